"""A plug-in defence: gradient sparsification (docs/plugins.md, worked example 1).

Aji & Heafield (2017), "Sparse communication for distributed gradient descent", EMNLP: keep only
the largest-magnitude entries of a gradient and send zeros elsewhere. Fu et al. (2022, USENIX
Security, §7) and VFLAIR (Zou et al. 2024) evaluate it as a defence of the host's labels against
label inference from the partial losses ("GS"), which fl_split does not ship.

Per record, the release keeps the ``ceil((1 - rate) * d)`` entries of largest ``|value|`` of the
record's ``d``-element tensor and zeroes the rest (``--defense-options rate=0.75``; VFLAIR sweeps
rate 0.95-0.99 on wider cut layers). It is deterministic and has **no differential privacy
guarantee** — a record's tensor can change arbitrarily and so can its sparse release — so the
class defines no ``privacy_cost``: a run says "no privacy claimed" for the protected party and
reports no epsilon for it. It has no public bound on its values either (gradients are unbounded),
so ``public_range`` is ``None``: the receiver watches the sender's running scale instead.

    PYTHONPATH=$PWD/examples/plugins fl-split train --dataset credit --defense gradient_sparsification:GradientSparsification \\
        --protect host --defense-options rate=0.75
"""

from __future__ import annotations

import math

import torch

from fl_split.privacy.base import Release
from fl_split.privacy.plugin import MechanismSpec, PluginMechanism


class GradientSparsification(PluginMechanism):
    """Top-k magnitude sparsification of each record's tensor (Aji & Heafield 2017)."""

    name = "gradient-sparsification"
    random = False

    def __init__(self, spec: MechanismSpec) -> None:
        super().__init__(spec)
        self.rate = float(spec.options.get("rate", 0.75))
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"rate={self.rate!r}; allowed: 0 <= rate < 1 (the fraction of entries zeroed)")
        self.keep = max(1, math.ceil((1.0 - self.rate) * spec.width))

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = t.detach().reshape(len(t), -1)
        idx = flat.abs().topk(self.keep, dim=1).indices
        mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, idx, True)
        out = torch.where(mask, flat, torch.zeros_like(flat)).reshape(t.shape)
        ctx = {"mask": mask.reshape(t.shape)} if self.direction == "forward" else {}
        return Release(value=out, ctx=ctx, encoding=self.encoding)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        mask = ctx.get("mask")  # a forward release passes the gradient of the kept entries only
        return grad if mask is None else grad * mask.to(device=grad.device, dtype=grad.dtype)

    def public_range(self):
        return None

    def describe(self) -> dict:
        return {**super().describe(), "rate": self.rate, "kept_per_record": self.keep,
                "reference": "Aji & Heafield 2017 (EMNLP); as a label defence: Fu et al. 2022, VFLAIR"}
