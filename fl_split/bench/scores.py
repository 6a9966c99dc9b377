"""Scores of ``fl-split bench``: an attack's normalised advantage and VFLAIR's Defense Capability Score.

* :func:`advantage` — an attack's success over its trivial baseline in [0, 1] (0 = the baseline,
  1 = perfect), the AP of every bench row (moved here from ``experiments/common.py``).
* :func:`dcs` — VFLAIR's DCS (Zou et al. 2023, "VFLAIR: A Research Library and Benchmark for
  Vertical Federated Learning", arXiv:2310.09827, §4 and ``src/metrics/Metrics & Benchmark.md``;
  the computation is ``cal_dcs`` in ``src/metrics/data_process.py`` of github.com/FLAIR-THU/VFLAIR):
  ``DCS = 1 / (1 + √((1 − β)·max(AP − AP*, 0)² + β·max(MP* − MP, 0)²))`` with β = 0.5, the ideal
  defence AP* = 0 and MP* = the undefended run's main-task performance; AP and MP are averaged over
  the repeats *before* the score (``get_avg`` there). Distances are one-sided as in their code: a
  defence is not penalised for beating the undefended accuracy or for an attack below AP*.
* :func:`t_dcs` / :func:`c_dcs` — VFLAIR's type-level score (the mean DCS over the attacks of one
  type) and comprehensive score (the mean of the T-DCS, equal weights :math:`w_j`).

One difference from VFLAIR, stated wherever the numbers are shown: VFLAIR's AP is the attack's raw
metric (label accuracy, 1 − MSE for GRN), ours is :func:`advantage`, so AP* = 0 means "no better
than the trivial baseline" for every attack alike (a raw label accuracy of 0.5 on two classes is
not a leak).
"""

from __future__ import annotations

import math
from typing import Iterable

#: VFLAIR's weight of the main-task distance
BETA = 0.5
#: VFLAIR's attack types (its T-DCS groups) for the built-in attacks; a plug-in attack is its own type
ATTACK_TYPES = {
    "label-norm": "label inference", "label-direction": "label inference", "label-completion": "label inference",
    "reconstruction": "feature reconstruction", "feature": "feature reconstruction",
    "inversion": "feature reconstruction", "fsha": "feature reconstruction",
    "property": "property inference", "membership": "membership inference",
}


def attack_type(name: str) -> str:
    return ATTACK_TYPES.get(name, name)


def advantage(r: dict, perfect: float | None = None) -> float:
    """An attack's success as a normalised advantage over its trivial baseline, in [0, 1]:
    0 = no better than the baseline, 1 = perfect. Higher-is-better metrics (accuracy, AUC, F1,
    SSIM): ``(value − baseline)/(perfect − baseline)`` with ``perfect`` = 1; lower-is-better (MSE):
    ``(baseline − value)/baseline``. Clipped at 0 (an attack worse than its baseline has learnt
    nothing the baseline does not know)."""
    v, b = float(r["value"]), float(r["baseline"])
    if r.get("better", "higher") == "lower":
        return max(0.0, (b - v) / b) if b > 0 else 0.0
    top = 1.0 if perfect is None else perfect
    return max(0.0, min(1.0, (v - b) / (top - b))) if top > b else 0.0


def dcs(ap: float, mp: float, mp_star: float, ap_star: float = 0.0, beta: float = BETA) -> float:
    """VFLAIR's Defense Capability Score of a defence at (AP, MP) against the ideal (AP*, MP*)."""
    d_ap = max(ap - ap_star, 0.0)
    d_mp = max(mp_star - mp, 0.0)
    return 1.0 / (1.0 + math.sqrt((1 - beta) * d_ap ** 2 + beta * d_mp ** 2))


def t_dcs(scores: dict[str, float]) -> dict[str, float]:
    """``{attack: DCS}`` -> ``{attack type: T-DCS}`` (the mean DCS of the type's attacks)."""
    by: dict[str, list[float]] = {}
    for name, v in scores.items():
        by.setdefault(attack_type(name), []).append(v)
    return {k: sum(v) / len(v) for k, v in by.items()}


def c_dcs(t: dict[str, float] | Iterable[float]) -> float | None:
    """The mean of the T-DCS (VFLAIR's C-DCS with equal weights); ``None`` without attacks."""
    vals = list(t.values()) if isinstance(t, dict) else list(t)
    return sum(vals) / len(vals) if vals else None


__all__ = ["BETA", "ATTACK_TYPES", "attack_type", "advantage", "dcs", "t_dcs", "c_dcs"]
