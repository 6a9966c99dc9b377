"""The kits across machines: four organisations in four Linux network namespaces on one bridge.

Each organisation (coordinator 10.77.0.1, host 10.77.0.2, guest-1 10.77.0.3, guest-2 10.77.0.4)
has its own network stack and its own copy of its kit; the SuperLink is reached by a DNS name
(``link.fl-split.test``, mapped in each namespace's ``/etc/netns/NS/hosts``), the host's data plane
by IP. The kits are written in one place and copied to one folder per organisation; every step is
that organisation's ``sh run.sh STEP`` run inside its namespace (``ip netns exec``), and only the
files of :data:`fl_split.kit.SENDS` move between the folders. docs/deploy.md, "Across machines".

Needs root and ``ip netns``; skipped with the reason otherwise. Every namespace, link, hosts file
and process it makes is removed, also on failure.
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

import pytest

from fl_split.kit import COORDINATOR, deliver, update_kit

PARTIES = ["host", "guest-1", "guest-2"]
ORGS = [COORDINATOR] + PARTIES
ADDRESS = {COORDINATOR: "10.77.0.1", "host": "10.77.0.2", "guest-1": "10.77.0.3", "guest-2": "10.77.0.4"}
LINK_NAME = "link.fl-split.test"
SMALL = ["--dataset", "digits", "--guests", "2", "--epochs", "2", "--limit", "150", "--seed", "3",
         "--defense", "gaussian", "--batch-size", "32"]
KIT_FLAGS = [a for i, a in enumerate(SMALL) if "--guests" not in SMALL[max(i - 1, 0):i + 1]]  # --parties says it
TAG = f"fls{os.getpid() % 100000}"


def _netns_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is unavailable"
    return None


pytestmark = pytest.mark.skipif(_netns_unavailable() is not None, reason=_netns_unavailable() or "")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Network:
    """The bridge ``TAG-br`` (no address: nothing of the host's own network is reachable) and one
    namespace per organisation, ``TAG-<org>``, with ``lo`` and one veth on the bridge."""

    def __init__(self) -> None:
        self.bridge, self.namespaces, self.procs = f"{TAG}br", [], []
        self.made_etc_netns = not Path("/etc/netns").exists()

    def ns(self, org: str) -> str:
        return f"{TAG}-{org}"

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, org in enumerate(ORGS):
                ns = self.ns(org)
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
                outer, inner = f"{TAG}v{i}", f"{TAG}n{i}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", ns)
                _ip("-n", ns, "link", "set", inner, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{ADDRESS[org]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                hosts = Path("/etc/netns") / ns / "hosts"  # `ip netns exec` shows it as /etc/hosts
                hosts.parent.mkdir(parents=True, exist_ok=True)
                hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{ADDRESS[COORDINATOR]} {LINK_NAME}\n")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def spawn(self, org: str, argv: list[str], cwd: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log, "ab") as fh:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(org), *argv], cwd=cwd, env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, org: str, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300):
        return subprocess.run(["ip", "netns", "exec", self.ns(org), *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def kill_all(self, org: str) -> None:
        """SIGKILL every process in ``org``'s namespace (what a machine's power cut does)."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(org)], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in list(self.namespaces):
            self.kill_all(ns.removeprefix(f"{TAG}-"))
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.namespaces = []
        if self.made_etc_netns:
            try:
                Path("/etc/netns").rmdir()
            except OSError:
                pass  # not empty: someone else's namespaces have files there now


def _wait_listening(net: Network, org: str, host: str, port: int, env, timeout: float = 90) -> None:
    probe = f"import socket; socket.create_connection(({host!r}, {port}), 2).close()"
    deadline = time.monotonic() + timeout
    while True:
        if net.run(org, [sys.executable, "-c", probe], Path("/"), env, timeout=30).returncode == 0:
            return
        assert time.monotonic() < deadline, f"{host}:{port} not listening from {org} after {timeout} s"
        time.sleep(1)


def _ok(out: subprocess.CompletedProcess, what: str) -> str:
    assert out.returncode == 0, f"{what}: rc {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.mark.slow
