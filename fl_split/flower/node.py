"""One Flower node hosting one party: role, lazy construction, state in ``context.state``.

The ClientApp (``clients/client_app.py``) hands every message to :func:`handle`. A node's role
comes from its ``node_config``:

* deployment (``flower-supernode --node-config``): ``role = "host"`` or ``role = "guest"`` with
  ``guest-index = i`` (1..G), and ``data-path`` = the party's file from ``fl-split export-parties`` —
  or, when the run config says ``data = "node-tables"``, the party's own raw table, aligned by the
  ServerApp's alignment phase (:mod:`fl_split.flower.alignment`, ``query.align`` messages);
* simulation: ``partition-id`` (0 = host, 1..G = guests); the node prepares the dataset itself
  (once per process) and keeps only its party's slice.

The party is built lazily from the run configuration the coordinator sends with ``setup``, with a
secret of its own (:class:`~fl_split.seeding.PartySecret`) created *here*, on the party's node:
fresh OS entropy, or derived from a private seed file the coordinator never reads (see
:func:`private_seed_of`). Its whole state (secret, models, optimizer, pending batches, ledger,
receiver caches) is written to ``context.state`` after every message
(:func:`fl_split.parties.export_flat`),
so any process can continue it — in deployment each message may start a fresh ClientApp process,
in simulation a node's messages go to whichever Ray actor is free. A per-process cache keyed by a
token stored beside the state skips the restore when this process handled the node's previous
message (the restored and the live party train bit-identically; the cache only saves time).

Direct data plane (``train.epoch``, :mod:`fl_split.flower.direct`): the host plays the message's
epochs and its guests serve it over gRPC streams; releases leave the party during the message, so
its state is saved whatever ends it (what it released is recorded, once).

Anything a party raises is answered with an error record (:func:`fl_split.flower.records.error_record`);
for the relay's per-round messages the node's state is left as it was before the message.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Context, Message

from fl_split.config import RUN_PLACEHOLDER, RunConfig
from fl_split.errors import ConfigError, ProtocolError
from fl_split.flower import records as R
from fl_split.flower.alignment import MSG_ALIGN
from fl_split.flower.predicting import MSG_PREDICT
from fl_split.flower.records import FederationError

#: (run id, node id) -> (state token, live party)
_PARTIES: dict[tuple[int, int], tuple[str, Any]] = {}


@dataclass(frozen=True)
class NodeRole:
    party: str          # "host" or "guest-i"
    role: str           # "host" or "guest"
    guest_index: int    # 0 for the host
    mode: str           # "simulation" or "deployment"
    data_path: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"party": self.party, "role": self.role, "guest-index": self.guest_index, "mode": self.mode,
                "data-path": self.data_path}


def node_role(node_config: dict[str, Any]) -> NodeRole:
    """The party this node hosts, from its ``node_config`` (see module docstring)."""
    if "role" in node_config:
        role = str(node_config["role"]).strip().lower()
        path = str(node_config.get("data-path", "")).strip()
        if not path:
            raise FederationError("node-config: 'data-path' is missing; a deployment node needs its party "
                                  "file (fl-split export-parties), e.g. --node-config \"role='guest' "
                                  "guest-index=1 data-path='parties/guest-1.npz'\"")
        if role == "host":
            return NodeRole("host", "host", 0, "deployment", path)
        if role == "guest":
            raw = node_config.get("guest-index")
            try:
                idx = int(raw)
                if isinstance(raw, float) and not float(raw).is_integer():
                    raise ValueError
            except (TypeError, ValueError):
                raise FederationError(f"node-config: guest-index is {raw!r}; a guest node needs an integer "
                                      f"guest-index >= 1") from None
            if idx < 1:
                raise FederationError(f"node-config: guest-index is {idx}; allowed: an integer >= 1")
            return NodeRole(f"guest-{idx}", "guest", idx, "deployment", path)
        raise FederationError(f"node-config: role is {node_config['role']!r}; allowed: 'host' or 'guest'")
    if "partition-id" in node_config:
        pid = int(node_config["partition-id"])
        if pid == 0:
            return NodeRole("host", "host", 0, "simulation")
        return NodeRole(f"guest-{pid}", "guest", pid, "simulation")
    raise FederationError("node-config has neither 'role' (deployment: role, guest-index, data-path) nor "
                          "'partition-id' (simulation)")


@functools.lru_cache(maxsize=1)
def worker_id() -> str:
    """Where this process runs: the Ray node ID inside a simulation actor, else host:pid."""
    try:
        import ray

        if ray.is_initialized():
            return "ray:" + ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - Ray absent or not in a Ray worker
        pass
    return f"{socket.gethostname()}:{os.getpid()}"


# -- building a party ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _simulation_plan(cfg: RunConfig):
    from fl_split.builder import plan_run, prepare_data

    return plan_run(cfg, prepare_data(cfg))


@functools.lru_cache(maxsize=4)
def _deployment_data(path: str, mtime: float):
    from fl_split.party_files import load_party

    return load_party(path)


@functools.lru_cache(maxsize=4)
def _deployment_plan(cfg: RunConfig, path: str, mtime: float):
    from fl_split.party_files import check_facts, plan_from_facts

    _, facts = _deployment_data(path, mtime)
    check_facts(cfg, facts, f"party file {path!r}")
    return plan_from_facts(cfg, facts)


def private_seed_of(role: NodeRole, context: Context, given=None):
    """The :class:`~fl_split.seeding.PrivateSeed` this node's party derives its secret from, or
    ``None`` (OS entropy).

    * ``given``: passed to the ClientApp by an in-process simulation (``fl-split train --engine
      flower --private-seed-file F``), whose run-config is empty;
    * simulation under ``flwr run``: the run-config key ``private-seed-file`` (a path, read here on
      the node; all parties run under one user and the ServerApp drops the key);
    * deployment: only the SuperNode's own ``--node-config "private-seed-file='PATH'"`` (an
      owner-only file on the node's machine). A ``private-seed-file`` in the run config is refused
      there: the coordinator and every party choose the run config, not this party.

    A seed *value* is refused everywhere: in the run config the SuperLink stores it (and every
    party can read it), in the node config it is on the SuperNode's command line (readable by
    every local user in ``/proc/PID/cmdline``).
    """
    from fl_split.seeding import PrivateSeed, PrivateSeedError

    if str(context.run_config.get("private-seed", "")).strip():
        raise FederationError("private-seed is set in the run config, which the SuperLink stores and every party "
                              "can read; allowed: a path to an owner-only seed file, run-config private-seed-file "
                              "(simulation) or this SuperNode's node-config private-seed-file (deployment)")
    if str(context.node_config.get("private-seed", "")).strip():
        raise FederationError(f"{role.party}: private-seed is set in the node config, which is on the SuperNode's "
                              f"command line (readable by every local user); allowed: node-config "
                              f"private-seed-file='PATH' of an owner-only file")
    run_file = str(context.run_config.get("private-seed-file", "")).strip()
    node_file = str(context.node_config.get("private-seed-file", "")).strip()
    if role.mode == "deployment":
        if run_file:
            raise FederationError("private-seed-file is set in the run config, which the coordinator and every "
                                  "party choose; set it in this SuperNode's --node-config instead (or leave it "
                                  "out for fresh OS entropy)")
        path, what = node_file, "node-config private-seed-file"
    elif given is not None:
        return PrivateSeed.coerce(given)
    else:
        path, what = run_file or node_file, "private-seed-file"
    if not path:
        return None
    try:
        seed = PrivateSeed.read_file(path, what)
        if seed.party is not None:
            seed.party_key(role.party)  # a node's own seed file must be this party's
    except PrivateSeedError as exc:
        raise FederationError(f"{role.party}: {exc}") from None
    return seed


def plan_of(cfg: RunConfig, role: NodeRole, state=None, handoff=None):
    """The run plan this node's party was built from (cached per process; ``state``: the node's
    ``context.state``, where a node reading its own table keeps its aligned ID list; ``handoff``:
    see :func:`build_party`)."""
    if role.mode == "simulation":
        plan = handoff.plan(cfg, role.party) if handoff is not None else None
        return plan if plan is not None else _simulation_plan(cfg)
    if _node_tables(cfg):
        from fl_split.flower.alignment import node_plan

        return node_plan(cfg, role, state)
    path = os.path.abspath(os.path.expanduser(role.data_path))
    return _deployment_plan(cfg, path, os.path.getmtime(path) if os.path.exists(path) else 0.0)


def _set_threads(cfg: RunConfig, role: NodeRole) -> None:
    """This ClientApp's torch threads (``--threads``; ``auto``: the whole CPUs its Ray actor reserves,
    else 1 — :func:`fl_split.devices.party_threads`). Skipped where the parties are threads of one
    process (no Ray actor: the caller's setting stands)."""
    from fl_split.devices import apply_threads, party_threads
    from fl_split.flower.resources import capacity_here

    cap = capacity_here() if role.mode == "simulation" else None
    if role.mode == "simulation" and cap is None:
        return
    # Ray's CPUs are logical (flwr run's federation may count more than the cores): at most this
    # machine's cores shared by the G + 1 parties that train at once
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    apply_threads(party_threads(cfg.threads, cap["num_cpus"] if cap else None, max(1, cores // (cfg.guests + 1))))


def _node_tables(cfg: RunConfig) -> bool:
    from fl_split.flower.alignment import uses_node_tables

    return uses_node_tables(cfg)


def build_party(cfg: RunConfig, role: NodeRole, private_seed: int | None = None, secret=None, state=None,
                handoff=None):
    """``(party, public facts)`` of this node for ``cfg``, with its own secret (``secret``: the
    one restored from the node's state; else fresh or from ``private_seed``). ``state``: the node's
    ``context.state`` (a node reading its own table: its aligned ID list, :mod:`fl_split.flower.alignment`).
    A simulated node takes its slice from ``handoff`` (:class:`fl_split.flower.prepared.Handoff`, what
    the driver prepared once) when that holds it, else prepares the data itself."""
    from fl_split.builder import make_guest, make_host

    data, facts, plan = _node_inputs(cfg, role, state, handoff)
    _set_threads(cfg, role)
    if role.role == "host":
        party = make_host(plan, data, private_seed=private_seed, secret=secret)
    else:
        party = make_guest(plan, data, role.party, private_seed=private_seed, secret=secret)
    if plan.cfg.secure_merge:  # as fl_split.privacy.secure_merge.setup_parties (the roster: at setup)
        from fl_split.privacy import secure_merge as sm

        if role.role == "host":
            from fl_split.privacy.factory import fixed_point_of

            party.secure_merge = fixed_point_of(plan.cfg)
        else:
            party.secure_identity = sm.identity_from_seed(party.secret.derive_bytes("secure-merge identity"))
    return party, facts


def _own_identity(party, role: NodeRole, node_config) -> None:
    """A deployment guest's own long-term secure-merge identity from its node-config
    ``secure-merge-identity`` (an owner-only key file its kit made at ``init``), in place of the one
    derived from its party secret (docs/deploy.md, "Secure merge in a deployment")."""
    path = str(dict(node_config).get("secure-merge-identity", "") or "").strip()
    if path and role.role == "guest" and role.mode == "deployment":
        from fl_split.privacy.secure_merge import read_identity

        party.secure_identity = read_identity(path, role.party)


def _node_inputs(cfg: RunConfig, role: NodeRole, state=None, handoff=None):
    """``(PartyData, PublicFacts, RunPlan)`` of this node (cached where the data are read)."""
    if role.role == "guest" and role.guest_index > cfg.guests:
        raise FederationError(f"{role.party}: guest-index {role.guest_index} is out of range; the run has "
                              f"--guests {cfg.guests}")
    handed = handoff.fetch(cfg, role.party) if handoff is not None and role.mode == "simulation" else None
    if handed is not None:
        data, facts, plan = handed.data, handed.facts, handoff.plan(cfg, role.party)
    elif role.mode == "simulation":
        from fl_split.builder import prepare_data
        from fl_split.party_files import public_facts

        prepared = prepare_data(cfg)
        plan = _simulation_plan(cfg)
        data = prepared.parties[role.party]
        facts = public_facts(cfg, prepared)
    elif _node_tables(cfg):  # its own table, aligned by the coordinator's alignment phase
        from fl_split.flower.alignment import node_data, node_plan

        data, facts = node_data(cfg, role, state)
        plan = node_plan(cfg, role, state)
    else:
        if cfg.one_shot:
            raise ConfigError("one-shot", True, "false in deployment", reason="one-shot pretraining needs the "
                              "public records, which party files do not hold")
        path = os.path.abspath(os.path.expanduser(role.data_path))
        mtime = os.path.getmtime(path) if os.path.exists(path) else 0.0
        data, facts = _deployment_data(path, mtime)
        if data.party != role.party:
            raise FederationError(f"node-config says this node is {role.party}, but {path!r} holds "
                                  f"{data.party}'s data")
        plan = _deployment_plan(cfg, path, mtime)
    return data, facts, plan


def _save_model(context: Context, role: NodeRole, party, config_json: str, handoff=None, req=None) -> None:
    """``--save-model``: this node's party writes its own part, on its own machine (a simulation: the
    run's directory; a deployment: the SuperNode's ``--node-config "model-dir='…'"``); the coordinator
    never holds a model (fl_split/serving.py)."""
    from fl_split.serving import save_part

    cfg = _config_of(config_json)
    if not cfg.save_model:
        return
    directory = cfg.save_model
    if role.mode != "simulation":
        directory = str(dict(context.node_config).get("model-dir", "") or "").strip()
        if not directory:
            raise FederationError(f"{role.party} node-config: no model-dir; the run saves the model (--save-model), "
                                  f"and a party keeps its part on its own machine: --node-config \"... "
                                  f"model-dir='/path/private/to/{role.party}'\"")
    plan = _node_inputs(cfg, role, context.state, handoff)[2]
    public = R.loads(str(req["plan"])) if req is not None and "plan" in req else None
    if public is not None and role.role == "guest":  # a guest reading its own table cannot resolve the task
        import dataclasses

        plan = dataclasses.replace(plan, task=str(public["task"]), num_outputs=int(public["num_outputs"]))
    save_part(party, plan, directory)


# -- state ---------------------------------------------------------------------------------------
def _save(context: Context, party, config_json: str) -> None:
    from fl_split.parties import export_flat

    arrays, skeleton = export_flat(party)
    token = uuid.uuid4().hex
    context.state[R.STATE_ARRAYS] = R.arrays_to_record(arrays)
    context.state[R.STATE_META] = ConfigRecord({"config": config_json, "party": party.name,
                                                "skeleton": R.dumps(skeleton), "token": token})
    _PARTIES[(context.run_id, context.node_id)] = (token, party)


def _restore(context: Context, role: NodeRole, handoff=None):
    from fl_split.seeding import PartySecret
    from fl_split.state import unflatten

    meta = context.state.config_records.get(R.STATE_META)
    if OUT in context.state.config_records:
        raise ProtocolError(f"{role.party}: set up out of this run (the run went on without it, "
                            f"--on-guest-failure pad): it serves no round")
    if meta is None:
        raise ProtocolError(f"{role.party}: no party is set up on this node (the coordinator sends "
                            f"'setup' before any round)")
    cached = _PARTIES.get((context.run_id, context.node_id))
    if cached is not None and cached[0] == meta["token"]:
        return cached[1], str(meta["config"])
    # the weights come from the node's state: a saved part (--init-from) is read at setup only
    cfg = RunConfig.from_mapping(R.loads(str(meta["config"]))).replace(init_from="")
    state = unflatten(R.record_to_arrays(context.state.array_records[R.STATE_ARRAYS]), R.loads(str(meta["skeleton"])))
    party, _ = build_party(cfg, role, secret=PartySecret.from_state(state["secret"]), state=context.state,
                           handoff=handoff)
    if cfg.secure_merge:
        _own_identity(party, role, context.node_config)
    party.import_state(state)
    return party, str(meta["config"])


# -- the handler ---------------------------------------------------------------------------------
def handle(message: Message, context: Context, private_seed: int | None = None, handoff=None) -> Message:
    """Answer one coordinator message (any operation) for the party this node hosts
    (``private_seed``: see :func:`private_seed_of`; ``handoff``: see :func:`build_party`)."""
    mtype = message.metadata.message_type
    key = (context.run_id, context.node_id)
    req = R.request_of(message.content) if R.REQUEST in message.content.config_records else ConfigRecord()
    round_ = -1
    who = "node"
    try:
        round_ = R.int_field(req, "round", -1)
        role = node_role(dict(context.node_config))
        who = role.party
        if mtype == R.MSG_ROLE:
            return _reply(message, role=R.dumps(role.to_json()), **_role_capacity(role))
        if mtype == R.MSG_SETUP:
            expected = str(req.get("party", role.party))
            if expected != role.party:
                raise FederationError(f"the coordinator set this node up as {expected}, but it hosts {role.party}")
            config_json = str(req["config"])
            cfg = _coordinator_config(config_json, context)
            seed = private_seed_of(role, context, private_seed)
            party, facts = build_party(_init_from_here(cfg, role, dict(context.node_config)), role, seed,
                                       state=context.state, handoff=handoff)
            extra = _dataplane_setup(cfg, role, dict(context.node_config), context.state)
            if cfg.checkpoint_dir and _out_of_the_run(context, role, req):
                facts_json = facts.without_labels().to_json()  # a guest's: the coordinator checks them
                return _reply(message, facts=R.dumps(facts_json), **extra)
            context.state.config_records.pop(OUT, None)  # a set-up in the run rebuilds the party
            if cfg.secure_merge and role.role == "guest":  # pinned here, never from a coordinator message
                from fl_split.privacy.secure_merge import read_roster, roster_from_seed

                if role.mode == "simulation":
                    party.secure_roster = roster_from_seed(seed, cfg.guests)
                else:  # the node's own file of public identities (docs/deploy.md, "Secure merge")
                    _own_identity(party, role, context.node_config)
                    path = str(dict(context.node_config).get("secure-merge-roster", "") or "").strip()
                    if not path:
                        raise ConfigError("secure-merge", True, "with a node-config secure-merge-roster on every "
                                          "guest", reason=f"{role.party} has no pinned roster of the guests' "
                                          f"identities (docs/flower.md, \"Secure merge on Flower\")")
                    party.secure_roster = read_roster(os.path.expanduser(path), cfg.guests, role.party,
                                                      party.secure_identity)
            if cfg.checkpoint_dir:
                _checkpoint_setup(context, role, party, cfg, req, seed)
            _save(context, party, config_json)
            facts_json = facts.to_json() if role.role == "host" else facts.without_labels().to_json()
            return _reply(message, facts=R.dumps(facts_json), **extra)
        if mtype == R.MSG_CHECKPOINTS:  # a resume: which rounds this party can restore
            return _reply(message, held=R.dumps(_held_rounds(context, role, req)))
        if mtype == R.MSG_STOPPED:  # the run failed elsewhere: this operator is told why, with its own ε
            try:
                own = _own_epsilon(_restore(context, role, handoff)[0])
            except Exception:  # noqa: BLE001 - set up out of the run, or failed before its set-up
                own = "no release of this party in it"
            _operator(role, f"run {context.run_id} stopped: {' '.join(str(req.get('reason', '')).split())}; {own}")
            return _reply(message)
        if mtype == MSG_ALIGN:
            from fl_split.flower.alignment import handle_align

            return _reply(message, **handle_align(_coordinator_config(str(req["config"]), context), role, req,
                                                  context.state, dict(context.node_config)))
        if mtype == MSG_PREDICT:  # the prediction job: its own part, its own new table
            from fl_split.flower.predicting import handle_predict

            return _reply(message, **handle_predict(role, req, context))
        party, config_json = _restore(context, role, handoff)
        if mtype == R.MSG_EPOCH:
            return _epoch(message, context, role, party, config_json, req, handoff)
        keys = R.keys_from_json(req.get("keys", "[]"))
        if mtype == R.MSG_STEP:
            _expect(role, "guest", mtype)
            blobs = party.step(R.blob_list(req, "owed"), keys, round_)
            _save(context, party, config_json)
            return _reply(message, blobs=blobs)
        if mtype == R.MSG_SECURE_ANNOUNCE:  # --secure-merge: a new session (fl_split/privacy/secure_merge.py)
            _expect(role, "guest", mtype)
            session = R.blob_list(req, "session")
            if len(session) != 1:
                raise ProtocolError(f"{role.party}: secure merge: a session id of 16 to 64 bytes expected")
            announcement = party.relayed_announce(bytes(session[0]), R.loads(str(req["members"])),
                                           _config_of(config_json).on_guest_failure == "pad")
            _save(context, party, config_json)
            return _reply(message, announcement=[announcement])
        if mtype == R.MSG_SECURE_AGREE:  # every member's signed key, checked against the pinned roster
            _expect(role, "guest", mtype)
            party.secure_agree(R.blob_list(req, "announcements"))
            _save(context, party, config_json)
            return _reply(message)
        if mtype == R.MSG_REDO:  # --secure-merge, pad (relay): the round again, in the session just agreed
            _expect(role, "guest", mtype)
            if _config_of(config_json).on_guest_failure != "pad":
                raise ProtocolError(f"{role.party}: a round asked again without --on-guest-failure pad; refused")
            blobs = party.redo(keys, round_)
            _save(context, party, config_json)
            return _reply(message, blobs=blobs)
        if mtype == R.MSG_DROP:  # pad (relay): the host zero-fills a failed guest from this round on
            _expect(role, "host", mtype)
            party.drop_guest(str(req["guest"]), round_)
            _save(context, party, config_json)
            return _reply(message)
        if mtype == R.MSG_HOST_TRAIN:
            _expect(role, "host", mtype)
            acts = {g: R.blob_list(req, f"acts.{g}") for g in party.guests}
            grads = party.train(keys, acts, round_)
            _save(context, party, config_json)
            return _reply(message, **{f"grads.{g}": b for g, b in grads.items()})
        if mtype == R.MSG_HOST_EVAL:
            _expect(role, "host", mtype)
            acts = {g: R.blob_list(req, f"acts.{g}") for g in party.guests}
            metrics = party.evaluate(keys, acts, round_)
            _save(context, party, config_json)
            return _reply(message, metrics=R.dumps(metrics))
        if mtype == R.MSG_REPORT:  # the run's end: the party reports (and saves its own part)
            from fl_split.devices import report_with_device

            _save_model(context, role, party, config_json, handoff, req)
            reply = _reply(message, report=R.dumps(report_with_device(party)))
            _operator(role, f"run {context.run_id} completed: {_own_epsilon(party)}; this party's part is done")
            return reply
        raise ProtocolError(f"{role.party}: unknown message type {mtype!r}")
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the coordinator
        if "role" in locals():
            _operator(role, f"run {context.run_id} failed here" + (f" in round {round_}" if round_ >= 0 else "")
                      + f": {type(exc).__name__}: {' '.join(str(exc).split())}")
        # the live object may be half-updated: forget it; context.state still holds the last good state
        _PARTIES.pop(key, None)
        return Message(R.error_record(exc, who, None if round_ < 0 else round_), reply_to=message)


def _config_of(config_json: str) -> RunConfig:
    """The run's configuration as the node keeps it with its party (JSON)."""
    return RunConfig.from_mapping(R.loads(config_json))


def _init_from_here(cfg: RunConfig, role: NodeRole, node_config: dict) -> RunConfig:
    """``--init-from``: where this node's party finds its own saved part. A simulation's nodes share
    the machine, so the run's directory holds every part (``DIR/<party>/``); a deployment node reads
    its node-config ``init-from`` (else its ``model-dir``, where ``--save-model`` wrote it): the
    coordinator's path names a folder on the coordinator's machine and is never used."""
    if not cfg.init_from or role.mode == "simulation":
        return cfg
    directory = str(node_config.get("init-from", "") or node_config.get("model-dir", "") or "").strip()
    if not directory:
        raise FederationError(f"{role.party} node-config: no init-from (or model-dir); the run continues from a "
                              f"saved model (--init-from), and a party reads its own part on its own machine: "
                              f"--node-config \"... init-from='/path/private/to/{role.party}'\" (the folder "
                              f"holding {role.party}/)")
    return cfg.replace(init_from=directory)


def _coordinator_config(config_json: str, context: Context) -> RunConfig:
    """The run configuration the coordinator sent, after refusing (before any import) code it names
    that this deployment node's operator did not allow (:func:`fl_split.plugins.check_node_plugins`)."""
    from fl_split.plugins import check_node_plugins

    values = R.loads(config_json)
    check_node_plugins(values, dict(context.node_config))
    return own_limits(RunConfig.from_mapping(values), dict(context.node_config))


#: a deployment node's own training limits (node-config key: the run option); a job can only tighten them
OWN_LIMITS = {"budget": "budget", "max-test-requests": "max_test_requests"}


def own_limits(cfg: RunConfig, node_config: dict) -> RunConfig:
    """The run configuration with this **deployment** node's own limits applied: its node config's
    ``budget`` (the ε its ledger may reach; absent: the job's) and ``max-test-requests`` (how often it
    releases one test batch; absent: the CLI's default, 1). The job's values apply only where they are
    tighter: a coordinator can lower a party's limits, never raise them (docs/threat-model.md, "What
    each party controls"). A simulation's nodes are one user's: the run's options as they are."""
    if "role" not in node_config:
        return cfg
    own: dict[str, float | int] = {}
    for key, name in OWN_LIMITS.items():
        raw = str("" if node_config.get(key) is None else node_config[key]).strip()
        if not raw:
            continue
        try:
            own[name] = float(raw) if name == "budget" else int(raw)
            if not own[name] > 0 or (name == "budget" and own[name] == float("inf")):
                raise ValueError
        except ValueError:
            raise FederationError(f"node-config: {key}={raw!r}; allowed: "
                                  + ("a number > 0 (or unset: the job's)" if name == "budget"
                                     else "a whole number >= 1 (unset: 1)")) from None
    from fl_split.config import AUTO

    job_budget = None if cfg.budget == AUTO else float(cfg.budget)
    budgets = [b for b in (job_budget, own.get("budget")) if b is not None]
    tests = min(int(cfg.max_test_requests), int(own.get("max_test_requests", RunConfig().max_test_requests)))
    try:
        return cfg.replace(budget=min(budgets) if budgets else AUTO, max_test_requests=tests)
    except ConfigError:  # a run that charges nothing (no defence, no DP-SGD): no budget can bind
        return cfg.replace(max_test_requests=tests)


def _role_capacity(role: NodeRole) -> dict[str, str]:
    """A simulated node's answer to the role query also says what its Ray actor reserved and what
    the cluster has (machine facts), so that the coordinator picks a data plane that fits before
    any party is set up (:func:`fl_split.flower.strategy.fit_data_plane`)."""
    from fl_split.flower.resources import capacity_here

    cap = capacity_here() if role.mode == "simulation" else None
    return {} if cap is None else {"capacity": R.dumps(cap)}


def _dataplane_setup(cfg: RunConfig, role: NodeRole, node_config: dict, state) -> dict[str, str]:
    """Direct data plane: every party makes its own key pair (the private key stays in this node's
    ``state``) and tells the coordinator its public key; the host also its public facts (where
    guests reach it; in a simulation, how many ClientApps its Ray cluster runs at once). A
    deployment node's TLS settings are checked here, before any training."""
    if cfg.data_plane != "direct":
        return {}
    from fl_split.flower import direct

    if role.role != "host":
        direct.check_guest_node(role, node_config)
        return {"dataplane": R.dumps({"public-key": direct.new_identity(state)})}
    from fl_split.flower.resources import capacity_here

    info = direct.host_dataplane_info(role, node_config)
    extra = {"dataplane": R.dumps({**info, "public-key": direct.new_identity(state)})}
    cap = capacity_here() if role.mode == "simulation" else None
    if cap is not None:
        extra["capacity"] = R.dumps(cap)
    return extra


def _operator(role: NodeRole, line: str) -> None:
    """One line for this party's own operator, in its node's log (its SuperNode's stderr), in a
    deployment only: its epochs, its own ε and the run's end or failure (docs/deploy.md, "What each
    operator sees"). Public facts only: counts, ε, the error's words."""
    if role.mode == "deployment":
        print(f"{role.party}: {line}", file=sys.stderr, flush=True)


def _own_epsilon(party, epoch: int | None = None) -> str:
    """``ε X`` as this party's own ledger counts it (after ``epoch``, default: now)."""
    ledger = getattr(party, "ledger", None)
    if ledger is None:
        return "ε: no ledger (no privacy-accounted release)"
    eps = party.epsilons_per_epoch().get(str(epoch)) if epoch is not None else ledger.epsilon()
    return f"ε {eps:.4g} (its own ledger, δ {ledger.delta:g})" if eps is not None else "ε: n/a for its releases"


def _epoch(message: Message, context: Context, role: NodeRole, party, config_json: str, req, handoff=None) -> Message:
    """``train.epoch``: play (host) or serve (guest) the request's epochs over the direct data plane.

    Releases leave the party during the message, so its state — ledger included — is saved whatever
    happens (a lost peer, a refusal, an error): what it released is recorded, once."""
    from fl_split.flower import direct

    cfg = _config_of(config_json)
    ckpt = context.state.config_records.get(CKPT_META)
    plan = plan_of(cfg, role, context.state, handoff) if role.role == "host" or ckpt is not None else None
    wal = save = None
    saved: set[int] = set()
    if ckpt is not None:  # the log records every release durably before it leaves
        from fl_split.checkpoint import open_wal, save_party

        wal = open_wal(party, str(ckpt["dir"]), str(ckpt["run"]), resume=True, spent=ckpt.get("spent") or None)
        # the round the coordinator committed before this message: kept until it commits a newer one
        base = direct.last_round(plan, cfg, int(req["first-epoch"]) - 1)

        def save(round_: int, progress: dict | None = None) -> None:
            save_party(party, str(ckpt["dir"]), round_, run=str(ckpt["run"]), config=cfg.to_dict(),
                       progress=progress, base=base)
            saved.add(round_)
    ended = ""  # a guest: how the host ended its data-plane session ("done"; "failed": the host failed)
    try:
        # every party checkpoints itself at each epoch end inside the message (the host after its
        # evaluation round, a guest after serving it), so one message may cover the whole run
        if role.role == "host":
            outcome = direct.host_epochs(party, cfg, plan, req, role, dict(context.node_config), context.state,
                                         checkpoint=save)
            reply = {"outcome": R.dumps(outcome)}
        else:
            served = direct.guest_epochs(party, cfg, req, role, dict(context.node_config), context.state,
                                         plan=plan, checkpoint=save)
            ended = served.pop("end")  # how the host ended the session: for this node only, not the reply
            reply = {"served": R.dumps(served)}
            if save is not None and ended == "done":  # --one-shot: after epoch 1 the host asks its guests
                last = direct.last_round(plan, cfg, int(req["last-epoch"]))  # nothing (their state stays)
                if last not in saved:
                    save(last)
    finally:
        _close_wal(party, wal)
        _save(context, party, config_json)
    if role.mode == "deployment":  # each epoch this message covered, with this party's own ε after it
        first, last = int(req["first-epoch"]), int(req["last-epoch"])
        done = "played" if role.role == "host" else "served"
        per = party.epsilons_per_epoch() if getattr(party, "ledger", None) is not None else {}
        epochs = [e for e in range(first, last + 1) if str(e) in per]
        for e in epochs:
            _operator(role, f"epoch {e}/{cfg.epochs} {done}; {_own_epsilon(party, e)}")
        if ended not in ("", "done"):  # the host ended the session early: the run stops (its reason is the host's)
            _operator(role, f"run {context.run_id} stopped in epochs {first}-{last}/{cfg.epochs}: the host ended "
                            f"its data-plane session ({ended}); {_own_epsilon(party)}")
        elif not epochs:
            _operator(role, f"epochs {first}-{last}/{cfg.epochs} {done}; {_own_epsilon(party)}")
    return _reply(message, **reply)


def _close_wal(party, wal) -> None:
    """Close the log this message opened and detach it (the next message opens it again: in a
    deployment it may run in another process)."""
    if wal is not None:
        wal.close()
        party.ledger.attach_wal(None)


#: context.state key of a node's checkpoint settings (its directory, the run's identity)
CKPT_META = "fl_split.checkpoint"


def checkpoint_dir_of(role: NodeRole, cfg: RunConfig, node_config: dict, run: str) -> str:
    """Where this node's party keeps its checkpoints and log for the run ``run``: in a deployment the
    SuperNode's own ``--node-config "checkpoint-dir='…'"`` (on its own machine; the run-config's is the
    coordinator's) with :data:`RUN_PLACEHOLDER` replaced by ``run``, in a simulation the run's
    ``--checkpoint-dir``. The run's identity comes from the coordinator: only 32 hexadecimal digits
    (what it draws, ``uuid4().hex``) are accepted, so it cannot name a path outside the folder."""
    if role.mode == "deployment":
        path = str(node_config.get("checkpoint-dir", "") or "").strip()
        if not path:
            raise FederationError(f"{role.party} node-config: no checkpoint-dir; the run checkpoints "
                                  f"(--checkpoint-dir), and a party keeps its checkpoints on its own machine: "
                                  f"--node-config \"... checkpoint-dir='/path/private/to/{role.party}'\"")
        if RUN_PLACEHOLDER in path:
            if not re.fullmatch(r"[0-9a-f]{32}", run):
                raise ProtocolError(f"{role.party}: the run's identity {run[:40]!r} is not 32 hexadecimal digits")
            path = path.replace(RUN_PLACEHOLDER, run)
        return os.path.expanduser(path)
    return os.path.expanduser(cfg.checkpoint_dir)


def _held_rounds(context: Context, role: NodeRole, req) -> dict[str, Any]:
    """``query.checkpoints``: ``{round: progress or None}`` of this party's checkpoints of the run the
    request names (:func:`fl_split.checkpoint.held_rounds`), for the coordinator's choice of the
    round to resume from (:func:`fl_split.flower.direct.agree_on_round`)."""
    from fl_split.checkpoint import held_rounds

    try:
        run = str(R.loads(str(req["checkpoint"]))["run"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{role.party}: malformed checkpoint query ({type(exc).__name__})") from None
    cfg = _coordinator_config(str(req["config"]), context)
    directory = checkpoint_dir_of(role, cfg, dict(context.node_config), run)
    return {str(r): p for r, p in held_rounds(directory, role.party, run).items()}


#: a node's state key: its guest was set up out of the run (a resume of a padded run)
OUT = "fl_split.out"


def _out_of_the_run(context: Context, role: NodeRole, req) -> bool:
    """A resume's set-up telling a padded guest it stays out of the run (``checkpoint.out``): the
    guest restores nothing, opens no log and refuses every later round (:func:`_restore`) — it
    holds no checkpoint after its failure, and a party that served a round without its log could
    draw noise it has drawn before."""
    try:
        info = R.loads(str(req["checkpoint"]))
        out = bool(info.get("out", False))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"{role.party}: malformed checkpoint settings in setup ({type(exc).__name__})") from None
    if not out:
        return False
    if role.role == "host" or not bool(info.get("resume", False)):
        raise ProtocolError(f"{role.party}: only a guest of a resumed run can be set up out of it")
    context.state[OUT] = ConfigRecord({"party": role.party})
    for key in (R.STATE_META, CKPT_META):
        context.state.config_records.pop(key, None)
    _PARTIES.pop((context.run_id, context.node_id), None)
    return True


def _checkpoint_setup(context: Context, role: NodeRole, party, cfg: RunConfig, req, seed: int | None) -> None:
    """``--checkpoint-dir`` at setup: a fresh run checkpoints the new party (round 0: its secret and
    initial weights) and starts its log; a resume restores the committed round and replays the
    releases logged after it."""
    from fl_split.checkpoint import open_wal, restore_party, save_party

    try:
        info = R.loads(str(req["checkpoint"]))
        run, round_, resume = str(info["run"]), int(info["round"]), bool(info["resume"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{role.party}: malformed checkpoint settings in setup ({type(exc).__name__})") from None
    directory = checkpoint_dir_of(role, cfg, dict(context.node_config), run)
    os.makedirs(directory, mode=0o700, exist_ok=True)  # it will hold this party's secret
    spent = spend_dir_of_node(role, dict(context.node_config), directory)
    if resume:
        info = restore_party(party, directory, round_, run=run, config=cfg.to_dict(), private_seed=seed, spent=spent)
        if info["recovered"]:  # its checkpoint directory was restored from an older copy
            _operator(role, f"resumed from round {round_}: the write-ahead log lacked {info['recovered']} release(s) "
                            f"its spend record holds (its checkpoint directory was restored from an older copy); "
                            f"they are charged; {_own_epsilon(party)}")
    else:
        _close_wal(party, open_wal(party, directory, run, resume=False, spent=spent))
        save_party(party, directory, 0, run=run, config=cfg.to_dict())
    context.state[CKPT_META] = ConfigRecord({"dir": directory, "run": run, "spent": spent})


def spend_dir_of_node(role: NodeRole, node_config: dict, directory: str) -> str:
    """Where this node's party keeps its spend records (``docs/robustness.md``, "The spend record"):
    in a deployment its node-config ``spend-dir`` if set, else (and in a simulation) next to its
    checkpoint ``directory``, never inside it (a restore of that directory must leave them alone).
    A node-config ``checkpoint-dir`` of per-run folders (``…/{run}``) puts them next to the folder
    of all runs (``checkpoints/{run}`` -> ``checkpoints.spent``)."""
    from fl_split.checkpoint import spend_dir_of

    if role.mode == "deployment":
        path = str(node_config.get("spend-dir", "") or "").strip()
        if path:
            spent = os.path.abspath(os.path.expanduser(path))
            if os.path.commonpath([spent, os.path.abspath(directory)]) == os.path.abspath(directory):
                raise FederationError(f"{role.party} node-config: spend-dir {path!r} is inside its checkpoint-dir; "
                                      f"a restore of that folder would roll the spend record back with it: give a "
                                      f"folder outside it")
            return spent
        base = str(node_config.get("checkpoint-dir", "") or "").strip().split(RUN_PLACEHOLDER)[0].rstrip("/")
        if RUN_PLACEHOLDER in str(node_config.get("checkpoint-dir", "")) and base:
            return str(spend_dir_of(base))
    return str(spend_dir_of(directory))


def _expect(role: NodeRole, want: str, mtype: str) -> None:
    if role.role != want:
        raise ProtocolError(f"{role.party}: '{mtype}' is for the {want}, this node hosts a {role.role}")


def _reply(message: Message, **values: Any) -> Message:
    values["worker"] = worker_id()
    return Message(R.reply_content(**values), reply_to=message)


def make_client_app(private_seed: int | None = None, handoff=None):
    """The fl_split ClientApp: :func:`handle` registered under every message type the coordinator
    sends. ``private_seed`` (a :class:`~fl_split.seeding.PrivateSeed`) is for in-process simulations
    (``fl-split train --engine flower --private-seed-file F``), whose run-config is empty: it stays
    in the ClientApp, never in a message. ``handoff`` (in-process simulations too): each party's
    data as the driver prepared it (:mod:`fl_split.flower.prepared`)."""
    def _handle(message: Message, context: Context) -> Message:
        return handle(message, context, private_seed, handoff)

    return client_app_for(_handle)


def client_app_for(handler):
    """A ClientApp with ``handler(message, context)`` registered under every message type the
    coordinator sends (:func:`make_client_app`, the attacks' recording app, tests' faulty apps)."""
    from flwr.clientapp import ClientApp

    app = ClientApp()
    for mtype in (R.MSG_ROLE, R.MSG_SETUP, R.MSG_REPORT, R.MSG_STEP, R.MSG_HOST_TRAIN, R.MSG_HOST_EVAL, R.MSG_EPOCH,
                  R.MSG_CHECKPOINTS, R.MSG_STOPPED, MSG_ALIGN, MSG_PREDICT, R.MSG_SECURE_ANNOUNCE, R.MSG_SECURE_AGREE,
                  R.MSG_REDO, R.MSG_DROP):
        category, action = mtype.split(".")
        getattr(app, category)(action)(handler)
    return app
