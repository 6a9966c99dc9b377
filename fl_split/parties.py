"""``GuestParty`` and ``HostParty``: the trust boundary.

A party is the unit of trust (design principle 1, ``docs/references.md``): its data, models,
optimizer, secret and ledger never leave the object; what leaves is a :mod:`fl_split.protocol`
blob produced by its mechanism and charged to its ledger first, and — for the host — per-epoch
aggregate metrics declared in its privacy report. A party is given exactly what it needs (its
data slice, the public batch schedule, its own modules wrapped in a local-update policy, its
mechanisms, its :class:`~fl_split.seeding.PartySecret`, its ledger and the public sample rate);
it never reads the run configuration. The same classes run under the in-process
:class:`~fl_split.engine.LocalEngine` and inside Flower ClientApps; a party's whole state can be
exported and restored (:meth:`export_state`), which is how a Flower node keeps it in
``context.state`` between messages.

Per batch (spec §2):

1. guest ``g``: ``v_g = bottom_g(x_g[b])``, releases ``ã_g = M_fwd(v_g)``;
2. host: ``z = merge(a_h, ã_1 … ã_G)``, ``ŷ = top(z)``, loss ``L(ŷ, y[b])``; backward; for each guest
   ``δ_g = ∂L/∂ã_g`` is released as ``δ̃_g = M_bwd(δ_g)``; the host steps its optimizer;
3. guest ``g`` backpropagates ``δ̃_g`` through its mechanism's local derivative and its bottom,
   and steps.

A guest may release several batches before their gradients come back (``batches_per_round >
1``). It then applies the gradients in order, each to a forward recomputed with its *current*
weights (FedBCD-style local updates). With one batch per round the weights have not moved in
between and the kept autograd graph is used directly: exact sequential training.

Every random draw of a party comes from its secret, keyed by purpose and a **draw counter** that
only increases (``secret.torch_generator("release", counter)``; :meth:`_Party._draw`): unpredictable
to every other party, reproducible with ``--private-seed`` (same run, same requests ⇒ same
counters ⇒ same numbers, on every transport), and continued exactly by a restored party (the
counter is part of its exported state). A party never draws the same noise twice: were draws keyed
by the batch, a peer that asks for one batch again would get the same noise twice and subtract it
(issue 16). **A repeated request** for a released batch — a test batch asked again, or a training
batch asked again after its gradient came back (one that awaits its gradient is refused) — is
released again with fresh, independent noise, charged to the ledger as another release of those
records (so ``--budget`` bounds the repetitions), and one warning names the batch and how often it
was released (``docs/accounting.md``, "Threat model"). A guest releases one *test* batch at most
``--max-test-requests`` times (default 1): a request beyond that is refused before anything is
charged or drawn (issue 25).

**Resume.** A party restored from a checkpoint re-makes the releases its write-ahead log recorded
after it. A re-made release may use the counter the log recorded for it only when its value is
bit-identical to the logged one (nothing new leaves: not charged again); otherwise the value made
with the old counter is discarded, never sent, and the release is drawn with a counter beyond every
one the log ever recorded, and charged (:meth:`_Party.resume_draws`). No counter is ever used for
two different released values. From that floor on every draw is also keyed by a fresh salt of the
resume (OS entropy), so a log restored from an older copy cannot make the party repeat noise it
released after that copy (issue 25; the counters the old log records keep their keys). DP-SGD steps follow the same rule (a step whose parameters differ
from the logged ones is undone and taken again with a fresh counter).

**Hostile peers** (``docs/robustness.md``). Before any state changes a party checks a request and
every message in it: the request's round follows the last one it handled (a replayed or stale
request is refused), its batch keys exist in the schedule, are unique and of the expected phase;
each frame is no larger than the receiver expects, decodes, and is exactly the expected message
(kind, sender, receiver, batch and its digest, round, per-sample shape, float32, every value finite
and within ``protocol.MAX_ABS``). Any violation raises :class:`~fl_split.errors.ProtocolError`
naming the peer, and the party's models, optimizer, secret, pending batches and ledger are as
before. The host does not update on a batch whose loss is not finite.

**Bounded trust** (issue 16, :mod:`fl_split.privacy.bounds`). A well-formed message can still hold
values the sender's mechanism cannot produce (a guest multiplying its releases by 1,000). Each
receiver knows its peer's mechanism from the public configuration and checks every release against
its public range (or, with no defence, the peer's running scale) right after the protocol checks,
before any state changes; a violation raises :class:`~fl_split.errors.ReleaseOutOfRange` naming the
sender, the statistic and the bound. Receiver-side denoising runs after the check.

**Write-ahead releases.** When the party's ledger has a write-ahead log (``--checkpoint-dir``) the
party settles every charge before the values leave (:meth:`Ledger.settle
<fl_split.privacy.ledger.Ledger.settle>`): a digest of each released message — for a DP-SGD step,
of the parameters after it — goes to the log, fsynced (``fl_split.checkpoint``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fl_split.checkpoint import value_digest
from fl_split.data.base import PartyData
from fl_split.errors import ProtocolError
from fl_split.local_update import LocalUpdate
from fl_split.merge import Merge
from fl_split.privacy.base import Mechanism, NoDefense, PostProcess
from fl_split.privacy.bounds import PeerTrust
from fl_split.privacy.guard import RECENT, TrainTestGuard
from fl_split.privacy.diagnostics import LocalDiagnostics
from fl_split.privacy.disclosure import party_privacy_report
from fl_split.protocol import (Message, batch_digest, encode, frame_limit, handoff, open_message, receive_expected,
                               wire_bytes)
from fl_split.results import write_json_atomic
from fl_split.schedule import BatchKey, BatchSchedule
from fl_split.seeding import PartySecret
from fl_split.state import flatten, unflatten

if TYPE_CHECKING:
    from fl_split.privacy.ledger import Charge, Ledger, LedgerEntry
    from fl_split.privacy.r3elu import AllocationRelease, ImportanceTracker
    from fl_split.tasks import Objective

HIT_AT = 10
log = logging.getLogger("fl_split.party")
_PHASES = ("train", "test")


def resolve_device(name: str) -> torch.device:
    """``--device`` as a torch device, by the one rule of :func:`fl_split.devices.resolve`
    (``cuda:N`` checked against the GPUs this process sees)."""
    from fl_split.devices import resolve

    return torch.device(resolve(name))


def set_mode(module: nn.Module, train: bool) -> None:
    """``module.train(train)``, skipped when the module is already in that mode (the recursive
    switch costs ~0.1 ms per call on small models, paid per batch otherwise). Parties only ever
    switch whole models, so the top module's flag speaks for its submodules."""
    if module.training != train:
        module.train(train)


def batch_metric(logits: torch.Tensor, y: torch.Tensor, metric: str) -> int:
    """Number of correct predictions (accuracy) or hits in the top 10 (hit@10)."""
    if metric == "hit@10":
        k = min(HIT_AT, logits.shape[1])
        return int((logits.topk(k, dim=1).indices == y[:, None]).any(dim=1).sum())
    return int((logits.argmax(dim=1) == y).sum())


def _outgoing(in_process: bool) -> Callable[[Message], Any]:
    """How a party makes a released message leave: :func:`~fl_split.protocol.encode` (a frame, the
    default: the receiver may be in another process) or, when the transport says the receiver is
    in this process, :func:`~fl_split.protocol.handoff` (the tensor, copied and detached, on its
    device). Either way the release was charged first and the receiver checks it the same way; a
    write-ahead log's digest is that of the frame (:func:`~fl_split.protocol.wire_bytes`, made
    only when a log or a resumed draw asks for it)."""
    return handoff if in_process else encode


