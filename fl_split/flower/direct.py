"""The direct data plane under Flower: one control message per party per epoch (or per N epochs).

Flower stays the control plane; within the epochs of one ``train.epoch`` message the per-batch
tensors go straight between guests and host (:mod:`fl_split.dataplane`):

* **coordinator** (:func:`coordinate_direct`, run by the ServerApp strategy): collects every
  party's data-plane *public* key from its setup reply, and for every chunk of
  ``--epochs-per-message`` epochs pushes one ``train.epoch`` message to every party together — the
  epochs, a fresh (public) session identifier, the parties' public keys, and where the host's data
  plane is — then waits for every reply. No secret of the data plane passes through Flower: each
  party's private key stays in its own node state (:func:`party_keys`). The
  host's reply carries the chunk's per-epoch aggregates (or nothing with ``--report-metrics none``),
  its wire counts, and whether it stopped (budget) or a guest failed; the coordinator assembles the
  same results dictionary as :func:`fl_split.engine.coordinate`.
* **host** (:func:`host_epochs`, in the host's ClientApp): listens (:class:`HostEndpoint`), publishes
  its address (simulation) or is reached at its configured ``dataplane-address`` (deployment), waits
  for its guests, and runs the shared coordinator loop :func:`fl_split.engine.coordinate` over the
  chunk's epochs with a :class:`HostDataPlane` transport — the very loop of the local engine, so a
  round does exactly what it does there (results are bit-identical).
* **guest** (:func:`guest_epochs`, in each guest's ClientApp): finds the host, proves it is itself
  (its private key; the host proves it is the host) and answers its STEP frames with ``party.step`` until the host ends the session.

Node config of a deployment (``flower-supernode --node-config``), besides ``role``, ``guest-index``
and ``data-path``:

=========================  =============================================================================
``dataplane-address``      host: ``HOST:PORT`` where guests reach its data plane (required)
``dataplane-bind``         host: ``ADDR:PORT`` to listen on (default ``0.0.0.0:<port of the address>``)
``dataplane-certfile``     host: its TLS certificate (PEM; must name ``host``);
                           guest: its client certificate (must name the party, e.g. ``guest-2``)
``dataplane-keyfile``      the key of ``dataplane-certfile``
``dataplane-ca``           guest: the CA that signed the host's certificate; host: the CA of the guests'
                           certificates unless ``dataplane-client-ca`` says otherwise
``dataplane-client-ca``    host: require guests to present certificates signed by this CA
``dataplane-mutual-tls``   ``false`` on a node: TLS without client certificates (default ``true``: the
                           host requires each guest's certificate and checks its name)
``dataplane-insecure``     ``true`` on a node: allow a plaintext data plane (tests on one machine only)
=========================  =============================================================================

Every stream is authenticated party by party (:mod:`fl_split.dataplane.frames`) and every frame after
the handshake is sealed (AES-GCM), so the simulation's data plane inside the Ray cluster is
confidential too. Trust root: in a simulation the coordinator relays the public keys (whoever runs
the simulation runs every party); in a deployment the CA's certificates bind party names end to end.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from typing import Any

from fl_split.config import RunConfig
from fl_split.dataplane.errors import DataPlaneError, PeerFailure
from fl_split.flower import records as R

log = logging.getLogger("fl_split.flower")

#: node-config keys of the data plane
ADDRESS, BIND, CERTFILE, KEYFILE, CA, CLIENT_CA, INSECURE, MUTUAL = (
    "dataplane-address", "dataplane-bind", "dataplane-certfile", "dataplane-keyfile", "dataplane-ca",
    "dataplane-client-ca", "dataplane-insecure", "dataplane-mutual-tls")
#: context.state key of a party's data-plane private key (its node state only; never in a message)
KEY_STATE = "fl_split.dataplane"

#: how a deployment's host starts each epoch's line in its own log (``deploy local`` follows it)
HOST_EPOCH = "host: "
#: what the host's epoch reply may say besides the per-epoch aggregates (all public counts and times)
STOPPED_KEYS = ("stopped_reason", "stopped_detail", "stopped_round")


def _flag(node_config: dict, key: str, default: bool = False) -> bool:
    v = node_config.get(key, default)
    return v is True or str(v).strip().lower() in ("1", "true", "yes", "on")


# -- identities: each party's own key pair ---------------------------------------------------------
def new_identity(state) -> str:
    """Make this party's data-plane key pair at setup (X25519, OS entropy), keep the private key in
    its node state ``state`` (``context.state``: the node's memory, never a message) and return the
    public key for the coordinator to relay. A new setup (a new run, a resume) makes a new pair."""
    from flwr.app import ConfigRecord

    from fl_split.dataplane import frames as F

    private = F.new_private_key()
    state[KEY_STATE] = ConfigRecord({"private": private})
    return F.public_key(private)


def party_keys(state, party: str, directory: dict, peers: list[str]):
    """This party's :class:`~fl_split.dataplane.frames.LinkKeys`: its private key from its node state
    and the relayed public keys of ``peers``; the directory must carry this party's own public key
    unchanged (else the coordinator relayed keys of another setup)."""
    from fl_split.dataplane import frames as F
    from fl_split.errors import ProtocolError

    rec = state.config_records.get(KEY_STATE)
    if rec is None:
        raise ProtocolError(f"{party}: no data-plane key on this node (the coordinator sends 'setup' first)")
    private = bytes(rec["private"])
    if directory.get(party) != F.public_key(private):
        raise ProtocolError(f"{party}: the coordinator relayed a data-plane public key for {party} that is not "
                            f"this node's (a stale directory from another setup?)")
    missing = [p for p in peers if p not in directory]
    if missing:
        raise ProtocolError(f"{party}: the coordinator relayed no data-plane public key for {', '.join(missing)}")
    return F.LinkKeys(private, {p: directory[p] for p in peers})


def _text(node_config: dict, key: str) -> str:
    return str(node_config.get(key, "") or "").strip()


# -- setup: what the host tells the coordinator, checked early ------------------------------------
def host_dataplane_info(role, node_config: dict) -> dict[str, Any]:
    """The host's public data-plane facts for the coordinator: where guests reach it (deployment;
    empty in simulation, where the address is published per session) and whether it uses TLS.
    Deployment settings are checked here, at setup, so a bad certificate fails before training."""
    if role.mode != "deployment":
        return {"address": "", "tls": False}
    address = _text(node_config, ADDRESS)
    if not address or ":" not in address:
        raise DataPlaneError(f"host node-config: {ADDRESS} is {address!r}; the direct data plane needs the "
                             f"HOST:PORT guests reach the host at, e.g. --node-config \"... {ADDRESS}='"
                             f"host.example.org:9300' {CERTFILE}='host.crt' {KEYFILE}='host.key'\" "
                             f"(or run with data-plane='flower')")
    tls = _server_tls(node_config)
    return {"address": address, "tls": tls is not None, "mtls": tls is not None and tls.client_ca is not None}


def _server_tls(node_config: dict):
    from fl_split.dataplane.tls import ServerTLS

    cert, key = _text(node_config, CERTFILE), _text(node_config, KEYFILE)
    if cert or key:
        if not (cert and key):
            raise DataPlaneError(f"host node-config: {CERTFILE} and {KEYFILE} go together")
        client_ca = _text(node_config, CLIENT_CA) or _text(node_config, CA)
        if not _flag(node_config, MUTUAL, True):
            client_ca = ""
        elif not client_ca:
            ServerTLS.from_files(cert, key)  # a missing certificate is named first
            raise DataPlaneError(f"host node-config: no {CLIENT_CA} (or {CA}); the data plane uses mutual TLS by "
                                 f"default — the host requires each guest's certificate and checks that it names "
                                 f"the party — so set the CA that signed the guests' certificates, or "
                                 f"{MUTUAL}=false for TLS without client certificates")
        return ServerTLS.from_files(cert, key, client_ca)
    if not _flag(node_config, INSECURE):
        raise DataPlaneError(f"host node-config: no {CERTFILE} / {KEYFILE}; a deployment's data plane uses TLS "
                             f"(or set {INSECURE}=true on every node for a plaintext data plane on one machine)")
    return None


def check_guest_node(role, node_config: dict) -> None:
    """A deployment guest's TLS settings, checked at setup."""
    if role.mode != "deployment":
        return
    if not _text(node_config, CA) and not _flag(node_config, INSECURE):
        raise DataPlaneError(f"{role.party} node-config: no {CA} (the CA that signed the host's data-plane "
                             f"certificate); a deployment's data plane uses TLS (or set {INSECURE}=true on every "
                             f"node for a plaintext data plane on one machine)")
    _client_tls(role, node_config, tls=bool(_text(node_config, CA)))


