"""The host's end of the data plane: a gRPC server its guests stream to, and the transport the
host's coordinator loop runs over.

:class:`HostEndpoint` listens (TLS or plaintext), runs the handshake of every incoming stream
(:mod:`fl_split.dataplane.frames`: session, party, proof that the peer holds that party's private
key; under mutual TLS also a client certificate naming that party) and keeps one authenticated link
per guest. A connection that fails the handshake — a guest posing as another, another session, an
unknown or already connected party, a malformed frame — is refused with
``UNAUTHENTICATED`` / ``INVALID_ARGUMENT`` and a message naming it; the endpoint keeps waiting for
the real guest and nothing else changes. Every frame of an authenticated link is checked
(sequence number, authentication tag, form) before it is handed on.

What an unauthenticated peer can make the host hold is bounded (:mod:`fl_split.dataplane.limits`,
issue 16): one gRPC message of :data:`~fl_split.dataplane.limits.PIECE_BYTES` (gRPC refuses a longer
one from its length prefix, before buffering it), handshake frames of a few KiB checked before they
are parsed, a pool of unauthenticated streams in which a newcomer evicts the oldest silent stream of
the address holding the most, a :data:`HANDSHAKE_TIMEOUT` of one second, and bounded refusal
records with rate-limited log lines. An authenticated link sends its frames as pieces, reassembled
up to the largest frame the run's plan allows. Guests that do not connect while unauthenticated
connections are being refused are not blamed: :class:`~fl_split.dataplane.errors.FloodError` names
the flood (how many, of which kinds, from which addresses).

:class:`HostDataPlane` is a :class:`fl_split.engine.Transport` for the host's own process:
``guest_step`` sends each guest a STEP frame (its owed gradients and the round's batch keys) and
waits for every guest's RELEASE; ``host_train`` / ``host_evaluate`` call the host party directly.
The host runs the shared round loop (:func:`fl_split.engine.play_rounds`) over it, so a round
does exactly what it does in the local engine. A guest that disconnects, stalls longer than the
timeout, or sends a bad frame raises :class:`~fl_split.dataplane.errors.PeerFailure` naming it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass

from fl_split.dataplane import frames as F
from fl_split.dataplane import limits as L
from fl_split.dataplane.errors import CredentialError, DataPlaneError, FloodError, FrameError, PeerFailure
from fl_split.dataplane.tls import ServerTLS

log = logging.getLogger("fl_split.dataplane")

SERVICE = "fl_split.dataplane.v1.DataPlane"
METHOD = f"/{SERVICE}/Session"
#: gRPC channel options on both ends: messages of one handshake frame or one piece of a frame (gRPC
#: refuses a longer message from its length prefix, before buffering it), no silent port sharing
GRPC_OPTIONS = [("grpc.max_send_message_length", L.PIECE_BYTES + 1),
                ("grpc.max_receive_message_length", L.PIECE_BYTES + 1), ("grpc.so_reuseport", 0)]
#: the server's: a connection must finish its TLS / HTTP/2 handshake within 10 s (gRPC's default: 120 s)
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.server_handshake_timeout_ms", 10_000)]
#: at most this long for each handshake frame of a new connection (a real guest sends its HELLO at
#: once and its PROOF one round trip later); a connection that overruns it is refused with
#: DEADLINE_EXCEEDED, which a guest retries
HANDSHAKE_TIMEOUT = 1.0
#: the longest a piece sent right behind the PROOF waits for the host to accept that PROOF
SETTLE_TIMEOUT = 10.0


@dataclass
class _Closed:
    """A stream ended (the peer closed it, or the connection broke)."""

    reason: str


class _Refused(_Closed):
    """An authenticated stream sent a frame over the run plan's largest; nothing more is read from it."""


@dataclass
class _Refuse:
    """A refusal waiting in a connection's handshake queue (eviction, an oversized handshake frame)."""

    exc: Exception


