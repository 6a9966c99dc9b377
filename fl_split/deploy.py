"""``fl-split deploy local``: a real Flower deployment on loopback, one process per organisation.

What it starts, each in a **session of its own** (``start_new_session=True``) so that a Ctrl-C at
the terminal reaches only this command, which then ends them itself:

1. the party files (``fl-split export-parties``): ``WORKDIR/parties/host.npz``, ``guest-1.npz`` … —
   or, with ``--party-files DIR``, the files already in ``DIR`` (exported earlier, e.g. from your own
   tables with ``--data``), each checked against the run before any process starts;
2. with ``--tls``: a CA, the SuperLink's and the host data plane's certificates, a data-plane
   client certificate per guest (the host requires them: mutual TLS) and one SuperNode
   authentication key pair per party (:mod:`fl_split.certs`) in ``WORKDIR/certs``;
3. a SuperLink (``flower-superlink``: TLS, ``--enable-supernode-auth``,
   ``--disable-runtime-dependency-installation``), its state **in memory** (Flower's default): the
   run's messages never reach a disk, and the SuperLink answers each poll without a SQLite
   transaction (``--database FILE`` took twice its CPU: 14–15 s against 7–9 s of a 3-epoch run here,
   on a 2-core machine where every process competes for the same cores);
4. the parties' public keys registered with it (``flwr supernode register``; this and every other
   ``flwr`` command of the deployment run in one ``flwr`` process, :mod:`fl_split.flower.flwrcli`);
5. one SuperNode per party (``flower-supernode``) with its role, guest index, **its own** data
   file, its data-plane keys and the path of **its own** private seed file (if any) in
   ``--node-config``: with a private seed, each party's node gets a seed of its own
   (:meth:`~fl_split.seeding.PrivateSeed.for_party`, which derives that party's secret and no
   other's) in ``WORKDIR/nodes/<party>/private-seed`` — never a value on a command line or in an
   environment;
6. ``flwr run APP CONNECTION --stream`` with the run configuration in a TOML file; the connection
   lives in ``WORKDIR/flwr-home/config.toml`` (``FLWR_HOME``), so the user's ``~/.flwr`` and the
   local SuperLink on 127.0.0.1:39091 are never touched.

The outcome is read from the SuperLink (``flwr ls --run-id N --format json``: ``status`` and
``status-details``), not from ``flwr run``'s exit code (0 even when the ServerApp fails). Ports are
picked free below the ephemeral range (:func:`free_port`). Whatever ends the command (success, a failure, Ctrl-C, SIGTERM), every
process it started and every descendant of them is ended: SIGTERM, then SIGKILL after a grace
period. Logs stay in ``WORKDIR/logs``. See ``docs/deploy.md``.

Everything it writes is owner-only: the work directory is 0700, and the command and every process
it starts run under umask 077 (:data:`~fl_split.secure_files.PRIVATE_UMASK`), so party files (the
host's holds the labels), keys, seed files, checkpoints, logs and the SuperLink's database are
0600; anything group- or other-accessible left in a reused work directory is made owner-only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from fl_split.config import RunConfig, key_of, option_fields
from fl_split.errors import ConfigError, FlSplitError
from fl_split.flower.processes import end_processes, process_table
from fl_split.secure_files import PRIVATE_UMASK, make_owner_only, private_dir, write_private

__all__ = ["DeploymentError", "LocalDeployment", "ProcessGroup", "deploy_local", "free_port", "run_config_toml"]

#: run-config keys never sent to the coordinator: a party's private seed lives in its own node config
NOT_IN_RUN_CONFIG = ("private_seed",)


class DeploymentError(FlSplitError):
    """The deployment failed (a process exited, the ServerApp failed, a timeout); one line."""


#: the lowest port :func:`free_port` hands out
PORTS_FROM = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux
    ``ip_local_port_range``; the usual 32768–60999 where it cannot be read)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1, **below the ephemeral range**. A port the OS picks
    (``bind(0)``) comes from that range, which every outgoing connection also draws from: between
    this call and the bind of the server it is for (a SuperNode's, seconds later, after its
    imports), any client of the deployment could take it — seen once in a CI run: a SuperNode's
    Runtime API failed with "address already in use". Listeners are then the only competition
    (the port is checked free here). Ports from 20000 up to 3000 below that range: clear of Ray's
    default worker ports (10002–19999) and of the 3000 below the range the test suite's Ray nodes
    use. Falls back to the OS's pick when no such port is found."""
    import random

    lo, _ = ephemeral_ports()
    if lo - 3000 > PORTS_FROM:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(PORTS_FROM, lo - 3000)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def warm_command(supernode_args: list[str]) -> list[str]:
    """``flower-supernode ARGS`` run under ``fl-split party-runtime`` (fl_split/flower/warm.py): the
    party lives in one process for the whole run instead of one process per message."""
    return [sys.executable, "-m", "fl_split.cli", "party-runtime", "--", *supernode_args]


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    import shutil

    found = shutil.which(name)
    if not found:
        raise DeploymentError(f"{name} not found beside {sys.executable} or on PATH (install flwr)")
    return found


