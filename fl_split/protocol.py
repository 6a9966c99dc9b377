"""The only things that cross between parties, and their codec.

Two message kinds exist (spec §2, `docs/references.md`):

* ``activations`` — guest → host: the guest's *released* cut-layer output ``ã_g`` for one batch;
* ``gradients`` — host → guest: the *released* partial loss ``δ̃_g = M_bwd(∂L/∂ã_g)``.

Each is encoded to one ``bytes`` blob, a compact binary frame (little-endian; ``varint`` =
unsigned LEB128, at most 5 bytes here)::

    b"F2" | flags (1 byte) | sender, receiver, round, epoch, index, rows, ndim, dims… (varints)
          | batch digest (uint32) | payload

``flags`` packs the kind (bit 0: gradients), the encoding (bit 1: bits) and the phase (bit 2:
test). Parties are numbered ``host`` = 0, ``guest-g`` = ``g``. The payload is float32 or, for
``encoding="bits"``, the tensor's {0,1} values packed 1 bit per element, ``ceil(N/8)`` bytes per
sample (002 §4.4).

**Batch reference, not ID lists.** Every party computes the batch's IDs from the public schedule
(``fl_split.schedule``), so a message names its batch by its key and carries a 32-bit digest of the
batch's ID list (:func:`batch_digest`) that the receiver recomputes from its own schedule: a
receiver whose schedule disagrees with the sender's refuses the message. Sending the IDs
themselves (8 bytes per sample) would be most of a randomized-response payload; with the compact
frame a 32 × 64-bit RR message costs about 1/30 of its float32 form (002 promises 1/32). The same
frame travels through Flower or the data plane; between parties in one process
(:class:`~fl_split.engine.LocalEngine`) the message is handed over as a tensor instead
(:class:`Handoff`, issue 18), checked the same way and counted at its frame's size, so bytes on the
wire are counted the same way everywhere.

:func:`decode` checks structure; :meth:`Message.check` checks what the receiver expects (kind,
sender, batch, its digest and size, per-sample shape, the round it belongs to, and the values: every
one finite with ``|x| <= MAX_ABS``). Both raise :class:`~fl_split.errors.ProtocolError` before the
receiver touches any state; nothing else escapes them for any input (a peer's bytes must not crash
a party: ``tests/test_properties.py`` and the atheris harness in ``fuzz/`` check it).

**Hostile values.** ``MAX_ABS`` (10⁹) is the receiver's rule for "enormous": a finite value beyond
it is refused like a NaN. Below it no single layer of a receiver's forward can overflow float32
(10⁹ · a weight · a layer width stays below 10²⁰ ≪ 3.4·10³⁸) and a squared value is still finite.
Every shipped mechanism releases far less (tanh + Gaussian noise, clipped Laplace and R3eLU, bits);
a Laplace scale ``b`` would have to exceed ~5·10⁷ — a release that is pure noise — to reach it.
:func:`frame_limit` bounds a frame's size by what the receiver expects, so an oversized frame is
refused before its payload is converted. Helpers that parse the other pieces of a request
(:func:`parse_keys`, :func:`blob_list`) answer malformed input with ``ProtocolError`` too.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from fl_split.errors import ProtocolError
from fl_split.schedule import BatchKey

MAGIC = b"F2"
KINDS = ("activations", "gradients")
ENCODINGS = ("float32", "bits")
PHASES = ("train", "test")
#: largest value a varint field may hold (rounds, epochs, indices, rows, dims)
MAX_FIELD = 2 ** 32 - 1
#: largest number of sample dimensions
MAX_NDIM = 8
#: largest absolute value a receiver accepts in a message (see "Hostile values")
MAX_ABS = 1e9
#: largest frame :func:`decode` converts (a receiver's own limit, :func:`frame_limit`, is tighter)
MAX_FRAME_BYTES = 1 << 31
#: largest product of a frame's dimensions (zeros counted as 1)
MAX_SHAPE = 1 << 40
#: longest JSON text of a request's batch keys (a million keys fit)
MAX_KEYS_TEXT = 1 << 25
#: most bytes a header can take: magic, flags, 7 varints, MAX_NDIM dimension varints, the digest
MAX_HEADER_BYTES = 3 + 5 * (7 + MAX_NDIM) + 4
_DIGEST = struct.Struct("<I")


def batch_digest(ids: np.ndarray) -> int:
    """A 32-bit digest of a batch's ID list (its int64 little-endian bytes, BLAKE2b): what a message
    carries instead of the IDs, so sender and receiver can check they mean the same records."""
    data = np.ascontiguousarray(ids, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


@functools.lru_cache(maxsize=1024)
def party_index(name: str) -> int:
    """``host`` → 0, ``guest-g`` → ``g`` (the numbering of the frame)."""
    if not isinstance(name, str):
        raise ValueError(f"party name {name!r}; allowed: 'host' or 'guest-<g>' with g >= 1")
    if name == "host":
        return 0
    if name.startswith("guest-") and name[6:].isdigit() and int(name[6:]) >= 1 and str(int(name[6:])) == name[6:]:
        return int(name[6:])
    raise ValueError(f"party name {name!r}; allowed: 'host' or 'guest-<g>' with g >= 1")


@functools.lru_cache(maxsize=1024)
def party_name(index: int) -> str:
    return "host" if index == 0 else f"guest-{index}"


@dataclass
class Message:
    kind: str
    sender: str
    receiver: str
    round: int
    key: BatchKey
    digest: int  # batch_digest of the batch's IDs
    tensor: torch.Tensor
    encoding: str = "float32"

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    def check(self, *, kind: str, sender: str, receiver: str, key: BatchKey, ids: np.ndarray,
              sample_shape: tuple[int, ...] | None, digest: int | None = None,
              round_: int | None = None) -> "Message":
        """Raise :class:`ProtocolError` unless this is exactly the expected message (``ids``: the
        batch's IDs by the receiver's schedule; ``digest``: their digest, if already computed;
        ``round_``: the round the message must belong to — a message replayed from another round
        is refused)."""
        who = f"{kind} from {sender} to {receiver} for {key}"
        if self.kind != kind:
            raise ProtocolError(f"expected {who}, got a '{self.kind}' message")
        if self.sender != sender or self.receiver != receiver:
            raise ProtocolError(f"expected {who}, got one from {self.sender} to {self.receiver}")
        if self.key != key:
            raise ProtocolError(f"expected {who}, got one for {self.key}")
        if self.rows != len(ids):
            raise ProtocolError(f"{who}: {self.rows} rows for a batch of {len(ids)} samples")
        if self.digest != (batch_digest(ids) if digest is None else digest):
            raise ProtocolError(f"{who}: the batch reference does not match this party's schedule (the sender "
                                f"means other sample IDs)")
        shape = tuple(self.tensor.shape)
        if sample_shape is not None and shape[1:] != tuple(sample_shape):
            raise ProtocolError(f"{who}: per-sample shape {shape[1:]}, expected {tuple(sample_shape)}")
        if round_ is not None and self.round != round_:
            raise ProtocolError(f"{who}: the message belongs to round {self.round}, expected round {round_} "
                                f"(a replayed or stale message)")
        if self.tensor.dtype != torch.float32:
            raise ProtocolError(f"{who}: dtype {self.tensor.dtype}, expected float32")
        if not _all_bounded(self.tensor):
            if not _all_finite(self.tensor):
                raise ProtocolError(f"{who}: contains NaN or infinite values")
            raise ProtocolError(f"{who}: contains values beyond ±{MAX_ABS:g} (largest |value| "
                                f"{float(self.tensor.abs().max()):.3g}); refused: using them could overflow "
                                f"the receiver's forward pass")
        return self


def _all_bounded(t: torch.Tensor) -> bool:
    """Every value finite and ``|x| <= MAX_ABS`` (NaN propagates through max/min and fails the
    comparison, as ±inf does)."""
    if t.device.type == "cpu":
        return _array_bounded(t.numpy())
    return bool((t.abs() <= MAX_ABS).all())


def _array_bounded(a: np.ndarray) -> bool:
    if a.size == 0:
        return True
    return bool(a.max() <= MAX_ABS) and bool(a.min() >= -MAX_ABS)


def _all_finite(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def frame_limit(rows: int, sample_shape: tuple[int, ...] | None) -> int:
    """The largest frame a receiver expecting ``rows`` samples of ``sample_shape`` accepts (a float32
    payload plus the longest header; ``None``: only :data:`MAX_FRAME_BYTES`)."""
    if sample_shape is None:
        return MAX_FRAME_BYTES
    return MAX_HEADER_BYTES + 4 * int(rows) * math.prod(int(d) for d in sample_shape)


def parse_keys(text: object, what: str = "batch keys") -> tuple[BatchKey, ...]:
    """Batch keys from their JSON form ``[["train", epoch, index], …]`` (as a request carries them).
    Anything else — invalid JSON, another structure, an unknown phase, a negative or non-integer
    epoch or index — is a :class:`ProtocolError`."""
    import json

    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"malformed {what}: not UTF-8 text") from None
    if not isinstance(text, str):
        raise ProtocolError(f"malformed {what}: expected JSON text, got {type(text).__name__}")
    if len(text) > MAX_KEYS_TEXT:
        raise ProtocolError(f"malformed {what}: {len(text)} characters (at most {MAX_KEYS_TEXT})")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed {what}: not JSON ({exc.__class__.__name__})") from None
    if not isinstance(raw, list):
        raise ProtocolError(f"malformed {what}: expected a list, got {type(raw).__name__}")
    keys = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in PHASES
                and all(type(v) is int and 0 <= v <= MAX_FIELD for v in item[1:])):
            shown = repr(item)
            raise ProtocolError(f"malformed {what}: {shown[:80]} is not [phase, epoch, index] with phase in "
                                f"{PHASES} and integers in 0..{MAX_FIELD}")
        keys.append(BatchKey(item[0], item[1], item[2]))
    return tuple(keys)


def blob_list(values: object, what: str = "messages") -> list[bytes]:
    """A list of message blobs from a request field (missing or empty: ``[]``). Anything but a
    list of ``bytes`` is a :class:`ProtocolError` (never ``bytes(n)``: an integer would allocate
    ``n`` zero bytes)."""
    if values is None:
        return []
    if isinstance(values, (bytes, bytearray, memoryview, str)) or not isinstance(values, (list, tuple)):
        raise ProtocolError(f"malformed {what}: expected a list of byte strings, got {type(values).__name__}")
    out = []
    total = 0
    for i, b in enumerate(values):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"malformed {what}: item {i} is {type(b).__name__}, expected bytes")
        b = bytes(b)
        total += len(b)
        if total > MAX_FRAME_BYTES:
            raise ProtocolError(f"malformed {what}: more than {MAX_FRAME_BYTES} bytes in one request")
        out.append(b)
    return out


# -- varints ------------------------------------------------------------------------------------
_SMALL_VARINTS = tuple(bytes([i]) for i in range(128))


def _varint(v: int, what: str) -> bytes:
    if type(v) is int and 0 <= v < 128:
        return _SMALL_VARINTS[v]
    if not 0 <= int(v) <= MAX_FIELD:
        raise ValueError(f"{what} {v!r} outside 0..{MAX_FIELD}")
    v = int(v)
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _varint_size(v: int, what: str) -> int:
    """``len(_varint(v, what))`` without making it (the same ``ValueError`` out of range)."""
    if type(v) is int and 0 <= v < 128:
        return 1
    if not 0 <= int(v) <= MAX_FIELD:
        raise ValueError(f"{what} {v!r} outside 0..{MAX_FIELD}")
    return (int(v).bit_length() + 6) // 7


def _read_varint(blob: bytes, pos: int, what: str) -> tuple[int, int]:
    v, shift = 0, 0
    for i in range(5):
        if pos + i >= len(blob):
            raise ProtocolError(f"malformed message: the header ends inside the {what} field")
        b = blob[pos + i]
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if v > MAX_FIELD:
                raise ProtocolError(f"malformed message: {what} {v} exceeds {MAX_FIELD}")
            if i and b == 0:
                raise ProtocolError(f"malformed message: non-minimal encoding of the {what} field")
            return v, pos + i + 1
    raise ProtocolError(f"malformed message: the {what} field is longer than 5 bytes")


# -- codec --------------------------------------------------------------------------------------
def _checked_tensor(msg: Message) -> torch.Tensor:
    """The sender's checks of :func:`encode` and :func:`handoff` (kind, encoding, phase, 1..MAX_NDIM
    + 1 dimensions: ``ValueError``); returns the tensor detached from its graph."""
    if msg.kind not in KINDS:
        raise ValueError(f"unknown message kind {msg.kind!r}")
    if msg.encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {msg.encoding!r}")
    if msg.key.phase not in PHASES:
        raise ValueError(f"unknown phase {msg.key.phase!r}")
    t = msg.tensor.detach()
    if not 1 <= t.dim() <= MAX_NDIM + 1:
        raise ValueError(f"a message tensor has 1..{MAX_NDIM + 1} dimensions, got shape {list(t.shape)}")
    return t


def encode(msg: Message) -> bytes:
    """Serialise ``msg`` (tensor moved to CPU; float32, or bit-packed when ``encoding='bits'``)."""
    t = _checked_tensor(msg)
    if t.device.type != "cpu":
        t = t.cpu()
    shape = list(t.shape)
    if msg.encoding == "bits":
        flat = t.reshape(shape[0], int(np.prod(shape[1:], dtype=np.int64))).numpy()  # (also for 0 samples)
        if flat.size and not np.all((flat == 0) | (flat == 1)):
            raise ValueError("bits encoding needs a tensor of zeros and ones")
        payload = np.packbits(flat.astype(np.uint8), axis=1).tobytes()
    else:
        payload = np.ascontiguousarray(t.numpy(), dtype="<f4").tobytes()
    return _header(msg.kind, msg.encoding, msg.sender, msg.receiver, msg.round, msg.key, shape, msg.digest) + payload


def _header(kind: str, encoding: str, sender: str, receiver: str, round_: int, key: BatchKey, shape,
            digest: int) -> bytes:
    """The frame header (everything before the payload) of a message with these fields."""
    out = bytearray(_prefix(kind, encoding, key.phase, sender, receiver))
    for what, v in zip(_HEADER_FIELDS, (round_, key.epoch, key.index, shape[0], len(shape) - 1, *shape[1:])):
        if type(v) is int and 0 <= v < 128:
            out.append(v)
        else:
            out += _varint(v, what)
    out += _DIGEST.pack(int(digest) & 0xFFFFFFFF)
    return bytes(out)


_HEADER_FIELDS = ("round", "epoch", "index", "rows", "ndim", *(["dimension"] * MAX_NDIM))


@functools.lru_cache(maxsize=1024)
def _prefix(kind: str, encoding: str, phase: str, sender: str, receiver: str) -> bytes:
    """Magic, flags, sender and receiver: the first bytes of a header."""
    if kind not in KINDS or encoding not in ENCODINGS or phase not in PHASES:
        raise ValueError(f"unknown kind, encoding or phase: {kind!r}, {encoding!r}, {phase!r}")
    flags = (KINDS.index(kind)) | (ENCODINGS.index(encoding) << 1) | (PHASES.index(phase) << 2)
    return b"".join((MAGIC, bytes([flags]), _varint(party_index(sender), "sender"),
                     _varint(party_index(receiver), "receiver")))


def decode_expected(blob: object, *, kind: str, sender: str, receiver: str, round_: int, key: BatchKey,
                    rows: int, sample_shape: tuple[int, ...], digest: int) -> Message | None:
    """The receiver's fast path: ``blob`` decoded when it is *exactly* the expected message, else ``None``.

    The frame encoding is canonical (minimal varints, fixed field order), so a blob passes
    :func:`decode` followed by :meth:`Message.check` with these arguments if and only if its header
    equals the header built from them (with either encoding), its payload has exactly the expected
    size and every value is finite and within ``MAX_ABS``. Those three comparisons are all this
    does. ``None`` means "not exactly that message": the caller then runs :func:`decode` and
    :meth:`Message.check`, which raise the specific :class:`ProtocolError` (or accept a message the
    caller may match differently, e.g. gradients in another order)."""
    if type(blob) is not bytes or type(round_) is not int or len(sample_shape) > MAX_NDIM:
        return None
    shape = (int(rows), *sample_shape)
    try:
        head = _header(kind, "float32", sender, receiver, round_, key, shape, digest)
    except (ValueError, TypeError):  # e.g. a negative round: not a frame field, so not this message
        return None
    n = len(head)
    if len(blob) < n or blob[3:n] != head[3:] or blob[:2] != MAGIC:
        return None
    flags = blob[2]
    per_sample = math.prod(sample_shape)
    if flags == head[2]:  # float32
        if len(blob) - n != 4 * shape[0] * per_sample:
            return None
        arr = np.frombuffer(blob, dtype="<f4", offset=n)
        if not _array_bounded(arr):
            return None
        tensor, encoding = torch.from_numpy(arr.reshape(shape).copy()), "float32"
    elif flags == head[2] | 2:  # bits
        width = (per_sample + 7) // 8
        if len(blob) - n != shape[0] * width:
            return None
        packed = np.frombuffer(blob, dtype=np.uint8, offset=n).reshape(shape[0], width)
        flat = np.unpackbits(packed, axis=1, count=per_sample).astype(np.float32)
        tensor, encoding = torch.from_numpy(flat.reshape(shape)), "bits"
    else:
        return None
    return Message(kind=kind, sender=sender, receiver=receiver, round=round_, key=key, digest=digest,
                   tensor=tensor, encoding=encoding)


# -- in-process hand-over ---------------------------------------------------------------------------
class Handoff(Message):
    """A message handed over to a party in the same process: the released tensor itself, on its
    device, instead of its frame (``docs/design.md``, "The in-process hot path").

    The sender makes it with :func:`handoff` (a fresh float32 copy: the sender keeps no reference
    to it, and it carries no autograd history, so the receiver can neither change the sender's
    tensors nor backpropagate into its graph); the receiver checks it with :func:`receive_expected`
    / :func:`open_message`, which apply exactly the checks a frame gets (and raise the same errors).
    ``len()`` is the size its frame would have (what the coordinator counts as bytes on the wire);
    :meth:`to_bytes` is that frame, made only when someone needs the bytes (a checkpoint of the
    owed gradients, a write-ahead log's digest). Only a transport that calls the parties in one
    process can carry one: Flower and the data plane carry bytes, and their parsers refuse
    anything else (:func:`blob_list`)."""

    _frame: bytes | None = None
    _size: int | None = None

    def __len__(self) -> int:
        if self._size is None:
            shape = tuple(self.tensor.shape)
            per_sample = math.prod(shape[1:])
            body = shape[0] * ((per_sample + 7) // 8) if self.encoding == "bits" else 4 * shape[0] * per_sample
            key = self.key
            head = len(_prefix(self.kind, self.encoding, key.phase, self.sender, self.receiver)) + _DIGEST.size
            for what, v in zip(_HEADER_FIELDS, (self.round, key.epoch, key.index, shape[0], len(shape) - 1,
                                                *shape[1:])):
                head += _varint_size(v, what)
            self._size = head + body
        return self._size

    def to_bytes(self) -> bytes:
        """The frame :func:`encode` makes of this message (made once, then kept)."""
        if self._frame is None:
            self._frame = encode(self)
        return self._frame


def handoff(msg: Message) -> Handoff:
    """``msg`` as an in-process :class:`Handoff`: the sender's side of :func:`encode` without the bytes.

    The same checks as :func:`encode` (kind, encoding, phase, 1..MAX_NDIM + 1 dimensions, header
    fields in range, a ``bits`` message holds zeros and ones: ``ValueError``), and the tensor is
    what the receiver of the frame would decode: a new, contiguous float32 tensor (bits as exact
    0.0/1.0) detached from every graph, on the sender's device — no copy to the host."""
    t = _checked_tensor(msg)
    if msg.encoding == "bits":
        if t.numel() and not bool(((t == 0) | (t == 1)).all()):
            raise ValueError("bits encoding needs a tensor of zeros and ones")
        t = t.ne(0).to(torch.float32, memory_format=torch.contiguous_format)  # a new tensor; -0.0 -> 0.0
    elif t.dtype == torch.float32:
        t = t.clone(memory_format=torch.contiguous_format)
    else:  # what encode sends of another dtype: its float32 rounding
        t = t.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    out = Handoff(kind=msg.kind, sender=msg.sender, receiver=msg.receiver, round=msg.round, key=msg.key,
                  digest=msg.digest, tensor=t, encoding=msg.encoding)
    len(out)  # the header's fields in range (ValueError), as encode checks them
    return out


def wire_bytes(item: "bytes | Handoff") -> bytes:
    """The frame of a message: ``item`` itself, or a :class:`Handoff`'s :meth:`~Handoff.to_bytes`."""
    return item.to_bytes() if isinstance(item, Handoff) else item


def open_message(item: object, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """A received message, for :meth:`Message.check`: a frame goes through :func:`decode`; a
    :class:`Handoff` gets decode's structural checks (its frame no longer than ``max_bytes``, a
    float32-able tensor of 1..MAX_NDIM + 1 dimensions), with decode's errors. Anything else is a
    :class:`ProtocolError`, as for decode."""
    if not isinstance(item, Handoff):
        return decode(item, max_bytes=max_bytes)
    t = item.tensor
    if not isinstance(t, torch.Tensor) or t.dim() < 1 or not isinstance(item.key, BatchKey):
        raise ProtocolError(f"malformed message: an in-process message without a batch tensor "
                            f"({type(t).__name__})")
    if t.dim() - 1 > MAX_NDIM:
        raise ProtocolError(f"malformed message: {t.dim() - 1} sample dimensions (at most {MAX_NDIM})")
    if t.requires_grad:  # never let a receiver's backward reach into another party's graph
        item = Handoff(kind=item.kind, sender=item.sender, receiver=item.receiver, round=item.round, key=item.key,
                       digest=item.digest, tensor=t.detach(), encoding=item.encoding)
    try:
        size = len(item)
    except (ValueError, TypeError) as exc:  # a field a frame cannot hold: no frame decodes to it
        raise ProtocolError(f"malformed message: {exc}") from None
    if size > max_bytes:
        raise ProtocolError(f"oversized message: {size} bytes, at most {max_bytes} expected")
    if item.encoding not in ENCODINGS or (item.encoding == "bits" and not _binary(item.tensor)):
        # a bits frame decodes to zeros and ones only; no frame has another encoding
        raise ProtocolError(f"malformed message: encoding {item.encoding!r} with values no frame of it can hold")
    return item


def _binary(t: torch.Tensor) -> bool:
    return t.numel() == 0 or bool(((t == 0) | (t == 1)).all())


def receive_expected(item: object, *, kind: str, sender: str, receiver: str, round_: int, key: BatchKey,
                     rows: int, sample_shape: tuple[int, ...], digest: int) -> Message | None:
    """:func:`decode_expected` for a frame or a :class:`Handoff`: the message when it is exactly the
    expected one (every header field, the shape, float32, every value finite and within
    ``MAX_ABS``), else ``None`` (the caller then runs :func:`open_message` and
    :meth:`Message.check`, which say what is wrong). For a handoff no byte is made: the fields are
    compared and the tensor's values checked where it lies (on a GPU: one reduction and one
    synchronisation)."""
    if type(item) is not Handoff:
        return decode_expected(item, kind=kind, sender=sender, receiver=receiver, round_=round_, key=key,
                               rows=rows, sample_shape=sample_shape, digest=digest)
    t = item.tensor
    if not (item.kind == kind and item.sender == sender and item.receiver == receiver and type(round_) is int
            and type(item.round) is int and item.round == round_ and type(item.key) is BatchKey and item.key == key
            and item.digest == digest and item.encoding in ENCODINGS and isinstance(t, torch.Tensor)
            and t.dtype == torch.float32 and not t.requires_grad and len(sample_shape) <= MAX_NDIM
            and tuple(t.shape) == (int(rows), *sample_shape)):
        return None
    if item.encoding == "bits" and not _binary(t):
        return None
    return item if _all_bounded(t) else None


def decode(blob: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse a blob produced by :func:`encode`; malformed input raises :class:`ProtocolError`, and
    so does a frame longer than ``max_bytes`` (checked before anything is converted)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"malformed message: expected bytes, got {type(blob).__name__}")
    size = blob.nbytes if isinstance(blob, memoryview) else len(blob)
    if size > max_bytes:
        raise ProtocolError(f"oversized message: {size} bytes, at most {max_bytes} expected")
    blob = bytes(blob)
    if len(blob) < 3:
        raise ProtocolError(f"malformed message: {len(blob)} bytes is shorter than the header")
    if blob[:2] != MAGIC:
        raise ProtocolError(f"malformed message: bad magic {blob[:2]!r}, expected {MAGIC!r}")
    flags = blob[2]
    if flags & ~0x07:
        raise ProtocolError(f"malformed message: unknown flag bits {flags:#04x}")
    kind, encoding, phase = KINDS[flags & 1], ENCODINGS[(flags >> 1) & 1], PHASES[(flags >> 2) & 1]
    pos = 3
    values = {}
    for what in ("sender", "receiver", "round", "epoch", "index", "rows", "ndim"):
        values[what], pos = _read_varint(blob, pos, what)
    if values["ndim"] > MAX_NDIM:
        raise ProtocolError(f"malformed message: {values['ndim']} sample dimensions (at most {MAX_NDIM})")
    dims = []
    for _ in range(values["ndim"]):
        d, pos = _read_varint(blob, pos, "dimension")
        dims.append(d)
    if pos + _DIGEST.size > len(blob):
        raise ProtocolError("malformed message: the header ends inside the batch digest")
    (digest,) = _DIGEST.unpack_from(blob, pos)
    pos += _DIGEST.size
    n = values["rows"]
    shape = [n, *dims]
    if math.prod(max(d, 1) for d in shape) > MAX_SHAPE:
        # even with a zero dimension (no payload), NumPy cannot describe such a shape
        raise ProtocolError(f"malformed message: shape {shape} is too large")
    per_sample = math.prod(dims)
    body = len(blob) - pos
    expected = n * ((per_sample + 7) // 8) if encoding == "bits" else 4 * n * per_sample
    if body != expected:
        raise ProtocolError(f"malformed message: {body} payload bytes, expected {expected} for shape {shape} ({encoding})")
    if encoding == "bits":
        packed = np.frombuffer(blob, dtype=np.uint8, offset=pos).reshape(n, (per_sample + 7) // 8)
        flat = np.unpackbits(packed, axis=1, count=per_sample).astype(np.float32)
        tensor = torch.from_numpy(flat.reshape(shape))
    else:
        arr = np.frombuffer(blob, dtype="<f4", offset=pos).reshape(shape)
        tensor = torch.from_numpy(arr.copy())
    return Message(kind=kind, sender=party_name(values["sender"]), receiver=party_name(values["receiver"]),
                   round=values["round"], key=BatchKey(phase, values["epoch"], values["index"]), digest=digest,
                   tensor=tensor, encoding=encoding)
