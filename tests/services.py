"""Start and stop *our own* background services for the tests and benchmarks: a loopback Ray
cluster, a Flower SuperLink.

Ray daemons and Flower's SuperLink outlive the command that started them (DESIGN "Cleaning up").
Everything here is started in a **new session** (``start_new_session=True``) with its own temporary
directory and ports, and stopped by ending exactly the processes of that session: SIGTERM, then
SIGKILL after a grace period (``gcs_server`` may ignore SIGTERM). Nothing is ever killed by name
and ``ray stop`` is never used: it would end every Ray process of the user, not just ours.

``docs/flower.md`` shows the equivalent shell commands.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fl_split.flower.processes import descendants, pids_with_env, process_table

__all__ = ["FlwrRunHome", "pids_with_env", "LocalSuperLink", "LoopbackRayCluster", "descendants", "free_port", "process_table", "session_pids",
           "stop_session"]


def _ephemeral_low() -> int:
    """The lowest port the OS hands out for ``bind(0)`` (Linux: ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def session_pids(sid: int) -> list[int]:
    """Every live process whose session ID is ``sid``."""
    return [pid for pid, (state, _, s, _) in process_table().items() if s == sid and state != "Z"]


def stop_session(sid: int, grace: float = 10.0) -> list[int]:
    """End every process of session ``sid``: SIGTERM, wait up to ``grace`` s, then SIGKILL.

    Returns the PIDs that were signalled."""
    targets = session_pids(sid)
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and session_pids(sid):
        time.sleep(0.1)
    for pid in session_pids(sid):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and session_pids(sid):
        time.sleep(0.05)
    return targets


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _bin(name: str) -> str:
    """An executable of this Python environment (``ray``, ``flower-superlink`` …)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


class _Service:
    """Processes started in their own sessions, stopped together."""

    def __init__(self, prefix: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: Ray's socket paths are limited
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / log_name, "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env or os.environ.copy(), cwd=self.tmp)
        log.close()
        self.procs.append(p)
        return p

    @property
    def sessions(self) -> list[int]:
        return [p.pid for p in self.procs]  # a session leader's PID is its session ID

    def stop(self, grace: float = 10.0) -> list[int]:
        """End exactly the processes of our sessions; returns the PIDs signalled."""
        signalled: list[int] = []
        for p in reversed(self.procs):
            signalled += stop_session(p.pid, grace)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return signalled

    def log(self, name: str) -> str:
        path = self.tmp / name
        return path.read_text(errors="replace") if path.exists() else ""

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


class LoopbackRayCluster(_Service):
    """A Ray head and ``workers`` worker nodes on 127.0.0.1, each with ``cpus_per_node`` CPUs.

    Equivalent to ``ray start --head …`` / ``ray start --address=HEAD …`` on one machine with
    private ports and a private ``--temp-dir``; :attr:`address` is what ``--ray-address`` takes.
    """

    def __init__(self, workers: int = 1, cpus_per_node: int = 1, timeout: float = 120.0) -> None:
        super().__init__("flray")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes = 1 + workers
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        self.env.pop("RAY_ADDRESS", None)
        try:
            self._spawn([_bin("ray"), "start", "--head", "--block", "--port", str(self.port),
                         "--ray-client-server-port", str(free_port()), "--include-dashboard", "false",
                         *self._node_args(cpus_per_node, 0)],
                        "head.log", self.env)
            self._wait_gcs(timeout)
            for i in range(workers):
                self._spawn([_bin("ray"), "start", "--block", "--address", self.address,
                             *self._node_args(cpus_per_node, i + 1)], f"worker-{i + 1}.log", self.env)
            self._wait_nodes(timeout)
        except BaseException:
            self.stop()
            raise

    def _node_args(self, cpus: int, index: int) -> list[str]:
        # a private worker-port range per node, below the OS's ephemeral range: the other ports come
        # from free_port(), i.e. from that range, and once fell inside a node's worker ports (Ray
        # then refused to start: "worker_ports is trying to use a port number … used by other
        # components")
        low = _ephemeral_low() - 3000 + (os.getpid() % 40) * 60 + index * 20
        return ["--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus), "--num-gpus", "0",
                "--disable-usage-stats", "--temp-dir", str(self.tmp),
                "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
                "--min-worker-port", str(low), "--max-worker-port", str(low + 19)]

    def _wait_gcs(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.procs[0].poll() is not None:
                raise RuntimeError(f"ray head exited with code {self.procs[0].returncode}:\n{self.log('head.log')[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"the Ray head did not open {self.address} within {timeout:g} s")

    def _wait_nodes(self, timeout: float) -> None:
        """Wait until every node is alive (asked from a short-lived driver process)."""
        probe = ("import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + timeout
        alive = 0
        while time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-c", probe, self.address], capture_output=True, text=True,
                                 env=self.env, timeout=timeout)
            lines = out.stdout.strip().splitlines()
            alive = int(lines[-1]) if lines and lines[-1].isdigit() else 0
            if alive >= self.nodes:
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a ray node exited with code {p.returncode}")
            time.sleep(1.0)
        raise TimeoutError(f"{alive} of {self.nodes} Ray nodes alive after {timeout:g} s")


class LocalSuperLink(_Service):
    """A Flower SuperLink in simulation mode on private ports, with a private ``FLWR_HOME`` whose
    ``config.toml`` makes it the default connection — ``flwr run .`` then uses it (and starts no
    other SuperLink). :attr:`env` is the environment to run ``flwr`` with."""

    def __init__(self, timeout: float = 60.0) -> None:
        super().__init__("flwrhome")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        (self.tmp / "config.toml").write_text(
            f'[superlink]\ndefault = "fl-split-test"\n\n[superlink.fl-split-test]\n'
            f'address = "{self.address}"\ninsecure = true\n', encoding="utf-8")
        bindir = str(Path(sys.executable).parent)
        self.env = dict(os.environ, FLWR_HOME=str(self.tmp), FLWR_TELEMETRY_ENABLED="0",
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", RAY_USAGE_STATS_ENABLED="0",
                        PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        try:
            self._spawn([_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
                         "--host", "127.0.0.1", "--port", str(self.port), "--database", str(self.tmp / "state.db"),
                         "--disable-runtime-dependency-installation", "--log-file", str(self.tmp / "superlink.log")],
                        "superlink.out", self.env)
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{self.address}/health", timeout=0.5).is_success:
                    return
            except httpx.HTTPError:
                pass
            if self.procs[0].poll() is not None:
                raise RuntimeError(f"flower-superlink exited with code {self.procs[0].returncode}:\n"
                                   f"{self.log('superlink.out')[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"flower-superlink did not answer on {self.address} within {timeout:g} s")

    def stop(self, grace: float = 10.0) -> list[int]:
        # flower-superexec starts its own session (it exits when its parent SuperLink dies);
        # end it explicitly if it is a child of our SuperLink
        extra = [pid for p in self.procs for pid in _children_sessions(p.pid)]
        signalled = super().stop(grace)
        for sid in extra:
            signalled += stop_session(sid, grace)
        return signalled


def _children_sessions(ppid: int) -> list[int]:
    """Session IDs of direct children of ``ppid`` that lead their own session."""
    return [pid for pid, (_, parent, sid, _) in process_table().items() if parent == ppid and sid == pid]


class FlwrRunHome(_Service):
    """A private home for the SuperLink that ``flwr run .`` starts *itself* (the ``local`` connection
    of Flower's default ``config.toml``): ``HOME`` and ``FLWR_HOME`` in a temporary directory, its
    HTTP and Control API on ports the OS picks (``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``,
    ``FLWR_LOCAL_CONTROL_API_PORT``, flwr 1.41). ``flwr run`` detaches that SuperLink (a session of
    its own) and leaves it running; :meth:`stop` ends exactly the sessions of the SuperLink listening
    on our port and of the SuperExec it started — found by that port in their command lines."""

    def __init__(self) -> None:
        super().__init__("flwrrun")
        self.port, self.control_port = free_port(), free_port()
        bindir = str(Path(sys.executable).parent)
        self.env = dict(os.environ, HOME=str(self.tmp), FLWR_HOME=str(self.tmp / ".flwr"),
                        FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0",
                        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(self.port),
                        FLWR_LOCAL_CONTROL_API_PORT=str(self.control_port),
                        PATH=bindir + os.pathsep + os.environ.get("PATH", ""))

    def ours(self) -> list[int]:
        """Session IDs of the processes serving or using our SuperLink's port."""
        marks = (f" --port {self.port} ", f" 127.0.0.1:{self.port} ")  # the SuperLink's; the SuperExec's
        return sorted({sid for _, (state, _, sid, cmd) in process_table(cmdline=True).items()
                       if state != "Z" and "flower-super" in cmd and any(m in cmd + " " for m in marks)})

    def stop(self, grace: float = 10.0) -> list[int]:
        signalled: list[int] = []
        for sid in self.ours():
            signalled += stop_session(sid, grace)
        return signalled


