"""Data-plane frames, the handshake that proves the run's credential, and per-frame MACs.

One gRPC stream carries the frames between the host and one guest. A frame is::

    b"FLDP" | version (u8) | type (u8) | sequence number (u64) | header length (u32)
            | header (JSON, UTF-8) | blob count (u32) | (blob length (u32) | blob)…
            | MAC (32 bytes; not on the three handshake frames)

The blobs are :mod:`fl_split.protocol` messages, opaque here: the parties encode and check them.

**Handshake** (the coordinator gives every party the run's *credential* ``K`` — random, per run —
and a *session* identifier per control message; the credential is never sent on the data plane)::

    guest → host   HELLO    {party, session, nonce_g}
    host  → guest  WELCOME  {nonce_h, proof_h = HMAC(K, "host"  | session | party | nonce_g | nonce_h)}
    guest → host   PROOF    {proof_g = HMAC(K, "guest" | session | party | nonce_g | nonce_h)}

Each side checks the other's proof (constant-time) before anything else: a peer without ``K``
cannot pass, and the fresh nonces stop a recorded handshake from being replayed. Both sides then
derive one key per direction from ``K`` and the transcript, and every later frame carries
``HMAC(key, sequence number | frame)``: the receiver checks the MAC and the sequence number
**before it parses the header or reads a tensor**, so a frame that was not produced by the
authenticated peer of this session, or was replayed, reordered or altered, is refused
(:class:`~fl_split.dataplane.errors.FrameError`) and nothing in the receiver changes. TLS
(:mod:`fl_split.dataplane.tls`) adds confidentiality and authenticates the host's endpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from fl_split.dataplane.errors import CredentialError, FrameError

MAGIC = b"FLDP"
VERSION = 1

HELLO, WELCOME, PROOF, STEP, RELEASE, ERROR, END = range(1, 8)
NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", PROOF: "PROOF", STEP: "STEP", RELEASE: "RELEASE",
         ERROR: "ERROR", END: "END"}
#: frames exchanged before the session keys exist (they carry no tensor)
HANDSHAKE = (HELLO, WELCOME, PROOF)

_HEAD = struct.Struct("<4sBBQI")
_U32 = struct.Struct("<I")
MAC_BYTES = 32
NONCE_BYTES = 16
#: the largest header a receiver parses (JSON of a round's batch keys fits many times over)
MAX_HEADER = 1 << 24
#: the largest frame a receiver accepts at all (an authenticated link's own limit is the run plan's
#: largest frame, and gRPC's message limit one piece of it: :mod:`fl_split.dataplane.limits`)
MAX_FRAME = (1 << 31) - 1
_PARTY = re.compile(r"^(host|guest-[1-9][0-9]{0,5})$")
_SESSION = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass
class Frame:
    """A decoded frame: its type, sequence number, JSON header and blobs."""

    type: int
    seq: int = 0
    header: dict[str, Any] = field(default_factory=dict)
    blobs: list[bytes] = field(default_factory=list)

    @property
    def name(self) -> str:
        return NAMES.get(self.type, str(self.type))


def pack(type_: int, header: dict[str, Any] | None = None, blobs=(), seq: int = 0, key: bytes | None = None) -> bytes:
    """Encode one frame; with ``key`` append its MAC (every frame but the handshake's). The blobs
    are copied once (into the frame) and hashed in place."""
    if type_ not in NAMES:
        raise ValueError(f"unknown frame type {type_!r}")
    head = json.dumps(header or {}, separators=(",", ":"), allow_nan=False).encode("utf-8")
    parts = [_HEAD.pack(MAGIC, VERSION, type_, seq, len(head)), head, _U32.pack(len(blobs))]
    for b in blobs:
        parts.append(_U32.pack(len(b)))
        parts.append(b)
    if key is not None:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        parts.append(mac.digest())
    return b"".join(parts)


def unpack(data: bytes, peer: str, key: bytes | None = None, expect_seq: int | None = None,
           allowed: tuple[int, ...] | None = None) -> Frame:
    """Decode a frame from ``peer``; anything malformed raises :class:`FrameError` naming the peer.

    With ``key`` the MAC is checked first (constant time), then the sequence number, and only then
    is the rest parsed; ``allowed`` lists the frame types expected here."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError(f"malformed data-plane frame from {peer}: not bytes ({type(data).__name__})")
    data = memoryview(data).cast("B")
    if len(data) > MAX_FRAME:
        raise FrameError(f"malformed data-plane frame from {peer}: {len(data)} bytes (at most {MAX_FRAME})")
    if len(data) < _HEAD.size + 4:
        raise FrameError(f"malformed data-plane frame from {peer}: {len(data)} bytes is shorter than a frame header")
    if key is not None:
        if len(data) < _HEAD.size + 4 + MAC_BYTES:
            raise FrameError(f"malformed data-plane frame from {peer}: too short to carry a MAC")
        body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
        if not hmac.compare_digest(bytes(mac), hmac.new(key, body, hashlib.sha256).digest()):
            raise FrameError(f"refused a data-plane frame from {peer}: bad MAC (not signed with this session's "
                             f"key derived from the run's credential, or altered on the way)")
        data = body
    magic, version, type_, seq, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"malformed data-plane frame from {peer}: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"data-plane frame from {peer} has protocol version {version}, this party speaks {VERSION}")
    if type_ not in NAMES:
        raise FrameError(f"malformed data-plane frame from {peer}: unknown frame type {type_}")
    if allowed is not None and type_ not in allowed:
        raise FrameError(f"unexpected data-plane frame from {peer}: {NAMES[type_]}, expected "
                         + " or ".join(NAMES[t] for t in allowed))
    if key is None and type_ not in HANDSHAKE:
        raise FrameError(f"refused a data-plane frame from {peer}: {NAMES[type_]} before the handshake")
    if expect_seq is not None and seq != expect_seq:
        raise FrameError(f"refused a data-plane frame from {peer}: sequence number {seq}, expected {expect_seq} "
                         f"(replayed, lost or reordered)")
    pos = _HEAD.size
    if hlen > MAX_HEADER or pos + hlen + 4 > len(data):
        raise FrameError(f"malformed data-plane frame from {peer}: header of {hlen} bytes runs past the end")
    try:
        header = json.loads(bytes(data[pos: pos + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"malformed data-plane frame from {peer}: header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise FrameError(f"malformed data-plane frame from {peer}: header is {type(header).__name__}, expected an object")
    pos += hlen
    (count,) = _U32.unpack_from(data, pos)
    pos += 4
    blobs = []
    for i in range(count):
        if pos + 4 > len(data):
            raise FrameError(f"malformed data-plane frame from {peer}: blob {i} of {count} is missing")
        (n,) = _U32.unpack_from(data, pos)
        pos += 4
        if pos + n > len(data):
            raise FrameError(f"malformed data-plane frame from {peer}: blob {i} ({n} bytes) runs past the end")
        blobs.append(bytes(data[pos: pos + n]))
        pos += n
    if pos != len(data):
        raise FrameError(f"malformed data-plane frame from {peer}: {len(data) - pos} trailing bytes")
    return Frame(type_, seq, header, blobs)


# -- handshake -----------------------------------------------------------------------------------
def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _transcript(session: str, party: str, nonce_g: bytes, nonce_h: bytes) -> bytes:
    return b"|".join((b"fl-split dataplane v1", session.encode(), party.encode(), nonce_g, nonce_h))


def proof(credential: bytes, role: str, session: str, party: str, nonce_g: bytes, nonce_h: bytes) -> str:
    """``role``'s (``host`` / ``guest``) proof of holding ``credential`` for this handshake."""
    msg = role.encode() + b"|" + _transcript(session, party, nonce_g, nonce_h)
    return hmac.new(credential, msg, hashlib.sha256).hexdigest()


def check_proof(credential: bytes, role: str, session: str, party: str, nonce_g: bytes, nonce_h: bytes,
                got: object, peer: str) -> None:
    """Raise :class:`CredentialError` naming ``peer`` unless ``got`` is ``role``'s valid proof."""
    want = proof(credential, role, session, party, nonce_g, nonce_h)
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), want.encode()):
        raise CredentialError(f"{peer} presented a wrong data-plane credential (its {role} proof does not "
                              f"match this run's credential); refused before reading anything it sent")


def session_keys(credential: bytes, session: str, party: str, nonce_g: bytes, nonce_h: bytes) -> tuple[bytes, bytes]:
    """``(host → guest key, guest → host key)`` of one authenticated stream."""
    t = _transcript(session, party, nonce_g, nonce_h)
    return (hmac.new(credential, b"key host->guest|" + t, hashlib.sha256).digest(),
            hmac.new(credential, b"key guest->host|" + t, hashlib.sha256).digest())


def parse_hello(frame: Frame, peer: str) -> tuple[str, str, bytes]:
    """``(party, session, nonce_g)`` of a HELLO, checked for form."""
    h = frame.header
    party, session, nonce = h.get("party"), h.get("session"), h.get("nonce")
    if not (isinstance(party, str) and _PARTY.match(party)):
        raise FrameError(f"malformed HELLO from {peer}: party {party!r} is not 'host' or 'guest-<g>'")
    if not (isinstance(session, str) and _SESSION.match(session)):
        raise FrameError(f"malformed HELLO from {peer}: session {session!r} is not a hex identifier")
    return party, session, _nonce(nonce, "HELLO", peer)


def _nonce(value: object, what: str, peer: str) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != NONCE_BYTES:
        raise FrameError(f"malformed {what} from {peer}: nonce is not {NONCE_BYTES} bytes of hex")
    return raw


def welcome_nonce(frame: Frame, peer: str) -> bytes:
    return _nonce(frame.header.get("nonce"), "WELCOME", peer)


class Sealer:
    """One direction of an authenticated stream: numbers and MACs outgoing frames."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seq = 0

    def seal(self, type_: int, header: dict[str, Any] | None = None, blobs=()) -> bytes:
        self.seq += 1
        return pack(type_, header, blobs, self.seq, self.key)


class Opener:
    """The other direction: checks MAC and sequence number of incoming frames, in order."""

    def __init__(self, key: bytes, peer: str) -> None:
        self.key = key
        self.peer = peer
        self.seq = 0

    def open(self, data: bytes, allowed: tuple[int, ...] | None = None) -> Frame:
        frame = unpack(data, self.peer, self.key, self.seq + 1, allowed)
        self.seq += 1
        return frame


# -- the fields of STEP / RELEASE / ERROR ----------------------------------------------------------
def keys_to_header(keys) -> list[list]:
    return [list(k.as_tuple()) for k in keys]


def keys_from_header(raw: object, peer: str):
    """Batch keys of a STEP frame (``[[phase, epoch, index], …]``), checked for form."""
    from fl_split.schedule import BatchKey

    if not isinstance(raw, list):
        raise FrameError(f"malformed STEP from {peer}: keys are {type(raw).__name__}, expected a list")
    keys = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in ("train", "test")
                and all(type(v) is int and 0 <= v < 2 ** 32 for v in item[1:])):
            raise FrameError(f"malformed STEP from {peer}: {str(item)[:60]} is not [phase, epoch, index]")
        keys.append(BatchKey(item[0], item[1], item[2]))
    return tuple(keys)


def int_field(header: dict, name: str, what: str, peer: str) -> int:
    v = header.get(name)
    if type(v) is not int:
        raise FrameError(f"malformed {what} from {peer}: {name} is {v!r}, expected an integer")
    return v


def error_header(exc: BaseException, party: str, round_: int | None) -> dict[str, Any]:
    """The header of an ERROR frame describing ``exc`` (a :class:`BudgetExceeded` keeps its fields)."""
    from fl_split.errors import BudgetExceeded

    h: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc), "party": party,
                         "round": -1 if round_ is None else int(round_)}
    if isinstance(exc, BudgetExceeded):
        h["fields"] = {"party": exc.party, "spent": _num(exc.spent), "would_be": _num(exc.would_be),
                       "budget": _num(exc.budget), "accountant": exc.accountant}
    return h


def _num(v) -> float | None:
    import math

    v = float(v)
    return v if math.isfinite(v) else None


def raise_error_frame(frame: Frame, peer: str, round_: int | None):
    """Raise what an ERROR frame from ``peer`` describes: the party's :class:`BudgetExceeded`, or a
    :class:`~fl_split.errors.PartyError` naming ``peer``."""
    from fl_split.errors import BudgetExceeded, PartyError

    h = frame.header
    kind, message = str(h.get("type", "Error"))[:200], str(h.get("message", ""))[:4000]
    f = h.get("fields")
    if kind == "BudgetExceeded" and isinstance(f, dict):
        try:
            raise BudgetExceeded(str(f["party"]), _float(f["spent"]), _float(f["would_be"]), _float(f["budget"]),
                                 str(f["accountant"]))
        except (KeyError, TypeError, ValueError):
            pass
    r = h.get("round")
    raise PartyError(peer, r if type(r) is int and r >= 0 else round_, f"{kind}: {message}")


def _float(v) -> float:
    return float("nan") if v is None else float(v)
