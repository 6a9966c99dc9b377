"""Split ÷ monolithic on a GPU (issue 18): one epoch of cnn-mnist and mnist-mlp-bn at G = 1 and 3.

The data is an **MNIST-format stand-in** made here, offline: scikit-learn's 8×8 digits upsampled
(bilinear) to 28×28, with Gaussian pixel noise, drawn with replacement to ``--train-size`` +
``--test-size`` images and written as MNIST idx files into a temporary ``--data-root``; then
``--dataset mnist`` reads it like the real set (same shapes, same models, same batch counts per
epoch as MNIST at the default 60,000 + 10,000). Nothing is downloaded.

For each model and G, the local split engine and the monolithic model run alternately
(``bench_overhead.epoch_times``: same private seed, same initial weights, same batch order; the
final metrics must agree), ``--repeats`` times, on ``--device`` (default ``cuda`` when available,
else ``cpu``); ``ratio`` is the ratio of the median epoch times. With ``--flower`` (and flwr
installed) each G also runs as a Flower simulation (on CUDA with ``--num-gpus`` = one GPU shared by
the G + 1 ClientApps): its training time ÷ the local engine's, its start-up (wall − training) and the
timeline of ``FlowerEngine.startup()``, and whether its losses equal the local run's
(``--deterministic`` sets the flag of the same name on every run).

Writes JSON (device name: ``torch.cuda.get_device_name`` or the CPU model; torch/CUDA versions; load
average) and a Markdown table to ``--out`` (default ``experiments/results/bench_gpu.json``).

    python experiments/bench_gpu.py                           # the issue's setup, on the GPU
    python experiments/bench_gpu.py --flower --deterministic  # + Flower ÷ local, start-up
    python experiments/bench_gpu.py --device cpu --train-size 2000 --test-size 500 \\
        --out experiments/results/bench_gpu_cpu_smoke.json    # a smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_overhead import PRIVATE_SEED, epoch_times  # next to this file
from fl_split.config import RunConfig
from fl_split.engine import LocalEngine, MonolithicEngine

RESULTS = Path(__file__).resolve().parent / "results"
#: the issue's runs: (model, batch size)
MODELS = (("cnn-mnist", 128), ("mnist-mlp-bn", 64))
GUESTS = (1, 3)
#: issue 18's H100 numbers (current main then), for the table
ISSUE_H100 = {("cnn-mnist", 1): (5.58, 1.73), ("cnn-mnist", 3): (8.37, 1.73),
              ("mnist-mlp-bn", 1): (3.73, 3.24), ("mnist-mlp-bn", 3): (8.89, 3.24)}
TARGET = {("cnn-mnist", 1): 1.3, ("cnn-mnist", 3): 1.6, ("mnist-mlp-bn", 1): 1.1, ("mnist-mlp-bn", 3): 1.1}


def write_mnist_standin(root: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """scikit-learn digits → 28×28 uint8 MNIST idx files under ``root/MNIST/raw`` (what
    ``--dataset mnist --data-root root`` reads). Returns ``root``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    imgs = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]  # (1797, 1, 8, 8) in [0, 1]
    big = torch.nn.functional.interpolate(imgs, size=(28, 28), mode="bilinear", align_corners=False)[:, 0].numpy()
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        pick = rng.integers(0, len(big), n)
        x = np.clip(big[pick] + rng.normal(0.0, 0.08, (n, 28, 28)), 0.0, 1.0)
        x8, y8 = np.round(x * 255).astype(np.uint8), d.target[pick].astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 0x0803, n, 28, 28) + x8.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 0x0801, n) + y8.tobytes())
    return root


def device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _same_training(a: dict, b: dict) -> bool:
    strip = ("epoch_time_s",)
    ha = [{k: v for k, v in h.items() if k not in strip} for h in a["history"]]
    hb = [{k: v for k, v in h.items() if k not in strip} for h in b["history"]]
    return ha == hb


def split_vs_monolithic(cfg: RunConfig, repeats: int) -> dict:
    split, mono, metrics = [], [], {}
    for r in range(repeats):
        order = [("split", LocalEngine), ("mono", MonolithicEngine)]
        for label, cls in (order if r % 2 == 0 else order[::-1]):
            times, metric = epoch_times(cls, cfg)
            (split if label == "split" else mono).extend(times)
            metrics[label] = metric
    s, m = statistics.median(split), statistics.median(mono)
    return {"split_epoch_s": s, "monolithic_epoch_s": m, "ratio": s / m, "split_epoch_times": split,
            "monolithic_epoch_times": mono, "final_metric_split": metrics["split"],
            "final_metric_monolithic": metrics["mono"]}


