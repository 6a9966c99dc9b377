"""Accountants: how a composition of releases becomes an epsilon (analysis only, no state).

The ledger (:mod:`fl_split.privacy.ledger`) records what a party released; it hands each
accountant :class:`View` objects — one composition each — and reports the largest epsilon. An
accountant is a small class behind one interface, :meth:`Accountant.epsilon` ``(view, delta)``,
which raises :class:`NotApplicable` with a reason when it cannot account the view, and there is
ONE registry (:func:`accountant_names`, :func:`get_accountant`) that the configuration, the CLI
and the ledger all read.

Importing this module is cheap (no dp_accounting, Opacus or NumPy: ``fl-split --help`` lists the
accountants from here); the libraries are imported inside the methods that use them.

**Views.** Neighbouring datasets differ in one record's value (replace-one); every event is the
replace-one event of one release of one record.

* ``records`` — the releases of one record: ``items = ((release, count), …)``. Without
  amplification every record is a view (the ledger passes the Pareto-maximal ones, or a bound).
* ``steps`` — the training steps: ``items = ((step, count), …)`` with ``step = (members, q)``,
  ``members = ((release, n), …)`` everything the party released about one training batch and
  ``q`` its sampling rate ``B/N`` (1.0: not sampled). Used with amplification (the batch is one
  Poisson-sampled event containing all its releases) and by the ``paper`` accountant (001
  Cor. 4/5 counts steps).

**Accountants** (docs/accounting.md has the details and the tests that check each):
``basic``, ``paper``, ``paper-record``, ``pld``, ``rdp``, ``opacus``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fl_split.errors import ConfigError

#: base PLD discretisation interval; the interval of a composition is this times
#: ``max(1, largest per-release epsilon)`` (a relative resolution of 1e-4 of a release's loss). The
#: PLD is pessimistic: discretisation only ever rounds epsilon up.
PLD_INTERVAL = 1e-4
#: at most this many distinct pure-DP releases are composed as PLDs of their own in one
#: composition; the smaller ones are merged into one pure-DP release of their summed epsilon
#: (basic composition), and as many distinct subsampled Gaussians are kept before each is replaced
#: by the least noisy one of its rate
MAX_PLD_ATOMS = 64

RECORDS = "records"
STEPS = "steps"

#: note identifiers an accountant adds while computing (the report turns them into assumptions)
NOTE_BASIC_DELTA = "basic-delta"
NOTE_PLD_TAIL = "pld-tail"
NOTE_PLD_SGAUSS = "pld-sgauss-dominated"
NOTE_STEPS_GAUSSIAN = "steps-gaussian"
NOTE_STEPS_LAPLACE = "steps-laplace"
NOTE_STEPS_PURE = "steps-pure"
NOTE_STEPS_MIXED = "steps-mixed-basic"
NOTE_STEPS_APPROX = "steps-mixed-pld"
NOTE_PLD_BASIC_CAP = "pld-basic-cap"
NOTE_PLD_SLACK = "pld-slack"


class NotApplicable(Exception):
    """An accountant cannot account a view; ``str(exc)`` says why."""


@dataclass(frozen=True)
class Release:
    """One kind of release as accountants see it: the replace-one ``DpEvent`` of one release of one
    record, its pure epsilon (``None``: only (ε, δ)-DP) and the mechanism that charged it."""

    event: Any
    epsilon: float | None
    mechanism: str


@dataclass(frozen=True)
class View:
    """One composition (see the module docstring for ``kind`` and ``items``)."""

    kind: str
    items: tuple
    releases: Sequence[Release] = field(compare=False, hash=False, repr=False)
    pld_interval: float = PLD_INTERVAL

    def replace(self, items: tuple) -> "View":
        return View(self.kind, items, self.releases, self.pld_interval)

    def release_ids(self) -> list[int]:
        if self.kind == RECORDS:
            return [r for r, _ in self.items]
        return sorted({r for (members, _q), _c in self.items for r, _ in members})


# -- registry -----------------------------------------------------------------------------------
_REGISTRY: dict[str, type["Accountant"]] = {}
_INSTANCES: dict[str, "Accountant"] = {}


def register(cls: type["Accountant"]) -> type["Accountant"]:
    """Class decorator: make an accountant available by its ``name`` (in the order registered)."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"accountant name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def accountant_names() -> tuple[str, ...]:
    """Every accountant a ledger can report and budget with (the ``--accountant`` choices)."""
    return tuple(_REGISTRY)


def get_accountant(name: str) -> "Accountant":
    """The accountant called ``name``; a :class:`ConfigError` naming the choices otherwise."""
    acc = _INSTANCES.get(name) if isinstance(name, str) else None
    if acc is None:
        cls = _REGISTRY.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ConfigError("accountant", name, ", ".join(accountant_names()))
        acc = _INSTANCES[name] = cls()
    return acc


def reported_names(releases: Sequence[Release]) -> list[str]:
    """The accountants a report lists for a ledger holding ``releases``."""
    return [n for n in accountant_names() if get_accountant(n).listed(releases)]


