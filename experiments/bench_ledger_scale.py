"""Per-batch cost of the privacy ledger as the number of records grows (docs/accounting.md, "The ledger").

Ledger only, no training: synthetic int64 record IDs, ``--ids`` ``small`` (a random permutation
of ``0..N-1``: the ledger's direct ID table) and / or ``hashed`` (the same spread over the int64
range, negative ones included, as hashed text IDs are: its ID dictionary), one Gaussian forward release per training batch of
``--batch`` records with its sample rate, the ``pld`` accountant. For each ``N`` (default 10,000,
100,000, 1,000,000 and 10,000,000) and each module (this checkout's ``fl_split.privacy.ledger``
and, with ``--old PATH``, a copy of an older ``ledger.py`` loaded from that path) it times:

* ``first_ms``: the median charge of the first ``--batches`` batches (records released for the first time);
* ``epoch1``: the rest of the first epoch, charged in batches of 65,536 (set-up, not timed per batch);
* ``again_ms``: the median charge of ``--batches`` batches of the second epoch (records known);
* ``report_s``, ``export_s``, ``restore_s``: one ``report()``, ``export_state()``, ``Ledger.from_state()``
  (a checkpoint / a Flower message's state: O(records), not per batch).

With ``--train-rows N`` (e.g. 300000) it also generates two Parquet tables of N rows under a
temporary folder (integer IDs; the host 10 columns and the label, one guest 10 columns, rows
shuffled) and times one ``fl-split train`` epoch (batch 1024, local engine) with ``--defense none``
and each of ``--defenses`` (default ``gaussian``; e.g. ``gaussian laplace rr``), ``--train-repeats``
times interleaved: the results' ``time_s``, the CPU seconds of the same training loop (``CPU_WRAPPER``)
and, per defence, the ratios of the medians to ``none``'s (``ratios``, ``cpu_ratios``), and where the
time goes (``parts_ms_per_batch``: the time inside each function of :data:`PARTS`).
``--train-args`` adds ``fl-split train`` arguments, e.g. a larger model than the default MLP (64,32).

Run: ``python experiments/bench_ledger_scale.py [--old /tmp/ledger_old.py] [--sizes 10000 100000 1000000]
[--train-rows 300000]``; prints a table and writes ``experiments/results/bench_ledger_scale.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dp_accounting as dpa
import numpy as np

from fl_split.privacy import ledger as current
from fl_split.privacy.base import PrivacyCost

COST = PrivacyCost("gaussian", dpa.GaussianDpEvent(noise_multiplier=0.7 / 2.0), epsilon=None, sensitivity_l2=2.0,
                   params=(("sigma", 0.7),))


def load_module(path: str):
    """A copy of ``ledger.py`` at ``path``, imported as its own module."""
    spec = importlib.util.spec_from_file_location("ledger_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ledger_under_test"] = mod
    spec.loader.exec_module(mod)
    return mod


def measure(mod, n: int, batch: int, batches: int, id_kind: str) -> dict:
    ids = np.random.default_rng(0).permutation(n).astype(np.int64)
    if id_kind == "hashed":
        ids = ids * 7919 - (1 << 40)
    rate = batch / n
    led = mod.Ledger("guest-1", accountant="pld")

    def charge(epoch: int, index: int, members: np.ndarray) -> float:
        t = time.perf_counter()
        led.charge([mod.LedgerEntry(index, ("train", epoch, index), "forward", COST, members, rate)])
        return time.perf_counter() - t

    nb = min(batches, n // batch)
    first = [charge(1, i, ids[i * batch:(i + 1) * batch]) for i in range(nb)]
    t = time.perf_counter()
    big = 65536
    for j, start in enumerate(range(nb * batch, n, big)):
        charge(1, nb + j, ids[start:start + big])
    epoch1 = time.perf_counter() - t
    perm = np.random.default_rng(1).permutation(ids)
    again = [charge(2, i, perm[i * batch:(i + 1) * batch]) for i in range(nb)]
    t = time.perf_counter()
    rep = led.report()
    report_s = time.perf_counter() - t
    t = time.perf_counter()
    state = led.export_state()
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    restored = mod.Ledger.from_state(state)
    restore_s = time.perf_counter() - t
    assert restored.report() == rep
    out = {"records": n, "ids": id_kind, "first_ms": 1e3 * statistics.median(first), "epoch1_rest_s": epoch1,
           "again_ms": 1e3 * statistics.median(again), "report_s": report_s, "export_s": export_s,
           "restore_s": restore_s, "epsilon": rep["epsilon"], "releases_per_record": rep["releases_per_record"]}
    del led, restored, state
    gc.collect()
    return out


#: ``fl-split train`` in this interpreter, with the CPU seconds of its training loop written to ``argv[1]``
#: (JSON): from the start of ``engine.coordinate`` to the parties' reports (what ``time_s`` times; every
#: thread of the process: the local engine runs the parties in it). The reports (each party's ε under
#: every accountant; with a Gaussian release the first one imports Opacus, ~1.4 s) come after ``time_s``
#: and are not counted. On a shared machine the wall ``time_s`` stretches with the other jobs' load, the
#: CPU time far less. ``parts``: wall seconds inside each function of :data:`PARTS` (``module:Class.method``;
#: a perf_counter pair per call, ~1 µs), to say where a defence's extra time goes
CPU_WRAPPER = """
import importlib, json, sys, time
from pathlib import Path
from fl_split import cli, engine
inner, reports = engine.coordinate, engine.LocalTransport.reports
start, parts = [], {}
def timed(*a, **k):
    start.append(time.process_time())
    return inner(*a, **k)
