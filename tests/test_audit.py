"""The empirical privacy audit (``fl_split.privacy.audit``, ``fl-split audit``; docs/accounting.md,
"Empirical audit").

Statistical tests use fixed private seeds, so each outcome is deterministic; the tolerances say why
they hold for any seed with high probability, not just for these ones.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.privacy import audit
from fl_split.seeding import PartySecret, PrivateSeed

DELTA = 1e-5


def secret(tag: str) -> PartySecret:
    return PartySecret.from_private_seed(PrivateSeed.legacy(20261124), f"audit-test-{tag}")


# -- analysis ----------------------------------------------------------------------------------------
def test_clopper_pearson_known_values():
    # k = 0: the upper end is 1 − (α/2)^(1/n) in closed form; k = n mirrors it
    lo, hi = audit.clopper_pearson(0, 10, 0.05)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 10), rel=1e-9)
    lo, hi = audit.clopper_pearson(10, 10, 0.05)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 10), rel=1e-9)
    lo, hi = audit.clopper_pearson(50, 100, 0.05)  # the textbook interval [0.3983, 0.6017]
    assert lo == pytest.approx(0.3983, abs=1e-4) and hi == pytest.approx(0.6017, abs=1e-4)
    with pytest.raises(ValueError):
        audit.clopper_pearson(3, 2, 0.05)


def test_epsilon_lower_bound_from_rates():
    # a perfect-looking test on few trials bounds epsilon only by the sample size: log((1−δ−0)/FPR_u)
    r = audit.epsilon_lower_bound(0, 100, 0, 100, 0.0, 0.05)
    assert r["lower"] == pytest.approx(math.log((1 - audit.clopper_pearson(0, 100, 0.05)[1])
                                                / audit.clopper_pearson(0, 100, 0.05)[1]))
    # randomized response's optimal test: FPR = FNR = 1/(1+e^ε) gives ε as its point estimate
    eps = 1.5
    n = 1_000_000
    fp = round(n / (1 + math.exp(eps)))
    r = audit.epsilon_lower_bound(fp, n, fp, n, 0.0, 0.05)
    assert r["point"] == pytest.approx(eps, abs=1e-4)
    assert r["lower"] < eps < r["upper"]
    # an uninformative test (errors of a coin) bounds nothing
    assert audit.epsilon_lower_bound(500, 1000, 500, 1000, DELTA, 0.05)["lower"] == 0.0


def test_threshold_is_chosen_on_calibration_share_only():
    # statistics whose evaluation part is unrelated to the calibration part (the first quarter): the
    # chosen threshold and side must be a function of the calibration part alone
    rng = np.random.default_rng(0)
    s0, s1 = rng.normal(0, 1, 200), rng.normal(2, 1, 200)
    a = audit.audit_statistics(s0, s1, DELTA, 0.05)
    s0b, s1b = s0.copy(), s1.copy()
    s0b[50:], s1b[50:] = rng.normal(0, 1, 150), rng.normal(2, 1, 150)
    b = audit.audit_statistics(s0b, s1b, DELTA, 0.05)
    assert (b["threshold"], b["side"]) == (a["threshold"], a["side"])
    assert audit.calibration_size(200) == 50 and a["n0"] == a["n1"] == a["pairs"] == 150


# -- likelihood ratios are exact -----------------------------------------------------------------------
CONFIGS = [
    dict(defense="laplace", epsilon=1.0),
    dict(defense="laplace", epsilon=1.0, protect="host"),
    dict(defense="rr", epsilon=2.0),
    dict(defense="gaussian", sigma=2.0),
    dict(defense="gaussian", sigma=2.0, protect="host"),
    dict(defense="r3elu", epsilon=1.0),
    dict(defense="r3elu", epsilon=1.0, protect="host"),
    dict(defense="r3elu", epsilon=1.0, allocation="importance"),
    dict(defense="r3elu", epsilon=1.0, allocation="importance-tight"),
    dict(defense="r3elu", epsilon=1.0, allocation="importance", protect="host"),
]


def _mech(kw, width=4, releases=1):
    cfg = RunConfig(**kw)
    direction = "backward" if cfg.protect == "host" else "forward"
    u = audit.default_importance(width) if cfg.allocation != "uniform" else None
    return cfg, direction, audit.mechanisms_for(cfg, width, releases, direction, importance=u)


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_likelihood_ratio_is_a_density_ratio(kw):
    """``E_{y~p0}[exp(LLR(y))] = Σ p1 = 1`` for the true ratio ``p1/p0``; a wrong element model
    (grid, activation probability, the cut at 0) moves the mean. Pure mechanisms have
    ``|LLR| ≤ ε`` (≤ 2 here), so over 40000 draws the mean's SD is below e²/200 ≈ 0.04; the
    tolerance 0.12 is 3 SD (the measured deviations are below 0.01). For the Gaussian pair at the
    sensitivity ``Δ`` the LLR is exactly ``N(−μ²/2, μ²)``, ``μ = Δ/σ``: its mean and SD are checked
    to 3 % (40000 draws: the SEs are 0.5 % and 0.4 %)."""
    cfg, direction, (m,) = _mech(kw)
    x0, x1 = audit.canary_pair(m)
    y = m.release(x0.expand(40000, -1).contiguous(), secret(str(kw)).torch_generator("llr")).value
    llr = audit.log_likelihood_ratio(m, y, x0, x1)
    if cfg.defense == "gaussian":
        mu = m.sensitivity_l2 / m.sigma
        assert float(llr.mean()) == pytest.approx(-mu ** 2 / 2, rel=0.03)
        assert float(llr.std()) == pytest.approx(mu, rel=0.03)
        return
    assert float(torch.exp(llr).mean()) == pytest.approx(1.0, abs=0.12)
    # pure epsilon: the privacy loss never exceeds the claim
    assert float(llr.abs().max()) <= m.cost().epsilon * (1 + 1e-9)


def test_canaries_are_neighbours_at_the_extremes():
    cfg, _, (lap,) = _mech(dict(defense="laplace", epsilon=1.0))
    x0, x1 = audit.canary_pair(lap)
    assert torch.equal(x0, -x1) and float(x1.abs().min()) == float(torch.tensor(lap.bound, dtype=x1.dtype))
    _, _, (r3,) = _mech(dict(defense="r3elu", epsilon=1.0, allocation="importance"))
    x0, x1 = audit.canary_pair(r3)
    # the rising elements are the K with the smallest noise scale (largest importance share)
    up = set(torch.nonzero(x1[0] > 0).flatten().tolist())
    assert up == set(torch.argsort(r3.noise_scales())[: r3.k].tolist())


# -- the audit: below every claim, close to the pure ones ---------------------------------------------
AUDITED = [
    (dict(defense="laplace", epsilon=1.0), 1),
    (dict(defense="laplace", epsilon=1.0), 3),
    (dict(defense="laplace", epsilon=2.0, schedule="geometric"), 3),
    (dict(defense="laplace", epsilon=1.0, protect="host"), 1),
    (dict(defense="gaussian", sigma=0.7), 1),
    (dict(defense="gaussian", sigma=2.0), 3),
    (dict(defense="rr", epsilon=1.0), 1),
    (dict(defense="rr", epsilon=1.0), 3),
    (dict(defense="rr", epsilon=4.0, schedule="geometric"), 3),
    (dict(defense="r3elu", epsilon=1.0), 1),
    (dict(defense="r3elu", epsilon=1.0), 3),
    (dict(defense="r3elu", epsilon=2.0, schedule="geometric"), 3),
    (dict(defense="r3elu", epsilon=1.0, allocation="importance"), 1),
    (dict(defense="r3elu", epsilon=1.0, allocation="importance-tight"), 3),
    (dict(defense="r3elu", epsilon=1.0, allocation="importance", schedule="geometric"), 3),
    (dict(defense="r3elu", epsilon=1.0, allocation="importance-tight", protect="host"), 1),
]


@pytest.mark.parametrize("kw,k", AUDITED, ids=lambda v: "-".join(str(x) for x in v.values()) if isinstance(v, dict)
                         else f"x{v}")
def test_lower_bound_below_every_claim(kw, k):
    cfg, direction, mechs = _mech(kw, width=2, releases=k)
    res = audit.audit_mechanism(mechs, 8000, secret(f"{kw}{k}"), delta=DELTA, alpha=0.05,
                                label=f"{kw}{k}", direction=direction)
    assert any(v is not None for v in res.claimed.values())
    assert res.violated == [], (res.lower, res.claimed)
    assert 0.0 <= res.lower


@pytest.mark.parametrize("kw", [dict(defense="laplace", epsilon=1.0), dict(defense="laplace", epsilon=4.0),
                                dict(defense="rr", epsilon=1.0), dict(defense="rr", epsilon=4.0)],
                         ids=lambda kw: f"{kw['defense']}-{kw['epsilon']}")
def test_pure_mechanisms_bound_is_within_factor_two_at_one_release(kw):
    """The audit has power: at one release (width 2) the optimal test reaches the claim in the limit
    (Laplace: both elements past the other record's value, probability ~1/4, likelihood ratio e^ε;
    RR: both bits flipped). With 20000 trials per record (10000 counted) the Clopper–Pearson bound
    lands within about 11 % of ε at ε = 1 and 7 % at ε = 4 (measured: Laplace 0.89, 3.73; RR 0.96, 3.74):
    factor 2 has a wide margin."""
    cfg, direction, mechs = _mech(kw, width=2)
    res = audit.audit_mechanism(mechs, 20000, secret(f"power{kw}"), delta=DELTA, alpha=0.05,
                                label=f"power{kw}", direction=direction)
    claim = res.claimed["pld"]
    assert res.violated == []
    assert claim / 2 <= res.lower <= claim


def test_mis_accounted_mechanism_is_flagged():
    cfg, direction, _ = _mech(dict(defense="laplace", epsilon=1.0))
    mechs = audit.mechanisms_for(cfg, 2, 1, direction, mis_account=4.0)
    res = audit.audit_mechanism(mechs, 8000, secret("mis"), delta=DELTA, alpha=0.05, label="mis")
    assert res.claimed["basic"] == pytest.approx(0.25)
    assert set(res.violated) >= {"basic", "pld"}


def test_dpsgd_step_through_opacus_is_below_its_claim():
    res = audit.audit_dpsgd(1.0, 1.0, 400, secret("dpsgd"), releases=1, delta=DELTA, alpha=0.05)
    assert res.claimed["pld"] is not None and res.violated == []
    # the gradient canary is seen: the shift along e1 is 2C/B against noise σC/B, so the test errs
    # far less than a coin would (a broken canary, e.g. both records clipped the same way, gives ~0)
    assert res.lower > 1.0


# -- the CLI --------------------------------------------------------------------------------------------
def test_cli_writes_claims_and_bounds(tmp_path, capsys):
    out = tmp_path / "A.json"
    rc = main(["audit", "--defense", "rr", "--epsilon", "1", "--releases", "1,2", "--trials", "4000",
               "--private-seed", "38858752ea1fa32efc9531ef569aa6f7", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["releases"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:
        assert r["claimed_epsilon"] is not None and r["empirical_epsilon_lower"] <= r["claimed_epsilon"]
        assert r["violation"] is False and r["trials_per_record"] == 3000  # a quarter chose the test
    assert doc["results"][1]["claimed_epsilon"] == pytest.approx(2.0, abs=1e-3)
    assert "privacy audit" in capsys.readouterr().out


def test_cli_flags_mis_accounting_loudly(tmp_path, capsys):
    out = tmp_path / "A.json"
    rc = main(["audit", "--defense", "laplace", "--epsilon", "1", "--releases", "1", "--trials", "8000",
               "--mis-account", "4", "--private-seed", "38858752ea1fa32efc9531ef569aa6f7", "--out", str(out)])
    assert rc == 1
    assert "PRIVACY AUDIT VIOLATION" in capsys.readouterr().err
    doc = json.loads(out.read_text())  # the evidence is kept
    assert doc["violations"] and doc["results"][0]["empirical_epsilon_lower"] > doc["results"][0]["claimed_epsilon"]


@pytest.mark.parametrize("argv,flag", [
    (["--defense", "none"], "defense"),
    (["--defense", "laplace", "--trials", "5"], "trials"),
    (["--defense", "laplace", "--releases", "1,0"], "releases"),
    (["--defense", "laplace", "--alpha", "1.5"], "alpha"),
    (["--defense", "laplace", "--mis-account", "0.5"], "mis-account"),
    (["--defense", "rr", "--protect", "host"], "protect"),
    (["--defense", "r3elu", "--top-k", "3"], "top-k"),
])
def test_cli_bad_input_names_the_flag_and_writes_nothing(tmp_path, capsys, argv, flag):
    out = tmp_path / "A.json"
    rc = main(["audit", *argv, "--out", str(out)])
    assert rc == 2
    assert flag in capsys.readouterr().err
    assert not out.exists()


def test_geometric_schedule_past_exhaustion_is_audited():
    """Past ``ε/2^i < ε·2^-40`` the party releases zeros (``Exhausted``, no charge): the audit treats
    those releases as carrying nothing, and the ledger's claim stays below ``ε_T``."""
    cfg = RunConfig(defense="laplace", epsilon=1.0, schedule="geometric")
    mechs = audit.mechanisms_for(cfg, 2, 42, "forward")
    assert mechs[-1].name == "exhausted" and mechs[-1].cost() is None
    res = audit.audit_mechanism(mechs, 2000, secret("exhausted"), delta=DELTA, alpha=0.05, label="exhausted")
    assert res.claimed["basic"] < 1.0 and res.violated == []
