"""Thread oversubscription benchmark (issue 17): the CLI's epoch time, quiet vs beside a CPU-heavy process.

The README's main job (``fl-split train --dataset digits --guests 2 --defense gaussian --sigma 0.7
--denoise scale --denoise-param 0.2``, local engine) is run through the real CLI in a subprocess, with
``OMP_NUM_THREADS`` removed from its environment so that torch's own default applies unless
``--threads`` says otherwise, for each thread setting:

* ``auto`` — the CLI's default since issue 17 (one torch thread per party, ``fl_split.devices.party_threads``);
* ``N`` = the machine's CPU count — what torch does by default (the CLI before issue 17).

Each setting runs on the quiet machine and beside a **busy process**: another Python process doing
float32 matrix products with torch's default thread count (another training job), started before the
run and stopped after it. Quiet and busy runs alternate, ``--repeats`` times, so a change in the
machine's background load hits both. The figure is the median per-epoch time of the run (epochs 2..E:
the first carries one-off costs); the verdict is busy ÷ quiet per setting (issue 17's acceptance:
within 3× for the CLI's default).

Run: ``python experiments/bench_threads.py [--epochs 4] [--repeats 2]`` → ``experiments/results/bench_threads.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "bench_threads.json"
JOB = ["--dataset", "digits", "--guests", "2", "--defense", "gaussian", "--sigma", "0.7", "--denoise", "scale",
       "--denoise-param", "0.2", "--device", "cpu", "--no-progress"]
BUSY = ("import torch\n"
        "a = torch.randn(384, 384)\n"
        "while True:\n"
        "    b = a @ a\n")


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("OMP_NUM_THREADS", None)  # torch's default unless --threads
    env.pop("MKL_NUM_THREADS", None)
    return env


def cli_epochs(threads: str, epochs: int) -> list[float]:
    """Per-epoch times of one CLI run with ``--threads threads``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        subprocess.run([sys.executable, "-m", "fl_split.cli", "train", *JOB, "--epochs", str(epochs),
                        "--threads", threads, "--out", str(out)], check=True, env=_env(), cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [h["epoch_time_s"] for h in json.loads(out.read_text())["history"]]


def with_busy_process(fn):
    """Run ``fn()`` while a CPU-heavy process (torch's default threads) runs beside it."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(2.0)  # let it take the cores
        return fn()
    finally:
        busy.terminate()
        try:
            busy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            busy.kill()
            busy.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    settings = ["auto", str(cpus)]
    runs: dict[str, dict[str, list[list[float]]]] = {s: {"quiet": [], "busy": []} for s in settings}
    loads = []
    for rep in range(args.repeats):
        for s in settings:
            loads.append(os.getloadavg()[0])
            runs[s]["quiet"].append(cli_epochs(s, args.epochs))
            runs[s]["busy"].append(with_busy_process(lambda s=s: cli_epochs(s, args.epochs)))
            q, b = (statistics.median(runs[s][k][-1][1:] or runs[s][k][-1]) for k in ("quiet", "busy"))
            print(f"[{rep + 1}/{args.repeats}] --threads {s}: quiet {q:.3f} s/epoch, busy {b:.3f} s/epoch "
                  f"({b / q:.1f}x)", flush=True)
    summary = {}
    for s in settings:
        med = {k: statistics.median(t for run in runs[s][k] for t in (run[1:] or run)) for k in ("quiet", "busy")}
        summary[s] = {"quiet_epoch_s": med["quiet"], "busy_epoch_s": med["busy"], "ratio": med["busy"] / med["quiet"]}
    res = {"meta": {"cpus": cpus, "epochs": args.epochs, "repeats": args.repeats, "job": JOB,
                    "busy_process": "python: torch float32 384x384 matmul loop, torch's default threads",
                    "load_average_1min_at_starts": loads, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "statistic": "median per-epoch time over epochs 2..E of every run"},
           "runs": runs, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    for s, r in summary.items():
        print(f"--threads {s}: quiet {r['quiet_epoch_s']:.3f} s, busy {r['busy_epoch_s']:.3f} s per epoch: "
              f"{r['ratio']:.2f}x")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
