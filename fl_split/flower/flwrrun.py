"""``fl-split flwr-run``: ``flwr run . --stream`` that fits the machine, fails loudly and leaves nothing behind.

Plain ``flwr run .`` has three measured problems (DESIGN.md, "Flower facts measured here"; issue 17):

* Flower's default federation reserves 2 whole CPUs per ClientApp and lets Ray count the machine's
  cores, so on a 2-core machine one ClientApp runs at a time and the direct data plane (all
  ``G + 1`` at once) is refused;
* it exits 0 even when the ServerApp fails;
* it starts a detached local SuperLink (``flower-superlink`` and its ``flower-superexec``) on the
  fixed 127.0.0.1:39091 with state in ``~/.flwr`` and leaves it running.

This command runs the same ``flwr run APP CONNECTION --stream`` with

1. **its own SuperLink** (simulation mode, ``--disable-runtime-dependency-installation``) on a port
   the OS picks, its state and ``FLWR_HOME`` in a private work directory, started in a session of
   its own (:class:`fl_split.deploy.ProcessGroup`) — the user's ``~/.flwr`` is never touched;
2. **a federation derived from the job** (:func:`federation_for`): ``num-supernodes = G + 1``, each
   ClientApp reserving ``floor(CPUs / (G + 1))`` whole CPUs (at least 1: Flower's federation takes
   integers) and Ray told to count ``max(CPUs, (G + 1) × that)`` CPUs — the machine's CPUs shared by
   the ``G + 1`` ClientApps, as ``--num-cpus auto`` does for ``fl-split train --engine flower``
   (on 2 cores with 2 guests: 1 CPU each, Ray counts 3, the three share the 2 cores);
3. **the outcome read from the SuperLink** (``flwr ls --run-id N --format json``), not from
   ``flwr run``'s exit status: exit 0 only when the run finished ``completed``, 1 with the reason
   otherwise, 2 for bad options (before anything starts), 130 on Ctrl-C / SIGTERM;
4. **every process it started ended** on every way out (success, failure, Ctrl-C, SIGTERM): the
   members of its sessions and all their descendants (SuperExec, ServerApp, the simulation, Ray),
   SIGTERM then SIGKILL — by PID, never by name.

The run configuration is checked before anything starts (the same :class:`RunConfig` rules as
``fl-split train``) and handed to ``flwr run`` as a TOML file; a relative ``out`` is made absolute
against the caller's directory (the ServerApp runs elsewhere).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from fl_split.config import RunConfig
from fl_split.deploy import LocalDeployment, _bin, free_port

__all__ = ["FlwrRun", "federation_for", "flwr_run", "parse_pairs"]


def parse_pairs(text: str, flag: str) -> dict[str, Any]:
    """``"k=v k2='s'"`` (Flower's ``--run-config`` / ``--federation-config`` syntax) as a dict, with
    Flower's own parser; a malformed string is a :class:`~fl_split.errors.ConfigError` naming ``flag``."""
    from flwr.common.config import parse_config_args

    from fl_split.errors import ConfigError

    if not text.strip():
        return {}
    try:
        return dict(parse_config_args([text]))
    except Exception as exc:  # noqa: BLE001 - Flower raises ValueError / tomli errors / typer exits
        raise ConfigError(flag, text, "space-separated key=value pairs (strings in quotes), e.g. "
                          "\"guests=2 epochs=1\"", reason=str(exc) or type(exc).__name__) from None


def job_config(run_config: dict[str, Any], cwd: Path) -> tuple[RunConfig, dict[str, Any]]:
    """The job ``flwr run .`` would run with these overrides (the app's defaults from ``pyproject.toml``,
    :data:`fl_split.flower.appconfig.MAIN_JOB` included), validated; and the overrides to send, with
    a relative ``out`` made absolute against ``cwd``."""
    from fl_split.flower.appconfig import app_config

    values = dict(run_config)
    for key in ("out", "save-model"):  # paths the ServerApp / ClientApps write, as the caller meant them
        if values.get(key):
            values[key] = str((cwd / Path(str(values[key])).expanduser()).resolve())
    from fl_split.errors import ConfigError
    from fl_split.flower.strategy import PRIVATE_KEYS

    if str(values.get("private-seed", "")).strip():  # the SuperLink stores the run config: never a seed value
        raise ConfigError("private-seed", "<hidden>", "empty; give private-seed-file = a path to an owner-only seed "
                          "file (fl-split seed --out F)", reason="a run config is stored by the SuperLink")
    if values.get("private-seed-file"):  # a path the ClientApps read; absolute, as the caller meant it
        values["private-seed-file"] = str((cwd / Path(str(values["private-seed-file"])).expanduser()).resolve())
    merged = {k: v for k, v in {**app_config(), **values}.items() if k not in PRIVATE_KEYS}
    return RunConfig.from_mapping(merged), values


def federation_for(guests: int, cpus: int) -> dict[str, int]:
    """The simulation federation for ``G = guests`` on ``cpus`` CPUs (module docstring, point 2)."""
    parties = guests + 1
    each = max(1, cpus // parties)
    return {"num-supernodes": parties, "client-resources-num-cpus": each,
            "init-args-num-cpus": max(cpus, parties * each)}


class FlwrRun(LocalDeployment):
    """A private simulation SuperLink and one ``flwr run . --stream`` against it (module docstring).
    Reuses :class:`~fl_split.deploy.LocalDeployment`'s process group, log relay and outcome polling."""

    def __init__(self, cfg: RunConfig, run_config: dict[str, Any], federation: dict[str, Any],
                 workdir: str | os.PathLike, echo: Callable[[str], None] | None = None,
                 timeout: float = 1800.0, grace: float = 5.0) -> None:
        super().__init__(cfg, workdir, tls=False, node_auth=False, echo=echo or (lambda line: print(line, flush=True)),
                         timeout=timeout, grace=grace)
        self.run_config, self.federation = run_config, federation
        self.connection = "fl-split-sim"

    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)

    def start_superlink(self) -> None:
        self.link_port = free_port()
        self.address = f"127.0.0.1:{self.link_port}"
        self.group.spawn("superlink", [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation",
                                       "subprocess", "--host", "127.0.0.1", "--port", str(self.link_port),
                                       "--disable-runtime-dependency-installation"], self.env, cwd=self.workdir)
        self.flwr_cli()  # its imports overlap the SuperLink's start-up
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.connection}"\n\n[superlink.{self.connection}]\n'
            f'address = "{self.address}"\ninsecure = true\n', encoding="utf-8")
        self._wait_superlink()
        self._mark("superlink")

    def run(self) -> dict[str, Any]:  # type: ignore[override]
        """Submit the run, relay its log, wait for its outcome; returns ``{"run_id", "status"}``."""
        from fl_split.flower.appconfig import toml_value

        config = self.workdir / "run-config.toml"
        config.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in self.run_config.items()), encoding="utf-8")
        fed = " ".join(f"{k}={toml_value(v)}" for k, v in self.federation.items())
        app = self.staged_app()
        args = [_bin("flwr"), "run", str(app), self.connection, "--stream", "--run-config", str(config),
                "--federation-config", fed]
        self.echo(f"fl-split: flwr run {app} --stream --federation-config \"{fed}\" (a copy of the app's FAB files; "
                  f"its own SuperLink on {self.address}; logs in {self.group.log_dir})")
        status = self._submit(args)
        return {"run_id": self.run_id, "status": status}


