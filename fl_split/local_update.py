"""How a party updates its own model: one policy object per party (plain, frozen, DP-SGD).

The papers change how a party trains its own parameters in two ways, and nothing else in a party
needs to know which one is in force:

* :class:`OptimizerUpdate` — the party's optimizer (SGD or Adam) on its parameters (spec §2);
* :class:`FrozenUpdate` — 002's one-shot mode: the guest's pretrained bottom is frozen, it never
  receives a gradient;
* :class:`DpSgdUpdate` — 001 §5's DP-SGD baseline (and ``--dp-sgd``): Opacus per-sample clipping
  and Gaussian noise around the party's optimizer; each step is a privacy event charged to the
  party's ledger (:meth:`LocalUpdate.cost`), the noise drawn from the party's private generator.

A policy owns the (possibly wrapped) modules and the optimizer; the party calls
:meth:`LocalUpdate.backward` and :meth:`LocalUpdate.step`.
"""

from __future__ import annotations

import copy
import sys
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.optim.optimizer as _optim
from torch import nn

from fl_split.privacy.base import PrivacyCost


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer every party uses for its own parameters (same settings for all)."""

    name: str = "adam"  # "sgd" | "adam"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0

    def make(self, params) -> torch.optim.Optimizer:
        """The optimizer, with PyTorch's multi-tensor (``foreach``) update on every device: on CPU,
        where PyTorch's default is the per-parameter loop, it gives bit-identical parameters (tested)
        and cuts the per-step cost, which a party pays once per batch on a small model."""
        defer_dynamo_import()
        params = [p for p in params if p.requires_grad]
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                                   foreach=True)
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay, foreach=True)


class _EagerUntilDynamo:
    """What PyTorch's lazy ``torch._disable_dynamo`` wrapper calls for one optimizer method: the
    method itself while ``torch._dynamo`` has not been imported — no compiled frame can then be
    running, so "run this eagerly, do not trace it" is exactly a plain call — and, once anything
    has imported it, ``torch._dynamo.disable(method)``, as PyTorch would."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.disabled = None

    def __call__(self, *args, **kwargs):
        if self.disabled is None:
            import sys

            if "torch._dynamo" not in sys.modules:
                return self.fn(*args, **kwargs)
            self.disabled = sys.modules["torch._dynamo"].disable(self.fn, True, wrapping=False)
        return self.disabled(*args, **kwargs)


#: the optimizer methods PyTorch wraps in ``torch._disable_dynamo`` that a party calls
_DYNAMO_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def defer_dynamo_import() -> None:
    """Keep the first optimizer of a process from importing ``torch._dynamo`` (issue 18: start-up).

    ``torch.optim.Optimizer.add_param_group`` (and ``zero_grad``, ``state_dict``,
    ``load_state_dict``) are wrapped in ``torch._disable_dynamo``, which imports ``torch._dynamo``
    on the method's first call — 1–2.5 s and ~900 modules on the 2-core machine, paid by the local
    engine and by every Flower ClientApp actor when it builds its party, for a compiler fl_split
    never uses. The wrapper caches what to call on the method (``__dynamo_disable``); this fills
    that cache with :class:`_EagerUntilDynamo`, which calls the method directly until
    ``torch._dynamo`` is imported and behaves as PyTorch's wrapper from then on. Nothing is
    changed if ``torch._dynamo`` is already imported, or if PyTorch's wrappers are not the ones
    expected (the cache is then PyTorch's own). Parameters and results are unchanged
    (``tests/test_flower_startup.py``)."""
    import sys

    if "torch._dynamo" in sys.modules:
        return
    for name in _DYNAMO_WRAPPED:
        fn = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
        if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
            setattr(fn, "__dynamo_disable", _EagerUntilDynamo(fn))


