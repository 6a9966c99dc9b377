"""Calibrate every mechanism to the same tightly accounted per-party (ε, δ) — without training (issue 26;
moved here from ``experiments/calibrate.py`` for ``fl-split bench``, issue 28).

A party's reported ε is a function of its configuration: the schedule is public, every training
record is released once per epoch through the same mechanism (the per-record view, no
amplification claimed), so the worst record's ε is the composition of ``epochs`` copies of the
mechanism's cost. :func:`planned_epsilon` builds that cost exactly as a party does
(:func:`fl_split.privacy.factory.forward_mechanism` → ``Mechanism.cost()``; DP-SGD's
:func:`fl_split.privacy.dpsgd.dpsgd_cost` at ``--sigma``), charges it ``releases`` times for one record
to a real :class:`~fl_split.privacy.ledger.Ledger` and reads the ledger's ε (PLD accountant, the
per-element worst-case pair for Laplace / R3eLU). :func:`calibrate` bisects the mechanism's noise
parameter so that this ε is at most the target and within :data:`TOLERANCE` of it:

* ``laplace``, ``r3elu``, ``rr`` — the per-release ``--epsilon`` (ε grows with it);
* ``gaussian`` — ``--sigma`` (ε falls as σ grows);
* ``dpsgd`` — the noise multiplier ``--sigma`` on the guests' own parameters.

The cut width and releases per record come from one short probe run of the real engine
(:func:`probe`, a few records: every record is still released once per epoch), and the trained run's
own ledger reports the ε that is written to the CSV beside the target.
"""

from __future__ import annotations

import math
import numpy as np

from fl_split.config import RunConfig

#: a calibrated ε lies in [target·(1 − TOLERANCE), target] (never above the target)
TOLERANCE = 0.01
MECHANISMS = ("laplace", "gaussian", "rr", "r3elu", "dpsgd")
#: the parameter bisected and whether ε grows with it
PARAMETER = {"laplace": ("epsilon", True), "r3elu": ("epsilon", True), "rr": ("epsilon", True),
             "gaussian": ("sigma", False), "dpsgd": ("sigma", False)}


def parameter_of(defense: str) -> tuple[str, bool]:
    """The parameter calibrated for ``defense`` and whether ε grows with it: :data:`PARAMETER` for the
    built-ins; any other (e.g. a ``package.module:Class`` plug-in) is calibrated on ``--epsilon``."""
    return PARAMETER.get(defense, ("epsilon", True))


def _cost(cfg: RunConfig, width: int):
    from fl_split.privacy import factory

    if cfg.defense == "dpsgd":
        from fl_split.privacy.dpsgd import dpsgd_cost

        return dpsgd_cost(factory.dpsgd_sigma(cfg), cfg.max_grad_norm), "update"
    return factory.forward_mechanism(cfg, width).cost(), "forward"


def planned_epsilon(cfg: RunConfig, width: int, releases: int) -> float | None:
    """The ledger's ε (``cfg.accountant``, ``cfg.delta``) of one record released ``releases`` times
    through ``cfg``'s guest mechanism on a cut of ``width`` elements (``None``: no claim)."""
    from fl_split.privacy.ledger import Ledger, LedgerEntry

    cost, direction = _cost(cfg, width)
    if cost is None:
        return None
    ledger = Ledger("calibrate", accountant=cfg.accountant, delta=cfg.delta)
    ledger.charge([LedgerEntry(e + 1, ("train", e + 1, 0), direction, cost, np.array([0]), 1.0)
                   for e in range(releases)])
    v = ledger.epsilon()
    return None if v is None else float(v)


def probe(base: dict, defense: str = "rr", limit: int = 40) -> dict:
    """Cut width of each guest and releases per record, from one short run of the real engine."""
    from fl_split.engine import LocalEngine
    from fl_split.seeding import PrivateSeed

    cfg = RunConfig(**{**base, "defense": defense, "epsilon": 8.0, "limit": limit, "seed": 0})
    res = LocalEngine(cfg, private_seed=PrivateSeed.legacy(0)).run()
    out = {}
    for party, rep in res["privacy"].items():
        if party.startswith("guest") and isinstance(rep, dict):
            mech = rep["mechanism"]
            out[party] = {"width": int(mech.get("cut_width", mech.get("width"))),
                          "releases": int(rep["releases_per_record"])}
    return out