class Accountant:
    """One way of turning a composition into an epsilon. Subclasses set ``name`` and implement
    :meth:`epsilon` (and usually :meth:`check_unit`)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: which view of the training releases this accountant reads: ``"records"`` (always per
    #: record), ``"steps"`` (always per training step) or ``None`` (steps under amplification,
    #: records otherwise). Test-phase releases are always read per record.
    training: ClassVar[str | None] = None
    #: the value never exceeds basic composition of the same view (the ledger's budget check
    #: accepts without computing it when basic fits)
    capped_by_basic: ClassVar[bool] = False
    #: applicability is decided one release (records) or one step (steps) at a time
    structural: ClassVar[bool] = True

    def listed(self, releases: Sequence[Release]) -> bool:
        """Whether a report lists this accountant for a ledger holding ``releases``."""
        return True

    def check_unit(self, kind: str, unit: Any, releases: Sequence[Release]) -> None:
        """Raise :class:`NotApplicable` if one release (``kind == "records"``, ``unit`` its index)
        or one training step (``unit = (members, q)``) cannot be accounted."""

    def check(self, view: View) -> None:
        """Raise :class:`NotApplicable` if the view cannot be accounted (cheap: no composition)."""
        for unit, _ in view.items:
            self.check_unit(view.kind, unit, view.releases)

    def epsilon(self, view: View, delta: float, notes: set | None = None) -> float:
        """The epsilon of ``view`` at ``delta``; ``notes`` collects which approximations were used."""
        raise NotImplementedError


# -- closed forms -------------------------------------------------------------------------------
def amplified_pure_epsilon(eps: float, q: float) -> float:
    """Pure epsilon of a Poisson-subsampled ε-DP release, ``ln(1 + q(e^ε − 1))`` (Balle, Barthe &
    Gaboardi 2018, Thm 8, add/remove); ``q >= 1`` is no sampling."""
    if q >= 1.0:
        return float(eps)
    return math.log1p(q * math.expm1(eps)) if eps < 700 else eps + math.log(q)


def paper_epsilon(eps: float, steps: int, delta: float, gamma: float = 1.0) -> float:
    """001 Cor. 4/5: ``γε√(2T ln(1/δ)) + γε·T(e^{γε} − 1)`` (inf once ``e^{γε}`` overflows a float)."""
    ge = gamma * eps
    if ge > 700:
        return math.inf
    return ge * math.sqrt(2.0 * steps * math.log(1.0 / delta)) + ge * steps * math.expm1(ge)


def merged_gaussian(terms: Iterable[tuple[float, int]]) -> float:
    """Noise multiplier of the one Gaussian that ``n`` releases of each multiplier ``z`` compose to
    exactly: ``(Σ n/z²)^(-1/2)`` (a Gaussian of multiplier z repeated n times is one of z/√n)."""
    return sum(n / (z * z) for z, n in terms) ** -0.5


# -- events: support and single-release PLDs ------------------------------------------------------
def _dpe():
    from dp_accounting import dp_event

    return dp_event


def _noise_ok(v: float, ev: Any) -> None:
    if not float(v) > 0:
        raise NotApplicable(f"{type(ev).__name__} with noise {v} is not private (infinite epsilon)")


def pld_support(ev: Any) -> None:
    """Raise :class:`NotApplicable` unless the ledger's PLD can account one release of ``ev``."""
    from fl_split.privacy.events import is_epsilon_delta

    dpe = _dpe()
    if isinstance(ev, dpe.NoOpDpEvent):
        return
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return pld_support(ev.event)
    if isinstance(ev, dpe.ComposedDpEvent):
        for e in ev.events:
            pld_support(e)
        return
    if isinstance(ev, dpe.NonPrivateDpEvent):
        raise NotApplicable("a non-private release has infinite epsilon")
    if isinstance(ev, (dpe.GaussianDpEvent, dpe.LaplaceDpEvent)):
        return _noise_ok(ev.noise_multiplier, ev)
    if isinstance(ev, dpe.DiscreteLaplaceDpEvent):
        _noise_ok(ev.noise_parameter, ev)
        if int(ev.sensitivity) != ev.sensitivity or ev.sensitivity < 0:
            raise NotApplicable(f"DiscreteLaplaceDpEvent sensitivity {ev.sensitivity!r} is not an integer >= 0")
        return
    if isinstance(ev, dpe.RandomizedResponseDpEvent):
        if ev.num_buckets != 1:
            _noise_ok(ev.noise_parameter, ev)
        return
    if _is_skellam(ev):
        _noise_ok(ev.mu, ev)
        if int(ev.sensitivity) != ev.sensitivity or ev.sensitivity < 0:
            raise NotApplicable(f"SkellamDpEvent sensitivity {ev.sensitivity!r} is not an integer >= 0")
        return
    if is_epsilon_delta(ev):
        if not (0.0 <= float(ev.epsilon) < math.inf and 0.0 <= float(ev.delta) < 1.0):
            raise NotApplicable(f"EpsilonDeltaDpEvent({ev.epsilon}, {ev.delta}) is not a privacy guarantee")
        return
    if isinstance(ev, dpe.PoissonSampledDpEvent) and isinstance(ev.event, (dpe.GaussianDpEvent, dpe.LaplaceDpEvent)):
        return _noise_ok(ev.event.noise_multiplier, ev.event)
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        from fl_split.privacy.events import describe_event

        raise NotApplicable(f"dp_accounting's PLD amplifies only Gaussian and Laplace releases by "
                            f"Poisson sampling, not {describe_event(ev.event)}")
    raise NotApplicable(f"dp_accounting's PLD has no {type(ev).__name__}")


#: single-release PLDs by (atom, interval), shared by every ledger of the process: building one
#: (tens of ms for a Laplace PLD) is the expensive part, and the parties of a local run, or the
#: runs of a sweep, charge the same mechanisms. PLDs are immutable values, so sharing is safe.
_PLD_CACHE: OrderedDict = OrderedDict()
_PLD_CACHE_SIZE = 128
#: counts the PLD constructions (tests check that compositions are cached)
PLD_BUILDS = [0]


def _memo(cache: OrderedDict, size: int, key: Any, build: Callable[[], Any]) -> Any:
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    value = build()
    cache[key] = value
    if len(cache) > size:
        cache.popitem(last=False)
    return value