def backward_through(out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """``out.backward(grad)`` — the chain rule through a party's own graph with the gradient another
    party sent for ``out`` (eq. of the split backward: dL/dθ = (∂out/∂θ)ᵀ · grad) — taken as the
    backward of the scalar ``sum(out ⊙ grad)``, whose gradient with respect to ``out`` is ``1 · grad``:
    the same numbers, bit for bit (the product's backward multiplies ``grad`` by ones).

    Why not ``out.backward(grad)``: for a tensor gradient PyTorch's ``_make_grads`` imports
    ``torch.fx.experimental.symbolic_shapes`` and sympy (~480 modules: 0.36 s of CPU on a quiet
    2-core machine, 1–1.5 s under load) the first time a process does it — once per Ray actor, in
    start-up or in the first epoch (issue 18). A scalar backward does not
    (``tests/test_flower_startup.py``)."""
    if grad is None:
        out.backward()
        return
    if grad.shape != out.shape:  # a product would broadcast; out.backward(grad) refuses, and so does this
        raise RuntimeError(f"Mismatch in shape: grad_output[0] has a shape of {tuple(grad.shape)} and "
                           f"output[0] has a shape of {tuple(out.shape)}.")
    torch.sum(out * grad).backward()


_QUIET_FILTER: tuple | None = None


def quiet_input_grad_warning() -> None:
    """Silence PyTorch's warning that a module's full backward hook fires although no input
    requires a gradient: Opacus' per-sample-gradient hooks (DP-SGD) raise it on every backward of
    a bottom model, whose input (raw features) never requires one — true and intended.

    The filter matches only that warning raised from this module's ``backward`` call, and it is
    installed, not swapped in and out: ``warnings.catch_warnings`` is not thread-safe, and two
    parties stepping in threads of one process (the in-process Flower simulation) restored each
    other's filters, so the warning leaked. It is put back when something reset the filter list
    (a test framework's ``catch_warnings``), and added only then: a change to the list makes every
    "once per location" warning show again."""
    global _QUIET_FILTER
    if _QUIET_FILTER is not None and any(f is _QUIET_FILTER for f in warnings.filters):
        return
    warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning,
                            module=r"fl_split\.local_update$")
    _QUIET_FILTER = warnings.filters[0]


_FIRST_STEP = threading.Lock()
_stepped = False


def _first_step_locked(call) -> None:
    """Run an optimizer's ``step`` or ``zero_grad`` — under a lock until one has imported ``torch._dynamo``: torch
    imports it lazily on an optimizer's first such call, and two parties doing so in threads of one process (the
    inline Flower grid, the direct data plane's guests) could meet a half-imported module and fail ("partially
    initialized module 'torch._dynamo' has no attribute 'disable'")."""
    global _stepped
    if _stepped:
        call()
        return
    with _FIRST_STEP:
        call()
        _stepped = "torch._dynamo" in sys.modules


class LocalUpdate:
    """Base policy: the modules are trained by :attr:`optimizer` (see subclasses)."""

    name = "optimizer"
    #: the party trains these modules at all
    trains = True
    #: a guest may keep the autograd graph of its release forward and backpropagate through it
    #: when the gradient arrives (Opacus needs one forward per backward: DP-SGD recomputes)
    keeps_release_graph = True

    def __init__(self, modules: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> None:
        self.modules = modules
        self.optimizer = optimizer

    def cost(self) -> PrivacyCost | None:
        """The privacy cost of one step for one record of its batch (``None``: no claim)."""
        return None

    def zero_grad(self) -> None:
        _first_step_locked(lambda: self.optimizer.zero_grad(set_to_none=True))

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        backward_through(out, grad)

    def step(self, gen: torch.Generator | None = None) -> None:
        _first_step_locked(self.optimizer.step)

    def describe(self) -> dict:
        return {"name": self.name}

    def state_dict(self) -> dict | None:
        return self.optimizer.state_dict() if self.optimizer is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state)

    def snapshot(self) -> tuple:
        """What :meth:`undo_step` needs to take back the next :meth:`step`: the parameters and the
        optimizer state (a resumed party undoes a DP-SGD step that must not keep its logged
        noise counter, ``fl_split.parties``, issue 16)."""
        params = [p.detach().clone() for m in self.modules for p in m.parameters()]
        return params, copy.deepcopy(self.state_dict())

    def undo_step(self, snap: tuple) -> None:
        """Put back the parameters and optimizer state of ``snap``; the gradients are kept, so
        :meth:`step` can be taken again (with other noise)."""
        params, opt = snap
        with torch.no_grad():
            for p, old in zip((p for m in self.modules for p in m.parameters()), params):
                p.copy_(old)
        self.load_state_dict(copy.deepcopy(opt))


def _unwrapped_step(optimizer: torch.optim.Optimizer):
    """The update function that ``optimizer.step`` wraps (``Adam.step`` / ``SGD.step`` as written),
    or ``None`` when it cannot be found safely. ``Optimizer.step`` is wrapped twice per call: a
    profiler record with step-hook dispatch, and a grad-mode switch with a ``torch.compile`` graph
    break; together ~0.05 ms, paid per batch by every party (the monolithic model pays it once)."""
    cls = type(optimizer)
    if cls not in (torch.optim.SGD, torch.optim.Adam) or optimizer.defaults.get("differentiable", False):
        return None
    fn = cls.step
    for _ in range(4):
        if not hasattr(fn, "__wrapped__"):
            break
        fn = fn.__wrapped__
    if fn is cls.step or getattr(fn, "__qualname__", "") != f"{cls.__name__}.step":
        return None
    return fn


