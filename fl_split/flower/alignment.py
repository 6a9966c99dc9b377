"""ID alignment between deployed SuperNodes (``--data node-tables``): ``--align public`` or ``psi``
as a phase of the ServerApp before the parties are built.

In a Flower deployment each organisation's SuperNode holds its own raw table (node-config
``data-path``: CSV or Parquet with the ID column, the label column at the host only;
:func:`fl_split.data.own.read_own_table` makes the same checks as ``fl-split train --data``). The
run config says ``data = "node-tables"``. Before ``setup`` the ServerApp
(:class:`~fl_split.flower.strategy.VerticalSplitStrategy`) calls :func:`align_nodes`, which sends
``query.align`` messages (field ``op``):

1. ``open`` to every node: it reads and checks its table and answers with its feature column names
   and its file's name (public metadata in VFL: the coordinator refuses a column name claimed by two
   parties, and an ``--encode`` entry naming no party's column, as ``--data`` does in one process);
   with ``--align psi`` the node also makes its PSI start (its own list, hashed, blinded, permuted)
   and sends it with the answer;
2. the alignment:

   * ``--align psi``: :func:`fl_split.psi.run_psi` (the coordinator) over a :class:`FlowerPsiRoute` —
     the rounds of :mod:`fl_split.psi`, each one ``psi-blind`` message to every node at once (node i
     blinds the list it gets from its ring predecessor), then ``psi-finish`` (its positions in the
     intersection) to every node; each :mod:`fl_split.psi` frame a ``bytes`` field of a Flower
     message. The ServerApp (and the SuperLink, which stores the messages) sees blinded values only:
     the coordinator's view of ``fl_split/psi.py`` (sizes of sub-intersections of pseudonyms, ``|I|``,
     no ID, not ``I``);
   * ``--align public``: the host publishes its sorted ID list (``public-ids``), the ServerApp
     sends it to every guest (``public-accept``), which checks it holds each ID;

3. at the step that agrees a node's shared list (``psi-finish``, ``public-ids`` / ``public-accept``)
   the node aligns its rows to the list, splits it with ``--seed`` and encodes its raw columns, fitted
   on its own training rows (:func:`fl_split.data.own.align_own`,
   :class:`~fl_split.data.encoding.ColumnEncoder`), exactly as the in-process pipeline does, and
   answers with its **input shape** (how many encoded columns: one per training category and missing
   indicator — known only now, public metadata like the column names);
4. ``shapes`` to every node: every feature holder's input shape (each node checks its own), from which
   each builds its plan. So the run then equals ``fl-split train --data …`` on the same tables. With
   G guests the PSI phase costs G + 3 Flower round trips (``open`` with the start, G rounds of
   ``psi-blind``, ``psi-finish``, ``shapes``: N + 1 protocol rounds for N = G + 1 parties, and the
   widths); a deployment may start a ClientApp process per message, so round trips, not bytes, are
   its cost.

**What stays on a node.** Its table and its IDs; its PSI state between its messages (its round, its
permutation's seed and, until its last round, its key: :meth:`fl_split.psi.PsiParty.export_state`)
and its shared list and widths live in the node's ``context.state``, which its SuperNode keeps and
never sends (as the party's own secret and data-plane key); the key is dropped after the node's last
round, the rest at ``psi-finish``. No message carries a key (``tests/test_deploy_align.py`` scans
every message). Replies: names and widths, frames, digests of the found list.

**The coordinator's honesty.** Each node enforces the protocol's order (fl_split/psi.py, "What each
party enforces"): one start, one list per round from its ring predecessor, rounds in order, one
finish after the last round; and its own bound on every peer's announced set (fl_split/psi.py,
"Bounded inputs": its node-config ``psi-max-peer-ids``, else the default; the run config's can only
lower it, :func:`node_peer_limit`), checked in round 1 before any value of a peer is blinded. Frames are not signed: a coordinator that forged a list could have a
node blind values of *its* choosing (at most one list per round), and a coordinator colluding with
a party learns that party's sub-intersections. The deployment trusts its coordinator to route
honestly (as it trusts it with the run configuration); docs/datasets.md and docs/threat-model.md
say so.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord

from fl_split.config import RunConfig
from fl_split.errors import DataError, ProtocolError
from fl_split.flower import records as R

#: the Flower message type of the alignment phase (one type; the step is the request's ``op``)
MSG_ALIGN = "query.align"
#: context.state keys of a node: the shared list and widths (``ALIGNED``), its PSI state (``PSI_STATE``)
ALIGNED = "fl_split.aligned"
PSI_STATE = "fl_split.psi"


def uses_node_tables(cfg: RunConfig) -> bool:
    """Whether each deployment node reads its own table (``data = "node-tables"``)."""
    from fl_split.data.own import NODE_TABLES

    return cfg.data.strip() == NODE_TABLES


# -- the coordinator ---------------------------------------------------------------------------------
class FlowerPsiRoute:
    """:class:`fl_split.psi.PsiRoute` over a :class:`~fl_split.flower.transport.FlowerTransport`: each
    protocol round one ``query.align`` message to every node at once; the start travels with the
    ``open`` answers (:attr:`started`)."""

    def __init__(self, transport, config_json: str) -> None:
        self.transport, self.config_json = transport, config_json
        #: each party's input shape, from its reply to the step that agreed its shared list
        self.shapes: dict[str, list[int]] = {}
        #: each node's start frame, from its ``open`` answer (one Flower round trip saved)
        self.started: dict[str, bytes] = {}
        #: ``say(line)`` after each round (a deployment's progress: its rounds take seconds to minutes)
        self.say = lambda line: None
        self._rounds = 0

    def _ask(self, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return self.transport.exchange({p: (MSG_ALIGN, R.content(config=self.config_json, **v))
                                        for p, v in requests.items()}, None)

    def start(self, parties):
        return {p: self.started[p] for p in parties if p in self.started}

    def hop(self, frames):
        t0 = time.perf_counter()
        rep = self._ask({p: {"op": "psi-blind", "frame": b} for p, b in frames.items()})
        self._rounds += 1
        self.say(f"alignment: PSI round {self._rounds} of {len(frames) - 1} done "
                 f"({time.perf_counter() - t0:.1f} s)")
        return {p: _frame(rep[p], "frame", p) for p in frames}

    def finish(self, frames):
        rep = self._ask({p: {"op": "psi-finish", "frame": b} for p, b in frames.items()})
        self.shapes.update({p: _shape(r, p) for p, r in rep.items()})
        return {p: str(r.get("digest", "")) for p, r in rep.items()}


def _shape(rec, party: str) -> list[int]:
    try:
        shape = R.loads(str(rec["input-shape"]))
        if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"{party}: the reply that agrees its shared ID list carries no input shape") from None
    return shape


def _frame(rec, key: str, party: str) -> bytes:
    v = rec.get(key, None)
    if not isinstance(v, (bytes, bytearray)):
        raise ProtocolError(f"{party}: the reply's {key!r} is not bytes")
    return bytes(v)


def psi_over(route, parties: list[str]) -> dict[str, Any]:
    """:func:`fl_split.psi.run_psi` over ``route`` (the starts already in ``route.started``); returns
    the alignment's sizes: shared IDs, PSI messages and bytes (never an ID)."""
    from fl_split.psi import run_psi

    counts = {"messages": 0, "bytes": 0}

    def count(kind, sender, receiver, blob):
        counts["messages"] += 1
        counts["bytes"] += len(blob)

    shared_n = run_psi(route, parties, count)
    return {"align": "psi", "shared_ids": int(shared_n), "psi_messages": counts["messages"], "psi_bytes": counts["bytes"]}