def flwr_run(run_config: str = "", federation_config: str = "", workdir: str | None = None,
             timeout: float = 1800.0, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the app like ``flwr run . --stream`` (module docstring); returns ``{"run_id", "status",
    "federation"}``; raises :class:`~fl_split.errors.ConfigError` for bad options (nothing started)
    and :class:`~fl_split.deploy.DeploymentError` when the run fails. Every process started is ended
    before it returns or raises (also on ``KeyboardInterrupt``). A temporary work directory is
    removed after a successful run and kept (with the logs) after a failure."""
    from fl_split.flower.resources import local_cpus

    cfg, overrides = job_config(parse_pairs(run_config, "run-config"), Path.cwd())
    federation = {**federation_for(cfg.guests, local_cpus()), **parse_pairs(federation_config, "federation-config")}
    temporary = workdir is None
    work = Path(tempfile.mkdtemp(prefix="fl-split-flwr-")) if temporary else Path(workdir).expanduser()
    ok = False
    run = FlwrRun(cfg, overrides, federation, work, echo=echo, timeout=timeout)
    saved = {}
    if threading.current_thread() is threading.main_thread():
        def _on_term(signum, frame):  # noqa: ARG001 - SIGTERM ends the run like Ctrl-C
            raise KeyboardInterrupt

        saved = {signal.SIGTERM: signal.signal(signal.SIGTERM, _on_term),
                 # Ctrl-C works even when started with SIGINT ignored (a background job of a script)
                 signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        run.prepare()
        run.start_superlink()
        result = run.run()
        ok = True
    finally:
        run.stop()
        if temporary and ok:
            shutil.rmtree(work, ignore_errors=True)
        for sig, old in saved.items():
            signal.signal(sig, old)
    return {**result, "federation": federation}
