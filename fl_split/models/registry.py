"""Named split architectures and the builder that cuts them.

An :class:`Architecture` is a sequence of layers ``1 … num_layers``. The **cut** ``k`` puts layers
``1 … k`` in every party's bottom model (each built for that party's own input shape) and the
rest in the host's top model (built for the merged shape). ``cut_activation`` replaces the
activation that ends a *guest's* bottom, because some defences own that activation:
R3eLU *is* the cut-layer activation (001 Table 10 leaves the guest's last Linear bare), the
Gaussian mechanism needs ``tanh``-bounded outputs (003 §4), randomized response binarises the
pre-activation (002).

Initialisation is private: a party's modules are initialised from its own
:class:`~fl_split.seeding.PartySecret` (party ``p``'s bottom under ``("init", p)``, the host's top
under ``("init", "top")``), never from the public run seed, which would let any party rebuild
another's initial weights. With ``--private-seed`` the secrets are reproducible, so the
monolithic reference starts from exactly the split parties' weights.

``--norm`` picks the normalisation layers of the architectures that have some
(:func:`norm_layer`): BatchNorm in training mode mixes the records of a batch, which a
per-record privacy guarantee cannot allow (``fl_split.privacy.validate``).
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from fl_split.errors import ConfigError
from fl_split.models import catalog
from fl_split.merge import ELEMENTWISE, Merge, merged_shape
from fl_split.seeding import PartySecret

CUT_ACTIVATIONS = ("native", "none", "relu", "tanh")
#: ``--norm``: ``auto`` = the architecture's own
NORMS = ("auto", "batch", "group", "layer", "none")


def norm_layer(kind: str, channels: int, image: bool = True) -> nn.Module:
    """The normalisation of ``channels`` features of ``(N, C, H, W)`` (``image``) or ``(N, C)`` inputs.

    ``batch``: BatchNorm (mixes the records of a batch in training mode); ``group``:
    ``GroupNorm(gcd(32, C), C)`` as Opacus' ``ModuleValidator.fix`` does; ``layer``: per-record
    normalisation over all features (``GroupNorm(1, C)``, which is LayerNorm over ``(C, H, W)``
    for images); ``none``: identity."""
    if kind == "batch":
        return nn.BatchNorm2d(channels) if image else nn.BatchNorm1d(channels)
    if kind == "group":
        return nn.GroupNorm(math.gcd(32, channels), channels)
    if kind == "layer":
        return nn.GroupNorm(1, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"normalisation {kind!r} not in {NORMS[1:]}")



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

    def configure(self, hidden: tuple[int, ...] | None = None, norm: str = "auto") -> "Architecture":
        """A variant with other hidden widths (``--hidden``) or normalisation (``--norm``);
        architectures that have neither refuse."""
        if hidden is None and norm in ("auto", "none"):
            return self
        key, value = ("hidden", ",".join(map(str, hidden))) if hidden is not None else ("norm", norm)
        raise ConfigError(key, value, f"'auto' for model '{self.name}' (it has no such layers)")

    def check_cut(self, cut: int, merge: str) -> None:
        n = self.num_layers()
        if not 1 <= cut <= n:
            raise ConfigError("cut-layer", cut, f"an integer in 1..{n} for model '{self.name}'")
        if cut == n and merge not in ELEMENTWISE:
            raise ConfigError("cut-layer", cut, f"1..{n - 1} with --merge {merge} (cut {n} puts the "
                              "output layer in the bottoms, which only an element-wise merge can combine)")


_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    _REGISTRY[arch.name] = arch
    return arch


def model_names() -> list[str]:
    """Every architecture's name (from the light catalog, :mod:`fl_split.models.catalog`)."""
    return catalog.model_names()


def get_architecture(name: str) -> Architecture:
    """The registered architecture ``name`` (its module is imported on first use)."""
    entry = catalog.model_entry(name)
    if name not in _REGISTRY:
        importlib.import_module(entry.module)
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
                  num_outputs: int, private_seed: int, guest_cut_activation: str = "native") -> SplitModules:
    """Build every module of the split model (what :class:`~fl_split.parties.HostParty` and the
    guests each build for themselves, gathered here for tests), each party's modules initialised
    from its secret derived from ``private_seed``.

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
        bottoms[party] = build_bottom(arch, party, shape, cut, guest_cut_activation,
                                      PartySecret.from_private_seed(private_seed, party))
        shapes[party] = output_shape(bottoms[party], shape)
    m_shape = merged_shape(merge, shapes)
    top = build_top(arch, m_shape, cut, num_outputs, PartySecret.from_private_seed(private_seed, "host"))
    return SplitModules(bottoms=bottoms, merge=Merge(merge), top=top, cut_shapes=shapes,
                        merged_shape=m_shape, cut=cut, arch=arch.name)


def bottom_module(arch: Architecture, party: str | None, in_shape: tuple[int, ...], cut: int,
                  cut_activation: str) -> nn.Module:
    """A bottom of ``arch`` ending in ``cut_activation``, drawn from the current torch RNG; a user
    model (:mod:`fl_split.models.user`) is told which party it builds for."""
    if hasattr(arch, "bottom_for"):
        return arch.bottom_for(party, tuple(in_shape), cut_activation)
    return arch.bottom(tuple(in_shape), cut, cut_activation)


def build_bottom(arch: Architecture, party: str, in_shape: tuple[int, ...], cut: int,
                 guest_cut_activation: str, secret: PartySecret | None) -> nn.Module:
    """One party's bottom, initialised from that party's ``secret`` (``None``: a throwaway module
    for shape inference; the caller's RNG state is left untouched either way)."""
    act = guest_cut_activation if party != "host" else "native"

    def make():
        return bottom_module(arch, party, in_shape, cut, act)

    if secret is None:
        with torch.random.fork_rng(devices=[]):
            return make()
    with secret.seeded_torch("init", party):
        return make()


def build_top(arch: Architecture, merged: tuple[int, ...], cut: int, num_outputs: int,
              secret: PartySecret) -> nn.Module:
    """The host's top, initialised from the host's ``secret``."""
    with secret.seeded_torch("init", "top"):
        return arch.top(tuple(merged), cut, num_outputs)
