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


# -- hostile bytes: everything that parses a peer's (or a file's) bytes ---------------------------------
# (the coverage-guided counterpart is fuzz/fuzz_wire.py, run with atheris; see fuzz/README.md)
import json as _json  # noqa: E402

import pytest  # noqa: E402

from fl_split.errors import DataError  # noqa: E402
from fl_split.protocol import blob_list, parse_keys  # noqa: E402
from fl_split.seeding import PrivateSeed  # noqa: E402

json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                                     st.floats(allow_nan=False), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                           max_leaves=10)


@SETTINGS
@given(st.one_of(st.text(max_size=200), st.binary(max_size=100), json_values.map(_json.dumps),
                 st.lists(st.tuples(st.sampled_from(["train", "test", "x", 1]), st.integers(-3, 2 ** 33),
                                    st.one_of(st.integers(-3, 2 ** 33), st.booleans(), st.floats()))).map(_json.dumps)))
def test_parse_keys_answers_protocol_error_or_keys(text):
    try:
        keys = parse_keys(text)
    except ProtocolError:
        return
    assert all(isinstance(k, BatchKey) and k.phase in ("train", "test") and k.epoch >= 0 and k.index >= 0 for k in keys)


@SETTINGS
@given(st.one_of(st.none(), st.binary(max_size=10), st.text(max_size=10), st.integers(),
                 st.lists(st.one_of(st.binary(max_size=20), st.integers(0, 2 ** 62), st.text(max_size=3),
                                    st.floats(), st.none()), max_size=6)))
def test_blob_list_never_allocates_from_an_integer(values):
    try:
        out = blob_list(values)
    except ProtocolError:
        return
    assert all(isinstance(b, bytes) for b in out) and sum(map(len, out)) <= 20 * 6


_PARTIES: dict = {}


def _parties():
    """One host/guest pair after a good first round (built once: hypothesis reuses it)."""
    if not _PARTIES:
        from fl_split.builder import make_parties
        from fl_split.config import RunConfig

        host, guests, plan = make_parties(RunConfig(dataset="digits", guests=1, limit=120, batch_size=16,
                                                    defense="laplace", protect="both", progress=False), private_seed=PrivateSeed.legacy(1))
        g = guests["guest-1"]
        k1 = tuple(plan.schedule.train_keys(1)[:1])
        grads = host.train(k1, {"guest-1": g.step([], k1, 1)}, 1)["guest-1"]
        k2 = tuple(plan.schedule.train_keys(1)[1:2])
        _PARTIES.update(host=host, guest=g, k2=k2, acts=g.release(k2, 2), grads=grads)
        g._pending.pop(k2[0])  # released for the test only: not owed
    return _PARTIES


def _state(party) -> tuple:
    arrays, skeleton = flatten(party.export_state())
    return {k: v.tobytes() for k, v in arrays.items()}, skeleton


@st.composite
def mutated(draw, blob: bytes) -> bytes:
    b = bytearray(blob)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "extend", "header"]))
        if op == "flip" and b:
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            b = b[: draw(st.integers(0, len(b)))]
        elif op == "extend":
            b += draw(st.binary(min_size=1, max_size=64))
        elif op == "header" and len(b) > 12:
            i = draw(st.integers(2, 12))
            b[i] = draw(st.integers(0, 255))
    return bytes(b)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_parties_refuse_any_corrupted_frame_untouched(data):
    """A corrupted activation (to the host) or gradient (to the guest) frame: the receiver either
    accepts a still-valid message or raises ProtocolError — and then its whole state is unchanged."""
    p = _parties()
    host, g = p["host"], p["guest"]
    to_host = data.draw(st.booleans())
    blob = data.draw(mutated(p["acts"][0] if to_host else p["grads"][0]))
    party = host if to_host else g
    before = _state(party)
    try:
        decode(blob)
        valid_frame = True
    except ProtocolError:
        valid_frame = False
    saved = party.export_state()
    try:
        if to_host:
            host._received(p["k2"], {"guest-1": [blob]}, 2)  # every check the host makes before training
        else:
            g.apply_gradients([blob], 2)
    except ProtocolError:
        assert _state(party) == before
        return
    assert valid_frame
    party.import_state(saved)  # a still-valid message was applied: back to the shared starting point