class _Connection:
    """One incoming stream: frames go to a private queue during the handshake, then to the
    endpoint's shared queue tagged with the guest's name."""

    def __init__(self, peer: str, max_frame: int = F.MAX_FRAME) -> None:
        self.peer = peer
        self.address = L.address_of(peer)
        #: a byte arrived (a silent stream is the first to be evicted)
        self.spoke = False
        self.max_frame = int(max_frame)
        self.assembler: L.Assembler | None = None
        self.lock = threading.Lock()
        self.private: queue.Queue = queue.Queue()
        self.shared: queue.Queue | None = None
        self.party = ""
        self.outbox: queue.Queue = queue.Queue()
        self.sealer: F.Sealer | None = None
        self.opener: F.Opener | None = None
        self.finished = threading.Event()
        #: handshake frames read so far (HELLO, PROOF)
        self.handshake_frames = 0
        #: the handshake is over, authenticated (:attr:`shared` set) or refused
        self.settled = threading.Event()

    def put(self, item) -> None:
        with self.lock:
            if self.shared is not None:
                self.shared.put((self.party, item))
            else:
                self.private.put(item)

    def feed(self, data: bytes) -> bool:
        """One gRPC message from the peer. Its first :data:`~fl_split.dataplane.limits.HANDSHAKE_FRAMES`
        messages (HELLO, PROOF) are whole handshake frames of at most
        :data:`~fl_split.dataplane.limits.HANDSHAKE_FRAME_BYTES`; a later message is a piece of a frame,
        read only once the host has accepted the PROOF (until then the reader waits, and gRPC's flow
        control holds the rest at the peer) and reassembled up to :attr:`max_frame`.
        ``False``: refused or never authenticated, read nothing more."""
        self.spoke = True
        if not self.settled.is_set():
            with self.lock:
                if self.handshake_frames < L.HANDSHAKE_FRAMES:
                    if len(data) > L.HANDSHAKE_FRAME_BYTES:
                        self.private.put(_Refuse(_Oversized(
                            f"a connection from {self.peer} sent a {len(data)}-byte message before authenticating; "
                            f"a handshake frame has at most {L.HANDSHAKE_FRAME_BYTES} bytes (refused before it was "
                            f"parsed)")))
                        return False
                    self.handshake_frames += 1
                    self.private.put(data)
                    return True
            # A piece sent right after the PROOF, before the host has checked it (a guest may start
            # sending at once): nothing of it is looked at until the connection is authenticated.
            if not self.settled.wait(SETTLE_TIMEOUT) or self.shared is None:
                return False
        with self.lock:
            try:
                frame = self.assembler.add(data)
            except FrameError as exc:
                self.shared.put((self.party, _Refused(str(exc))))
                return False
            if frame is not None:
                self.shared.put((self.party, frame))
            return True

    def push(self, frame: bytes) -> None:
        """Queue one sealed frame to the peer, as pieces."""
        for piece in L.pieces(frame):
            self.outbox.put(piece)

    def authenticated(self, party: str, shared: queue.Queue, sealer: F.Sealer, opener: F.Opener) -> None:
        with self.lock:
            self.party, self.sealer, self.opener = party, sealer, opener
            self.assembler = L.Assembler(self.max_frame, party)
            while not self.private.empty():  # only a close can be left: pieces wait in feed
                item = self.private.get_nowait()
                if isinstance(item, _Closed):
                    shared.put((party, item))
            self.shared = shared
        self.settled.set()


