"""The warm party (issue 25, fl_split/flower/warm.py): ``fl-split party-runtime`` and its SuperNode.

The runtime's message handling runs in every deployment test (``deploy local`` and the kits use it by
default; tests/test_deploy.py checks that one process served every message of each party). Here: the
command's one-line refusals, the FAB check, and the lifetime guarantee — the runtime and its
SuperNode end together, whichever goes first (SIGKILL included), so that no node is left accepting
messages nobody answers and no process outlives a deployment.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from fl_split.errors import ConfigError
from fl_split.flower.processes import process_table
from fl_split.flower.warm import CLIENTAPP_REF, fab_clientapp, runtime_address
from tests.services import free_port

FLSPLIT = [sys.executable, "-m", "fl_split.cli"]
BIN = Path(sys.executable).parent


def _fab(clientapp: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("pyproject.toml", f'[tool.flwr.app.components]\nserverapp = "strategies.server_app:app"\n'
                                      f'clientapp = "{clientapp}"\n')
    return buf.getvalue()


def test_runtime_address_follows_the_supernode_flags():
    assert runtime_address(["--superlink", "x:9093", "--host", "127.0.0.1", "--port", "9123"]) == "127.0.0.1:9123"
    assert runtime_address(["--host", "0.0.0.0", "--port", "9200"]) == "127.0.0.1:9200"  # wildcard: loopback
    assert runtime_address([]) == "127.0.0.1:9094"  # Flower's defaults
    with pytest.raises(ConfigError, match="--isolation: got 'subprocess'.*allowed: 'process'"):
        runtime_address(["--isolation", "subprocess"])


def test_the_runtime_runs_only_fl_splits_clientapp():
    assert fab_clientapp(_fab(CLIENTAPP_REF)) == CLIENTAPP_REF
    assert fab_clientapp(_fab("evil.app:app")) == "evil.app:app"  # run_task refuses anything but CLIENTAPP_REF
    # the repository's own app names it (the FAB flwr run builds from this checkout)
    root = Path(__file__).resolve().parents[1]
    assert f'clientapp = "{CLIENTAPP_REF}"' in (root / "pyproject.toml").read_text()


def test_short_object_waits_apply_where_flower_pulls_objects_only():
    import types

    from fl_split.flower.warm import PULL_BACKOFF, short_object_waits

    calls = []
    module = types.ModuleType("fake_grid_module")
    module.pull_objects = lambda **kw: calls.append(kw)
    short_object_waits(module)
    short_object_waits(module)  # once: no partial of a partial
    module.pull_objects(object_ids=["a"], pull_object_fn=None)
    assert calls == [{"object_ids": ["a"], "pull_object_fn": None, "initial_backoff": PULL_BACKOFF,
                      "backoff_cap": 0.5, "max_tries_per_object": None}]
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    import flwr.superlink.grid.inmemory_grid as inmemory

    before = dict(vars(inmemory))
    short_object_waits(InMemoryGrid.__new__(InMemoryGrid))  # the simulation's grid: nothing to shorten
    assert dict(vars(inmemory)) == before


@pytest.mark.parametrize("argv, words", [
    (["party-runtime"], "no command"),
    (["party-runtime", "--", "flwr-clientapp", "--token", "x"], "flwr-clientapp"),
    (["party-runtime", "--", "flower-supernode", "--superexec-auth-secret-file", "/tmp/s"], "fresh secret per start"),
])
def test_party_runtime_refuses_with_one_line(argv, words):
    out = subprocess.run([*FLSPLIT, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and words in out.stderr, out.stderr


def _launch(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """``fl-split party-runtime`` with a SuperNode that looks for a SuperLink that is not there (it
    keeps retrying): no task ever comes. Returns the runtime and its log."""
    log = tmp_path / "runtime.log"
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr-home"), FLWR_TELEMETRY_ENABLED="0")
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*FLSPLIT, "party-runtime", "--", str(BIN / "flower-supernode"), "--insecure",
                                 "--superlink", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--node-config", "role='host' data-path='x.npz'"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log


def _start(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """:func:`_launch`, once the pair is up. Returns the runtime, the SuperNode's PID and the log."""
    proc, log = _launch(tmp_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "serves the ClientApp tasks of SuperNode pid" in text:
            pid = int(text.split("SuperNode pid ", 1)[1].split()[0])
            # the secret file is removed once the SuperNode has read it (its Runtime API is open;
            # importing flwr may take tens of seconds on a loaded machine)
            while time.monotonic() < deadline:
                if "--superexec-auth-secret-file" in _cmdline(pid) and not Path(_secret_path(pid)).exists():
                    return proc, pid, log
                assert proc.poll() is None, log.read_text(errors="replace")
                time.sleep(0.1)
            break
        assert proc.poll() is None, text
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(log.read_text(errors="replace"))


def test_stop_raises_only_inside_a_task_and_only_once():
    """The runtime's signal gate (``fl_split.flower.processes.DeferredInterrupt``, also ``deploy
    local``'s): outside a ClientApp task a signal is only recorded (the loops check it), inside one it
    interrupts the task once; a second signal during the clean-up is recorded, never raised."""
    from fl_split.flower.processes import DeferredInterrupt

    stop = DeferredInterrupt()
    stop.handler(signal.SIGTERM, None)  # e.g. while PartyRuntime imports torch: nothing raised there
    assert stop.signal == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        stop.raise_if_stopped()
    with pytest.raises(KeyboardInterrupt):  # a task does not start after a stop
        with stop.interruptible():
            pass
    stop = DeferredInterrupt()
    with pytest.raises(KeyboardInterrupt):
        with stop.interruptible():
            stop.handler(signal.SIGINT, None)
    stop.handler(signal.SIGTERM, None)  # the second one: recorded as nothing new, not raised
    assert stop.signal == signal.SIGINT


_SIGNAL_IN_EXEC = """
import os, signal, sys
from fl_split.flower.processes import DeferredInterrupt
stop = DeferredInterrupt()
if sys.argv[1] == "naive":  # what the runtime did before: raise wherever the signal lands
    def handler(signum, frame):
        stop.signal = signum
        raise KeyboardInterrupt
else:
    handler = stop.handler
signal.signal(signal.SIGTERM, handler)
try:  # the signal lands inside exec of a string, as in every @dataclass built at import time
    exec("import os, signal; os.kill(os.getpid(), signal.SIGTERM); sum(range(10000))")
    stop.raise_if_stopped()
except KeyboardInterrupt:
    sys.exit(128 + stop.signal)
"""


def test_a_signal_inside_exec_still_exits_with_its_own_code(tmp_path):
    """The flake this gate fixed (about 1 run in 10: the SIGTERMed ``python -m fl_split.cli
    party-runtime`` exited -2, not 143). In CPython 3.11 a KeyboardInterrupt that leaves an ``exec``
    of a string marks the process as ended by an unhandled KeyboardInterrupt, even when it is
    caught; a program run with ``-m`` then ends by killing itself with SIGINT, whatever it passed
    to ``sys.exit``. The gate records the signal there instead of raising."""
    (tmp_path / "signal_in_exec.py").write_text(_SIGNAL_IN_EXEC)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run = lambda mode: subprocess.run([sys.executable, "-m", "signal_in_exec", mode], timeout=120,  # noqa: E731
                                      capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])
    assert run("gate").returncode == 128 + signal.SIGTERM
    if sys.version_info[:2] == (3, 11):  # the interpreter behaviour the gate works around (the control)
        assert run("naive").returncode == -signal.SIGINT


