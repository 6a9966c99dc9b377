"""Wire codec round trips and the rejection of malformed messages (SPEC §2, DESIGN principle 1/4)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from fl_split.builder import make_parties
from fl_split.config import RunConfig
from fl_split.errors import ProtocolError
from fl_split.protocol import MAGIC, Message, decode, encode
from fl_split.schedule import BatchKey

KEY = BatchKey("train", 1, 3)


def _msg(tensor, ids=None, encoding="float32", kind="activations"):
    n = tensor.shape[0]
    return Message(kind, "guest-1", "host", 7, KEY, np.arange(10, 10 + n) if ids is None else ids, tensor, encoding)


def test_float_round_trip_is_exact():
    t = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(0))
    m = decode(encode(_msg(t)))
    assert torch.equal(m.tensor, t) and m.tensor.dtype == torch.float32
    assert (m.kind, m.sender, m.receiver, m.round, m.key) == ("activations", "guest-1", "host", 7, KEY)
    np.testing.assert_array_equal(m.ids, np.arange(10, 15))


@pytest.mark.parametrize("width", [1, 7, 8, 9, 64, 100])
def test_bits_round_trip_and_one_bit_per_element(width):
    bits = (torch.rand(6, width, generator=torch.Generator().manual_seed(width)) > 0.5).float()
    blob_bits = encode(_msg(bits, encoding="bits"))
    blob_float = encode(_msg(bits))
    assert torch.equal(decode(blob_bits).tensor, bits)
    # payload = ceil(N/8) bytes per sample vs 4N for float32; headers differ only in the encoding name
    payload_bits = 6 * ((width + 7) // 8)
    payload_float = 6 * 4 * width
    assert len(blob_float) - len(blob_bits) == payload_float - payload_bits + (len("float32") - len("bits"))


def test_bits_encoding_refuses_non_binary_tensor():
    with pytest.raises(ValueError, match="zeros and ones"):
        encode(_msg(torch.tensor([[0.5, 1.0]]), encoding="bits"))


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
    (dict(ids=np.arange(20, 24)), "sample IDs do not match"),
    (dict(ids=np.arange(10, 13)), "sample IDs do not match"),
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


def _forge(header_changes=None, body=None, magic=MAGIC):
    good = encode(_msg(torch.ones(2, 3)))
    (hlen,) = struct.unpack_from("<I", good, 4)
    header = json.loads(good[8: 8 + hlen])
    header.update(header_changes or {})
    h = json.dumps(header).encode()
    return magic + struct.pack("<I", len(h)) + h + (good[8 + hlen:] if body is None else body)


@pytest.mark.parametrize("blob,fragment", [
    (b"", "shorter than the header"),
    (b"XXXX\x00\x00\x00\x00", "bad magic"),
    (MAGIC + struct.pack("<I", 999) + b"{}", "header runs past the end"),
    (MAGIC + struct.pack("<I", 2) + b"{}", "malformed message header"),
    ("not bytes", "expected bytes"),
])
def test_decode_rejects_malformed(blob, fragment):
    with pytest.raises(ProtocolError) as exc:
        decode(blob)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("changes,body,fragment", [
    ({"shape": [2, 4]}, None, "payload bytes"),
    ({"encoding": "int8"}, None, "unknown encoding"),
    ({"kind": "labels"}, None, "unknown kind"),
    ({"shape": [-1, 3]}, None, "bad shape"),
    ({}, b"\x00" * 5, "payload bytes"),
])
def test_decode_rejects_inconsistent(changes, body, fragment):
    with pytest.raises(ProtocolError) as exc:
        decode(_forge(changes, body))
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
    wrong_ids.ids = wrong_ids.ids + 1
    for bad, fragment in [([grads["guest-1"][0]], "owed for"),
                          ([encode(wrong_ids), grads["guest-1"][1]], "sample IDs do not match"),
                          ([grads["guest-1"][0], grads["guest-1"][0]], "owed for"),
                          ([b"garbage", grads["guest-1"][1]], "malformed")]:
        with pytest.raises(ProtocolError, match=fragment):
            g.apply_gradients(bad)
        assert _same(before, _snapshot(g.bottom)) and g.steps == 0 and g.pending_keys == sorted(keys)
    g.apply_gradients(grads["guest-1"])
    assert g.steps == 2 and g.pending_keys == []