class HostEndpoint:
    """The host's data-plane server for one session (one control message: one or more epochs).

    ``bind`` is ``HOST:PORT`` (port 0: any free port; :attr:`address` is where it listens),
    ``keys`` the host's data-plane identity (its private key, each guest's public key),
    ``session`` the control message's session identifier, ``max_frame`` the largest frame an
    authenticated guest may send (:func:`fl_split.dataplane.limits.largest_frame` of the run's plan).

    Streams: one reserved per expected guest (its authenticated link), a pool of
    ``UNAUTHENTICATED_STREAMS`` + one per guest for streams still in their handshake
    (:class:`~fl_split.dataplane.limits.Admission`), and room for evicted ones to finish; gRPC's
    thread pool and concurrent-call limit are sized to that sum. :attr:`refusals` holds the bounded
    records of refused connections; :attr:`refused` its recent messages."""

    def __init__(self, guests: list[str], keys: F.LinkKeys, session: str, bind: str,
                 tls: ServerTLS | None = None, timeout: float = 60.0, advertise: str = "",
                 max_frame: int | None = None) -> None:
        import grpc

        self.guests = list(guests)
        self._expected = tuple(self.guests)
        self.keys = keys
        self.session = session
        self.timeout = float(timeout)
        self.tls = tls
        self.max_frame = F.MAX_FRAME if max_frame is None else min(int(max_frame), F.MAX_FRAME)
        self.refusals = L.Refusals(log)
        #: the last refusal messages (bounded; the counts are in :attr:`refusals`)
        self.refused = self.refusals.recent
        pool = L.UNAUTHENTICATED_STREAMS + len(self.guests)
        self._pool = L.Admission(pool, pool // 2)
        self._shared: queue.Queue = queue.Queue()
        self._links: dict[str, _Connection] = {}
        self._cond = threading.Condition()
        self._closed = False
        streams = len(self.guests) + pool + L.EVICTION_MARGIN
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Session": grpc.stream_stream_rpc_method_handler(self._stream)})
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams,
                                                              thread_name_prefix="fl_split-dataplane"),
                                   handlers=(handler,), options=SERVER_OPTIONS,
                                   maximum_concurrent_rpcs=streams)
        try:
            port = (self._server.add_secure_port(bind, tls.credentials()) if tls is not None
                    else self._server.add_insecure_port(bind))
        except RuntimeError as exc:
            raise DataPlaneError(f"the host cannot listen for its data plane on {bind} ({exc}); is the port "
                                 f"in use? (node config dataplane-address / dataplane-bind)") from None
        if not port:
            raise DataPlaneError(f"the host cannot listen for its data plane on {bind} (is the port in use?)")
        host = bind.rsplit(":", 1)[0]
        self.port = int(port)
        self.address = advertise or f"{host}:{self.port}"
        self._server.start()

    # -- incoming streams -------------------------------------------------------------------------
    def _stream(self, request_iterator, context):
        """Admit a new stream to the unauthenticated pool (evicting one if it is full), run it, and
        take it out of the pool whatever ends it."""
        conn = _Connection(context.peer(), self.max_frame)
        victim = self._pool.admit(conn)
        if victim is not None:
            victim.put(_Refuse(_Evicted(
                f"a connection from {victim.peer}: evicted before it authenticated (the host's data plane holds at "
                f"most {self._pool.capacity} unauthenticated streams, {self._pool.per_address} per address, and "
                f"{'this address' if victim.address == conn.address else 'the busiest address'} opened another)")))
        try:
            yield from self._session(request_iterator, context, conn)
        finally:
            self._pool.leave(conn)
            conn.settled.set()  # a reader waiting behind an unchecked PROOF stops

    def _refuse(self, conn: _Connection, exc: Exception):
        """Record a refused connection (bounded, rate-limited log); returns its gRPC status code."""
        import grpc

        msg = str(exc)
        if isinstance(exc, _Evicted):
            kind, code = "evicted", grpc.StatusCode.RESOURCE_EXHAUSTED
        elif isinstance(exc, _HandshakeTimeout):
            kind = "left" if isinstance(exc, _HandshakeLeft) else ("handshake timeout" if conn.spoke else "silent")
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        elif isinstance(exc, FrameError):
            kind = "oversized" if isinstance(exc, _Oversized) else "malformed"
            code = grpc.StatusCode.INVALID_ARGUMENT
        else:
            kind, code = "credential", grpc.StatusCode.UNAUTHENTICATED
        named = any(msg.startswith(f"{g} (connecting from") for g in self._expected)
        self.refusals.record(msg, conn.address, kind, named)
        return code

    def _session(self, request_iterator, context, conn: _Connection):
        import grpc

        def read() -> None:
            try:
                for data in request_iterator:
                    if not conn.feed(data):
                        return
                conn.put(_Closed("its stream ended: the guest process exited or closed the connection"))
            except Exception as exc:  # noqa: BLE001 - grpc.RpcError, cancellation: the link is gone
                conn.put(_Closed(_rpc_reason(exc)))

        threading.Thread(target=read, name="fl_split-dataplane-reader", daemon=True).start()
        context.add_callback(lambda: conn.put(_Closed("the connection was closed")))
        who = f"a connection from {conn.peer}"
        try:
            hello = F.unpack(_get(conn.private, HANDSHAKE_TIMEOUT, who), who, allowed=(F.HELLO,))
            party, session, nonce_g, eph_g = F.parse_hello(hello, who)
            who = f"{party} (connecting from {conn.peer})"
            if session != self.session:
                raise CredentialError(f"{who} asked for data-plane session {session}, this host serves "
                                      f"{self.session} (a stale or foreign connection)")
            if party not in self.guests:
                raise CredentialError(f"{who} is not a guest of this run (guests: {', '.join(self.guests)})")
            if self.tls is not None and self.tls.client_ca is not None:
                _check_client_certificate(context, party, who)
            ephemeral, nonce_h = F.new_private_key(), F.new_nonce()
            secrets = F.link_secrets("host", self.keys.private, self.keys.peer(party, who), ephemeral, eph_g,
                                     session, party, nonce_g, nonce_h, who)
            yield F.pack(F.WELCOME, {"nonce": nonce_h.hex(), "eph": F.public_key(ephemeral),
                                     "proof": F.proof(secrets, "host")})
            got = F.unpack(_get(conn.private, HANDSHAKE_TIMEOUT, who), who, allowed=(F.PROOF,))
            F.check_proof(secrets, "guest", got.header.get("proof"), who, party)
            with self._cond:
                if party in self._links:
                    raise CredentialError(f"{who}: {party} is already connected to this data plane")
                if self._closed:
                    raise CredentialError(f"{who}: the data plane is closing")
                if not self._pool.leave(conn):  # evicted while it finished its handshake
                    raise _Evicted(f"{who} was evicted from the host's unauthenticated streams")
                conn.authenticated(party, self._shared, F.Sealer(secrets.to_guest), F.Opener(secrets.to_host, party))
                self._links[party] = conn
                self._cond.notify_all()
        except (FrameError, CredentialError, _HandshakeTimeout, _Evicted) as exc:
            code = self._refuse(conn, exc)
            conn.finished.set()
            conn.settled.set()  # before abort (which raises): the reader stops at once
            context.abort(code, str(exc))
            return
        try:
            while True:
                item = conn.outbox.get()
                if item is None:
                    return
                yield item
        finally:
            conn.finished.set()

    # -- the host's side ---------------------------------------------------------------------------
    def wait_for_guests(self) -> None:
        """Block until every guest is connected and authenticated (at most :attr:`timeout`)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while len(self._links) < len(self.guests):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [g for g in self.guests if g not in self._links]
                    self.refusals.flush()
                    if self.refusals.anonymous:
                        raise FloodError(
                            f"{', '.join(missing)} did not connect to the host's data plane at {self.address} within "
                            f"{self.timeout:g} s (--dataplane-timeout) while the host refused "
                            f"{self.refusals.anonymous} unauthenticated connection(s) that never named a guest of "
                            f"this run ({self.refusals.describe()}): an unauthenticated flood of the data-plane "
                            f"address, which can crowd guests out — not in itself a failure of {', '.join(missing)}; "
                            f"make the address reachable only by the guests, or require client certificates "
                            f"(dataplane-client-ca)")
                    recent = list(self.refused)[-3:]
                    refused = (f"; refused {self.refusals.total} connection(s): " + " | ".join(recent)
                               if recent else "")
                    raise PeerFailure(missing[0], None, f"{', '.join(missing)} did not connect to the host's data plane "
                                      f"at {self.address} within {self.timeout:g} s (--dataplane-timeout){refused}")
                self._cond.wait(min(left, 0.5))

    def send(self, party: str, type_: int, header: dict, blobs=()) -> int:
        """Queue one frame to ``party``; returns its size in bytes."""
        conn = self._links[party]
        data = conn.sealer.seal(type_, header, blobs)
        conn.push(data)
        return len(data)

    def collect(self, round_: int, expected: list[str]) -> tuple[dict[str, list[bytes]], dict[str, str], dict[str, F.Frame]]:
        """Every expected guest's answer to round ``round_``, waiting at most :attr:`timeout`.

        Returns ``(releases, failures, errors)``: the blobs of each guest that released; for each
        guest that is lost, stalled or sent a bad frame, why (it is dropped from the endpoint: nothing
        more is read from it); each guest's ERROR frame (its own refusal or error)."""
        deadline = time.monotonic() + self.timeout
        pending = [g for g in self.guests if g in expected]
        out: dict[str, list[bytes]] = {}
        failed: dict[str, str] = {}
        errors: dict[str, F.Frame] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                for g in pending:
                    failed[g] = (f"data plane: no reply from {g} within {self.timeout:g} s (--dataplane-timeout); "
                                 f"it stalled or its machine is overloaded")
                    self.drop(g, "no reply in time")
                break
            try:
                party, item = self._shared.get(timeout=left)
            except queue.Empty:
                continue
            if party not in pending:
                continue  # a dropped guest's late frame, or its connection closing
            if isinstance(item, _Refused):
                failed[party] = f"data plane: {item.reason}"
            elif isinstance(item, _Closed):
                failed[party] = f"data plane: lost the connection to {party} ({item.reason})"
            else:
                try:
                    frame = self._links[party].opener.open(item, allowed=(F.RELEASE, F.ERROR))
                    r = F.int_field(frame.header, "round", frame.name, party)
                    if r != round_:
                        raise FrameError(f"{party} sent a {frame.name} for round {r}, expected round {round_}")
                except FrameError as exc:
                    failed[party] = f"data plane: {exc}"
                else:
                    if frame.type == F.ERROR:
                        errors[party] = frame
                    else:
                        out[party] = frame.blobs
            if party in failed:
                self.drop(party, "failed")
            pending.remove(party)
        return out, failed, errors

    def drop(self, party: str, reason: str) -> None:
        """Stop talking to ``party`` (END, then close its stream); its later frames are ignored."""
        with self._cond:
            conn = self._links.get(party)
            self.guests = [g for g in self.guests if g != party]
        if conn is not None and conn.sealer is not None:
            try:
                conn.push(conn.sealer.seal(F.END, {"reason": reason[:2000]}))
            except Exception:  # noqa: BLE001 - best effort
                pass
            conn.outbox.put(None)

    def close(self, reason: str = "done", grace: float = 5.0) -> None:
        """Tell every connected guest the session ended (``reason``) and stop listening."""
        with self._cond:
            self._closed = True
            links = list(self._links.values())
            active = [self._links[g] for g in self.guests if g in self._links]
        for conn in active:
            try:
                conn.push(conn.sealer.seal(F.END, {"reason": reason[:2000]}))
            except Exception:  # noqa: BLE001 - best effort
                pass
            conn.outbox.put(None)
        deadline = time.monotonic() + grace
        for conn in links:
            conn.finished.wait(max(0.0, deadline - time.monotonic()))
        self._server.stop(grace=0.5).wait(2.0)
        self.refusals.flush()

    def __enter__(self) -> "HostEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close("failed" if exc[0] is not None else "done")


