""":class:`HostParty`: the labels, its own bottom (optional), the merge and the top (spec §2, step 2)."""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fl_split.checkpoint import value_digest
from fl_split.data.base import PartyData
from fl_split.errors import ProtocolError
from fl_split.local_update import LocalUpdate
from fl_split.merge import Merge
from fl_split.parties.base import _outgoing, _Party, set_mode
from fl_split.parties.baseline import LOST as BASELINE_LOST
from fl_split.parties.baseline import Z as BASELINE_Z
from fl_split.parties.baseline import HostAlone, per_record_error, verdict
from fl_split.parties.schedule import Importance, MechanismSchedule
from fl_split.privacy.base import NoDefense, PostProcess
from fl_split.privacy.bounds import PeerTrust
from fl_split.privacy.guard import RECENT, LossJumpAlarm, TrainTestGuard, label_matrix
from fl_split.privacy.diagnostics import LocalDiagnostics
from fl_split.privacy.disclosure import party_privacy_report
from fl_split.protocol import Message, wire_bytes
from fl_split.results import write_json_atomic
from fl_split.schedule import BatchKey, BatchSchedule
from fl_split.seeding import PartySecret

if TYPE_CHECKING:
    from fl_split.privacy.ledger import Ledger, LedgerEntry
    from fl_split.tasks import Objective


