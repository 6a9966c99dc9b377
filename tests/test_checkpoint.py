"""Checkpoint and resume (local engine): atomic files, the write-ahead release log and its
deduplication rule, a run killed with SIGKILL and resumed, bad use, and failing guests.

The Flower engine's kill-and-resume test comes with the deployment work of issue 11 (the nodes
call the same party-level functions, ``fl_split.checkpoint.save_party`` / ``restore_party``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_split.checkpoint import (
    COORDINATOR, CheckpointError, load_coordinator, party_checkpoint_path, party_checkpoints, read_checkpoint,
    read_wal, restore_party, spend_dir_of, spend_path, wal_path, write_atomic, write_checkpoint,
)
from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.engine import GuestFailure, LocalEngine, run_experiment
from fl_split.errors import ConfigError
from fl_split.seeding import PrivateSeed

PS = PrivateSeed.legacy(11)  # private seed of every comparison: same seeds => same numbers


def _cfg(tmp_path=None, **kw) -> RunConfig:
    base = dict(dataset="digits", guests=2, epochs=2, limit=400, batch_size=32, defense="gaussian", sigma=0.7,
                denoise="scale", progress=False)
    if tmp_path is not None:
        base["checkpoint_dir"] = str(tmp_path / "ck")
    base.update(kw)
    return RunConfig(**base)


class Crash(BaseException):
    """A simulated crash (like SIGKILL it is not an Exception: nothing catches it on the way)."""


class CrashAfterGuests:
    """Wraps the local transport: in round ``at`` the guests release, then the process 'dies'
    before the host trains (their releases left, no checkpoint covers them)."""

    def __init__(self, inner, at: int) -> None:
        self.inner, self.at, self.guests = inner, at, inner.guests

    def guest_step(self, owed, keys, round_):
        out = self.inner.guest_step(owed, keys, round_)
        if round_ == self.at:
            raise Crash()
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _summary(res: dict) -> tuple:
    """What an interrupted-and-resumed run must reproduce exactly."""
    priv = {p: (r.get("epsilon"), r.get("releases"), r.get("releases_per_record")) for p, r in res["privacy"].items()}
    hist = [(h["epoch"], h["train_loss"], h["test_metric"], h["test_loss"]) for h in res["history"]]
    return res["final"]["value"], res["final"]["train_loss"], priv, hist, res["wire"]


def _resumed_like(res: dict, ref: dict) -> None:
    """What a resumed run reproduces of the uninterrupted one: every release re-made up to the crash
    is the same, so the accounting (epsilon, releases, per-record releases), the wire counts and the
    epochs evaluated before its checkpoint are equal. From the logs' last draw counter on, a resumed
    party draws with a fresh resume salt (issue 25: a log rolled back to an older copy must not repeat
    noise), so the numbers after the crash come from other, independent noise and are not compared."""
    got, want = _summary(res), _summary(ref)
    assert got[2] == want[2] and got[4] == want[4]
    done = res["checkpoint"]["resumed_from_round"] // (res["wire"]["rounds"] // len(res["history"]))
    assert got[3][:done] == want[3][:done]


# -- files -------------------------------------------------------------------------------------------
def test_checkpoint_file_round_trip_and_refusals(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.int64).reshape(2, 3), "b": np.array([1.5, -2.0], dtype=np.float32),
              "e": np.zeros((0, 4), dtype=np.uint8)}
    path = write_checkpoint(tmp_path / "x.ckpt", {"format": "fl_split.checkpoint/1", "kind": "t", "n": 3}, arrays)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    header, got = read_checkpoint(path)
    assert header == {"format": "fl_split.checkpoint/1", "kind": "t", "n": 3}
    assert set(got) == set(arrays) and all(np.array_equal(got[k], arrays[k]) and got[k].dtype == arrays[k].dtype
                                           for k in arrays)
    data = path.read_bytes()
    for cut in (0, 5, len(data) // 2, len(data) - 1):
        (tmp_path / "t.ckpt").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"t\.ckpt: .*(truncated|not an fl_split).*refusing"):
            read_checkpoint(tmp_path / "t.ckpt")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    (tmp_path / "f.ckpt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_checkpoint(tmp_path / "f.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "none.ckpt")


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "c.ckpt"
    write_atomic(target, [b"old"])
    real = os.fsync

    def failing(fd):
        raise OSError(5, "disk gone")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="disk gone"):
        write_atomic(target, [b"new", b"er"])
    monkeypatch.setattr(os, "fsync", real)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]  # no temporary file left


# -- resume reproduces an uninterrupted run ---------------------------------------------------------------
@pytest.mark.parametrize("kw,every,crash_at", [
    ({}, 4, 19),                                                           # K = 1, mid-epoch crash
    ({"batches_per_round": 3, "dp_sgd": "guest", "norm": "none"}, 1, 6),   # K = 3, DP-SGD steps logged too
    ({"defense": "laplace", "protect": "both", "epsilon": 50.0}, "epoch", 13),  # host releases logged too
])
def test_crash_and_resume_equals_an_uninterrupted_run(tmp_path, kw, every, crash_at):
    ref = run_experiment(_cfg(**kw), private_seed=PS)
    cfg = _cfg(tmp_path, checkpoint_every=every, **kw)
    with pytest.raises(Crash):
        LocalEngine(cfg, PS, transport=lambda t: CrashAfterGuests(t, crash_at)).run()
    state = load_coordinator(cfg.checkpoint_dir)
    assert 0 <= state.round < crash_at and state.finished is None
    res = LocalEngine(cfg.replace(resume=True), PS).run()
    _resumed_like(res, ref)
    ck = res["checkpoint"]
    assert ck["resumed_from_round"] == state.round
    assert sum(ck["replayed"].values()) > 0  # releases made after the checkpoint were replayed ...
    assert all(v == 0 for v in ck["pending_replays"].values())  # ... and every one re-made identically
    # the logs hold each release once: exactly as many records as an uninterrupted ledger has entries
    for party in ("guest-1", "guest-2"):
        records, _, _ = read_wal(wal_path(cfg.checkpoint_dir, party))
        assert len(records) == len({(r.round, r.key, r.direction, r.digest) for r in records})
    # a finished run cannot be resumed again
    with pytest.raises(ConfigError, match=r"^--resume: .*already ended \(completed"):
        LocalEngine(cfg.replace(resume=True), PS).run()


def test_a_release_remade_differently_is_charged_again(tmp_path):
    """Same key, other value (here: the restored guest's weights were changed): a new release."""
    ref = run_experiment(_cfg(), private_seed=PS)
    cfg = _cfg(tmp_path, checkpoint_every=4)
    with pytest.raises(Crash):
        LocalEngine(cfg, PS, transport=lambda t: CrashAfterGuests(t, 10)).run()
    engine = LocalEngine(cfg.replace(resume=True), PS)
    real = engine.local.restore

    def restore_then_perturb(round_, private_seed=None):
        out = real(round_, private_seed)
        with torch.no_grad():
            next(engine.guests["guest-1"].bottom.parameters()).add_(1e-3)
        return out

    engine.local.restore = restore_then_perturb
    res = engine.run()
    assert res["checkpoint"]["replayed"] == {"host": 0, "guest-1": 2, "guest-2": 2}  # rounds 9, 10 (checkpoint: 8)
    # guest-1's two releases differ; guest-2's round-9 release is the same (its weights are the checkpoint's),
    # its round-10 release differs (it applied the host's gradient of guest-1's perturbed round 9)
    assert res["checkpoint"]["pending_replays"] == {"guest-1": 2, "guest-2": 1}
    for party, extra in (("guest-1", 2), ("guest-2", 1)):
        got, want = res["privacy"][party], ref["privacy"][party]
        assert got["releases"] == want["releases"] + extra * 32  # both versions of each batch are charged
        assert got["epsilon"] > want["epsilon"]


def test_resume_never_forgets_spent_budget(tmp_path):
    """A party restored from a checkpoint older than its last releases reports them as spent."""
    cfg = _cfg(tmp_path, checkpoint_every="epoch", epochs=1)
    engine = LocalEngine(cfg, PS, transport=lambda t: CrashAfterGuests(t, 7))
    with pytest.raises(Crash):
        engine.run()
    crashed = engine.guests["guest-1"].ledger
    at_crash = (len(crashed), crashed.epsilon())
    fresh = LocalEngine(cfg.replace(resume=True), PS)
    g = fresh.guests["guest-1"]
    header, _ = read_checkpoint(party_checkpoint_path(cfg.checkpoint_dir, "guest-1", 0))
    assert header["round"] == 0
    info = restore_party(g, cfg.checkpoint_dir, 0, run=header["run"], config=fresh.cfg.to_dict())
    assert info["replayed"] == 7
    assert (len(g.ledger), g.ledger.epsilon()) == at_crash and at_crash[1] > 0


def _released_after_checkpoint(ck: Path) -> bool:
    """Whether guest-1's write-ahead log holds a release made after its last checkpoint."""
    records, _, _ = read_wal(wal_path(ck, "guest-1"))
    header, _ = read_checkpoint(party_checkpoint_path(ck, "guest-1", load_coordinator(ck).round))
    return len(records) > header["skeleton"]["ledger"]["wal_records"]


@pytest.mark.slow
def test_sigkill_and_resume_from_the_command_line(tmp_path):
    """``fl-split train --checkpoint-dir`` in its own process group, SIGKILLed mid-run, then
    ``--resume``: the same releases and epsilon as an uninterrupted run with the same seeds."""
    ck = tmp_path / "ck"
    args = ["--dataset", "digits", "--guests", "2", "--epochs", "3", "--defense", "gaussian", "--sigma", "0.7",
            "--denoise", "scale", "--no-progress", "--private-seed", "5eed0c4f9a2e7b13d86f1a0b3c5e7d92", "--checkpoint-every", "10"]
    env = dict(os.environ, FL_SPLIT_NO_DOWNLOAD="1", OMP_NUM_THREADS="1")
    killed_out = tmp_path / "killed.json"
    proc = subprocess.Popen([sys.executable, "-m", "fl_split.cli", "train", *args, "--checkpoint-dir", str(ck),
                             "--out", str(killed_out)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Kill only once a release follows the last checkpoint (what resume must replay). The check is made
        # with the run stopped (SIGSTOP), so what it sees is what the kill leaves: no timing guess, which
        # failed on a loaded CI machine when 0.15 s held no release.
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no release after a checkpoint from round 30 on within 180 s"
            if (ck / COORDINATOR).exists() and load_coordinator(ck).round >= 30:
                os.killpg(proc.pid, signal.SIGSTOP)
                if _released_after_checkpoint(ck):
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.02)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL and not killed_out.exists()
    state = load_coordinator(ck)
    assert state.finished is None and state.round >= 30
    assert _released_after_checkpoint(ck), "no release after the checkpoint"
    t0 = time.monotonic()
    assert main(["train", *args, "--checkpoint-dir", str(ck), "--resume", "--out", str(tmp_path / "res.json")]) == 0
    resume_s = time.monotonic() - t0
    assert main(["train", *args, "--out", str(tmp_path / "ref.json")]) == 0
    res, ref = (json.loads((tmp_path / f).read_text()) for f in ("res.json", "ref.json"))
    # after the crash the resumed parties draw with a fresh resume salt (issue 25): other noise, so the
    # final metric is not compared; the accounting is the uninterrupted run's
    assert {p: r["releases"] for p, r in res["privacy"].items()} == {p: r["releases"] for p, r in ref["privacy"].items()}
    assert {p: r["epsilon"] for p, r in res["privacy"].items()} == {p: r["epsilon"] for p, r in ref["privacy"].items()}
    assert res["checkpoint"]["resumed_from_round"] == state.round
    assert sum(res["checkpoint"]["replayed"].values()) > 0 and not any(res["checkpoint"]["pending_replays"].values())
    print(f"killed after round {state.round}; resume took {resume_s:.1f} s")


# -- bad use is refused with a message, nothing spent -------------------------------------------------------
def test_bad_resumes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^--resume: got True \(there is no checkpoint directory"):
        _cfg(resume=True)
    with pytest.raises(ConfigError, match=r"^--resume: .*has no coordinator.ckpt \(the directory does not exist\)"):
        LocalEngine(_cfg(tmp_path, resume=True), PS).run()
    cfg = _cfg(tmp_path, checkpoint_every=4)
    with pytest.raises(Crash):
        LocalEngine(cfg, PS, transport=lambda t: CrashAfterGuests(t, 10)).run()
    ck = Path(cfg.checkpoint_dir)
    # a fresh run into a directory holding a checkpoint
    with pytest.raises(ConfigError, match=r"^--checkpoint-dir: .*holds another run's checkpoint.*--resume"):
        LocalEngine(cfg, PS).run()
    # other options: every differing one is named
    with pytest.raises(ConfigError, match=r"made with --lr 0\.01, --sigma 0\.7; this run has --lr 0\.1, --sigma 0\.5"):
        LocalEngine(cfg.replace(resume=True, lr=0.1, sigma=0.5), PS).run()
    # free options may change
    LocalEngine(cfg.replace(resume=True, checkpoint_every=4, on_guest_failure="pad"), PS)
    # a private seed that does not derive the checkpointed secrets
    with pytest.raises(ConfigError, match=r"^--private-seed: .*does not derive (host|guest-\d)'s checkpointed secret"):
        LocalEngine(cfg.replace(resume=True), PrivateSeed.legacy(12)).run()
    # a damaged or truncated party checkpoint
    good = party_checkpoint_path(ck, "guest-2", 8)
    saved = good.read_bytes()
    good.write_bytes(saved[: len(saved) // 3])
    with pytest.raises(CheckpointError, match=r"guest-2\.r00000008\.ckpt: truncated or damaged"):
        LocalEngine(cfg.replace(resume=True), PS).run()
    good.write_bytes(saved)
    # a write-ahead log shorter than the checkpoint counts, its spend record too (a log alone is repaired
    # from its record: tests/test_adversary_rollback.py): spent budget would be forgotten
    wal = wal_path(ck, "guest-1")
    record = spend_path(spend_dir_of(ck), "guest-1", load_coordinator(ck).run)
    text = wal.read_bytes()
    lines = text.split(b"\n")
    for f in (wal, record):
        f.write_bytes(b"\n".join(lines[:3]) + b"\n")
    with pytest.raises(CheckpointError, match=r"guest-1: the write-ahead log has \d+ releases but the checkpoint "
                                              r"of round 8 already counts \d+"):
        LocalEngine(cfg.replace(resume=True), PS).run()
    record.write_bytes(text)
    # damage in the middle of the log is refused; a torn last line is not
    damaged = bytearray(text)
    damaged[len(lines[0]) + 12] ^= 0x20
    wal.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"guest-1\.wal: line 2 is damaged"):
        LocalEngine(cfg.replace(resume=True), PS).run()
    wal.write_bytes(text + b'0000abcd {"seq": 9')  # torn while being written: that release never left
    res = LocalEngine(cfg.replace(resume=True), PS).run()
    _resumed_like(res, run_experiment(_cfg(), private_seed=PS))
    assert read_wal(wal)[2] == len(wal.read_bytes())  # the torn tail was cut off before appending


def test_truncated_coordinator_checkpoint_is_refused(tmp_path):
    cfg = _cfg(tmp_path, epochs=1)
    LocalEngine(cfg, PS).run()
    path = Path(cfg.checkpoint_dir) / COORDINATOR
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=r"coordinator\.ckpt: truncated or damaged .*refusing to restore"):
        LocalEngine(cfg.replace(resume=True), PS).run()


def test_cli_resume_errors_are_one_line(tmp_path, capsys):
    afile = tmp_path / "f"
    afile.write_text("x")
    code = main(["train", "--checkpoint-dir", str(afile), "--epochs", "1", "--limit", "200", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("fl-split: error: --checkpoint-dir: ") and "a file" in err[0]
    code = main(["train", "--resume", "--epochs", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("fl-split: error: --resume: got True")
    code = main(["train", "--checkpoint-dir", str(tmp_path / "none"), "--resume", "--epochs", "1", "--limit", "200"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no coordinator.ckpt" in err[0]


# -- guests that fail ---------------------------------------------------------------------------------------
class GuestDiesAt:
    """``guest`` raises from round ``at`` on (a crashed process, a timeout: it never answers again)."""

    def __init__(self, inner, guest: str, at: int) -> None:
        self.inner, self.guest, self.at, self.guests = inner, guest, at, inner.guests
        party = inner.parties[guest]
        real = party.step

        def step(owed, keys, round_, **kw):
            if round_ >= self.at:
                raise ConnectionError(f"{guest} is unreachable")
            return real(owed, keys, round_, **kw)

        party.step = step

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_guest_failure_stop_names_it_checkpoints_and_resumes(tmp_path):
    ref = run_experiment(_cfg(), private_seed=PS)
    cfg = _cfg(tmp_path, checkpoint_every=5)
    with pytest.raises(GuestFailure, match=r"^guest-2 failed in round 12: ConnectionError: guest-2 is unreachable; "
                                           r"stopped \(--on-guest-failure stop\); resume from the checkpoint of "
                                           r"round 10 in .* with --resume$") as err:
        LocalEngine(cfg, PS, transport=lambda t: GuestDiesAt(t, "guest-2", 12)).run()
    assert (err.value.party, err.value.round) == ("guest-2", 12)
    state = load_coordinator(cfg.checkpoint_dir)
    assert state.round == 10 and state.stopped == {"reason": "guest_failure", "guests": ["guest-2"], "round": 12}
    assert state.guest_failures[0]["guest"] == "guest-2" and state.finished is None
    # guest-1 released round 12 before the stop: logged, replayed and deduplicated on resume
    res = LocalEngine(cfg.replace(resume=True), PS).run()
    _resumed_like(res, ref)
    assert res["checkpoint"]["replayed"]["guest-1"] >= 2
    assert res["guest_failures"][0]["action"] == "stop"


def test_guest_failure_pad_goes_on_with_a_zero_embedding(tmp_path):
    cfg = _cfg(on_guest_failure="pad")
    full = run_experiment(cfg, private_seed=PS)
    res = LocalEngine(cfg, PS, transport=lambda t: GuestDiesAt(t, "guest-2", 7)).run()
    assert res["stopped_reason"] == "completed" and len(res["history"]) == 2
    assert [(f["guest"], f["round"], f["action"]) for f in res["guest_failures"]] == [("guest-2", 7, "pad")]
    assert "ConnectionError" in res["guest_failures"][0]["reason"]
    assert "guest-2" not in res["privacy"] and "guest-2" not in res["parties"]
    # guest-1 trained on; the host released nothing for guest-2 from round 7 on
    assert res["privacy"]["guest-1"]["releases"] == full["privacy"]["guest-1"]["releases"]
    assert res["parties"]["host"]["released"]["batches"] < full["parties"]["host"]["released"]["batches"]
    assert 0.2 < res["final"]["value"] <= 1.0
    # the padded run checkpoints and resumes too (the failure is part of the state)
    ck = _cfg(tmp_path, on_guest_failure="pad", checkpoint_every=4)
    with pytest.raises(Crash):
        LocalEngine(ck, PS, transport=lambda t: CrashAfterGuests(GuestDiesAt(t, "guest-2", 7), 17)).run()
    again = LocalEngine(ck.replace(resume=True), PS).run()
    _resumed_like(again, res)
    assert again["guest_failures"] == res["guest_failures"]


def test_pad_is_refused_for_a_product_merge():
    with pytest.raises(ConfigError, match=r"^--on-guest-failure: got 'pad' \(a zero-filled embedding makes a "
                                          r"product merge zero"):
        _cfg(on_guest_failure="pad", merge="mul")


def test_keep_two_party_checkpoints(tmp_path):
    cfg = _cfg(tmp_path, checkpoint_every=3, epochs=1)  # 10 training rounds and 1 evaluation
    LocalEngine(cfg, PS).run()
    for party in ("host", "guest-1", "guest-2"):
        assert party_checkpoints(cfg.checkpoint_dir, party) == [6, 9]
    shutil.rmtree(cfg.checkpoint_dir)
