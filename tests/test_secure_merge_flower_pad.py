"""``--secure-merge`` with ``--on-guest-failure pad`` and with ``--checkpoint-dir`` / ``--resume`` under
``--engine flower``: a guest failing mid-round is padded as in the local engine (the guests left agree on
a new session and release the round again, charged; the first releases are never opened), and a resumed
run agrees a new session and ends as the uninterrupted run (docs/flower.md, "Secure merge on Flower")."""

from __future__ import annotations

import pytest

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.flower import records as R
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.parties.guest import GuestParty
from fl_split.privacy import secure_merge as sm
from tests.test_flower import PS, InlineGrid, _simulation_nodes, _strip
from tests.test_flower_checkpoint import assert_resumed_like
from tests.test_secure_merge_flower import RecordingGrid

pytestmark = pytest.mark.usefixtures("flower_task_identity")

#: guest-2 fails in this round (epoch 1's third training batch: 64 records)
FAIL_ROUND = 3


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=3, merge="sum", epochs=2, batch_size=64, limit=300, progress=False,
                host_features=False, secure_merge=True, seed=3, device="cpu", engine="flower",
                defense="gaussian", sigma=1.0, secure_merge_collusion="0", on_guest_failure="pad")
    base.update(kw)
    return RunConfig(**base)


def _guest_2_fails(monkeypatch) -> None:
    """From round :data:`FAIL_ROUND` on guest-2 raises in every step, after applying its gradients and
    releasing the round (a release masked with its pair keys that never reaches the host)."""
    step = GuestParty.step

    def failing(self, grads, keys, round_, *a, **kw):
        out = step(self, grads, keys, round_, *a, **kw)
        if self.name == "guest-2" and round_ >= FAIL_ROUND:
            raise ConnectionError("guest-2 is unreachable")
        return out

    monkeypatch.setattr(GuestParty, "step", failing)


def _without_reasons(results: dict) -> dict:
    out = _strip(results)
    for f in out["guest_failures"]:
        assert "guest-2 is unreachable" in f.pop("reason")
    return out


