"""``FlowerEngine``: the same experiment as the local engine, through a Flower simulation.

``fl-split train --engine flower`` (and :func:`fl_split.engine.run_experiment` with
``engine="flower"``) runs the ServerApp of ``strategies/`` and the ClientApp of ``clients/`` in a
Flower simulation **in this process** (``flwr.simulation.run_simulation``): ``G + 1`` virtual
SuperNodes on a Ray backend, whose actors run the ClientApps. No SuperLink is started, so none is
left running; Ray is shut down when the run ends (or only disconnected from, for a cluster given
by ``--ray-address``). The run configuration is handed to the ServerApp directly (an in-process
simulation's run-config is empty) and the ServerApp sends it to the parties with ``setup``.

Resources: each ClientApp (Ray actor) reserves ``--num-cpus`` / ``--num-gpus``; parties put their
tensors where ``--device`` says (``auto``: the GPU Ray gave the actor, if any).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import warnings
from typing import Any

from fl_split.config import RunConfig
from fl_split.errors import ConfigError, FlSplitError
from fl_split.flower.processes import descendants

#: environment for an offline, quiet simulation (restored afterwards unless the caller set them)
OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # never `uv sync` the app (offline)
    "FLWR_TELEMETRY_ENABLED": "0",                       # no telemetry requests (offline)
    "RAY_DEDUP_LOGS": "0",
}


@contextlib.contextmanager
def offline_env():
    saved = {k: os.environ.get(k) for k in OFFLINE_ENV}
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: seconds Flower gets to stop the simulation after the ServerApp returned, before the watchdog
#: ends ClientApp actors that are still busy (a party that never answers would otherwise block
#: Flower's shutdown, which waits for every running ClientApp)
STOP_GRACE = 20.0


def _end_stuck_actors(server_done: threading.Event, finished: threading.Event, grace: float) -> None:
    """Watchdog: once the ServerApp is done, give the simulation ``grace`` seconds to stop; then
    SIGKILL the ClientApp actors this process's own Ray instance still runs (found among this
    process's descendants by PID, never by name across the machine)."""
    server_done.wait()
    if finished.wait(grace):
        return
    stuck = [pid for pid, cmd in descendants(os.getpid()).items() if cmd.startswith("ray::ClientAppActor")]
    if stuck:
        logging.getLogger("fl_split.flower").warning(
            "ending %d ClientApp actor(s) still busy %g s after the run stopped: %s", len(stuck), grace, stuck)
    for pid in stuck:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class FlowerEngine:
    """Run ``cfg`` as a Flower simulation; :meth:`run` returns the results dictionary.

    ``client_app`` replaces the fl_split ClientApp (tests inject failing parties);
    ``num_supernodes`` overrides ``G + 1`` (tests build mismatched federations);
    ``poll_interval`` is how often the coordinator looks for replies (seconds).
    After :meth:`run`, :attr:`transport` holds the exchange statistics and the workers
    (Ray node IDs) that answered (:attr:`transports`: one per run of :meth:`run_series`)."""

    name = "flower"

    def __init__(self, cfg: RunConfig, client_app=None, num_supernodes: int | None = None,
                 verbose: bool = False, stop_grace: float = STOP_GRACE, poll_interval: float | None = None,
                 private_seed: int | None = None) -> None:
        from fl_split.flower.transport import POLL_INTERVAL

        self.cfg = cfg
        self.private_seed = private_seed
        self.poll_interval = POLL_INTERVAL if poll_interval is None else poll_interval
        self.stop_grace = stop_grace
        self.client_app = client_app
        self.num_supernodes = num_supernodes if num_supernodes is not None else cfg.guests + 1
        self.verbose = verbose
        self.transport = None
        self.transports: list = []

    def backend_config(self) -> dict[str, Any]:
        """The Ray backend configuration: client resources, and the cluster to join."""
        init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": self.verbose}
        if self.cfg.ray_address:
            init_args["address"] = self.cfg.ray_address
        return {"client_resources": {"num_cpus": float(self.cfg.num_cpus), "num_gpus": float(self.cfg.num_gpus)},
                "init_args": init_args}

    @staticmethod
    def check(cfg: RunConfig) -> None:
        """Fail fast, before Ray starts, on what the parties would reject anyway: the data and
        model options (the simulation prepares the same data) and a device Ray cannot provide."""
        from fl_split.builder import plan_run

        if cfg.device == "cuda" and cfg.num_gpus <= 0:
            raise ConfigError("device", cfg.device, "auto or cpu, or cuda with --num-gpus > 0",
                              reason="Ray gives a ClientApp a GPU only when --num-gpus reserves one")
        plan_run(cfg)

    def run(self) -> dict[str, Any]:
        """Run :attr:`cfg`; returns its results dictionary."""
        return self.run_series([self.cfg])[0]

    def run_series(self, cfgs: list[RunConfig]) -> list[dict[str, Any]]:
        """Run several configurations one after the other in **one** simulation (one Ray start;
        each run sets the parties up afresh). They must share the federation: ``guests``, and the
        Ray options ``num-cpus``, ``num-gpus``, ``ray-address`` of :attr:`cfg`."""
        from flwr.simulation import run_simulation

        from strategies.server_app import make_server_app

        if self.client_app is None:
            from fl_split.flower.node import make_client_app

            client_app = make_client_app(self.private_seed)
        else:
            client_app = self.client_app
        fed = ("guests", "num_cpus", "num_gpus", "ray_address")
        for c in cfgs:
            bad = [k for k in fed if getattr(c, k) != getattr(self.cfg, k)]
            if bad:
                raise ConfigError(bad[0].replace("_", "-"), getattr(c, bad[0]), repr(getattr(self.cfg, bad[0])),
                                  reason="every run of a series shares the simulation's federation")
            self.check(c)
        sink: dict[str, Any] = {}
        server_done, finished = threading.Event(), threading.Event()
        watchdog = threading.Thread(target=_end_stuck_actors, args=(server_done, finished, self.stop_grace),
                                    name="fl_split-watchdog", daemon=True)
        # Flower's own log lines (deprecation notes, ClientApp tracebacks) are kept out of the
        # console unless verbose: failures reach the caller as one exception, with the last
        # Flower error attached when the simulation itself broke
        flwr_logger = logging.getLogger("flwr")
        level, quiet = flwr_logger.level, _Collect()
        handler_levels = {h: h.level for h in flwr_logger.handlers}
        if not self.verbose:
            for h in handler_levels:
                h.setLevel(logging.CRITICAL + 1)
            flwr_logger.setLevel(logging.ERROR)
            flwr_logger.addHandler(quiet)
        try:
            watchdog.start()
            with offline_env(), warnings.catch_warnings():
                # Ray's notice about a future default of accelerator env vars (we rely on the
                # current one: an actor without --num-gpus sees no GPU)
                warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\..*")
                run_simulation(server_app=make_server_app(list(cfgs), sink, self.poll_interval, done=server_done), client_app=client_app,
                               num_supernodes=self.num_supernodes, backend_config=self.backend_config(),
                               verbose_logging=self.verbose)
        finally:
            finished.set()
            server_done.set()
            watchdog.join()
            flwr_logger.setLevel(level)
            flwr_logger.removeHandler(quiet)
            for h, lvl in handler_levels.items():
                h.setLevel(lvl)
            self.transport = sink.get("transport")
            self.transports = sink.get("transports", [])
        if "error" in sink:
            raise sink["error"]
        if len(sink.get("results", ())) != len(cfgs):
            last = quiet.last_error()
            raise FlSplitError("the Flower simulation ended without results"
                               + (f": {last}" if last else " (run with verbose=True for Flower's log)"))
        return sink["results"]


class _Collect(logging.Handler):
    """Keeps Flower's ERROR records of a quiet run (to explain a simulation that broke)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def last_error(self) -> str:
        from fl_split.flower.transport import flower_reason

        for rec in reversed(self.records):
            text = flower_reason(rec.getMessage())
            if text and "Traceback" not in text:
                return text
        return ""
