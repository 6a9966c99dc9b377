"""Scale benchmark: one training epoch and the alignment at 100k / 1M / 10M rows per party, across engines.

For each ``--sizes`` value ``N`` it writes own Parquet tables of ``N`` rows (integer IDs, every party's
rows shuffled; the host 10 feature columns and a binary label, each of ``--guests`` guests 10 columns)
and runs ``fl-split train`` / ``fl-split deploy local`` on them (``docs/data.md``, own tables), one
epoch, batch 1024, one subprocess per run:

* **engines** (``--engines``): ``local`` (one process), ``flower`` (``--engine flower``, the Flower
  simulation on Ray) and ``deploy`` (``fl-split deploy local``: a SuperLink, one SuperNode per party,
  TLS, the warm ClientApp; ``docs/deploy.md``);
* **defences** (``--defenses``): ``none`` and the guests' ``gaussian``, ``laplace``, ``rr`` at their
  CLI defaults, interleaved within each engine and repeat so that a ratio to ``none`` compares runs
  made minutes apart on this shared 2-core machine (absolute times there vary by ±30 %);
* per run: the results' ``time_s`` (the training loop and the test evaluation, not start-up nor
  loading) and ``history[0].epoch_time_s``, the command's wall time, the peak resident memory of each
  process of the run (``VmHWM`` read from ``/proc`` every 0.2 s, by process kind as in
  ``experiments/bench_deploy.py``), and the bytes the results' ``wire`` counts (activations and
  gradients between the parties);
* **PSI** (``--psi-sizes``): ``fl_split.psi.align_by_psi`` on two parties of ``n`` random 62-bit IDs,
  half shared (``experiments/bench_psi.py``'s measurement: its own process, time, CPU seconds, peak
  RSS as ``VmHWM``, bytes sent).

``--plan`` lists the runs without running anything. Results (with the exact command) go to
``--out`` (default ``experiments/results/bench_scale.json``); ``--plot PNG`` draws epoch time and the
defended / undefended ratio against rows from that file (``--from`` reads existing ones, merged).

Run: ``python experiments/bench_scale.py --sizes 100000 1000000 --engines local flower deploy``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FLSPLIT = [sys.executable, "-m", "fl_split.cli"]
OUT = ROOT / "experiments" / "results" / "bench_scale.json"
ENGINES = ("local", "flower", "deploy")
DEFENSES = ("none", "gaussian", "laplace", "rr")
#: a process of a run, by its command line (the first needle found)
KINDS = (("flwr-serverapp", "serverapp"), ("flower-superexec", "superexec"), ("flower-superlink", "superlink"),
         ("party-runtime", "party runtime"), ("fl_split.flower.warm", "supernode"), ("flower-supernode", "supernode"),
         ("flwr-clientapp", "clientapp"), ("flwr", "flwr"), ("raylet", "ray"), ("gcs_server", "ray"),
         ("ray::", "ray worker"), ("ray/", "ray"), ("fl_split.cli", "the command"))


def write_tables(folder: Path, rows: int, guests: int) -> list[str]:
    """Own Parquet tables of ``rows`` rows (same IDs, each party's rows shuffled); the ``--data`` flags."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    ids = rng.permutation(rows).astype(np.int64)
    width = 10 * (guests + 1)
    x = rng.normal(size=(rows, width)).astype(np.float32).round(4)
    y = (x[:, 0] + x[:, 10::10].sum(axis=1) + 0.5 * rng.normal(size=rows) > 0).astype(np.int8)
    host = folder / "host.parquet"
    pd.DataFrame({"id": ids, **{f"h{i}": x[:, i] for i in range(10)}, "y": y}).to_parquet(host)
    flags = ["--data", f"host={host}"]
    for g in range(1, guests + 1):
        path = folder / f"guest-{g}.parquet"
        pd.DataFrame({"id": ids, **{f"g{g}_{i}": x[:, 10 * g + i] for i in range(10)}}).sample(
            frac=1, random_state=g).to_parquet(path)
        flags += ["--data", f"guest-{g}={path}"]
    return flags


def _descendants(root: int) -> dict[int, str]:
    """``{pid: command line}`` of ``root``'s process tree (``/proc``)."""
    children: dict[int, list[int]] = {}
    cmd: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd[int(entry)] = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        out[pid] = cmd.get(pid, "")
        todo += children.get(pid, [])
    return out


class PeakRss:
    """Peak resident memory (``VmHWM``, MiB) of every process under ``root``, read every ``interval`` s."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        self.root, self.interval = root, interval
        self.peak: dict[int, float] = {}
        self.kind: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for pid, cmd in _descendants(self.root).items():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    hwm = int(status.split("VmHWM:")[1].split()[0]) / 1024
                except (OSError, IndexError, ValueError):
                    continue
                self.peak[pid] = max(hwm, self.peak.get(pid, 0.0))
                if cmd:
                    self.kind[pid] = "the command" if pid == self.root else next(
                        (k for needle, k in KINDS if needle in cmd), "other")
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        procs = sorted(((self.kind.get(p, "other"), round(m, 1)) for p, m in self.peak.items()), key=lambda kv: -kv[1])
        return {"max_mib": procs[0][1] if procs else None, "sum_mib": round(sum(m for _, m in procs), 1),
                "processes": [list(kv) for kv in procs[:12]]}


def one_run(engine: str, defense: str, flags: list[str], work: Path, seed: Path, timeout: int) -> dict:
    """One epoch with ``engine`` and ``defense``: times, peak RSS per process, bytes on the wire."""
    out = work / f"{engine}-{defense}.json"
    out.unlink(missing_ok=True)
    job = [*flags, "--id-column", "id", "--label-column", "y", "--epochs", "1", "--batch-size", "1024",
           "--defense", defense, "--no-progress", "--private-seed-file", str(seed), "--out", str(out)]
    if engine == "deploy":
        wd = work / f"deploy-{defense}"
        shutil.rmtree(wd, ignore_errors=True)
        args = [*FLSPLIT, "deploy", "local", "--tls", *job, "--workdir", str(wd)]
    else:
        args = [*FLSPLIT, "train", "--engine", engine, "--no-run-dir", *job]
    log = work / f"{engine}-{defense}.log"
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        rss = PeakRss(proc.pid)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        mem = rss.stop()
    row = {"engine": engine, "defense": defense, "wall_s": round(time.monotonic() - t0, 2), "exit": code,
           "peak_rss": mem, "load": round(os.getloadavg()[0], 1)}
    if code != 0 or not out.exists():
        row["error"] = log.read_text(errors="replace")[-1500:]
        return row
    res = json.loads(out.read_text())
    wire = res.get("wire", {})
    row.update(time_s=round(res["time_s"], 3), epoch_time_s=round(res["history"][0]["epoch_time_s"], 3),
               accuracy=res["final"]["value"], n_train=res["plan"]["n_train"],
               wire_bytes={k: wire.get(k) for k in ("bytes_to_host", "bytes_to_guests") if k in wire},
               epsilon={p: r.get("epsilon") for p, r in res.get("privacy", {}).items()})
    return row


def psi_run(n: int) -> dict:
    """``experiments/bench_psi.py``'s measurement of ``align_by_psi`` at ``n`` IDs per party, its peak
    memory read as ``VmHWM`` (:class:`PeakRss`): the child's ``ru_maxrss`` keeps the high-water mark
    of this (parent) process across ``exec``, so after the tables of a large size it reads this one's."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_psi import OURS

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", OURS, str(ROOT), str(n)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    rss = PeakRss(proc.pid)
    out, err = proc.communicate()
    mem = rss.stop()
    if proc.returncode:
        raise SystemExit(f"PSI at n={n} failed:\n{err[-3000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    row.pop("peak_rss_mb", None)
    row.update(peak_rss_mib=mem["max_mib"], process_seconds=round(time.perf_counter() - t0, 2))
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per (rows, engine, defence): median ``time_s`` and its ratio to ``none``'s of the same engine and size."""
    out = []
    keys = sorted({(r["rows"], r["engine"]) for r in rows})
    for n, engine in keys:
        sel = [r for r in rows if r["rows"] == n and r["engine"] == engine and "time_s" in r]
        med = {d: statistics.median([r["time_s"] for r in sel if r["defense"] == d])
               for d in DEFENSES if any(r["defense"] == d for r in sel)}
        for d, m in med.items():
            rss = max(r["peak_rss"]["max_mib"] or 0 for r in sel if r["defense"] == d)
            out.append({"rows": n, "engine": engine, "defense": d, "median_time_s": round(m, 3),
                        "ratio_to_none": round(m / med["none"], 3) if "none" in med else None,
                        "runs": sum(r["defense"] == d for r in sel), "max_process_rss_mib": rss,
                        "rss_bytes_per_row": round(rss * 2**20 / n, 1)})
    return out


def plot(doc: dict, png: Path) -> None:
    """Epoch time (log-log) and the ratio to ``none`` against rows, one line per engine and defence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    summ = doc["summary"]
    for engine in ENGINES:
        for d in DEFENSES:
            pts = sorted((s["rows"], s["median_time_s"], s["ratio_to_none"]) for s in summ
                         if s["engine"] == engine and s["defense"] == d)
            if not pts:
                continue
            # a colour per defence, a line style and marker per engine (12 lines: the default cycle repeats)
            style = {"local": "-", "flower": "--", "deploy": ":"}[engine]
            look = dict(color=f"C{DEFENSES.index(d)}", marker={"local": "o", "flower": "s", "deploy": "^"}[engine])
            a.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{engine} {d}", **look)
            if d != "none":
                b.plot([p[0] for p in pts], [p[2] for p in pts], style, label=f"{engine} {d}", **look)
    a.set(xscale="log", yscale="log", xlabel="rows per party", ylabel="time_s of one epoch (s)",
          title="one epoch (batch 1024)")
    b.axhline(1.3, color="grey", lw=0.8)
    b.set(xscale="log", xlabel="rows per party", ylabel="defended / undefended (medians)",
          title="ratio to --defense none (target 1.3)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000], help="rows per party (none: PSI only)")
    ap.add_argument("--guests", type=int, default=1, choices=[1, 2])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--defenses", nargs="+", choices=DEFENSES, default=list(DEFENSES))
    ap.add_argument("--only", nargs="*", default=[], metavar="SIZE:ENGINE",
                    help="restrict an engine at a size to none and gaussian, e.g. 1000000:flower")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--psi-sizes", type=int, nargs="*", default=[])
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    ap.add_argument("--plan", action="store_true", help="list the runs and exit")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--plot", help="PNG to draw from the results")
    ap.add_argument("--from", dest="source", nargs="+",
                    help="plot (and summarise) these results files, their runs merged, instead of running")
    args = ap.parse_args(argv)
    if "none" not in args.defenses:
        ap.error("--defenses must include none (every ratio is to it)")
    if args.source:
        docs = [json.loads(Path(f).read_text()) for f in args.source]
        doc = {"from": args.source, "commands": [d.get("command") for d in docs],
               "runs": [r for d in docs for r in d["runs"]], "psi": [r for d in docs for r in d.get("psi", [])]}
        doc["summary"] = summarise(doc["runs"])
        if args.plot:
            plot(doc, Path(args.plot))
        Path(args.out).write_text(json.dumps(doc, indent=1))
        return 0
    only = {tuple(s.split(":", 1)) for s in args.only}
    plan = []
    for n in args.sizes:
        for rep in range(args.repeats):
            for engine in args.engines:
                defs = [d for d in args.defenses if (str(n), engine) not in only or d in ("none", "gaussian")]
                plan += [(n, rep, engine, d) for d in defs]
    if args.plan:
        for p in plan:
            print(*p)
        return 0
    doc = {"command": " ".join([Path(sys.executable).name, *[str(a) for a in (argv or sys.argv)]]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.machine()},
           "setup": {"guests": args.guests, "columns_per_party": 10, "batch": 1024, "epochs": 1,
                     "ids": "integer, same IDs in every table, each table shuffled"},
           "runs": [], "psi": []}
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    os.chmod(work, 0o700)
    seed = work / "private-seed"
    subprocess.run([*FLSPLIT, "seed", "--out", str(seed)], check=True, capture_output=True, cwd=ROOT)
    try:
        for n in args.sizes:
            tables = work / f"n{n}"
            tables.mkdir()
            t0 = time.perf_counter()
            flags = write_tables(tables, n, args.guests)
            size = sum(p.stat().st_size for p in tables.iterdir())
            print(f"[{n:,} rows] tables written in {time.perf_counter() - t0:.1f} s ({size / 2**20:.0f} MiB)", flush=True)
            for (m, rep, engine, d) in [p for p in plan if p[0] == n]:
                row = {"rows": n, "repeat": rep, **one_run(engine, d, flags, work, seed, args.timeout)}
                doc["runs"].append(row)
                print(f"[{n:,} rows] {engine:6} {d:8} time_s {row.get('time_s')} wall {row['wall_s']} s, peak RSS "
                      f"{row['peak_rss']['max_mib']} MiB (sum {row['peak_rss']['sum_mib']}), wire {row.get('wire_bytes')}"
                      f"{'  FAILED ' + row['error'][-300:] if 'error' in row else ''} (load {row['load']})", flush=True)
                doc["summary"] = summarise(doc["runs"])
                Path(args.out).write_text(json.dumps(doc, indent=1))
            shutil.rmtree(tables, ignore_errors=True)
        for n in args.psi_sizes:
            r = {"n_per_party": n, **psi_run(n)}
            doc["psi"].append(r)
            print(f"[PSI {n:,} x {n:,}] {r['seconds']:.1f} s, CPU {r['cpu_s']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB "
                  f"(after imports {r['rss_before_mb']:.0f}), {r['bytes'] / 2**20:.1f} MiB sent", flush=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["summary"] = summarise(doc["runs"])
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for s in doc["summary"]:
        print(f"{s['rows']:>10,} {s['engine']:6} {s['defense']:8} {s['median_time_s']:8.2f} s  ratio "
              f"{s['ratio_to_none']}  peak RSS {s['max_process_rss_mib']} MiB ({s['rss_bytes_per_row']} B/row)")
    if args.plot:
        plot(doc, Path(args.plot))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
