"""Poisoning by a guest, detected or bounded (issue 36): the host's label agreement and its own-baseline verdict.

    .venv/bin/python experiments/poisoning_detect.py honest   # false alarms: dataset x defence x relay round x seed
    .venv/bin/python experiments/poisoning_detect.py attack   # the permutation from round 10 and the consistent liar

``honest`` counts, per run, a guest refused (any poisoning check) and a ``degraded`` status, and keeps the label
agreement's smallest judged correlation and the largest verdict z. ``attack`` runs guest-1 permuting its training
releases' records within each batch from round 10 (test releases honest: ``experiments/loss_alarm.py``'s
``PermutingGuest``) and guest-1 scaling its training *and* test releases alike from its first batch (the consistent
liar), and reports what the run ended as, where, and its test accuracy. Numbers go to
``experiments/results/poisoning_detect_<mode>.json``; ``docs/threat-model.md`` quotes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.loss_alarm import PermutingGuest  # noqa: E402
from fl_split.config import RunConfig  # noqa: E402
from fl_split.engine import LocalEngine  # noqa: E402
from fl_split.errors import ReleaseOutOfRange  # noqa: E402
from fl_split.seeding import PrivateSeed  # noqa: E402
from tests.helpers import POISONING_DEFENCES as DEFENCES  # noqa: E402
from tests.helpers import tampered  # noqa: E402


class ScalingGuest:
    """The consistent liar: ``guest`` multiplies every release, training and test alike, by ``factor``."""

    def __init__(self, local, factor: float, guest: str = "guest-1") -> None:
        self.local, self.factor, self.guest = local, float(factor), guest
        self.guests = local.guests

    def guest_step(self, owed, keys, round_):
        out = self.local.guest_step(owed, keys, round_)
        if self.guest in out:
            def change(m):
                m.tensor = m.tensor * self.factor
                m.encoding = "float32"
            out[self.guest] = [tampered(b, change) for b in out[self.guest]]
        return out

    def __getattr__(self, name):
        return getattr(self.local, name)


def cfg(dataset: str, defence: str, seed: int, **kw) -> RunConfig:
    base = dict(dataset=dataset, guests=2, epochs=3, progress=False, protect="both", seed=seed)
    base.update(DEFENCES[defence])
    base.update(kw)
    return RunConfig(**base)


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def run(c: RunConfig, seed: int, transport=None) -> dict:
    """One run; the label agreement's judged correlations are traced from the host's guard."""
    e = LocalEngine(c, private_seed=PrivateSeed.legacy(seed), transport=transport)
    guard, rhos, unjudged = e.host.guard, [], []
    violation = guard.violation

    def traced(guest, tensors, noisy=False, labels=None):
        s = guard.statistics(guest, tensors, labels)
        if s is not None and not math.isnan(s["label_rho"]):
            row = (round(s["label_rho"], 4), round(s["label_threshold"], 4), round(s["label_expected"], 4))
            (rhos if s["label_judged"] else unjudged).append(row)
        return violation(guest, tensors, noisy, labels)

    guard.violation = traced
    t0 = time.perf_counter()
    try:
        r = e.run()
        out = {"ended": r["status"], "accuracy": r["final"]["value"],
               "failures": [(f["guest"], f["round"], f["reason"][:160]) for f in r["guest_failures"]],
               "detail": r.get("status_detail", "")[:300]}
    except ReleaseOutOfRange as exc:
        last = e.host.history[-1] if e.host.history else {}
        out = {"ended": "refused", "accuracy": last.get("test_metric"), "accuracy_epoch": last.get("epoch"),
               "failures": [(exc.sender, exc.round, str(exc)[:160])], "detail": ""}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    q = e.host.quality
    out["z"] = [round(v["z"], 2) if math.isfinite(v["z"]) else str(v["z"]) for v in q]
    out["baseline"] = _finite(round(q[-1]["baseline_metric"], 4)) if q else None
    # the judged label correlation closest to its refusal threshold: (correlation, threshold, honest prediction)
    out["label_closest"] = min(rhos, key=lambda r: r[0] - r[1]) if rhos else None
    out["label_judged"] = len(rhos)
    # every label correlation computed, judged or not, as (correlation - the honest prediction): the honest spread
    out["label_gaps"] = sorted(round(r[0] - r[2], 4) for r in rhos + unjudged)[:3]
    q = e.host.quality
    out["final_error"] = ([round(q[-1][k], 4) for k in ("joint_error", "baseline_error", "prior_error")] if q else None)
    out["lost"] = _finite(round(q[-1]["lost"], 3)) if q else None
    return out


def honest(args) -> list[dict]:
    rows = []
    for dataset in args.datasets:
        for defence in args.defences:
            for bpr in (1, "epoch"):
                for hf in (True, False):
                    for seed in args.seeds:
                        extra = {} if hf else {"host_features": False}
                        r = run(cfg(dataset, defence, seed, batches_per_round=bpr, **extra), seed)
                        rows.append({"dataset": dataset, "defence": defence, "bpr": bpr, "host_features": hf,
                                     "seed": seed, **r})
                        print(json.dumps(rows[-1]), flush=True)
    refused = sum(r["ended"] == "refused" or bool(r["failures"]) for r in rows)
    degraded = sum(r["ended"] == "degraded" for r in rows)
    close = [r["label_closest"] for r in rows if r["label_closest"] is not None]
    zs = [z for r in rows for z in r["z"][-1:] if isinstance(z, float)]
    gaps = [g for r in rows for g in r["label_gaps"]]
    lost = [r["lost"] for r in rows if r["lost"] is not None]
    print(f"honest runs: {len(rows)}; a guest refused: {refused}; degraded: {degraded}; label checks judged: "
          f"{sum(r['label_judged'] for r in rows)} in {len(close)} runs, closest to its threshold (correlation, "
          f"threshold, prediction): {min(close, key=lambda c: c[0] - c[1]) if close else None}; largest final "
          f"verdict z {max(zs)}; label correlation minus its honest prediction, smallest: {min(gaps)}; largest "
          f"share of the baseline's gain lost at the end: {max(lost)}")
    return rows


def attack(args) -> list[dict]:
    rows = []
    for seed in args.seeds:
        for defence in args.defences:
            c = cfg("digits", defence, seed)
            rows.append({"attack": "honest", "defence": defence, "seed": seed, **run(c, seed)})
            print(json.dumps(rows[-1]), flush=True)
            for start in args.starts:
                for pad in (False, True):
                    cc = c.replace(on_guest_failure="pad") if pad else c
                    r = run(cc, seed, transport=lambda t: PermutingGuest(t, seed=seed, start=start))
                    rows.append({"attack": "permute", "start": start, "defence": defence, "seed": seed,
                                 "on_guest_failure": "pad" if pad else "stop", **r})
                    print(json.dumps(rows[-1]), flush=True)
        for factor in args.factors:
            for hf in (True, False):
                c = cfg("digits", "none", seed, **({} if hf else {"host_features": False}))
                r = run(c, seed, transport=lambda t: ScalingGuest(t, factor))
                rows.append({"attack": "scale", "factor": factor, "defence": "none", "host_features": hf,
                             "seed": seed, **r})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("honest", "attack"))
    p.add_argument("--datasets", nargs="+", default=["digits", "credit", "breast-cancer"])
    p.add_argument("--defences", nargs="+", default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--starts", nargs="+", type=int, default=[10], help="attack: the permutation's first round")
    p.add_argument("--factors", nargs="+", type=float, default=[10.0, 100.0, 1000.0],
                   help="attack: the consistent liar's scale factors")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.defences is None:
        args.defences = list(DEFENCES) if args.mode == "honest" else ["none", "gaussian", "dpsgd"]
    if args.seeds is None:
        args.seeds = [1, 2] if args.mode == "honest" else [1, 2, 3]
    torch.set_num_threads(1)
    logging.getLogger("fl_split").setLevel(logging.ERROR)
    rows = {"honest": honest, "attack": attack}[args.mode](args)
    out = Path(args.out or ROOT / "experiments" / "results" / f"poisoning_detect_{args.mode}.json")
    out.write_text(json.dumps({"command": " ".join(["experiments/poisoning_detect.py", *(argv or sys.argv[1:])]),
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
