"""``fl-split predict`` as a Flower job (issue 24): in a simulation (``--engine flower``) and in a
deployment (``--engine deploy-local``, :mod:`fl_split.deploy_predict`), each node scoring with its
own saved part and its own new table.

The parties are the objects of the one-process prediction (:class:`fl_split.predict.GuestScorer`,
:class:`~fl_split.predict.HostScorer`), built on each node from **its own** folder of the saved
model and **its own** new table: in a deployment the SuperNode's ``--node-config`` ``model-dir``
(the folder ``train --save-model`` wrote there: ``model-dir/<party>/``), ``data-path`` (its new
table) and, at the host, ``predict-out`` (where it writes the predictions); in a simulation the job's
paths (one user runs every party). The coordinator sends ``query.predict`` messages (field ``op``):

1. ``open`` to every node: it loads and checks its own part (SHA-256 of each file) and reads its
   table; it answers with its part's **manifest** (public: architecture, shapes, the run's public
   configuration, file digests — no weight, no label, no secret), from which the coordinator checks
   that the parts make one model (:func:`fl_split.serving.check_parts`); with ``--align psi`` the
   answer carries the node's PSI start;
2. the alignment of the new IDs, as in training (:mod:`fl_split.flower.alignment`): ``psi-blind``
   rounds and ``psi-finish`` (:func:`fl_split.psi.run_psi`: the coordinator sees blinded values and
   sizes only, each node learns the intersection) or, with ``--align public``, the host's sorted ID
   list sent to every guest (``public-ids`` / ``public-accept``), as ``--align public`` publishes it in
   training. Each node answers with a digest of its list; the coordinator checks they agree;
3. ``release`` to every guest: within **its own inference limits** (a deployment: its node config's
   ``inference-budget`` and ``max-queries-per-id``, else the defaults; the job's ``budget`` and
   ``max_queries_per_id`` can only tighten them; docs/serving.md "Inference limits"; a refusal is one
   line in the guest's log and one at the coordinator, nothing released or charged) it charges its
   **inference ledger** (``model-dir/<guest>/inference-
   ledger.npz``, on its own machine) one release per scored record, then releases the cut-layer
   output of the shared rows through its saved mechanism with fresh noise
   (:meth:`~fl_split.predict.GuestScorer.release`); the reply carries the released values (as every
   training release travels through the relay) and its privacy report;
4. ``score`` to the host, with the released values: it merges, runs its top and writes the
   predictions, owner-only (:func:`fl_split.predict.write_predictions`); its reply is the summary —
   the number of records, the task and, when its table has the label, the task's metrics (the
   aggregate a training run reports too). No prediction and no ID leaves the host.

The coordinator never holds a model part (manifests only) nor an ID outside the intersection (with
``psi``: none at all). A node keeps its shared list and its PSI state in its ``context.state``.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Any

import numpy as np
from flwr.app import ConfigRecord

from fl_split.config import RunConfig
from fl_split.errors import ConfigError, DataError, ProtocolError
from fl_split.flower import records as R
from fl_split.flower.records import FederationError

#: the Flower message type of the prediction job (one type; the step is the request's ``op``)
MSG_PREDICT = "query.predict"
#: context.state keys of a node in the prediction job: its shared list, its PSI state
SHARED = "fl_split.predict.shared"
PSI_STATE = "fl_split.predict.psi"


# -- the job ----------------------------------------------------------------------------------------
def job_spec(id_column: str, label_column: str, align: str, budget: float | None, guests: int,
             model: str = "", tables: dict[str, str] | None = None, out: str = "",
             max_queries_per_id: int | None = None, limits=None) -> dict[str, Any]:
    """The prediction job every node receives. ``budget`` and ``max_queries_per_id``: the coordinator's
    inference limits, which only tighten each guest's own (``None``: not set). ``model``, ``tables``,
    ``out`` and ``limits`` (the guests' own :class:`~fl_split.predict.InferenceLimits`) only in a
    simulation (one user runs every party); a deployment's nodes take them from their own node config."""
    from fl_split.predict import check_limits

    if align not in ("public", "psi"):
        raise ConfigError("align", align, "public or psi")
    check_limits(budget, max_queries_per_id)
    spec: dict[str, Any] = {"id_column": id_column, "label_column": label_column, "align": align,
                            "budget": budget, "max_queries_per_id": max_queries_per_id, "guests": int(guests)}
    if model:
        spec.update(model=model, tables=dict(tables or {}), out=out)
        if limits is not None:
            spec["limits"] = {"budget": limits.budget, "max_queries_per_id": limits.max_queries_per_id}
    return spec


# -- a node -----------------------------------------------------------------------------------------
def _paths(role, node_config: dict, spec: dict) -> tuple[str, str, str]:
    """``(model dir, new table, predictions file)`` of this node: its own node config in a deployment
    (paths in the job are refused there: the coordinator does not choose a party's files)."""
    if role.mode != "deployment":
        return str(spec["model"]), str(spec["tables"][role.party]), str(spec.get("out", ""))
    if spec.get("model") or spec.get("tables") or spec.get("out"):
        raise FederationError(f"{role.party}: the prediction job names files; in a deployment each SuperNode "
                              f"takes its own from its node config (model-dir, data-path, predict-out)")
    model = str(node_config.get("model-dir", "") or "").strip()
    if not model:
        raise FederationError(f"{role.party} node-config: no model-dir; a node that predicts loads its own saved "
                              f"part: --node-config \"... model-dir='/path/to/model'\" (the folder holding "
                              f"{role.party}/, written by train --save-model)")
    out = str(node_config.get("predict-out", "") or "").strip()
    if role.role == "host" and not out:
        raise FederationError("host node-config: no predict-out; the host writes the predictions on its own "
                              "machine: --node-config \"... predict-out='/path/to/pred.csv'\"")
    # a kit's SuperNode names where its new rows will be (kit.toml predict-data-path): read when the job
    # comes, so new rows need no restart; else its data-path (loopback predict gives the new table there)
    table = str(node_config.get("predict-data-path", "") or "").strip() or role.data_path
    if not os.path.isfile(os.path.expanduser(table)):
        # (the file's name only: the message reaches the coordinator, the party's folders are its own)
        raise FederationError(f"{role.party}: no table of new rows, {os.path.basename(table)!r} (its node config's "
                              f"{'predict-data-path' if node_config.get('predict-data-path') else 'data-path'}): "
                              f"put the rows to score there, with the columns of its training table")
    return model, table, out


def guest_limits(role, node_config: dict, spec: dict):
    """This guest's own :class:`~fl_split.predict.InferenceLimits`: in a deployment its node config's
    ``inference-budget`` and ``max-queries-per-id`` (absent: the defaults; limits in the job are refused
    there: the coordinator does not set a party's own limits); in a simulation the job's ``limits``."""
    from fl_split.predict import DEFAULT_MAX_QUERIES_PER_ID, InferenceLimits

    if role.mode != "deployment":
        own = spec.get("limits") or {}
        return InferenceLimits(own.get("budget"), own.get("max_queries_per_id", DEFAULT_MAX_QUERIES_PER_ID))
    if spec.get("limits"):
        raise FederationError(f"{role.party}: the prediction job sets the guests' own inference limits; in a "
                              f"deployment each guest takes its own from its node config (inference-budget, "
                              f"max-queries-per-id); a job's budget can only tighten them")
    raw_b, raw_q = (str("" if node_config.get(k) is None else node_config[k]).strip()
                    for k in ("inference-budget", "max-queries-per-id"))
    try:
        budget = None if not raw_b else float(raw_b)
        queries = DEFAULT_MAX_QUERIES_PER_ID if not raw_q else int(raw_q)
        return InferenceLimits(budget, queries)
    except (ConfigError, ValueError):
        raise FederationError(f"{role.party} node-config: inference-budget={raw_b!r}, max-queries-per-id={raw_q!r}; "
                              f"allowed: a number > 0 (or unset: the ε of max-queries-per-id releases of one "
                              f"record) and an integer >= 1 (unset: {DEFAULT_MAX_QUERIES_PER_ID})") from None


def _scorer(role, node_config: dict, spec: dict):
    from fl_split.predict import GuestScorer, HostScorer

    model, table, _ = _paths(role, node_config, spec)
    if role.role == "host":
        return HostScorer(model, "host", table, spec["id_column"], spec["label_column"])
    return GuestScorer(model, role.party, table, spec["id_column"], limits=guest_limits(role, node_config, spec))


def _shared(role, state) -> np.ndarray:
    rec = state.config_records.get(SHARED)
    if rec is None:
        raise ProtocolError(f"{role.party}: no aligned ID list on this node; the prediction job aligns first")
    return np.frombuffer(bytes(rec["ids"]), "<i8").astype(np.int64)


def _keep(state, shared: np.ndarray) -> str:
    from fl_split.psi import ids_digest

    state[SHARED] = ConfigRecord({"ids": np.ascontiguousarray(shared, "<i8").tobytes()})
    return ids_digest(shared)


def handle_predict(role, req, context) -> dict[str, Any]:
    """One ``query.predict`` step at this node (module docstring); returns the reply's values."""
    from fl_split.flower.alignment import node_peer_limit, psi_step

    spec = R.loads(str(req["job"]))
    op = str(req.get("op", ""))
    state, node_config = context.state, dict(context.node_config)
    scorer = _scorer(role, node_config, spec)  # its own part, checked, and its own table (every step)
    parties = list(scorer.manifest["parties"])
    aligned = SHARED in state.config_records
    if op == "open":
        reply: dict[str, Any] = {"manifest": R.dumps(scorer.manifest)}
        if spec["align"] == "psi":
            reply["frame"] = psi_step(role.party, parties, scorer.ids, state, "psi-start", None, PSI_STATE)
        return reply
    if op in ("psi-blind", "psi-finish", "public-ids", "public-accept"):
        if aligned:
            raise ProtocolError(f"{role.party}: '{op}' after this node agreed on its shared ID list")
        want = "psi" if op.startswith("psi") else "public"
        if spec["align"] != want:
            raise ProtocolError(f"{role.party}: '{op}' but the job aligns with --align {spec['align']}")
    if op == "psi-blind":
        return {"frame": psi_step(role.party, parties, scorer.ids, state, op, _bytes(req, "frame", role), PSI_STATE,
                                  limits=node_peer_limit(scorer.ids, node_config))}  # its own bound on a peer's set
    if op == "psi-finish":
        return {"digest": _keep(state, psi_step(role.party, parties, scorer.ids, state, op,
                                                _bytes(req, "frame", role), PSI_STATE))}
    if op == "public-ids":
        _expect(role, "host", op)
        shared = np.sort(scorer.ids)
        _keep(state, shared)
        return {"ids": np.ascontiguousarray(shared, "<i8").tobytes()}
    if op == "public-accept":
        from fl_split.data.own import check_public_ids

        _expect(role, "guest", op)
        raw = _bytes(req, "ids", role)
        if len(raw) % 8:
            raise ProtocolError(f"{role.party}: the host's ID list of {len(raw)} bytes is not int64s")
        shared = np.frombuffer(raw, "<i8").astype(np.int64)
        if shared.size > 1 and not np.all(np.diff(shared) > 0):
            raise ProtocolError(f"{role.party}: the host's ID list is not sorted and unique")
        check_public_ids(scorer.ids, shared, scorer.where)  # every published ID must be in its table
        return {"digest": _keep(state, shared)}
    if op == "release":
        from fl_split.errors import BudgetExceeded
        from fl_split.predict import InferenceRefused

        _expect(role, "guest", op)
        try:
            value, report = scorer.release(_shared(role, state), spec["budget"], spec.get("max_queries_per_id"))
        except (InferenceRefused, BudgetExceeded) as exc:  # one line here; the coordinator gets the same one
            import logging

            logging.getLogger("fl_split.flower").warning("%s", exc)
            raise
        report["ledger"] = f"{role.party}/inference-ledger.npz in its model-dir" if report.get("covered") else None
        buf = io.BytesIO()
        np.save(buf, value.detach().cpu().numpy(), allow_pickle=False)
        return {"value": buf.getvalue(), "privacy": R.dumps(report)}
    if op == "score":
        import torch

        from fl_split.predict import write_predictions

        _expect(role, "host", op)
        shared = _shared(role, state)
        released = {}
        for g in scorer.manifest["guest_shapes"]:
            arr = np.load(io.BytesIO(_bytes(req, f"released.{g}", role)), allow_pickle=False)
            if arr.shape[0] != len(shared):
                raise ProtocolError(f"host: {g}'s release has {arr.shape[0]} rows, the shared list {len(shared)}")
            released[g] = torch.from_numpy(np.ascontiguousarray(arr))
        _, _, out = _paths(role, node_config, spec)
        summary = write_predictions(scorer, shared, released, R.loads(str(req["privacy"])), out)
        summary["out"] = "the host's predict-out" if role.mode == "deployment" else out  # its path stays with it
        return {"summary": R.dumps(summary)}
    raise ProtocolError(f"{role.party}: unknown prediction step {op!r}")


def _bytes(req, key: str, role) -> bytes:
    v = req.get(key, None)
    if not isinstance(v, (bytes, bytearray)):
        raise ProtocolError(f"{role.party}: the request's {key!r} is not bytes")
    return bytes(v)


def _expect(role, want: str, op: str) -> None:
    if role.role != want:
        raise ProtocolError(f"{role.party}: '{op}' is for the {want}, this node hosts a {role.role}")


# -- the coordinator --------------------------------------------------------------------------------
def _route(transport, job_json: str):
    """:class:`~fl_split.flower.alignment.FlowerPsiRoute` over ``query.predict`` messages."""
    from fl_split.flower.alignment import FlowerPsiRoute

    class PredictPsiRoute(FlowerPsiRoute):
        def _ask(self, requests):
            return ask(self.transport, job_json, requests)

        def finish(self, frames):
            rep = self._ask({p: {"op": "psi-finish", "frame": b} for p, b in frames.items()})
            return {p: str(r.get("digest", "")) for p, r in rep.items()}

    return PredictPsiRoute(transport, job_json)


def ask(transport, job_json: str, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return transport.exchange({p: (MSG_PREDICT, R.content(job=job_json, **v)) for p, v in requests.items()}, None)


def predict_nodes(transport, spec: dict[str, Any], log=None) -> dict[str, Any]:
    """The prediction job over the federation of ``transport`` (module docstring); returns the summary
    (records, task, the host's predictions file, metrics when the host has the label, each guest's
    privacy report, the alignment's sizes)."""
    from fl_split.flower.alignment import _frame, psi_over
    from fl_split.serving import check_parts

    say = log or (lambda line: None)
    job = R.dumps(spec)
    parties = ["host", *transport.guests]
    t0 = time.perf_counter()
    opened = ask(transport, job, {p: {"op": "open"} for p in parties})
    manifests = {p: R.loads(str(r["manifest"])) for p, r in opened.items()}
    check_parts(manifests)  # the parts make one model: public manifests only, never a weight
    say(f"predict: every party loaded its own part ({', '.join(parties)}); the parts make one model")
    if spec["align"] == "psi":
        route = _route(transport, job)
        route.say = say
        route.started = {p: _frame(r, "frame", p) for p, r in opened.items()}
        alignment: dict[str, Any] = psi_over(route, parties)
        n = alignment["shared_ids"]
    else:
        from fl_split.psi import ids_digest

        host_ids = _frame(ask(transport, job, {"host": {"op": "public-ids"}})["host"], "ids", "host")
        digests = ask(transport, job, {g: {"op": "public-accept", "ids": host_ids} for g in transport.guests})
        want = ids_digest(np.frombuffer(host_ids, "<i8"))
        for g, r in digests.items():
            if str(r.get("digest", "")) != want:
                raise DataError(f"--align public: {g} accepted another ID list than the host published")
        n = len(host_ids) // 8
        alignment = {"align": "public", "shared_ids": int(n)}
    say(f"predict: {n} new records shared by every party (--align {spec['align']})")
    rel = ask(transport, job, {g: {"op": "release"} for g in transport.guests})
    privacy = {g: R.loads(str(r["privacy"])) for g, r in rel.items()}
    values = {f"released.{g}": _frame(r, "value", g) for g, r in rel.items()}
    host = ask(transport, job, {"host": {"op": "score", "privacy": R.dumps(privacy), **values}})["host"]
    summary = R.loads(str(host["summary"]))
    summary["alignment"] = {**alignment, "time_s": round(time.perf_counter() - t0, 3)}
    for g, r in privacy.items():
        say(f"{g}: {r['mechanism']}, epsilon {r['epsilon']:.4g} over all its inference releases" if r.get("covered")
            else f"{g}: {r.get('note', 'not covered')}")
    return summary


def federation_config(manifest_config: dict[str, Any], guests: int, **overrides: Any) -> RunConfig:
    """The configuration a prediction job's federation runs under: the saved run's public
    configuration (its ``--node-timeout``, devices…), relay data plane (scoring is one exchange per
    step), nothing to save, check or checkpoint."""
    values = dict(guests=int(guests), engine="flower", data_plane="flower", progress=False, save_model="",
                  checkpoint_dir="", resume=False, init_from="", data="")
    values.update(overrides)
    return RunConfig.from_mapping(manifest_config).replace(**values)


# -- running it --------------------------------------------------------------------------------------
def predict_job(grid, cfg: RunConfig, spec: dict[str, Any], poll: float | None = None, log=None) -> dict[str, Any]:
    """Discover the federation (``cfg``: guests, node timeout) and run the job ``spec`` on it."""
    from fl_split.flower.transport import POLL_INTERVAL, discover

    transport = discover(grid, cfg, POLL_INTERVAL if poll is None else poll)
    return predict_nodes(transport, spec, log)


def predict_server_app(cfg: RunConfig, spec: dict[str, Any], sink: dict[str, Any], poll: float, done=None):
    """A ServerApp running the job for an in-process simulation; the summary (or the error) lands in
    ``sink`` as :func:`fl_split.flower.strategy.make_server_app`'s results do."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def _main(grid, context) -> None:  # noqa: ARG001
        sink["results"], sink["transports"], sink["timelines"] = [], [], []
        try:
            sink["results"].append(predict_job(grid, cfg, spec, poll))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            sink["error"] = exc
        finally:
            if done is not None:
                done.set()

    return app


def run_flwr_job(grid, cfg: RunConfig, job_text: str) -> None:
    """The ServerApp of ``flwr run`` with the run-config key ``predict-job`` (a deployment's
    prediction, :mod:`fl_split.deploy_predict`): run it, write the summary to ``cfg.out``."""
    import logging

    from fl_split.results import write_json_atomic

    log = logging.getLogger("fl_split.flower")
    try:
        spec = json.loads(job_text)
    except ValueError:
        raise ConfigError("predict-job", job_text[:40], "the JSON of a prediction job") from None
    if spec.get("model") or spec.get("tables") or spec.get("out"):
        raise ConfigError("predict-job", "(paths)", "a job without paths",
                          reason="in a deployment each SuperNode takes its files from its own node config")
    summary = predict_job(grid, cfg, spec, log=lambda line: log.info("%s", line))
    if cfg.out:
        write_json_atomic(cfg.out, summary)
