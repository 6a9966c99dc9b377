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

import contextlib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_split.config import RunConfig
from fl_split.data.base import PartyData
from fl_split.errors import ProtocolError
from fl_split.merge import Merge
from fl_split.privacy.base import Mechanism, NoDefense, PostProcess, ReleaseStats

if TYPE_CHECKING:
    from fl_split.privacy.ledger import Ledger, LedgerEntry
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


def set_mode(module: nn.Module, train: bool) -> None:
    """``module.train(train)``, skipped when the module is already in that mode (the recursive
    switch costs ~0.1 ms per call on small models, paid per batch otherwise). Parties only ever
    switch whole models, so the top module's flag speaks for its submodules."""
    if module.training != train:
        module.train(train)


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


class MechanismSchedule:
    """The mechanism a party applies in each epoch (one object per epoch, built on first use).

    A constant schedule builds one object; the geometric schedule (001 §3.4) a new one per
    epoch with ``ε/2^epoch``. ``factory(epoch) -> Mechanism``.
    """

    def __init__(self, factory: Callable[[int], Mechanism] | Mechanism | None, constant: bool = True) -> None:
        if factory is None:
            factory = NoDefense()
        self._fixed = factory if isinstance(factory, Mechanism) else None
        self._factory = factory
        self._constant = constant
        self._cache: dict[int, Mechanism] = {}

    def __call__(self, epoch: int) -> Mechanism:
        if self._fixed is not None:
            return self._fixed
        e = 1 if self._constant else max(int(epoch), 1)
        if e not in self._cache:
            self._cache[e] = self._factory(e)
        return self._cache[e]


def make_dp_optimizer(cfg: RunConfig, modules: list[nn.Module]) -> torch.optim.Optimizer:
    """Opacus DP-SGD (per-sample clipping to ``--max-grad-norm`` + Gaussian noise of multiplier
    ``--sigma``) around the party's usual optimizer, over ``modules`` (already GradSampleModules).
    The noise generator is re-seeded before every step (:func:`_dp_seed`) so noise is
    deterministic per (run, party, batch) whatever the transport."""
    from opacus.optimizers import DPOptimizer

    params = [p for m in modules for p in m.parameters()]
    return DPOptimizer(make_optimizer(cfg, params), noise_multiplier=cfg.sigma, max_grad_norm=cfg.max_grad_norm,
                       expected_batch_size=cfg.batch_size, loss_reduction="mean")


