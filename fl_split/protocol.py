"""The only things that cross between parties, and their codec.

Two message kinds exist (SPEC §2):

* ``activations`` — guest → host: the guest's *released* cut-layer output ``ã_g`` for one batch;
* ``gradients`` — host → guest: the *released* partial loss ``δ̃_g = M_bwd(∂L/∂ã_g)``.

Each is encoded to one ``bytes`` blob::

    b"FLS1" | uint32 header length | header (JSON, UTF-8) | IDs (int64 LE) | payload

The payload is float32 (little-endian) or, for ``encoding="bits"``, the tensor's {0,1} values
packed 1 bit per element, ``ceil(N/8)`` bytes per sample (002 §4.4). The same blob travels
in-process (:class:`~fl_split.engine.LocalEngine`) and inside Flower records, so bytes on the
wire are counted the same way on both transports.

:func:`decode` checks structure; :meth:`Message.check` checks what the receiver expects (kind,
sender, batch, the batch's IDs, per-sample shape, finiteness). Both raise
:class:`~fl_split.errors.ProtocolError` before the receiver touches any state.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from fl_split.errors import ProtocolError
from fl_split.schedule import BatchKey

MAGIC = b"FLS1"
KINDS = ("activations", "gradients")
ENCODINGS = ("float32", "bits")
_HEAD = struct.Struct("<4sI")


@dataclass
class Message:
    kind: str
    sender: str
    receiver: str
    round: int
    key: BatchKey
    ids: np.ndarray
    tensor: torch.Tensor
    encoding: str = "float32"

    def check(self, *, kind: str, sender: str, receiver: str, key: BatchKey, ids: np.ndarray,
              sample_shape: tuple[int, ...] | None) -> "Message":
        """Raise :class:`ProtocolError` unless this is exactly the expected message."""
        who = f"{kind} from {sender} to {receiver} for {key}"
        if self.kind != kind:
            raise ProtocolError(f"expected {who}, got a '{self.kind}' message")
        if self.sender != sender or self.receiver != receiver:
            raise ProtocolError(f"expected {who}, got one from {self.sender} to {self.receiver}")
        if self.key != key:
            raise ProtocolError(f"expected {who}, got one for {self.key}")
        if len(self.ids) != len(ids) or not np.array_equal(self.ids, ids):
            raise ProtocolError(f"{who}: sample IDs do not match the batch "
                                f"({len(self.ids)} IDs received, {len(ids)} expected)")
        shape = tuple(self.tensor.shape)
        if shape[0] != len(ids):
            raise ProtocolError(f"{who}: {shape[0]} rows for {len(ids)} samples")
        if sample_shape is not None and shape[1:] != tuple(sample_shape):
            raise ProtocolError(f"{who}: per-sample shape {shape[1:]}, expected {tuple(sample_shape)}")
        if self.tensor.dtype != torch.float32:
            raise ProtocolError(f"{who}: dtype {self.tensor.dtype}, expected float32")
        if not _all_finite(self.tensor):
            raise ProtocolError(f"{who}: contains NaN or infinite values")
        return self


def _all_finite(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def encode(msg: Message) -> bytes:
    """Serialise ``msg`` (tensor moved to CPU; float32, or bit-packed when ``encoding='bits'``)."""
    if msg.kind not in KINDS:
        raise ValueError(f"unknown message kind {msg.kind!r}")
    t = msg.tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    shape = list(t.shape)
    if msg.encoding == "bits":
        flat = t.reshape(shape[0], int(np.prod(shape[1:], dtype=np.int64))).numpy()  # (also for 0 samples)
        if flat.size and not np.all((flat == 0) | (flat == 1)):
            raise ValueError("bits encoding needs a tensor of zeros and ones")
        payload = np.packbits(flat.astype(np.uint8), axis=1).tobytes()
    elif msg.encoding == "float32":
        payload = np.ascontiguousarray(t.numpy(), dtype="<f4").tobytes()
    else:
        raise ValueError(f"unknown encoding {msg.encoding!r}")
    header = json.dumps({
        "kind": msg.kind, "sender": msg.sender, "receiver": msg.receiver, "round": int(msg.round),
        "phase": msg.key.phase, "epoch": int(msg.key.epoch), "index": int(msg.key.index),
        "shape": shape, "encoding": msg.encoding,
    }, separators=(",", ":")).encode("utf-8")
    ids = np.ascontiguousarray(msg.ids, dtype="<i8").tobytes()
    return b"".join((_HEAD.pack(MAGIC, len(header)), header, ids, payload))


def decode(blob: bytes) -> Message:
    """Parse a blob produced by :func:`encode`; malformed input raises :class:`ProtocolError`."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"malformed message: expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _HEAD.size:
        raise ProtocolError(f"malformed message: {len(blob)} bytes is shorter than the header")
    magic, hlen = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise ProtocolError(f"malformed message: bad magic {magic!r}, expected {MAGIC!r}")
    end = _HEAD.size + hlen
    if end > len(blob):
        raise ProtocolError("malformed message: header runs past the end")
    try:
        h = json.loads(blob[_HEAD.size: end].decode("utf-8"))
        kind, sender, receiver = str(h["kind"]), str(h["sender"]), str(h["receiver"])
        key = BatchKey(str(h["phase"]), int(h["epoch"]), int(h["index"]))
        shape = [int(s) for s in h["shape"]]
        encoding, round_ = str(h["encoding"]), int(h["round"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed message header: {exc}") from None
    if kind not in KINDS:
        raise ProtocolError(f"malformed message: unknown kind {kind!r}")
    if encoding not in ENCODINGS:
        raise ProtocolError(f"malformed message: unknown encoding {encoding!r}")
    if not shape or any(s < 0 for s in shape):
        raise ProtocolError(f"malformed message: bad shape {shape}")
    n = shape[0]
    per_sample = int(np.prod(shape[1:], dtype=np.int64))
    id_bytes = 8 * n
    body = blob[end:]
    expected = id_bytes + (n * ((per_sample + 7) // 8) if encoding == "bits" else 4 * n * per_sample)
    if len(body) != expected:
        raise ProtocolError(f"malformed message: {len(body)} payload bytes, expected {expected} for shape {shape} ({encoding})")
    ids = np.frombuffer(body, dtype="<i8", count=n).astype(np.int64)
    if encoding == "bits":
        packed = np.frombuffer(body, dtype=np.uint8, offset=id_bytes).reshape(n, (per_sample + 7) // 8)
        flat = np.unpackbits(packed, axis=1, count=per_sample).astype(np.float32)
        tensor = torch.from_numpy(flat.reshape(shape))
    else:
        arr = np.frombuffer(body, dtype="<f4", offset=id_bytes).reshape(shape)
        tensor = torch.from_numpy(arr.copy())
    return Message(kind=kind, sender=sender, receiver=receiver, round=round_, key=key, ids=ids,
                   tensor=tensor, encoding=encoding)
