"""Randomness: a public schedule for everyone, private draws for each party.

Two kinds of random numbers exist in a run (``docs/accounting.md``, "Threat model"):

* **Public** — the train/test split, the batch order, the round plan, which every party must
  agree on. They come from the run seed ``--seed``, a public fact (it is in every party's setup
  message and in the results JSON): :func:`derive_seed`, :func:`numpy_rng`.
* **Private to a party** — its model initialisation, every mechanism draw (noise, R3eLU
  activation draws, randomized-response flips, masks), DP-SGD noise and one-shot pretraining
  shuffles. They come from a :class:`PartySecret` that never leaves the party. If a receiver
  could rebuild a party's generator it could subtract the noise: every guarantee would be void.

A :class:`PartySecret` is 256 bits: fresh operating-system entropy by default, or — for
reproducible research runs — derived from a ``--private-seed`` and the party's name *inside*
the party (:meth:`PartySecret.from_private_seed`). A party's draws are keyed by purpose and its
own draw counter, ``HMAC-SHA256(secret, purpose | counter)``: the counter only increases and is
part of the party's state, so no two draws share noise (a batch asked for again gets fresh noise,
``fl_split.parties``, issue 16), a party restored from its state continues exactly, and without the
secret nothing about them can be computed from public facts. The secret is kept in the party's own
state and never written into a message, a reply, a log line, a report or a results file
(``repr`` hides it).

PyTorch's generators (Mersenne Twister on CPU, Philox on CUDA) are not cryptographic: their
seeds are unguessable here, but a party's raw generator outputs must not be released. They
never are: a release is always a function of private data plus noise.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets as _secrets
from collections.abc import Iterator

import numpy as np
import torch

#: how a party's secret was obtained (reported as ``privacy[party].private_randomness``)
OS_ENTROPY = "os-entropy"
PRIVATE_SEED = "private-seed"
SECRET_BYTES = 32


def _text(*parts: object) -> bytes:
    return "\x1f".join(str(p) for p in parts).encode("utf-8")


def _seed63(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# -- public randomness (the schedule) -----------------------------------------------------------
def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed that depends only on the public ``seed`` and the string forms of ``parts``.

    For the public schedule only. Python's ``hash()`` is salted per process, so SHA-256 is used."""
    return _seed63(hashlib.sha256(_text(int(seed), *parts)).digest())


def numpy_rng(seed: int, *parts: object) -> np.random.Generator:
    """A fresh NumPy generator for a *public* draw (split, batch order) from ``derive_seed``."""
    return np.random.default_rng(derive_seed(seed, *parts))


# -- private randomness (each party's own) --------------------------------------------------------
class PartySecret:
    """A party's private randomness: 256 secret bits and the generators keyed by them.

    Build with :meth:`fresh` (operating-system entropy) or :meth:`from_private_seed`. Every draw
    is keyed by what it is for (:meth:`derive`), e.g. ``("release", 17)`` (purpose, draw counter).
    """

    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != SECRET_BYTES:
            raise ValueError(f"a party secret is {SECRET_BYTES} bytes")
        if source not in (OS_ENTROPY, PRIVATE_SEED):
            raise ValueError(f"party secret source must be {OS_ENTROPY!r} or {PRIVATE_SEED!r}, got {source!r}")
        self._key = bytes(key)
        self.source = source

    @classmethod
    def fresh(cls) -> "PartySecret":
        """256 bits of operating-system entropy (``secrets.token_bytes``)."""
        return cls(_secrets.token_bytes(SECRET_BYTES), OS_ENTROPY)

    @classmethod
    def from_private_seed(cls, private_seed: int, party: str) -> "PartySecret":
        """Reproducible research runs: the secret of ``party`` derived from ``--private-seed``.

        Whoever knows the private seed can rebuild every party's noise: it must stay with the
        person who runs all parties (simulation), or be set per SuperNode in a deployment."""
        seed = int(private_seed)
        if seed < 0:
            raise ValueError("--private-seed must be an integer >= 0")
        key = hashlib.sha256(_text("fl_split private seed", seed, party)).digest()
        return cls(key, PRIVATE_SEED)

    @classmethod
    def for_party(cls, party: str, private_seed: int | None) -> "PartySecret":
        """``from_private_seed`` when a private seed is given, else :meth:`fresh`."""
        return cls.fresh() if private_seed is None else cls.from_private_seed(private_seed, party)

    # -- draws ---------------------------------------------------------------------------------
    def derive(self, *parts: object) -> int:
        """A 63-bit seed ``HMAC-SHA256(secret, parts)``: unpredictable without the secret."""
        return _seed63(hmac.new(self._key, _text(*parts), hashlib.sha256).digest())

    def torch_generator(self, *parts: object, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.derive(*parts))
        return gen

    def numpy_rng(self, *parts: object) -> np.random.Generator:
        return np.random.default_rng(self.derive(*parts))

    @contextlib.contextmanager
    def seeded_torch(self, *parts: object) -> Iterator[None]:
        """Run a block (module construction) under a private global torch seed; the caller's RNG
        state is restored afterwards."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.derive(*parts))
            yield

    # -- state (kept by the party only) ----------------------------------------------------------
    def state_dict(self) -> dict:
        """For the party's own exported state (``context.state`` stays on the party's node)."""
        return {"key": np.frombuffer(self._key, dtype=np.uint8).copy(), "source": self.source}

    @classmethod
    def from_state(cls, state: dict) -> "PartySecret":
        key = np.asarray(state["key"], dtype=np.uint8).tobytes()
        return cls(key, str(state["source"]))

    def fingerprint(self) -> str:
        """A one-way tag for in-process caches (never reported)."""
        return hashlib.sha256(b"fl_split fingerprint" + self._key).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartySecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return f"PartySecret(<hidden>, source={self.source!r})"

    __str__ = __repr__

    def __reduce__(self):  # pickling (Ray) keeps the key: the object only travels with its party
        return (PartySecret, (self._key, self.source))