def event_pld(ev: Any, count: int, interval: float):
    """PLD of ``count`` adaptive repetitions of ``ev``, built from dp_accounting's constructors.

    Plain Laplace / discrete Laplace / Gaussian / RR are the replace-one pairs (every event is
    normalised to the replace-one sensitivity, so Laplace/Gaussian are shift-by-one pairs);
    Poisson-subsampled Laplace / Gaussian use the library's subsampled PLDs; an
    :class:`EpsilonDeltaDpEvent` uses ``from_privacy_parameters``. Releases clipped per element are
    composed on their exact loss grid and rounded once: ``d`` discrete Laplace elements
    (:func:`_elementwise_dlap_pld`) and ``d`` binary randomized responses, whose ``count`` releases
    are one binomial of ``count·d`` bits (:func:`_binary_rr_pld`).
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    dpe = _dpe()
    if count == 0 or isinstance(ev, dpe.NoOpDpEvent):
        return pld_lib.identity(value_discretization_interval=interval)
    if isinstance(ev, dpe.SelfComposedDpEvent) and isinstance(ev.event, dpe.DiscreteLaplaceDpEvent) \
            and int(ev.event.sensitivity) > 0 and int(ev.count) > 1:
        pld_support(ev.event)
        a, s, d = float(ev.event.noise_parameter), int(ev.event.sensitivity), int(ev.count)
        atom = _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("elementwise-dlap", a, s, d, interval),
                     lambda: _elementwise_dlap_pld(a, s, d, interval))
        return atom if count == 1 else atom.self_compose(count)
    if isinstance(ev, dpe.SelfComposedDpEvent) and isinstance(ev.event, dpe.RandomizedResponseDpEvent) \
            and int(ev.event.num_buckets) == 2 and 0.0 < float(ev.event.noise_parameter) < 1.0:
        # count releases of d bits are count·d bits: one binomial, composed exactly, rounded once
        eta, bits = float(ev.event.noise_parameter), count * int(ev.count)
        return _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("binary-rr-bits", eta, bits, interval),
                     lambda: _binary_rr_pld(eta, bits, interval))
    if isinstance(ev, dpe.SelfComposedDpEvent) and _is_skellam(ev.event) and int(ev.count) > 1:
        # d elements of each of count releases compose (elementwise clipping): one self-composition of
        # the 1-D pair, d·count times, cached (a ledger asks for the same counts at every epoch)
        pld_support(ev.event)
        mu, s, n = float(ev.event.mu), int(ev.event.sensitivity), int(ev.count) * count
        return _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("elementwise-skellam", mu, s, n, interval),
                     lambda: _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("skellam", mu, s, interval),
                                   lambda: skellam_pld(mu, s, interval)).self_compose(n))
    if isinstance(ev, dpe.SelfComposedDpEvent):
        return event_pld(ev.event, count * int(ev.count), interval)
    if isinstance(ev, dpe.ComposedDpEvent):
        out = pld_lib.identity(value_discretization_interval=interval)
        for e in ev.events:
            out = out.compose(event_pld(e, count, interval))
        return out
    if isinstance(ev, dpe.GaussianDpEvent):
        _noise_ok(ev.noise_multiplier, ev)
        # count Gaussians of multiplier z compose exactly into one of multiplier z/√count
        return _gaussian_pld(float(ev.noise_multiplier) / math.sqrt(count), 1.0, interval)
    atom = _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("event", repr(ev), interval), lambda: _leaf_pld(ev, interval))
    return atom if count == 1 else atom.self_compose(count)


def _elementwise_dlap_pld(a: float, s: int, d: int, interval: float):
    """PLD of one release of ``d`` discrete Laplace elements ``DLap(a)`` each shifted by ``s`` (the
    per-element worst-case pair, :func:`events.elementwise_dlap_event`), at ``interval``.

    One element's privacy loss is ``a·j`` with ``j = |z − s| − |z|`` an integer: ``+s`` for ``z ≤ 0``
    (probability ``1/(1+e^{−a})``), ``−s`` for ``z ≥ s`` (``e^{−as}/(1+e^{−a})``), ``s − 2z`` between
    (``tanh(a/2)·e^{−az}``). On the grid ``a`` this is exact, so the ``d`` elements are composed
    there without rounding (dp_accounting's FFT self-convolution, tails beyond 1e-15 counted as
    infinite loss: pessimistic), and the composition is rounded up to ``interval`` once. Composing
    the ``d`` elements at ``interval`` instead would round every element's loss up, a bias of up to
    ``d·interval`` — far above ε when ``a·s`` is below the interval (e.g. ``d = 16384``).
    """
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    PLD_BUILDS[0] += 1
    probs = np.zeros(2 * s + 1)  # index j + s
    probs[2 * s] = 1.0 / (1.0 + math.exp(-a))
    probs[0] += math.exp(-a * s) / (1.0 + math.exp(-a))
    z = np.arange(1, s)
    np.add.at(probs, s - 2 * z + s, math.tanh(a / 2.0) * np.exp(-a * z))
    one = pld_pmf.DensePLDPmf(a, -s, probs, 0.0, True)
    comp = one.self_compose(d)
    losses = (comp._lower_loss + np.arange(len(comp._probs))) * a  # dp_accounting 0.6's dense PMF fields
    k = np.ceil(losses / interval)
    k = np.where(k * interval < losses, k + 1, k).astype(np.int64)  # never round a loss down
    keep = comp._probs > 0
    out: dict[int, float] = {}
    for kk, pp in zip(k[keep].tolist(), comp._probs[keep].tolist()):
        out[kk] = out.get(kk, 0.0) + pp
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
        out, float(comp._infinity_mass), interval, pessimistic_estimate=True, symmetric=True)


#: the binomial of :func:`_binary_rr_pld` is evaluated within this many standard deviations (plus
#: :data:`_RR_WINDOW_PAD` bits) of its mean; beyond, its tails (Bernstein: below 1e-20) are counted
#: pessimistically, never dropped
_RR_WINDOW_SD = 12.0
_RR_WINDOW_PAD = 60


def _binary_rr_pld(eta: float, bits: int, interval: float):
    """PLD of ``bits`` independent binary randomized responses of noise ``eta``, all bits differing.

    This is the worst neighbouring pair of a ``d``-bit release (replace-one: a pair differing in
    fewer bits is dominated, its other bits composing as the identity), and of ``n`` such releases
    with ``bits = n·d`` (independent bits compose into one binomial, exactly). Each bit is flipped
    with probability ``f = η/2`` and has loss ``±ε_b``, ``ε_b = ln((1 − f)/f)``; with ``j ~
    Binomial(bits, f)`` flipped bits under ``P`` the loss is ``L_j = (bits − 2j)·ε_b``, so

        δ(ε) = Σ_j P(j)·max(0, 1 − e^{ε − L_j})                      (the hockey-stick divergence)

    (docs/accounting.md, "How each mechanism is charged"). The PLD takes the binomial's masses at
    the exact losses (scipy's ``binom.pmf``) and rounds each loss up to ``interval`` once: a
    pessimistic estimate whose ε exceeds the exact one by at most ``interval``. Composing ``bits``
    RR PLDs at ``interval`` instead rounded every bit's loss up, by up to ``interval`` each — tens of
    times the exact ε when ``ε_b`` is far below the interval of a wide release. Outside a window of
    :data:`_RR_WINDOW_SD` standard deviations the binomial's tails are moved pessimistically: the
    high-loss tail (and any mass lost to rounding) to infinite loss, the low-loss tail onto the
    window's lowest loss. The pair is symmetric (flipping every bit swaps ``P`` and ``Q``).
    """
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from scipy.stats import binom

    PLD_BUILDS[0] += 1
    f = eta / 2.0
    eps_bit = math.log1p(-f) - math.log(f)
    mean, sd = bits * f, math.sqrt(bits * f * (1.0 - f))
    lo = max(0, int(math.floor(mean - _RR_WINDOW_SD * sd)) - _RR_WINDOW_PAD)
    hi = min(bits, int(math.ceil(mean + _RR_WINDOW_SD * sd)) + _RR_WINDOW_PAD)
    j = np.arange(lo, hi + 1)
    probs = binom.pmf(j, bits, f)
    high_tail = float(binom.cdf(lo - 1, bits, f)) if lo > 0 else 0.0  # j < lo: the largest losses
    low_tail = float(binom.sf(hi, bits, f)) if hi < bits else 0.0  # j > hi: the smallest losses
    probs[-1] += low_tail  # moved up to the window's lowest loss (j = hi)
    losses = (bits - 2 * j) * eps_bit
    k = np.ceil(losses / interval)
    k = np.where(k * interval < losses, k + 1, k).astype(np.int64)  # never round a loss down
    out: dict[int, float] = {}
    for kk, pp in zip(k.tolist(), probs.tolist()):
        if pp > 0.0:
            out[kk] = out.get(kk, 0.0) + pp
    infinity = high_tail + max(0.0, 1.0 - math.fsum(out.values()) - high_tail)
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
        out, infinity, interval, pessimistic_estimate=True, symmetric=True)


def _is_skellam(ev: Any) -> bool:
    return type(ev).__name__ == "SkellamDpEvent" and hasattr(ev, "mu") and hasattr(ev, "sensitivity")


#: the Skellam PMF is evaluated within this many standard deviations of 0 (and of the shift); the
#: rest of its mass (Bennett: below 2·e^{-K²/2·(1+K/(3σ))^{-1}}, ~1e-14 at K = 8) counts as infinite loss
SKELLAM_WINDOW_SD = 8.0


def skellam_pld(mu: float, s: int, interval: float):
    """PLD of one element released with ``Sk(mu)`` noise, the pair ``(Sk(mu), s + Sk(mu))``.

    ``Sk(mu)`` (two Poissons of mean ``mu/2``) has ``P(z) = e^{-mu}·I_|z|(mu)`` (scipy's ``ive``,
    exact and stable). Every outcome's loss ``ln P(z) − ln P(z − s)`` is rounded up to ``interval``
    (pessimistic); the mass outside the window of :data:`SKELLAM_WINDOW_SD` standard deviations, and
    any outcome where the neighbour's mass underflows, is infinite loss. Symmetric: ``z → s − z``
    swaps the two distributions. Shift pairs of a symmetric log-concave family are ordered by the
    shift, so ``s`` (the largest integer move of an element) is the worst pair of one element."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from scipy.special import ive

    PLD_BUILDS[0] += 1
    if s == 0:
        return pld_lib.identity(value_discretization_interval=interval)
    half = int(math.ceil(SKELLAM_WINDOW_SD * math.sqrt(mu))) + 1
    z = np.arange(-half, s + half + 1)
    p = ive(np.abs(z), mu)
    q = ive(np.abs(z - s), mu)
    with np.errstate(divide="ignore"):
        loss = np.log(p) - np.log(q)
    finite = (p > 0) & (q > 0)
    k = np.ceil(loss[finite] / interval)
    k = np.where(k * interval < loss[finite], k + 1, k).astype(np.int64)  # never round a loss down
    out: dict[int, float] = {}
    for kk, pp in zip(k.tolist(), p[finite].tolist()):
        out[kk] = out.get(kk, 0.0) + pp
    infinity = max(0.0, 1.0 - math.fsum(out.values()))
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
        out, infinity, interval, pessimistic_estimate=True, symmetric=True)


