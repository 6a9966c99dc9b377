"""The host's merge layer (001 §2.2, Table 1): ``concat``, ``sum``, ``avg``, ``max``, ``min``, ``mul``.

Inputs are the parties' cut-layer outputs in merge order (host first if it has features, then
guest-1 … guest-G). Gradients are PyTorch's:

* ``concat`` along the **last axis** (features of a vector; width of an image feature map, the
  axis the image was striped along), gradient = the matching slice;
* ``sum``: each input gets the upstream gradient; ``avg``: upstream / n;
* ``mul``: upstream × the product of the other inputs;
* ``max`` / ``min``: upstream goes to the input holding the extreme value; on exact ties it is
  split evenly among the tied inputs (``torch.amax``/``amin`` semantics).

Element-wise ops need equal shapes; :func:`merged_shape` raises a :class:`ConfigError` that
names every party's width otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fl_split.config import MERGE_OPS
from fl_split.errors import ConfigError

ELEMENTWISE = ("sum", "avg", "max", "min", "mul")


def merged_shape(op: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape (without batch) of ``merge(op)`` applied to parties' outputs of ``shapes``."""
    if op not in MERGE_OPS:
        raise ConfigError("merge", op, "one of " + ", ".join(MERGE_OPS))
    items = list(shapes.items())
    if not items:
        raise ConfigError("merge", op, "at least one party with a bottom model")
    if op == "concat":
        first = items[0][1]
        for party, s in items[1:]:
            if len(s) != len(first) or s[:-1] != first[:-1]:
                raise ConfigError("merge", op, "outputs that differ at most in their last axis",
                                  reason="cut-layer shapes " + ", ".join(f"{p}={tuple(v)}" for p, v in items))
        return (*first[:-1], sum(s[-1] for _, s in items))
    first = items[0][1]
    if any(s != first for _, s in items[1:]):
        widths = ", ".join(f"{p}={'x'.join(map(str, s))}" for p, s in items)
        raise ConfigError("merge", op, "'concat', or parties with equal cut-layer widths "
                          "(use --padding or a model whose bottoms share a width)",
                          reason=f"element-wise merge of unequal widths: {widths}")
    return tuple(first)


def merge_tensors(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Apply merge ``op`` to a sequence of same-batch tensors (autograd-friendly)."""
    if len(tensors) == 1:
        return tensors[0]
    if op == "concat":
        return torch.cat(list(tensors), dim=-1)
    if op == "sum":
        out = tensors[0]
        for t in tensors[1:]:
            out = out + t
        return out
    if op == "avg":
        out = tensors[0]
        for t in tensors[1:]:
            out = out + t
        return out / len(tensors)
    if op == "mul":
        out = tensors[0]
        for t in tensors[1:]:
            out = out * t
        return out
    if op == "max":
        return torch.stack(list(tensors), dim=0).amax(dim=0)
    if op == "min":
        return torch.stack(list(tensors), dim=0).amin(dim=0)
    raise ConfigError("merge", op, "one of " + ", ".join(MERGE_OPS))


class Merge(nn.Module):
    """``nn.Module`` wrapper of :func:`merge_tensors` (parameter-free)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        if op not in MERGE_OPS:
            raise ConfigError("merge", op, "one of " + ", ".join(MERGE_OPS))
        self.op = op

    def forward(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:  # noqa: D102
        return merge_tensors(self.op, tensors)

    def extra_repr(self) -> str:
        return f"op={self.op!r}"
