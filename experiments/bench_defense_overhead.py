"""Training-step overhead of each defence vs no defence (local engine, same config, one run).

Paper 003 Table 9 reports +0.5 % (noise) and +5.6 % (masking) per training step on CPU; the
issue's goal is ≤ 10 % for every defence. Two measurements, both on epochs 2… (epoch 1 also pays
one-time costs — building the accountant's privacy-loss distribution, Opacus' wrapping — reported
apart as ``first_epoch_extra_s``):

* **attributed** — inside each run, the wall time spent in the defence's own code is summed:
  mechanism releases and local derivatives, receiver-side denoising, R3eLU importance updates,
  ledger charges, and the seeded generators they draw from. The overhead is that time over the
  rest of the epoch. It compares two parts of *the same* run, so it is robust to the machine's
  noise (this 2-core VM shows ±30 % between identical epochs). DP-SGD's cost is inside Opacus'
  backward and optimizer step and is not attributed (``null``).
* **end to end** — median epoch time with the defence over the median without it; the
  configurations are alternated ``--repeats`` times (order reversed on odd repeats) so drift hits
  all alike. This includes everything (e.g. a model trained on noise may run at a different speed)
  and is noisy on a shared machine.

Epoch time includes the forward and backward releases, ledger charges (default PLD accountant),
codec and evaluation.

    python experiments/bench_defense_overhead.py
    python experiments/bench_defense_overhead.py --dataset movielens-small --guests 1
    python experiments/bench_defense_overhead.py --hidden 2048,1024 --epochs 2   # compute-bound step
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import fl_split.engine as engine_mod
from fl_split.parties import Importance
from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.privacy import denoise, mechanisms
from fl_split.privacy.ledger import Ledger
from fl_split.seeding import PartySecret

RESULTS = Path(__file__).resolve().parent / "results"

#: name -> config changes (each defence on the direction(s) it supports; denoising on top of noise)
DEFENSES = {
    "none": {},
    "laplace (both)": dict(defense="laplace", protect="both", epsilon=8.0),
    "gaussian (guest)": dict(defense="gaussian", protect="guest", sigma=0.7),
    "gaussian + mask": dict(defense="gaussian", protect="guest", sigma=0.7, denoise="mask", denoise_param=0.2),
    "gaussian + scale": dict(defense="gaussian", protect="guest", sigma=0.7, denoise="scale", denoise_param=0.2),
    "r3elu (both)": dict(defense="r3elu", protect="both", epsilon=8.0),
    "r3elu importance": dict(defense="r3elu", protect="guest", epsilon=8.0, allocation="importance"),
    "rr (guest)": dict(defense="rr", protect="guest", epsilon=8.0),
    "dpsgd (guest)": dict(defense="dpsgd", protect="guest", sigma=1.0),
}

#: (owner, attribute) of the defence's own code, timed by :func:`attributed`
DEFENCE_CODE = [
    *[(cls, name) for cls in (mechanisms.Laplace, mechanisms.Gaussian, mechanisms.R3eLU,
                              mechanisms.RandomizedResponse) for name in ("release", "local_grad")],
    (mechanisms.R3eLU, "set_importance"), (mechanisms.ImportanceTracker, "update"), (Importance, "apply"),
    (denoise.Scale, "__call__"), (denoise.Mask, "__call__"),
    (Ledger, "charge"),
    (PartySecret, "torch_generator"),
]


@contextlib.contextmanager
def attributed():
    """Time spent in :data:`DEFENCE_CODE`, read at every epoch end: yields the list of cumulative
    seconds at each epoch end (the code is restored afterwards). None of these calls nest."""
    spent = [0.0]
    marks: list[float] = []
    saved = []

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    for owner, name in DEFENCE_CODE:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed(getattr(owner, name)))
    record = engine_mod._epoch_record

    def epoch_record(*args, **kwargs):
        marks.append(spent[0])
        return record(*args, **kwargs)

    engine_mod._epoch_record = epoch_record
    try:
        yield marks
    finally:
        engine_mod._epoch_record = record
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--guests", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--hidden", default="auto", help="hidden widths of model 'mlp' (e.g. 2048,1024 for a "
                    "compute-bound step); auto = the dataset's default model")
    ap.add_argument("--out", default=str(RESULTS / "bench_defense_overhead.json"))
    args = ap.parse_args(argv)
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (epoch 1 carries one-time costs; the steady state is epochs 2...)")
    torch.set_num_threads(1)
    # the default accountant (pld): its ledger charges are part of what a user pays per step
    base = dict(dataset=args.dataset, guests=args.guests, epochs=args.epochs, progress=False, limit=args.limit,
                clip_c=10.0, top_k="half")  # as recorded (001's C and K = N/2); the cost hardly depends on them
    if args.hidden != "auto":
        base.update(model="mlp", hidden=args.hidden)
    first: dict[str, list[float]] = {k: [] for k in DEFENSES}
    steady: dict[str, list[float]] = {k: [] for k in DEFENSES}
    shares: dict[str, list[float]] = {k: [] for k in DEFENSES}  # defence time / rest, per steady epoch
    own_ms: dict[str, list[float]] = {k: [] for k in DEFENSES}  # defence time per batch, per steady epoch
    metric: dict[str, float] = {}
    batches = 0
    for r in range(args.repeats):
        order = list(DEFENSES) if r % 2 == 0 else list(DEFENSES)[::-1]
        for name in order:
            with attributed() as marks:
                res = LocalEngine(RunConfig(**base, **DEFENSES[name])).run()
            ts = [h["epoch_time_s"] for h in res["history"]]
            batches = res["plan"]["batches_per_epoch"]
            first[name].append(ts[0])
            steady[name].extend(ts[1:])
            for e in range(1, len(ts)):
                own = marks[e] - marks[e - 1]
                shares[name].append(own / (ts[e] - own))
                own_ms[name].append(1000 * own / batches)
            metric[name] = res["final"]["value"]
    ref, ref_first = statistics.median(steady["none"]), statistics.median(first["none"])
    rows = []
    print(f"{args.dataset}{'' if args.hidden == 'auto' else f' (mlp {args.hidden})'}: epochs 2-{args.epochs}, "
          f"{args.repeats} repeats, {batches} batches/epoch; paper 003 Table 9: +0.5% noise, +5.6% masking on CPU")
    print(f"  {'defense':20s} {'attributed':>10s} {'ms/batch':>9s}   {'end to end':>10s} {'epoch s':>8s}   "
          f"{'1st-epoch extra':>15s}  metric")
    for name in DEFENSES:
        med, med1 = statistics.median(steady[name]), statistics.median(first[name])
        dp = name.startswith("dpsgd")
        att = None if dp else statistics.median(shares[name])
        att_ms = None if dp else statistics.median(own_ms[name])
        rows.append({"defense": name, "attributed_overhead": att, "attributed_ms_per_batch": att_ms,
                     "epoch_s_median": med, "overhead": med / ref - 1,
                     "overhead_ms_per_batch": 1000 * (med - ref) / batches,
                     "first_epoch_s_median": med1, "first_epoch_extra_s": (med1 - ref_first) - (med - ref),
                     "final_metric": metric[name], "epoch_s": steady[name], "first_epoch_s": first[name],
                     "config": DEFENSES[name]})
        att_txt = "n/a" if att is None else f"{100 * att:+.1f} %"
        ms_txt = "" if att_ms is None else f"{att_ms:.2f}"
        print(f"  {name:20s} {att_txt:>10s} {ms_txt:>9s}   {100 * (med / ref - 1):+9.1f} % {med:8.3f}   "
              f"{rows[-1]['first_epoch_extra_s']:+14.3f}s  {metric[name]:.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.machine(),
            "args": vars(args), "batches_per_epoch": batches,
            "attributed_code": [f"{getattr(o, '__name__', o)}.{n}" for o, n in DEFENCE_CODE]}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
