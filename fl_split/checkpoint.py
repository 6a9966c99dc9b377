"""Crash-safe checkpoints and each party's write-ahead release log (``docs/robustness.md``).

Three kinds of files live in a checkpoint directory (``--checkpoint-dir``); in a deployment each
party's live on its own machine, under the same names:

* ``<party>.r<round>.ckpt`` — one party's whole state after ``round`` (:meth:`export_state` of
  :class:`~fl_split.parties.GuestParty` / :class:`~fl_split.parties.HostParty`: models, optimizer,
  secret, pending batches, ledger, importances, diagnostics, caches). It holds the party's secret
  and data-derived weights, so it is written with mode 0600 and never leaves the party. The two
  newest are kept (the coordinator commits round ``r`` only after every party saved it, so the
  previous one is all a resume can still need);
* ``<party>.wal`` — the party's **write-ahead log** of releases: one fsynced record per charged
  release, appended *before* the release leaves the party
  (:meth:`fl_split.privacy.ledger.Ledger.settle`). A resume replays the records made after the
  checkpoint into the restored ledger, so spent budget is never forgotten;
* ``coordinator.ckpt`` — the coordinator's round, results so far (history, wire counters, guest
  failures) and the gradients it holds for the next round. Rewriting it is the commit point of a
  checkpoint.

Every file is written atomically (a temporary file in the same directory, ``fsync``, rename,
``fsync`` of the directory), so it is never half-written. A checkpoint ends with the SHA-256 of
its contents: a truncated or damaged file is refused with a :class:`CheckpointError` naming the
file. The log is append-only text, one record per line with its CRC-32; a torn last line (the
process died while writing it, so the release it describes never left) is dropped, damage
anywhere else is refused.

**Deduplication rule** (why a resumed run that re-makes a release does not pay twice): a replayed
log record is kept as *pending* in the ledger, keyed by ``(round, batch key, direction, cost,
records)`` with the digest of the value that left (the encoded message; for a DP-SGD step, the
parameters after it). A release of the resumed run with the same key is not charged when it is
made; before it leaves, its digest is compared: equal — the same bytes already left, nothing new
is learnt, the pending record is consumed; different — it is a new release and is charged (and
logged) like any other. Same secret, same requests, same weights ⇒ the same draw counters, the same
noise and the same value, so on one machine a resumed run reproduces its releases bit for bit.

**Draw counters** (issue 16). A party's noise is keyed by a counter that only increases
(``fl_split.parties``), and each log record carries the counter of its release's noise (``"c"``;
format ``fl_split.wal/2``). :func:`restore_party` gives the restored party the counters recorded
after its checkpoint with their digests, and the floor one beyond every counter the log holds
(:meth:`~fl_split.parties.GuestParty.resume_draws`): a re-made release may use a logged counter
only for the bit-identical value; a different value made with it is discarded, never sent, and
drawn again beyond the floor (then charged, by the rule above); from the floor on, draws are keyed
by a fresh salt of the resume as well, so a log rolled back to an older copy (whose floor is too low)
cannot bring old noise back (issue 25). No counter ever serves two
different released values — else a host that made the resumed run diverge (other gradients after
the restart) would get the old noise on a new value and subtract it.

**The spend record** (issue 36). Every line of a party's log is also appended, in the same
fsync round, to the party's *spend record* ``<party>.<run>.spent``, which lives **outside** the
checkpoint directory (by default next to it, ``<checkpoint-dir>.spent/``; a deployment node's
node-config ``spend-dir``). The two are the same bytes. A checkpoint directory restored from an
older copy (a backup, a VM image) brings back a shorter log, but not a shorter spend record:
:func:`reconcile_spend_record` finds the log to be a prefix of the record and restores the missing
lines into it before anything else reads the log, so the releases made after the copy are replayed
and charged like those of any crash (and re-made bit for bit, or charged again when they differ).
A missing spend record, or one that disagrees with the log, refuses the resume (one line, nothing
written). Restoring the spend record too defeats it: it is the party's own account of its own
budget (``docs/threat-model.md``, "Rolling back a party's own files").

The functions here work on one party (:func:`save_party`, :func:`restore_party`,
:func:`open_wal`) so that a Flower node can call them on its own machine; the local engine's
:class:`Checkpointer` drives them for every party in this process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
import tempfile
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.errors import ConfigError, DataError

if TYPE_CHECKING:
    from fl_split.config import RunConfig
    from fl_split.privacy.ledger import LedgerEntry

FORMAT = "fl_split.checkpoint/1"
WAL_FORMAT = "fl_split.wal/2"  # /2: each record has its draw counter "c"
MAGIC = b"FLSPLIT\x00CKPT\x01"
_LEN = struct.Struct("<Q")
_SHA = 32
#: NumPy dtypes a checkpoint may hold (never object arrays)
DTYPES = frozenset({"bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                    "float16", "float32", "float64"})
COORDINATOR = "coordinator.ckpt"
#: party checkpoints kept per party
KEEP = 2
#: options that may change between a run and its resume (everything else must match)
FREE_ON_RESUME = ("out", "progress", "checkpoint_dir", "checkpoint_every", "resume", "node_timeout", "num_cpus", "num_gpus",
                  "ray_address", "data_root", "host_metrics", "on_guest_failure",
                  "threads", "save_model")


class CheckpointError(DataError):
    """A checkpoint or write-ahead log that cannot be used: missing, truncated, damaged, or from
    another run, party or configuration. Nothing is restored or spent when it is raised."""


# -- atomic files --------------------------------------------------------------------------------
def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or a new file in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, chunks: Iterable[bytes], mode: int = 0o600) -> Path:
    """Write ``chunks`` to ``path`` atomically: a temporary file in the same directory, fsync,
    rename over ``path``, fsync of the directory. A crash leaves the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # a new checkpoint directory is owner-only
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            for c in chunks:
                fh.write(c)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


