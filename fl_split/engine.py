"""Engines: who carries the messages. The round logic itself is shared.

:func:`coordinate` is the coordinator's loop (the same one the Flower strategy runs): for each
round of :func:`~fl_split.schedule.plan_rounds` it asks every guest to apply the gradients it
is owed and release the round's batches, hands the releases to the host, and keeps the
host's released gradients for the next round. After each epoch it evaluates the test split.
A :class:`Transport` says how a request reaches a party: :class:`LocalTransport` calls the
party objects in this process (exact, fastest); ``fl_split.flower`` sends Flower messages.

**In one process no bytes** (issue 18, ``docs/design.md``, "The in-process hot path"): the
:class:`LocalTransport` asks the parties for :class:`~fl_split.protocol.Handoff` messages — the
released tensor, copied and detached, on the sender's device — instead of frames. Each is charged,
logged and checked exactly as its frame would be, and counted on the wire at its frame's size;
``LocalEngine(codec=True)`` forces the frames (the tests compare the two bit for bit). Everything
that crosses a process boundary stays bytes.

**Checkpoints** (``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``; :mod:`fl_split.checkpoint`):
after the rounds :meth:`Checkpointer.due <fl_split.checkpoint.Checkpointer.due>` names, every
active party saves its state (``transport.checkpoint``), then the coordinator commits its own. A
resumed run restores every party to the committed round (``transport.restore``, which replays each
party's write-ahead log) and goes on from the next round.

**A guest that fails** (it raises, returns an error, never answers): the transport raises
:class:`GuestFailure`. With ``--on-guest-failure stop`` the coordinator records it in its
checkpoint (the last committed round is where a resume starts) and stops with an error naming the
guest; with ``pad`` the host zero-fills that guest's embedding from that round on
(``transport.drop_guest``), nothing more is sent to or released for it, and
``results["guest_failures"]`` says who failed in which round.

**A guest whose release is out of its public range** (issue 16, :mod:`fl_split.privacy.bounds`):
the host refuses the round before anything changes (:class:`~fl_split.errors.ReleaseOutOfRange`);
the coordinator treats that guest as a failed guest — ``stop`` names it, the statistic and the
public bound and stops; ``pad`` drops it and the host plays the same round again with the other
guests' releases. A guest that refuses the *host's* gradients stops the run (never padded: the
guest is not the one at fault).

:class:`MonolithicEngine` trains the same modules as one model with one optimizer, in the same
batch order: the "no split" baseline of 001 Table 1, and the reference of the equivalence test.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from fl_split.builder import (make_monolithic, make_parties, monolithic_batch, objective, optimizer_settings,
                              train_monolithic_epoch)
from fl_split.config import RunConfig, guest_names
from fl_split.errors import BudgetExceeded, ConfigError, PartyError, ProtocolError, ReleaseOutOfRange
from fl_split.parties import GuestParty, HostParty, resolve_device
from fl_split.parties.baseline import apply_quality
from fl_split.protocol import wire_bytes
from fl_split.schedule import BatchKey, EvalRound, TrainRound, plan_rounds
from fl_split.tasks import METRICS, Scorer, epoch_metrics


class Transport(Protocol):
    """How the coordinator reaches the parties. A message ("blob") is a frame (``bytes``) or, between
    parties of one process, a :class:`~fl_split.protocol.Handoff`; the coordinator only counts them
    (``len``: the frame's size) and passes them on, and checkpoints them as frames."""

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

    # Optional (checked with hasattr): checkpoint(round_), restore(round_) -> list of replay
    # summaries, drop_guest(guest, round_). guest_step steps the guests named in ``owed`` only.


class GuestFailure(PartyError):
    """One or more guests did not answer a round (raised, error reply, no reply).

    ``failed``: guest -> reason; ``partial``: the releases of the guests that did answer (``None``
    when the transport could not keep them: then the run cannot go on padded)."""

    def __init__(self, round_: int, failed: dict[str, str], partial: dict[str, list[bytes]] | None,
                 note: str = "") -> None:
        self.failed = dict(failed)
        self.partial = partial
        first = sorted(failed)[0]
        if len(failed) == 1:
            detail = failed[first]
        else:
            detail = "; ".join(f"{g}: {why}" for g, why in sorted(failed.items()))
            detail = f"guests {sorted(failed)} failed ({detail})"
        super().__init__(first, round_, detail + (f"; {note}" if note else ""))


def _guest_failure(exc: Exception, guests: list[str], round_: int) -> GuestFailure | None:
    """``exc`` from ``transport.guest_step`` as a :class:`GuestFailure` when it names a guest (a
    Flower error reply is a :class:`PartyError` of that guest; its other releases are lost)."""
    if isinstance(exc, GuestFailure):
        return exc
    if isinstance(exc, PartyError) and not isinstance(exc, BudgetExceeded) and exc.party in guests:
        return GuestFailure(round_, {exc.party: exc.detail}, None)
    return None


def coordinate(cfg: RunConfig, plan, transport: Transport, engine: str, checkpoints=None,
               epochs: tuple[int, int] | None = None, on_epoch=None) -> dict[str, Any]:
    """Run every round of the plan through ``transport``; returns the results dictionary.

    ``checkpoints``: a started :class:`fl_split.checkpoint.Checkpointer` (``--checkpoint-dir``); on a
    resume its state says where to go on from (the parties were restored by the engine).
    ``epochs = (first, last)``: play only the rounds of those epochs (the host of the direct data
    plane plays the epochs of one control message, :mod:`fl_split.flower.direct`); the results then
    cover only them. ``on_epoch(row, progress)`` is called with each epoch's ``history`` row as it
    is made (the Flower relay logs it then) and ``progress``: copies of the round and of the history,
    wire counts and guest failures so far (the direct plane's host checkpoints them with itself)."""
    schedule = plan.schedule
    owed: dict[str, list[bytes]] = {g: [] for g in transport.guests}
    wire = {"bytes_to_host": 0, "bytes_to_guests": 0, "messages_to_host": 0, "messages_to_guests": 0,
            "rounds": 0}
    history: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    done, before = 0, 0.0
    state = checkpoints.state if checkpoints is not None else None
    if state is not None and state.round > 0:
        owed = {g: list(state.owed.get(g, [])) for g in transport.guests}
        wire.update(state.wire)
        history = [dict(h) for h in state.history]
        failures = [dict(f) for f in state.guest_failures]
        done, before = state.round, float(state.elapsed)
    absent = {f["guest"] for f in failures if f.get("action") == "pad"}
    total = cfg.epochs * schedule.num_train_batches()
    bar = tqdm(total=total, desc=f"{engine} split training", unit="batch", disable=not cfg.progress,
               leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    t_epoch = t0
    stopped: dict[str, Any] = {"stopped_reason": "completed"}
    last = 0

    def commit(rnd_round: int, **extra: Any) -> None:
        # copies: the coordinator goes on changing its own (a later stop record must not see them)
        checkpoints.commit(round=rnd_round, history=[dict(h) for h in history], wire=dict(wire),
                           owed={g: [wire_bytes(b) for b in bl] for g, bl in owed.items()}, guest_failures=[dict(f) for f in failures],
                           elapsed=before + time.perf_counter() - t0, **extra)

    def host_call(method, rnd, acts):
        # the host refuses a release outside its sender's public range: that guest is stopped or
        # padded (_refused_release) and the round is played again without it
        while True:
            try:
                return method(rnd.keys, acts, rnd.round)
            except ReleaseOutOfRange as exc:
                acts = _refused_release(cfg, transport, exc, acts, rnd.round, failures, absent, checkpoints)
                acts = _secure_redo(cfg, transport, absent, rnd, acts)

    if cfg.secure_merge:  # a session per run (and per resume): masks are never reused
        transport.secure_rekey([g for g in transport.guests if g not in absent])

    try:
        for rnd in plan_rounds(schedule, cfg.epochs, cfg.batches_per_round):
            if epochs is not None and not epochs[0] <= rnd.epoch <= epochs[1]:
                continue
            last = rnd.round
            if rnd.round <= done:
                if isinstance(rnd, TrainRound):
                    bar.update(len(rnd.keys))
                continue
            active = [g for g in transport.guests if g not in absent]
            send = {g: owed.get(g, []) for g in active}
            wire["rounds"] += 1
            wire["bytes_to_guests"] += sum(len(b) for bl in send.values() for b in bl)
            wire["messages_to_guests"] += sum(len(bl) for bl in send.values())
            if cfg.one_shot and rnd.epoch > 1:
                # 002 one-shot: every record was released once in epoch 1; the host trains
                # and evaluates on its cache and nothing is sent to or from the guests
                acts = {g: [] for g in active}
            else:
                try:
                    acts = transport.guest_step(send, rnd.keys, rnd.round)
                except (GuestFailure, PartyError) as exc:
                    fail = _guest_failure(exc, active, rnd.round)
                    if fail is None:
                        raise
                    acts = _on_guest_failure(cfg, transport, fail, rnd.round, failures, absent, checkpoints, exc)
                    active = [g for g in active if g not in absent]
                    acts = _secure_redo(cfg, transport, absent, rnd, acts)
            wire["bytes_to_host"] += sum(len(b) for bl in acts.values() for b in bl)
            wire["messages_to_host"] += sum(len(bl) for bl in acts.values())
            if isinstance(rnd, TrainRound):
                owed = host_call(transport.host_train, rnd, acts)
                if cfg.progress:  # (a disabled bar still formats its postfix: ~20 µs a round)
                    bar.update(len(rnd.keys))
                    bar.set_postfix(epoch=rnd.epoch, refresh=False)
            elif isinstance(rnd, EvalRound):
                metrics = host_call(transport.host_evaluate, rnd, acts)
                owed = {g: [] for g in transport.guests if g not in absent}
                now = time.perf_counter()
                history.append(_epoch_record(rnd.epoch, metrics, now - t_epoch))
                t_epoch = now
                if on_epoch is not None:
                    on_epoch(dict(history[-1]), {"round": rnd.round, "history": [dict(h) for h in history],
                                                 "wire": dict(wire), "guest_failures": [dict(f) for f in failures]})
                if history[-1].get("test_metric") is not None:
                    bar.set_postfix(epoch=rnd.epoch, test=f"{history[-1]['test_metric']:.4f}", refresh=False)
            if checkpoints is not None and checkpoints.due(rnd):
                transport.checkpoint(rnd.round)
                commit(rnd.round, checkpoints=checkpoints.state.checkpoints + 1)
    except BudgetExceeded as exc:
        # a party refused a release: stop cleanly; nothing over budget has left any party
        stopped = {"stopped_reason": "budget", "stopped_detail": str(exc), "stopped_round": last}
    finally:
        bar.close()
    elapsed = before + time.perf_counter() - t0
    if checkpoints is not None:
        # the run is over: a resume would only repeat (or be refused at) its end
        checkpoints.commit(finished={"reason": stopped["stopped_reason"], "round": last}, history=history, wire=wire,
                           guest_failures=failures, elapsed=elapsed)
    reports = transport.reports()
    results = make_results(cfg, plan, history, wire, elapsed, engine, parties=reports)
    results["privacy"] = {name: rep["privacy"] for name, rep in reports.items() if "privacy" in rep}
    results["guest_failures"] = failures
    if checkpoints is not None:
        results["checkpoint"] = checkpoints.describe()
    results.update(stopped)
    apply_quality(results)  # "degraded": worse than the host's own baseline (fl_split/parties/baseline.py)
    if not history and stopped["stopped_reason"] != "completed":
        why = f"no epoch was evaluated: the run stopped ({stopped['stopped_reason']}) in round {last}: " \
              f"{stopped.get('stopped_detail', '')}"
        results["final"]["value_reason"] = results["final"]["train_loss_reason"] = why
    return results


def _on_guest_failure(cfg: RunConfig, transport, fail: GuestFailure, round_: int, failures: list, absent: set,
                      checkpoints, original: Exception) -> dict[str, list[bytes]]:
    """Record a guest failure; stop (raise) or go on padded. Returns the round's releases.

    Stopping without a checkpoint directory re-raises the transport's own error unchanged."""
    action = cfg.on_guest_failure
    for g, why in sorted(fail.failed.items()):
        failures.append({"guest": g, "round": round_, "reason": why, "action": action})
    left = [g for g in transport.guests if g not in absent and g not in fail.failed]
    why_stop = None
    if action == "stop":
        why_stop = "--on-guest-failure stop"
    elif fail.partial is None:
        why_stop = "the transport lost the other guests' releases of the round, so it cannot go on padded"
    elif not left and not cfg.host_features:
        why_stop = "no guest is left and the host holds no features"
    if why_stop is not None:
        for f in failures[-len(fail.failed):]:
            f["action"] = "stop"
        if checkpoints is not None:
            # the parties' last consistent state is the committed round; their write-ahead logs
            # hold every release made since (a resume replays them)
            checkpoints.commit(stopped={"reason": "guest_failure", "guests": sorted(fail.failed), "round": round_},
                               guest_failures=[dict(f) for f in failures])
            where = (f"; resume from the checkpoint of round {checkpoints.state.round} in {checkpoints.directory} "
                     f"with --resume")
            raise GuestFailure(round_, fail.failed, fail.partial, note=f"stopped ({why_stop}){where}") from original
        if action == "stop":
            raise original
        raise GuestFailure(round_, fail.failed, fail.partial, note=f"stopped ({why_stop})") from original
    for g in sorted(fail.failed):
        absent.add(g)
        transport.drop_guest(g, round_)
    return {g: list(bl) for g, bl in fail.partial.items() if g not in absent}


def _secure_redo(cfg: RunConfig, transport, absent: set, rnd, acts: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
    """``--secure-merge`` after a guest was dropped: the round's releases carry masks shared with it, so
    they are discarded unopened; the remaining guests agree on new keys and release the round again
    (a second release, charged). Without secure merge: ``acts`` unchanged."""
    if not cfg.secure_merge:
        return acts
    left = [g for g in transport.guests if g not in absent]
    transport.secure_rekey(left)
    return transport.secure_redo(rnd.keys, rnd.round)


def _refused_release(cfg: RunConfig, transport, exc: ReleaseOutOfRange, acts: dict[str, list[bytes]], round_: int,
                     failures: list, absent: set, checkpoints) -> dict[str, list[bytes]]:
    """The host refused a guest's release as out of its public range (nothing changed at the host):
    that guest failed. ``stop`` raises with one line naming it, the statistic and the bound;
    ``pad`` drops it and returns the round's other releases, for the host to play the round again."""
    guest = exc.sender
    if guest not in acts or guest in absent:  # not a guest of this round: nothing to pad
        raise exc
    fail = GuestFailure(round_, {guest: f"ReleaseOutOfRange: {exc}"},
                        {g: bl for g, bl in acts.items() if g != guest})
    stop = cfg.on_guest_failure == "stop"
    original = ReleaseOutOfRange(exc.sender, exc.receiver, exc.what, exc.batch, exc.round,
                                 exc.reason + ("; stopped (--on-guest-failure stop)" if stop else "")) if stop else exc
    return _on_guest_failure(cfg, transport, fail, round_, failures, absent, checkpoints, original)


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
    for k, v in metrics.items():  # the task's other metrics (binary: test_auc …; regression: test_mae …)
        if k.startswith("test_") and k not in row and isinstance(v, (int, float)) and not isinstance(v, bool):
            row[k] = float(v)
    row["epoch_time_s"] = seconds
    return row


def make_results(cfg: RunConfig, plan, history: list[dict], wire: dict, elapsed: float, engine: str,
                 **extra: Any) -> dict[str, Any]:
    """The results dictionary shared by every engine (see README, "Results JSON")."""
    config = cfg.to_dict()
    config.update(model=plan.arch, cut_layer=plan.cut)
    last = history[-1] if history else {}
    kept = cfg.report_metrics == "none" and engine != "monolithic"
    final = {"metric": plan.metric, "value": last.get("test_metric"), "train_loss": last.get("train_loss"),
             "task": plan.task,
             "metrics": {m: last.get(f"test_{m}", last.get("test_metric") if m == plan.metric else None)
                         for m in METRICS[plan.task]}}
    if not history:  # strict JSON: no NaN; null with the reason (fl_split.results)
        final["value_reason"] = final["train_loss_reason"] = "no epoch was evaluated"
    if kept:
        final.update(value=None, train_loss=None, metrics={}, kept_by_host=cfg.host_metrics)
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
        "status": "completed",
        **extra,
    }


class LocalTransport:
    """Parties in this process; their messages are handed over as they are.

    By default the parties release :class:`~fl_split.protocol.Handoff` messages (``in_process``)
    to the receivers that are parties of this transport too: the tensors stay on their device, no
    frame is encoded or decoded, and the receiver checks the tensor as it would check the frame.
    A receiver that is not one of them (the direct data plane's host has no local guests) gets
    frames, and ``codec=True`` makes every party release frames (the wire path of a deployment, in
    one process). Messages from elsewhere (a checkpoint's owed gradients) are frames either way;
    the receivers take both.

    A guest that raises while stepping (anything but a budget refusal or a configuration error)
    is a failed guest: the others' releases of the round are kept in the :class:`GuestFailure`.
    With :meth:`attach_checkpoints` every party keeps its checkpoints and write-ahead log in one
    directory (in a deployment each party's would be on its own machine)."""

    def __init__(self, host: HostParty, guests: dict[str, GuestParty], codec: bool = False) -> None:
        self.host = host
        self.codec = bool(codec)
        self._to_host = not self.codec and host is not None
        self.parties = guests
        self.guests = list(guests)
        self.dropped: set[str] = set()
        self._ckpt: tuple | None = None  # (directory, run id, config dict)
        self._wals: list = []

    def _all(self) -> dict[str, GuestParty | HostParty]:
        return {"host": self.host, **{g: p for g, p in self.parties.items() if g not in self.dropped}}

    def guest_step(self, owed, keys, round_):
        out: dict[str, list[bytes]] = {}
        failed: dict[str, str] = {}
        for g in owed:
            try:
                out[g] = self.parties[g].step(owed[g], keys, round_, in_process=self._to_host)
            except (BudgetExceeded, ConfigError):
                raise
            except ReleaseOutOfRange as exc:
                if exc.sender == "host":  # the guest refused the host's gradients: the host is at fault
                    raise
                failed[g] = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a failing guest is reported, the others go on
                failed[g] = f"{type(exc).__name__}: {exc}"
        if failed:
            raise GuestFailure(round_, failed, out)
        return out

    def secure_rekey(self, members: list[str]) -> None:
        """A new secure-merge session among ``members`` (fl_split/privacy/secure_merge.py, :func:`rekey`)."""
        from fl_split.privacy.secure_merge import rekey

        rekey(self.parties, members)

    def secure_redo(self, keys, round_: int) -> dict[str, list[bytes]]:
        """Every active guest releases ``keys`` again, in the session just agreed (charged again)."""
        return {g: self.parties[g].redo(keys, round_, in_process=self._to_host)
                for g in self.guests if g not in self.dropped}

    def host_train(self, keys, acts, round_):
        # the host's receivers are every active guest: hand over only if all of them are here
        local = not self.codec and all(g in self.parties for g in self.host.active_guests)
        return self.host.train(keys, acts, round_, in_process=local)

    def host_evaluate(self, keys, acts, round_):
        return self.host.evaluate(keys, acts, round_)

    def drop_guest(self, guest: str, round_: int) -> None:
        self.dropped.add(guest)
        self.host.drop_guest(guest, round_)

    def reports(self):
        from fl_split.devices import report_with_device

        return {"host": report_with_device(self.host),
                **{g: report_with_device(p) for g, p in self.parties.items() if g not in self.dropped}}

    # -- checkpoints ---------------------------------------------------------------------------------
    def attach_checkpoints(self, directory, run: str, config: dict, resume: bool) -> dict[str, int]:
        """Give every party its write-ahead log (new, or the run's own on resume, reconciled with the
        party's spend record: every party is checked before any log is repaired); returns, on
        resume, how many releases each party's log lacked and its spend record restored."""
        from fl_split.checkpoint import open_wal, reconcile_spend_record, spend_dir_of, spend_path, wal_path

        self._ckpt = (directory, run, config)
        parties = [p for p in self._all().values() if p.ledger is not None]
        if resume:
            for party in parties:
                reconcile_spend_record(wal_path(directory, party.name), spend_path(spend_dir_of(directory), party.name,
                                                                                 run), party.name, run, write=False)
        recovered = {}
        for party in parties:
            wal = open_wal(party, directory, run, resume=resume)
            self._wals.append(wal)
            recovered[party.name] = wal.recovered
        return recovered

    def checkpoint(self, round_: int) -> None:
        from fl_split.checkpoint import save_party

        directory, run, config = self._ckpt
        for party in self._all().values():
            save_party(party, directory, round_, run=run, config=config)

    def restore(self, round_: int, private_seed: int | None = None) -> dict[str, int]:
        """Restore every active party to ``round_``; returns how many logged releases each replayed."""
        from fl_split.checkpoint import restore_party

        directory, run, config = self._ckpt
        out = {}
        for name, party in self._all().items():
            out[name] = restore_party(party, directory, round_, run=run, config=config,
                                      private_seed=private_seed)["replayed"]
        return out

    def pending_replays(self) -> dict[str, int]:
        return {n: p.ledger.pending_replays for n, p in self._all().items() if p.ledger is not None}

    def close(self) -> None:
        for wal in self._wals:
            wal.close()
        self._wals = []


class LocalEngine:
    """All parties in one process, handing their checked messages over as tensors (exact
    per-batch semantics when ``batches_per_round = 1``). Each party has its own secret: fresh entropy, or derived from
    ``private_seed`` inside :func:`~fl_split.builder.make_parties`.

    With ``--checkpoint-dir`` a fresh run checkpoints every party before its first round (round 0:
    a resume must find each party's secret and initial weights) and then as ``--checkpoint-every``
    says; ``--resume`` restores the parties to the coordinator's last committed round.
    ``transport`` wraps the :class:`LocalTransport` (tests inject failing guests); ``codec=True``
    makes the parties exchange frames instead of in-process hand-overs (the wire path, for tests
    and ``experiments/bench_overhead.py --codec``)."""

    name = "local"

    def __init__(self, cfg: RunConfig, private_seed: int | None = None, transport=None, codec: bool = False) -> None:
        from fl_split.devices import with_device

        self.cfg = cfg = with_device(cfg)  # --device auto resolved once, by the rule of every engine
        self.private_seed = private_seed
        if cfg.party_files:  # each party from its own file, every file checked before anything is built
            from fl_split.party_files import parties_from_files

            self.host, self.guests, self.plan = parties_from_files(cfg, cfg.party_files, private_seed)
        else:
            self.host, self.guests, self.plan = make_parties(cfg, private_seed)
        if cfg.secure_merge:  # identities pinned from the configuration; keys agreed when the run starts
            from fl_split.privacy.secure_merge import setup_parties

            setup_parties(self.host, self.guests)
        self.local = LocalTransport(self.host, self.guests, codec=codec)
        self.transport = transport(self.local) if transport is not None else self.local

    def run(self) -> dict[str, Any]:
        ckpt = None
        replayed: dict[str, int] = {}
        try:
            if self.cfg.checkpoint_dir:
                from fl_split.checkpoint import Checkpointer

                ckpt = Checkpointer(self.cfg, self.name)
                state = ckpt.start()
                recovered = self.local.attach_checkpoints(ckpt.directory, state.run, ckpt.config(),
                                                          resume=self.cfg.resume)
                if self.cfg.resume:
                    for f in state.guest_failures:
                        if f.get("action") == "pad":
                            self.local.dropped.add(f["guest"])
                    replayed = self.local.restore(state.round, self.private_seed)
                else:
                    self.local.checkpoint(0)
                    ckpt.commit(round=0)
            results = coordinate(self.cfg, self.plan, self.transport, self.name, checkpoints=ckpt)
            if ckpt is not None:
                results["checkpoint"].update(replayed=replayed, pending_replays=self.local.pending_replays())
                if self.cfg.resume:  # releases a restored checkpoint directory had lost (docs/robustness.md)
                    results["checkpoint"]["recovered"] = recovered
            if self.cfg.save_model:
                from fl_split.serving import save_part

                # each party writes its own folder from its own object (fl_split/serving.py)
                for party in (self.host, *self.guests.values()):
                    save_part(party, self.plan, self.cfg.save_model)
            return results
        finally:
            self.local.close()


class MonolithicEngine:
    """One model, one optimizer, same modules / weights / batch order as the split run."""

    name = "monolithic"

    def __init__(self, cfg: RunConfig, public: bool = False, private_seed: int | None = None,
                 secret=None) -> None:
        from fl_split.devices import with_device

        self.cfg = cfg = with_device(cfg)
        self.model, self.data, self.plan = make_monolithic(cfg, public=public, private_seed=private_seed,
                                                           secret=secret)
        self.device = resolve_device(cfg.device)
        self.model.to(self.device)
        self.optimizer = optimizer_settings(cfg).make(self.model.parameters())
        self.holders = list(self.plan.input_shapes)

    def _batch(self, key: BatchKey):
        return monolithic_batch(self.data, self.plan, key, self.device)

    def run(self) -> dict[str, Any]:
        cfg, schedule = self.cfg, self.plan.schedule
        history = []
        bar = tqdm(total=cfg.epochs * schedule.num_train_batches(), desc="monolithic training", unit="batch",
                   disable=not cfg.progress, leave=False, dynamic_ncols=True)
        t0 = time.perf_counter()
        t_epoch = t0
        try:
            for epoch in range(1, cfg.epochs + 1):
                loss_sum, n = train_monolithic_epoch(self.model, self.optimizer, self.data, self.plan, epoch,
                                                     self.device, on_batch=lambda: bar.update(1))
                stats = self.evaluate(epoch)
                now = time.perf_counter()
                metrics = {"epoch": epoch, "train_loss": loss_sum / n if n else float("nan"),
                           **epoch_metrics(self.plan.task, stats["metrics"]),
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
        """The test split's loss and the task's metrics (as the split host computes them)."""
        self.model.eval()
        host = self.data.parties["host"]
        scorer, loss_of = Scorer(self.plan.task, host.target_scale), objective(self.cfg, self.plan, host)
        n, loss_sum = 0, 0.0
        for key in self.plan.schedule.test_keys(epoch):
            xs, y = self._batch(key)
            out = self.model(xs)
            scorer.add(out, y)
            loss_sum += float(loss_of(out, y, reduction="sum"))
            n += len(y)
        return {"metrics": scorer.metrics(), "n": n, "loss_sum": loss_sum}


def run_experiment(cfg: RunConfig, private_seed: int | None = None, say=None, local_engine=None) -> dict[str, Any]:
    """Build and run the configured experiment on the configured engine.

    ``private_seed`` (``--private-seed``) makes every party's private randomness reproducible; it
    is not part of the (public) configuration and never appears in the results. ``say`` gets the
    Flower engine's one line about ``--num-cpus auto``. In this process the parties train with
    ``--threads`` torch threads (``auto``: 1, see :func:`fl_split.devices.party_threads`);
    the previous setting is restored afterwards. A Flower ClientApp sets its own. ``local_engine``:
    builds the split local engine instead of :class:`LocalEngine` (same arguments; the Python API
    observes the run through it, :mod:`fl_split.api`)."""
    if cfg.save_model:  # the parties write there, Flower's ClientApps from their own working directories
        import os

        cfg = cfg.replace(save_model=os.path.abspath(os.path.expanduser(cfg.save_model)))
    if cfg.engine == "flower" and not cfg.monolithic:
        from fl_split.flower import FlowerEngine

        results = FlowerEngine(cfg, private_seed=private_seed, say=say).run()
    else:
        from fl_split.devices import apply_threads, party_threads

        old = apply_threads(party_threads(cfg.threads, None))
        try:
            if cfg.monolithic:
                results = MonolithicEngine(cfg, private_seed=private_seed).run()
            else:
                results = (local_engine or LocalEngine)(cfg, private_seed).run()
        finally:
            apply_threads(old)
    if cfg.save_model and not cfg.monolithic:  # each party saved its own part (local engine, Flower nodes)
        results["saved_model"] = {"dir": cfg.save_model, "parties": ["host", *guest_names(cfg.guests)]}
    if cfg.data:  # own data, prepared in this process: how the shared ID list was agreed (sizes, PSI traffic;
        # never an ID). A deployment's coordinator never reads data and does not come here.
        from fl_split.builder import prepare_data

        results["alignment"] = prepare_data(cfg).alignment
    return results
