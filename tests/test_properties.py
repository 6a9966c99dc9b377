"""Property-based tests (hypothesis): the codec, party-state flattening and release diagnostics.

Each property holds for *every* input of its strategy, not only the hand-picked cases of the
example tests: the codec round-trips any batch exactly and answers any corrupted blob with a
``ProtocolError`` (never another exception: a peer's bad bytes must not crash a party, DESIGN
principle 4); state flattening is an exact inverse for nested containers of tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fl_split.errors import ProtocolError
from fl_split.privacy.base import ReleaseStats
from fl_split.protocol import Message, batch_digest, decode, encode
from fl_split.schedule import BatchKey
from fl_split.state import flatten, unflatten

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.tuples(st.integers(0, 9), st.lists(st.integers(1, 6), min_size=1, max_size=3))
keys = st.builds(BatchKey, st.sampled_from(["train", "test"]), st.integers(1, 500), st.integers(0, 10_000))
names = st.sampled_from(["host", "guest-1", "guest-12"])


@st.composite
def messages(draw) -> Message:
    n, sample = draw(shapes)
    shape = (n, *sample)
    encoding = draw(st.sampled_from(["float32", "bits"]))
    if encoding == "bits":
        values = draw(arrays(np.float32, shape, elements=st.sampled_from([0.0, 1.0])))
    else:
        values = draw(arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
    ids = draw(arrays(np.int64, (n,), elements=st.integers(-(2 ** 62), 2 ** 62)))
    return Message(draw(st.sampled_from(["activations", "gradients"])), draw(names), draw(names),
                   draw(st.integers(0, 2 ** 31)), draw(keys), batch_digest(ids), torch.from_numpy(values), encoding)


@SETTINGS
@given(messages())
def test_codec_round_trip_is_exact_for_any_batch(m):
    blob = encode(m)
    got = decode(blob)
    assert (got.kind, got.sender, got.receiver, got.round, got.key, got.encoding) == \
        (m.kind, m.sender, m.receiver, m.round, m.key, m.encoding)
    assert got.digest == m.digest
    assert got.tensor.dtype == torch.float32 and torch.equal(got.tensor, m.tensor)
    # a header of at most 3 + 7·5 + 5·ndim + 4 bytes (varints), then the payload: 1 bit per element
    # packed per sample (ceil(d/8) bytes) or 4 bytes per element; no per-sample IDs
    n, d = m.tensor.shape[0], math.prod(m.tensor.shape[1:])
    payload = n * ((d + 7) // 8 if m.encoding == "bits" else 4 * d)
    assert 0 < len(blob) - payload <= 3 + 7 * 5 + 5 * (m.tensor.dim() - 1) + 4


@SETTINGS
@given(messages(), st.data())
def test_corrupted_blobs_raise_protocol_error_or_decode(m, data):
    """Truncate, extend or flip bytes of a valid blob: decode either fails with ProtocolError or
    returns a well-formed Message (a flipped payload byte is still a valid float)."""
    blob = bytearray(encode(m))
    op = data.draw(st.sampled_from(["truncate", "extend", "flip"]))
    if op == "truncate":
        blob = blob[: data.draw(st.integers(0, max(len(blob) - 1, 0)))]
    elif op == "extend":
        blob += bytes(data.draw(st.binary(min_size=1, max_size=16)))
    else:
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    try:
        got = decode(bytes(blob))
    except ProtocolError:
        return
    assert isinstance(got, Message) and got.tensor.shape[0] == got.rows


@SETTINGS
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_decoder(blob):
    try:
        decode(blob)
    except ProtocolError:
        pass


tensors = st.builds(lambda a: torch.from_numpy(a),
                    arrays(st.sampled_from([np.float32, np.float64, np.int64]), st.tuples(st.integers(0, 3), st.integers(1, 3)),
                           elements=st.integers(-1000, 1000)))
leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 40), 2 ** 40), st.floats(allow_nan=False),
                   st.text(max_size=5), tensors)
nested = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner),
    st.dictionaries(st.text(min_size=1, max_size=4), inner, max_size=3),
    st.dictionaries(st.integers(0, 50), inner, min_size=1, max_size=3)), max_leaves=12)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@SETTINGS
@given(nested)
def test_state_flatten_is_an_exact_inverse(obj):
    """What a Flower node stores in context.state comes back identical (types, dtypes, int keys)."""
    arrays_, skeleton = flatten(obj)
    assert _same(unflatten(arrays_, skeleton), obj)


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 4), st.floats(0, 1e6)), min_size=1, max_size=40))
def test_release_stats_summaries_match_the_values(seq):
    rs = ReleaseStats()
    for epoch, v in seq:
        rs.add(epoch, {"snr": v})
    rep = rs.report()
    values = [v for _, v in seq]
    assert rep["releases"] == len(values)
    assert rep["overall"]["snr"]["min"] == min(values) and rep["overall"]["snr"]["max"] == max(values)
    assert math.isclose(rep["overall"]["snr"]["mean"], sum(values) / len(values), rel_tol=1e-9, abs_tol=1e-9)
    restored = ReleaseStats()
    restored.load_state_dict(unflatten(*flatten(rs.state_dict())))
    assert restored.report() == rep
