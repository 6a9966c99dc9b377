"""Hostile peers: every malformed or hostile input is refused with a ProtocolError naming the peer,
and the receiver's whole exported state (models, optimizer, secret, pending batches, ledger,
importances, diagnostics, caches) is bit-for-bit what it was. Party level, and the Flower node's
handler (``fl_split/flower/node.py::handle``) fed hostile records.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto

from fl_split.builder import make_parties
from fl_split.config import RunConfig
from fl_split.errors import ProtocolError
from fl_split.protocol import MAX_ABS, Message as Wire, batch_digest, decode, encode
from fl_split.schedule import BatchKey
from fl_split.state import flatten
from fl_split.seeding import PrivateSeed


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=1, limit=160, batch_size=16, defense="gaussian", sigma=0.7,
                protect="both", progress=False)
    base.update(kw)
    return RunConfig(**base)


def snapshot(party) -> tuple:
    arrays, skeleton = flatten(party.export_state())
    return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays.items()}, skeleton


def assert_untouched(party, before) -> None:
    after = snapshot(party)
    assert after[1] == before[1], "the party's state skeleton changed"
    changed = [k for k in before[0] if before[0][k] != after[0].get(k)]
    assert not changed and set(after[0]) == set(before[0]), f"state arrays changed: {changed[:5]}"


def _reencode(blob: bytes, **changes) -> bytes:
    m = decode(blob)
    for k, v in changes.items():
        setattr(m, k, v)
    return encode(m)


def _with_value(blob: bytes, value: float) -> bytes:
    m = decode(blob)
    m.tensor = m.tensor.clone()
    m.tensor.view(-1)[3] = value
    return encode(m)


@pytest.fixture()
def run():
    """host and guest after one good round (round 1), the guest owing round 1's gradients."""
    host, guests, plan = make_parties(_cfg(), private_seed=PrivateSeed.legacy(3))
    g = guests["guest-1"]
    keys1 = tuple(plan.schedule.train_keys(1)[:1])
    acts = g.step([], keys1, 1)
    grads = host.train(keys1, {"guest-1": acts}, 1)
    keys2 = tuple(plan.schedule.train_keys(1)[1:2])
    return host, g, plan, keys1, keys2, acts, grads["guest-1"]


# -- the host receives activations ------------------------------------------------------------------
def _host_cases(g, plan, keys1, keys2, acts1):
    """(name, keys, acts, round, fragment) of hostile round-2 requests; acts2 are good ones."""
    acts2 = [encode(Wire("activations", "guest-1", "host", 2, keys2[0], g.digest(keys2[0]),
                         torch.zeros(len(g.ids(keys2[0])), *g.cut_shape)))]
    good = acts2[0]
    m = decode(good)
    wrong_shape = encode(Wire("activations", "guest-1", "host", 2, keys2[0], m.digest, torch.zeros(m.rows, 3)))
    big = encode(Wire("activations", "guest-1", "host", 2, keys2[0], m.digest, torch.zeros(m.rows * 40, *g.cut_shape)))
    test_key = plan.schedule.test_keys(1)[0]
    return acts2, [
        ("wrong per-sample shape", keys2, [wrong_shape], 2, r"activations from guest-1 .*per-sample shape"),
        ("NaN", keys2, [_with_value(good, float("nan"))], 2, r"from guest-1 .*NaN or infinite"),
        ("Inf", keys2, [_with_value(good, float("-inf"))], 2, r"from guest-1 .*NaN or infinite"),
        ("enormous", keys2, [_with_value(good, 3e30)], 2, r"from guest-1 .*beyond ±1e\+09"),
        ("just over the bound", keys2, [_with_value(good, MAX_ABS * 1.01)], 2, r"from guest-1 .*beyond"),
        ("wrong batch digest", keys2, [_reencode(good, digest=m.digest ^ 1)], 2, r"from guest-1 .*batch reference"),
        ("wrong key", keys2, [_reencode(good, key=keys1[0])], 2, r"from guest-1 .*got one for"),
        ("wrong sender", keys2, [_reencode(good, sender="guest-2")], 2, r"expected activations from guest-1"),
        ("gradients kind", keys2, [_reencode(good, kind="gradients")], 2, r"got a 'gradients' message"),
        ("replayed round-1 message", keys2, [_reencode(good, round=1)], 2, r"belongs to round 1, expected round 2"),
        ("truncated frame", keys2, [good[:-5]], 2, r"malformed message"),
        ("oversized frame", keys2, [big], 2, r"oversized message"),
        ("garbage", keys2, [b"\x00" * 40], 2, r"malformed message"),
        ("not bytes", keys2, [12345], 2, r"expected bytes"),
        ("too many messages", keys2, [good, good], 2, r"2 activation messages from guest-1, expected 1"),
        ("unknown guest", keys2, "extra", 2, r"host: activations from \['guest-1', 'guest-9'\]"),
        ("repeated batch in request", keys2 * 2, [good, good], 2, r"host: request names .* twice"),
        ("test batch in a training request", (test_key,), [good], 2, r"expected train batches only"),
        ("batch not in the schedule", (BatchKey("train", 1, 10_000),), [good], 2, r"not a batch of the schedule"),
        ("replayed request (stale round)", keys2, acts2, 1, r"request for round 1, but round 1 was already handled"),
        ("replay of round 1 whole", keys1, acts1, 1, r"round 1 was already handled"),
    ]


