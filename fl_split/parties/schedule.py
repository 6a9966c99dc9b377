"""Which mechanism a party applies to each batch (001 §3.4's schedules), and the neuron importances
of R3eLU's allocation (001 Eq. 8–10) with their release."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from fl_split.privacy.base import Mechanism, NoDefense
from fl_split.schedule import BatchKey

if TYPE_CHECKING:
    from fl_split.privacy.ledger import LedgerEntry
    from fl_split.privacy.r3elu import AllocationRelease, ImportanceTracker


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
