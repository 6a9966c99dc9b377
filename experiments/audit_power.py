"""Detection power of the empirical audit (issue 26, item 3; docs/accounting.md, "Detection power").

For each mechanism and width: audit the correctly accounted mechanism once (``trials`` per record,
the exact likelihood-ratio statistic of the worst-case pair, Clopper–Pearson at 95 %) and find the
smallest mis-accounting factor ``f`` the audit flags: the smallest ``f`` whose claim — the
mechanism's own tight event at ``f``× its noise (``fl-split audit --mis-account f``,
:class:`fl_split.privacy.audit.MisAccounted`) — falls below the empirical lower bound. The release
and the test do not depend on ``f`` (only the claim does), so one audit per row gives the whole
answer: ``f`` is found by bisection on the claim. Rows whose bound never reaches a claim up to
``f = 64`` print "not flagged".

Sampling limit: ``max_certifiable_epsilon`` in the JSON (below).

    python experiments/audit_power.py           # ~5 min on the busy 2-core machine
    python experiments/audit_power.py --quick   # 10x fewer trials
    python experiments/audit_power.py --detection 20   # issue 37: Laplace ε = 1, width 64, 2x mis-accounted,
                                                       # 20 fresh seeds at the CLI's default trials (~3 min)

The sampling limit printed beside each row is :func:`fl_split.privacy.audit.max_certifiable_epsilon`
(the most any outcome of the counted trials can certify; ≈ ln(n/3.7) at 95 %).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from fl_split.config import RunConfig
from fl_split.privacy import audit
from fl_split.privacy.audit import MisAccounted, claimed_epsilons
from fl_split.seeding import PartySecret, PrivateSeed

OUT = Path(__file__).resolve().parent / "results" / "audit" / "power.json"
DELTA, ALPHA = 1e-5, 0.05

#: (label, RunConfig keywords, direction, width); DP-SGD rows have width None
ROWS = [
    ("laplace eps 1", dict(defense="laplace", epsilon=1.0), "forward", 2),
    ("laplace eps 1", dict(defense="laplace", epsilon=1.0), "forward", 8),
    ("laplace eps 1", dict(defense="laplace", epsilon=1.0), "forward", 64),
    ("laplace eps 4", dict(defense="laplace", epsilon=4.0), "forward", 64),
    ("laplace eps 4 backward", dict(defense="laplace", epsilon=4.0, protect="host"), "backward", 64),
    ("gaussian sigma 16", dict(defense="gaussian", sigma=16.0), "forward", 64),
    ("gaussian sigma 20 backward", dict(defense="gaussian", sigma=20.0, protect="host"), "backward", 64),
    ("rr eps 4", dict(defense="rr", epsilon=4.0), "forward", 64),
    ("r3elu eps 4 K=2", dict(defense="r3elu", epsilon=4.0), "forward", 64),  # --top-k auto: 64/32
    ("r3elu eps 4 K=2 backward", dict(defense="r3elu", epsilon=4.0, protect="host"), "backward", 64),
    ("r3elu eps 4 K=32", dict(defense="r3elu", epsilon=4.0, top_k="half"), "forward", 64),
    ("dpsgd sigma 1", dict(defense="dpsgd", sigma=1.0), "update", None),
    ("dpsgd sigma 4", dict(defense="dpsgd", sigma=4.0), "update", None),
]


def claim_at(factor: float, cfg, direction: str, width: int | None) -> float:
    """The pld claim of one release accounted at ``factor``× the noise."""
    if direction == "update":
        from fl_split.privacy.dpsgd import dpsgd_cost
        from fl_split.privacy.events import noisier_event
        from fl_split.privacy.base import PrivacyCost

        cost = dpsgd_cost(cfg.sigma, cfg.max_grad_norm)
        if factor > 1:
            cost = PrivacyCost(cost.mechanism, noisier_event(cost.dp_event, factor), None)
        return claimed_epsilons([cost], DELTA, "update")["pld"]
    mech, = audit.mechanisms_for(cfg, width, 1, direction)
    cost = (MisAccounted(mech, factor) if factor > 1 else mech).cost()
    return claimed_epsilons([cost], DELTA, direction)["pld"]


def smallest_flagged(lower: float, cfg, direction: str, width: int | None, hi: float = 64.0) -> float | None:
    """The smallest factor in (1, hi] whose claim is below ``lower`` (bisection to 1 %), else None."""
    if claim_at(1.0, cfg, direction, width) < lower:
        return 1.0  # the correct claim itself is violated (a bug)
    if claim_at(hi, cfg, direction, width) >= lower:
        return None
    lo = 1.0
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        if claim_at(mid, cfg, direction, width) < lower:
            hi = mid
        else:
            lo = mid
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100000, help="trials per record, boundary mechanisms")
    ap.add_argument("--dpsgd-trials", type=int, default=40000, help="trials per record, DP-SGD")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--detection", type=int, metavar="SEEDS", default=0,
                    help="instead: the detection probability at the default ε (Laplace ε = 1, width 64, 2x "
                         "mis-accounted, --trials per record) over SEEDS fresh seeds")
    args = ap.parse_args()
    if args.detection:
        return detection(args.detection, 200000 if args.trials == 100000 else args.trials,
                         args.out.with_name("detection_default_eps.json") if args.out == OUT else args.out)
    div = 10 if args.quick else 1
    secret = PartySecret.from_private_seed(PrivateSeed.legacy(20261126), "audit-power")
    rows = []
    for label, kw, direction, width in ROWS:
        cfg = RunConfig(**kw)
        t0 = time.perf_counter()
        if direction == "update":
            n = args.dpsgd_trials // div
            res = audit.audit_dpsgd(cfg.sigma, cfg.max_grad_norm, n, secret, delta=DELTA, alpha=ALPHA, label=label)
        else:
            n = args.trials // div
            mechs = audit.mechanisms_for(cfg, width, 1, direction)
            res = audit.audit_mechanism(mechs, n, secret, delta=DELTA, alpha=ALPHA, label=f"{label}/{width}",
                                        direction=direction)
        claim = res.claimed["pld"]
        params = res.describe
        f = smallest_flagged(res.lower, cfg, direction, width)
        counted = res.trials
        row = {"mechanism": label, "direction": direction, "width": width, "trials_per_record": n,
               "claimed_pld": claim, "empirical_lower": res.lower, "ratio": res.lower / claim if claim else None,
               "noise_multiplier": params.get("noise_multiplier"), "k": params.get("k"),
               "smallest_flagged_factor": f,
               "max_certifiable_epsilon": audit.max_certifiable_epsilon(counted, DELTA, ALPHA),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"{label:36s} w={str(width):4s} claim {claim:7.3f}  lower {res.lower:6.3f}  "
              f"flags factor >= {'-' if f is None else f'{f:.2f}'}  (limit {row['max_certifiable_epsilon']:.1f}, "
              f"{row['seconds']} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"delta": DELTA, "confidence": 1 - ALPHA, "seed": "legacy 20261126",
                                    "statistic": "exact log-likelihood ratio of the worst-case pair",
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


def detection(seeds: int, trials: int, out: Path) -> None:
    """Audit Laplace ε = 1, width 64, one release, with ``seeds`` fresh private seeds (``legacy(s)``,
    s = 0 … seeds−1): how often the 2x mis-accounted claim is flagged and the correct one is (the
    releases and the bound do not depend on the claim, so one audit answers both)."""
    cfg = RunConfig(defense="laplace", epsilon=1.0)
    rows = []
    for s in range(seeds):
        t0 = time.perf_counter()
        mechs = audit.mechanisms_for(cfg, 64, 1, "forward", mis_account=2.0)
        secret = PartySecret.from_private_seed(PrivateSeed.legacy(s), "audit-detection")
        res = audit.audit_mechanism(mechs, trials, secret, delta=DELTA, alpha=ALPHA, label="laplace/forward/1")
        correct = claimed_epsilons([m.inner.cost() for m in mechs], DELTA)["pld"]
        rows.append({"seed": s, "lower": res.lower, "mis_claim": res.claimed["pld"], "correct_claim": correct,
                     "flagged_mis": res.lower > res.claimed["pld"], "flagged_correct": res.lower > correct,
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"seed {s:2d}: lower {res.lower:.3f}  mis-accounted claim {res.claimed['pld']:.3f} "
              f"{'FLAGGED' if rows[-1]['flagged_mis'] else 'missed'}  correct {correct:.3f} "
              f"{'FALSE ALARM' if rows[-1]['flagged_correct'] else 'ok'}  ({rows[-1]['seconds']} s)", flush=True)
    hit = sum(r["flagged_mis"] for r in rows)
    doc = {"mechanism": "laplace eps 1, width 64, 1 release, 2x mis-accounted", "trials_per_record": trials,
           "counted": trials - audit.calibration_size(trials), "delta": DELTA, "confidence": 1 - ALPHA,
           "test": "paired exact binomial (docs/accounting.md, 'Empirical audit')", "seeds": seeds,
           "flagged": hit, "false_alarms": sum(r["flagged_correct"] for r in rows), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"flagged {hit} of {seeds}; false alarms {doc['false_alarms']}; wrote {out}")


if __name__ == "__main__":
    main()
