"""PSI benchmark (issue 23): fl_split's ``--align psi`` beside SecretFlow's PSI engine, same run.

Two parties with ``n`` IDs each, half of them shared (random 63-bit IDs), for each ``n`` of
``--sizes`` (default 10k, 100k, 1M):

* **ours** — :func:`fl_split.psi.align_by_psi` (the N-party ECDH-PSI over X25519 of
  ``fl_split/psi.py``, here N = 2, every message framed and checked as in a run), each size in a
  fresh subprocess so that its peak resident memory (``ru_maxrss``) is its own (recorded beside the
  resident memory after the imports: fl_split imports torch, ~0.7 GB); the backend it used
  (``crypto_mb``: Intel's multi-buffer X25519, the ``psi`` extra; ``cryptography``: OpenSSL, one
  point per call) is recorded. ``--portable`` also runs the ``cryptography`` backend (not at 1M:
  minutes);
* **SecretFlow** — ``spu.psi.psi_execute`` (spu from PyPI, not a dependency of fl_split) with
  ``--spu-python PATH`` (a venv with ``pip install spu``): two processes over brpc on the loopback
  (``experiments/spu_psi_peer.py``), ECDH on Curve25519 and RR22 (OPRF-based, the fastest it has),
  reading and writing CSV files as its API does; the time is the slower rank's ``psi_execute``.

Both run on the same machine in the same run, alternating per size, so the ratio is meaningful even
on a busy machine (this VM's timings vary by ±30 % between identical runs, more when other jobs
share its 2 cores); the CPU seconds each used (``getrusage``: ours the aligning process, SecretFlow
both ranks) are recorded too — the work done, which a busy machine stretches far less than the wall
time.

Run: ``python experiments/bench_psi.py --spu-python /tmp/spuvenv/bin/python`` (with a Python that has
``fl-split[psi]``) → ``experiments/results/bench_psi.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "bench_psi.json"
PEER = ROOT / "experiments" / "spu_psi_peer.py"

OURS = r"""
import json, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from fl_split.psi import align_by_psi
from fl_split.psi_group import backend
n = int(sys.argv[2])
rng = np.random.default_rng(0)
universe = rng.choice(2**62, size=n + n // 2, replace=False).astype(np.int64)
ids = {"host": universe[:n], "guest-1": universe[n // 2:]}
stats = {}
rss_before = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024  # MB, after the imports
use0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
shared = align_by_psi(ids, stats=stats)
dt = time.perf_counter() - t0
use = resource.getrusage(resource.RUSAGE_SELF)
cpu = use.ru_utime + use.ru_stime - use0.ru_utime - use0.ru_stime
assert len(shared) == n // 2 and np.array_equal(shared, np.sort(universe[n // 2:n]))
print(json.dumps({"seconds": dt, "cpu_s": cpu, "shared": int(len(shared)), "backend": backend(), "messages": stats["messages"],
                  "bytes": stats["bytes"], "rss_before_mb": rss_before, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def ours(n: int, backend: str | None) -> dict:
    env = dict(os.environ)
    if backend:
        env["FL_SPLIT_PSI_BACKEND"] = backend
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", OURS, str(ROOT), str(n)], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"ours at n={n} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_seconds"] = time.perf_counter() - t0
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spu(python: str, n: int, protocol: str, work: Path) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    universe = rng.choice(2**62, size=n + n // 2, replace=False).astype(np.int64)
    files = []
    for rank, part in enumerate((universe[:n], universe[n // 2:])):
        src = work / f"spu-{n}-{rank}.csv"
        src.write_text("id\n" + "\n".join(map(str, part.tolist())) + "\n")
        files.append((src, work / f"spu-{n}-{rank}-{protocol}.out.csv"))
    ports = [str(_free_port()), str(_free_port())]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([python, str(PEER), str(rank), *ports, protocol, str(src), str(dst)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, (src, dst) in enumerate(files)]
    outs = [p.communicate(timeout=1800) for p in procs]
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        return {"error": " | ".join(o[1].strip().splitlines()[-1] if o[1].strip() else "" for o in outs)}
    reports = [json.loads([ln for ln in o[0].splitlines() if ln.startswith("SPU_RESULT ")][-1][11:]) for o in outs]
    assert all(r["intersection"] == n // 2 for r in reports), reports
    return {"seconds": max(r["seconds"] for r in reports), "cpu_s": sum(r["cpu_s"] for r in reports),
            "peak_rss_mb": [r["peak_rss_mb"] for r in reports], "process_seconds": wall,
            "shared": reports[0]["intersection"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="IDs per party, comma-separated")
    ap.add_argument("--spu-python", default="", help="a Python with spu installed (SecretFlow's PSI); none: ours only")
    ap.add_argument("--portable", action="store_true", help="also the cryptography backend (sizes below 1M)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            row: dict = {"n_per_party": n, "ours": ours(n, None)}
            print(f"n={n:>9,}  ours ({row['ours']['backend']}): {row['ours']['seconds']:7.2f} s "
                  f"({row['ours']['cpu_s']:.1f} CPU s), "
                  f"peak RSS {row['ours']['peak_rss_mb']:.0f} MB ({row['ours']['rss_before_mb']:.0f} MB after the imports)",
                  flush=True)
            if args.portable and n < 1_000_000:
                row["ours_cryptography"] = ours(n, "cryptography")
                print(f"             ours (cryptography): {row['ours_cryptography']['seconds']:7.2f} s", flush=True)
            if args.spu_python:
                for proto in ("ecdh", "rr22"):
                    row[f"spu_{proto}"] = r = spu(args.spu_python, n, proto, Path(tmp))
                    print(f"             SecretFlow {proto.upper():4}: "
                          + (f"{r['seconds']:7.2f} s ({r['cpu_s']:.1f} CPU s, both ranks)" if "seconds" in r
                             else r["error"]), flush=True)
            rows.append(row)
    spu_version = ""
    if args.spu_python:
        spu_version = subprocess.run([args.spu_python, "-c", "import spu; print(spu.__version__)"],
                                     capture_output=True, text=True).stdout.strip()
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                       "load_average_at_end": os.getloadavg()},
           "peak_rss_note": "ours: one process holding both parties and the coordinator (fl_split imports torch first: "
                            "see rss_before_mb); SecretFlow: each rank's process",
           "spu_version": spu_version, "overlap": "half of each party's IDs are shared", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
