"""Kill-and-resume under Flower (``--engine flower``, direct data plane): every party checkpoints
itself when its control message ends and logs each release before it leaves; a run killed with
SIGKILL in the middle of an epoch and resumed ends with the same final metric and the same ε as
the local engine with the same public and private seeds (which an uninterrupted Flower run equals,
``tests/test_flower.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fl_split.checkpoint import CheckpointError, load_coordinator
from fl_split.config import RunConfig
from fl_split.deploy import ProcessGroup
from fl_split.flower.processes import process_table
from fl_split.seeding import PrivateSeed

PS_HEX = "5eed0c4f9a2e7b13d86f1a0b3c5e7d92"  # a 128-bit private seed: the same on the command line and in the local reference

# --limit 600: four times the rounds of --limit 150, so epoch 2 lasts long enough for the kill to
# land inside it on a loaded machine
ARGS = ["--dataset", "digits", "--guests", "2", "--epochs", "2", "--limit", "600", "--seed", "3",
        "--defense", "gaussian", "--no-progress"]


def test_flower_checkpoints_refused_where_not_supported():
    from fl_split.errors import ConfigError

    with pytest.raises(ConfigError, match="data-plane"):
        RunConfig(engine="flower", data_plane="flower", checkpoint_dir="/tmp/x")
    with pytest.raises(ConfigError, match="checkpoint-every"):
        RunConfig(engine="flower", checkpoint_every="3", checkpoint_dir="/tmp/x")
    RunConfig(engine="flower", checkpoint_dir="/tmp/x")  # direct data plane, at epoch ends: accepted


@pytest.mark.slow
def test_flower_run_killed_mid_epoch_resumes_to_the_same_accounting(tmp_path):
    directory = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "fl_split.cli", "train", "--engine", "flower", "--num-cpus", "0.5", *ARGS,
           "--private-seed", PS_HEX, "--checkpoint-dir", str(directory)]
    group = ProcessGroup(tmp_path / "logs")
    proc = group.spawn("run", cmd, dict(os.environ))
    wal = directory / "guest-1.wal"
    committed_size = epoch1 = None
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:  # epoch 1 committed, then epoch 2's first releases logged
            assert proc.poll() is None, group.log_tail("run", 20)
            try:
                if committed_size is None and (directory / "coordinator.ckpt").exists() \
                        and load_coordinator(directory).round > 0:
                    epoch1 = load_coordinator(directory).round  # the first epoch end's checkpoint
                    committed_size = wal.stat().st_size
            except CheckpointError:
                pass
            if committed_size is not None and wal.stat().st_size > committed_size:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the run never reached epoch 2")
        members = group.members()
        os.kill(proc.pid, signal.SIGKILL)  # the crash: no handler runs
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    finally:
        group.stop(2)
    assert load_coordinator(directory).round == epoch1 > 0
    table = process_table()
    assert not [p for p in members if p in table and table[p][0] != "Z"]

    out_path = tmp_path / "resumed.json"
    resumed = subprocess.run(cmd + ["--resume", "--out", str(out_path)], capture_output=True, text=True,
                             timeout=600, start_new_session=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = json.loads(out_path.read_text())
    assert res["checkpoint"]["resumed_from_round"] == epoch1
    assert [h["epoch"] for h in res["history"]] == [1, 2]

    from fl_split.cli import build_parser, config_from_args
    from fl_split.engine import run_experiment

    local = run_experiment(config_from_args(build_parser().parse_args(["train", *ARGS])), private_seed=PrivateSeed.parse(PS_HEX))
    # epoch 1 (checkpointed) and the releases re-made after it are the local run's; from the logs' last
    # draw counter on, the resumed parties draw with a fresh resume salt (issue 25: a rolled-back log
    # must not repeat noise), so epoch 2's numbers are those of other noise and are not compared
    assert res["history"][0]["test_metric"] == local["history"][0]["test_metric"]
    assert res["history"][0]["train_loss"] == pytest.approx(local["history"][0]["train_loss"], rel=1e-6)
    for party, rep in local["privacy"].items():
        assert res["privacy"][party]["epsilon"] == rep["epsilon"]
        assert res["privacy"][party]["releases"] == rep["releases"]


# ------------------------------------------------------------------------------------------------
# one control message for the run, a checkpoint at every epoch end (in process)

@pytest.mark.usefixtures("flower_task_identity")
@pytest.mark.parametrize("defense", ["none", "gaussian"])
def test_one_message_for_the_run_checkpoints_every_epoch_and_resumes_after_the_last(tmp_path, monkeypatch, defense):
    """``--epochs-per-message 3``: the coordinator commits only when the run's one ``train.epoch``
    message ends, yet every party checkpoints each epoch end inside it. The host fails in epoch 3:
    the coordinator's commit is still round 0 (set-up), the parties hold the end of epoch 2, and
    the resume asks them (``query.checkpoints``), restores that round and plays epoch 3 alone —
    ending as the uninterrupted local run (bit for bit without noise; with noise the same
    accounting and the same first two epochs: after a resume the parties draw with a fresh salt)."""
    from fl_split.checkpoint import party_checkpoints
    from fl_split.errors import PartyError
    from fl_split.flower import records as R
    from fl_split.flower.strategy import VerticalSplitStrategy
    from fl_split.parties.host import HostParty
    from tests.test_flower import InlineGrid, _cfg, _local, _simulation_nodes, _strip

    extra = {"protect": "both"} if defense != "none" else {}
    cfg = _cfg(epochs=3, epochs_per_message=3, defense=defense, checkpoint_dir=str(tmp_path / "ckpt"), **extra)
    evaluated, train = [], HostParty.train

    def evaluate_then_fail(self, *a, **kw):
        if len(evaluated) == 2:  # the first training round of epoch 3: the host's machine goes down
            raise RuntimeError("host lost")
        return train(self, *a, **kw)

    monkeypatch.setattr(HostParty, "train", evaluate_then_fail)
    evaluate = HostParty.evaluate
    monkeypatch.setattr(HostParty, "evaluate", lambda self, *a, **kw: evaluated.append(1) or evaluate(self, *a, **kw))
    with pytest.raises(PartyError, match="host lost"):
        VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    directory = tmp_path / "ckpt"
    assert load_coordinator(directory).round == 0  # nothing committed since the set-up
    held = party_checkpoints(directory, "host")
    assert len(held) == 3 and held[0] == 0 and held[2] == 2 * held[1]  # the committed round and epochs 1, 2
    for guest in ("guest-1", "guest-2"):
        assert party_checkpoints(directory, guest) == held

    monkeypatch.setattr(HostParty, "train", train)
    grid = InlineGrid(_simulation_nodes(3), fresh_process=True)
    got = VerticalSplitStrategy(cfg.replace(resume=True)).run(grid)
    assert got["checkpoint"]["resumed_from_round"] == held[2]
    assert grid.types.count(R.MSG_CHECKPOINTS) == 3 and grid.types.count(R.MSG_EPOCH) == 3  # epoch 3 only
    assert [h["epoch"] for h in got["history"]] == [1, 2, 3]
    assert load_coordinator(directory).resumed[-1]["agreed_round"] == held[2]
    assert_resumed_like(got, _local(cfg.replace(checkpoint_dir="")), noisy=defense != "none")


def assert_resumed_like(got: dict, local: dict, noisy: bool) -> None:
    """A run resumed after epoch 2 against the local engine's uninterrupted run: without noise equal in
    everything but the checkpoint fields; with noise (fresh resume salts after the crash) the same first two
    epochs and every party's ε and release count."""
    from tests.test_flower import _strip

    if not noisy:
        got = dict(got)
        got.pop("checkpoint")
        a, b = _strip(got), _strip(local)
        for c in (a["config"], b["config"]):
            del c["checkpoint_dir"], c["resume"]
        assert a == b
    else:
        assert _strip(got)["history"][:2] == _strip(local)["history"][:2]
        assert sorted(got["privacy"]) == sorted(local["privacy"])
        for party, rep in local["privacy"].items():
            assert got["privacy"][party]["epsilon"] == rep["epsilon"]
            assert got["privacy"][party]["releases"] == rep["releases"]


