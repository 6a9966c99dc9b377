"""Per-party ledger and accountants (SPEC §5; docs/accounting.md).

Every accountant is checked against an independent computation done here: dp_accounting called
directly on the same composed events (PLD, RDP), Opacus' accountant stepped by hand, closed
forms for single releases and for sequential / 001 Cor. 4-5 composition. Most PLD comparisons
run at a coarse discretisation (``pld_interval=1e-3``) for speed: the ledger and the direct
computation then use the same interval, so they must agree to rounding, whatever the interval.
"""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import NeighboringRelation as NR
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from fl_split.errors import BudgetExceeded, ConfigError
from fl_split.privacy import ledger as ledger_mod
from fl_split.privacy.base import PrivacyCost
from fl_split.privacy.ledger import EpsilonDeltaDpEvent, Ledger, LedgerEntry, paper_epsilon
from fl_split.state import flatten, from_json, to_json, unflatten

DELTA = 1e-5
COARSE = 1e-3  # PLD interval used by most tests (see module docstring)
# The ledger widens the PLD interval to base x max(1, largest per-release epsilon) (a relative
# resolution); tests comparing with a direct PLD at the base interval keep per-release epsilons
# (Gaussian: at delta) <= 1, e.g. noise multiplier 5 (epsilon 0.73 at 1e-5).


# -- costs as the mechanisms describe them (brief / SPEC §3) -----------------------------------
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
    return PrivacyCost("dpsgd", dpa.GaussianDpEvent(noise_multiplier=z), None, sensitivity_l2=1.0,
                       params=(("noise_multiplier", z), ("max_grad_norm", 1.0)))


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
    for acc, expect in (("basic", 20 * 0.1), ("paper", paper_epsilon(0.1, 20, DELTA))):
        led = Ledger("g", accountant=acc)
        epochs(led, cost, n_records=30, batch=8, n_epochs=20)
        assert led.epsilon() == pytest.approx(expect, rel=1e-12)
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
    assert led.epsilon("paper") == pytest.approx(paper_epsilon(1.0, 3, DELTA))
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
    real = ledger_mod.event_pld
    monkeypatch.setattr(ledger_mod, "event_pld", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
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
    with pytest.raises(ConfigError, match="one per-release epsilon"):
        led.charge([entry(laplace(4.0, 1.0), [1], epoch=2)])
    assert len(led) == 1
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
