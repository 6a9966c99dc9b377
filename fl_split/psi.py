"""Private set intersection of the parties' ID lists, for ``--align psi``: an N-party ECDH-PSI that
reveals only the intersection.

Own data (:mod:`fl_split.data.own`) comes as one table per party, each with its own ID set. With
``--align public`` the host's ID list is published to every party. With ``--align psi`` the
``N = G + 1`` parties (host = 0, guest-g = g) run a multi-party ECDH-PSI (the commutative-blinding
protocol of Huberman, Franklin, Hogg 1999 / Meadows 1986, SecretFlow's ECDH-PSI, extended to N
parties with a key-less coordinator) in the group of :mod:`fl_split.psi_group` (X25519, hash
straight to a u-coordinate: twist security is argued there).

**The protocol** (``k_i``: party i's fresh secret scalar, ``π_i`` its fresh random permutation, both
made per alignment and never sent; ``H``: hash to the group; ``+`` on party indices is mod N):

1. *start* — party i sends ``L_i = π_i([H(x)^{k_i} for x in X_i])`` (one hop done);
2. *round r = 1 … N-1* — the list of origin i is at party ``i + r``, which raises every element to its
   own key keeping the order, and passes it on to ``i + r + 1`` (in round 1 the list comes inside the
   coordinator's ``sizes`` frame, every party's announced size, checked first: "Bounded inputs",
   below); all N lists move in the same round
   (a ring: every party receives from ``i - 1`` and sends to ``i + 1``), so the protocol costs N + 1
   rounds of messages, not N² sequential hops. After round N-1 the list
   ``F_i = π_i([H(x)^{k_0 k_1 … k_{N-1}}])`` goes to the coordinator (from party ``i - 1``, never back
   to i);
3. *finish* — the coordinator, which holds no key and no ID, computes ``I* = ∩_i F_i`` and sends
   party i the positions ``{p : F_i[p] ∈ I*}``; party i maps them through ``π_i`` to its IDs:
   ``I = X_0 ∩ … ∩ X_{N-1}``, sorted. Each party answers with a digest of its ``I``
   (:func:`ids_digest`); the coordinator checks that all agree.

**Who learns what.**

* party i learns ``I`` and the set sizes ``|X_j|`` (the lengths of the lists it blinds). The lists it
  receives carry key sets ``{i-r, …, i-1}`` (never ``k_i``): under DDH they are unlinkable to the
  values it can compute from its own IDs (``H(x)``, ``H(x)^{k_i}``). It produces one fully blinded
  list, ``F_{i+1}`` (another party's), and never sees its own ``F_i`` — that is why ``F_i`` does not
  come back to i: holding both it could compare them and learn which of its IDs party i+1 holds.
  So with two or more guests the host learns exactly ``I`` and no sub-intersection
  (``tests/test_own_data.py`` checks it on the message transcript).
* the coordinator (the router in process; the ServerApp, and the SuperLink that stores the
  messages, in a deployment) sees only blinded values: the set sizes and the sizes of the
  intersections of any sub-family of the ``F_i`` (how many pseudonyms guest-1 and the host share,
  …), no ID and not ``I`` itself (only ``|I|`` and the digests).
* **collusion** is not covered: the coordinator together with party j learns, for j's IDs, every
  sub-intersection (j maps the positions of ``F_j`` in any sub-intersection the coordinator
  computes); two parties together learn the pairwise intersections of their own lists' members. The
  deployment trusts its coordinator to route honestly (as it trusts it with the run configuration).

**What each party enforces** (a party cannot be made an oracle beyond the protocol): it blinds its
own list once (*start*) and then exactly one list per round, rounds 1 … N-1 in order, each from its
ring predecessor with the origin and hop the round implies (never its own list); every value it
blinds must be a canonical group element that does not give the all-zero output
(:func:`fl_split.psi_group.blind`); its key is dropped after its last round; *finish* is accepted
once, after the last round, with positions that are sorted, unique and inside its own list. So each
party raises at most ``Σ_j |X_j|`` values to its key per alignment, each list once. The coordinator
checks that every hop keeps the list's length, origin and hop count and that no ``F_i`` repeats a
value.

**Bounded inputs.** A party that submits IDs it does not hold learns, for each, whether the others
all hold it: submitting the whole ID space would give it the others' intersection. So every party
bounds the set of every other: a party's start list is its announcement (its length is fixed before
any party blinds a value of another's list); the coordinator sends every party all announced sizes
inside round 1's ``sizes`` frame (:func:`sizes_frame`), and each party, before it reads any value
of that round's list, checks that its own size is stated truly and that no peer's exceeds its own
limit (:func:`peer_limit`: by default the larger of ``4 ×`` its own size and its own size
``+ 10,000``; ``--psi-max-peer-ids N|RATIOx`` in one process, a deployment node's node-config
``psi-max-peer-ids``, which the run config can only lower). A peer beyond it is refused with one
line naming the peer, its announced size, the limit and the setting (:class:`DataError`); every
later list it blinds must hold exactly its origin's announced size. Within the limit ``L`` a party
holding ``m`` IDs can still probe ``L − m`` IDs it does not hold (docs/threat-model.md,
"Alignment").

**Over the run's channels.** Each message is one framed ``bytes`` blob (:func:`encode` /
:func:`decode`: ``b"P2" | kind | sender | receiver | payload``, ``0`` = the coordinator, ``i + 1`` =
party i) with sender and receiver checked by the receiver, bounded in size. :func:`run_psi` is the
coordinator — the order of the steps and its checks — over a :class:`PsiRoute`:

* :class:`LocalRoute` (:func:`align_by_psi`): between :class:`PsiParty` objects in one process
  (the local engine and the in-process Flower simulation prepare every party's data in one process);
* :class:`fl_split.flower.alignment.FlowerPsiRoute`: a Flower deployment's ServerApp sends each step
  to the party's SuperNode as a Flower message; what a party keeps between steps (its key while it
  has rounds to blind, its permutation's seed, its round) stays in its node's ``context.state``
  (:meth:`PsiParty.export_state`), never in a message.

After alignment ``I`` is the run's shared ID list, public among the parties: the accounting's
public-ID assumption (docs/accounting.md) covers exactly ``I``.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from functools import reduce
from typing import Protocol

import numpy as np

from fl_split.errors import DataError, ProtocolError
from fl_split.protocol import _read_varint, _varint, party_index, party_name
from fl_split.psi_group import POINT, blind, hash_ids

MAGIC = b"P2"
KINDS = ("list", "positions", "sizes")
COORDINATOR = "coordinator"
#: at most this many bytes per PSI frame: ~ 16 million IDs of 32-byte points
MAX_PSI_FRAME = 512 * 1024 * 1024
#: a progress bar from this many X25519 operations on (fewer take well under a second)
PROGRESS_FROM = 100_000
#: the default bound on a peer's announced set: the larger of this many times the own size …
DEFAULT_PEER_RATIO = 4
#: … and the own size plus this many IDs (module docstring, "Bounded inputs")
DEFAULT_PEER_SLACK = 10_000
PEER_LIMIT_ALLOWED = ("empty (the default: the larger of 4x the own set and the own set + 10,000), a number of IDs N "
                      "(e.g. 50000) or a ratio to the own set RATIOx (e.g. 25x)")


def peer_limit(spec: object, own: int) -> tuple[int, str]:
    """The largest peer set a party holding ``own`` IDs aligns with, and how it came about.

    ``spec``: ``""`` the default, ``"N"`` N IDs, ``"RATIOx"`` RATIO times its own size. The second
    value is for the refusal's line. :class:`ValueError` for a malformed ``spec``."""
    text = str(spec if spec is not None else "").strip().lower().replace("_", "").replace(",", "")
    if not text:
        limit = max(DEFAULT_PEER_RATIO * own, own + DEFAULT_PEER_SLACK)
        return limit, (f"the default: the larger of {DEFAULT_PEER_RATIO}x its {own:,} IDs and "
                       f"{own:,} + {DEFAULT_PEER_SLACK:,}")
    try:
        if text.endswith("x"):
            ratio = float(text[:-1])
            if not (math.isfinite(ratio) and ratio > 0):
                raise ValueError
            return int(math.floor(ratio * own)), f"{text[:-1]}x its {own:,} IDs"
        n = int(text)
        if n < 1:
            raise ValueError
        return n, f"{n:,} IDs"
    except ValueError:
        raise ValueError(f"psi-max-peer-ids: got {spec!r}; allowed: {PEER_LIMIT_ALLOWED}") from None


