"""Named split architectures and the builder that cuts them.

An :class:`Architecture` is a sequence of layers ``1 … num_layers``. The **cut** ``k`` puts layers
``1 … k`` in every party's bottom model (each built for that party's own input shape) and the
rest in the host's top model (built for the merged shape). ``cut_activation`` replaces the
activation that ends a *guest's* bottom, because some defences own that activation:
R3eLU *is* the cut-layer activation (001 Table 10 leaves the guest's last Linear bare), the
Gaussian mechanism needs ``tanh``-bounded outputs (003 §4), randomized response binarises the
pre-activation (002).

Initialisation is deterministic per module: party ``p``'s bottom is initialised under the seed
``(run seed, "init", p)`` and the top under ``(run seed, "init", "top")`` — so a party can build
its own bottom alone (deployment) and the monolithic reference gets identical weights.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from fl_split.errors import ConfigError
from fl_split.merge import ELEMENTWISE, Merge, merged_shape
from fl_split.seeding import seeded_torch

CUT_ACTIVATIONS = ("native", "none", "relu", "tanh")

_MODEL_MODULES = ("fl_split.models.mlp", "fl_split.models.vision")


class Architecture(ABC):
    """A named model that can be cut after any of its layers."""

    name: str = ""
    description: str = ""
    #: "vector" (flattens its input) or "image" (expects (C, H, W) inputs)
    inputs: str = "vector"
    default_cut: int = 1

    @abstractmethod
    def num_layers(self) -> int:
        """How many layers can be placed in the bottom (valid cuts are ``1 … num_layers()``)."""

    @abstractmethod
    def bottom(self, in_shape: tuple[int, ...], cut: int, cut_activation: str) -> nn.Module:
        """Layers ``1 … cut`` for a party whose input has shape ``in_shape`` (no batch axis)."""

    @abstractmethod
    def top(self, merged: tuple[int, ...], cut: int, num_outputs: int) -> nn.Module:
        """Layers ``cut+1 …`` for the merged cut-layer output of shape ``merged``; returns logits."""

    def configure(self, hidden: tuple[int, ...] | None = None, batch_norm: bool | None = None) -> "Architecture":
        """A variant with other hidden widths / BatchNorm; fixed architectures refuse."""
        if hidden is None and not batch_norm:
            return self
        key, value = ("hidden", hidden) if hidden is not None else ("batch-norm", batch_norm)
        raise ConfigError(key, value, f"the default for model '{self.name}' (only model 'mlp' "
                          "takes --hidden / --batch-norm)")

    def check_cut(self, cut: int, merge: str) -> None:
        n = self.num_layers()
        if not 1 <= cut <= n:
            raise ConfigError("cut-layer", cut, f"an integer in 1..{n} for model '{self.name}'")
        if cut == n and merge not in ELEMENTWISE:
            raise ConfigError("cut-layer", cut, f"1..{n - 1} with --merge {merge} (cut {n} puts the "
                              "output layer in the bottoms, which only an element-wise merge can combine)")


_REGISTRY: dict[str, Architecture] = {}
_loaded = False


def register(arch: Architecture) -> Architecture:
    _REGISTRY[arch.name] = arch
    return arch


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _MODEL_MODULES:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as exc:
                if exc.name != mod:
                    raise


def model_names() -> list[str]:
    _ensure_loaded()
    return list(_REGISTRY)


def get_architecture(name: str) -> Architecture:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise ConfigError("model", name, "one of " + ", ".join(_REGISTRY))
    return _REGISTRY[name]


@dataclass
class SplitModules:
    """The modules of one split model: a bottom per feature-holding party, the merge, the top."""

    bottoms: dict[str, nn.Module]
    merge: Merge
    top: nn.Module
    cut_shapes: dict[str, tuple[int, ...]]
    merged_shape: tuple[int, ...]
    cut: int
    arch: str
    extra: dict = field(default_factory=dict)


@torch.no_grad()
def output_shape(module: nn.Module, in_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape (without batch) of ``module`` applied to ``in_shape`` (dry run in eval mode)."""
    was_training = module.training
    module.eval()
    try:
        out = module(torch.zeros((2, *in_shape)))
    finally:
        module.train(was_training)
    return tuple(out.shape[1:])


def build_modules(arch_name: str, cut: int | str, merge: str, input_shapes: dict[str, tuple[int, ...]],
                  num_outputs: int, seed: int, guest_cut_activation: str = "native") -> SplitModules:
    """Build every module of the split model (what :class:`~fl_split.parties.HostParty` and the
    guests each build for themselves, gathered here for the monolithic reference and tests).

    ``input_shapes`` maps each feature-holding party (merge order) to its input shape.
    """
    arch = get_architecture(arch_name)
    cut = arch.default_cut if cut in (None, "auto") else int(cut)
    arch.check_cut(cut, merge)
    if guest_cut_activation not in CUT_ACTIVATIONS:
        raise ValueError(f"cut activation {guest_cut_activation!r} not in {CUT_ACTIVATIONS}")
    bottoms: dict[str, nn.Module] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for party, shape in input_shapes.items():
        bottoms[party] = build_bottom(arch, party, shape, cut, guest_cut_activation, seed)
        shapes[party] = output_shape(bottoms[party], shape)
    m_shape = merged_shape(merge, shapes)
    top = build_top(arch, m_shape, cut, num_outputs, seed)
    return SplitModules(bottoms=bottoms, merge=Merge(merge), top=top, cut_shapes=shapes,
                        merged_shape=m_shape, cut=cut, arch=arch.name)


def build_bottom(arch: Architecture, party: str, in_shape: tuple[int, ...], cut: int,
                 guest_cut_activation: str, seed: int) -> nn.Module:
    """One party's bottom, initialised under its own derived seed."""
    act = guest_cut_activation if party != "host" else "native"
    with seeded_torch(seed, "init", party):
        return arch.bottom(tuple(in_shape), cut, act)


def build_top(arch: Architecture, merged: tuple[int, ...], cut: int, num_outputs: int, seed: int) -> nn.Module:
    with seeded_torch(seed, "init", "top"):
        return arch.top(tuple(merged), cut, num_outputs)
