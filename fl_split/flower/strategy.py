"""The coordinator of vertical split learning on Flower: :class:`VerticalSplitStrategy` and the
ServerApps built on it (``strategies/server_app.py`` is a thin shell over this module).

Vertical split learning is not FedAvg: nothing is aggregated. The coordinator schedules and never
sees raw data, labels or weights. The strategy

1. waits for the expected ``G + 1`` nodes (``--node-timeout``), asks each for its role and
   validates the federation (one host, guests ``1..G`` each once);
2. sends every party the run configuration (``setup``) and rebuilds the run plan from the
   host's public facts;
3. trains:

   * ``--data-plane direct`` (default): checks that every ClientApp can run at once, then one
     ``train.epoch`` message per party per epoch (``--epochs-per-message``): the host drives the
     shared coordinator loop and reaches its guests over the direct data plane
     (:mod:`fl_split.flower.direct`);
   * ``--data-plane flower`` (relay): the shared coordinator loop :func:`fl_split.engine.coordinate`
     here, over a :class:`~fl_split.flower.transport.FlowerTransport` — every tensor in a Flower
     message, ``--batches-per-round`` batches per round;

4. asks every party for its report and returns the same results dictionary as the local engine
   (and writes it to ``--out`` under ``flwr run``).

A party's error reply stops the run with :class:`~fl_split.errors.PartyError` (party, round, error);
a refused release (:class:`~fl_split.errors.BudgetExceeded`) stops it cleanly with
``stopped_reason: "budget"``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fl_split.config import RunConfig
from fl_split.flower.transport import POLL_INTERVAL, FlowerTransport, discover, setup

log = logging.getLogger("fl_split.flower")


def check_options(cfg: RunConfig) -> None:
    """Options the Flower coordinator cannot honour, refused before any node is contacted (the
    ServerApp in a deployment; the in-process simulation also before Ray starts)."""
    from fl_split.errors import ConfigError

    if cfg.data_plane == "flower" and cfg.on_guest_failure == "pad" and not cfg.secure_merge:
        raise ConfigError("on-guest-failure", "pad", "stop with --data-plane flower",
                          reason="a relay round ends with the first error reply, so the other guests' releases "
                                 "of the round are lost with a failed guest (with --secure-merge every guest left "
                                 "releases the round again, so the relay pads there); pad runs on the direct "
                                 "data plane")


class VerticalSplitStrategy:
    """Coordinates one vertical split-learning run over a Flower :class:`Grid`.

    ``timeline`` (optional) receives ``time.perf_counter()`` marks of the run's phases
    (``server_start``, ``nodes_registered``, ``setup_done``, ``training_start``, ``training_end``,
    ``reports_done``): the start-up breakdown of ``experiments/bench_flower.py``."""

    def __init__(self, cfg: RunConfig, poll_interval: float = POLL_INTERVAL, timeline: dict | None = None,
                 fit_resources: bool = False) -> None:
        self.cfg = cfg
        #: ``flwr run .``: fit the data plane to the federation Flower gives (:func:`fit_data_plane`)
        #: instead of stopping when the direct data plane's ClientApps cannot all run at once
        self.fit_resources = fit_resources
        self.poll_interval = poll_interval
        self.transport: FlowerTransport | None = None
        self.plan = None
        self.timeline = timeline
        self.checkpoints = None
        #: ``data = "node-tables"``: how the nodes aligned their IDs (results["alignment"])
        self.alignment: dict[str, Any] | None = None

    def _mark(self, name: str) -> None:
        if self.timeline is not None:
            self.timeline.setdefault(name, time.perf_counter())

    def configure(self, grid: Grid) -> FlowerTransport:
        """Discover and validate the federation, set the parties up; returns the transport."""
        self._mark("server_start")
        check_options(self.cfg)
        self.transport = discover(grid, self.cfg, self.poll_interval, on_registered=lambda: self._mark("nodes_registered"))
        self._mark("roles_answered")
        log.info("federation: %s", ", ".join(f"{p} = node {n}" for p, n in self.transport.nodes.items()))
        if self.fit_resources:
            host_role = self.transport.role_replies.get("host")
            self.cfg, line = fit_data_plane(self.cfg, host_role.get("capacity") if host_role is not None else None)
            if line:
                log.warning("%s", line)
        from fl_split.flower.alignment import align_nodes, uses_node_tables

        if uses_node_tables(self.cfg):  # each node its own table: align the IDs between the nodes first
            self.alignment = align_nodes(self.transport, self.cfg, lambda line: log.info("%s", line))
            self._mark("aligned")
        checkpoint = None
        if self.cfg.checkpoint_dir:
            from fl_split.checkpoint import Checkpointer

            self.checkpoints = Checkpointer(self.cfg, "flower")
            state = self.checkpoints.start()
            if self.cfg.resume:  # the newest round every party checkpointed, maybe past the last commit
                from fl_split.flower.direct import resume_round

                resume_round(self.transport, self.cfg, self.checkpoints)
            checkpoint = {"run": state.run, "round": state.round, "resume": bool(self.cfg.resume)}
            if self.cfg.resume:  # guests the run went on without (--on-guest-failure pad) stay out of it
                from fl_split.flower.direct import _padded

                checkpoint["out"] = sorted(_padded(self.checkpoints.state.guest_failures))
        # the relay pads only under --secure-merge (check_options), whose guests release the round again
        self.transport.pad = self.cfg.data_plane == "flower" and self.cfg.on_guest_failure == "pad"
        self.plan = setup(self.transport, self.cfg, checkpoint)
        if self.checkpoints is not None and not self.cfg.resume:
            # every party saved round 0 at setup: a run killed inside its first message resumes
            self.checkpoints.commit()
        self.transport.public_plan = {"task": self.plan.task, "num_outputs": int(self.plan.num_outputs)}
        self._mark("setup_done")
        if self.cfg.data_plane == "direct":
            from fl_split.flower.direct import check_direct

            check_direct(self.cfg, self.transport.setup_replies.get("host"), self.cfg.guests)
        from fl_split.privacy.diagnostics import hopeless_releases

        for line in hopeless_releases(self.plan):
            log.warning("%s", line)
        return self.transport

    def run(self, grid: Grid, write_out: bool = False) -> dict[str, Any]:
        """Train and evaluate; returns the results dictionary (see README, "Results JSON")."""
        transport = self.configure(grid)
        try:
            if self.cfg.data_plane == "direct":
                from fl_split.flower.direct import coordinate_direct

                if self.cfg.secure_merge:  # the run's session, before any epoch (the relay's: in coordinate);
                    # a resume's is new too, among the guests still in the run (pad: not those it went on without)
                    from fl_split.flower.direct import _padded

                    out = _padded(self.checkpoints.state.guest_failures) if self.checkpoints is not None else {}
                    transport.secure_rekey([g for g in transport.guests if g not in out])
                results = coordinate_direct(self.cfg, self.plan, transport, transport.setup_replies.get("host"),
                                            timeline=self.timeline, checkpoints=self.checkpoints)
            else:
                from fl_split.engine import coordinate
                from fl_split.flower.direct import epoch_line

                self._mark("training_start")
                # each epoch is logged as its evaluation round ends (`flwr run --stream` shows it then),
                # as the direct data plane logs it when its control message returns
                results = coordinate(self.cfg, self.plan, transport, "flower",
                                     on_epoch=lambda row, _: log.info("%s", epoch_line(row, self.plan.metric)))
                self._mark("training_end")
        except Exception as exc:  # every party still up hears how the run ended, then the error goes on
            if hasattr(transport, "tell_stopped"):
                transport.tell_stopped(f"{type(exc).__name__}: {exc}", getattr(exc, "party", None))
            raise
        self._mark("reports_done")
        if self.alignment is not None:
            results["alignment"] = self.alignment
        for party, rep in results.get("privacy", {}).items():
            log.info("%s", privacy_line(party, rep))
        if results.get("stopped_reason", "completed") != "completed":
            log.warning("stopped early (%s): %s", results["stopped_reason"], results.get("stopped_detail", ""))
        if results.get("status") == "degraded":
            log.warning("status: degraded: %s", results.get("status_detail", ""))
        if write_out and self.cfg.out:
            from fl_split.results import write_json_atomic

            write_json_atomic(self.cfg.out, results)
            log.info("results written to %s", self.cfg.out)
        return results


def fit_data_plane(cfg: RunConfig, capacity) -> tuple[RunConfig, str | None]:
    """``flwr run .`` with the federation Flower creates by default (2 SuperNodes reserving 2 CPUs
    each) runs one ClientApp at a time on a 2-core machine, and the direct data plane needs all
    ``G + 1`` at once. The ServerApp cannot change the federation's resources, so it changes what
    it runs: the relay data plane (``--data-plane flower``: every tensor in a Flower message, one
    ClientApp at a time, the same rounds and results, slower). Returns the configuration to run and
    the one line that says so (``None``: unchanged). ``capacity``: the host's role reply (its Ray
    actor's reservation and the cluster; ``None`` outside a simulation — a deployment runs one
    ClientApp per SuperNode). What needs the direct plane (``--on-guest-failure pad``, checkpoints) is
    refused as before, with the capacity message."""
    from fl_split.errors import ConfigError
    from fl_split.flower import records as R
    from fl_split.flower.resources import check_capacity, check_worker_threads, pool_widened_here, slots

    if cfg.data_plane != "direct" or not capacity:
        return cfg, None
    cap = R.loads(str(capacity))
    try:
        check_capacity(cfg.guests, cap, " (measured by the host's ClientApp)")
        if not pool_widened_here():
            check_worker_threads(cfg.guests)
    except ConfigError as exc:
        try:  # what needs the direct plane (pad, checkpoints) keeps the capacity message
            relay = cfg.replace(data_plane="flower")
            check_options(relay)
        except ConfigError:
            raise exc from None
        parties = cfg.guests + 1
        fit = slots(cap["nodes"], float(cap["num_cpus"]), float(cap["num_gpus"]))
        cpus = sum(n.get("CPU", 0) for n in cap["nodes"])
        why = (f"Flower's federation fits {fit} of the {parties} ClientApps at once ({float(cap['num_cpus']):g} CPU "
               f"each, Ray has {cpus:g})" if fit < parties else exc.reason)
        return relay, (
            f"fl_split: relay data plane (--data-plane flower, one ClientApp at a time, same results, slower): {why}; "
            f"for the direct data plane run `fl-split flwr-run` or give each ClientApp fewer CPUs "
            f"(--federation-config \"client-resources-num-cpus=1 init-args-num-cpus={parties}\")")
    return cfg, None


def privacy_line(party: str, rep: dict[str, Any]) -> str:
    """One log line of a party's privacy report: mechanism, epsilon, delta, accountant, releases."""
    from fl_split.privacy.disclosure import snr_bound

    mech = rep.get("mechanism") or {}
    name = mech.get("name", "none") if isinstance(mech, dict) else str(mech)
    if rep.get("epsilon") is None:
        return f"{party}: {name}, no differential privacy claimed ({rep.get('releases', 0)} record releases)"
    snr = snr_bound(rep)
    return (f"{party}: {name}, epsilon = {rep['epsilon']:.4g} at delta = {rep['delta']:g} ({rep['accountant']} "
            f"accountant; {rep['releases']} record releases, at most {rep['releases_per_record']} per record"
            + ("" if snr is None else f"; signal-to-noise ratio at most {snr:.3g} per element") + ")")