def check_peer_limit(spec: object) -> bool:
    """Whether ``spec`` is a valid ``psi-max-peer-ids`` (:func:`peer_limit`)."""
    try:
        peer_limit(spec, 1)
    except ValueError:
        return False
    return True


def _who(name: str) -> int:
    return 0 if name == COORDINATOR else party_index(name) + 1


def _name(index: int) -> str:
    return COORDINATOR if index == 0 else party_name(index - 1)


def encode(kind: str, sender: str, receiver: str, payload: bytes) -> bytes:
    """One PSI frame."""
    return MAGIC + bytes([KINDS.index(kind)]) + _varint(_who(sender), "sender") + _varint(_who(receiver), "receiver") \
        + payload


def decode(blob: object, *, kind: str, sender: str, receiver: str) -> bytes:
    """The payload of ``blob`` if it is a PSI frame of ``kind`` from ``sender`` to ``receiver``;
    :class:`ProtocolError` otherwise (before anything else is touched)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise ProtocolError(f"a PSI message must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) > MAX_PSI_FRAME:
        raise ProtocolError(f"PSI message of {len(blob)} bytes exceeds {MAX_PSI_FRAME}")
    if len(blob) < 5 or blob[:2] != MAGIC:
        raise ProtocolError("not a PSI message (bad magic)")
    if blob[2] >= len(KINDS) or KINDS[blob[2]] != kind:
        raise ProtocolError(f"PSI message of kind {blob[2]}, expected {kind!r}")
    s, pos = _read_varint(blob, 3, "sender")
    r, pos = _read_varint(blob, pos, "receiver")
    if (s, r) != (_who(sender), _who(receiver)):
        raise ProtocolError(f"PSI {kind} from {_name(s)} to {_name(r)}, expected {sender} to {receiver}")
    return blob[pos:]


def list_frame(sender: str, receiver: str, origin: int, hop: int, pts: np.ndarray) -> bytes:
    """A ``list`` frame: the list of party ``origin`` after ``hop`` blindings."""
    return encode("list", sender, receiver, _varint(origin, "origin") + _varint(hop, "hop")
                  + np.ascontiguousarray(pts, np.uint8).tobytes())


def read_list(blob: object, sender: str, receiver: str) -> tuple[int, int, np.ndarray]:
    """``(origin, hop, points)`` of a ``list`` frame (:class:`ProtocolError` when malformed)."""
    payload = decode(blob, kind="list", sender=sender, receiver=receiver)
    origin, pos = _read_varint(payload, 0, "origin")
    hop, pos = _read_varint(payload, pos, "hop")
    if (len(payload) - pos) % POINT:
        raise ProtocolError(f"PSI list from {sender}: {len(payload) - pos} bytes of points, not a multiple of {POINT}")
    return origin, hop, np.frombuffer(payload, np.uint8, offset=pos).reshape(-1, POINT)


def sizes_frame(receiver: str, sizes: list[int], inner: bytes) -> bytes:
    """A ``sizes`` frame from the coordinator to ``receiver``, around its round-1 list.

    It holds every party's announced set size (index order) and, inside, the list ``receiver``
    blinds in round 1 (module docstring, "Bounded inputs")."""
    return encode("sizes", COORDINATOR, receiver,
                  _varint(len(sizes), "parties") + b"".join(_varint(int(x), "size") for x in sizes) + inner)


def read_sizes(blob: object, receiver: str, n: int) -> tuple[list[int], bytes]:
    """``(sizes, inner frame)`` of a ``sizes`` frame for ``receiver`` among ``n`` parties."""
    payload = decode(blob, kind="sizes", sender=COORDINATOR, receiver=receiver)
    count, pos = _read_varint(payload, 0, "parties")
    if count != n:
        raise ProtocolError(f"{receiver}: PSI sizes of {count} parties, expected {n}")
    sizes = []
    for _ in range(n):
        x, pos = _read_varint(payload, pos, "size")
        sizes.append(x)
    return sizes, payload[pos:]


def _sorted_unique(ids) -> np.ndarray:
    """``np.unique`` by sorting (numpy's hash-based unique is several times slower at 1M IDs)."""
    a = np.sort(np.asarray(ids, np.int64))
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


def fresh_secret() -> bytes:
    """32 bytes from the OS's CSPRNG: a party's key or permutation seed (one place, which tests
    watch)."""
    return os.urandom(32)


def _ring(parties: list[str], i: int) -> str:
    return parties[i % len(parties)]


class PsiParty:
    """One party's side (module docstring): its own IDs, a fresh key and permutation per alignment.

    ``parties``: every party in index order (host first). ``key``, ``perm_seed``, ``rnd``, ``sizes``:
    its state when restored in a fresh process (:meth:`import_state`); fresh secrets otherwise. The
    permutation is PCG64's, seeded with 256 secret bits: its order means nothing to the others.
    ``max_peer_ids``: its own bound on a peer's set (:func:`peer_limit`), named in a refusal as
    ``flag``."""

    def __init__(self, party: str, ids: np.ndarray, parties: list[str], *, key: bytes | None = None,
                 perm_seed: bytes | None = None, rnd: int = 0,
                 tick: Callable[[int], None] | None = None, max_peer_ids: object = "",
                 flag: str = "--psi-max-peer-ids", sizes: list[int] | None = None) -> None:
        self.party, self.parties = party, list(parties)
        self.me, self.n = self.parties.index(party), len(self.parties)
        self._own = _sorted_unique(ids)
        self.max_peer_ids, self.flag = max_peer_ids, flag
        #: every party's announced set size (index order), from round 1 on
        self.sizes = None if sizes is None else [int(x) for x in sizes]
        self._key = fresh_secret() if key is None and rnd < self.n else key
        self._perm_seed = perm_seed or fresh_secret()
        #: 0: not started; r: rounds 1 … r-1 done; n: every round done; n + 1: finished
        self.round = rnd
        self.tick = tick
        self._shared: np.ndarray | None = None

    def _order(self) -> np.ndarray:
        """``π_i`` applied to the own IDs: position → ID (from the secret seed: a fresh process
        rebuilds it)."""
        seed = int.from_bytes(hashlib.blake2b(self._perm_seed, digest_size=32).digest(), "little")
        return np.random.Generator(np.random.PCG64(seed)).permutation(self._own)

    def _next(self, hop: int) -> str:
        return COORDINATOR if hop == self.n else _ring(self.parties, self.me + 1)

    def start(self) -> bytes:
        """Step 1: the own list, hashed, blinded with the own key, permuted."""
        if self.round != 0:
            raise ProtocolError(f"{self.party}: a second PSI start in this alignment")
        pts = blind(hash_ids(self._order()), self._key, f"{self.party}: its own IDs", self.tick)
        self.round = 1
        return list_frame(self.party, self._next(1), self.me, 1, pts)

    def check_sizes(self, sizes: list[int]) -> None:
        """Refuse announced sizes that misstate its own set or name a peer set beyond its limit.

        One line (:func:`peer_limit`), before any element of any peer is read."""
        own = len(self._own)
        if sizes[self.me] != own:
            raise ProtocolError(f"{self.party}: the coordinator announced {sizes[self.me]} IDs for this party, "
                                f"which holds {own}")
        limit, how = peer_limit(self.max_peer_ids, own)
        for j, size in enumerate(sizes):
            if j != self.me and size > limit:
                peer = self.parties[j]
                raise DataError(f"{self.party}: PSI refused: {peer} announced {size:,} IDs, more than "
                                f"{self.party}'s limit of {limit:,} peer IDs ({how}); nothing of {peer}'s list "
                                f"was blinded; to align with a larger set, {self.party} sets {self.flag} "
                                f"(N IDs or RATIOx)")

    def hop(self, blob: bytes) -> bytes:
        """Step 2, round ``self.round``: blind the ring predecessor's list and pass it on.

        The list is of origin ``me - round``; its order is kept. One list per round, rounds in order.
        In round 1 the list comes inside the coordinator's ``sizes`` frame: the announced sizes are
        checked against the party's limit first; every list must hold exactly its origin's announced
        size."""
        r = self.round
        if not 1 <= r < self.n:
            raise ProtocolError(f"{self.party}: a PSI list to blind in round {r} of {self.n - 1}; a party blinds "
                                f"one list per round, after its start")
        prev = _ring(self.parties, self.me - 1)
        if r == 1:
            sizes, blob = read_sizes(blob, self.party, self.n)
            self.check_sizes(sizes)
            self.sizes = sizes
        elif self.sizes is None:
            raise ProtocolError(f"{self.party}: a PSI list in round {r} but no announced sizes")
        origin, hop, pts = read_list(blob, prev, self.party)
        want = (self.me - r) % self.n
        if (origin, hop) != (want, r):
            raise ProtocolError(f"{self.party}: PSI list of origin {origin} after {hop} hop(s) in round {r}; "
                                f"expected origin {want} after {r}")
        if len(pts) != self.sizes[origin]:
            raise ProtocolError(f"{self.party}: PSI list of {self.parties[origin]} with {len(pts):,} values, but "
                                f"{self.parties[origin]} announced {self.sizes[origin]:,}; refused")
        out = blind(pts, self._key, f"{self.party}: the list from {prev}", self.tick)
        self.round = r + 1
        if self.round == self.n:
            self._key = None  # the last list is blinded: the key is of no further use
        return list_frame(self.party, self._next(r + 1), origin, r + 1, out)

    def finish(self, blob: bytes) -> np.ndarray:
        """Step 3: the positions of the own list in ``I*`` → the intersection ``I`` (sorted)."""
        if self.round != self.n:
            raise ProtocolError(f"{self.party}: PSI positions before its last round (round {self.round} of "
                                f"{self.n - 1}) or a second time")
        payload = decode(blob, kind="positions", sender=COORDINATOR, receiver=self.party)
        if len(payload) % 4:
            raise ProtocolError(f"{self.party}: PSI positions of {len(payload)} bytes are not uint32s")
        pos = np.frombuffer(payload, "<u4").astype(np.int64)
        if pos.size and (pos[-1] >= len(self._own) or (pos.size > 1 and not np.all(np.diff(pos) > 0))):
            raise ProtocolError(f"{self.party}: PSI positions not sorted, unique and inside its list of "
                                f"{len(self._own)}")
        self.round = self.n + 1
        self._shared = np.sort(self._order()[pos])
        return self._shared.copy()

    @property
    def intersection(self) -> np.ndarray:
        if self._shared is None:
            raise ProtocolError(f"{self.party}: the PSI has not finished")
        return self._shared.copy()

    def export_state(self) -> dict[str, object]:
        """What it keeps between two messages when each may run in a fresh process (a deployment
        node keeps it in its own ``context.state``, never in a message): its round, its
        permutation's seed and, while it has a list left to blind, its key."""
        out: dict[str, object] = {"round": int(self.round), "perm-seed": self._perm_seed}
        if self._key is not None:
            out["key"] = self._key
        if self.sizes is not None:
            out["sizes"] = np.asarray(self.sizes, "<u8").tobytes()
        return out

    @classmethod
    def import_state(cls, party: str, ids: np.ndarray, parties: list[str], state: dict,
                     **limits) -> "PsiParty":
        """The party :meth:`export_state` saved (``ids``: its own IDs, read again from its table;
        ``limits``: ``max_peer_ids`` and ``flag``, from its own configuration again)."""
        try:
            rnd, seed = int(state["round"]), bytes(state["perm-seed"])
            key = bytes(state["key"]) if "key" in state else None
            raw = bytes(state["sizes"]) if "sizes" in state else None
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"{party}: damaged PSI state") from None
        if not 0 <= rnd <= len(parties) + 1 or len(seed) != 32 or (key is None) != (rnd >= len(parties)) \
                or (key is not None and len(key) != POINT) or (raw is not None and len(raw) != 8 * len(parties)) \
                or (raw is None) != (rnd <= 1):
            raise ProtocolError(f"{party}: damaged PSI state (round {rnd})")
        sizes = None if raw is None else np.frombuffer(raw, "<u8").tolist()
        return cls(party, ids, parties, key=key, perm_seed=seed, rnd=rnd, sizes=sizes, **limits)