def flower_vs_local(cfg: RunConfig) -> dict:
    """One Flower simulation of ``cfg`` and one local run: training-time ratio, start-up, equality."""
    from fl_split.flower import FlowerEngine
    from fl_split.flower.resources import local_cpus

    parties = cfg.guests + 1
    fcfg = cfg.replace(engine="flower", num_cpus=max(0.01, int(100 * min(1.0, local_cpus() / parties)) / 100))
    if torch.device(cfg.device).type == "cuda":  # one GPU shared by every ClientApp (Ray's GPU actors)
        fcfg = fcfg.replace(device="cuda", num_gpus=max(0.01, int(100 / parties) / 100))
    local = LocalEngine(cfg, PRIVATE_SEED).run()
    engine = FlowerEngine(fcfg, private_seed=PRIVATE_SEED)
    t0 = time.perf_counter()
    flower = engine.run()
    wall = time.perf_counter() - t0
    st = engine.startup()
    training = flower["time_s"]  # the results' training time, defined as the local engine's
    return {"local_time_s": local["time_s"], "flower_training_s": training, "flower_wall_s": wall,
            "flower_startup_s": wall - training, "ratio_training": training / local["time_s"],
            "timeline": st, "flower_equals_local": _same_training(flower, local),
            "final_loss_local": local["final"]["train_loss"], "final_loss_flower": flower["final"]["train_loss"],
            "devices": {p: r.get("device") for p, r in flower.get("parties", {}).items()},
            "num_cpus": fcfg.num_cpus, "num_gpus": fcfg.num_gpus}


def markdown(report: dict) -> str:
    lines = [f"Device: {report['device_name']} ({report['device']}); {report['train_size']:,} train + "
             f"{report['test_size']:,} test images (digits stand-in), {report['epochs']} epoch(s), median of "
             f"{report['repeats']} alternated repeat(s); deterministic: {report['deterministic']}", "",
             "| run | split s/epoch | monolithic s/epoch | ratio | target (H100) | issue 18 H100 ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        key = (r["model"], r["guests"])
        old = ISSUE_H100.get(key)
        lines.append(f"| {r['model']}, batch {r['batch_size']}, {r['guests']} guest(s) | {r['split_epoch_s']:.3f} | "
                     f"{r['monolithic_epoch_s']:.3f} | **{r['ratio']:.2f}×** | ≤ {TARGET[key]}× | "
                     f"{old[0] / old[1]:.2f}× |")
    fl = [r for r in report["rows"] if "flower" in r]
    if fl:
        lines += ["", "| run | local s | Flower training s | Flower ÷ local | start-up s (wall − training) | "
                      "Flower = local |", "|---|---:|---:|---:|---:|---|"]
        for r in fl:
            f = r["flower"]
            lines.append(f"| {r['model']}, {r['guests']} guest(s) | {f['local_time_s']:.2f} | "
                         f"{f['flower_training_s']:.2f} | {f['ratio_training']:.2f}× | {f['flower_startup_s']:.1f} | "
                         f"{f['flower_equals_local']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--train-size", type=int, default=60000)
    ap.add_argument("--test-size", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="alternated split/monolithic repeats per cell")
    ap.add_argument("--models", nargs="+", default=[m for m, _ in MODELS], choices=[m for m, _ in MODELS])
    ap.add_argument("--guests", type=int, nargs="+", default=list(GUESTS))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process")
    ap.add_argument("--deterministic", action="store_true", help="pass --deterministic to every run")
    ap.add_argument("--flower", action="store_true", help="also Flower ÷ local and start-up (needs flwr)")
    ap.add_argument("--data-root", default="", help="write the stand-in here (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_gpu.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    if args.train_size < 1 or args.test_size < 1:
        ap.error(f"--train-size and --test-size must be >= 1, got {args.train_size} and {args.test_size}")
    from fl_split.devices import resolve

    device = resolve(args.device)  # a specific error naming --device when it is not available here
    torch.set_num_threads(args.threads)
    flower_ok = False
    if args.flower:
        try:
            import flwr  # noqa: F401

            flower_ok = True
        except ImportError:
            print("--flower: flwr is not importable here; Flower part skipped", flush=True)
    tmp = None
    if args.data_root:
        root = Path(args.data_root)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="fl-split-mnist-standin-")
        root = Path(tmp.name)
    write_mnist_standin(root, args.train_size, args.test_size)
    report = {"device": device, "device_name": device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": sys.version.split()[0], "cpus": os.cpu_count(),
              "threads": args.threads, "train_size": args.train_size, "test_size": args.test_size,
              "epochs": args.epochs, "repeats": args.repeats, "deterministic": args.deterministic,
              "data": "scikit-learn digits upsampled to 28x28 (bilinear) + N(0, 0.08) noise, as MNIST idx files",
              "loadavg_before": os.getloadavg(), "note": args.note, "rows": []}
    try:
        batch = dict(MODELS)
        for model in args.models:
            for g in args.guests:
                cfg = RunConfig(dataset="mnist", data_root=str(root), model=model, guests=g, epochs=args.epochs,
                                batch_size=batch[model], device=device, progress=False, seed=0,
                                deterministic=args.deterministic)
                t0 = time.perf_counter()
                row = {"model": model, "guests": g, "batch_size": batch[model], **split_vs_monolithic(cfg, args.repeats)}
                print(f"{model:14s} G={g}  split {row['split_epoch_s']:.3f} s/epoch  monolithic "
                      f"{row['monolithic_epoch_s']:.3f} s/epoch  ratio {row['ratio']:.2f}  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                if flower_ok:
                    row["flower"] = flower_vs_local(cfg)
                    f = row["flower"]
                    print(f"{'':14s} Flower training {f['flower_training_s']:.2f} s vs local {f['local_time_s']:.2f} s "
                          f"= {f['ratio_training']:.2f}x; start-up {f['flower_startup_s']:.1f} s; "
                          f"equal: {f['flower_equals_local']}", flush=True)
                report["rows"].append(row)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["loadavg_after"] = os.getloadavg()
    report["table"] = markdown(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(report["table"])
    print(f"\nsaved {args.out}")
    return report


if __name__ == "__main__":
    main()
