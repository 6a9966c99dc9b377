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
reproducible research runs — derived from a :class:`PrivateSeed` and the party's name *inside*
the party (:meth:`PartySecret.from_private_seed`). A private seed holds at least 128 secret bits
(``--private-seed HEX``, ``--private-seed-file PATH`` of an owner-only file, ``--private-seed -``
for stdin) and a party's secret is ``HKDF-SHA256(seed, party)``: a party that learns its own
secret, or the seed of its own node, learns nothing about another party's. Small integers (the
old ``--private-seed 5``) can be searched in seconds and are refused, except under the explicit
research flag ``--insecure-private-seed``, which stretches them with PBKDF2-HMAC-SHA256
(:data:`INSECURE_PBKDF2_ITERATIONS` iterations per party, ≈0.14 s on one core) and is recorded
as ``private_randomness = "insecure-private-seed"`` (:meth:`PrivateSeed.legacy`, API only, is the
old single-SHA-256 derivation, kept so that committed experiment numbers reproduce). A party's
draws are keyed by purpose and its own draw counter, ``HMAC-SHA256(secret, purpose | counter)``:
the counter only increases and is part of the party's state, so no two draws share noise (a batch
asked for again gets fresh noise, ``fl_split.parties``, issue 16), a party restored from its state
continues exactly, and without the secret nothing about them can be computed from public facts.
The secret is kept in the party's own
state and never written into a message, a reply, a log line, a report or a results file
(``repr`` hides it).

PyTorch's generators (Mersenne Twister on CPU, Philox on CUDA) are not cryptographic: their
seeds are unguessable here, but a party's raw generator outputs must not be released. They
never are: a release is always a function of private data plus noise.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import math
import os
import re
import secrets as _secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from fl_split.errors import PrivateSeedError

