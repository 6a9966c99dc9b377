"""What an unauthenticated peer can make the host hold — bytes, streams, seconds, log lines — and
what an authenticated one can make it buffer (design, privacy principle 7; issue 16).

Anyone who knows the host's data-plane address can open streams to it. Before a stream has
authenticated, the host bounds:

* **bytes** — gRPC's receive limit is server-wide and checked on a message's length prefix, before
  the message is buffered (measured: a 300 MB message against a 256 KiB limit moves the server's
  RSS by ≈ 5 MB; against the old 2 GiB − 1 limit, by ≈ 860 MB). So the limit on both ends is one
  :data:`PIECE_BYTES` piece, and a handshake frame must fit in :data:`HANDSHAKE_FRAME_BYTES`
  (a few KiB, checked before it is parsed); after the :data:`HANDSHAKE_FRAMES` of them nothing is
  read until the host has accepted the guest's PROOF.
  After the handshake a frame travels as pieces (:func:`pieces`, :class:`Assembler`) and is
  reassembled up to the largest frame the run's plan allows (:func:`largest_frame`), not 2 GiB.
* **streams** — :class:`Admission`: unauthenticated streams share a pool of
  :data:`UNAUTHENTICATED_STREAMS` + one per expected guest, at most half of it per peer address.
  A newcomer over the limit evicts the oldest *silent* stream (no byte received yet) of the address
  holding the most (its own first, when its own address is at its share). Real guests send their
  HELLO at once, so a flood of silent streams only ever evicts itself; an authenticated link leaves
  the pool (its thread is one of the gRPC server's reserved per-guest slots).
* **seconds** — the handshake deadline (``HANDSHAKE_TIMEOUT`` in :mod:`~fl_split.dataplane.host`).
* **records and log lines** — :class:`Refusals`: a counter per kind and per address (at most
  :data:`MAX_ADDRESSES` addresses), the last :data:`RECENT_REFUSALS` messages, the first
  :data:`LOG_FIRST` refusals logged one by one and then one summary line per :data:`LOG_EVERY`
  seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque

from fl_split.dataplane.errors import FrameError

log = logging.getLogger("fl_split.dataplane")

#: one gRPC message after the handshake (and the gRPC receive limit on both ends, plus the flag
#: byte): 256 KiB pieces cost nothing measurable against unchunked 4 MB frames (579 vs 583 MB/s on
#: loopback, `docs/flower.md`); 64 KiB ones halve the throughput
PIECE_BYTES = 256 * 1024
#: the largest handshake frame (HELLO / WELCOME / PROOF are a few hundred bytes)
HANDSHAKE_FRAME_BYTES = 8 * 1024
#: the handshake frames a guest sends (HELLO, PROOF); a later message waits unread until the
#: host has accepted the PROOF
HANDSHAKE_FRAMES = 2
#: unauthenticated streams the host holds at once, besides one per expected guest
UNAUTHENTICATED_STREAMS = 16
#: room in gRPC's concurrent-call limit for evicted streams that are still finishing
EVICTION_MARGIN = 16
#: refusal records kept: recent messages, addresses counted one by one
RECENT_REFUSALS = 16
MAX_ADDRESSES = 64
#: refusals logged one by one, then at most one summary line per LOG_EVERY seconds
LOG_FIRST = 5
LOG_EVERY = 10.0
#: bytes of a frame besides its blobs: fixed header, JSON header (round, an ERROR's message), MAC or
#: AEAD tag — generous; the batch keys are counted per blob
FRAME_SLACK = 64 * 1024
KEY_BYTES = 48

_MORE, _LAST = b"\x00", b"\x01"


def address_of(peer: str) -> str:
    """The address part of a gRPC peer string (``ipv4:10.0.0.9:51234`` → ``ipv4:10.0.0.9``,
    ``ipv6:[::1]:5000`` → ``ipv6:[::1]``); per-address limits count streams by it."""
    head, sep, tail = peer.rpartition(":")
    return head if sep and tail.isdigit() and ":" in head else peer


# -- frames after the handshake: pieces ------------------------------------------------------------
def pieces(frame: bytes):
    """The gRPC messages that carry ``frame``: each a flag byte (``0``: more follows, ``1``: last)
    and at most :data:`PIECE_BYTES` of the frame."""
    view = memoryview(frame)
    n = len(view)
    for i in range(0, max(n, 1), PIECE_BYTES):
        yield (_LAST if i + PIECE_BYTES >= n else _MORE) + view[i: i + PIECE_BYTES]


class Assembler:
    """Reassembles the pieces of an authenticated stream's frames, refusing a frame as soon as it
    grows past ``limit`` bytes (the run plan's largest frame: :func:`largest_frame`)."""

    def __init__(self, limit: int, peer: str) -> None:
        self.limit = int(limit)
        self.peer = peer
        self._parts: list = []
        self._size = 0

    def add(self, piece: bytes) -> bytes | None:
        """Take one piece; returns the frame it completes, or ``None``. Raises :class:`FrameError`."""
        if len(piece) < 1 or piece[0] > 1:
            raise FrameError(f"malformed data-plane piece from {self.peer}: "
                             f"{'empty' if not piece else f'flag {piece[0]}'}, expected 0 or 1")
        self._size += len(piece) - 1
        if self._size > self.limit:
            raise FrameError(f"refused a data-plane frame from {self.peer}: more than {self.limit} bytes, the largest "
                             f"frame this run's plan allows (batch size, cut width, batches per round); refused "
                             f"before the rest was buffered")
        self._parts.append(memoryview(piece)[1:])
        if piece[0] == 0:
            return None
        frame = b"".join(self._parts)
        self._parts, self._size = [], 0
        return frame


def largest_frame(schedule, batches_per_round, cut_shapes) -> int:
    """The largest legitimate frame of a run: a STEP (a training round's owed gradients) or a
    RELEASE (a training round's activations, or the evaluation round's over the whole test split)
    for the widest cut, each blob at most :func:`fl_split.protocol.frame_limit` (what the receiving
    party accepts anyway), plus per-blob lengths and keys and :data:`FRAME_SLACK`."""
    from fl_split.protocol import frame_limit
    from fl_split.schedule import EVAL_BATCH

    n_train = schedule.num_train_batches()
    k = n_train if batches_per_round == "epoch" else min(max(1, int(batches_per_round)), max(n_train, 1))
    eb = max(schedule.batch_size, EVAL_BATCH)
    full, rest = divmod(int(schedule.n_test), eb)  # the evaluation round: every test batch at once
    n_test = max(1, full + (rest > 0))
    blobs = 0
    for shape in cut_shapes:
        shape = tuple(int(d) for d in shape)
        test = full * frame_limit(eb, shape) + (frame_limit(rest, shape) if rest else 0)
        blobs = max(blobs, k * frame_limit(schedule.batch_size, shape), test)
    return FRAME_SLACK + (4 + KEY_BYTES) * max(k, n_test) + blobs


# -- streams before authentication -----------------------------------------------------------------
class Admission:
    """The pool of unauthenticated streams (see the module docstring). Members are objects with
    ``address`` and ``spoke`` (a byte has arrived) attributes."""

    def __init__(self, capacity: int, per_address: int) -> None:
        self.capacity = int(capacity)
        self.per_address = max(1, int(per_address))
        self._lock = threading.Lock()
        self._members: dict = {}  # member -> admission order
        self._order = 0

    def admit(self, member):
        """Add ``member``; returns the member it evicts (already out of the pool), or ``None``."""
        with self._lock:
            victim = None
            own = [m for m in self._members if m.address == member.address]
            if len(own) >= self.per_address:
                victim = self._oldest(own)
            elif len(self._members) >= self.capacity:
                counts = Counter(m.address for m in self._members)
                top = max(counts.values())
                victim = self._oldest([m for m in self._members if counts[m.address] == top])
            if victim is not None:
                del self._members[victim]
            self._order += 1
            self._members[member] = self._order
            return victim

    def _oldest(self, candidates):
        return min(candidates, key=lambda m: (bool(m.spoke), self._members[m]))

    def leave(self, member) -> bool:
        """Take ``member`` out (it authenticated, or its stream ended); ``False`` when it was evicted."""
        with self._lock:
            return self._members.pop(member, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._members)


# -- refusals ---------------------------------------------------------------------------------------
class Refusals:
    """Bounded records of refused connections and rate-limited log lines about them.

    ``recent`` is a deque of the last :data:`RECENT_REFUSALS` messages (``append`` works on it as on
    a list); :attr:`anonymous` counts the refused connections that never named an expected guest
    (silent, evicted, oversized or malformed, a wrong session or an unknown party) — an
    unauthenticated flood, not a guest failure."""

    def __init__(self, logger: logging.Logger = log, log_first: int = LOG_FIRST, log_every: float = LOG_EVERY) -> None:
        self.total = 0
        self.anonymous = 0
        self.kinds: Counter = Counter()
        self.addresses: Counter = Counter()
        self.recent: deque = deque(maxlen=RECENT_REFUSALS)
        self._log = logger
        self._first = int(log_first)
        self._every = float(log_every)
        self._lock = threading.Lock()
        self._suppressed = 0
        self._suppressed_kinds: Counter = Counter()
        self._last = time.monotonic()

    def record(self, message: str, address: str, kind: str, named: bool) -> None:
        with self._lock:
            self.total += 1
            self.anonymous += not named
            self.kinds[kind] += 1
            key = address if address in self.addresses or len(self.addresses) < MAX_ADDRESSES else "other addresses"
            self.addresses[key] += 1
            self.recent.append(message)
            if self.total <= self._first:
                line = f"data plane: refused {message}"
            else:
                self._suppressed += 1
                self._suppressed_kinds[kind] += 1
                line = self._summary_locked() if time.monotonic() - self._last >= self._every else None
        if line:
            self._log.warning("%s", line)

    def flush(self) -> None:
        """Log the summary of what was refused since the last line, if anything was."""
        with self._lock:
            line = self._summary_locked() if self._suppressed else None
        if line:
            self._log.warning("%s", line)

    def _summary_locked(self) -> str:
        now = time.monotonic()
        kinds = ", ".join(f"{k} {n}" for k, n in self._suppressed_kinds.most_common())
        line = (f"data plane: refused {self._suppressed} more connection(s) in the last {now - self._last:.0f} s "
                f"({kinds}); {self.total} in all, from {self.sources()}")
        self._suppressed = 0
        self._suppressed_kinds.clear()
        self._last = now
        return line

    def sources(self, n: int = 5) -> str:
        """The addresses refused most, with their counts."""
        top = self.addresses.most_common(n)
        more = len(self.addresses) - len(top)
        return ", ".join(f"{a} ({c})" for a, c in top) + (f" and {more} more address(es)" if more > 0 else "")

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in self.kinds.most_common())
        return f"{self.total} refused ({kinds}) from {self.sources()}"
