"""Split-learning overhead: epoch time of the local split engine ÷ the monolithic model.

Same config, same modules, same batch order, no defence; both run in this process, alternated
``--repeats`` times so machine noise hits both alike. Prints a table and saves JSON under
``experiments/results/``. Goals (issue 10): ≤ 1.25 on the small CPU models (digits,
movielens-small), ≤ 1.05 on a compute-bound one (digits-wide).

``ratio`` is the ratio of the medians of all epoch times; ``ratio_paired`` the median over repeats of
(split ÷ monolithic) of runs made back to back, which is the steadier of the two on a loaded machine.
The JSON records the load average before and after (``os.getloadavg()``): other processes on
the machine slow both sides, but not by the same factor when the split side does more calls.

The split engine adds a roughly constant cost per batch and guest (a second backward call and
optimizer step per party, encoding, decoding and checking two messages), so the ratio depends on
how much compute a batch has. ``digits-wide`` is the digits run with a wide MLP
(``--hidden 2048,1024``) to show the ratio when compute dominates; the JSON also reports the
absolute overhead in milliseconds per batch.

    python experiments/bench_overhead.py                  # digits, movielens-small, digits-wide
    python experiments/bench_overhead.py --datasets digits --epochs 3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine, MonolithicEngine

RESULTS = Path(__file__).resolve().parent / "results"

DEFAULTS = {
    # the README's digits setup: 2 guests + host, concat, Adam
    "digits": dict(dataset="digits", guests=2, merge="concat", batch_size=32),
    # 001's MovieLens setup: host + 1 guest (96/64 columns), avg merge, batch 32, lr 0.01, Adam
    "movielens-small": dict(dataset="movielens-small", guests=1, merge="avg", batch_size=32),
    # compute-bound variant of the digits run
    "digits-wide": dict(dataset="digits", guests=2, merge="concat", batch_size=32, model="mlp", hidden="2048,1024"),
}


def epoch_times(engine_cls, cfg: RunConfig) -> list[float]:
    res = engine_cls(cfg).run()
    return [h["epoch_time_s"] for h in res["history"]], res["final"]["value"]


def cfg_batches(cfg: RunConfig) -> int:
    from fl_split.builder import plan_run

    return plan_run(cfg).schedule.num_train_batches()


def bench(name: str, epochs: int, repeats: int, limit: int) -> dict:
    cfg = RunConfig(**DEFAULTS[name], epochs=epochs, progress=False, limit=limit)
    split, mono, metrics, paired = [], [], {}, []
    load_before = os.getloadavg()
    for r in range(repeats):
        # alternate the order so drift (thermal, other load) does not favour one side
        order = [("split", LocalEngine), ("mono", MonolithicEngine)]
        pair = {}
        for label, cls in (order if r % 2 == 0 else order[::-1]):
            times, metric = epoch_times(cls, cfg)
            (split if label == "split" else mono).extend(times)
            metrics[label] = metric
            pair[label] = statistics.median(times)
        paired.append(pair["split"] / pair["mono"])
    s, m = statistics.median(split), statistics.median(mono)
    batches = cfg_batches(cfg)
    return {"dataset": name, "epochs": epochs, "repeats": repeats, "limit": limit, "batches_per_epoch": batches,
            "overhead_ms_per_batch": 1000 * (s - m) / batches,
            "config": {k: v for k, v in cfg.to_dict().items() if k in DEFAULTS[name] or k in ("epochs", "lr", "optimizer")},
            "split_epoch_s_median": s, "monolithic_epoch_s_median": m, "ratio": s / m,
            "ratio_paired": statistics.median(paired), "ratios_per_repeat": paired,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "split_epoch_s": split, "monolithic_epoch_s": mono,
            "final_metric_split": metrics["split"], "final_metric_monolithic": metrics["mono"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit", type=int, default=0, help="use only N shared IDs (0 = all)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noisy)")
    ap.add_argument("--out", default=str(RESULTS / "bench_overhead.json"))
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.datasets:
        t0 = time.perf_counter()
        row = bench(name, args.epochs, args.repeats, args.limit)
        rows.append(row)
        print(f"{name:16s} split {row['split_epoch_s_median']:.3f} s/epoch   monolithic "
              f"{row['monolithic_epoch_s_median']:.3f} s/epoch   ratio {row['ratio']:.3f} "
              f"(paired {row['ratio_paired']:.3f})   "
              f"(+{row['overhead_ms_per_batch']:.2f} ms/batch)   "
              f"(metric split {row['final_metric_split']:.4f} / mono {row['final_metric_monolithic']:.4f}; "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.machine(),
            "threads": args.threads, "cpus": os.cpu_count(), "goal_ratio": {"small_cpu": 1.25, "compute_bound": 1.05},
            "note": args.note}
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
