"""Per-party privacy ledger and accountants (SPEC §5).

Every release a party makes (one batch of records through one mechanism, in one direction) is
charged to its :class:`Ledger` *before* the data leaves. The ledger turns what was charged into
an epsilon with one of five accountants and refuses a charge that would take the party over its
budget (:class:`~fl_split.errors.BudgetExceeded`, nothing recorded).

**Per-record view (default).** A :class:`~fl_split.privacy.base.PrivacyCost` describes one
release of *one record's* tensor. A record's privacy loss is the composition of the releases
that contained it; the reported epsilon is the maximum over records. Neighbouring datasets
differ in one record's *value* (replace-one): the sensitivities of the mechanisms are the largest
change of one record's released tensor, so a LaplaceDpEvent / GaussianDpEvent of noise
multiplier ``z`` is the shift-by-one pair of its noise distribution.

The ledger keeps, per record ID, how many times it was released under each distinct cost
(identical costs are grouped by a canonical JSON key of mechanism, event and parameters), and a
histogram of the distinct count vectors. Composition is monotone (dropping releases is
post-processing), so the worst record is among the Pareto-maximal count vectors, each composed
once and cached: a new composition happens only when the worst vector changes (about once per
epoch in a run), so a charge costs well under a millisecond otherwise.

**Accountants.**

* ``basic`` — sequential composition (Dwork & Roth Thm 3.16): the sum of per-release pure
  epsilons; releases without a pure epsilon (Gaussian) each get ``δ/T`` (``T`` = such releases of
  the worst record) and contribute their exact single-release epsilon at that delta
  (dp_accounting's analytic Gaussian, Balle & Wang 2018; PLD for other events).
* ``paper`` — 001 Cor. 4/5 (strong composition, Dwork-Rothblum-Vadhan 2010):
  ``ε_total = γε√(2T ln(1/δ)) + γε·T(e^{γε} − 1)`` with ``T`` the worst record's releases, ``ε`` the
  (common) pure per-release epsilon, ``γ`` the sampling rate under amplification and 1 without.
  Not applicable to (ε, δ)-only releases or to mixed per-release epsilons.
* ``pld`` — privacy loss distributions from ``dp_accounting.pld`` (pessimistic, connect-the-dots),
  composed per record, and never reported above ``basic`` (also a valid bound; the PLD's
  rounding can exceed it by one interval for few releases and its float arithmetic overflows
  for per-release losses of several hundred). The ``PLDAccountant`` class itself is not used for the per-record view:
  it rejects Laplace under replace-one and randomized response under add/remove, and (v0.6.0)
  ignores ``count`` for a self-composed RandomizedResponseDpEvent. The library's own PLD
  constructors are composed instead; for Laplace, Gaussian and their Poisson-subsampled forms
  this is exactly what ``PLDAccountant`` computes (tests check the equality).
* ``rdp`` — ``dp_accounting.rdp.RdpAccountant`` (default orders), replace-one relation;
  add/remove when Poisson-subsampled events are composed (amplification).
* ``opacus`` — Opacus' ``RDPAccountant`` for records whose releases are all Gaussian (DP-SGD
  steps or Gaussian cut-layer noise); a cross-check of ``rdp``.

A pure ε-DP part with no dp_accounting event (R3eLU's activation-state randomized response,
001 Cor. 2) is described by :class:`EpsilonDeltaDpEvent` ``(ε, 0)``: PLD uses the library's
``from_privacy_parameters`` and RDP binary randomized response of the same epsilon, whose output
pair dominates every ε-DP mechanism's (Kairouz, Oh & Viswanath 2015), so both stay valid upper
bounds.

**Amplification** (off by default, SPEC §5): training-phase entries are accounted globally as
``PoissonSampledDpEvent(B/N, event)`` composed once per training release (any record may be in
any batch under that model), test-phase entries stay per record, and the epsilon is the larger
of the two views. Amplification assumes Poisson batches hidden from the adversary; vertical
split learning provides neither (the host knows each batch's IDs).
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from fl_split.errors import BudgetExceeded, ConfigError
from fl_split.privacy.base import PrivacyCost

#: accountants a ledger can report and budget with (``opacus`` only for Gaussian releases)
ACCOUNTANTS = ("basic", "paper", "pld", "rdp", "opacus")
#: the accountants every report lists side by side ("opacus" is added for Gaussian-only ledgers)
REPORTED = ("basic", "paper", "pld", "rdp")
DIRECTIONS = ("forward", "backward", "update")
#: base PLD discretisation interval; the interval used for a composition is this times
#: ``max(1, largest per-release epsilon)`` — a relative resolution of 1e-4 of a release's loss,
#: which keeps large-epsilon releases (e.g. 003's per-pass epsilons in the hundreds) tractable.
#: The PLD is pessimistic: discretisation only ever rounds epsilon up.
PLD_INTERVAL = 1e-4
#: slack of the budget comparison (floating-point sums of equal epsilons)
BUDGET_SLACK = 1e-9
#: release counts up to this are composed exactly in the budget pre-check; above it they are
#: rounded up to a geometric grid (ratio GRID_RATIO), see :meth:`Ledger.charge`
GRID_EXACT = 16
GRID_RATIO = 1.05

_NR = dp_accounting.NeighboringRelation
_LOG_FIELDS = ("round", "phase", "epoch", "index", "direction", "cost", "n", "sample_rate")

if hasattr(dpe, "EpsilonDeltaDpEvent"):  # newer dp_accounting releases define it
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


#: single-release PLDs by (event, interval), shared by every ledger of the process: building one
#: (tens of ms for a Laplace PLD) is the expensive part, and the parties of a local run, or the
#: runs of a sweep, charge the same mechanisms. PLDs are immutable values, so sharing is safe.
_ATOMS: dict = {}


class _NotApplicable(Exception):
    """An accountant cannot account an event (the message says why)."""


@dataclass
class LedgerEntry:
    """One release of one batch: ``ids`` are the records in it (their count = samples released)."""

    round: int
    key: tuple  # BatchKey.as_tuple() = (phase, epoch, index)
    direction: str  # "forward" | "backward" | "update" (a DP-SGD step)
    cost: PrivacyCost
    ids: np.ndarray
    sample_rate: float | None = None  # B/N of the training split, used only with amplification


# -- DpEvent (de)serialisation ------------------------------------------------------------------
def _event_types() -> dict[str, type]:
    types = {name: cls for name, cls in vars(dpe).items()
             if isinstance(cls, type) and issubclass(cls, dpe.DpEvent)}
    types.setdefault("EpsilonDeltaDpEvent", EpsilonDeltaDpEvent)
    return types


_EVENT_TYPES = _event_types()


def event_to_json(ev: Any) -> dict:
    """A DpEvent as a JSON-able dict ``{"type": class name, field: value…}`` (nested events too)."""
    if not isinstance(ev, dpe.DpEvent) or not attr.has(type(ev)):
        raise TypeError(f"expected a dp_accounting DpEvent, got {type(ev).__name__}")
    out: dict[str, Any] = {"type": type(ev).__name__}
    for f in attr.fields(type(ev)):
        out[f.name] = _json_value(getattr(ev, f.name))
    return out


def _json_value(v: Any) -> Any:
    if isinstance(v, dpe.DpEvent):
        return event_to_json(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
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


def cost_to_json(cost: PrivacyCost) -> dict:
    return {"mechanism": cost.mechanism, "dp_event": event_to_json(cost.dp_event),
            "epsilon": None if cost.epsilon is None else float(cost.epsilon),
            "sensitivity_l1": None if cost.sensitivity_l1 is None else float(cost.sensitivity_l1),
            "sensitivity_l2": None if cost.sensitivity_l2 is None else float(cost.sensitivity_l2),
            "params": [[str(k), _json_value(v)] for k, v in cost.params]}


def cost_from_json(d: Mapping) -> PrivacyCost:
    return PrivacyCost(str(d["mechanism"]), event_from_json(d["dp_event"]), d["epsilon"],
                       sensitivity_l1=d["sensitivity_l1"], sensitivity_l2=d["sensitivity_l2"],
                       params=tuple((str(k), _freeze(v)) for k, v in d["params"]))


def cost_key(cost: PrivacyCost) -> str:
    """Stable identity of a cost: identical releases are grouped under it."""
    return json.dumps(cost_to_json(cost), sort_keys=True, separators=(",", ":"))


# -- events -> accountants --------------------------------------------------------------------
def _is_epsilon_delta(ev: Any) -> bool:
    return type(ev).__name__ == "EpsilonDeltaDpEvent" and hasattr(ev, "epsilon") and hasattr(ev, "delta")


#: largest epsilon a binary randomized response event can carry: beyond, ``e^ε`` overflows a
#: float (and dp_accounting's PLD constructors with it)
MAX_RR_EPSILON = 700.0


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


def canonical_event(ev: dpe.DpEvent) -> dpe.DpEvent:
    """Replace pure :class:`EpsilonDeltaDpEvent` parts by binary RR of the same epsilon (where an
    RR event can carry it)."""
    if _is_epsilon_delta(ev) and float(ev.delta) == 0.0 and float(ev.epsilon) <= MAX_RR_EPSILON:
        return dpe.RandomizedResponseDpEvent(noise_parameter=rr_noise(float(ev.epsilon)), num_buckets=2)
    if isinstance(ev, dpe.ComposedDpEvent):
        return dpe.ComposedDpEvent([canonical_event(e) for e in ev.events])
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return dpe.SelfComposedDpEvent(canonical_event(ev.event), ev.count)
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        return dpe.PoissonSampledDpEvent(ev.sampling_probability, canonical_event(ev.event))
    return ev


def _event_label(ev: Any) -> str:
    return type(ev).__name__


def event_pld(ev: dpe.DpEvent, count: int, interval: float,
              cache: dict | None = None) -> pld_lib.PrivacyLossDistribution:
    """PLD of ``count`` adaptive repetitions of ``ev``, built from dp_accounting's constructors.

    Plain Laplace / Gaussian / RR are the replace-one (shift) pairs; Poisson-subsampled
    Laplace / Gaussian use the library's add/remove subsampled PLDs (amplification). ``cache``
    keeps single-release PLDs (building a subsampled one is the expensive part). An
    :class:`EpsilonDeltaDpEvent` uses the library's ``from_privacy_parameters`` (for δ = 0 the
    same PLD as binary randomized response of that epsilon, up to rounding).
    """
    if count == 0 or isinstance(ev, dpe.NoOpDpEvent):
        return pld_lib.identity(value_discretization_interval=interval)
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return event_pld(ev.event, count * int(ev.count), interval, cache)
    if isinstance(ev, dpe.ComposedDpEvent):
        out = pld_lib.identity(value_discretization_interval=interval)
        for e in ev.events:
            out = out.compose(event_pld(e, count, interval, cache))
        return out
    if isinstance(ev, dpe.NonPrivateDpEvent):
        raise _NotApplicable("a non-private release has infinite epsilon")
    if isinstance(ev, dpe.GaussianDpEvent):
        _check_noise(ev.noise_multiplier, ev)
        # count Gaussians of multiplier z compose exactly into one of multiplier z/√count
        return pld_lib.from_gaussian_mechanism(float(ev.noise_multiplier) / math.sqrt(count),
                                               value_discretization_interval=interval)
    key = (repr(ev), interval)
    atom = None if cache is None else cache.get(key)
    if atom is None:
        atom = _atom_pld(ev, interval)
        if cache is not None:
            if len(cache) > 64:
                cache.clear()
            cache[key] = atom
    return atom if count == 1 else atom.self_compose(count)


def _atom_pld(ev: dpe.DpEvent, interval: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of one release of a leaf event."""
    if isinstance(ev, dpe.LaplaceDpEvent):
        _check_noise(ev.noise_multiplier, ev)
        return pld_lib.from_laplace_mechanism(float(ev.noise_multiplier), value_discretization_interval=interval)
    if isinstance(ev, dpe.RandomizedResponseDpEvent):
        if ev.num_buckets == 1:
            return pld_lib.identity(value_discretization_interval=interval)
        _check_noise(ev.noise_parameter, ev)
        return pld_lib.from_randomized_response(
            float(ev.noise_parameter), int(ev.num_buckets), value_discretization_interval=interval,
            neighboring_relation=_NR.REPLACE_ONE)
    if _is_epsilon_delta(ev):
        params = pld_common.DifferentialPrivacyParameters(float(ev.epsilon), float(ev.delta))
        return pld_lib.from_privacy_parameters(params, value_discretization_interval=interval)
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        q, inner = float(ev.sampling_probability), ev.event
        if isinstance(inner, dpe.GaussianDpEvent):
            _check_noise(inner.noise_multiplier, inner)
            return pld_lib.from_gaussian_mechanism(float(inner.noise_multiplier), sampling_prob=q,
                                                   value_discretization_interval=interval)
        if isinstance(inner, dpe.LaplaceDpEvent):
            _check_noise(inner.noise_multiplier, inner)
            return pld_lib.from_laplace_mechanism(float(inner.noise_multiplier), sampling_prob=q,
                                                  value_discretization_interval=interval)
        raise _NotApplicable(f"dp_accounting's PLD amplifies only Gaussian and Laplace releases by "
                             f"Poisson sampling, not {_describe_event(inner)}")
    raise _NotApplicable(f"dp_accounting's PLD has no {_event_label(ev)}")


