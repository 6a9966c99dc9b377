"""The mechanism interface every boundary crossing goes through (SPEC §3).

A mechanism (a) transforms a tensor with the generator it is given (seeded per party and batch
by the caller), (b) knows its local derivative, so a guest can backpropagate the received
gradient through its own release, and (c) describes its privacy cost. Forward mechanisms run
on a guest's cut-layer output; backward mechanisms run on the host's partial loss ``δ_g``
before it is sent to guest ``g``.

``NoDefense`` is the identity: what :mod:`fl_split.parties` uses when no defence is configured,
and the reason a split run with no defence is the same training as the monolithic model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Release:
    """What a mechanism produced for one batch.

    ``value`` leaves the party. ``ctx`` stays with the sender and is what its local derivative
    needs (e.g. R3eLU's activation mask). ``stats`` are diagnostics (signal-to-noise ratio…).
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
        """Name and parameters, as reported in results."""
        return {"name": self.name}

    def cost(self) -> "PrivacyCost | None":
        """The privacy cost of one release of one record; ``None`` = no privacy claim."""
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
    """Privacy cost of releasing **one record's** cut-layer tensor **once** (SPEC §5 per-record view).

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