class PsiRoute(Protocol):
    """How the protocol's steps reach the parties: each method delivers one step to the parties
    named and returns what they send back. :class:`LocalRoute` calls :class:`PsiParty` objects in
    this process; a Flower deployment's ServerApp sends Flower messages
    (:mod:`fl_split.flower.alignment`). The order of the steps and the checks between them are
    :func:`run_psi`'s, the same for every route."""

    def start(self, parties: list[str]) -> dict[str, bytes]: ...          # every party: its list
    def hop(self, frames: dict[str, bytes]) -> dict[str, bytes]: ...      # each receiver: its output
    def finish(self, frames: dict[str, bytes]) -> dict[str, str]: ...     # each party: ids_digest of I


class LocalRoute:
    """:class:`PsiRoute` between :class:`PsiParty` objects in one process."""

    def __init__(self, ids: dict[str, np.ndarray], tick: Callable[[int], None] | None = None,
                 max_peer_ids: object = "") -> None:
        order = sorted(ids, key=party_index)
        self.parties = {p: PsiParty(p, ids[p], order, tick=tick, max_peer_ids=max_peer_ids) for p in order}

    def start(self, parties):
        return {p: self.parties[p].start() for p in parties}

    def hop(self, frames):
        return {p: self.parties[p].hop(b) for p, b in frames.items()}

    def finish(self, frames):
        return {p: ids_digest(self.parties[p].finish(b)) for p, b in frames.items()}


