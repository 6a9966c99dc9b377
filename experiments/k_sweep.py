"""Accuracy vs batches per round K on the local engine, for Adam and SGD (complements bench_flower.py).

K > 1 is FedBCD-style training: a guest releases K batches with the weights it has at the start
of the round and applies their gradients afterwards, each to a forward recomputed with its current
weights (docs/design.md, "Rounds"). The Flower engine computes exactly what the local engine
computes for the same K (tests/test_flower.py), so the local engine measures the accuracy cost of K
without Flower's latency. Digits, 2 guests, 5 epochs, batch 32; Adam at lr 0.01 and plain SGD at
lr 0.1; mean over seeds.

    python experiments/k_sweep.py            # ≈ 2 min

Writes ``experiments/results/k_sweep.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.seeding import PrivateSeed

RESULTS = Path(__file__).resolve().parent / "results"
OPTIMIZERS = {"adam": 0.01, "sgd": 0.1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16, 24, 32, 45])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default=str(RESULTS / "k_sweep.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for opt, lr in OPTIMIZERS.items():
        for k in args.ks:
            accs = [LocalEngine(RunConfig(dataset="digits", guests=2, epochs=5, progress=False, seed=s,
                                          batches_per_round=k, optimizer=opt, lr=lr),
                                private_seed=PrivateSeed.legacy(s)).run()["final"]["value"]
                    for s in args.seeds]
            rows.append({"optimizer": opt, "lr": lr, "k": k, "accuracy": accs, "mean": statistics.fmean(accs),
                         "sd": statistics.stdev(accs) if len(accs) > 1 else 0.0})
            print(f"{opt:5s} K = {k:3d}: {rows[-1]['mean']:.4f} ± {rows[-1]['sd']:.4f}", flush=True)
    lines = ["| K | " + " | ".join(f"{o} (lr {lr:g})" for o, lr in OPTIMIZERS.items()) + " |",
             "|---:|" + "---:|" * len(OPTIMIZERS)]
    for k in args.ks:
        cells = [next(f"{r['mean']:.4f} ± {r['sd']:.4f}" for r in rows if r["optimizer"] == o and r["k"] == k)
                 for o in OPTIMIZERS]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"dataset": "digits", "guests": 2, "epochs": 5, "seeds": args.seeds},
                               "rows": rows, "table": "\n".join(lines)}, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
