"""A user model for ``--model own_mlp:build`` (docs/models.md, "Your own model").

It re-creates the built-in ``mlp`` (hidden widths 64, 32; cut after layer 1 unless
``--cut-layer 2``) from plain ``torch.nn`` layers, in the same construction order, so that with the
same ``--private-seed`` it trains bit-identically to ``--model mlp`` (tests/test_own_model.py).
Copy it and change the layers to plug in your own bottom and top models.

The module must be importable in every party's process; from the repository root::

    PYTHONPATH=$PWD/examples fl-split train --dataset digits --model own_mlp:build --epochs 2
"""

from __future__ import annotations

import math

from torch import nn

HIDDEN = (64, 32)


def _layer(width_in: int, width_out: int, activation: str) -> list[nn.Module]:
    """``Linear`` then the activation: ``native`` = ReLU (the mlp's own), ``tanh``, ``relu``, or
    ``none`` (a bare Linear: the defence's R3eLU or randomized response is the activation)."""
    mods: list[nn.Module] = [nn.Linear(width_in, width_out)]
    if activation != "none":
        mods.append(nn.Tanh() if activation == "tanh" else nn.ReLU())
    return mods


def build(spec) -> nn.Module:
    """One module of party ``spec.party``: its bottom (``spec.part == "bottom"``) or the host's top.

    ``spec`` is a :class:`fl_split.models.user.ModelSpec`."""
    cut = spec.cut or 1
    if cut > len(HIDDEN):
        raise ValueError(f"examples.own_mlp: cut {cut} > {len(HIDDEN)} hidden layers")
    mods: list[nn.Module] = [nn.Flatten()] if len(spec.in_shape) != 1 else []
    width = math.prod(spec.in_shape)
    if spec.part == "bottom":
        for i in range(cut):
            mods += _layer(width, HIDDEN[i], spec.cut_activation if i == cut - 1 else "native")
            width = HIDDEN[i]
        return nn.Sequential(*mods)
    for i in range(cut, len(HIDDEN)):
        mods += _layer(width, HIDDEN[i], "native")
        width = HIDDEN[i]
    mods.append(nn.Linear(width, spec.num_outputs))  # logits; softmax lives in the loss
    return nn.Sequential(*mods)


def build_batchnorm(spec) -> nn.Module:
    """The same MLP with BatchNorm after each hidden Linear: mixes the records of a batch, so a run
    under a defence refuses it (fl_split.privacy.validate), as it refuses ``--norm batch``."""
    module = build(spec)
    mods: list[nn.Module] = []
    for m in module:
        mods.append(m)
        if isinstance(m, nn.Linear) and spec.part == "bottom":
            mods.append(nn.BatchNorm1d(m.out_features))
    return nn.Sequential(*mods)


def not_a_module(spec):
    """Returns a tensor-free dict: refused (``--model`` must return an ``nn.Module``)."""
    return {"bottom": None}