def align_nodes(transport, cfg: RunConfig, log=None) -> dict[str, Any]:
    """The alignment phase (module docstring); returns ``results["alignment"]`` — the same keys and
    values as :func:`fl_split.data.own.load_own`'s on the same tables (sizes and PSI traffic, never an
    ID). ``log(line)`` gets one line per step."""
    from fl_split.data.base import feature_parties
    from fl_split.data.own import check_column_owner, check_encode
    from fl_split.psi import ids_digest

    say = log or (lambda line: None)
    config_json = R.dumps(cfg.to_flower())
    parties = ["host", *transport.guests]
    route = FlowerPsiRoute(transport, config_json)
    route.say = say
    t0 = time.perf_counter()
    opened = route._ask({p: {"op": "open", "psi-start": cfg.align == "psi"} for p in parties})
    owner: dict[str, str] = {}
    columns: dict[str, list[str]] = {}
    for p in parties:
        if cfg.align == "psi":
            route.started[p] = _frame(opened[p], "frame", p)
        info = R.loads(str(opened[p]["table"]))
        columns[p] = [str(c) for c in info["columns"]]
        check_column_owner(owner, f"{p} ({info['file']})", p, columns[p])
    check_encode(cfg, columns)
    say(f"alignment: every party's table checked ({', '.join(f'{p}: {len(c)} columns' for p, c in columns.items())})")
    if cfg.align == "psi":
        alignment: dict[str, Any] = {**psi_over(route, parties), "time_s": round(time.perf_counter() - t0, 3)}
        shared_n = alignment["shared_ids"]
        counts = {"messages": alignment["psi_messages"], "bytes": alignment["psi_bytes"]}
        say(f"alignment: private set intersection of {len(parties)} parties: {shared_n} shared IDs "
            f"({counts['messages']} PSI messages, {counts['bytes']} bytes)")
    else:
        host_rep = route._ask({"host": {"op": "public-ids"}})["host"]
        host_ids = _frame(host_rep, "ids", "host")
        route.shapes["host"] = _shape(host_rep, "host")
        digests = route._ask({g: {"op": "public-accept", "ids": host_ids} for g in transport.guests})
        route.shapes.update({g: _shape(r, g) for g, r in digests.items()})
        want = ids_digest(np.frombuffer(host_ids, "<i8"))
        for g in transport.guests:
            if str(digests[g].get("digest", "")) != want:
                raise DataError(f"--align public: {g} accepted another ID list than the host published")
        shared_n = len(host_ids) // 8
        alignment = {"align": "public", "shared_ids": int(shared_n)}
        say(f"alignment: the host's {shared_n} IDs published to every guest (--align public)")
    # each party fitted its encoder on its training rows: its width is known now, and every node needs
    # every feature holder's (the plan's shapes)
    shapes = {p: route.shapes[p] for p in feature_parties(cfg.guests, cfg.host_features)}
    route._ask({p: {"op": "shapes", "input-shapes": R.dumps(shapes)} for p in parties})
    say(f"alignment: input widths after each party's encoding: "
        f"{', '.join(f'{p}: {s[0] if s else 0}' for p, s in shapes.items())}")
    return alignment