#: how a party's secret was obtained (reported as ``privacy[party].private_randomness``)
OS_ENTROPY = "os-entropy"
PRIVATE_SEED = "private-seed"
INSECURE_PRIVATE_SEED = "insecure-private-seed"
SOURCES = (OS_ENTROPY, PRIVATE_SEED, INSECURE_PRIVATE_SEED)
SECRET_BYTES = 32
#: a private seed holds at least this many bytes (128 bits): out of reach of any search
MIN_SEED_BYTES = 16
#: PBKDF2-HMAC-SHA256 iterations that stretch an ``--insecure-private-seed`` integer, per party
#: (OWASP's 2023 figure for PBKDF2-HMAC-SHA256; ≈0.14 s on one core of the development machine,
#: so a search over 10^6 integers costs ≈40 core-hours instead of seconds — still no protection for
#: 0, 1, 11: the flag's name says so)
INSECURE_PBKDF2_ITERATIONS = 600_000


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
def _hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int = SECRET_BYTES) -> bytes:
    """HKDF-SHA256 (RFC 5869: extract, then expand) — the KDF for >= 128-bit input keying material."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


@functools.lru_cache(maxsize=256)
def _insecure_party_key(value: int, party: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", str(value).encode("ascii"),
                               _text("fl_split insecure private seed", party), INSECURE_PBKDF2_ITERATIONS, SECRET_BYTES)


#: a hex seed whose entropy estimate (:func:`pattern_estimate`) is at most this is refused as patterned
#: (random 32-digit seeds estimate >= 91 bits: the least of 10^5 draws, `fl-split seed`'s 64 digits ~240)
MIN_PATTERN_BITS = 64


def pattern_estimate(digits: str) -> tuple[float, str]:
    """An upper estimate of the entropy of a hex seed typed by a person, in bits, and the rule that
    gave it — the least of three:

    * **period**: a string that repeats a block of ``p`` digits (``000…``, ``abab…``, ``5eed5eed…``,
      repeated bytes) holds at most ``4·p`` bits;
    * **symbols**: ``n`` digits drawn from their own frequencies hold ``n·H`` bits (``H``: the
      empirical Shannon entropy per digit; few distinct symbols → low);
    * **steps**: the first digit and the differences between neighbours (mod 16) — ``0123…``,
      ``fedc…``, ``02468…`` — hold ``4 + (n−1)·H(differences)`` bits;
    * **copies**: near-patterns — a repeated block with a few digits substituted, inserted or
      dropped (``deadbeef``×3 + ``deadbeee``) — are described as literal digits (4 bits each) and
      copies of earlier stretches of the seed (:func:`_copies_bits`: 1 + log2 of the start + log2
      of the length per copy), the cheapest such description.

    Frequencies (symbols, steps) are not changed much by a few edits; the copies rule covers the
    periods that an edit breaks. It only catches patterns: a seed that passes is not thereby random
    (use ``fl-split seed``)."""
    d = digits.lower()
    n = len(d)
    if n == 0:
        return 0.0, "empty"
    period = next(p for p in range(1, n + 1) if all(d[i] == d[i % p] for i in range(n)))

    def h(seq) -> float:
        counts = {}
        for x in seq:
            counts[x] = counts.get(x, 0) + 1
        return -sum(c / len(seq) * math.log2(c / len(seq)) for c in counts.values())

    steps = [(int(d[i + 1], 16) - int(d[i], 16)) % 16 for i in range(n - 1)]
    return min((4.0 * period, f"it repeats a {period}-digit block"),
               (n * h(d), f"{len(set(d))} distinct digits"),
               (4.0 + (n - 1) * h(steps) if steps else 4.0, "its digits step by regular differences"),
               (_copies_bits(d), "it is mostly copies of its own earlier digits"))


def _copies_bits(d: str) -> float:
    """The cheapest description of ``d`` as literal digits (4 bits each) and copies, where a copy of
    ``L`` digits at position ``j`` repeats the stretch that starts at some earlier position (it may
    overlap itself) and costs ``1 + log2(j) + log2(n − j)`` bits (a flag, where it copies from,
    how far). Dynamic programming over the positions, O(n²)."""
    if len(d) > 256:  # the rest as literals: an upper estimate still, in O(256²)
        return _copies_bits(d[:256]) + 4.0 * (len(d) - 256)
    n = len(d)
    # lcp[j]: the longest stretch at j that also starts at an earlier position (overlap allowed)
    lcp = [0] * n
    row = [0] * (n + 1)  # row[k] = longest common prefix of d[k:] and d[j:], for j from the end
    for j in range(n - 1, -1, -1):
        new = [0] * (n + 1)
        for k in range(j - 1, -1, -1):
            if d[k] == d[j]:
                new[k] = row[k + 1] + 1
        lcp[j] = max(new[:j], default=0)
        row = new
    best = [0.0] + [math.inf] * n
    for j in range(n):
        if best[j] == math.inf:
            continue
        best[j + 1] = min(best[j + 1], best[j] + 4.0)
        if lcp[j] >= 2:
            cost = best[j] + 1.0 + math.log2(j) + math.log2(n - j)
            for length in range(2, lcp[j] + 1):
                best[j + length] = min(best[j + length], cost)
    return best[n]


_HEX = re.compile(r"(0x)?([0-9a-fA-F]+)")
SEED_ALLOWED = (f"at least {2 * MIN_SEED_BYTES} hexadecimal digits ({8 * MIN_SEED_BYTES} bits; make one with "
                f"`fl-split seed --out FILE`), a seed file (--private-seed-file PATH, owner-only) or - (read "
                f"stdin); a small integer only with --insecure-private-seed (research reproduction)")


class PrivateSeed:
    """Where reproducible party secrets come from: >= 128 secret bits, never a guessable integer.

    * :meth:`parse` (``--private-seed HEX``), :meth:`read_file` (``--private-seed-file PATH``: the
      file must be owner-only), :meth:`generate` (``fl-split seed``);
    * :meth:`insecure` (``--insecure-private-seed``): an integer, for reproducing old research
      numbers only — stretched with PBKDF2, reported as ``"insecure-private-seed"``;
    * :meth:`for_party`: the seed of one party's node (``deploy local`` writes one per SuperNode):
      it derives that party's secret and nobody else's (it *is* the party's key, bound to its name).

    ``repr`` hides the value; :meth:`file_text` is the only way to write it (to an owner-only file).
    """

    __slots__ = ("_material", "source", "party", "_kdf")

    def __init__(self, material: bytes, source: str = PRIVATE_SEED, party: str | None = None,
                 kdf: str | None = None) -> None:
        if source not in (PRIVATE_SEED, INSECURE_PRIVATE_SEED):
            raise ValueError(f"private seed source must be {PRIVATE_SEED!r} or {INSECURE_PRIVATE_SEED!r}")
        kdf = kdf or ("hkdf" if source == PRIVATE_SEED else "pbkdf2")
        if kdf not in (("hkdf",) if source == PRIVATE_SEED else ("pbkdf2", "sha256-v1", "hkdf")):
            raise ValueError(f"a {source} seed cannot use the {kdf!r} derivation")
        material = bytes(material)
        if party is not None and len(material) != SECRET_BYTES:
            raise PrivateSeedError(f"a party's seed is {SECRET_BYTES} bytes")
        if source == PRIVATE_SEED and len(material) < MIN_SEED_BYTES:
            raise PrivateSeedError(f"a private seed holds {len(material) * 8} bits; allowed: {SEED_ALLOWED}")
        self._material, self.source, self.party, self._kdf = material, source, party, kdf

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def generate(cls) -> "PrivateSeed":
        """256 bits of operating-system entropy (``secrets.token_bytes``)."""
        return cls(_secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def parse(cls, text: str, what: str = "--private-seed", allow_pattern: bool = False) -> "PrivateSeed":
        """A hex seed of >= 32 digits. A bare (small) integer is refused with what is allowed, and so
        is a patterned one (:func:`pattern_estimate` at most :data:`MIN_PATTERN_BITS`) unless
        ``allow_pattern`` (``--insecure-private-seed``: :meth:`insecure_hex`)."""
        raw = str(text).strip()
        m = _HEX.fullmatch(raw)
        if not m or len(m.group(2)) < 2 * MIN_SEED_BYTES:
            shown = repr(raw) if len(raw) <= 12 else "<hidden>"  # a refused seed may still be someone's secret
            why = ("a small integer can be searched in seconds" if raw.isdigit() else
                   f"{len(m.group(2)) * 4} bits" if m else "not hexadecimal")
            raise PrivateSeedError(f"{what}: got {shown} ({why}); allowed: {SEED_ALLOWED}")
        digits = m.group(2)
        bits, rule = pattern_estimate(digits)
        if bits <= MIN_PATTERN_BITS and not allow_pattern:
            raise PrivateSeedError(f"{what}: got <hidden> (a patterned seed: {rule}, estimated entropy {bits:.0f} "
                                   f"bits, at most {MIN_PATTERN_BITS}); allowed: {SEED_ALLOWED}; a patterned "
                                   f"hex seed only with --insecure-private-seed")
        return cls(bytes.fromhex(digits if len(digits) % 2 == 0 else "0" + digits))

    @classmethod
    def insecure_hex(cls, text: str) -> "PrivateSeed":
        """``--insecure-private-seed`` with a patterned hex ``--private-seed`` (``000…0``, ``5eed…``):
        derived like any hex seed (HKDF), reported as ``"insecure-private-seed"``."""
        return cls(cls.parse(text, allow_pattern=True)._material, INSECURE_PRIVATE_SEED, kdf="hkdf")

    @classmethod
    def insecure(cls, value: int) -> "PrivateSeed":
        """``--insecure-private-seed``: an integer >= 0 (research reproduction only; see module doc)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PrivateSeedError(f"--private-seed: got {value!r}; allowed with --insecure-private-seed: "
                                   f"an integer >= 0")
        return cls(str(value).encode("ascii"), INSECURE_PRIVATE_SEED)

    @classmethod
    def legacy(cls, value: int) -> "PrivateSeed":
        """API only, to reproduce numbers committed before issue 16: the integer ``value`` with the
        old derivation, one SHA-256 of the integer and the party's name — searchable at ~10^5 seeds
        per second, so a receiver recovers it from one release. Reported as insecure."""
        seed = cls.insecure(value)
        return cls(seed._material, INSECURE_PRIVATE_SEED, kdf="sha256-v1")

    @classmethod
    def from_text(cls, text: str, what: str) -> "PrivateSeed":
        """The contents of a seed file (or stdin): ``#`` comment lines, optionally ``# party: NAME``
        and ``# source: insecure-private-seed`` (a per-party seed written by ``deploy local``), and
        the seed in hex."""
        party = None
        source = PRIVATE_SEED
        body = []
        for line in str(text).splitlines():
            line = line.strip()
            if line.startswith("#"):
                key, _, value = line.lstrip("#").partition(":")
                if key.strip() == "party":
                    party = value.strip()
                elif key.strip() == "source":
                    source = value.strip()
            elif line:
                body.append(line)
        if source not in (PRIVATE_SEED, INSECURE_PRIVATE_SEED):
            raise PrivateSeedError(f"{what}: source {source!r}; allowed: {PRIVATE_SEED} or {INSECURE_PRIVATE_SEED}")
        seed = cls.parse("".join(body), what)
        if party is not None or source != PRIVATE_SEED:
            if party is None:
                raise PrivateSeedError(f"{what}: a '# source:' line without '# party:'; allowed: a seed "
                                       f"written by fl-split seed or deploy local")
            return cls(seed._material, source, party)
        return seed

    @classmethod
    def read_file(cls, path: str | os.PathLike, what: str = "--private-seed-file") -> "PrivateSeed":
        """A seed from an owner-only file. A file that the group or others may read (or write) is
        refused: the seed derives the party's noise, so a reader could subtract it."""
        p = Path(path).expanduser()
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise PrivateSeedError(f"{what}: cannot read {str(p)!r} ({exc.strerror}); allowed: {SEED_ALLOWED}") from None
        with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise PrivateSeedError(f"{what}: {str(p)!r} is not a regular file")
            if st.st_mode & 0o077:
                raise PrivateSeedError(f"{what}: {str(p)!r} has mode {stat.S_IMODE(st.st_mode):04o}: the group or "
                                       f"others can access it; allowed: an owner-only file (chmod 600 {p})")
            text = fh.read(1 << 16)
        return cls.from_text(text, f"{what} {str(p)!r}")

    @classmethod
    def coerce(cls, value: "PrivateSeed | str | bytes") -> "PrivateSeed":
        """``value`` as a :class:`PrivateSeed`: a seed, a hex string, or >= 16 raw bytes. An ``int``
        is refused: write ``PrivateSeed.insecure(n)`` to say it is a guessable research seed."""
        if isinstance(value, PrivateSeed):
            return value
        if isinstance(value, (bytes, bytearray)):
            return cls(bytes(value))
        if isinstance(value, str):
            return cls.parse(value)
        raise PrivateSeedError(f"private seed: got a {type(value).__name__}; allowed: a PrivateSeed, a hex "
                               f"string of >= {2 * MIN_SEED_BYTES} digits, >= {MIN_SEED_BYTES} bytes, or "
                               f"PrivateSeed.insecure(n) for a small integer (research reproduction only)")

    # -- derivation ------------------------------------------------------------------------------
    def party_key(self, party: str) -> bytes:
        """The 256-bit secret of ``party``: HKDF-SHA256 of the seed and the party's name (or, for an
        insecure integer, PBKDF2). A per-party seed is that key itself, for its own party only."""
        if self.party is not None:
            if party != self.party:
                raise PrivateSeedError(f"this private seed belongs to {self.party}, not {party}")
            return self._material
        if self._kdf == "sha256-v1":
            return hashlib.sha256(_text("fl_split private seed", int(self._material.decode("ascii")), party)).digest()
        if self._kdf == "pbkdf2":
            return _insecure_party_key(int(self._material.decode("ascii")), str(party))
        return _hkdf_sha256(self._material, b"fl_split private seed v2", _text("party secret", party))

    def for_party(self, party: str) -> "PrivateSeed":
        """The seed of ``party``'s node alone (``deploy local`` writes it to that node's own file)."""
        return PrivateSeed(self.party_key(party), self.source, party)

    def file_text(self) -> str:
        """What a seed file holds (see :meth:`from_text`); write it to an owner-only file only."""
        lines = ["# fl-split private seed: keep this file owner-only (chmod 600); whoever reads it can "
                 "rebuild the noise of the parties it derives"]
        if self.party is not None:
            lines.append(f"# party: {self.party}")
        if self.source != PRIVATE_SEED:
            if self.party is None:
                raise PrivateSeedError("an --insecure-private-seed integer is not written to a seed file")
            lines.append(f"# source: {self.source}")
        lines.append(self._material.hex())
        return "\n".join(lines) + "\n"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PrivateSeed)
                and (self.source, self.party, self._kdf) == (other.source, other.party, other._kdf)
                and hmac.compare_digest(self._material, other._material))

    def __hash__(self) -> int:
        return hash(hashlib.sha256(b"fl_split seed fingerprint" + self._material).digest()[:8])

    def __repr__(self) -> str:
        return f"PrivateSeed(<hidden>, source={self.source!r}{'' if self.party is None else ', party=' + repr(self.party)})"

    __str__ = __repr__

    def __reduce__(self):  # pickling (Ray actors of an in-process simulation) keeps the value
        return (_rebuild_seed, (self._material, self.source, self.party, self._kdf))


