"""The claim table's verdict rules (issue 26, ``experiments/verdicts.py``) on synthetic per-seed
numbers: decisions on the standard error that more seeds settle, n ≥ 2, Holm–Bonferroni over the
table, equivalence margins, the usability guard and the channel check."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from scipy import stats

from experiments import claims as CL
from experiments import common as C
from experiments import verdicts as V


def _seeds(mean: float, sd: float, n: int) -> list[float]:
    """n per-seed values with exactly this mean and sample sd: more seeds, the same spread. Even n:
    ± sd·√((n−1)/n) alternating; odd n: one at the mean, the other n − 1 at ± sd alternating."""
    if n % 2 == 0:
        h = sd * math.sqrt((n - 1) / n)
        return [mean + (h if i % 2 else -h) for i in range(n)]
    return [mean] + [mean + (sd if i % 2 else -sd) for i in range(n - 1)]


def test_synthetic_seeds_have_the_stated_mean_and_sd():
    for n in (3, 4, 12, 13):
        m, sd = V.mean_sd(_seeds(0.85, 0.05, n))
        assert m == pytest.approx(0.85) and sd == pytest.approx(0.05), n


def test_one_seed_decides_nothing():
    t = V.t_test([0.9], 0.5)
    assert t["n"] == 1 and math.isnan(t["p"]) and not (t["above"] or t["below"] or t["clear"])
    w = V.welch([0.9], [0.1, 0.2])
    assert math.isnan(w["p"]) and not w["clear"]
    assert not V.within(V.paired([0.5], [0.5]), 0.1)["inside"]
    assert not V.usable([0.9], 0.1, 0.95)["ok"]  # one seed: not shown usable either


def test_one_seed_verdict_is_inconclusive(tmp_path):
    """The n ≥ 2 guard: a one-seed ``--verify`` prints no "partly holds" (issue 26) — in the
    experiment's own claims.json and again in the table."""
    args = argparse.Namespace(quick=True, out=str(tmp_path), seeds=[0], substitute=[], data_root="")
    out = C.Out("exp_test", args, "exp_test.py")
    rows = [C.claim("x", "s", "c", "1", "2", C.PARTLY, rule="a rule of some length"),
            C.claim("y", "s", "c", "1", "2", C.HOLDS, rule="bytes, deterministic, no seeds", deterministic=True),
            C.claim("z", "s", "c", "1", "2", C.UNINFORMATIVE, rule="a rule of some length")]
    out.claims(rows)
    got = {c["id"]: c for c in json.loads((tmp_path / "claims.json").read_text())}
    assert got["x"]["verdict"] == V.INCONCLUSIVE and "one seed" in got["x"]["note"]
    assert got["y"]["verdict"] == V.HOLDS  # deterministic: needs no seeds
    assert got["z"]["verdict"] == V.UNINFORMATIVE
    # the table applies the same guard to a claims.json written without it
    table = CL.correct([{"id": "w", "verdict": V.FAILS, "n": 1, "p": 0.001, "experiment": "exp1_merge_padding"}])
    assert table[0]["verdict"] == V.INCONCLUSIVE


def test_more_seeds_with_the_same_mean_shrink_the_se_and_settle_the_claim():
    """2-digits-host's shape: a per-seed share of 0.85 ± 0.05 against a target of 0.80. The old rule
    (margin ≥ 2 × the per-seed sd: 0.05 < 0.10) stays undecided at every n; the t-test on the
    standard error settles it once enough seeds are run."""
    target = 0.80
    ses, decided = [], {}
    for n in (3, 4, 8, 12):
        xs = _seeds(0.85, 0.05, n)
        t = V.t_test(xs, target)
        m, sd = V.mean_sd(xs)
        assert abs(m - target) < 2 * sd  # the old margin rule: inconclusive for every n
        ses.append(t["se"])
        decided[n] = t["above"]
        assert t["se"] == pytest.approx(0.05 / math.sqrt(n))
        assert t["p_above"] == pytest.approx(stats.ttest_1samp(xs, target, alternative="greater").pvalue)
    assert ses == sorted(ses, reverse=True)
    assert not decided[3] and decided[8] and decided[12]


def test_welch_and_paired_match_scipy():
    a, b = [0.91, 0.88, 0.95, 0.90], [0.80, 0.86, 0.79]
    w = V.welch(a, b)
    assert w["p"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert w["p_above"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False, alternative="greater").pvalue)
    assert w["clear"] and w["above"] and not w["below"]
    p = V.paired(a[:3], b)
    assert p["p"] == pytest.approx(stats.ttest_rel(a[:3], b).pvalue)
    # a zero spread decides on the side of the difference
    z = V.t_test([0.3, 0.3, 0.3], 0.1)
    assert z["above"] and not z["below"] and z["p"] == 0.0