# -- a node ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _table(cfg: RunConfig, party: str, path: str, mtime: float):
    from fl_split.data.own import SUFFIXES, read_own_table

    if Path(path).suffix.lower() not in SUFFIXES:
        raise DataError(f"{party}: node-config data-path {path!r} is not a table (.csv or .parquet); with "
                        f"data = 'node-tables' each SuperNode's data-path is its own table (party files: leave "
                        f"data empty)")
    return read_own_table(cfg, party, path)


def own_table(cfg: RunConfig, role):
    """This node's checked table (cached per process and file version)."""
    path = os.path.abspath(os.path.expanduser(role.data_path))
    return _table(cfg, role.party, path, os.path.getmtime(path) if os.path.exists(path) else 0.0)


def handle_align(cfg: RunConfig, role, req, state, node_config: dict | None = None) -> dict[str, Any]:
    """One ``query.align`` step at this node (module docstring); returns the reply's values. The step
    that agrees this node's shared ID list carries every holder's input shape: the node then aligns
    and encodes its data (every check of it) before it answers. ``node_config``: this node's own
    (its ``psi-max-peer-ids``)."""
    if role.mode != "deployment" or not uses_node_tables(cfg):
        raise ProtocolError(f"{role.party}: an alignment message, but this node does not read its own table "
                            f"(deployment with data = 'node-tables')")
    op = str(req.get("op", ""))
    table = own_table(cfg, role)
    aligned = state.config_records.get(ALIGNED)
    if op == "open":
        reply: dict[str, Any] = {"table": R.dumps({"columns": table.slice.columns, "file": Path(role.data_path).name})}
        if bool(req.get("psi-start", False)) and aligned is None:
            reply["frame"] = _psi_step(cfg, role, state, "psi-start", None, table)
        return reply
    if op == "shapes":
        if aligned is None or "input-shapes" in aligned:
            raise ProtocolError(f"{role.party}: 'shapes' {'before' if aligned is None else 'again after'} this "
                                f"node agreed on its shared ID list")
        shapes = R.loads(str(req["input-shapes"])) if "input-shapes" in req else None
        if not isinstance(shapes, dict):
            raise ProtocolError(f"{role.party}: the 'shapes' step carries no input shapes (or malformed ones)")
        data = _aligned(cfg, role.party, *_file(role), bytes(aligned["shared"]))
        mine = shapes.get(role.party, [])
        if data.has_features != (role.party in shapes) or [int(x) for x in mine] != list(data.input_shape):
            raise ProtocolError(f"{role.party}: the coordinator lists input shape {mine} for this party, its data "
                                f"has {list(data.input_shape)}")
        state[ALIGNED] = ConfigRecord({"shared": bytes(aligned["shared"]), "input-shapes": R.dumps(shapes)})
        return {}
    if aligned is not None:
        raise ProtocolError(f"{role.party}: '{op}' after this node agreed on its shared ID list")
    reply = _align_step(cfg, role, req, state, op, table, node_config or {})
    if ALIGNED in state.config_records:  # the list is agreed: build the data now (every check of it)
        try:
            data = _aligned(cfg, role.party, *_file(role), bytes(state.config_records[ALIGNED]["shared"]))
        except Exception:
            state.config_records.pop(ALIGNED, None)  # not agreed after all: the run fails here
            raise
        reply["input-shape"] = R.dumps(list(data.input_shape))  # its width after its own encoding: public
    return reply


