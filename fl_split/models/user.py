"""Bring your own model: ``--model package.module:function`` (docs/models.md, "Your own model").

The function is imported and called **in each party's own process**, once per module that party
owns, with a :class:`ModelSpec`, and returns that module as a ``torch.nn.Module``:

* a guest's bottom (``spec.part == "bottom"``, ``spec.role == "guest"``) for its input shape;
* the host's own bottom (``--host-features``) and the host's top (``spec.part == "top"``, built for
  the merged cut-layer shape; it returns the logits).

Everything after the modules are built is what the built-in architectures get: the merge, the
defences and their accounting, the record-independence refusal (BatchNorm under a differential
privacy claim, ``fl_split.privacy.validate``), Opacus' checks under DP-SGD, both engines. The call
is made under the party's private seeded torch RNG (:func:`fl_split.models.registry.build_bottom`
/ ``build_top``: ``secret.seeded_torch("init", party)``), so ``--private-seed`` reproduces a user
model exactly as it reproduces a built-in one, and no party can recompute another's weights from
public values (DESIGN.md, "Privacy principles": initialisation is private).

A defence that owns the cut-layer activation (R3eLU, randomized response: a bare last layer;
Gaussian: ``tanh``) asks for it in ``spec.cut_activation``; a guest's bottom that does not end as
asked is refused (:func:`check_cut_activation`), since the mechanism's bound would otherwise be
wrong or the activation applied twice.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from torch import nn

from fl_split.config import factory_label, is_model_factory, is_user_model  # noqa: F401
from fl_split.errors import ConfigError
from fl_split.models.registry import Architecture

ALLOWED = "a built-in model name (see `fl-split models`) or 'package.module:function' returning an nn.Module " \
          "(docs/models.md)"


@dataclass(frozen=True)
class ModelSpec:
    """What the user's function is told when it builds one module (all public run metadata)."""

    #: the party that owns the module: "host", "guest-1", …; ``None`` when fl_split builds a
    #: stand-in of the architecture for an attack simulation (``fl_split.attacks``)
    party: str | None
    #: "guest" or "host"
    role: str
    #: "bottom" (a party's input → its cut-layer output) or "top" (merged → logits; host only)
    part: str
    #: bottom: the shape of this party's input columns (no batch axis; images (C, H, W));
    #: top: the merged cut-layer shape (``--merge``)
    in_shape: tuple[int, ...]
    #: ``--cut-layer`` if given, else ``None`` (the function decides where its bottom ends)
    cut: int | None
    #: a guest's bottom: how it must end — "native" (as you like), "none" (a bare last layer: the
    #: defence's R3eLU or randomized response is the activation), "tanh" / "relu" (that module
    #: last); always "native" for the host's modules
    cut_activation: str
    #: classes (or items) of the task, the top's output width; ``None`` when unknown (attack stand-ins)
    num_outputs: int | None
    #: the dataset's metric ("accuracy", "auc", "hit@10", …); ``None`` when unknown
    metric: str | None