def _check_noise(v: float, ev: Any) -> None:
    if not float(v) > 0:
        raise _NotApplicable(f"{_event_label(ev)} with noise {v} is not private (infinite epsilon)")


def _rdp_epsilon(events: list[tuple[dpe.DpEvent, int]], delta: float) -> float:
    subsampled = any(isinstance(canonical_event(e), dpe.PoissonSampledDpEvent) for e, _ in events)
    # replace-one for the per-record view; RDP of Poisson subsampling is for add/remove
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=_NR.ADD_OR_REMOVE_ONE if subsampled
                                          else _NR.REPLACE_ONE)
    for ev, n in events:
        ev = canonical_event(ev)
        if not acc.supports(ev):
            raise _NotApplicable(f"dp_accounting's RDP accountant does not support {_describe_event(ev)}"
                                 + (" (with Poisson-subsampled events in the same composition)" if subsampled else ""))
        acc.compose(ev, int(n))
    return float(acc.get_epsilon(delta))


def _describe_event(ev: Any) -> str:
    if isinstance(ev, dpe.ComposedDpEvent):
        return "[" + ", ".join(_describe_event(e) for e in ev.events) + "]"
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return f"{_describe_event(ev.event)}x{ev.count}"
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        return f"PoissonSampled({_describe_event(ev.event)})"
    return _event_label(ev)