def reports_timed(self):
    Path(sys.argv[1]).write_text(json.dumps({"cpu_s": time.process_time() - start[-1], "parts": parts}))
    return reports(self)
def clocked(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            parts[label] = parts.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, w)
for path in json.loads(sys.argv[2]):
    mod, _, attr = path.partition(":")
    owner_name, _, name = attr.rpartition(".")
    module = importlib.import_module(mod)
    owner = getattr(module, owner_name) if owner_name else module
    clocked(owner, name, path)
engine.coordinate = timed
engine.LocalTransport.reports = reports_timed
raise SystemExit(cli.main(sys.argv[3:]))
"""

#: the functions whose time every ``--train-rows`` run reports (``parts_ms_per_batch``, per training
#: batch): each defence's release, the exact Laplace sampler inside it, the ledger's charge, the keyed
#: generator of each draw, the sender's in-process hand-off (a ``bits`` release is checked and
#: converted), the receiver's message check and its public-range check, and the two parties' optimizer
#: steps and backward passes (not privacy code: there to show how much of the gap is the training
#: itself running slower beside the defence)
PARTS = {"gaussian": "fl_split.privacy.mechanisms:Gaussian.release",
         "laplace": "fl_split.privacy.mechanisms:Laplace.release",
         "rr": "fl_split.privacy.mechanisms:RandomizedResponse.release",
         "sampler": "fl_split.privacy.sampling:DiscreteLaplace.sample",
         "ledger": "fl_split.privacy.ledger:Ledger.charge",
         "draw": "fl_split.parties.base:_Party._draw",
         "handoff": "fl_split.parties.base:handoff",
         "check": "fl_split.parties.base:_Party._check",
         "range": "fl_split.privacy.bounds:PeerTrust.check",
         "opt-step": "fl_split.local_update:OptimizerUpdate.step",
         "backward": "fl_split.local_update:LocalUpdate.backward"}


def train_epochs(rows: int, repeats: int, defenses: tuple[str, ...] = ("gaussian",), extra: tuple[str, ...] = ()
                 ) -> dict:
    """One ``fl-split train`` epoch on own Parquet tables of ``rows`` rows, none vs each of ``defenses``
    (interleaved: one run of each per repeat); ``extra``: more ``fl-split train`` arguments (a model)."""
    import pandas as pd

    rng = np.random.default_rng(0)
    ids = rng.permutation(rows).astype(np.int64)
    x = rng.normal(size=(rows, 20)).round(4)
    y = (x[:, 0] + x[:, 10] + 0.5 * rng.normal(size=rows) > 0).astype(int)
    times: dict[str, list[float]] = {d: [] for d in ("none", *defenses)}
    cpu: dict[str, list[float]] = {d: [] for d in times}
    parts: dict[str, list[dict]] = {d: [] for d in times}
    with tempfile.TemporaryDirectory() as tmp:
        host, guest = Path(tmp) / "host.parquet", Path(tmp) / "guest.parquet"
        pd.DataFrame({"id": ids, **{f"h{i}": x[:, i] for i in range(10)}, "y": y}).to_parquet(host)
        pd.DataFrame({"id": ids, **{f"g{i}": x[:, 10 + i] for i in range(10)}}).sample(
            frac=1, random_state=1).to_parquet(guest)
        for _ in range(repeats):
            for defense in times:
                out = Path(tmp) / f"{defense}.json"
                cpu_file = Path(tmp) / f"{defense}.cpu"
                subprocess.run([sys.executable, "-c", CPU_WRAPPER, str(cpu_file), json.dumps(list(PARTS.values())),
                                "train", "--data", f"host={host}", "--data", f"guest-1={guest}",
                                "--id-column", "id", "--label-column", "y",
                                "--epochs", "1", "--batch-size", "1024", "--defense", defense, "--no-progress",
                                "--no-run-dir", "--private-seed", "1", "--insecure-private-seed", "--out", str(out),
                                *extra],
                               check=True, capture_output=True)
                result = json.loads(out.read_text())
                times[defense].append(result["time_s"])
                batches = result["plan"]["batches_per_epoch"]  # training batches: the split's, not assumed
                clock = json.loads(cpu_file.read_text())
                cpu[defense].append(clock["cpu_s"])
                parts[defense].append(clock["parts"])
                print(f"train {rows:,} rows --defense {defense}: {times[defense][-1]:.2f} s, CPU "
                      f"{cpu[defense][-1]:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    med = {d: statistics.median(t) for d, t in times.items()}
    ratios = {d: med[d] / med["none"] for d in defenses}
    med_cpu = {d: statistics.median(t) for d, t in cpu.items()}
    # per part: the median over the repeats of its seconds in one epoch, in ms per training batch
    part_ms = {d: {k: 1e3 * statistics.median(r.get(p, 0.0) for r in runs) / batches for k, p in PARTS.items()}
               for d, runs in parts.items()}
    return {"rows": rows, "extra_args": list(extra), "time_s": times, "parts_ms_per_batch": part_ms,
            "median_s": med, "ratios": ratios,
            "ratio": ratios.get("gaussian", max(ratios.values())), "cpu_s": cpu, "median_cpu_s": med_cpu,
            "cpu_ratios": {d: med_cpu[d] / med_cpu["none"] for d in defenses}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="path of an older ledger.py to compare with")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 10_000_000])
    ap.add_argument("--old-max", type=int, default=1_000_000, help="largest size the old module is run at")
    ap.add_argument("--ids", nargs="+", choices=["small", "hashed"], default=["small", "hashed"])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--train-rows", type=int, default=0, help="also time one fl-split train epoch at this many rows")
    ap.add_argument("--train-repeats", type=int, default=3)
    ap.add_argument("--defenses", nargs="+", default=["gaussian"], choices=["gaussian", "laplace", "rr"],
                    help="defences timed against --defense none with --train-rows")
    ap.add_argument("--train-args", default="", help="more fl-split train arguments for --train-rows, e.g. "
                    "'--hidden 256,64,256,128 --cut-layer 2' (a larger model than the default 64,32)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_ledger_scale.json"))
    args = ap.parse_args(argv)
    modules = [("after", current)] + ([("before", load_module(args.old))] if args.old else [])
    rows = []
    for n in args.sizes:
        for label, mod in modules:
            for id_kind in args.ids:
                if label == "before" and n > args.old_max:
                    continue
                load = os.getloadavg()[0]
                r = {"module": label, **measure(mod, n, args.batch, args.batches, id_kind), "load_before": load}
                rows.append(r)
                print(f"{label:6} {id_kind:6} N={n:>10,}  first {r['first_ms']:7.2f} ms  again {r['again_ms']:7.2f} ms  "
                      f"epoch-1 rest {r['epoch1_rest_s']:6.2f} s  report {r['report_s']:6.3f} s  "
                      f"export {r['export_s']:6.2f} s  restore {r['restore_s']:6.2f} s  eps {r['epsilon']!r}  "
                      f"(load {load:.1f})", flush=True)
    for n in args.sizes:  # the same epsilon before and after
        eps = {r["epsilon"] for r in rows if r["records"] == n}
        if len(eps) > 1:
            raise SystemExit(f"N={n}: epsilon differs: {eps}")
    train = None
    if args.train_rows:
        train = train_epochs(args.train_rows, args.train_repeats, tuple(args.defenses),
                             tuple(shlex.split(args.train_args)))
        print(f"train epoch, median: none {train['median_s']['none']:.2f} s; " + "; ".join(
            f"{d} {train['median_s'][d]:.2f} s, ratio {r:.2f} (CPU {train['cpu_ratios'][d]:.2f})"
            for d, r in train["ratios"].items()))
        print("ms per training batch inside each part (median over the repeats; a part's time includes the "
              "parts it calls):")
        print("  " + " ".join(f"{n:>9}" for n in ["defence", *PARTS]))
        for d, ms in train["parts_ms_per_batch"].items():
            print("  " + " ".join([f"{d:>9}"] + [f"{ms[k]:9.3f}" for k in PARTS]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                                          "batch": args.batch, "batches": args.batches, "rows": rows,
                                          "train": train}, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