def test_host_refuses_hostile_activations_untouched(run):
    host, g, plan, keys1, keys2, acts1, _ = run
    acts2, cases = _host_cases(g, plan, keys1, keys2, acts1)
    before = snapshot(host)
    for name, keys, blobs, round_, fragment in cases:
        by_guest = {"guest-1": acts2, "guest-9": [b"x"]} if blobs == "extra" else {"guest-1": blobs}
        with pytest.raises(ProtocolError, match=fragment):
            host.train(keys, by_guest, round_)
        assert_untouched(host, before), name
    # the good request still trains afterwards
    host.train(keys2, {"guest-1": acts2}, 2)
    assert host.steps == 2 and host.last_round == 2


def test_host_evaluate_refuses_hostile_and_stale(run):
    host, g, plan, *_ = run
    tkeys = plan.schedule.test_keys(1)
    acts = g.release(tkeys, 3)
    before = snapshot(host)
    for keys, blobs, round_, fragment in [
        (tkeys, [_with_value(acts[0], float("nan"))], 3, "NaN"),
        (tkeys, [_reencode(acts[0], round=2)], 3, "belongs to round 2"),
        (tkeys, acts, 1, "already handled"),
        (tuple(plan.schedule.train_keys(1)[:1]), acts, 3, "expected test batches only"),
    ]:
        with pytest.raises(ProtocolError, match=fragment):
            host.evaluate(keys, {"guest-1": blobs}, round_)
        assert_untouched(host, before)
    assert host.evaluate(tkeys, {"guest-1": acts}, 3)["epoch"] == 1


def test_host_does_not_update_on_a_non_finite_loss(run):
    host, g, plan, keys1, keys2, *_ = run
    acts2 = g.step(run[6], keys2, 2)
    with torch.no_grad():
        for p in host.top.parameters():
            p.mul_(1e30)  # the host's own weights are broken: logits overflow, the loss is NaN
    before = snapshot(host)
    with pytest.raises(ProtocolError, match=r"host: the loss of train\[epoch 1, batch 1\] is not finite .*no update"):
        host.train(keys2, {"guest-1": acts2}, 2)
    after = snapshot(host)
    changed = [k for k in before[0] if before[0][k] != after[0][k] and "ledger" not in k]
    assert not changed and host.steps == 1  # nothing stepped (the charge made before computing stays: nothing left)


# -- the guest receives gradients --------------------------------------------------------------------------
def test_guest_refuses_hostile_gradients_untouched(run):
    host, g, plan, keys1, keys2, acts1, grads = run
    good = grads[0]
    m = decode(good)
    before = snapshot(g)
    big = encode(Wire("gradients", "host", "guest-1", 1, keys1[0], m.digest, torch.zeros(m.rows * 40, *g.cut_shape)))
    for name, blobs, keys, round_, fragment in [
        ("NaN", [_with_value(good, float("nan"))], keys2, 2, r"gradients from host .*NaN"),
        ("enormous", [_with_value(good, -1e20)], keys2, 2, r"gradients from host .*beyond"),
        ("wrong shape", [encode(Wire("gradients", "host", "guest-1", 1, keys1[0], m.digest, torch.zeros(m.rows, 2)))],
         keys2, 2, r"gradients from host .*per-sample shape"),
        ("wrong digest", [_reencode(good, digest=batch_digest(g.ids(keys1[0]) + 1))], keys2, 2, "batch reference"),
        ("replayed from another round", [_reencode(good, round=0)], keys2, 2, r"belongs to round 0, expected round 1"),
        ("not owed", [_reencode(good, key=keys2[0])], keys2, 2, r"owed for"),
        ("repeated", [good, good], keys2, 2, r"2 gradient messages received, but owed for"),
        ("missing", [], keys2, 2, r"0 gradient messages received"),
        ("wrong receiver", [_reencode(good, receiver="guest-2")], keys2, 2, r"got one from host to guest-2"),
        ("truncated", [good[:9]], keys2, 2, "malformed message"),
        ("oversized", [big], keys2, 2, "oversized message"),
        ("not a list", good, keys2, 2, "expected a list of messages"),
        ("stale request", [good], keys2, 1, r"guest-1: request for round 1, but round 1 was already handled"),
        ("repeated key in request", [good], keys2 * 2, 2, r"guest-1: request names .* twice"),
        ("bad key in request", [good], (BatchKey("train", 1, 99_999),), 2, "not a batch of the schedule"),
        ("mixed phases", [good], (*keys2, plan.schedule.test_keys(1)[0]), 2, "expected train batches only"),
    ]:
        with pytest.raises(ProtocolError, match=fragment):
            g.step(blobs, keys, round_)
        assert_untouched(g, before), name
    assert g.step(grads, keys2, 2) and g.steps == 1 and g.last_round == 2