@contextlib.contextmanager
def quiet_input_grad_warning():
    """Silence PyTorch's warning that a module's full backward hook fires although no input
    requires a gradient: Opacus' per-sample-gradient hooks (DP-SGD) raise it on every backward of
    a bottom model, whose input (raw features) never requires one — true and intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        yield


def dp_module(module: nn.Module) -> nn.Module:
    """``module`` made Opacus-compatible (BatchNorm → GroupNorm) and wrapped for per-sample grads."""
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    fixed = ModuleValidator.fix(module)
    errors = ModuleValidator.validate(fixed, strict=False)
    if errors:
        from fl_split.errors import ConfigError

        raise ConfigError("defense", "dpsgd", "a model Opacus supports", reason="; ".join(map(str, errors[:3])))
    return GradSampleModule(fixed, loss_reduction="mean")


def _cut_layer(module: nn.Module) -> nn.Module:
    """The last Linear/Conv layer of a bottom model: the cut layer whose neurons R3eLU's
    importance allocation scores (001 Eq. 8-9)."""
    last = None
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            last = m
    if last is None:
        raise ValueError("importance allocation needs a Linear or Conv cut layer in the bottom model")
    return last


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
    """Holds features only: a bottom model, its optimizer, its forward mechanism and its ledger.

    Privacy (SPEC §3, §5): every release is charged to :attr:`ledger` *before* anything is
    computed or leaves (costs do not depend on the data), for all batches of the request at once,
    so a refused request (``BudgetExceeded``) releases nothing. ``dpsgd`` trains the bottom with
    Opacus DP-SGD; ``frozen`` is 002's one-shot mode (pretrained bottom, no gradients back).
    """

    def __init__(self, name: str, cfg: RunConfig, schedule: BatchSchedule, data: PartyData,
                 bottom: nn.Module, cut_shape: tuple[int, ...],
                 mechanism: Mechanism | Callable[[int], Mechanism] | None = None,
                 grad_postprocess: PostProcess | None = None, device: torch.device | str = "cpu", *,
                 ledger: Ledger | None = None, dpsgd: bool = False, frozen: bool = False,
                 importance: bool = False, constant_schedule: bool = True) -> None:
        super().__init__(name, cfg, schedule, data, device)
        if not data.has_features:
            raise ValueError(f"{name}: a guest must hold feature columns")
        self.cut_shape = tuple(cut_shape)
        self.dpsgd = dpsgd
        self.frozen = frozen
        bottom = bottom.to(self.device)
        if frozen:
            bottom.requires_grad_(False)
        self.bottom = dp_module(bottom) if dpsgd else bottom
        self.optimizer = (make_dp_optimizer(cfg, [self.bottom]) if dpsgd
                          else make_optimizer(cfg, self.bottom.parameters()) if not frozen else None)
        self.mechanisms = MechanismSchedule(mechanism, constant_schedule)
        #: receiver-side post-processing of received gradients (denoising), identity by default
        self.grad_postprocess = grad_postprocess or PostProcess()
        self.ledger = ledger
        self.importance = None
        if importance:
            from fl_split.privacy.mechanisms import ImportanceTracker

            self.importance = ImportanceTracker(_cut_layer(self.bottom))
        self.steps = 0
        self.released = {"batches": 0, "records": 0}
        #: diagnostics of the releases (signal-to-noise ratio, noise scale), per epoch
        self.release_stats = ReleaseStats()
        self._pending: dict[BatchKey, _Pending] = {}

    @property
    def mechanism(self) -> Mechanism:
        """The first epoch's mechanism (what reports describe)."""
        return self.mechanisms(1)

    # -- forward ----------------------------------------------------------------------------
    def _charge(self, entries: list[LedgerEntry]) -> None:
        if self.ledger is not None and entries:
            self.ledger.charge(entries)

    def release(self, keys: list[BatchKey] | tuple[BatchKey, ...], round_: int) -> list[bytes]:
        """Compute and release the cut-layer output of each batch in ``keys``."""
        keys = list(keys)
        for key in keys:
            if key.phase == "train" and key in self._pending:
                raise ProtocolError(f"{self.name}: {key} was already released and awaits its gradient")
        rate = self.cfg.batch_size / self.schedule.n_train
        entries = [_entry(round_, key, "forward", cost, self.ids(key), rate)
                   for key in keys if (cost := self.mechanisms(key.epoch).cost()) is not None]
        self._charge(entries)  # raises BudgetExceeded before anything is computed or leaves
        blobs = []
        for key in keys:
            train = key.phase == "train" and not self.frozen
            x = self.rows(key)
            mech = self.mechanisms(key.epoch)
            if self.importance is not None and hasattr(mech, "set_importance"):
                mech.set_importance(self.importance.values)
            if train and not self.dpsgd:
                set_mode(self.bottom, True)
                v = self.bottom(x)
            else:
                # DP-SGD guests forward without the graph (Opacus must not capture activations
                # of this pass) and recompute when the gradient arrives
                set_mode(self.bottom, train)
                with torch.no_grad():
                    v = self.bottom(x)
            gen = self._generator("release", key) if mech.random else None
            rel = mech.release(v.detach(), gen)
            self.release_stats.add(key.epoch, rel.stats)
            blobs.append(encode(Message("activations", self.name, "host", round_, key, self.ids(key),
                                        rel.value, rel.encoding)))
            self.released["batches"] += 1
            self.released["records"] += len(v)
            if train:
                self._pending[key] = _Pending(round_, self.steps, rel.ctx, None if self.dpsgd else v)
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
        if self.dpsgd and msgs:
            rate = self.cfg.batch_size / self.schedule.n_train
            self._charge([_entry(-1 if round_ is None else round_, m.key, "update",
                                 dpsgd_cost(self.cfg), self.ids(m.key), rate) for m in msgs])
        for m in msgs:
            p = self._pending.pop(m.key)
            out = p.out if (p.out is not None and p.version == self.steps) else self._recompute(m.key)
            gen = self._generator("denoise", m.key) if self.grad_postprocess.random else None
            grad = self.grad_postprocess(m.tensor.to(self.device), gen)
            grad = self.mechanisms(m.key.epoch).local_grad(p.ctx, grad)
            self.optimizer.zero_grad(set_to_none=True)
            with quiet_input_grad_warning():
                out.backward(grad)
            if self.importance is not None:
                self.importance.update()
            if self.dpsgd:
                self.optimizer.generator = self._generator("dpsgd", m.key)
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
        set_mode(self.bottom, True)
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
        mech = self.mechanism
        return {"role": "guest", "optimizer_steps": self.steps, "mechanism": mech.describe(),
                "postprocess": self.grad_postprocess.describe(), "released": dict(self.released),
                "privacy": privacy_report(self.cfg, self.ledger, mech, self.dpsgd, self.released, "guest",
                                          int(np.prod(self.cut_shape)), self.release_stats)}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            "model": self.bottom.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "steps": self.steps,
            "released": dict(self.released),
            "pending": [[list(k.as_tuple()), p.round, p.version, p.ctx] for k, p in sorted(self._pending.items())],
            "ledger": self.ledger.export_state() if self.ledger is not None else None,
            "importance": self.importance.state_dict() if self.importance is not None else None,
            "release_stats": self.release_stats.state_dict(),
        }

    def import_state(self, state: dict[str, Any]) -> None:
        self.bottom.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.released = {k: int(v) for k, v in state["released"].items()}
        self._pending = {BatchKey(str(k[0]), int(k[1]), int(k[2])): _Pending(int(r), int(v), dict(ctx), None)
                         for k, r, v, ctx in state["pending"]}
        self.release_stats.load_state_dict(state["release_stats"])
        if self.ledger is not None:
            from fl_split.privacy.ledger import Ledger

            self.ledger = Ledger.from_state(state["ledger"])
        if self.importance is not None:
            self.importance.load_state_dict(state["importance"])


