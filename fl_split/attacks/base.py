"""What every attack provides, and the two halves of an attack run.

An :class:`Attack` is used in two halves that never meet:

* :meth:`Attack.run` — the adversary's half: a function of an
  :class:`~fl_split.attacks.view.AdversaryView` and the options, returning a :class:`Guess`
  (what the adversary believes about the victim's records, plus what a *trivial* adversary with
  the same auxiliary knowledge would guess: the baseline);
* :meth:`Attack.score` — the evaluator's half: compares a guess with the ground truth
  (:class:`~fl_split.attacks.truth.Referee`) and returns a :class:`Scored` (metric value,
  baseline value, details).

The runner (:mod:`fl_split.attacks.runner`) builds the view, calls ``run``, then ``score``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.attacks.options import AUTO, AttackOptions
from fl_split.errors import ConfigError

if TYPE_CHECKING:
    from fl_split.attacks.truth import Referee
    from fl_split.attacks.view import AdversaryView, Grant


@dataclass
class Guess:
    """The adversary's output: ``values[i]`` is its guess about the record at shared position
    ``positions[i]`` of ``phase`` (a string, or one phase per row). ``baseline`` is the trivial
    adversary's guess in the same form (``None`` when the baseline is analytic)."""

    phase: Any
    positions: np.ndarray
    values: Any
    baseline: Any = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scored:
    """The evaluator's verdict: ``value`` of the metric and of the baseline (``metric`` and
    ``baseline_name`` override the attack's when they depend on the data, e.g. SSIM for images)."""

    value: float
    baseline: float
    details: dict[str, Any] = field(default_factory=dict)
    metric: str = ""
    baseline_name: str = ""


class Attack:
    """One attack (see the module docstring). Class attributes describe it for reports."""

    name = ""
    title = ""
    #: the paper (and equation) it implements
    reference = ""
    #: parties that can mount it ("host", "guest")
    adversaries: tuple[str, ...] = ("host",)
    metric = ""
    #: "higher" or "lower" is better for the attacker
    better = "higher"
    baseline_name = ""
    #: needs the public split (Session(..., public=True))
    public = False
    #: replaces the honest host during training (Session.hijack_host)
    malicious = False
    #: defaults of the generic options, per attack
    defaults: dict[str, Any] = {}

    def option(self, opts: AttackOptions, name: str) -> Any:
        value = getattr(opts, name)
        return self.defaults.get(name, value) if value == AUTO else value

    def adversary(self, opts: AttackOptions) -> str:
        """The role that mounts it (``--adversary``; ``auto`` = the first of :attr:`adversaries`)."""
        role = self.adversaries[0] if opts.adversary == AUTO else opts.adversary
        if role not in self.adversaries:
            raise ConfigError("adversary", opts.adversary, " or ".join(("auto", *self.adversaries)),
                              reason=f"{self.name} is mounted by the {' or '.join(self.adversaries)}")
        return role

    def parties(self, opts: AttackOptions) -> tuple[str, str]:
        """``(adversary party, victim party)``."""
        return ("host", opts.guest) if self.adversary(opts) == "host" else (opts.guest, "host")

    def check(self, referee: "Referee", plan, opts: AttackOptions) -> None:
        """Refuse options that cannot work on this run (:class:`ConfigError` naming the flag)."""

    def grants(self, referee: "Referee", opts: AttackOptions) -> list["Grant"]:
        return []

    def run(self, view: "AdversaryView", opts: AttackOptions) -> Guess:  # pragma: no cover - abstract
        raise NotImplementedError

    def score(self, guess: Guess, referee: "Referee", opts: AttackOptions) -> Scored:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"attack": self.name, "title": self.title, "reference": self.reference, "metric": self.metric,
                "better": self.better, "baseline": self.baseline_name}


def observed_epoch(opts: AttackOptions, attack: Attack) -> Any:
    """``--attack-epoch`` resolved for ``attack`` (``auto`` → its default, else ``last``)."""
    e = opts.attack_epoch
    return attack.defaults.get("attack_epoch", "last") if e == AUTO else e


def observed(view: "AdversaryView", kind: str, peer: str, epoch: Any, phase: str = "train"):
    """Per-record observations of one epoch, or of every epoch stacked and flattened (``"all"``):
    ``Records`` whose ``values`` are ``(n, features)``."""
    from fl_split.attacks.view import Records

    if epoch == "all":
        r = view.records_over_epochs(kind, phase, "all", peer=peer)
    else:
        r = view.records(kind, phase, epoch, peer=peer)
    return Records(r.phase, r.positions, r.ids, r.values.reshape(len(r), -1))