@pytest.mark.parametrize("data_plane", ["flower", "direct"])
def test_pad_rekeys_releases_the_round_again_and_equals_the_local_engine(monkeypatch, data_plane):
    """guest-2 fails in round 3. Guests 1 and 3 agree on a new session without it and release round 3
    again; the host trains on the second releases only (the first ones, masked towards guest-2, are
    never opened) and the results equal the local engine's with the same failure — history, wire counts,
    guest failures, every party's ε — with round 3's batch charged twice in guests 1 and 3's ledgers."""
    from fl_split.dataplane.host import HostDataPlane
    from fl_split.parties.host import HostParty

    cfg = _cfg(data_plane=data_plane)
    whole = LocalEngine(cfg.replace(engine="local", on_guest_failure="stop"), PS).run()
    _guest_2_fails(monkeypatch)
    local = LocalEngine(cfg.replace(engine="local"), PS).run()

    trained: dict[int, dict[str, list[bytes]]] = {}
    train = HostParty.train

    def spy_train(self, keys, acts, round_, *a, **kw):
        trained[round_] = {g: [bytes(b) for b in bl] for g, bl in acts.items() if bl}  # (the relay: [] for guest-2)
        return train(self, keys, acts, round_, *a, **kw)

    monkeypatch.setattr(HostParty, "train", spy_train)
    redone: dict[str, list[bytes]] = {}
    first: dict[str, list[bytes]] = {}
    if data_plane == "direct":  # what the host's data plane received in round 3: the first and the second releases
        step, redo, ask = HostDataPlane.guest_step, HostDataPlane.secure_redo, HostDataPlane._ask
        asked: list[tuple[str, list[str], dict]] = []

        def spy_step(self, owed, keys, round_):
            try:
                return step(self, owed, keys, round_)
            except Exception as exc:
                first.update({g: list(b) for g, b in (getattr(exc, "partial", None) or {}).items()})
                raise

        def spy_ask(self, guests, header, blobs=()):
            out = ask(self, guests, header, blobs)
            asked.append((header["op"], list(guests), out))
            return out

        def spy_redo(self, keys, round_):
            out = redo(self, keys, round_)
            redone.update({g: list(b) for g, b in out.items()})
            return out

        monkeypatch.setattr(HostDataPlane, "guest_step", spy_step)
        monkeypatch.setattr(HostDataPlane, "secure_redo", spy_redo)
        monkeypatch.setattr(HostDataPlane, "_ask", spy_ask)
    grid = RecordingGrid(_simulation_nodes(4), fresh_process=data_plane == "flower")
    got = VerticalSplitStrategy(cfg).run(grid)
    assert got["stopped_reason"] == "completed"
    assert [(f["guest"], f["round"], f["action"]) for f in got["guest_failures"]] == [("guest-2", FAIL_ROUND, "pad")]
    assert _without_reasons(got) == _without_reasons(local)
    assert sorted(got["privacy"]) == ["guest-1", "guest-3", "host"]
    for g in ("guest-1", "guest-3"):  # round 3's 64 records released twice, both charged
        assert got["privacy"][g]["releases"] == whole["privacy"][g]["releases"] + 64
        assert got["privacy"][g]["epsilon"] > whole["privacy"][g]["epsilon"]

    if data_plane == "flower":  # the relay's messages: round 3's step replies, then the redo replies
        ids = dict(zip(grid.ids, ["host", "guest-1", "guest-2", "guest-3"]))
        g2 = grid.ids[2]
        assert max(int(req["round"]) for n, mtype, req in grid.received if mtype == R.MSG_STEP and n == g2) \
            == FAIL_ROUND  # then nothing more is sent to it
        reqs = [(n, req) for n, mtype, req in grid.received if mtype == R.MSG_STEP and n != g2]
        reps = [(n, rep) for n, mtype, rep in grid.answers if mtype == R.MSG_STEP and n != g2]
        assert [n for n, _ in reqs] == [n for n, _ in reps]
        first = {ids[n]: rep["blobs"] for (n, req), (_, rep) in zip(reqs, reps) if int(req["round"]) == FAIL_ROUND}
        redone = {ids[n]: rep["blobs"] for n, mtype, rep in grid.answers if mtype == R.MSG_REDO}
        assert R.MSG_DROP in grid.types
    # the host trained round 3 on the second releases only; the first ones were never handed to it
    assert sorted(redone) == sorted(first) == ["guest-1", "guest-3"]
    assert sorted(trained[FAIL_ROUND]) == ["guest-1", "guest-3"]
    for g in ("guest-1", "guest-3"):
        assert trained[FAIL_ROUND][g] == [bytes(b) for b in redone[g]] != [bytes(b) for b in first[g]]
    # two sessions: every guest's, then guests 1 and 3's (announced again, fresh keys)
    anns = [sm.KeyAnnouncement.from_bytes(rep["announcement"][0]) for _, mtype, rep in grid.answers
            if mtype == R.MSG_SECURE_ANNOUNCE]
    if data_plane == "flower":
        assert [a.guest for a in anns] == ["guest-1", "guest-2", "guest-3", "guest-1", "guest-3"]
        assert len({a.session for a in anns}) == 2 and len({a.public for a in anns}) == 5
    else:  # the second session's keys travel over the data plane, relayed by the host
        assert [a.guest for a in anns] == ["guest-1", "guest-2", "guest-3"]
        assert [(op, guests) for op, guests, _ in asked] == [("secure-announce", ["guest-1", "guest-3"]),
                                                            ("secure-agree", ["guest-1", "guest-3"]),
                                                            ("redo", ["guest-1", "guest-3"])]
        again = [sm.KeyAnnouncement.from_bytes(asked[0][2][g][0]) for g in ("guest-1", "guest-3")]
        assert [a.guest for a in again] == ["guest-1", "guest-3"] and len({a.session for a in again}) == 1
        assert again[0].session != anns[0].session and not {a.public for a in again} & {a.public for a in anns}
        assert asked[1][2] == {"guest-1": [], "guest-3": []}  # an agreement releases nothing


def test_a_guest_refuses_a_session_outside_its_current_one_and_a_redo_without_a_new_one():
    """With pad a session may leave out guests the run went on without, never add one back or leave this
    guest out; without pad it must hold every guest of the run. A guest releases only the round it served
    last again, and only in a session that has not masked it yet."""
    from fl_split.errors import ProtocolError
    from fl_split.schedule import BatchKey

    eng = LocalEngine(_cfg(engine="local", defense="none"), PS)
    g1 = eng.guests["guest-1"]
    with pytest.raises(ProtocolError, match="every guest of the run"):
        g1.relayed_announce(bytes(16), ["guest-1", "guest-3"], pad=False)
    g1.relayed_announce(bytes(16), ["guest-1", "guest-3"], pad=True)
    g1.secure_agree([eng.guests["guest-3"].secure_announce(bytes(16), ["guest-1", "guest-3"])])
    for members in (["guest-1", "guest-2"], ["guest-2", "guest-3"], ["guest-1", "guest-1"]):
        with pytest.raises(ProtocolError, match="refused"):
            g1.relayed_announce(bytes(16), members, pad=True)
    keys = [BatchKey("train", 1, 0)]
    g1.step([], keys, 1)
    with pytest.raises(ProtocolError, match="in the session that masked it"):
        g1.redo(keys, 1)
    with pytest.raises(ProtocolError, match="only the round just served"):
        g1.redo(keys, 2)
    g1.relayed_announce(bytes(range(16)), ["guest-1"], pad=True)
    g1.secure_agree([])
    assert len(g1.redo(keys, 1)) == 1  # in the new session


