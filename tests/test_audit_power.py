"""The audit has power at real widths (issue 26, item 3): ``fl-split audit --mis-account 2`` is flagged
for a 64-wide Laplace and for DP-SGD at σ = 1, and the correctly accounted ones pass.

``--mis-account f`` accounts the mechanism as if its noise were ``f`` times larger (its tight event
through :func:`fl_split.privacy.events.noisier_event`). The statistic is the exact log-likelihood
ratio of the worst-case pair over the whole release (Laplace: the sum of the 64 per-element
log-ratios; DP-SGD: the projection of each step on its canary's coordinate, 1024 canaries a step).

**False alarms.** Each bound holds with confidence ``1 − α`` (α = 0.05, Clopper–Pearson on both error
rates), so a correctly accounted mechanism is flagged with probability at most 5 % per row; the seeds
are fixed, so each outcome here is deterministic, and the correct rows sit well below their claims
(Laplace 1.27 of 1.94, DP-SGD 4.7 of 10.0 measured), not at the edge. **Power.** The mis-accounted
rows are flagged with the margins measured over 4 seeds each (Laplace ε = 4: bounds 1.10–1.56 against
the false claim 0.91; DP-SGD: 4.58–5.14 against 4.38); the smallest flagged factors per mechanism
and width are in docs/accounting.md ("Detection power").
"""

from __future__ import annotations

import json

import dp_accounting as dpa
import pytest

from fl_split.cli import main
from fl_split.privacy import audit
from fl_split.privacy.accountants import event_pure_epsilon
from fl_split.privacy.events import noisier_event, pure_dp_event

DELTA = 1e-5
SEED = "c4e1a9073fb25d86e0a47b93d1f6285c"


def _audit(tmp_path, argv):
    out = tmp_path / "A.json"
    rc = main(["audit", *argv, "--private-seed", SEED, "--out", str(out)])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("mis", [None, "2"])
def test_cli_flags_a_2x_mis_accounted_64_wide_laplace(tmp_path, capsys, mis):
    argv = ["--defense", "laplace", "--epsilon", "4", "--width", "64", "--releases", "1", "--trials", "100000"]
    rc, doc = _audit(tmp_path, argv + (["--mis-account", mis] if mis else []))
    row = doc["results"][0]
    assert row["width"] == 64 and row["trials_per_record"] == 50000
    if mis:
        assert rc == 1 and doc["violations"], row
        assert "PRIVACY AUDIT VIOLATION" in capsys.readouterr().err
        assert row["empirical_epsilon_lower"] > row["claimed_epsilon"]
    else:
        assert rc == 0 and not doc["violations"], row
        assert row["empirical_epsilon_lower"] < row["claimed_epsilon"]
        assert row["empirical_epsilon_lower"] > 0.5  # the statistic sees the release, not a coin


@pytest.mark.parametrize("mis", [None, "2"])
def test_cli_flags_a_2x_mis_accounted_dpsgd_at_sigma_1(tmp_path, capsys, mis):
    argv = ["--defense", "dpsgd", "--sigma", "1", "--releases", "1", "--trials", "40000"]
    rc, doc = _audit(tmp_path, argv + (["--mis-account", mis] if mis else []))
    row = doc["results"][0]
    assert row["mechanism_parameters"]["canaries_per_step"] == 1024
    if mis:
        assert rc == 1 and doc["violations"], row
        assert row["empirical_epsilon_lower"] > row["claimed_epsilon"]
    else:
        assert rc == 0 and not doc["violations"], row
        assert 3.0 < row["empirical_epsilon_lower"] < row["claimed_epsilon"]


def test_noisier_event_is_the_claim_of_the_noisier_mechanism():
    """``noisier_event(ev, f)``: Gaussian multipliers × f, (discrete) Laplace scales × f, randomized
    response's epsilon ÷ f, through compositions."""
    g = noisier_event(dpa.GaussianDpEvent(0.5), 2.0)
    assert g == dpa.GaussianDpEvent(1.0)
    lap = noisier_event(dpa.SelfComposedDpEvent(dpa.dp_event.DiscreteLaplaceDpEvent(0.01, 40), 64), 2.0)
    assert lap.count == 64 and lap.event.noise_parameter == pytest.approx(0.005) and lap.event.sensitivity == 40
    rr = noisier_event(dpa.ComposedDpEvent([pure_dp_event(1.2), dpa.LaplaceDpEvent(3.0)]), 3.0)
    assert event_pure_epsilon(rr.events[0]) == pytest.approx(0.4) and rr.events[1].noise_multiplier == 9.0


def test_mis_accounted_cost_is_the_tight_cost_at_more_noise():
    """MisAccounted keeps the mechanism's event structure: a 64-wide Laplace at factor 2 is charged as
    64 discrete Laplace elements of half the loss each (pure ε ÷ 2, and its (ε, δ) that of the same
    mechanism with twice the noise), not as one pure event."""
    from fl_split.config import RunConfig

    cfg = RunConfig(defense="laplace", epsilon=4.0)
    mech, = audit.mechanisms_for(cfg, 64, 1, "forward", mis_account=2.0)
    cost = mech.cost()
    assert cost.epsilon == pytest.approx(2.0)
    assert cost.dp_event.count == 64
    assert cost.dp_event.event.noise_parameter == pytest.approx(mech.inner.cost().dp_event.event.noise_parameter / 2)