# -- the checkpoint container --------------------------------------------------------------------
def write_checkpoint(path: str | os.PathLike, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Path:
    """``MAGIC | len | header JSON | array bytes | SHA-256`` (see :func:`read_checkpoint`)."""
    specs, blobs, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.name not in DTYPES:
            raise TypeError(f"checkpoint array {name!r}: dtype {a.dtype} is not storable")
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        specs.append([str(name), a.dtype.name, [int(s) for s in a.shape], offset, len(raw)])
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps({**header, "arrays": specs}, separators=(",", ":"), allow_nan=True).encode("utf-8")
    digest = hashlib.sha256()
    parts = [MAGIC, _LEN.pack(len(head)), head, *blobs]
    for p in parts:
        digest.update(p)
    return write_atomic(path, [*parts, digest.digest()])


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(header, arrays)`` of a file written by :func:`write_checkpoint`; anything else — missing,
    truncated, damaged, not a checkpoint — is a :class:`CheckpointError` naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    return parse_checkpoint(data, str(path))


def parse_checkpoint(data: bytes, source: str = "checkpoint", verify: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse checkpoint bytes (``verify``: check the SHA-256 trailer first; the fuzzer turns it off
    to reach the structure checks)."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{source}: {why}; refusing to restore from it")

    n0 = len(MAGIC) + _LEN.size
    if len(data) < n0 + _SHA:
        raise bad(f"truncated ({len(data)} bytes)" if data[:len(MAGIC)] == MAGIC[:len(data)] else
                  "not an fl_split checkpoint")
    if data[:len(MAGIC)] != MAGIC:
        raise bad("not an fl_split checkpoint (bad magic)")
    body, trailer = data[:-_SHA], data[-_SHA:]
    if verify and hashlib.sha256(body).digest() != trailer:
        raise bad("truncated or damaged (checksum mismatch)")
    (hlen,) = _LEN.unpack_from(body, len(MAGIC))
    if hlen > len(body) - n0:
        raise bad("damaged header length")
    try:
        header = json.loads(body[n0:n0 + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("damaged header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or not isinstance(header.get("arrays"), list):
        raise bad(f"not a {FORMAT} header")
    payload = memoryview(body)[n0 + hlen:]
    arrays: dict[str, np.ndarray] = {}
    for spec in header["arrays"]:
        if not (isinstance(spec, list) and len(spec) == 5 and isinstance(spec[0], str) and spec[1] in DTYPES
                and isinstance(spec[2], list) and all(type(s) is int and s >= 0 for s in spec[2])
                and all(type(v) is int and v >= 0 for v in spec[3:])):
            raise bad("damaged array table")
        name, dtype, shape, offset, nbytes = spec
        dt = np.dtype(dtype).newbyteorder("<")
        if math.prod(shape) * dt.itemsize != nbytes or offset + nbytes > len(payload) or name in arrays:
            raise bad(f"damaged array {name[:40]!r}")
        arrays[name] = np.frombuffer(payload[offset:offset + nbytes], dtype=dt).reshape(shape).astype(dt.newbyteorder("="))
    del header["arrays"]
    return header, arrays


# -- the write-ahead log -------------------------------------------------------------------------
def value_digest(data: bytes) -> str:
    """The digest a log record keeps of a released value (BLAKE2b-128 of its bytes)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _line(record: Mapping[str, Any]) -> bytes:
    text = json.dumps(record, separators=(",", ":"), allow_nan=True)
    return f"{zlib.crc32(text.encode('utf-8')):08x} {text}\n".encode("utf-8")


@dataclass
class WalRecord:
    """One logged release: what the ledger needs to charge it again, and its value's digest."""

    seq: int
    round: int
    key: tuple[str, int, int]
    direction: str
    cost: Any  # PrivacyCost
    n: int
    ids: int  # batch_digest of the release's record IDs
    sample_rate: float | None
    digest: str
    draw: int | None = None  # the party's draw counter of the release's noise (None: no noise drawn)


class WriteAheadLog:
    """A party's append-only, fsynced log of its releases (``<party>.wal``), mirrored line for line
    into its spend record outside the checkpoint directory (``spent``; ``None``: no record).

    The first line names the format, the party and the run; cost definitions are written once,
    before the first release that uses them; every release line carries its sequence number.
    """

    def __init__(self, path: Path, party: str, run: str, records: list[WalRecord], costs: dict[str, int],
                 end: int, spent: Path | None = None) -> None:
        self.path = path
        self.party = party
        self.run = run
        self.records = records
        self.spent = spent
        self.recovered = 0  # releases the log lacked and its spend record restored (when opened)
        self._costs = costs  # cost key -> index
        self._fh = self._fh_spent = self._sync = None
        self._fh = _open_at(path, end)
        if spent is not None:
            try:
                self._fh_spent = _open_at(spent, end)  # the same bytes as the log (reconciled before)
            except BaseException:
                self._fh.close()
                raise

    @property
    def count(self) -> int:
        return len(self.records)

    @classmethod
    def create(cls, path: str | os.PathLike, party: str, run: str, spent: str | os.PathLike | None = None
               ) -> "WriteAheadLog":
        path = Path(path)
        spent = None if spent is None else Path(spent)
        for p, what in ((path, "a write-ahead log"), (spent, "a spend record")):
            if p is not None and p.exists():
                raise CheckpointError(f"{p}: {what} already exists (another run's releases); "
                                      f"resume that run with --resume or use an empty --checkpoint-dir")
        head = _line({"wal": WAL_FORMAT, "party": party, "run": run})
        if spent is not None:  # first: a log never exists without its record
            write_atomic(spent, [head])
        write_atomic(path, [head])
        return cls(path, party, run, [], {}, len(head), spent)

    @classmethod
    def open(cls, path: str | os.PathLike, party: str, run: str, spent: str | os.PathLike | None = None
             ) -> "WriteAheadLog":
        recovered = 0 if spent is None else reconcile_spend_record(path, spent, party, run)
        records, costs, end = read_wal(path, party, run)
        wal = cls(Path(path), party, run, records, costs, end, None if spent is None else Path(spent))
        wal.recovered = recovered
        return wal

    def append(self, items: list[tuple]) -> None:
        """Log ``(entry, value digest[, draw counter])`` items and fsync, before the releases leave
        the party."""
        from fl_split.privacy.events import cost_key, cost_to_json
        from fl_split.protocol import batch_digest

        lines = []
        for e, digest, *rest in items:
            draw = None if not rest or rest[0] is None else int(rest[0])
            ck = cost_key(e.cost)
            idx = self._costs.get(ck)
            if idx is None:
                idx = self._costs[ck] = len(self._costs)
                lines.append(_line({"cost": idx, "def": cost_to_json(e.cost)}))
            key = tuple(e.key.as_tuple() if hasattr(e.key, "as_tuple") else e.key)
            rec = WalRecord(len(self.records), int(e.round), (str(key[0]), int(key[1]), int(key[2])), e.direction,
                            e.cost, len(e.ids), batch_digest(np.asarray(e.ids)),
                            None if e.sample_rate is None else float(e.sample_rate), digest, draw)
            lines.append(_line({"seq": rec.seq, "round": rec.round, "key": list(rec.key), "dir": rec.direction,
                                "cost": idx, "n": rec.n, "ids": rec.ids, "q": rec.sample_rate, "v": digest,
                                "c": draw}))
            self.records.append(rec)
        data = b"".join(lines)
        if self._fh_spent is None:
            self._fh.write(data)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            return
        for h in (self._fh_spent, self._fh):
            h.write(data)
            h.flush()
        # the two fsyncs at once (measured here: 1.2 ms a line for both, 5.2 ms for the log's alone
        # and 10.3 ms for both in turn); both are done before the release may leave
        if self._sync is None:
            from concurrent.futures import ThreadPoolExecutor

            self._sync = ThreadPoolExecutor(1, thread_name_prefix="spend-record-fsync")
        pending = self._sync.submit(os.fsync, self._fh_spent.fileno())
        try:
            os.fsync(self._fh.fileno())
        finally:
            pending.result()

    def close(self) -> None:
        for h in (self._fh, self._fh_spent):
            if h is not None and not h.closed:
                h.close()
        if self._sync is not None:
            self._sync.shutdown()
            self._sync = None


def _open_at(path: Path, end: int):
    """Open ``path`` for appending at ``end``, dropping a torn last line (the process died writing it)."""
    fh = open(path, "r+b")
    try:
        fh.seek(end)
        fh.truncate()
        fh.flush()
        os.fsync(fh.fileno())
    except BaseException:
        fh.close()
        raise
    return fh


def read_wal(path: str | os.PathLike, party: str | None = None, run: str | None = None
             ) -> tuple[list[WalRecord], dict[str, int], int]:
    """Parse a log: ``(records, cost key -> index, end of the last good line)``. A torn last line is
    ignored; any other damage, or a log of another party or run, is a :class:`CheckpointError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"write-ahead log {str(path)!r} does not exist; without it the releases made "
                              f"after the checkpoint cannot be counted, so the run cannot be resumed") from None
    return parse_wal(data, path, party, run)


def parse_wal(data: bytes, path: str | os.PathLike = "write-ahead log", party: str | None = None,
              run: str | None = None) -> tuple[list[WalRecord], dict[str, int], int]:
    """:func:`read_wal` of bytes already read (``path`` names them in errors)."""
    from fl_split.privacy.events import cost_from_json, cost_key

    lines = data.split(b"\n")
    complete = lines[:-1]  # the part after the last newline is a torn line (or empty)
    records: list[WalRecord] = []
    costs: dict[int, Any] = {}
    keys: dict[str, int] = {}
    end = 0
    for i, raw in enumerate(complete):
        rec = _parse_line(raw)
        last = i == len(complete) - 1 and not lines[-1]
        if rec is None:
            if last:
                break  # a damaged final line: its write never completed
            raise CheckpointError(f"{path}: line {i + 1} is damaged (CRC mismatch); the log cannot be trusted")
        if i == 0:
            if rec.get("wal") != WAL_FORMAT:
                raise CheckpointError(f"{path}: not an fl_split write-ahead log of format {WAL_FORMAT!r} "
                                      f"(found {rec.get('wal')!r})")
            if party is not None and rec.get("party") != party:
                raise CheckpointError(f"{path}: the log of {rec.get('party')!r}, expected {party!r}")
            if run is not None and rec.get("run") != run:
                raise CheckpointError(f"{path}: the log of another run ({rec.get('run')!r}, expected {run!r})")
        elif "def" in rec:
            try:
                c = cost_from_json(rec["def"])
            except Exception as exc:  # noqa: BLE001 - any damage in a definition
                raise CheckpointError(f"{path}: line {i + 1}: bad cost definition ({exc})") from None
            costs[int(rec["cost"])] = c
            keys[cost_key(c)] = int(rec["cost"])
        else:
            try:
                rec_key = rec["key"]
                r = WalRecord(int(rec["seq"]), int(rec["round"]), (str(rec_key[0]), int(rec_key[1]), int(rec_key[2])),
                              str(rec["dir"]), costs[int(rec["cost"])], int(rec["n"]), int(rec["ids"]),
                              None if rec["q"] is None else float(rec["q"]), str(rec["v"]),
                              None if rec["c"] is None else int(rec["c"]))
            except (KeyError, TypeError, ValueError, IndexError):
                raise CheckpointError(f"{path}: line {i + 1}: not a release record") from None
            if r.seq != len(records):
                raise CheckpointError(f"{path}: line {i + 1}: release {r.seq} follows release {len(records) - 1}")
            records.append(r)
        end += len(raw) + 1
    if end == 0:
        raise CheckpointError(f"{path}: empty or damaged write-ahead log (no header line)")
    return records, keys, end


def _parse_line(raw: bytes) -> dict | None:
    if len(raw) < 10 or raw[8:9] != b" ":
        return None
    try:
        crc = int(raw[:8].decode("ascii"), 16)
    except (UnicodeDecodeError, ValueError):
        return None
    body = raw[9:]
    if zlib.crc32(body) != crc:
        return None
    try:
        rec = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


# -- one party -------------------------------------------------------------------------------------
_PARTY_RE = re.compile(r"^(host|guest-[1-9][0-9]*)\.r([0-9]{8})\.ckpt$")


def party_checkpoint_path(directory: str | os.PathLike, party: str, round_: int) -> Path:
    return Path(directory) / f"{party}.r{int(round_):08d}.ckpt"


def wal_path(directory: str | os.PathLike, party: str) -> Path:
    return Path(directory) / f"{party}.wal"


#: what a run's identity may look like in a file name (a Flower node gets it from the coordinator)
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def spend_dir_of(directory: str | os.PathLike) -> Path:
    """The default place of a party's spend records: next to its checkpoint directory, not inside
    it (``<checkpoint-dir>.spent``), so a restore of that directory leaves them alone."""
    d = Path(os.path.abspath(os.path.expanduser(directory)))
    return d.with_name(d.name + ".spent")


def spend_path(spent_dir: str | os.PathLike, party: str, run: str) -> Path:
    """``<spent_dir>/<party>.<run>.spent``: the party's spend record of the run ``run``."""
    if not _RUN_ID_RE.match(str(run)):
        raise CheckpointError(f"{party}: the run identity {str(run)[:70]!r} cannot name a spend record "
                              f"(allowed: 1-64 letters, digits, '-' or '_')")
    return Path(spent_dir).expanduser() / f"{party}.{run}.spent"


def reconcile_spend_record(log: str | os.PathLike, spent: str | os.PathLike, party: str, run: str, *,
                           write: bool = True) -> int:
    """Make a party's write-ahead log and its spend record the same lines again; returns how many
    releases the log lacked (restored into it from the record: a checkpoint directory restored from
    an older copy).

    Both are read and verified first (:func:`read_wal`); the shorter must be a prefix of the longer
    (line for line), and the longer is written over the shorter (atomically). A missing record, or
    one that disagrees with the log, is a :class:`CheckpointError` and nothing is written: the
    releases one of them shows may be missing from the other, and no rule can tell which left.
    ``write=False`` only checks (and counts)."""
    log, spent = Path(log), Path(spent)
    if not spent.exists():
        raise CheckpointError(
            f"{party}: its spend record {str(spent)!r} does not exist; it is kept outside the checkpoint directory "
            f"so that a directory restored from an older copy cannot forget releases made after that copy "
            f"(docs/robustness.md, 'The spend record'): restore it or point at it (a deployment node: node-config "
            f"spend-dir); only if the checkpoint directory was never restored from a copy, copy "
            f"{log.name} there under that name")
    try:
        a = log.read_bytes()
    except FileNotFoundError:
        a = None
    b = spent.read_bytes()
    ra, _, ea = parse_wal(a, log, party, run) if a is not None else ([], {}, 0)
    rb, _, eb = parse_wal(b, spent, party, run)
    a, b = (a or b"")[:ea], b[:eb]
    if a == b:
        return 0
    if len(a) < len(b) and b.startswith(a):
        if write:
            write_atomic(log, [b])  # the log was rolled back (or never written): its record knows more
        return len(rb) - len(ra)
    if len(b) < len(a) and a.startswith(b):
        if write:
            write_atomic(spent, [a])  # the record was rolled back, or a crash fell between the two writes
        return 0
    n = next(i for i, (x, y) in enumerate(zip(a.split(b"\n"), b.split(b"\n"))) if x != y)
    raise CheckpointError(
        f"{party}: its write-ahead log {str(log)!r} and its spend record {str(spent)!r} disagree from line {n + 1} "
        f"on ({len(ra)} and {len(rb)} releases): one of them comes from another history of the run, so releases "
        f"either shows may be missing from the other; refusing to resume (restore the pair that belongs together)")


def party_checkpoints(directory: str | os.PathLike, party: str) -> list[int]:
    """Rounds for which ``party`` has a checkpoint in ``directory``, ascending."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _PARTY_RE.match(p.name)
        if m and m.group(1) == party:
            out.append(int(m.group(2)))
    return sorted(out)


def open_wal(party, directory: str | os.PathLike, run: str, *, resume: bool,
             spent: str | os.PathLike | None = None) -> "WriteAheadLog | None":
    """Attach the party's write-ahead log to its ledger (a new one, or the run's existing one on
    resume), mirrored into its spend record in ``spent`` (default: :func:`spend_dir_of` the
    checkpoint directory; on resume reconciled with the log first, :func:`reconcile_spend_record`).
    A party without a ledger (it claims no DP) releases nothing that needs logging."""
    if party.ledger is None:
        return None
    path = wal_path(directory, party.name)
    record = spend_path(spend_dir_of(directory) if spent is None else spent, party.name, run)
    wal = (WriteAheadLog.open(path, party.name, run, record) if resume
           else WriteAheadLog.create(path, party.name, run, record))
    party.ledger.attach_wal(wal)
    return wal


def save_party(party, directory: str | os.PathLike, round_: int, *, run: str, config: Mapping[str, Any],
               progress: Mapping[str, Any] | None = None, base: int | None = None) -> Path:
    """Checkpoint ``party``'s whole state after ``round_`` (atomically, mode 0600) and keep the
    :data:`KEEP` newest of its checkpoints, and ``base`` too.

    ``base``: the round the coordinator last committed, which a Flower party must keep while it
    checkpoints every epoch inside one control message (the coordinator hears of those epochs only
    when the message ends; a resume restores the newest round every party holds, else ``base``:
    :func:`held_rounds`). ``progress``: the public results of the epochs since ``base`` (the host's
    per-epoch aggregates, wire counts and guest failures), kept in the header for that resume."""
    from fl_split.state import flatten

    arrays, skeleton = flatten(party.export_state())
    header = {"format": FORMAT, "kind": "party", "party": party.name, "round": int(round_), "run": run,
              "config": dict(config), "skeleton": skeleton, "encoder": _encoder_state(party)}
    if progress is not None:
        header["progress"] = dict(progress)
    path = write_checkpoint(party_checkpoint_path(directory, party.name, round_), header, arrays)
    for old in party_checkpoints(directory, party.name)[:-KEEP]:
        if old != base:
            party_checkpoint_path(directory, party.name, old).unlink(missing_ok=True)
    fsync_dir(directory)
    return path


def held_rounds(directory: str | os.PathLike, party: str, run: str) -> dict[int, dict[str, Any] | None]:
    """``{round: progress or None}`` of the checkpoints ``party`` holds in ``directory`` for the run
    ``run`` (each read and verified; a damaged file or another run's is left out, and a resume
    cannot choose it). A Flower node answers the coordinator's ``query.checkpoints`` with it."""
    out: dict[int, dict[str, Any] | None] = {}
    for round_ in party_checkpoints(directory, party):
        try:
            header, _ = read_checkpoint(party_checkpoint_path(directory, party, round_))
        except CheckpointError:
            continue
        if header.get("kind") == "party" and header.get("party") == party and header.get("run") == run \
                and header.get("round") == round_:
            progress = header.get("progress")
            out[round_] = dict(progress) if isinstance(progress, dict) else None
    return out


def _encoder_state(party) -> dict[str, Any] | None:
    """The party's fitted column encoder (:class:`~fl_split.data.encoding.ColumnEncoder`) as JSON: part of
    its state, so a resumed run is refused when the table or ``--encode`` would encode it otherwise."""
    enc = getattr(getattr(party, "data", None), "encoder", None)
    return enc.to_dict() if enc is not None else None


def restore_party(party, directory: str | os.PathLike, round_: int, *, run: str, config: Mapping[str, Any],
                  private_seed: int | None = None, spent: str | os.PathLike | None = None) -> dict[str, Any]:
    """Restore ``party`` from its checkpoint of ``round_``, then replay into its ledger the releases
    its write-ahead log recorded after that checkpoint (they left the party: they stay spent).

    The log is first reconciled with the party's spend record in ``spent`` (default:
    :func:`spend_dir_of` the checkpoint directory; :func:`reconcile_spend_record`): releases a
    checkpoint directory restored from an older copy no longer shows are put back into the log and
    replayed with the others. The result's ``recovered`` counts them.

    Refused with :class:`CheckpointError` / :class:`~fl_split.errors.ConfigError` before the party
    changes: a missing, damaged or foreign checkpoint, another configuration (the differing
    options are named), a private seed that does not derive the checkpointed secret, a log shorter
    than the checkpoint says, a missing spend record or one that disagrees with the log."""
    from fl_split.state import unflatten

    path = party_checkpoint_path(directory, party.name, round_)
    if not path.exists():
        have = party_checkpoints(directory, party.name)
        raise CheckpointError(f"{party.name}: no checkpoint of round {round_} in {str(directory)!r} "
                              f"(it has rounds {have or 'none'}); the coordinator's checkpoint and this party's "
                              f"do not belong together")
    header, arrays = read_checkpoint(path)
    if header.get("kind") != "party" or header.get("party") != party.name or header.get("round") != int(round_):
        raise CheckpointError(f"{path}: holds {header.get('party')!r} round {header.get('round')}, expected "
                              f"{party.name} round {round_}")
    if header.get("run") != run:
        raise CheckpointError(f"{path}: belongs to another run ({header.get('run')!r}, expected {run!r})")
    check_same_config(header.get("config", {}), config, str(path))
    saved_encoder, encoder = header.get("encoder"), _encoder_state(party)
    if saved_encoder is not None and saved_encoder != encoder:
        raise CheckpointError(f"{path}: {party.name} encodes its columns differently from the checkpointed run (its "
                              f"table or --encode changed since): a resumed run must apply the very encoding it "
                              f"trained with")
    try:
        state = unflatten(arrays, header["skeleton"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: damaged state ({exc.__class__.__name__})") from None
    if private_seed is not None:
        from fl_split.seeding import PartySecret

        if PartySecret.from_state(state["secret"]) != PartySecret.from_private_seed(private_seed, party.name):
            raise ConfigError("private-seed", "<given>", "the private seed of the checkpointed run, or none (the "
                              "checkpoint holds each party's secret)",
                              reason=f"it does not derive {party.name}'s checkpointed secret")
    records: list[WalRecord] = []
    floor = recovered = 0
    if party.ledger is not None:
        log = wal_path(directory, party.name)
        record = spend_path(spend_dir_of(directory) if spent is None else spent, party.name, run)
        recovered = reconcile_spend_record(log, record, party.name, run)
        records, _, _ = read_wal(log, party.name, run)
        done = int(state["ledger"].get("wal_records", 0)) if state.get("ledger") else 0
        if len(records) < done:
            raise CheckpointError(f"{party.name}: the write-ahead log has {len(records)} releases but the checkpoint "
                                  f"of round {round_} already counts {done}: the log was truncated or replaced, and "
                                  f"resuming would forget spent budget")
        floor = 1 + max((r.draw for r in records if r.draw is not None), default=-1)
        records = records[done:]
    party.import_state(state)
    # every counter the log recorded (before or after the checkpoint) is spent: a re-made release may
    # use its logged counter only for the bit-identical value (fl_split.parties, issue 16)
    party.resume_draws(floor, {r.draw: r.digest for r in records if r.draw is not None})
    replayed = 0
    if party.ledger is not None and records:
        replayed = party.ledger.replay(_entries(party, records))
    return {"party": party.name, "round": int(round_), "replayed": replayed, "recovered": recovered}


def _entries(party, records: list[WalRecord]) -> list[tuple["LedgerEntry", str]]:
    """Log records as ledger entries (their record IDs recomputed from the party's own schedule and
    checked against the logged batch reference)."""
    from fl_split.privacy.ledger import LedgerEntry
    from fl_split.protocol import batch_digest
    from fl_split.schedule import BatchKey

    out = []
    for r in records:
        try:
            ids = party.ids(BatchKey(*r.key))
        except (IndexError, ValueError):
            raise CheckpointError(f"{party.name}: logged release {r.seq} names batch {r.key}, which this run's "
                                  f"schedule does not have") from None
        if len(ids) != r.n or batch_digest(ids) != r.ids:
            raise CheckpointError(f"{party.name}: logged release {r.seq} ({r.key}) was of other records than "
                                  f"this run's schedule gives")
        out.append((LedgerEntry(r.round, r.key, r.direction, r.cost, ids, r.sample_rate), r.digest))
    return out


def check_same_config(saved: Mapping[str, Any], current: Mapping[str, Any], source: str) -> None:
    """Raise :class:`ConfigError` naming every option that differs (except :data:`FREE_ON_RESUME`)."""
    from fl_split.config import key_of

    diff = []
    for k in sorted(set(saved) | set(current)):
        if k in FREE_ON_RESUME:
            continue
        if saved.get(k, "<unset>") != current.get(k, "<unset>"):
            diff.append(k)
    if diff:
        was = ", ".join(f"--{key_of(k)} {saved.get(k, '<unset>')!r}" for k in diff)
        now = ", ".join(f"--{key_of(k)} {current.get(k, '<unset>')!r}" for k in diff)
        raise ConfigError("resume", True, "the options of the checkpointed run (free to change: "
                          + ", ".join(f"--{key_of(k)}" for k in FREE_ON_RESUME if k != "resume") + ")",
                          reason=f"{source} was made with {was}; this run has {now}")


# -- the coordinator ---------------------------------------------------------------------------------
@dataclass
class CoordinatorState:
    """What the coordinator checkpoints: everything :func:`fl_split.engine.coordinate` needs to go on."""

    run: str
    engine: str
    config: dict[str, Any]
    round: int = 0  # last round every party checkpointed (0: before the first round)
    history: list[dict[str, Any]] = field(default_factory=list)
    wire: dict[str, int] = field(default_factory=dict)
    elapsed: float = 0.0
    owed: dict[str, list[bytes]] = field(default_factory=dict)
    guest_failures: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: int = 0
    resumed: list[dict[str, Any]] = field(default_factory=list)
    #: set when the run ended: {"reason": "completed" | "budget", "round": r}; a finished run cannot resume
    finished: dict[str, Any] | None = None
    #: set when the run stopped and can resume: {"reason": "guest_failure", "guest", "round"}
    stopped: dict[str, Any] | None = None


def save_coordinator(directory: str | os.PathLike, state: CoordinatorState) -> Path:
    meta = dataclasses.asdict(state)
    owed = meta.pop("owed")
    arrays = {f"owed/{g}/{i}": np.frombuffer(b, dtype=np.uint8) for g, bl in owed.items() for i, b in enumerate(bl)}
    header = {"format": FORMAT, "kind": "coordinator", "state": meta,
              "owed": {g: len(bl) for g, bl in owed.items()}}
    return write_checkpoint(Path(directory) / COORDINATOR, header, arrays)


def load_coordinator(directory: str | os.PathLike) -> CoordinatorState:
    path = Path(directory) / COORDINATOR
    header, arrays = read_checkpoint(path)
    if header.get("kind") != "coordinator" or not isinstance(header.get("state"), dict):
        raise CheckpointError(f"{path}: not a coordinator checkpoint")
    try:
        owed = {g: [arrays[f"owed/{g}/{i}"].tobytes() for i in range(int(n))] for g, n in header["owed"].items()}
        return CoordinatorState(**header["state"], owed=owed)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: damaged coordinator state ({exc.__class__.__name__})") from None


def _occupied(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir()
                  if p.name == COORDINATOR or _PARTY_RE.match(p.name) or p.name.endswith(".wal"))


class Checkpointer:
    """The coordinator's side of ``--checkpoint-dir`` / ``--checkpoint-every`` / ``--resume``.

    :meth:`start` checks the directory (a fresh run needs one without checkpoints; a resume needs
    the run's coordinator checkpoint, made with the same options, and not finished) and gives the
    run its identity; :meth:`due` says after which rounds to checkpoint; :meth:`commit` writes the
    coordinator's state once every party has saved the round.
    """

    def __init__(self, cfg: "RunConfig", engine: str) -> None:
        self.cfg = cfg
        self.directory = Path(cfg.checkpoint_dir).expanduser()
        self.engine = engine
        self.every = cfg.checkpoint_every
        self.state: CoordinatorState | None = None
        self.resumed_from: int | None = None

    @property
    def run(self) -> str:
        assert self.state is not None
        return self.state.run

    def config(self) -> dict[str, Any]:
        return self.cfg.to_dict()

    def start(self) -> CoordinatorState:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise ConfigError("checkpoint-dir", str(self.cfg.checkpoint_dir), "a directory", reason="it is a file")
        if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError("checkpoint-dir", str(self.cfg.checkpoint_dir), "a writable directory",
                              reason="it is not writable")
        if self.cfg.resume:
            if not (d / COORDINATOR).exists():
                raise ConfigError("resume", True, "a --checkpoint-dir holding a run's checkpoint",
                                  reason=f"{str(d)!r} has no {COORDINATOR}"
                                         + ("" if d.is_dir() else " (the directory does not exist)"))
            st = load_coordinator(d)
            if st.engine != self.engine:
                raise ConfigError("engine", self.engine, repr(st.engine),
                                  reason=f"the checkpoint in {str(d)!r} is of a {st.engine} run")
            check_same_config(st.config, self.config(), f"the checkpoint in {str(d)!r}")
            if st.finished is not None:
                raise ConfigError("resume", True, "a run that has not finished",
                                  reason=f"the run in {str(d)!r} already ended ({st.finished.get('reason')}, "
                                         f"round {st.finished.get('round')}); nothing to resume")
            self.resumed_from = st.round
            st.resumed.append({"from_round": st.round, "stopped": st.stopped})
            st.stopped = None
            st.config = self.config()
            self.state = st
            return st
        busy = _occupied(d)
        if busy:
            raise ConfigError("checkpoint-dir", str(self.cfg.checkpoint_dir), "an empty directory, or --resume",
                              reason=f"it holds another run's checkpoint ({', '.join(busy[:4])}"
                                     f"{' …' if len(busy) > 4 else ''}); resume it with --resume, or choose "
                                     f"another directory (its logs record spent privacy budget: do not delete them "
                                     f"casually)")
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)  # it will hold the parties' secrets
        except OSError as exc:
            raise ConfigError("checkpoint-dir", str(self.cfg.checkpoint_dir), "a directory that can be created",
                              reason=exc.strerror or str(exc)) from None
        self.state = CoordinatorState(run=uuid.uuid4().hex, engine=self.engine, config=self.config())
        return self.state

    def due(self, rnd) -> bool:
        from fl_split.schedule import EvalRound

        if self.every == "epoch":
            return isinstance(rnd, EvalRound)
        return rnd.round % int(self.every) == 0

    def commit(self, **changes: Any) -> None:
        assert self.state is not None
        for k, v in changes.items():
            setattr(self.state, k, v)
        save_coordinator(self.directory, self.state)

    def describe(self) -> dict[str, Any]:
        st = self.state
        return {"dir": str(self.directory), "every": self.every, "run": st.run if st else None,
                "checkpoints": st.checkpoints if st else 0, "last_round": st.round if st else None,
                "resumed_from_round": self.resumed_from}
