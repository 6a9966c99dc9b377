"""R3eLU's importance allocation is a charged release (issue 16, finding 8).

Under ``--allocation importance`` the per-feature noise scales (001 Cor. 6) and activation
probabilities (Eq. 10) follow importances computed from the party's own gradients. A receiver can
read them back from the releases, so the allocation must be either public or accounted. fl_split
releases it (:class:`~fl_split.privacy.r3elu.AllocationRelease`, noisy importance shares) and charges
it to every training record; the mechanism only ever sees the released value.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.errors import BudgetExceeded, ConfigError
from fl_split.privacy.r3elu import AllocationRelease
from fl_split.seeding import PrivateSeed

BASE = dict(dataset="digits", guests=1, epochs=3, batch_size=64, limit=400, seed=0, defense="r3elu",
            protect="guest", epsilon=8.0, allocation="importance", accountant="basic", top_k=8)


def test_allocation_release_is_calibrated_to_its_epsilon():
    """L1 sensitivity of importance shares on the grid: 2/γ steps of share change plus one rounding
    step per element; the discrete Laplace is calibrated to it, slack included (never over ε)."""
    for width, eps in ((64, 0.8), (10, 4.0), (512, 0.05)):
        a = AllocationRelease(width, eps)
        assert a.sensitivity_units == min(round(2 / a.gamma) + width, width * round(1 / a.gamma))
        assert a.sensitivity_units / a.noise.t <= a.epsilon_bound <= eps * (1 + 1e-12)
        c = a.cost()
        assert c.epsilon == eps and c.mechanism == "allocation"


def test_allocation_release_noise_has_the_calibrated_spread():
    """The released shares are the true shares plus DLap(t)·γ: over 400 draws of a 64-wide release
    (25,600 values) the SD of released − true is √2·b within 3 % (the SD estimate of a Laplace sample
    of that size has a relative standard error ≈ √(5/4)/√n ≈ 0.7 %, so 3 % is > 4 standard errors)."""
    a = AllocationRelease(64, 10.0)
    u = torch.rand(64, generator=torch.Generator().manual_seed(0)) ** 3
    shares = (u / u.sum()).double()
    gen = torch.Generator().manual_seed(1)
    diffs = []
    for _ in range(400):
        out = a.noise.sample((64,), gen, "cpu").double() * a.gamma  # the noise alone, before clamping
        diffs.append(out)
    sd = float(torch.cat(diffs).std())
    assert sd == pytest.approx(math.sqrt(2) * a.scale, rel=0.03)
    # the clamped release never goes below 0; at a large ε it is the shares up to the noise
    rel = torch.stack([a.release(u, gen).double() for _ in range(50)])
    assert bool((rel >= 0).all())
    sharp = AllocationRelease(64, 2000.0)
    out = sharp.release(u, gen).double()
    assert float((out - shares).abs().max()) < 8 * math.sqrt(2) * sharp.scale + sharp.gamma


def test_allocation_is_charged_per_refresh_and_only_the_released_value_is_used():
    """Three epochs, allocation refreshed before each (001 §3.4): U = 0 before epoch 1 (nothing
    learned, data-independent: no release, uniform), then two releases of ε/10 each, charged to every
    training record; the mechanism's importances are the released shares, never the tracker's U."""
    engine = LocalEngine(RunConfig(**BASE), private_seed=PrivateSeed.legacy(5))
    res = engine.run()
    guest = engine.guests["guest-1"]
    led = res["privacy"]["guest-1"]
    assert led["epsilon"] == pytest.approx(3 * 8.0 + 2 * 0.8, rel=1e-9)
    assert led["by_direction"]["allocation"]["batches"] == 2
    rep = res["parties"]["guest-1"]["allocation"]
    assert rep["releases"] == 2 and rep["epsilon"] == pytest.approx(0.8)
    released = torch.tensor(rep["last_shares"])
    used = guest.mechanism.importance
    assert torch.allclose(used, released, atol=1e-6)
    private = guest.importance.tracker.values
    assert not torch.allclose(used / used.sum(), private / private.sum(), atol=1e-3)  # the noise is there


def test_allocation_epsilon_flag_and_per_batch_refresh():
    """``--allocation-epsilon`` sets each release's ε; refreshing before every batch releases (and
    charges) one allocation per training batch after the first update."""
    cfg = RunConfig(**{**BASE, "epochs": 1, "importance_refresh": "batch", "allocation_epsilon": 0.5})
    engine = LocalEngine(cfg, private_seed=PrivateSeed.legacy(6))
    res = engine.run()
    batches = engine.plan.schedule.num_train_batches()
    rep = res["parties"]["guest-1"]["allocation"]
    # training batch 1 comes before any update; every later training batch and the test batches
    # (after the epoch's updates) each get a fresh allocation
    test_batches = len(engine.plan.schedule.test_keys(1))
    assert rep["releases"] == (batches - 1) + test_batches
    assert res["privacy"]["guest-1"]["epsilon"] == pytest.approx(8.0 + 0.5 * rep["releases"], rel=1e-9)
    with pytest.raises(ConfigError, match="allocation-epsilon"):
        RunConfig(**{**BASE, "allocation_epsilon": -1.0}).validate()


def test_allocation_over_budget_releases_nothing():
    """A budget that covers the training releases but not the allocation: the party refuses before
    anything of the request leaves (atomic charge), and the run stops with ``budget``."""
    cfg = RunConfig(**{**BASE, "epochs": 2, "budget": 16.5})  # 2·8 fits, 2·8 + 0.8 does not
    engine = LocalEngine(cfg, private_seed=PrivateSeed.legacy(7))
    res = engine.run()
    assert res["stopped_reason"] == "budget"
    led = engine.guests["guest-1"].ledger
    assert led.epsilon() <= 16.5
    assert engine.guests["guest-1"].importance.releases == 0


def test_host_backward_allocation_is_charged_to_the_host():
    """--protect host: the host's importances over its top's inputs are released and charged to
    the host's ledger, and each guest's backward mechanism uses its part of the released shares."""
    cfg = RunConfig(**{**BASE, "protect": "host", "epochs": 2})
    engine = LocalEngine(cfg, private_seed=PrivateSeed.legacy(8))
    res = engine.run()
    host = res["privacy"]["host"]
    assert host["by_direction"]["allocation"]["batches"] >= 1
    rep = res["parties"]["host"]["allocation"]
    assert rep["releases"] >= 1 and len(rep["last_noise_scales"]["guest-1"]) == int(np.prod(
        engine.plan.cut_shapes["guest-1"]))