# -- the Flower node's handler ---------------------------------------------------------------------------
def _ask(ctx, mtype: str, **values):
    from fl_split.flower import records as R
    from fl_split.flower.node import handle

    msg = Message(R.content(**values), dst_node_id=ctx.node_id, message_type=mtype, group_id="0")
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    reply = handle(message_from_proto(message_to_proto(msg)), ctx, PrivateSeed.legacy(3))
    return reply.content


def _state_bytes(ctx) -> dict:
    out = {}
    for name, rec in ctx.state.array_records.items():
        for k, a in rec.items():
            out[f"{name}/{k}"] = a.numpy().tobytes()
    for name, rec in ctx.state.config_records.items():
        out[f"{name}"] = sorted((k, str(v)) for k, v in rec.items() if k != "token")
    return out


HOSTILE_STEP = [
    ("keys not JSON", {"keys": "[[", "owed": []}),
    ("keys of another shape", {"keys": '{"a": 1}', "owed": []}),
    ("key with a bad phase", {"keys": '[["valid", 1, 0]]', "owed": []}),
    ("owed as integers", {"keys": '[["train", 1, 1]]', "owed": [7, 8]}),
    ("owed garbage bytes", {"keys": '[["train", 1, 1]]', "owed": [b"\x00\x01garbage"]}),
    ("replayed round", {"keys": '[["train", 1, 1]]', "owed": []}),
]


@pytest.mark.parametrize("name,values", HOSTILE_STEP, ids=[n for n, _ in HOSTILE_STEP])
def test_node_handle_refuses_hostile_records_untouched(flower_task_identity, name, values):
    from fl_split.flower import records as R
    from fl_split.flower.node import _PARTIES

    cfg = _cfg(data_plane="flower") if "data_plane" in RunConfig.__dataclass_fields__ else _cfg()
    ctx = Context(run_id=7, node_id=1001, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                  run_config={})
    out = _ask(ctx, R.MSG_SETUP, config=R.dumps(cfg.to_flower()), party="guest-1")
    assert R.ERROR not in out.config_records
    out = _ask(ctx, R.MSG_STEP, round=1, keys='[["train", 1, 0]]', owed=[])
    assert R.ERROR not in out.config_records
    before = _state_bytes(ctx)
    out = _ask(ctx, R.MSG_STEP, round=1 if name == "replayed round" else 2, **values)
    assert R.ERROR in out.config_records, name
    err = out.config_records[R.ERROR]
    assert err["party"] == "guest-1"
    assert _state_bytes(ctx) == before
    _PARTIES.clear()
    # documented error types only (a peer's bytes never crash the node with anything else)
    assert err["type"] == "ProtocolError", (name, err["type"], err["message"])


def test_node_handle_answers_a_malformed_round(flower_task_identity):
    from fl_split.flower import records as R

    cfg = _cfg(data_plane="flower") if "data_plane" in RunConfig.__dataclass_fields__ else _cfg()
    ctx = Context(run_id=7, node_id=1002, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                  run_config={})
    _ask(ctx, R.MSG_SETUP, config=R.dumps(cfg.to_flower()), party="guest-1")
    before = _state_bytes(ctx)
    out = _ask(ctx, R.MSG_STEP, round="not a round", keys='[["train", 1, 0]]', owed=[])
    assert R.ERROR in out.config_records and _state_bytes(ctx) == before


@pytest.mark.parametrize("values", [
    {"type": "ValueError", "message": "x", "party": "guest-1", "round": "abc"},
    {"type": "BudgetExceeded", "message": "x", "party": "guest-1", "round": 3, "fields": "{not json"},
    {"type": "BudgetExceeded", "message": "x", "party": "guest-1", "round": 3, "fields": "{}"},
])
def test_coordinator_answers_a_hostile_error_reply_with_party_error(values):
    """The coordinator parses a party's error reply: damage there is the party's error, not a crash."""
    from flwr.app import ConfigRecord

    from fl_split.errors import FlSplitError
    from fl_split.flower import records as R

    with pytest.raises(FlSplitError):
        R.raise_error_record(RecordDict({R.ERROR: ConfigRecord(values)}), "guest-1", 3)


def test_decode_refuses_a_shape_numpy_cannot_describe():
    """Found by the atheris run (fuzz/README.md): a bits frame with a zero dimension has no payload,
    but NumPy cannot describe its other dimensions (it raised ValueError 'array is too big')."""
    blob = bytes.fromhex("46320241f602018007021d050001fffd02fffff805f5fcc63a0000a060")
    with pytest.raises(ProtocolError, match=r"shape \[29, 0, 1, 48895, 12468223, 122797685\] is too large"):
        decode(blob)
