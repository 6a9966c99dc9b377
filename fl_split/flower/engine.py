"""``FlowerEngine``: the same experiment as the local engine, through a Flower simulation.

``fl-split train --engine flower`` (and :func:`fl_split.engine.run_experiment` with
``engine="flower"``) runs the coordinator strategy (:mod:`fl_split.flower.strategy`) and the
ClientApp handler (:mod:`fl_split.flower.node`) in a Flower simulation **in this process**
(``flwr.simulation.run_simulation``): ``G + 1`` virtual SuperNodes on a Ray backend, whose actors
run the ClientApps. No SuperLink is started, so none is left running; Ray is shut down when the run
ends (or only disconnected from, for a cluster given by ``--ray-address``). The run configuration
is handed to the ServerApp directly (an in-process simulation's run-config is empty) and the
ServerApp sends it to the parties with ``setup``.

Start-up (``docs/flower.md``, "Start-up"): the engine starts Ray itself, before the simulation —
with no per-job runtime environment (the workers inherit ``PYTHONPATH`` from this process; Flower's
own start passes it as a runtime environment, which costs seconds per actor) and, for a local
instance, with only the CPUs the ``G + 1`` ClientApps reserve, so the actor pool holds ``G + 1``
actors instead of one per core. Flower's in-process runtime is made prompt for
the run (:mod:`fl_split.flower.vce`: messages delivered within 5 ms, stopped within 50 ms of the
ServerApp's end), and Ray's shutdown does not wait a second for its autoscaler monitor.
:attr:`FlowerEngine.timeline` records where the time went.

Resources: each ClientApp (Ray actor) reserves ``--num-cpus`` / ``--num-gpus``; the direct data
plane needs all ``G + 1`` at once (checked before Ray starts, :mod:`fl_split.flower.resources`).
``--device auto`` is resolved here by the rule of every engine (:mod:`fl_split.devices`).
``--num-cpus auto`` (the default) is resolved here too: the CPUs Ray sees shared by the ``G + 1``
ClientApps (:func:`fl_split.flower.resources.auto_share`), announced in one line (``say``).

Nothing is left running (issue 17): the processes of a local Ray instance that outlive
``ray.shutdown()`` are ended by PID (:class:`_Recorder`); Ray's driver start replaces the SIGTERM
handler, so the caller's (the CLI's :func:`fl_split.flower.processes.exit_on_signals`) is put back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

from fl_split.config import RunConfig
from fl_split.errors import ConfigError, FlSplitError
from fl_split.flower.processes import descendants, end_processes

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

#: how often a local Ray start is tried before the run gives up (see :meth:`FlowerEngine._start_ray`)
RAY_START_ATTEMPTS = 2


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


def _end_monitor_without_grace() -> None:
    """Make ``ray.shutdown()`` of this process's local Ray instance end its autoscaler monitor with
    SIGKILL at once. Ray gives each of its daemons one second to end after SIGTERM, one after the
    other; measured (Ray 2.55, 2-core machine): every daemon ended within 0.04 s except the monitor,
    which used the whole second every time — 1.0 of the 1.4 s ``ray.shutdown()`` took. The monitor
    of a single-machine instance that ends with the run holds nothing to save. Ray internals
    (``_global_node._kill_process_impl``): left as they are if this Ray lacks them."""
    try:
        from ray._private import ray_constants
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        impl = node._kill_process_impl
        monitor = ray_constants.PROCESS_TYPE_MONITOR
    except (ImportError, AttributeError):  # (no local node: _global_node is None)
        return
    if not callable(impl):
        return

    def kill(process_type, allow_graceful=False, check_alive=True, wait=False):
        return impl(process_type, allow_graceful=allow_graceful and process_type != monitor,
                    check_alive=check_alive, wait=wait)

    node._kill_process_impl = kill


class _Recorder(threading.Thread):
    """Records, once a second while the simulation runs, every process this process started since
    :meth:`start` (Ray's daemons, its workers and ClientApp actors), with its command line: when Ray
    shuts down, a worker whose raylet is gone is re-parented away from this process (no longer a
    descendant) and may linger — measured under load: all 3 ClientApp actors still running after the
    CLI returned. :meth:`end_leftovers` ends those still running the same command, by PID."""

    def __init__(self) -> None:
        super().__init__(name="fl_split-recorder", daemon=True)
        self.before = set(descendants(os.getpid()))
        self.seen: dict[int, str] = {}
        self.halt = threading.Event()

    def snapshot(self) -> None:
        for pid, cmd in descendants(os.getpid()).items():
            if pid not in self.before and (cmd or pid not in self.seen):
                self.seen[pid] = cmd

    def run(self) -> None:
        while not self.halt.wait(1.0):
            self.snapshot()

    def end_leftovers(self, grace: float = 3.0) -> list[int]:
        from fl_split.flower.processes import alive, process_table

        self.halt.set()
        table = process_table(cmdline=True)
        left = {p for p in alive(set(self.seen)) if p in table and self.seen[p] and table[p][3] == self.seen[p]}
        if left:
            end_processes(left, grace=grace)
        return sorted(left)


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
                 private_seed: int | None = None, say=None) -> None:
        from fl_split.flower.transport import POLL_INTERVAL

        #: called with the one line that says what ``--num-cpus auto`` chose (the CLI prints it)
        self.say = say
        self.cfg = cfg
        self.private_seed = private_seed
        self.poll_interval = POLL_INTERVAL if poll_interval is None else poll_interval
        self.stop_grace = stop_grace
        self.client_app = client_app
        self.num_supernodes = num_supernodes if num_supernodes is not None else cfg.guests + 1
        self.verbose = verbose
        self.transport = None
        self.transports: list = []
        self.timeline: dict[str, float] = {}
        self.timelines: list[dict[str, float]] = []
        #: the parties' data as this process prepared it for the last run (:mod:`fl_split.flower.prepared`)
        self.handoff = None

    def backend_config(self) -> dict[str, Any]:
        """The Ray backend configuration: client resources, and the cluster to join."""
        init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": self.verbose}
        if self.cfg.ray_address:
            init_args["address"] = self.cfg.ray_address
        # (Ray is started by _start_ray before the simulation; these apply only if it was not)
        return {"client_resources": {"num_cpus": float(self.cfg.num_cpus), "num_gpus": float(self.cfg.num_gpus)},
                "init_args": init_args}

    @staticmethod
    def check(cfg: RunConfig) -> None:
        """Fail fast, before Ray starts, on what the parties would reject anyway: the data and
        model options (the simulation prepares the same data), a device Ray cannot provide, and —
        for the direct data plane on a local Ray instance — too few resources to run every
        ClientApp at once."""
        from fl_split.builder import plan_run
        from fl_split.devices import for_simulation
        from fl_split.flower.strategy import check_options

        for_simulation(cfg)
        check_options(cfg)
        if cfg.data_plane == "direct":
            if not cfg.ray_address and cfg.num_cpus != "auto":  # auto shares the CPUs: all fit by construction
                from fl_split.flower.resources import check_capacity, local_capacity

                check_capacity(cfg.guests, local_capacity(cfg.num_cpus, cfg.num_gpus), " (this machine)")
        plan_run(cfg)

    def _share_cpus(self, cfgs: list[RunConfig], node_cpus: list[float], where: str) -> list[RunConfig]:
        """Resolve ``--num-cpus auto`` (:func:`fl_split.flower.resources.auto_share`) in :attr:`cfg` and
        ``cfgs``, and say what was chosen in one line (:attr:`say`)."""
        from fl_split.flower.resources import resolve_num_cpus, share_line

        if self.cfg.num_cpus != "auto":
            return cfgs
        self.cfg = resolve_num_cpus(self.cfg, self.num_supernodes, node_cpus)
        if self.say is not None:
            self.say(share_line(self.cfg, self.num_supernodes, node_cpus, where))
        return [resolve_num_cpus(c, self.num_supernodes, node_cpus) for c in cfgs]

    def _start_ray(self) -> bool:
        """Start (or join, with ``--ray-address``) Ray for the simulation; ``False`` if this process
        was already connected to Ray (then Flower uses that instance as it is)."""
        import ray

        if ray.is_initialized():
            return False
        cfg = self.cfg
        args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": self.verbose, "include_dashboard": False}
        # the ClientApps unpickle the app by reference: they import what this process imports
        os.environ["PYTHONPATH"] = os.pathsep.join([*sys.path, *([os.environ["PYTHONPATH"]]
                                                                  if os.environ.get("PYTHONPATH") else [])])
        if cfg.ray_address:
            # other machines do not inherit this process's environment: ship PYTHONPATH to them
            args.update(address=cfg.ray_address, runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
        else:
            from fl_split.flower.resources import local_cpus

            # only the CPUs the G + 1 ClientApps reserve: the pool then holds G + 1 actors, not one per core
            if cfg.num_cpus == "auto":  # (run_series resolves it first; all of this machine's CPUs)
                args["num_cpus"] = local_cpus()
            else:
                need = math.ceil(self.num_supernodes * float(cfg.num_cpus) - 1e-9)
                args["num_cpus"] = max(1, min(local_cpus(), need))
        if cfg.ray_address:
            ray.init(**args)
            return True
        # A local start can fail half-way on a loaded machine (Ray gives its raylet a fixed 30 s to
        # register with the GCS): end what that attempt started, so nothing is left running, and
        # try once more before giving up with Ray's reason.
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            before = set(descendants(os.getpid()))
            try:
                ray.init(**args)
                _end_monitor_without_grace()
                return True
            except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception for a timed-out start
                with contextlib.suppress(Exception):
                    ray.shutdown()
                end_processes(set(descendants(os.getpid())) - before)
                if attempt == RAY_START_ATTEMPTS:
                    from fl_split.flower.records import FederationError

                    raise FederationError(
                        f"Ray did not start on this machine ({attempt} attempts): {exc}. A loaded machine "
                        "can be too slow for Ray's start-up; fewer CPUs for the run (--num-cpus) or "
                        "an already running cluster (--ray-address) are the ways out") from exc
                logging.getLogger("fl_split.flower").warning("Ray did not start (%s); trying again", exc)
        raise AssertionError("unreachable")

    def _client_app(self, cfgs: list[RunConfig]):
        """The fl_split ClientApp with each party's data prepared here once and put in Ray's object
        store, one object per party (:mod:`fl_split.flower.prepared`): the actors fetch their own
        party's slice instead of preparing the dataset again."""
        import ray

        from fl_split.flower.node import make_client_app
        from fl_split.flower.prepared import Handoff

        self.handoff = Handoff.offer(list(cfgs), put=ray.put)
        return make_client_app(self.private_seed, self.handoff)

    def server_app(self, cfgs: list[RunConfig], sink: dict[str, Any], poll: float, done: threading.Event):
        """The ServerApp of the simulation (the training coordinator; the prediction job,
        :mod:`fl_split.flower.predicting`, gives its own)."""
        from fl_split.flower.strategy import make_server_app

        return make_server_app(cfgs, sink, poll, done=done)

    def run(self) -> dict[str, Any]:
        """Run :attr:`cfg`; returns its results dictionary."""
        return self.run_series([self.cfg])[0]

    def run_series(self, cfgs: list[RunConfig]) -> list[dict[str, Any]]:
        """Run several configurations one after the other in **one** simulation (one Ray start;
        each run sets the parties up afresh). They must share the federation: ``guests``, and the
        Ray options ``num-cpus``, ``num-gpus``, ``ray-address`` of :attr:`cfg`."""
        from fl_split.devices import for_simulation

        t_start = time.perf_counter()
        fed = ("guests", "num_cpus", "num_gpus", "ray_address")
        for c in cfgs:
            bad = [k for k in fed if getattr(c, k) != getattr(self.cfg, k)]
            if bad:
                raise ConfigError(bad[0].replace("_", "-"), getattr(c, bad[0]), repr(getattr(self.cfg, bad[0])),
                                  reason="every run of a series shares the simulation's federation")
            self.check(c)
            if c.secure_merge and self.private_seed is None and self.client_app is None:  # before Ray starts
                raise ConfigError("private-seed-file", "", "a private seed file with --secure-merge --engine flower",
                                  reason="each simulated guest pins the other guests' identities from the run's "
                                         "private seed (docs/flower.md, \"Secure merge on Flower\")")
        # --device auto: resolved once, here, by the rule of every engine; the parties get the result
        cfgs = [for_simulation(c) for c in cfgs]
        if not self.cfg.ray_address:  # --num-cpus auto: this machine's CPUs shared by the G + 1 ClientApps
            from fl_split.flower.resources import local_cpus

            cfgs = self._share_cpus(cfgs, [float(local_cpus())], "on this machine")
        from flwr.simulation import run_simulation

        from fl_split.flower.vce import prompt_runtime

        client_app = self.client_app
        timeline: dict[str, float] = {"engine_start": t_start, "imports_done": time.perf_counter()}
        self.timeline = timeline
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
        saved_path = os.environ.get("PYTHONPATH")
        started = False
        recorder = None
        try:
            with offline_env(), warnings.catch_warnings():
                # Ray's notice about a future default of accelerator env vars (we rely on the
                # current one: an actor without --num-gpus sees no GPU)
                warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\..*")
                sigterm = _sigterm_handler()
                recorder = _Recorder()
                started = self._start_ray()
                if started and not self.cfg.ray_address:  # a local instance: every process of it is ours
                    recorder.snapshot()
                    recorder.start()
                _restore_sigterm(sigterm)
                timeline["ray_started"] = time.perf_counter()
                if self.cfg.ray_address:  # --num-cpus auto: the cluster's CPUs, known once joined
                    cfgs = self._share_cpus(cfgs, _cluster_cpus(), "in the Ray cluster")
                if client_app is None:
                    client_app = self._client_app(cfgs)
                timeline["parties_offered"] = time.perf_counter()
                watchdog.start()
                # the direct data plane runs all G + 1 ClientApps at once: past Flower's thread pool
                from fl_split.flower.resources import widened_worker_pool

                with widened_worker_pool(self.num_supernodes if any(c.data_plane == "direct" for c in cfgs) else 0), \
                        prompt_runtime():
                    run_simulation(server_app=self.server_app(list(cfgs), sink, self.poll_interval, server_done),
                                   client_app=client_app, num_supernodes=self.num_supernodes,
                                   backend_config=self.backend_config(), verbose_logging=self.verbose)
                timeline["simulation_returned"] = time.perf_counter()
        finally:
            client_app = self.handoff = None  # the slices' references: released before Ray stops
            finished.set()
            server_done.set()
            if watchdog.is_alive():
                watchdog.join()
            if started:
                import ray

                if ray.is_initialized():  # Flower shuts Ray down itself unless the simulation broke early
                    ray.shutdown()
            if recorder is not None and recorder.is_alive():
                recorder.snapshot()
                recorder.end_leftovers()
            timeline["ray_stopped"] = time.perf_counter()
            if saved_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved_path
            flwr_logger.setLevel(level)
            flwr_logger.removeHandler(quiet)
            for h, lvl in handler_levels.items():
                h.setLevel(lvl)
            self.transport = sink.get("transport")
            self.transports = sink.get("transports", [])
            self.timelines = sink.get("timelines", [])
            if self.timelines:
                timeline.update({k: v for k, v in self.timelines[0].items() if k not in timeline})
        if "error" in sink:
            raise sink["error"]
        if len(sink.get("results", ())) != len(cfgs):
            last = quiet.last_error()
            raise FlSplitError("the Flower simulation ended without results"
                               + (f": {last}" if last else " (run with verbose=True for Flower's log)"))
        return sink["results"]

    def startup(self) -> dict[str, float]:
        """Where the wall time of the last :meth:`run` / :meth:`run_series` went (seconds), from
        :attr:`timeline`: ``imports`` (the simulation driver and the apps), ``ray_start``,
        ``simulation_start`` (Flower's runtime and actor pool, until the ServerApp runs),
        ``node_registration``, ``actors_ready`` (each ClientApp's first message: actor start and its
        imports), ``setup`` (every party builds itself: data, models), then ``training`` (the first
        run's), ``reports`` and ``shutdown``."""
        t = self.timeline
        order = [("imports", "engine_start", "imports_done"), ("ray_start", "imports_done", "ray_started"),
                 ("simulation_start", "ray_started", "server_start"),
                 ("node_registration", "server_start", "nodes_registered"),
                 ("actors_ready", "nodes_registered", "roles_answered"), ("setup", "roles_answered", "setup_done"),
                 ("checks", "setup_done", "training_start"), ("training", "training_start", "training_end"),
                 ("reports", "training_end", "reports_done"), ("shutdown", "reports_done", "ray_stopped")]
        out = {name: t[b] - t[a] for name, a, b in order if a in t and b in t}
        if "engine_start" in t and "training_start" in t:
            out["before_first_batch"] = t["training_start"] - t["engine_start"]
        if "engine_start" in t and "ray_stopped" in t:
            out["total"] = t["ray_stopped"] - t["engine_start"]
        return out


def _sigterm_handler():
    """This process's Python-level SIGTERM handler (``None`` off the main thread)."""
    return signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None


def _restore_sigterm(handler) -> None:
    """Ray's driver start replaces SIGTERM's handler (a ``sys.exit`` that then waits forever for
    Flower's threads; measured: still alive after SIGTERM, or an abort with Ray's ``*** SIGTERM
    received`` dump): give SIGTERM back to the Python handler set before Ray started (the CLI's,
    :func:`fl_split.flower.processes.exit_on_signals`), if there was one."""
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _cluster_cpus() -> list[float]:
    """The CPUs of every live node of the Ray cluster this process joined."""
    import ray

    return [float(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive") and n.get("Resources")]


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