def _load_bytes(tmp_dir, name: str, data: bytes, meta: bytes | None = None):
    from fl_split.party_files import load_party

    path = tmp_dir / name
    path.write_bytes(data)
    if meta is not None:
        (tmp_dir / f"{path.stem}.meta.json").write_bytes(meta)
    try:
        load_party(path)
    except DataError:
        pass


_FILES: dict = {}


def _party_files(tmp_factory):
    if not _FILES:
        from fl_split.config import RunConfig
        from fl_split.party_files import export_parties

        cfg = RunConfig(dataset="digits", guests=1, limit=40, progress=False)
        for fmt in ("npz", "csv", "parquet"):
            d = tmp_factory.mktemp(fmt)
            export_parties(cfg, d, fmt)
            _FILES[fmt] = (d / f"guest-1.{fmt}").read_bytes()
            if fmt != "npz":
                _FILES[f"{fmt}-meta"] = (d / "guest-1.meta.json").read_bytes()
    return _FILES


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.data())
def test_party_file_loaders_answer_data_error_only(tmp_path_factory, data):
    """npz / csv / parquet party files and their metadata, mutated: load_party raises DataError or
    loads a consistent party (never another exception)."""
    files = _party_files(tmp_path_factory)
    d = tmp_path_factory.mktemp("fuzz")
    fmt = data.draw(st.sampled_from(["npz", "csv", "parquet", "csv-meta", "parquet-meta", "random"]))
    if fmt == "random":
        _load_bytes(d, "guest-1." + data.draw(st.sampled_from(["npz", "csv", "parquet"])),
                    data.draw(st.binary(max_size=300)), data.draw(st.binary(max_size=100)))
    elif fmt.endswith("-meta"):
        base = fmt.split("-")[0]
        _load_bytes(d, f"guest-1.{base}", files[base], data.draw(mutated(files[fmt])))
    else:
        meta = files.get(f"{fmt}-meta")
        _load_bytes(d, f"guest-1.{fmt}", data.draw(mutated(files[fmt])), meta)


@SETTINGS
@given(st.data())
def test_checkpoint_and_log_parsers_answer_checkpoint_error_only(tmp_path_factory, data):
    import hashlib

    from fl_split.checkpoint import CheckpointError, parse_checkpoint, read_wal, write_checkpoint

    d = tmp_path_factory.mktemp("ck")
    arrays = {"a": np.arange(5, dtype=np.int32), "b": np.ones((2, 2), dtype=np.float64)}
    path = write_checkpoint(d / "x.ckpt", {"format": "fl_split.checkpoint/1", "kind": "party", "v": [1, 2]}, arrays)
    raw = path.read_bytes()
    body = data.draw(mutated(raw[:-32]))
    try:
        header, got = parse_checkpoint(body + hashlib.sha256(body).digest())
    except CheckpointError:
        pass
    else:
        assert isinstance(header, dict) and all(isinstance(v, np.ndarray) for v in got.values())
    wal = d / "g.wal"
    wal.write_bytes(data.draw(st.binary(max_size=400)))
    try:
        read_wal(wal)
    except CheckpointError:
        pass


@SETTINGS
@given(st.one_of(st.text(max_size=50), json_values.map(_json.dumps)),
       st.one_of(st.lists(st.one_of(st.binary(max_size=8), st.integers(0, 2 ** 62), st.text(max_size=3)), max_size=4),
                 st.integers(), st.text(max_size=5)))
def test_flower_records_parsers_answer_protocol_error_only(text, values):
    """What a Flower node parses out of a request (fl_split/flower/records.py) goes through the
    hardened helpers: only ProtocolError, never bytes(n) from an integer."""
    from flwr.app import ConfigRecord

    from fl_split.flower import records as R

    try:
        R.keys_from_json(text)
    except ProtocolError:
        pass
    try:
        rec = ConfigRecord({"owed": values})
    except Exception:  # noqa: BLE001 - a value Flower itself refuses to put in a record
        return
    try:
        out = R.blob_list(rec, "owed")
    except ProtocolError:
        return
    assert all(isinstance(b, bytes) for b in out) and sum(map(len, out)) <= 8 * 4
