"""Cost of each boundary mechanism on one tensor, beside paper 002's Table 2.

002 §4.3 times its mechanisms on "1000 random vectors with 10000 elements": randomized
response 0.3958 s, Laplace 0.6911 s on their machine. We release a 1000×10000 float32 tensor
with each mechanism (Laplace, Gaussian, R3eLU forward and backward, randomized response, and
the two denoisers), take the median of several interleaved repeats, and report it also as a
ratio to ``torch.relu`` on the same tensor (a rough machine-independent unit: the cheapest
elementwise op; on a loaded shared machine it is itself noisy, so the JSON keeps the minimum too).

Then (unless ``--no-steps``) it measures each defence's overhead on training steps vs no defence
(paper 003 Table 9), with ``bench_defense_overhead.py`` next to this file.

Run: ``python experiments/bench_mechanisms.py [--repeats 7] [--device cpu|cuda] [--threads N]``.
Writes ``experiments/results/bench_mechanisms.json`` (and ``bench_defense_overhead.json``) and
prints both tables.

``--samplers`` (issue 18) times only the two Laplace samplers on the same 10^7 elements — the old
float32 inverse CDF and the exact discrete Laplace (``fl_split/privacy/sampling.py``) — at each of
``--thread-counts`` (default 2 and 1), interleaved, with the load average before and after (the
machine is shared), and writes ``experiments/results/bench_sampler.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from fl_split.privacy.denoise import Mask, Scale
from fl_split.privacy.mechanisms import Gaussian, Laplace, R3eLU, RandomizedResponse
from fl_split.privacy.sampling import DiscreteLaplace, unit_laplace_float

ROWS, COLS = 1000, 10000
PAPER_002 = {"rr": 0.3958, "laplace": 0.6911}  # seconds, 002 Table 2 (their machine)
RESULTS = Path(__file__).resolve().parent / "results" / "bench_mechanisms.json"
SAMPLER_RESULTS = Path(__file__).resolve().parent / "results" / "bench_sampler.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timings(cases: dict, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Wall times of every case, ``repeats`` rounds, **interleaved** (one call of each case per
    round) so that load from other processes on a shared machine hits all cases alike."""
    for fn in cases.values():  # warm-up (allocator, lazy init)
        fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def mechanism_tensor_costs(repeats: int = 7, device: str = "cpu", seed: int = 0) -> dict:
    """Median seconds of one release of a ``ROWS×COLS`` float32 tensor per mechanism, and the
    ratio to ``torch.relu`` on the same tensor."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(ROWS, COLS, generator=gen, device=dev)
    tanh_x = torch.tanh(x)
    d = COLS
    cases = {
        "relu (reference)": lambda: torch.relu(x),
        # the sampler alone: the float32 inverse CDF fl_split used before issue 8, and the exact
        # discrete Laplace that replaced it (docs/accounting.md, "Sampling Laplace noise on floats")
        "laplace sampler (old float)": lambda: unit_laplace_float(x.shape, gen, dev),
        "laplace sampler (discrete)": lambda: DiscreteLaplace(1500.0).sample(x.shape, gen, dev),
        "laplace": lambda: Laplace(d, "forward", 1.0, epsilon=1.0).release(x, gen),
        "gaussian": lambda: Gaussian(d, "forward", 0.7).release(tanh_x, gen),
        "gaussian backward": lambda: Gaussian(d, "backward", 0.7, bound=1.0).release(x, gen),
        "r3elu forward": lambda: R3eLU(d, "forward", 1.0, 10.0).release(x, gen),
        "r3elu backward": lambda: R3eLU(d, "backward", 1.0, 10.0).release(x, gen),
        "rr": lambda: RandomizedResponse(d, 1.0).release(x, gen),
        "mask (denoise)": lambda: Mask(0.2)(x, gen),
        "scale (denoise)": lambda: Scale(0.2)(x, None),
    }
    times = _timings(cases, repeats, dev)
    relu = statistics.median(times["relu (reference)"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"mechanism": name, "seconds": med, "min_seconds": min(ts), "ratio_to_relu": med / relu,
                     "paper_002_seconds": PAPER_002.get(name)})
    return {"tensor": [ROWS, COLS], "dtype": "float32", "device": str(dev), "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "rows": rows,
            "note": "median wall time of one release (stats included); 002 Table 2 times are on "
                    "the authors' machine and include their own truncate/binarise steps"}


def sampler_costs(repeats: int = 9, device: str = "cpu", thread_counts=(2, 1), seed: int = 0) -> dict:
    """Seconds to draw ``ROWS×COLS`` Laplace noise with the old float sampler and the exact discrete
    Laplace (``t = 1500``, a typical grid value), per torch thread count: all cases interleaved
    round by round, median and minimum of ``repeats``."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = (ROWS, COLS)
    dlap = DiscreteLaplace(1500.0)
    before = os.getloadavg()
    old_threads = torch.get_num_threads()
    rows = []
    try:
        times: dict[tuple[str, int], list[float]] = {}
        cases = {"old float32 Laplace": lambda: unit_laplace_float(shape, gen, dev),
                 "exact discrete Laplace": lambda: dlap.sample(shape, gen, dev)}
        for _ in range(repeats + 1):  # the first round warms up
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for name, fn in cases.items():
                    t0 = time.perf_counter()
                    fn()
                    _sync(dev)
                    times.setdefault((name, threads), []).append(time.perf_counter() - t0)
        for (name, threads), ts in times.items():
            ts = ts[1:]
            rows.append({"sampler": name, "threads": threads, "seconds": statistics.median(ts),
                         "min_seconds": min(ts), "paper_002_seconds": PAPER_002["laplace"]})
    finally:
        torch.set_num_threads(old_threads)
    return {"elements": ROWS * COLS, "device": str(dev), "repeats": repeats, "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_before": before, "load_average_after": os.getloadavg(), "rows": rows,
            "note": "median/min wall time of one draw of 10^7 elements; 002 Table 2's Laplace time "
                    "(0.691 s) is the authors' whole mechanism on their machine"}