def ids_digest(ids: np.ndarray) -> str:
    """A digest of an ID list (int64, in order): how a party tells the coordinator which
    intersection it found without sending it."""
    return hashlib.blake2b(np.ascontiguousarray(np.asarray(ids), "<i8").tobytes(), digest_size=16).hexdigest()


def _as_keys(pts: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pts).view("S32").ravel()


def run_psi(route: PsiRoute, parties: list[str],
            transcript: Callable[[str, str, str, bytes], None] | None = None) -> int:
    """The coordinator of the module docstring over ``route`` (``parties`` in index order, host
    first): start, N-1 rounds of hops, positions. Returns ``|I|``; it never sees ``I``.

    ``transcript(kind, sender, receiver, blob)`` sees every frame (the start and hop outputs as the
    coordinator receives them, the positions it sends). Raises :class:`ProtocolError` for a malformed
    frame or a hop that changed a list's length, :class:`DataError` when the intersection is empty or
    the parties found different intersections."""
    log = transcript or (lambda *a: None)
    n = len(parties)
    if n < 2 or [party_index(p) for p in parties] != list(range(n)):
        raise ValueError(f"PSI parties {parties}: host, guest-1, … in order")
    sizes: dict[int, int] = {}
    held = route.start(list(parties))  # origin index → the frame now on its way
    frames: dict[int, bytes] = {}
    for i, p in enumerate(parties):
        to = _ring(parties, i + 1)
        blob = held.get(p)
        origin, hop, pts = read_list(blob, p, to)
        if (origin, hop) != (i, 1):
            raise ProtocolError(f"{p}: its PSI list says origin {origin}, hop {hop}; expected {i}, 1")
        sizes[i] = len(pts)
        log("list", p, to, blob)
        frames[i] = blob
    announced = [sizes[i] for i in range(n)]  # the starts fix every party's size before anyone blinds a peer's
    for r in range(1, n):
        at = {j: (j - r) % n for j in range(n)}  # party j holds the list of origin j - r in round r
        outs = route.hop({parties[j]: (sizes_frame(parties[j], announced, frames[i]) if r == 1 else frames[i])
                          for j, i in at.items()})
        for j, i in at.items():
            p, to = parties[j], (COORDINATOR if r + 1 == n else _ring(parties, j + 1))
            blob = outs.get(p)
            origin, hop, pts = read_list(blob, p, to)
            if (origin, hop, len(pts)) != (i, r + 1, sizes[i]):
                raise ProtocolError(f"{p}: PSI list of origin {origin} after {hop} hop(s) with {len(pts)} values; "
                                    f"expected origin {i} after {r + 1} with {sizes[i]}")
            log("list", p, to, blob)
            frames[i] = blob
    full = {i: _as_keys(read_list(frames[i], parties[(i - 1) % n], COORDINATOR)[2]) for i in range(n)}
    ordered = {i: np.sort(f) for i, f in full.items()}  # sort-based: numpy's hash unique is slow on S32
    for i, f in ordered.items():
        if len(f) > 1 and bool((f[1:] == f[:-1]).any()):
            raise ProtocolError(f"{parties[i]}'s fully blinded PSI list repeats a value; refused")
    star = reduce(lambda a, b: np.intersect1d(a, b, assume_unique=True), ordered.values())
    if not len(star):
        raise DataError(f"--align psi: the parties' ID sets have no ID in common ({', '.join(parties)}); "
                        f"nothing to train on")
    pos = {parties[i]: encode("positions", COORDINATOR, parties[i],
                              np.flatnonzero(np.isin(f, star, assume_unique=True)).astype("<u4").tobytes()) for i, f in full.items()}
    for p in parties:
        log("positions", COORDINATOR, p, pos[p])
    digests = route.finish(pos)
    if len({digests.get(p) for p in parties}) != 1:
        raise DataError("--align psi: the parties found different intersections; refused")
    return int(len(star))