def _align_step(cfg: RunConfig, role, req, state, op: str, table, node_config: dict) -> dict[str, Any]:
    from fl_split.psi import ids_digest

    is_host = role.role == "host"
    if op == "public-ids" and not is_host:
        raise ProtocolError(f"{role.party}: '{op}' is for the host")
    if op == "public-accept" and is_host:
        raise ProtocolError(f"{role.party}: '{op}' is for a guest")
    ids = table.slice.ids
    if op == "public-ids":
        if cfg.align != "public":
            raise ProtocolError(f"{role.party}: the run aligns with --align {cfg.align}, not public")
        shared = np.sort(ids)
        _keep(state, shared)
        return {"ids": np.ascontiguousarray(shared, "<i8").tobytes()}
    if op == "public-accept":
        from fl_split.data.own import check_public

        if cfg.align != "public":
            raise ProtocolError(f"{role.party}: the run aligns with --align {cfg.align}, not public")
        raw = _bytes(req, "ids", role.party)
        if len(raw) % 8:
            raise ProtocolError(f"{role.party}: the host's ID list of {len(raw)} bytes is not int64s")
        shared = np.frombuffer(raw, "<i8").astype(np.int64)
        if shared.size > 1 and not np.all(np.diff(shared) > 0):
            raise ProtocolError(f"{role.party}: the host's ID list is not sorted and unique")
        check_public(table, shared)
        _keep(state, shared)
        return {"digest": ids_digest(shared)}
    if op == "psi-finish":
        shared = _psi_step(cfg, role, state, op, _bytes(req, "frame", role.party), table, node_config)
        _keep(state, shared)
        return {"digest": ids_digest(shared)}
    if op == "psi-blind":
        return {"frame": _psi_step(cfg, role, state, op, _bytes(req, "frame", role.party), table, node_config)}
    raise ProtocolError(f"{role.party}: unknown alignment step {op!r}")


def _psi_step(cfg: RunConfig, role, state, op: str, frame: bytes | None, table, node_config: dict | None = None):
    """One PSI step of this node (start, blind, finish) in the alignment phase (:func:`psi_step`)."""
    if cfg.align != "psi":
        raise ProtocolError(f"{role.party}: '{op}' but the run aligns with --align {cfg.align}")
    parties = ["host", *(f"guest-{i}" for i in range(1, cfg.guests + 1))]
    limits = node_peer_limit(table.slice.ids, node_config or {}, cfg.psi_max_peer_ids)
    return psi_step(role.party, parties, table.slice.ids, state, op, frame, limits=limits)


#: the node-config key of a deployment node's bound on a peer's PSI set (:func:`fl_split.psi.peer_limit`)
NODE_PEER_LIMIT = "psi-max-peer-ids"


def node_peer_limit(ids, node_config: dict, run_value: object = "") -> dict[str, Any]:
    """A deployment node's bound on a peer's PSI set: ``max_peer_ids`` and ``flag`` of its party.

    Its own node-config ``psi-max-peer-ids`` (else the default), lowered — never raised — by the
    run config's (DESIGN.md, "Privacy principles" 10)."""
    from fl_split.psi import _sorted_unique, peer_limit

    mine = str(node_config.get(NODE_PEER_LIMIT, "") or "").strip()
    try:
        own = len(_sorted_unique(ids))
        limit = peer_limit(mine, own)[0]
        run = str(run_value or "").strip()
        if run and peer_limit(run, own)[0] < limit:
            return {"max_peer_ids": run, "flag": f"this node's node-config {NODE_PEER_LIMIT} (the run config's "
                                                 f"{NODE_PEER_LIMIT} = {run!r} lowers it)"}
    except ValueError as e:
        raise DataError(f"node-config {e}") from None
    return {"max_peer_ids": mine, "flag": f"this node's node-config {NODE_PEER_LIMIT}"}