def _gaussian_pld(z: float, q: float, interval: float):
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    def build():
        PLD_BUILDS[0] += 1
        if q >= 1.0:
            return pld_lib.from_gaussian_mechanism(z, value_discretization_interval=interval)
        return pld_lib.from_gaussian_mechanism(z, sampling_prob=q, value_discretization_interval=interval)

    return _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("gauss", z, q, interval), build)


def _pure_pld(eps: float, interval: float):
    """PLD of the dominating pair of an ε-DP mechanism: binary randomized response (replace-one),
    or ``from_privacy_parameters(ε, 0)`` beyond what RR can carry."""
    from dp_accounting.pld import common as pld_common
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from fl_split.privacy.events import MAX_RR_EPSILON, rr_noise

    def build():
        PLD_BUILDS[0] += 1
        if eps <= MAX_RR_EPSILON:
            return pld_lib.from_randomized_response(
                rr_noise(eps), 2, value_discretization_interval=interval,
                neighboring_relation=_relation("replace"))
        return pld_lib.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(eps, 0.0),
                                               value_discretization_interval=interval)

    return _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("pure", eps, interval), build)


def _leaf_pld(ev: Any, interval: float):
    """PLD of one release of a leaf event."""
    from dp_accounting.pld import common as pld_common
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from fl_split.privacy.events import is_epsilon_delta

    dpe = _dpe()
    PLD_BUILDS[0] += 1
    if isinstance(ev, dpe.LaplaceDpEvent):
        _noise_ok(ev.noise_multiplier, ev)
        return pld_lib.from_laplace_mechanism(float(ev.noise_multiplier), value_discretization_interval=interval)
    if isinstance(ev, dpe.DiscreteLaplaceDpEvent):
        pld_support(ev)
        if int(ev.sensitivity) == 0:
            return pld_lib.identity(value_discretization_interval=interval)
        return pld_lib.from_discrete_laplace_mechanism(float(ev.noise_parameter), sensitivity=int(ev.sensitivity),
                                                       value_discretization_interval=interval)
    if isinstance(ev, dpe.RandomizedResponseDpEvent):
        if ev.num_buckets == 1:
            return pld_lib.identity(value_discretization_interval=interval)
        _noise_ok(ev.noise_parameter, ev)
        return pld_lib.from_randomized_response(float(ev.noise_parameter), int(ev.num_buckets),
                                                value_discretization_interval=interval,
                                                neighboring_relation=_relation("replace"))
    if _is_skellam(ev):
        pld_support(ev)
        return skellam_pld(float(ev.mu), int(ev.sensitivity), interval)
    if is_epsilon_delta(ev):
        params = pld_common.DifferentialPrivacyParameters(float(ev.epsilon), float(ev.delta))
        return pld_lib.from_privacy_parameters(params, value_discretization_interval=interval)
    if isinstance(ev, dpe.PoissonSampledDpEvent):
        q, inner = float(ev.sampling_probability), ev.event
        if isinstance(inner, dpe.GaussianDpEvent):
            _noise_ok(inner.noise_multiplier, inner)
            return pld_lib.from_gaussian_mechanism(float(inner.noise_multiplier), sampling_prob=q,
                                                   value_discretization_interval=interval)
        if isinstance(inner, dpe.LaplaceDpEvent):
            _noise_ok(inner.noise_multiplier, inner)
            return pld_lib.from_laplace_mechanism(float(inner.noise_multiplier), sampling_prob=q,
                                                  value_discretization_interval=interval)
    pld_support(ev)  # raises with the reason
    raise NotApplicable(f"dp_accounting's PLD has no {type(ev).__name__}")


def _relation(name: str):
    import dp_accounting

    nr = dp_accounting.NeighboringRelation
    return nr.REPLACE_ONE if name == "replace" else nr.ADD_OR_REMOVE_ONE


_EPS_CACHE: OrderedDict = OrderedDict()


def gaussian_epsilon(z: float, delta: float) -> float:
    """Exact epsilon of one Gaussian release of multiplier ``z`` at ``delta`` (dp_accounting's
    analytic Gaussian, Balle & Wang 2018)."""
    import dp_accounting

    return _memo(_EPS_CACHE, 4096, ("g", z, delta), lambda: float(dp_accounting.get_epsilon_gaussian(z, delta)))


def single_release_epsilon(ev: Any, delta: float, interval: float = PLD_INTERVAL) -> float:
    """Epsilon of one release of ``ev`` at ``delta``: the analytic Gaussian for a Gaussian event,
    its PLD otherwise."""
    from fl_split.privacy.events import gaussian_multiplier

    z = gaussian_multiplier(ev)
    if z is not None:
        _noise_ok(z, ev)
        return gaussian_epsilon(z, delta)
    return _memo(_EPS_CACHE, 4096, ("e", repr(ev), delta, interval),
                 lambda: float(event_pld(ev, 1, interval).get_epsilon_for_delta(delta)))


def sampled_gaussian_epsilon(z: float, q: float, delta: float, interval: float) -> float:
    """Epsilon of one Poisson-subsampled Gaussian release (dp_accounting's PLD, add/remove)."""
    if q >= 1.0:
        return gaussian_epsilon(z, delta)
    return _memo(_EPS_CACHE, 4096, ("sg", z, q, delta, interval),
                 lambda: float(_gaussian_pld(z, q, interval).get_epsilon_for_delta(delta)))


def event_pure_epsilon(ev: Any) -> float | None:
    """The pure epsilon of the ideal mechanism an event describes (``None``: not pure, or unknown):
    Laplace ``1/b``, discrete Laplace ``a·Δ``, k-ary RR ``ln((1−η+η/k)/(η/k))``, ``(ε, 0)``, and
    sums over compositions."""
    from fl_split.privacy.events import is_epsilon_delta

    dpe = _dpe()
    if isinstance(ev, dpe.NoOpDpEvent):
        return 0.0
    if isinstance(ev, dpe.LaplaceDpEvent):
        return 1.0 / float(ev.noise_multiplier) if ev.noise_multiplier > 0 else None
    if isinstance(ev, dpe.DiscreteLaplaceDpEvent):
        return float(ev.noise_parameter) * int(ev.sensitivity)
    if isinstance(ev, dpe.RandomizedResponseDpEvent):
        k, eta = int(ev.num_buckets), float(ev.noise_parameter)
        if k == 1:
            return 0.0
        return math.log((1.0 - eta + eta / k) / (eta / k)) if eta > 0 else None
    if is_epsilon_delta(ev):
        return float(ev.epsilon) if float(ev.delta) == 0.0 else None
    if isinstance(ev, dpe.SelfComposedDpEvent):
        inner = event_pure_epsilon(ev.event)
        return None if inner is None else int(ev.count) * inner
    if isinstance(ev, dpe.ComposedDpEvent):
        parts = [event_pure_epsilon(e) for e in ev.events]
        return None if any(p is None for p in parts) else math.fsum(parts)
    return None


