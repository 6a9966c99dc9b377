"""Bounded trust after authentication (issue 16, ``fl_split/privacy/bounds.py``).

An authenticated guest that multiplies its releases by 1,000 (finite, the right shape, below
``protocol.MAX_ABS``) is refused by the host before anything changes, within the epoch in which it
starts: under the main job's defence (Gaussian σ = 0.7 on a tanh cut), Laplace, R3eLU, randomized
response and no defence. The run stops naming the guest, the statistic and the public bound, or
(``--on-guest-failure pad``) goes on with that guest zero-padded. A host that scales the gradients
it sends is refused by the guest, and the run stops naming the host. Honest runs never trip.
"""

from __future__ import annotations

import pytest
import torch

from fl_split.builder import make_parties
from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.errors import ReleaseOutOfRange
from fl_split.privacy.bounds import GAUSS_K, PeerTrust, ScaleMonitor
from fl_split.privacy.factory import Exhausted
from fl_split.privacy.mechanisms import Gaussian, Laplace, R3eLU, RandomizedResponse
from fl_split.schedule import BatchKey
from fl_split.seeding import PrivateSeed
from tests.helpers import tampered
from tests.test_hostile import assert_untouched, snapshot

#: the defences of the acceptance test (the main job's first); each with the options it needs
DEFENCES = {
    "gaussian": dict(defense="gaussian", sigma=0.7),
    "laplace": dict(defense="laplace", epsilon=50.0),
    "r3elu": dict(defense="r3elu", epsilon=50.0),
    "rr": dict(defense="rr", epsilon=50.0, protect="guest"),
    "none": dict(defense="none"),
}


def _cfg(defence: str, **kw) -> RunConfig:
    # 400 digits records, batches of 16: 18 training batches per epoch (more than the monitor's warm-up)
    base = dict(dataset="digits", guests=2, limit=400, batch_size=16, epochs=1, progress=False, protect="both",
                loss_alarm=True)  # off by default; the honest runs below check that it judged them too
    base.update(DEFENCES[defence])
    base.update(kw)
    return RunConfig(**base)


def scaled(blobs: list[bytes], factor: float) -> list[bytes]:
    """The same messages with every value multiplied by ``factor`` (finite, right shape; bits
    re-encoded as float32, which is what a guest scaling its randomized response must send).
    Frames or in-process hand-overs, whichever the transport carries (``tests.helpers.tampered``)."""
    def scale(m):
        m.tensor = m.tensor * factor
        m.encoding = "float32"

    return [tampered(b, scale) for b in blobs]


class ScalingGuest:
    """A transport in which ``guest`` multiplies its training releases by ``factor`` from round
    ``start`` on (what a malicious guest does to its own encoded blobs)."""

    def __init__(self, local, guest: str = "guest-1", factor: float = 1000.0, start: int = 1) -> None:
        self.local, self.guest, self.factor, self.start = local, guest, factor, start
        self.guests = local.guests

    def guest_step(self, owed, keys, round_):
        out = self.local.guest_step(owed, keys, round_)
        if round_ >= self.start and self.guest in out and keys[0].phase == "train":
            out[self.guest] = scaled(out[self.guest], self.factor)
        return out

    def __getattr__(self, name):
        return getattr(self.local, name)


class ScalingHost(ScalingGuest):
    """A transport in which the host multiplies the gradients it sends by ``factor``."""

    def guest_step(self, owed, keys, round_):
        return self.local.guest_step(owed, keys, round_)

    def host_train(self, keys, acts, round_):
        grads = self.local.host_train(keys, acts, round_)
        if round_ >= self.start:
            grads = {g: scaled(bl, self.factor) for g, bl in grads.items()}
        return grads


def _start(defence: str) -> int:
    # with a public range the first release is checked; without one the running scale needs its
    # warm-up first (a guest that scales from its first batch is the documented blind spot)
    return ScaleMonitor.WARMUP + 3 if defence == "none" else 2


# -- detection within one epoch ---------------------------------------------------------------------
@pytest.mark.parametrize("defence", list(DEFENCES))
def test_a_guest_scaling_its_releases_is_stopped_within_the_epoch(defence):
    cfg = _cfg(defence)
    engine = LocalEngine(cfg, private_seed=PrivateSeed.legacy(4), transport=lambda t: ScalingGuest(t, start=_start(defence)))
    per_epoch = engine.plan.schedule.num_train_batches()
    with pytest.raises(ReleaseOutOfRange) as err:
        engine.run()
    e = err.value
    assert (e.sender, e.receiver, e.what) == ("guest-1", "host", "activations")
    assert e.round == _start(defence) <= per_epoch  # the first scaled batch, inside epoch 1
    text = str(e)
    assert "host refused guest-1's activations" in text and "stopped (--on-guest-failure stop)" in text
    if defence == "none":
        assert "batch RMS" in text and "the largest RMS" in text
    elif defence == "rr":
        assert "alphabet {0, 1}" in text
    else:
        assert "exceeds the public bound" in text and defence in text


