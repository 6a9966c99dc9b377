"""Boundary mechanisms: Laplace, Gaussian, R3eLU and randomized response (SPEC §3).

Every mechanism works on a batch ``t`` of shape ``(B, *sample_shape)``; one *record's tensor* is
one sample's slice, of ``d = prod(sample_shape)`` elements (the mechanism's ``width``). All draws
come from the generator the caller passes (seeded per party, batch and purpose), on the device of
the input, with no Python loop over samples or elements.

**What epsilon means here.** ``epsilon`` is the privacy cost of releasing **one record's whole
cut-layer tensor once** (not per element): the noise of every mechanism is calibrated to the
sensitivity of the whole ``d``-element tensor. Papers 002 (Laplace, randomized response) state
a per-element epsilon; their ``ε`` corresponds to our ``d·ε``. ``cost()`` returns a
:class:`~fl_split.privacy.base.PrivacyCost` whose ``dp_event`` (``dp_accounting``) describes
that single release, for the accountants.

**Neighbouring relation.** A record's tensor is replaced by any other admissible tensor (the
sensitivities below are worst cases over *all* pairs of inputs). ``dp_accounting``'s PLD/RDP
accountants accept the randomized-response events these mechanisms use only under
``NeighborRel.REPLACE_ONE``/``REPLACE_SPECIAL``, and Laplace events only under
``ADD_OR_REMOVE_ONE``/``REPLACE_SPECIAL``: account with ``REPLACE_SPECIAL``.

Conventions shared by all mechanisms (details in ``docs/mechanisms.md``):

* ``release(t, gen)`` returns the released tensor (same shape and dtype as ``t``), the context
  its local derivative needs (kept by the sender) and diagnostics ``stats``; ``snr`` is always
  *mean |signal element| / noise scale* (Laplace ``b``, Gaussian ``σ``), see each class;
* ``local_grad(ctx, grad)`` maps the gradient w.r.t. the released tensor back to the
  mechanism's input (only used by guests on forward releases);
* Laplace noise is drawn by inverting the CDF of one float32 uniform per element; the uniform
  is floored at ``2**-24``, so ``|noise| ≤ 16.64·b`` (a tail truncation at probability
  ``2**-24``; floating-point side channels are out of scope, as in every float DP library).
"""

from __future__ import annotations

import math

import dp_accounting
import torch
from torch import nn

from fl_split.errors import ConfigError
from fl_split.privacy.base import Mechanism, PrivacyCost, Release
from fl_split.privacy.ledger import pure_dp_event

DIRECTIONS = ("forward", "backward")
ALLOCATIONS = ("uniform", "importance", "importance-tight")

#: smallest uniform used by the Laplace sampler (float32 ``torch.rand`` resolution)
_U_FLOOR = 2.0 ** -24


# -- validation helpers -------------------------------------------------------------------------
def _positive(key: str, value, what: str = "a finite number > 0") -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, value, what) from None
    if not (math.isfinite(x) and x > 0):
        raise ConfigError(key, value, what)
    return x


def _width(width) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"mechanism width must be a positive int (elements per record), got {width!r}")
    return int(width)


def _direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"mechanism direction must be one of {DIRECTIONS}, got {direction!r}")
    return direction