def release_slack(rel: Release) -> float:
    """How much a release's stated pure epsilon exceeds its event's: the sampler slack of a
    float-exact discrete Laplace (the event describes the ideal mechanism, and the sampler's
    pointwise probabilities are within that excess of it: docs/accounting.md, "Sampling Laplace
    noise on floats"); 0 when the event carries the whole claim."""
    if rel.epsilon is None:
        return 0.0
    ideal = event_pure_epsilon(rel.event)
    if ideal is None:
        return 0.0
    excess = rel.epsilon - ideal
    return excess if excess > 1e-12 * max(1.0, rel.epsilon) else 0.0


def dominance_family(rel: Release) -> tuple[str, float] | None:
    """``(family, order)`` for a release of a family totally ordered by dominance, else ``None``.

    Within a family a release of larger ``order`` dominates one of smaller order (its pair of
    output distributions is at least as distinguishable for every test; composition preserves
    this): Laplace shift pairs by ``1/b`` and Gaussian ones by ``1/z`` (location families with a
    monotone likelihood ratio, rescaled to unit noise), binary randomized response and pure
    ``(ε, 0)`` events by ``ε`` (the latter are accounted as that randomized response). Only releases
    whose stated epsilon is their event's are ordered (a sampler slack would break the order for
    basic composition)."""
    from fl_split.privacy.events import gaussian_multiplier, is_epsilon_delta

    ev = rel.event
    z = gaussian_multiplier(ev)
    if z is not None:
        return ("gaussian", 1.0 / z) if z > 0 and rel.epsilon is None else None
    if rel.epsilon is None or release_slack(rel) or event_pure_epsilon(ev) is None:
        return None
    dpe = _dpe()
    if isinstance(ev, dpe.LaplaceDpEvent):
        return ("laplace", 1.0 / float(ev.noise_multiplier))
    if (isinstance(ev, dpe.RandomizedResponseDpEvent) and int(ev.num_buckets) == 2) or \
            (is_epsilon_delta(ev) and float(ev.delta) == 0.0):
        return ("binary-rr", event_pure_epsilon(ev))
    return None


# -- atoms: what one composition is made of ----------------------------------------------------
@dataclass(frozen=True)
class _Atom:
    """One distinct ingredient of a composition, repeated ``count`` times.

    ``kind``: ``event`` (an unsampled release's event), ``gauss`` (the exact merge of a record's
    Gaussian releases, count 1), ``sgauss`` (a Poisson-sampled Gaussian step: ``(z, q)``), ``slap``
    (a Poisson-sampled step of one Laplace release: ``(b, q)``), ``pure`` (the dominating pair of an
    ε-DP step or tail), ``approx`` (the dominating pair of an ``(ε, δ)``-DP step: ``(ε, δ)``).
    ``eps``: pure epsilon of one occurrence; ``scale``: the loss scale of one occurrence that sets
    the PLD interval.
    """

    kind: str
    key: Any
    count: int
    eps: float | None
    scale: float


def _is_gaussian(rel: Release) -> bool:
    from fl_split.privacy.events import gaussian_multiplier

    return gaussian_multiplier(rel.event) is not None


def _is_laplace(rel: Release) -> bool:
    return isinstance(rel.event, _dpe().LaplaceDpEvent)


def _names(rels: Iterable[Release]) -> str:
    return "/".join(sorted({r.mechanism for r in rels}))


def classify_step(members: tuple, q: float, releases: Sequence[Release], sampled_laplace: bool,
                  allow_mixed: bool = False) -> str:
    """How a Poisson-sampled step (``q < 1``) is accounted: ``gaussian`` (every member Gaussian:
    one Gaussian of the merged multiplier, exactly), ``laplace`` (a single Laplace release: the
    library's subsampled Laplace; only when ``sampled_laplace``), ``pure`` (every member pure: the
    amplified pure epsilon ``ln(1+q(e^{Σε}−1))`` as binary randomized response), ``mixed`` (pure
    and Gaussian members; only when ``allow_mixed``: see :func:`_atoms`), else
    :class:`NotApplicable`."""
    rels = [releases[r] for r, _ in members]
    if all(_is_gaussian(r) for r in rels):
        return "gaussian"
    if sampled_laplace and len(members) == 1 and members[0][1] == 1 and _is_laplace(rels[0]):
        return "laplace"
    if all(r.epsilon is not None for r in rels):
        return "pure"
    approx = [r for r in rels if r.epsilon is None]
    if allow_mixed and all(_is_gaussian(r) for r in approx):
        return "mixed"
    what = "PLD or RDP" if allow_mixed else "RDP"
    raise NotApplicable(
        f"a Poisson-sampled training step mixes (epsilon, delta)-only releases ({_names(approx)}) with "
        f"other releases ({_names(r for r in rels if r.epsilon is not None)}); dp_accounting has no "
        f"{what} of such a subsampled composition")