@pytest.mark.slow
def test_sigterm_while_the_runtime_starts_ends_both_with_143(tmp_path):
    """SIGTERM as soon as the runtime names its SuperNode (it is still waiting for the Runtime API
    or importing the party's code): 143, and the node ends too."""
    proc, log = _launch(tmp_path)
    node = None
    try:
        deadline = time.monotonic() + 300
        while "SuperNode pid " not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.02)
        node = int(log.read_text().split("SuperNode pid ", 1)[1].split()[0])
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text(errors="replace")[-2000:]
        assert _gone_within(node, 30), log.read_text(errors="replace")[-2000:]
    finally:
        if node is None:
            proc.kill()
            proc.wait(timeout=30)
        else:
            _cleanup(proc, node)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _secret_path(pid: int) -> str:
    args = _cmdline(pid)
    return args[args.index("--superexec-auth-secret-file") + 1]


def _alive(pid: int) -> bool:
    state = process_table().get(pid)
    return state is not None and state[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _cleanup(proc: subprocess.Popen, pid: int) -> None:
    for p in (proc.pid, pid):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    proc.wait(timeout=30)


@pytest.mark.slow
def test_supernode_dies_with_its_runtime_even_on_sigkill(tmp_path):
    proc, node, _ = _start(tmp_path)
    try:
        assert _alive(node)
        assert "--isolation" in _cmdline(node) and "process" in _cmdline(node)
        os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the kernel's parent-death signal ends the node
        proc.wait(timeout=30)
        assert _gone_within(node, 30), "the SuperNode outlived its SIGKILLed runtime"
    finally:
        _cleanup(proc, node)


@pytest.mark.slow
def test_sigterm_ends_both_and_a_dead_supernode_ends_the_runtime(tmp_path):
    proc, node, log = _start(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text(errors="replace")[-2000:]
        assert _gone_within(node, 30), log.read_text(errors="replace")[-2000:]
    finally:
        _cleanup(proc, node)
    (tmp_path / "second").mkdir()
    proc, node, log = _start(tmp_path / "second")
    try:
        os.kill(node, signal.SIGKILL)  # the node goes first: its runtime has nothing to serve
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL, log.read_text(errors="replace")[-2000:]
        assert "the SuperNode exited with code 137; 0 messages served" in log.read_text()
    finally:
        _cleanup(proc, node)


# -- kill -9 of one party's runtime mid-epoch, then --resume (issue 25 item 6) ---------------------------
PS_HEX = "8b4d28389d613dd1041cf2977b03872c"
# --limit 600: epoch 2 lasts long enough for the kill to land inside it on a loaded machine
KILL_ARGS = ["--dataset", "digits", "--guests", "2", "--epochs", "2", "--limit", "600", "--seed", "3",
             "--defense", "gaussian", "--no-progress"]


@pytest.mark.slow
def test_deployment_with_a_sigkilled_party_stops_in_one_line_and_resumes(tmp_path):
    """A guest's runtime (its party, warm) is SIGKILLed in epoch 2 of a loopback deployment — inside
    the run's one control message, after every party checkpointed epoch 1 and before the coordinator
    committed anything: the deployment stops with one line naming that party's process and leaves
    nothing running; the same command with ``--resume`` resumes after epoch 1 (the newest round every
    party holds), completes, epoch 1 equals the local engine's, and every
    party's ledger holds exactly the local engine's releases and ε — the releases made in the killed
    epoch were charged by the write-ahead log and re-made after it with a fresh resume salt (no noise
    repeated; the resumed epoch 2 is therefore other noise and not compared)."""
    from fl_split.checkpoint import load_coordinator, party_checkpoints
    from tests.services import pids_with_env

    seed = tmp_path / "private-seed"
    seed.write_text(PS_HEX + "\n")
    seed.chmod(0o600)
    workdir, ckpt = tmp_path / "dep", tmp_path / "ckpt"
    cmd = [*FLSPLIT, "deploy", "local", "--insecure", *KILL_ARGS, "--private-seed-file", str(seed),
           "--checkpoint-dir", str(ckpt), "--workdir", str(workdir)]
    log = tmp_path / "first.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    wal = ckpt / "guest-1" / "guest-1.wal"
    runtime = committed = epoch1 = None
    deadline = time.monotonic() + 900
    try:
        # one train.epoch message covers both epochs (--epochs-per-message auto in a deployment), so the
        # coordinator commits nothing before the run ends; guest-1 checkpoints epoch 1's end inside it
        while time.monotonic() < deadline:  # epoch 1 checkpointed by guest-1, then epoch 2's releases logged
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                rounds = [r for r in party_checkpoints(ckpt / "guest-1", "guest-1") if r > 0]
                if committed is None and rounds:
                    epoch1, committed = rounds[0], wal.stat().st_size
            except OSError:  # not written yet
                pass
            if committed is not None and wal.stat().st_size > committed:
                text = (workdir / "logs" / "supernode-guest-1.log").read_text(errors="replace")
                runtime = int(text.split("party-runtime: pid ", 1)[1].split()[0])
                os.kill(runtime, signal.SIGKILL)  # the crash of guest-1's party: no handler runs
                break
            time.sleep(0.05)
        else:
            pytest.fail("the deployment never reached epoch 2")
        assert proc.wait(timeout=300) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text(errors="replace")
    failed = [line for line in out.splitlines() if line.startswith("fl-split: failed:")]
    assert len(failed) == 1 and "supernode-guest-1 exited with code -9" in failed[0], out[-3000:]
    assert pids_with_env(f"FLWR_HOME={workdir.resolve() / 'flwr-home'}".encode()) == []

    assert load_coordinator(ckpt / "coordinator").round == 0  # only the set-up was committed

    out_path = tmp_path / "resumed.json"
    resumed = subprocess.run(cmd + ["--resume", "--out", str(out_path)], capture_output=True, text=True,
                             timeout=1200, start_new_session=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    res = json.loads(out_path.read_text())
    assert [h["epoch"] for h in res["history"]] == [1, 2]
    from fl_split.cli import build_parser, config_from_args
    from fl_split.engine import run_experiment
    from fl_split.seeding import PrivateSeed

    local = run_experiment(config_from_args(build_parser().parse_args(["train", *KILL_ARGS])),
                           private_seed=PrivateSeed.parse(PS_HEX))
    # the newest round every party checkpointed (the parties' answers to query.checkpoints)
    assert res["checkpoint"]["resumed_from_round"] == epoch1 > 0  # the checkpoint of epoch 1
    assert "resuming after epoch 1" in resumed.stdout + resumed.stderr
    assert res["history"][0]["test_metric"] == local["history"][0]["test_metric"]
    assert res["history"][0]["train_loss"] == pytest.approx(local["history"][0]["train_loss"], rel=1e-6)
    for party, rep in local["privacy"].items():
        assert res["privacy"][party]["epsilon"] == rep["epsilon"]
        assert res["privacy"][party]["releases"] == rep["releases"]
