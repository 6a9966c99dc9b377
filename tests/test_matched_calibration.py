"""Matched-privacy calibration (issue 26): every mechanism's calibrated config reports the target
ε within tolerance through the real ledger — calibration only, no training."""

from __future__ import annotations

import dp_accounting
import pytest

from experiments import calibrate as cal
from fl_split.config import RunConfig

BASE = dict(dataset="digits", guests=2, epochs=3, protect="guest", progress=False, accountant="pld", delta=1e-5)
# what calibrate.probe reads from the engine for digits with 2 guests and 3 epochs (64-wide cuts,
# each record released once per epoch); two widths, so the largest guest ε is the one matched
PARTIES = {"guest-1": {"width": 64, "releases": 3}, "guest-2": {"width": 16, "releases": 3}}


@pytest.mark.parametrize("mech", cal.MECHANISMS)
@pytest.mark.parametrize("target", [1.0, 64.0])
def test_calibrated_config_reports_target(mech, target):
    c = cal.calibrate(BASE, mech, target, PARTIES)
    assert c["ok"], c
    cfg = RunConfig(**{**BASE, **c["changes"]})
    eps = {p: cal.planned_epsilon(cfg, v["width"], v["releases"]) for p, v in PARTIES.items()}
    worst = max(eps.values())
    assert cal.reported_ok(worst, target), (eps, target)
    assert all(e <= target * (1 + 1e-9) for e in eps.values())
    # the calibration is tight: 1.5x less noise (in the direction the parameter acts) breaks the target
    name, increasing = cal.PARAMETER[mech]
    value = c["changes"][name] * (1.5 if increasing else 1 / 1.5)
    looser = RunConfig(**{**BASE, **c["changes"], name: value})
    assert max(cal.planned_epsilon(looser, v["width"], v["releases"]) for v in PARTIES.values()) > target


def test_dpsgd_matches_dp_accounting():
    """Independent check: DP-SGD's calibrated σ, composed 3 times as a replace-one Gaussian of
    multiplier σ/2 (no amplification), in dp_accounting's own PLD accountant."""
    c = cal.calibrate(BASE, "dpsgd", 8.0, PARTIES)
    sigma = c["changes"]["sigma"]
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(sigma / 2.0), 3)
    exact = acc.get_epsilon(1e-5)
    assert exact == pytest.approx(c["planned_epsilon"], rel=2e-3)
    assert 8.0 * (1 - cal.TOLERANCE) <= exact <= 8.0 * 1.002


def test_reported_ok_refuses_above_target_and_far_below():
    assert cal.reported_ok(7.95, 8.0)
    assert not cal.reported_ok(8.01, 8.0)
    assert not cal.reported_ok(7.0, 8.0)
    assert not cal.reported_ok(None, 8.0)


@pytest.mark.parametrize("target", [0.0, -1.0, float("inf")])
def test_bad_target_is_an_error(target):
    with pytest.raises(ValueError, match="target ε"):
        cal.calibrate(BASE, "rr", target, PARTIES)


def test_rerun_of_some_mechanisms_replaces_only_their_rows():
    """``--matched --defenses rr``: RR's rows are replaced where they stood, the others' kept."""
    from experiments.matched import _merge, mechanisms_of

    assert mechanisms_of(None) == tuple(cal.MECHANISMS)
    assert mechanisms_of(["rr", "gaussian+scale"]) == ("gaussian", "rr")
    row = lambda m, t, v: dict(mechanism=m, epsilon_target=t, metric="accuracy", value=v)  # noqa: E731
    old = [row("none", "", 0.9), row("laplace", 1.0, 0.5), row("rr", 1.0, 0.6), row("rr", 1.0, 0.61),
           row("laplace", 8.0, 0.7), row("rr", 8.0, 0.8)]
    new = [row("rr", 1.0, 0.1), row("rr", 1.0, 0.11), row("rr", 8.0, 0.2), row("rr", 64.0, 0.3)]
    merged = _merge(old, new, ("rr",))
    assert [(r["mechanism"], r["epsilon_target"], r["value"]) for r in merged] == [
        ("none", "", 0.9), ("laplace", 1.0, 0.5), ("rr", 1.0, 0.1), ("rr", 1.0, 0.11),
        ("laplace", 8.0, 0.7), ("rr", 8.0, 0.2), ("rr", 64.0, 0.3)]