@pytest.mark.parametrize("defence", ["gaussian", "none"])
def test_pad_zero_fills_the_scaling_guest_and_charges_nothing_for_it(defence):
    start = _start(defence)
    cfg = _cfg(defence, on_guest_failure="pad", epochs=2)
    engine = LocalEngine(cfg, private_seed=PrivateSeed.legacy(4), transport=lambda t: ScalingGuest(t, start=start))
    results = engine.run()
    assert results["stopped_reason"] == "completed"
    [f] = results["guest_failures"]
    assert (f["guest"], f["round"], f["action"]) == ("guest-1", start, "pad")
    assert "ReleaseOutOfRange" in f["reason"] and "guest-1" in f["reason"]
    assert engine.host.absent == {"guest-1": start}
    # the host released (and, with a defence, charged) a gradient to guest-1 for the rounds before
    # the refusal only: none for the refused batch, none after it
    per_epoch = engine.plan.schedule.num_train_batches()
    train_batches = 2 * per_epoch
    expected = (start - 1) * 2 + (train_batches - (start - 1))
    assert engine.host.released["batches"] == expected
    if engine.host.ledger is not None:
        assert len(engine.host.ledger) == expected  # one entry per gradient release
        assert engine.host.ledger.releases == engine.host.released["records"]
    assert len(results["history"]) == 2 and all(h["test_metric"] > 0.1 for h in results["history"])


def test_pad_on_a_refused_test_release_goes_on():
    # the guest scales its test releases: refused at evaluation, padded, the epoch still closes
    class ScalingTest(ScalingGuest):
        def guest_step(self, owed, keys, round_):
            out = self.local.guest_step(owed, keys, round_)
            if keys[0].phase == "test" and self.guest in out:
                out[self.guest] = scaled(out[self.guest], self.factor)
            return out

    engine = LocalEngine(_cfg("gaussian", on_guest_failure="pad"), private_seed=PrivateSeed.legacy(4), transport=ScalingTest)
    results = engine.run()
    assert results["stopped_reason"] == "completed"
    [f] = results["guest_failures"]
    assert f["guest"] == "guest-1" and f["action"] == "pad" and "test[epoch 1" in f["reason"]
    assert len(results["history"]) == 1


# -- the refusal changes nothing ----------------------------------------------------------------------
@pytest.mark.parametrize("defence", list(DEFENCES))
def test_the_host_refuses_a_scaled_release_with_its_state_untouched(defence):
    host, guests, plan = make_parties(_cfg(defence), private_seed=PrivateSeed.legacy(3))
    keys = plan.schedule.train_keys(1)
    warm = ScaleMonitor.WARMUP + 1 if defence == "none" else 1
    owed = {g: [] for g in guests}
    for r in range(1, warm + 1):
        acts = {g: p.step(owed[g], (keys[r - 1],), r) for g, p in guests.items()}
        owed = host.train((keys[r - 1],), acts, r)
    r = warm + 1
    acts = {g: p.step(owed[g], (keys[r - 1],), r) for g, p in guests.items()}
    bad = dict(acts, **{"guest-1": scaled(acts["guest-1"], 1000.0)})
    before = snapshot(host)
    seen = {g: m.seen for g, m in host.trust.monitors.items()}
    releases = host.ledger.releases if host.ledger is not None else None
    with pytest.raises(ReleaseOutOfRange, match="host refused guest-1's activations"):
        host.train((keys[r - 1],), bad, r)
    assert_untouched(host, before)  # models, optimizer, secret, ledger, importances, last round
    assert {g: m.seen for g, m in host.trust.monitors.items()} == seen  # no statistic recorded either
    if releases is not None:
        assert host.ledger.releases == releases  # no release charged for the refused batch
    # the same round is then played without guest-1 (what pad does): accepted
    host.drop_guest("guest-1", r)
    grads = host.train((keys[r - 1],), {"guest-2": acts["guest-2"]}, r)
    assert set(grads) == {"guest-2"}