def _atoms(view: View, delta: float, notes: set | None, *, sampled_laplace: bool,
           allow_mixed: bool = False) -> list[_Atom]:
    """The distinct ingredients of ``view``: a record's Gaussian releases merged exactly into one
    Gaussian, every other release kind as an ``event`` atom; under Poisson sampling one atom per
    distinct step (see :func:`classify_step`); unsampled steps are flattened into their releases.

    A ``mixed`` step (pure and Gaussian releases; PLD only) is ``(ε_p + ε_G(δ_s), δ_s)``-DP by basic
    composition of its pure part and its Gaussians (merged exactly), with ``δ_s = δ/(2·T·q)`` for
    the view's ``T`` mixed steps, hence ``(ln(1+q(e^ε−1)), q·δ_s)``-DP after Poisson sampling; it is
    composed as the dominating pair of that guarantee (``approx`` atom), the steps together
    spending half of ``delta`` as their δ."""
    from fl_split.privacy.events import gaussian_multiplier

    rel = view.releases
    flat: dict[int, int] = {}
    atoms: list[_Atom] = []
    mixed_steps = 0
    if view.kind == STEPS and allow_mixed:
        mixed_steps = sum(c for (members, q), c in view.items if q < 1.0 and classify_step(
            members, q, rel, sampled_laplace, allow_mixed) == "mixed")
    if view.kind == RECORDS:
        for r, n in view.items:
            flat[r] = flat.get(r, 0) + n
    else:
        for (members, q), c in view.items:
            if q >= 1.0:
                for r, n in members:
                    flat[r] = flat.get(r, 0) + n * c
                continue
            how = classify_step(members, q, rel, sampled_laplace, allow_mixed)
            if how == "mixed":
                d_in = min(delta / (2.0 * mixed_steps * q), 0.5)
                z = merged_gaussian((gaussian_multiplier(rel[r].event), n) for r, n in members
                                    if rel[r].epsilon is None)
                _noise_ok(z, rel[members[0][0]].event)
                pure = tuple((r, n) for r, n in members if rel[r].epsilon is not None)
                e = amplified_pure_epsilon(_step_epsilon(pure, rel) + gaussian_epsilon(z, d_in), q)
                atoms.append(_Atom("approx", (e, q * d_in), c, None, e))
                _note(notes, NOTE_STEPS_APPROX)
                continue
            if how == "gaussian":
                z = merged_gaussian((gaussian_multiplier(rel[r].event), n) for r, n in members)
                _noise_ok(z, rel[members[0][0]].event)
                atoms.append(_Atom("sgauss", (z, q), c, None,
                                   amplified_pure_epsilon(gaussian_epsilon(z, delta), q)))
                _note(notes, NOTE_STEPS_GAUSSIAN)
            elif how == "laplace":
                r = members[0][0]
                b = float(rel[r].event.noise_multiplier)
                _noise_ok(b, rel[r].event)
                e = amplified_pure_epsilon(rel[r].epsilon if rel[r].epsilon is not None else 1.0 / b, q)
                atoms.append(_Atom("slap", (b, q), c, e, e))
                _note(notes, NOTE_STEPS_LAPLACE)
            else:
                e = amplified_pure_epsilon(sum(n * rel[r].epsilon for r, n in members), q)
                atoms.append(_Atom("pure", e, c, e, e))
                _note(notes, NOTE_STEPS_PURE)
    gauss = []
    for r in sorted(flat):
        n = flat[r]
        z = gaussian_multiplier(rel[r].event)
        if z is not None:
            _noise_ok(z, rel[r].event)
            gauss.append((z, n))
            continue
        eps = rel[r].epsilon
        # a Skellam release's interval scale: a quarter of its Gaussian twin's ε (the d·n elements compose
        # on that grid, each rounded up once: ≈ 0.1 % above the exact ε at σ = 1.5..4, d = 64, 5 releases)
        z_sk = _skellam_multiplier(rel[r].event) if eps is None else None
        atoms.append(_Atom("event", rel[r].event, n, eps,
                           eps if eps is not None else gaussian_epsilon(z_sk, delta) / 4 if z_sk else 1.0))
    if gauss:
        atoms.append(_Atom("gauss", merged_gaussian(gauss), 1, None,
                           max(gaussian_epsilon(z, delta) for z, _ in gauss)))
    return atoms


def _note(notes: set | None, what: str) -> None:
    if notes is not None:
        notes.add(what)


def _cap_atoms(atoms: list[_Atom], notes: set | None) -> list[_Atom]:
    """At most :data:`MAX_PLD_ATOMS` distinct pure atoms (the smaller ones merged into one pure
    atom of their summed epsilon, valid by basic composition) and as many distinct subsampled
    Gaussians per rate (beyond, each is replaced by the least noisy of its rate: the subsampled
    Gaussian's privacy curve grows as its multiplier shrinks)."""
    pure = [a for a in atoms if a.eps is not None]
    other = [a for a in atoms if a.eps is None]
    if len(pure) > MAX_PLD_ATOMS:
        pure.sort(key=lambda a: (-a.eps, a.kind, repr(a.key)))
        tail = pure[MAX_PLD_ATOMS:]
        rest = math.fsum(a.count * a.eps for a in tail)
        pure = pure[:MAX_PLD_ATOMS] + [_Atom("pure", rest, 1, rest, 0.0)]
        _note(notes, NOTE_PLD_TAIL)
    ap = [a for a in other if a.kind == "approx"]
    if len(ap) > MAX_PLD_ATOMS:
        ap.sort(key=lambda a: (-a.key[0], -a.key[1]))
        tail = ap[MAX_PLD_ATOMS:]
        merged = (math.fsum(a.count * a.key[0] for a in tail), math.fsum(a.count * a.key[1] for a in tail))
        other = [a for a in other if a.kind != "approx"] + ap[:MAX_PLD_ATOMS] + [_Atom("approx", merged, 1, None, 0.0)]
        _note(notes, NOTE_PLD_TAIL)
    sg = [a for a in other if a.kind == "sgauss"]
    if len(sg) > MAX_PLD_ATOMS:
        zmin: dict[float, float] = {}
        cnt: dict[float, int] = {}
        scale: dict[float, float] = {}
        for a in sg:
            z, q = a.key
            zmin[q] = min(zmin.get(q, math.inf), z)
            cnt[q] = cnt.get(q, 0) + a.count
            scale[q] = max(scale.get(q, 0.0), a.scale)
        other = [a for a in other if a.kind != "sgauss"] + [
            _Atom("sgauss", (zmin[q], q), cnt[q], None, scale[q]) for q in sorted(zmin)]
        _note(notes, NOTE_PLD_SGAUSS)
    return pure + other


def _atom_pld(a: _Atom, interval: float):
    if a.kind == "event":
        return event_pld(a.key, a.count, interval)
    if a.kind == "gauss":
        out = _gaussian_pld(a.key, 1.0, interval)
    elif a.kind == "sgauss":
        out = _gaussian_pld(a.key[0], a.key[1], interval)
    elif a.kind == "approx":
        from dp_accounting.pld import common as pld_common
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        e, d = a.key

        def build_approx():
            PLD_BUILDS[0] += 1
            return pld_lib.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(e, d),
                                                   value_discretization_interval=interval)

        out = _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("approx", e, d, interval), build_approx)
    elif a.kind == "slap":
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        b, q = a.key

        def build():
            PLD_BUILDS[0] += 1
            return pld_lib.from_laplace_mechanism(b, sampling_prob=q, value_discretization_interval=interval)

        out = _memo(_PLD_CACHE, _PLD_CACHE_SIZE, ("slap", b, q, interval), build)
    else:
        out = _pure_pld(a.key, interval)
    return out if a.count == 1 else out.self_compose(a.count)


# -- RDP ----------------------------------------------------------------------------------------
_RDP_CACHE: OrderedDict = OrderedDict()


