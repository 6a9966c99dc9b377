"""Per-party ledger and accountants (spec §5; docs/accounting.md).

Every accountant is checked against an independent computation done here: dp_accounting called
directly on the same composed events (PLD, RDP), Opacus' accountant stepped by hand, closed
forms for single releases and for sequential / 001 Cor. 4-5 composition, and the exact privacy
curve of composed binary randomized response (a binomial sum, no library). Most PLD comparisons
run at a coarse discretisation (``pld_interval=1e-3``) for speed: the ledger and the direct
computation then use the same interval, so they must agree to rounding, whatever the interval;
the tests that must separate PLD from basic composition use the default interval and a tolerance
derived from it.

One neighbouring relation: replace-one. Every event is the replace-one event of one release of one
record; DP-SGD at noise multiplier σ is ``GaussianDpEvent(σ/2)`` (the clipped sum moves by 2C).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import NeighboringRelation as NR
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from fl_split.errors import BudgetExceeded, ConfigError
from fl_split.privacy import accountants as acc_mod
from fl_split.privacy.accountants import accountant_names, pure_rdp_vector
from fl_split.privacy.base import PrivacyCost
from fl_split.privacy.dpsgd import dpsgd_cost
from fl_split.privacy.events import cost_key, pure_dp_event, rr_noise
from fl_split.privacy.ledger import EpsilonDeltaDpEvent, Ledger, LedgerEntry, paper_epsilon
from fl_split.state import flatten, from_json, to_json, unflatten

DELTA = 1e-5
COARSE = 1e-3  # PLD interval used by most tests (see module docstring)
# The ledger widens the PLD interval to base x max(1, largest per-release epsilon) (a relative
# resolution); tests comparing with a direct PLD at the base interval keep per-release epsilons
# (Gaussian: at delta) <= 1, e.g. noise multiplier 5 (epsilon 0.73 at 1e-5).


# -- costs as the mechanisms describe them (brief / spec §3) -----------------------------------
def laplace(b: float, l1: float) -> PrivacyCost:
    return PrivacyCost("laplace", dpa.LaplaceDpEvent(noise_multiplier=b / l1), epsilon=l1 / b,
                       sensitivity_l1=l1, params=(("b", b),))


def gaussian(sigma: float, l2: float) -> PrivacyCost:
    return PrivacyCost("gaussian", dpa.GaussianDpEvent(noise_multiplier=sigma / l2), epsilon=None,
                       sensitivity_l2=l2, params=(("sigma", sigma),))


def rr(eps: float, d: int) -> PrivacyCost:
    eb = eps / d
    return PrivacyCost("rr", dpa.SelfComposedDpEvent(dpa.RandomizedResponseDpEvent(
        noise_parameter=2 / (1 + math.exp(eb)), num_buckets=2), d), epsilon=eps, params=(("d", d),))


def r3elu(eps: float, k: int = 4, c: float = 10.0) -> PrivacyCost:
    ep, el = eps / 2, eps / 2
    return PrivacyCost("r3elu", dpa.ComposedDpEvent([EpsilonDeltaDpEvent(ep, 0.0),
                                                     dpa.LaplaceDpEvent(noise_multiplier=1 / el)]),
                       epsilon=eps, sensitivity_l1=2 * k * c, params=(("k", k), ("c", c)))


def dpsgd(z: float) -> PrivacyCost:
    """A Gaussian step whose replace-one event has multiplier ``z`` (DP-SGD at σ = 2z)."""
    return PrivacyCost("dpsgd", dpa.GaussianDpEvent(noise_multiplier=z), None, sensitivity_l2=1.0,
                       params=(("noise_multiplier", 2 * z), ("max_grad_norm", 0.5)))


def dlap(eps: float, sens: int) -> PrivacyCost:
    """Exact discrete Laplace on a grid: sensitivity ``sens`` grid units, parameter a = ε/Δ."""
    return PrivacyCost("laplace", dpa.dp_event.DiscreteLaplaceDpEvent(noise_parameter=eps / sens, sensitivity=sens),
                       epsilon=eps, sensitivity_l1=float(sens), params=(("grid", True),))


def entry(cost, ids, *, epoch=1, index=0, phase="train", direction="forward", rate=None, rnd=0):
    return LedgerEntry(rnd, (phase, epoch, index), direction, cost, np.asarray(ids, dtype=np.int64), rate)


def epochs(led, cost, n_records, batch, n_epochs, *, phase="train", direction="forward", rate=None, start=0):
    """Charge ``n_epochs`` passes over records ``start..start+n_records-1`` in batches."""
    ids = np.arange(start, start + n_records)
    for e in range(1, n_epochs + 1):
        perm = np.random.default_rng(e).permutation(ids)
        for i in range(0, n_records, batch):
            led.charge([entry(cost, perm[i:i + batch], epoch=e, index=i // batch, phase=phase,
                              direction=direction, rate=rate, rnd=e)])


def direct_pld(events_counts, interval=COARSE, relation=NR.ADD_OR_REMOVE_ONE):
    acc = dpa.pld.PLDAccountant(relation, value_discretization_interval=interval)
    for ev, n in events_counts:
        acc.compose(ev, n)
    return acc.get_epsilon(DELTA)


def direct_rdp(events_counts, relation=NR.REPLACE_ONE):
    acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    for ev, n in events_counts:
        acc.compose(ev, n)
    return acc.get_epsilon(DELTA)


# -- single releases: closed forms --------------------------------------------------------------
def test_single_laplace_release_closed_form():
    """One Laplace release with b over L1 sensitivity Δ1 is (Δ1/b)-DP; PLD at δ > 0 cannot exceed it."""
    cost = laplace(b=8.0, l1=4.0)
    for acc in ("basic", "paper", "pld", "rdp"):
        led = Ledger("g", accountant=acc, pld_interval=COARSE)
        led.charge([entry(cost, [1, 2, 3])])
        eps = led.epsilon()
        if acc == "basic":
            assert eps == pytest.approx(4.0 / 8.0, rel=1e-12)
        elif acc == "paper":
            assert eps == pytest.approx(0.5 * math.sqrt(2 * math.log(1 / DELTA)) + 0.5 * math.expm1(0.5))
            assert eps > 0.5  # Cor. 4/5 is looser than basic for few releases (reported anyway)
        elif acc == "pld":
            assert 0.5 * 0.99 <= eps <= 0.5 + COARSE  # the tight PLD: at most the pure epsilon
        else:  # RDP → (ε, δ) conversion is not tight for a single release; as the library computes it
            assert eps == pytest.approx(direct_rdp([(cost.dp_event, 1)]), rel=1e-12) and 0.5 <= eps < 0.55


def test_single_randomized_response_release_closed_form():
    """RR on d bits with per-bit flip probability 1/(1+e^{ε/d}): each bit is (ε/d)-DP, the record ε-DP."""
    eps, d = 2.0, 8
    cost = rr(eps, d)
    led = Ledger("g", accountant="basic", pld_interval=COARSE)
    led.charge([entry(cost, [5])])
    assert led.epsilon() == pytest.approx(eps)
    flip = 1 / (1 + math.exp(eps / d))
    eta = cost.dp_event.event.noise_parameter  # dp_accounting: uniform bucket with probability η
    assert eta / 2 == pytest.approx(flip)
    assert math.log((1 - eta / 2) / (eta / 2)) == pytest.approx(eps / d)
    # tight accountants: the PLD of d RR bits, composed one bit at a time with the library's own
    # PLDAccountant (replace-one; its count argument is not used for RR events in 0.6.0)
    acc = dpa.pld.PLDAccountant(NR.REPLACE_ONE, value_discretization_interval=COARSE)
    for _ in range(d):
        acc.compose(cost.dp_event.event)
    assert led.epsilon("pld") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    assert led.epsilon("pld") <= eps + COARSE * d
    assert led.epsilon("rdp") == pytest.approx(direct_rdp([(cost.dp_event, 1)]), rel=1e-9)


def test_basic_sums_pure_epsilons_and_splits_delta_for_gaussian():
    led = Ledger("g", accountant="basic", pld_interval=COARSE)
    lap, gau = laplace(2.0, 1.0), gaussian(2.0, 1.0)
    for i in range(3):
        led.charge([entry(lap, [7], index=i), entry(gau, [7], index=i)])
    # three pure releases (0.5 each) + three Gaussian releases each at δ/3 (exact, via a fine PLD here)
    single = pld_lib.from_gaussian_mechanism(2.0, value_discretization_interval=1e-4)
    gauss_single = single.get_epsilon_for_delta(DELTA / 3)
    # the ledger uses the exact analytic Gaussian; the pessimistic PLD is above it by < 1e-3
    assert 3 * 0.5 + 3 * (gauss_single - 1e-3) <= led.epsilon() <= 3 * 0.5 + 3 * gauss_single
    rep = led.report()
    assert any("delta/T" in a for a in rep["assumptions"])
    assert rep["epsilons"]["paper"] is None  # Gaussian releases are not pure


# -- compositions: paper, pld, rdp, opacus against direct computations ---------------------------
def test_paper_formula_and_basic_over_epochs():
    cost = laplace(b=10.0, l1=1.0)  # ε = 0.1 per release
    # 30 records in batches of 8: 4 training steps per epoch, 80 in all; each record in 20 of them
    # (no sample rate given: gamma = 1)
    for acc, expect in (("basic", 20 * 0.1), ("paper", paper_epsilon(0.1, 80, DELTA)),
                        ("paper-record", paper_epsilon(0.1, 20, DELTA))):
        led = Ledger("g", accountant=acc)
        epochs(led, cost, n_records=30, batch=8, n_epochs=20)
        assert led.epsilon() == pytest.approx(expect, rel=1e-12)
    assert led.training_steps == 80 and led.report()["training_steps"] == 80
    assert any("gamma = 1" in a and "no sample rate" in a for a in led.report()["assumptions"])
    # the formula itself, computed here: γε√(2T ln(1/δ)) + γε T(e^{γε} − 1), γ = 1
    by_hand = 0.1 * math.sqrt(40 * math.log(1e5)) + 0.1 * 20 * math.expm1(0.1)
    assert paper_epsilon(0.1, 20, DELTA) == pytest.approx(by_hand)


def test_pld_and_rdp_match_dp_accounting_on_the_same_events():
    lap, gau = laplace(4.0, 2.0), gaussian(10.0, 2.0)
    led = Ledger("g", pld_interval=COARSE)
    epochs(led, lap, n_records=20, batch=5, n_epochs=3)
    epochs(led, gau, n_records=20, batch=5, n_epochs=2)
    events = [(lap.dp_event, 3), (gau.dp_event, 2)]
    assert led.epsilon("pld") == pytest.approx(direct_pld(events), rel=1e-6)
    assert led.epsilon("rdp") == pytest.approx(direct_rdp(events), rel=1e-9)
    assert led.epsilon("pld") < led.epsilon("basic")
    assert led.report()["releases_per_record"] == 5


def test_pld_matches_at_the_default_interval():
    """The default 1e-4 discretisation, as the accountant with the same interval gives it."""
    cost = laplace(b=4.0, l1=2.0)
    led = Ledger("g")
    epochs(led, cost, n_records=12, batch=4, n_epochs=4)
    assert led.epsilon() == pytest.approx(direct_pld([(cost.dp_event, 4)], interval=1e-4), rel=1e-9)


def test_r3elu_pure_part_is_accounted_as_randomized_response():
    """EpsilonDeltaDpEvent(ε_p, 0) is composed as binary RR of ε_p (the dominating pair of ε_p-DP);
    the PLD equals the library's from_privacy_parameters(ε_p, 0) composed with the Laplace part."""
    cost = r3elu(1.0)
    led = Ledger("g", pld_interval=COARSE)
    epochs(led, cost, n_records=10, batch=5, n_epochs=3)
    part = pld_lib.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(0.5, 0.0),
                                           value_discretization_interval=COARSE)
    part = part.compose(pld_lib.from_laplace_mechanism(2.0, value_discretization_interval=COARSE)).self_compose(3)
    assert led.epsilon("pld") == pytest.approx(part.get_epsilon_for_delta(DELTA), rel=1e-6)
    # binary RR of ε_p is the same pair (its PLD may round one interval higher per release)
    rr_pld = pld_lib.from_randomized_response(2 / (1 + math.exp(0.5)), 2, value_discretization_interval=COARSE,
                                              neighboring_relation=NR.REPLACE_ONE)
    rr_pld = rr_pld.compose(pld_lib.from_laplace_mechanism(2.0, value_discretization_interval=COARSE)).self_compose(3)
    assert abs(led.epsilon("pld") - rr_pld.get_epsilon_for_delta(DELTA)) <= 3 * COARSE + 1e-9
    rr_event = dpa.ComposedDpEvent([dpa.RandomizedResponseDpEvent(2 / (1 + math.exp(0.5)), 2),
                                    dpa.LaplaceDpEvent(2.0)])
    assert led.epsilon("rdp") == pytest.approx(direct_rdp([(rr_event, 3)]), rel=1e-9)
    assert led.epsilon("basic") == pytest.approx(3.0)
    assert led.epsilon("paper-record") == pytest.approx(paper_epsilon(1.0, 3, DELTA))
    assert led.epsilon("paper") == pytest.approx(paper_epsilon(1.0, 6, DELTA))  # 2 steps x 3 epochs
    assert led.epsilon("pld") <= 3.0 + 3 * COARSE
    assert any("randomized response" in a for a in led.report()["assumptions"])