def _import(module_name: str):
    """Import ``module_name``; a top-level module that is not on the import path but sits in the
    working directory (``my_models.py`` or a package ``my_models/``) is imported from there, as
    ``python -m`` would: the working directory is put on ``sys.path`` (first; kept, so the parties'
    Flower workers, which inherit this process's path, find it too)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        here = os.path.isfile(os.path.join(cwd, f"{top}.py")) or os.path.isdir(os.path.join(cwd, top))
        if e.name != top or not here or cwd in sys.path or "" in sys.path:
            raise
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def load_function(value: str):
    """The callable named by ``value`` (``package.module:function``), or a ConfigError naming ``--model``."""
    if not is_user_model(value):
        raise ConfigError("model", value, ALLOWED)
    module_name, attr = value.split(":")
    try:
        obj = _import(module_name)
    except Exception as e:  # ImportError, or an error raised while importing the user's module
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            hint = (f" (neither on the import path nor in the working directory {os.getcwd()}: put its directory "
                    f"on PYTHONPATH, e.g. PYTHONPATH=/path/to/dir)")
        raise ConfigError("model", value, ALLOWED,
                          reason=f"cannot import module '{module_name}': {type(e).__name__}: {e}{hint}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError("model", value, ALLOWED, reason=f"module '{module_name}' has no '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError("model", value, ALLOWED, reason=f"'{attr}' in '{module_name}' is not callable")
    return obj


def check_cut_activation(value: str, module: nn.Module, cut_activation: str) -> None:
    """Refuse a guest's bottom that does not end as its defence requires (see module docstring)."""
    if cut_activation == "native":
        return
    leaves = [m for m in module.modules() if not list(m.children())]
    last = leaves[-1] if leaves else None
    is_activation = last is not None and type(last).__module__ == "torch.nn.modules.activation"
    wanted = {"tanh": nn.Tanh, "relu": nn.ReLU}.get(cut_activation)
    ok = (not is_activation) if wanted is None else isinstance(last, wanted)
    if not ok:
        need = "no activation as its last module" if wanted is None else f"nn.{wanted.__name__}() as its last module"
        raise ConfigError("model", value, f"a function whose guest bottom follows spec.cut_activation: with "
                          f"cut_activation '{cut_activation}' it ends with {need}",
                          reason=f"the guest's bottom ends with {type(last).__name__ if last else 'nothing'}, "
                                 "and the defence owns the cut-layer activation")


class UserArchitecture(Architecture):
    """A user's ``package.module:function`` behind the :class:`Architecture` interface, so that the
    builder, the engines and the defences treat it as a built-in architecture."""

    inputs = "any"

    def __init__(self, value, cut: int | None = None, num_outputs: int | None = None,
                 metric: str | None = None) -> None:
        # ``value``: 'package.module:function', or the function itself (the Python API, docs/api.md),
        # then named by its label in the plan, the results and the saved manifests
        self.name = factory_label(value) if is_model_factory(value) else value
        self.description = f"user model {self.name}"
        self.fn = value if is_model_factory(value) else load_function(value)
        self.cut = cut
        self.num_outputs = num_outputs
        self.metric = metric
        # the plan's cut: the given --cut-layer, else "auto" (the function decides)
        self.default_cut = "auto"

    def num_layers(self) -> int:  # the function decides; any --cut-layer >= 1 is passed on
        return 0

    def check_cut(self, cut, merge: str) -> None:
        if cut != "auto" and not (isinstance(cut, int) and cut >= 1):
            raise ConfigError("cut-layer", cut, "'auto' or an integer >= 1 (passed to the model function as spec.cut)")

    def _call(self, spec: ModelSpec) -> nn.Module:
        module = self.fn(spec)
        if not isinstance(module, nn.Module):
            raise ConfigError("model", self.name, "a function that returns a torch.nn.Module",
                              reason=f"it returned {type(module).__name__} for the {spec.part} of "
                                     f"{spec.party or 'a stand-in'}")
        return module

    def bottom_for(self, party: str | None, in_shape: tuple[int, ...], cut_activation: str) -> nn.Module:
        role = "host" if party == "host" else "guest"
        act = "native" if role == "host" else cut_activation
        module = self._call(ModelSpec(party=party, role=role, part="bottom", in_shape=tuple(in_shape),
                                      cut=self.cut, cut_activation=act, num_outputs=self.num_outputs,
                                      metric=self.metric))
        check_cut_activation(self.name, module, act)
        return module

    def bottom(self, in_shape: tuple[int, ...], cut, cut_activation: str) -> nn.Module:
        return self.bottom_for(None, in_shape, cut_activation)

    def top(self, merged: tuple[int, ...], cut, num_outputs: int) -> nn.Module:
        return self._call(ModelSpec(party="host", role="host", part="top", in_shape=tuple(merged), cut=self.cut,
                                    cut_activation="native", num_outputs=num_outputs, metric=self.metric))
