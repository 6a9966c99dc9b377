"""``GuestParty`` and ``HostParty``: each owns its data slice, models, optimizer, mechanisms.

A party is the unit of trust (DESIGN principle 1): its data and model never leave the object;
what leaves is a :mod:`fl_split.protocol` blob produced from its mechanism's release. The same
classes run under the in-process :class:`~fl_split.engine.LocalEngine` and inside Flower
ClientApps; a party's whole state can be exported and restored (:meth:`export_state`), which is
how a Flower node keeps it in ``context.state`` between messages.

Per batch (SPEC §2):

1. guest ``g``: ``v_g = bottom_g(x_g[b])``, releases ``ã_g = M_fwd(v_g)``;
2. host: ``z = merge(a_h, ã_1 … ã_G)``, ``ŷ = top(z)``, loss ``L(ŷ, y[b])``; backward; for each guest
   ``δ_g = ∂L/∂ã_g`` is released as ``δ̃_g = M_bwd(δ_g)``; the host steps its optimizer;
3. guest ``g`` backpropagates ``δ̃_g`` through its mechanism's local derivative and its bottom,
   and steps.

A guest may release several batches before their gradients come back (``batches_per_round >
1``). It then applies the gradients in order, each to a forward recomputed with its *current*
weights (FedBCD-style local updates). With one batch per round the weights have not moved in
between and the kept autograd graph is used directly: exact sequential training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_split.config import RunConfig
from fl_split.data.base import PartyData
from fl_split.errors import ProtocolError
from fl_split.merge import Merge
from fl_split.privacy.base import Mechanism, NoDefense, PostProcess
from fl_split.protocol import Message, decode, encode
from fl_split.schedule import BatchKey, BatchSchedule
from fl_split.seeding import torch_generator
from fl_split.state import flatten, unflatten

HIT_AT = 10


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from fl_split.errors import ConfigError

            raise ConfigError("device", name, "auto or cpu (no CUDA device is visible)")
        return torch.device("cuda")
    return torch.device("cpu")


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    """The optimizer every party uses for its own parameters (same settings for all)."""
    params = [p for p in params if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def batch_metric(logits: torch.Tensor, y: torch.Tensor, metric: str) -> int:
    """Number of correct predictions (accuracy) or hits in the top 10 (hit@10)."""
    if metric == "hit@10":
        k = min(HIT_AT, logits.shape[1])
        return int((logits.topk(k, dim=1).indices == y[:, None]).any(dim=1).sum())
    return int((logits.argmax(dim=1) == y).sum())


@dataclass
class _Pending:
    """A released training batch whose gradient has not come back yet."""

    round: int
    version: int
    ctx: dict[str, torch.Tensor]
    out: torch.Tensor | None  # live autograd graph (None after a state restore)


class _Party:
    def __init__(self, name: str, cfg: RunConfig, schedule: BatchSchedule, data: PartyData,
                 device: torch.device | str = "cpu") -> None:
        self.name = name
        self.cfg = cfg
        self.schedule = schedule
        self.data = data
        self.device = torch.device(device)

    def ids(self, key: BatchKey) -> np.ndarray:
        pos = self.schedule.positions(key)
        return (self.data.train_ids if key.phase == "train" else self.data.test_ids)[pos]

    def rows(self, key: BatchKey) -> torch.Tensor:
        pos = torch.from_numpy(self.schedule.positions(key))
        x = self.data.x_train if key.phase == "train" else self.data.x_test
        return x.index_select(0, pos).to(self.device, non_blocking=True)

    def labels(self, key: BatchKey) -> torch.Tensor:
        pos = torch.from_numpy(self.schedule.positions(key))
        y = self.data.y_train if key.phase == "train" else self.data.y_test
        return y.index_select(0, pos).to(self.device, non_blocking=True)


class GuestParty(_Party):
    """Holds features only: a bottom model, its optimizer, and its forward mechanism."""

    def __init__(self, name: str, cfg: RunConfig, schedule: BatchSchedule, data: PartyData,
                 bottom: nn.Module, cut_shape: tuple[int, ...], mechanism: Mechanism | None = None,
                 grad_postprocess: PostProcess | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(name, cfg, schedule, data, device)
        if not data.has_features:
            raise ValueError(f"{name}: a guest must hold feature columns")
        self.bottom = bottom.to(self.device)
        self.optimizer = make_optimizer(cfg, self.bottom.parameters())
        self.cut_shape = tuple(cut_shape)
        self.mechanism = mechanism or NoDefense()
        #: receiver-side post-processing of received gradients (denoising), identity by default
        self.grad_postprocess = grad_postprocess or PostProcess()
        self.steps = 0
        self._pending: dict[BatchKey, _Pending] = {}

    # -- forward ----------------------------------------------------------------------------
    def release(self, keys: list[BatchKey] | tuple[BatchKey, ...], round_: int) -> list[bytes]:
        """Compute and release the cut-layer output of each batch in ``keys``."""
        blobs = []
        for key in keys:
            train = key.phase == "train"
            if train and key in self._pending:
                raise ProtocolError(f"{self.name}: {key} was already released and awaits its gradient")
            x = self.rows(key)
            if train:
                self.bottom.train()
                v = self.bottom(x)
            else:
                self.bottom.eval()
                with torch.no_grad():
                    v = self.bottom(x)
            gen = self._generator("release", key) if self.mechanism.random else None
            rel = self.mechanism.release(v.detach(), gen)
            blobs.append(encode(Message("activations", self.name, "host", round_, key, self.ids(key),
                                        rel.value, rel.encoding)))
            if train:
                self._pending[key] = _Pending(round_, self.steps, rel.ctx, v)
        return blobs

    # -- backward ---------------------------------------------------------------------------
    def apply_gradients(self, blobs: list[bytes], round_: int | None = None) -> None:
        """Backpropagate the released partial losses of every pending batch, in order.

        All messages are decoded and checked first: a bad message raises
        :class:`ProtocolError` and leaves the party exactly as it was.
        """
        owed = sorted(self._pending)
        msgs = [decode(b) for b in blobs]
        got = [m.key for m in msgs]
        if sorted(got) != owed or len(set(got)) != len(got):
            raise ProtocolError(f"{self.name}: gradients received for {[str(k) for k in got]}, "
                                f"but owed for {[str(k) for k in owed]}")
        for m in msgs:
            m.check(kind="gradients", sender="host", receiver=self.name, key=m.key, ids=self.ids(m.key),
                    sample_shape=self.cut_shape)
        for m in msgs:
            p = self._pending.pop(m.key)
            out = p.out if (p.out is not None and p.version == self.steps) else self._recompute(m.key)
            gen = self._generator("denoise", m.key) if self.grad_postprocess.random else None
            grad = self.grad_postprocess(m.tensor.to(self.device), gen)
            grad = self.mechanism.local_grad(p.ctx, grad)
            self.optimizer.zero_grad(set_to_none=True)
            out.backward(grad)
            self.optimizer.step()
            self.steps += 1

    def step(self, grad_blobs: list[bytes], keys, round_: int) -> list[bytes]:
        """One round for this guest: apply the gradients it is owed, then release ``keys``."""
        self.apply_gradients(grad_blobs, round_)
        return self.release(keys, round_)

    def _recompute(self, key: BatchKey) -> torch.Tensor:
        """Forward ``key`` again with the current weights, leaving BatchNorm statistics untouched
        (they were already updated when the batch was first released)."""
        # the forward updates scratch copies of the buffers; the originals are put back by
        # reference (not copied in place: the new graph may have saved the scratch tensors)
        saved = [(m, name, buf) for m in self.bottom.modules() for name, buf in m.named_buffers(recurse=False)]
        for m, name, buf in saved:
            setattr(m, name, buf.clone())
        self.bottom.train()
        try:
            return self.bottom(self.rows(key))
        finally:
            for m, name, buf in saved:
                setattr(m, name, buf)

    def _generator(self, purpose: str, key: BatchKey) -> torch.Generator:
        return torch_generator(self.cfg.seed, self.name, purpose, *key.as_tuple(), device=self.device)

    @property
    def pending_keys(self) -> list[BatchKey]:
        return sorted(self._pending)

    def report(self) -> dict[str, Any]:
        """End-of-run facts this party is willing to disclose (no data, no weights)."""
        return {"role": "guest", "optimizer_steps": self.steps, "mechanism": self.mechanism.describe(),
                "postprocess": self.grad_postprocess.describe()}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            "model": self.bottom.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "pending": [[list(k.as_tuple()), p.round, p.version, p.ctx] for k, p in sorted(self._pending.items())],
        }

    def import_state(self, state: dict[str, Any]) -> None:
        self.bottom.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self._pending = {BatchKey(str(k[0]), int(k[1]), int(k[2])): _Pending(int(r), int(v), dict(ctx), None)
                         for k, r, v, ctx in state["pending"]}


class HostParty(_Party):
    """Holds the labels, optionally its own bottom, the merge layer and the top model."""

    def __init__(self, cfg: RunConfig, schedule: BatchSchedule, data: PartyData, bottom: nn.Module | None,
                 merge: Merge, top: nn.Module, guest_shapes: dict[str, tuple[int, ...]],
                 backward_mechanisms: dict[str, Mechanism] | None = None,
                 act_postprocess: PostProcess | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__("host", cfg, schedule, data, device)
        if data.y_train is None:
            raise ValueError("the host must hold the labels")
        self.bottom = bottom.to(self.device) if bottom is not None else None
        self.top = top.to(self.device)
        self.merge = merge
        self.guest_shapes = {g: tuple(s) for g, s in guest_shapes.items()}
        self.guests = list(guest_shapes)
        params = list(self.bottom.parameters()) if self.bottom is not None else []
        self.optimizer = make_optimizer(cfg, params + list(self.top.parameters()))
        self.backward_mechanisms = backward_mechanisms or {g: NoDefense() for g in self.guests}
        #: receiver-side post-processing of received activations (denoising), identity by default
        self.act_postprocess = act_postprocess or PostProcess()
        self.steps = 0
        self.metric = data.metric

    def _received(self, keys, blobs_by_guest: dict[str, list[bytes]]) -> dict[str, list[Message]]:
        """Decode and check every guest's messages for ``keys`` (before touching any state)."""
        if sorted(blobs_by_guest) != sorted(self.guests):
            raise ProtocolError(f"host: activations from {sorted(blobs_by_guest)}, expected {sorted(self.guests)}")
        out: dict[str, list[Message]] = {}
        for g in self.guests:
            blobs = blobs_by_guest[g]
            if len(blobs) != len(keys):
                raise ProtocolError(f"host: {len(blobs)} activation messages from {g}, expected {len(keys)}")
            out[g] = [decode(b).check(kind="activations", sender=g, receiver="host", key=k, ids=self.ids(k),
                                      sample_shape=self.guest_shapes[g]) for b, k in zip(blobs, keys)]
        return out

    def _forward(self, key: BatchKey, acts: dict[str, torch.Tensor], train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts: list[torch.Tensor] = []
        if self.bottom is not None:
            parts.append(self.bottom(self.rows(key)))
        leaves: dict[str, torch.Tensor] = {}
        for g in self.guests:
            a = acts[g].to(self.device)
            if train:
                a.requires_grad_(True)
            leaves[g] = a
            gen = torch_generator(self.cfg.seed, "host", "denoise", g, *key.as_tuple(), device=self.device) \
                if self.act_postprocess.random else None
            parts.append(self.act_postprocess(a, gen))
        return self.top(self.merge(parts)), leaves

    def train(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int) -> tuple[dict[str, list[bytes]], dict[str, float]]:
        """Train on every batch in ``keys``; returns the released gradients per guest and stats."""
        msgs = self._received(keys, blobs_by_guest)
        grads: dict[str, list[bytes]] = {g: [] for g in self.guests}
        loss_sum, n = 0.0, 0
        if self.bottom is not None:
            self.bottom.train()
        self.top.train()
        for i, key in enumerate(keys):
            y = self.labels(key)
            logits, leaves = self._forward(key, {g: msgs[g][i].tensor for g in self.guests}, train=True)
            loss = F.cross_entropy(logits, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            ids = self.ids(key)
            for g in self.guests:
                mech = self.backward_mechanisms[g]
                gen = torch_generator(self.cfg.seed, "host", "release", g, *key.as_tuple(), device=self.device) \
                    if mech.random else None
                rel = mech.release(leaves[g].grad, gen)
                grads[g].append(encode(Message("gradients", "host", g, round_, key, ids, rel.value, rel.encoding)))
            self.optimizer.step()
            self.steps += 1
            loss_sum += loss.item() * len(y)
            n += len(y)
        return grads, {"loss_sum": loss_sum, "n": n}

    @torch.no_grad()
    def evaluate(self, keys, blobs_by_guest: dict[str, list[bytes]]) -> dict[str, float]:
        """Metric counts on the test batches ``keys`` (accuracy or hit@10) and the test loss."""
        msgs = self._received(keys, blobs_by_guest)
        if self.bottom is not None:
            self.bottom.eval()
        self.top.eval()
        hits, n, loss_sum = 0, 0, 0.0
        for i, key in enumerate(keys):
            y = self.labels(key)
            logits, _ = self._forward(key, {g: msgs[g][i].tensor for g in self.guests}, train=False)
            hits += batch_metric(logits, y, self.metric)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            n += len(y)
        return {"hits": hits, "n": n, "loss_sum": loss_sum}

    def report(self) -> dict[str, Any]:
        """End-of-run facts this party is willing to disclose (no data, no weights)."""
        return {"role": "host", "optimizer_steps": self.steps,
                "mechanisms": {g: m.describe() for g, m in self.backward_mechanisms.items()},
                "postprocess": self.act_postprocess.describe()}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            "bottom": self.bottom.state_dict() if self.bottom is not None else None,
            "top": self.top.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def import_state(self, state: dict[str, Any]) -> None:
        if self.bottom is not None:
            self.bottom.load_state_dict(state["bottom"])
        self.top.load_state_dict(state["top"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


def export_flat(party: GuestParty | HostParty) -> tuple[dict[str, np.ndarray], Any]:
    """A party's state as ``(arrays, json-able skeleton)`` (see :mod:`fl_split.state`)."""
    return flatten(party.export_state())


def import_flat(party: GuestParty | HostParty, arrays: dict[str, np.ndarray], skeleton: Any) -> None:
    party.import_state(unflatten(arrays, skeleton))