#: the release probe keeps its training rows only up to this many numbers (RECENT batches' features, float32)
PROBE_MAX_ELEMENTS = 2_000_000


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


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
                 objective: "Objective | None" = None, loss_alarm: bool = False) -> None:
        super().__init__("host", data, schedule, secret, ledger, sample_rate, device)
        from fl_split.tasks import Objective, kind_of

        #: the task's loss (fl_split/tasks.py): cross-entropy (optionally class-weighted) or MSE
        self.task = kind_of(data.task, data.num_classes)
        self.objective = objective or Objective(self.task)
        #: what the host checks of each guest's releases: the public range of the guest's forward
        #: mechanism (``guest_mechanisms``, from the public configuration), else its running scale
        self.trust = PeerTrust("host", "activations", dict(guest_mechanisms or {}), frozen=True)
        #: per-guest training vs test release statistics (issue 25: a guest poisoning its training releases)
        self.guard = TrainTestGuard("host", label_matrix(self.task, data.num_classes))
        self._train_round_batches = 0  # batches in the last training round decoded (the guard's ``defer``)
        #: the training-loss jump alarm, attributed to one guest (issue 25, ``--loss-alarm``; None: off)
        self.loss_alarm: LossJumpAlarm | None = LossJumpAlarm("host") if loss_alarm else None
        self._screened: list[float] = []  # the losses of the training round being received (the alarm's)
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
        #: ``--secure-merge``: ``(clip, scale)`` of the guests' fixed point; the host then receives masked
        #: ring elements and unmasks only their sum (fl_split/privacy/secure_merge.py)
        self.secure_merge: tuple[float, int] | None = None
        self._train_loss = [0.0, 0]
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self._cached: dict[str, np.ndarray] = {}
        self.metric = data.metric
        #: the host's own-features reference (fl_split/parties/baseline.py), fitted at the first evaluation
        self.baseline: HostAlone | None = None
        #: each evaluation's verdict on the joint model against that reference (:func:`verdict`)
        self.quality: list[dict[str, Any]] = []
        #: the release probe's training batches: the last RECENT accepted ones, as (key, releases) references, or
        #: as (features, labels) rows once restored from an export (:meth:`_probe_rows`)
        self._recent_releases: deque = deque(maxlen=RECENT)

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
        self._recent_releases.clear()  # the probe's rows held that guest's release
        if self.loss_alarm is not None:  # the loss without that guest is another quantity: a new history
            self.loss_alarm.reset()

    # -- receiving ---------------------------------------------------------------------------
    def _received(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int | None = None,
                  screen: Callable | None = None) -> dict[str, list[torch.Tensor]]:
        """Decode and check every guest's messages for ``keys`` (before touching any state).

        In one-shot mode empty lists mean "use what you cached when these records were released".
        Absent guests (:meth:`drop_guest`) send nothing. ``screen(out, fresh)``: a further check of a
        training round's releases (the loss-jump alarm), after the range checks and before anything
        is recorded.
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
            labels = [self.labels(k) for k in keys] if fresh else []
            for g in fresh:
                self.guard.check_test(g, out[g], f"{keys[0].phase}[epoch {keys[0].epoch}]", round_,
                                      noisy=self.trust.public_range(g, keys[0]) is not None, defer=defer,
                                      labels=labels)
        elif keys and keys[0].phase == "train":
            if screen is not None:
                screen(out, fresh)
            labels = [self.labels(k) for k in keys[-RECENT:]] if fresh else []
            for g in fresh:
                self.guard.check_deferred(g, out[g], f"{keys[0].phase}[epoch {keys[0].epoch}]", round_,
                                          labels=labels)
            self._train_round_batches = len(keys)
        for g in fresh:
            for k, t in zip(keys, out[g]):
                self.trust.record(g, k, t)
                if k.phase == "train":
                    self.guard.record_train(g, t, self.labels(k))
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

    def _forward(self, key: BatchKey, acts: dict[str, torch.Tensor], train: bool, drop: str | None = None,
                 gen: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The top's output for ``key``; ``drop``: that guest zero-filled too; ``gen``: the generator of a
        random post-processing (default: a fresh private draw)."""
        parts: list[torch.Tensor] = []
        if self.bottom is not None:
            parts.append(self.bottom(self.rows(key)))
        if self.secure_merge is not None:
            if drop is not None:
                raise ProtocolError(f"host: under --secure-merge the host holds only the guests' sum; it cannot "
                                    f"zero-fill {drop} alone")
            return self._forward_secure(key, acts, train, parts, gen)
        leaves: dict[str, torch.Tensor] = {}
        for g in self.guests:
            if g in self.absent or g == drop:  # a failed guest's embedding is zero-filled (001's padding)
                parts.append(torch.zeros((len(self.schedule.positions(key)), *self.guest_shapes[g]),
                                         device=self.device))
                continue
            a = acts[g].to(self.device)
            if train and not self.one_shot:
                a.requires_grad_(True)
            leaves[g] = a
            if gen is None and self.act_postprocess.random:
                parts.append(self.act_postprocess(a, self._gen("denoise")))
            else:
                parts.append(self.act_postprocess(a, gen))
        return self.top(self.merge(parts)), leaves

    def _forward_secure(self, key: BatchKey, acts: dict[str, torch.Tensor], train: bool, parts: list,
                        gen: torch.Generator | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``--secure-merge``: the active guests' masked releases summed on the ring and decoded — the
        only guest value the host sees — in the first guest's slot, zeros in the others (the sum and
        avg merges are unchanged); every guest's gradient is the sum's (∂L/∂h_g = ∂L/∂Σh)."""
        from fl_split.privacy.secure_merge import decode, unmask_sum

        clip, scale = self.secure_merge
        active = self.active_guests
        total = decode(torch.from_numpy(unmask_sum([acts[g] for g in active])), clip, scale).to(self.device)
        if train and not self.one_shot:
            total.requires_grad_(True)
        if gen is None and self.act_postprocess.random:
            gen = self._gen("denoise")
        parts.append(self.act_postprocess(total, gen))
        rows = len(self.schedule.positions(key))
        parts.extend(torch.zeros((rows, *self.guest_shapes[g]), device=self.device) for g in self.guests[1:])
        return self.top(self.merge(parts)), {g: total for g in active}

    # -- the loss-jump alarm (fl_split/privacy/guard.py, LossJumpAlarm) ----------------------------
    @torch.no_grad()
    def _probe(self, keys, acts: dict[str, list[torch.Tensor]], drop: str | None = None) -> list[float]:
        """Each batch's training loss under the current models, forward only, in evaluation mode (no
        dropout draw, no batch-norm statistic moves), ``drop`` zero-filled; a random post-processing
        draws from a fixed public generator, not the party's (its counters do not move)."""
        modes = [(m, m.training) for m in (self.bottom, self.top) if m is not None]
        for m, _ in modes:
            set_mode(m, False)
        try:
            gen = (torch.Generator(device=self.device).manual_seed(0) if self.act_postprocess.random else None)
            active = self.active_guests
            vals = [self.objective(self._forward(k, {g: acts[g][i] for g in active}, False, drop, gen)[0],
                                   self.labels(k)) for i, k in enumerate(keys)]
            return torch.stack(vals).double().cpu().tolist()
        finally:
            for m, was in modes:
                set_mode(m, was)

    def _screen(self, keys, acts: dict[str, list[torch.Tensor]], fresh: list[str], round_: int | None) -> None:
        """The loss-jump alarm on a training round (before anything changes): the round's losses are
        kept in ``_screened`` for :meth:`train` to record once the round is accepted."""
        self._screened = []
        if self.loss_alarm is None or not fresh or not keys:
            return
        losses = self._probe(keys, acts)
        sched = [self.trust.mechanisms.get(g) for g in self.active_guests]
        regimes = [tuple(m(k) if m is not None else None for m in sched) for k in keys]
        self.loss_alarm.check([str(k) for k in keys], losses,
                              lambda i: {g: self._probe([keys[i]], {a: [acts[a][i]] for a in acts}, drop=g)[0]
                                         for g in fresh}, round_, regimes)
        self._screened = losses

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

    def _epoch_entries(self, epoch: int) -> list["LedgerEntry"]:
        """Epoch ``epoch``'s backward releases and DP-SGD updates (the host releases no test batch)."""
        return self._entries(self.schedule.train_keys(epoch), 0)

    def train(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int,
              in_process: bool = False) -> dict[str, list[bytes]]:
        """Train on every batch in ``keys``; returns the released gradients per guest (nothing
        else leaves: the training loss stays here until the epoch's aggregate). Before anything
        changes the round passes the public-range checks, the guard's deferred comparison and the
        training-loss jump alarm (:mod:`fl_split.privacy.guard`); a refusal raises
        :class:`~fl_split.errors.ReleaseOutOfRange` with the host untouched. ``in_process``:
        the guests are in this process; release :class:`~fl_split.protocol.Handoff` messages
        instead of frames (``blobs_by_guest`` may hold either)."""
        keys = self._request(keys, round_, phase="train")
        self._screened = []
        msgs = self._received(keys, blobs_by_guest, round_,
                              screen=lambda out, fresh: self._screen(keys, out, fresh, round_))
        if self.loss_alarm is not None and self._screened:
            self.loss_alarm.record(self._screened)
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
        self._keep_probe_rows(keys, {g: msgs[g] for g in active})
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
        joint: list[torch.Tensor] = []
        for i, key in enumerate(keys):
            y = self.labels(key)
            logits, _ = self._forward(key, {g: msgs[g][i] for g in active}, train=False)
            scorer.add(logits, y)
            loss_sum += float(self.objective(logits, y, reduction="sum"))
            joint.append(per_record_error(self.task, logits, y))
            n += len(y)
        epoch = keys[0].epoch if keys else len(self.history) + 1
        if keys:
            self._judge(int(epoch), keys, msgs, torch.cat(joint), scorer.metrics())
        back = next(iter(self.backward_mechanisms.values()))() if self.backward_mechanisms else None
        self.diagnostics.check(epoch, back.name if back is not None else "none",
                               back.public_diagnostics().get("snr_bound") if back is not None else None)
        tl, tn = self._train_loss
        metrics = {"epoch": int(epoch), "train_loss": tl / tn if tn else math.nan,
                   **epoch_metrics(self.task, scorer.metrics()), "test_loss": loss_sum / n if n else math.nan}
        self._train_loss = [0.0, 0]
        self.history.append(metrics)
        if self.metrics_file:
            write_json_atomic(self.metrics_file, {"party": "host", "metric": self.metric, "history": self.history})
        self._done(round_)
        return dict(metrics) if self.report_metrics == "epoch" else {"epoch": int(epoch)}

    # -- the verdict against the host's own baseline (fl_split/parties/baseline.py) ----------------------
    def _judge(self, epoch: int, keys, msgs: dict[str, list[torch.Tensor]], joint: torch.Tensor,
               metrics: dict[str, float]) -> None:
        """Compare this evaluation's per-record test errors ``joint`` with the host-alone baseline's (paired,
        one-sided, :func:`~fl_split.parties.baseline.verdict`) and keep the verdict in :attr:`quality`; when
        degraded, also the error with each guest zero-filled (what ``pad`` would do). Forward passes only, in
        evaluation mode, a public generator for a random post-processing: nothing of the party's state moves."""
        from fl_split.tasks import Scorer

        if self.baseline is None:
            self.baseline = HostAlone(self.task, self.data.num_classes,
                                      self.data.x_train if self.bottom is not None else None, self.data.y_train)
        ys = [self.labels(k) for k in keys]
        base_scorer = Scorer(self.task, self.data.target_scale)
        base, prior = [], []
        for k, y in zip(keys, ys):
            err, out, guess = self.baseline.errors(self.rows(k) if self.baseline.has_features else None, y)
            base.append(err)
            prior.append(guess)
            base_scorer.add(out, y)
        v = verdict(joint, torch.cat(base), torch.cat(prior) if self.baseline.has_features else None)
        row = {"epoch": epoch, **v, "metric": self.metric, "joint_metric": metrics.get(self.metric),
               "baseline_metric": base_scorer.metrics().get(self.metric),
               "baseline": "host features" if self.baseline.has_features else "label prior"}
        row["baseline_degraded"] = v["degraded"]
        probe = self._release_probe(keys, msgs, ys, joint, torch.cat(prior))
        if probe is not None:
            row["probe"] = probe
            row["degraded"] = bool(v["degraded"] or probe["degraded"])
        if row["degraded"] and self.active_guests and self.secure_merge is None:  # (secure merge: only the sum)
            gen_of = (lambda: torch.Generator(device=self.device).manual_seed(0)) if self.act_postprocess.random \
                else (lambda: None)
            active = self.active_guests
            row["zero_filled"] = {}
            for g in active:
                gen = gen_of()
                errors = [per_record_error(self.task, self._forward(k, {a: msgs[a][i] for a in active}, False, g, gen)[0],
                                           y) for i, (k, y) in enumerate(zip(keys, ys))]
                row["zero_filled"][g] = float(torch.cat(errors).mean())
        self.quality.append(row)

    def _keep_probe_rows(self, keys, msgs: dict[str, list[torch.Tensor]]) -> None:
        """Keep the last RECENT batches of an accepted training round as the release probe's training rows (not
        under secure merge: the host holds no guest's release there, only their sum)."""
        if self.secure_merge is not None or not msgs:
            return
        for i, k in enumerate(keys[-RECENT:], start=max(len(keys) - RECENT, 0)):
            # references only: the rows are built when a probe or an export asks (:meth:`_probe_rows`)
            self._recent_releases.append((k, {g: msgs[g][i].detach() for g in msgs}))

    def _probe_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The release probe's training rows ``[(features float32, labels)]`` per kept batch; none when they
        would exceed PROBE_MAX_ELEMENTS (nothing kept, nothing exported)."""
        rows = [(self._probe_features(e[0], e[1]).float(), self.labels(e[0]).detach().cpu())
                if isinstance(e[1], dict) else e for e in self._recent_releases]
        if sum(x.numel() for x, _ in rows) > PROBE_MAX_ELEMENTS:
            return []
        return rows

    def _export_probe_rows(self) -> dict[str, torch.Tensor]:
        rows = self._probe_rows()
        return {"x": torch.cat([x for x, _ in rows]) if rows else torch.zeros(0),
                "y": torch.cat([y for _, y in rows]) if rows else torch.zeros(0),
                "sizes": torch.tensor([len(y) for _, y in rows], dtype=torch.long)}

    def _probe_features(self, key: BatchKey, releases: dict[str, torch.Tensor]) -> torch.Tensor:
        """One batch's rows for the release probe: the host's features (if any), then each guest's release, flat."""
        parts = [self.rows(key).reshape(len(self.schedule.positions(key)), -1)] if self.bottom is not None else []
        parts += [releases[g].reshape(len(releases[g]), -1) for g in sorted(releases)]
        return torch.cat([p.detach().double().cpu() for p in parts], 1)

    def _release_probe(self, keys, msgs: dict[str, list[torch.Tensor]], ys: list[torch.Tensor], joint: torch.Tensor,
                       prior: torch.Tensor) -> dict[str, Any] | None:
        """The second reference (:class:`~fl_split.parties.baseline.HostAlone` again): a linear model on the host's
        features and the guests' releases as received, standardised (a consistent scale cancels), fitted on the
        last RECENT training batches and scored on this evaluation's test releases; its verdict as
        :func:`verdict`'s, against the label prior. Fitted only where it could matter: the joint model's error at
        least LOST × the prior's (below that no reference can make it degraded), the guests' own releases held
        (not under secure merge) and RECENT training batches seen since the last restore. Local, nothing sent."""
        from fl_split.tasks import Scorer

        active = self.active_guests
        if (not active or self.secure_merge is not None or len(self._recent_releases) < RECENT
                or float(joint.mean()) < BASELINE_LOST * float(prior.mean())):
            return None
        rows = self._probe_rows()
        if len(rows) < RECENT:
            return None
        x = torch.cat([x for x, _ in rows]).double()
        y = torch.cat([y for _, y in rows])
        model = HostAlone(self.task, self.data.num_classes, x, y)
        scorer = Scorer(self.task, self.data.target_scale)
        errors = []
        for i, (k, yk) in enumerate(zip(keys, ys)):
            out = model.outputs(self._probe_features(k, {g: msgs[g][i] for g in active}).float().double(), len(yk))
            errors.append(per_record_error(self.task, out, yk))
            scorer.add(out, yk)
        v = verdict(joint, torch.cat(errors), prior)
        return {**v, "metric_value": scorer.metrics().get(self.metric), "rows": len(y)}

    def quality_report(self) -> dict[str, Any] | None:
        """The run's verdict for the coordinator: ``{"status": "ok" | "degraded", "reason", …}`` from the last
        evaluation; with ``report_metrics="none"`` the status and the epoch only (the numbers stay here)."""
        if not self.quality:
            return None
        last = self.quality[-1]
        status = "degraded" if last["degraded"] else "ok"
        out: dict[str, Any] = {"status": status, "epoch": last["epoch"],
                               "degraded_epochs": [q["epoch"] for q in self.quality if q["degraded"]]}
        if self.report_metrics == "none":
            out["reason"] = ("the joint model's test error is above that of a reference the host fitted locally (its own "
                             "features, or a linear model on the releases it received) beyond sampling error"
                             if status == "degraded" else "")
            return out
        zero = "".join(f"; with {g} zero-filled {v:.4g}" for g, v in sorted(last.get("zero_filled", {}).items()))
        probe = last.get("probe")
        if status == "degraded" and probe is not None and probe["degraded"] and not last.get("baseline_degraded"):
            out["reason"] = (
                f"epoch {last['epoch']}: the joint model's test error {last['joint_error']:.4g} ({last['metric']} "
                f"{_num(last['joint_metric'])}) is above that of a linear model on what the host holds (its features, if "
                f"any, and the releases it received), fitted on its last {probe['rows']} training records, "
                f"{probe['baseline_error']:.4g} "
                f"({_num(probe['metric_value'])}) by {probe['z']:.3g} standard errors over {probe['records']} test "
                f"records (degraded above {BASELINE_Z:g}) and gives back {probe['lost']:.2f} of its gain over the "
                f"label prior's {probe['prior_error']:.4g} (degraded from {BASELINE_LOST:g}){zero}")
            out["epochs"] = [dict(q) for q in self.quality]
            return out
        lost = (f" and gives back {last['lost']:.2f} of their gain over the label prior's {last['prior_error']:.4g} "
                f"(degraded from {BASELINE_LOST:g})" if math.isfinite(last["lost"]) else "")
        out["reason"] = (
            f"epoch {last['epoch']}: the joint model's test error {last['joint_error']:.4g} ({last['metric']} "
            f"{_num(last['joint_metric'])}) is above the host-alone baseline's {last['baseline_error']:.4g} "
            f"({last['baseline']}: {_num(last['baseline_metric'])}) by {last['z']:.3g} standard errors over "
            f"{last['records']} test records (degraded above {BASELINE_Z:g}){lost}{zero}"
            if status == "degraded" else "")
        out["epochs"] = [dict(q) for q in self.quality]  # a non-finite number: null with a reason (fl_split/results.py)
        return out

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
                "quality": self.quality_report(),
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
            # the verdicts so far (the baseline itself is refitted, deterministically, when first needed)
            "quality": json.dumps(self.quality),
            "probe_rows": self._export_probe_rows(),
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
        self.quality = json.loads(state.get("quality", "[]"))
        self._recent_releases = deque(maxlen=RECENT)
        rows = state.get("probe_rows")
        if rows is not None and len(rows["sizes"]):
            xs = torch.split(torch.as_tensor(rows["x"]), [int(n) for n in rows["sizes"]])
            ys = torch.split(torch.as_tensor(rows["y"]), [int(n) for n in rows["sizes"]])
            self._recent_releases.extend(zip(xs, ys))