@pytest.mark.parametrize("defence", ["gaussian", "laplace", "r3elu", "none"])
def test_a_guest_refuses_scaled_gradients_from_the_host_untouched(defence):
    host, guests, plan = make_parties(_cfg(defence, guests=1), private_seed=PrivateSeed.legacy(3))
    g = guests["guest-1"]
    keys = plan.schedule.train_keys(1) + plan.schedule.train_keys(2)
    # without a public range the guest's scale check refuses nothing in the first epoch (its warm-up)
    assert g.trust.warmup == max(ScaleMonitor.WARMUP, plan.schedule.num_train_batches())
    warm = g.trust.warmup + 1 if defence == "none" else 1
    owed: list[bytes] = []
    for r in range(1, warm + 1):
        acts = g.step(owed, (keys[r - 1],), r)
        owed = host.train((keys[r - 1],), {"guest-1": acts}, r)["guest-1"]
    before = snapshot(g)
    seen = {p: m.seen for p, m in g.trust.monitors.items()}
    with pytest.raises(ReleaseOutOfRange) as err:
        g.step(scaled(owed, 1000.0), (keys[warm],), warm + 1)
    assert (err.value.sender, err.value.receiver, err.value.what) == ("host", "guest-1", "gradients")
    assert str(err.value).startswith(f"guest-1 refused host's gradients for {keys[warm - 1]}")
    assert_untouched(g, before)  # no step, no release, nothing charged, the batch still owed
    assert {p: m.seen for p, m in g.trust.monitors.items()} == seen
    g.step(owed, (keys[warm],), warm + 1)  # the honest gradients are then accepted


@pytest.mark.parametrize("mode", ["stop", "pad"])
def test_a_host_scaling_its_gradients_stops_the_run_naming_the_host(mode):
    # never padded: the guests did nothing wrong
    engine = LocalEngine(_cfg("gaussian", on_guest_failure=mode), private_seed=PrivateSeed.legacy(4),
                         transport=lambda t: ScalingHost(t, start=3))
    with pytest.raises(ReleaseOutOfRange) as err:
        engine.run()
    assert err.value.sender == "host" and err.value.what == "gradients"
    assert "exceeds the public bound" in str(err.value)