def format_sampler_table(res: dict) -> str:
    head = f"{'sampler':<24} {'threads':>7} {'median s':>9} {'min s':>8}"
    lines = [f"{res['elements']:,} Laplace draws on {res['device']} (median of {res['repeats']}; load "
             f"{res['load_average_before'][0]:.1f} -> {res['load_average_after'][0]:.1f}; 002 Table 2 "
             f"Laplace: {PAPER_002['laplace']} s)", head, "-" * len(head)]
    for r in res["rows"]:
        lines.append(f"{r['sampler']:<24} {r['threads']:>7} {r['seconds']:>9.4f} {r['min_seconds']:>8.4f}")
    return "\n".join(lines)


def format_table(res: dict) -> str:
    head = f"{'mechanism':<20} {'median s':>9} {'min s':>8} {'x relu':>8} {'002 Table 2 (s)':>16}"
    lines = [f"1 release of a {res['tensor'][0]}x{res['tensor'][1]} float32 tensor on {res['device']} "
             f"({res['torch_threads']} threads, median of {res['repeats']})", head, "-" * len(head)]
    for r in res["rows"]:
        paper = f"{r['paper_002_seconds']:.4f}" if r["paper_002_seconds"] is not None else ""
        lines.append(f"{r['mechanism']:<20} {r['seconds']:>9.4f} {r['min_seconds']:>8.4f} {r['ratio_to_relu']:>8.2f} "
                     f"{paper:>16}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-steps", action="store_true", help="skip the per-training-step overhead part")
    ap.add_argument("--samplers", action="store_true",
                    help="time only the old float and the exact discrete Laplace samplers (bench_sampler.json)")
    ap.add_argument("--thread-counts", type=int, nargs="+", default=[2, 1],
                    help="torch thread counts for --samplers (default: 2 1)")
    args = ap.parse_args(argv)
    if args.samplers:
        res = sampler_costs(args.repeats, args.device, tuple(args.thread_counts))
        res["table"] = format_sampler_table(res)
        out = SAMPLER_RESULTS if args.out == RESULTS else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(res["table"])
        print(f"\nsaved {out}")
        return res
    if args.threads:
        torch.set_num_threads(args.threads)
    res = mechanism_tensor_costs(args.repeats, args.device)
    table = format_table(res)
    res["table"] = table
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table)
    print(f"\nsaved {args.out}")
    if not args.no_steps:
        import bench_defense_overhead  # next to this file (sys.path[0] when run as a script)

        print()
        bench_defense_overhead.main([])
    return res


if __name__ == "__main__":
    main()