def _gaussian_multiplier(ev: Any) -> float | None:
    return float(ev.noise_multiplier) if isinstance(ev, dpe.GaussianDpEvent) else None


def single_release_epsilon(ev: dpe.DpEvent, delta: float, interval: float = PLD_INTERVAL,
                           cache: dict | None = None) -> float:
    """Epsilon of one release of ``ev`` at ``delta``: dp_accounting's exact analytic Gaussian
    (Balle & Wang 2018) for a Gaussian event, its PLD otherwise."""
    z = _gaussian_multiplier(ev)
    if z is not None:
        _check_noise(z, ev)
        return float(dp_accounting.get_epsilon_gaussian(z, delta))
    return float(event_pld(ev, 1, interval, cache).get_epsilon_for_delta(delta))


def amplified_pure_epsilon(eps: float, q: float) -> float:
    """Pure epsilon of a Poisson-subsampled ε-DP release, ``ln(1 + q(e^ε − 1))`` (Balle, Barthe &
    Gaboardi 2018, Thm 8, add/remove)."""
    return math.log1p(q * math.expm1(eps)) if eps < 700 else eps + math.log(q)


def paper_epsilon(eps: float, releases: int, delta: float, gamma: float = 1.0) -> float:
    """001 Cor. 4/5: ``γε√(2T ln(1/δ)) + γε·T(e^{γε} − 1)`` (inf once ``e^{γε}`` overflows a float)."""
    ge = gamma * eps
    if ge > 700:
        return math.inf
    return ge * math.sqrt(2.0 * releases * math.log(1.0 / delta)) + ge * releases * math.expm1(ge)


# -- the ledger ---------------------------------------------------------------------------------
@dataclass
class _Plan:
    """The ledger state after a charge, computed without touching the ledger."""

    new_costs: dict[str, PrivacyCost]
    new_cols: list[tuple[str, bool]]
    touched: np.ndarray
    exists: np.ndarray
    pos: np.ndarray
    rows: np.ndarray  # new count rows of the touched records (width = all columns)
    hist: dict[tuple, int] | None  # None: not computed (the ledger's histogram goes stale)
    amp: dict[tuple[str, float | None], int]
    log: list[tuple]
    phases: list[str]


