"""A guest's end of the data plane: connect to the host, prove who it is, serve its requests.

:func:`serve` opens one gRPC stream to the host's :class:`~fl_split.dataplane.host.HostEndpoint`
(retrying while the host is not listening yet), runs the handshake — the guest checks the host's
proof (made with the host's private key, whose public half the coordinator relayed) before it
answers, so it never releases anything to a peer that is not the host; with TLS the host's
certificate must also name ``host`` — and then answers every STEP frame with ``step(owed, keys, round)``'s blobs in a
RELEASE frame until the host sends END. A party's own error (a malformed message it refused, a
release over its budget, anything it raises) goes back as an ERROR frame and the guest keeps
serving: the host decides to stop. A lost connection, a bad frame or no frame from the host for
twice ``timeout`` seconds (the host itself times its guests out after ``timeout``) raises
:class:`~fl_split.dataplane.errors.PeerFailure`.

A refusal the host may lift — eviction from its pool of unauthenticated streams
(``RESOURCE_EXHAUSTED``), a handshake over its deadline (``DEADLINE_EXCEEDED``) — is retried until
the connection timeout; a wrong credential or a malformed frame is not. Like the host, a guest
bounds what the peer at the host's address can make it hold (:mod:`fl_split.dataplane.limits`): one
handshake frame of a few KiB before the host proved the credential, then frames as pieces of at
most ``max_frame`` bytes (the run plan's largest).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fl_split.dataplane import frames as F
from fl_split.dataplane import limits as L
from fl_split.dataplane.errors import CredentialError, DataPlaneError, FrameError, PeerFailure
from fl_split.dataplane.host import GRPC_OPTIONS, METHOD, _Closed, _rpc_reason
from fl_split.dataplane.tls import HOST_NAME, ClientTLS

#: pause between connection attempts while the host is not listening yet
RETRY = 0.1


@dataclass
class Served:
    """What a guest did in one session."""

    steps: int = 0
    errors: int = 0
    end_reason: str = ""


def serve(party: str, step: Callable, address: str, keys: F.LinkKeys, session: str, tls: ClientTLS | None = None,
          timeout: float = 60.0, connect_timeout: float | None = None, max_frame: int | None = None,
          ops: Callable | None = None) -> Served:
    """Serve the host at ``address`` as ``party`` (``keys``: its own private key and the host's public
    key) until the host ends the session; returns what was done. ``max_frame``: the largest frame the
    host may send (:func:`fl_split.dataplane.limits.largest_frame`). ``ops(op, header, blobs, keys,
    round)`` answers a STEP frame whose header names an ``op`` (``--secure-merge`` after a guest failed:
    a new session's key agreement and the round's release again); without it such a frame is an error
    the guest reports."""
    import grpc

    host_key = keys.peer("host", party)
    connect_timeout = timeout if connect_timeout is None else connect_timeout
    deadline = time.monotonic() + connect_timeout
    attempt_error = ""
    while True:
        channel = (grpc.secure_channel(address, tls.credentials(), options=GRPC_OPTIONS + tls.channel_options())
                   if tls is not None else grpc.insecure_channel(address, options=GRPC_OPTIONS))
        link = _Stream(channel, F.MAX_FRAME if max_frame is None else max_frame)
        try:
            nonce_g, ephemeral = F.new_nonce(), F.new_private_key()
            link.send(F.pack(F.HELLO, {"party": party, "session": session, "nonce": nonce_g.hex(),
                                       "eph": F.public_key(ephemeral)}))
            first = link.receive(max(0.1, deadline - time.monotonic()))
            if isinstance(first, _Closed):
                raise _Unreachable(first.reason)
            break
        except (_Unreachable, queue.Empty) as exc:
            link.close()
            channel.close()
            attempt_error = str(exc) or "no answer"
            if "Hostname Verification" in attempt_error:
                raise PeerFailure("host", None, f"{party} refused the data-plane peer at {address}: its TLS "
                                  f"certificate does not name '{HOST_NAME}' (only the host's certificate may serve the "
                                  f"data plane; {attempt_error})") from None
            if "UNAUTHENTICATED" in attempt_error or "INVALID_ARGUMENT" in attempt_error:
                raise PeerFailure(party, None, f"the host at {address} refused {party}'s data-plane connection "
                                  f"({attempt_error})") from None
            if time.monotonic() + RETRY > deadline:
                raise PeerFailure("host", None, f"{party} cannot reach the host's data plane at {address} within "
                                  f"{connect_timeout:g} s ({attempt_error})") from None
            time.sleep(RETRY)
    try:
        who = f"the host at {address}"
        welcome = F.unpack(first, who, allowed=(F.WELCOME,))
        nonce_h, eph_h = F.parse_welcome(welcome, who)
        secrets = F.link_secrets("guest", keys.private, host_key, ephemeral, eph_h, session, party, nonce_g,
                                 nonce_h, who)
        F.check_proof(secrets, "host", welcome.header.get("proof"), who, "the host")
        link.send(F.pack(F.PROOF, {"proof": F.proof(secrets, "guest")}))
        sealer, opener = F.Sealer(secrets.to_host), F.Opener(secrets.to_guest, "the host")
        # the host times its guests out; a guest only needs to notice a host that is gone, and
        # waits longer than the host does (the host first waits for every guest to connect, and
        # computes between its frames)
        return _serve_steps(party, step, link, sealer, opener, 2 * timeout, ops)
    except (FrameError, CredentialError) as exc:
        raise PeerFailure("host", None, f"{party} refused the data-plane peer: {exc}") from None
    finally:
        link.close()
        channel.close()


def _serve_steps(party: str, step: Callable, link: "_Stream", sealer: F.Sealer, opener: F.Opener,
                 timeout: float, ops: Callable | None = None) -> Served:
    link.authenticated()
    served = Served()
    round_ = None
    while True:
        try:
            item = link.receive(timeout)
        except queue.Empty:
            raise PeerFailure("host", round_, f"{party} received nothing from the host for {timeout:g} s "
                              f"(twice --dataplane-timeout); the host stalled or failed") from None
        if isinstance(item, _Closed):
            raise PeerFailure("host", round_, f"{party} lost its connection to the host ({item.reason})")
        try:
            frame = opener.open(item, allowed=(F.STEP, F.END))
        except FrameError as exc:
            raise PeerFailure("host", round_, f"{party}: {exc}") from None
        if frame.type == F.END:
            served.end_reason = str(frame.header.get("reason", ""))
            return served
        try:
            round_ = F.int_field(frame.header, "round", "STEP", "the host")
            keys = F.keys_from_header(frame.header.get("keys"), "the host")
        except FrameError as exc:
            raise PeerFailure("host", round_, f"{party}: {exc}") from None
        op = frame.header.get("op")
        try:
            if op is None:
                blobs = step(frame.blobs, keys, round_)
            elif ops is None:
                raise FrameError(f"{party}: a STEP frame with op {str(op)[:40]!r}, which this session does not serve")
            else:
                blobs = ops(str(op), frame.header, frame.blobs, keys, round_)
        except Exception as exc:  # noqa: BLE001 - the party's own error goes back to the host
            served.errors += 1
            link.send(sealer.seal(F.ERROR, F.error_header(exc, party, round_)))
            continue
        link.send(sealer.seal(F.RELEASE, {"round": round_}, blobs))
        served.steps += 1


class _Unreachable(DataPlaneError):
    pass


class _Stream:
    """One bidirectional stream. Frames out go through a queue (gRPC consumes the request iterator
    in its own thread); frames in are read in the calling thread, with a watchdog that cancels the
    call when nothing arrives before the current deadline (so a lost host cannot block a guest)."""

    def __init__(self, channel, max_frame: int = F.MAX_FRAME) -> None:
        self._max_frame = int(max_frame)
        self._assembler: L.Assembler | None = None
        self._out: queue.Queue = queue.Queue()
        self._call = channel.stream_stream(METHOD)(self._requests())
        self._deadline = float("inf")
        self._expired = False
        self._done = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="fl_split-dataplane-watchdog", daemon=True)
        self._watchdog.start()

    def _requests(self):
        while True:
            item = self._out.get()
            if item is None:
                return
            yield item

    def _watch(self) -> None:
        while not self._done.wait(0.05):
            if time.monotonic() > self._deadline:
                self._expired = True
                self._call.cancel()
                return

    def authenticated(self) -> None:
        """The handshake is done: from now on frames go both ways as pieces."""
        self._assembler = L.Assembler(self._max_frame, "the host")

    def send(self, data: bytes) -> None:
        if self._assembler is None:
            self._out.put(data)
        else:
            for piece in L.pieces(data):
                self._out.put(piece)

    def receive(self, timeout: float):
        """The next frame, or :class:`_Closed` when the stream ended, broke or sent a frame over the
        limit; raises :class:`queue.Empty` when nothing arrived within ``timeout`` seconds."""
        self._deadline = time.monotonic() + timeout
        try:
            while True:
                data = next(self._call)
                if self._assembler is None:
                    if len(data) > L.HANDSHAKE_FRAME_BYTES:
                        return _Closed(f"the host sent a {len(data)}-byte message before proving the credential; a "
                                       f"handshake frame has at most {L.HANDSHAKE_FRAME_BYTES} bytes (not parsed)")
                    return data
                try:
                    frame = self._assembler.add(data)
                except FrameError as exc:
                    return _Closed(str(exc))
                if frame is not None:
                    return frame
        except StopIteration:
            return _Closed("the host closed the stream")
        except Exception as exc:  # noqa: BLE001 - grpc.RpcError: the stream broke, was refused or timed out
            if self._expired:
                raise queue.Empty from None
            return _Closed(_rpc_reason(exc))
        finally:
            self._deadline = float("inf")

    def close(self) -> None:
        self._done.set()
        self._out.put(None)
        try:
            self._call.cancel()
        except Exception:  # noqa: BLE001
            pass
