"""``fl-split certs`` and ``fl-split deploy local``: a real loopback deployment (a SuperLink and one
SuperNode per party as separate processes, TLS, SuperNode authentication, the direct data plane over
TLS), its results against the local engine's, a ServerApp that fails, an interrupted deployment —
and after each, no process it started is left.

A process belongs to a deployment when its environment has ``FLWR_HOME=<workdir>/flwr-home``:
every process ``fl-split deploy`` starts, and everything they start, inherits it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_split.config import RunConfig
from tests.services import pids_with_env

FLSPLIT = [sys.executable, "-m", "fl_split.cli"]
SMALL = ["--dataset", "digits", "--guests", "2", "--epochs", "1", "--limit", "150", "--seed", "3",
         "--defense", "gaussian", "--batch-size", "32"]


def _deployment_pids(workdir: Path) -> list[int]:
    return pids_with_env(f"FLWR_HOME={workdir.resolve() / 'flwr-home'}".encode())


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_free_ports_are_below_the_ephemeral_range_and_free(monkeypatch):
    """A deployment's server ports come from below the range outgoing connections draw their local
    ports from (a client could take a port there before its server binds it), and are free; a port
    taken by a listener is never handed out."""
    import socket

    import fl_split.deploy as D

    lo, hi = D.ephemeral_ports()
    assert 1024 < lo < hi
    ports = {D.free_port() for _ in range(20)}
    assert all(D.PORTS_FROM <= p < lo - 3000 for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        other = D.free_port()
        picks = iter([busy, busy, other])  # the random picks: the listener's port twice, then a free one
        import random

        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert D.free_port() == other


def test_certs_command_writes_ca_certificates_and_node_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    out = subprocess.run([*FLSPLIT, "certs", "--out", str(tmp_path), "--hosts", "link.example.org", "10.0.0.5",
                          "--node-keys", "host", "guest-1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    for name in ("superlink", "dataplane-host"):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{name}.crt").read_bytes())
        assert cert.issuer == ca.subject
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        # the data plane's certificate names the party ``host`` (what guests require), then the hosts;
        # the SuperLink's the hosts and loopback (the SuperExec Flower launches beside it dials 127.0.0.1)
        loop = name == "superlink"
        assert san.get_values_for_type(x509.DNSName) == ["host"] * (name == "dataplane-host") + [
            "link.example.org"] + ["localhost"] * loop
        assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"] + ["127.0.0.1", "::1"] * loop
        assert (tmp_path / f"{name}.key").stat().st_mode & 0o077 == 0
    for party in ("host", "guest-1"):
        key = load_ssh_private_key((tmp_path / f"auth-{party}.key").read_bytes(), None)
        pub = load_ssh_public_key((tmp_path / f"auth-{party}.pub").read_bytes())
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert pub.public_numbers() == key.public_key().public_numbers()
        assert (tmp_path / f"auth-{party}.key").stat().st_mode & 0o077 == 0


def test_deploy_refuses_local_engine_options(tmp_path):
    out = subprocess.run([*FLSPLIT, "deploy", "local", *SMALL, "--engine", "local", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "engine" in out.stderr


def test_a_run_flower_refuses_is_named_by_its_words_not_the_box_around_them():
    """``flwr run`` prints a refused run inside a box; the one-line failure keeps the box's words (a
    run-config key Flower does not know once read "… without starting a run (╰───╯)")."""
    from fl_split.deploy import stream_words

    box = ["╭─ Error ─────╮", "│ [code: 15] Invalid run configuration.   │", "╰─────────────╯"]
    assert [stream_words(line) for line in box] == ["Error", "[code: 15] Invalid run configuration.", ""]


def test_deploy_local_follows_the_hosts_epoch_lines_as_its_log_grows(tmp_path):
    """One control message covers a deployment's whole run, so the coordinator hears of its epochs
    when it ends; ``deploy local`` shows each epoch as the host writes it to its own log: only the
    lines written after the run was submitted, only the host's epoch lines, and a line only once it
    is complete."""
    from fl_split.deploy import FollowLog
    from fl_split.flower.direct import HOST_EPOCH, epoch_line

    log = tmp_path / "supernode-host.log"
    log.write_text(f"{HOST_EPOCH}epoch 1: an earlier run's line\n")
    follow = FollowLog(log, HOST_EPOCH)
    line = HOST_EPOCH + epoch_line({"epoch": 1, "train_loss": 0.5, "test_metric": 0.75, "epoch_time_s": 0.6}, "accuracy")
    with open(log, "a") as fh:
        fh.write("INFO: party-runtime: message 3 (train.epoch)\n" + line[:10])
    assert follow.lines() == []
    with open(log, "a") as fh:
        fh.write(line[10:] + "\n")
    assert follow.lines() == ["host: epoch 1: train loss 0.5000, test accuracy 0.7500 (0.60 s)"]
    assert follow.lines() == []


def test_epochs_per_message_auto_is_the_whole_run_in_a_deployment_only():
    from fl_split.flower import records as R
    from fl_split.flower.direct import epochs_per_message

    class Nodes:
        def __init__(self, mode):
            self.role_replies = {p: {"role": R.dumps({"party": p, "mode": mode})} for p in ("host", "guest-1")}

    cfg = RunConfig(engine="flower", epochs=4)
    assert cfg.epochs_per_message == "auto"
    assert epochs_per_message(cfg, Nodes("deployment")) == 4
    assert epochs_per_message(cfg, Nodes("simulation")) == 1
    assert epochs_per_message(cfg.replace(epochs_per_message=2), Nodes("deployment")) == 2
    with pytest.raises(Exception, match=r"epochs-per-message.*'auto' or an integer >= 1"):
        RunConfig(engine="flower", epochs_per_message=0)


def test_the_staged_app_builds_the_checkouts_fab(tmp_path):
    """``flwr run`` gets a copy of the app holding the files of its FAB (flwr 1.41 walks every file of
    the directory it is given, the checkout's .venv and .git included, before it filters): Flower
    builds the very same FAB from the copy, byte for byte."""
    from flwr.cli.build import build_fab_from_disk

    from fl_split.deploy import find_app_dir, staged_app

    staged = staged_app(tmp_path / "app")
    assert build_fab_from_disk(staged) == build_fab_from_disk(find_app_dir())
    assert (staged / "fl_split" / "deploy.py").exists() and not (staged / ".git").exists()
    assert staged_app(tmp_path / "app") == staged  # staged again over the last copy


@pytest.mark.parametrize("reinclude", [False, True])
def test_the_staged_app_skips_ignored_directories_unless_a_pattern_reincludes(tmp_path, reinclude):
    """A directory .gitignore ignores is not walked, unless a ``!`` pattern could re-include a file in it
    (Flower's filter honours it): the copy's FAB equals Flower's either way."""
    from flwr.cli.build import build_fab_from_disk

    from fl_split.deploy import find_app_dir, staged_app

    app = tmp_path / "src"  # a small app with this project's pyproject (its fab-include patterns)
    for rel in ("fl_split/__init__.py", "fl_split/scratch/keep.py", "strategies/server_app.py",
                "clients/client_app.py", "README.md"):
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text("x = 1\n")
    (app / "pyproject.toml").write_bytes((find_app_dir() / "pyproject.toml").read_bytes())
    (app / ".gitignore").write_text("scratch/\n" + ("!fl_split/scratch/keep.py\n" if reinclude else ""))
    staged = staged_app(tmp_path / "app", app)
    assert (staged / "fl_split" / "scratch" / "keep.py").exists() == reinclude
    assert (staged / "clients" / "client_app.py").exists()
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)


@pytest.mark.slow
def test_loopback_tls_deployment_with_two_guests(tls_deployment):
    """The whole path as separate processes, TLS and SuperNode authentication (the session's shared
    run, tests/shared_runs.py; tests/test_adversary_secrets.py checks what it exposed); same final
    metric as the local engine with the same public and private seeds (each node a seed file of its
    own, the run config none); every process gone afterwards. (An ``--insecure-private-seed``
    deployment: tests/test_own_data.py.)"""
    run = tls_deployment
    workdir = run.workdir
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.left == [], f"processes left running: {run.left}"
    results = json.loads(run.out_path.read_text())
    dep = results["deployment"]
    assert dep["tls"] and dep["node_auth"]
    assert (workdir / "certs" / "guest-1.crt").exists()  # the host's data plane required client certificates
    assert set(results["privacy"]) == {"host", "guest-1", "guest-2"}
    for guest in ("guest-1", "guest-2"):
        assert results["privacy"][guest]["epsilon"] > 0
    assert results["final"]["metric"] == "accuracy" and results["final"]["value"] is not None
    assert "guest-1" in run.stdout and "final test accuracy" in run.stdout
    # the run went through the SuperLink with TLS; the private seed stayed in the node configs
    assert "https://127.0.0.1" in (workdir / "logs" / "superlink.log").read_text()
    assert "private-seed" not in (workdir / "run-config.toml").read_text()
    # the warm party (fl_split/flower/warm.py): one process per party served every message, no
    # flwr-clientapp process was started (the SuperNodes ran with --isolation process)
    for party in ("host", "guest-1", "guest-2"):
        log = (workdir / "logs" / f"supernode-{party}.log").read_text(errors="replace")
        assert log.count("party-runtime: pid ") == 1, log[-2000:]
        served = [line.split("(", 1)[1].split(")")[0] for line in log.splitlines()
                  if line.startswith("party-runtime: message ")]
        assert served == ["query.role", "query.setup", "train.epoch", "query.report"], served
        assert "flwr-clientapp" not in log
    assert {r["private_randomness"] for r in results["privacy"].values()} == {"private-seed"}
    # the local engine, same options and seeds, in this process
    from fl_split.cli import build_parser, config_from_args
    from fl_split.engine import run_experiment

    cfg = config_from_args(build_parser().parse_args(["train", *SMALL]))
    local = run_experiment(cfg, private_seed=run.seed)
    assert results["final"]["value"] == local["final"]["value"]
    assert results["final"]["train_loss"] == pytest.approx(local["final"]["train_loss"], rel=1e-6)
    for party, rep in local["privacy"].items():
        assert results["privacy"][party]["epsilon"] == rep["epsilon"]


@pytest.mark.slow
def test_deploy_command_exits_nonzero_with_one_line_when_the_serverapp_fails(tmp_path):
    """A flag the ServerApp refuses (pad on the relay data plane): exit 1, one line (read from the
    SuperLink: ``flwr run`` exits 0), nothing left. (A ServerApp that fails at set-up because the
    party files were exported with other options — a separate loopback deployment until 2026-11-27 —
    is checked in process: ``test_flower.py::test_inline_deployment_setup_errors``.)"""
    workdir = tmp_path / "dep"
    proc = subprocess.run([*FLSPLIT, "deploy", "local", "--insecure", *SMALL, "--data-plane", "flower",
                           "--on-guest-failure", "pad",
                           "--workdir", str(workdir)], capture_output=True, text=True, timeout=600)
    left = _deployment_pids(workdir)
    _kill(left)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [line for line in proc.stderr.splitlines() if line.startswith("fl-split: failed:")]
    assert len(failed) == 1 and "on-guest-failure" in failed[0] and "ServerApp failed" in failed[0], proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        line for line in proc.stderr.splitlines() if line.startswith("fl-split: ")]
    assert left == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_deployment_ends_every_process(tmp_path, sig):
    """SIGINT (Ctrl-C) or SIGTERM while the SuperNodes run: exit 130, nothing left."""
    workdir = tmp_path / "dep"
    # started with SIGINT ignored, as a background job of a non-interactive shell is: Ctrl-C must
    # still end the deployment
    proc = subprocess.Popen([*FLSPLIT, "deploy", "local", "--insecure", *SMALL, "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 300
        while not (workdir / "logs" / "supernode-guest-2.log").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        time.sleep(2)
        assert _deployment_pids(workdir), "nothing was running"
        proc.send_signal(sig)
        try:
            # teardown is bounded (3 × (10 s grace + 5 s)); the rest is slack for a loaded machine
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the CLI dumps every thread's stack to stderr
            time.sleep(3)
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"fl-split deploy did not exit within 240 s of the signal; its threads:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    left = _deployment_pids(workdir)
    _kill(left)
    assert proc.returncode == 130, err
    assert "warning: --insecure" in err
    assert left == []


@pytest.mark.slow
def test_supernode_with_an_unregistered_key_is_refused(tmp_path):
    """SuperNode authentication: the SuperLink refuses a node whose public key nobody registered,
    and the deployment names the node that exited."""
    from fl_split.deploy import DeploymentError, LocalDeployment

    cfg = RunConfig(dataset="digits", guests=1, limit=100, engine="flower")
    dep = LocalDeployment(cfg, tmp_path / "dep", tls=True, echo=lambda line: None)
    try:
        dep.prepare()
        dep.start_superlink()
        registered = dep._flwr("supernode", "register", str(dep.certs / "auth-host.pub"), dep.connection)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        dep.start_supernodes()
        deadline = time.monotonic() + 180
        while not dep.group.exited() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [name for name, _ in dep.group.exited()] == ["supernode-guest-1"]
        with pytest.raises(DeploymentError, match="supernode-guest-1 exited"):
            dep._check_alive()
        link_log = (dep.group.log_dir / "superlink.log").read_text(errors="replace")
        assert "No SuperNode found with the given public key" in link_log
    finally:
        dep.stop()
    assert _deployment_pids(tmp_path / "dep") == []