class Ledger:
    """A party's record of every release and its privacy accounting (see the module docstring).

    ``accountant`` is the one whose epsilon is reported as ``epsilon`` and compared with
    ``budget``; ``pld_interval`` is the base PLD discretisation (see :data:`PLD_INTERVAL`).
    """

    def __init__(self, party: str, *, accountant: str = "pld", delta: float = 1e-5,
                 budget: float | None = None, amplification: bool = False,
                 pld_interval: float = PLD_INTERVAL) -> None:
        if accountant not in ACCOUNTANTS:
            raise ConfigError("accountant", accountant, ", ".join(ACCOUNTANTS))
        if not (isinstance(delta, (int, float)) and 0.0 < float(delta) < 1.0):
            raise ConfigError("delta", delta, "a number strictly between 0 and 1")
        if budget is not None and not (isinstance(budget, (int, float)) and float(budget) > 0
                                       and math.isfinite(float(budget))):
            raise ConfigError("budget", budget, "'auto' (no budget) or a number > 0")
        if not (isinstance(pld_interval, (int, float)) and 0.0 < float(pld_interval) <= 1.0):
            raise ValueError(f"pld_interval: got {pld_interval!r}; allowed: a number in (0, 1]")
        self.party = str(party)
        self.accountant = accountant
        self.delta = float(delta)
        self.budget = None if budget is None else float(budget)
        self.amplification = bool(amplification)
        self.pld_interval = float(pld_interval)
        self._costs: dict[str, PrivacyCost] = {}  # canonical key -> cost, in order of first charge
        self._cols: list[tuple[str, bool]] = []  # count columns: (cost key, training phase)
        self._col_index: dict[tuple[str, bool], int] = {}
        self._ids = np.zeros(0, dtype=np.int64)  # sorted record IDs ever released
        self._counts = np.zeros((0, 0), dtype=np.int64)  # releases per record (row) and column
        #: sparse count vector -> number of records having it; ``None`` = stale (charges without a
        #: budget skip it, see :meth:`charge`), rebuilt from the counts when a view needs it
        self._hist: dict[tuple, int] | None = {}
        self._amp: dict[tuple[str, float | None], int] = {}  # (cost, q) -> training releases
        self._phases: list[str] = []
        self._log: dict[str, list] = {k: [] for k in _LOG_FIELDS}
        self._cache: dict[tuple, tuple[float | None, str | None]] = {}
        self._key_memo: dict[int, tuple[PrivacyCost, str]] = {}
        self._single: dict[tuple, float] = {}
        self._atoms = _ATOMS  # single-release PLDs, shared by the ledgers of this process
        self._limits: dict[tuple, tuple[int, int | None]] = {}  # budget bisection brackets
        self._cand_memo: dict[tuple, list[tuple]] = {}  # Pareto-maximal count vectors (see _groups)

    # -- public interface --------------------------------------------------------------------
    def charge(self, entries: Iterable[LedgerEntry]) -> None:
        """Atomically record ``entries``.

        The would-be epsilon under the selected accountant is computed first; if the accountant
        cannot account one of the releases a :class:`ConfigError` names it and the accountants
        that can, and if it exceeds the budget :class:`BudgetExceeded` is raised. Either way
        nothing is recorded.
        """
        entries = list(entries)
        if not entries:
            return
        # without a budget nothing needs the would-be epsilon: the count-vector histogram is
        # left stale and rebuilt only when an epsilon is asked for (about half of a charge's cost)
        plan = self._plan(entries, with_hist=self.budget is not None or self.accountant == "paper")
        why = self._inapplicable(self.accountant, plan)
        if why is not None:
            if plan.hist is None:  # naming the usable accountants needs every view
                plan = self._plan(entries)
            usable = [a for a in ACCOUNTANTS if a != self.accountant and self._inapplicable(a, plan) is None]
            mechs = sorted({c.mechanism for c in {**self._costs, **plan.new_costs}.values()})
            raise ConfigError("accountant", self.accountant, ", ".join(usable) or "none",
                              reason=f"{self.party}: the {self.accountant} accountant cannot account "
                                     f"{'/'.join(mechs)} releases: {why}")
        if self.budget is not None and not self._within_budget(plan):
            would = self._view(self.accountant, plan)[0]
            spent = self.epsilon()
            raise BudgetExceeded(self.party, 0.0 if spent is None else spent, would, self.budget, self.accountant)
        self._commit(plan)

    def would_be(self, entries: Iterable[LedgerEntry], accountant: str | None = None) -> float | None:
        """The epsilon if ``entries`` were charged (nothing is recorded)."""
        acc = self._accountant(accountant)
        entries = list(entries)
        return self._view(acc, self._plan(entries) if entries else None)[0]

    def epsilon(self, accountant: str | None = None) -> float | None:
        """Epsilon spent so far (``None``: the accountant does not apply to these releases)."""
        return self._view(self._accountant(accountant), None)[0]

    def __len__(self) -> int:
        return len(self._log["round"])

    @property
    def releases(self) -> int:
        """Record-releases: the sum of batch sizes over all entries."""
        return int(sum(self._log["n"]))

    def releases_per_record(self) -> int:
        """How many times the most released record was released."""
        return int(self._counts.sum(axis=1).max()) if len(self._ids) else 0

    def report(self) -> dict[str, Any]:
        """The party's privacy block (field meanings in docs/accounting.md)."""
        names = list(REPORTED)
        if self._costs and all(_gaussian_multiplier(c.dp_event) is not None for c in self._costs.values()):
            names.append("opacus")
        epsilons: dict[str, float | None] = {}
        reasons: dict[str, str] = {}
        for name in names:
            value, why = self._view(name, None)
            epsilons[name] = value
            if value is None:
                reasons[name] = why or "not applicable"
        if self.accountant not in epsilons:
            epsilons[self.accountant], why = self._view(self.accountant, None)
            if why:
                reasons[self.accountant] = why
        by_direction: dict[str, dict[str, int]] = {}
        for d, n in zip(self._log["direction"], self._log["n"]):
            slot = by_direction.setdefault(DIRECTIONS[d], {"batches": 0, "releases": 0})
            slot["batches"] += 1
            slot["releases"] += int(n)
        per_cost = self._releases_per_cost()
        mechanisms = [{"name": c.mechanism, "params": {k: _json_value(v) for k, v in c.params},
                       "epsilon": c.epsilon, "sensitivity_l1": c.sensitivity_l1,
                       "sensitivity_l2": c.sensitivity_l2, "dp_event": event_to_json(c.dp_event),
                       "releases": per_cost.get(k, 0)} for k, c in self._costs.items()]
        return {
            "releases": self.releases,
            "batches": len(self),
            "releases_per_record": self.releases_per_record(),
            "delta": self.delta,
            "epsilon": epsilons[self.accountant],
            "accountant": self.accountant,
            "epsilons": epsilons,
            "budget": self.budget,
            "amplification": self.amplification,
            "assumptions": self._assumptions(reasons),
            "mechanisms": mechanisms,
            "by_direction": by_direction,
            "pld_interval": self.pld_interval,
        }

    def export_state(self) -> dict[str, Any]:
        """Everything, as NumPy arrays and JSON-able values (for :func:`fl_split.state.flatten`)."""
        keys = list(self._costs)
        index = {k: i for i, k in enumerate(keys)}
        return {
            "format": 1,
            "party": self.party,
            "accountant": self.accountant,
            "delta": self.delta,
            "budget": self.budget,
            "amplification": self.amplification,
            "pld_interval": self.pld_interval,
            "costs": [cost_to_json(self._costs[k]) for k in keys],
            "columns": [[index[k], bool(t)] for k, t in self._cols],
            "ids": self._ids.copy(),
            "counts": self._counts.copy(),
            "amp": [[index[k], q, int(n)] for (k, q), n in self._amp.items()],
            "phases": list(self._phases),
            "log": {f: np.asarray(self._log[f], dtype=np.float64 if f == "sample_rate" else np.int64)
                    for f in _LOG_FIELDS},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "Ledger":
        """Rebuild a ledger from :meth:`export_state` (exact: same reports, same budget)."""
        if not isinstance(state, Mapping) or state.get("format") != 1:
            raise ValueError("ledger state: not a state exported by Ledger.export_state (format 1)")
        led = cls(state["party"], accountant=state["accountant"], delta=state["delta"],
                  budget=state["budget"], amplification=bool(state["amplification"]),
                  pld_interval=state["pld_interval"])
        costs = [cost_from_json(c) for c in state["costs"]]
        keys = [cost_key(c) for c in costs]
        led._costs = dict(zip(keys, costs))
        led._cols = [(keys[int(i)], bool(t)) for i, t in state["columns"]]
        led._col_index = {c: j for j, c in enumerate(led._cols)}
        ids = np.asarray(state["ids"], dtype=np.int64).reshape(-1)
        counts = np.asarray(state["counts"], dtype=np.int64).reshape(len(ids), len(led._cols))
        if len(ids) > 1 and not (np.diff(ids) > 0).all():
            raise ValueError("ledger state: record IDs are not strictly increasing")
        led._ids, led._counts = ids, counts
        led._hist = _histogram(counts)
        led._amp = {(keys[int(i)], None if q is None else float(q)): int(n) for i, q, n in state["amp"]}
        led._phases = [str(p) for p in state["phases"]]
        log = state["log"]
        for f in _LOG_FIELDS:
            arr = np.asarray(log[f])
            led._log[f] = ([None if math.isnan(v) else float(v) for v in arr.tolist()] if f == "sample_rate"
                           else [int(v) for v in arr.tolist()])
        return led

    # -- planning a charge -------------------------------------------------------------------
    def _accountant(self, accountant: str | None) -> str:
        acc = self.accountant if accountant is None else accountant
        if acc not in ACCOUNTANTS:
            raise ConfigError("accountant", acc, ", ".join(ACCOUNTANTS))
        return acc

    def _cost_key(self, cost: PrivacyCost) -> str:
        memo = self._key_memo.get(id(cost))
        if memo is not None and memo[0] is cost:
            return memo[1]
        key = cost_key(cost)
        if len(self._key_memo) > 256:
            self._key_memo.clear()
        self._key_memo[id(cost)] = (cost, key)  # holds the object so its id is not reused
        return key

    def _validate(self, e: Any) -> tuple[str, int, int, int, PrivacyCost, np.ndarray, float | None]:
        if not isinstance(e, LedgerEntry):
            raise TypeError(f"{self.party}: ledger entries must be LedgerEntry objects, got {type(e).__name__}")
        key = e.key.as_tuple() if hasattr(e.key, "as_tuple") else e.key
        if not (isinstance(key, (tuple, list)) and len(key) == 3 and isinstance(key[0], str)):
            raise ValueError(f"{self.party}: ledger entry key {e.key!r}; allowed: (phase, epoch, index)")
        if e.direction not in DIRECTIONS:
            raise ValueError(f"{self.party}: ledger entry direction {e.direction!r}; allowed: {', '.join(DIRECTIONS)}")
        if not isinstance(e.cost, PrivacyCost) or not isinstance(e.cost.dp_event, dpe.DpEvent):
            raise TypeError(f"{self.party}: ledger entry cost must be a PrivacyCost with a dp_accounting "
                            f"DpEvent, got {e.cost!r}")
        ids = np.asarray(e.ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"{self.party}: ledger entry ids must be a 1-D integer array, got "
                             f"dtype {ids.dtype} shape {ids.shape}")
        q = e.sample_rate
        if q is not None and not (isinstance(q, (int, float, np.floating)) and 0.0 < float(q) <= 1.0):
            raise ValueError(f"{self.party}: ledger entry sample_rate {q!r}; allowed: None or a number in (0, 1]")
        if self.amplification and key[0] == "train" and q is None:
            raise ValueError(f"{self.party}: with amplification every training entry needs its "
                             f"sample_rate (batch size / training records)")
        return (key[0], int(key[1]), int(key[2]), DIRECTIONS.index(e.direction), e.cost,
                ids.astype(np.int64, copy=False), None if q is None else float(q))

    def _plan(self, entries: list[LedgerEntry], with_hist: bool = True) -> _Plan:
        new_costs: dict[str, PrivacyCost] = {}
        new_cols: list[tuple[str, bool]] = []
        new_col_index: dict[tuple[str, bool], int] = {}
        col_of: list[int] = []
        ids_of: list[np.ndarray] = []
        amp = dict(self._amp)
        log = []
        phases = list(self._phases)
        for e in entries:
            phase, epoch, index, direction, cost, ids, q = self._validate(e)
            key = self._cost_key(cost)
            if key not in self._costs and key not in new_costs:
                new_costs[key] = cost
            train = phase == "train"
            col = (key, train)
            j = self._col_index.get(col)
            if j is None:
                j = new_col_index.get(col)
                if j is None:
                    j = new_col_index[col] = len(self._cols) + len(new_cols)
                    new_cols.append(col)
            col_of.append(j)
            ids_of.append(ids)
            if train:
                aq = None if (q is None or q >= 1.0) else q
                amp[(key, aq)] = amp.get((key, aq), 0) + 1
            if phase not in phases:
                phases.append(phase)
            log.append((int(e.round), phases.index(phase), epoch, index, direction, key, len(ids), q))
        width = len(self._cols) + len(new_cols)
        all_ids = np.concatenate(ids_of) if ids_of else np.zeros(0, dtype=np.int64)
        cols = np.repeat(np.asarray(col_of, dtype=np.int64), [len(i) for i in ids_of])
        touched, inv = np.unique(all_ids, return_inverse=True)
        rows = np.zeros((len(touched), width), dtype=np.int64)
        np.add.at(rows, (inv.reshape(-1), cols), 1)
        pos = np.searchsorted(self._ids, touched)
        exists = pos < len(self._ids)
        exists[exists] = self._ids[pos[exists]] == touched[exists]
        old = np.zeros_like(rows)
        old[exists, :self._counts.shape[1]] = self._counts[pos[exists]]
        rows += old
        if not with_hist:
            return _Plan(new_costs, new_cols, touched, exists, pos, rows, None, amp, log, phases)
        hist = dict(self._current_hist())
        for block, sign in ((old[exists], -1), (rows, 1)):
            # count vectors of a batch are few and short: grouping Python tuples is ~20x faster
            # than np.unique(axis=0) at batch sizes (this runs on every charge)
            for row, m in Counter(map(tuple, block.tolist())).items():
                k = _sparse(row)
                v = hist.get(k, 0) + sign * m
                if v:
                    hist[k] = v
                else:
                    hist.pop(k, None)
        return _Plan(new_costs, new_cols, touched, exists, pos, rows, hist, amp, log, phases)

    def _commit(self, plan: _Plan) -> None:
        self._costs.update(plan.new_costs)
        for col in plan.new_cols:
            self._col_index[col] = len(self._cols)
            self._cols.append(col)
        if plan.new_cols:
            self._counts = np.pad(self._counts, ((0, 0), (0, len(self._cols) - self._counts.shape[1])))
        ex = plan.exists
        if ex.any():
            self._counts[plan.pos[ex]] = plan.rows[ex]
        if (~ex).any():
            self._ids = np.insert(self._ids, plan.pos[~ex], plan.touched[~ex])
            self._counts = np.insert(self._counts, plan.pos[~ex], plan.rows[~ex], axis=0)
        self._hist = plan.hist
        self._amp = plan.amp
        self._phases = plan.phases
        index = {k: i for i, k in enumerate(self._costs)}
        for rnd, phase, epoch, idx, direction, key, n, q in plan.log:
            for f, v in zip(_LOG_FIELDS, (rnd, phase, epoch, idx, direction, index[key], n, q)):
                self._log[f].append(v)

    # -- views -------------------------------------------------------------------------------
    def _current_hist(self) -> dict[tuple, int]:
        if self._hist is None:
            self._hist = _histogram(self._counts)
        return self._hist

    def _state(self, plan: _Plan | None, with_hist: bool = True):
        """``(costs, columns, histogram, amplified counts)`` now or after ``plan``; the histogram
        is ``None`` unless ``with_hist`` (only the per-record views need it)."""
        if plan is None:
            return self._costs, self._cols, self._current_hist() if with_hist else None, self._amp
        if with_hist and plan.hist is None:
            raise RuntimeError("ledger: this view needs a plan computed with its histogram")
        costs = {**self._costs, **plan.new_costs}
        return costs, self._cols + plan.new_cols, plan.hist if with_hist else None, plan.amp

    def _groups(self, plan: _Plan | None) -> list[list[tuple[str, float | None, int]]]:
        """What is composed: one ``[(cost key, sampling rate or None, releases)]`` per view."""
        costs, cols, hist, amp = self._state(plan)
        # the Pareto filter is quadratic in the distinct count vectors; which vectors exist changes
        # far less often than their multiplicities (columns are append-only, so their number
        # identifies them)
        memo_key = (frozenset(hist), len(cols))
        per_record = self._cand_memo.get(memo_key)
        if per_record is None:
            per_record = _candidates(hist, cols, skip_train=self.amplification)
            if len(self._cand_memo) > 256:
                self._cand_memo.clear()
            self._cand_memo[memo_key] = per_record
        groups = [[(k, None, n) for k, n in vec] for vec in per_record]
        if self.amplification and amp:
            groups.append(sorted(((k, q, n) for (k, q), n in amp.items()), key=lambda t: (t[0], t[1] or 1.0)))
        return groups

    def _inapplicable(self, accountant: str, plan: _Plan | None) -> str | None:
        """Why ``accountant`` cannot account the releases (``None``: it can). Structural, so it is
        decided on one release of each kind of release charged (cached)."""
        costs, cols, _, amp = self._state(plan, with_hist=False)
        kinds = {(k, None) for k, train in cols if not (self.amplification and train)}
        if self.amplification:
            kinds |= set(amp)
        for k, q in sorted(kinds, key=lambda t: (t[0], t[1] or 1.0)):
            why = self._items_epsilon(accountant, ((k, q, 1),), costs)[1]
            if why is not None:
                return why
        if accountant == "paper":  # needs one epsilon and one rate per composition
            for items in self._groups(plan):
                why = self._items_epsilon(accountant, tuple((k, q, 1) for k, q, _ in items), costs)[1]
                if why is not None:
                    return why
        return None

    def _within_budget(self, plan: _Plan) -> bool:
        """Whether the selected accountant's epsilon after ``plan`` stays within the budget.

        Composition is monotone in the release counts (dropping releases is post-processing),
        which avoids a new composition per charge (under amplification the count changes every
        step): a view of one kind of release keeps the largest count known to fit and the
        smallest known not to (found by doubling, then bisection) and composes only when a count
        falls in between; a
        mixed view first tries its counts rounded up to a coarse grid, then the exact value.
        """
        acc, limit = self.accountant, self.budget + BUDGET_SLACK
        costs = self._state(plan)[0]
        for items in self._groups(plan):
            if len(items) == 1:
                k, q, n = items[0]
                lo, hi = self._limits.get((acc, k, q), (0, None))
                if hi is None and n > lo:  # probe ahead (doubling), so a run composes O(log T) times
                    g = _grid(max(n, 2 * lo))
                    if self._items_epsilon(acc, ((k, q, g),), costs)[0] <= limit:
                        lo = g
                    else:
                        hi = g
                while n > lo and (hi is None or n < hi):
                    mid = n if hi is None else (lo + hi) // 2 if hi - lo > 1 else n
                    if self._items_epsilon(acc, ((k, q, mid),), costs)[0] <= limit:
                        lo = max(lo, mid)
                    else:
                        hi = mid if hi is None else min(hi, mid)
                self._limits[(acc, k, q)] = (lo, hi)
                if n > lo:
                    return False
                continue
            value = self._items_epsilon(acc, tuple((k, q, _grid(n)) for k, q, n in items), costs)[0]
            if value > limit and self._items_epsilon(acc, tuple(items), costs)[0] > limit:
                return False
        return True

    def _view(self, accountant: str, plan: _Plan | None, bound: bool = False) -> tuple[float | None, str | None]:
        """Epsilon under ``accountant`` of the current state (or of ``plan``'s), with the reason
        when it does not apply; ``bound``: an upper bound from counts rounded up to the grid."""
        costs = self._state(plan)[0]
        groups = self._groups(plan)
        if bound:
            groups = [[(k, q, _grid(n)) for k, q, n in items] for items in groups]
        best = 0.0
        for items in groups:
            value, why = self._items_epsilon(accountant, tuple(items), costs)
            if value is None:
                return None, why
            best = max(best, value)
        return best, None

    def _items_epsilon(self, accountant: str, items: tuple, costs: Mapping[str, PrivacyCost]):
        ck = (accountant, items)
        hit = self._cache.get(ck)
        if hit is not None:
            return hit
        try:
            value, why = float(self._compute(accountant, items, costs)), None
        except _NotApplicable as exc:
            value, why = None, str(exc)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[ck] = (value, why)
        return value, why

    def _event(self, cost: PrivacyCost, q: float | None) -> dpe.DpEvent:
        return cost.dp_event if q is None else dpe.PoissonSampledDpEvent(q, cost.dp_event)

    def _interval(self, items, costs) -> float:
        scale = 1.0
        for k, q, _ in items:
            cost = costs[k]
            s = cost.epsilon
            if s is None:
                z = _gaussian_multiplier(cost.dp_event)
                s = float(dp_accounting.get_epsilon_gaussian(z, self.delta)) if z else 1.0
            if q is not None:
                s = amplified_pure_epsilon(s, q)
            scale = max(scale, s)
        return self.pld_interval * scale

    def _compute(self, accountant: str, items: tuple, costs: Mapping[str, PrivacyCost]) -> float:
        delta = self.delta
        if accountant == "basic":
            total, other = 0.0, []
            for k, q, n in items:
                cost = costs[k]
                if cost.epsilon is not None:
                    total += n * (cost.epsilon if q is None else amplified_pure_epsilon(cost.epsilon, q))
                else:
                    other.append((k, q, n))
            t = sum(n for _, _, n in other)
            for k, q, n in other:  # each (ε, δ)-only release gets δ/T
                sk = (k, q, t)
                if sk not in self._single:
                    if len(self._single) > 4096:
                        self._single.clear()
                    self._single[sk] = single_release_epsilon(self._event(costs[k], q), delta / t,
                                                              self._interval([(k, q, 1)], costs), self._atoms)
                total += n * self._single[sk]
            return total
        if accountant == "paper":
            eps = {costs[k].epsilon for k, _, _ in items}
            if None in eps:
                names = sorted({costs[k].mechanism for k, _, _ in items if costs[k].epsilon is None})
                raise _NotApplicable(f"001 Cor. 4/5 needs pure epsilon-DP releases; {', '.join(names)} "
                                     f"releases are only (epsilon, delta)-DP")
            values = sorted(eps)
            if not math.isclose(values[0], values[-1], rel_tol=1e-12):
                raise _NotApplicable(f"001 Cor. 4/5 needs one per-release epsilon; releases have "
                                     f"{', '.join(f'{v:g}' for v in values)}")
            rates = {q for _, q, _ in items}
            if len(rates) > 1:
                raise _NotApplicable("001 Cor. 4/5 needs one sampling rate; entries have several")
            q = next(iter(rates))
            return paper_epsilon(values[-1], sum(n for _, _, n in items), delta, 1.0 if q is None else q)
        if accountant == "pld":
            interval = self._interval(items, costs)
            with warnings.catch_warnings():  # float overflow for losses in the hundreds: inf, capped below
                warnings.simplefilter("ignore", RuntimeWarning)
                try:
                    out = pld_lib.identity(value_discretization_interval=interval)
                    for k, q, n in items:
                        out = out.compose(event_pld(self._event(costs[k], q), n, interval, self._atoms))
                    eps = float(out.get_epsilon_for_delta(delta))
                except OverflowError:  # losses beyond ~700 nats: the library cannot build the PLD
                    eps = math.inf
            # basic composition is also a valid (ε, δ) bound: the PLD never reports above it (its
            # pessimistic rounding can exceed it by an interval for few releases, and its float
            # arithmetic overflows for per-release losses of several hundred)
            basic = self._compute("basic", items, costs)
            return eps if math.isfinite(eps) and eps <= basic else basic
        if accountant == "rdp":
            return _rdp_epsilon([(self._event(costs[k], q), n) for k, q, n in items], delta)
        if accountant == "opacus":
            history = []
            for k, q, n in items:
                z = _gaussian_multiplier(costs[k].dp_event)
                if z is None:
                    raise _NotApplicable(f"Opacus accounts Gaussian mechanisms (DP-SGD) only, not "
                                         f"{costs[k].mechanism} ({_describe_event(costs[k].dp_event)})")
                history.append((z, 1.0 if q is None else q, int(n)))
            from opacus.accountants import RDPAccountant

            acc = RDPAccountant()
            acc.history = history  # (noise multiplier, sample rate, steps), Opacus' own bookkeeping
            with warnings.catch_warnings():  # "optimal order is the smallest alpha" at tiny noise
                warnings.simplefilter("ignore", UserWarning)
                return float(acc.get_epsilon(delta))
        raise ConfigError("accountant", accountant, ", ".join(ACCOUNTANTS))

    # -- report helpers ----------------------------------------------------------------------
    def _releases_per_cost(self) -> dict[str, int]:
        out: dict[str, int] = {}
        keys = list(self._costs)
        for c, n in zip(self._log["cost"], self._log["n"]):
            out[keys[c]] = out.get(keys[c], 0) + int(n)
        return out

    def _assumptions(self, reasons: Mapping[str, str]) -> list[str]:
        out = []
        if self.amplification:
            out.append("amplification by subsampling: training releases are accounted as Poisson-sampled "
                       "(rate = batch size / training records) and composed once per training batch; this "
                       "assumes Poisson batches hidden from the adversary, which vertical split learning does "
                       "not provide (the host knows every batch's IDs and batches are shuffled fixed-size "
                       "slices), so this epsilon is optimistic; test-phase releases stay per record")
        else:
            out.append(f"per-record view: each record's loss composes the releases that contained it "
                       f"(at most {self.releases_per_record()} per record); epsilon is the worst record's; "
                       f"no amplification by subsampling is claimed (the host knows which IDs are in each batch)")
        out.append("neighbouring datasets differ in one record's value (replace-one); sensitivities bound "
                   "the change of one record's released tensor" + (" (add/remove for the Poisson-sampled "
                                                                   "training view)" if self.amplification else ""))
        if any(c.epsilon is None for c in self._costs.values()):
            out.append("basic: each (epsilon, delta)-only release of the worst record is counted at delta/T "
                       "(T = such releases) and the per-release epsilons are summed")
        if "paper" not in reasons and self._costs:
            out.append("paper: 001 Cor. 4/5 strong composition with the releases of the worst record as T"
                       + (" and gamma = sampling rate" if self.amplification else " and gamma = 1")
                       + "; it can exceed basic composition for few releases")
        for name, why in reasons.items():
            out.append(f"{name} accountant not applicable: {why}")
        if any(c.mechanism == "dpsgd" for c in self._costs.values()):
            out.append("DP-SGD ('update' entries) protects what the trained parameters reveal, not the "
                       "cut-layer tensors the party exchanges")
        if any(_is_epsilon_delta_inside(c.dp_event) for c in self._costs.values()):
            out.append("pure epsilon-DP parts without a dp_accounting event (EpsilonDeltaDpEvent) are "
                       "accounted as binary randomized response of the same epsilon (their dominating pair); "
                       f"beyond epsilon {MAX_RR_EPSILON:g}, which no float can carry as e^epsilon, by basic "
                       "composition only")
        return out


def _is_epsilon_delta_inside(ev: Any) -> bool:
    if _is_epsilon_delta(ev):
        return True
    if isinstance(ev, dpe.ComposedDpEvent):
        return any(_is_epsilon_delta_inside(e) for e in ev.events)
    if isinstance(ev, (dpe.SelfComposedDpEvent, dpe.PoissonSampledDpEvent)):
        return _is_epsilon_delta_inside(ev.event)
    return False


def _grid(n: int) -> int:
    """Smallest grid count >= n: exact up to GRID_EXACT, then geometric steps of GRID_RATIO."""
    g = GRID_EXACT
    if n <= g:
        return n
    while g < n:
        g = math.ceil(g * GRID_RATIO)
    return g


def _sparse(row) -> tuple:
    """``((column, count), …)`` of the non-zero counts of one record's count vector."""
    return tuple((j, int(v)) for j, v in enumerate(row) if v)


def _histogram(counts: np.ndarray) -> dict[tuple, int]:
    return {k: m for row, m in Counter(map(tuple, counts.tolist())).items() if (k := _sparse(row))}


def _candidates(hist: Mapping[tuple, int], cols: list[tuple[str, bool]], skip_train: bool) -> list[tuple]:
    """Pareto-maximal per-record count vectors, aggregated by cost: ``((cost key, n), …)``."""
    vecs = set()
    for sparse in hist:
        agg: dict[str, int] = {}
        for j, n in sparse:
            k, train = cols[j]
            if skip_train and train:
                continue
            agg[k] = agg.get(k, 0) + n
        if agg:
            vecs.add(tuple(sorted(agg.items())))
    dicts = [(v, dict(v)) for v in vecs]
    out = []
    for v, d in dicts:
        dominated = any(w != v and all(e.get(k, 0) >= n for k, n in d.items()) for w, e in dicts)
        if not dominated:
            out.append(v)
    return sorted(out)