def _session_ids(grid) -> set[bytes]:
    return {sm.KeyAnnouncement.from_bytes(rep["announcement"][0]).session for _, mtype, rep in grid.answers
            if mtype == R.MSG_SECURE_ANNOUNCE}


@pytest.mark.parametrize("defense", ["none", "gaussian"])
def test_a_resumed_run_agrees_a_new_session_and_equals_the_uninterrupted_run(tmp_path, monkeypatch, defense):
    """The host fails at the start of epoch 3 (before anything of it is released); the resume restores
    every party to the end of epoch 2, agrees a new session (a fresh id and fresh keys, over Flower) and
    plays epoch 3. Without noise the results are the uninterrupted run's bit for bit; with noise the same
    accounting — every party's ε and releases — and the same first two epochs (after a resume the parties
    draw with a fresh salt)."""
    cfg = _cfg(epochs=3, on_guest_failure="stop", defense=defense, data_plane="direct",
               checkpoint_dir=str(tmp_path / "ckpt"))
    first = RecordingGrid(_simulation_nodes(4))
    got, grid = _host_lost_in_epoch_3_then_resumed(cfg, monkeypatch, first)
    assert got["checkpoint"]["resumed_from_round"] == 10 and [h["epoch"] for h in got["history"]] == [1, 2, 3]
    assert len(_session_ids(first)) == len(_session_ids(grid)) == 1 and not _session_ids(first) & _session_ids(grid)
    assert_resumed_like(got, LocalEngine(cfg.replace(engine="local", checkpoint_dir=""), PS).run(),
                        noisy=defense != "none")


def test_a_padded_run_resumes_without_the_failed_guest(tmp_path, monkeypatch):
    """pad and a resume together: guest-2 fails in epoch 1 and is padded (new session of guests 1 and 3),
    the host fails at the start of epoch 3; the resume sets guest-2 up out of the run, agrees a new session
    of guests 1 and 3 only, and ends as the uninterrupted padded run of the local engine, bit for bit."""
    cfg = _cfg(epochs=3, defense="none", data_plane="direct", checkpoint_dir=str(tmp_path / "ckpt"))
    _guest_2_fails(monkeypatch)
    local = LocalEngine(cfg.replace(engine="local", checkpoint_dir=""), PS).run()
    got, grid = _host_lost_in_epoch_3_then_resumed(cfg, monkeypatch, InlineGrid(_simulation_nodes(4)))
    anns = [sm.KeyAnnouncement.from_bytes(rep["announcement"][0]) for _, mtype, rep in grid.answers
            if mtype == R.MSG_SECURE_ANNOUNCE]
    assert [a.guest for a in anns] == ["guest-1", "guest-3"]
    got.pop("checkpoint")
    a, b = _without_reasons(got), _without_reasons(local)
    for c in (a["config"], b["config"]):
        del c["checkpoint_dir"], c["resume"]
    assert a == b


def _host_lost_in_epoch_3_then_resumed(cfg: RunConfig, monkeypatch, first) -> tuple[dict, "RecordingGrid"]:
    """Run ``cfg`` on grid ``first`` with the host failing at the start of epoch 3 (before anything of it
    is released), then resume it on a fresh recording grid: the resumed results and that grid."""
    from fl_split.dataplane.host import HostDataPlane
    from fl_split.errors import PartyError

    step = HostDataPlane.guest_step

    def host_lost(self, owed, keys, round_):
        if keys[0].epoch == 3:
            raise RuntimeError("host lost")
        return step(self, owed, keys, round_)

    monkeypatch.setattr(HostDataPlane, "guest_step", host_lost)
    with pytest.raises(PartyError, match="host lost"):
        VerticalSplitStrategy(cfg).run(first)
    monkeypatch.setattr(HostDataPlane, "guest_step", step)
    grid = RecordingGrid(_simulation_nodes(4))
    return VerticalSplitStrategy(cfg.replace(resume=True)).run(grid), grid
