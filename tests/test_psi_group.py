"""The group of the PSI (:mod:`fl_split.psi_group`): X25519 as RFC 7748 defines it, commutative on
the curve and on its twist (hashed IDs land on both), small-order and non-canonical values refused,
and the two backends byte for byte the same."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fl_split.errors import ProtocolError
from fl_split.psi_group import _crypto_mb, blind, hash_ids

P = 2**255 - 19


def _u(pts: np.ndarray) -> list[int]:
    return [int.from_bytes(bytes(r), "little") for r in pts]


def _on_curve(u: int) -> bool:
    """Whether u is the x-coordinate of a point of Curve25519 (else of its twist): v² = u³ + Au² + u."""
    rhs = (u * u * u + 486662 * u * u + u) % P
    return rhs == 0 or pow(rhs, (P - 1) // 2, P) == 1


@pytest.fixture(params=["cryptography", "crypto_mb"])
def backend(request, monkeypatch):
    if request.param == "crypto_mb" and _crypto_mb() is None:
        pytest.skip("libcrypto_mb (the psi extra, AVX-512 IFMA) is not available here")
    monkeypatch.setenv("FL_SPLIT_PSI_BACKEND", request.param)
    return request.param


def test_rfc7748_vector(backend):
    """RFC 7748 §5.2, first X25519 test vector."""
    k = bytes.fromhex("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4")
    u = np.frombuffer(bytes.fromhex("e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c"),
                      np.uint8).reshape(1, 32).copy()
    u[0, 31] &= 0x7F  # the RFC's u has bit 255 set, which X25519 masks; ours are canonical
    out = blind(u, k, "rfc")
    assert bytes(out[0]).hex() == "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552"


def test_blinding_commutes_on_the_curve_and_on_the_twist(backend):
    pts = hash_ids(np.arange(-100, 300, dtype=np.int64) * 7919)
    kinds = [_on_curve(u) for u in _u(pts)]
    assert 100 < sum(kinds) < 300  # about half and half
    assert all(u < P and u < 2**255 for u in _u(pts))
    a, b = os.urandom(32), os.urandom(32)
    ab, ba = blind(blind(pts, a, "t"), b, "t"), blind(blind(pts, b, "t"), a, "t")
    np.testing.assert_array_equal(ab, ba)
    # a blinded point stays on its side (curve or twist): the clamped scalar keeps the x-line
    assert [_on_curve(u) for u in _u(ab)] == kinds
    assert len({bytes(r) for r in ab}) == len(pts)  # distinct IDs stay distinct


def test_the_backends_agree_byte_for_byte():
    if _crypto_mb() is None:
        pytest.skip("libcrypto_mb (the psi extra, AVX-512 IFMA) is not available here")
    pts, k = hash_ids(np.arange(1001)), os.urandom(32)  # not a multiple of 8: the padded lanes
    os.environ["FL_SPLIT_PSI_BACKEND"] = "cryptography"
    try:
        slow = blind(pts, k, "t")
    finally:
        os.environ.pop("FL_SPLIT_PSI_BACKEND")
    np.testing.assert_array_equal(blind(pts, k, "t"), slow)


def test_small_order_and_non_canonical_values_are_refused(backend):
    good = hash_ids(np.arange(9))
    k = os.urandom(32)
    # u = 0 and u = 1 (orders 2 and 4 on the curve), and an order-8 point (RFC 7748 / cr.yp.to list)
    order8 = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")
    for bad in (b"\x00" * 32, b"\x01" + b"\x00" * 31, order8):
        pts = np.concatenate([good, np.frombuffer(bad, np.uint8).reshape(1, 32)])
        with pytest.raises(ProtocolError, match="small order"):
            blind(pts, k, "peer")
    for bad in ((P).to_bytes(32, "little"), (P + 5).to_bytes(32, "little"), b"\x09" + b"\x00" * 30 + b"\x80"):
        pts = np.concatenate([good, np.frombuffer(bad, np.uint8).reshape(1, 32)])
        with pytest.raises(ProtocolError, match="not canonical"):
            blind(pts, k, "peer")
    with pytest.raises(ProtocolError, match="32-byte points"):
        blind(np.zeros((3, 31), np.uint8), k, "peer")


def test_bench_psi_runs_and_records(tmp_path):
    """experiments/bench_psi.py at a small size (ours only): the intersection is checked inside, and
    the JSON holds time, CPU time, memory and the backend."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(root / "experiments" / "bench_psi.py"), "--sizes", "2000",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    ours = row["ours"]
    assert row["n_per_party"] == 2000 and ours["shared"] == 1000 and ours["messages"] == 6
    assert ours["seconds"] > 0 and ours["cpu_s"] > 0 and ours["peak_rss_mb"] >= ours["rss_before_mb"] > 0
    assert ours["backend"] in ("crypto_mb", "cryptography")