def epsilon_of(base: dict, defense: str, value: float, parties: dict) -> float | None:
    """The largest planned ε over the guests of ``base`` with ``defense``'s parameter at ``value``
    (``None``: the mechanism claims no privacy, e.g. a plug-in without ``privacy_cost``)."""
    name, _ = parameter_of(defense)
    cfg = RunConfig(**{**base, "defense": defense, name: value})
    eps = [e for p in parties.values() if (e := planned_epsilon(cfg, p["width"], p["releases"])) is not None]
    return max(eps) if eps else None


def claims_privacy(base: dict, defense: str, parties: dict) -> bool:
    """Whether ``defense`` has a DP event to account (a plug-in without one cannot be calibrated to
    any ε: ``fl-split bench`` runs it once, at its own options, as "no privacy claimed")."""
    name, _ = parameter_of(defense)
    value = RunConfig(**{**base, "defense": defense}).to_dict().get(name.replace("-", "_"))
    return epsilon_of(base, defense, value if value is not None else 1.0, parties) is not None


def calibrate(base: dict, defense: str, target: float, parties: dict, iters: int = 60) -> dict:
    """Bisect ``defense``'s noise parameter (in log space) so that every guest's planned ε is ≤
    ``target`` and the largest within :data:`TOLERANCE` of it. Returns the config changes, the
    planned ε and whether the tolerance was met (a mechanism whose ε is a step function of its
    parameter, or whose range ends below the target, may not meet it: then ``ok`` is False)."""
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise ValueError(f"target ε {target!r}; allowed: a finite number > 0")
    name, increasing = parameter_of(defense)
    f = lambda v: epsilon_of(base, defense, v, parties)  # noqa: E731
    releases = max(p["releases"] for p in parties.values())
    # start where basic composition puts it (per-release ε = target / releases; σ = 1) and step by 2
    # until the target is bracketed: extreme parameters make the PLD slow and are never needed
    x = target / releases if increasing else 1.0
    ex = f(x)
    if ex is None:
        raise ValueError(f"{defense}: claims no privacy (no DP event), so it cannot be calibrated to ε {target}")
    safer = (lambda v: v / 2) if increasing else (lambda v: v * 2)  # noqa: E731
    riskier = (lambda v: v * 2) if increasing else (lambda v: v / 2)  # noqa: E731
    for _ in range(40):
        if ex <= target:
            break
        x = safer(x)
        ex = f(x)
    else:
        raise ValueError(f"{defense}: target ε {target} below the planned ε at {name} = {x:g}")
    safe, best, best_eps = x, x, ex
    unsafe = None
    for _ in range(40):
        y = riskier(safe)
        ey = f(y)
        if ey > target:
            unsafe = y
            break
        safe, best, best_eps = y, y, ey
    if unsafe is not None:
        for _ in range(iters):
            if best_eps >= target * (1 - TOLERANCE / 4) or abs(math.log(unsafe / safe)) < 1e-9:
                break
            mid = math.sqrt(safe * unsafe)
            e = f(mid)
            if e <= target:
                safe, best, best_eps = mid, mid, e
            else:
                unsafe = mid
    changes = {"defense": defense, name: float(best)}
    return {"changes": changes, "planned_epsilon": best_eps,
            "ok": target * (1 - TOLERANCE) <= best_eps <= target}


def reported_ok(reported: float | None, target: float) -> bool:
    """Whether a party's reported ε meets the target within :data:`TOLERANCE` (never above it)."""
    return reported is not None and target * (1 - TOLERANCE) <= reported <= target * (1 + 1e-9)


__all__ = ["TOLERANCE", "MECHANISMS", "PARAMETER", "parameter_of", "planned_epsilon", "probe", "epsilon_of", "calibrate",
           "reported_ok"]
