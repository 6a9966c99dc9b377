"""DpEvents as the ledger stores them: a JSON codec, cost identities, and pure-DP events.

A :class:`~fl_split.privacy.base.PrivacyCost` carries a ``dp_accounting`` ``DpEvent`` describing
one release of one record's tensor under replace-one neighbours. This module turns events and
costs into JSON and back (a ledger is part of a party's exported state), gives every cost a
stable identity (:func:`cost_key`: identical releases are grouped under it) and an accounting
identity (:func:`accounting_key`: what the accountants read, the event and the pure epsilon, so
costs that differ only in descriptive parameters are composed as one kind of release), and
describes a pure ε-DP mechanism that has no event of its own (:func:`pure_dp_event`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attr
from dp_accounting import dp_event as dpe

from fl_split.privacy.base import PrivacyCost

#: largest epsilon a binary randomized response event can carry: beyond, ``e^ε`` overflows a
#: float (and dp_accounting's PLD constructors with it)
MAX_RR_EPSILON = 700.0

if hasattr(dpe, "EpsilonDeltaDpEvent"):  # newer dp_accounting releases may define it
    EpsilonDeltaDpEvent = dpe.EpsilonDeltaDpEvent
else:
    @attr.s(frozen=True, slots=True, auto_attribs=True)
    class EpsilonDeltaDpEvent(dpe.DpEvent):
        """An (ε, δ)-DP mechanism known only by its parameters (missing from dp_accounting 0.6).

        With ``delta = 0`` (pure DP) it is accounted as binary randomized response of the same
        epsilon (the dominating pair of every ε-DP mechanism); with ``delta > 0`` PLD uses
        ``from_privacy_parameters`` and RDP does not apply.
        """

        epsilon: float
        delta: float = 0.0


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SkellamDpEvent(dpe.DpEvent):
    """One integer element released with ``Sk(mu)`` noise (``Poisson(mu/2) − Poisson(mu/2)``, variance
    ``mu``) whose value moves by at most ``sensitivity`` between neighbours (Agarwal, Kairouz, Liu,
    NeurIPS 2021). The secure merge's distributed noise (:mod:`fl_split.privacy.secure_merge`): the
    honest guests' shares sum to exactly this. Accounted by PLD from its PMF
    (:func:`fl_split.privacy.accountants.skellam_pld`); no other accountant has it."""

    mu: float
    sensitivity: int


# -- DpEvent (de)serialisation ------------------------------------------------------------------
def _event_types() -> dict[str, type]:
    types = {name: cls for name, cls in vars(dpe).items()
             if isinstance(cls, type) and issubclass(cls, dpe.DpEvent)}
    types.setdefault("EpsilonDeltaDpEvent", EpsilonDeltaDpEvent)
    types.setdefault("SkellamDpEvent", SkellamDpEvent)
    return types


_EVENT_TYPES = _event_types()


def event_to_json(ev: Any) -> dict:
    """A DpEvent as a JSON-able dict ``{"type": class name, field: value…}`` (nested events too)."""
    if not isinstance(ev, dpe.DpEvent) or not attr.has(type(ev)):
        raise TypeError(f"expected a dp_accounting DpEvent, got {type(ev).__name__}")
    out: dict[str, Any] = {"type": type(ev).__name__}
    for f in attr.fields(type(ev)):
        out[f.name] = json_value(getattr(ev, f.name))
    return out


def json_value(v: Any) -> Any:
    """A value of a DpEvent field or a cost parameter as plain JSON (NumPy scalars unwrapped)."""
    if isinstance(v, dpe.DpEvent):
        return event_to_json(v)
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "item") and hasattr(v, "dtype"):  # a NumPy scalar (NumPy not imported here)
        return json_value(v.item())
    raise TypeError(f"cannot serialise a {type(v).__name__} inside a DpEvent")


def event_from_json(d: Mapping) -> dpe.DpEvent:
    """Inverse of :func:`event_to_json` (only dp_accounting's event classes and ours)."""
    name = d.get("type")
    cls = _EVENT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown DpEvent type {name!r} in ledger state; known: {', '.join(sorted(_EVENT_TYPES))}")
    return cls(**{k: _from_json_value(v) for k, v in d.items() if k != "type"})


def _from_json_value(v: Any) -> Any:
    if isinstance(v, Mapping) and "type" in v:
        return event_from_json(v)
    if isinstance(v, (list, tuple)):
        return [_from_json_value(x) for x in v]
    return v


def _freeze(v: Any) -> Any:
    """Lists back to tuples (PrivacyCost params are hashable)."""
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _num(v: Any) -> float | None:
    return None if v is None else float(v)


def cost_to_json(cost: PrivacyCost) -> dict:
    """A cost as plain JSON (inverse: :func:`cost_from_json`)."""
    return {"mechanism": cost.mechanism, "dp_event": event_to_json(cost.dp_event),
            "epsilon": _num(cost.epsilon), "sensitivity_l1": _num(cost.sensitivity_l1),
            "sensitivity_l2": _num(cost.sensitivity_l2),
            "params": [[str(k), json_value(v)] for k, v in cost.params]}


def cost_from_json(d: Mapping) -> PrivacyCost:
    return PrivacyCost(str(d["mechanism"]), event_from_json(d["dp_event"]), d["epsilon"],
                       sensitivity_l1=d["sensitivity_l1"], sensitivity_l2=d["sensitivity_l2"],
                       params=tuple((str(k), _freeze(v)) for k, v in d["params"]))


def cost_key(cost: PrivacyCost) -> str:
    """Stable identity of a cost (mechanism, event, epsilon, sensitivities, parameters): the
    ledger reports releases per cost under it."""
    return json.dumps(cost_to_json(cost), sort_keys=True, separators=(",", ":"))


def accounting_key(cost: PrivacyCost) -> str:
    """What accountants read of a cost: its event and its pure epsilon. Costs with the same
    accounting key are the same kind of release for every accountant (e.g. two R3eLU costs whose
    importance-derived parameters differ but whose events are equal)."""
    return json.dumps({"dp_event": event_to_json(cost.dp_event), "epsilon": _num(cost.epsilon)},
                      sort_keys=True, separators=(",", ":"))


# -- pure-DP events ---------------------------------------------------------------------------
def is_epsilon_delta(ev: Any) -> bool:
    return type(ev).__name__ == "EpsilonDeltaDpEvent" and hasattr(ev, "epsilon") and hasattr(ev, "delta")


def rr_noise(eps: float) -> float:
    """dp_accounting's RR noise parameter ``η`` for a binary ε-DP randomized response.

    With probability η the output is uniform over the 2 buckets, so the truth is kept with
    probability ``1 − η/2``; ``(1 − η/2)/(η/2) = e^ε`` gives ``η = 2/(1 + e^ε)``.
    """
    if not 0.0 <= eps <= MAX_RR_EPSILON:
        raise ValueError(f"rr_noise: epsilon {eps!r} outside [0, {MAX_RR_EPSILON:g}] (e^epsilon overflows)")
    return 2.0 / (1.0 + math.exp(eps))


def pure_dp_event(eps: float) -> dpe.DpEvent:
    """A DpEvent standing for an ε-DP mechanism: binary randomized response of that epsilon, whose
    output pair dominates every ε-DP mechanism's (Kairouz, Oh & Viswanath 2015), or — beyond
    :data:`MAX_RR_EPSILON`, where it cannot be represented — :class:`EpsilonDeltaDpEvent` ``(ε, 0)``
    (accounted by basic composition: PLD falls back to it, RDP does not apply)."""
    eps = float(eps)
    if eps <= MAX_RR_EPSILON:
        return dpe.RandomizedResponseDpEvent(noise_parameter=rr_noise(eps), num_buckets=2)
    return EpsilonDeltaDpEvent(eps, 0.0)


def elementwise_dlap_event(t: float, shift: int, elements: int) -> dpe.DpEvent:
    """The worst-case neighbouring pair of a release whose ``elements`` differing elements each move
    by at most ``shift`` grid steps and get independent ``DLap(t)`` noise (issue 26, DESIGN.md privacy
    principle 9): ``elements`` discrete Laplace events of sensitivity ``shift``, composed.

    Each element's pair ``(DLap(0, t), DLap(s, t))`` with ``s ≤ shift`` is dominated by the one at
    ``s = shift`` (a location family with a monotone likelihood ratio: the Neyman–Pearson tests are
    thresholds and a larger shift is stochastically larger), and dominance survives composition, so
    the composed event is the exact worst case whenever all ``elements`` can move by ``shift`` at
    once (per-element clipping). Its pure epsilon ``elements·shift/t`` is the 1-D event's of L1
    sensitivity ``elements·shift``; at ``δ > 0`` it is much smaller (the elements compose).
    """
    if int(shift) <= 0 or int(elements) <= 0:
        return dpe.NoOpDpEvent()
    one = dpe.DiscreteLaplaceDpEvent(noise_parameter=1.0 / float(t), sensitivity=int(shift))
    return one if int(elements) == 1 else dpe.SelfComposedDpEvent(one, int(elements))


def canonical_event(ev: dpe.DpEvent) -> dpe.DpEvent:
    """Replace pure :class:`EpsilonDeltaDpEvent` parts by binary RR of the same epsilon (where an
    RR event can carry it)."""
    if is_epsilon_delta(ev) and float(ev.delta) == 0.0 and float(ev.epsilon) <= MAX_RR_EPSILON:
        return dpe.RandomizedResponseDpEvent(noise_parameter=rr_noise(float(ev.epsilon)), num_buckets=2)
    if isinstance(ev, dpe.ComposedDpEvent):
        return dpe.ComposedDpEvent([canonical_event(e) for e in ev.events])
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return dpe.SelfComposedDpEvent(canonical_event(ev.event), ev.count)
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        return dpe.PoissonSampledDpEvent(ev.sampling_probability, canonical_event(ev.event))
    return ev


def noisier_event(ev: Any, factor: float) -> dpe.DpEvent:
    """The event of the same release with ``factor``× its noise: what a ledger would charge if it
    believed the noise ``factor`` times larger (the audit's deliberate mis-accounting,
    :class:`~fl_split.privacy.audit.MisAccounted`). Gaussian and Laplace multipliers grow by
    ``factor``, a discrete Laplace parameter ``a = 1/t`` shrinks by it, a randomized response's (and
    a pure event's) epsilon shrinks by it; compositions and sampling are kept."""
    f = float(factor)
    if isinstance(ev, (dpe.GaussianDpEvent, dpe.LaplaceDpEvent)):
        return type(ev)(noise_multiplier=float(ev.noise_multiplier) * f)
    if isinstance(ev, dpe.DiscreteLaplaceDpEvent):
        return dpe.DiscreteLaplaceDpEvent(noise_parameter=float(ev.noise_parameter) / f, sensitivity=ev.sensitivity)
    if isinstance(ev, dpe.RandomizedResponseDpEvent) and int(ev.num_buckets) == 2 and ev.noise_parameter > 0:
        eta = float(ev.noise_parameter)
        return dpe.RandomizedResponseDpEvent(noise_parameter=rr_noise(math.log((2.0 - eta) / eta) / f), num_buckets=2)
    if is_epsilon_delta(ev):
        return EpsilonDeltaDpEvent(float(ev.epsilon) / f, float(ev.delta))
    if isinstance(ev, dpe.ComposedDpEvent):
        return dpe.ComposedDpEvent([noisier_event(e, f) for e in ev.events])
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return dpe.SelfComposedDpEvent(noisier_event(ev.event, f), ev.count)
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        return dpe.PoissonSampledDpEvent(ev.sampling_probability, noisier_event(ev.event, f))
    if isinstance(ev, dpe.NoOpDpEvent):
        return ev
    raise ValueError(f"noisier_event: cannot rescale the noise of {describe_event(ev)}")


def contains(ev: Any, pred) -> bool:
    """Whether ``ev`` or one of its nested events satisfies ``pred``."""
    if pred(ev):
        return True
    if isinstance(ev, dpe.ComposedDpEvent):
        return any(contains(e, pred) for e in ev.events)
    if isinstance(ev, (dpe.SelfComposedDpEvent, dpe.PoissonSampledDpEvent)):
        return contains(ev.event, pred)
    return False


def describe_event(ev: Any) -> str:
    """A short name of an event: ``[RandomizedResponseDpEvent, DiscreteLaplaceDpEvent]``…"""
    if isinstance(ev, dpe.ComposedDpEvent):
        return "[" + ", ".join(describe_event(e) for e in ev.events) + "]"
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return f"{describe_event(ev.event)}x{ev.count}"
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        return f"PoissonSampled({describe_event(ev.event)})"
    return type(ev).__name__


def gaussian_multiplier(ev: Any) -> float | None:
    """The noise multiplier of a (top-level) GaussianDpEvent, else ``None``."""
    return float(ev.noise_multiplier) if isinstance(ev, dpe.GaussianDpEvent) else None