def _entry(round_: int, key: BatchKey, direction: str, cost, ids: np.ndarray, rate: float) -> "LedgerEntry":
    from fl_split.privacy.ledger import LedgerEntry

    return LedgerEntry(round_, key.as_tuple(), direction, cost, ids, rate)


@functools.lru_cache(maxsize=8)
def dpsgd_cost(cfg: RunConfig):
    """One DP-SGD step as seen by one record of the batch: a Gaussian mechanism of noise
    multiplier ``σ`` on its clipped (``--max-grad-norm``) per-sample gradient. One object per
    configuration (see :meth:`Mechanism.cost`)."""
    import dp_accounting

    from fl_split.privacy.base import PrivacyCost

    return PrivacyCost("dpsgd", dp_accounting.GaussianDpEvent(noise_multiplier=cfg.sigma), None,
                       sensitivity_l2=cfg.max_grad_norm,
                       params=(("noise_multiplier", cfg.sigma), ("max_grad_norm", cfg.max_grad_norm)))


def privacy_report(cfg: RunConfig, ledger: Ledger | None, mech: Mechanism, dpsgd: bool, released: dict,
                   role: str, cut_width: int, stats: ReleaseStats) -> dict[str, Any]:
    """A party's entry of the results' ``privacy`` block (SPEC §5 report), with the diagnostics of
    its releases (``release_stats``: signal-to-noise ratio and noise scale, overall and per epoch)."""
    desc = dict(mech.describe())
    if dpsgd:
        desc = {"name": "dpsgd", "noise_multiplier": cfg.sigma, "max_grad_norm": cfg.max_grad_norm,
                "library": "opacus"}
    desc["cut_width"] = cut_width
    cost = None if dpsgd else mech.cost()
    if cost is not None:
        desc.setdefault("sensitivity_l1", cost.sensitivity_l1)
        desc.setdefault("sensitivity_l2", cost.sensitivity_l2)
    out: dict[str, Any] = {"mechanism": desc}
    if ledger is None:
        what = "forward releases (cut-layer activations)" if role == "guest" else "backward releases (partial losses)"
        out.update(releases=released.get("records", 0), releases_per_record=None, delta=cfg.delta, epsilon=None,
                   accountant=cfg.accountant, epsilons={}, budget=None,
                   assumptions=[f"unprotected: this party's {what} are not perturbed; no differential "
                                f"privacy is claimed for them"], release_stats=stats.report())
        return out
    rep = ledger.report()
    out.update(rep)
    out["mechanism"] = desc
    out["release_stats"] = stats.report()
    if dpsgd:
        out.setdefault("assumptions", [])
        out["assumptions"] = list(out["assumptions"]) + [
            "DP-SGD protects what the party's trained parameters reveal; the cut-layer tensors it "
            "exchanges are computed from raw data and are not covered by this epsilon"]
    return out


