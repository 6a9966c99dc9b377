"""Benchmark of the Flower engine: batches per round K vs epoch time, accuracy and bytes (issue #3).

For each dataset and each K in {1, 4, 16, 64, epoch}:

* **epoch time** of the Flower engine (one in-process Flower simulation on Ray, all K run one
  after the other in it, so Ray starts once) and of the local engine on the same configuration;
* **accuracy** after the full training (``--epochs``) at each K, mean ± sd over ``--seeds`` seeds,
  against exact training (K = 1). The Flower engine computes exactly what the local engine computes
  for the same configuration (``tests/test_flower.py``; this script re-checks it on the timing runs),
  so the seed-averaged accuracies come from the local engine;
* **payload bytes per round** (protocol blobs, both directions; the ``wire`` block of the results).

The recommended default K is the smallest K whose accuracy is within 0.5 point of exact training
and whose Flower epoch time is at most 2x the local engine's; if no K meets both, the script says
so and names the K meeting the accuracy goal with the best time ratio.

    python experiments/bench_flower.py                  # digits + movielens-small, 3 seeds (~10 min)
    python experiments/bench_flower.py --quick          # digits only, 1 seed, short (smoke test)
    python experiments/bench_flower.py --poll-comparison  # reply polling: 5 ms pull vs 0.1 s (send_and_receive's)

Writes ``experiments/results/bench_flower.json`` and prints a Markdown table (docs/flower.md).
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
from fl_split.data.registry import dataset_info, dataset_names
from fl_split.engine import LocalEngine
from fl_split.flower import FlowerEngine

KS = (1, 4, 16, 64, "epoch")
#: per dataset: guests, training epochs for accuracy, epochs timed under Flower
SETUPS = {
    "digits": {"guests": 2, "epochs": 5, "timing_epochs": 3},
    "movielens-small": {"guests": 1, "epochs": 5, "timing_epochs": 2},
}
ACC_TOLERANCE = 0.005   # 0.5 point
TIME_RATIO = 2.0


def _versions() -> dict:
    import flwr
    import ray

    return {"python": platform.python_version(), "torch": torch.__version__, "flwr": flwr.__version__,
            "ray": ray.__version__, "cpus": os.cpu_count(), "machine": platform.machine()}


def _epoch_times(results: dict) -> list[float]:
    return [h["epoch_time_s"] for h in results["history"]]


def _same_training(a: dict, b: dict) -> bool:
    strip = ("epoch_time_s",)
    ha = [{k: v for k, v in h.items() if k not in strip} for h in a["history"]]
    hb = [{k: v for k, v in h.items() if k not in strip} for h in b["history"]]
    return ha == hb and a["wire"] == b["wire"]


def bench_dataset(name: str, setup: dict, seeds: int, ks, quick: bool) -> dict:
    base = RunConfig(dataset=name, guests=setup["guests"], epochs=setup["epochs"], progress=False, seed=0,
                     engine="flower", limit=600 if quick else 0)
    timing = [base.replace(batches_per_round=k, epochs=setup["timing_epochs"]) for k in ks]
    print(f"[{name}] Flower simulation: K = {list(ks)}, {setup['timing_epochs']} epochs each", flush=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    engine = FlowerEngine(timing[0])
    flower = engine.run_series(timing)
    sim_wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    print(f"[{name}] local engine on the same configurations", flush=True)
    local = [LocalEngine(c.replace(engine="local")).run() for c in timing]

    print(f"[{name}] accuracy: {len(ks)} K x {seeds} seeds x {setup['epochs']} epochs (local engine)", flush=True)
    acc: dict[str, list[float]] = {}
    for k in ks:
        acc[str(k)] = [LocalEngine(base.replace(engine="local", batches_per_round=k, seed=s),
                                   private_seed=s).run()["final"]["value"] for s in range(seeds)]
    exact = statistics.fmean(acc["1"])

    rows = []
    for k, f, loc, tr in zip(ks, flower, local, engine.transports):
        f_times, l_times = _epoch_times(f), _epoch_times(loc)
        # steady state: skip the first epoch when several were timed (actors warm up in it)
        f_ep = statistics.median(f_times[1:] if len(f_times) > 1 else f_times)
        l_ep = statistics.median(l_times[1:] if len(l_times) > 1 else l_times)
        a = acc[str(k)]
        wire = f["wire"]
        rows.append({
            "K": k, "rounds_per_epoch": wire["rounds"] // setup["timing_epochs"],
            "flower_epoch_s": f_ep, "local_epoch_s": l_ep, "time_ratio": f_ep / l_ep,
            "flower_epoch_times": f_times, "local_epoch_times": l_times,
            "bytes_per_round": (wire["bytes_to_host"] + wire["bytes_to_guests"]) / wire["rounds"],
            "flower_wait_s": tr.stats.seconds if tr else None, "exchanges": tr.stats.exchanges if tr else None,
            "accuracy_mean": statistics.fmean(a), "accuracy_sd": statistics.stdev(a) if len(a) > 1 else 0.0,
            "accuracies": a, "delta_vs_exact": statistics.fmean(a) - exact,
            "flower_equals_local": _same_training(f, loc),
        })
    return {"dataset": name, "metric": flower[0]["final"]["metric"], "guests": setup["guests"],
            "epochs": setup["epochs"], "timing_epochs": setup["timing_epochs"], "seeds": seeds,
            "n_train": flower[0]["plan"]["n_train"], "batches_per_epoch": flower[0]["plan"]["batches_per_epoch"],
            "exact_accuracy": exact, "simulation_wall_s": sim_wall, "loadavg_before": load_before,
            "loadavg_after": load_after, "rows": rows}


def recommend(datasets: list[dict]) -> dict:
    """Smallest K meeting both goals on every dataset, else the best compromise."""
    def ok_acc(r):
        return r["delta_vs_exact"] >= -ACC_TOLERANCE

    def ok_time(r):
        return r["time_ratio"] <= TIME_RATIO

    ks = [r["K"] for r in datasets[0]["rows"]]
    by_k = {str(k): [next(r for r in d["rows"] if r["K"] == k) for d in datasets] for k in ks}
    both = [k for k in ks if all(ok_acc(r) and ok_time(r) for r in by_k[str(k)])]
    if both:
        return {"K": both[0], "meets_both_goals": True,
                "why": f"smallest K within {ACC_TOLERANCE * 100:.1f} point of exact accuracy with a Flower "
                       f"epoch time <= {TIME_RATIO:g}x the local engine's on every dataset"}
    acc_ok = [k for k in ks if all(ok_acc(r) for r in by_k[str(k)])]
    pool = acc_ok or ks
    best = min(pool, key=lambda k: max(r["time_ratio"] for r in by_k[str(k)]))
    return {"K": best, "meets_both_goals": False,
            "why": (f"no K meets both goals; K={best} is the fastest K " +
                    ("within the accuracy tolerance" if acc_ok else "(none is within the accuracy tolerance)") +
                    f" (worst time ratio {max(r['time_ratio'] for r in by_k[str(best)]):.1f}x)")}


def markdown(report: dict) -> str:
    lines = []
    for d in report["datasets"]:
        lines.append(f"**{d['dataset']}** — {d['guests']} guest(s), {d['n_train']} training records, "
                     f"{d['batches_per_epoch']} batches/epoch; {d['metric']} after {d['epochs']} epochs, "
                     f"mean ± sd over {d['seeds']} seed(s); exact (K = 1): {d['exact_accuracy']:.4f}")
        lines.append("")
        lines.append("| K | rounds/epoch | Flower epoch (s) | local epoch (s) | ratio | payload bytes/round "
                     f"| {d['metric']} | Δ vs exact (points) | Flower ≡ local |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for r in d["rows"]:
            lines.append(f"| {r['K']} | {r['rounds_per_epoch']} | {r['flower_epoch_s']:.2f} | {r['local_epoch_s']:.2f} "
                         f"| {r['time_ratio']:.1f}× | {r['bytes_per_round'] / 1e3:,.1f} kB "
                         f"| {r['accuracy_mean']:.4f} ± {r['accuracy_sd']:.4f} | {100 * r['delta_vs_exact']:+.2f} "
                         f"| {'yes' if r['flower_equals_local'] else 'NO'} |")
        lines.append("")
    rec = report["recommendation"]
    lines.append(f"Recommended default `batches-per-round`: **{rec['K']}** — {rec['why']}.")
    return "\n".join(lines)


def poll_comparison(out: Path, polls=(0.005, 0.1), epochs: int = 3) -> dict:
    """Digits, K = 1 (the most exchanges): epoch time when the coordinator polls for replies every
    5 ms (push_messages + pull_messages) vs every 0.1 s (Grid.send_and_receive's fixed sleep)."""
    cfg = RunConfig(dataset="digits", guests=2, epochs=epochs, progress=False, batches_per_round=1, engine="flower")
    report = {"versions": _versions(), "dataset": "digits", "guests": 2, "K": 1, "runs": []}
    for poll in polls:
        print(f"[poll {poll} s] Flower simulation, digits, K = 1, {epochs} epochs", flush=True)
        engine = FlowerEngine(cfg, poll_interval=poll)
        res = engine.run()
        times = _epoch_times(res)
        report["runs"].append({"poll_s": poll, "epoch_times": times, "median_epoch_s": statistics.median(times[1:]),
                               "rounds_per_epoch": res["wire"]["rounds"] // epochs})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for r in report["runs"]:
        print(f"poll {r['poll_s']:g} s: median epoch {r['median_epoch_s']:.2f} s "
              f"({r['median_epoch_s'] / r['rounds_per_epoch']:.3f} s per round)")
    print(f"written to {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=list(SETUPS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="digits only, 600 records, 1 seed, K in {1, epoch}")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_flower.json"))
    p.add_argument("--poll-comparison", action="store_true",
                   help="only compare reply polling intervals (writes results/bench_flower_poll.json)")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)  # the Ray actors run with one thread each; compare like with like
    if ns.poll_comparison:
        poll_comparison(Path(__file__).parent / "results" / "bench_flower_poll.json")
        return 0
    ks = (1, "epoch") if ns.quick else KS
    names = ["digits"] if ns.quick else ns.datasets
    seeds = 1 if ns.quick else ns.seeds
    report = {"versions": _versions(), "Ks": list(ks), "accuracy_tolerance": ACC_TOLERANCE,
              "time_ratio_goal": TIME_RATIO, "datasets": [], "skipped": {}}
    for name in names:
        if name not in dataset_names() or not dataset_info(name).available():
            note = "not registered" if name not in dataset_names() else "not available offline"
            print(f"note: skipping {name}: {note} (see `fl-split datasets`)", flush=True)
            report["skipped"][name] = note
            continue
        setup = dict(SETUPS.get(name, {"guests": 1, "epochs": 5, "timing_epochs": 2}))
        if ns.quick:
            setup.update(epochs=2, timing_epochs=2)
        report["datasets"].append(bench_dataset(name, setup, seeds, ks, ns.quick))
    if not report["datasets"]:
        print("nothing to benchmark", file=sys.stderr)
        return 1
    report["recommendation"] = recommend(report["datasets"])
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
