"""The mechanism interface a researcher's own defence implements (``--defense package.module:Class``,
docs/plugins.md, issue 28).

A plug-in defence is a class; the factory (:mod:`fl_split.privacy.factory`) constructs it as
``Class(spec)`` with a :class:`MechanismSpec` wherever it would construct a built-in mechanism —
for each protected direction (``--protect``), each cut width, each training iteration of the
geometric schedule — and from then on it is handled exactly like a built-in:

* :meth:`PluginMechanism.release` runs on the releasing party, with that party's secret generator
  (privacy principle 1: draw only from ``gen``; ``torch.rand(...)`` without it would be neither
  private nor reproducible); :meth:`~PluginMechanism.local_grad` lets a guest backpropagate through
  its own forward release;
* :meth:`PluginMechanism.public_range` — what every honest release satisfies, from public
  parameters only: the receiver checks each release against it before using it
  (:mod:`fl_split.privacy.bounds`); ``None`` = no public bound (the receiver then watches the
  sender's running scale, as for no defence);
* :meth:`PluginMechanism.privacy_cost` — a :class:`~fl_split.privacy.base.PrivacyCost` whose
  ``dp_event`` (a ``dp_accounting.DpEvent``) describes releasing **one record's** whole cut-layer
  tensor **once** (replace-one neighbours). The party's ledger charges it per release and every
  accountant composes it (:mod:`fl_split.privacy.ledger`). **A class that does not define
  privacy_cost claims no differential privacy**: the party keeps no ledger, its results entry says
  ``"privacy_claim": "none"`` and "no privacy claimed", and no epsilon is printed for it. A class
  that defines it must return a cost with a ``DpEvent`` on every construction, else the run stops
  with one line naming ``--defense``;
* :meth:`PluginMechanism.describe` and :meth:`~PluginMechanism.public_diagnostics` — public,
  parameter-derived values only (they go into the results and report);
* optionally, for ``fl-split audit`` (only for a class that claims privacy):
  ``canary_pair()`` (two neighbouring inputs at the extremes of its range) and
  ``log_likelihood_ratio(y, x0, x1)`` (the exact test statistic; without it the audit uses the
  release's projection on the canaries' difference). They are a *second* test only: the audit
  always runs its own, from the public configuration, and flags the claim if either test does
  (``docs/accounting.md``, "A plug-in is audited independently").

Class attributes: ``name`` (reports; defaults to the class name), ``random`` (draws from ``gen``),
``encoding`` ("float32"), ``cut_activation`` — how a guest's bottom must end when the plug-in
protects its forward releases ("native": as the architecture has it; "none": a bare last layer;
"tanh" / "relu").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fl_split.errors import ConfigError
from fl_split.privacy.base import Mechanism, PrivacyCost, Release

CUT_ACTIVATIONS = ("native", "none", "tanh", "relu")
#: what ``--defense package.module:Class`` must name
REQUIRED = ("a class subclassing fl_split.privacy.plugin.PluginMechanism (or fl_split.privacy.base.Mechanism): "
            "release, local_grad, public_range, describe, and privacy_cost for a differential privacy claim "
            "(docs/plugins.md)")


@dataclass(frozen=True)
class MechanismSpec:
    """What a plug-in mechanism is constructed with: the run's public privacy parameters."""

    #: "forward" (a guest's cut-layer output) or "backward" (the host's partial loss to one guest)
    direction: str
    #: elements of one record's tensor
    width: int
    #: this release's per-record epsilon (``--epsilon``; geometric schedule: ``ε/2^i`` at iteration i)
    epsilon: float
    delta: float
    #: the clipping bound of this direction (``--clip-c``/``--clip-c-backward``; auto = 10)
    bound: float
    #: ``--sigma``
    sigma: float
    #: 1-based training iteration (the geometric schedule's i)
    iteration: int
    #: ``--defense-options key=value,...`` (values parsed as numbers where they are numbers)
    options: dict[str, Any] = field(default_factory=dict)


class PluginMechanism(Mechanism):
    """Base class of a plug-in defence (module docstring). Subclasses implement :meth:`release`,
    :meth:`public_range`, :meth:`describe` and, to claim differential privacy, :meth:`privacy_cost`."""

    cut_activation = "native"

    def __init__(self, spec: MechanismSpec) -> None:
        self.spec = spec
        self.width = spec.width
        self.direction = spec.direction

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:  # pragma: no cover - abstract
        raise NotImplementedError

    def public_range(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, "direction": self.direction, "width": self.width, "plugin": plugin_name(type(self))}


