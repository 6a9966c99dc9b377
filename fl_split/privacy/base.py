"""The mechanism interface every boundary crossing goes through (spec §3).

A mechanism (a) transforms a tensor with the generator it is given (the releasing party's secret
stream: privacy principles, docs/references.md), (b) knows its local derivative, so a guest can
backpropagate the received gradient through its own release, and (c) describes its privacy
cost. Forward mechanisms run on a guest's cut-layer output; backward mechanisms run on the
host's partial loss ``δ_g`` before it is sent to guest ``g``.

**Diagnostics that do not leak** (privacy principle 2). Two kinds, never mixed:

* ``Release.stats`` — computed from the *private* input of one release (its signal-to-noise
  ratio, the fraction of activated elements…). They belong to the releasing party's local log
  and must never be put in a message, a reply to the coordinator or a report;
* :meth:`Mechanism.public_diagnostics` and :meth:`Mechanism.describe` — functions of the
  mechanism's *public parameters* only (ε, clip bound, width, σ…), identical for every input,
  safe to report. In particular nothing derived from data-dependent state (R3eLU's importances)
  appears there.

``NoDefense`` is the identity: what :mod:`fl_split.parties` uses when no defence is configured,
and the reason a split run with no defence is the same training as the monolithic model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fl_split.privacy.bounds import PublicRange


@dataclass
class Release:
    """What a mechanism produced for one batch.

    ``value`` leaves the party. ``ctx`` stays with the sender and is what its local derivative
    needs (e.g. R3eLU's activation mask). ``stats`` are **private** diagnostics of this release,
    computed from the input: they stay with the releasing party (its local log, see
    :mod:`fl_split.privacy.diagnostics`). Every perturbing mechanism reports ``snr`` = RMS of the
    signal (the bounded input the noise is added to) over the standard deviation of the noise,
    per element; the per-record SNR of a ``d``-element release is ``snr·√d``.
    """

    value: torch.Tensor
    ctx: dict[str, torch.Tensor] = field(default_factory=dict)
    encoding: str = "float32"
    stats: dict[str, float] = field(default_factory=dict)


class Mechanism:
    """Base class; the default behaviour is the identity (no defence)."""

    name = "none"
    #: draws random numbers (the caller then passes a seeded generator)
    random = False
    #: wire encoding of released values ("bits" for randomized response)
    encoding = "float32"

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        """Transform ``t`` (detached) into the released tensor."""
        return Release(value=t.detach(), encoding=self.encoding)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        """Map a gradient w.r.t. the released tensor to one w.r.t. the mechanism's input."""
        return grad

    def describe(self) -> dict:
        """Name and parameters, as reported in results: public, parameter-derived values only."""
        return {"name": self.name}

    def public_diagnostics(self) -> dict:
        """Diagnostics computable from public parameters alone (safe to report): ``noise_scale``
        (the parameter-derived scale: Laplace ``b``, Gaussian ``σ``…), ``noise_sd`` (its standard
        deviation per element) and ``snr_bound``, the largest RMS signal per element the mechanism
        admits over ``noise_sd`` (an upper bound on every release's private ``stats["snr"]``).
        Empty when nothing is perturbed."""
        return {}

    def public_range(self) -> "PublicRange | None":
        """What every honest release satisfies, from public parameters only (issue 16,
        :mod:`fl_split.privacy.bounds`): the receiver checks each release against it before using
        it. ``None`` (the identity: no defence) means no public bound; the receiver then watches
        the peer's running scale instead."""
        return None

    def cost(self) -> "PrivacyCost | None":
        """The privacy cost of one release of one record; ``None`` = no privacy claim.

        Computed once (:meth:`privacy_cost`) and then returned as the same object: a mechanism's
        parameters are fixed at construction, and parties charge it on every release (the
        ledger recognises a cost it has seen by identity, without re-serialising it)."""
        if "_cost" not in self.__dict__:
            self._cost = self.privacy_cost()
        return self._cost

    def privacy_cost(self) -> "PrivacyCost | None":
        """Build the cost of :meth:`cost` (subclasses override this one)."""
        return None


class NoDefense(Mechanism):
    """Identity release: nothing is perturbed and no privacy is claimed."""


class PostProcess:
    """Receiver-side post-processing of a *released* tensor (denoising, 003 §3).

    It touches only released data, so it changes no privacy guarantee. It is differentiable:
    the host's gradient w.r.t. a received activation flows through it. Identity by default.
    """

    name = "none"
    random = False

    def __call__(self, t: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        return t

    def describe(self) -> dict:
        return {"name": self.name}


@dataclass(frozen=True)
class PrivacyCost:
    """Privacy cost of releasing **one record's** cut-layer tensor **once** (spec §5 per-record view).

    ``dp_event`` is a ``dp_accounting.DpEvent`` describing that single release (input to the
    tight PLD/RDP accountants); ``epsilon`` is its pure-DP epsilon when the mechanism is
    epsilon-DP (Laplace, randomized response, R3eLU), ``None`` when it is only (epsilon, delta)-DP
    (Gaussian). Sensitivities are those the noise was calibrated to. ``params`` are hashable
    ``(name, value)`` pairs for reports.
    """

    mechanism: str
    dp_event: object
    epsilon: float | None
    sensitivity_l1: float | None = None
    sensitivity_l2: float | None = None
    params: tuple[tuple[str, object], ...] = ()


class ReleaseStats:
    """Per-epoch aggregates of the diagnostics (``Release.stats``) of a party's releases.

    spec §3 asks that users see what a budget costs: every release reports its signal-to-noise
    ratio (``snr``: RMS of the signal over the noise's standard deviation, per element, see
    :class:`Release`) and its noise scale. These are private (computed from the party's values):
    a ``ReleaseStats`` belongs in the party's own state and log, not in a report. Keeping every value would grow with the run, so each epoch keeps
    ``[sum, min, max, count]`` per statistic; :meth:`report` gives mean/min/max overall and per
    epoch. Plain numbers only, so it travels in a party's exported state.
    """

    def __init__(self) -> None:
        self._by_epoch: dict[int, dict[str, list[float]]] = {}

    def add(self, epoch: int, stats: dict[str, float]) -> None:
        if not stats:
            return
        agg = self._by_epoch.setdefault(int(epoch), {})
        for name, value in stats.items():
            v = float(value)
            a = agg.get(name)
            if a is None:
                agg[name] = [v, v, v, 1.0]
            else:
                a[0] += v
                a[1] = min(a[1], v)
                a[2] = max(a[2], v)
                a[3] += 1.0

    def report(self) -> dict:
        """``{"overall": {stat: {mean, min, max}}, "per_epoch": [{"epoch", stat_mean…}], "releases"}``
        (releases = batches released with diagnostics); empty when nothing was perturbed."""
        if not self._by_epoch:
            return {}
        total: dict[str, list[float]] = {}
        per_epoch = []
        for epoch in sorted(self._by_epoch):
            row: dict[str, float] = {"epoch": epoch}
            for name, (s, lo, hi, n) in sorted(self._by_epoch[epoch].items()):
                row[f"{name}_mean"] = s / n
                t = total.setdefault(name, [0.0, lo, hi, 0.0])
                t[0] += s
                t[1], t[2], t[3] = min(t[1], lo), max(t[2], hi), t[3] + n
            per_epoch.append(row)
        overall = {name: {"mean": s / n, "min": lo, "max": hi} for name, (s, lo, hi, n) in total.items()}
        releases = int(max(t[3] for t in total.values()))
        return {"overall": overall, "per_epoch": per_epoch, "releases": releases}

    def state_dict(self) -> dict:
        return {int(e): {k: list(v) for k, v in agg.items()} for e, agg in self._by_epoch.items()}

    def load_state_dict(self, state: dict) -> None:
        self._by_epoch = {int(e): {str(k): [float(x) for x in v] for k, v in agg.items()}
                          for e, agg in (state or {}).items()}


def mean_snr(privacy_entry: dict) -> float | None:
    """The mean signal-to-noise ratio of a party's releases, from its ``privacy`` results entry
    (``release_stats``); ``None`` when nothing it released was perturbed."""
    return (privacy_entry.get("release_stats") or {}).get("overall", {}).get("snr", {}).get("mean")
