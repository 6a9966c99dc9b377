"""Image architectures for vertically striped images: ``cnn-stripe``, ``cnn-mnist`` (003 Table 1),
``resnet18-split`` (001 Table 10, CIFAR) and ``resnet20`` (003 Table 1, CIFAR-10).

Every party holds a vertical stripe ``(C, H, w_p)`` of each image (the pixel columns it owns).
An architecture here is a list of *layers* ``1 … n`` followed by one output ``Linear`` (the
head, which needs the number of classes and therefore always sits in the host's top). The cut
``k ∈ 1 … n`` puts layers ``1 … k`` in every party's bottom, each built for that party's own
stripe shape; the host's top holds layers ``k+1 … n`` and the head, built for the merged shape.
``concat`` merges along the width axis, so the parties' feature maps re-assemble side by side
and the top sees one feature map of the whole image (spec §2, ``fl_split.merge``).

**Narrow stripes.** Pooling layers pool an axis only when it is at least 2 wide (kernel 1
otherwise) and use ``ceil_mode`` so odd widths keep their last column; strided convolutions use
padding 1, so any stripe width ≥ 1 goes through every layer. Heights are the same for every
party, hence so are the pooling decisions along the height axis (concat needs equal heights).

**Cut activation** (guests only, ``native`` / ``none`` / ``relu`` / ``tanh``) replaces the *last
nonlinearity of the bottom*: the ReLU that ends a conv / FC layer, the ReLU after the residual
addition of a stage's last block, or — when the cut is a pooling layer, which has no
nonlinearity of its own — the one just before the pool. ``none`` leaves that layer bare (R3eLU,
001 Table 10; randomized response, 002), ``tanh`` bounds it in ``[-1, 1]`` (the Gaussian
mechanism, 003 §4: max- and average-pooling of values in ``[-1, 1]`` stay in ``[-1, 1]``).
Every native activation here is ReLU.

ResNet blocks are torchvision's :class:`~torchvision.models.resnet.BasicBlock` (the cut-aware
subclass only swaps the ReLU after the addition), initialised like torchvision's ResNet
(Kaiming-normal ``fan_out`` convolutions, BatchNorm weight 1 / bias 0). Initialisation is seeded
by :func:`fl_split.models.registry.build_bottom` / ``build_top``, not here.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, conv1x1, conv3x3

from fl_split.errors import ConfigError
from fl_split.models.registry import CUT_ACTIVATIONS, Architecture, norm_layer, output_shape, register

Shape = tuple[int, ...]


# --------------------------------------------------------------------------------------------
# building blocks


def activation(act: str) -> list[nn.Module]:
    """The modules ending a layer whose activation is ``act`` (native = ReLU for these models)."""
    if act not in CUT_ACTIVATIONS:
        raise ValueError(f"cut activation {act!r} not in {CUT_ACTIVATIONS}")
    if act == "none":
        return []
    return [nn.Tanh() if act == "tanh" else nn.ReLU()]


def _activation_module(act: str) -> nn.Module:
    mods = activation(act)
    return mods[0] if mods else nn.Identity()


def stripe_pool(shape: Shape) -> nn.Module:
    """2×2 max-pooling that only pools axes at least 2 wide (``ceil_mode``: odd sizes keep their
    last row/column), so a 1-pixel-wide stripe passes with its width intact."""
    _, h, w = shape
    kernel = (2 if h >= 2 else 1, 2 if w >= 2 else 1)
    return nn.MaxPool2d(kernel_size=kernel, stride=kernel, ceil_mode=True)


class CutBasicBlock(BasicBlock):
    """torchvision's ``BasicBlock`` whose ReLU after the residual addition can be replaced.

    ``forward`` is torchvision's: ``act(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`` with
    ``act = ReLU`` natively; the last block of a guest's bottom takes the cut activation.
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 final: str = "native", norm: str = "batch") -> None:
        super().__init__(inplanes, planes, stride=stride, downsample=downsample,
                         norm_layer=lambda c: norm_layer(norm, c))
        self.final = _activation_module(final)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.final(out + identity)


