"""The kits across machines: four organisations in four Linux network namespaces on one bridge.

Each organisation (coordinator 10.77.0.1, host 10.77.0.2, guest-1 10.77.0.3, guest-2 10.77.0.4)
has its own network stack and its own copy of its kit; the SuperLink is reached by a DNS name
(``link.fl-split.test``, mapped in each namespace's ``/etc/netns/NS/hosts``), the host's data plane
by IP. The kits are written in one place and copied to one folder per organisation; every step is
that organisation's ``sh run.sh STEP`` run inside its namespace (``ip netns exec``), and only the
files of :data:`fl_split.kit.SENDS` move between the folders. The whole lifecycle runs from the kits
without a hand edit: train and save, a party killed and rejoined, a run interrupted by a killed party
and resumed, a predict on new rows. docs/deploy.md, "Across machines" and "After the first run".

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

import numpy as np
import pandas as pd
import pytest

from fl_split.kit import COORDINATOR, deliver, update_kit

PARTIES = ["host", "guest-1", "guest-2"]
ORGS = [COORDINATOR] + PARTIES
ADDRESS = {COORDINATOR: "10.77.0.1", "host": "10.77.0.2", "guest-1": "10.77.0.3", "guest-2": "10.77.0.4"}
LINK_NAME = "link.fl-split.test"
EPOCHS = 6
#: the job: each organisation's own raw table (breast-cancer's columns, partly overlapping IDs), aligned by PSI;
#: one Flower message per epoch, so that a party killed after its first epoch interrupts the training itself
JOB = ["--epochs", str(EPOCHS), "--seed", "3", "--defense", "gaussian", "--batch-size", "32", "--align", "psi",
       "--id-column", "ID", "--label-column", "Y", "--node-timeout", "60", "--epochs-per-message", "1"]
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


def _wait_for(path: Path, text: str, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() - t0 < timeout, f"{what}: no {text!r} after {timeout} s\n" + \
            path.read_text(errors="replace")[-2000:]
        time.sleep(0.5)
    return time.monotonic() - t0


@pytest.mark.slow
def test_kits_across_network_namespaces(tmp_path):
    """Four organisations, four network stacks: ``init`` everywhere (fingerprints printed), the public
    files exchanged, the host ``sign``s, the coordinator ``start``s its SuperLink on 0.0.0.0 (named by
    DNS) and ``register``s, every party ``start``s its SuperNode on its own table, and then, with no
    file edited: ``run --save-model`` completes (PSI, gaussian) and each party saved its part; guest-2's
    machine loses power and its ``start`` rejoins; a new ``run`` is interrupted by killing guest-2 after
    its first epoch (the run fails, and each operator is told), guest-2 starts again and ``run --resume``
    completes the interrupted run from its checkpoints; ``predict`` scores every party's new rows and the
    host's predictions join back on its own ID column. Each party's log shows its epochs, its own ε
    and how each run ended."""
    from cryptography import x509

    from tests.test_own_data import write_party_tables

    env = dict(os.environ, PYTHON=sys.executable, FLWR_TELEMETRY_ENABLED="0")
    env.pop("FLWR_HOME", None)
    tables = tmp_path / "tables"
    tables.mkdir()
    all_ids = np.sort(pd.read_csv(write_party_tables(tables)["host"]).ID.to_numpy())
    keep = {p: all_ids[all_ids % k != 0] for p, k in (("host", 13), ("guest-1", 7), ("guest-2", 11))}
    paths = write_party_tables(tables, keep=keep)
    gen = tmp_path / "written-here"
    out = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "kit", "--out", str(gen),
                          "--parties", ",".join(PARTIES), *JOB, "--data", ";".join(f"{p}={v}" for p, v in paths.items()),
                          "--superlink", f"{LINK_NAME}:9093", "--dataplane", f"{ADDRESS['host']}:9300"],
                         capture_output=True, text=True, timeout=120)
    _ok(out, "deploy kit")
    orgs = tmp_path / "orgs"  # each organisation's machine: its own copy of its own kit
    for org in ORGS:
        shutil.copytree(gen / org, orgs / org)
    kits = {org: orgs / org for org in ORGS}
    new_ids = np.concatenate([all_ids[::9], [10 ** 9 + 7]])  # new rows: some known IDs, and one only the host has
    for party in PARTIES:  # each organisation's own table and new rows, in its own folder
        frame = pd.read_csv(paths[party])
        frame.to_csv(kits[party] / "mine.csv", index=False)
        extra = frame.iloc[:1].assign(ID=10 ** 9 + 7) if party == "host" else frame.iloc[:0]  # the host's alone
        pd.concat([frame[frame.ID.isin(new_ids)], extra]).to_csv(kits[party] / "new-rows.csv", index=False)
        update_kit(kits[party], data_path="mine.csv")  # the one edit README.txt asks for (step 0)
    sh = ["/bin/sh", "run.sh"]
    logs = tmp_path / "logs"
    logs.mkdir()
    timings = {}
    with Network() as net:
        for org in ORGS:
            said = _ok(net.run(org, [*sh, "init"], kits[org], env), f"{org} init")
            assert "fingerprint outbox/" in said, said
        deliver(orgs, PARTIES)
        _ok(net.run("host", [*sh, "sign"], kits["host"], env), "host sign")
        deliver(orgs, PARTIES)
        cert = x509.load_pem_x509_certificate((kits[COORDINATOR] / "keys" / "superlink.crt").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert LINK_NAME in san.get_values_for_type(x509.DNSName)
        assert "127.0.0.1" in [str(a) for a in san.get_values_for_type(x509.IPAddress)]

        net.spawn(COORDINATOR, [*sh, "start"], kits[COORDINATOR], logs / "superlink.log", env)
        _wait_listening(net, "host", LINK_NAME, 9093, env)
        _ok(net.run(COORDINATOR, [*sh, "register"], kits[COORDINATOR], env), "register")
        for party in PARTIES:
            net.spawn(party, [*sh, "start"], kits[party], logs / f"{party}.log", env)
        results = kits[COORDINATOR] / "results.json"

        # 1. train and save: every party's own part in its own kit
        t0 = time.monotonic()
        run = _ok(net.run(COORDINATOR, [*sh, "run", "--save-model"], kits[COORDINATOR], env, timeout=900), "run")
        timings["first run"] = time.monotonic() - t0
        assert "completed" in run, run[-2000:]
        first = json.loads(results.read_text())
        assert first["final"]["value"] > 0.6 and len(first["history"]) == EPOCHS
        for party in PARTIES:
            assert (kits[party] / "model" / party).is_dir(), party

        # 2. guest-2's machine loses power; its operator starts it again: it rejoins
        def restart_guest2(name: str) -> float:
            net.kill_all("guest-2")
            time.sleep(1)
            net.spawn("guest-2", [*sh, "start"], kits["guest-2"], logs / f"{name}.log", env)
            return _wait_for(logs / f"{name}.log", "SuperNode ID:", 60, name)

        timings["rejoin"] = restart_guest2("guest-2-again")
        assert timings["rejoin"] < 45, f"guest-2 rejoined after {timings['rejoin']:.0f} s"

        # 3. a new run, interrupted: guest-2 killed after serving its first epoch; the run fails
        results.unlink()
        runner = net.spawn(COORDINATOR, [*sh, "run"], kits[COORDINATOR], logs / "interrupted.log", env)
        _wait_for(logs / "guest-2-again.log", f"guest-2: epoch 1/{EPOCHS} served", 300, "guest-2 epoch 1")
        timings["rejoin 2"] = restart_guest2("guest-2-third")
        assert runner.wait(timeout=300) != 0, (logs / "interrupted.log").read_text(errors="replace")[-2000:]
        assert not results.exists()
        stopped = (logs / "interrupted.log").read_text(errors="replace")
        assert " failed" in stopped or " stopped" in stopped, stopped[-2000:]
        assert "N/A" not in stopped.splitlines()[-1], stopped[-2000:]

        # 4. resume it from every party's checkpoints: the same run's epochs, completed
        t0 = time.monotonic()
        run = _ok(net.run(COORDINATOR, [*sh, "run", "--resume"], kits[COORDINATOR], env, timeout=900), "resume")
        timings["resume"] = time.monotonic() - t0
        assert "completed" in run, run[-2000:]
        resumed = json.loads(results.read_text())
        assert len(resumed["history"]) == EPOCHS and resumed["final"]["value"] > 0.6
        ck = resumed["checkpoint"]  # it went on from a round inside the training, not from its end
        assert ck["resumed_from_round"] < ck["last_round"], ck
        labels = sorted(p.name for p in (kits[COORDINATOR] / "checkpoints").iterdir())
        assert len(labels) == 2, labels  # the first run's and the interrupted-then-resumed one's
        for party in PARTIES:  # every party: one folder per run, named by the run's identity
            runs = [p.name for p in (kits[party] / "checkpoints").iterdir() if p.is_dir()
                    and len(p.name) == 32 and set(p.name) <= set("0123456789abcdef")]
            assert len(runs) == 2, (party, runs)

        # 5. predict on every party's new rows; the host's predictions join back on its own IDs
        t0 = time.monotonic()
        said = _ok(net.run(COORDINATOR, [*sh, "predict"], kits[COORDINATOR], env, timeout=600), "predict")
        timings["predict"] = time.monotonic() - t0
        shared = set(new_ids)
        for party in PARTIES:
            shared &= set(pd.read_csv(kits[party] / "new-rows.csv").ID)
        summary = json.loads((kits[COORDINATOR] / "predict-summary.json").read_text())
        assert summary["records"] == len(shared) and f"{len(shared)} rows scored" in said, said[-2000:]
        pred = pd.read_csv(kits["host"] / "predictions.csv")
        host_new = pd.read_csv(kits["host"] / "new-rows.csv")
        joined = host_new.merge(pred, on="ID", how="inner", validate="one_to_one")
        assert sorted(joined.ID) == sorted(shared) and 10 ** 9 + 7 not in set(pred.ID)
        assert not (kits[COORDINATOR] / "predictions.csv").exists()  # the predictions stay at the host
        for g in ("guest-1", "guest-2"):
            assert (kits[g] / "model" / g / "inference-ledger.npz").exists(), g
    print("; ".join(f"{k} {v:.0f} s" for k, v in timings.items()))

    for party in PARTIES:  # each operator saw its own runs: its epochs, its own ε, each run's end
        text = "".join((logs / f"{n}.log").read_text(errors="replace") for n in
                       ([party] if party != "guest-2" else ["guest-2", "guest-2-again", "guest-2-third"]))
        if party == "host":
            assert "host: epoch 1: train loss" in text and f"host: epoch {EPOCHS}: train loss" in text, text[-2000:]
        else:
            for e in range(1, EPOCHS + 1):
                assert f"{party}: epoch {e}/{EPOCHS} served; ε " in text, f"{party}: {text[-2000:]}"
        assert f"{party}: run " in text and " completed: ε" in text, f"{party}: {text[-2000:]}"
        if party != "guest-2":  # the interrupted run's end reached the parties still up
            assert " failed" in text or " stopped" in text, f"{party}: {text[-3000:]}"
    assert not (Path("/etc/netns").exists() and list(Path("/etc/netns").glob(f"{TAG}-*")))