class MechanismSchedule:
    """The mechanism a party applies to each batch.

    ``factory(iteration) -> Mechanism``; a constant schedule builds one object. 001 §3.4's
    geometric schedule gives training iteration ``i`` (1-based, counted over the whole run:
    ``(epoch − 1)·batches_per_epoch + index + 1``) the budget ``ε_T/2^i``; the test releases after
    epoch ``e`` use the mechanism of that epoch's last iteration. A few recent objects are cached.
    """

    CACHE = 4

    def __init__(self, factory: Callable[[int], Mechanism] | Mechanism | None, batches_per_epoch: int,
                 constant: bool = True) -> None:
        if factory is None:
            factory = NoDefense()
        self._fixed = factory if isinstance(factory, Mechanism) else None
        self._factory = factory
        self._constant = constant
        self._per_epoch = int(batches_per_epoch)
        self._cache: dict[int, Mechanism] = {}

    def iteration(self, key: BatchKey) -> int:
        if key.phase == "train":
            return (key.epoch - 1) * self._per_epoch + key.index + 1
        return max(key.epoch, 1) * self._per_epoch

    def __call__(self, key: BatchKey | None = None) -> Mechanism:
        """The mechanism of ``key``'s batch (``None``: the first iteration's, for reports)."""
        if self._fixed is not None:
            return self._fixed
        i = 1 if (self._constant or key is None) else self.iteration(key)
        mech = self._cache.get(i)
        if mech is None:
            if len(self._cache) >= self.CACHE:
                self._cache.pop(next(iter(self._cache)))
            mech = self._cache[i] = self._factory(i)
        return mech