#: run-config keys the coordinator must not use, send or write (read by the ClientApps only)
PRIVATE_KEYS = ("private-seed", "private-seed-file")
#: the run-config key of a prediction job (fl_split.flower.predicting; empty: train)
JOB_KEY = "predict-job"


def config_from_context(context: Context) -> RunConfig:
    """The run configuration of ``flwr run`` (``[tool.flwr.app.config]`` + ``--run-config``), without
    ``private-seed-file``: that path is for the parties' own secrets (simulation), never sent or
    written. A seed *value* (``private-seed``) is refused: the SuperLink stores the run config."""
    from fl_split.errors import ConfigError

    if str(context.run_config.get("private-seed", "")).strip():
        raise ConfigError("private-seed", "<hidden>", "empty; give private-seed-file = a path to an owner-only "
                          "seed file (simulation) or each SuperNode's node-config private-seed-file",
                          reason="the SuperLink stores the run config and every party can read it")
    public = {k: v for k, v in dict(context.run_config).items() if k not in PRIVATE_KEYS and k != JOB_KEY}
    return RunConfig.from_mapping(public).replace(engine="flower", progress=False)


def flwr_run_app() -> ServerApp:
    """The ServerApp of ``flwr run .``: one run configured by the app config; results go to ``out``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        _log_through_flower()
        cfg = config_from_context(context)
        job = str(context.run_config.get(JOB_KEY, "") or "").strip()
        if job:  # a deployment's prediction job (fl_split/deploy_predict.py): no training
            from fl_split.flower.predicting import run_flwr_job

            run_flwr_job(grid, cfg, job)
            return
        VerticalSplitStrategy(cfg, fit_resources=True).run(grid, write_out=True)

    return app


def _log_through_flower() -> None:
    """Send fl_split's INFO logs to Flower's handlers (they reach ``flwr run --stream`` / ``flwr log``),
    and make Flower log an fl_split error as one line (:class:`OneLineErrors`)."""
    ours, flwr_logger = logging.getLogger("fl_split"), logging.getLogger("flwr")
    ours.setLevel(logging.INFO)
    for h in flwr_logger.handlers:
        if h not in ours.handlers:
            ours.addHandler(h)
    ours.propagate = False
    if not any(isinstance(f, OneLineErrors) for f in flwr_logger.filters):
        flwr_logger.addFilter(OneLineErrors())


class OneLineErrors(logging.Filter):
    """Flower logs an exception that ends the ServerApp with its traceback (``Simulation raised an
    exception``, ``ServerApp raised an exception``; flwr 1.41). For the errors fl_split raises on
    purpose (:class:`~fl_split.errors.FlSplitError`: bad options, data, a party's error reply, a
    refused release) the message already names the flag, the party or the round: this filter on
    Flower's logger turns such a record into that one line. Any other exception keeps its traceback
    (a bug). Flower's own exit-code lines follow (not ours to change)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from fl_split.errors import FlSplitError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FlSplitError):
            text = " ".join(str(exc).split())  # one line, whatever the message's line breaks
            record.msg, record.args = "fl_split stopped the run: %s: %s", (type(exc).__name__, text)
            record.exc_info, record.exc_text = None, None
        return True


def make_server_app(cfg: RunConfig | list[RunConfig], sink: dict[str, Any], poll_interval: float = POLL_INTERVAL,
                    done: threading.Event | None = None) -> ServerApp:
    """A ServerApp running ``cfg`` — or each of a list of configurations in turn — for an
    in-process simulation (whose run-config is empty).

    The outcome lands in ``sink``: ``results`` (a list, one per configuration), or ``error`` (the
    exception, re-raised by the caller), ``transport`` / ``transports`` (exchange statistics, the
    workers that answered) and ``timelines`` (each run's phase marks); ``done`` is set when the
    ServerApp returns."""
    cfgs = [cfg] if isinstance(cfg, RunConfig) else list(cfg)
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        sink["results"], sink["transports"], sink["timelines"] = [], [], []
        try:
            for c in cfgs:
                timeline: dict[str, float] = {}
                sink["timelines"].append(timeline)
                strategy = VerticalSplitStrategy(c, poll_interval, timeline=timeline)
                try:
                    sink["results"].append(strategy.run(grid))
                finally:
                    sink["transport"] = strategy.transport
                    sink["transports"].append(strategy.transport)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, not to Flower's logs
            sink["error"] = exc
        finally:
            if done is not None:
                done.set()

    return server_app