def _progress(first: int, epochs: list[int], failures=()) -> dict:
    return {"first_epoch": first, "history": [{"epoch": e} for e in epochs], "wire": {"rounds": 9 * len(epochs)},
            "guest_failures": list(failures)}


def test_resume_round_is_the_newest_every_party_still_in_the_run_holds():
    """:func:`agree_on_round` on what the parties report: a guest one epoch behind holds the round
    back; a host record that does not continue the committed history is passed over; a guest padded
    (``--on-guest-failure pad``) before the round is not waited for; nothing newer: the commit."""
    from fl_split.checkpoint import CoordinatorState
    from fl_split.flower.direct import agree_on_round

    state = CoordinatorState(run="r", engine="flower", config={}, round=9, history=[{"epoch": 1}])
    host = {9: None, 18: _progress(2, [2]), 27: _progress(2, [2, 3])}
    both = {"host": host, "guest-1": {9: None, 18: None, 27: None}, "guest-2": {9: None, 18: None, 27: None}}
    assert agree_on_round(state, both) == (27, host[27])
    behind = {**both, "guest-2": {9: None, 18: None}}  # killed before it saved epoch 3
    assert agree_on_round(state, behind) == (18, host[18])
    assert agree_on_round(state, {**both, "guest-2": {9: None}}) == (9, None)
    stale = {**both, "host": {9: None, 18: _progress(1, [1, 2]), 27: _progress(3, [3])}}
    assert agree_on_round(state, stale) == (9, None)  # neither continues epoch 1
    pad = {"guest": "guest-2", "round": 12, "action": "pad"}
    padded = {**behind, "host": {9: None, 18: _progress(2, [2], [pad]), 27: _progress(2, [2, 3], [pad])}}
    assert agree_on_round(state, padded)[0] == 27
    assert agree_on_round(CoordinatorState(run="r", engine="flower", config={}, round=27,
                                           history=[{"epoch": e} for e in (1, 2, 3)]), both) == (27, None)