class OptimizerUpdate(LocalUpdate):
    """The party's own SGD/Adam on all its parameters.

    :meth:`step` calls the optimizer's update function directly (under ``torch.no_grad``, as
    ``Optimizer.step`` does) when no step hook is registered anywhere: the same arithmetic, without
    the per-call profiler record (see :func:`_unwrapped_step`). :meth:`zero_grad` sets every
    gradient to ``None``, as ``zero_grad(set_to_none=True)`` does."""

    def __init__(self, modules: list[nn.Module], settings: OptimizerSettings) -> None:
        super().__init__(modules, settings.make(p for m in modules for p in m.parameters()))
        self.settings = settings
        self._update = _unwrapped_step(self.optimizer)

    def step(self, gen: torch.Generator | None = None) -> None:
        opt = self.optimizer
        if (self._update is None or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _optim._global_optimizer_pre_hooks or _optim._global_optimizer_post_hooks):
            _first_step_locked(opt.step)
            return
        with torch.no_grad():
            self._update(opt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.settings.name

    def zero_grad(self) -> None:
        # what ``optimizer.zero_grad(set_to_none=True)`` does for a plain optimizer, without its
        # per-call wrappers (profiler record, dynamo guard: ~0.05 ms, paid per batch and party)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None


class FrozenUpdate(LocalUpdate):
    """002's one-shot guest: a pretrained, frozen bottom (no gradient ever flows back)."""

    name = "frozen"
    trains = False
    keeps_release_graph = False

    def __init__(self, modules: list[nn.Module]) -> None:
        for m in modules:
            m.requires_grad_(False)
        super().__init__(modules, None)

    def zero_grad(self) -> None:  # pragma: no cover - never called on a frozen party
        raise RuntimeError("a frozen model is never updated")

    backward = step = zero_grad  # type: ignore[assignment]


class DpSgdUpdate(LocalUpdate):
    """Opacus DP-SGD: per-sample gradients clipped to ``max_grad_norm``, Gaussian noise of
    multiplier ``noise_multiplier`` added to their sum, around the party's optimizer (001 §5).

    The modules are wrapped in ``GradSampleModule`` (use :attr:`modules`, not the originals). The
    noise comes from the generator the party passes to :meth:`step` (drawn from its secret, per
    batch), so it is reproducible with ``--private-seed`` and unpredictable otherwise. Each step
    costs :func:`fl_split.privacy.dpsgd.dpsgd_cost` for the records of its batch. The caller must
    have refused record-coupling modules (BatchNorm) before (``fl_split.privacy.validate``).
    """

    name = "dpsgd"
    keeps_release_graph = False

    def __init__(self, modules: list[nn.Module], settings: OptimizerSettings, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: int) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        wrapped = [GradSampleModule(m, loss_reduction="mean") for m in modules]
        base = settings.make(p for m in wrapped for p in m.parameters())
        super().__init__(wrapped, DPOptimizer(base, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                              expected_batch_size=expected_batch_size, loss_reduction="mean"))
        self.settings = settings
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self._cost = None

    def cost(self) -> PrivacyCost:
        if self._cost is None:
            from fl_split.privacy.dpsgd import dpsgd_cost

            self._cost = dpsgd_cost(self.noise_multiplier, self.max_grad_norm)
        return self._cost

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        quiet_input_grad_warning()  # Opacus' hooks on a bottom whose input needs no gradient
        backward_through(out, grad)

    def step(self, gen: torch.Generator | None = None) -> None:
        if gen is None:
            raise ValueError("DP-SGD needs the party's private generator for its noise")
        self.optimizer.generator = gen
        _first_step_locked(self.optimizer.step)

    def undo_step(self, snap: tuple) -> None:
        """As :meth:`LocalUpdate.undo_step`; Opacus' clipped sums are dropped and its per-sample
        gradients unmarked, so the next step clips them again and adds new noise (Opacus marks
        them to refuse a second step on the same gradients, which is what a redone step is)."""
        super().undo_step(snap)
        for p in self.optimizer.params:
            p.summed_grad = None
            gs = getattr(p, "grad_sample", None)
            for t in (gs if isinstance(gs, list) else [gs]):
                if isinstance(t, torch.Tensor) and hasattr(t, "_processed"):
                    del t._processed

    def describe(self) -> dict:
        return {"name": self.name, "optimizer": self.settings.name, "noise_multiplier": self.noise_multiplier,
                "max_grad_norm": self.max_grad_norm, "library": "opacus"}