def _rdp_vector(ev: Any, relation: str):
    """RDP of one release of ``ev`` at dp_accounting's default orders (a fresh ``RdpAccountant``
    composed once; its per-order RDP is read from the accountant)."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    from fl_split.privacy.events import describe_event

    def build():
        acc = rdp_lib.RdpAccountant(neighboring_relation=_relation(relation))
        if not acc.supports(ev):
            raise NotApplicable(f"dp_accounting's RDP accountant does not support {describe_event(ev)}")
        acc.compose(ev, 1)
        # dp_accounting 0.6 keeps the composed RDP per order in ``_rdp`` (no public getter); the
        # tests compare the result with RdpAccountant.get_epsilon on the same events
        return np.array(acc._rdp, dtype=np.float64), np.array(acc._orders, dtype=np.float64)

    return _memo(_RDP_CACHE, 1024, (repr(ev), relation), build)


def pure_rdp_vector(eps: float):
    """RDP, at dp_accounting's default orders, of binary randomized response of epsilon ``eps``
    (replace-one) — the dominating pair of every ε-DP mechanism. This is dp_accounting's
    ``_randomized_response_rdp_replace_one`` for two buckets, ``log(p/2·e^{αε} + (1−p/2)·e^{−αε})/(α−1)``
    with ``p/2 = 1/(1+e^ε)``, evaluated for all orders at once (the library's per-order loop takes
    ~65 ms per epsilon; a schedule with a distinct epsilon per step has thousands). The tests
    check it against the library."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    def build():
        a = np.asarray(rdp_lib.DEFAULT_RDP_ORDERS, dtype=np.float64)
        e = float(eps)
        out = (np.logaddexp(a * e, e - a * e) - np.logaddexp(0.0, e)) / (a - 1.0)
        small = a * e < 1.0
        if small.any():  # the same, written so that the first-order terms cancel exactly
            s = a[small]
            num = np.expm1(s * e) + np.expm1((1.0 - s) * e) - math.expm1(e)
            out[small] = np.log1p(num / (1.0 + math.exp(e))) / (s - 1.0)
        return out, a

    return _memo(_RDP_CACHE, 1024, ("pure", float(eps)), build)


# -- the accountants ----------------------------------------------------------------------------
@register
class Basic(Accountant):
    """Sequential composition (Dwork & Roth Thm 3.16)."""

    name = "basic"
    summary = "sequential composition: the sum of per-release epsilons (delta split over (eps, delta)-only releases)"

    def check_unit(self, kind, unit, releases):
        if kind == RECORDS:
            rel = releases[unit]
            if rel.epsilon is None:
                _single_support(rel)
            return
        members, q = unit
        for r, _ in members:
            if releases[r].epsilon is None:
                _single_support(releases[r])

    def epsilon(self, view, delta, notes=None):
        self.check(view)
        rel, interval = view.releases, view.pld_interval
        if view.kind == RECORDS:
            total, other = 0.0, []
            for r, n in view.items:
                if rel[r].epsilon is not None:
                    total += n * rel[r].epsilon
                else:
                    other.append((rel[r], n))
            t = sum(n for _, n in other)
            if t:
                _note(notes, NOTE_BASIC_DELTA)
            for release, n in other:  # each (ε, δ)-only release gets δ/T
                total += n * single_release_epsilon(release.event, delta / t,
                                                    _release_interval(release, delta, interval))
            return total
        from fl_split.privacy.events import gaussian_multiplier

        total, approx = 0.0, []
        for (members, q), c in view.items:
            pure = sum(n * rel[r].epsilon for r, n in members if rel[r].epsilon is not None)
            if all(rel[r].epsilon is not None for r, _ in members):
                total += c * amplified_pure_epsilon(pure, q)
            else:
                approx.append(((members, q), c, pure))
        t = sum(c for _, c, _ in approx)  # each step with (ε, δ)-only releases gets δ/T
        if t:
            _note(notes, NOTE_BASIC_DELTA)
        for (members, q), c, pure in approx:
            gauss = [(gaussian_multiplier(rel[r].event), n) for r, n in members if rel[r].epsilon is None
                     and _is_gaussian(rel[r])]
            if q < 1.0 and pure == 0.0 and len(gauss) == len(members):
                # every member Gaussian: one subsampled Gaussian of the merged multiplier, exactly
                z = merged_gaussian(gauss)
                scale = amplified_pure_epsilon(gaussian_epsilon(z, delta / t), q)
                total += c * sampled_gaussian_epsilon(z, q, delta / t, interval * max(1.0, scale))
                continue
            # the step composes to (pure + Σ ε_i(δ_i), Σ δ_i); Poisson sampling at q makes it
            # (ln(1+q(e^that−1)), q Σ δ_i): each step's share δ/T is spent as q·Σ δ_i
            others = [(rel[r], n) for r, n in members if rel[r].epsilon is None]
            m = sum(n for _, n in others)
            inner_delta = min(delta / (t * q), 0.5) / m
            inner = pure + sum(n * single_release_epsilon(rr.event, inner_delta, _release_interval(rr, delta, interval))
                               for rr, n in others)
            if q < 1.0:
                _note(notes, NOTE_STEPS_MIXED)
            total += c * amplified_pure_epsilon(inner, q)
        return total


def _single_support(rel: Release) -> None:
    if _is_gaussian(rel):
        return _noise_ok(rel.event.noise_multiplier, rel.event)
    pld_support(rel.event)


def _release_interval(rel: Release, delta: float, base: float) -> float:
    from fl_split.privacy.events import gaussian_multiplier

    s = rel.epsilon
    if s is None:
        z = gaussian_multiplier(rel.event)
        s = gaussian_epsilon(z, delta) if z else 1.0
    return base * max(1.0, s)


def _skellam_multiplier(ev: Any) -> float | None:
    """The Gaussian noise multiplier of the same variance and L2 shift as a (composed) Skellam release,
    ``√μ/(s·√d)``: it sets the PLD interval (:func:`_atoms`), as a Gaussian's epsilon does (the Skellam
    PLD is rounded pessimistically whatever the interval)."""
    dpe = _dpe()
    d = 1
    if isinstance(ev, dpe.SelfComposedDpEvent):
        d, ev = int(ev.count), ev.event
    if not _is_skellam(ev) or ev.mu <= 0 or ev.sensitivity <= 0:
        return None
    return math.sqrt(float(ev.mu)) / (float(ev.sensitivity) * math.sqrt(d))


@register
class Paper(Accountant):
    """001 Cor. 4/5 as published: strong composition over the training steps."""

    name = "paper"
    summary = "001 Cor. 4/5 as stated: T = training steps, gamma = B/N, epsilon = per-step pure epsilon"
    training = STEPS
    structural = False

    def check(self, view):
        rel = view.releases
        if view.kind == RECORDS:
            _one_pure_epsilon([rel[r] for r, _ in view.items], "per-release", [rel[r].epsilon for r, _ in view.items])
            return
        rels = [rel[r] for (members, _q), _c in view.items for r, _ in members]
        approx = [r for r in rels if r.epsilon is None]
        if approx:
            raise NotApplicable(f"001 Cor. 4/5 needs pure epsilon-DP releases; {_names(approx)} releases "
                                f"are only (epsilon, delta)-DP")
        _one_pure_epsilon(rels, "per-step", [_step_epsilon(m, rel) for (m, _q), _c in view.items])
        rates = sorted({q for (_m, q), _c in view.items})
        if rates and not math.isclose(rates[0], rates[-1], rel_tol=1e-9):
            raise NotApplicable(f"001 Cor. 4/5 needs one sampling ratio gamma; training steps have "
                                f"{', '.join(f'{q:g}' for q in rates)}")

    def epsilon(self, view, delta, notes=None):
        self.check(view)
        if not view.items:
            return 0.0
        rel = view.releases
        if view.kind == RECORDS:
            return paper_epsilon(rel[view.items[0][0]].epsilon, sum(n for _, n in view.items), delta, 1.0)
        (members, q), _ = view.items[0]
        return paper_epsilon(_step_epsilon(members, rel), sum(c for _, c in view.items), delta, q)