def _client_tls(role, node_config: dict, tls: bool):
    from fl_split.dataplane.tls import ClientTLS

    if not tls:
        if role.mode == "deployment" and not _flag(node_config, INSECURE):
            raise DataPlaneError(f"{role.party}: the host's data plane is plaintext and this node requires TLS "
                                 f"(set {INSECURE}=true on every node to allow it on one machine)")
        return None
    ca = _text(node_config, CA)
    if not ca:
        raise DataPlaneError(f"{role.party}: the host's data plane uses TLS; set {CA} in this node's node-config "
                             f"(the CA that signed the host's certificate)")
    if _flag(node_config, MUTUAL, True) and not (_text(node_config, CERTFILE) and _text(node_config, KEYFILE)):
        raise DataPlaneError(f"{role.party} node-config: no {CERTFILE} / {KEYFILE}; the data plane uses mutual TLS "
                             f"by default — set this guest's client certificate (named {role.party}, signed by the "
                             f"CA the host trusts), or {MUTUAL}=false on every node for TLS without client "
                             f"certificates")
    return ClientTLS.from_files(ca, _text(node_config, CERTFILE), _text(node_config, KEYFILE))


# -- the parties' side of train.epoch ----------------------------------------------------------------
def _request(req) -> tuple[int, int, str, dict, dict]:
    """``(first epoch, last epoch, session, data-plane info, public-key directory)`` of a request."""
    from fl_split.dataplane import frames as F
    from fl_split.errors import ProtocolError

    try:
        first, last = int(req["first-epoch"]), int(req["last-epoch"])
        session = str(req["session"])
        info = R.loads(str(req["dataplane"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed train.epoch request ({type(exc).__name__}: {exc})") from None
    if not (1 <= first <= last) or not isinstance(info, dict) or not isinstance(info.get("keys"), dict):
        raise ProtocolError("malformed train.epoch request (epochs, data-plane address or public keys)")
    directory = info["keys"]
    for p, pub in directory.items():
        try:
            F.check_public_key(pub, f"train.epoch request: public key of {p}")
        except DataPlaneError as exc:
            raise ProtocolError(str(exc)) from None
    return first, last, session, info, directory


def host_epochs(party, cfg: RunConfig, plan, req, role, node_config: dict, state=None,
                checkpoint=None) -> dict[str, Any]:
    """Play the request's epochs as the host, reaching the guests over the data plane; returns the
    outcome for the coordinator (the same pieces as the local engine's results, for these epochs).

    ``checkpoint(round, progress)`` (``--checkpoint-dir``) is called at each epoch end, after the
    evaluation round and before the next epoch's first STEP, with the epochs' public results since
    the message began (:func:`agree_on_round` reads them back on a resume). A deployment's host
    logs each epoch's line then, on its own machine: the coordinator hears of the message's epochs
    only when it ends."""
    from fl_split.dataplane import rendezvous
    from fl_split.dataplane.host import HostDataPlane, HostEndpoint
    from fl_split.dataplane.limits import largest_frame
    from fl_split.engine import coordinate

    first, last, session, _, directory = _request(req)
    keys = party_keys(state, party.name, directory, list(party.active_guests))
    # the largest frame an authenticated guest may send: its widest legitimate RELEASE (issue 16)
    max_frame = largest_frame(plan.schedule, cfg.batches_per_round, [plan.cut_shapes[g] for g in party.active_guests])
    if role.mode == "deployment":
        address = _text(node_config, ADDRESS)
        bind = _text(node_config, BIND) or f"0.0.0.0:{address.rsplit(':', 1)[1]}"
        endpoint = HostEndpoint(party.active_guests, keys, session, bind, _server_tls(node_config),
                                cfg.dataplane_timeout, advertise=address, max_frame=max_frame)
        board = None
    else:
        # a guest that failed in an earlier chunk (--on-guest-failure pad) is not waited for
        endpoint = HostEndpoint(party.active_guests, keys, session, f"{rendezvous.local_ip()}:0", None,
                                cfg.dataplane_timeout, max_frame=max_frame)
        board = rendezvous.board()
        board.publish(session, endpoint.address)
    def epoch_end(row: dict[str, Any], progress: dict[str, Any]) -> None:
        if role.mode == "deployment":  # the node's own log (its SuperNode's stderr): public aggregates only
            print(f"{HOST_EPOCH}{epoch_line(row, plan.metric)}", file=sys.stderr, flush=True)
        if checkpoint is not None:
            checkpoint(int(progress["round"]), {"first_epoch": first, "history": progress["history"],
                                                "wire": progress["wire"],
                                                "guest_failures": progress["guest_failures"]})

    reason = "failed"
    try:
        endpoint.wait_for_guests()
        results = coordinate(cfg.replace(progress=False), plan, HostDataPlane(party, endpoint), "flower",
                             epochs=(first, last), on_epoch=epoch_end)
        reason = "done"
    finally:
        endpoint.close(reason)
        if board is not None:
            board.withdraw(session)
    outcome: dict[str, Any] = {"history": results["history"], "wire": results["wire"],
                               "guest_failures": results.get("guest_failures", [])}
    if results.get("stopped_reason", "completed") != "completed":
        outcome["stopped"] = {k: results[k] for k in STOPPED_KEYS if k in results}
    return outcome


def guest_epochs(party, cfg: RunConfig, req, role, node_config: dict, state=None, plan=None,
                 checkpoint=None) -> dict[str, Any]:
    """Serve the host for the request's epochs; returns how many steps were served.

    ``checkpoint(round)`` (``--checkpoint-dir``, with the run ``plan``) is called after the guest
    served each epoch's evaluation round, before its release goes back: the guest's state then is
    the epoch end's (it applied the epoch's last gradients in that step)."""
    from fl_split.dataplane import rendezvous
    from fl_split.dataplane.guest import serve
    from fl_split.dataplane.limits import largest_frame

    first, last, session, info, directory = _request(req)
    step = party.step
    if checkpoint is not None:
        ends = {last_round(plan, cfg, e) for e in range(first, last + 1)}

        def step(owed, keys, round_):
            blobs = party.step(owed, keys, round_)
            if round_ in ends:
                checkpoint(round_)
            return blobs

    keys = party_keys(state, party.name, directory, ["host"])
    address = str(info.get("address", ""))
    if not address:
        address = rendezvous.board().lookup(session, cfg.dataplane_timeout) or ""
        if not address:
            raise PeerFailure("host", None, f"the host did not open its data plane within {cfg.dataplane_timeout:g} s "
                              f"(--dataplane-timeout); {party.name} waited for it")
    tls = _client_tls(role, node_config, bool(info.get("tls")))
    # the largest frame the host may send this guest: a STEP with the owed gradients of a round (issue 16)
    max_frame = largest_frame(party.schedule, cfg.batches_per_round, [party.cut_shape])
    served = serve(party.name, step, address, keys, session, tls, cfg.dataplane_timeout, max_frame=max_frame,
                   ops=_secure_ops(party, cfg, checkpoint, plan)
                   if cfg.secure_merge and cfg.on_guest_failure == "pad" else None)
    return {"steps": served.steps, "errors": served.errors, "end": served.end_reason}


def _secure_ops(party, cfg: RunConfig, checkpoint, plan):
    """A guest's answers to the host's ``op`` frames (``--secure-merge --on-guest-failure pad``: a guest
    of the round failed, so the others agree on a new session and release the round again; the host
    relays the signed keys as the coordinator does; docs/flower.md, "Secure merge on Flower")."""
    from fl_split.errors import ProtocolError

    ends = set() if checkpoint is None else {last_round(plan, cfg, e) for e in range(1, cfg.epochs + 1)}

    def ops(op: str, header: dict, blobs: list, keys, round_: int) -> list[bytes]:
        if op == "secure-announce":
            try:
                session = bytes.fromhex(str(header.get("session", "")))
            except ValueError:
                raise ProtocolError(f"{party.name}: secure merge: a session id of 16 to 64 bytes expected") from None
            return [party.relayed_announce(session, header.get("members"), cfg.on_guest_failure == "pad")]
        if op == "secure-agree":
            party.secure_agree(list(blobs))
            return []
        if op == "redo":
            out = party.redo(keys, round_)
            if round_ in ends:  # the epoch end's checkpoint was taken before the round was released again
                checkpoint(round_)
            return out
        raise ProtocolError(f"{party.name}: unknown data-plane op {op[:40]!r}")

    return ops


# -- the coordinator's side -----------------------------------------------------------------------
def public_keys(setup_replies: dict) -> dict[str, str]:
    """``{party: data-plane public key}`` from the parties' setup replies (checked for form)."""
    from fl_split.dataplane import frames as F
    from fl_split.errors import ProtocolError

    out: dict[str, str] = {}
    for party, reply in setup_replies.items():
        try:
            pub = R.loads(str(reply["dataplane"]))["public-key"]
            out[party] = F.check_public_key(pub, f"{party}'s setup reply")
        except (KeyError, TypeError, ValueError, DataPlaneError) as exc:
            raise ProtocolError(f"{party}: its setup reply carries no valid data-plane public key "
                                f"({type(exc).__name__}: {exc})") from None
    return out


def check_direct(cfg: RunConfig, host_setup, guests: int) -> None:
    """Before the first epoch: options the direct plane cannot honour, and whether the simulation
    can run every ClientApp at once (the host's setup reply says what its actor has)."""
    from fl_split.flower.resources import check_capacity, check_worker_threads, pool_widened_here

    cap = host_setup.get("capacity") if host_setup is not None else None
    if cap:  # a simulation (a deployment's nodes report no capacity)
        check_capacity(guests, R.loads(str(cap)), " (measured by the host's ClientApp)")
        if not pool_widened_here():  # `flwr run`: the SuperLink's simulation keeps Flower's thread pool
            check_worker_threads(guests)


def _first_round(plan, cfg: RunConfig, epoch: int) -> tuple[int, int]:
    """The first round of ``epoch`` and the number of rounds of ``epoch`` (public schedule)."""
    per = plan.schedule.num_train_batches()
    k = per if cfg.batches_per_round == "epoch" else max(1, int(cfg.batches_per_round))
    rounds = -(-per // k) + 1
    return (epoch - 1) * rounds + 1, rounds


def epoch_line(row: dict[str, Any], metric: str) -> str:
    """One log line of an epoch's public aggregates."""
    def fmt(v):
        return "-" if v is None else f"{v:.4f}"

    return (f"epoch {row['epoch']}: train loss {fmt(row.get('train_loss'))}, test {metric} "
            f"{fmt(row.get('test_metric'))} ({float(row.get('epoch_time_s', 0.0)):.2f} s)")


def last_round(plan, cfg: RunConfig, epoch: int) -> int:
    """The last round (the evaluation) of ``epoch``; 0 for epoch 0."""
    if epoch < 1:
        return 0
    first, per_epoch = _first_round(plan, cfg, epoch)
    return first + per_epoch - 1


def epochs_per_message(cfg: RunConfig, transport) -> int:
    """``--epochs-per-message``: the epochs one ``train.epoch`` message covers. ``auto``: the whole
    run when the nodes are a deployment's (their role replies say so) — the control plane, a few
    Flower round trips between machines, is then paid once per run, while every party checkpoints
    each epoch end and the host logs each epoch on its own machine; 1 in a simulation, where a
    message costs little and the coordinator logs each epoch as it ends."""
    if cfg.epochs_per_message != "auto":
        return int(cfg.epochs_per_message)
    roles = getattr(transport, "role_replies", {}) or {}
    modes = {R.loads(str(rep["role"])).get("mode") for rep in roles.values() if "role" in rep}
    return max(1, cfg.epochs) if "deployment" in modes else 1


def resume_round(transport, cfg: RunConfig, checkpoints) -> int:
    """A resume under Flower: ask every party which rounds it holds (``query.checkpoints``), move
    the coordinator's state on to the newest round they all hold (:func:`agree_on_round`), commit
    it and return it. The parties checkpoint every epoch end inside a control message, the
    coordinator commits only when the message ends: a run killed in the middle of a message that
    covered several epochs resumes after its last epoch every party saved, not at the message's
    start."""
    from fl_split.errors import ProtocolError

    state = checkpoints.state
    req = R.content(config=R.dumps(cfg.to_flower()), checkpoint=R.dumps({"run": state.run}))
    replies = transport.exchange({p: (R.MSG_CHECKPOINTS, req) for p in transport.nodes}, 0)
    held: dict[str, dict[int, Any]] = {}
    for party, rep in replies.items():
        try:
            held[party] = {int(r): p for r, p in R.loads(str(rep["held"])).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"{party}: malformed reply to the checkpoint query ({type(exc).__name__})") from None
    round_, progress = agree_on_round(state, held)
    if progress is not None:
        wire = dict(state.wire)
        for k, v in progress["wire"].items():
            wire[k] = int(wire.get(k, 0)) + int(v)
        checkpoints.commit(round=round_, history=[*state.history, *progress["history"]], wire=wire,
                           guest_failures=[*state.guest_failures, *progress["guest_failures"]],
                           checkpoints=state.checkpoints + 1)
        log.info("resuming after epoch %d (round %d), the newest every party checkpointed; the coordinator "
                 "had committed round %d", len(state.history), round_, checkpoints.resumed_from or 0)
    if state.resumed:
        state.resumed[-1]["agreed_round"] = round_
    checkpoints.resumed_from = round_
    return round_


def agree_on_round(state, held: dict[str, dict[int, Any]]) -> tuple[int, dict[str, Any] | None]:
    """The round a Flower run resumes from: the newest round after the coordinator's committed one
    (``state.round``) that the host and every guest still in the run hold a checkpoint of, with the
    host's record of the epochs since (``progress``, saved with its checkpoint: they must continue
    the committed history); else the committed round, with ``None``. ``held``: each party's
    ``{round: progress or None}`` (:func:`fl_split.checkpoint.held_rounds`).

    The host checkpoints an epoch end before it starts the next epoch and a guest before its last
    release of the epoch reaches the host, so the parties are at most one epoch apart and every
    party keeps its two newest checkpoints and the committed one: the newest common round is there."""
    done = len(state.history)
    padded = set(_padded(state.guest_failures))
    for round_ in sorted(held.get("host", {}), reverse=True):
        if round_ <= state.round:
            break
        progress = held["host"][round_]
        if not _continues(progress, done):
            continue
        gone = padded | set(_padded(progress["guest_failures"]))
        if all(round_ in rounds for party, rounds in held.items() if party != "host" and party not in gone):
            return round_, progress
    return state.round, None


def _continues(progress, done: int) -> bool:
    """Whether the host's ``progress`` record covers the epochs right after the ``done`` committed ones."""
    try:
        epochs = [int(h["epoch"]) for h in progress["history"]]
        return (int(progress["first_epoch"]) == done + 1 and epochs == list(range(done + 1, done + 1 + len(epochs)))
                and len(epochs) > 0 and isinstance(progress["wire"], dict)
                and isinstance(progress["guest_failures"], list))
    except (KeyError, TypeError, ValueError):
        return False


def _padded(failures: list[dict[str, Any]]) -> dict[str, int]:
    """The guests of ``failures`` the run went on without (``--on-guest-failure pad``) → their round."""
    return {str(f["guest"]): int(f["round"]) for f in failures if f.get("action") == "pad"}


def coordinate_direct(cfg: RunConfig, plan, transport, host_setup, engine: str = "flower",
                      timeline: dict | None = None, checkpoints=None) -> dict[str, Any]:
    """Run every epoch through ``train.epoch`` control messages; returns the results dictionary
    (the same as :func:`fl_split.engine.coordinate` produces for the local engine).

    ``checkpoints`` (``--checkpoint-dir``): a started :class:`fl_split.checkpoint.Checkpointer`.
    Every party checkpoints itself at each epoch end (on its own node); once every reply of a
    message is in, the coordinator commits the message's last round. A resume starts with the epoch
    after the round :func:`resume_round` agreed on (the parties restored that round at setup)."""
    from fl_split.checkpoint import CheckpointError
    from tqdm.auto import tqdm

    from fl_split.engine import make_results
    from fl_split.parties.baseline import apply_quality

    info = R.loads(str(host_setup.get("dataplane", "{}"))) if host_setup is not None else {}
    # the parties' public keys, as their setup replies gave them: relayed, never made here
    directory = public_keys(getattr(transport, "setup_replies", {}) or {})
    dataplane = R.dumps({"address": str(info.get("address", "")), "tls": bool(info.get("tls", False)),
                         "keys": directory})
    wire = {"bytes_to_host": 0, "bytes_to_guests": 0, "messages_to_host": 0, "messages_to_guests": 0, "rounds": 0}
    history: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    stopped: dict[str, Any] = {"stopped_reason": "completed"}
    bar = tqdm(total=cfg.epochs * plan.schedule.num_train_batches(), desc=f"{engine} split training (direct)",
               unit="batch", disable=not cfg.progress, leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    start = 1
    state = checkpoints.state if checkpoints is not None else None
    if state is not None and state.round > 0:
        _, per_epoch0 = _first_round(plan, cfg, 1)
        start = state.round // per_epoch0 + 1
        if state.round != last_round(plan, cfg, start - 1) or len(state.history) != start - 1:
            raise CheckpointError(f"{checkpoints.directory}: the round to resume from ({state.round}) is not the end "
                                  f"of epoch {len(state.history)} of this run's schedule")
        history = [dict(h) for h in state.history]
        wire.update(state.wire)
        failures = list(state.guest_failures)
        bar.update(plan.schedule.num_train_batches() * (start - 1))
    # --on-guest-failure pad: the guests the run goes on without (guest -> the round it failed in);
    # they get no further control message, and their error replies do not stop the run
    absent = _padded(failures)
    pad = cfg.on_guest_failure == "pad"

    def padded_by_host(party: str, reply) -> set[str]:
        return set(_padded(R.loads(str(reply["outcome"])).get("guest_failures", []))) if party == "host" else set()

    try:
        per_message = epochs_per_message(cfg, transport)
        for first in range(start, cfg.epochs + 1, per_message):
            last = min(cfg.epochs, first + per_message - 1)
            round_, per_epoch = _first_round(plan, cfg, first)
            session = secrets.token_hex(8)
            req = R.content(**{"first-epoch": first, "last-epoch": last, "session": session,
                               "dataplane": dataplane})
            # every party works for the whole chunk; the parties bound every wait by --dataplane-timeout
            limit = cfg.node_timeout + cfg.dataplane_timeout * (per_epoch * (last - first + 1) + 2)
            t = time.perf_counter()
            if timeline is not None and "training_start" not in timeline:
                timeline["training_start"] = t
            parties = [p for p in transport.nodes if p not in absent]
            replies = transport.exchange({p: (R.MSG_EPOCH, req) for p in parties}, round_, timeout=limit,
                                         fail_fast=True, optional=frozenset(parties) - {"host"} if pad else frozenset(),
                                         release=padded_by_host if pad else None)
            seconds = time.perf_counter() - t
            outcome = R.loads(str(replies["host"]["outcome"]))
            padded = _padded(outcome.get("guest_failures", []))
            for p, rep in replies.items():  # a guest failure the host did not go on without stops the run
                if isinstance(rep, Exception) and p not in padded:
                    raise rep
            absent.update(padded)
            for k in wire:
                wire[k] += int(outcome["wire"].get(k, 0))
            rows = list(outcome["history"])
            spent = sum(float(r.get("epoch_time_s", 0.0)) for r in rows)
            for r in rows:  # the control plane's share of the chunk's time, spread over its epochs
                r["epoch_time_s"] = float(r.get("epoch_time_s", 0.0)) + (seconds - spent) / max(len(rows), 1)
                history.append(r)
                # logged as each control message returns, so `flwr run --stream` shows it then
                log.info("%s", epoch_line(r, plan.metric))
            failures += list(outcome.get("guest_failures", []))
            bar.update(plan.schedule.num_train_batches() * len(rows))
            if history and history[-1].get("test_metric") is not None:
                bar.set_postfix(epoch=history[-1]["epoch"], test=f"{history[-1]['test_metric']:.4f}", refresh=False)
            if "stopped" in outcome:
                stopped = dict(outcome["stopped"])
                break
            if checkpoints is not None:  # every party saved the chunk's last round: commit it
                checkpoints.commit(round=last_round(plan, cfg, last), history=[dict(h) for h in history],
                                   wire=dict(wire), guest_failures=list(failures),
                                   checkpoints=checkpoints.state.checkpoints + 1)
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    if timeline is not None:
        timeline["training_end"] = time.perf_counter()
    reports = transport.reports(absent)
    results = make_results(cfg, plan, history, wire, elapsed, engine, parties=reports)
    results["privacy"] = {name: rep["privacy"] for name, rep in reports.items() if "privacy" in rep}
    results["guest_failures"] = failures
    results.update(stopped)
    apply_quality(results)  # "degraded": worse than the host's own baseline (fl_split/parties/baseline.py)
    if checkpoints is not None:
        checkpoints.commit(finished={"reason": stopped["stopped_reason"],
                                     "round": checkpoints.state.round})
        results["checkpoint"] = checkpoints.describe()
    return results