def test_opacus_cross_check_for_gaussian_only_ledgers():
    cost = dpsgd(1.3)
    led = Ledger("g", accountant="rdp", pld_interval=COARSE)
    epochs(led, cost, n_records=16, batch=4, n_epochs=7, direction="update")
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(7):  # each record: one full-batch (sample rate 1) step per epoch
        acc.step(noise_multiplier=1.3, sample_rate=1.0)
    rep = led.report()
    assert rep["epsilons"]["opacus"] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    # two RDP implementations with different order grids agree closely
    assert rep["epsilons"]["opacus"] == pytest.approx(rep["epsilons"]["rdp"], rel=0.02)
    assert rep["epsilon"] == pytest.approx(direct_rdp([(cost.dp_event, 7)]), rel=1e-9)
    assert any("parameters" in a for a in rep["assumptions"])
    assert rep["by_direction"] == {"update": {"batches": 28, "releases": 112}}
    # not Gaussian: no opacus column
    led2 = Ledger("g", accountant="basic")
    led2.charge([entry(laplace(1.0, 1.0), [1])])
    assert "opacus" not in led2.report()["epsilons"]


# -- per-record view ---------------------------------------------------------------------------
def test_worst_record_is_reported_with_uneven_counts():
    cost = laplace(b=2.0, l1=1.0)
    led = Ledger("g", accountant="basic", pld_interval=COARSE)
    led.charge([entry(cost, [1, 2, 3], index=0)])
    led.charge([entry(cost, [1, 4], index=1)])
    led.charge([entry(cost, [1, 5], index=2)])
    rep = led.report()
    assert rep["releases"] == 7 and rep["batches"] == 3 and len(led) == 3 and led.releases == 7
    assert rep["releases_per_record"] == 3  # record 1 was in 3 batches, the others in 1
    assert rep["epsilon"] == pytest.approx(3 * 0.5)
    assert rep["epsilons"]["pld"] == pytest.approx(direct_pld([(cost.dp_event, 3)]), rel=1e-9)


def test_worst_record_over_incomparable_count_vectors():
    """Record A: 3 cheap releases; record B: 2 expensive ones. The max is taken over both."""
    cheap, dear = laplace(b=4.0, l1=1.0), laplace(b=1.0, l1=1.0)
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    for i in range(3):
        led.charge([entry(cheap, [10], index=i)])
    for i in range(2):
        led.charge([entry(dear, [20], index=10 + i)])
    expect = max(direct_pld([(cheap.dp_event, 3)]), direct_pld([(dear.dp_event, 2)]))
    assert led.epsilon() == pytest.approx(expect, rel=1e-9)
    assert led.epsilon("basic") == pytest.approx(2.0)
    # a record with both dominates: it alone is now the worst
    led.charge([entry(dear, [10], index=98)])
    led.charge([entry(dear, [10], index=99)])
    assert led.epsilon() == pytest.approx(direct_pld([(cheap.dp_event, 3), (dear.dp_event, 2)]), rel=1e-6)
    assert led.epsilon("basic") == pytest.approx(3 * 0.25 + 2.0)


def test_test_phase_ids_are_just_records():
    cost = laplace(1.0, 1.0)
    led = Ledger("g", accountant="basic")
    led.charge([entry(cost, [1, 2], phase="train"), entry(cost, [100, 101], phase="test")])
    led.charge([entry(cost, [100], phase="test", epoch=2)])
    assert led.epsilon() == pytest.approx(2.0) and led.report()["releases_per_record"] == 2


