"""Denoising of released tensors by their receiver (000/003 §3, spec §3 "Denoising").

Both operate only on *released* (already noisy) data, so they are post-processing and change no
privacy guarantee (003 Thm. 3.6). They are plain tensor operations, so autograd flows through
them: the host's gradient w.r.t. a received activation is the gradient w.r.t. the denoised one
times the operation's derivative (``λ`` for scaling, the mask for masking).

* :class:`Scale` — ``S(x) = λ·x`` with ``λ = 1/α ∈ (0, 1)`` (003 §3.1);
* :class:`Mask` — ``R_p(x) = x ⊙ m``, ``m_ij ~ Bernoulli(p)`` i.i.d., **without** the ``1/p``
  rescaling of dropout (003 §3.2, App. A.4.1).

003's best settings are ``λ`` or ``p`` ≈ 0.1–0.2 at ``σ = 0.7``.
"""

from __future__ import annotations

import math

import torch

from fl_split.errors import ConfigError
from fl_split.privacy.base import PostProcess


def _unit_open(value, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError("denoise-param", value, f"a number in (0, 1) ({what})") from None
    if not (math.isfinite(x) and 0.0 < x < 1.0):
        raise ConfigError("denoise-param", value, f"a number in (0, 1) ({what})")
    return x


class Scale(PostProcess):
    """``S(x) = λ·x``, ``λ ∈ (0, 1)`` (003 §3.1: scaling by ``1/α`` shrinks the noise's share of the
    estimation error). Deterministic; its derivative is ``λ``."""

    name = "scale"
    random = False

    def __init__(self, lam: float) -> None:
        self.lam = _unit_open(lam, "scaling factor lambda")

    def __call__(self, t: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        return t * self.lam

    def describe(self) -> dict:
        return {"name": self.name, "lambda": self.lam}


class Mask(PostProcess):
    """``R_p(x) = x ⊙ m`` with ``m_ij ~ Bernoulli(p)`` i.i.d. (003 §3.2): each element is kept
    with probability ``p`` and zeroed otherwise, **no** ``1/p`` rescaling. The mask is drawn from
    ``gen`` (the receiving party's own generator, on the tensor's device); the derivative is ``m``.
    It is post-processing of released data, so neither its randomness nor its exact keep rate
    (a float32 uniform against ``p``) matters for privacy."""

    name = "mask"
    random = True

    def __init__(self, p: float) -> None:
        self.p = _unit_open(p, "keep probability p")

    def __call__(self, t: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        m = torch.rand(t.shape, generator=gen, device=t.device) < self.p
        return t * m.to(t.dtype)

    def describe(self) -> dict:
        return {"name": self.name, "p": self.p, "rescale": False}


__all__ = ["Mask", "Scale"]
