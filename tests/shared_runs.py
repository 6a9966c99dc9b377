"""Expensive runs that several test modules assert on: each runs once per session (the fixtures are
in ``tests/conftest.py``), so a 2-core CI machine does not start the same loopback deployment twice.

:func:`sampled_tls_deployment` — ``fl-split deploy local --tls`` (a SuperLink and three SuperNodes
as separate processes, SuperNode authentication, the direct data plane over TLS) with a private seed
file, every process it starts sampled while it runs. ``tests/test_deploy.py`` asserts on its results
(TLS, equality with the local engine); ``tests/test_adversary_secrets.py`` on what the processes and
files exposed (no seed or key material on a command line, in an environment or a readable file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from fl_split.secure_files import readable_by_others, write_private
from fl_split.seeding import PrivateSeed


def cmdline_and_environ(pid: int) -> bytes:
    """``/proc/PID/cmdline`` and ``/proc/PID/environ`` (what another local user can read), or ``b""``."""
    data = b""
    for what in ("cmdline", "environ"):
        try:
            data += Path(f"/proc/{pid}/{what}").read_bytes() + b"\0"
        except OSError:
            pass
    return data


def key_material(path: Path) -> list[bytes]:
    """The base64 lines of a PEM / OpenSSH private key (what an attacker would need)."""
    return [line.strip() for line in path.read_bytes().splitlines()
            if len(line.strip()) >= 40 and not line.startswith(b"-----")]


@dataclass
class SampledDeployment:
    """One finished ``deploy local`` run and what was seen while it ran."""

    argv: list[str]
    seed: PrivateSeed
    workdir: Path
    out_path: Path
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    #: ``{pid: cmdline + environ bytes}`` of the command and every deployment process: each distinct
    #: reading of every sample (a process that changes its environment shows each version)
    seen: dict[int, bytes] = field(default_factory=dict)
    #: ``"path mode"`` of every file or folder under the work directory ever group- or other-accessible
    exposed: set[str] = field(default_factory=set)
    #: the private-key lines of the work directory's ``certs/*.key`` (read once they were written)
    key_lines: list[bytes] = field(default_factory=list)
    #: deployment processes still running after the command exited (then killed)
    left: list[int] = field(default_factory=list)


def sampled_tls_deployment(tmp: Path, run_flags: list[str], timeout: float = 900) -> SampledDeployment:
    """``deploy local --tls RUN_FLAGS --private-seed-file …`` with a fresh private seed; while it runs,
    the ``cmdline``/``environ`` of the command and of every process it started (found by its
    FLWR_HOME) and the modes of everything under its work directory are sampled every 0.3 s."""
    from tests.test_deploy import FLSPLIT, _deployment_pids, _kill

    seed = PrivateSeed.generate()
    seed_file = write_private(tmp / "my.seed", seed.file_text().encode())
    workdir, out_path = tmp / "dep", tmp / "results.json"
    argv = [*FLSPLIT, "deploy", "local", "--tls", *run_flags, "--private-seed-file", str(seed_file),
            "--workdir", str(workdir), "--out", str(out_path)]
    run = SampledDeployment(argv, seed, workdir, out_path)
    snapshots: dict[int, set[bytes]] = {}  # a process's cmdline/environ, each distinct reading once
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # output to files: a pipe nobody reads while the test samples /proc could fill and block the run
    with open(tmp / "stdout.txt", "wb") as so, open(tmp / "stderr.txt", "wb") as se:
        proc = subprocess.Popen(argv, stdout=so, stderr=se, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in [proc.pid, *_deployment_pids(workdir)]:
                data = cmdline_and_environ(pid)
                if data and data not in snapshots.setdefault(pid, set()):
                    snapshots[pid].add(data)
                    run.seen[pid] = run.seen.get(pid, b"") + data
            if workdir.exists():
                run.exposed |= {f"{p} {m:04o}" for p, m in readable_by_others(workdir)}
                if not run.key_lines and (workdir / "certs" / "auth-guest-2.pub").exists():
                    time.sleep(0.2)
                    run.key_lines = [ln for k in (workdir / "certs").glob("*.key") for ln in key_material(k)]
            time.sleep(0.3)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        run.left = _deployment_pids(workdir)
        _kill(run.left)
    run.returncode = proc.returncode
    run.stdout = (tmp / "stdout.txt").read_text(errors="replace")
    run.stderr = (tmp / "stderr.txt").read_text(errors="replace")
    return run


@dataclass
class TableDeployment:
    """One ``deploy local --data … --align psi`` run on text IDs and the local engine's run of the same."""

    paths: dict[str, str]
    #: the e-mail IDs every party holds, and those some party lacks (outside the intersection)
    inter: object
    outside: object
    workdir: Path
    proc: subprocess.CompletedProcess
    #: the deployment's and the local engine's results (``None`` if the deployment failed)
    dep: dict | None
    local: dict | None
    #: everything the deployment wrote: results, stdout, stderr, every file of its work directory but keys
    seen: bytes
    left: list[int]


def psi_table_deployment(tmp: Path) -> TableDeployment:
    """``deploy local --insecure --data host=… --data guest-1=… --data guest-2=… --id-column ID
    --align psi`` (no ``--guests``: the parties are read from ``--data``) on three tables with
    partly overlapping e-mail IDs, then ``train`` with the same flags and seeds in this process.
    tests/test_join_keys.py (text IDs) and tests/test_deploy_align.py (node tables) assert on it."""
    import json
    import sys

    from fl_split.cli import main
    from tests.test_deploy import _deployment_pids, _kill
    from tests.test_join_keys import SEED, _flags, _overlap, _texts
    from tests.test_own_data import write_party_tables

    keep, inter, outside = _overlap()
    paths = write_party_tables(tmp, keep=keep, id_map=_texts)
    seed = write_private(tmp / "seed", PrivateSeed.generate().file_text().encode())
    run = ["--seed", str(SEED), "--epochs", "1", "--batch-size", "64", "--private-seed-file", str(seed)]
    workdir, out = tmp / "dep", tmp / "dep.json"
    # --node-timeout: each round of the alignment starts a ClientApp process per node at once, which a
    # loaded 2-core machine can stretch past the default 120 s
    proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "local", "--insecure", *_flags(paths),
                           "--align", "psi", *run, "--node-timeout", "600", "--workdir", str(workdir),
                           "--out", str(out)], capture_output=True, text=True, timeout=1500)
    left = _deployment_pids(workdir)
    _kill(left)
    dep = local = None
    seen = proc.stdout.encode() + proc.stderr.encode()
    if proc.returncode == 0:
        dep = json.loads(out.read_text())
        local_out = tmp / "local.json"
        if main(["train", *_flags(paths), "--align", "psi", *run, "--no-progress", "--out", str(local_out)]) == 0:
            local = json.loads(local_out.read_text())
        seen += out.read_bytes()
        seen += b"".join(p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.suffix != ".key")
    return TableDeployment(paths, _texts(inter), _texts(outside), workdir, proc, dep, local, seen, left)
