"""Data-plane frames, the handshake that authenticates each party as itself, and sealed frames.

One gRPC stream carries the frames between the host and one guest. A handshake frame is::

    b"FLDP" | version (u8) | type (u8) | sequence number (u64) | header length (u32)
            | header (JSON, UTF-8) | blob count (u32) | (blob length (u32) | blob)…

and every later frame is *sealed* (authenticated encryption, AES-256-GCM)::

    b"FLDP" | version (u8) | type (u8) | sequence number (u64) | AES-GCM(key, nonce = sequence number,
            associated data = those 14 bytes, plaintext = the frame in the form above) | tag (16 bytes)

The blobs are :mod:`fl_split.protocol` messages, opaque here: the parties encode and check them.

**Identities.** Every party makes its own X25519 key pair when it is set up
(:func:`new_private_key`); the private key never leaves the party (it stays in its node state), the
public key goes to the coordinator, which relays the host's to every guest and every guest's to the
host (:class:`LinkKeys`). There is no secret shared by the whole run: what a guest holds opens only
its own link, and nothing it holds lets it pass as another guest or as the host (design, privacy
principle 7).

**Handshake** (guest *g* with static key ``s_g``, host with ``s_h``; ``e_g`` / ``e_h`` fresh
ephemeral keys, ``N_g`` / ``N_h`` fresh nonces; ``DH`` is X25519)::

    guest → host   HELLO    {party, session, nonce N_g, eph E_g}
    host  → guest  WELCOME  {nonce N_h, eph E_h, proof_h = HMAC(k_proof, "host"  | T)}
    guest → host   PROOF    {proof_g = HMAC(k_proof, "guest" | T)}

    T  = SHA-256("fl-split dataplane v2" | session | party | N_g | N_h | S_g | S_h | E_g | E_h)
    k  = HKDF-SHA256(DH(e_h, E_g) | DH(s_h, S_g) | DH(s_h, E_g) | DH(e_h, S_g), salt = T)

(the guest computes the same four values as ``DH(e_g, E_h) | DH(s_g, S_h) | DH(e_g, S_h) |
DH(s_g, E_h)``). ``k_proof`` and one key per direction come from HKDF with distinct labels. The
static-static term makes the link secret computable only by the host and *that* guest (guest-1
lacks ``s_2`` and ``s_h``: it can pose neither as guest-2 nor as the host); the ephemeral terms make
every session's keys fresh (forward secrecy, no replay of a recorded handshake). Each side checks the
other's proof (constant time) before anything else; the host's proof comes first, so a guest never
releases anything to a peer that is not the host.

After the handshake every frame is sealed: the receiver **authenticates and decrypts a frame before
it parses the header or reads a tensor**, and the sequence number (the AES-GCM nonce, bound as
associated data) must be the next one, so a frame that was not produced by the authenticated peer of
this session, or was replayed, reordered or altered, is refused
(:class:`~fl_split.dataplane.errors.FrameError`) and nothing in the receiver changes. Sealing makes the
data plane confidential on every transport — the simulation's plaintext gRPC inside a Ray cluster
included; a deployment also runs TLS underneath (:mod:`fl_split.dataplane.tls`), where certificate
names bind to party names (``docs/deploy.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fl_split.dataplane.errors import CredentialError, DataPlaneError, FrameError

MAGIC = b"FLDP"
VERSION = 2

HELLO, WELCOME, PROOF, STEP, RELEASE, ERROR, END = range(1, 8)
NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", PROOF: "PROOF", STEP: "STEP", RELEASE: "RELEASE",
         ERROR: "ERROR", END: "END"}
#: frames exchanged before the session keys exist (they carry no tensor)
HANDSHAKE = (HELLO, WELCOME, PROOF)

_HEAD = struct.Struct("<4sBBQI")
_OUTER = struct.Struct("<4sBBQ")
_U32 = struct.Struct("<I")
TAG_BYTES = 16
KEY_BYTES = 32
NONCE_BYTES = 16
#: the largest header a receiver parses (JSON of a round's batch keys fits many times over)
MAX_HEADER = 1 << 24
#: the largest frame a receiver accepts at all (an authenticated link's own limit is the run plan's
#: largest frame, and gRPC's message limit one piece of it: :mod:`fl_split.dataplane.limits`)
MAX_FRAME = (1 << 31) - 1
_PARTY = re.compile(r"^(host|guest-[1-9][0-9]{0,5})$")
_SESSION = re.compile(r"^[0-9a-f]{8,64}$")
_PUBLIC = re.compile(r"^[0-9a-f]{64}$")


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
    """Encode one frame; with ``key`` seal it (AES-256-GCM, the sequence number as nonce; every
    frame but the handshake's)."""
    if type_ not in NAMES:
        raise ValueError(f"unknown frame type {type_!r}")
    head = json.dumps(header or {}, separators=(",", ":"), allow_nan=False).encode("utf-8")
    parts = [_HEAD.pack(MAGIC, VERSION, type_, seq, len(head)), head, _U32.pack(len(blobs))]
    for b in blobs:
        parts.append(_U32.pack(len(b)))
        parts.append(b)
    plain = b"".join(parts)
    if key is None:
        return plain
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    outer = _OUTER.pack(MAGIC, VERSION, type_, seq)
    if len(outer) + len(plain) + TAG_BYTES > MAX_FRAME:
        raise DataPlaneError(f"a {NAMES[type_]} frame of {len(plain)} bytes is over the data plane's limit of "
                             f"{MAX_FRAME} bytes; use smaller batches (--batch-size) or fewer batches per round")
    return outer + AESGCM(key).encrypt(_aead_nonce(seq), plain, outer)


def _aead_nonce(seq: int) -> bytes:
    # one key per direction and per session, and the sequence number only increases: never reused
    return b"\x00\x00\x00\x00" + struct.pack("<Q", seq)


def unpack(data: bytes, peer: str, key: bytes | None = None, expect_seq: int | None = None,
           allowed: tuple[int, ...] | None = None) -> Frame:
    """Decode a frame from ``peer``; anything malformed raises :class:`FrameError` naming the peer.

    With ``key`` the frame is sealed: the sequence number must be ``expect_seq`` and the frame must
    authenticate (AES-GCM tag) before anything in it is parsed; ``allowed`` lists the frame types
    expected here."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError(f"malformed data-plane frame from {peer}: not bytes ({type(data).__name__})")
    data = memoryview(data).cast("B")
    if len(data) > MAX_FRAME:
        raise FrameError(f"malformed data-plane frame from {peer}: {len(data)} bytes (at most {MAX_FRAME})")
    if key is not None:
        data = _open_sealed(data, peer, key, expect_seq)
    elif len(data) < _HEAD.size + 4:
        raise FrameError(f"malformed data-plane frame from {peer}: {len(data)} bytes is shorter than a frame header")
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


def _open_sealed(data: memoryview, peer: str, key: bytes, expect_seq: int | None) -> memoryview:
    """The plaintext of a sealed frame, after its sequence number and its tag are checked."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(data) < _OUTER.size + _HEAD.size + 4 + TAG_BYTES:
        raise FrameError(f"malformed data-plane frame from {peer}: {len(data)} bytes is shorter than a sealed frame")
    magic, version, type_, seq = _OUTER.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"malformed data-plane frame from {peer}: bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"data-plane frame from {peer} has protocol version {version}, this party speaks {VERSION}")
    if expect_seq is not None and seq != expect_seq:
        raise FrameError(f"refused a data-plane frame from {peer}: sequence number {seq}, expected {expect_seq} "
                         f"(replayed, lost or reordered)")
    try:
        plain = AESGCM(key).decrypt(_aead_nonce(seq), data[_OUTER.size:], data[:_OUTER.size])
    except InvalidTag:
        raise FrameError(f"refused a data-plane frame from {peer}: bad authentication tag (not sealed with this "
                         f"session's key, or altered on the way); nothing in it was read") from None
    inner = _HEAD.unpack_from(plain)
    if inner[:4] != (magic, version, type_, seq):
        raise FrameError(f"malformed data-plane frame from {peer}: its sealed head does not match its outer head")
    return memoryview(plain)


# -- identities and the handshake ------------------------------------------------------------------
def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def new_private_key() -> bytes:
    """A fresh X25519 private key (32 raw bytes, from the OS's entropy): a party's data-plane
    identity, or one session's ephemeral key."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    return X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_key(private: bytes) -> str:
    """The public half of ``private``, as 64 hex digits (what the coordinator relays)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return X25519PrivateKey.from_private_bytes(bytes(private)).public_key().public_bytes(
        Encoding.Raw, PublicFormat.Raw).hex()


def check_public_key(value: object, what: str) -> str:
    """``value`` as a public key (64 lowercase hex digits), or a :class:`DataPlaneError` naming ``what``."""
    if not (isinstance(value, str) and _PUBLIC.match(value)):
        raise DataPlaneError(f"{what}: {str(value)[:80]!r} is not an X25519 public key (64 hex digits)")
    return value


@dataclass(frozen=True)
class LinkKeys:
    """A party's data-plane identity: its own private key (never sent anywhere) and the public keys
    of the peers it may talk to (the host: each guest's; a guest: the host's), as the coordinator
    relayed them."""

    private: bytes
    peers: Mapping[str, str]

    def __post_init__(self) -> None:
        if not isinstance(self.private, (bytes, bytearray)) or len(self.private) != KEY_BYTES:
            raise DataPlaneError("a data-plane private key is 32 bytes (X25519)")
        for party, pub in self.peers.items():
            check_public_key(pub, f"the public data-plane key of {party}")

    @property
    def public(self) -> str:
        return public_key(self.private)

    def peer(self, party: str, who: str) -> bytes:
        """``party``'s public key, or a :class:`CredentialError` (``who`` connected as it)."""
        pub = self.peers.get(party)
        if pub is None:
            raise CredentialError(f"{who}: no data-plane public key of {party} was relayed to this party; "
                                  f"it is not a peer of this run")
        return bytes.fromhex(pub)

    def __repr__(self) -> str:  # never print the private key
        return f"LinkKeys(public={self.public}, peers={dict(self.peers)})"


def _dh(private: bytes, public: bytes, peer: str) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    try:
        return X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # a low-order point: the shared value would be zero, known to anyone
        raise CredentialError(f"{peer} presented an invalid data-plane key (a low-order X25519 point); "
                              f"refused before reading anything it sent") from None


@dataclass(frozen=True)
class LinkSecrets:
    """What one handshake derives: the proof key, one key per direction, the transcript hash."""

    proof_key: bytes
    to_guest: bytes
    to_host: bytes
    transcript: bytes

    def __repr__(self) -> str:  # never print a key
        return f"LinkSecrets(transcript={self.transcript.hex()})"


def link_secrets(role: str, static: bytes, peer_static: bytes, ephemeral: bytes, peer_ephemeral: bytes,
                 session: str, party: str, nonce_g: bytes, nonce_h: bytes, peer: str) -> LinkSecrets:
    """The secrets of the link between the host and guest ``party``, computed by ``role`` (``host``
    or ``guest``) from its own static and ephemeral private keys and the peer's public ones."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if role == "host":
        s_h, s_g = public_key(static), peer_static.hex()
        e_h, e_g = public_key(ephemeral), peer_ephemeral.hex()
        ikm = (_dh(ephemeral, peer_ephemeral, peer) + _dh(static, peer_static, peer)
               + _dh(static, peer_ephemeral, peer) + _dh(ephemeral, peer_static, peer))
    elif role == "guest":
        s_g, s_h = public_key(static), peer_static.hex()
        e_g, e_h = public_key(ephemeral), peer_ephemeral.hex()
        ikm = (_dh(ephemeral, peer_ephemeral, peer) + _dh(static, peer_static, peer)
               + _dh(ephemeral, peer_static, peer) + _dh(static, peer_ephemeral, peer))
    else:
        raise ValueError(f"role {role!r}")
    transcript = hashlib.sha256(b"|".join((b"fl-split dataplane v2", session.encode(), party.encode(), nonce_g,
                                           nonce_h, s_g.encode(), s_h.encode(), e_g.encode(),
                                           e_h.encode()))).digest()
    okm = HKDF(hashes.SHA256(), 3 * KEY_BYTES, transcript, b"fl-split dataplane v2 keys").derive(ikm)
    return LinkSecrets(okm[:KEY_BYTES], okm[KEY_BYTES:2 * KEY_BYTES], okm[2 * KEY_BYTES:], transcript)


def proof(secrets: LinkSecrets, role: str) -> str:
    """``role``'s (``host`` / ``guest``) proof that it computed this link's secrets."""
    return hmac.new(secrets.proof_key, role.encode() + b"|" + secrets.transcript, hashlib.sha256).hexdigest()


def check_proof(secrets: LinkSecrets, role: str, got: object, peer: str, claimed: str) -> None:
    """Raise :class:`CredentialError` naming ``peer`` unless ``got`` is ``role``'s valid proof."""
    want = proof(secrets, role)
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), want.encode()):
        raise CredentialError(f"{peer} failed to prove it is {claimed}: its {role} proof does not match the "
                              f"data-plane key relayed for {claimed}; refused before reading anything it sent")


