"""Batch order and round plan shared by every party and both engines.

All parties know the shared train/test ID lists, the batch size and the run seed, so each can
compute which IDs form batch ``(epoch, index)`` on its own; messages carry the IDs anyway so a
receiver can check them (:mod:`fl_split.protocol`). The training order of epoch ``e`` is a
permutation drawn from ``(seed, "order", e)``; the last batch may be smaller (no drop).

A *round* is what one coordinator exchange covers (docs/flower.md: a Flower message costs ~0.1 s, so a
round carries ``batches_per_round`` batches). Rounds never cross an epoch boundary: the test
split is evaluated after each epoch's last round.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fl_split.seeding import numpy_rng

#: test batches are larger: no gradient is kept, and fewer messages is cheaper
EVAL_BATCH = 1024


@dataclass(frozen=True, order=True)
class BatchKey:
    """Names one mini-batch: phase ``train``/``test``, epoch, index within the epoch."""

    phase: str
    epoch: int
    index: int

    def as_tuple(self) -> tuple[str, int, int]:
        return (self.phase, self.epoch, self.index)

    def __str__(self) -> str:
        return f"{self.phase}[epoch {self.epoch}, batch {self.index}]"


class BatchSchedule:
    """Which rows form each batch, as positions into the shared train / test ID lists."""

    def __init__(self, n_train: int, n_test: int, batch_size: int, seed: int) -> None:
        self.n_train = int(n_train)
        self.n_test = int(n_test)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self._order: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._order:
            if len(self._order) > 4:
                self._order.clear()
            self._order[epoch] = numpy_rng(self.seed, "order", epoch).permutation(self.n_train)
        return self._order[epoch]

    def num_train_batches(self) -> int:
        return -(-self.n_train // self.batch_size)

    def train_keys(self, epoch: int) -> list[BatchKey]:
        return [BatchKey("train", epoch, i) for i in range(self.num_train_batches())]

    def test_keys(self, epoch: int) -> list[BatchKey]:
        eb = max(self.batch_size, EVAL_BATCH)
        return [BatchKey("test", epoch, i) for i in range(-(-self.n_test // eb))]

    def positions(self, key: BatchKey) -> np.ndarray:
        if key.phase == "train":
            b = self.batch_size
            if not 0 <= key.index < self.num_train_batches():
                raise IndexError(f"{key}: no such training batch")
            return self.order(key.epoch)[key.index * b: (key.index + 1) * b]
        if key.phase == "test":
            eb = max(self.batch_size, EVAL_BATCH)
            if not 0 <= key.index * eb < max(self.n_test, 1):
                raise IndexError(f"{key}: no such test batch")
            return np.arange(key.index * eb, min((key.index + 1) * eb, self.n_test))
        raise ValueError(f"unknown phase {key.phase!r}")


@dataclass(frozen=True)
class TrainRound:
    """Guests apply the gradients they are owed, release ``keys``; the host trains on them."""

    round: int
    epoch: int
    keys: tuple[BatchKey, ...]
    last_of_epoch: bool


@dataclass(frozen=True)
class EvalRound:
    """Guests apply owed gradients and release the test split; the host evaluates epoch ``epoch``."""

    round: int
    epoch: int
    keys: tuple[BatchKey, ...]


def plan_rounds(schedule: BatchSchedule, epochs: int, batches_per_round: int | str) -> Iterator[TrainRound | EvalRound]:
    """The sequence of rounds for ``epochs`` epochs, numbered from 1."""
    r = 0
    for epoch in range(1, epochs + 1):
        keys = schedule.train_keys(epoch)
        k = len(keys) if batches_per_round == "epoch" else max(1, int(batches_per_round))
        chunks = [tuple(keys[i: i + k]) for i in range(0, len(keys), k)]
        for j, chunk in enumerate(chunks):
            r += 1
            yield TrainRound(r, epoch, chunk, last_of_epoch=j == len(chunks) - 1)
        r += 1
        yield EvalRound(r, epoch, tuple(schedule.test_keys(epoch)))
