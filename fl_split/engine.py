"""Engines: who carries the messages. The round logic itself is shared.

:func:`coordinate` is the coordinator's loop (the same one the Flower strategy runs): for each
round of :func:`~fl_split.schedule.plan_rounds` it asks every guest to apply the gradients it
is owed and release the round's batches, hands the releases to the host, and keeps the
host's released gradients for the next round. After each epoch it evaluates the test split.
A :class:`Transport` says how a request reaches a party: :class:`LocalTransport` calls the
party objects in this process (exact, fastest); ``fl_split.flower`` sends Flower messages.

:class:`MonolithicEngine` trains the same modules as one model with one optimizer, in the same
batch order: the "no split" baseline of 001 Table 1, and the reference of the equivalence test.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fl_split.builder import make_monolithic, make_parties, optimizer_settings
from fl_split.config import RunConfig
from fl_split.errors import BudgetExceeded, ProtocolError
from fl_split.parties import GuestParty, HostParty, batch_metric, resolve_device
from fl_split.schedule import BatchKey, EvalRound, TrainRound, plan_rounds


class Transport(Protocol):
    """How the coordinator reaches the parties."""

    guests: list[str]

    def guest_step(self, owed: dict[str, list[bytes]], keys: tuple[BatchKey, ...], round_: int) -> dict[str, list[bytes]]:
        """Every guest applies ``owed[g]`` then releases ``keys``; returns their blobs."""

    def host_train(self, keys: tuple[BatchKey, ...], acts: dict[str, list[bytes]], round_: int) -> dict[str, list[bytes]]:
        """The host trains on ``acts``; returns the gradient blobs per guest (nothing else)."""

    def host_evaluate(self, keys: tuple[BatchKey, ...], acts: dict[str, list[bytes]], round_: int) -> dict:
        """The host evaluates the test split and closes the epoch; returns the epoch's aggregates
        (``{"epoch", "train_loss", "test_metric", "test_loss"}``, or only ``{"epoch"}`` when the host
        keeps its metrics: ``--report-metrics none``)."""

    def reports(self) -> dict[str, dict]:
        """Each party's end-of-run report (``party.report()``), keyed by party name."""


