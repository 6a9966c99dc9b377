"""Cost of turning a party's ID column into int64 keys (issue 23, item 1; ``fl_split/data/ids.py``).

For ``n`` rows (default 100,000 and 1,000,000) it times, per ID kind, the whole read of one party's
ID column as the pipeline does it — :func:`fl_split.data.own.read_table` on a CSV holding the ID
column and one feature (the ID column read as text), then :func:`fl_split.data.ids.table_keys`
(canonical text, keys, the duplicate / collision check, the party's key → value mapping) — and
``table_keys`` alone:

* ``integer``: non-negative integers (their own keys; the vectorised path);
* ``email``: ``client.N@example-bank.org`` (hashed: SHA-256 per value);
* ``composite``: name + birth date, two columns (joined by ``\\x1f``, hashed).

The median of ``--repeats`` interleaved repeats, with the load average before and after (the
machine is shared). Run: ``python experiments/bench_ids.py [--sizes 100000 1000000] [--repeats 3]``;
writes ``experiments/results/bench_ids.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from fl_split.data.ids import table_keys
from fl_split.data.own import read_table

KINDS = {"integer": ["id"], "email": ["email"], "composite": ["name", "birth_date"]}


def table(n: int, kind: str) -> pd.DataFrame:
    i = np.random.default_rng(0).permutation(n)
    x = np.round(np.random.default_rng(1).normal(size=n), 4)
    if kind == "integer":
        return pd.DataFrame({"id": i * 7 + 11, "x": x})
    if kind == "email":
        return pd.DataFrame({"email": [f"client.{v}@example-bank.org" for v in i], "x": x})
    return pd.DataFrame({"name": [f"Person {v // 3}" for v in i],
                         "birth_date": [f"{1940 + v % 60}-{1 + v % 12:02d}-{1 + v % 28:02d}" for v in i], "x": x})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_ids.json"))
    args = ap.parse_args(argv)
    out: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                 "load_before": os.getloadavg()[0], "repeats": args.repeats, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            paths = {}
            for kind in KINDS:
                paths[kind] = Path(tmp) / f"{kind}-{n}.csv"
                table(n, kind).to_csv(paths[kind], index=False)
            times: dict[str, dict[str, list[float]]] = {k: {"read_and_keys_s": [], "keys_s": []} for k in KINDS}
            for _ in range(args.repeats):  # interleaved: a load spike hits every kind alike
                for kind, cols in KINDS.items():
                    t0 = time.perf_counter()
                    frame = read_table(str(paths[kind]), "bench", cols)
                    t1 = time.perf_counter()
                    keys, _names = table_keys(frame, cols, "bench")
                    t2 = time.perf_counter()
                    assert len(keys) == n
                    times[kind]["read_and_keys_s"].append(t2 - t0)
                    times[kind]["keys_s"].append(t2 - t1)
            for kind in KINDS:
                row = {"n": n, "kind": kind, **{k: round(statistics.median(v), 3) for k, v in times[kind].items()}}
                out["rows"].append(row)
                print(f"{n:>9,} {kind:<10} read+keys {row['read_and_keys_s']:7.2f} s   keys {row['keys_s']:7.2f} s")
    out["load_after"] = os.getloadavg()[0]
    print(f"load average {out['load_before']:.1f} → {out['load_after']:.1f} on {out['cpus']} CPUs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