def plugin_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def claims_privacy(cls: type) -> bool:
    """Whether a plug-in class claims differential privacy: it defines ``privacy_cost`` (or ``cost``)."""
    return cls.privacy_cost is not Mechanism.privacy_cost or cls.cost is not Mechanism.cost


def load_class(kind: str, value: str, base: type, required: str) -> type:
    """The class ``value`` (``package.module:Class``) names, a subclass of ``base``; else one
    :class:`ConfigError` line naming ``--kind``. Importing runs the module: callers on a deployment
    node check the operator's allow-list first (:func:`fl_split.plugins.check_node_plugins`)."""
    from fl_split.models.user import _import  # the working directory as `python -m` would, see there

    module_name, attr = value.split(":")
    try:
        obj = _import(module_name)
    except Exception as e:  # ImportError, or whatever the user's module raised while importing
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            hint = (" (not on the import path: put its directory on PYTHONPATH; under Flower every ClientApp "
                    "process must be able to import it)")
        raise ConfigError(kind, value, required,
                          reason=f"cannot import module '{module_name}': {type(e).__name__}: {e}{hint}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(kind, value, required, reason=f"module '{module_name}' has no '{attr}'")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ConfigError(kind, value, required, reason=f"it is a {type(obj).__name__}, not a class")
    if not issubclass(obj, base):
        raise ConfigError(kind, value, required,
                          reason=f"{obj.__name__} does not subclass {base.__module__}.{base.__name__}")
    return obj


def mechanism_class(value: str) -> type:
    """The plug-in mechanism class ``--defense value`` names, checked (what
    :func:`fl_split.plugins.resolve` returns for a defence)."""
    cls = load_class("defense", value, Mechanism, REQUIRED)
    check_class(value, cls)
    return cls


def check_class(value: str, cls: type) -> None:
    """Class-level checks of a plug-in defence."""
    act = getattr(cls, "cut_activation", "native")
    if act not in CUT_ACTIVATIONS:
        raise ConfigError("defense", value, "a class whose cut_activation is one of " + ", ".join(CUT_ACTIVATIONS),
                          reason=f"{cls.__name__}.cut_activation is {act!r}")


def parse_options(text: str) -> dict[str, Any]:
    """``--defense-options 'a=1,b=0.5,mode=x'`` → ``{"a": 1, "b": 0.5, "mode": "x"}``."""
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in str(text or "").split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("defense-options", text, "comma-separated key=value pairs, e.g. 'rate=0.9,lam=0.1'")
        raw = raw.strip()
        value: Any = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                continue
        out[key.strip()] = value
    return out


def build(value: str, cls: type, spec: MechanismSpec) -> Mechanism:
    """``cls(spec)``, checked: a :class:`Mechanism` whose cost is a ``DpEvent`` when it claims privacy."""
    import dp_accounting

    try:
        mech = cls(spec)
    except ConfigError:
        raise
    except Exception as e:  # the user's constructor refused its parameters
        raise ConfigError("defense", value, "a class constructed as Class(spec: fl_split.privacy.plugin.MechanismSpec)",
                          reason=f"{cls.__name__}({spec.direction}, width {spec.width}) raised "
                                 f"{type(e).__name__}: {e}") from None
    if not isinstance(mech, Mechanism):
        raise ConfigError("defense", value, "a Mechanism subclass", reason=f"it built a {type(mech).__name__}")
    if "name" not in type(mech).__dict__ and type(mech).name in ("none", Mechanism.name):
        mech.name = cls.__name__  # reports name a plug-in by its class, never "none"
    if claims_privacy(cls):
        cost = mech.cost()
        if not isinstance(cost, PrivacyCost) or not isinstance(cost.dp_event, dp_accounting.DpEvent):
            got = type(cost).__name__ if not isinstance(cost, PrivacyCost) else \
                f"a PrivacyCost whose dp_event is {type(cost.dp_event).__name__}"
            raise ConfigError("defense", value, "privacy_cost() returning fl_split.privacy.base.PrivacyCost with a "
                              "dp_accounting.DpEvent (or no privacy_cost method: no privacy claimed)",
                              reason=f"{cls.__name__}.privacy_cost() returned {got}")
    return mech


def is_plugin_mechanism(mech: Mechanism) -> bool:
    """A mechanism built from a plug-in class (not one of fl_split's own)."""
    return not type(mech).__module__.startswith("fl_split.privacy.") or isinstance(mech, PluginMechanism)