def coordinate(cfg: RunConfig, plan, transport: Transport, engine: str) -> dict[str, Any]:
    """Run every round of the plan through ``transport``; returns the results dictionary."""
    schedule = plan.schedule
    owed: dict[str, list[bytes]] = {g: [] for g in transport.guests}
    wire = {"bytes_to_host": 0, "bytes_to_guests": 0, "messages_to_host": 0, "messages_to_guests": 0,
            "rounds": 0}
    history: list[dict[str, Any]] = []
    total = cfg.epochs * schedule.num_train_batches()
    bar = tqdm(total=total, desc=f"{engine} split training", unit="batch", disable=not cfg.progress,
               leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    t_epoch = t0
    stopped = {"stopped_reason": "completed"}
    try:
        for rnd in plan_rounds(schedule, cfg.epochs, cfg.batches_per_round):
            wire["rounds"] += 1
            wire["bytes_to_guests"] += sum(len(b) for bl in owed.values() for b in bl)
            wire["messages_to_guests"] += sum(len(bl) for bl in owed.values())
            if cfg.one_shot and rnd.epoch > 1:
                # 002 one-shot: every record was released once in epoch 1; the host trains
                # and evaluates on its cache and nothing is sent to or from the guests
                acts = {g: [] for g in transport.guests}
            else:
                acts = transport.guest_step(owed, rnd.keys, rnd.round)
            wire["bytes_to_host"] += sum(len(b) for bl in acts.values() for b in bl)
            wire["messages_to_host"] += sum(len(bl) for bl in acts.values())
            if isinstance(rnd, TrainRound):
                owed = transport.host_train(rnd.keys, acts, rnd.round)
                bar.update(len(rnd.keys))
                bar.set_postfix(epoch=rnd.epoch, refresh=False)
            elif isinstance(rnd, EvalRound):
                owed = {g: [] for g in transport.guests}
                metrics = transport.host_evaluate(rnd.keys, acts, rnd.round)
                now = time.perf_counter()
                history.append(_epoch_record(rnd.epoch, metrics, now - t_epoch))
                t_epoch = now
                if history[-1].get("test_metric") is not None:
                    bar.set_postfix(epoch=rnd.epoch, test=f"{history[-1]['test_metric']:.4f}", refresh=False)
    except BudgetExceeded as exc:
        # a party refused a release: stop cleanly; nothing over budget has left any party
        stopped = {"stopped_reason": "budget", "stopped_detail": str(exc), "stopped_round": rnd.round}
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    reports = transport.reports()
    results = make_results(cfg, plan, history, wire, elapsed, engine, parties=reports)
    results["privacy"] = {name: rep["privacy"] for name, rep in reports.items() if "privacy" in rep}
    results.update(stopped)
    return results


#: what the host may tell the coordinator about an epoch (its declared aggregates)
AGGREGATES = ("train_loss", "test_metric", "test_loss")


def _epoch_record(epoch: int, metrics: dict, seconds: float) -> dict[str, Any]:
    """One ``history`` row: the host's aggregates for ``epoch`` (``None`` where the host keeps
    them: ``--report-metrics none``) and the coordinator's own epoch time."""
    if int(metrics.get("epoch", epoch)) != int(epoch):
        raise ProtocolError(f"host reported metrics for epoch {metrics.get('epoch')}, expected epoch {epoch}")
    row: dict[str, Any] = {"epoch": epoch}
    for k in AGGREGATES:
        v = metrics.get(k)
        row[k] = None if v is None else float(v)
    row["epoch_time_s"] = seconds
    return row


def make_results(cfg: RunConfig, plan, history: list[dict], wire: dict, elapsed: float, engine: str,
                 **extra: Any) -> dict[str, Any]:
    """The results dictionary shared by every engine (see README, "Results JSON")."""
    config = cfg.to_dict()
    config.update(model=plan.arch, cut_layer=plan.cut)
    last = history[-1] if history else {}
    kept = cfg.report_metrics == "none" and engine != "monolithic"
    final = {"metric": plan.metric, "value": last.get("test_metric", float("nan")),
             "train_loss": last.get("train_loss", float("nan"))}
    if kept:
        final.update(value=None, train_loss=None, kept_by_host=cfg.host_metrics)
    return {
        "config": config,
        "plan": {
            "engine": engine,
            "n_train": plan.schedule.n_train,
            "n_test": plan.schedule.n_test,
            "batches_per_epoch": plan.schedule.num_train_batches(),
            "input_shapes": {p: list(s) for p, s in plan.input_shapes.items()},
            "cut_shapes": {p: list(s) for p, s in plan.cut_shapes.items()},
            "merged_shape": list(plan.merged_shape),
        },
        "history": history,
        "final": final,
        "wire": wire,
        "time_s": elapsed,
        "stopped_reason": "completed",
        **extra,
    }


class LocalTransport:
    """Parties in this process; blobs are handed over as they are."""

    def __init__(self, host: HostParty, guests: dict[str, GuestParty]) -> None:
        self.host = host
        self.parties = guests
        self.guests = list(guests)

    def guest_step(self, owed, keys, round_):
        return {g: self.parties[g].step(owed[g], keys, round_) for g in self.guests}

    def host_train(self, keys, acts, round_):
        return self.host.train(keys, acts, round_)

    def host_evaluate(self, keys, acts, round_):
        return self.host.evaluate(keys, acts)

    def reports(self):
        return {"host": self.host.report(), **{g: p.report() for g, p in self.parties.items()}}


class LocalEngine:
    """All parties in one process, talking through the codec (exact per-batch semantics when
    ``batches_per_round = 1``). Each party has its own secret: fresh entropy, or derived from
    ``private_seed`` inside :func:`~fl_split.builder.make_parties`."""

    name = "local"

    def __init__(self, cfg: RunConfig, private_seed: int | None = None) -> None:
        self.cfg = cfg
        self.host, self.guests, self.plan = make_parties(cfg, private_seed)

    def run(self) -> dict[str, Any]:
        return coordinate(self.cfg, self.plan, LocalTransport(self.host, self.guests), self.name)


class MonolithicEngine:
    """One model, one optimizer, same modules / weights / batch order as the split run."""

    name = "monolithic"

    def __init__(self, cfg: RunConfig, public: bool = False, private_seed: int | None = None,
                 secret=None) -> None:
        self.cfg = cfg
        self.model, self.data, self.plan = make_monolithic(cfg, public=public, private_seed=private_seed,
                                                           secret=secret)
        self.device = resolve_device(cfg.device)
        self.model.to(self.device)
        self.optimizer = optimizer_settings(cfg).make(self.model.parameters())
        self.holders = list(self.plan.input_shapes)

    def _batch(self, key: BatchKey):
        pos = torch.from_numpy(self.plan.schedule.positions(key))
        split = "train" if key.phase == "train" else "test"
        xs = {p: getattr(self.data.parties[p], f"x_{split}").index_select(0, pos).to(self.device) for p in self.holders}
        y = getattr(self.data.parties["host"], f"y_{split}").index_select(0, pos).to(self.device)
        return xs, y

    def run(self) -> dict[str, Any]:
        cfg, schedule = self.cfg, self.plan.schedule
        history = []
        bar = tqdm(total=cfg.epochs * schedule.num_train_batches(), desc="monolithic training", unit="batch",
                   disable=not cfg.progress, leave=False, dynamic_ncols=True)
        t0 = time.perf_counter()
        t_epoch = t0
        try:
            for epoch in range(1, cfg.epochs + 1):
                self.model.train()
                loss_sum, n = 0.0, 0
                for key in schedule.train_keys(epoch):
                    xs, y = self._batch(key)
                    loss = F.cross_entropy(self.model(xs), y)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.optimizer.step()
                    loss_sum += loss.item() * len(y)
                    n += len(y)
                    bar.update(1)
                stats = self.evaluate(epoch)
                now = time.perf_counter()
                metrics = {"epoch": epoch, "train_loss": loss_sum / n if n else float("nan"),
                           "test_metric": stats["hits"] / stats["n"] if stats["n"] else float("nan"),
                           "test_loss": stats["loss_sum"] / stats["n"] if stats["n"] else float("nan")}
                history.append(_epoch_record(epoch, metrics, now - t_epoch))
                t_epoch = now
        finally:
            bar.close()
        elapsed = time.perf_counter() - t0
        wire = {"bytes_to_host": 0, "bytes_to_guests": 0, "messages_to_host": 0, "messages_to_guests": 0, "rounds": 0}
        return make_results(cfg, self.plan, history, wire, elapsed, self.name)

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict:
        self.model.eval()
        hits, n, loss_sum = 0, 0, 0.0
        for key in self.plan.schedule.test_keys(epoch):
            xs, y = self._batch(key)
            logits = self.model(xs)
            hits += batch_metric(logits, y, self.plan.metric)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            n += len(y)
        return {"hits": hits, "n": n, "loss_sum": loss_sum}


def run_experiment(cfg: RunConfig, private_seed: int | None = None) -> dict[str, Any]:
    """Build and run the configured experiment on the configured engine.

    ``private_seed`` (``--private-seed``) makes every party's private randomness reproducible; it
    is not part of the (public) configuration and never appears in the results."""
    if cfg.monolithic:
        return MonolithicEngine(cfg, private_seed=private_seed).run()
    if cfg.engine == "flower":
        from fl_split.flower import FlowerEngine

        return FlowerEngine(cfg, private_seed=private_seed).run()
    return LocalEngine(cfg, private_seed).run()
