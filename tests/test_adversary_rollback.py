"""A whole-state rollback cannot under-report spent budget (docs/robustness.md, "The spend record";
docs/threat-model.md, "Rolling back a party's own files").

The red team's attack: every party's checkpoint directory (host, guests, coordinator) is restored
from a snapshot taken after epoch 1 (a backup, a VM image) and the run is resumed. Before the spend
record, the resumed run silently re-made the releases made after the snapshot with fresh noise
(every resume draws a fresh salt) and charged them once: it reported the uninterrupted run's ε
although those batches had left twice. Now each party's spend record, outside the checkpoint
directory, still holds the lost releases: they are put back into the log and charged, and the
resumed run re-makes each of them bit for bit (the same bytes leave again: nothing new is learnt,
nothing is charged twice) or, where a deviating host makes a re-made release differ, charges it
again.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest
import torch

from fl_split.checkpoint import (
    COORDINATOR, CheckpointError, load_coordinator, read_wal, spend_dir_of, spend_path, wal_path,
)
from fl_split.cli import print_summary
from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.privacy.ledger import Ledger, LedgerEntry
from fl_split.seeding import PrivateSeed

PS = PrivateSeed.legacy(11)
GUESTS = ("guest-1", "guest-2")


def _cfg(tmp_path: Path, **kw) -> RunConfig:
    base = dict(dataset="digits", guests=2, epochs=2, limit=300, batch_size=32, defense="gaussian", sigma=0.7,
                progress=False, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every="epoch")
    return RunConfig(**{**base, **kw})


class SnapshotAfterEpoch:
    """Wraps the local transport and copies the whole checkpoint directory (every party's files and
    the coordinator's) once the coordinator has committed epoch ``epoch``: the backup."""

    def __init__(self, inner, directory: Path, snapshot: Path, epoch: int = 1) -> None:
        self.inner, self.guests = inner, inner.guests
        self.directory, self.snapshot, self.epoch = directory, snapshot, epoch

    def guest_step(self, owed, keys, round_):
        if not self.snapshot.exists() and (self.directory / COORDINATOR).exists() \
                and len(load_coordinator(self.directory).history) >= self.epoch:
            shutil.copytree(self.directory, self.snapshot)
        return self.inner.guest_step(owed, keys, round_)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _log(directory, party, run):
    return read_wal(wal_path(directory, party), party, run)[0]


def _first_run(tmp_path):
    """The uninterrupted run, its snapshot after epoch 1, and each party's log at its end."""
    cfg = _cfg(tmp_path)
    ck, snap = Path(cfg.checkpoint_dir), tmp_path / "snapshot"
    ref = LocalEngine(cfg, PS, transport=lambda t: SnapshotAfterEpoch(t, ck, snap)).run()
    run = load_coordinator(ck).run
    logs = {g: _log(ck, g, run) for g in GUESTS}
    assert snap.exists() and load_coordinator(snap).finished is None  # the backup is of a run in progress
    return cfg, ck, snap, run, ref, logs


def _restore_all(ck: Path, snap: Path) -> None:
    """Every party's checkpoint directory (here: the one directory they share) from the snapshot."""
    shutil.rmtree(ck)
    shutil.copytree(snap, ck)


def test_whole_state_rollback_is_charged_and_remade_bit_for_bit(tmp_path, capsys):
    cfg, ck, snap, run, ref, logs = _first_run(tmp_path)
    lost = {g: len(logs[g]) - len(_log(snap, g, run)) for g in GUESTS}
    assert all(n > 0 for n in lost.values())  # the snapshot's logs lack epoch 2's releases
    _restore_all(ck, snap)
    assert {g: len(_log(ck, g, run)) for g in GUESTS} == {g: len(logs[g]) - lost[g] for g in GUESTS}

    res = LocalEngine(cfg.replace(resume=True), PS).run()
    # the releases the restored logs lacked came back from the spend records (outside ck) and were charged
    assert res["checkpoint"]["recovered"] == lost
    assert res["checkpoint"]["resumed_from_round"] == load_coordinator(snap).round
    # and the resumed run re-made every one of them bit for bit: the same bytes left again, nothing new
    assert all(v == 0 for v in res["checkpoint"]["pending_replays"].values())
    for g in GUESTS:
        after = _log(ck, g, run)
        assert [(r.key, r.direction, r.digest, r.draw) for r in after] == \
               [(r.key, r.direction, r.digest, r.draw) for r in logs[g]]
    # so the report is the uninterrupted run's, to the last digit, and so is the model
    for g in GUESTS:
        got, want = res["privacy"][g], ref["privacy"][g]
        assert (got["epsilon"], got["releases"], got["releases_per_record"]) == \
               (want["epsilon"], want["releases"], want["releases_per_record"])
    assert res["final"] == ref["final"]
    # and the user is told (fl-split train's summary)
    capsys.readouterr()
    print_summary(res)
    said = " ".join(capsys.readouterr().out.split())
    assert ("the restored write-ahead logs lacked releases their spend records hold, now charged: "
            f"guest-1 {lost['guest-1']}, guest-2 {lost['guest-2']}") in said


def test_whole_state_rollback_then_a_deviating_host_is_charged_twice(tmp_path):
    """After the restore the host sends other gradients (here: its restored top model is nudged), so
    the guests' re-made releases of epoch 2 differ from those that left before the restore: each is
    a second release of its batch, charged. ε is compared with the accountant on the expected count."""
    cfg, ck, snap, run, ref, logs = _first_run(tmp_path)
    _restore_all(ck, snap)
    engine = LocalEngine(cfg.replace(resume=True), PS)
    real = engine.local.restore

    def restore_then_deviate(round_, private_seed=None):
        out = real(round_, private_seed)
        with torch.no_grad():
            for p in engine.host.top.parameters():
                p.add_(0.05)
        return out

    engine.local.restore = restore_then_deviate
    res = engine.run()
    for g in GUESTS:
        after = _log(ck, g, run)
        again = after[len(logs[g]):]  # logged after the spend record's releases: made a second time
        assert again and all(r.round <= logs[g][-1].round for r in again)
        got, want = res["privacy"][g], ref["privacy"][g]
        assert got["releases"] == want["releases"] + sum(r.n for r in again)
        assert got["epsilon"] > want["epsilon"]
        # the worst record was released once more than in the uninterrupted run (one batch per epoch),
        # and the report is the accountant's ε of that many releases of one record
        m = got["releases_per_record"]
        assert m == want["releases_per_record"] + 1
        cost = again[0].cost
        alone = Ledger(g, accountant=cfg.accountant, delta=cfg.delta)
        alone.charge([LedgerEntry(i, ("train", 0, i), "forward", cost, torch.tensor([0]).numpy(), None)
                      for i in range(m)])
        assert got["epsilon"] == pytest.approx(alone.epsilon(), rel=1e-9)


def test_a_missing_or_disagreeing_spend_record_refuses_the_resume_with_nothing_written(tmp_path):
    cfg, ck, snap, run, ref, logs = _first_run(tmp_path)
    _restore_all(ck, snap)
    record = spend_path(spend_dir_of(ck), "guest-2", run)
    kept = record.read_bytes()
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    record.unlink()
    spent = {p.name: p.read_bytes() for p in spend_dir_of(ck).iterdir()}
    with pytest.raises(CheckpointError, match=r"^guest-2: its spend record .*guest-2\.\w+\.spent' does not exist; "
                                              r"it is kept outside the checkpoint directory"):
        LocalEngine(cfg.replace(resume=True), PS).run()
    assert {p.name: p.read_bytes() for p in spend_dir_of(ck).iterdir()} == spent
    # another history: the record's first release, which the restored log holds too, has another
    # value (a well-formed line with its own CRC)
    lines = kept.split(b"\n")
    i = next(i for i, line in enumerate(lines) if b'"seq":0,' in line)
    text = lines[i][9:].replace(b'"v":"', b'"v":"0', 1)
    lines[i] = b"%08x %s" % (zlib.crc32(text), text)
    record.write_bytes(b"\n".join(lines))
    spent = {p.name: p.read_bytes() for p in spend_dir_of(ck).iterdir()}
    with pytest.raises(CheckpointError, match=r"^guest-2: its write-ahead log .* and its spend record .* disagree "
                                              r"from line \d+ on"):
        LocalEngine(cfg.replace(resume=True), PS).run()
    # nothing written: every file of the checkpoint directory as it was (guest-1's log not repaired
    # either, though its own record would repair it), and the other spend records too
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert {p.name: p.read_bytes() for p in spend_dir_of(ck).iterdir()} == spent


@pytest.mark.usefixtures("flower_task_identity")
def test_whole_state_rollback_under_flower_nodes_is_charged_and_remade_bit_for_bit(tmp_path, monkeypatch):
    """The same attack on the Flower path (the coordinator strategy and the ClientApp's handler,
    nodes in this process as in a simulation, each message from ``context.state`` alone): the
    snapshot is taken when the coordinator commits epoch 1, the run goes on to its end, every
    directory is restored and the run resumed. Each node puts back the releases from its spend
    record and re-makes them bit for bit."""
    from fl_split.checkpoint import Checkpointer
    from fl_split.flower.strategy import VerticalSplitStrategy
    from tests.test_flower import InlineGrid, _cfg as flower_cfg, _simulation_nodes

    cfg = flower_cfg(epochs=2, defense="gaussian", sigma=0.7, checkpoint_dir=str(tmp_path / "ck"))
    ck, snap = tmp_path / "ck", tmp_path / "snapshot"
    commit = Checkpointer.commit

    def commit_then_back_up(self, **changes):
        commit(self, **changes)
        if not snap.exists() and len(self.state.history) == 1:  # epoch 1 committed: every party is idle
            shutil.copytree(ck, snap)

    monkeypatch.setattr(Checkpointer, "commit", commit_then_back_up)
    ref = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    run = load_coordinator(ck).run
    logs = {g: _log(ck, g, run) for g in GUESTS}
    assert all(len(_log(snap, g, run)) < len(logs[g]) for g in GUESTS)  # the backup lacks epoch 2's releases
    _restore_all(ck, snap)

    res = VerticalSplitStrategy(cfg.replace(resume=True)).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    assert res["checkpoint"]["resumed_from_round"] == load_coordinator(snap).round
    for g in GUESTS:  # every lost release came back from the spend record and was re-made identically
        assert [(r.key, r.digest, r.draw) for r in _log(ck, g, run)] == [(r.key, r.digest, r.draw) for r in logs[g]]
        got, want = res["privacy"][g], ref["privacy"][g]
        assert (got["epsilon"], got["releases"]) == (want["epsilon"], want["releases"])
    assert res["final"] == ref["final"]


def test_a_deployment_nodes_spend_record_lives_outside_its_checkpoint_folder(tmp_path):
    """``deploy local --checkpoint-dir DIR`` gives each node ``DIR/<party>`` for its checkpoints and
    ``DIR.spent/<party>`` for its spend records (a restore of all of DIR leaves them alone); a node
    config's own ``spend-dir`` is taken, unless it lies inside the node's checkpoint folder; without
    one, the records go next to that folder."""
    from fl_split.deploy import LocalDeployment
    from fl_split.flower.node import NodeRole, spend_dir_of_node
    from fl_split.flower.records import FederationError

    cfg = RunConfig(dataset="digits", checkpoint_dir=str(tmp_path / "ck"))
    dep = LocalDeployment(cfg, tmp_path / "dep", tls=False)
    dep.party_file = lambda party: tmp_path / f"{party}.npz"
    dep.dataplane_port = 1  # not started: only its node configs are read
    text = dep.node_config("guest-1")
    assert f"checkpoint-dir='{tmp_path / 'ck' / 'guest-1'}'" in text
    assert f"spend-dir='{tmp_path / 'ck.spent' / 'guest-1'}'" in text

    role = NodeRole("guest-1", "guest", 1, "deployment", "g.npz")
    node_ck = str(tmp_path / "ck" / "guest-1")
    assert spend_dir_of_node(role, {"spend-dir": str(tmp_path / "elsewhere")}, node_ck) == str(tmp_path / "elsewhere")
    assert spend_dir_of_node(role, {}, node_ck) == str(tmp_path / "ck" / "guest-1.spent")
    with pytest.raises(FederationError, match=r"^guest-1 node-config: spend-dir .* is inside its checkpoint-dir"):
        spend_dir_of_node(role, {"spend-dir": node_ck + "/spent"}, node_ck)
    assert spend_dir_of(tmp_path / "ck" / "") == tmp_path / "ck.spent"
    # a kit's per-run folders (checkpoints/{run}): next to the folder of all runs
    per_run = {"checkpoint-dir": str(tmp_path / "checkpoints" / "{run}")}
    node_ck = str(tmp_path / "checkpoints" / "ab12")
    assert spend_dir_of_node(role, per_run, node_ck) == str(tmp_path / "checkpoints.spent")