def parse_hello(frame: Frame, peer: str) -> tuple[str, str, bytes, bytes]:
    """``(party, session, nonce_g, ephemeral public key)`` of a HELLO, checked for form."""
    h = frame.header
    party, session = h.get("party"), h.get("session")
    if not (isinstance(party, str) and _PARTY.match(party)):
        raise FrameError(f"malformed HELLO from {peer}: party {party!r} is not 'host' or 'guest-<g>'")
    if not (isinstance(session, str) and _SESSION.match(session)):
        raise FrameError(f"malformed HELLO from {peer}: session {session!r} is not a hex identifier")
    return party, session, _nonce(h.get("nonce"), "HELLO", peer), _ephemeral(h.get("eph"), "HELLO", peer)


def parse_welcome(frame: Frame, peer: str) -> tuple[bytes, bytes]:
    """``(nonce_h, ephemeral public key)`` of a WELCOME, checked for form."""
    h = frame.header
    return _nonce(h.get("nonce"), "WELCOME", peer), _ephemeral(h.get("eph"), "WELCOME", peer)


def _nonce(value: object, what: str, peer: str) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != NONCE_BYTES:
        raise FrameError(f"malformed {what} from {peer}: nonce is not {NONCE_BYTES} bytes of hex")
    return raw


def _ephemeral(value: object, what: str, peer: str) -> bytes:
    if not (isinstance(value, str) and _PUBLIC.match(value)):
        raise FrameError(f"malformed {what} from {peer}: eph is not an X25519 public key (64 hex digits)")
    return bytes.fromhex(value)


class Sealer:
    """One direction of an authenticated stream: numbers and seals outgoing frames."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seq = 0

    def seal(self, type_: int, header: dict[str, Any] | None = None, blobs=()) -> bytes:
        self.seq += 1
        return pack(type_, header, blobs, self.seq, self.key)


class Opener:
    """The other direction: checks sequence number and tag of incoming frames, in order."""

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