def test_kits_across_network_namespaces(tmp_path):
    """Four organisations, four network stacks: ``init`` everywhere, the public files exchanged, the
    host ``sign``s, the coordinator ``start``s its SuperLink on 0.0.0.0 (named by DNS) and
    ``register``s, every party ``start``s its SuperNode, the coordinator ``run``s the job to
    completion; the SuperLink's certificate names the DNS name and 127.0.0.1 (Flower's SuperExec).
    Then guest-2's machine loses power (every process of its namespace SIGKILLed) and its
    ``sh run.sh start`` rejoins, and a second run completes; each party's log shows its epochs, its
    own ε and the run's end."""
    from cryptography import x509

    from fl_split.cli import build_parser, config_from_args
    from fl_split.party_files import export_parties

    env = dict(os.environ, PYTHON=sys.executable, FLWR_TELEMETRY_ENABLED="0")
    env.pop("FLWR_HOME", None)
    gen = tmp_path / "written-here"
    out = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "kit", "--out", str(gen),
                          "--parties", ",".join(PARTIES), *KIT_FLAGS, "--superlink", f"{LINK_NAME}:9093",
                          "--dataplane", f"{ADDRESS['host']}:9300"], capture_output=True, text=True, timeout=120)
    _ok(out, "deploy kit")
    orgs = tmp_path / "orgs"  # each organisation's machine: its own copy of its own kit
    for org in ORGS:
        shutil.copytree(gen / org, orgs / org)
    kits = {org: orgs / org for org in ORGS}
    cfg = config_from_args(build_parser().parse_args(["train", *SMALL]))
    tables = tmp_path / "tables"
    export_parties(cfg, tables, "npz")
    for party in PARTIES:  # each organisation's own table, in its own folder
        shutil.copyfile(tables / f"{party}.npz", kits[party] / f"{party}.npz")
        update_kit(kits[party], data_path=f"{party}.npz")
    sh = ["/bin/sh", "run.sh"]
    with Network() as net:
        for org in ORGS:
            _ok(net.run(org, [*sh, "init"], kits[org], env), f"{org} init")
        deliver(orgs, PARTIES)
        _ok(net.run("host", [*sh, "sign"], kits["host"], env), "host sign")
        deliver(orgs, PARTIES)
        cert = x509.load_pem_x509_certificate((kits[COORDINATOR] / "keys" / "superlink.crt").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert LINK_NAME in san.get_values_for_type(x509.DNSName)
        assert "127.0.0.1" in [str(a) for a in san.get_values_for_type(x509.IPAddress)]

        logs = tmp_path / "logs"
        logs.mkdir()
        net.spawn(COORDINATOR, [*sh, "start"], kits[COORDINATOR], logs / "superlink.log", env)
        _wait_listening(net, "host", LINK_NAME, 9093, env)
        _ok(net.run(COORDINATOR, [*sh, "register"], kits[COORDINATOR], env), "register")
        for party in PARTIES:
            net.spawn(party, [*sh, "start"], kits[party], logs / f"{party}.log", env)
        t0 = time.monotonic()
        run = _ok(net.run(COORDINATOR, [*sh, "run"], kits[COORDINATOR], env, timeout=900), "run")
        first = time.monotonic() - t0
        assert "completed" in run, run[-2000:]
        results = json.loads((kits[COORDINATOR] / "results.json").read_text())
        assert results["final"]["value"] > 0.15 and len(results["history"]) == 2

        # guest-2's machine loses power; its operator starts it again: it rejoins and a run completes
        net.kill_all("guest-2")
        time.sleep(1)
        t1 = time.monotonic()
        net.spawn("guest-2", [*sh, "start"], kits["guest-2"], logs / "guest-2-again.log", env)
        while "SuperNode ID:" not in (logs / "guest-2-again.log").read_text(errors="replace"):
            assert time.monotonic() - t1 < 60, (logs / "guest-2-again.log").read_text(errors="replace")[-2000:]
            time.sleep(0.5)
        rejoin = time.monotonic() - t1
        assert rejoin < 45, f"guest-2 rejoined after {rejoin:.0f} s"
        (kits[COORDINATOR] / "results.json").unlink()
        run = _ok(net.run(COORDINATOR, [*sh, "run"], kits[COORDINATOR], env, timeout=900), "run after rejoin")
        assert "completed" in run, run[-2000:]
        again = json.loads((kits[COORDINATOR] / "results.json").read_text())  # fresh noise: no private seed
        assert len(again["history"]) == 2 and again["final"]["value"] > 0.15
        rejoined = (logs / "guest-2-again.log").read_text(errors="replace")
        print(f"first run {first:.0f} s; rejoin {rejoin:.0f} s; rejoin and second run {time.monotonic() - t1:.0f} s")

    for party in PARTIES:  # each operator saw its own run: its epochs, its own ε, the run's end
        for name in [party] + (["guest-2-again"] if party == "guest-2" else []):
            text = (logs / f"{name}.log").read_text(errors="replace")
            if party == "host":  # its epoch lines (public aggregates), then its own ε (no ledger under --defense gaussian)
                assert "host: epoch 1: train loss" in text and "host: epoch 2: train loss" in text, text[-2000:]
                assert "host: epochs 1-2/2 played; ε" in text, text[-2000:]
            else:
                for e in (1, 2):
                    assert f"{party}: epoch {e}/2 served; ε " in text, f"{name}: {text[-2000:]}"
            assert f"{party}: run " in text and " completed: ε" in text, f"{name}: {text[-2000:]}"
    assert "refused to activate" not in (logs / "guest-2.log").read_text(errors="replace")
    assert not (Path("/etc/netns").exists() and list(Path("/etc/netns").glob(f"{TAG}-*")))