def _step_epsilon(members: tuple, rel: Sequence[Release]) -> float:
    return math.fsum(n * rel[r].epsilon for r, n in members)


def _one_pure_epsilon(rels: list[Release], what: str, values: list[float | None]) -> None:
    approx = [r for r in rels if r.epsilon is None]
    if approx:
        raise NotApplicable(f"001 Cor. 4/5 needs pure epsilon-DP releases; {_names(approx)} releases "
                            f"are only (epsilon, delta)-DP")
    vals = sorted(set(values))
    if vals and not math.isclose(vals[0], vals[-1], rel_tol=1e-9):
        raise NotApplicable(f"001 Cor. 4/5 needs one {what} epsilon; the releases have "
                            f"{', '.join(f'{v:g}' for v in vals[:6])}{', …' if len(vals) > 6 else ''}")


@register
class PaperRecord(Paper):
    """001 Cor. 4/5 read per record: T = the worst record's releases, gamma = 1."""

    name = "paper-record"
    summary = "001 Cor. 4/5 per record: T = the record's releases, gamma = 1 (no amplification)"
    training = RECORDS


@register
class Pld(Accountant):
    """Privacy loss distributions (dp_accounting.pld), pessimistic; never above basic."""

    name = "pld"
    summary = "privacy loss distributions of dp_accounting (pessimistic), never above basic"
    capped_by_basic = True

    def check_unit(self, kind, unit, releases):
        if kind == RECORDS:
            return pld_support(releases[unit].event)
        members, q = unit
        for r, _ in members:
            pld_support(releases[r].event)
        if q < 1.0:
            classify_step(members, q, releases, sampled_laplace=True, allow_mixed=True)

    def epsilon(self, view, delta, notes=None):
        import warnings

        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        self.check(view)
        if not view.items:
            return 0.0
        atoms = _cap_atoms(_atoms(view, delta, notes, sampled_laplace=True, allow_mixed=True), notes)
        interval = view.pld_interval * max([1.0] + [a.scale for a in atoms])
        # releases whose stated epsilon exceeds their (ideal) event's: the actual mechanism's
        # probabilities are within e^{±excess/4} of the event's pointwise, so for the composition
        # δ'(ε + S) <= e^{S/2}·δ(ε) with S the summed excess: report ε(δ·e^{−S/2}) + S
        slack = 0.0
        if view.kind == RECORDS:
            slack = math.fsum(n * release_slack(view.releases[r]) for r, n in view.items)
        else:
            slack = math.fsum(n * c * release_slack(view.releases[r])
                              for (members, q), c in view.items if q >= 1.0 for r, n in members)
        if slack:
            _note(notes, NOTE_PLD_SLACK)
        with warnings.catch_warnings():  # float overflow for losses in the hundreds: inf, capped below
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                out = pld_lib.identity(value_discretization_interval=interval)
                for a in atoms:
                    out = out.compose(_atom_pld(a, interval))
                eps = float(out.get_epsilon_for_delta(delta * math.exp(-slack / 2.0))) + slack
            except (OverflowError, ValueError):  # losses beyond ~700 nats: the library cannot build the PLD
                eps = math.inf
        # basic composition is also a valid (ε, δ) bound: the PLD never reports above it (its
        # pessimistic rounding can exceed it by an interval for few releases, and its float
        # arithmetic overflows for per-release losses of several hundred)
        basic = get_accountant("basic").epsilon(view, delta)
        if math.isfinite(eps) and eps <= basic:
            return eps
        _note(notes, NOTE_PLD_BASIC_CAP)
        return basic


@register
class Rdp(Accountant):
    """Rényi DP (dp_accounting.rdp.RdpAccountant, default orders)."""

    name = "rdp"
    summary = "Renyi DP of dp_accounting (default orders)"

    def check_unit(self, kind, unit, releases):
        from fl_split.privacy.events import MAX_RR_EPSILON, canonical_event

        if kind == RECORDS:
            _rdp_vector(canonical_event(releases[unit].event), "replace")
            return
        members, q = unit
        if q >= 1.0:
            for r, _ in members:
                _rdp_vector(canonical_event(releases[r].event), "replace")
            return
        if classify_step(members, q, releases, sampled_laplace=False) == "pure":
            e = amplified_pure_epsilon(_step_epsilon(members, releases), q)
            if e > MAX_RR_EPSILON:
                raise NotApplicable(f"a training step's amplified epsilon {e:g} is beyond what randomized "
                                    f"response can carry (RDP needs its dominating pair)")

    def epsilon(self, view, delta, notes=None):
        import numpy as np
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        from fl_split.privacy.events import canonical_event

        self.check(view)
        if not view.items:
            return 0.0
        dpe = _dpe()
        total, orders = None, None
        for a in _atoms(view, delta, notes, sampled_laplace=False):
            if a.kind == "event":
                ev, relation = canonical_event(a.key), "replace"
            elif a.kind == "gauss":
                ev, relation = dpe.GaussianDpEvent(a.key), "replace"
            elif a.kind == "sgauss":
                ev, relation = dpe.PoissonSampledDpEvent(a.key[1], dpe.GaussianDpEvent(a.key[0])), "add_remove"
            else:  # pure: its dominating pair, binary randomized response
                vec, orders = pure_rdp_vector(a.key)
                total = a.count * vec if total is None else total + a.count * vec
                continue
            vec, orders = _rdp_vector(ev, relation)
            total = a.count * vec if total is None else total + a.count * vec
        if total is None:
            return 0.0
        return float(rdp_lib.compute_epsilon(orders, np.asarray(total), delta)[0])


@register
class Opacus(Accountant):
    """Opacus' RDPAccountant, for ledgers whose releases are all Gaussian (a cross-check of rdp)."""

    name = "opacus"
    summary = "Opacus' RDPAccountant (Gaussian releases only; a cross-check of rdp)"

    def listed(self, releases):
        return bool(releases) and all(_is_gaussian(r) for r in releases)

    def check_unit(self, kind, unit, releases):
        from fl_split.privacy.events import describe_event

        rels = [releases[unit]] if kind == RECORDS else [releases[r] for r, _ in unit[0]]
        for r in rels:
            if not _is_gaussian(r):
                raise NotApplicable(f"Opacus accounts Gaussian mechanisms (DP-SGD) only, not "
                                    f"{r.mechanism} ({describe_event(r.event)})")
            _noise_ok(r.event.noise_multiplier, r.event)

    def epsilon(self, view, delta, notes=None):
        import warnings

        from opacus.accountants import RDPAccountant

        self.check(view)
        if not view.items:
            return 0.0
        rel = view.releases
        history = []
        if view.kind == RECORDS:
            history = [(float(rel[r].event.noise_multiplier), 1.0, int(n)) for r, n in view.items]
        else:
            for (members, q), c in view.items:
                z = merged_gaussian((float(rel[r].event.noise_multiplier), n) for r, n in members)
                history.append((z, float(q), int(c)))
        acc = RDPAccountant()
        acc.history = history  # (noise multiplier, sample rate, steps), Opacus' own bookkeeping
        with warnings.catch_warnings():  # "optimal order is the smallest alpha" at tiny noise
            warnings.simplefilter("ignore", UserWarning)
            return float(acc.get_epsilon(delta))