# -- processes --------------------------------------------------------------------------------------
class ProcessGroup:
    """Processes started in sessions of their own and ended together, with their descendants.

    Nothing is found by name: :meth:`stop` ends the members of our sessions and every descendant
    of the processes we started (a SuperLink's ``flower-superexec`` and ``flwr-serverapp`` lead
    sessions of their own), SIGTERM first, SIGKILL after ``grace`` seconds."""

    #: the environment variable every process of a group carries (and every process they start
    #: inherits): :meth:`members` finds by it a process whose parent died before it was signalled
    MARK = "FL_SPLIT_PROCESS_GROUP"

    def __init__(self, log_dir: Path) -> None:
        import uuid

        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.tag = uuid.uuid4().hex

    def spawn(self, name: str, args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env={**env, self.MARK: self.tag}, cwd=cwd,
                                 umask=PRIVATE_UMASK)
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 5) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])

    def exited(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def members(self) -> set[int]:
        """Live PIDs in our sessions, below the processes we started, or carrying our :attr:`MARK`
        (a child started while its parent was being stopped outlives it, re-parented to init)."""
        from fl_split.flower.processes import pids_with_env

        table = process_table()
        roots = {p.pid for p in self.procs.values()}
        out = {pid for pid, (state, _, sid, _) in table.items() if sid in roots and state != "Z"}
        frontier = list(roots | out)
        while frontier:
            parent = frontier.pop()
            for pid, (state, ppid, _, _) in table.items():
                if ppid == parent and pid not in out and state != "Z":
                    out.add(pid)
                    frontier.append(pid)
        out |= {p.pid for p in self.procs.values() if p.poll() is None}
        out |= set(pids_with_env(f"{self.MARK}={self.tag}".encode(), table))
        return out

    def stop(self, grace: float = 10.0) -> set[int]:
        """End every member; returns the PIDs signalled."""
        signalled: set[int] = set()
        for _ in range(3):  # a process may start a child while we stop it: look again
            targets = self.members() - signalled
            if not targets:
                break
            signalled |= targets
            end_processes(targets, grace, while_waiting=self._reap)
        self._reap()
        return signalled

    def _reap(self) -> None:
        for p in self.procs.values():
            p.poll()


# -- configuration ------------------------------------------------------------------------------------
def run_config_toml(cfg: RunConfig, out: Path) -> str:
    """Every option of ``cfg`` as a Flower run-config TOML file (all keys explicit, so the app's
    own defaults in ``pyproject.toml`` do not matter); results go to ``out``."""
    from fl_split.flower.appconfig import toml_value

    values = {f.name: getattr(cfg, f.name) for f in option_fields() if f.name not in NOT_IN_RUN_CONFIG}
    values.update(out=str(out), engine="flower", progress=False, party_files="")
    if cfg.checkpoint_dir:  # the coordinator's own; each party's is in its node config
        values["checkpoint_dir"] = str(checkpoint_dir_of(cfg, "coordinator"))
    return "".join(f"{key_of(name)} = {toml_value(v)}\n" for name, v in values.items())


def checkpoint_dir_of(cfg: RunConfig, who: str) -> Path:
    """``--checkpoint-dir DIR`` of a loopback deployment: ``DIR/coordinator`` for the ServerApp,
    ``DIR/<party>`` for each SuperNode (in a real deployment each is on its own machine)."""
    return Path(cfg.checkpoint_dir).expanduser().resolve() / who


def spend_dir_of_party(cfg: RunConfig, party: str) -> Path:
    """A loopback deployment party's spend records: ``DIR.spent/<party>``, outside ``DIR``, so a
    restore of the whole checkpoint folder leaves them alone (docs/robustness.md, "The spend record")."""
    from fl_split.checkpoint import spend_dir_of

    return spend_dir_of(Path(cfg.checkpoint_dir).expanduser().resolve()) / party


def _literal(path: Path | str) -> str:
    text = str(path)
    if "'" in text or "\n" in text:
        raise ConfigError("workdir", text, "a path without quotes or newlines")
    return f"'{text}'"


def find_app_dir() -> Path:
    """The Flower app (the repository root with ``[tool.flwr.app]`` in ``pyproject.toml``)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.exists() and "[tool.flwr.app]" in pyproject.read_text(encoding="utf-8"):
        return root
    raise DeploymentError(f"no Flower app found: {pyproject} is missing or has no [tool.flwr.app]; run "
                          f"fl-split deploy from a checkout of the repository")


def staged_app(dest: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """A copy of the Flower app at ``root`` (default :func:`find_app_dir`) in ``dest`` holding the files
    its FAB holds, for ``flwr run dest``: the same FAB, built in a fraction of the time.

    ``flwr run DIR`` (flwr 1.41 ``flwr/cli/utils.py`` ``collect_files``) walks every file under DIR —
    a checkout's ``.venv`` and ``.git`` included, tens of thousands of files — and only then drops what
    ``.gitignore`` and the FAB rules exclude: 15–20 s of every run on this machine. Here the walk
    does not enter ``.git`` or a directory ``.gitignore`` ignores (a ``.gitignore`` with a ``!``
    pattern, which could re-include a file under one, is walked whole); Flower's own filters
    (``filter_paths_for_publish``, then ``get_filtered_fab_paths``) choose the files, which are copied
    to ``dest`` (emptied first) with ``pyproject.toml`` and ``.gitignore``. tests/test_deploy.py checks
    that ``flwr run dest`` builds the very same FAB bytes as ``flwr run root``."""
    import shutil

    import tomli
    from flwr.cli.build import get_filtered_fab_paths
    from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns

    root = Path(root).resolve() if root is not None else find_app_dir()
    patterns = load_gitignore_patterns(root / ".gitignore")
    ignored = build_pathspec(patterns) if not any(p.startswith("!") for p in patterns) else None
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        dirnames[:] = [d for d in dirnames if not (prefix == "" and d == ".git") and not (
            ignored is not None and ignored.match_file(f"{prefix}{d}/"))]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink() and path.resolve().is_relative_to(root):
                files[prefix + name] = path
    chosen = filter_paths_for_publish(files)
    config = tomli.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    keep = set(get_filtered_fab_paths(chosen, config)) | ({"pyproject.toml", ".gitignore"} & set(files))
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    for rel in sorted(keep):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files[rel], target)
    return dest


class LocalDeployment:
    """A SuperLink and ``G + 1`` SuperNodes on 127.0.0.1 (see the module docstring)."""

    def __init__(self, cfg: RunConfig, workdir: str | os.PathLike, *, tls: bool = True, node_auth: bool = True,
                 private_seed=None, party_format: str = "npz",
                 echo: Callable[[str], None] | None = None, timeout: float = 1800.0, grace: float = 10.0,
                 party_files: str | os.PathLike | None = None, warm: bool = True) -> None:
        self.cfg, self.tls, self.node_auth = cfg, tls, node_auth and tls
        #: each SuperNode under ``fl-split party-runtime`` (its party warm in one process,
        #: fl_split/flower/warm.py) or Flower's per-message ``flwr-clientapp`` processes
        self.warm = warm
        self.private_seed, self.party_format = private_seed, party_format
        #: ``--party-files DIR``: the parties' files exist already (export-parties); used where they are
        self.given_parties = Path(party_files).expanduser().resolve() if party_files else None
        #: ``--data host=PATH --data guest-1=PATH …``: each SuperNode reads its own table and the ServerApp
        #: aligns the IDs between the nodes (fl_split.flower.alignment); the run config says node-tables
        self.own_tables: dict[str, Path] | None = None
        from fl_split.data.own import NODE_TABLES, parse_data_spec

        spec = parse_data_spec(cfg.data) if cfg.data and cfg.data.strip() != NODE_TABLES else None
        if isinstance(spec, dict):
            self.own_tables = {p: Path(v).expanduser().resolve() for p, v in spec.items()}
        self.workdir = Path(workdir).expanduser().resolve()
        self.echo = echo or (lambda line: print(line, flush=True))
        self.timeout, self.grace = timeout, grace
        self.group = ProcessGroup(self.workdir / "logs")
        self.flwr_home = self.workdir / "flwr-home"
        self.certs = self.workdir / "certs"
        self.parties_dir = self.given_parties or self.workdir / "parties"
        self.results_path = self.workdir / "run-results.json"
        self.connection = "fl-split-local"
        self.run_id: int | None = None
        self.timeline: dict[str, float] = {}
        self.parties = ["host"] + [f"guest-{i}" for i in range(1, cfg.guests + 1)]
        bindir = str(Path(sys.executable).parent)
        self.env = dict(os.environ, FLWR_HOME=str(self.flwr_home), FLWR_TELEMETRY_ENABLED="0",
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", RAY_USAGE_STATS_ENABLED="0",
                        PYTHONUNBUFFERED="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        for var in ("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT", "RAY_ADDRESS"):
            self.env.pop(var, None)
        self.env[ProcessGroup.MARK] = self.group.tag  # `flwr run` and every command are the group's too
        from fl_split.flower.processes import DeferredInterrupt

        #: Ctrl-C / SIGTERM (deploy_local installs its handler): raised in the waits, never mid-import
        self.interrupts = DeferredInterrupt()
        self._cli = None  # the one `flwr` process every flwr command of the deployment runs in

    def flwr_cli(self):
        """The deployment's :class:`~fl_split.flower.flwrcli.FlwrCli` (started on first use; a member
        of :attr:`group`, so it ends with the deployment): every ``flwr`` command — the registrations,
        ``flwr run``, ``flwr ls`` — runs in it, and none pays the ~1.5 s of a fresh ``flwr`` process.
        One that has died (its command ended with its exit status) is replaced, as a fresh ``flwr`` would be."""
        if self._cli is None or self._cli.proc.poll() is not None:
            from fl_split.flower.flwrcli import FlwrCli

            self._cli = FlwrCli(self.env, self.workdir, umask=PRIVATE_UMASK)
            self.group.procs["flwr"] = self._cli.proc
        return self._cli

    # -- steps ----------------------------------------------------------------------------------------
    def _mark(self, name: str) -> None:
        self.timeline[name] = time.monotonic()

    def check_tables(self) -> None:
        """``--data`` with one table per party: every table checked as ``fl-split train --data`` checks
        it (one-line errors), before anything is written or started. Only the checks each node makes
        on its own table and the column names (public); no alignment here — the nodes align."""
        from fl_split.data.own import check_column_owner, check_encode, read_own_table

        owner: dict[str, str] = {}
        columns: dict[str, list[str]] = {}
        for party, path in (self.own_tables or {}).items():
            table = read_own_table(self.cfg, party, str(path))
            check_column_owner(owner, table.where, party, table.slice.columns)
            columns[party] = table.slice.columns
        check_encode(self.cfg, columns)  # every --encode entry names some party's column

    def prepare_data(self) -> None:
        """The work directory (0700) and each party's data: its own table checked, the party files
        exported, or the given ones checked."""
        from fl_split.party_files import export_parties

        if self.own_tables is not None:
            self.check_tables()
        private_dir(self.workdir)
        make_owner_only(self.workdir)  # a reused work directory: nothing of an earlier run stays readable
        private_dir(self.flwr_home)
        if self.own_tables is not None:
            pass  # each node its own table (node-config data-path)
        elif self.given_parties is None:
            export_parties(replace(self.cfg, out=""), self.parties_dir, self.party_format)
        else:  # every file checked against the run and against each other before anything starts
            from fl_split.party_files import load_parties

            load_parties(self.cfg, self.given_parties)
            self._given_files = {p: next(self.given_parties / f"{p}.{f}" for f in ("npz", "csv", "parquet")
                                         if (self.given_parties / f"{p}.{f}").is_file()) for p in self.parties}

    def prepare(self) -> None:
        self.prepare_data()
        if self.tls:
            from fl_split.certs import write_deployment_certificates

            # each guest gets a client certificate named after it: the host's data plane requires them
            # (mutual TLS) and checks the name against the party of each stream
            write_deployment_certificates(self.certs, node_keys=self.parties if self.node_auth else (),
                                          clients=[p for p in self.parties if p != "host"])
        self.results_path.unlink(missing_ok=True)
        for old in self.workdir.glob("superlink.db*"):  # an earlier version's SuperLink state (its runs' messages)
            old.unlink()
        if self.cfg.secure_merge:  # the guests' public identities, pinned by each guest from its node config
            from fl_split.privacy.secure_merge import roster_from_seed

            roster = roster_from_seed(self.private_seed, self.cfg.guests)
            write_private(self.roster_file, json.dumps({g: k.hex() for g, k in roster.items()}).encode("ascii"))
        for party in self.parties:
            seed_file = self.seed_file(party)
            seed_file.unlink(missing_ok=True)
            if self.private_seed is not None:  # each node its own seed: it derives its party's secret only
                private_dir(seed_file.parent)
                write_private(seed_file, self.private_seed.for_party(party).file_text().encode("ascii"))
        self._mark("prepared")

    @property
    def roster_file(self) -> Path:
        """``--secure-merge``: every guest's public identity (docs/deploy.md, "Secure merge")."""
        return self.workdir / "secure-merge-roster.json"

    def seed_file(self, party: str) -> Path:
        """``party``'s own private seed file (0600, in its node's own 0700 directory)."""
        return self.workdir / "nodes" / party / "private-seed"

    def party_file(self, party: str) -> Path:
        if self.own_tables is not None:
            return self.own_tables[party]
        if self.given_parties is not None:
            return self._given_files[party]
        return self.parties_dir / f"{party}.{self.party_format}"

    def start_superlink(self) -> None:
        self.link_port = free_port()
        self.address = f"127.0.0.1:{self.link_port}"
        args = [_bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(self.link_port),
                "--disable-runtime-dependency-installation"]  # no --database: the state in memory (module docstring)
        if self.tls:
            args += ["--ssl-ca-certfile", str(self.certs / "ca.crt"), "--ssl-certfile", str(self.certs / "superlink.crt"),
                     "--ssl-keyfile", str(self.certs / "superlink.key")]
            if self.node_auth:
                args.append("--enable-supernode-auth")
        else:
            args.append("--insecure")
        self.group.spawn("superlink", args, self.env, cwd=self.workdir)
        self.flwr_cli()  # its imports overlap the SuperLink's start-up
        conn = [f'[superlink]\ndefault = "{self.connection}"\n\n[superlink.{self.connection}]\n',
                f'address = "{self.address}"\n']
        conn.append(f'root-certificates = "{self.certs / "ca.crt"}"\n' if self.tls else "insecure = true\n")
        write_private(self.flwr_home / "config.toml", "".join(conn).encode("utf-8"))
        self._wait_superlink()
        self._mark("superlink")

    def _wait_superlink(self, timeout: float = 120.0) -> None:
        import ssl

        import httpx

        verify: Any = ssl.create_default_context(cafile=str(self.certs / "ca.crt")) if self.tls else False
        url = f"{'https' if self.tls else 'http'}://{self.address}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=1.0, verify=verify).is_success:
                    return
            except httpx.HTTPError:
                pass
            self._check_alive()
            self.interrupts.sleep(0.2)
        raise DeploymentError(f"the SuperLink did not answer on {self.address} within {timeout:g} s "
                              f"(log: {self.group.log_dir / 'superlink.log'})")

    def _flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """``flwr ARGS`` to its end, in the deployment's one ``flwr`` process (:meth:`flwr_cli`)."""
        return self.flwr_cli().run(*args, timeout=timeout)

    def register_nodes(self) -> None:
        """``flwr supernode register`` for every party (one after the other in the one ``flwr``
        process: ~0.1 s each; three fresh ``flwr`` processes side by side took 2.9–3.4 s here)."""
        for party in self.parties:
            out = self._flwr("supernode", "register", str(self.certs / f"auth-{party}.pub"), self.connection,
                             "--name", party, "--format", "json")
            if out.returncode != 0 or '"success": true' not in out.stdout:
                detail = (out.stdout + out.stderr).strip().splitlines()
                raise DeploymentError(f"flwr supernode register for {party} failed: "
                                      f"{detail[-1] if detail else 'exit code ' + str(out.returncode)}")
        self._mark("registered")

    def node_config(self, party: str) -> str:
        role = "host" if party == "host" else "guest"
        items = [f"role='{role}'"]
        if role == "guest":
            items.append(f"guest-index={int(party.split('-')[1])}")
        items.append(f"data-path={_literal(self.party_file(party))}")
        from fl_split.plugins import plugin_strings

        allowed = sorted(set(plugin_strings(self.cfg.to_flower()).values()))
        if allowed:  # the user's own config (every party is this user's): its plug-ins are allowed on each node
            items.append(f"plugins={_literal(','.join(allowed))}")
        if self.cfg.data_plane == "direct":
            if role == "host":
                items.append(f"dataplane-address='127.0.0.1:{self.dataplane_port}'")
                if self.tls:
                    items += [f"dataplane-certfile={_literal(self.certs / 'dataplane-host.crt')}",
                              f"dataplane-keyfile={_literal(self.certs / 'dataplane-host.key')}",
                              f"dataplane-client-ca={_literal(self.certs / 'ca.crt')}"]
            elif self.tls:
                items += [f"dataplane-ca={_literal(self.certs / 'ca.crt')}",
                          f"dataplane-certfile={_literal(self.certs / f'{party}.crt')}",
                          f"dataplane-keyfile={_literal(self.certs / f'{party}.key')}"]
            if not self.tls:
                items.append("dataplane-insecure=true")
        if self.cfg.checkpoint_dir:
            items.append(f"checkpoint-dir={_literal(checkpoint_dir_of(self.cfg, party))}")
            items.append(f"spend-dir={_literal(spend_dir_of_party(self.cfg, party))}")
        if self.own_tables is not None and self.cfg.align == "psi" and self.cfg.psi_max_peer_ids.strip():
            # the user's own bound on a peer's PSI set (every party is this user's): its node's own limit,
            # which the run config alone could only lower (fl_split/flower/alignment.py, node_peer_limit)
            items.append(f"psi-max-peer-ids={_literal(self.cfg.psi_max_peer_ids.strip())}")
        if self.private_seed is not None:  # the path only: the seed itself is never on a command line
            items.append(f"private-seed-file={_literal(self.seed_file(party))}")
        if self.cfg.secure_merge and role == "guest":
            items.append(f"secure-merge-roster={_literal(self.roster_file)}")
        items += self.model_items(party)
        return " ".join(items)

    def model_items(self, party: str) -> list[str]:
        """``--save-model DIR``: the node writes its own part into ``DIR/<party>/`` (its node-config
        ``model-dir``; on loopback every node's is the one ``DIR``, so ``fl-split predict --model DIR``
        finds every part). ``--init-from DIR``: the node continues from its own ``DIR/<party>/`` (its
        node-config ``init-from``)."""
        items = []
        if self.cfg.save_model:
            items.append(f"model-dir={_literal(Path(self.cfg.save_model).expanduser().resolve())}")
        if self.cfg.init_from:  # --init-from DIR: each node continues from its own DIR/<party>/
            items.append(f"init-from={_literal(Path(self.cfg.init_from).expanduser().resolve())}")
        return items

    def saved_model(self) -> dict[str, Any] | None:
        """``results["saved_model"]`` of a run with ``--save-model DIR`` (the shape ``fl-split train``
        records, :func:`fl_split.engine.run_experiment`): the folder every node was given as its
        ``model-dir`` and the parties that each wrote their own part ``DIR/<party>/`` into it."""
        if not self.cfg.save_model:
            return None
        return {"dir": str(Path(self.cfg.save_model).expanduser().resolve()), "parties": list(self.parties)}

    def start_supernodes(self) -> None:
        self.dataplane_port = free_port()
        for party in self.parties:
            args = [_bin("flower-supernode"), "--superlink", self.address, "--host", "127.0.0.1",
                    "--port", str(free_port()), "--node-config", self.node_config(party)]
            if self.tls:
                args += ["--root-certificates", str(self.certs / "ca.crt")]
                if self.node_auth:
                    args += ["--auth-supernode-private-key", str(self.certs / f"auth-{party}.key")]
            else:
                args.append("--insecure")
            self.group.spawn(f"supernode-{party}", warm_command(args) if self.warm else args, self.env,
                             cwd=self.workdir)
        self._mark("supernodes")

    def _check_alive(self) -> None:
        for name, code in self.group.exited():
            if name not in ("flwr-run", "flwr"):  # their commands end with their exit status
                tail = self.group.log_tail(name, 1)
                raise DeploymentError(f"{name} exited with code {code}" + (f": {tail}" if tail else "")
                                      + f" (log: {self.group.log_dir / (name + '.log')})")

    def run(self) -> dict[str, Any]:
        """Submit the run, relay its log lines, wait for its outcome; returns the results."""
        config = self.workdir / "run-config.toml"
        cfg = self.cfg
        if self.own_tables is not None:  # no party's table path in the run config: each node has its own
            from fl_split.data.own import NODE_TABLES

            cfg = replace(cfg, data=NODE_TABLES)
        write_private(config, run_config_toml(cfg, self.results_path).encode("utf-8"))
        self._submit([_bin("flwr"), "run", str(self.staged_app()), self.connection, "--stream", "--run-config",
                      str(config)], umask=PRIVATE_UMASK, follow_host=True)
        if not self.results_path.exists():
            raise DeploymentError(f"run {self.run_id} completed but wrote no results to {self.results_path}")
        return json.loads(self.results_path.read_text(encoding="utf-8"))

    def staged_app(self) -> Path:
        """The app for ``flwr run``: :func:`staged_app` in ``WORKDIR/app`` (the checkout's FAB, without
        Flower walking the checkout's ``.venv``)."""
        return staged_app(self.workdir / "app")

    def _submit(self, args: list[str], umask: int = -1, follow_host: bool = False) -> str:
        """Run ``flwr run`` (``args``), relay its stream, wait for it and for the run's outcome within
        :attr:`timeout`; returns the final status, raises :class:`DeploymentError` unless the run
        completed. ``follow_host``: also show the epoch lines the host writes to its own log as each
        epoch ends (the coordinator hears of a message's epochs when it ends: ``--epochs-per-message``)."""
        from fl_split.flower.direct import HOST_EPOCH

        self._mark("submitted")
        host_log = FollowLog(self.group.log_dir / "supernode-host.log", HOST_EPOCH) if follow_host else None
        proc: Any
        if args[0] == _bin("flwr"):  # in the deployment's one flwr process (ended with the group)
            proc = self.flwr_cli().start(*args[1:])
        else:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    text=True, env=self.env, cwd=self.workdir, start_new_session=True, umask=umask)
            self.group.procs["flwr-run"] = proc
        reader = threading.Thread(target=self._relay, args=(proc,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise DeploymentError(f"the run did not finish within {self.timeout:g} s")
            self._check_alive()
            for line in host_log.lines() if host_log is not None else ():
                self.echo(f"  | {line}   (the host's log)")
            self.interrupts.sleep(0.5)
        reader.join(timeout=5)
        self._mark("stream-ended")
        if self.run_id is None:
            raise DeploymentError(f"flwr run exited with code {proc.returncode} without starting a run "
                                  f"({self._last_stream_line or 'no output'})")
        status, details = self._wait_outcome(deadline)
        self._mark("finished")
        if status != "finished:completed":
            raise DeploymentError(f"run {self.run_id} {status.replace('finished:', '')}: "
                                  f"{_one_line(details) or 'no details'} (logs: {self.group.log_dir})")
        return status

    _last_stream_line = ""

    def _relay(self, proc: subprocess.Popen) -> None:
        with open(self.group.log_dir / "flwr-run.log", "w", encoding="utf-8") as log:
            t0 = time.monotonic()
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(f"[{time.monotonic() - t0:8.2f} s] {line}")  # when each line arrived
                log.flush()
                line = _strip_ansi(line.rstrip("\n"))
                if not line.strip():
                    continue
                words = stream_words(line)
                if words:
                    self._last_stream_line = words
                if line.startswith("Successfully started run "):
                    self.run_id = int(line.rsplit(" ", 1)[-1])
                    self._mark("run-started")
                self.echo(f"  | {line}")

    def status(self) -> tuple[str, str]:
        return run_status(self._flwr("ls", self.connection, "--run-id", str(self.run_id), "--format", "json"))

    def _wait_outcome(self, deadline: float) -> tuple[str, str]:
        while True:
            status, details = self.status()
            if status.startswith("finished") or time.monotonic() > deadline:
                return status, details
            self._check_alive()
            self.interrupts.sleep(0.25)  # one request to the SuperLink in the running flwr process

    def stop(self) -> set[int]:
        return self.group.stop(self.grace)

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


class FollowLog:
    """The lines starting with ``prefix`` that a log file gains from now on (read as it grows)."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path, self.prefix, self._rest = path, prefix, b""
        self._pos = path.stat().st_size if path.exists() else 0

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                data = fh.read()
        except OSError:
            return []
        self._pos += len(data)
        *complete, self._rest = (self._rest + data).split(b"\n")
        return [t for t in (c.decode("utf-8", "replace").rstrip("\r") for c in complete) if t.startswith(self.prefix)]


def stream_words(line: str) -> str:
    """The words of a line of ``flwr run``'s output: Flower frames its errors in a box, whose last
    line is only its border (``╰────╯``); a failure names ``[code: 15] Invalid run configuration.``,
    not that."""
    return line.strip().strip("│┃╭╮╰╯─━ ").strip()


def _one_line(text: str) -> str:
    return " ".join(_strip_ansi(text).split())


def run_status(out: subprocess.CompletedProcess) -> tuple[str, str]:
    """``(status, status-details)`` of the run ``flwr ls --run-id N --format json`` printed in ``out``
    (``("unknown", its output in one line)`` if it printed none)."""
    try:
        run = json.loads(out.stdout)["runs"][0]
        return str(run.get("status", "")), str(run.get("status-details", ""))
    except (ValueError, KeyError, IndexError):
        return "unknown", _one_line(out.stdout + out.stderr)


def deploy_local(cfg: RunConfig, workdir: str | os.PathLike, *, tls: bool = True, node_auth: bool = True,
                 private_seed=None, party_format: str = "npz",
                 echo: Callable[[str], None] | None = None, timeout: float = 1800.0,
                 party_files: str | os.PathLike | None = None,
                 deployment: type[LocalDeployment] | None = None, warm: bool = True) -> dict[str, Any]:
    """Run ``cfg`` as a loopback deployment (module docstring); ``deployment``: the class that runs it
    (:class:`LocalDeployment`, or :class:`fl_split.kit.KitDeployment` — by executing the organisations'
    kits, always TLS and node authentication — which the caller imports: kit builds on this module); returns the results dictionary
    (``results["deployment"]`` adds the run ID, the workdir and the phases' seconds). Every
    process started is ended before this returns or raises, also on KeyboardInterrupt; SIGTERM
    and SIGINT are turned into KeyboardInterrupt at its next wait while it runs. ``private_seed``: a
    :class:`~fl_split.seeding.PrivateSeed` (each node gets its own, see the module docstring).
    Runs under umask 077; the work directory and everything in it are owner-only afterwards."""
    if cfg.secure_merge and private_seed is None and not getattr(deployment, "FROM_KITS", False):
        # before anything is written or started: without kits, the roster is derived from the private seed
        raise ConfigError("secure-merge", True, "with --private-seed-file in fl-split deploy local, or with "
                          "--from-kits", reason="each guest pins the others' identities from a roster deploy "
                          "local derives from the private seed, or from the public identities its kit received "
                          "(docs/deploy.md, \"Secure merge in a deployment\")")
    if private_seed is not None:
        from fl_split.seeding import PrivateSeed

        private_seed = PrivateSeed.coerce(private_seed)
    kind = deployment or LocalDeployment
    from_kits = getattr(kind, "FROM_KITS", False)
    dep = kind(cfg, workdir, tls=tls, node_auth=node_auth, private_seed=private_seed,
                          party_format=party_format, echo=echo, timeout=timeout, party_files=party_files,
                          warm=warm)
    previous = previous_int = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM and Ctrl-C end the deployment (KeyboardInterrupt at its next wait: DeferredInterrupt),
        # also when this process was started with SIGINT ignored (a background job of a
        # non-interactive shell inherits SIG_IGN, and Python then keeps it)
        previous = signal.signal(signal.SIGTERM, dep.interrupts.handler)
        previous_int = signal.signal(signal.SIGINT, dep.interrupts.handler)
    previous_umask = os.umask(PRIVATE_UMASK)
    say = dep.echo  # one line as each phase starts: a deployment is never silent while it sets up

    try:
        t0 = time.monotonic()
        say(f"deploy: preparing {dep.workdir}: "
            + ("writing a kit per organisation (WORKDIR/kits), each running its run.sh init (its own keys), "
               "exchanging the public files, the host signing the guests' CSRs; " if from_kits else "")
            + (f"checking each party's own table (its SuperNode reads it; the ServerApp aligns the IDs between "
               f"the nodes, --align {cfg.align})" if dep.own_tables is not None
               else "checking the given party files" if party_files is not None else "exporting one data file per party")
            + (", making certificates and keys" if tls and not from_kits else "") + " …")
        dep.prepare()
        say("deploy: starting the SuperLink …")
        dep.start_superlink()
        if dep.node_auth:
            say(f"deploy: registering {len(dep.parties)} SuperNode public keys …")
            dep.register_nodes()
        say(f"deploy: starting {len(dep.parties)} SuperNodes ({', '.join(dep.parties)}) …")
        dep.start_supernodes()
        say(f"deploy: running the job on {dep.address} (flwr run) …")
        results = dep.run()
        dep.interrupts.raise_if_stopped()  # a signal after the last wait still ends it as interrupted
        saved = dep.saved_model()
        if saved is not None:  # each SuperNode wrote its own part: where, as `fl-split train` records it
            results["saved_model"] = saved
        marks = dep.timeline
        results["deployment"] = {"run_id": str(dep.run_id), "workdir": str(dep.workdir), "tls": tls,
                                 "node_auth": dep.node_auth, "superlink": dep.address,
                                 "seconds": {k: round(v - t0, 2) for k, v in marks.items()}}
        return results
    finally:
        dep.stop()
        os.umask(previous_umask)
        if dep.workdir.is_dir():
            make_owner_only(dep.workdir)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)