def test_cli_exit_status_and_one_line(monkeypatch, capsys, tmp_path):
    from fl_split import cli, engine as eng

    real = eng.LocalTransport.guest_step

    def guest_step(self, owed, keys, round_):
        out = real(self, owed, keys, round_)
        if round_ >= 3 and "guest-1" in out and keys[0].phase == "train":
            out["guest-1"] = scaled(out["guest-1"], 1000.0)
        return out

    monkeypatch.setattr(eng.LocalTransport, "guest_step", guest_step)
    out = tmp_path / "results.json"
    code = cli.main(["train", "--dataset", "digits", "--guests", "2", "--limit", "400", "--batch-size", "16",
                     "--epochs", "1", "--defense", "gaussian", "--sigma", "0.7", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_FAILED
    assert len(err) == 1, err
    assert err[0].startswith("fl-split: failed: host refused guest-1's activations for train[epoch 1, batch 2] "
                             "in round 3: max value")
    assert f"bound + {GAUSS_K:g}·sigma = 1 + {GAUSS_K:g}·0.7" in err[0] and err[0].endswith(
        "stopped (--on-guest-failure stop)")
    assert not out.exists()


# -- honest runs never trip ---------------------------------------------------------------------------
@pytest.mark.parametrize("defence", list(DEFENCES))
def test_honest_runs_never_trip(defence):
    for seed in (1, 2):
        engine = LocalEngine(_cfg(defence, epochs=3, seed=seed), private_seed=PrivateSeed.legacy(seed))
        results = engine.run()
        assert results["stopped_reason"] == "completed" and results["guest_failures"] == []
        assert engine.host.loss_alarm.judged > 0  # the training-loss jump alarm judged them too


def test_honest_geometric_schedule_and_importance_allocation_never_trip():
    for kw in (dict(defense="laplace", schedule="geometric", epsilon=50.0),
               dict(defense="r3elu", allocation="importance", epsilon=20.0),
               dict(defense="r3elu", allocation="importance-tight", importance_refresh="batch", epsilon=20.0)):
        engine = LocalEngine(_cfg("none", epochs=2, **kw), private_seed=PrivateSeed.legacy(5))
        results = engine.run()
        assert results["stopped_reason"] == "completed" and results["guest_failures"] == []
        # the geometric schedule changes the guests' mechanism every batch: the loss alarm never
        # compares losses across two of them (the honest loss grew 10x in 3 batches: the noise
        # doubles each one)
        assert (engine.host.loss_alarm.judged == 0) == (kw.get("schedule") == "geometric")


# -- the public ranges themselves -----------------------------------------------------------------------
MECHANISMS = [
    Gaussian(64, "forward", 0.7), Gaussian(64, "backward", 0.7, bound=0.5), Gaussian(8, "forward", 1e-4),
    Laplace(64, "forward", 1.0, epsilon=8.0), Laplace(64, "backward", 0.5, b=0.01), Laplace(16, "forward", 0.3, epsilon=1e-9),
    R3eLU(64, "forward", 8.0, 1.0), R3eLU(64, "backward", 8.0, 0.7, k=5), R3eLU(64, "forward", 1e3, 1.0),
    R3eLU(64, "forward", 8.0, 1.0, allocation="importance"), R3eLU(64, "backward", 2.0, 1.0, allocation="importance-tight"),
    RandomizedResponse(64, 8.0), Exhausted(50),
]


@pytest.mark.parametrize("mech", MECHANISMS, ids=lambda m: f"{m.name}-{getattr(m, 'direction', '')}")
def test_honest_releases_are_within_the_public_range_and_scaled_ones_are_not(mech):
    gen = torch.Generator().manual_seed(11)
    rng = mech.public_range()
    assert rng is not None and rng.describe()["mechanism"] == mech.name
    caught = 0
    for i in range(40):
        if hasattr(mech, "set_importance") and i % 10 == 5:
            mech.set_importance(torch.rand(64, generator=gen) ** 4)  # any importances: still in range
        x = torch.randn(32, getattr(mech, "width", 64), generator=gen) * 5.0
        out = mech.release(x, gen if mech.random else None).value
        assert rng.violation(out) is None, rng.violation(out)
        caught += rng.violation(out * 1000.0) is not None
    # every scaled batch is caught (the exhausted schedule's zeros stay zeros: nothing to catch)
    assert caught == (0 if isinstance(mech, Exhausted) else 40)


def test_range_rules_name_the_statistic():
    lap = Laplace(64, "forward", 1.0, epsilon=8.0).public_range()
    off = torch.full((2, 64), lap.grid * 0.5)  # half a grid step: no release of this mechanism
    assert "not on the grid" in lap.violation(off)
    r3 = R3eLU(64, "forward", 8.0, 1.0).public_range()
    neg = torch.zeros(2, 64)
    neg[0, 0] = -r3.grid
    assert "below the public bound 0" in r3.violation(neg)
    gauss = Gaussian(64, "forward", 0.7).public_range()
    wide = torch.full((1, 64), 7.0)  # every element within 1 + 9σ = 7.3, the row far outside
    assert "per-sample L2 norm" in gauss.violation(wide)
    rr = RandomizedResponse(8, 2.0).public_range()
    assert "alphabet" in rr.violation(torch.tensor([[0.0, 1.0, 0.5, 0, 0, 0, 0, 0]]))
    assert rr.violation(torch.tensor([[0.0, 1.0] * 4])) is None


def test_scale_monitor_warms_up_then_refuses_a_jump():
    mon = ScaleMonitor()
    for _ in range(ScaleMonitor.WARMUP - 1):
        assert mon.violation(1e6) is None  # nothing to compare with yet
        mon.add(1.0)
    mon.add(1.0)
    assert mon.violation(ScaleMonitor.FACTOR * 0.99) is None
    assert f"allowed: {ScaleMonitor.FACTOR:g}x" in mon.violation(ScaleMonitor.FACTOR * 1.01)
    trust = PeerTrust("host", "activations", {})
    key = BatchKey("train", 1, 0)
    for _ in range(ScaleMonitor.WARMUP):
        trust.check("guest-1", key, torch.ones(4, 3))
        trust.record("guest-1", key, torch.ones(4, 3))
    with pytest.raises(ReleaseOutOfRange, match="guest-1's activations for train"):
        trust.check("guest-1", key, torch.full((4, 3), 1000.0))
    trust.check("guest-1", BatchKey("test", 1, 0), torch.full((4, 3), 1000.0))  # test releases: no statistic


def test_scale_monitor_reference_is_the_runs_largest_not_the_recent_one():
    # the honest movielens-small run it stopped (exp2, R3eLU on the guest, seed 7): converged partial
    # losses of ~5e-7 for 64+ batches, then a 1.7e-5 spike — 34x the recent maximum, far below the run's
    mon = ScaleMonitor()
    for rms in [1e-3] * ScaleMonitor.WARMUP + [5e-7] * 200:
        mon.add(rms)
    assert mon.violation(1.7e-5) is None
    assert mon.violation(ScaleMonitor.FACTOR * 0.99e-3) is None
    assert "of its 208 accepted training releases" in mon.violation(ScaleMonitor.FACTOR * 1.01e-3)
    assert mon.seen == 208


@pytest.mark.parametrize("mech", [m for m in MECHANISMS if not isinstance(m, Exhausted)],
                         ids=lambda m: f"{m.name}-{m.direction}")
def test_project_puts_any_tensor_inside_the_range(mech):
    # what the attacks' malicious host does to stay inside the range the guest checks
    rng = mech.public_range()
    wild = torch.randn(8, mech.width, generator=torch.Generator().manual_seed(2)) * 1e4
    assert rng.violation(wild) is not None and rng.violation(rng.project(wild)) is None
