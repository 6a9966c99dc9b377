"""R3eLU, the randomized-response ReLU of paper 001 (§3, Alg. 1/2, Eq. 4–10, Cor. 1–6; spec §3), and
the importance tracker its dynamic budget allocation reads (§3.4, Eq. 8–9).

The mechanism observes nothing by itself: the party that owns it keeps an
:class:`ImportanceTracker` on a layer, calls :meth:`ImportanceTracker.update` after each backward,
and, when it decides (before each epoch as 001 does, or per batch as an option), releases the
allocation through :class:`AllocationRelease` (charged: the receiver can read the allocation back)
and hands the *released* shares to :meth:`R3eLU.set_importance`; the mechanism uses the last ``U``
it was given.

The Laplace part is drawn as discrete Laplace noise on a power-of-two grid
(:mod:`fl_split.privacy.sampling`), calibrated so that the claimed epsilon holds *including* the
snapping to the grid and the sampler's floating-point slack.
"""

from __future__ import annotations

import math

import dp_accounting
import torch
from torch import nn

from fl_split.errors import ConfigError
from fl_split.privacy.base import Mechanism, PrivacyCost, Release
from fl_split.privacy.events import elementwise_dlap_event
from fl_split.privacy.ledger import pure_dp_event
from fl_split.privacy.sampling import (CLAIM_MARGIN, T_CAP, T_MIN, DiscreteLaplace, EpsilonTooSmall, bernoulli_below,
                                       calibrate, check_direction, check_width, choose_grid, dlap_sd, flat_batch,
                                       grid_units, positive, rms, snap, solve_t)

ALLOCATIONS = ("uniform", "importance", "importance-tight")
SIDES = ("output", "input")


