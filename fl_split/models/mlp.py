"""Multi-layer perceptrons: the generic ``mlp`` and the MLPs of paper 001 Table 10.

Layer ``i`` (1-based) of an MLP with hidden widths ``h_1 … h_L`` is
``Linear(h_{i-1}, h_i) [+ norm] + ReLU`` for ``i ≤ L`` and ``Linear(h_L, outputs)`` for
``i = L + 1`` (logits; softmax lives in the loss). Image inputs are flattened first.

``cut_activation`` (guests only) changes how the last bottom layer ends: ``native`` as above,
``none`` a bare ``Linear`` (001 Table 10's guest, whose activation is R3eLU), ``relu`` / ``tanh``
that activation after the layer (and its BatchNorm, if any).
"""

from __future__ import annotations

import math

from torch import nn

from fl_split.errors import ConfigError
from fl_split.models.registry import NORMS, Architecture, norm_layer, register


class MLP(Architecture):
    inputs = "vector"

    def __init__(self, name: str, hidden: tuple[int, ...], norm: str = "none", default_cut: int = 1,
                 description: str = "", configurable: bool = False) -> None:
        self.name = name
        self.hidden = tuple(int(h) for h in hidden)
        if norm not in NORMS[1:]:
            raise ValueError(f"MLP norm {norm!r} not in {NORMS[1:]}")
        self.norm = norm
        self.default_cut = default_cut
        self.description = description
        self.configurable = configurable

    def configure(self, hidden: tuple[int, ...] | None = None, norm: str = "auto") -> "MLP":
        """A copy with other hidden widths (only the generic ``mlp``) or normalisation (any MLP:
        001's MNIST MLP runs under a defence with ``--norm group`` or ``layer``)."""
        if hidden is not None and not self.configurable:
            raise ConfigError("hidden", ",".join(map(str, hidden)), f"'auto' for model '{self.name}' "
                              "(only model 'mlp' takes --hidden)")
        if hidden is None and norm in ("auto", self.norm):
            return self
        hidden = hidden if hidden is not None else self.hidden
        return MLP(self.name, hidden, self.norm if norm == "auto" else norm,
                   min(self.default_cut, len(hidden)), self.description, configurable=self.configurable)

    def num_layers(self) -> int:
        return len(self.hidden) + 1

    def _layer(self, i: int, width_in: int, num_outputs: int | None, activation: str = "native") -> list[nn.Module]:
        """Modules of layer ``i`` (1-based)."""
        last = i == len(self.hidden) + 1
        width_out = num_outputs if last else self.hidden[i - 1]
        mods: list[nn.Module] = [nn.Linear(width_in, width_out)]
        if last:
            return mods
        if activation == "none":
            return mods
        if self.norm != "none":
            mods.append(norm_layer(self.norm, width_out, image=False))
        mods.append(nn.Tanh() if activation == "tanh" else nn.ReLU())
        return mods

    def bottom(self, in_shape: tuple[int, ...], cut: int, cut_activation: str) -> nn.Module:
        mods: list[nn.Module] = [nn.Flatten()] if len(in_shape) != 1 else []
        width = math.prod(in_shape)
        for i in range(1, cut + 1):
            if i == len(self.hidden) + 1:
                raise ConfigError("cut-layer", cut, f"1..{len(self.hidden)} for model '{self.name}' "
                                  "(the bottom cannot hold the output layer without knowing the classes)")
            mods += self._layer(i, width, None, cut_activation if i == cut else "native")
            width = self.hidden[i - 1]
        return nn.Sequential(*mods)

    def top(self, merged: tuple[int, ...], cut: int, num_outputs: int) -> nn.Module:
        mods: list[nn.Module] = [nn.Flatten()] if len(merged) != 1 else []
        width = math.prod(merged)
        for i in range(cut + 1, len(self.hidden) + 2):
            mods += self._layer(i, width, num_outputs)
            width = num_outputs if i == len(self.hidden) + 1 else self.hidden[i - 1]
        return nn.Sequential(*mods)

    def check_cut(self, cut: int, merge: str) -> None:
        # the output layer needs the number of classes, known only to the host: bottoms end at L
        n = len(self.hidden)
        if not 1 <= cut <= n:
            raise ConfigError("cut-layer", cut, f"an integer in 1..{n} for model '{self.name}'")


register(MLP("mlp", (64, 32), description="generic MLP: Linear+ReLU layers (--hidden, --norm), "
             "default hidden 64,32, cut after layer 1", configurable=True))
register(MLP("movielens-mlp", (128, 128, 64), default_cut=1,
             description="001 Table 10 MovieLens: Linear(d,128)+ReLU | 128-64-items"))
register(MLP("bookcrossing-mlp", (128, 256, 128), default_cut=1,
             description="001 Table 10 BookCrossing: Linear(d,128)+ReLU | 256-128-items"))
register(MLP("mnist-mlp-bn", (128, 64, 64), norm="batch", default_cut=2,
             description="001 Table 10 MNIST: Linear(d,128)+BN+ReLU, Linear(128,64)[+BN+ReLU] | "
                         "Linear(64,64)+BN+ReLU, Linear(64,10)"))
