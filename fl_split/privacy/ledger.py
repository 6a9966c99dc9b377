"""Per-party privacy ledger: the state of what a party released (spec §5).

Every release a party makes (one batch of records through one mechanism, in one direction) is
charged to its :class:`Ledger` *before* the data leaves. The ledger keeps what the accountants
need and nothing else, and refuses a charge that would take the party over its budget
(:class:`~fl_split.errors.BudgetExceeded`, nothing recorded). The analysis lives elsewhere
(analysis apart from state, as Opacus does): events and their JSON codec in
:mod:`fl_split.privacy.events`, the accountants and their registry in
:mod:`fl_split.privacy.accountants`, the report and its assumptions in
:mod:`fl_split.privacy.report`.

**What is kept.** The distinct costs (by :func:`~fl_split.privacy.events.cost_key`) and the
distinct *kinds of release* accountants see (by
:func:`~fl_split.privacy.events.accounting_key`: event and pure epsilon);

* per record ID, a sparse count vector: how many times it was released as each kind, in the
  training phase or not, with a histogram of the distinct vectors — the **per-record view**: a
  record's loss composes the releases that contained it, the epsilon is the worst record's;
* per training batch ``(epoch, index)``, everything the party released about it (its *step*:
  ``((kind, n), …)`` and the sampling rate ``q = B/N``), with a histogram of the distinct steps —
  the **steps view**, read with amplification (each step one Poisson-sampled event containing all
  its releases, however many ``charge`` calls they arrived in) and by 001's Cor. 4/5 (``paper``);
* one compact log row per entry (round, phase, epoch, index, direction, cost, batch size, rate).

**Cost per charge: O(batch).** Record IDs map to slots (a NumPy table indexed by the ID while IDs
are small and non-negative, else a dictionary, :data:`DIRECT_MIN`); slot -> ID and slot -> count
vector are NumPy arrays grown by doubling, each distinct count vector is interned once. A charge
groups its records by (current vector, counts added) in NumPy and works in Python once per group;
the histogram, the bounds and the worst basic composition are updated per distinct new vector
(docs/accounting.md, "The ledger"). Only :meth:`Ledger.export_state` and :meth:`Ledger.from_state`
(vectorised) are O(records).

**Write-ahead.** With a log attached (:meth:`Ledger.attach_wal`, ``--checkpoint-dir``), every charged
entry is appended to the party's fsynced log by :meth:`Ledger.settle` — after the value is computed,
before it leaves the party — with the digest of the value. A ledger restored from an older checkpoint
:meth:`replays <Ledger.replay>` the log's later records (charged at once: they left), and keeps them
pending: a release of the resumed run with the same ``(round, batch key, direction, cost, records)``
is not charged when it is made, and :meth:`settle` compares digests before it leaves — the same value
consumes the pending record (the same bytes already left), a different one is charged like any
other (``fl_split.checkpoint`` and ``docs/robustness.md`` have the whole rule).

Composition is monotone (dropping releases is post-processing), so the worst record is among the
Pareto-maximal count vectors; each is composed once and cached, and a new composition happens only
when the worst vectors change. When more than :data:`MAX_CANDIDATES` vectors are incomparable (a
distinct cost per step makes every record's vector distinct), one bound of them all is composed
instead (:func:`_bound`: their element-wise maximum, with releases of a family ordered by dominance
compared position by position) — an upper bound by the same monotonicity — and the report says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_split.errors import BudgetExceeded, ConfigError
from fl_split.privacy.accountants import (  # noqa: F401  (re-exported: the analysis, by its old names)
    PLD_INTERVAL,
    RECORDS,
    STEPS,
    NotApplicable,
    Release,
    View,
    accountant_names,
    amplified_pure_epsilon,
    event_pld,
    get_accountant,
    paper_epsilon,
    reported_names,
    single_release_epsilon,
)
from fl_split.privacy.base import PrivacyCost
from fl_split.privacy.events import (  # noqa: F401  (re-exported: mechanisms import pure_dp_event from here)
    MAX_RR_EPSILON,
    EpsilonDeltaDpEvent,
    accounting_key,
    canonical_event,
    cost_from_json,
    cost_key,
    cost_to_json,
    event_from_json,
    event_to_json,
    pure_dp_event,
    rr_noise,
)

#: accountants a ledger can report and budget with (the registry's names; prefer accountant_names())
ACCOUNTANTS = accountant_names()
#: the accountants every report lists ("opacus" is added for Gaussian-only ledgers)
REPORTED = tuple(n for n in ACCOUNTANTS if n != "opacus")
DIRECTIONS = ("forward", "backward", "update", "allocation")
#: slack of the budget comparison (floating-point sums of equal epsilons)
BUDGET_SLACK = 1e-9
#: release counts up to this are composed exactly in the budget pre-check; above it they are
#: rounded up to a geometric grid (ratio GRID_RATIO), see :meth:`Ledger.charge`
GRID_EXACT = 16
GRID_RATIO = 1.05
#: per-record view: at most this many Pareto-maximal count vectors are composed one by one; beyond,
#: their element-wise maximum (an upper bound of each) is composed instead
MAX_CANDIDATES = 32
#: the Pareto filter is not attempted on more distinct count vectors than this (it would cost more
#: than it saves); their element-wise maximum is composed
PARETO_INPUT_MAX = 256
STATE_FORMAT = 2
#: record IDs in [0, max(DIRECT_MIN, 4 x records)) find their slot in a NumPy table (int32, as
#: long as the largest ID: at most 64 MiB below DIRECT_MIN); any other ID switches the ledger to a
#: dictionary (hashed text IDs are negative, large integer IDs far apart)
DIRECT_MIN = 1 << 24

#: note: a bounded per-record view's PLD was capped by the exact worst record's basic composition
NOTE_EXACT_BASIC_CAP = "exact-basic-cap"
_LOG_FIELDS = ("round", "phase", "epoch", "index", "direction", "cost", "n", "sample_rate")
_IDS = itertools.count(1)  # identities of histogram key sets (memo keys, never reused)


@dataclass
class LedgerEntry:
    """One release of one batch: ``ids`` are the records in it (their count = samples released)."""

    round: int
    key: tuple  # BatchKey.as_tuple() = (phase, epoch, index)
    direction: str  # "forward" | "backward" | "update" (a DP-SGD step) | "allocation" (R3eLU importance shares)
    cost: PrivacyCost
    ids: np.ndarray
    sample_rate: float | None = None  # B/N of the training split (amplification and the paper accountant)


@dataclass
class Charge:
    """Entries recorded by :meth:`Ledger.charge` that :meth:`Ledger.settle` must see before the
    releases leave: ``covered[i]``: entry ``i`` matched a release replayed from the write-ahead log
    and was not charged (yet)."""

    entries: list[LedgerEntry]
    covered: list[bool]


@dataclass
class _State:
    """What the accountants read: the ledger's now, or a plan's (the ledger after a charge)."""

    releases: list[Release]
    cols: list[tuple[int, bool]]  # count columns: (release kind, training phase)
    hist: dict[tuple, int]  # sparse per-record count vector -> records having it
    hist_id: int  # identity of hist's key set
    step_hist: dict[tuple, int]  # (members, q) -> training steps having it
    #: a count vector bounding every record's, over all releases / over non-training ones
    bounds: tuple["_Bound", "_Bound"] = field(default_factory=lambda: (_Bound(), _Bound()))
    #: the exact worst record's basic composition, over all releases / over non-training ones
    #: (kept up to date charge by charge: a record's basic epsilon only grows)
    basic_max: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class _Bound:
    """A count vector whose composition bounds every record's (kept up to date charge by charge:
    records only ever gain releases, so the bound only grows with the touched records).

    Releases of a family ordered by dominance
    (:func:`~fl_split.privacy.accountants.dominance_family`) are sorted per record, largest
    first, and ``best[family][i]`` is the largest ``(order, kind)`` any record has at position
    ``i``: a record's i-th largest release is dominated by it (so a distinct cost per step costs
    no more than the worst record's own number of releases). Other kinds keep the largest count any
    record has (``emax``). Composition is monotone in dominance and in counts."""

    emax: dict = field(default_factory=dict)  # kind -> largest count
    best: dict = field(default_factory=dict)  # family -> [(order, kind), …] non-increasing

    def updated(self, vectors: Iterable[Mapping[int, int]], family) -> "_Bound":
        emax, best, copied = self.emax, self.best, set()
        for vec in vectors:
            runs: dict[str, list] = {}
            for r, n in vec.items():
                fam = family(r)
                if fam is None:
                    if n > emax.get(r, 0):
                        if emax is self.emax:
                            emax = dict(emax)
                        emax[r] = n
                else:
                    runs.setdefault(fam[0], []).append(((fam[1], r), n))
            for f, rs in runs.items():
                if f not in copied:
                    if best is self.best:
                        best = dict(best)
                    best[f] = list(best.get(f, ()))
                    copied.add(f)
                b, p = best[f], 0
                for key, n in sorted(rs, reverse=True):
                    for _ in range(n):
                        if p == len(b):
                            b.append(key)
                        elif key > b[p]:
                            b[p] = key
                        p += 1
        return self if (emax is self.emax and best is self.best) else _Bound(emax, best)

    def items(self) -> tuple:
        out = dict(self.emax)
        for b in self.best.values():
            for _order, r in b:
                out[r] = out.get(r, 0) + 1
        return tuple(sorted(out.items()))


@dataclass
class _Plan:
    """The ledger after a charge, computed without touching the ledger."""

    state: _State
    new_costs: dict[str, PrivacyCost]
    new_cost_release: list[int]
    release_index: dict[str, int] | None  # accounting key -> release kind, when kinds were added
    slots: np.ndarray  # slots of the touched records (new IDs: the ledger's next slots, in order)
    vids: np.ndarray  # their new count vectors (indices into Ledger._vecs)
    new_ids: np.ndarray  # IDs first released by this plan, in slot order
    steps: dict[tuple[int, int], tuple[tuple, float]]  # new members / rate of the touched steps
    missing_rate: int
    log: list[tuple]
    phases: list[str]


@dataclass
class _Accounting:
    """One accountant's answer for a state: epsilon (``None``: not applicable, ``why``), the notes
    of the approximations used, whether the per-record view was bounded by an element-wise max."""

    value: float | None
    why: str | None = None
    notes: frozenset = field(default_factory=frozenset)
    bounded: bool = False


class Ledger:
    """A party's record of every release and its privacy accounting (see the module docstring).

    ``accountant`` is the one whose epsilon is reported as ``epsilon`` and compared with
    ``budget``; ``pld_interval`` is the base PLD discretisation (see
    :data:`~fl_split.privacy.accountants.PLD_INTERVAL`).
    """

    #: read by :mod:`fl_split.privacy.report` (which does not import this module: one-way layers)
    directions = DIRECTIONS
    max_candidates = MAX_CANDIDATES

    def __init__(self, party: str, *, accountant: str = "pld", delta: float = 1e-5,
                 budget: float | None = None, amplification: bool = False,
                 pld_interval: float = PLD_INTERVAL) -> None:
        get_accountant(accountant)  # ConfigError naming the choices
        if not (isinstance(delta, (int, float)) and 0.0 < float(delta) < 1.0):
            raise ConfigError("delta", delta, "a number strictly between 0 and 1")
        if budget is not None and not (isinstance(budget, (int, float)) and float(budget) > 0
                                       and math.isfinite(float(budget))):
            raise ConfigError("budget", budget, "'auto' (no budget) or a number > 0")
        if not (isinstance(pld_interval, (int, float)) and 0.0 < float(pld_interval) <= 1.0):
            raise ValueError(f"pld_interval: got {pld_interval!r}; allowed: a number in (0, 1]")
        self.party = str(party)
        self.accountant = accountant
        self.delta = float(delta)
        self.budget = None if budget is None else float(budget)
        self.amplification = bool(amplification)
        self.pld_interval = float(pld_interval)
        self._costs: dict[str, PrivacyCost] = {}  # cost key -> cost, in order of first charge
        self._cost_pos: dict[str, int] = {}  # cost key -> its index in _costs
        self._cost_release: list[int] = []  # cost index -> release kind
        self._release_index: dict[str, int] = {}  # accounting key -> release kind
        self._col_index: dict[tuple[int, bool], int] = {}
        # per-record view, vectorised (the cost of a charge does not grow with the records): record ID
        # -> slot; slot -> ID and slot -> count vector id, NumPy arrays grown geometrically; count
        # vectors ((column, n), …) interned once each
        self._slot: dict[int, int] | None = None  # ID -> slot, once an ID left the direct table's range
        self._direct = np.zeros(0, dtype=np.int32)  # ID -> slot + 1 (0: none) while IDs are small and >= 0
        self._n_rec = 0
        self._ids = np.zeros(0, dtype=np.int64)
        self._vid = np.zeros(0, dtype=np.int64)
        self._vecs: list[tuple] = []
        self._vec_index: dict[tuple, int] = {}
        self._steps: dict[tuple[int, int], tuple[tuple, float]] = {}  # (epoch, index) -> (members, q)
        self._missing_rate = 0  # training entries charged without a sample rate
        self._state = _State([], [], {}, next(_IDS), {})
        self._phases: list[str] = []
        self._log: dict[str, list] = {k: [] for k in _LOG_FIELDS}
        self._cache: dict[tuple, tuple] = {}  # (accountant, kind, items) -> (value, why, notes)
        self._key_memo: dict[int, tuple[PrivacyCost, str, str]] = {}
        self._unit_memo: dict[tuple, str | None] = {}  # (accountant, kind, unit) -> reason
        self._limits: dict[tuple, tuple[int, int | None]] = {}  # budget bisection brackets
        self._cand_memo: dict[tuple, tuple[list[tuple], bool]] = {}  # per-record candidates
        self._max_memo: tuple[int, int] = (0, 0)
        self._families: list = []  # release kind -> dominance family (or None)
        self._basic_memo: dict[tuple, float] = {}  # a record's count vector -> its basic epsilon
        self._wal = None  # fl_split.checkpoint.WriteAheadLog (None: no log, no settle needed)
        self.wal_records = 0  # log records this state includes (a checkpoint's replay starts there)
        #: releases replayed from the log and not re-made yet: match key -> value digests (a multiset)
        self._replayed: dict[tuple, list[str]] = {}

    # -- public interface --------------------------------------------------------------------
    def charge(self, entries: Iterable[LedgerEntry]) -> Charge | None:
        """Atomically record ``entries``.

        If the selected accountant cannot account one of the releases a :class:`ConfigError`
        names it and the accountants that can; if the epsilon after the entries would exceed the
        budget :class:`BudgetExceeded` is raised. Either way nothing is recorded.

        Returns what :meth:`settle` needs when a write-ahead log is attached or releases were
        replayed (``None`` otherwise: nothing to settle). Entries matching a replayed release are
        left uncharged until :meth:`settle` compares the values.
        """
        entries = list(entries)
        if not entries:
            return None
        covered = [False] * len(entries)
        if self._replayed:
            taken: dict[tuple, int] = {}
            for i, e in enumerate(entries):
                mk = self._match_key(e)
                n = taken.get(mk, 0)
                if n < len(self._replayed.get(mk, ())):
                    covered[i] = True
                    taken[mk] = n + 1
        todo = [e for e, c in zip(entries, covered) if not c]
        if todo:
            self._record(todo)
        if self._wal is None and not any(covered):
            return None
        return Charge(entries, covered)

    def settle(self, charge: Charge | None, digests: list[str], draws: list[int | None] | None = None) -> None:
        """Called by the party after computing the releases of ``charge``, before they leave, with
        the digest of each entry's value (:func:`fl_split.checkpoint.value_digest`) and the draw
        counter of its noise (``draws``, logged with it: a resumed party must know every counter
        the run used, ``fl_split.parties``).

        An entry that matched a replayed release is deduplicated when its digest equals the
        replayed one (the same value already left and is charged); otherwise it is charged now
        (budget checked: :class:`BudgetExceeded` means it must not leave). Then every newly
        charged entry is appended to the write-ahead log and fsynced.
        """
        if charge is None:
            return
        if len(digests) != len(charge.entries):
            raise ValueError(f"{self.party}: {len(digests)} digests for {len(charge.entries)} ledger entries")
        if draws is None:
            draws = [None] * len(digests)
        if len(draws) != len(charge.entries):
            raise ValueError(f"{self.party}: {len(draws)} draw counters for {len(charge.entries)} ledger entries")
        logged: list[tuple[LedgerEntry, str, int | None]] = []
        extra: list[LedgerEntry] = []
        consumed: list[tuple[tuple, str]] = []
        for e, cov, d, c in zip(charge.entries, charge.covered, digests, draws):
            if cov:
                mk = self._match_key(e)
                pending = self._replayed.get(mk, [])
                if pending.count(d) > sum(1 for k, x in consumed if k == mk and x == d):
                    consumed.append((mk, d))
                    continue
                extra.append(e)  # re-made differently: a new release
            logged.append((e, d, c))
        if extra:
            self._record(extra)
        for mk, d in consumed:
            pending = self._replayed[mk]
            pending.remove(d)
            if not pending:
                del self._replayed[mk]
        if self._wal is not None and logged:
            self._wal.append(logged)
            self.wal_records = self._wal.count

    def attach_wal(self, wal) -> None:
        """Log every charged entry to ``wal`` (an :class:`fl_split.checkpoint.WriteAheadLog`) in
        :meth:`settle`, before the release leaves."""
        self._wal = wal

    def replay(self, items: list[tuple[LedgerEntry, str]]) -> int:
        """Charge releases the write-ahead log recorded after this state's checkpoint (they left the
        party: no budget check can take them back) and keep each pending for deduplication."""
        if not items:
            return 0
        plan = self._plan([e for e, _ in items])
        why = self._why_not(self.accountant, plan.state)
        if why is not None:
            self._forget(plan)
            raise ConfigError("accountant", self.accountant, "the accountant of the checkpointed run",
                              reason=f"{self.party}: cannot account the logged releases: {why}")
        self._commit(plan)
        for e, d in items:
            self._replayed.setdefault(self._match_key(e), []).append(d)
        self.wal_records += len(items)
        return len(items)

    @property
    def wal(self):
        """The attached write-ahead log (``None``: none)."""
        return self._wal

    @property
    def pending_replays(self) -> int:
        """Replayed releases not re-made (yet) by the resumed run."""
        return sum(len(v) for v in self._replayed.values())

    def _match_key(self, e: LedgerEntry) -> tuple:
        key = e.key.as_tuple() if hasattr(e.key, "as_tuple") else e.key
        return (int(e.round), str(key[0]), int(key[1]), int(key[2]), e.direction, self._cost_key(e.cost)[0],
                int(len(e.ids)))

    def _record(self, entries: list[LedgerEntry]) -> None:
        plan = self._plan(entries)
        try:
            self._admit(plan)
        except BaseException:
            self._forget(plan)
            raise
        self._commit(plan)

    def _admit(self, plan: "_Plan") -> None:
        """Raise if ``plan`` cannot be committed (accountant not applicable, budget exceeded)."""
        why = self._why_not(self.accountant, plan.state)
        if why is not None:
            usable = [a for a in accountant_names() if a != self.accountant and self._why_not(a, plan.state) is None]
            mechs = sorted({c.mechanism for c in {**self._costs, **plan.new_costs}.values()})
            raise ConfigError("accountant", self.accountant, ", ".join(usable) or "none",
                              reason=f"{self.party}: the {self.accountant} accountant cannot account "
                                     f"{'/'.join(mechs)} releases: {why}")
        if self.budget is not None and not self._within_budget(plan.state):
            would = self._accounting(self.accountant, plan.state).value
            spent = self.epsilon()
            raise BudgetExceeded(self.party, 0.0 if spent is None else spent, would, self.budget, self.accountant)

    def _forget(self, plan: "_Plan") -> None:
        """Drop what was memoised about release kinds a plan added but the ledger did not commit
        (their indices will name other kinds later)."""
        if plan.release_index is not None:
            self._cache.clear()
            self._unit_memo.clear()
            self._limits.clear()
            self._basic_memo.clear()

    def would_be(self, entries: Iterable[LedgerEntry], accountant: str | None = None) -> float | None:
        """The epsilon if ``entries`` were charged (nothing is recorded)."""
        name = self._name(accountant)
        entries = list(entries)
        if not entries:
            return self._accounting(name, self._state).value
        plan = self._plan(entries)
        try:
            return self._accounting(name, plan.state).value
        finally:
            self._forget(plan)

    def epsilon(self, accountant: str | None = None) -> float | None:
        """Epsilon spent so far (``None``: the accountant does not apply to these releases)."""
        return self._accounting(self._name(accountant), self._state).value

    def __len__(self) -> int:
        return len(self._log["round"])

    @property
    def releases(self) -> int:
        """Record-releases: the sum of batch sizes over all entries."""
        return int(sum(self._log["n"]))

    def releases_per_record(self) -> int:
        """How many times the most released record was released."""
        hid, best = self._max_memo
        if hid != self._state.hist_id:
            best = max((sum(n for _, n in k) for k in self._state.hist), default=0)
            self._max_memo = (self._state.hist_id, best)
        return int(best)

    @property
    def training_steps(self) -> int:
        """Training batches this party released about (001 Cor. 4/5's T)."""
        return len(self._steps)

    def report(self) -> dict[str, Any]:
        """The party's privacy block (field meanings in docs/accounting.md)."""
        from fl_split.privacy.report import build_report

        return build_report(self)

    def export_state(self) -> dict[str, Any]:
        """Everything, as NumPy arrays and JSON-able values (for :func:`fl_split.state.flatten`)."""
        keys = list(self._costs)
        n = self._n_rec
        order = np.argsort(self._ids[:n], kind="stable")
        rids = self._ids[:n][order]
        rvid = self._vid[:n][order]
        vlen = np.asarray([len(v) for v in self._vecs], dtype=np.int64)
        vcol = np.asarray([c for v in self._vecs for c, _ in v], dtype=np.int64)
        vcnt = np.asarray([m for v in self._vecs for _, m in v], dtype=np.int64)
        vstart = np.concatenate([[0], np.cumsum(vlen)[:-1]]).astype(np.int64) if len(vlen) else vlen
        sizes = vlen[rvid] if n else np.zeros(0, dtype=np.int64)
        # each record's vector, gathered: its start repeated, plus 0..size-1
        pos = (np.repeat(vstart[rvid] - np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64), sizes)
               + np.arange(int(sizes.sum()), dtype=np.int64)) if n else np.zeros(0, dtype=np.int64)
        skeys = sorted(self._steps)
        members = [self._steps[k][0] for k in skeys]
        return {
            "format": STATE_FORMAT,
            "party": self.party,
            "accountant": self.accountant,
            "delta": self.delta,
            "budget": self.budget,
            "amplification": self.amplification,
            "pld_interval": self.pld_interval,
            "costs": [cost_to_json(self._costs[k]) for k in keys],
            "columns": [[int(r), bool(t)] for r, t in self._state.cols],
            "records": {"ids": np.repeat(rids, sizes),
                        "columns": vcol[pos] if n else np.zeros(0, dtype=np.int64),
                        "counts": vcnt[pos] if n else np.zeros(0, dtype=np.int64)},
            "steps": {"epoch": np.asarray([k[0] for k in skeys], dtype=np.int64),
                      "index": np.asarray([k[1] for k in skeys], dtype=np.int64),
                      "rate": np.asarray([self._steps[k][1] for k in skeys], dtype=np.float64),
                      "step": np.repeat(np.arange(len(skeys), dtype=np.int64), [len(m) for m in members]),
                      "release": np.asarray([r for m in members for r, _ in m], dtype=np.int64),
                      "count": np.asarray([n for m in members for _, n in m], dtype=np.int64)},
            "missing_rate": int(self._missing_rate),
            "phases": list(self._phases),
            "log": {f: np.asarray(self._log[f], dtype=np.float64 if f == "sample_rate" else np.int64)
                    for f in _LOG_FIELDS},
            "wal_records": int(self.wal_records),
            "replayed": [[list(k), list(v)] for k, v in self._replayed.items()],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "Ledger":
        """Rebuild a ledger from :meth:`export_state` (exact: same reports, same budget)."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"ledger state: not a state exported by Ledger.export_state (format {STATE_FORMAT})")
        led = cls(state["party"], accountant=state["accountant"], delta=state["delta"],
                  budget=state["budget"], amplification=bool(state["amplification"]),
                  pld_interval=state["pld_interval"])
        releases: list[Release] = []
        for c in state["costs"]:
            cost = cost_from_json(c)
            led._cost_pos[cost_key(cost)] = len(led._costs)
            led._costs[cost_key(cost)] = cost
            led._cost_release.append(led._release_of(cost, releases, led._release_index))
        cols = [(int(r), bool(t)) for r, t in state["columns"]]
        if any(not 0 <= r < len(releases) for r, _ in cols):
            raise ValueError("ledger state: a count column names an unknown release")
        led._col_index = {c: j for j, c in enumerate(cols)}
        recs = state["records"]
        ids, cs, ns = (np.asarray(recs[k], dtype=np.int64).reshape(-1) for k in ("ids", "columns", "counts"))
        rids, rvid, vecs = _records_of(ids, cs, ns)
        led._grow(len(rids))
        led._n_rec = len(rids)
        led._ids[:len(rids)] = rids
        led._insert(rids, 0)
        led._vid[:len(rids)] = np.asarray([led._intern(v) for v in vecs], dtype=np.int64)[rvid] if vecs else rvid
        counts = np.bincount(rvid, minlength=len(vecs)).tolist()
        hist: dict[tuple, int] = {v: n for v, n in zip(vecs, counts)}
        st = state["steps"]
        ep, ix, rate, sp, sr, sc = (np.asarray(st[k]).reshape(-1).tolist()
                                    for k in ("epoch", "index", "rate", "step", "release", "count"))
        mem: dict[int, list] = {}
        for s, r, n in zip(sp, sr, sc):
            mem.setdefault(int(s), []).append((int(r), int(n)))
        led._steps = {(int(e), int(i)): (tuple(sorted(mem.get(j, ()))), float(q))
                      for j, (e, i, q) in enumerate(zip(ep, ix, rate))}
        step_hist: dict[tuple, int] = {}
        for sig in led._steps.values():
            step_hist[sig] = step_hist.get(sig, 0) + 1
        aggs = [[_aggregate(v, cols, skip) for v in hist] for skip in (False, True)]
        family = led._family_lookup(releases, len(releases))
        bounds = tuple(_Bound().updated(aggs[skip], family) for skip in (False, True))
        basic_max = tuple(max([0.0] + [led._basic_of(a, releases) for a in aggs[skip] if a]) for skip in (False, True))
        led._state = _State(releases, cols, hist, next(_IDS), step_hist, bounds, basic_max)
        led._missing_rate = int(state["missing_rate"])
        led._phases = [str(p) for p in state["phases"]]
        log = state["log"]
        for f in _LOG_FIELDS:
            arr = np.asarray(log[f])
            led._log[f] = ([None if math.isnan(v) else float(v) for v in arr.tolist()] if f == "sample_rate"
                           else [int(v) for v in arr.tolist()])
        led.wal_records = int(state.get("wal_records", 0))
        led._replayed = {(int(k[0]), str(k[1]), int(k[2]), int(k[3]), str(k[4]), str(k[5]), int(k[6])):
                         [str(d) for d in v] for k, v in state.get("replayed", [])}
        return led

    # -- planning a charge -------------------------------------------------------------------
    def _name(self, accountant: str | None) -> str:
        name = self.accountant if accountant is None else accountant
        get_accountant(name)
        return name

    @staticmethod
    def _release_of(cost: PrivacyCost, releases: list[Release], index: dict[str, int], akey: str | None = None) -> int:
        akey = accounting_key(cost) if akey is None else akey
        r = index.get(akey)
        if r is None:
            r = index[akey] = len(releases)
            releases.append(Release(cost.dp_event, None if cost.epsilon is None else float(cost.epsilon),
                                    cost.mechanism))
        return r

    def _cost_key(self, cost: PrivacyCost) -> tuple[str, str]:
        memo = self._key_memo.get(id(cost))
        if memo is not None and memo[0] is cost:
            return memo[1], memo[2]
        keys = cost_key(cost), accounting_key(cost)
        if len(self._key_memo) > 256:
            self._key_memo.clear()
        self._key_memo[id(cost)] = (cost, *keys)  # holds the object so its id is not reused
        return keys

    def _validate(self, e: Any) -> tuple[str, int, int, int, PrivacyCost, np.ndarray, float | None]:
        from dp_accounting import dp_event as dpe

        if not isinstance(e, LedgerEntry):
            raise TypeError(f"{self.party}: ledger entries must be LedgerEntry objects, got {type(e).__name__}")
        key = e.key.as_tuple() if hasattr(e.key, "as_tuple") else e.key
        if not (isinstance(key, (tuple, list)) and len(key) == 3 and isinstance(key[0], str)):
            raise ValueError(f"{self.party}: ledger entry key {e.key!r}; allowed: (phase, epoch, index)")
        if e.direction not in DIRECTIONS:
            raise ValueError(f"{self.party}: ledger entry direction {e.direction!r}; allowed: {', '.join(DIRECTIONS)}")
        if not isinstance(e.cost, PrivacyCost) or not isinstance(e.cost.dp_event, dpe.DpEvent):
            raise TypeError(f"{self.party}: ledger entry cost must be a PrivacyCost with a dp_accounting "
                            f"DpEvent, got {e.cost!r}")
        ids = np.asarray(e.ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"{self.party}: ledger entry ids must be a 1-D integer array, got "
                             f"dtype {ids.dtype} shape {ids.shape}")
        q = e.sample_rate
        if q is not None and not (isinstance(q, (int, float, np.floating)) and not isinstance(q, bool)
                                  and 0.0 < float(q) <= 1.0):
            raise ValueError(f"{self.party}: ledger entry sample_rate {q!r}; allowed: None or a number in (0, 1]")
        if self.amplification and key[0] == "train" and q is None:
            raise ValueError(f"{self.party}: with amplification every training entry needs its "
                             f"sample_rate (batch size / training records)")
        return (key[0], int(key[1]), int(key[2]), DIRECTIONS.index(e.direction), e.cost,
                ids.astype(np.int64, copy=False), None if q is None else float(q))

    def _plan(self, entries: list[LedgerEntry]) -> _Plan:
        base = self._state
        releases = base.releases
        new_costs: dict[str, PrivacyCost] = {}
        new_cost_release: list[int] = []
        new_r: dict[str, int] = {}
        release_index = self._release_index
        new_release_index: dict[str, int] | None = None
        new_releases: list[Release] | None = None
        cols = base.cols
        new_cols: list[tuple[int, bool]] = []
        new_col_index: dict[tuple[int, bool], int] = {}
        col_of: list[int] = []
        ids_of: list[np.ndarray] = []
        steps: dict[tuple[int, int], tuple[dict, float]] = {}
        missing = self._missing_rate
        log = []
        phases = list(self._phases)
        for e in entries:
            phase, epoch, index, direction, cost, ids, q = self._validate(e)
            ckey, akey = self._cost_key(cost)
            ci = self._cost_pos.get(ckey)
            if ci is not None:
                r = self._cost_release[ci]
            elif ckey in new_r:
                r = new_r[ckey]
            else:
                if new_releases is None:
                    new_releases, new_release_index = list(releases), dict(release_index)
                new_costs[ckey] = cost
                r = new_r[ckey] = self._release_of(cost, new_releases, new_release_index, akey)
                new_cost_release.append(r)
            train = phase == "train"
            col = (r, train)
            j = self._col_index.get(col)
            if j is None:
                j = new_col_index.get(col)
                if j is None:
                    j = new_col_index[col] = len(cols) + len(new_cols)
                    new_cols.append(col)
            col_of.append(j)
            ids_of.append(ids)
            if train:
                sk = (epoch, index)
                cur = steps.get(sk)
                if cur is None:
                    old = self._steps.get(sk)
                    cur = steps[sk] = (dict(old[0]) if old else {}, old[1] if old else 0.0)
                members, rate = cur
                members[r] = members.get(r, 0) + 1
                steps[sk] = (members, max(rate, 1.0 if q is None else q))
                missing += q is None
            if phase not in phases:
                phases.append(phase)
            log.append((int(e.round), phases.index(phase), epoch, index, direction, ckey, len(ids), q))
        # per-record count vectors of the touched records: records grouped by (old vector, this
        # charge's counts), one Python step per group (a batch has few), NumPy per record
        all_ids = np.concatenate(ids_of) if ids_of else np.zeros(0, dtype=np.int64)
        hist = base.hist
        changed = False
        slots = vids = new_ids = np.zeros(0, dtype=np.int64)
        new_vecs: list[tuple] = []  # distinct count vectors records have after this plan
        if all_ids.size:
            col_arr = np.repeat(np.asarray(col_of, dtype=np.int64), [len(i) for i in ids_of])
            rids, dense = np.unique(all_ids, return_inverse=True)
            dense = dense.reshape(-1)
            ucols, cinv = np.unique(col_arr, return_inverse=True)
            k = len(ucols)
            delta = np.bincount(dense * k + cinv.reshape(-1), minlength=len(rids) * k).reshape(len(rids), k)
            slots = self._lookup(rids)
            fresh = slots < 0
            if fresh.any():
                new_ids = rids[fresh]
                slots[fresh] = self._n_rec + np.arange(len(new_ids), dtype=np.int64)
            old_vid = np.full(len(rids), -1, dtype=np.int64)
            old_vid[~fresh] = self._vid[slots[~fresh]]
            groups, ginv, gcount = _groups(old_vid, delta)
            ucol_list = ucols.tolist()
            hist = dict(base.hist)
            moves = []
            group_vid = []
            for row, n in zip(groups.tolist(), gcount.tolist()):
                ov = row[0]
                d = dict(self._vecs[ov]) if ov >= 0 else {}
                for c, m in zip(ucol_list, row[1:]):
                    if m:
                        d[c] = d.get(c, 0) + m
                vec = tuple(sorted(d.items()))
                group_vid.append(self._intern(vec))
                moves.append((self._vecs[ov] if ov >= 0 else None, vec, n))
            for old, _vec, n in moves:  # out of the old vectors first (their counts cover these records)
                if old is not None:
                    m = hist[old] - n
                    if m:
                        hist[old] = m
                    else:
                        del hist[old]
                        changed = True
            seen = set()
            for _old, vec, n in moves:
                if vec in hist:
                    hist[vec] += n
                else:
                    hist[vec] = n
                    changed = True
                if vec not in seen:
                    seen.add(vec)
                    new_vecs.append(vec)
            vids = np.asarray(group_vid, dtype=np.int64)[ginv.reshape(-1)]
        step_hist = base.step_hist
        new_steps: dict[tuple[int, int], tuple[tuple, float]] = {}
        if steps:
            step_hist = dict(base.step_hist)
            for sk, (members, rate) in steps.items():
                sig = (tuple(sorted(members.items())), rate)
                new_steps[sk] = sig
                _move(step_hist, self._steps.get(sk), sig)
        all_releases = new_releases if new_releases is not None else releases
        all_cols = cols + new_cols if new_cols else cols
        bounds, basic_max = base.bounds, base.basic_max
        if new_vecs:
            # the bounds and the worst basic composition depend on the set of count vectors only
            family = self._family_lookup(all_releases, len(base.releases))
            aggs = [[_aggregate(v, all_cols, skip) for v in new_vecs] for skip in (False, True)]
            bounds = tuple(base.bounds[skip].updated(aggs[skip], family) for skip in (False, True))
            basic_max = tuple(max([base.basic_max[skip]] + [self._basic_of(a, all_releases) for a in aggs[skip] if a])
                              for skip in (False, True))
        state = _State(all_releases, all_cols, hist, next(_IDS) if changed else base.hist_id, step_hist, bounds,
                       basic_max)
        return _Plan(state, new_costs, new_cost_release, new_release_index, slots, vids, new_ids, new_steps, missing,
                     log, phases)

    def _intern(self, vec: tuple) -> int:
        """The id of count vector ``vec`` (interned once; a refused plan's vectors stay: ids name tuples)."""
        v = self._vec_index.get(vec)
        if v is None:
            v = self._vec_index[vec] = len(self._vecs)
            self._vecs.append(vec)
        return v

    def _direct_ok(self, hi: int, n: int) -> bool:
        """Whether IDs up to ``hi`` fit the direct table for ``n`` records (at most 4 slots per record)."""
        return hi < max(DIRECT_MIN, 4 * n) and n < 2 ** 31 - 1

    def _lookup(self, rids: np.ndarray) -> np.ndarray:
        """Slots of the sorted, distinct IDs ``rids`` (-1: not released yet)."""
        if self._slot is None:
            n = len(self._direct)
            if len(rids) and rids[0] >= 0 and rids[-1] < n:
                return self._direct[rids].astype(np.int64) - 1
            out = np.full(len(rids), -1, dtype=np.int64)
            inside = (rids >= 0) & (rids < n)
            out[inside] = self._direct[rids[inside]] - 1
            return out
        return np.asarray(list(map(self._slot.get, rids.tolist(), itertools.repeat(-1, len(rids)))), dtype=np.int64)

    def _insert(self, new_ids: np.ndarray, start: int) -> None:
        """Give the sorted, distinct new IDs ``new_ids`` the slots ``start, start + 1, …``."""
        if not len(new_ids):
            return
        slots = np.arange(start, start + len(new_ids), dtype=np.int64)
        if self._slot is None:
            lo, hi = int(new_ids[0]), int(new_ids[-1])
            if lo >= 0 and self._direct_ok(hi, start + len(new_ids)):
                if hi >= len(self._direct):
                    size = max(hi + 1, min(2 * len(self._direct), max(DIRECT_MIN, 4 * (start + len(new_ids)))), 1024)
                    table = np.zeros(size, dtype=np.int32)
                    table[:len(self._direct)] = self._direct
                    self._direct = table
                self._direct[new_ids] = slots + 1
                return
            # an ID outside the direct table's range: a dictionary from now on
            self._slot = dict(zip(self._ids[:start].tolist(), range(start)))
            self._direct = np.zeros(0, dtype=np.int32)
        self._slot.update(zip(new_ids.tolist(), slots.tolist()))

    def _grow(self, n: int) -> None:
        """Make room for ``n`` record slots (capacity doubled: amortised O(1) per new record)."""
        if n > len(self._vid):
            cap = max(n, 2 * len(self._vid), 1024)
            for name in ("_ids", "_vid"):
                arr = np.zeros(cap, dtype=np.int64)
                old = getattr(self, name)
                arr[:len(old)] = old
                setattr(self, name, arr)

    def _commit(self, plan: _Plan) -> None:
        s = plan.state
        for k, c in plan.new_costs.items():
            self._cost_pos[k] = len(self._costs)
            self._costs[k] = c
        self._cost_release.extend(plan.new_cost_release)
        if plan.release_index is not None:
            self._release_index = plan.release_index
        for j in range(len(self._state.cols), len(s.cols)):
            self._col_index[s.cols[j]] = j
        if len(plan.new_ids):
            start = self._n_rec
            self._grow(start + len(plan.new_ids))
            self._ids[start:start + len(plan.new_ids)] = plan.new_ids
            self._insert(plan.new_ids, start)
            self._n_rec = start + len(plan.new_ids)
        if len(plan.slots):
            self._vid[plan.slots] = plan.vids
        self._steps.update(plan.steps)
        self._missing_rate = plan.missing_rate
        self._phases = plan.phases
        self._state = s
        index = self._cost_pos
        for rnd, phase, epoch, idx, direction, key, n, q in plan.log:
            for f, v in zip(_LOG_FIELDS, (rnd, phase, epoch, idx, direction, index[key], n, q)):
                self._log[f].append(v)

    def _basic_of(self, agg: Mapping[int, int], releases: list[Release]) -> float:
        """Basic composition of one record's releases (``inf`` if basic cannot account them)."""
        vec = tuple(sorted(agg.items()))
        hit = self._basic_memo.get(vec)
        if hit is None:
            try:
                hit = get_accountant("basic").epsilon(View(RECORDS, vec, releases, self.pld_interval), self.delta)
            except NotApplicable:
                hit = math.inf
            if len(self._basic_memo) > 4096:
                self._basic_memo.clear()
            self._basic_memo[vec] = hit
        return hit

    def _family_lookup(self, releases: list[Release], committed: int):
        """``kind -> dominance family`` (memoised for the ``committed`` kinds: kinds are append-only,
        but a refused plan's new kinds are not kept)."""
        from fl_split.privacy.accountants import dominance_family

        fams = self._families
        for r in range(len(fams), committed):
            fams.append(dominance_family(releases[r]))

        def family(r: int):
            if r >= len(fams):  # a plan's kinds beyond the ledger's (not kept if refused)
                return dominance_family(releases[r])
            return fams[r]

        return family

    # -- views -------------------------------------------------------------------------------
    def _reads_steps(self, name: str) -> bool:
        training = get_accountant(name).training
        return training == STEPS or (training is None and self.amplification)

    def _candidates(self, s: _State, skip_train: bool) -> tuple[list[tuple], bool]:
        """Per-record compositions: the Pareto-maximal count vectors aggregated by release kind
        (``((kind, n), …)``), or their element-wise maximum (``True``: a bound was used)."""
        memo_key = (s.hist_id, skip_train)
        hit = self._cand_memo.get(memo_key)
        if hit is not None:
            return hit
        out = _candidates(s.hist, s.cols, skip_train, s.bounds[skip_train])
        if len(self._cand_memo) > 64:
            self._cand_memo.clear()
        self._cand_memo[memo_key] = out
        return out

    def _views(self, name: str, s: _State) -> tuple[list[View], bool]:
        steps = self._reads_steps(name)
        vecs, bounded = self._candidates(s, skip_train=steps)
        views = [View(RECORDS, v, s.releases, self.pld_interval) for v in vecs]
        if steps and s.step_hist:
            views.append(View(STEPS, tuple(sorted(s.step_hist.items())), s.releases, self.pld_interval))
        return views, bounded

    def _why_not(self, name: str, s: _State) -> str | None:
        """Why accountant ``name`` cannot account state ``s`` (``None``: it can). Decided one
        release kind / one training step at a time (memoised) for structural accountants."""
        acc = get_accountant(name)
        if not acc.structural:
            for v in self._views(name, s)[0]:
                try:
                    acc.check(v)
                except NotApplicable as exc:
                    return str(exc)
            return None
        steps = self._reads_steps(name)
        units = [(RECORDS, r) for r in sorted({r for r, train in s.cols if not (steps and train)})]
        if steps:
            units += [(STEPS, sig) for sig in s.step_hist]
        for kind, unit in units:
            mk = (name, kind, unit)
            if mk not in self._unit_memo:
                try:
                    acc.check_unit(kind, unit, s.releases)
                    self._unit_memo[mk] = None
                except NotApplicable as exc:
                    self._unit_memo[mk] = str(exc)
            why = self._unit_memo[mk]
            if why is not None:
                return why
        return None

    def _epsilon_of(self, name: str, view: View) -> tuple[float | None, str | None, frozenset]:
        ck = (name, view.kind, view.items)
        hit = self._cache.get(ck)
        if hit is not None:
            return hit
        notes: set = set()
        try:
            out = (float(get_accountant(name).epsilon(view, self.delta, notes)), None, frozenset(notes))
        except NotApplicable as exc:
            out = (None, str(exc), frozenset())
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[ck] = out
        return out

    def _accounting(self, name: str, s: _State) -> _Accounting:
        """Accountant ``name``'s epsilon of state ``s``: the maximum over its views."""
        why = self._why_not(name, s)
        if why is not None:
            return _Accounting(None, why)
        views, bounded = self._views(name, s)
        acc = get_accountant(name)
        exact = s.basic_max[self._reads_steps(name)]
        best, notes = 0.0, set()
        for v in views:
            value, why, n = self._epsilon_of(name, v)
            if value is None:
                return _Accounting(None, why)
            if bounded and v.kind == RECORDS:
                # the bound's basic composition is above the worst record's, which is known exactly;
                # it is a valid bound for every accountant never above basic
                if name == "basic":
                    value = exact
                elif acc.capped_by_basic and exact < value:
                    value = exact
                    notes.add(NOTE_EXACT_BASIC_CAP)
            best = max(best, value)
            notes |= n
        return _Accounting(best, None, frozenset(notes), bounded and name != "basic")

    def _within_budget(self, s: _State) -> bool:
        """Whether the selected accountant's epsilon of ``s`` stays within the budget.

        Composition is monotone in the release counts (dropping releases is post-processing),
        which avoids a new composition per charge (under amplification the step count changes
        every step): an accountant never above basic accepts when basic fits; a view of one kind
        keeps the largest count known to fit and the smallest known not to (found by doubling,
        then bisection) and composes only when a count falls in between; a mixed view first tries
        its counts rounded up to a coarse grid, then the exact value.
        """
        name, limit = self.accountant, self.budget + BUDGET_SLACK
        acc = get_accountant(name)
        views, bounded = self._views(name, s)
        exact = s.basic_max[self._reads_steps(name)]
        for v in views:
            if not v.items:
                continue
            if bounded and v.kind == RECORDS and (name == "basic" or acc.capped_by_basic):
                if exact <= limit:
                    continue
                if name == "basic":
                    return False
            if acc.capped_by_basic and self._epsilon_of("basic", v)[0] <= limit:
                continue
            if len(v.items) == 1:
                unit, n = v.items[0]
                lk = (name, v.kind, unit)
                lo, hi = self._limits.get(lk, (0, None))
                if hi is None and n > lo:  # probe ahead (doubling), so a run composes O(log T) times
                    g = _grid(max(n, 2 * lo))
                    if self._fits(name, v.replace(((unit, g),)), limit):
                        lo = g
                    else:
                        hi = g
                while n > lo and (hi is None or n < hi):
                    mid = n if hi is None else (lo + hi) // 2 if hi - lo > 1 else n
                    if self._fits(name, v.replace(((unit, mid),)), limit):
                        lo = max(lo, mid)
                    else:
                        hi = mid if hi is None else min(hi, mid)
                self._limits[lk] = (lo, hi)
                if n > lo:
                    return False
                continue
            if not self._fits(name, v.replace(tuple((u, _grid(n)) for u, n in v.items)), limit) \
                    and not self._fits(name, v, limit):
                return False
        return True

    def _fits(self, name: str, view: View, limit: float) -> bool:
        value = self._epsilon_of(name, view)[0]
        return value is not None and value <= limit

    # -- report helpers (read by fl_split.privacy.report) ------------------------------------
    def _releases_per_cost(self) -> dict[str, int]:
        out: dict[str, int] = {}
        keys = list(self._costs)
        for c, n in zip(self._log["cost"], self._log["n"]):
            out[keys[c]] = out.get(keys[c], 0) + int(n)
        return out


def _groups(old_vid: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct rows of ``[old_vid, delta]`` (rows: records), the row of each record and their counts.

    Rows are packed into one int64 (mixed radix) when they fit, so a 1-D sort does the grouping."""
    radix = [int(old_vid.max()) + 2] + [int(m) + 1 for m in delta.max(axis=0).tolist()]
    if math.prod(radix) < 2 ** 62:
        code = old_vid + 1
        for c, r in enumerate(radix[1:]):
            code = code * r + delta[:, c]
        ucode, ginv, gcount = np.unique(code, return_inverse=True, return_counts=True)
        rows = np.empty((len(ucode), len(radix)), dtype=np.int64)
        rest = ucode.copy()
        for c in range(len(radix) - 1, 0, -1):
            rows[:, c] = rest % radix[c]
            rest //= radix[c]
        rows[:, 0] = rest - 1
        return rows, ginv.reshape(-1), gcount
    rows, ginv, gcount = np.unique(np.column_stack([old_vid, delta]), axis=0, return_inverse=True,
                                   return_counts=True)
    return rows, ginv.reshape(-1), gcount


def _records_of(ids: np.ndarray, cols: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """Exported per-record arrays -> (record IDs ascending, each one's vector index, the distinct
    vectors ``((column, n), …)`` in order of first appearance), vectorised (no Python step per record)."""
    if not len(ids):
        return ids, ids, []
    order = np.lexsort((counts, cols, ids))
    ids, cols, counts = ids[order], cols[order], counts[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    sizes = np.diff(np.r_[starts, len(ids)])
    width = int(sizes.max())
    pos = np.arange(len(ids)) - np.repeat(starts, sizes)
    row = np.repeat(np.arange(len(starts)), sizes)
    mat = np.zeros((len(starts), 2 * width), dtype=np.int64)  # (column + 1, n) pairs, 0-padded
    mat[row, 2 * pos] = cols + 1
    mat[row, 2 * pos + 1] = counts
    if int(mat.min()) >= 0 and math.prod(int(m) + 1 for m in mat.max(axis=0).tolist()) < 2 ** 62:
        code = np.zeros(len(starts), dtype=np.int64)
        for c, m in enumerate(mat.max(axis=0).tolist()):
            code = code * (int(m) + 1) + mat[:, c]
        _u, first, inv = np.unique(code, return_index=True, return_inverse=True)
    else:
        _u, first, inv = np.unique(mat, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    # distinct vectors numbered by first appearance (records by ID)
    by_first = np.argsort(first, kind="stable")
    renum = np.empty_like(by_first)
    renum[by_first] = np.arange(len(by_first))
    vecs = []
    for r in first[by_first].tolist():
        k = int(sizes[r])
        vecs.append(tuple((int(mat[r, 2 * i]) - 1, int(mat[r, 2 * i + 1])) for i in range(k)))
    return ids[starts], renum[inv], vecs


def _grid(n: int) -> int:
    """Smallest grid count >= n: exact up to GRID_EXACT, then geometric steps of GRID_RATIO."""
    g = GRID_EXACT
    if n <= g:
        return n
    while g < n:
        g = math.ceil(g * GRID_RATIO)
    return g


def _aggregate(vec: tuple, cols: list[tuple[int, bool]], skip_train: bool) -> dict[int, int]:
    """A record's count vector by release kind (its training releases left out if ``skip_train``)."""
    agg: dict[int, int] = {}
    for j, n in vec:
        r, train = cols[j]
        if not (skip_train and train):
            agg[r] = agg.get(r, 0) + n
    return agg


def _candidates(hist: Mapping[tuple, int], cols: list[tuple[int, bool]], skip_train: bool,
                bound: _Bound) -> tuple[list[tuple], bool]:
    """Per-record compositions of ``hist`` (see :meth:`Ledger._candidates`)."""
    if len(hist) > PARETO_INPUT_MAX:
        items = bound.items()
        return ([items] if items else []), True
    vecs = set()
    for sparse in hist:
        agg: dict[int, int] = {}
        for j, n in sparse:
            r, train = cols[j]
            if skip_train and train:
                continue
            agg[r] = agg.get(r, 0) + n
        if agg:
            vecs.add(tuple(sorted(agg.items())))
    if not vecs:
        return [], False
    emax: dict[int, int] = {}
    for v in vecs:
        for r, n in v:
            if n > emax.get(r, 0):
                emax[r] = n
    top = tuple(sorted(emax.items()))
    if top in vecs:  # one record dominates every other
        return [top], False
    if len(vecs) <= PARETO_INPUT_MAX:
        # by decreasing total: a vector is dominated only by one of larger total, and if by any,
        # then by a maximal one (transitivity), so only the maximal ones found so far are compared
        maximal: list[tuple[tuple, dict]] = []
        for v in sorted(vecs, key=lambda v: (-sum(n for _, n in v), v)):
            if not any(all(d.get(r, 0) >= n for r, n in v) for _, d in maximal):
                maximal.append((v, dict(v)))
                if len(maximal) > MAX_CANDIDATES:
                    break
        else:
            return sorted(v for v, _ in maximal), False
    return [bound.items()], True


def _move(hist: dict, old, new) -> bool:
    """Move one count in histogram ``hist`` from key ``old`` (``None``: a new entry) to ``new``;
    returns whether the set of keys changed."""
    changed = False
    if old is not None:
        m = hist[old] - 1
        if m:
            hist[old] = m
        else:
            del hist[old]
            changed = True
    if new in hist:
        hist[new] += 1
    else:
        hist[new] = 1
        changed = True
    return changed
