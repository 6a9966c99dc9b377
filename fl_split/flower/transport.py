"""The coordinator's side of the control plane: :class:`FlowerTransport` and federation discovery.

:class:`FlowerTransport` pushes Flower messages to the parties and collects the replies
(:meth:`FlowerTransport.exchange`); the direct data plane uses it for its control messages
(:mod:`fl_split.flower.direct`). In relay mode (``--data-plane flower``) it also implements
:class:`fl_split.engine.Transport` with one message per party per round, so the coordinator loop
:func:`fl_split.engine.coordinate` runs unchanged. A round costs at most two
exchanges (DESIGN "Latency"): one ``train.step`` message per guest, pushed together (the guests
work in parallel), then one ``train.host`` / ``evaluate.host`` message to the host. Replies are
collected with :meth:`Grid.push_messages` + :meth:`Grid.pull_messages` and a short poll (5 ms)
instead of ``send_and_receive``'s fixed 0.1 s sleep.

Before the first round :func:`discover` waits for the expected ``G + 1`` nodes (``grid.get_node_ids()``
is empty at first), asks every node for its role (the ServerApp cannot read ``node_config``),
validates the federation (:func:`validate_federation`); :func:`setup` sends every party the run
configuration and rebuilds the run plan from the parties' public facts, so the coordinator never
touches data.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flwr.app import Message, RecordDict

from fl_split.config import RunConfig
from fl_split.errors import PartyError
from fl_split.flower import records as R
from fl_split.flower.records import FederationError

log = logging.getLogger("fl_split.flower")

#: how often replies are polled for (seconds)
POLL_INTERVAL = 0.005
#: after a first error reply, how long the other replies of the exchange are still awaited (seconds)
ERROR_GRACE = 3.0
#: a ServerApp in its own process (a deployment, ``flwr run``) asks the SuperLink over HTTP: while
#: it waits, the interval grows from :data:`POLL_INTERVAL` to this (every poll is a request the
#: SuperLink serves — at 5 ms, 100–200 a second through a whole epoch or PSI round; both processes'
#: CPU, which the parties need on a small machine). A reply is seen at most this much later.
REMOTE_POLL_CAP = 0.05


def remote_grid(grid) -> bool:
    """Whether ``grid`` reaches the SuperLink over the network (not Flower's in-process simulation grid)."""
    return type(grid).__name__ != "InMemoryGrid"


@dataclass
class ExchangeStats:
    """Wall time spent waiting on Flower per exchange (for benchmarks)."""

    exchanges: int = 0
    seconds: float = 0.0
    workers: set[str] = field(default_factory=set)


class FlowerTransport:
    """Reaches the parties through a Flower :class:`~flwr.serverapp.Grid`.

    ``nodes`` maps party names (``host``, ``guest-1`` …) to Flower node IDs. Every wait is bounded
    by ``timeout`` seconds; a party that does not answer in time raises :class:`FederationError`.
    """

    def __init__(self, grid, nodes: dict[str, int], timeout: float, poll: float = POLL_INTERVAL) -> None:
        from fl_split.flower.objectwaits import short_object_waits

        short_object_waits(grid)  # a deployment's replies: no 1 s first wait for their objects
        self.grid = grid
        self.nodes = dict(nodes)
        self.guests = sorted((p for p in nodes if p != "host"), key=lambda p: int(p.split("-")[1]))
        self.timeout = float(timeout)
        self.poll = float(poll)
        self.poll_cap = max(self.poll, REMOTE_POLL_CAP) if remote_grid(grid) else self.poll
        self.stats = ExchangeStats()
        #: every party's reply to ``setup`` (the host's says where its data plane is)
        self.setup_replies: dict[str, Any] = {}
        #: ``{party: reply to the role query}`` (a simulated node's carries its ``capacity``)
        self.role_replies: dict[str, Any] = {}
        #: the run's public ``task`` and ``num_outputs``, sent with the report request (set after setup)
        self.public_plan: dict[str, Any] | None = None
        #: relay, ``--secure-merge --on-guest-failure pad``: a guest's error reply does not end the round
        #: (:meth:`guest_step` raises a :class:`~fl_split.engine.GuestFailure` with the others' releases)
        self.pad = False
        #: relay: the guests the run went on without (:meth:`drop_guest`)
        self.dropped: set[str] = set()

    # -- one exchange ----------------------------------------------------------------------------
    def exchange(self, requests: dict[str, tuple[str, RecordDict]], round_: int | None,
                 timeout: float | None = None, fail_fast: bool = False, optional: frozenset[str] = frozenset(),
                 release: Callable[[str, Any], set[str]] | None = None) -> dict[str, Any]:
        """Send ``{party: (message_type, content)}`` together; return ``{party: reply ConfigRecord}``.

        An error reply raises (the first failing party in merge order); so does a party that has
        not answered after ``timeout`` seconds (default: ``--node-timeout``). With ``fail_fast`` an
        error reply stops the wait early: the other replies get :data:`ERROR_GRACE` seconds more
        (a host's reply names the guest at fault better than a guest's own).

        ``--on-guest-failure pad`` on the direct data plane: an error reply of an ``optional`` party
        neither raises nor shortens the wait; its :class:`PartyError` is returned in its place.
        ``release(party, reply)`` is called with each good reply as it arrives and names parties whose
        replies are no longer awaited (the host's reply names the guests it went on without); those
        are left out of the result."""
        t0 = time.perf_counter()
        limit = self.timeout if timeout is None else float(timeout)
        group = str(round_ if round_ is not None else 0)
        msgs = {p: Message(content, dst_node_id=self.nodes[p], message_type=mtype, group_id=group)
                for p, (mtype, content) in requests.items()}
        ids = list(self.grid.push_messages(msgs.values()))
        if len(ids) != len(msgs):
            raise FederationError(f"Flower accepted {len(ids)} of {len(msgs)} messages in round {round_}")
        party_of = dict(zip(ids, msgs))
        pending = set(ids)
        replies: dict[str, Message] = {}
        deadline = time.monotonic() + limit
        failing = False
        released: set[str] = set()
        wait = self.poll
        while pending:
            for msg in self.grid.pull_messages(list(pending)):
                mid = msg.metadata.reply_to_message_id
                if mid in pending:
                    pending.discard(mid)
                    party = party_of[mid]
                    replies[party] = msg
                    if _is_error(msg):
                        if fail_fast and not failing and party not in optional:
                            failing = True
                            deadline = min(deadline, time.monotonic() + ERROR_GRACE)
                    elif release is not None:
                        released |= set(release(party, _check_reply(msg, party, round_)))
                        pending = {m for m in pending if party_of[m] not in released}
            if not pending:
                break
            if time.monotonic() > deadline:
                if failing:
                    break
                late = sorted(party_of[m] for m in pending)
                what = ", ".join(f"{p} (node {self.nodes[p]})" for p in late)
                raise FederationError(f"no reply from {what} within {limit:g} s"
                                      f"{'' if round_ is None else f' in round {round_}'} "
                                      f"({requests[late[0]][0]}); raise --node-timeout if the party is slow")
            time.sleep(wait)
            wait = min(wait * 1.5, self.poll_cap)
        out: dict[str, Any] = {}
        for p in sorted(replies, key=_party_order):
            if p in released:
                continue
            try:
                out[p] = _check_reply(replies[p], p, round_)
            except PartyError as exc:
                if p not in optional:
                    raise
                out[p] = exc
                continue
            w = out[p].get("worker")
            if w:
                self.stats.workers.add(str(w))
        self.stats.exchanges += 1
        self.stats.seconds += time.perf_counter() - t0
        return out

    # -- Transport protocol ------------------------------------------------------------------------
    def _active(self) -> list[str]:
        return [g for g in self.guests if g not in self.dropped]

    def guest_step(self, owed, keys, round_):
        from fl_split.engine import GuestFailure

        keys_json = R.keys_to_json(keys)
        reqs = {g: (R.MSG_STEP, R.content(round=round_, keys=keys_json, owed=list(owed.get(g, []))))
                for g in self._active()}
        # (a refusal over budget is raised by the exchange itself: the run stops cleanly, never pads)
        rep = self.exchange(reqs, round_, optional=frozenset(reqs) if self.pad else frozenset())
        failed = {g: r.detail for g, r in rep.items() if isinstance(r, PartyError)}
        out = {g: R.blob_list(r, "blobs") for g, r in rep.items() if g not in failed}
        if failed:  # (pad only) every other guest answered: its releases are kept, as the local engine's
            raise GuestFailure(round_, failed, out)
        return out

    def secure_redo(self, keys, round_: int) -> dict[str, list[bytes]]:
        """``--secure-merge``, pad: every active guest releases ``keys`` again in the session just agreed
        (``train.redo``: a second release, charged in its ledger; the round's first releases carried the
        failed guest's masks and are never opened)."""
        keys_json = R.keys_to_json(keys)
        rep = self.exchange({g: (R.MSG_REDO, R.content(round=round_, keys=keys_json)) for g in self._active()},
                            round_)
        return {g: R.blob_list(r, "blobs") for g, r in rep.items()}

    def drop_guest(self, guest: str, round_: int) -> None:
        """pad: the host zero-fills ``guest`` from ``round_`` on (``train.drop``); nothing more is sent to it."""
        self.exchange({"host": (R.MSG_DROP, R.content(round=round_, guest=guest))}, round_)
        self.dropped.add(guest)

    def secure_rekey(self, members: list[str]) -> bytes:
        """``--secure-merge``: a new session among ``members`` in two exchanges — each member's signed
        X25519 key (``query.secure_announce``), then every announcement to every member
        (``query.secure_agree``), which checks each against the identity it pinned itself
        (fl_split/privacy/secure_merge.py, :func:`~fl_split.privacy.secure_merge.rekey`). The coordinator
        only relays: a key it changed fails the signature check. Returns the session id (fresh random)."""
        import os

        session = os.urandom(16)
        who = R.dumps(list(members))
        rep = self.exchange({g: (R.MSG_SECURE_ANNOUNCE, R.content(session=[session], members=who))
                             for g in members}, None)
        announcements = [R.blob_list(rep[g], "announcement")[0] if R.blob_list(rep[g], "announcement") else b""
                         for g in members]
        self.exchange({g: (R.MSG_SECURE_AGREE, R.content(announcements=list(announcements))) for g in members}, None)
        return session

    def host_train(self, keys, acts, round_):
        req = R.content(round=round_, keys=R.keys_to_json(keys), **{f"acts.{g}": list(acts[g]) for g in self._active()})
        rep = self.exchange({"host": (R.MSG_HOST_TRAIN, req)}, round_)["host"]
        return {g: R.blob_list(rep, f"grads.{g}") for g in self._active()}

    def host_evaluate(self, keys, acts, round_):
        req = R.content(round=round_, keys=R.keys_to_json(keys), **{f"acts.{g}": list(acts[g]) for g in self._active()})
        rep = self.exchange({"host": (R.MSG_HOST_EVAL, req)}, round_)["host"]
        return R.loads(str(rep["metrics"]))

    def tell_stopped(self, reason: str, failed: str | None = None, wait: float = 5.0) -> None:
        """Best effort, after the run failed: tell every party but the one that ``failed`` why
        (``query.stopped``, the failure's one line — what the coordinator itself prints), so that each
        operator's terminal shows how the run ended (docs/deploy.md, "What each operator sees"). Waits
        at most ``wait`` seconds for the replies and never raises: a party that is down does not hear it."""
        try:
            msgs = [Message(R.content(reason=" ".join(str(reason).split())[:2000]), dst_node_id=node,
                            message_type=R.MSG_STOPPED, group_id="0")
                    for party, node in self.nodes.items() if party != failed]
            pending = set(self.grid.push_messages(msgs))
            deadline = time.monotonic() + wait
            while pending and time.monotonic() < deadline:
                for msg in self.grid.pull_messages(list(pending)):
                    pending.discard(msg.metadata.reply_to_message_id)
                time.sleep(self.poll)
        except Exception:  # noqa: BLE001 - the run's own error is what the caller raises
            pass

    def reports(self, absent=None):
        """Every party's report but those of the guests the run went on without (``absent``, by
        default those the relay dropped; ``--on-guest-failure pad``): their nodes failed, and their
        ledgers are their own (as in the local engine, they have no entry)."""
        absent = self.dropped if absent is None else absent
        # the run's public task and outputs (the host's facts): a guest that read its own table cannot
        # know them, and writes them into its saved part's manifest (fl_split/serving.py)
        extra = {} if self.public_plan is None else {"plan": R.dumps(self.public_plan)}
        reqs = {p: (R.MSG_REPORT, R.content(**extra)) for p in self.nodes if p not in absent}
        rep = self.exchange(reqs, None)
        return {p: R.loads(str(rep[p]["report"])) for p in ["host", *self.guests] if p not in absent}


def _party_order(p: str) -> tuple[int, int]:
    return (0, 0) if p == "host" else (1, int(p.split("-")[1]) if p.split("-")[-1].isdigit() else 0)


def flower_reason(reason: str) -> str:
    """One line from a Flower error reason, which reads ``<class 'X'>:<'text'>`` and may embed a
    whole remote traceback: the exception's own message, prefixed with its type if that is all."""
    text = str(reason).strip()
    m = re.fullmatch(r"<class '([^']+)'>:<'(.*)'>", text, re.S)
    kind, text = (m.group(1).rsplit(".", 1)[-1], m.group(2)) if m else ("", text)
    if "Message:" in text:
        return text.rsplit("Message:", 1)[1].strip() or "(no message)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    last = lines[-1] if lines else "(no reason given)"
    return f"{kind}: {last}" if kind and "Traceback" not in text else last


def _is_error(msg: Message) -> bool:
    return msg.has_error() or R.ERROR in msg.content.config_records


def _check_reply(msg: Message, party: str, round_: int | None):
    if msg.has_error():
        err = msg.error
        raise PartyError(party, round_, f"the ClientApp crashed (Flower error {err.code}): {flower_reason(err.reason)}")
    R.raise_error_record(msg.content, party, round_)
    if R.REPLY not in msg.content.config_records:
        raise PartyError(party, round_, "reply carries no fl_split record")
    return R.reply_of(msg.content)


# -- federation ------------------------------------------------------------------------------------
def wait_for_nodes(grid, expected: int, timeout: float, poll: float = 0.05) -> list[int]:
    """Node IDs once at least ``expected`` nodes have registered (nodes register asynchronously;
    a deployment's SuperNodes take seconds to start: a remote grid is asked every 0.25 s)."""
    if remote_grid(grid):
        poll = max(poll, 0.25)
    deadline = time.monotonic() + timeout
    while True:
        ids = sorted(int(n) for n in grid.get_node_ids())
        if len(ids) >= expected:
            return ids
        if time.monotonic() > deadline:
            raise FederationError(f"waited {timeout:g} s for {expected} nodes (1 host + {expected - 1} guests), "
                                  f"{len(ids)} registered; start the missing SuperNodes or raise --node-timeout")
        time.sleep(poll)


def validate_federation(roles: dict[int, dict[str, Any]], guests: int) -> dict[str, int]:
    """``{party: node_id}`` from the nodes' answers to the role query, or a clear error.

    A valid federation has exactly one host and guests with indices exactly ``1..guests``, each
    once (``roles`` maps node ID -> ``{"role", "guest-index", ...}``)."""
    hosts = sorted(n for n, r in roles.items() if r["role"] == "host")
    by_index: dict[int, list[int]] = {}
    for n, r in roles.items():
        if r["role"] == "guest":
            by_index.setdefault(int(r["guest-index"]), []).append(n)
    problems = []
    if len(hosts) != 1:
        problems.append(f"{len(hosts)} host nodes{' ' + str(hosts) if hosts else ''} (exactly one is needed)")
    dup = {i: ns for i, ns in by_index.items() if len(ns) > 1}
    if dup:
        problems.append("duplicate guest indices " + ", ".join(f"{i} on nodes {ns}" for i, ns in sorted(dup.items())))
    extra = sorted(i for i in by_index if not 1 <= i <= guests)
    if extra:
        problems.append(f"guest indices {extra} outside 1..{guests}")
    missing = [i for i in range(1, guests + 1) if i not in by_index]
    if missing:
        problems.append(f"no node for guest indices {missing}")
    if problems:
        raise FederationError(f"the federation does not match the run (1 host + {guests} guests, --guests "
                              f"{guests}): " + "; ".join(problems))
    nodes = {"host": hosts[0]}
    nodes.update({f"guest-{i}": by_index[i][0] for i in range(1, guests + 1)})
    return nodes


def discover(grid, cfg: RunConfig, poll: float = POLL_INTERVAL, on_registered=None) -> FlowerTransport:
    """Wait for the nodes, learn their roles, validate; a transport addressing each party
    (``on_registered``: called once the nodes have registered, before the role query)."""
    ids = wait_for_nodes(grid, cfg.guests + 1, cfg.node_timeout)
    if on_registered is not None:
        on_registered()
    probe = FlowerTransport(grid, {f"node-{n}": n for n in ids}, cfg.node_timeout, poll)
    answers = probe.exchange({f"node-{n}": (R.MSG_ROLE, R.content()) for n in ids}, None)
    roles = {int(p.split("-", 1)[1]): R.loads(str(rec["role"])) for p, rec in answers.items()}
    nodes = validate_federation(roles, cfg.guests)
    transport = FlowerTransport(grid, nodes, cfg.node_timeout, poll)
    transport.stats.workers |= probe.stats.workers
    by_node = {n: p for p, n in nodes.items()}
    transport.role_replies = {by_node[int(p.split("-", 1)[1])]: rec for p, rec in answers.items()
                              if int(p.split("-", 1)[1]) in by_node}
    return transport


def setup(transport: FlowerTransport, cfg: RunConfig, checkpoint: dict | None = None):
    """Build every party from ``cfg``; returns the run plan rebuilt from the host's public facts.
    ``checkpoint`` (``--checkpoint-dir``): the run's identity and the round to resume from, which
    every party needs to find its own checkpoint and log; its ``out`` (a resume): the guests the run
    went on without (``--on-guest-failure pad``), each told so instead — such a guest holds no
    checkpoint after its failure, restores nothing and serves no round."""
    from fl_split.party_files import PublicFacts, plan_from_facts

    config_json = R.dumps(cfg.to_flower())

    def extra(p: str) -> dict[str, Any]:
        if checkpoint is None:
            return {}
        info = {k: v for k, v in checkpoint.items() if k != "out"}
        if p in checkpoint.get("out", ()):
            info["out"] = True
        return {"checkpoint": R.dumps(info)}

    reqs = {p: (R.MSG_SETUP, R.content(config=config_json, party=p, **extra(p))) for p in transport.nodes}
    rep = transport.exchange(reqs, 0)
    transport.setup_replies = rep
    facts = {p: PublicFacts.from_json(R.loads(str(r["facts"]))) for p, r in rep.items()}
    host = facts["host"]
    for p, f in facts.items():
        for attr in ("dataset", "n_train", "n_test"):
            if getattr(f, attr) != getattr(host, attr):
                raise FederationError(f"{p}'s data disagree with the host's: {attr} = {getattr(f, attr)!r}, "
                                      f"host has {getattr(host, attr)!r} (export all party files together)")
        if p != "host" and tuple(f.input_shapes.get(p, ())) != tuple(host.input_shapes.get(p, ())):
            raise FederationError(f"{p}'s input shape {f.input_shapes.get(p)} differs from the one the host "
                                  f"expects {host.input_shapes.get(p)}")
    return plan_from_facts(cfg, host)