class _HandshakeTimeout(DataPlaneError):
    pass


class _HandshakeLeft(_HandshakeTimeout):
    pass


class _Evicted(DataPlaneError):
    """Evicted from the unauthenticated pool by a newer stream (RESOURCE_EXHAUSTED: a guest retries)."""


class _Oversized(FrameError):
    """A message too large (or too many) for a handshake, refused before it was parsed."""


def certificate_names(context) -> list[str]:
    """The names (subject CN and subjectAltNames) of the client certificate of a gRPC call, from
    its TLS auth context; empty when the peer presented none."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - no TLS on this call
        return []
    names: list[str] = []
    for prop in ("x509_common_name", "x509_subject_alternative_name"):
        for v in auth.get(prop, ()) or ():
            name = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            if name not in names:
                names.append(name)
    return names


def _check_client_certificate(context, party: str, who: str) -> None:
    """Mutual TLS binds names: the guest's client certificate (signed by the CA the host trusts)
    must name the party its HELLO claims (design, privacy principle 7)."""
    names = certificate_names(context)
    if party not in names:
        raise CredentialError(f"{who}: its client certificate names {', '.join(names) or 'nobody'}, not {party}; "
                              f"under mutual TLS a guest connects only as the party its certificate names")


def _get(q: queue.Queue, timeout: float, who: str) -> bytes:
    try:
        item = q.get(timeout=timeout)
    except queue.Empty:
        raise _HandshakeTimeout(f"{who} did not complete the data-plane handshake within {timeout:g} s") from None
    if isinstance(item, _Refuse):
        raise item.exc
    if isinstance(item, _Closed):
        raise _HandshakeLeft(f"{who} left during the data-plane handshake ({item.reason})")
    return item


def _rpc_reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    try:
        if callable(code) and callable(details):
            return f"{code().name}: {details()}"
    except Exception:  # noqa: BLE001
        pass
    return f"{type(exc).__name__}: {exc}"


class HostDataPlane:
    """A :class:`fl_split.engine.Transport` inside the host: guests over the data plane, the host
    party in this process (the local engine's calls). Guests fail as in the local engine: a refusal
    over budget is re-raised, anything else makes a :class:`~fl_split.engine.GuestFailure` naming the
    guest, with the other guests' releases of the round (``--on-guest-failure`` decides)."""

    def __init__(self, host, endpoint: HostEndpoint) -> None:
        from fl_split.engine import LocalTransport

        self._local = LocalTransport(host, {}, codec=True)  # the guests are in other processes: frames
        self.host = host
        self.endpoint = endpoint
        self.guests = list(endpoint.guests)
        #: the round of the latest STEP (``None`` before this session's first): a key agreement after it
        #: is a re-keying after a guest failed (:meth:`secure_rekey`)
        self._round: int | None = None

    def guest_step(self, owed, keys, round_):
        self._round = int(round_)
        header = {"round": int(round_), "keys": F.keys_to_header(keys)}
        expected = [g for g in self.guests if g in owed]
        for g in expected:
            self.endpoint.send(g, F.STEP, header, owed[g])
        return self._collected(int(round_), expected)

    def _collected(self, round_: int, guests: list[str], note: str | None = None) -> dict[str, list[bytes]]:
        """The RELEASE blobs of ``guests`` for ``round_``. A guest's ``BudgetExceeded`` is raised as it is;
        any other failure raises :class:`~fl_split.engine.GuestFailure` with the others' releases (with a
        ``note``: without them, so the run cannot go on padded)."""
        from fl_split.engine import GuestFailure

        out, failed, errors = self.endpoint.collect(round_, guests)
        for g in guests:
            if g in errors and errors[g].header.get("type") == "BudgetExceeded":
                F.raise_error_frame(errors[g], g, round_)
        for g, frame in errors.items():
            failed[g] = f"{str(frame.header.get('type', 'Error'))[:200]}: {str(frame.header.get('message', ''))[:4000]}"
        if failed:
            raise GuestFailure(round_, failed, out if note is None else None, note=note or "")
        return out

    def secure_rekey(self, members: list[str]) -> None:
        """``--secure-merge``. Before this session's first round: nothing — the coordinator agreed the
        run's session with the guests over Flower before the first ``train.epoch``
        (:meth:`fl_split.flower.transport.FlowerTransport.secure_rekey`); a guest outside it refuses to
        release. After a guest failed mid-round (``--on-guest-failure pad``): a new session among
        ``members`` over the data plane, the host relaying as the coordinator does — each member's
        signed key (STEP ``op: secure-announce``), then every announcement to every member (``op:
        secure-agree``), which each checks against the identities it pinned itself."""
        import os

        if self._round is None:
            return
        session = os.urandom(16)
        base = {"round": self._round, "keys": []}
        anns = self._ask(members, {**base, "op": "secure-announce", "session": session.hex(), "members": list(members)})
        announcements = [anns[g][0] if anns[g] else b"" for g in members]
        self._ask(members, {**base, "op": "secure-agree"}, announcements)

    def secure_redo(self, keys, round_: int) -> dict[str, list[bytes]]:
        """``--secure-merge``, pad: every active guest releases ``keys`` again in the session just agreed
        (STEP ``op: redo``; a second release, charged in its ledger)."""
        return self._ask(list(self.endpoint.guests), {"round": int(round_), "keys": F.keys_to_header(keys),
                                                      "op": "redo"})

    def _ask(self, guests: list[str], header: dict, blobs=()) -> dict[str, list[bytes]]:
        """One STEP frame with an ``op`` to each of ``guests``; their RELEASE blobs. Any guest that fails
        here fails the round (:class:`~fl_split.engine.GuestFailure` without releases: the run stops)."""
        for g in guests:
            self.endpoint.send(g, F.STEP, header, blobs)
        return self._collected(int(header["round"]), guests,
                               note=f"in the secure-merge {header['op']} after a guest failed")

    def host_train(self, keys, acts, round_):
        return self._local.host_train(keys, acts, round_)

    def host_evaluate(self, keys, acts, round_):
        return self._local.host_evaluate(keys, acts, round_)

    def drop_guest(self, guest: str, round_: int) -> None:
        self.endpoint.drop(guest, f"dropped in round {round_} (--on-guest-failure pad)")
        self._local.drop_guest(guest, round_)

    def reports(self) -> dict:
        return {}  # the coordinator asks every party through the control plane
