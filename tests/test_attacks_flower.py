"""Attacks on a run trained under Flower (``fl-split attack --engine flower``,
:mod:`fl_split.attacks.flower`): each party records what it holds on its own node, the attack
process rebuilds the adversary's view from that, and the attack gives exactly the local engine's
numbers (the two engines train bit-identically). Attacks whose threat model cannot hold under
Flower are refused before anything starts."""

from __future__ import annotations

import pytest

from fl_split.attacks.flower import FlowerSession, read_blobs
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.runner import make_session, run_attack
from fl_split.config import RunConfig
from fl_split.errors import ConfigError
from fl_split.seeding import PrivateSeed

SEED = PrivateSeed.legacy(7)  # the private seed of every attack run (the pre-issue-16 derivation: measured margins hold)
BASE = dict(dataset="digits", guests=1, limit=300, epochs=2, progress=False, device="cpu", seed=3)


def test_recorded_blobs_round_trip(tmp_path):
    from fl_split.attacks.flower import _append

    blobs = [b"", b"a", bytes(range(256)) * 3]
    _append(tmp_path / "x.in", blobs[:2])
    _append(tmp_path / "x.in", blobs[2:])
    assert read_blobs(tmp_path / "x.in") == blobs
    assert read_blobs(tmp_path / "missing") == []


@pytest.mark.parametrize("attack", ["membership", "fsha"])
def test_attacks_that_cannot_run_under_flower_are_refused_before_training(attack):
    with pytest.raises(ConfigError, match=r"^--engine: got 'flower' .*allowed: local for"):
        make_session(RunConfig(**BASE, engine="flower", public_fraction=0.3), AttackOptions(attack=attack), SEED)


@pytest.mark.slow
@pytest.mark.parametrize("plane", ["direct", "flower"])
def test_attacks_under_flower_give_the_local_engines_numbers(plane):
    """Property inference by the host and label inference (direction scoring) by the guest, on one
    training each way: under Flower (Ray actors; the direct data plane or the relay) the adversary's
    view — its own party object, inbox and outbox — and the attack's value are the local engine's."""
    from fl_split.flower.resources import local_cpus

    cpus = max(0.01, int(100 * min(1.0, local_cpus() / 2)) / 100)
    cfg = RunConfig(**BASE)
    flower = make_session(cfg.replace(engine="flower", data_plane=plane, num_cpus=cpus), AttackOptions(attack="property"),
                          SEED)
    assert isinstance(flower, FlowerSession)
    local = make_session(cfg, AttackOptions(attack="property"), SEED)
    for opts in (AttackOptions(attack="property"), AttackOptions(attack="label-direction")):
        got = run_attack(flower.cfg, opts, session=flower)
        want = run_attack(local.cfg, opts, session=local)
        assert (got["value"], got["baseline"]) == (want["value"], want["baseline"]), opts.attack
        assert got["threat_model"] == want["threat_model"]
        assert got["final"] == want["final"] and got["privacy"] == want["privacy"]
    for party in ("host", "guest-1"):  # every party's record, blob for blob
        assert flower._boxes[party] == local._boxes[party], party
