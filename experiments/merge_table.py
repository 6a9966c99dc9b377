"""Every offline dataset × every merge op through ``fl-split train``: split vs monolithic (001 Table 1).

For each dataset (``digits``, ``breast-cancer``, ``credit``, ``movielens-small``) and each merge
op (``concat``, ``sum``, ``avg``, ``max``, ``min``, ``mul``) this runs the real command line
(``fl_split.cli.main(["train", ...])``, in this process) twice per seed: split training on the
local engine, and ``--monolithic`` (the same modules as one model, one optimizer). Each dataset
uses its default model, 2 guests + a host with features (1 guest for movielens-small, 001's
96/64 split), 5 epochs, Adam, lr 0.01, batch 32.

Reported per (dataset, merge): the final test metric (accuracy; hit@10 for movielens-small), mean
± sd over seeds, for split and monolithic; the largest |split − monolithic| over seeds (0 when the
equivalence holds: no defence, same weights and batch order); and the gap to the monolithic
``concat`` model, the natural "no split" reference of 001 Table 1.

    python experiments/merge_table.py                      # 3 seeds, ≈ 10 min on 2 cores
    python experiments/merge_table.py --seeds 0 --datasets digits

Writes ``experiments/results/merge_table.{json,csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fl_split.cli import main as cli_main
from fl_split.config import MERGE_OPS

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = {
    "digits": ["--guests", "2"],
    "breast-cancer": ["--guests", "2"],
    "credit": ["--guests", "2"],
    "movielens-small": ["--guests", "1"],
}
COMMON = ["--epochs", "5", "--batch-size", "32", "--lr", "0.01", "--optimizer", "adam", "--no-progress"]


def run_cli(args: list[str]) -> dict:
    """``fl-split train ARGS --out TMP`` in this process; the results JSON it wrote."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        out = Path(tmp) / "r.json"
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(["train", *args, "--out", str(out)])
        if code != 0:
            raise RuntimeError(f"fl-split train {' '.join(args)} exited with {code}")
        return json.loads(out.read_text())


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--merges", nargs="+", default=list(MERGE_OPS), choices=list(MERGE_OPS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default=str(RESULTS / "merge_table"), help="path prefix of .json/.csv/.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    t0 = time.perf_counter()
    for ds in args.datasets:
        for merge in args.merges:
            split, mono = [], []
            metric = ""
            for seed in args.seeds:
                base = ["--dataset", ds, *DATASETS[ds], "--merge", merge, "--seed", str(seed),
                        "--private-seed", str(seed), "--insecure-private-seed", *COMMON]
                rs, rm = run_cli(base), run_cli([*base, "--monolithic"])
                metric = rs["final"]["metric"]
                split.append(rs["final"]["value"])
                mono.append(rm["final"]["value"])
            (sm, ss), (mm, ms) = _mean_sd(split), _mean_sd(mono)
            rows.append({"dataset": ds, "merge": merge, "metric": metric, "seeds": args.seeds,
                         "split": split, "monolithic": mono, "split_mean": sm, "split_sd": ss,
                         "monolithic_mean": mm, "monolithic_sd": ms,
                         "max_abs_split_minus_monolithic": max(abs(a - b) for a, b in zip(split, mono))})
            print(f"{ds:16s} {merge:7s} split {sm:.4f} ± {ss:.4f}   monolithic {mm:.4f} ± {ms:.4f}   "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ref = {r["dataset"]: r["monolithic_mean"] for r in rows if r["merge"] == "concat"}
    for r in rows:
        # rounded so that equal means print as +0.00, not -0.00
        r["vs_monolithic_concat_points"] = (round(100 * (r["split_mean"] - ref[r["dataset"]]), 9) + 0.0
                                            if r["dataset"] in ref else None)
    lines = [f"| dataset | metric | merge | split (mean ± sd, {len(args.seeds)} seeds) | monolithic | "
             "max \\|split − mono\\| | vs monolithic concat (points) |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        gap = r["vs_monolithic_concat_points"]
        lines.append(f"| {r['dataset']} | {r['metric']} | {r['merge']} | {r['split_mean']:.4f} ± {r['split_sd']:.4f} | "
                     f"{r['monolithic_mean']:.4f} ± {r['monolithic_sd']:.4f} | {r['max_abs_split_minus_monolithic']:.1e} | "
                     f"{'' if gap is None else f'{gap:+.2f}'} |")
    table = "\n".join(lines)
    print(table)
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": sys.version.split()[0], "torch": torch.__version__, "common_flags": COMMON,
            "datasets": {d: DATASETS[d] for d in args.datasets}, "seconds": time.perf_counter() - t0}
    prefix.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    with prefix.with_suffix(".csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["dataset", "metric", "merge", "split_mean", "split_sd", "monolithic_mean", "monolithic_sd",
                    "max_abs_split_minus_monolithic", "vs_monolithic_concat_points"])
        for r in rows:
            w.writerow([r["dataset"], r["metric"], r["merge"], r["split_mean"], r["split_sd"], r["monolithic_mean"],
                        r["monolithic_sd"], r["max_abs_split_minus_monolithic"], r["vs_monolithic_concat_points"]])
    prefix.with_suffix(".md").write_text(table + "\n")
    print(f"saved {prefix}.json / .csv / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