def align_by_psi(ids: dict[str, np.ndarray], transcript: Callable[[str, str, str, bytes], None] | None = None,
                 progress: bool = False, stats: dict | None = None, max_peer_ids: object = "") -> np.ndarray:
    """:func:`run_psi` over a :class:`LocalRoute` between one :class:`PsiParty` per party (``ids``:
    each party's own IDs) and the intersection every party agreed on (sorted).

    ``transcript(kind, sender, receiver, blob)`` sees every message (tests scan it); ``progress``:
    a progress bar over the X25519 operations when there are many (``PROGRESS_FROM``); ``stats``
    gets ``time_s``, ``messages`` and ``bytes``; ``max_peer_ids``: every party's bound on a peer's set
    (``--psi-max-peer-ids``, :func:`peer_limit`). Raises :class:`DataError` when the intersection is
    empty, a party refuses a peer's announced size, or the parties disagree."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    counts = {"messages": 0, "bytes": 0}

    def log(kind, sender, receiver, blob):
        counts["messages"] += 1
        counts["bytes"] += len(blob)
        if transcript is not None:
            transcript(kind, sender, receiver, blob)

    route = LocalRoute(ids, max_peer_ids=max_peer_ids)
    total = len(ids) * sum(len(party._own) for party in route.parties.values())  # X25519 operations
    with tqdm(total=total, desc="private set intersection", unit="pt", unit_scale=True, leave=False,
              dynamic_ncols=True, disable=not progress or total < PROGRESS_FROM) as bar:
        for party in route.parties.values():
            party.tick = bar.update
        run_psi(route, list(route.parties), log)
    if stats is not None:
        stats.update(time_s=round(time.perf_counter() - t0, 3), **counts)
    return route.parties["host"].intersection