def psi_step(party: str, parties: list[str], ids, state, op: str, frame: bytes | None, key: str = PSI_STATE,
             limits: dict[str, Any] | None = None):
    """One PSI step of ``party`` holding ``ids`` (start, blind, finish), its state restored from and
    saved to its own ``context.state`` under ``key`` (a fresh ClientApp process continues from
    there); also the prediction job's alignment (:mod:`fl_split.flower.predicting`). ``limits``:
    its bound on a peer's set (:func:`node_peer_limit`; ``None``: the default)."""
    from fl_split.psi import PsiParty

    limits = limits if limits is not None else {"max_peer_ids": "", "flag": f"node-config {NODE_PEER_LIMIT}"}
    rec = state.config_records.get(key)
    if op == "psi-start":
        if rec is not None:
            raise ProtocolError(f"{party}: a second PSI start in this run")
        psi = PsiParty(party, ids, parties, **limits)
        out = psi.start()
    else:
        if rec is None:
            raise ProtocolError(f"{party}: '{op}' before this node's PSI start")
        psi = PsiParty.import_state(party, ids, parties, dict(rec.items()), **limits)
        out = psi.hop(frame) if op == "psi-blind" else psi.finish(frame)
    if op == "psi-finish":
        state.config_records.pop(key, None)  # the PSI is over: no key, no seed left
    else:
        state[key] = ConfigRecord(psi.export_state())
    return out


def _bytes(req, key: str, party: str) -> bytes:
    v = req.get(key, None)
    if not isinstance(v, (bytes, bytearray)):
        raise ProtocolError(f"{party}: the request's {key!r} is not bytes")
    return bytes(v)


def _keep(state, shared: np.ndarray) -> None:
    state[ALIGNED] = ConfigRecord({"shared": np.ascontiguousarray(shared, "<i8").tobytes()})


def _file(role) -> tuple[str, float]:
    path = os.path.abspath(os.path.expanduser(role.data_path))
    return path, os.path.getmtime(path) if os.path.exists(path) else 0.0


@functools.lru_cache(maxsize=4)
def _aligned(cfg: RunConfig, party: str, path: str, mtime: float, shared: bytes):
    """This node's data: its table aligned to the shared list and encoded with its own training rows."""
    from fl_split.data.own import align_own

    table = _table(cfg, party, path, mtime)
    return align_own(cfg, table, np.frombuffer(shared, "<i8").astype(np.int64))


def node_data(cfg: RunConfig, role, state):
    """``(PartyData, PublicFacts)`` of this node after the alignment phase (cached per process; any
    process rebuilds it from the node's table and ``context.state``)."""
    from fl_split.party_files import PublicFacts, data_config

    rec = state.config_records.get(ALIGNED)
    if rec is None or "input-shapes" not in rec:
        raise ProtocolError(f"{role.party}: no aligned data on this node; with data = 'node-tables' the "
                            f"coordinator runs the alignment phase before 'setup'")
    data = _aligned(cfg, role.party, *_file(role), bytes(rec["shared"]))
    widths = {str(p): tuple(int(x) for x in s) for p, s in json.loads(str(rec["input-shapes"])).items()}
    if role.party in widths and tuple(data.input_shape) != widths[role.party]:
        raise ProtocolError(f"{role.party}: the coordinator lists input shape {widths[role.party]} for this party, "
                            f"its data has {tuple(data.input_shape)}")
    task, metric = "classification", "accuracy"
    if role.party == "host":  # the labels' owner resolves the run's task (fl_split/tasks.py), as prepare_data does
        import dataclasses

        from fl_split.tasks import HEADLINE, resolve

        task = resolve(cfg.task, data.task, data.num_classes, cfg.data_name)
        metric = HEADLINE[task]
        data = dataclasses.replace(data, task=task, metric=metric)
    facts = PublicFacts(dataset=cfg.data_name, task=task, metric=metric, n_train=len(data.train_ids),
                        n_test=len(data.test_ids), input_shapes=widths, data_config=data_config(cfg),
                        num_classes=int(data.num_classes) if role.party == "host" else None)
    return data, facts


def node_plan(cfg: RunConfig, role, state):
    """The run plan of this node from its public facts (as from a party file)."""
    from fl_split.party_files import plan_from_facts

    return plan_from_facts(cfg, node_data(cfg, role, state)[1])
