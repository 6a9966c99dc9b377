"""Coverage-guided fuzzing (atheris) of what parses a peer's bytes: the wire codec and the request helpers.

Targets (the first input byte picks one, so one process covers them all):

* ``decode`` — :func:`fl_split.protocol.decode` on arbitrary bytes, then :meth:`Message.check` with
  the expectations of a receiver that agrees with the header (so the shape, round and value checks
  run too). Properties: only :class:`~fl_split.errors.ProtocolError` escapes; a frame that decodes
  re-encodes to the same bytes (float32) or to a frame that decodes to the same message (bits).
* ``keys`` — :func:`fl_split.protocol.parse_keys` on arbitrary text;
* ``blobs`` — :func:`fl_split.protocol.blob_list` on lists built from the input (bytes, ints, strings);
* ``loaders`` — the party-file loaders on arbitrary bytes written to a file
  (``fl_split.party_files.load_party`` for npz / csv / parquet and a table's metadata file), the
  checkpoint parser (``fl_split.checkpoint.parse_checkpoint`` with its checksum check off, so the
  structure checks are reached) and the write-ahead log reader (``read_wal``): only
  :class:`~fl_split.errors.DataError` escapes (``--targets`` picks the targets of a run).

A crash is anything else (an uncaught exception, a failed property). Run (atheris is the optional
``[fuzz]`` extra; CI does not need it)::

    .venv/bin/pip install -e ".[fuzz]"
    .venv/bin/python fuzz/fuzz_wire.py -atheris_runs=0 --seeds /tmp/fuzz/corpus   # write seed frames
    nice .venv/bin/python fuzz/fuzz_wire.py /tmp/fuzz/corpus -max_total_time=3600 -max_len=4096

``fuzz/README.md`` has the numbers of the runs made here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["fl_split"]):
    import numpy as np
    import torch

    from fl_split import checkpoint, party_files
    from fl_split.errors import DataError, ProtocolError
    from fl_split.protocol import (
        ENCODINGS, KINDS, Message, blob_list, decode, encode, parse_keys,
    )
    from fl_split.schedule import BatchKey

TARGETS = ("decode", "keys", "blobs", "loaders")
_TMP = tempfile.mkdtemp(prefix="fl_split_fuzz_")
_ACTIVE = list(TARGETS)


def _decode(data: bytes) -> None:
    try:
        m = decode(data)
    except ProtocolError:
        return
    if m.encoding == "float32":
        again = encode(m)
        if again != data:
            raise AssertionError(f"float32 frame does not re-encode to the same bytes ({len(data)} vs {len(again)})")
    else:
        m2 = decode(encode(m))
        if not (torch.equal(m2.tensor, m.tensor) and m2.key == m.key and m2.round == m.round):
            raise AssertionError("bits frame does not round-trip")
    rows = m.rows
    ids = np.arange(min(rows, 1 << 20), dtype=np.int64)
    if len(ids) != rows:
        return
    try:
        m.check(kind=m.kind, sender=m.sender, receiver=m.receiver, key=m.key, ids=ids,
                sample_shape=tuple(m.tensor.shape[1:]), digest=m.digest, round_=m.round)
    except ProtocolError:
        return
    t = m.tensor
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise AssertionError("check accepted a non-finite tensor")


def _keys(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    text = fdp.ConsumeUnicodeNoSurrogates(len(data)) if fdp.ConsumeBool() else data[1:]
    try:
        keys = parse_keys(text)
    except ProtocolError:
        return
    for k in keys:
        if not (isinstance(k, BatchKey) and k.phase in ("train", "test") and k.epoch >= 0 and k.index >= 0):
            raise AssertionError(f"parse_keys returned {k!r}")


def _blobs(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    kind = fdp.ConsumeIntInRange(0, 3)
    if kind == 0:
        values: object = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
    elif kind == 1:
        values = fdp.ConsumeUnicodeNoSurrogates(32)
    else:
        values = []
        for _ in range(fdp.ConsumeIntInRange(0, 8)):
            pick = fdp.ConsumeIntInRange(0, 3)
            if pick == 0:
                values.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 32)))
            elif pick == 1:
                values.append(fdp.ConsumeIntInRange(0, 1 << 40))  # must never become bytes(n)
            elif pick == 2:
                values.append(fdp.ConsumeUnicodeNoSurrogates(8))
            else:
                values.append(fdp.ConsumeFloat())
        if kind == 3:
            values = tuple(values)
    try:
        out = blob_list(values)
    except ProtocolError:
        return
    if not all(isinstance(b, bytes) for b in out):
        raise AssertionError("blob_list returned a non-bytes item")


def _loaders(data: bytes) -> None:
    if not data:
        return
    which, body = data[0] % 6, data[1:]
    try:
        if which == 4:  # checkpoint bytes with a valid checksum: the structure checks must hold
            checkpoint.parse_checkpoint(body, "fuzz.ckpt", verify=False)
            return
        if which == 5:  # a write-ahead log
            path = os.path.join(_TMP, "guest-1.wal")
            with open(path, "wb") as fh:
                fh.write(body)
            checkpoint.read_wal(path)
            return
        ext = ("npz", "csv", "parquet", "csv")[which]
        path = os.path.join(_TMP, f"guest-1.{ext}")
        meta = os.path.join(_TMP, "guest-1.meta.json")
        if which == 3:  # a valid-looking data file with a fuzzed metadata file
            with open(meta, "wb") as fh:
                fh.write(body)
        else:
            with open(path, "wb") as fh:
                fh.write(body)
        party_files.load_party(path)
    except DataError:
        return


_FUNCS = {"decode": _decode, "keys": _keys, "blobs": _blobs, "loaders": _loaders}


def test_one(data: bytes) -> None:
    if not data:
        return
    _FUNCS[_ACTIVE[data[0] % len(_ACTIVE)]](data[1:])


def write_seeds(folder: str) -> None:
    """Valid frames (both kinds and encodings, several shapes) and key lists as a starting corpus."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    n = 0
    for kind in KINDS:
        for enc in ENCODINGS:
            for shape in ((2, 3), (4, 1, 2, 2), (1, 9), (0, 5)):
                vals = rng.integers(0, 2, shape).astype(np.float32) if enc == "bits" else \
                    rng.normal(size=shape).astype(np.float32)
                m = Message(kind, "guest-1" if kind == "activations" else "host",
                            "host" if kind == "activations" else "guest-1", 7, BatchKey("train", 2, 5), 12345,
                            torch.from_numpy(vals), enc)
                blob = encode(m)
                with open(os.path.join(folder, f"seed{n:03d}"), "wb") as fh:
                    fh.write(bytes([_ACTIVE.index("decode") if "decode" in _ACTIVE else 0]) + blob)
                n += 1
    if "keys" in _ACTIVE:
        for text in ('[["train",1,0],["train",1,1]]', '[["test",3,0]]', "[]"):
            with open(os.path.join(folder, f"seed{n:03d}"), "wb") as fh:
                fh.write(bytes([_ACTIVE.index("keys"), 0]) + text.encode())
            n += 1
    print(f"wrote {n} seeds to {folder}")


def main() -> None:
    global _ACTIVE
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seeds", default="")
    ns, rest = ap.parse_known_args()
    _ACTIVE = [t for t in ns.targets.split(",") if t]
    unknown = [t for t in _ACTIVE if t not in TARGETS]
    if unknown:
        sys.exit(f"unknown targets {unknown}; allowed: {', '.join(TARGETS)}")
    if ns.seeds:
        write_seeds(ns.seeds)
        return
    torch.set_num_threads(1)
    atheris.Setup([sys.argv[0], *rest], test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