class PadShortcut(nn.Module):
    """He et al. (2016) option-A shortcut of the CIFAR ResNets: subsample by the stride and
    zero-pad the new channels (parameter-free; what 003's ResNet-20 uses)."""

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        extra = planes - inplanes
        self.pad = (extra // 2, extra - extra // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = x[:, :, :: self.stride, :: self.stride]
        return nn.functional.pad(x, (0, 0, 0, 0, *self.pad))

    def extra_repr(self) -> str:
        return f"stride={self.stride}, pad_channels={self.pad}"


def _resnet_init(module: nn.Module) -> nn.Module:
    """torchvision ResNet initialisation (``torchvision.models.resnet.ResNet.__init__``)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)) and m.weight is not None:
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    return module


# --------------------------------------------------------------------------------------------
# layer specifications


@dataclass(frozen=True)
class Layer:
    """One cuttable layer: ``build(in_shape, act, norm)`` returns its module for that input shape
    (``norm``: the architecture's normalisation, see :func:`~fl_split.models.registry.norm_layer`).

    ``has_act=False`` marks a layer without a nonlinearity of its own (a pooling layer): when
    the cut falls on it, the cut activation goes to the layer before (see the module docstring).
    """

    name: str
    build: Callable[[Shape, str, str], nn.Module]
    has_act: bool = True


def conv_layer(channels: int, pool: bool) -> Callable[[Shape, str, str], nn.Module]:
    """``Conv2d(C, channels, 3, padding=1) + act [+ stripe_pool]`` (no normalisation)."""

    def build(shape: Shape, act: str, norm: str) -> nn.Module:
        mods: list[nn.Module] = [nn.Conv2d(shape[0], channels, kernel_size=3, padding=1), *activation(act)]
        if pool:
            mods.append(stripe_pool((channels, *shape[1:])))
        return nn.Sequential(*mods)

    return build


def fc_layer(width: int) -> Callable[[Shape, str, str], nn.Module]:
    """``[Flatten] + Linear(prod(in), width) + act`` (no normalisation)."""

    def build(shape: Shape, act: str, norm: str) -> nn.Module:
        mods: list[nn.Module] = [nn.Flatten()] if len(shape) != 1 else []
        mods += [nn.Linear(math.prod(shape), width), *activation(act)]
        return nn.Sequential(*mods)

    return build


def resnet_stem(channels: int) -> Callable[[Shape, str, str], nn.Module]:
    """CIFAR stem: ``Conv2d(C, channels, 3, padding=1, bias=False) + norm + act`` (no max-pool)."""

    def build(shape: Shape, act: str, norm: str) -> nn.Module:
        return _resnet_init(nn.Sequential(conv3x3(shape[0], channels), norm_layer(norm, channels), *activation(act)))

    return build


def resnet_stage(planes: int, blocks: int, stride: int, shortcut: str) -> Callable[[Shape, str, str], nn.Module]:
    """``blocks`` BasicBlocks; the first has ``stride`` and, if the shape changes, a shortcut:
    ``"conv"`` = torchvision's ``conv1x1 + norm`` (option B), ``"pad"`` = :class:`PadShortcut`
    (option A). The last block's post-addition activation is ``act``."""

    def build(shape: Shape, act: str, norm: str) -> nn.Module:
        inplanes = shape[0]
        mods: list[nn.Module] = []
        for b in range(blocks):
            s = stride if b == 0 else 1
            down = None
            if s != 1 or inplanes != planes:
                down = (nn.Sequential(conv1x1(inplanes, planes, s), norm_layer(norm, planes)) if shortcut == "conv"
                        else PadShortcut(inplanes, planes, s))
            mods.append(CutBasicBlock(inplanes, planes, s, down, final=act if b == blocks - 1 else "native",
                                      norm=norm))
            inplanes = planes
        return _resnet_init(nn.Sequential(*mods))

    return build


def pool_layer(kind: str, size: int) -> Callable[[Shape, str, str], nn.Module]:
    """Adaptive ``kind`` ("max" / "avg") pooling to ``size × size`` and flatten (no activation)."""

    def build(shape: Shape, act: str, norm: str) -> nn.Module:
        pool = nn.AdaptiveMaxPool2d(size) if kind == "max" else nn.AdaptiveAvgPool2d(size)
        return nn.Sequential(pool, nn.Flatten())

    return build


# --------------------------------------------------------------------------------------------
# the architecture


class ImageArchitecture(Architecture):
    """Layers ``1 … n`` (cuttable) + the output head ``[Flatten] + Linear(prod(in), classes)``."""

    inputs = "image"

    def __init__(self, name: str, layers: list[Layer], default_cut: int, description: str,
                 norm: str | None = None) -> None:
        self.name = name
        self.layers = list(layers)
        self.default_cut = default_cut
        self.description = description
        #: the normalisation of its layers (``None``: the architecture has none)
        self.norm = norm

    def configure(self, hidden: tuple[int, ...] | None = None, norm: str = "auto") -> "ImageArchitecture":
        """A copy with another normalisation (``--norm``); ``--hidden`` is the MLPs' only."""
        if hidden is not None:
            raise ConfigError("hidden", ",".join(map(str, hidden)), f"'auto' for model '{self.name}' "
                              "(only the MLPs take --hidden)")
        if norm in ("auto", self.norm) or (self.norm is None and norm == "none"):
            return self
        if self.norm is None:
            raise ConfigError("norm", norm, f"auto or none for model '{self.name}' (it has no normalisation layers)")
        return ImageArchitecture(self.name, self.layers, self.default_cut, self.description, norm)
        if not 1 <= default_cut <= len(self.layers):
            raise ValueError(f"{name}: default cut {default_cut} outside 1..{len(self.layers)}")

    def num_layers(self) -> int:
        return len(self.layers)

    def check_cut(self, cut: int, merge: str) -> None:
        # the head needs the number of classes (the host's): bottoms end at layer n at the latest,
        # whatever the merge
        n = self.num_layers()
        if isinstance(cut, bool) or not isinstance(cut, int) or not 1 <= cut <= n:
            names = ", ".join(f"{i}={layer.name}" for i, layer in enumerate(self.layers, 1))
            raise ConfigError("cut-layer", cut, f"an integer in 1..{n} for model '{self.name}' ({names})")

    def _check_input(self, shape: Shape) -> None:
        if len(shape) != 3 or any(int(s) < 1 for s in shape):
            raise ConfigError("model", self.name, "a vector model (e.g. mlp) for inputs that are not images",
                              reason=f"'{self.name}' needs (channels, height, width) inputs, got shape {tuple(shape)}")

    def act_layer(self, cut: int) -> int:
        """The layer whose ending activation the cut activation replaces (skips pooling layers)."""
        i = cut
        while i > 1 and not self.layers[i - 1].has_act:
            i -= 1
        return i

    def _stack(self, shape: Shape, first: int, last: int,
               acts: dict[int, str]) -> tuple[list[tuple[str, nn.Module]], Shape]:
        """Layers ``first … last`` built in turn for the running shape (``acts``: overrides)."""
        mods: list[tuple[str, nn.Module]] = []
        for i in range(first, last + 1):
            layer = self.layers[i - 1]
            m = layer.build(shape, acts.get(i, "native"), self.norm or "none")
            shape = output_shape(m, shape)
            mods.append((layer.name, m))
        return mods, shape

    def bottom(self, in_shape: Shape, cut: int, cut_activation: str) -> nn.Module:
        self.check_cut(cut, "concat")
        self._check_input(in_shape)
        if cut_activation not in CUT_ACTIVATIONS:
            raise ValueError(f"cut activation {cut_activation!r} not in {CUT_ACTIVATIONS}")
        mods, _ = self._stack(tuple(in_shape), 1, cut, {self.act_layer(cut): cut_activation})
        return nn.Sequential(OrderedDict(mods))

    def top(self, merged: Shape, cut: int, num_outputs: int) -> nn.Module:
        self.check_cut(cut, "concat")
        mods, shape = self._stack(tuple(merged), cut + 1, self.num_layers(), {})
        head: list[nn.Module] = [nn.Flatten()] if len(shape) != 1 else []
        head.append(nn.Linear(math.prod(shape), num_outputs))
        mods.append(("head", nn.Sequential(*head)))
        return nn.Sequential(OrderedDict(mods))


# --------------------------------------------------------------------------------------------
# registered architectures


def cnn_stripe() -> ImageArchitecture:
    """A small CNN for one image stripe (digits 8×w, MNIST 28×14, …); no normalisation layers, so
    every defence can protect it as it is."""
    return ImageArchitecture(
        "cnn-stripe",
        [Layer("conv1", conv_layer(16, pool=True)),
         Layer("conv2", conv_layer(32, pool=True)),
         Layer("fc1", fc_layer(64))],
        default_cut=2,
        description="small stripe CNN: conv16+pool, conv32+pool | FC64, FC-out")


def cnn_mnist() -> ImageArchitecture:
    """003 Table 1 'CNN on MNIST' (the code of 003: conv32, conv64, max-pool, FC256, FC10).

    Cut 2 = '2×Conv2d | FC - FC - Loss' (cut width 64×14×14 = 12544 for the whole image), cut 3
    = '2×Conv2d - FC | FC - Loss' (cut width 256)."""
    return ImageArchitecture(
        "cnn-mnist",
        [Layer("conv1", conv_layer(32, pool=False)),
         Layer("conv2", conv_layer(64, pool=True)),
         Layer("fc1", fc_layer(256))],
        default_cut=2,
        description="003 Table 1 CNN-MNIST: conv32, conv64+pool | FC256, FC-out")


def resnet18_split() -> ImageArchitecture:
    """001 Table 10 CIFAR model: CIFAR ResNet-18 (3×3 stem, no max-pool), torchvision blocks."""
    return ImageArchitecture(
        "resnet18-split",
        [Layer("conv1", resnet_stem(64)),
         Layer("layer1", resnet_stage(64, 2, 1, "conv")),
         Layer("layer2", resnet_stage(128, 2, 2, "conv")),
         Layer("layer3", resnet_stage(256, 2, 2, "conv")),
         Layer("layer4", resnet_stage(512, 2, 2, "conv")),
         Layer("pool", pool_layer("avg", 1), has_act=False)],
        default_cut=2,
        description="001 Table 10 CIFAR ResNet-18: stem, layer1 | layer2..4, avgpool, FC-out", norm="batch")


def resnet20() -> ImageArchitecture:
    """003 Table 1 ResNet-20 for CIFAR-10: 3 stages × 3 BasicBlocks (16/32/64 channels), option-A
    shortcuts, then 003's 4×4 max-pool of the 8×8 map (here adaptive to 2×2: 64·2·2 = 256)."""
    return ImageArchitecture(
        "resnet20",
        [Layer("conv1", resnet_stem(16)),
         Layer("layer1", resnet_stage(16, 3, 1, "pad")),
         Layer("layer2", resnet_stage(32, 3, 2, "pad")),
         Layer("layer3", resnet_stage(64, 3, 2, "pad")),
         Layer("pool", pool_layer("max", 2), has_act=False)],
        default_cut=5,
        description="003 Table 1 ResNet-20: stem, 3 stages x 3 blocks (16/32/64), maxpool->256 | FC-out",
        norm="batch")


for _factory in (cnn_stripe, cnn_mnist, resnet18_split, resnet20):
    register(_factory())
