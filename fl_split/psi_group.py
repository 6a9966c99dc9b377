"""The group of :mod:`fl_split.psi`: X25519 (RFC 7748) on Curve25519, batched.

**Hash to the group.** An ID ``x`` (int64) maps to the u-coordinate ``H(x) = BLAKE2b-256("fl_split
psi x25519 v1" ‖ x)`` with bit 255 cleared (X25519 ignores it; clearing it makes the encoding
canonical). Straight to a u-coordinate, not through Elligator or Ristretto's hash-to-group, because
X25519 is *twist-secure*: every 255-bit ``u`` is the x-coordinate of a point on Curve25519 (order
8·ℓ) or on its quadratic twist (order 4·ℓ', ℓ' a 253-bit prime), the Montgomery ladder computes
``x([k]P)`` on either, and DDH is hard in both prime-order parts (Bernstein, "Curve25519", §4
and safecurves.cr.yp.to/twist.html). A hashed ID lands on one or the other, half and half; the
blinding commutes on both (``X25519(a, X25519(b, u)) = X25519(b, X25519(a, u))``: scalar
multiplication commutes and the x-coordinate forgets only the sign), which is all ECDH-PSI needs.
The clamped scalar is a multiple of 8, so a small-order input (curve: order ≤ 8, twist: ≤ 4) gives
the all-zero output: :func:`blind` refuses it, as it refuses a non-canonical ``u`` (bit 255 set or
``u ≥ p``) — a peer's list holds only values of the group. Ristretto255 (libsodium's
``crypto_core_ristretto255_from_hash``) would be the principled alternative; pynacl 1.6 does not
expose it and libsodium's Edwards scalar multiplication is no faster than the ladder here.

**Backends** (the same bytes; parties with different backends interoperate):

* ``crypto_mb``: Intel's crypto multi-buffer library (``libcrypto_mb`` of the PyPI package
  ``ipp-crypto``; its runtime needs ``intel-cmplr-lib-rt``; both in the ``psi`` extra),
  ``mbx_x25519_mb8``: eight ladders at once in AVX-512 IFMA lanes (SecretFlow's ECDH-PSI uses the
  same library). Measured on this project's 2-core Xeon: 10.7 µs per X25519 on one core, 6.0 µs with
  two threads (ctypes releases the GIL) — against 67 µs for one ``cryptography`` / libsodium call;
* ``cryptography`` (a dependency of the package): OpenSSL's X25519, one call per point, on any CPU
  (about 7-9× slower than crypto_mb in ``experiments/bench_psi.py``).

:func:`backend` picks ``crypto_mb`` where it loads and the CPU has IFMA, else ``cryptography``;
``FL_SPLIT_PSI_BACKEND=cryptography`` forces the portable one (tests compare the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fl_split.errors import ProtocolError

#: bytes of one group element (an X25519 u-coordinate, little endian)
POINT = 32
_DOMAIN = b"fl_split psi x25519 v1"
#: points per thread task (small enough for a smooth progress bar, large enough to amortise)
CHUNK = 4096


def hash_ids(ids: np.ndarray) -> np.ndarray:
    """``H(x)`` of each ID (module docstring): an ``(n, 32)`` uint8 array."""
    ids = np.ascontiguousarray(ids, "<i8")
    raw = ids.tobytes()
    blake = hashlib.blake2b
    out = b"".join(blake(_DOMAIN + raw[i:i + 8], digest_size=POINT).digest() for i in range(0, len(raw), 8))
    pts = np.frombuffer(out, np.uint8).reshape(len(ids), POINT).copy()
    pts[:, 31] &= 0x7F
    return pts


def check_points(pts: np.ndarray, what: str) -> None:
    """:class:`ProtocolError` unless every row is a canonical u-coordinate (bit 255 clear, ``u < p``)."""
    if pts.ndim != 2 or pts.shape[1] != POINT or pts.dtype != np.uint8:
        raise ProtocolError(f"{what}: not a list of {POINT}-byte points")
    if len(pts) == 0:
        return
    high = pts[:, 31] & 0x80
    # u >= p = 2^255 - 19 (bit 255 clear): bytes 1..30 all 0xff, byte 31 = 0x7f, byte 0 >= 0xed
    big = (pts[:, 31] == 0x7F) & (pts[:, 1:31] == 0xFF).all(axis=1) & (pts[:, 0] >= 0xED)
    if high.any() or big.any():
        raise ProtocolError(f"{what}: {int((high != 0).sum() + big.sum())} value(s) that are not canonical "
                            f"X25519 u-coordinates; refused")


# -- backends ----------------------------------------------------------------------------------------
def _dist_file(dist: str, name: str) -> str | None:
    """The installed path of the file ``name`` of the distribution ``dist`` (its shared libraries
    lie in the environment's ``lib/``, wherever pip put it)."""
    from importlib import metadata

    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == name and os.path.exists(str(f.locate())):
            return str(f.locate())
    return None


@functools.lru_cache(maxsize=1)
def _crypto_mb():
    """``mbx_x25519_mb8`` of libcrypto_mb, or ``None`` (not installed, no IFMA, a runtime missing)."""
    lib_path = _dist_file("ipp-crypto", "libcrypto_mb.so")  # needs the system's libcrypto.so.3 too
    if lib_path is None:
        return None
    try:
        for name in ("libintlc.so.5", "libirng.so", "libimf.so", "libsvml.so"):  # its Intel runtime, first
            dep = _dist_file("intel-cmplr-lib-rt", name)
            if dep is not None:
                ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(lib_path)
        lib.mbx_is_crypto_mb_applicable.argtypes = [ctypes.c_uint64]
        lib.mbx_is_crypto_mb_applicable.restype = ctypes.c_int
        if not lib.mbx_is_crypto_mb_applicable(0):  # needs AVX-512 IFMA
            return None
        fn = lib.mbx_x25519_mb8
        fn.argtypes, fn.restype = [ctypes.c_void_p] * 3, ctypes.c_uint64
        return fn
    except (OSError, AttributeError):
        return None


def backend() -> str:
    """``crypto_mb`` or ``cryptography`` (module docstring)."""
    want = os.environ.get("FL_SPLIT_PSI_BACKEND", "").strip()
    if want == "cryptography":
        return want
    if want not in ("", "crypto_mb"):
        from fl_split.errors import ConfigError

        raise ConfigError("FL_SPLIT_PSI_BACKEND", want, ["crypto_mb", "cryptography"])
    if _crypto_mb() is not None:
        return "crypto_mb"
    if want == "crypto_mb":
        raise ProtocolError("FL_SPLIT_PSI_BACKEND=crypto_mb but libcrypto_mb does not load here (pip install "
                            "'fl-split[psi]' on x86-64 Linux; the CPU needs AVX-512 IFMA)")
    return "cryptography"


def _mb_part(fn, key: np.ndarray, src: np.ndarray, dst: np.ndarray) -> int:
    """X25519 of ``src`` rows into ``dst`` rows, eight per call; ``src`` has a multiple of 8 rows."""
    keys = np.full(8, key.ctypes.data, np.uint64)
    pa = src.ctypes.data + POINT * np.arange(len(src), dtype=np.uint64)
    oa = dst.ctypes.data + POINT * np.arange(len(src), dtype=np.uint64)
    pk, pp, po = keys.ctypes.data, pa.ctypes.data, oa.ctypes.data
    bad = 0
    for s in range(0, len(src), 8):
        bad |= fn(po + 8 * s, pk, pp + 8 * s)
    return bad


def _ossl_part(key: bytes, src: np.ndarray, dst: np.ndarray) -> int:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    sk, pub = X25519PrivateKey.from_private_bytes(key), X25519PublicKey.from_public_bytes
    raw = src.tobytes()
    try:
        out = b"".join(sk.exchange(pub(raw[i:i + POINT])) for i in range(0, len(raw), POINT))
    except ValueError:  # OpenSSL refuses the all-zero output of a small-order point
        return 1
    dst[:] = np.frombuffer(out, np.uint8).reshape(-1, POINT)
    return 0


def blind(pts: np.ndarray, key: bytes, what: str, tick: Callable[[int], None] | None = None,
          threads: int | None = None) -> np.ndarray:
    """``X25519(key, u)`` for each row ``u`` of ``pts`` (validated first, :func:`check_points`),
    in chunks over a thread pool (ctypes releases the GIL around each ``mbx_x25519_mb8`` call, so
    crypto_mb uses every core; the ``cryptography`` binding holds it for most of a call, so the
    portable backend gains little from the threads); ``tick(n)`` after each chunk.
    :class:`ProtocolError` when a row is not of the group or gives the all-zero output (a
    small-order point)."""
    check_points(pts, what)
    if len(key) != POINT:
        raise ValueError("an X25519 scalar has 32 bytes")
    n = len(pts)
    out = np.zeros((n, POINT), np.uint8)
    if n == 0:
        return out
    fn = _crypto_mb() if backend() == "crypto_mb" else None
    if fn is not None:
        pad = (-n) % 8  # the ladder runs eight lanes: repeat the last point
        src = np.concatenate([pts, np.repeat(pts[-1:], pad, 0)]) if pad else np.ascontiguousarray(pts)
        dst = np.zeros_like(src)
        kbuf = np.frombuffer(bytes(key), np.uint8).copy()

        def part(a: int, b: int) -> int:
            return _mb_part(fn, kbuf, src[a:b], dst[a:b])
    else:
        src = np.ascontiguousarray(pts)
        dst = out

        def part(a: int, b: int) -> int:
            return _ossl_part(bytes(key), src[a:b], dst[a:b])

    bounds = [(a, min(a + CHUNK, len(src))) for a in range(0, len(src), CHUNK)]
    bad = 0
    workers = threads or min(len(bounds), os.cpu_count() or 1)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for (a, b), status in zip(bounds, pool.map(lambda ab: part(*ab), bounds)):
            bad |= status
            if tick is not None:
                tick(min(b, n) - min(a, n))
    if fn is not None:
        out[:] = dst[:n]
    if bad or (out == 0).all(axis=1).any():
        raise ProtocolError(f"{what}: a value of small order (the all-zero X25519 output); refused")
    return out