def test_equivalence_needs_a_margin_and_settles_with_seeds():
    """'no difference' claims (1a, 7a, 4d): a non-significant difference is not evidence of none; the
    TOST against a margin settles it either way with more seeds."""
    few = V.within(V.paired(_seeds(0.50, 0.04, 3), [0.49] * 3), 0.05)
    many = V.within(V.paired(_seeds(0.50, 0.04, 30), [0.49] * 30), 0.05)
    assert not few["inside"] and many["inside"] and not many["outside"]
    big = V.within(V.paired(_seeds(0.20, 0.03, 4), [0.50] * 4), 0.05)  # a cut of 0.30, as scaling at σ = 0.1
    assert big["outside"] and not big["inside"]


def test_holm_adjusts_in_step_down_order():
    ps = [0.01, 0.04, None, 0.03, 0.005, float("nan")]
    adj = V.holm(ps)
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → monotone 0.06
    assert adj[4] == pytest.approx(0.02) and adj[0] == pytest.approx(0.03)
    assert adj[3] == pytest.approx(0.06) and adj[1] == pytest.approx(0.06)
    assert adj[2] is None and math.isnan(adj[5])
    assert V.holm([0.9, 0.8]) == [1.0, 1.0]  # 0.8 × 2 capped at 1, then monotone


def _row(cid: str, verdict: str, **kw) -> dict:
    return {"id": cid, "source": "s", "claim": "c", "paper": "1", "ours": "2", "verdict": verdict, "rule": "r",
            "experiment": "exp1_merge_padding", **kw}


def test_table_keeps_only_verdicts_that_survive_holm():
    rows = [_row(str(i), V.HOLDS, p=p, n=3) for i, p in enumerate((0.001, 0.002, 0.03))]
    rows.append(_row("u", V.UNINFORMATIVE, p=0.0001, n=3))
    rows.append(_row("d", V.HOLDS, n=3, deterministic=True))
    out = {c["id"]: c for c in CL.correct(rows)}
    assert out["0"]["verdict"] == V.HOLDS and out["0"]["p_holm"] == pytest.approx(0.003)
    assert out["1"]["verdict"] == V.HOLDS and out["1"]["p_holm"] == pytest.approx(0.004)
    # 0.03 alone, 0.03 after Holm (m = 3, third smallest × 1) — kept; with a fourth test it would not be
    assert out["2"]["verdict"] == V.HOLDS
    more = CL.correct(rows + [_row("x", V.FAILS, p=0.04, n=3)])
    by = {c["id"]: c for c in more}
    assert by["2"]["verdict"] == V.INCONCLUSIVE and by["2"]["verdict_uncorrected"] == V.HOLDS
    assert by["u"]["verdict"] == V.UNINFORMATIVE and "p_holm" not in by["u"]  # not a decided verdict: no test
    assert by["d"]["verdict"] == V.HOLDS
    text = CL.table(more)
    assert "Holm" in text and "(alone: holds; not after Holm)" in text


def test_usability_guard():
    """A defended model at its constant prediction cannot earn a 'holds' (3b's guard, generalised)."""
    trivial = [0.084, 0.083, 0.085]
    at_chance = V.usable([0.085, 0.081, 0.090], trivial, 0.965)
    assert not at_chance["ok"]
    usable = V.usable([0.80, 0.83, 0.85], trivial, 0.965)
    assert usable["ok"] and usable["share"] > 0.8
    # clearly above chance but under a tenth of the undefended gain: not usable
    sliver = V.usable([0.15, 0.151, 0.149], trivial, 0.965)
    assert sliver["p"] < 0.05 and not sliver["ok"]


def test_channel_check():
    """DP-SGD noises the protected party's parameter updates, never the activations or gradients the
    attacks read: credited against the host's property inference it is not applicable (3c-*)."""
    assert not V.touches("dpsgd", "guest", "property-host")
    assert not V.touches("dpsgd", "host", "property-guest")
    assert not V.touches("dpsgd", "guest", "reconstruction")
    assert V.touches("r3elu", "guest", "property-host") and V.touches("laplace", "guest", "fsha")
    assert V.touches("r3elu", "host", "property-guest") and V.touches("r3elu", "host", "label")
    assert not V.touches("r3elu", "guest", "label") and not V.touches("rr", "host", "property-host")
    assert V.NOT_APPLICABLE in V.VERDICTS


