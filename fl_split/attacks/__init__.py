"""Attacks on split learning, each mounted by the party that would mount it (spec §4, issue 9).

* :mod:`~fl_split.attacks.view` — the adversary's view (its own party object, its decoded inbox and
  outbox, public facts, granted auxiliary data) and the observed training :class:`Session`;
* one module per attack: :mod:`~fl_split.attacks.property` (001 Eq. 1, both directions),
  :mod:`~fl_split.attacks.reconstruction` (learned inversion decoder), :mod:`~fl_split.attacks.fsha`
  (Pasquini et al. 2021, a malicious host), :mod:`~fl_split.attacks.inversion` (He et al. 2019,
  white-box), :mod:`~fl_split.attacks.feature` (Luo et al. 2021, GRN),
  :mod:`~fl_split.attacks.membership` (shadow models), :mod:`~fl_split.attacks.label` (Li et al.
  2022 norm / direction scoring, Fu et al. 2022 model completion);
* :mod:`~fl_split.attacks.metrics` — SSIM, PSNR, MSE, AUC, F1;
* :func:`run_attack` / :func:`make_session` (:mod:`~fl_split.attacks.runner`) — what ``fl-split
  attack`` runs, reusable from scripts.

``docs/attacks.md`` describes each attack's threat model, algorithm, metric and baseline.
"""

from __future__ import annotations

__all__ = ["ATTACK_NAMES", "AttackOptions", "get_attack", "make_session", "run_attack"]


def __getattr__(name: str):  # lazy: importing the package (e.g. for the CLI parser) loads no torch
    if name in ("ATTACK_NAMES", "AttackOptions"):
        from fl_split.attacks import options

        return getattr(options, name)
    if name in ("get_attack", "make_session", "run_attack"):
        from fl_split.attacks import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'fl_split.attacks' has no attribute {name!r}")