class HostParty(_Party):
    """Holds the labels, optionally its own bottom, the merge layer and the top model.

    Privacy: the partial loss ``δ_g`` sent to guest ``g`` is released through
    ``backward_mechanisms[g]`` and charged to :attr:`ledger` (one release per batch per guest,
    all batches of a request charged before training on any). ``dpsgd`` trains the host's own
    parameters with Opacus. ``one_shot`` (002): the host keeps every received release by record
    and trains later epochs on that cache; nothing flows back to the guests.
    """

    def __init__(self, cfg: RunConfig, schedule: BatchSchedule, data: PartyData, bottom: nn.Module | None,
                 merge: Merge, top: nn.Module, guest_shapes: dict[str, tuple[int, ...]],
                 backward_mechanisms: dict[str, Mechanism | Callable[[int], Mechanism]] | None = None,
                 act_postprocess: PostProcess | None = None, device: torch.device | str = "cpu", *,
                 ledger: Ledger | None = None, dpsgd: bool = False, one_shot: bool = False,
                 constant_schedule: bool = True) -> None:
        super().__init__("host", cfg, schedule, data, device)
        if data.y_train is None:
            raise ValueError("the host must hold the labels")
        self.dpsgd = dpsgd
        bottom = bottom.to(self.device) if bottom is not None else None
        top = top.to(self.device)
        self.bottom = dp_module(bottom) if (dpsgd and bottom is not None) else bottom
        self.top = dp_module(top) if dpsgd else top
        self.merge = merge
        self.guest_shapes = {g: tuple(s) for g, s in guest_shapes.items()}
        self.guests = list(guest_shapes)
        modules = ([self.bottom] if self.bottom is not None else []) + [self.top]
        if dpsgd:
            self.optimizer = make_dp_optimizer(cfg, modules)
        else:
            self.optimizer = make_optimizer(cfg, [p for m in modules for p in m.parameters()])
        backward_mechanisms = backward_mechanisms or {}
        self.backward_mechanisms = {g: MechanismSchedule(backward_mechanisms.get(g), constant_schedule)
                                    for g in self.guests}
        #: receiver-side post-processing of received activations (denoising), identity by default
        self.act_postprocess = act_postprocess or PostProcess()
        self.ledger = ledger
        self.one_shot = one_shot
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self._cached: dict[str, np.ndarray] = {}
        self.steps = 0
        self.released = {"batches": 0, "records": 0}
        #: diagnostics of the backward releases (all guests together), per epoch
        self.release_stats = ReleaseStats()
        self.metric = data.metric

    # -- receiving ---------------------------------------------------------------------------
    def _received(self, keys, blobs_by_guest: dict[str, list[bytes]]) -> dict[str, list[torch.Tensor]]:
        """Decode and check every guest's messages for ``keys`` (before touching any state).

        In one-shot mode empty lists mean "use what you cached when these records were released".
        """
        if sorted(blobs_by_guest) != sorted(self.guests):
            raise ProtocolError(f"host: activations from {sorted(blobs_by_guest)}, expected {sorted(self.guests)}")
        out: dict[str, list[torch.Tensor]] = {}
        for g in self.guests:
            blobs = blobs_by_guest[g]
            if self.one_shot and not blobs and keys:
                out[g] = [self._from_cache(g, k) for k in keys]
                continue
            if len(blobs) != len(keys):
                raise ProtocolError(f"host: {len(blobs)} activation messages from {g}, expected {len(keys)}")
            out[g] = [decode(b).check(kind="activations", sender=g, receiver="host", key=k, ids=self.ids(k),
                                      sample_shape=self.guest_shapes[g]).tensor for b, k in zip(blobs, keys)]
        if self.one_shot:
            for g in self.guests:
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
            a = acts[g].to(self.device)
            if train and not self.one_shot:
                a.requires_grad_(True)
            leaves[g] = a
            gen = torch_generator(self.cfg.seed, "host", "denoise", g, *key.as_tuple(), device=self.device) \
                if self.act_postprocess.random else None
            parts.append(self.act_postprocess(a, gen))
        return self.top(self.merge(parts)), leaves

    # -- training ----------------------------------------------------------------------------
    def _entries(self, keys, round_: int) -> list[LedgerEntry]:
        rate = self.cfg.batch_size / self.schedule.n_train
        entries = []
        for key in keys:
            ids = self.ids(key)
            if not self.one_shot:
                for g in self.guests:
                    cost = self.backward_mechanisms[g](key.epoch).cost()
                    if cost is not None:
                        entries.append(_entry(round_, key, "backward", cost, ids, rate))
            if self.dpsgd:
                entries.append(_entry(round_, key, "update", dpsgd_cost(self.cfg), ids, rate))
        return entries

    def train(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int) -> tuple[dict[str, list[bytes]], dict[str, float]]:
        """Train on every batch in ``keys``; returns the released gradients per guest and stats."""
        keys = list(keys)
        msgs = self._received(keys, blobs_by_guest)
        entries = self._entries(keys, round_)
        if self.ledger is not None and entries:
            self.ledger.charge(entries)  # BudgetExceeded here: nothing trained, nothing released
        grads: dict[str, list[bytes]] = {g: [] for g in self.guests}
        loss_sum, n = 0.0, 0
        if self.bottom is not None:
            set_mode(self.bottom, True)
        set_mode(self.top, True)
        for i, key in enumerate(keys):
            y = self.labels(key)
            logits, leaves = self._forward(key, {g: msgs[g][i] for g in self.guests}, train=True)
            loss = F.cross_entropy(logits, y)
            self.optimizer.zero_grad(set_to_none=True)
            with quiet_input_grad_warning():
                loss.backward()
            ids = self.ids(key)
            if not self.one_shot:
                for g in self.guests:
                    mech = self.backward_mechanisms[g](key.epoch)
                    gen = torch_generator(self.cfg.seed, "host", "release", g, *key.as_tuple(), device=self.device) \
                        if mech.random else None
                    rel = mech.release(leaves[g].grad, gen)
                    self.release_stats.add(key.epoch, rel.stats)
                    grads[g].append(encode(Message("gradients", "host", g, round_, key, ids, rel.value, rel.encoding)))
                    self.released["batches"] += 1
                    self.released["records"] += len(ids)
            if self.dpsgd:
                self.optimizer.generator = torch_generator(self.cfg.seed, "host", "dpsgd", *key.as_tuple(),
                                                           device=self.device)
            self.optimizer.step()
            self.steps += 1
            loss_sum += loss.item() * len(y)
            n += len(y)
        return grads, {"loss_sum": loss_sum, "n": n}

    @torch.no_grad()
    def evaluate(self, keys, blobs_by_guest: dict[str, list[bytes]]) -> dict[str, float]:
        """Metric counts on the test batches ``keys`` (accuracy or hit@10) and the test loss."""
        keys = list(keys)
        msgs = self._received(keys, blobs_by_guest)
        if self.bottom is not None:
            set_mode(self.bottom, False)
        set_mode(self.top, False)
        hits, n, loss_sum = 0, 0, 0.0
        for i, key in enumerate(keys):
            y = self.labels(key)
            logits, _ = self._forward(key, {g: msgs[g][i] for g in self.guests}, train=False)
            hits += batch_metric(logits, y, self.metric)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            n += len(y)
        return {"hits": hits, "n": n, "loss_sum": loss_sum}

    def report(self) -> dict[str, Any]:
        """End-of-run facts this party is willing to disclose (no data, no weights)."""
        first = {g: m(1) for g, m in self.backward_mechanisms.items()}
        mech = next(iter(first.values())) if first else NoDefense()
        width = int(np.prod(next(iter(self.guest_shapes.values())))) if self.guest_shapes else 0
        return {"role": "host", "optimizer_steps": self.steps,
                "mechanisms": {g: m.describe() for g, m in first.items()},
                "postprocess": self.act_postprocess.describe(), "released": dict(self.released),
                "privacy": privacy_report(self.cfg, self.ledger, mech, self.dpsgd, self.released, "host", width,
                                          self.release_stats)}

    # -- state ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {
            "bottom": self.bottom.state_dict() if self.bottom is not None else None,
            "top": self.top.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "released": dict(self.released),
            "ledger": self.ledger.export_state() if self.ledger is not None else None,
            "release_stats": self.release_stats.state_dict(),
            "cache": {name: {"x": c["x"], "filled": torch.from_numpy(self._cached[name])}
                      for name, c in self._cache.items()},
        }

    def import_state(self, state: dict[str, Any]) -> None:
        if self.bottom is not None:
            self.bottom.load_state_dict(state["bottom"])
        self.top.load_state_dict(state["top"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.released = {k: int(v) for k, v in state["released"].items()}
        if self.ledger is not None:
            from fl_split.privacy.ledger import Ledger

            self.ledger = Ledger.from_state(state["ledger"])
        self.release_stats.load_state_dict(state["release_stats"])
        self._cache = {name: {"x": torch.as_tensor(c["x"])} for name, c in state["cache"].items()}
        self._cached = {name: np.asarray(torch.as_tensor(c["filled"]).numpy(), dtype=bool)
                        for name, c in state["cache"].items()}


def export_flat(party: GuestParty | HostParty) -> tuple[dict[str, np.ndarray], Any]:
    """A party's state as ``(arrays, json-able skeleton)`` (see :mod:`fl_split.state`)."""
    return flatten(party.export_state())


def import_flat(party: GuestParty | HostParty, arrays: dict[str, np.ndarray], skeleton: Any) -> None:
    party.import_state(unflatten(arrays, skeleton))