def _flat(t: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """``t`` as ``(B, d)`` after checking that each sample has ``width`` elements."""
    if t.dim() < 2:
        raise ValueError(f"{name}: expected a batch of shape (B, *sample_shape), got shape {tuple(t.shape)}")
    d = t[0].numel() if t.shape[0] else int(math.prod(t.shape[1:]))
    if d != width:
        raise ValueError(f"{name}: samples have {d} elements, the mechanism was built for width {width}")
    return t.detach().reshape(t.shape[0], width)


def unit_laplace(shape, gen: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    """``Lap(0, 1)`` samples by CDF inversion of one uniform each: ``±(−log(1 − 2|u − ½|))``."""
    w = torch.rand(shape, generator=gen, device=device, dtype=dtype) - 0.5
    mag = w.abs().mul_(-2.0).add_(1.0).clamp_min_(_U_FLOOR).log_()  # log(1 − 2|w|) ≤ 0
    return mag.copysign_(w)  # |log(1 − 2|w|)| with the sign of w (the law is symmetric)


def _mean_abs(x: torch.Tensor) -> float:
    return float(x.abs().mean()) if x.numel() else 0.0


# -- Laplace ------------------------------------------------------------------------------------
class Laplace(Mechanism):
    """Laplace mechanism on a bounded tensor (001 baseline, 002 §3.2 Eq. 1, 003 App. B.1).

    Each element is **clipped** to ``[-bound, bound]`` (002 zeroes out-of-range elements instead;
    clipping keeps more signal and has the same sensitivity — SPEC §3 allows either), then
    ``Lap(0, b)`` is added to every element. Forward and backward releases are the same
    operation. A record's tensor has L1 sensitivity ``Δ1 = 2·bound·d``, so ``b = Δ1/ε`` or, when
    the scale is given (003 Table 3's ``b``), ``ε = Δ1/b``.

    ``local_grad`` is the clip's derivative: 1 where ``|v| < bound``, 0 elsewhere.
    """

    name = "laplace"
    random = True

    def __init__(self, width: int, direction: str, bound: float, epsilon: float | None = None,
                 b: float | None = None) -> None:
        self.width = _width(width)
        self.direction = _direction(direction)
        self.bound = _positive("clip-c", bound)
        if (epsilon is None) == (b is None):
            raise ValueError("Laplace needs exactly one of epsilon (--epsilon) and b (--laplace-b), "
                             f"got epsilon={epsilon!r}, b={b!r}")
        self.sensitivity_l1 = 2.0 * self.bound * self.width
        if epsilon is not None:
            self.epsilon = _positive("epsilon", epsilon)
            self.b = self.sensitivity_l1 / self.epsilon
        else:
            self.b = _positive("laplace-b", b)
            self.epsilon = self.sensitivity_l1 / self.b

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = _flat(t, self.width, self.name)
        clipped = flat.clamp(-self.bound, self.bound)
        out = unit_laplace(flat.shape, gen, flat.device, flat.dtype).mul_(self.b).add_(clipped).reshape(t.shape)
        ctx = {}
        if self.direction == "forward":
            ctx["mask"] = (flat.abs() < self.bound).reshape(t.shape)
        stats = {"snr": _mean_abs(clipped) / self.b, "noise_scale": self.b}
        return Release(value=out, ctx=ctx, encoding=self.encoding, stats=stats)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        mask = ctx.get("mask")
        return grad if mask is None else grad * mask.to(device=grad.device, dtype=grad.dtype)

    def describe(self) -> dict:
        return {"name": self.name, "direction": self.direction, "width": self.width, "bound": self.bound,
                "bounding": "clip", "epsilon": self.epsilon, "b": self.b, "noise_scale": self.b,
                "sensitivity_l1": self.sensitivity_l1}

    def privacy_cost(self) -> PrivacyCost:
        return PrivacyCost("laplace", dp_accounting.LaplaceDpEvent(noise_multiplier=self.b / self.sensitivity_l1),
                           epsilon=self.sensitivity_l1 / self.b, sensitivity_l1=self.sensitivity_l1,
                           params=(("b", self.b), ("bound", self.bound), ("width", self.width),
                                   ("direction", self.direction)))


# -- Gaussian -----------------------------------------------------------------------------------
class Gaussian(Mechanism):
    """Gaussian noise injection (000/003 §3.3).

    Forward: the input is the output of a ``tanh`` cut layer; it is clamped to ``[-bound, bound]``
    (a no-op for tanh with the default ``bound=1``) and ``N(0, σ²)`` is added to every element.
    Any two records' tensors differ by at most ``2·bound·√d`` in L2 (003: ``2√d``).

    Backward: each sample's partial loss ``δ`` is clipped to L2 norm ``≤ bound`` (``δ ·
    min(1, bound/‖δ‖₂)``) and ``N(0, σ²)`` is added; any two vectors of the ball differ by at
    most ``2·bound``.

    The noise multiplier is ``σ/Δ2``; the mechanism is (ε, δ)-DP only, so ``cost().epsilon`` is
    ``None`` and the accountant derives ε from the ``GaussianDpEvent``. ``local_grad`` is the
    identity (tanh's derivative is part of the guest's bottom model).
    """

    name = "gaussian"
    random = True

    def __init__(self, width: int, direction: str, sigma: float, bound: float = 1.0) -> None:
        self.width = _width(width)
        self.direction = _direction(direction)
        self.sigma = _positive("sigma", sigma)
        self.bound = _positive("clip-c", bound)
        if self.direction == "forward":
            self.sensitivity_l2 = 2.0 * self.bound * math.sqrt(self.width)
        else:
            self.sensitivity_l2 = 2.0 * self.bound

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = _flat(t, self.width, self.name)
        if self.direction == "forward":
            signal = flat.clamp(-self.bound, self.bound)
        else:
            norms = flat.norm(dim=1, keepdim=True)
            signal = flat * (self.bound / norms.clamp_min(self.bound))  # factor min(1, bound/‖δ‖)
        noise = torch.randn(flat.shape, generator=gen, device=flat.device, dtype=flat.dtype).mul_(self.sigma)
        out = (signal + noise).reshape(t.shape)
        return Release(value=out, encoding=self.encoding,
                       stats={"snr": _mean_abs(signal) / self.sigma, "noise_scale": self.sigma})

    def describe(self) -> dict:
        return {"name": self.name, "direction": self.direction, "width": self.width, "sigma": self.sigma,
                "bound": self.bound, "bounding": "clamp" if self.direction == "forward" else "l2-clip",
                "noise_scale": self.sigma, "sensitivity_l2": self.sensitivity_l2,
                "noise_multiplier": self.sigma / self.sensitivity_l2}

    def privacy_cost(self) -> PrivacyCost:
        return PrivacyCost("gaussian", dp_accounting.GaussianDpEvent(noise_multiplier=self.sigma / self.sensitivity_l2),
                           epsilon=None, sensitivity_l2=self.sensitivity_l2,
                           params=(("sigma", self.sigma), ("bound", self.bound), ("width", self.width),
                                   ("direction", self.direction)))


# -- R3eLU --------------------------------------------------------------------------------------
def clip_k(v: torch.Tensor, c: float, k: int) -> torch.Tensor:
    """``ClipK(v, C, K)`` (001 §3.2, SPEC §3) on a batch ``(B, d)``: per sample keep the ``k``
    largest entries, zero the rest, clip the kept ones to ``[0, C]``.

    So ``0 ≤ v̂_i ≤ C`` with at most ``K`` non-zeros (Cor. 1). Ties at the K-th value are broken
    as :func:`torch.topk` breaks them (an implementation-defined but deterministic choice of
    exactly ``k`` indices).
    """
    return _clip_k(v, c, k)[0]


def _clip_k(v: torch.Tensor, c: float, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v̂, top-K indices, top-K values)`` of :func:`clip_k` (one ``topk`` for all three)."""
    vals, idx = torch.topk(v, k, dim=1, sorted=False)
    return torch.zeros_like(v).scatter_(1, idx, vals.clamp(0.0, c)), idx, vals


def activation_probability(ratio: torch.Tensor, eps_p: float, k: int) -> torch.Tensor:
    """Eq. 4/6/10: ``p = ½ + ratio·(e^{ε_p/K}/(1+e^{ε_p/K}) − ½)`` for ``ratio ∈ [0, 1]``."""
    q = 1.0 / (1.0 + math.exp(-eps_p / k))  # e^a/(1+e^a), computed without overflow
    return 0.5 + ratio * (q - 0.5)


def _row_ratio(x: torch.Tensor) -> torch.Tensor:
    """``x_i/‖x‖_∞`` per row of a non-negative ``(B, d)`` tensor; 0 on rows that are all zero."""
    m = x.amax(dim=1, keepdim=True)
    return torch.where(m > 0, x / m.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(x))


def geometric_epsilon(eps_total: float, i: int) -> float:
    """Per-iteration budget of the geometric schedule (001 §3.4): ``ε_i = ε_T/2^i``, ``i ≥ 1``.

    The first ``n`` budgets sum to ``ε_T·(1 − 2^{-n}) < ε_T``, so any number of iterations
    stays within the total budget by sequential composition.
    """
    eps_total = _positive("epsilon", eps_total)
    if isinstance(i, bool) or int(i) != i or i < 1:
        raise ValueError(f"geometric_epsilon: iteration index must be an int >= 1 (1-based), got {i!r}")
    return eps_total / 2.0 ** int(i)


class R3eLU(Mechanism):
    """Randomized-response ReLU (001 §3, Alg. 1/2, Eq. 4–6, 10, Cor. 1–6; SPEC §3).

    ``ε = ε_p + ε_l`` with ``ε_p = eps_p_fraction·ε`` (randomized response of the activation
    state) and ``ε_l`` (Laplace, scale ``2KC/ε_l``). ``K`` defaults to ``width // 2`` (at least 1).

    * **Forward** (Alg. 1, guest, on the cut layer's pre-activation ``v``): ``v̂ = ClipK(v, C, K)``;
      ``p_i`` by Eq. 4; with probability ``p_i`` output ``max(v̂_i + Lap(0, 2KC/ε_l), 0)``, else 0.
      The paper draws ``r ~ N(0,1)`` and tests ``r < p_i``, which does not activate with
      probability ``p_i``; we draw ``r ~ U(0,1)`` (SPEC fix).
      ``ctx["mask"]`` marks elements that were activated, in the top-K, unclipped
      (``0 < v < C``) and positive after noise: the only ones through which the output depends
      on ``v`` (SPEC "guest-side local derivative"); ``local_grad`` multiplies by it.
    * **Backward** (Alg. 2, host, on ``δ``): ``|δ̂| = ClipK(|δ|, C, K)``; ``p_i`` by Eq. 6 from
      ``|δ̂_i|/‖|δ̂|‖_∞``; keep ``sign(δ_i)·|δ̂_i|`` with probability ``p_i``, else 0; then add
      ``Lap(0, 2KC/ε_l)`` to **every** element. ``local_grad`` is the identity.
    * **Importance allocation** (``allocation="importance"``, §3.4): after
      :meth:`set_importance` with neuron importances ``U`` (see :class:`ImportanceTracker`),
      ``p_i`` uses ``U_i/‖U‖_∞`` instead of the data ratio (Eq. 10) and the Laplace budget is split
      across features (Cor. 6): feature ``i`` gets ``ε_l·w_i`` and scale ``2KC/(ε_l·w_i)``, with
      ``w_i = (1 − f)·U_i/ΣU + f/d`` (``f = importance_floor``: a floor so features of zero
      importance get a finite scale; ``Σ w_i = 1`` so the total stays ``ε_l``). While ``U`` is
      all zeros (nothing learned yet) the mechanism behaves exactly as ``uniform``.
      ``allocation="importance-tight"`` is our variant with the same proportions and the
      smallest scales that still cost ``ε_l`` (see :meth:`noise_scales`).

    ``cost()``: pure ``ε``-DP (Cor. 3/6), as the composition of an ``ε_p``-DP event (the
    activation state) and a Laplace event of noise multiplier ``(2KC/ε_l)/(2KC) = 1/ε_l``. Under
    either importance allocation the per-feature scales keep ``Σ_i |Δ_i|/b_i ≤ ε_l`` for every
    neighbour pair, i.e. unit Laplace noise on a tensor of L1 sensitivity ``ε_l``: the same event.
    """

    name = "r3elu"
    random = True

    def __init__(self, width: int, direction: str, epsilon: float, c: float, k: int | None = None,
                 eps_p_fraction: float = 0.5, allocation: str = "uniform", importance_floor: float = 0.1) -> None:
        self.width = _width(width)
        self.direction = _direction(direction)
        self.epsilon = _positive("epsilon", epsilon)
        self.c = _positive("clip-c", c)
        if k is None:
            k = max(self.width // 2, 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.width:
            raise ConfigError("top-k", k, f"an integer in [1, {self.width}] (the cut width)")
        self.k = int(k)
        f = float(eps_p_fraction)
        if not 0.0 < f < 1.0:
            raise ValueError(f"R3eLU eps_p_fraction must be in (0, 1) (share of epsilon for the randomized "
                             f"response; the rest goes to the Laplace noise), got {eps_p_fraction!r}")
        self.eps_p_fraction = f
        self.eps_p = f * self.epsilon
        self.eps_l = self.epsilon - self.eps_p
        if allocation not in ALLOCATIONS:
            raise ConfigError("allocation", allocation, " or ".join(ALLOCATIONS))
        self.allocation = allocation
        if not 0.0 < float(importance_floor) <= 1.0:
            raise ValueError(f"R3eLU importance_floor must be in (0, 1], got {importance_floor!r}")
        self.importance_floor = float(importance_floor)
        self.sensitivity_l1 = 2.0 * self.k * self.c  # Cor. 1
        self.scale = self.sensitivity_l1 / self.eps_l  # uniform Laplace scale 2KC/ε_l
        self._importance = torch.zeros(self.width)

    # importance allocation ---------------------------------------------------------------------
    def set_importance(self, u: torch.Tensor) -> None:
        """Store neuron importances ``U ≥ 0`` (001 Eq. 9), used when ``allocation="importance"``.

        ``u`` has ``width`` entries, or one per output channel of a conv cut layer (a divisor of
        ``width``): it is then broadcast over that channel's spatial positions, channel-major as
        ``(C, H, W)`` flattens. Ignored by a ``uniform`` mechanism.
        """
        u = torch.as_tensor(u).detach().reshape(-1).to(dtype=torch.float32)
        n = u.numel()
        if n == 0 or self.width % n:
            raise ValueError(f"R3eLU.set_importance: got {n} importances for a cut width of {self.width} "
                             f"(need {self.width} or a divisor of it, one per output channel)")
        if not bool(torch.isfinite(u).all()) or bool((u < 0).any()):
            raise ValueError("R3eLU.set_importance: importances must be finite and >= 0")
        self._importance = u.repeat_interleave(self.width // n) if n != self.width else u.clone()

    @property
    def importance(self) -> torch.Tensor:
        return self._importance.clone()

    def _uses_importance(self) -> bool:
        return self.allocation != "uniform" and bool(self._importance.sum() > 0)

    def feature_weights(self) -> torch.Tensor:
        """Cor. 6 budget shares ``w_i`` (sum 1): ``(1 − f)·U_i/ΣU + f/d``; ``1/d`` each while no
        importance is set or under ``uniform``."""
        if not self._uses_importance():
            return torch.full((self.width,), 1.0 / self.width)
        u = self._importance.double()
        w = (1.0 - self.importance_floor) * u / u.sum() + self.importance_floor / self.width
        return w.float()

    def feature_epsilons(self) -> torch.Tensor:
        """Laplace budget of each feature under ``importance`` (Cor. 6): ``ε_l·w_i``, summing to ``ε_l``."""
        return self.eps_l * self.feature_weights()

    def noise_scales(self) -> torch.Tensor:
        """Per-feature Laplace scales.

        * ``uniform`` (or no importance yet): ``2KC/ε_l`` for every element (Alg. 1/2);
        * ``importance`` (Cor. 6 as published): ``2KC/(ε_l·w_i)`` — each feature's share
          ``ε_l·w_i`` is calibrated to the *whole-vector* sensitivity ``2KC``, which is valid but
          conservative: the worst-case loss is only ``ε_l·S_{2K}(w)/(2K) ≤ ε_l`` (forward; ``S_m``
          below); with equal shares ``w_i = 1/d`` that is ``ε_l/d`` and the noise is ``d`` times
          the uniform one;
        * ``importance-tight`` (our variant, not in the paper): same proportions, with the
          common factor set so the worst neighbour pair loses exactly ``ε_l``:
          ``C·S_{2K}(w)/(ε_l·w_i)`` forward (elements differ by ≤ C, at most 2K of them) and
          ``2C·S_K(w)/(ε_l·w_i)`` backward (signed elements differ by ≤ 2C, L1 ≤ 2KC), where
          ``S_m(w)`` is the sum of the ``m`` largest shares. With equal shares both equal ``2KC/ε_l``.
        """
        if not self._uses_importance():
            return torch.full((self.width,), self.scale)
        w = self.feature_weights().double()
        if self.allocation == "importance":
            return (self.sensitivity_l1 / (self.eps_l * w)).float()
        top = torch.sort(w, descending=True).values
        if self.direction == "forward":
            factor = self.c * float(top[: min(2 * self.k, self.width)].sum())
        else:
            factor = 2.0 * self.c * float(top[: self.k].sum())
        return (factor / (self.eps_l * w)).float()

    def probabilities(self, vhat: torch.Tensor) -> torch.Tensor:
        """``p`` of Eq. 4/6 (from ``v̂_i/‖v̂‖_∞``) or Eq. 10 (from ``U_i/‖U‖_∞``) for ``(B, d)`` ``v̂ ≥ 0``."""
        if self._uses_importance():
            u = self._importance.to(device=vhat.device, dtype=vhat.dtype)
            return activation_probability(u / u.max(), self.eps_p, self.k).expand_as(vhat)
        return activation_probability(_row_ratio(vhat), self.eps_p, self.k)

    # release -----------------------------------------------------------------------------------
    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = _flat(t, self.width, self.name)
        dev, dt = flat.device, flat.dtype
        if self._uses_importance():
            scale = self.noise_scales().to(device=dev, dtype=dt)  # (d,), broadcast over the batch
            mean_scale = float(scale.mean())
        else:
            scale, mean_scale = self.scale, self.scale
        if self.direction == "forward":
            vhat, idx, vals = _clip_k(flat, self.c, self.k)
            p = self.probabilities(vhat)
            active = torch.rand(flat.shape, generator=gen, device=dev, dtype=dt) < p
            out = unit_laplace(flat.shape, gen, dev, dt).mul_(scale).add_(vhat).clamp_min_(0.0).mul_(active)
            # the output depends on v only where the element was activated, is positive after
            # noise, and was kept by ClipK without being clipped (0 < v < C)
            free = torch.zeros(flat.shape, dtype=torch.bool, device=dev).scatter_(1, idx, (vals > 0) & (vals < self.c))
            ctx = {"mask": (free & active & (out > 0)).reshape(t.shape)}
            signal = vhat
        else:
            mag = clip_k(flat.abs(), self.c, self.k)
            p = self.probabilities(mag)
            active = torch.rand(flat.shape, generator=gen, device=dev, dtype=dt) < p
            kept = torch.sign(flat).mul_(mag).mul_(active)
            out = unit_laplace(flat.shape, gen, dev, dt).mul_(scale).add_(kept)
            ctx = {}
            signal = mag
        stats = {"snr": _mean_abs(signal) / mean_scale, "noise_scale": mean_scale,
                 "mean_active_fraction": float(active.float().mean()) if active.numel() else 0.0}
        return Release(value=out.reshape(t.shape), ctx=ctx, encoding=self.encoding, stats=stats)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        mask = ctx.get("mask")
        return grad if mask is None else grad * mask.to(device=grad.device, dtype=grad.dtype)

    def describe(self) -> dict:
        scales = self.noise_scales()
        return {"name": self.name, "direction": self.direction, "width": self.width, "epsilon": self.epsilon,
                "eps_p": self.eps_p, "eps_l": self.eps_l, "c": self.c, "k": self.k,
                "allocation": self.allocation, "importance_floor": self.importance_floor,
                "importance_active": self._uses_importance(),
                "noise_scale": float(scales.mean()), "noise_scale_min": float(scales.min()),
                "noise_scale_max": float(scales.max()), "sensitivity_l1": self.sensitivity_l1,
                "keep_probability_max": float(activation_probability(torch.tensor(1.0), self.eps_p, self.k))}

    def privacy_cost(self) -> PrivacyCost:
        # dp_accounting 0.6 has no generic pure-DP event; the binary randomized response with
        # keep probability e^ε_p/(1+e^ε_p) (noise_parameter 2/(1+e^ε_p), see RandomizedResponse)
        # has the privacy profile that dominates every ε_p-DP mechanism (Kairouz, Oh & Viswanath
        # 2015, Thm. 2.1), so it stands for the ε_p-DP activation state (Cor. 2) exactly.
        state = pure_dp_event(self.eps_p)
        noise = dp_accounting.LaplaceDpEvent(noise_multiplier=1.0 / self.eps_l)
        return PrivacyCost("r3elu", dp_accounting.ComposedDpEvent([state, noise]), epsilon=self.epsilon,
                           sensitivity_l1=self.sensitivity_l1,
                           params=(("eps_p", self.eps_p), ("eps_l", self.eps_l), ("c", self.c), ("k", self.k),
                                   ("width", self.width), ("direction", self.direction),
                                   ("allocation", self.allocation)))


class ImportanceTracker:
    """Running neuron importance of the cut layer (001 §3.4, Eq. 8–9).

    After each backward, parameter importance ``Î_j = (∇_{θ_j}L · θ_j)²`` (Eq. 8) is summed over
    the parameters connected to each output neuron (weights of its row / filter and its bias;
    per output **channel** for a conv layer) and folded into a running mean over the updates so
    far, starting from 0 (Eq. 9 with its iteration counter ``q·⌊T/n_t⌋ + (t mod n_t)`` = the
    number of updates). :attr:`values` has one entry per neuron (``out_features`` or
    ``out_channels``); :meth:`R3eLU.set_importance` broadcasts per-channel values over the
    spatial positions of the cut tensor.
    """

    def __init__(self, layer: nn.Module) -> None:
        if isinstance(layer, nn.Linear):
            n = layer.out_features
        elif isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            n = layer.out_channels
        else:
            raise ValueError(f"ImportanceTracker needs an nn.Linear or nn.Conv cut layer, got {type(layer).__name__}")
        self.layer = layer
        self.n = n
        self.count = 0
        self._mean = torch.zeros(n, dtype=torch.float64)

    def current(self) -> torch.Tensor | None:
        """Eq. 8 summed per neuron for the gradients now in the layer (``None`` if it has none)."""
        total, seen = torch.zeros(self.n, dtype=torch.float64), False
        for p in self.layer.parameters(recurse=False):
            if p.grad is None:
                continue
            seen = True
            imp = (p.grad.detach() * p.detach()).double().pow(2)
            total += imp.reshape(self.n, -1).sum(dim=1).cpu()  # weight (out, …) and bias (out,)
        return total if seen else None

    def update(self) -> None:
        """Fold the current gradients into the running mean (call after each backward)."""
        cur = self.current()
        if cur is None:
            return
        self.count += 1
        self._mean += (cur - self._mean) / self.count

    @property
    def values(self) -> torch.Tensor:
        """Neuron importances ``U`` (float32, CPU), all zeros before the first update."""
        return self._mean.float()

    def state_dict(self) -> dict:
        return {"mean": self._mean.clone(), "count": int(self.count)}

    def load_state_dict(self, state: dict) -> None:
        mean = torch.as_tensor(state["mean"], dtype=torch.float64).reshape(-1)
        if mean.numel() != self.n:
            raise ValueError(f"ImportanceTracker state has {mean.numel()} neurons, the layer has {self.n}")
        self._mean = mean.clone()
        self.count = int(state["count"])


# -- randomized response ------------------------------------------------------------------------
class RandomizedResponse(Mechanism):
    """Randomized response on binarized features (002 §3.3, Eq. 2–3).

    ``B_i = 1[v_i > 0]``; each bit is kept with probability ``e^{ε_b}/(1+e^{ε_b})`` and flipped
    otherwise, with ``ε_b = ε/d`` so the whole ``d``-bit record is ε-LDP by composition (002
    states ``ε`` per element: its ``ε`` is our ``d·ε``). Released values are float ``{0., 1.}``
    and travel bit-packed (``encoding = "bits"``, ``ceil(d/8)`` bytes per sample).

    ``local_grad`` is the straight-through estimator (identity): binarization has a zero
    derivative almost everywhere; 002 freezes the guest and never needed one. This is our
    choice, documented in ``docs/mechanisms.md``.
    """

    name = "rr"
    random = True
    encoding = "bits"

    def __init__(self, width: int, epsilon: float, direction: str = "forward") -> None:
        self.width = _width(width)
        self.direction = _direction(direction)
        self.epsilon = _positive("epsilon", epsilon)
        self.eps_bit = self.epsilon / self.width
        self.keep_probability = 1.0 / (1.0 + math.exp(-self.eps_bit))  # e^ε_b/(1+e^ε_b)

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = _flat(t, self.width, self.name)
        bits = flat > 0
        flip = torch.rand(flat.shape, generator=gen, device=flat.device) >= self.keep_probability
        out = (bits ^ flip).to(flat.dtype).reshape(t.shape)
        q = self.keep_probability
        # E[out | B] = (1 − q) + (2q − 1)·B: signal amplitude 2q − 1 against noise std √(q(1 − q))
        # (infinite once q rounds to 1: no bit is ever flipped)
        noise_sd = math.sqrt(q * (1 - q))
        stats = {"snr": (2 * q - 1) / noise_sd if noise_sd > 0 else math.inf, "keep_probability": q,
                 "noise_scale": 1.0 - q}
        return Release(value=out, encoding=self.encoding, stats=stats)

    def describe(self) -> dict:
        return {"name": self.name, "direction": self.direction, "width": self.width, "epsilon": self.epsilon,
                "epsilon_per_bit": self.eps_bit, "keep_probability": self.keep_probability,
                "noise_scale": 1.0 - self.keep_probability, "sensitivity_l1": float(self.width),
                "local_grad": "straight-through"}

    def privacy_cost(self) -> PrivacyCost:
        # dp_accounting's RandomizedResponseDpEvent(p, k) outputs the true bucket with
        # probability 1 − p and a uniformly drawn bucket (possibly the true one) with
        # probability p, so with k = 2 it keeps the bit with probability 1 − p + p/2 = 1 − p/2.
        # Keeping with e^ε_b/(1+e^ε_b) means p/2 = 1/(1+e^ε_b), i.e. p = 2/(1+e^ε_b)
        # (pure_dp_event; beyond ε_b = 700 an (ε_b, 0) event, where e^ε_b overflows).
        bit = pure_dp_event(self.eps_bit)
        return PrivacyCost("rr", dp_accounting.SelfComposedDpEvent(bit, self.width), epsilon=self.epsilon,
                           sensitivity_l1=float(self.width),
                           params=(("epsilon_per_bit", self.eps_bit), ("width", self.width),
                                   ("direction", self.direction)))


__all__ = ["ALLOCATIONS", "DIRECTIONS", "Gaussian", "ImportanceTracker", "Laplace", "R3eLU", "RandomizedResponse",
           "activation_probability", "clip_k", "geometric_epsilon", "unit_laplace"]
