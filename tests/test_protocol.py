"""Wire codec round trips and the rejection of malformed messages (spec §2, design principles 1 and 4; docs/references.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_split.builder import make_parties
from fl_split.config import RunConfig
from fl_split.errors import ProtocolError
from fl_split.protocol import MAGIC, Message, batch_digest, decode, encode
from fl_split.schedule import BatchKey
from fl_split.seeding import PrivateSeed

KEY = BatchKey("train", 1, 3)


IDS = np.arange(10, 15)


def _msg(tensor, ids=None, encoding="float32", kind="activations"):
    n = tensor.shape[0]
    ids = np.arange(10, 10 + n) if ids is None else ids
    return Message(kind, "guest-1", "host", 7, KEY, batch_digest(ids), tensor, encoding)


def test_float_round_trip_is_exact():
    t = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(0))
    m = decode(encode(_msg(t)))
    assert torch.equal(m.tensor, t) and m.tensor.dtype == torch.float32
    assert (m.kind, m.sender, m.receiver, m.round, m.key) == ("activations", "guest-1", "host", 7, KEY)
    assert m.digest == batch_digest(IDS) and m.rows == 5


@pytest.mark.parametrize("width", [1, 7, 8, 9, 64, 100])
def test_bits_round_trip_and_one_bit_per_element(width):
    bits = (torch.rand(6, width, generator=torch.Generator().manual_seed(width)) > 0.5).float()
    blob_bits = encode(_msg(bits, encoding="bits"))
    blob_float = encode(_msg(bits))
    assert torch.equal(decode(blob_bits).tensor, bits)
    # payload = ceil(N/8) bytes per sample vs 4N for float32; the headers are the same size
    payload_bits = 6 * ((width + 7) // 8)
    payload_float = 6 * 4 * width
    assert len(blob_float) - len(blob_bits) == payload_float - payload_bits


def test_the_frame_is_compact_and_carries_a_batch_reference_not_ids():
    """Issue 10: no per-sample IDs on the wire. A 32 × 64-bit randomized-response message is
    1/30 of its float32 form or less (002 promises 1/32 for the payload alone)."""
    bits = (torch.rand(32, 64, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    m = Message("activations", "guest-3", "host", 1234, BatchKey("train", 12, 44), batch_digest(np.arange(32)), bits,
                "bits")
    blob_bits, blob_float = encode(m), encode(Message(**{**m.__dict__, "encoding": "float32"}))
    assert len(blob_bits) - 32 * 8 <= 18  # the whole header
    assert len(blob_bits) / len(blob_float) <= 1 / 30


def test_bits_encoding_refuses_non_binary_tensor():
    with pytest.raises(ValueError, match="zeros and ones"):
        encode(_msg(torch.tensor([[0.5, 1.0]]), encoding="bits"))


@pytest.mark.parametrize("name,bad", [("guest-0", True), ("guest-01", True), ("client", True), ("host", False),
                                      ("guest-12", False)])
def test_party_names_on_the_wire(name, bad):
    m = Message("gradients", "host", name, 1, KEY, 0, torch.ones(1, 1))
    if bad:
        with pytest.raises(ValueError, match="party name"):
            encode(m)
    else:
        assert decode(encode(m)).receiver == name


def _expect(m, **over):
    kw = dict(kind="activations", sender="guest-1", receiver="host", key=KEY, ids=np.arange(10, 10 + m.tensor.shape[0]),
              sample_shape=tuple(m.tensor.shape[1:]))
    kw.update(over)
    return m.check(**kw)


def test_check_accepts_the_expected_message():
    m = decode(encode(_msg(torch.ones(4, 2))))
    assert _expect(m) is m


@pytest.mark.parametrize("over,fragment", [
    (dict(sample_shape=(3,)), "per-sample shape"),
    (dict(ids=np.arange(20, 24)), "batch reference does not match"),
    (dict(ids=np.arange(10, 13)), "4 rows for a batch of 3 samples"),
    (dict(key=BatchKey("train", 1, 4)), "got one for train[epoch 1, batch 3]"),
    (dict(kind="gradients"), "got a 'activations' message"),
    (dict(sender="guest-2"), "got one from guest-1"),
])
def test_check_rejects_unexpected(over, fragment):
    m = decode(encode(_msg(torch.ones(4, 2))))
    with pytest.raises(ProtocolError) as exc:
        _expect(m, **over)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_check_rejects_non_finite(bad):
    t = torch.ones(3, 2)
    t[1, 1] = bad
    with pytest.raises(ProtocolError, match="NaN or infinite"):
        _expect(decode(encode(_msg(t))))


def test_check_rejects_wrong_dtype():
    m = _msg(torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(ProtocolError, match="dtype torch.float64, expected float32"):
        _expect(m)


GOOD = encode(_msg(torch.ones(2, 3)))  # F2 | flags | 1 | 0 | 7 | 1 | 3 | 2 | 1 | 3 | digest | 24 bytes


@pytest.mark.parametrize("blob,fragment", [
    (b"", "shorter than the header"),
    (b"XX\x00\x00", "bad magic"),
    (MAGIC + b"\x08" + GOOD[3:], "unknown flag bits"),
    (GOOD[:5], "header ends inside the round field"),
    (MAGIC + b"\x00" + b"\xff" * 6, "longer than 5 bytes"),
    (MAGIC + b"\x00\x81\x00" + GOOD[4:], "non-minimal encoding"),
    (GOOD[:13], "ends inside the batch digest"),
    (GOOD[:-1], "payload bytes"),
    (GOOD + b"\x00", "payload bytes"),
    (GOOD[:9] + b"\x09" + GOOD[10:], "sample dimensions"),
    ("not bytes", "expected bytes"),
])
def test_decode_rejects_malformed(blob, fragment):
    with pytest.raises((ProtocolError, ValueError)) as exc:
        decode(blob)
    assert fragment in str(exc.value)


# --- parties reject bad messages without touching their state -------------------------------------


def _snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture()
def parties():
    cfg = RunConfig(dataset="digits", guests=1, limit=120, progress=False, batch_size=16)
    return make_parties(cfg)


def test_host_rejects_nan_activations_and_keeps_state(parties):
    host, guests, plan = parties
    keys = plan.schedule.train_keys(1)[:2]
    acts = guests["guest-1"].release(keys, 1)
    m = decode(acts[1])
    m.tensor[0, 0] = float("nan")
    before = _snapshot(host.top)
    with pytest.raises(ProtocolError, match="NaN"):
        host.train(keys, {"guest-1": [acts[0], encode(m)]}, 1)
    assert _same(before, _snapshot(host.top)) and host.steps == 0
    # the good messages still train afterwards
    host.train(keys, {"guest-1": acts}, 1)
    assert host.steps == 2


def test_host_rejects_missing_guest_and_wrong_count(parties):
    host, guests, plan = parties
    keys = plan.schedule.train_keys(1)[:2]
    acts = guests["guest-1"].release(keys, 1)
    with pytest.raises(ProtocolError, match="activations from"):
        host.train(keys, {}, 1)
    with pytest.raises(ProtocolError, match="1 activation messages from guest-1, expected 2"):
        host.train(keys, {"guest-1": acts[:1]}, 1)


def test_guest_rejects_bad_gradients_and_keeps_state(parties):
    host, guests, plan = parties
    g = guests["guest-1"]
    keys = plan.schedule.train_keys(1)[:2]
    grads = host.train(keys, {"guest-1": g.release(keys, 1)}, 1)
    before = _snapshot(g.bottom)
    wrong_ids = decode(grads["guest-1"][0])
    wrong_ids.digest = batch_digest(g.ids(keys[0]) + 1)
    for bad, fragment in [([grads["guest-1"][0]], "owed for"),
                          ([encode(wrong_ids), grads["guest-1"][1]], "batch reference does not match"),
                          ([grads["guest-1"][0], grads["guest-1"][0]], "owed for"),
                          ([b"garbage", grads["guest-1"][1]], "malformed")]:
        with pytest.raises(ProtocolError, match=fragment):
            g.apply_gradients(bad)
        assert _same(before, _snapshot(g.bottom)) and g.steps == 0 and g.pending_keys == sorted(keys)
    g.apply_gradients(grads["guest-1"])
    assert g.steps == 2 and g.pending_keys == []


# -- the receiver's fast path (issue 10: the hot path) ------------------------------------------------------
def _expected(m: Message, **over) -> dict:
    kw = dict(kind=m.kind, sender=m.sender, receiver=m.receiver, round_=m.round, key=m.key, rows=m.rows,
              sample_shape=tuple(m.tensor.shape[1:]), digest=m.digest)
    kw.update(over)
    return kw


@pytest.mark.parametrize("encoding", ["float32", "bits"])
def test_fast_path_accepts_exactly_what_decode_and_check_accept(encoding):
    """``decode_expected`` gives the message ``decode`` + ``check`` give for the expected frame."""
    from fl_split.protocol import decode_expected

    t = (torch.rand(5, 3, 4, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    m = _msg(t, encoding=encoding)
    m.round = 300  # a two-byte varint
    blob = encode(m)
    fast = decode_expected(blob, **_expected(m))
    slow = decode(blob).check(kind=m.kind, sender=m.sender, receiver=m.receiver, key=m.key, ids=IDS,
                              sample_shape=(3, 4), round_=300)
    assert fast is not None and torch.equal(fast.tensor, slow.tensor)
    assert (fast.kind, fast.sender, fast.receiver, fast.round, fast.key, fast.digest, fast.encoding) == \
        (slow.kind, slow.sender, slow.receiver, slow.round, slow.key, slow.digest, slow.encoding)


@pytest.mark.parametrize("case", ["round", "sender", "receiver", "kind", "key", "digest", "rows", "shape", "nan",
                                  "inf", "huge", "truncated", "extra", "magic", "flags", "not-bytes"])
def test_fast_path_declines_anything_else(case):
    """Anything but the exact expected frame gives ``None`` (the caller then runs decode + check,
    which name the fault); nothing is converted from a frame whose header differs."""
    from fl_split.protocol import decode_expected

    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    m = _msg(t)
    blob = encode(m)
    kw = _expected(m)
    if case in ("nan", "inf", "huge"):
        bad = t.clone()
        bad[2, 1] = {"nan": float("nan"), "inf": float("inf"), "huge": 2e9}[case]
        blob = encode(_msg(bad))
    elif case == "truncated":
        blob = blob[:-1]
    elif case == "extra":
        blob = blob + b"\0"
    elif case == "magic":
        blob = b"F3" + blob[2:]
    elif case == "flags":
        blob = blob[:2] + bytes([blob[2] | 0x08]) + blob[3:]
    elif case == "not-bytes":
        blob = bytearray(blob)
    else:
        kw.update({"round": {"round_": 8}, "sender": {"sender": "guest-2"}, "receiver": {"receiver": "guest-1"},
                   "kind": {"kind": "gradients"}, "key": {"key": BatchKey("train", 1, 4)},
                   "digest": {"digest": m.digest ^ 1}, "rows": {"rows": 4}, "shape": {"sample_shape": (4,)}}[case])
    assert decode_expected(blob, **kw) is None


def test_parties_take_the_fast_path_and_train_as_before():
    """A run's messages all pass the fast path (the slow path, ``open_message`` — ``decode`` for a
    frame —, is never needed), on the wire path and on the in-process one, and the run equals the
    monolithic model (``tests/test_equivalence.py`` checks that in detail)."""
    import fl_split.parties.base as B
    import fl_split.parties.guest as G
    from fl_split.engine import LocalEngine

    calls = {"slow": 0}
    real = B.open_message
    assert G.open_message is real  # the two modules that call it

    def counting(*a, **k):
        calls["slow"] += 1
        return real(*a, **k)

    B.open_message = G.open_message = counting
    try:
        for kw in ({}, {"defense": "rr"}, {"batches_per_round": 3}):
            for codec in (True, False):
                LocalEngine(RunConfig(dataset="digits", guests=2, epochs=1, limit=200, progress=False, **kw),
                            private_seed=PrivateSeed.legacy(1), codec=codec).run()
    finally:
        B.open_message = G.open_message = real
    assert calls["slow"] == 0