class Importance:
    """001 §3.4's neuron importances ``U`` for R3eLU's allocation (Eq. 8–10), when they change, and
    their release.

    ``tracker`` folds the gradients of every backward into the running mean of Eq. 9; releases use
    a snapshot taken before the epoch begins (the paper) or before each release (``refresh =
    "batch"``). A snapshot is always taken *before* the batch's own backward, so the noise of a
    release never depends on that batch's records (only, like the weights, on earlier ones).
    The host's tracker scores the merged input of its top: :meth:`apply` takes the function that
    picks one guest's cut-layer features out of it.

    **A snapshot is a release** (issue 16; DESIGN.md privacy principle 2). The receiver can read
    the allocation back from the releases (per-element grid steps, noise spread and activation
    rates), and ``U`` comes from this party's data, so each snapshot is released through
    ``allocation`` (:class:`~fl_split.privacy.r3elu.AllocationRelease`: noisy importance shares)
    and charged to every training record, *before* any release that uses it leaves. The mechanism
    only ever sees the released shares: what it derives from them is post-processing, public, and
    in the party's report. Before the first update ``U = 0`` is data-independent: nothing is
    released and the mechanism is ``uniform``.
    """

    def __init__(self, tracker: "ImportanceTracker", allocation: "AllocationRelease", refresh: str = "epoch") -> None:
        if refresh not in ("epoch", "batch"):
            raise ValueError(f"importance refresh must be 'epoch' or 'batch', got {refresh!r}")
        self.tracker = tracker
        self.allocation = allocation
        self.refresh = refresh
        self._snapshot: torch.Tensor | None = None
        self._epoch = 0
        #: how many allocations were released, and the last one (public: the receiver can read it)
        self.releases = 0
        self.last_released: torch.Tensor | None = None

    def _due(self, key: BatchKey, have: bool, epoch: int) -> bool:
        return self.refresh == "batch" or not have or (key.phase == "train" and key.epoch != epoch)

    def plan(self, keys, updates_per_key: int) -> set[BatchKey]:
        """The keys of a request at which a new allocation is released (and must be charged first).

        ``updates_per_key``: how many tracker updates happen between two keys of the request (0 for a
        guest, which applies its gradients before it releases; 1 for the host, which updates after
        each batch's backward). A snapshot taken while no update has happened is ``U = 0``: no
        release."""
        out: set[BatchKey] = set()
        have, epoch = self._snapshot is not None, self._epoch
        for i, key in enumerate(keys):
            if self._due(key, have, epoch):
                if self.tracker.count + i * updates_per_key > 0:
                    out.add(key)
                have, epoch = True, (key.epoch if key.phase == "train" else epoch)
        return out

    def entry(self, round_: int, key: BatchKey, train_ids: np.ndarray) -> "LedgerEntry":
        """The ledger entry of the allocation released at ``key``: one release for every training
        record (``U`` is a running mean over all updates so far)."""
        from fl_split.privacy.ledger import LedgerEntry

        return LedgerEntry(round_, ("allocation", key.epoch, key.index), "allocation", self.allocation.cost(),
                           np.asarray(train_ids), None)

    def values_for(self, key: BatchKey, produce: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None,
                   release: bool = False) -> torch.Tensor:
        """The allocation in force for ``key`` (see :meth:`take`)."""
        return self.take(key, produce, release)[0]

    def take(self, key: BatchKey, produce: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None,
             release: bool = False) -> tuple[torch.Tensor, bytes | None, int | None]:
        """The allocation in force for ``key`` (call once per key), the bytes of a newly released
        allocation (for the write-ahead log) or ``None``, and the draw counter of its noise.

        At a refresh that :meth:`plan` charged (``release``) a new allocation is released:
        ``produce(U)`` returns the released shares and their counter (the party's
        ``_release_allocation``: fresh noise under the resume rule of every release)."""
        if not self._due(key, self._snapshot is not None, self._epoch):
            return self._snapshot, None, None
        fresh, drawn = None, None
        if release:
            if produce is None:
                self._snapshot = self.allocation.release(self.tracker.values, None)
            else:
                self._snapshot, drawn = produce(self.tracker.values)
            self.releases += 1
            self.last_released = self._snapshot.clone()
            fresh = self._snapshot.numpy().tobytes()
        elif self.tracker.count == 0:
            self._snapshot = torch.zeros_like(self.tracker.values)
        else:  # pragma: no cover - plan() charges every refresh after an update
            raise RuntimeError(f"importance snapshot at {key} after {self.tracker.count} updates was not charged")
        self._epoch = key.epoch if key.phase == "train" else self._epoch
        return self._snapshot, fresh, drawn

    @staticmethod
    def give(mech: Mechanism, u: torch.Tensor, part: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Hand the allocation ``u`` (or the ``part`` of it for one guest) to ``mech``; mechanisms
        without an allocation ignore it."""
        if hasattr(mech, "set_importance"):
            mech.set_importance(part(u) if part is not None else u)

    def update(self) -> None:
        self.tracker.update()

    def describe(self) -> dict:
        """Public: the allocation mechanism, how many allocations were released and the last one
        (the receiver can read it back from the releases, so nothing here is private)."""
        return {**self.allocation.describe(), "refresh": self.refresh, "releases": self.releases,
                "last_shares": None if self.last_released is None else [round(float(v), 6) for v in self.last_released]}

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "epoch": self._epoch,
                "snapshot": None if self._snapshot is None else self._snapshot.clone(), "releases": self.releases,
                "last_released": None if self.last_released is None else self.last_released.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self._epoch = int(state["epoch"])
        snap = state.get("snapshot")
        self._snapshot = None if snap is None else torch.as_tensor(snap).clone()
        self.releases = int(state.get("releases", 0))
        last = state.get("last_released")
        self.last_released = None if last is None else torch.as_tensor(last).clone()


@dataclass
class _Pending:
    """A released training batch whose gradient has not come back yet."""

    round: int
    version: int
    ctx: dict[str, torch.Tensor]
    out: torch.Tensor | None  # live autograd graph (None after a state restore)


class _Party:
    """What guests and hosts share: data access by batch key, secret, ledger, release counters."""

    role = ""

    def __init__(self, name: str, data: PartyData, schedule: BatchSchedule, secret: PartySecret,
                 ledger: "Ledger | None", sample_rate: float, device: torch.device | str) -> None:
        self.name = name
        self.data = data
        self.schedule = schedule
        self.secret = secret
        self.ledger = ledger
        self.sample_rate = float(sample_rate)
        self.device = torch.device(device)
        self.steps = 0
        self.released = {"batches": 0, "records": 0}
        #: the last request round this party handled (a request for it or an earlier one is refused)
        self.last_round = 0
        self._digests: dict[BatchKey, int] = {}
        #: the next draw counter (only increases; every private draw consumes one)
        self.draws = 0
        #: after a resume: counters below it may have been used by the run that crashed; a draw below
        #: it may only re-make the value the write-ahead log recorded for it (``_logged``: counter -> digest)
        self._draw_floor = 0
        self._logged: dict[int, str] = {}
        #: resume salts ``[(from counter, 32 random bytes)]``: a draw at counter ``c`` is keyed by the
        #: salt of the last segment starting at or below ``c`` (none before the first resume)
        self._salts: list[tuple[int, bytes]] = []
        #: how many times each batch was released by this party (a repeat is warned about); the
        #: batches in order of first release, as two lists that export without a per-message sort
        self._times: dict[BatchKey, int] = {}
        self._first: tuple[list[int], list[int]] = ([], [])  # epoch, 2·index + phase
        #: the ledger's epsilon when each epoch's releases ended (taken when the first release of a
        #: later epoch is charged; the last epoch's is the ledger's current epsilon)
        self.epsilon_by_epoch: dict[int, float | None] = {}
        self._epoch = 0

    def ids(self, key: BatchKey) -> np.ndarray:
        pos = self.schedule.positions(key)
        return (self.data.train_ids if key.phase == "train" else self.data.test_ids)[pos]

    def digest(self, key: BatchKey) -> int:
        """The batch reference of ``key`` that messages carry (:func:`~fl_split.protocol.batch_digest`)."""
        d = self._digests.get(key)
        if d is None:
            if len(self._digests) > 4096:
                self._digests.clear()
            d = self._digests[key] = batch_digest(self.ids(key))
        return d

    def _check(self, blob: bytes, kind: str, sender: str, key: BatchKey, sample_shape,
               round_: int | None = None) -> Message:
        """Decode ``blob`` and check it is exactly the expected message (before any state changes).

        The fast path (:func:`~fl_split.protocol.decode_expected`) compares the frame with the
        expected header and checks the values; anything else goes through :func:`decode` and
        :meth:`Message.check`, which say what is wrong. An in-process
        :class:`~fl_split.protocol.Handoff` gets the same checks on its tensor
        (:func:`~fl_split.protocol.receive_expected`, :func:`~fl_split.protocol.open_message`)."""
        if round_ is not None and sample_shape is not None:
            m = receive_expected(blob, kind=kind, sender=sender, receiver=self.name, round_=round_, key=key,
                                rows=len(self.schedule.positions(key)), sample_shape=sample_shape,
                                digest=self.digest(key))
            if m is not None:
                return m
        ids = self.ids(key)
        return open_message(blob, max_bytes=frame_limit(len(ids), sample_shape)).check(
            kind=kind, sender=sender, receiver=self.name, key=key, ids=ids, sample_shape=sample_shape,
            digest=self.digest(key), round_=round_)

    def _request(self, keys, round_: int | None, phase: str | None = None, what: str = "request") -> list[BatchKey]:
        """Check a request before anything changes: its round follows the last one handled, its keys
        are batch keys of this party's schedule, unique, of one phase (``phase`` if given)."""
        if round_ is not None and not isinstance(round_, (int, np.integer)):
            raise ProtocolError(f"{self.name}: {what} round {round_!r} is not an integer")
        if round_ is not None and round_ >= 0 and round_ <= self.last_round:
            raise ProtocolError(f"{self.name}: {what} for round {round_}, but round {self.last_round} was already "
                                f"handled (a replayed or stale request)")
        try:
            keys = list(keys)
        except TypeError:
            raise ProtocolError(f"{self.name}: {what} batch keys are not a list") from None
        seen: set[BatchKey] = set()
        for k in keys:
            if not isinstance(k, BatchKey):
                raise ProtocolError(f"{self.name}: {what} names {k!r}, not a batch key")
            if k in seen:
                raise ProtocolError(f"{self.name}: {what} names {k} twice")
            seen.add(k)
            want = phase or keys[0].phase
            if k.phase != want:
                raise ProtocolError(f"{self.name}: {what} names {k}; expected {want} batches only")
            try:
                self.schedule.positions(k)
            except (IndexError, ValueError):
                raise ProtocolError(f"{self.name}: {what} names {k}, which is not a batch of the schedule") from None
        return keys

    def _done(self, round_: int | None) -> None:
        if round_ is not None and round_ >= 0:
            self.last_round = int(round_)

    def rows(self, key: BatchKey) -> torch.Tensor:
        pos = torch.from_numpy(self.schedule.positions(key))
        x = self.data.x_train if key.phase == "train" else self.data.x_test
        x = x.index_select(0, pos)
        return x if x.device == self.device else x.to(self.device, non_blocking=True)

    def labels(self, key: BatchKey) -> torch.Tensor:
        pos = torch.from_numpy(self.schedule.positions(key))
        y = self.data.y_train if key.phase == "train" else self.data.y_test
        y = y.index_select(0, pos)
        return y if y.device == self.device else y.to(self.device, non_blocking=True)

    # -- private draws (issue 16) ---------------------------------------------------------------
    def _draw(self, purpose: str) -> tuple[torch.Generator, int]:
        """A private generator keyed by ``(purpose, counter)`` with a fresh counter, and the counter.

        Never keyed by the batch: a repeated request for a batch gets independent noise."""
        c = self.draws
        self.draws = c + 1
        return self._generator(purpose, c), c

    def _generator(self, purpose: str, c: int) -> torch.Generator:
        """The private generator of draw ``c``: ``HMAC(secret, purpose | c)``, and after a resume, from
        the resume floor on, ``HMAC(secret, purpose | c | resume salt)`` (:meth:`resume_draws`)."""
        salt = next((s for start, s in reversed(self._salts) if start <= c), None)
        parts = (purpose, c) if salt is None else (purpose, c, "resume", salt.hex())
        return self.secret.torch_generator(*parts, device=self.device)

    def _gen(self, purpose: str) -> torch.Generator:
        """A fresh private generator for ``purpose`` (a draw whose value never leaves as such)."""
        return self._draw(purpose)[0]

    def _may_leave(self, counter: int, digest: Callable[[], str]) -> bool:
        """Whether a value drawn with ``counter`` may leave: always for a counter no run used
        before; below the resume floor only as the bit-identical re-make of the value the log
        recorded for that counter. Otherwise the party moves beyond every logged counter for
        good (the caller draws again; the old value is discarded)."""
        if counter >= self._draw_floor:
            return True
        if self._logged.get(counter) == digest():
            del self._logged[counter]
            return True
        self.draws = max(self.draws, self._draw_floor)
        self._draw_floor = 0
        self._logged = {}
        return False

    def resume_draws(self, floor: int, logged: dict[int, str]) -> None:
        """After a restore: ``floor`` is one beyond every counter the write-ahead log recorded,
        ``logged`` the counters of the releases made after the checkpoint and their digests."""
        self._draw_floor = max(int(floor), self.draws)
        self._logged = {int(c): str(d) for c, d in logged.items() if int(c) >= self.draws}
        if self._draw_floor == self.draws:
            self._logged = {}
        # the log may be an older copy (a backup, a VM snapshot): counters at or beyond its floor may
        # have keyed releases it no longer records. From the floor on, every draw is keyed by a fresh
        # salt from OS entropy as well, so no later draw repeats noise that left before (issue 25)
        import secrets

        self._salts = [seg for seg in self._salts if seg[0] < self._draw_floor]
        self._salts.append((self._draw_floor, secrets.token_bytes(32)))

    def _release(self, mech: Mechanism, value: torch.Tensor, encode_: Callable[[Any], bytes]
                 ) -> tuple[Any, bytes, int | None]:
        """``mech``'s release of ``value`` made a message by ``encode_`` (a frame, or an in-process
        :class:`~fl_split.protocol.Handoff`), with fresh noise (and its counter)."""
        if not mech.random:
            rel = mech.release(value, None)
            return rel, encode_(rel), None
        gen, c = self._draw("release")
        rel = mech.release(value, gen)
        blob = encode_(rel)
        if not self._may_leave(c, lambda: value_digest(wire_bytes(blob))):
            gen, c = self._draw("release")
            rel = mech.release(value, gen)
            blob = encode_(rel)
        return rel, blob, c

    def _release_allocation(self, u: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The importance allocation released for importances ``u`` with fresh noise (and its
        counter), under the same resume rule as every release (:meth:`_may_leave`)."""
        gen, c = self._draw("allocation")
        shares = self.importance.allocation.release(u, gen)
        if not self._may_leave(c, lambda: value_digest(shares.numpy().tobytes())):
            gen, c = self._draw("allocation")
            shares = self.importance.allocation.release(u, gen)
        return shares, c

    def _step(self, dpsgd: bool, digest: bool) -> tuple[str | None, int | None]:
        """Step the local update (a DP-SGD step with fresh noise); returns the digest of the
        parameters after it when ``digest`` (for the write-ahead log) and the counter used."""
        if not dpsgd:
            self.update.step(None)
            return None, None
        gen, c = self._draw("dpsgd")
        if c >= self._draw_floor:
            self.update.step(gen)
            return (self._params_digest() if digest else None), c
        snap = self.update.snapshot()
        self.update.step(gen)
        d = self._params_digest()
        if not self._may_leave(c, lambda: d):
            self.update.undo_step(snap)
            gen, c = self._draw("dpsgd")
            self.update.step(gen)
            d = self._params_digest()
        return d, c

    def _count_release(self, key: BatchKey) -> None:
        """Count a release of ``key``; warn once per repeat (it is charged like any release)."""
        n = self._times.get(key, 0) + 1
        self._times[key] = n
        if n == 1:
            self._first[0].append(int(key.epoch))
            self._first[1].append(2 * int(key.index) + _PHASES.index(key.phase))
        else:
            log.warning("%s: %s was requested again: released %d times now, each with fresh noise and "
                        "charged", self.name, key, n)

    def _entry(self, round_: int, key: BatchKey, direction: str, cost) -> "LedgerEntry":
        from fl_split.privacy.ledger import LedgerEntry

        return LedgerEntry(round_, key.as_tuple(), direction, cost, self.ids(key), self.sample_rate)

    def _charge(self, entries: list["LedgerEntry"]) -> "Charge | None":
        """Record ``entries`` before anything they describe is computed or leaves (atomic:
        ``BudgetExceeded`` records nothing). Costs do not depend on the data. Returns what
        :meth:`_settle` needs (``None``: nothing to settle, the common case without a log)."""
        if self.ledger is not None and entries:
            epoch = max(int(e.key[1]) for e in entries)
            ended = None
            if epoch > self._epoch and self._epoch >= 1 and len(self.ledger):
                ended = self.ledger.epsilon()  # the previous epoch's releases are all charged
            charge = self.ledger.charge(entries)  # BudgetExceeded: nothing recorded, here either
            if epoch > self._epoch:
                if ended is not None:
                    self.epsilon_by_epoch[self._epoch] = ended
                self._epoch = epoch
            return charge
        return None

    def epsilons_per_epoch(self) -> dict[str, float | None]:
        """``{epoch: epsilon}`` of this party's ledger after each epoch's releases (public, as the
        final epsilon is: a function of the public parameters and release counts)."""
        if self.ledger is None:
            return {}
        out = dict(self.epsilon_by_epoch)
        if self._epoch >= 1 and len(self.ledger):
            out[self._epoch] = self.ledger.epsilon()
        return {str(e): out[e] for e in sorted(out)}

    def _settle(self, charge: "Charge | None", digests: list[str] | None, draws: list[int | None] | None = None) -> None:
        """Before the values of ``charge`` leave: log them (write-ahead, with the draw counter of
        each) and deduplicate re-made releases of a resumed run (see :mod:`fl_split.checkpoint`)."""
        if charge is not None:
            self.ledger.settle(charge, digests or [], draws)

    def _allocation_report(self, mechs: dict[str, tuple[Mechanism, Callable | None]]) -> dict[str, Any]:
        """The released importance allocation and, per receiver, the per-feature noise scales it
        implies (public: the receiver can read both back from the releases), if this party has one."""
        imp = getattr(self, "importance", None)
        if imp is None:
            return {}
        scales: dict[str, list[float]] = {}
        if imp.last_released is not None:
            for name, (mech, part) in mechs.items():
                if hasattr(mech, "set_importance"):
                    m = copy.deepcopy(mech)  # the party's own mechanism keeps its state
                    m.set_importance(part(imp.last_released) if part is not None else imp.last_released)
                    scales[name] = [round(float(v), 6) for v in m.noise_scales()]
        return {"allocation": {**imp.describe(), "last_noise_scales": scales or None}}

    def _params_digest(self) -> str:
        """Digest of the party's parameters (what a DP-SGD step releases, for the write-ahead log)."""
        h = hashlib.blake2b(digest_size=16)
        for m in self.update.modules:
            for p in m.parameters():
                h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    def _common_state(self) -> dict[str, Any]:
        return {"secret": self.secret.state_dict(), "steps": self.steps, "released": dict(self.released),
                "last_round": int(self.last_round),
                "ledger": self.ledger.export_state() if self.ledger is not None else None,
                "draws": {"next": int(self.draws), "floor": int(self._draw_floor),
                          "logged": [[int(c), d] for c, d in sorted(self._logged.items())],
                          "salts": [[int(c), salt.hex()] for c, salt in self._salts],
                          "released": {"epoch": np.asarray(self._first[0], dtype=np.int64),
                                       "slot": np.asarray(self._first[1], dtype=np.int64)},
                          "repeats": [[list(k.as_tuple()), n] for k, n in self._times.items() if n > 1]},
                "epsilon_by_epoch": {"epoch": int(self._epoch),
                                     "values": [[int(e), v] for e, v in sorted(self.epsilon_by_epoch.items())]}}

    def _load_common(self, state: dict[str, Any]) -> None:
        self.secret = PartySecret.from_state(state["secret"])
        self.steps = int(state["steps"])
        self.released = {k: int(v) for k, v in state["released"].items()}
        self.last_round = int(state.get("last_round", 0))
        draws = state["draws"]
        self.draws = int(draws["next"])
        self._draw_floor = int(draws["floor"])
        self._logged = {int(c): str(d) for c, d in draws["logged"]}
        self._salts = [(int(c), bytes.fromhex(str(h))) for c, h in draws.get("salts", [])]
        epochs = np.asarray(draws["released"]["epoch"]).reshape(-1).tolist()
        slots = np.asarray(draws["released"]["slot"]).reshape(-1).tolist()
        self._first = ([int(e) for e in epochs], [int(x) for x in slots])
        self._times = {BatchKey(_PHASES[x % 2], e, x // 2): 1 for e, x in zip(*self._first)}
        for k, n in draws["repeats"]:
            self._times[BatchKey(str(k[0]), int(k[1]), int(k[2]))] = int(n)
        per_epoch = state.get("epsilon_by_epoch") or {"epoch": 0, "values": []}
        self._epoch = int(per_epoch["epoch"])
        self.epsilon_by_epoch = {int(e): (None if v is None else float(v)) for e, v in per_epoch["values"]}
        if self.ledger is not None:
            from fl_split.privacy.ledger import Ledger

            wal = self.ledger.wal
            self.ledger = Ledger.from_state(state["ledger"])
            if wal is not None:  # the log belongs to the party, not to one state of its ledger
                self.ledger.attach_wal(wal)


class GuestParty(_Party):
    """Holds features only: a bottom model (inside its local-update policy), its forward
    mechanism, its secret and its ledger.

    Privacy (spec §3, §5): every release is charged to :attr:`ledger` *before* anything is
    computed or leaves, for all batches of the request at once, so a refused request
    (``BudgetExceeded``) releases nothing. A DP-SGD update policy charges its steps too.
    """

    role = "guest"

    def __init__(self, name: str, data: PartyData, schedule: BatchSchedule, *, update: LocalUpdate,
                 cut_shape: tuple[int, ...], mechanisms: MechanismSchedule, secret: PartySecret,
                 ledger: "Ledger | None" = None, sample_rate: float = 1.0,
                 grad_postprocess: PostProcess | None = None, importance: Importance | None = None,
                 device: torch.device | str = "cpu", host_mechanisms: MechanismSchedule | None = None,
                 max_test_requests: int | None = None) -> None:
        super().__init__(name, data, schedule, secret, ledger, sample_rate, device)
        #: ``--max-test-requests``: how many times one test batch is released (``None``: no cap)
        self.max_test_requests = max_test_requests
        #: what this guest checks of the host's gradients: the public range of the host's backward
        #: mechanism (``host_mechanisms``, from the public configuration), else their running scale
        self.trust = PeerTrust(name, "gradients", {"host": host_mechanisms} if host_mechanisms is not None else {})
        if not data.has_features:
            raise ValueError(f"{name}: a guest must hold feature columns")
        self.update = update
        self.bottom = update.modules[0]
        self.cut_shape = tuple(cut_shape)
        self.mechanisms = mechanisms
        #: receiver-side post-processing of received gradients (denoising), identity by default
        self.grad_postprocess = grad_postprocess or PostProcess()
        self.importance = importance
        self.diagnostics = LocalDiagnostics(name, int(np.prod(self.cut_shape)))
        self._pending: dict[BatchKey, _Pending] = {}

    @property
    def mechanism(self) -> Mechanism:
        """The first iteration's mechanism (what reports describe)."""
        return self.mechanisms()

    # -- forward ----------------------------------------------------------------------------
    def release(self, keys: list[BatchKey] | tuple[BatchKey, ...], round_: int, in_process: bool = False) -> list[bytes]:
        """Compute and release the cut-layer output of each batch in ``keys``: frames, or with
        ``in_process`` :class:`~fl_split.protocol.Handoff` messages for a receiver in this process
        (charged, logged and checked the same; :func:`_outgoing`)."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ProtocolError(f"{self.name}: a batch is asked for twice in one request ({[str(k) for k in keys]})")
        for key in keys:
            if key.phase == "train" and key in self._pending:
                raise ProtocolError(f"{self.name}: {key} was already released and awaits its gradient")
            n = self._times.get(key, 0)
            if key.phase == "test" and self.max_test_requests is not None and n >= self.max_test_requests:
                # before anything is charged or computed: a refused request spends nothing (issue 25)
                raise ProtocolError(f"{self.name}: {key} requested again (round {round_}); refused: it was released "
                                    f"{n} time{'s' if n != 1 else ''} and --max-test-requests {self.max_test_requests} "
                                    f"allows no more (each repeat is another noisy copy of the same records)")
        costs = [self.mechanisms(key).cost() for key in keys]
        # an importance allocation released at a key is charged before that key's release
        alloc = self.importance.plan(keys, updates_per_key=0) if self.importance is not None else set()
        entries = []
        for key, c in zip(keys, costs):
            if key in alloc:
                entries.append(self.importance.entry(round_, key, self.data.train_ids))
            if c is not None:
                entries.append(self._entry(round_, key, "forward", c))
        charge = self._charge(entries)
        out = _outgoing(in_process)
        blobs: list[bytes] = []
        digests: list[str] = []
        draws: list[int | None] = []
        for key, cost in zip(keys, costs):
            if key.phase == "test" and key.index == 0:
                self.diagnostics.check(key.epoch, self.mechanisms(key).name)  # the epoch's training is over
            train = key.phase == "train" and self.update.trains
            x = self.rows(key)
            mech = self.mechanisms(key)
            if self.importance is not None:
                u, shares, drawn = self.importance.take(key, self._release_allocation, release=key in alloc)
                self.importance.give(mech, u)
                if shares is not None:
                    digests.append(value_digest(shares))
                    draws.append(drawn)
            set_mode(self.bottom, train)
            if train and self.update.keeps_release_graph:
                v = self.bottom(x)
            else:
                # DP-SGD guests forward without the graph (Opacus must not capture activations of
                # this pass) and recompute when the gradient arrives
                with torch.no_grad():
                    v = self.bottom(x)
            rel, blob, c = self._release(mech, v.detach(), lambda r: out(Message(
                "activations", self.name, "host", round_, key, self.digest(key), r.value, r.encoding)))
            self.diagnostics.add(key.epoch, rel.stats)
            blobs.append(blob)
            if cost is not None and charge is not None:  # the log's digest: only when there is a log
                digests.append(value_digest(wire_bytes(blob)))
                draws.append(c)
            self._count_release(key)
            self.released["batches"] += 1
            self.released["records"] += len(v)
            if train:
                self._pending[key] = _Pending(round_, self.steps, rel.ctx,
                                              v if self.update.keeps_release_graph else None)
        self._settle(charge, digests, draws)
        return blobs

    # -- backward ---------------------------------------------------------------------------
    def apply_gradients(self, blobs: list[bytes], round_: int | None = None) -> None:
        """Backpropagate the released partial losses of every pending batch, in order.

        All messages are decoded and checked first: a bad message raises
        :class:`ProtocolError` and leaves the party exactly as it was.
        """
        owed = sorted(self._pending)
        if not isinstance(blobs, (list, tuple)):
            raise ProtocolError(f"{self.name}: gradients from host: expected a list of messages, got "
                                f"{type(blobs).__name__}")
        if len(blobs) != len(owed):
            raise ProtocolError(f"{self.name}: {len(blobs)} gradient messages received, but owed for "
                                f"{[str(k) for k in owed]}")
        msgs = self._gradients_in_order(blobs, owed)
        if msgs is None:
            limit = frame_limit(self.schedule.batch_size, self.cut_shape)  # only training batches are owed
            msgs = [open_message(b, max_bytes=limit) for b in blobs]
            got = [m.key for m in msgs]
            if sorted(got) != owed or len(set(got)) != len(got):
                raise ProtocolError(f"{self.name}: gradients received for {[str(k) for k in got]}, "
                                    f"but owed for {[str(k) for k in owed]}")
            for m in msgs:
                m.check(kind="gradients", sender="host", receiver=self.name, key=m.key, ids=self.ids(m.key),
                        sample_shape=self.cut_shape, digest=self.digest(m.key), round_=self._pending[m.key].round)
        for m in msgs:  # bounded trust: within the host's public mechanism (before anything changes)
            self.trust.check("host", m.key, m.tensor, self._pending[m.key].round)
        for m in msgs:
            self.trust.record("host", m.key, m.tensor)
        cost = self.update.cost()
        charge = None
        if cost is not None and msgs:
            charge = self._charge([self._entry(-1 if round_ is None else round_, m.key, "update", cost) for m in msgs])
        digests: list[str] = []
        draws: list[int | None] = []
        for m in msgs:
            p = self._pending.pop(m.key)
            out = p.out if (p.out is not None and p.version == self.steps) else self._recompute(m.key)
            gen = self._gen("denoise") if self.grad_postprocess.random else None
            grad = self.grad_postprocess(m.tensor.to(self.device), gen)
            grad = self.mechanisms(m.key).local_grad(p.ctx, grad)
            self.update.zero_grad()
            self.update.backward(out, grad)
            if self.importance is not None:
                self.importance.update()
            d, c = self._step(cost is not None, charge is not None)
            self.steps += 1
            if charge is not None:
                digests.append(d)
                draws.append(c)
        self._settle(charge, digests, draws)

    def _gradients_in_order(self, blobs, owed: list[BatchKey]) -> list[Message] | None:
        """The fast path of :meth:`apply_gradients`: every blob is exactly the gradient message owed
        for the batch at its position (:func:`~fl_split.protocol.decode_expected`); ``None`` if any
        is not (the caller then decodes and checks each, and says what is wrong)."""
        msgs = []
        for b, k in zip(blobs, owed):
            m = receive_expected(b, kind="gradients", sender="host", receiver=self.name,
                                round_=self._pending[k].round, key=k, rows=len(self.schedule.positions(k)),
                                sample_shape=self.cut_shape, digest=self.digest(k))
            if m is None:
                return None
            msgs.append(m)
        return msgs

    def step(self, grad_blobs: list[bytes], keys, round_: int, in_process: bool = False) -> list[bytes]:
        """One round for this guest: apply the gradients it is owed, then release ``keys``
        (the request is checked first: a replayed round or a bad key changes nothing).
        ``in_process``: the host is in this process; release :class:`~fl_split.protocol.Handoff`
        messages instead of frames (``grad_blobs`` may be either)."""
        keys = self._request(keys, round_)
        self.apply_gradients(grad_blobs, round_)
        blobs = self.release(keys, round_, in_process)
        self._done(round_)
        return blobs

    def _recompute(self, key: BatchKey) -> torch.Tensor:
        """Forward ``key`` again with the current weights, leaving normalisation statistics
        untouched (they were already updated when the batch was first released)."""
        # the forward updates scratch copies of the buffers; the originals are put back by
        # reference (not copied in place: the new graph may have saved the scratch tensors)
        saved = [(m, name, buf) for m in self.bottom.modules() for name, buf in m.named_buffers(recurse=False)]
        for m, name, buf in saved:
            setattr(m, name, buf.clone())
        set_mode(self.bottom, True)
        try:
            return self.bottom(self.rows(key))
        finally:
            for m, name, buf in saved:
                setattr(m, name, buf)

    @property
    def pending_keys(self) -> list[BatchKey]:
        return sorted(self._pending)

    def report(self) -> dict[str, Any]:
        """End-of-run facts this party is willing to disclose (no data, no weights, no secret)."""
        mech = self.mechanism
        dp = self.update.describe() if self.update.cost() is not None else None
        return {"role": "guest", "optimizer_steps": self.steps, "mechanism": mech.describe(),
                **self._allocation_report({"host": (mech, None)}),
                "postprocess": self.grad_postprocess.describe(), "released": dict(self.released),
                "privacy": party_privacy_report(role="guest", ledger=self.ledger, mechanism=mech, update=dp,
                                                released=self.released, cut_width=int(np.prod(self.cut_shape)),
                                                randomness=self.secret.source, aggregates=False,
                                                per_epoch=self.epsilons_per_epoch())}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            **self._common_state(),
            "model": self.bottom.state_dict(),
            "optimizer": self.update.state_dict(),
            "pending": [[list(k.as_tuple()), p.round, p.version, p.ctx] for k, p in sorted(self._pending.items())],
            "importance": self.importance.state_dict() if self.importance is not None else None,
            "diagnostics": self.diagnostics.state_dict(),
        }

    def import_state(self, state: dict[str, Any]) -> None:
        self._load_common(state)
        self.bottom.load_state_dict(state["model"])
        self.update.load_state_dict(state["optimizer"])
        self._pending = {BatchKey(str(k[0]), int(k[1]), int(k[2])): _Pending(int(r), int(v), dict(ctx), None)
                         for k, r, v, ctx in state["pending"]}
        if self.importance is not None:
            self.importance.load_state_dict(state["importance"])
        self.diagnostics.load_state_dict(state["diagnostics"])


class HostParty(_Party):
    """Holds the labels, optionally its own bottom, the merge layer and the top model.

    Privacy: the partial loss ``δ_g`` sent to guest ``g`` is released through
    ``backward_mechanisms[g]`` and charged to :attr:`ledger` (one release per batch per guest, all
    batches of a request charged before training on any). A DP-SGD update policy charges its
    steps to the same ledger. ``one_shot`` (002): the host keeps every received release by record
    and trains later epochs on that cache; nothing flows back to the guests.

    Only per-epoch aggregates leave the host besides its releases: :meth:`evaluate` returns the
    epoch's training loss, test metric and test loss and the task's other test metrics
    (:mod:`fl_split.tasks`; ``report_metrics="epoch"``) or nothing
    (``"none"``); either way the host appends them to its own ``metrics_file`` if it has one.
    """

    role = "host"

    def __init__(self, data: PartyData, schedule: BatchSchedule, *, update: LocalUpdate, has_bottom: bool,
                 merge: Merge, guest_shapes: dict[str, tuple[int, ...]],
                 backward_mechanisms: dict[str, MechanismSchedule], secret: PartySecret,
                 ledger: "Ledger | None" = None, sample_rate: float = 1.0,
                 act_postprocess: PostProcess | None = None, one_shot: bool = False,
                 importance: Importance | None = None, importance_parts: dict[str, Callable] | None = None,
                 report_metrics: str = "epoch", metrics_file: str = "",
                 device: torch.device | str = "cpu",
                 guest_mechanisms: dict[str, MechanismSchedule] | None = None,
                 objective: "Objective | None" = None) -> None:
        super().__init__("host", data, schedule, secret, ledger, sample_rate, device)
        from fl_split.tasks import Objective, kind_of

        #: the task's loss (fl_split/tasks.py): cross-entropy (optionally class-weighted) or MSE
        self.task = kind_of(data.task, data.num_classes)
        self.objective = objective or Objective(self.task)
        #: what the host checks of each guest's releases: the public range of the guest's forward
        #: mechanism (``guest_mechanisms``, from the public configuration), else its running scale
        self.trust = PeerTrust("host", "activations", dict(guest_mechanisms or {}), frozen=True)
        #: per-guest training vs test release statistics (issue 25: a guest poisoning its training releases)
        self.guard = TrainTestGuard("host")
        self._train_round_batches = 0  # batches in the last training round decoded (the guard's ``defer``)
        if data.y_train is None:
            raise ValueError("the host must hold the labels")
        if report_metrics not in ("epoch", "none"):
            raise ValueError(f"report_metrics must be 'epoch' or 'none', got {report_metrics!r}")
        self.update = update
        self.bottom = update.modules[0] if has_bottom else None
        self.top = update.modules[-1]
        self.merge = merge
        self.guest_shapes = {g: tuple(s) for g, s in guest_shapes.items()}
        self.guests = list(guest_shapes)
        self.backward_mechanisms = dict(backward_mechanisms)
        #: receiver-side post-processing of received activations (denoising), identity by default
        self.act_postprocess = act_postprocess or PostProcess()
        self.one_shot = one_shot
        self.importance = importance
        self.importance_parts = importance_parts or {}
        self.report_metrics = report_metrics
        self.metrics_file = metrics_file
        width = int(np.prod(next(iter(self.guest_shapes.values())))) if self.guest_shapes else 0
        self.diagnostics = LocalDiagnostics("host", width)
        self.history: list[dict[str, Any]] = []
        #: guests that failed, with the round from which their embedding is zero-filled (--on-guest-failure pad)
        self.absent: dict[str, int] = {}
        self._train_loss = [0.0, 0]
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self._cached: dict[str, np.ndarray] = {}
        self.metric = data.metric

    @property
    def active_guests(self) -> list[str]:
        """The guests whose releases the host expects (all but those that failed)."""
        return [g for g in self.guests if g not in self.absent] if self.absent else self.guests

    def drop_guest(self, guest: str, round_: int) -> None:
        """``guest`` failed (``--on-guest-failure pad``): from ``round_`` on its embedding is
        zero-filled (001's padding) and nothing is released to it."""
        if guest not in self.guests:
            raise ProtocolError(f"host: cannot drop {guest!r}; the guests are {self.guests}")
        self.absent.setdefault(guest, int(round_))

    # -- receiving ---------------------------------------------------------------------------
    def _received(self, keys, blobs_by_guest: dict[str, list[bytes]],
                  round_: int | None = None) -> dict[str, list[torch.Tensor]]:
        """Decode and check every guest's messages for ``keys`` (before touching any state).

        In one-shot mode empty lists mean "use what you cached when these records were released".
        Absent guests (:meth:`drop_guest`) send nothing.
        """
        active = self.active_guests
        if not isinstance(blobs_by_guest, dict) or sorted(g for g in blobs_by_guest
                                                          if g in active or blobs_by_guest[g]) != sorted(active):
            got = sorted(blobs_by_guest) if isinstance(blobs_by_guest, dict) else type(blobs_by_guest).__name__
            raise ProtocolError(f"host: activations from {got}, expected {sorted(active)}")
        out: dict[str, list[torch.Tensor]] = {}
        for g in active:
            blobs = blobs_by_guest[g]
            if not isinstance(blobs, (list, tuple)):
                raise ProtocolError(f"host: activations from {g}: expected a list of messages, got "
                                    f"{type(blobs).__name__}")
            if self.one_shot and not blobs and keys:
                out[g] = [self._from_cache(g, k) for k in keys]
                continue
            if len(blobs) != len(keys):
                raise ProtocolError(f"host: {len(blobs)} activation messages from {g}, expected {len(keys)}")
            out[g] = [self._check(b, "activations", g, k, self.guest_shapes[g], round_).tensor
                      for b, k in zip(blobs, keys)]
        fresh = [g for g in active if blobs_by_guest[g]]
        for g in fresh:  # bounded trust: within the guest's public mechanism (before anything changes)
            for k, t in zip(keys, out[g]):
                self.trust.check(g, k, t, round_)
        if keys and keys[0].phase == "test":  # the epoch's honest-looking test releases vs the training ones
            # after a long relay round the recent training releases come from an older model: compare
            # these test releases with the next round instead (fl_split/privacy/guard.py, "Like with like")
            defer = self._train_round_batches > RECENT
            for g in fresh:
                self.guard.check_test(g, out[g], f"{keys[0].phase}[epoch {keys[0].epoch}]", round_,
                                      noisy=self.trust.public_range(g, keys[0]) is not None, defer=defer)
        elif keys and keys[0].phase == "train":
            for g in fresh:
                self.guard.check_deferred(g, out[g], f"{keys[0].phase}[epoch {keys[0].epoch}]", round_)
            self._train_round_batches = len(keys)
        for g in fresh:
            for k, t in zip(keys, out[g]):
                self.trust.record(g, k, t)
                if k.phase == "train":
                    self.guard.record_train(g, t)
        if self.one_shot:
            for g in active:
                if blobs_by_guest[g]:
                    for k, t in zip(keys, out[g]):
                        self._to_cache(g, k, t)
        return out

    def _to_cache(self, g: str, key: BatchKey, t: torch.Tensor) -> None:
        n = self.schedule.n_train if key.phase == "train" else self.schedule.n_test
        name = f"{g}/{key.phase}"
        if name not in self._cache:
            self._cache[name] = {"x": torch.zeros((n, *self.guest_shapes[g]))}
            self._cached[name] = np.zeros(n, dtype=bool)
        pos = self.schedule.positions(key)
        self._cache[name]["x"][torch.from_numpy(pos)] = t.cpu()
        self._cached[name][pos] = True

    def _from_cache(self, g: str, key: BatchKey) -> torch.Tensor:
        name = f"{g}/{key.phase}"
        pos = self.schedule.positions(key)
        if name not in self._cached or not self._cached[name][pos].all():
            raise ProtocolError(f"host: no cached release from {g} for {key} (one-shot mode caches the "
                                f"first release of every record)")
        return self._cache[name]["x"][torch.from_numpy(pos)]

    def _forward(self, key: BatchKey, acts: dict[str, torch.Tensor], train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts: list[torch.Tensor] = []
        if self.bottom is not None:
            parts.append(self.bottom(self.rows(key)))
        leaves: dict[str, torch.Tensor] = {}
        for g in self.guests:
            if g in self.absent:  # a failed guest's embedding is zero-filled (001's padding)
                parts.append(torch.zeros((len(self.schedule.positions(key)), *self.guest_shapes[g]),
                                         device=self.device))
                continue
            a = acts[g].to(self.device)
            if train and not self.one_shot:
                a.requires_grad_(True)
            leaves[g] = a
            gen = self._gen("denoise") if self.act_postprocess.random else None
            parts.append(self.act_postprocess(a, gen))
        return self.top(self.merge(parts)), leaves

    # -- training ----------------------------------------------------------------------------
    def _entries(self, keys, round_: int, alloc: set[BatchKey] = frozenset()) -> list["LedgerEntry"]:
        entries = []
        update_cost = self.update.cost()
        for key in keys:
            if key in alloc:  # the importance allocation released before this batch's backward
                entries.append(self.importance.entry(round_, key, self.data.train_ids))
            if not self.one_shot:
                for g in self.active_guests:
                    cost = self.backward_mechanisms[g](key).cost()
                    if cost is not None:
                        entries.append(self._entry(round_, key, "backward", cost))
            if update_cost is not None:
                entries.append(self._entry(round_, key, "update", update_cost))
        return entries

    def train(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int,
              in_process: bool = False) -> dict[str, list[bytes]]:
        """Train on every batch in ``keys``; returns the released gradients per guest (nothing
        else leaves: the training loss stays here until the epoch's aggregate). ``in_process``:
        the guests are in this process; release :class:`~fl_split.protocol.Handoff` messages
        instead of frames (``blobs_by_guest`` may hold either)."""
        keys = self._request(keys, round_, phase="train")
        msgs = self._received(keys, blobs_by_guest, round_)
        active = self.active_guests
        alloc = (self.importance.plan(keys, updates_per_key=1)
                 if self.importance is not None and not self.one_shot else set())
        # BudgetExceeded here: nothing trained, nothing released
        charge = self._charge(self._entries(keys, round_, alloc))
        digests: list[str] | None = [] if charge is not None else None
        draws: list[int | None] = []
        grads: dict[str, list[bytes]] = {g: [] for g in active}
        out = _outgoing(in_process)
        dpsgd = self.update.cost() is not None
        if self.bottom is not None:
            set_mode(self.bottom, True)
        set_mode(self.top, True)
        for i, key in enumerate(keys):
            y = self.labels(key)
            mechs = {g: self.backward_mechanisms[g](key) for g in active}
            if self.importance is not None and not self.one_shot:  # before this batch's backward (see Importance)
                u, shares, drawn = self.importance.take(key, self._release_allocation, release=key in alloc)
                if shares is not None and digests is not None:
                    digests.append(value_digest(shares))
                    draws.append(drawn)
                for g, mech in mechs.items():
                    self.importance.give(mech, u, self.importance_parts.get(g))
            logits, leaves = self._forward(key, {g: msgs[g][i] for g in active}, train=True)
            loss = self.objective(logits, y)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise ProtocolError(f"host: the loss of {key} is not finite with the activations from {active} "
                                    f"(round {round_}); refused: no update and no release from this batch")
            self.update.zero_grad()
            self.update.backward(loss)
            if self.importance is not None:
                self.importance.update()
            if not self.one_shot:
                digest = self.digest(key)
                self._count_release(key)
                for g in active:
                    mech = mechs[g]
                    rel, blob, c = self._release(mech, leaves[g].grad, lambda r, g=g: out(Message(
                        "gradients", "host", g, round_, key, digest, r.value, r.encoding)))
                    self.diagnostics.add(key.epoch, rel.stats)
                    grads[g].append(blob)
                    if digests is not None and mech.cost() is not None:
                        digests.append(value_digest(wire_bytes(blob)))
                        draws.append(c)
                    self.released["batches"] += 1
                    self.released["records"] += len(y)
            d, c = self._step(dpsgd, digests is not None)
            self.steps += 1
            if digests is not None and dpsgd:
                digests.append(d)
                draws.append(c)
            self._train_loss[0] += loss_value * len(y)
            self._train_loss[1] += len(y)
        self._settle(charge, digests, draws)
        self._done(round_)
        return grads

    @torch.no_grad()
    def evaluate(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int | None = None) -> dict[str, Any]:
        """Evaluate the test split (``keys``: all test batches of one epoch) and close the epoch.

        Returns the epoch's aggregates — ``{"epoch", "train_loss", "test_metric", "test_loss"}``
        with ``report_metrics="epoch"``, only ``{"epoch"}`` with ``"none"`` — and writes them to
        the host's own metrics file when it has one."""
        keys = self._request(keys, round_, phase="test")
        msgs = self._received(keys, blobs_by_guest, round_)
        active = self.active_guests
        if self.bottom is not None:
            set_mode(self.bottom, False)
        set_mode(self.top, False)
        from fl_split.tasks import Scorer, epoch_metrics

        scorer = Scorer(self.task, self.data.target_scale)
        n, loss_sum = 0, 0.0
        for i, key in enumerate(keys):
            y = self.labels(key)
            logits, _ = self._forward(key, {g: msgs[g][i] for g in active}, train=False)
            scorer.add(logits, y)
            loss_sum += float(self.objective(logits, y, reduction="sum"))
            n += len(y)
        epoch = keys[0].epoch if keys else len(self.history) + 1
        self.diagnostics.check(epoch, next(iter(self.backward_mechanisms.values()))().name
                               if self.backward_mechanisms else "none")
        tl, tn = self._train_loss
        metrics = {"epoch": int(epoch), "train_loss": tl / tn if tn else math.nan,
                   **epoch_metrics(self.task, scorer.metrics()), "test_loss": loss_sum / n if n else math.nan}
        self._train_loss = [0.0, 0]
        self.history.append(metrics)
        if self.metrics_file:
            write_json_atomic(self.metrics_file, {"party": "host", "metric": self.metric, "history": self.history})
        self._done(round_)
        return dict(metrics) if self.report_metrics == "epoch" else {"epoch": int(epoch)}

    def report(self) -> dict[str, Any]:
        """End-of-run facts this party is willing to disclose (no data, no weights, no secret)."""
        first = {g: m() for g, m in self.backward_mechanisms.items()}
        mech = next(iter(first.values())) if first else NoDefense()
        width = int(np.prod(next(iter(self.guest_shapes.values())))) if self.guest_shapes else 0
        dp = self.update.describe() if self.update.cost() is not None else None
        return {"role": "host", "optimizer_steps": self.steps,
                "mechanisms": {g: m.describe() for g, m in first.items()},
                **self._allocation_report({g: (m, self.importance_parts.get(g)) for g, m in first.items()}),
                "postprocess": self.act_postprocess.describe(), "released": dict(self.released),
                "privacy": party_privacy_report(role="host", ledger=self.ledger, mechanism=mech, update=dp,
                                                released=self.released, cut_width=width,
                                                randomness=self.secret.source,
                                                aggregates=self.report_metrics == "epoch",
                                                per_epoch=self.epsilons_per_epoch())}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            **self._common_state(),
            "bottom": self.bottom.state_dict() if self.bottom is not None else None,
            "top": self.top.state_dict(),
            "optimizer": self.update.state_dict(),
            "importance": self.importance.state_dict() if self.importance is not None else None,
            "diagnostics": self.diagnostics.state_dict(),
            "history": json.dumps(self.history),
            "train_loss": [float(self._train_loss[0]), int(self._train_loss[1])],
            "cache": {name: {"x": c["x"], "filled": torch.from_numpy(self._cached[name])}
                      for name, c in self._cache.items()},
            "absent": json.dumps(self.absent),
        }

    def import_state(self, state: dict[str, Any]) -> None:
        self._load_common(state)
        if self.bottom is not None:
            self.bottom.load_state_dict(state["bottom"])
        self.top.load_state_dict(state["top"])
        self.update.load_state_dict(state["optimizer"])
        if self.importance is not None:
            self.importance.load_state_dict(state["importance"])
        self.diagnostics.load_state_dict(state["diagnostics"])
        self.history = json.loads(state["history"])
        self._train_loss = [float(state["train_loss"][0]), int(state["train_loss"][1])]
        self._cache = {name: {"x": torch.as_tensor(c["x"])} for name, c in state["cache"].items()}
        self._cached = {name: np.asarray(torch.as_tensor(c["filled"]).numpy(), dtype=bool)
                        for name, c in state["cache"].items()}
        self.absent = {str(g): int(r) for g, r in json.loads(state.get("absent", "{}")).items()}


def export_flat(party: GuestParty | HostParty) -> tuple[dict[str, np.ndarray], Any]:
    """A party's state as ``(arrays, json-able skeleton)`` (see :mod:`fl_split.state`)."""
    return flatten(party.export_state())


def import_flat(party: GuestParty | HostParty, arrays: dict[str, np.ndarray], skeleton: Any) -> None:
    party.import_state(unflatten(arrays, skeleton))