def _rebuild_seed(material: bytes, source: str, party: str | None, kdf: str | None = None) -> PrivateSeed:
    return PrivateSeed(material, source, party, kdf)


class PartySecret:
    """A party's private randomness: 256 secret bits and the generators keyed by them.

    Build with :meth:`fresh` (operating-system entropy) or :meth:`from_private_seed`. Every draw
    is keyed by what it is for (:meth:`derive`), e.g. ``("release", 17)`` (purpose, draw counter).
    """

    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != SECRET_BYTES:
            raise ValueError(f"a party secret is {SECRET_BYTES} bytes")
        if source not in SOURCES:
            raise ValueError(f"party secret source must be one of {SOURCES}, got {source!r}")
        self._key = bytes(key)
        self.source = source

    @classmethod
    def fresh(cls) -> "PartySecret":
        """256 bits of operating-system entropy (``secrets.token_bytes``)."""
        return cls(_secrets.token_bytes(SECRET_BYTES), OS_ENTROPY)

    @classmethod
    def from_private_seed(cls, private_seed: "PrivateSeed | str | bytes", party: str) -> "PartySecret":
        """Reproducible research runs: the secret of ``party`` derived from a :class:`PrivateSeed`
        (``HKDF-SHA256(seed, party)``; see the module docstring).

        Whoever knows the private seed can rebuild every party's noise: it must stay with the
        person who runs all parties (simulation), or be one seed per SuperNode in a deployment."""
        seed = PrivateSeed.coerce(private_seed)
        return cls(seed.party_key(party), seed.source)

    @classmethod
    def for_party(cls, party: str, private_seed: "PrivateSeed | None") -> "PartySecret":
        """``from_private_seed`` when a private seed is given, else :meth:`fresh`."""
        return cls.fresh() if private_seed is None else cls.from_private_seed(private_seed, party)

    # -- draws ---------------------------------------------------------------------------------
    def derive(self, *parts: object) -> int:
        """A 63-bit seed ``HMAC-SHA256(secret, parts)``: unpredictable without the secret."""
        return _seed63(hmac.new(self._key, _text(*parts), hashlib.sha256).digest())

    def derive_bytes(self, *parts: object) -> bytes:
        """32 secret bytes ``HMAC-SHA256(secret, parts)`` (key material: an identity, an ephemeral key)."""
        return hmac.new(self._key, _text("bytes", *parts), hashlib.sha256).digest()

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
