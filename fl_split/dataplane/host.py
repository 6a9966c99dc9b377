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
from fl_split.dataplane.errors import CredentialError, DataPlaneError, FrameError, PeerFailure
from fl_split.dataplane.tls import ServerTLS

log = logging.getLogger("fl_split.dataplane")

SERVICE = "fl_split.dataplane.v1.DataPlane"
METHOD = f"/{SERVICE}/Session"
#: gRPC channel options on both ends: frames up to MAX_FRAME, no silent port sharing
GRPC_OPTIONS = [("grpc.max_send_message_length", F.MAX_FRAME), ("grpc.max_receive_message_length", F.MAX_FRAME),
                ("grpc.so_reuseport", 0)]
#: at most this long for a new connection to complete its handshake
HANDSHAKE_TIMEOUT = 10.0


@dataclass
class _Closed:
    """A stream ended (the peer closed it, or the connection broke)."""

    reason: str


class _Connection:
    """One incoming stream: frames go to a private queue during the handshake, then to the
    endpoint's shared queue tagged with the guest's name."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.lock = threading.Lock()
        self.private: queue.Queue = queue.Queue()
        self.shared: queue.Queue | None = None
        self.party = ""
        self.outbox: queue.Queue = queue.Queue()
        self.sealer: F.Sealer | None = None
        self.opener: F.Opener | None = None
        self.finished = threading.Event()

    def put(self, item) -> None:
        with self.lock:
            if self.shared is not None:
                self.shared.put((self.party, item))
            else:
                self.private.put(item)

    def authenticated(self, party: str, shared: queue.Queue, sealer: F.Sealer, opener: F.Opener) -> None:
        with self.lock:
            self.party, self.sealer, self.opener = party, sealer, opener
            while not self.private.empty():
                shared.put((party, self.private.get_nowait()))
            self.shared = shared


class HostEndpoint:
    """The host's data-plane server for one session (one control message: one or more epochs).

    ``bind`` is ``HOST:PORT`` (port 0: any free port; :attr:`address` is where it listens),
    ``keys`` the host's data-plane identity (its private key, each guest's public key),
    ``session`` the control message's session identifier."""

    def __init__(self, guests: list[str], keys: F.LinkKeys, session: str, bind: str,
                 tls: ServerTLS | None = None, timeout: float = 60.0, advertise: str = "") -> None:
        import grpc

        self.guests = list(guests)
        self.keys = keys
        self.session = session
        self.timeout = float(timeout)
        self.tls = tls
        self.refused: list[str] = []
        self._shared: queue.Queue = queue.Queue()
        self._links: dict[str, _Connection] = {}
        self._cond = threading.Condition()
        self._closed = False
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Session": grpc.stream_stream_rpc_method_handler(self._session)})
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=len(self.guests) + 8,
                                                              thread_name_prefix="fl_split-dataplane"),
                                   handlers=(handler,), options=GRPC_OPTIONS,
                                   maximum_concurrent_rpcs=len(self.guests) + 8)
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
    def _session(self, request_iterator, context):
        import grpc

        conn = _Connection(context.peer())

        def read() -> None:
            try:
                for data in request_iterator:
                    conn.put(data)
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
                conn.authenticated(party, self._shared, F.Sealer(secrets.to_guest), F.Opener(secrets.to_host, party))
                self._links[party] = conn
                self._cond.notify_all()
        except (FrameError, CredentialError, _HandshakeTimeout) as exc:
            msg = str(exc)
            self.refused.append(msg)
            log.warning("data plane: refused %s", msg)
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, FrameError) else grpc.StatusCode.UNAUTHENTICATED
            conn.finished.set()
            context.abort(code, msg)
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
                    refused = (f"; refused {len(self.refused)} connection(s): " + " | ".join(self.refused[-3:])
                               if self.refused else "")
                    raise PeerFailure(missing[0], None, f"{', '.join(missing)} did not connect to the host's data plane "
                                      f"at {self.address} within {self.timeout:g} s (--dataplane-timeout){refused}")
                self._cond.wait(min(left, 0.5))

    def send(self, party: str, type_: int, header: dict, blobs=()) -> int:
        """Queue one frame to ``party``; returns its size in bytes."""
        conn = self._links[party]
        data = conn.sealer.seal(type_, header, blobs)
        conn.outbox.put(data)
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
            if isinstance(item, _Closed):
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
                conn.outbox.put(conn.sealer.seal(F.END, {"reason": reason[:2000]}))
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
                conn.outbox.put(conn.sealer.seal(F.END, {"reason": reason[:2000]}))
            except Exception:  # noqa: BLE001 - best effort
                pass
            conn.outbox.put(None)
        deadline = time.monotonic() + grace
        for conn in links:
            conn.finished.wait(max(0.0, deadline - time.monotonic()))
        self._server.stop(grace=0.5).wait(2.0)

    def __enter__(self) -> "HostEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close("failed" if exc[0] is not None else "done")


class _HandshakeTimeout(DataPlaneError):
    pass


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
    if isinstance(item, _Closed):
        raise _HandshakeTimeout(f"{who} left during the data-plane handshake ({item.reason})")
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

        self._local = LocalTransport(host, {})
        self.host = host
        self.endpoint = endpoint
        self.guests = list(endpoint.guests)

    def guest_step(self, owed, keys, round_):
        from fl_split.engine import GuestFailure

        header = {"round": int(round_), "keys": F.keys_to_header(keys)}
        expected = [g for g in self.guests if g in owed]
        for g in expected:
            self.endpoint.send(g, F.STEP, header, owed[g])
        out, failed, errors = self.endpoint.collect(round_, expected)
        for g in expected:
            if g in errors and errors[g].header.get("type") == "BudgetExceeded":
                F.raise_error_frame(errors[g], g, round_)
        for g, frame in errors.items():
            failed[g] = f"{str(frame.header.get('type', 'Error'))[:200]}: {str(frame.header.get('message', ''))[:4000]}"
        if failed:
            raise GuestFailure(round_, failed, out)
        return out

    def host_train(self, keys, acts, round_):
        return self._local.host_train(keys, acts, round_)

    def host_evaluate(self, keys, acts, round_):
        return self._local.host_evaluate(keys, acts, round_)

    def drop_guest(self, guest: str, round_: int) -> None:
        self.endpoint.drop(guest, f"dropped in round {round_} (--on-guest-failure pad)")
        self._local.drop_guest(guest, round_)

    def reports(self) -> dict:
        return {}  # the coordinator asks every party through the control plane
