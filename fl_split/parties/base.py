"""What guests and hosts share (:class:`_Party`): data by batch key, secret and draw counters, ledger
and write-ahead settlement, the repeated-request rule, state export; and small helpers."""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fl_split.checkpoint import value_digest
from fl_split.data.base import PartyData
from fl_split.errors import ProtocolError
from fl_split.privacy.base import Mechanism
from fl_split.protocol import (Message, batch_digest, encode, frame_limit, handoff, open_message, receive_expected,
                               wire_bytes)
from fl_split.schedule import BatchKey, BatchSchedule
from fl_split.seeding import PartySecret
from fl_split.state import flatten, unflatten

if TYPE_CHECKING:
    from fl_split.parties.guest import GuestParty
    from fl_split.parties.host import HostParty
    from fl_split.privacy.ledger import Charge, Ledger, LedgerEntry


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

    def _epoch_entries(self, epoch: int) -> list["LedgerEntry"]:
        """The ledger entries this party's releases of ``epoch`` will charge (each role says which)."""
        return []

    def check_budget_covers_an_epoch(self) -> None:
        """Refuse a ``--budget`` that this party's first epoch alone would exceed, before anything is
        released or written (docs/accounting.md, "Budget").

        Called at set-up, while the ledger is still empty: the ε it would reach after the epoch's
        entries (every forward/backward/update release of epoch 1; costs do not depend on the data;
        :meth:`~fl_split.privacy.ledger.Ledger.would_be`, nothing recorded). An importance allocation
        is not included, so the figure is a lower bound and a run it lets through may still stop at
        the budget later (then it stops cleanly, as before)."""
        led = self.ledger
        if led is None or led.budget is None:
            return
        entries = self._epoch_entries(1)
        if not entries:
            return
        from fl_split.errors import ConfigError

        eps = led.would_be(entries)
        if eps is not None and eps > led.budget:
            raise ConfigError("budget", led.budget, f"at least {eps:.4g} (one epoch), or less privacy loss per "
                              "release (a smaller --epsilon, a larger --sigma)",
                              reason=f"one epoch costs {self.name} ε {eps:.4g} ({led.accountant}, δ {led.delta:g}); "
                              f"nothing was trained, released or written")

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




def export_flat(party: GuestParty | HostParty) -> tuple[dict[str, np.ndarray], Any]:
    """A party's state as ``(arrays, json-able skeleton)`` (see :mod:`fl_split.state`)."""
    return flatten(party.export_state())


def import_flat(party: GuestParty | HostParty, arrays: dict[str, np.ndarray], skeleton: Any) -> None:
    party.import_state(unflatten(arrays, skeleton))