# -- building blocks (001 §3.2) --------------------------------------------------------------------
def clip_k(v: torch.Tensor, c: float, k: int) -> torch.Tensor:
    """``ClipK(v, C, K)`` (001 §3.2, spec §3) on a batch ``(B, d)``: per sample keep the ``k``
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


def keep_probability(eps_p: float, k: int) -> float:
    """``q = e^{ε_p/K}/(1 + e^{ε_p/K})``, the largest activation probability (Eq. 4)."""
    return 1.0 / (1.0 + math.exp(-eps_p / k))  # computed without overflow


def activation_probability(ratio: torch.Tensor, eps_p: float, k: int) -> torch.Tensor:
    """Eq. 4/6/10: ``p = ½ + ratio·(e^{ε_p/K}/(1+e^{ε_p/K}) − ½)`` for ``ratio ∈ [0, 1]``."""
    return 0.5 + ratio * (keep_probability(eps_p, k) - 0.5)


def _row_ratio(x: torch.Tensor) -> torch.Tensor:
    """``x_i/‖x‖_∞`` per row of a non-negative ``(B, d)`` tensor; 0 on rows that are all zero."""
    m = x.amax(dim=1, keepdim=True)
    return torch.where(m > 0, x / m.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(x))


def geometric_epsilon(eps_total: float, i: int) -> float:
    """Per-iteration budget of the geometric schedule (001 §3.4): ``ε_i = ε_T/2^i``, ``i ≥ 1``.

    The first ``n`` budgets sum to ``ε_T·(1 − 2^{-n}) < ε_T``, so any number of iterations
    stays within the total budget by sequential composition.
    """
    eps_total = positive("epsilon", eps_total)
    if isinstance(i, bool) or int(i) != i or i < 1:
        raise ValueError(f"geometric_epsilon: iteration index must be an int >= 1 (1-based), got {i!r}")
    return eps_total / 2.0 ** int(i)


def _top_sum(w: torch.Tensor, m: int) -> float:
    """Sum of the ``m`` largest entries of ``w``."""
    return float(torch.sort(w, descending=True).values[: min(m, w.numel())].sum())


class _Grid:
    """Per-element grid ``γ_i``, clip range ``M_i`` (grid steps) and ``DLap(t_i)`` noise."""

    def __init__(self, gamma, units, noise, eps_bound: float) -> None:
        self.gamma = gamma  # float or float64 (d,) CPU tensor
        self.units = units  # int or float64 (d,) tensor
        self.noise = noise
        self.eps_bound = eps_bound
        self._dev: dict[str, tuple] = {}
        sd, sc = self.sds(), self.scales()
        self.mean_sd = float(sd.mean()) if isinstance(sd, torch.Tensor) else float(sd)
        self.mean_scale = float(sc.mean()) if isinstance(sc, torch.Tensor) else float(sc)
        self.signal_free = not bool(torch.as_tensor(units).gt(0).any())

    def on(self, device) -> tuple:
        if not isinstance(self.gamma, torch.Tensor):
            return self.gamma, self.units
        key = str(device)
        if key not in self._dev:
            self._dev[key] = (self.gamma.to(device), self.units.to(device))
        return self._dev[key]

    def scales(self) -> torch.Tensor | float:
        """Effective Laplace scales ``b_i = γ_i·t_i`` (what the continuous mechanism would use)."""
        return self.gamma * self.noise.t

    def sds(self) -> torch.Tensor | float:
        """Noise standard deviations ``γ_i·SD(DLap(t_i))``."""
        if isinstance(self.gamma, torch.Tensor):
            r = torch.exp(-1.0 / self.noise.t)
            return self.gamma * torch.sqrt(2.0 * r) / -torch.expm1(-1.0 / self.noise.t)
        return self.gamma * dlap_sd(self.noise.t)


# -- the mechanism ------------------------------------------------------------------------------
class R3eLU(Mechanism):
    """Randomized-response ReLU (001 §3, Alg. 1/2, Eq. 4–6, 10, Cor. 1–6; spec §3).

    ``ε = ε_p + ε_l`` with ``ε_p = eps_p_fraction·ε`` (randomized response of the activation
    state) and ``ε_l`` (Laplace). ``K`` defaults to ``width // 2`` (at least 1).

    * **Forward** (Alg. 1, guest, on the cut layer's pre-activation ``v``): ``v̂ = ClipK(v, C, K)``;
      ``p_i`` by Eq. 4; with probability ``p_i`` output ``max(v̂_i + Lap(2KC/ε_l), 0)``, else 0.
      The paper draws ``r ~ N(0,1)`` and tests ``r < p_i``, which does not activate with
      probability ``p_i``; we draw a uniform (spec fix). ``ctx["mask"]`` marks elements that were
      activated, in the top-K, unclipped (``0 < v < C``) and positive after noise: the only ones
      through which the output depends on ``v``; ``local_grad`` multiplies by it.
    * **Backward** (Alg. 2, host, on ``δ``): ``|δ̂| = ClipK(|δ|, C, K)``; ``p_i`` by Eq. 6 from
      ``|δ̂_i|/‖|δ̂|‖_∞``; keep ``sign(δ_i)·|δ̂_i|`` with probability ``p_i``, else 0; then add
      ``Lap(2KC/ε_l)`` to **every** element. ``local_grad`` is the identity.
    * **Laplace on a grid.** ``Lap(b)`` is discrete Laplace ``DLap(t)`` on a power-of-two grid ``γ``
      (``b = γ·t``, :mod:`fl_split.privacy.sampling`); the clipped values are snapped to it,
      ``n = round(v̂/γ) ∈ [0, M]`` forward (``[−M, M]`` backward), ``M = round(C/γ)``. Uniform
      calibration: at most ``K`` non-zeros each side, so the L1 sensitivity is ``2K·M`` grid steps
      (Cor. 1 on the grid) and ``t = 2KM/(ε_l − slack)``: ``b ≈ 2KC/ε_l`` as in the paper.
    * **Importance allocation** (``allocation="importance"``, 001 §3.4 as published): after
      :meth:`set_importance` with importances ``U``, ``p_i`` uses ``U_i/‖U‖_∞`` (Eq. 10, in both
      directions) and each element gets the Laplace scale of Cor. 6 / Eq. 16,
      ``b_i = C·ΣU_j/(ε_l·U_i)`` forward — elements in ``[0, C]`` differ by at most ``C``, so
      ``Σ_i C/b_i = ε_l`` whatever the neighbours — and ``b_i = 2C·ΣU_j/(ε_l·U_i)`` backward, where
      elements are signed in ``[−C, C]`` and can differ by ``2C`` (Eq. 16 is stated for the forward
      direction; this is its backward form). With equal importances and ``K = N/2`` the forward
      scale is ``C·N/ε_l = 2KC/ε_l``, Alg. 1's (``test_cor6_reduces_to_alg1``). ``U_i/ΣU`` is
      floored: ``w_i = (1 − f)·U_i/ΣU + f/N`` (``f = importance_floor``, default 0.1), which keeps
      ``Σw_i = 1`` and gives a feature of zero importance the finite scale ``C·N/(f·ε_l)``; the
      scales are ``C/(ε_l·w_i)`` (``2C/(ε_l·w_i)`` backward). While ``U`` is all zeros (nothing
      learned yet) the mechanism behaves exactly as ``uniform``.
      ``allocation="importance-tight"`` (ours, not in the paper): same proportions, with the
      smallest common factor that still costs ``ε_l`` given that at most ``K`` elements are
      non-zero (see :meth:`noise_scales`).

    ``cost()``: pure ``ε``-DP (Cor. 3/6): an ``ε_p``-DP event for the activation state composed
    with the worst-case pair of the Laplace part (uniform; :meth:`laplace_event`: ``2K`` discrete
    Laplace events of sensitivity ``M`` forward, ``K`` of ``2M`` backward) or, under an importance allocation (whose
    per-element scales change with ``U``), the ``ε_l``-DP event :func:`pure_dp_event` that
    dominates every ``ε_l``-DP mechanism.

    **Diagnostics.** ``Release.stats`` are private (computed from ``v``): ``snr`` = RMS of ``v̂``
    (forward) or ``|δ̂|`` (backward) over the noise SD of the mean scale. :meth:`public_diagnostics`
    and :meth:`describe` use parameters only (the *uniform* scale, never importance-derived ones);
    :meth:`local_diagnostics` has the importance-derived scales, for the party's own log.
    """

    name = "r3elu"
    random = True

    def __init__(self, width: int, direction: str, epsilon: float, c: float, k: int | None = None,
                 eps_p_fraction: float = 0.5, allocation: str = "uniform", importance_floor: float = 0.1) -> None:
        self.width = check_width(width)
        self.direction = check_direction(direction)
        self.epsilon = positive("epsilon", epsilon)
        self.c = positive("clip-c", c)
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
        self.sensitivity_l1 = 2.0 * self.k * self.c  # Cor. 1 (in value units)
        #: elements that can differ between neighbours: the union of two top-K supports
        self.differing = min(2 * self.k, self.width)
        b_nom = self.sensitivity_l1 / self.eps_l  # Alg. 1/2: 2KC/ε_l
        gamma = choose_grid(b_nom, self.c)
        units = grid_units(self.c, gamma)
        self.sensitivity_units = 2 * self.k * units
        noise, eps_bound, self.signal_free = calibrate(self.sensitivity_units, self.eps_l, self.differing,
                                                       b_nom / gamma)
        if self.signal_free:  # ε_l below what the sampler can carry: input-independent noise (costs 0)
            units = self.sensitivity_units = 0
        self._uniform = _Grid(gamma, units, noise, eps_bound)
        self.gamma = gamma
        self.t = noise.t
        self.scale = gamma * noise.t  # the uniform Laplace scale, ≈ 2KC/ε_l
        self.eps_l_bound = eps_bound  # ≤ ε_l: what the Laplace part spends, slack included
        self._importance = torch.zeros(self.width)
        self._grid: _Grid | None = None  # importance-derived grid (None: uniform)

    # importance allocation ---------------------------------------------------------------------
    def set_importance(self, u: torch.Tensor) -> None:
        """Store importances ``U ≥ 0`` (001 Eq. 9), used when ``allocation`` is not ``uniform``.

        ``u`` has ``width`` entries, or one per channel of a conv layer (a divisor of ``width``):
        it is then broadcast over that channel's spatial positions, channel-major as ``(C, H, W)``
        flattens. Ignored by a ``uniform`` mechanism.
        """
        u = torch.as_tensor(u).detach().reshape(-1).to(dtype=torch.float32).cpu()
        n = u.numel()
        if n == 0 or self.width % n:
            raise ValueError(f"R3eLU.set_importance: got {n} importances for a cut width of {self.width} "
                             f"(need {self.width} or a divisor of it, one per channel)")
        if not bool(torch.isfinite(u).all()) or bool((u < 0).any()):
            raise ValueError("R3eLU.set_importance: importances must be finite and >= 0")
        u = u.repeat_interleave(self.width // n) if n != self.width else u.clone()
        if self._grid is not None and torch.equal(u, self._importance):
            return  # the same U again (a per-epoch snapshot handed over before every release)
        self._importance = u
        self._grid = self._importance_grid() if self._uses_importance() else None

    @property
    def importance(self) -> torch.Tensor:
        return self._importance.clone()

    def _uses_importance(self) -> bool:
        return self.allocation != "uniform" and bool(self._importance.sum() > 0)

    def feature_weights(self) -> torch.Tensor:
        """Cor. 6 budget shares ``w_i`` (sum 1): ``(1 − f)·U_i/ΣU + f/d``; ``1/d`` each while no
        importance is set or under ``uniform``."""
        if not self._uses_importance():
            return torch.full((self.width,), 1.0 / self.width, dtype=torch.float64)
        u = self._importance.double()
        return (1.0 - self.importance_floor) * u / u.sum() + self.importance_floor / self.width

    def feature_epsilons(self) -> torch.Tensor:
        """Laplace budget of each feature under ``importance`` (Cor. 6): ``ε_l·w_i``, summing to ``ε_l``."""
        return self.eps_l * self.feature_weights()

    def _importance_grid(self) -> _Grid:
        """Per-element grid and noise for the current ``U``.

        Element ``i`` has a range of ``r_i`` grid steps (``M_i = round(C/γ_i)`` forward, ``2M_i``
        backward) and ``t_i = r_i·A/(ε'·w_i)``, so its loss at full range is ``ε'·w_i/A``:
        ``A = 1`` for ``importance`` (all elements may differ: ``Σ = ε'``), ``A = S_{2K}(w)``
        forward and ``S_K(w)`` backward for ``importance-tight`` (the worst neighbours use the 2K,
        resp. twice the K, largest shares: ``= ε'``). ``ε' = ε_l − slack``.
        """
        w = self.feature_weights()
        per = 1.0 if self.direction == "forward" else 2.0  # range of one element: C, or 2C signed
        if self.allocation == "importance":
            a = 1.0  # Eq. 16: b_i = C/(ε_l·w_i) = C·ΣU/(ε_l·U_i)  (2C/… backward)
        elif self.direction == "forward":
            a = _top_sum(w, 2 * self.k)
        else:
            a = _top_sum(w, self.k)
        b_target = per * self.c * a / (self.eps_l * w)
        gamma = choose_grid(b_target, self.c)
        units = torch.round(self.c / gamma)  # torch rounds half to even, as snap() does
        ranges = per * units
        zero = ranges == 0  # the clip bound is below half a grid step: nothing of v survives
        t_unit = torch.where(zero, b_target / gamma * self.eps_l, ranges * a / w)  # t_i·ε'
        try:
            noise, slack = solve_t(t_unit, self.eps_l, self.differing)
        except EpsilonTooSmall:  # as in the uniform case: snap everything to 0, input-independent noise
            return _Grid(gamma, torch.zeros_like(units), DiscreteLaplace(
                torch.clamp(b_target / gamma, T_MIN, T_CAP)), 0.0)
        full = torch.where(zero, torch.zeros_like(w), ranges / noise.t)  # loss of element i at full range
        if self.allocation == "importance":
            loss = float(full.sum())
        elif self.direction == "forward":
            loss = _top_sum(full, 2 * self.k)
        else:
            loss = 2.0 * _top_sum(full / 2.0, self.k)
        bound = loss * (1 + CLAIM_MARGIN) + slack
        if not bound <= self.eps_l * (1 + 1e-12):  # pragma: no cover - guarded by construction
            raise AssertionError(f"R3eLU importance calibration overshoots: {bound} > {self.eps_l}")
        return _Grid(gamma, units, noise, bound)

    def _active_grid(self) -> _Grid:
        return self._grid if (self._grid is not None and self._uses_importance()) else self._uniform

    def noise_scales(self) -> torch.Tensor:
        """Per-feature Laplace scales ``b_i = γ_i·t_i`` (under an importance allocation they derive
        from the ``U`` last given, which a party gives only as a released :class:`AllocationRelease`).

        * ``uniform`` (or no importance yet): ``≈ 2KC/ε_l`` for every element (Alg. 1/2);
        * ``importance`` (Cor. 6 / Eq. 16 as published): ``C/(ε_l·w_i)`` forward,
          ``2C/(ε_l·w_i)`` backward;
        * ``importance-tight`` (ours): ``C·S_{2K}(w)/(ε_l·w_i)`` forward (elements differ by ≤ C,
          at most 2K of them) and ``2C·S_K(w)/(ε_l·w_i)`` backward (signed, K-sparse on each side),
          ``S_m(w)`` the sum of the ``m`` largest shares. With equal shares both are ``2KC/ε_l``.

        Each is up to the grid: ``b_i = γ_i·t_i`` where ``t_i`` is calibrated on ``M_i = round(C/γ_i)``
        grid steps (within 1/32 of ``C/γ_i``) so that the loss is exactly budgeted.
        """
        g = self._active_grid()
        s = g.scales()
        return s.float() if isinstance(s, torch.Tensor) else torch.full((self.width,), float(s))

    def probabilities(self, vhat: torch.Tensor) -> torch.Tensor:
        """``p`` of Eq. 4/6 (from ``v̂_i/‖v̂‖_∞``) or Eq. 10 (from ``U_i/‖U‖_∞``) for ``(B, d)`` ``v̂ ≥ 0``
        (in ``vhat``'s dtype; releases use the float64 values of :meth:`_probabilities64`)."""
        return self._probabilities64(vhat).to(vhat.dtype)

    def _probabilities64(self, vhat: torch.Tensor) -> torch.Tensor:
        if self._uses_importance():
            u = self._importance.to(device=vhat.device, dtype=torch.float64)
            return activation_probability(u / u.max(), self.eps_p, self.k).expand(vhat.shape)
        return activation_probability(_row_ratio(vhat.double()), self.eps_p, self.k)

    # release -----------------------------------------------------------------------------------
    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = flat_batch(t, self.width, self.name)
        dev, dt = flat.device, flat.dtype
        grid = self._active_grid()
        gamma, units = grid.on(dev)
        if self.direction == "forward":
            vhat, idx, vals = _clip_k(flat, self.c, self.k)
            active = bernoulli_below(self._probabilities64(vhat), gen)
            n = snap(vhat, gamma, 0, units)
            y = grid.noise.sample(flat.shape, gen, dev).add_(n).clamp_min_(0.0).mul_(active)
            out = (y * gamma).to(dt)
            # the output depends on v only where the element was activated, is positive after
            # noise, and was kept by ClipK without being clipped (0 < v < C)
            free = torch.zeros(flat.shape, dtype=torch.bool, device=dev).scatter_(1, idx, (vals > 0) & (vals < self.c))
            ctx = {"mask": (free & active & (y > 0)).reshape(t.shape)}
            signal = vhat
        else:
            mag = clip_k(flat.abs(), self.c, self.k)
            active = bernoulli_below(self._probabilities64(mag), gen)
            kept = torch.sign(flat).mul_(mag).mul_(active)
            n = snap(kept, gamma, -units, units)
            out = (grid.noise.sample(flat.shape, gen, dev).add_(n) * gamma).to(dt)
            ctx = {}
            signal = mag
        stats = {"snr": 0.0 if grid.signal_free else rms(signal) / grid.mean_sd, "noise_scale": grid.mean_scale,
                 "mean_active_fraction": float(active.float().mean()) if active.numel() else 0.0}
        return Release(value=out.reshape(t.shape), ctx=ctx, encoding=self.encoding, stats=stats)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        mask = ctx.get("mask")
        return grad if mask is None else grad * mask.to(device=grad.device, dtype=grad.dtype)

    # reports -----------------------------------------------------------------------------------
    def noise_sd(self) -> float:
        """SD of the uniform noise (public): ``γ·SD(DLap(t)) ≈ √2·b``."""
        return float(self._uniform.sds())

    def describe(self) -> dict:
        """Parameters only (public): the uniform scale, never importance-derived values."""
        return {"name": self.name, "direction": self.direction, "width": self.width, "epsilon": self.epsilon,
                "eps_p": self.eps_p, "eps_l": self.eps_l, "c": self.c, "k": self.k,
                "allocation": self.allocation, "importance_floor": self.importance_floor,
                "noise_scale": self.scale, "sensitivity_l1": self.sensitivity_l1,
                "sampler": "discrete-laplace", "grid": self.gamma, "t": self.t,
                "sensitivity_units": self.sensitivity_units, "signal_free": self.signal_free,
                "keep_probability_max": keep_probability(self.eps_p, self.k)}

    def public_diagnostics(self) -> dict:
        """``noise_scale`` (uniform ``≈ 2KC/ε_l``), ``noise_sd`` and ``snr_bound``: the largest RMS a
        record's ``v̂``/``|δ̂|`` can have (``C·√(K/d)``: K elements at C) over the noise SD."""
        sd = self.noise_sd()
        return {"noise_scale": self.scale, "noise_sd": sd,
                "snr_bound": 0.0 if self.signal_free else self.c * math.sqrt(self.k / self.width) / sd}

    def local_diagnostics(self) -> dict:
        """Importance-derived values (from the released allocation the party gave the mechanism)."""
        s = self.noise_scales()
        return {"importance_active": self._uses_importance(), "noise_scale_mean": float(s.mean()),
                "noise_scale_min": float(s.min()), "noise_scale_max": float(s.max())}

    def public_range(self):
        """What every honest release satisfies, from public parameters only (issue 16,
        :mod:`fl_split.privacy.bounds`); forward releases are ``≥ 0``.

        * ``uniform``: ``γ·(n + Z)`` with ``|n| ≤ M``: on the grid ``γ``, ``|v| ≤ γ·(M + 42t)``
          (``≈ C + 42·b``);
        * importance allocations: the per-element grids and scales follow the sender's private
          ``U``, so the range covers every ``U``: each ``γ_i`` is a power of two no finer than the
          grid of the smallest possible scale ``per·C/ε_l`` (``w_i ≤ 1``, ``A ≥ w_i``), and each
          scale is at most ``1.5·per·C·d/(f·ε_l)`` (``w_i ≥ f/d``; ``M_i·γ_i ≤ C + γ_i/2 ≤ 1.5·C``;
          the grid keeps ``γ_i·T_MIN ≤`` the target scale, so the ``T_MIN`` floor adds nothing),
          taken twice over (``ε' < ε_l``, ``t``'s rounding up): ``|v| ≤ 1.5·C + 42·b_max``.
        """
        from fl_split.privacy.bounds import LAPLACE_K, PublicRange, dlap_range

        forward = self.direction == "forward"
        if not self._uses_importance_allocation():
            return dlap_range(self.name, self.gamma, self._uniform.units, self.t,
                              nonnegative=forward)
        per = 1.0 if forward else 2.0
        grid = float(choose_grid(per * self.c / self.eps_l, self.c))
        b_max = 2.0 * per * 1.5 * self.c * self.width / (self.importance_floor * self.eps_l)
        hi = 1.5 * self.c + LAPLACE_K * b_max
        return PublicRange(self.name, 0.0 if forward else -hi, hi, grid=grid,
                           why=f"{self.allocation} allocation, any importances: grid {grid:g}, |v| <= 1.5·C + "
                               f"{LAPLACE_K:g}·b_max, b_max = 2·1.5·{per:g}·C·d/(f·eps_l) = {b_max:.6g}"
                               + ("; values >= 0" if forward else ""))

    def _uses_importance_allocation(self) -> bool:
        return self.allocation != "uniform"

    def laplace_event(self):
        """The worst-case neighbouring pair of the uniform Laplace part (issue 26), as a DpEvent.

        The noise is added to the snapped ``n`` of ``ClipK`` (before the output's ``max(·, 0)`` and
        the activation mask, both post-processing of ``n + Z`` together with the activation state).
        Forward, ``n ∈ [0, M]^d`` with at most ``K`` non-zeros: neighbours differ in at most
        ``min(2K, d)`` elements (the union of two top-K supports), each by at most ``M``, and two
        disjoint supports at ``M`` attain it, so the pair is ``min(2K, d)`` discrete Laplace events
        of sensitivity ``M``. Backward, ``n ∈ [−M, M]^d``, K-sparse: with ``j`` shared support
        elements the shifts are ``j`` of ``2M`` and ``2(K − j)`` of ``M``; two shifts of ``M`` are
        dominated by one of ``2M`` (the 1-D Laplace pair of the summed shift dominates the split one;
        checked exactly on the lattice in tests/test_tight_accounting.py), so the pair is ``K``
        events of sensitivity ``2M`` (attained: the same K elements at ``+C`` and ``−C``). Both have
        the pure epsilon ``2KM/t`` of Cor. 1 (forward, when ``2K ≤ d``).
        """
        units = self.sensitivity_units // (2 * self.k)  # M (0 when signal-free)
        if self.direction == "forward":
            return elementwise_dlap_event(self.t, units, self.differing)
        return elementwise_dlap_event(self.t, 2 * units, self.k)

    def privacy_cost(self) -> PrivacyCost:
        # dp_accounting 0.6 has no generic pure-DP event; the binary randomized response with
        # keep probability e^ε_p/(1+e^ε_p) has the privacy profile that dominates every ε_p-DP
        # mechanism (Kairouz, Oh & Viswanath 2015, Thm. 2.1), so it stands for the ε_p-DP
        # activation state (Cor. 2) exactly.
        state = pure_dp_event(self.eps_p)
        if self.allocation == "uniform" and not self.signal_free:
            noise = self.laplace_event()
        else:  # per-element scales that follow U: an ε_l-DP release, whatever U is
            noise = pure_dp_event(self.eps_l)
        slack = self.eps_l_bound - self.sensitivity_units / self.t
        return PrivacyCost("r3elu", dp_accounting.ComposedDpEvent([state, noise]), epsilon=self.epsilon,
                           sensitivity_l1=self.sensitivity_units * self.gamma,
                           params=(("eps_p", self.eps_p), ("eps_l", self.eps_l), ("c", self.c), ("k", self.k),
                                   ("width", self.width), ("direction", self.direction),
                                   ("allocation", self.allocation), ("grid", self.gamma), ("t", self.t),
                                   ("sensitivity_units", int(self.sensitivity_units)),
                                   ("sampler_slack", max(slack, 0.0))))


# -- the allocation as a release (issue 16; DESIGN.md privacy principle 2) ------------------------
class AllocationRelease:
    """The importance allocation of 001 §3.4 made a charged release.

    Under ``--allocation importance`` / ``importance-tight`` the per-feature noise scales (Cor. 6)
    and activation probabilities (Eq. 10) follow the importances ``U`` of Eq. 8–9, which come from
    the party's own gradients, so from its data. A receiver reads them back from the releases
    (each element's grid step and noise spread, each element's activation rate): the allocation is
    itself a data-dependent release. It is therefore released *through its own mechanism* and
    charged, and the R3eLU mechanism only ever sees the released value, so everything it derives
    from it is post-processing (and public: the report shows it).

    Mechanism: the shares ``s = U/ΣU`` lie in the simplex, so two neighbouring datasets — one
    record's values replaced, and that record may dominate the gradients — give shares at most 2
    apart in L1. ``s`` is snapped to a power-of-two grid ``γ`` (``n_i = round(s_i/γ)``, so
    ``Σ|n_i − n'_i| ≤ 2/γ + d`` grid steps: each rounding adds at most one) and released as
    ``γ·(n + DLap(t))`` with the exact discrete Laplace sampler of :mod:`fl_split.privacy.sampling`
    calibrated to ``ε_U`` *including* the sampler's slack; negative values are set to 0
    (post-processing). The U of a snapshot is a running mean over every update so far, so each
    release is charged to every training record of the party (direction ``allocation``); before
    the first update ``U = 0`` is data-independent and nothing is released (the mechanism is then
    ``uniform``).
    """

    name = "allocation"
    random = True

    def __init__(self, width: int, epsilon: float) -> None:
        self.width = check_width(width)
        self.epsilon = positive("allocation-epsilon", epsilon)
        b_nom = 2.0 / self.epsilon  # L1 sensitivity 2 of the simplex
        self.gamma = choose_grid(b_nom, 1.0)
        self.units = grid_units(1.0, self.gamma)
        delta = min(int(round(2.0 / self.gamma)) + self.width, self.width * self.units)
        self.noise, self.epsilon_bound, self.signal_free = calibrate(delta, self.epsilon, self.width, b_nom / self.gamma)
        self.sensitivity_units = 0 if self.signal_free else delta
        self.scale = self.gamma * self.noise.t

    def release(self, u: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """The released allocation for importances ``u ≥ 0`` (``width`` entries): non-negative
        noisy shares, float32 on the CPU (what the mechanism then uses as its ``U``)."""
        u = torch.as_tensor(u).detach().reshape(-1).to(torch.float64).cpu()
        if u.numel() != self.width:
            raise ValueError(f"allocation release: {u.numel()} importances for a width of {self.width}")
        total = float(u.sum())
        shares = u / total if total > 0 else torch.full_like(u, 1.0 / self.width)
        n = torch.zeros_like(shares) if self.signal_free else snap(shares, self.gamma, 0, self.units)
        dev = gen.device if gen is not None else torch.device("cpu")  # the party's generator, on its device
        y = self.noise.sample((self.width,), gen, dev).to("cpu", torch.float64).add_(n)
        return (y * self.gamma).clamp_min_(0.0).float()

    def cost(self) -> PrivacyCost:
        """One ``ε_U``-DP release per record (discrete Laplace on the grid, slack included)."""
        if self.signal_free:  # the shares were not used: input-independent noise, costs 0
            event = dp_accounting.dp_event.NoOpDpEvent()
        else:
            event = dp_accounting.dp_event.DiscreteLaplaceDpEvent(noise_parameter=1.0 / self.noise.t,
                                                                  sensitivity=int(self.sensitivity_units))
        slack = self.epsilon_bound - (self.sensitivity_units / self.noise.t if not self.signal_free else 0.0)
        return PrivacyCost("allocation", event, epsilon=self.epsilon, sensitivity_l1=2.0,
                           params=(("width", self.width), ("grid", self.gamma), ("t", float(self.noise.t)),
                                   ("sensitivity_units", int(self.sensitivity_units)),
                                   ("sampler_slack", max(slack, 0.0))))

    def describe(self) -> dict:
        """Parameters only (public)."""
        return {"name": self.name, "epsilon": self.epsilon, "width": self.width, "sensitivity_l1": 2.0,
                "noise_scale": self.scale, "grid": self.gamma, "sampler": "discrete-laplace",
                "signal_free": self.signal_free}


# -- importance (001 §3.4, Eq. 8–9) -------------------------------------------------------------------
class ImportanceTracker:
    """Running importance of the neurons on one side of a layer (001 §3.4, Eq. 8–9).

    After each backward, parameter importance ``Î_j = (∇_{θ_j}L · θ_j)²`` (Eq. 8) is summed over
    the parameters connected to each neuron and folded into a running mean over the updates so far,
    starting from 0 (Eq. 9, whose iteration counter ``q·⌊T/n_t⌋ + (t mod n_t)`` is the number of
    updates).

    * ``side="output"`` (a guest's cut layer, 001's use): one value per **output** neuron — the
      weights of its row (``nn.Linear``) or filter (conv, per output channel) and its bias;
    * ``side="input"`` (the host's first top layer, scoring the cut-layer features it *receives*,
      for the backward direction): one value per **input** feature — the weights of its column
      (``nn.Linear``; biases are not connected to an input) or, for a conv, of all filters' slices
      over that input channel (respecting ``groups``).

    :attr:`values` has one entry per neuron/feature (or channel); :meth:`R3eLU.set_importance`
    broadcasts per-channel values over the spatial positions of the tensor.
    """

    def __init__(self, layer: nn.Module, side: str = "output") -> None:
        if side not in SIDES:
            raise ValueError(f"ImportanceTracker side must be one of {SIDES}, got {side!r}")
        if isinstance(layer, nn.Linear):
            n = layer.out_features if side == "output" else layer.in_features
        elif isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            n = layer.out_channels if side == "output" else layer.in_channels
        else:
            raise ValueError(f"ImportanceTracker needs an nn.Linear or nn.Conv layer, got {type(layer).__name__}")
        self.layer = layer
        self.side = side
        self.n = n
        self.count = 0
        self._mean = torch.zeros(n, dtype=torch.float64)

    def current(self) -> torch.Tensor | None:
        """Eq. 8 summed per neuron/feature for the gradients now in the layer (``None`` if none)."""
        total, seen = torch.zeros(self.n, dtype=torch.float64), False
        weight = getattr(self.layer, "weight", None)
        bias = getattr(self.layer, "bias", None)
        for name, p in (("weight", weight), ("bias", bias)):
            if p is None or p.grad is None:
                continue
            imp = (p.grad.detach() * p.detach()).double().pow(2)
            if self.side == "output":
                seen = True
                total += imp.reshape(self.n, -1).sum(dim=1).cpu()  # weight (out, …) and bias (out,)
            elif name == "weight":
                seen = True
                total += self._per_input(imp).cpu()
        return total if seen else None

    def _per_input(self, imp: torch.Tensor) -> torch.Tensor:
        if isinstance(self.layer, nn.Linear):
            return imp.sum(dim=0)  # (out, in): column sums
        groups = self.layer.groups
        out, in_per = imp.shape[0], imp.shape[1]  # conv weight (out, in/groups, *kernel)
        per = imp.reshape(groups, out // groups, in_per, -1).sum(dim=(1, 3))  # (groups, in/groups)
        return per.reshape(-1)  # input channel g·(in/groups) + j

    def update(self) -> None:
        """Fold the current gradients into the running mean (call after each backward)."""
        cur = self.current()
        if cur is None:
            return
        self.count += 1
        self._mean += (cur - self._mean) / self.count

    @property
    def values(self) -> torch.Tensor:
        """Importances ``U`` (float32, CPU), all zeros before the first update."""
        return self._mean.float()

    def state_dict(self) -> dict:
        return {"mean": self._mean.clone(), "count": int(self.count), "side": self.side}

    def load_state_dict(self, state: dict) -> None:
        if state.get("side", "output") != self.side:
            raise ValueError(f"ImportanceTracker state is for side {state.get('side')!r}, this tracker is {self.side!r}")
        mean = torch.as_tensor(state["mean"], dtype=torch.float64).reshape(-1)
        if mean.numel() != self.n:
            raise ValueError(f"ImportanceTracker state has {mean.numel()} entries, the layer has {self.n}")
        self._mean = mean.clone()
        self.count = int(state["count"])


__all__ = ["ALLOCATIONS", "SIDES", "AllocationRelease", "ImportanceTracker", "R3eLU", "activation_probability", "clip_k",
           "geometric_epsilon", "keep_probability"]