def test_held_rounds_lists_only_this_runs_sound_checkpoints(tmp_path):
    """What a node reports to ``query.checkpoints``: its checkpoints of this run, with the host's
    progress record; a damaged file and another run's are left out (a resume cannot pick them), and
    saving every epoch keeps the coordinator's committed round (``base``) beside the two newest."""
    from fl_split.checkpoint import held_rounds, party_checkpoint_path, party_checkpoints, save_party
    from fl_split.engine import LocalEngine
    from tests.test_flower import PS, _cfg

    party = LocalEngine(_cfg(), PS).host
    for r in (0, 9, 18, 27):
        save_party(party, tmp_path, r, run="run-a", config={}, progress=_progress(1, [r // 9]) if r else None, base=0)
    assert party_checkpoints(tmp_path, "host") == [0, 18, 27]
    save_party(party, tmp_path, 36, run="run-b", config={}, base=0)
    assert party_checkpoints(tmp_path, "host") == [0, 27, 36]
    path = party_checkpoint_path(tmp_path, "host", 27)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    held = held_rounds(tmp_path, "host", "run-a")
    assert held == {0: None, 27: _progress(1, [3])}
    path.write_bytes(bytes(data))
    assert held_rounds(tmp_path, "host", "run-a") == {0: None}
    assert list(held_rounds(tmp_path, "host", "run-b")) == [36]


@pytest.mark.usefixtures("flower_task_identity")
def test_a_padded_guest_is_set_up_out_of_the_run_when_it_resumes(tmp_path, monkeypatch):
    """``--on-guest-failure pad`` and a resume: guest-2 fails in epoch 1 (the host pads it and goes
    on), then the host fails in epoch 3. Guest-2 holds no checkpoint after its failure, so the
    resume must not ask it to restore the agreed round (the end of epoch 2, which the host and
    guest-1 hold): it is set up out of the run, as it was when the run stopped, and the resumed run
    ends as the uninterrupted one with the same failure."""
    from fl_split.checkpoint import party_checkpoints
    from fl_split.errors import PartyError
    from fl_split.flower.strategy import VerticalSplitStrategy
    from flwr.app import Message

    from fl_split.flower import records as R
    from fl_split.parties.guest import GuestParty
    from fl_split.parties.host import HostParty
    from tests.test_flower import InlineGrid, _cfg, _simulation_nodes, _strip

    step = GuestParty.step

    def guest_2_lost(self, grads, keys, round_, *a, **kw):
        if self.name == "guest-2" and round_ >= 3:
            raise ConnectionError("guest-2 is unreachable")
        return step(self, grads, keys, round_, *a, **kw)

    monkeypatch.setattr(GuestParty, "step", guest_2_lost)
    base = _cfg(epochs=3, epochs_per_message=3, on_guest_failure="pad")
    whole = VerticalSplitStrategy(base).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    assert [(f["guest"], f["action"]) for f in whole["guest_failures"]] == [("guest-2", "pad")]

    cfg = base.replace(checkpoint_dir=str(tmp_path / "ckpt"))
    evaluated, train, evaluate = [], HostParty.train, HostParty.evaluate

    def fail_in_epoch_3(self, *a, **kw):
        if len(evaluated) == 2:
            raise RuntimeError("host lost")
        return train(self, *a, **kw)

    monkeypatch.setattr(HostParty, "train", fail_in_epoch_3)
    monkeypatch.setattr(HostParty, "evaluate", lambda self, *a, **kw: evaluated.append(1) or evaluate(self, *a, **kw))
    with pytest.raises(PartyError, match="host lost"):
        VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    directory = tmp_path / "ckpt"
    held = party_checkpoints(directory, "host")
    assert party_checkpoints(directory, "guest-1") == held and len(held) == 3
    assert party_checkpoints(directory, "guest-2") == held[:1]  # set-up only: it failed in epoch 1

    monkeypatch.setattr(HostParty, "train", train)
    grid = InlineGrid(_simulation_nodes(3), fresh_process=True)
    got = VerticalSplitStrategy(cfg.replace(resume=True)).run(grid)
    assert got["checkpoint"]["resumed_from_round"] == held[2]
    assert got["guest_failures"] == whole["guest_failures"]
    assert party_checkpoints(directory, "guest-2") == held[:1]  # it restored, logged and saved nothing
    # told it is out, guest-2 refuses any round a coordinator might still send it
    probe = Message(R.content(**{"first-epoch": 3, "last-epoch": 3, "session": "s", "dataplane": "{}"}),
                    dst_node_id=grid.ids[2], message_type=R.MSG_EPOCH, group_id="")
    probe.metadata.__dict__["_message_id"] = "probe"
    with pytest.raises(PartyError, match="guest-2: set up out of this run"):
        R.raise_error_record(grid._answer(probe).content, "guest-2", None)
    # and only a guest of a resumed run can be told so (never the host)
    out = R.dumps({"run": "r", "round": held[2], "resume": True, "out": True})
    setup_out = Message(R.content(config=R.dumps(cfg.replace(resume=True).to_flower()), party="host", checkpoint=out),
                        dst_node_id=grid.ids[0], message_type=R.MSG_SETUP, group_id="")
    setup_out.metadata.__dict__["_message_id"] = "setup-out"
    with pytest.raises(PartyError, match="host: only a guest of a resumed run can be set up out of it"):
        R.raise_error_record(grid._answer(setup_out).content, "host", None)
    got.pop("checkpoint")
    a, b = _strip(got), _strip(whole)
    for c in (a["config"], b["config"]):
        c.pop("checkpoint_dir", None), c.pop("resume", None)
    assert a == b
