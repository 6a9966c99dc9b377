"""Tight accounting of per-element clipped releases (issue 26, items 1; DESIGN.md privacy principle 9).

A d-element release clipped per element is charged as the PLD of its worst-case neighbouring pair:
d discrete Laplace events of sensitivity 2M (Laplace), 2K of M forward / K of 2M backward (R3eLU's
Laplace part, composed with its randomized-response part). Every expected value here is computed
independently with dp_accounting's PLD API (never through fl_split's accountants): a lower bound
(``pessimistic_estimate=False``) and an upper bound (pessimistic, at a finer interval than the
ledger's) of the exact (ε, δ). The reported ε must lie at or above the lower bound (soundness) and
within 1.05× of it (tightness); basic composition keeps d·ε_elem.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.privacy.base import PrivacyCost
from fl_split.privacy.ledger import Ledger, LedgerEntry
from fl_split.privacy.mechanisms import Laplace, RandomizedResponse
from fl_split.privacy.r3elu import R3eLU
from fl_split.seeding import PrivateSeed

DELTA = 1e-5
EPOCHS = 5
#: the independent computation's interval: 5× finer than the ledger's at these epsilons
FINE = 2e-5


def exact_bounds(parts, releases: int, delta: float = DELTA) -> tuple[float, float]:
    """``(lower, upper)`` bounds of the exact ε at ``delta`` of ``releases`` repetitions of the
    composition ``parts``: ``("dlap", a, sensitivity, count)`` or ``("rr", eps, -, -)`` (binary
    randomized response of that epsilon, replace-one), straight from dp_accounting's constructors."""
    out = []
    for pess in (False, True):
        total = None
        for kind, a, s, count in parts:
            if kind == "dlap":
                one = pld.from_discrete_laplace_mechanism(a, sensitivity=s, value_discretization_interval=FINE,
                                                          pessimistic_estimate=pess)
            else:
                one = pld.from_randomized_response(2.0 / (1.0 + math.exp(a)), 2, value_discretization_interval=FINE,
                                                   pessimistic_estimate=pess,
                                                   neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
            one = one.self_compose(count * releases)
            total = one if total is None else total.compose(one)
        out.append(float(total.get_epsilon_for_delta(delta)))
    return out[0], out[1]


def charged(cost: PrivacyCost, epochs: int = EPOCHS, n_records: int = 40, batch: int = 8) -> Ledger:
    """A ledger charged with ``epochs`` passes over ``n_records`` records in batches (one forward
    release of each record per epoch: the default schedule)."""
    led = Ledger("guest-1", accountant="pld")
    ids = np.arange(n_records)
    for e in range(1, epochs + 1):
        perm = np.random.default_rng(e).permutation(ids)
        for i in range(0, n_records, batch):
            led.charge([LedgerEntry(e, ("train", e, i // batch), "forward", cost, perm[i:i + batch], None)])
    return led


def assert_tight(reported: float, lower: float, upper: float) -> None:
    assert upper >= lower  # the two independent estimates bracket the exact value
    assert reported >= lower - 1e-9, "reported below the exact epsilon: unsound"
    assert reported <= 1.05 * lower, f"reported {reported} is more than 1.05x the exact {lower}"


def test_64_wide_laplace_eps4_five_epochs_is_tight():
    """The issue's case: digits' 64-wide cut, ε = 4 per release, 5 epochs. The ledger reported 20.0
    (one 1-D event of sensitivity 2Md); the exact (ε, 1e-5) is 4.89."""
    m = Laplace(64, "forward", 1.0, epsilon=4.0)
    led = charged(m.cost())
    rep = led.report()
    lower, upper = exact_bounds([("dlap", 1.0 / m.t, 2 * m.units, 64)], EPOCHS)
    assert_tight(rep["epsilon"], lower, upper)
    assert 4.85 < lower < 4.95  # the 4.89
    # the grid mechanism is the continuous one to within its grid: 320 Laplace releases of ε 4/64
    # (REPLACE_SPECIAL: the multiplier b/(2C) is already relative to the replace-one shift 2C)
    cont = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_SPECIAL, value_discretization_interval=FINE)
    cont.compose(dpa.LaplaceDpEvent(noise_multiplier=m.b / (2 * m.bound)), 64 * EPOCHS)
    assert cont.get_epsilon(DELTA) == pytest.approx(lower, rel=0.01)
    # the other accountants stay sound: pure ε (basic) keeps d·ε_elem per release, paper is 001's formula
    assert rep["epsilons"]["basic"] == pytest.approx(20.0)
    assert rep["epsilons"]["paper"] >= rep["epsilons"]["basic"]
    assert rep["epsilons"]["rdp"] is None  # dp_accounting has no RDP of discrete Laplace


def test_elements_below_the_pld_interval_are_composed_without_rounding_each():
    """A wide release whose per-element loss (0.5/256 ≈ 0.002) is comparable to the ledger's PLD
    interval (1e-4): rounding each of the 512 element losses up would add up to 0.05 (a third of ε);
    the ledger composes the elements on their exact loss grid and rounds once per release. The
    independent value uses dp_accounting at a 100× finer interval (bias ≤ 512·1e-6)."""
    m = Laplace(256, "forward", 1.0, epsilon=0.5)
    rep = charged(m.cost(), epochs=2).report()
    bounds = []
    for pess in (False, True):
        one = pld.from_discrete_laplace_mechanism(1.0 / m.t, sensitivity=2 * m.units, value_discretization_interval=1e-6,
                                                  pessimistic_estimate=pess)
        bounds.append(float(one.self_compose(2 * 256).get_epsilon_for_delta(DELTA)))
    assert_tight(rep["epsilon"], *bounds)
    assert rep["epsilon"] <= bounds[1] + 2 * 1e-4  # at most one ledger interval per release above


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_r3elu_laplace_part_is_tight(direction):
    """R3eLU's Laplace part alone (charged at ε_l) and composed with its randomized-response part:
    forward 2K elements move by M (two disjoint top-K supports), backward K elements by 2M (the
    same support, opposite signs)."""
    m = R3eLU(64, direction, 4.0, 10.0)  # K = 32, ε_p = ε_l = 2
    units = m.sensitivity_units // (2 * m.k)
    lap = (("dlap", 1.0 / m.t, units, 2 * m.k) if direction == "forward" else ("dlap", 1.0 / m.t, 2 * units, m.k))
    part = PrivacyCost("r3elu", m.laplace_event(), epsilon=m.eps_l_bound)
    assert_tight(charged(part).report()["epsilon"], *exact_bounds([lap], EPOCHS))
    full = charged(m.cost()).report()
    assert_tight(full["epsilon"], *exact_bounds([("rr", m.eps_p, 0, 1), lap], EPOCHS))
    assert full["epsilons"]["basic"] == pytest.approx(20.0)
    assert full["epsilon"] < 14.0  # the 1-D event gave 20.0 (RR ∘ one Laplace of ε 2, ×5: capped by basic)


def test_r3elu_few_kept_elements_and_wide_k():
    """K = 2 of 64 (the defaults' top-k auto): 4 elements differ forward. K > d/2: at most d elements
    can differ, so the event is tighter than Cor. 1's 2KM (the excess counts as slack: still sound)."""
    m = R3eLU(64, "forward", 4.0, 0.1, k=2)
    units = m.sensitivity_units // (2 * m.k)
    assert m.laplace_event().count == 4
    lo, hi = exact_bounds([("rr", m.eps_p, 0, 1), ("dlap", 1.0 / m.t, units, 4)], EPOCHS)
    assert_tight(charged(m.cost()).report()["epsilon"], lo, hi)
    wide = R3eLU(8, "forward", 4.0, 10.0, k=6)
    assert wide.laplace_event().count == 8  # min(2K, d)
    rep = charged(wide.cost()).report()
    assert rep["epsilons"]["basic"] == pytest.approx(20.0) and rep["epsilon"] <= 20.0


def _dlap_pmf(a: float, lo: int, hi: int, shift: int = 0) -> np.ndarray:
    z = np.arange(lo, hi + 1)
    return math.tanh(a / 2) * np.exp(-a * np.abs(z - shift))  # (1 − e^{−a})/(1 + e^{−a}) e^{−a|z|}


def _hockey(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(p - math.exp(eps) * q, 0.0).sum())


@pytest.mark.parametrize("a,m", [(0.3, 2), (0.1, 3), (1.0, 1)])
def test_one_shift_of_2m_dominates_two_shifts_of_m(a, m):
    """The lemma R3eLU's backward event rests on: the discrete Laplace pair shifted by 2M dominates
    the product of two pairs shifted by M (every hockey-stick divergence, ε of both signs), computed
    exactly on the integer lattice (tails beyond the window below 1e-13). The converse fails, so the
    check can fail."""
    width = int(math.ceil(32.0 / a)) + 4 * m
    p1, q1 = _dlap_pmf(a, -width, width), _dlap_pmf(a, -width, width, m)
    p2, q2 = np.outer(p1, p1).ravel(), np.outer(q1, q1).ravel()
    ps, qs = p1, _dlap_pmf(a, -width, width, 2 * m)
    worse_somewhere = False
    for eps in np.linspace(-2 * a * m, 2 * a * m, 81):
        single, pair = _hockey(ps, qs, eps), _hockey(p2, q2, eps)
        assert single >= pair - 1e-12, (eps, single, pair)
        worse_somewhere |= single > pair + 1e-6
    assert worse_somewhere


def test_ledger_of_a_real_digits_run_is_tight():
    """Through a real run config: digits, 1 guest, 64-wide cut, Laplace ε = 4 per epoch, 5 epochs;
    the guest's reported ε against the exact one of its worst record (5 releases)."""
    cfg = RunConfig(dataset="digits", guests=1, epochs=EPOCHS, batch_size=32, limit=200, progress=False, seed=3,
                    defense="laplace", protect="guest", epsilon=4.0, accountant="pld")
    rep = LocalEngine(cfg, private_seed=PrivateSeed.legacy(4)).run()["privacy"]["guest-1"]
    mech = rep["mechanism"]
    width = mech["width"]
    assert width == 64 and rep["releases_per_record"] == EPOCHS
    shift = mech["sensitivity_units"] // width
    lower, upper = exact_bounds([("dlap", 1.0 / mech["t"], shift, width)], EPOCHS)
    assert_tight(rep["epsilon"], lower, upper)
    assert rep["epsilons"]["basic"] == pytest.approx(20.0)


# -- randomized response: d bits of ε_b each --------------------------------------------------------
def rr_loss_log_pmf(bits: int, eps_bit: float) -> tuple[np.ndarray, np.ndarray]:
    """``(losses, log P)`` of ``bits`` binary randomized responses of ε_b, every bit differing: the
    loss is ``k·ε_b − (bits − k)·ε_b`` with ``k ~ Binomial(bits, e^ε_b/(1 + e^ε_b))`` kept bits."""
    from scipy.special import gammaln

    k = np.arange(bits + 1)
    log_keep, log_flip = -np.logaddexp(0.0, -eps_bit), -np.logaddexp(0.0, eps_bit)
    log_p = gammaln(bits + 1) - gammaln(k + 1) - gammaln(bits - k + 1) + k * log_keep + (bits - k) * log_flip
    return (2 * k - bits) * eps_bit, log_p


def exact_delta(losses: np.ndarray, log_p: np.ndarray, eps: float) -> float:
    """The hockey-stick divergence ``Σ P(L)·max(0, 1 − e^{ε − L})``, summed in log space."""
    from scipy.special import logsumexp

    above = losses > eps
    if not above.any():
        return 0.0
    return float(np.exp(logsumexp(log_p[above] + np.log(-np.expm1(eps - losses[above])))))


def exact_epsilon(losses: np.ndarray, log_p: np.ndarray, delta: float = DELTA) -> float:
    """The smallest ε with ``exact_delta(ε) ≤ delta`` (bisection to 1e-9; δ(ε) is decreasing)."""
    lo, hi = 0.0, float(losses.max())
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_delta(losses, log_p, mid) > delta else (lo, mid)
    return hi


def exact_rr_epsilon(bits: int, eps_bit: float, delta: float = DELTA) -> float:
    return exact_epsilon(*rr_loss_log_pmf(bits, eps_bit), delta)


def test_the_exact_binomial_sum_agrees_with_dp_accountings_pld():
    """The test's own exact value is right: 64 bits of ε_b = 1 lie between dp_accounting's optimistic
    and pessimistic PLDs of 64 composed binary randomized responses (at an interval 1e-5)."""
    lower, upper = exact_bounds([("rr", 1.0, 0, 64)], 1)
    assert lower - 1e-9 <= exact_rr_epsilon(64, 1.0) <= upper + 1e-9
    assert exact_rr_epsilon(64, 1.0) == pytest.approx(55.709, abs=1e-3)  # the audit's value


@pytest.mark.parametrize("bits,eps_bit,old", [(64, 1.0, 56.004), (1024, 0.1, 22.81), (16384, 0.1, 1453.9)])
def test_one_randomized_response_release_is_tight_at_every_width(bits, eps_bit, old):
    """One ``bits``-wide RR release is charged as the exact binomial mixture of its worst pair,
    rounded up to the ledger's interval once: at or above the exact ε (sound), within 5 % of it. Each
    bit's loss used to be rounded up on a grid set by the whole release's ε (``old``: 10.7× the
    exact ε at 16,384 bits)."""
    cost = RandomizedResponse(bits, bits * eps_bit).privacy_cost()
    rep = charged(cost, epochs=1).report()
    exact = exact_rr_epsilon(bits, eps_bit)
    assert exact - 1e-9 <= rep["epsilon"] <= 1.05 * exact, (rep["epsilon"], exact)
    assert rep["epsilon"] <= exact + 1e-4 * bits * eps_bit + 1e-9  # at most one ledger interval above
    assert rep["epsilon"] < old
    assert rep["epsilons"]["basic"] == pytest.approx(bits * eps_bit)


@pytest.mark.parametrize("eps,releases", [(64.0, 2), (64.0, 5), (1.0, 5), (4.0, 20)])
def test_composed_randomized_response_releases_stay_above_the_exact_composition(eps, releases):
    """Several 64-bit releases of one record (ε = 1: the digits run's default; ε = 64: ε_b = 1):
    the ledger's ε is at or above the exact composition — ``releases·64`` independent bits, one
    binomial — and within 5 % of it."""
    rep = charged(RandomizedResponse(64, eps).privacy_cost(), epochs=releases).report()
    assert rep["releases_per_record"] == releases
    exact = exact_rr_epsilon(64 * releases, eps / 64)
    assert exact - 1e-9 <= rep["epsilon"] <= 1.05 * exact, (rep["epsilon"], exact)


def test_two_kinds_of_randomized_response_compose_above_the_exact_convolution():
    """Two different RR releases of one record (64 bits at ε_b = 1 and 32 bits at ε_b = 0.5, i.e. two
    PLDs composed by dp_accounting): at or above the exact ε of the convolved loss distributions."""
    led = Ledger("guest-1", accountant="pld")
    for i, cost in enumerate([RandomizedResponse(64, 64.0).privacy_cost(),
                              RandomizedResponse(32, 16.0).privacy_cost()]):
        led.charge([LedgerEntry(1, ("train", 1, i), "forward", cost, np.arange(4), None)])
    (l1, p1), (l2, p2) = rr_loss_log_pmf(64, 1.0), rr_loss_log_pmf(32, 0.5)
    exact = exact_epsilon(np.add.outer(l1, l2).ravel(), np.add.outer(p1, p2).ravel())
    reported = led.report()["epsilon"]
    assert exact - 1e-9 <= reported <= 1.05 * exact, (reported, exact)
