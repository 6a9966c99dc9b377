"""What a deployment's control plane costs in CPU (issue 25, the wall target): on a 2-core machine a
loopback deployment's processes compete for the same cores, so every poll and every import is paid
in wall time. These tests pin the behaviour that keeps them down; ``experiments/bench_deploy.py``
measures the times (no wall-clock assertions here).

* :class:`fl_split.flower.flwrcli.FlwrCli` — many ``flwr`` commands in one process answer exactly
  as separate ``flwr`` processes do (output, exit status), and a dead helper ends its command;
* ``flwr run``'s check of the app (``strategies.server_app:app``) imports no torch;
* the ServerApp's waits on a remote grid, and an idle party runtime's polls, space out to a cap
  and snap back when something arrives (a simulation's in-process grid keeps its interval).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _flwr_home(tmp_path: Path) -> dict[str, str]:
    """A FLWR_HOME whose default connection points at a port nothing listens on."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "dead"\n\n[superlink.dead]\n'
                                      'address = "127.0.0.1:9"\ninsecure = true\n', encoding="utf-8")
    return dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0")


def test_one_flwr_process_answers_each_command_as_a_fresh_flwr_would(tmp_path):
    from fl_split.deploy import _bin
    from fl_split.flower.flwrcli import FlwrCli

    env = _flwr_home(tmp_path)
    commands = [["--version"],
                ["no-such-command"],  # Click's usage error: exit status 2, the message in a box
                ["ls", "dead", "--format", "json"],  # the SuperLink unreachable: JSON with success false
                ["ls", "no-such-connection", "--format", "json"],
                ["--version"]]  # the process is still sound after the failures
    with FlwrCli(env, tmp_path) as cli:
        for args in commands:
            fresh = subprocess.run([_bin("flwr"), *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, timeout=120)
            mine = cli.run(*args)
            assert (mine.returncode, mine.stdout) == (fresh.returncode, fresh.stdout), args
    assert [cmd[0] for cmd in commands].count("--version") == 2
    assert "Flower version" in fresh.stdout and cli.proc.returncode == 0  # closed by its input's end


def test_a_command_of_a_dead_helper_ends_with_the_helpers_status(tmp_path):
    from fl_split.flower.flwrcli import FlwrCli

    cli = FlwrCli(_flwr_home(tmp_path), tmp_path)
    try:
        assert cli.run("--version").returncode == 0
        cli.proc.kill()
        cli.proc.wait(timeout=10)
        out = cli.run("--version", timeout=30)  # no hang: the reader saw the end of the output
        assert out.returncode == -9 and out.stdout == ""
        assert cli.start("--version").wait(timeout=10) == -9  # and so does every later command
    finally:
        cli.close()


def test_flwr_runs_check_of_the_app_imports_no_torch():
    """``flwr run`` validates ``[tool.flwr.app.components]`` with ``find_spec``, which executes the
    ``strategies`` package: that must not pull in the server app and torch (2.4 s of CPU per run)."""
    code = ("import sys\n"
            "from flwr.supercore.object_ref import validate\n"
            "ok = validate('strategies.server_app:app', project_dir='.')\n"
            "assert ok == (True, None), ok\n"
            "assert 'torch' not in sys.modules and 'strategies.server_app' not in sys.modules\n"
            "import strategies\n"
            "assert strategies.app is strategies.server_app.app  # the names still resolve on use\n"
            "assert 'torch' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


class _Reply:
    """What the transport reads of a reply: its metadata's ``reply_to_message_id`` and its content."""

    def __init__(self, mid: str) -> None:
        from types import SimpleNamespace

        from fl_split.flower import records as R

        self.metadata = SimpleNamespace(reply_to_message_id=mid)
        self.content = R.reply_content(ok="yes")

    def has_error(self) -> bool:
        return False


class _Grid:
    """A grid whose replies arrive on the ``ready``-th poll."""

    def __init__(self, ready: int) -> None:
        self.ready, self.polls = ready, 0

    def push_messages(self, msgs):
        return [f"m{i}" for i, _ in enumerate(msgs)]

    def pull_messages(self, ids):
        self.polls += 1
        return [_Reply(mid) for mid in ids] if self.polls >= self.ready else []


class InMemoryGrid(_Grid):
    """Named as Flower's simulation grid (the transport tells the two apart by type name)."""


@pytest.mark.parametrize("grid_type, remote", [(_Grid, True), (InMemoryGrid, False)])
def test_the_coordinators_waits_space_out_on_a_remote_grid_only(monkeypatch, flower_task_identity, grid_type, remote):
    from fl_split.flower import transport as T

    sleeps: list[float] = []
    monkeypatch.setattr(T.time, "sleep", sleeps.append)
    grid = grid_type(ready=12)
    transport = T.FlowerTransport(grid, {"host": 5}, timeout=60.0)
    out = transport.exchange({"host": ("query.role", T.R.content())}, None)
    assert dict(out["host"]) == {"ok": "yes"} and grid.polls == 12 and len(sleeps) == 11
    if remote:  # 5 ms, growing by half each empty poll, capped
        assert sleeps[0] == pytest.approx(T.POLL_INTERVAL)
        assert all(b == pytest.approx(min(a * 1.5, T.REMOTE_POLL_CAP)) for a, b in zip(sleeps, sleeps[1:]))
        assert max(sleeps) == pytest.approx(T.REMOTE_POLL_CAP)
    else:
        assert set(sleeps) == {T.POLL_INTERVAL}


def test_an_idle_runtime_spaces_its_polls_out_and_snaps_back_after_a_task(monkeypatch):
    from fl_split.flower import warm as W

    runtime = W.PartyRuntime.__new__(W.PartyRuntime)  # no SuperNode: acquire and run_task are stubbed
    runtime.poll = W.POLL_INTERVAL
    tokens = iter([None] * 8 + ["task"] + [None] * 3)
    ran, sleeps = [], []
    runtime.acquire = lambda: next(tokens)
    runtime.run_task = ran.append
    monkeypatch.setattr(W.time, "sleep", sleeps.append)
    left = iter(range(12, 0, -1))
    runtime.serve(lambda: next(left, 0) > 0)
    assert ran == ["task"] and len(sleeps) == 11
    before, after = sleeps[:8], sleeps[8:]
    assert before[0] == W.POLL_INTERVAL and max(before) == pytest.approx(W.IDLE_POLL_CAP)
    assert all(b >= a for a, b in zip(before, before[1:]))
    assert after[0] == W.POLL_INTERVAL  # a task came: the next message may follow at once


def test_a_deployment_replaces_a_dead_flwr_process(tmp_path):
    """The deployment's ``flwr`` commands keep working after its one ``flwr`` process died (a fresh
    ``flwr`` per command would not have noticed): the next command starts another."""
    from fl_split.config import RunConfig
    from fl_split.deploy import LocalDeployment

    dep = LocalDeployment(RunConfig(dataset="digits", guests=1, limit=100, engine="flower"), tmp_path / "dep",
                          tls=False, echo=lambda line: None)
    dep.workdir.mkdir(parents=True)
    try:
        first = dep.flwr_cli()
        assert dep._flwr("--version").returncode == 0
        first.proc.kill()
        first.proc.wait(timeout=10)
        again = dep._flwr("--version")
        assert again.returncode == 0 and "Flower version" in again.stdout
        assert dep.flwr_cli() is not first and dep.group.procs["flwr"] is dep.flwr_cli().proc
    finally:
        dep.stop()
    assert dep._cli.proc.wait(timeout=10) is not None  # signalled with the deployment: it ends (no TimeoutExpired)