def test_charges_compose_once_per_new_worst_vector(monkeypatch):
    """Hundreds of charges, few compositions: a PLD is built only when the worst record's count
    vector changes (once per epoch here), then cached; with a budget, the pre-check composes
    O(log releases) times."""
    calls = []
    real = acc_mod.event_pld
    monkeypatch.setattr(acc_mod, "event_pld", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    cost = laplace(2.0, 1.0)
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    ids = np.arange(400)
    for e in range(1, 4):
        for i in range(0, 400, 4):
            led.charge([entry(cost, ids[i:i + 4], epoch=e, index=i // 4)])
            led.epsilon()  # a caller reading epsilon after every round
    assert len(led) == 300
    assert sorted(calls) == [1, 2, 3]
    calls.clear()
    led = Ledger("g", accountant="pld", pld_interval=COARSE, budget=100.0)
    epochs(led, cost, n_records=400, batch=4, n_epochs=3)
    assert calls == []  # basic (1.5) fits the budget, and the PLD is never above basic
    calls.clear()
    led = Ledger("g", accountant="pld", pld_interval=COARSE, budget=1.4)
    with pytest.raises(BudgetExceeded):
        epochs(led, cost, n_records=400, batch=4, n_epochs=3)
    assert len(calls) <= 3  # counts 1, 2, then 4 (doubling ahead) cover all three epochs


# -- budget ------------------------------------------------------------------------------------
def _snapshot(led):
    arrays, skel = flatten(led.export_state())
    return json.dumps({k: v.tolist() for k, v in arrays.items()}), to_json(skel), json.dumps(led.report())


def test_budget_refusal_is_atomic():
    cost = laplace(1.0, 1.0)  # ε = 1 per release
    led = Ledger("guest-1", accountant="basic", budget=2.5)
    led.charge([entry(cost, [1, 2, 3], index=0)])
    led.charge([entry(cost, [1, 2, 3], epoch=2, index=0)])
    before = _snapshot(led)
    # the first entry alone would fit (record 4 is new); together with the second it does not
    with pytest.raises(BudgetExceeded) as exc:
        led.charge([entry(cost, [4], epoch=3, index=0), entry(cost, [2], epoch=3, index=1)])
    e = exc.value
    assert (e.party, e.budget, e.accountant) == ("guest-1", 2.5, "basic")
    assert e.spent == pytest.approx(2.0) and e.would_be == pytest.approx(3.0)
    assert "budget" in str(e) and "guest-1" in str(e)
    assert _snapshot(led) == before  # nothing recorded
    assert led.epsilon() <= led.budget
    led.charge([entry(cost, [4], epoch=3, index=0)])  # the part that fits is still accepted
    assert len(led) == 3 and led.epsilon() == pytest.approx(2.0)
    assert led.would_be([entry(cost, [4], epoch=4)]) == pytest.approx(2.0)
    assert led.would_be([entry(cost, [1], epoch=4)]) == pytest.approx(3.0)
    assert len(led) == 3  # would_be records nothing


@pytest.mark.parametrize("amplification", [False, True])
def test_budget_stops_at_the_exact_release(amplification):
    """The pre-checks (doubling + bisection on counts) accept exactly the releases whose exact
    epsilon fits: the first refused count is the first whose direct RDP epsilon exceeds the budget."""
    z, q = 4.0, 0.25
    budget = 1.5 if amplification else 6.0
    cost = dpsgd(z)
    event = dpa.PoissonSampledDpEvent(q, cost.dp_event) if amplification else cost.dp_event
    rel = NR.ADD_OR_REMOVE_ONE if amplification else NR.REPLACE_ONE
    first_over = next(n for n in range(1, 10_000) if direct_rdp([(event, n)], rel) > budget)
    assert first_over > 16  # exercises the grid / bisection path, not just exact small counts
    led = Ledger("h", accountant="rdp", budget=budget, amplification=amplification)
    accepted = 0
    with pytest.raises(BudgetExceeded):
        for i in range(10_000):
            led.charge([entry(cost, [3], index=i, direction="update", rate=q)])
            accepted += 1
    assert accepted == first_over - 1
    assert led.epsilon() <= budget


def test_budget_with_mixed_costs_uses_exact_value_near_the_limit():
    lap, gau = laplace(4.0, 1.0), gaussian(8.0, 1.0)
    events = lambda n: [(lap.dp_event, n), (gau.dp_event, n)]
    first_over = next(n for n in range(1, 500) if direct_rdp(events(n)) > 3.0)
    led = Ledger("g", accountant="rdp", budget=3.0)
    accepted = 0
    with pytest.raises(BudgetExceeded):
        for i in range(500):
            led.charge([entry(lap, [1], index=i), entry(gau, [1], index=i)])
            accepted += 1
    assert accepted == first_over - 1


def test_unsupported_accountant_is_a_config_error_and_records_nothing():
    led = Ledger("host", accountant="paper")
    with pytest.raises(ConfigError) as exc:
        led.charge([entry(gaussian(1.0, 2.0), [1, 2])])
    msg = str(exc.value)
    assert "--accountant" in msg and "paper" in msg and "gaussian" in msg
    assert "pld" in exc.value.allowed and "rdp" in exc.value.allowed and "basic" in exc.value.allowed
    assert "paper" not in exc.value.allowed
    assert len(led) == 0 and led.report()["releases"] == 0
    # mixed per-release epsilons (geometric schedule) are not for Cor. 4/5 either
    led = Ledger("g", accountant="paper")
    led.charge([entry(laplace(2.0, 1.0), [1])])
    with pytest.raises(ConfigError, match="one per-step epsilon") as exc:
        led.charge([entry(laplace(4.0, 1.0), [1], epoch=2)])
    assert len(led) == 1
    # the per-record reading fails too (record 1 would have two epsilons); basic, pld, rdp apply
    assert exc.value.allowed == "basic, pld, rdp"
    # approximate-DP parts have no RDP; Opacus only accounts Gaussian releases
    approx = PrivacyCost("custom", EpsilonDeltaDpEvent(1.0, 1e-6), None)
    with pytest.raises(ConfigError, match="RDP"):
        Ledger("g", accountant="rdp").charge([entry(approx, [1])])
    with pytest.raises(ConfigError, match="Opacus"):
        Ledger("g", accountant="opacus").charge([entry(laplace(1.0, 1.0), [1])])
    # the report of a ledger whose accountant applies names the ones that do not
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    led.charge([entry(approx, [1])])
    rep = led.report()
    assert rep["epsilons"]["rdp"] is None and rep["epsilons"]["paper"] is None
    assert any(a.startswith("rdp accountant not applicable") for a in rep["assumptions"])


@pytest.mark.parametrize("kwargs,key", [(dict(accountant="moments"), "--accountant"), (dict(delta=0.0), "--delta"),
                                        (dict(delta=1.5), "--delta"), (dict(budget=-1.0), "--budget")])
def test_bad_ledger_settings(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        Ledger("g", **kwargs)


def test_bad_entries_are_rejected_with_what_is_allowed():
    led = Ledger("g", accountant="basic")
    cost = laplace(1.0, 1.0)
    with pytest.raises(ValueError, match="forward, backward, update"):
        led.charge([LedgerEntry(0, ("train", 1, 0), "sideways", cost, np.arange(3))])
    with pytest.raises(ValueError, match="integer"):
        led.charge([LedgerEntry(0, ("train", 1, 0), "forward", cost, np.array([0.5, 1.5]))])
    with pytest.raises(ValueError, match="sample_rate"):
        led.charge([LedgerEntry(0, ("train", 1, 0), "forward", cost, np.arange(3), 1.5)])
    with pytest.raises(TypeError, match="PrivacyCost"):
        led.charge([LedgerEntry(0, ("train", 1, 0), "forward", None, np.arange(3))])
    with pytest.raises(ValueError, match="sample_rate"):
        Ledger("g", amplification=True).charge([entry(cost, [1])])  # training entry without B/N
    assert len(led) == 0


# -- persistence -------------------------------------------------------------------------------
def test_export_and_restore_round_trip():
    led = Ledger("guest-2", accountant="pld", delta=1e-6, budget=40.0, pld_interval=COARSE)
    epochs(led, laplace(4.0, 2.0), n_records=12, batch=5, n_epochs=2)
    epochs(led, rr(1.0, 4), n_records=6, batch=6, n_epochs=1, phase="test", start=100)
    led.charge([entry(r3elu(0.5), [1, 2], epoch=3, direction="backward")])
    arrays, skel = flatten(led.export_state())
    restored = Ledger.from_state(unflatten(arrays, from_json(to_json(skel))))
    assert restored.report() == led.report()
    assert (restored.budget, restored.delta, restored.accountant, restored.amplification) == (40.0, 1e-6, "pld", False)
    json.dumps(led.report())  # the privacy block is JSON-able
    # both continue identically, including where the budget refuses
    more = [entry(laplace(4.0, 2.0), [1, 2, 3], epoch=4)]
    restored.charge(more)
    led.charge(more)
    assert restored.report() == led.report()
    big = [entry(laplace(0.5, 2.0), [1], epoch=5 + i, index=i) for i in range(10)]
    for lg in (led, restored):
        with pytest.raises(BudgetExceeded):
            lg.charge(big)
    assert restored.report() == led.report()


def test_amplified_state_round_trip():
    led = Ledger("h", accountant="rdp", amplification=True, pld_interval=COARSE)
    epochs(led, dpsgd(5.0), n_records=40, batch=10, n_epochs=2, direction="update", rate=0.25)
    restored = Ledger.from_state(unflatten(*flatten(led.export_state())))
    assert restored.report() == led.report()


# -- amplification -----------------------------------------------------------------------------
def test_amplification_composes_poisson_sampled_training_steps():
    cost, q = dpsgd(5.0), 0.25
    off = Ledger("h", accountant="pld", pld_interval=COARSE)
    on = Ledger("h", accountant="pld", pld_interval=COARSE, amplification=True)
    for led in (off, on):
        epochs(led, cost, n_records=40, batch=10, n_epochs=3, direction="update", rate=q)
    steps = 12
    sampled = dpa.PoissonSampledDpEvent(q, cost.dp_event)
    assert on.epsilon() == pytest.approx(direct_pld([(sampled, steps)]), rel=1e-6)
    assert on.epsilon("rdp") == pytest.approx(direct_rdp([(sampled, steps)], NR.ADD_OR_REMOVE_ONE), rel=1e-9)
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=5.0, sample_rate=q)
    assert on.report()["epsilons"]["opacus"] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    assert off.epsilon() == pytest.approx(direct_pld([(cost.dp_event, 3)]), rel=1e-6)
    assert on.epsilon() < off.epsilon()
    rep = on.report()
    assert rep["amplification"] is True
    assert any("Poisson" in a and "host knows" in a for a in rep["assumptions"])
    assert not any("Poisson" in a for a in off.report()["assumptions"])


def test_amplified_pure_releases_and_paper_gamma():
    cost, q = laplace(1.0, 1.0), 0.1
    on = Ledger("g", accountant="basic", amplification=True)
    epochs(on, cost, n_records=50, batch=5, n_epochs=2, rate=q)
    steps = 20
    assert on.epsilon() == pytest.approx(steps * math.log(1 + q * (math.e - 1)))
    assert on.epsilon("paper") == pytest.approx(paper_epsilon(1.0, steps, DELTA, gamma=q))
    sampled = dpa.PoissonSampledDpEvent(q, cost.dp_event)
    assert on.epsilon("pld") == pytest.approx(direct_pld([(sampled, steps)], interval=1e-4), rel=1e-6)


def test_test_phase_stays_per_record_under_amplification():
    cost, q = laplace(2.0, 1.0), 0.1
    on = Ledger("g", accountant="pld", pld_interval=COARSE, amplification=True)
    epochs(on, cost, n_records=20, batch=2, n_epochs=1, rate=q)  # 10 training steps
    train_view = direct_pld([(dpa.PoissonSampledDpEvent(q, cost.dp_event), 10)])
    assert on.epsilon() == pytest.approx(train_view, rel=1e-6)
    # each test record released 4 times, per record (not amplified): this view now dominates
    epochs(on, cost, n_records=6, batch=3, n_epochs=4, phase="test", start=1000)
    test_view = direct_pld([(cost.dp_event, 4)])
    assert test_view > train_view
    assert on.epsilon() == pytest.approx(test_view, rel=1e-6)


def test_pld_interval_scales_with_large_releases_and_never_exceeds_basic():
    """Per-release epsilons above 1 widen the PLD interval to base x epsilon (same relative
    resolution); 003-sized releases (epsilon ~ 1000) overflow the PLD's float arithmetic, and
    basic composition — also a valid bound — is reported instead of inf."""
    cost = laplace(b=0.1, l1=5.0)  # ε = 50 per release
    led = Ledger("g", accountant="pld")
    led.charge([entry(cost, [1])])
    led.charge([entry(cost, [1], epoch=2)])
    assert led.epsilon() == pytest.approx(direct_pld([(cost.dp_event, 2)], interval=1e-4 * 50), rel=1e-9)
    assert led.epsilon() <= 100.0
    huge = laplace(b=0.5, l1=512.0)  # 003 Table 11: d = 256, b = 0.5, L1 = 2d → ε = 1024
    led = Ledger("g", accountant="pld")
    led.charge([entry(huge, [1])])
    assert led.epsilon() == pytest.approx(1024.0)
    eps = led.report()["epsilons"]
    assert eps["basic"] == pytest.approx(1024.0) and eps["pld"] == pytest.approx(1024.0)
    assert eps["paper"] == math.inf  # e^{1024} overflows: Cor. 4/5 gives no finite bound here


def test_charges_without_a_budget_report_the_same_as_with_one():
    """Without a budget the ledger defers its per-record histogram to the next epsilon query; the
    answers must be exactly those of a ledger that keeps it current (a budget forces that)."""
    lazy, eager = Ledger("g", accountant="basic"), Ledger("g", accountant="basic", budget=1e9)
    costs = [laplace(4.0, 2.0), rr(3.0, 8)]
    rng = np.random.default_rng(7)
    for step in range(40):
        ids = rng.choice(30, size=int(rng.integers(1, 12)), replace=False)
        e = entry(costs[step % 2], ids, epoch=1 + step // 10, index=step % 10,
                  phase="test" if step % 7 == 0 else "train")
        lazy.charge([e])
        eager.charge([e])
        if step % 9 == 0:  # queries in between rebuild the lazy histogram
            assert lazy.epsilon() == eager.epsilon()
    for acc in ("basic", "paper", "pld", "rdp"):
        assert lazy.epsilon(acc) == eager.epsilon(acc), acc
    a, b = lazy.report(), eager.report()
    b["budget"] = None
    assert a == b


# -- one registry ------------------------------------------------------------------------------
def test_one_registry_of_accountants_read_by_ledger_and_config():
    names = accountant_names()
    assert names == ("basic", "paper", "paper-record", "pld", "rdp", "opacus")
    with pytest.raises(ConfigError) as exc:
        Ledger("g", accountant="moments")
    assert exc.value.allowed == ", ".join(names)
    led = Ledger("g")
    with pytest.raises(ConfigError) as exc:
        led.epsilon("tight")
    assert exc.value.allowed == ", ".join(names)
    from fl_split.config import RunConfig

    choices = {f.name: f for f in dataclasses.fields(RunConfig)}["accountant"].metadata["choices"]
    assert tuple(choices() if callable(choices) else choices) == names


def test_importing_the_accountants_loads_no_accounting_library():
    """``fl-split --help`` lists the accountants: the registry must not import dp_accounting,
    Opacus or SciPy (they are imported inside the methods that use them)."""
    code = ("import sys, fl_split.privacy.accountants as a; a.accountant_names(); "
            "print([m for m in ('dp_accounting', 'opacus', 'scipy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- DP-SGD under replace-one --------------------------------------------------------------------
def test_dpsgd_cost_is_the_replace_one_gaussian():
    """Replacing one record moves the clipped sum by up to 2C: a Gaussian of multiplier σ/2."""
    cost = dpsgd_cost(0.7, 1.5)
    assert isinstance(cost.dp_event, dpa.GaussianDpEvent) and cost.dp_event.noise_multiplier == pytest.approx(0.35)
    assert cost.epsilon is None and cost.sensitivity_l2 == 3.0
    assert dict(cost.params)["noise_multiplier"] == 0.7 and dict(cost.params)["max_grad_norm"] == 1.5
    assert dpsgd_cost(0.7, 1.5) is cost  # one object per setting (the ledger keys costs by identity first)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpsgd_cost(0.0, 1.0)


def test_dpsgd_epsilon_against_opacus_and_dp_accounting():
    """σ = 0.7, every record in every step (sample rate 1), T = 5 steps, δ = 1e-5.

    Opacus is add/remove (one record moves the clipped sum by C): replace-one at σ is Opacus at
    σ/2, so its RDPAccountant stepped at σ/2 must give the ledger's opacus and rdp values.
    dp_accounting has its own replace-one analysis of the Gaussian (PLDAccountant(REPLACE_ONE)
    doubles the shift): at σ it must give the ledger's PLD. Both are far above what σ itself
    gives (the understated value fl_split reported before: 19.3 instead of 49.5)."""
    from opacus.accountants import RDPAccountant

    sigma, steps = 0.7, 5
    led = Ledger("g", accountant="rdp")
    for t in range(steps):
        led.charge([entry(dpsgd_cost(sigma, 1.0), np.arange(20), epoch=t + 1, direction="update", rate=1.0)])
    rep = led.report()
    half = RDPAccountant()
    for _ in range(steps):
        half.step(noise_multiplier=sigma / 2, sample_rate=1.0)
    assert rep["epsilons"]["opacus"] == pytest.approx(half.get_epsilon(DELTA), rel=1e-9)
    assert rep["epsilons"]["rdp"] == pytest.approx(half.get_epsilon(DELTA), rel=1e-9)  # same orders here
    assert rep["epsilons"]["rdp"] == pytest.approx(direct_rdp([(dpa.GaussianDpEvent(sigma / 2), steps)]), rel=1e-9)
    library = dpa.pld.PLDAccountant(NR.REPLACE_ONE, value_discretization_interval=1e-4)
    library.compose(dpa.GaussianDpEvent(sigma), steps)
    # T Gaussians compose exactly into one (multiplier σ/2/√T): the analytic Gaussian's epsilon
    exact = dpa.get_epsilon_gaussian(sigma / 2 / math.sqrt(steps), DELTA)
    assert rep["epsilons"]["pld"] == pytest.approx(library.get_epsilon(DELTA), rel=1e-6)
    assert rep["epsilons"]["pld"] == pytest.approx(exact, rel=1e-6)
    assert rep["epsilons"]["rdp"] == pytest.approx(49.5, abs=0.05)
    old = RDPAccountant()
    for _ in range(steps):
        old.step(noise_multiplier=sigma, sample_rate=1.0)
    assert old.get_epsilon(DELTA) == pytest.approx(19.3, abs=0.05)
    assert rep["epsilons"]["rdp"] / old.get_epsilon(DELTA) > 2.2
    assert any("sigma/2" in a for a in rep["assumptions"])


# -- amplification: one sampled event per training batch ---------------------------------------
def test_amplification_one_step_per_batch_released_to_two_guests():
    """The host's releases of one batch to G = 2 guests are ONE Poisson-sampled event containing both
    (q = 0.05, 100 steps, Laplace ε = 1 per release): basic is 100·ln(1+q(e²−1)) = 27.72, not the
    16.48 of 200 independent samples."""
    q, steps, cost = 0.05, 100, laplace(1.0, 1.0)
    led = Ledger("host", accountant="basic", amplification=True)
    for i in range(steps):
        ids = np.arange(5 * (i % 20), 5 * (i % 20) + 5)
        led.charge([entry(cost, ids, epoch=1 + i // 20, index=i % 20, direction="backward", rate=q)
                    for _guest in range(2)])
    amplified = math.log1p(q * math.expm1(2.0))  # the step is 2-DP; sampled at q
    assert led.epsilon() == pytest.approx(steps * amplified, rel=1e-12)
    assert led.epsilon() == pytest.approx(27.72, abs=0.005)
    independent = 2 * steps * math.log1p(q * math.expm1(1.0))
    assert independent == pytest.approx(16.48, abs=0.005) and led.epsilon() > independent + 11
    # PLD / RDP: the step's pure epsilon as binary randomized response (its dominating pair), composed
    # 100 times — dp_accounting called directly on that event
    rr_event = dpa.RandomizedResponseDpEvent(rr_noise(amplified), 2)
    direct = pld_lib.from_randomized_response(rr_noise(amplified), 2, value_discretization_interval=1e-4,
                                              neighboring_relation=NR.REPLACE_ONE).self_compose(steps)
    assert led.epsilon("pld") == pytest.approx(direct.get_epsilon_for_delta(DELTA), rel=1e-9)
    assert led.epsilon("rdp") == pytest.approx(direct_rdp([(rr_event, steps)]), rel=1e-9)
    # the old reading (each guest's release its own sample) is optimistic, under PLD too
    sampled = dpa.PoissonSampledDpEvent(q, cost.dp_event)
    assert direct_pld([(sampled, 2 * steps)], interval=1e-4) < led.epsilon("pld")
    assert led.epsilon("paper") == pytest.approx(paper_epsilon(2.0, steps, DELTA, gamma=q))
    assert any("ln(1+q(e^eps-1))" in a and "dominating pair" in a for a in led.report()["assumptions"])


def test_amplified_gaussian_steps_compose_exactly_into_one_gaussian():
    """A host step with Gaussian backward releases to 2 guests and a DP-SGD update is one sampled
    Gaussian of the merged multiplier; dp_accounting's RDP accountant, given the composed event
    inside the Poisson sampling, computes the same multiplier itself."""
    q, steps = 0.1, 30
    back, upd = gaussian(6.0, 2.0), dpsgd_cost(1.1, 1.0)  # multipliers 3 and 0.55
    led = Ledger("host", accountant="pld", amplification=True, pld_interval=COARSE)
    for i in range(steps):
        led.charge([entry(back, [i], index=i, direction="backward", rate=q),
                    entry(back, [i], index=i, direction="backward", rate=q),
                    entry(upd, [i], index=i, direction="update", rate=q)])
    composed = dpa.PoissonSampledDpEvent(q, dpa.ComposedDpEvent([back.dp_event, back.dp_event, upd.dp_event]))
    assert led.epsilon("rdp") == pytest.approx(direct_rdp([(composed, steps)], NR.ADD_OR_REMOVE_ONE), rel=1e-9)
    z = (2 / 3.0 ** 2 + 1 / 0.55 ** 2) ** -0.5
    merged = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    interval = COARSE * acc_mod.amplified_pure_epsilon(dpa.get_epsilon_gaussian(z, DELTA), q)
    assert led.epsilon() == pytest.approx(direct_pld([(merged, steps)], interval=max(COARSE, interval)), rel=1e-6)
    from opacus.accountants import RDPAccountant

    op = RDPAccountant()
    for _ in range(steps):
        op.step(noise_multiplier=z, sample_rate=q)
    assert led.report()["epsilons"]["opacus"] == pytest.approx(op.get_epsilon(DELTA), rel=1e-9)
    # three independent samples per step would be optimistic
    apart = [(dpa.PoissonSampledDpEvent(q, back.dp_event), 2 * steps),
             (dpa.PoissonSampledDpEvent(q, upd.dp_event), steps)]
    assert direct_rdp(apart, NR.ADD_OR_REMOVE_ONE) < led.epsilon("rdp")


def test_a_batch_charged_in_two_calls_is_one_step():
    """A guest charges its forward release of a batch when it releases it and its DP-SGD update of
    the same batch when the gradient comes back (a later call, interleaved with the next batch's
    release): the ledger ends exactly where charging both at once would."""
    q, fwd, upd = 0.25, gaussian(8.0, 2.0), dpsgd_cost(1.0, 1.0)
    apart = Ledger("guest-1", accountant="rdp", amplification=True, pld_interval=COARSE)
    together = Ledger("guest-1", accountant="rdp", amplification=True, pld_interval=COARSE)
    keys = [(e, i) for e in (1, 2) for i in range(4)]
    for n, (e, i) in enumerate(keys):
        ids = np.arange(10 * i, 10 * i + 10)
        apart.charge([entry(fwd, ids, epoch=e, index=i, rate=q)])
        if n:
            pe, pi = keys[n - 1]
            apart.charge([entry(upd, np.arange(10 * pi, 10 * pi + 10), epoch=pe, index=pi, direction="update", rate=q)])
        together.charge([entry(fwd, ids, epoch=e, index=i, rate=q),
                         entry(upd, ids, epoch=e, index=i, direction="update", rate=q)])
    e, i = keys[-1]
    apart.charge([entry(upd, np.arange(10 * i, 10 * i + 10), epoch=e, index=i, direction="update", rate=q)])
    for name in ("basic", "pld", "rdp", "opacus"):
        assert apart.epsilon(name) == together.epsilon(name), name
    assert apart.training_steps == 8
    composed = dpa.PoissonSampledDpEvent(q, dpa.ComposedDpEvent([fwd.dp_event, upd.dp_event]))
    assert apart.epsilon() == pytest.approx(direct_rdp([(composed, 8)], NR.ADD_OR_REMOVE_ONE), rel=1e-9)


def test_amplified_step_mixing_gaussian_and_laplace():
    """dp_accounting has no PLD/RDP of a Poisson-sampled composition of a Gaussian and a Laplace
    release. Basic amplifies the step's (ε, δ) by sampling; PLD composes the dominating pair of that
    (ε, δ) guarantee (half of δ spent on the steps' δ); RDP does not apply and says why."""
    q, steps = 0.1, 200
    led = Ledger("host", accountant="basic", amplification=True)
    for i in range(steps):
        led.charge([entry(laplace(2.0, 1.0), [i], index=i, direction="backward", rate=q),
                    entry(dpsgd_cost(4.0, 1.0), [i], index=i, direction="update", rate=q)])
    rep = led.report()
    assert rep["epsilons"]["rdp"] is None
    assert any(a.startswith("rdp accountant not applicable") and "mixes" in a for a in rep["assumptions"])
    # basic, each step: 0.5 + ε_G(δ_in) with δ_in = δ/(T q), then ln(1 + q(e^that − 1))
    inner = 0.5 + dpa.get_epsilon_gaussian(2.0, DELTA / (steps * q))
    assert led.epsilon() == pytest.approx(steps * math.log1p(q * math.expm1(inner)), rel=1e-9)
    # pld, each step: (ln(1+q(e^{0.5 + ε_G(δ_s)} − 1)), q δ_s) with δ_s = δ/(2 T q), composed as PLDs
    d_s = DELTA / (2 * steps * q)
    e = math.log1p(q * math.expm1(0.5 + dpa.get_epsilon_gaussian(2.0, d_s)))
    pair = pld_lib.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(e, q * d_s),
                                           value_discretization_interval=1e-4 * max(1.0, e))
    by_hand = pair.self_compose(steps).get_epsilon_for_delta(DELTA)
    assert rep["epsilons"]["pld"] == pytest.approx(min(by_hand, led.epsilon()), rel=1e-9)
    assert rep["epsilons"]["pld"] < led.epsilon()
    assert any("from_privacy_parameters" in a and "half of delta" in a for a in rep["assumptions"])
    with pytest.raises(ConfigError, match="mixes") as exc:
        Ledger("host", accountant="rdp", amplification=True).charge(
            [entry(laplace(2.0, 1.0), [1], direction="backward", rate=q),
             entry(dpsgd_cost(1.0, 1.0), [1], direction="update", rate=q)])
    assert exc.value.allowed == "basic, pld"


# -- paper: 001 Cor. 4/5 as stated -----------------------------------------------------------------
def test_paper_accountant_counts_training_steps_with_gamma_b_over_n():
    """T = training steps the party released in, γ = B/N, ε = the per-step pure epsilon (a host's two
    backward releases per step: 2ε); test-phase releases per record with γ = 1; the max of the views."""
    n, b, epochs_ = 100, 10, 3
    q = b / n
    host = Ledger("host", accountant="paper")
    ids = np.arange(n)
    for e in range(1, epochs_ + 1):
        for i in range(0, n, b):
            host.charge([entry(laplace(2.0, 1.0), ids[i:i + b], epoch=e, index=i // b, direction="backward", rate=q)
                         for _ in range(2)])
    assert host.epsilon() == pytest.approx(paper_epsilon(1.0, 30, DELTA, gamma=q), rel=1e-12)
    assert host.epsilon("paper-record") == pytest.approx(paper_epsilon(0.5, 6, DELTA), rel=1e-12)
    # test-phase: 8 releases of the same records at γ = 1 now dominate
    guest = Ledger("guest-1", accountant="paper")
    epochs(guest, laplace(2.0, 1.0), n_records=n, batch=b, n_epochs=epochs_, rate=q)
    train_view = paper_epsilon(0.5, 30, DELTA, gamma=q)
    assert guest.epsilon() == pytest.approx(train_view, rel=1e-12)
    epochs(guest, laplace(2.0, 1.0), n_records=20, batch=20, n_epochs=8, phase="test", start=1000)
    assert guest.epsilon() == pytest.approx(max(train_view, paper_epsilon(0.5, 8, DELTA)), rel=1e-12)
    assert paper_epsilon(0.5, 8, DELTA) > train_view
    # steps with different epsilons, or an (ε, δ)-only release: not applicable, with the reason
    led = Ledger("g", accountant="basic")
    led.charge([entry(laplace(2.0, 1.0), [1], index=0, rate=q)])
    led.charge([entry(laplace(2.0, 1.0), [2], index=1, rate=q), entry(laplace(2.0, 1.0), [2], index=1, rate=q)])
    rep = led.report()
    assert rep["epsilons"]["paper"] is None and "one per-step epsilon" in " ".join(rep["assumptions"])
    assert rep["epsilons"]["paper-record"] == pytest.approx(paper_epsilon(0.5, 2, DELTA))
    led.charge([entry(dpsgd_cost(1.0, 1.0), [3], index=2, direction="update", rate=q)])
    assert any(a.startswith("paper accountant not applicable: 001 Cor. 4/5 needs pure epsilon-DP releases; "
                            "dpsgd releases are only (epsilon, delta)-DP") for a in led.report()["assumptions"])


# -- PLD tests whose tolerance separates PLD from basic composition ----------------------------------
def exact_rr_epsilon(eps: float, releases: int, delta: float) -> float:
    """Exact epsilon at ``delta`` of ``releases`` binary randomized responses of ``eps`` (no library):
    with K the number of truthful answers, K ~ Bin(T, p) on one side and Bin(T, 1 − p) on the other
    (p = e^ε/(1+e^ε)), the privacy loss is ε(2K − T), and δ(ε') = Σ_k P(k)(1 − e^{ε' − ε(2k−T)})⁺."""
    t = releases
    lp, lq = eps - math.log1p(math.exp(eps)), -math.log1p(math.exp(eps))
    lc = [math.lgamma(t + 1) - math.lgamma(k + 1) - math.lgamma(t - k + 1) for k in range(t + 1)]

    def delta_at(e: float) -> float:
        return math.fsum(math.exp(lc[k] + k * lp + (t - k) * lq) * -math.expm1(e - eps * (2 * k - t))
                         for k in range(t + 1) if eps * (2 * k - t) > e)

    lo, hi = 0.0, t * eps
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_at(mid) > delta else (lo, mid)
    return hi


def test_pld_of_many_rr_releases_is_tight_and_far_below_basic():
    """400 binary RR releases of ε = 0.1 to one record: basic says 40; the exact epsilon (binomial sum)
    is ≈ 9. The ledger's pessimistic PLD (interval Δ = 1e-4) rounds each release's loss up by less
    than Δ, so it lies in [exact, exact + T·Δ] (T·Δ = 0.04): a tolerance 700× smaller than the gap to
    basic, so this test fails if the PLD degenerates to basic (or to anything else)."""
    eps, t = 0.1, 400
    led = Ledger("g", accountant="pld")  # default interval 1e-4
    for i in range(t):
        led.charge([entry(rr(eps, 1), [7, 8], epoch=i + 1)])
    exact = exact_rr_epsilon(eps, t, DELTA)
    tol = t * 1e-4
    assert exact <= led.epsilon() <= exact + tol
    assert led.epsilon("basic") == pytest.approx(eps * t) and led.epsilon("basic") - exact > 700 * tol
    # and dp_accounting composing the same event at a 10x finer interval agrees within T·(Δ + Δ/10)
    fine = pld_lib.from_randomized_response(rr_noise(eps), 2, value_discretization_interval=1e-5,
                                            neighboring_relation=NR.REPLACE_ONE).self_compose(t)
    assert abs(led.epsilon() - fine.get_epsilon_for_delta(DELTA)) <= t * 1.1e-4


def test_pld_of_many_laplace_releases_is_tight_and_far_below_basic():
    """200 Laplace releases of ε = 0.1: basic 20, the PLD ≈ 4. The truth lies between dp_accounting's
    optimistic and pessimistic PLDs at a 10x finer interval; the ledger's (interval Δ = 1e-4) is
    at least the optimistic one and at most the pessimistic one + T·Δ."""
    cost, t = laplace(b=10.0, l1=1.0), 200
    led = Ledger("g", accountant="pld")
    epochs(led, cost, n_records=6, batch=6, n_epochs=t)
    fine_pess = pld_lib.from_laplace_mechanism(10.0, value_discretization_interval=1e-5).self_compose(t)
    fine_opt = pld_lib.from_laplace_mechanism(10.0, value_discretization_interval=1e-5,
                                              pessimistic_estimate=False).self_compose(t)
    lower, upper = fine_opt.get_epsilon_for_delta(DELTA), fine_pess.get_epsilon_for_delta(DELTA)
    assert lower <= led.epsilon() <= upper + t * 1e-4
    assert led.epsilon("basic") == pytest.approx(20.0) and led.epsilon("basic") - upper > 500 * t * 1e-4


# -- discrete Laplace ------------------------------------------------------------------------------
def test_discrete_laplace_releases():
    """DiscreteLaplaceDpEvent(a, Δ) with ε = aΔ: basic sums ε, PLD is dp_accounting's discrete Laplace
    PLD (as its PLDAccountant builds it), close to the continuous Laplace of the same ε; RDP has none."""
    cost = dlap(0.5, 1000)
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    epochs(led, cost, n_records=8, batch=4, n_epochs=3)
    assert led.epsilon("basic") == pytest.approx(1.5)
    assert led.epsilon() == pytest.approx(direct_pld([(cost.dp_event, 3)]), rel=1e-9)
    assert led.epsilon() == pytest.approx(direct_pld([(laplace(2.0, 1.0).dp_event, 3)]), abs=2e-3)
    rep = led.report()
    assert rep["epsilons"]["rdp"] is None
    assert any(a.startswith("rdp accountant not applicable") and "DiscreteLaplaceDpEvent" in a
               for a in rep["assumptions"])
    assert any("from_discrete_laplace_mechanism" in a for a in rep["assumptions"])
    with pytest.raises(ConfigError, match="DiscreteLaplace") as exc:
        Ledger("g", accountant="rdp").charge([entry(cost, [1])])
    assert "pld" in exc.value.allowed and "basic" in exc.value.allowed
    # a fine grid (sensitivity 1e5 grid units) builds in a fraction of a second
    fine = dlap(1.0, 100_000)
    led = Ledger("g", accountant="pld")
    t0 = time.perf_counter()
    led.charge([entry(fine, [1])])
    assert led.epsilon() == pytest.approx(1.0, abs=1e-3)
    assert time.perf_counter() - t0 < 20


def test_discrete_laplace_in_r3elu_and_under_amplification():
    """R3eLU with the discrete Laplace: [RR of ε_p, DLap] composed per release; with amplification a
    step of it is the pure-DP fallback (ln(1+q(e^ε−1)) as binary RR) in every accountant."""
    ep, el, sens, q = 0.5, 0.5, 640, 0.2
    cost = PrivacyCost("r3elu", dpa.ComposedDpEvent([pure_dp_event(ep),
                                                     dpa.dp_event.DiscreteLaplaceDpEvent(el / sens, sens)]),
                       epsilon=ep + el, sensitivity_l1=float(sens))
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    epochs(led, cost, n_records=10, batch=5, n_epochs=2)
    part = pld_lib.from_randomized_response(rr_noise(ep), 2, value_discretization_interval=COARSE,
                                            neighboring_relation=NR.REPLACE_ONE)
    part = part.compose(pld_lib.from_discrete_laplace_mechanism(el / sens, sensitivity=sens,
                                                                value_discretization_interval=COARSE))
    # (the pessimistic PLD of two releases of ε = 1 rounds above basic composition: capped at 2)
    assert led.epsilon() == pytest.approx(min(part.self_compose(2).get_epsilon_for_delta(DELTA), 2.0), rel=1e-9)
    for e in range(3, 13):
        led.charge([entry(cost, np.arange(10), epoch=e)])
    assert led.epsilon() == pytest.approx(part.self_compose(12).get_epsilon_for_delta(DELTA), rel=1e-9)
    assert led.epsilon() < 11.0 < led.epsilon("basic")
    assert led.epsilon("rdp") is None
    amp = Ledger("g", accountant="pld", amplification=True)
    epochs(amp, cost, n_records=10, batch=5, n_epochs=2, rate=q)  # 4 steps
    e1 = math.log1p(q * math.expm1(1.0))
    assert amp.epsilon("basic") == pytest.approx(4 * e1, rel=1e-12)
    assert amp.epsilon("rdp") == pytest.approx(direct_rdp([(pure_dp_event(e1), 4)]), rel=1e-9)
    direct = pld_lib.from_randomized_response(rr_noise(e1), 2, value_discretization_interval=1e-4,
                                              neighboring_relation=NR.REPLACE_ONE).self_compose(4)
    assert amp.epsilon() == pytest.approx(min(direct.get_epsilon_for_delta(DELTA), 4 * e1), rel=1e-9)


def test_pure_rdp_vector_is_dp_accountings_randomized_response():
    for eps in (0.01, 0.3, 1.0, 5.0, 60.0):
        ours, orders = pure_rdp_vector(eps)
        acc = dpa.rdp.RdpAccountant(neighboring_relation=NR.REPLACE_ONE)
        acc.compose(pure_dp_event(eps))
        assert list(orders) == list(acc._orders)
        np.testing.assert_allclose(ours, acc._rdp, rtol=1e-9)


# -- many distinct costs -------------------------------------------------------------------------
def _distinct_cost_run(make_cost, n=200, b=10, n_epochs=4, **kw):
    """A distinct cost per step; returns the ledger, the costs in step order and each record's costs."""
    led = Ledger("g", **kw)
    rng = np.random.default_rng(3)
    costs, where = [], {}
    for e in range(1, n_epochs + 1):
        perm = rng.permutation(n)
        for k in range(n // b):
            cost = make_cost(len(costs))
            costs.append(cost)
            for r in perm[k * b:(k + 1) * b]:
                where.setdefault(int(r), []).append(cost)
            led.charge([entry(cost, perm[k * b:(k + 1) * b], epoch=e, index=k)])
    return led, costs, where


def test_many_distinct_laplace_costs_are_bounded_by_sorted_releases():
    """A distinct Laplace cost per step (ε_i = 1/(1+i), as a per-iteration schedule makes): every
    record's count vector is distinct and incomparable. The bound sorts each record's releases
    (Laplace is ordered by dominance: a larger ε dominates) and takes, position by position, the
    largest any record has: 4 releases for 4 epochs, not one per step, and every record's
    composition is at most the bound's."""
    t0 = time.perf_counter()
    led, costs, where = _distinct_cost_run(lambda i: laplace(b=1.0 + i, l1=1.0), accountant="pld", budget=1e6)
    charging = time.perf_counter() - t0
    rep = led.report()
    ranked = [sorted((c.epsilon for c in cs), reverse=True) for cs in where.values()]
    bound = [max(r[i] for r in ranked) for i in range(4)]
    worst_basic = max(sum(r) for r in ranked)
    assert rep["epsilons"]["basic"] == pytest.approx(worst_basic, rel=1e-12)  # basic stays exact
    assert worst_basic <= sum(bound) < 2 * worst_basic  # the bound is close: far below all 80 steps' sum
    assert math.fsum(c.epsilon for c in costs) > 4 * sum(bound)
    direct = pld_lib.identity(value_discretization_interval=1e-4)
    for e_ in bound:
        direct = direct.compose(pld_lib.from_laplace_mechanism(1 / e_, value_discretization_interval=1e-4))
    assert rep["epsilons"]["pld"] == pytest.approx(min(direct.get_epsilon_for_delta(DELTA), worst_basic), rel=1e-6)
    for cs in list(where.values())[:20]:  # every record is below the bound
        own = pld_lib.identity(value_discretization_interval=1e-4)
        for c in cs:
            own = own.compose(pld_lib.from_laplace_mechanism(c.dp_event.noise_multiplier,
                                                             value_discretization_interval=1e-4))
        assert own.get_epsilon_for_delta(DELTA) <= rep["epsilons"]["pld"] + 1e-9
    bound_events = [(dpa.LaplaceDpEvent(1 / e_), 1) for e_ in bound]
    assert rep["epsilons"]["rdp"] == pytest.approx(direct_rdp(bound_events), rel=1e-9)
    assert "per-record bound" in " ".join(rep["assumptions"])
    assert charging < 30  # 80 charges with a budget check each (well under a second here)
    # a handful of incomparable records is still composed record by record (no bound)
    small = Ledger("g", accountant="basic")
    for i in range(5):
        small.charge([entry(laplace(1.0 + i, 1.0), [i], index=i)])
    assert small.epsilon() == pytest.approx(1.0) and "per-record bound" not in " ".join(small.report()["assumptions"])


def test_many_distinct_unordered_costs_use_the_elementwise_maximum_and_merge_the_pld_tail():
    """Releases of no dominance-ordered family (here discrete Laplace with distinct parameters) are
    bounded by the element-wise maximum of the records' counts — a record released at every step —
    and beyond the 64 largest distinct pure releases the PLD merges the rest into one pure release
    of their summed epsilon (basic composition). Both are stated in the report."""
    led, costs, where = _distinct_cost_run(lambda i: dlap(1.0 / (1 + i), 50), accountant="pld", pld_interval=COARSE)
    rep = led.report()
    worst_basic = max(sum(c.epsilon for c in cs) for cs in where.values())
    assert rep["epsilons"]["basic"] == pytest.approx(worst_basic, rel=1e-12)  # exact, record by record
    # the bound: every step once (the element-wise maximum); its PLD, by hand: the 64 largest
    # releases + binary RR of the rest's summed epsilon
    top, rest = sorted(costs, key=lambda c: -c.epsilon)[:64], sorted(costs, key=lambda c: -c.epsilon)[64:]
    by_hand = pld_lib.from_randomized_response(rr_noise(math.fsum(c.epsilon for c in rest)), 2,
                                               value_discretization_interval=COARSE,
                                               neighboring_relation=NR.REPLACE_ONE)
    for c in top:
        by_hand = by_hand.compose(pld_lib.from_discrete_laplace_mechanism(
            c.dp_event.noise_parameter, sensitivity=50, value_discretization_interval=COARSE))
    state = led._state
    (items,), bounded = led._candidates(state, skip_train=False)
    assert bounded and [n for _, n in items] == [1] * len(costs)
    view = acc_mod.View(acc_mod.RECORDS, items, state.releases, COARSE)
    notes = set()
    assert acc_mod.get_accountant("pld").epsilon(view, DELTA, notes) == pytest.approx(
        min(by_hand.get_epsilon_for_delta(DELTA), math.fsum(c.epsilon for c in costs)), rel=1e-6)
    assert acc_mod.NOTE_PLD_TAIL in notes
    # reported: the smaller of that and the worst record's exact basic composition (both valid)
    assert rep["epsilons"]["pld"] == pytest.approx(min(by_hand.get_epsilon_for_delta(DELTA), worst_basic), rel=1e-6)
    text = " ".join(rep["assumptions"])
    assert "per-record bound" in text and "element-wise maximum" in text and "64 largest" in text


# -- persistence, with steps ---------------------------------------------------------------------
def test_round_trip_with_steps_and_budget():
    led = Ledger("guest-1", accountant="basic", amplification=True, budget=30.0, pld_interval=COARSE)
    fwd, upd, q = laplace(4.0, 1.0), dpsgd_cost(2.0, 1.0), 0.2
    for i in range(6):
        led.charge([entry(fwd, [i, i + 1], index=i, rate=q)])
        if i:
            led.charge([entry(upd, [i - 1, i], index=i - 1, direction="update", rate=q)])
    epochs(led, dlap(0.25, 50), n_records=4, batch=4, n_epochs=2, phase="test", start=500)
    state = led.export_state()
    assert state["format"] == 2 and state["steps"]["epoch"].tolist() == [1] * 6
    restored = Ledger.from_state(unflatten(*flatten(state)))
    assert restored.report() == led.report()
    assert restored.training_steps == 6
    more = [entry(upd, [5, 6], index=5, direction="update", rate=q)]
    for lg in (led, restored):
        lg.charge(more)
    assert restored.report() == led.report()
    big = [entry(fwd, [1], epoch=9, index=i, rate=q) for i in range(1000)]
    for lg in (led, restored):
        with pytest.raises(BudgetExceeded):
            lg.charge(big)
    assert restored.report() == led.report()
    with pytest.raises(ValueError, match="format 2"):
        Ledger.from_state({**state, "format": 1})


def test_costs_differing_only_in_parameters_are_one_kind_of_release():
    """Two costs with the same event and epsilon (e.g. R3eLU with refreshed importances) are listed
    apart in the report but composed as one kind (no element-wise bound, one PLD atom)."""
    a = PrivacyCost("r3elu", dpa.LaplaceDpEvent(2.0), 0.5, params=(("importance", (1.0, 2.0)),))
    b = PrivacyCost("r3elu", dpa.LaplaceDpEvent(2.0), 0.5, params=(("importance", (2.0, 1.0)),))
    assert cost_key(a) != cost_key(b)
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    for i in range(40):
        led.charge([entry(a if i % 2 else b, [i % 7, 7 + i % 5], index=i)])
    rep = led.report()
    assert len(rep["mechanisms"]) == 2 and sum(m["releases"] for m in rep["mechanisms"]) == 80
    worst = rep["releases_per_record"]
    assert rep["epsilons"]["basic"] == pytest.approx(0.5 * worst)
    assert rep["epsilon"] == pytest.approx(direct_pld([(a.dp_event, worst)]), rel=1e-9)


def test_discrete_laplace_sampler_slack_is_added_to_the_pld():
    """A cost may state a pure epsilon above its event's (the sampler slack: the event is the ideal
    discrete Laplace mechanism). Basic sums the stated epsilons; the PLD of the events is taken at
    δ·e^{−S/2} and the summed excess S is added (δ'(ε + S) ≤ e^{S/2}·δ(ε))."""
    slack, sens, t = 1e-3, 400, 800.0  # event epsilon Δ/t = 0.5, stated 0.501
    cost = PrivacyCost("laplace", dpa.dp_event.DiscreteLaplaceDpEvent(1.0 / t, sens), epsilon=sens / t + slack,
                       sensitivity_l1=1.0, params=(("sampler_slack", slack),))
    led = Ledger("g", accountant="pld", pld_interval=COARSE)
    epochs(led, cost, n_records=4, batch=4, n_epochs=20)
    s_total = 20 * slack
    direct = pld_lib.from_discrete_laplace_mechanism(1.0 / t, sensitivity=sens, value_discretization_interval=COARSE)
    expect = direct.self_compose(20).get_epsilon_for_delta(DELTA * math.exp(-s_total / 2)) + s_total
    assert led.epsilon() == pytest.approx(expect, rel=1e-9)
    assert led.epsilon("basic") == pytest.approx(20 * (0.5 + slack))
    assert any("S, their summed excess" in a for a in led.report()["assumptions"])


def test_the_laplace_mechanisms_cost_goes_through_the_ledger():
    """The Laplace mechanism's own cost (discrete Laplace on a grid, with its sampler slack) is
    accounted by basic, paper and pld, not by rdp; its epsilon is the requested one. Its event is
    the per-element worst case (issue 26): 16 discrete Laplace events of sensitivity 2M, so the PLD
    is that of 16 × 10 continuous Laplace releases of ε 2/16 (noise multiplier 8)."""
    from fl_split.privacy.mechanisms import Laplace

    cost = Laplace(16, "forward", 1.0, epsilon=2.0).cost()
    assert type(cost.dp_event).__name__ == "SelfComposedDpEvent" and cost.dp_event.count == 16
    assert type(cost.dp_event.event).__name__ == "DiscreteLaplaceDpEvent" and cost.epsilon == pytest.approx(2.0)
    led = Ledger("guest-1", accountant="pld")
    epochs(led, cost, n_records=20, batch=10, n_epochs=10, rate=0.5)
    rep = led.report()
    assert rep["epsilons"]["basic"] == pytest.approx(20.0)
    assert rep["epsilons"]["paper"] == pytest.approx(paper_epsilon(2.0, 20, DELTA, gamma=0.5))
    assert rep["epsilons"]["rdp"] is None
    continuous = direct_pld([(dpa.LaplaceDpEvent(8.0), 160)], interval=2e-4)
    assert continuous - 0.01 <= rep["epsilon"] <= continuous * 1.03 and rep["epsilon"] < 20.0


def test_a_refused_new_kind_of_release_leaves_nothing_behind():
    """A refused charge's new kind of release is not remembered: the next new kind takes its index
    and must be judged (and accounted) on its own."""
    led = Ledger("g", accountant="rdp", budget=5.0)
    with pytest.raises(ConfigError, match="DiscreteLaplace"):
        led.charge([entry(dlap(0.5, 10), [1])])
    assert led.would_be([entry(dlap(0.5, 10), [1])]) is None
    led.charge([entry(laplace(2.0, 1.0), [1])])  # the same index, now a Laplace release
    assert led.epsilon() == pytest.approx(direct_rdp([(dpa.LaplaceDpEvent(2.0), 1)]), rel=1e-12)
    with pytest.raises(BudgetExceeded):
        led.charge([entry(laplace(0.1, 1.0), [1], epoch=2)])  # ε = 10 alone
    led.charge([entry(laplace(4.0, 1.0), [1], epoch=3)])
    events = [(dpa.LaplaceDpEvent(2.0), 1), (dpa.LaplaceDpEvent(4.0), 1)]
    assert led.epsilon() == pytest.approx(direct_rdp(events), rel=1e-12)
    assert Ledger.from_state(led.export_state()).report() == led.report()


def test_any_int64_key_is_accounted_like_its_rank():
    """Record keys are any int64 (fl_split.data.ids: text and composite IDs hash to *negative* keys,
    integer IDs reach 2**63 - 1): the ledger's per-record counts, ε and budget refusals depend on which
    releases share a record, never on the key's value — the same charges on keys of every range give
    the same report as on the keys 0..n-1, and survive export/restore."""
    n = 40
    wild = np.sort(np.concatenate([np.array([-(2**63), -1, 2**63 - 1, 0], dtype=np.int64),
                                   np.random.default_rng(7).integers(-(2**63), 2**63 - 1, size=n - 4,
                                                                     dtype=np.int64)]))
    assert len(np.unique(wild)) == n
    plain = np.arange(n, dtype=np.int64)
    reports = []
    for keys in (plain, wild):
        led = Ledger("g", accountant="pld", pld_interval=COARSE, budget=6.0)
        for e in range(1, 4):  # three epochs; records 0..9 released twice per epoch (a test split too)
            perm = np.random.default_rng(e).permutation(n)
            for i in range(0, n, 8):
                led.charge([entry(laplace(4.0, 2.0), keys[perm[i:i + 8]], epoch=e, index=i // 8, rnd=e)])
            led.charge([entry(rr(1.0, 4), keys[:10], epoch=e, phase="test", rnd=e)])
        with pytest.raises(BudgetExceeded):
            led.charge([entry(laplace(0.5, 2.0), keys, epoch=4, rnd=4)])
        restored = Ledger.from_state(unflatten(*flatten(led.export_state())))
        assert restored.report() == led.report()
        reports.append(led.report())
    assert reports[0] == reports[1]