def test_committed_table_applies_the_rules():
    """The committed claim table was re-derived under these rules: no 3c-* verdict credits DP-SGD
    against a channel it does not touch, 4d-σ is judged across its σ sweep (σ = 0.1 included), and
    no decided verdict rests on a p that Holm's correction rejects."""
    rows = CL.correct(CL.collect(CL.RESULTS))
    by = {c["id"]: c for c in rows}
    assert all(c["verdict"] == V.NOT_APPLICABLE for k, c in by.items() if k.startswith("3c-"))
    assert "σ = 0.1" in by["4d-σ"]["ours"]
    for c in rows:
        if c["verdict"] in V.DECIDED and c.get("p") is not None:
            assert c["p_holm"] < V.ALPHA, c["id"]
        assert c.get("n", 2) >= 2 or c["verdict"] not in V.DECIDED or c.get("deterministic")


# -- matched accounted privacy (issue 26): a difference a larger budget explains is not counted ----------
def test_exp8_counts_a_difference_only_where_the_budget_cannot_explain_it():
    from experiments.exp8_privacy_utility_attacks import _budget_explains_nothing as matched

    r3 = {"guest_epsilon": 5530.0, "host_epsilon": 5530.0}
    laplace = {"guest_epsilon": 4920.0, "host_epsilon": 4920.0}
    assert matched(r3, laplace, loss=True)        # R3eLU lost with more budget: the loss counts
    assert not matched(r3, laplace, loss=False)   # a win over a smaller budget would not
    assert matched(laplace, r3, loss=False)
    rr = {"guest_epsilon": 6000.0, "host_epsilon": None}  # RR claims nothing for the host: unbounded
    assert not matched(r3, rr, loss=True) and matched(r3, rr, loss=False)
    split = {"guest_epsilon": 6000.0, "host_epsilon": 4000.0}  # more for one party, less for the other
    assert not matched(r3, split, loss=True) and not matched(r3, split, loss=False)


def _exp2_runs(r3_value: float, r3_eps_scale: float) -> list[dict]:
    """Synthetic experiment-2 runs on digits, guest protected, 3 seeds: Laplace and DP-SGD at 0.90,
    R3eLU at ``r3_value``; accounted ε = ε per release × 5 (Laplace, DP-SGD) and × 5 × ``r3_eps_scale``
    (R3eLU)."""
    from experiments import exp2_utility_epsilon as E

    runs = []

    def add(defence, direction, eps, mean, acc):
        for seed, v in zip((0, 1, 2), _seeds(mean, 0.01, 3)):
            runs.append({"dataset": "digits", "defence": defence, "direction": direction, "epsilon": eps,
                         "seed": seed, "sigma": None, "metric": "accuracy", "value": v, "train_loss": 0.1,
                         "accounted_epsilon": acc, "snr_bound": 1.0, "host_snr_bound": None})

    add("none", "none", None, 0.95, None)
    add("r3elu-importance", "both", 4.0, 0.1, 20.0)
    for eps in E.EPSILONS:
        add("laplace", "guest", eps, 0.90, 5 * eps)
        add("dpsgd", "guest", eps, 0.90 + eps / 100, 5 * eps)
        add("r3elu", "guest", eps, r3_value, 5 * eps * r3_eps_scale)
    return runs


@pytest.mark.parametrize("scale, losses, verdict", [(1.5, 5, "does not hold"), (0.01, 0, "inconclusive")])
def test_exp2_best_counts_a_loss_only_against_no_more_accounted_epsilon(scale, losses, verdict):
    """R3eLU far below the others in every cell: with more accounted ε than the cells it is set
    against, every cell is a loss; with less than every other cell of the sweep, none can be."""
    from experiments import exp2_utility_epsilon as E

    runs = _exp2_runs(0.3, scale)
    args = argparse.Namespace(datasets=["digits"], seeds=[0, 1, 2])
    summary = E.summarise(runs)
    for r in summary:
        r["trivial"] = 0.084
    best = next(c for c in E.make_claims(summary, args, runs) if c["id"] == "2-best")
    assert f"clearly below the better one with at most its ε in {losses}," in best["ours"], best["ours"]
    assert "at the same nominal ε, as committed: 0 clearly above, 5 clearly below of 5" in best["ours"]
    assert best["verdict"] == verdict


def test_exp2_tables_take_the_reaccounted_epsilon_and_keep_the_charged_one():
    from experiments import exp2_utility_epsilon as E
    from experiments.reaccount import config_key

    runs = _exp2_runs(0.3, 1.0)
    tight = {config_key("digits", "laplace", "guest", 4.0): {"parties": {"guest-1": {"tight": 4.9}}}}
    row = E._get(E.summarise(runs, tight), "digits", "laplace", "guest", 4.0)
    assert row["accounted_epsilon"] == 4.9 and row["charged_epsilon"] == pytest.approx(20.0)
    assert E._eps_text(row) == "4.9 (was 20)"
    untouched = E._get(E.summarise(runs, tight), "digits", "dpsgd", "guest", 4.0)
    assert untouched["accounted_epsilon"] == untouched["charged_epsilon"] == pytest.approx(20.0)
