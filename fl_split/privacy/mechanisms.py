"""Boundary mechanisms: Laplace, Gaussian, R3eLU and randomized response (spec §3).

Every mechanism works on a batch ``t`` of shape ``(B, *sample_shape)``; one *record's tensor* is
one sample's slice, of ``d = prod(sample_shape)`` elements (the mechanism's ``width``). All draws
come from the generator the caller passes (the party's secret stream, docs/references.md, "Privacy
principles"), on the device of the input, with no Python loop over samples or elements.

**What epsilon means here.** ``epsilon`` is the privacy cost of releasing **one record's whole
cut-layer tensor once** (not per element): the noise of every mechanism is calibrated to the
sensitivity of the whole ``d``-element tensor. Papers 002 (Laplace, randomized response) state
a per-element epsilon; their ``ε`` corresponds to our ``d·ε``. ``cost()`` returns a
:class:`~fl_split.privacy.base.PrivacyCost` whose ``dp_event`` (``dp_accounting``) describes
that single release, for the accountants.

**Neighbouring relation.** Replace-one: a record's tensor is replaced by any other admissible
tensor (the sensitivities below are worst cases over *all* pairs of inputs). ``dp_accounting``'s
PLD accepts discrete Laplace events only under ``ADD_OR_REMOVE_ONE``/``REPLACE_SPECIAL`` and
randomized-response events only under ``REPLACE_ONE``/``REPLACE_SPECIAL``; since each event here
is already the worst case over all pairs, ``REPLACE_SPECIAL`` is the right reading.

Conventions shared by all mechanisms (details in ``docs/mechanisms.md``):

* ``release(t, gen)`` returns the released tensor (same shape and dtype as ``t``), the context
  its local derivative needs (kept by the sender) and ``stats``: **private** diagnostics computed
  from the input (``snr`` = RMS of the signal over the noise's standard deviation), for the
  party's own log only; :meth:`public_diagnostics` has what may be reported;
* ``local_grad(ctx, grad)`` maps the gradient w.r.t. the released tensor back to the
  mechanism's input (only used by guests on forward releases);
* Laplace noise (the Laplace mechanism and R3eLU's Laplace part) is **discrete Laplace on a
  power-of-two grid** (:mod:`fl_split.privacy.sampling`), so its pure epsilon holds on floats,
  snapping and sampler slack included; the Gaussian mechanism keeps float sampling (not exact:
  ``docs/accounting.md``, "Sampling Laplace noise on floats"); Bernoulli draws (randomized
  response, R3eLU's activation) compare 32-bit integers with a threshold rounded *down*, so a
  keep probability never rounds up.
"""

from __future__ import annotations

import math

import dp_accounting
import torch

from fl_split.privacy.base import Mechanism, PrivacyCost, Release
from fl_split.privacy.bounds import PublicRange, bits_range, dlap_range, gaussian_range
from fl_split.privacy.events import elementwise_dlap_event
from fl_split.privacy.ledger import pure_dp_event
from fl_split.privacy.r3elu import (ALLOCATIONS, ImportanceTracker, R3eLU, activation_probability, clip_k,
                                    geometric_epsilon)
from fl_split.privacy.sampling import (CLAIM_MARGIN, DIRECTIONS, DiscreteLaplace, bernoulli_below, calibrate,
                                       check_direction, check_width, choose_grid, dlap_sd, flat_batch, grid_units,
                                       positive, rms, sampler_slack, snap)


# -- Laplace ------------------------------------------------------------------------------------
class Laplace(Mechanism):
    """Laplace mechanism on a bounded tensor (001 baseline, 002 §3.2 Eq. 1, 003 App. B.1).

    Each element is **clipped** to ``[-bound, bound]`` (002 zeroes out-of-range elements instead;
    clipping keeps more signal and has the same sensitivity — spec §3 allows either), snapped to a
    power-of-two grid ``γ`` (``n = round(v/γ) ∈ [−M, M]``, ``M = round(bound/γ)``) and released
    as ``γ·(n + Z)``, ``Z ~ DLap(t)`` per element: the discrete Laplace mechanism, whose scale
    ``b = γ·t`` plays the continuous ``Lap(0, b)``'s part. Forward and backward releases are the
    same operation.

    A record's tensor has L1 sensitivity ``Δ = 2·M·d`` grid steps (``≈ 2·bound·d``, within 1/32),
    so given ``epsilon`` the noise is ``t = Δ/(ε − slack)`` (slack: :func:`sampling.sampler_slack`,
    ``d·t·2^-46``) and the claim ``ε`` holds exactly; given ``b`` (003 Table 3's scale),
    ``ε = Δ/t + slack`` is reported. The cost's event is the worst-case pair under per-element
    clipping, ``d`` discrete Laplace events of sensitivity ``2M`` (:func:`events.elementwise_dlap_event`):
    the same pure ``ε``, the exact (ε, δ) (``docs/accounting.md``, "How each mechanism is charged").

    ``local_grad`` is the clip's derivative: 1 where ``|v| < bound``, 0 elsewhere (the snapping,
    a move of at most ``γ/2 ≤ bound/32``, is passed through as the identity).

    An ``epsilon`` too small for the sampler (``signal_free``, :func:`sampling.calibrate`: below
    about ``2·√(d·Δ)·2^-23``, where one element's signal would be below 1e-6 of the noise) gives a
    release of input-independent noise: it costs 0, and is charged as the requested ε.
    """

    name = "laplace"
    random = True

    def __init__(self, width: int, direction: str, bound: float, epsilon: float | None = None,
                 b: float | None = None) -> None:
        self.width = check_width(width)
        self.direction = check_direction(direction)
        self.bound = positive("clip-c", bound)
        if (epsilon is None) == (b is None):
            raise ValueError("Laplace needs exactly one of epsilon (--epsilon) and b (--laplace-b), "
                             f"got epsilon={epsilon!r}, b={b!r}")
        if epsilon is not None:
            eps = positive("epsilon", epsilon)
            b_target = 2.0 * self.bound * self.width / eps
        else:
            b_target = positive("laplace-b", b)
        self.gamma = choose_grid(b_target, self.bound)
        self.units = grid_units(self.bound, self.gamma)
        self.sensitivity_units = 2 * self.units * self.width
        self.signal_free = False
        if epsilon is not None:
            self.noise, self.epsilon_bound, self.signal_free = calibrate(self.sensitivity_units, eps, self.width,
                                                                         b_target / self.gamma)
            self.epsilon = eps
            if self.signal_free:  # ε below what the sampler can carry: release input-independent noise
                self.units = self.sensitivity_units = 0
        else:
            self.noise, self.epsilon_bound = _given_scale(self.sensitivity_units, b_target / self.gamma, self.width)
            self.epsilon = self.epsilon_bound
        self.t = self.noise.t
        self.b = self.gamma * self.t
        self.sensitivity_l1 = self.sensitivity_units * self.gamma  # ≈ 2·bound·d, in value units

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = flat_batch(t, self.width, self.name)
        clipped = flat.clamp(-self.bound, self.bound)
        n = snap(clipped, self.gamma, -self.units, self.units)
        out = self.noise.sample(flat.shape, gen, flat.device).add_(n).mul_(self.gamma).to(flat.dtype)
        ctx = {}
        if self.direction == "forward":
            ctx["mask"] = (flat.abs() < self.bound).reshape(t.shape)
        stats = {"snr": 0.0 if self.signal_free else rms(clipped) / self.noise_sd(), "noise_scale": self.b}
        return Release(value=out.reshape(t.shape), ctx=ctx, encoding=self.encoding, stats=stats)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        mask = ctx.get("mask")
        return grad if mask is None else grad * mask.to(device=grad.device, dtype=grad.dtype)

    def noise_sd(self) -> float:
        """``γ·SD(DLap(t)) ≈ √2·b``."""
        return self.gamma * dlap_sd(self.t)

    def describe(self) -> dict:
        return {"name": self.name, "direction": self.direction, "width": self.width, "bound": self.bound,
                "bounding": "clip", "epsilon": self.epsilon, "b": self.b, "noise_scale": self.b,
                "sensitivity_l1": self.sensitivity_l1, "sampler": "discrete-laplace", "grid": self.gamma,
                "t": self.t, "sensitivity_units": self.sensitivity_units, "signal_free": self.signal_free}

    def public_diagnostics(self) -> dict:
        sd = self.noise_sd()
        return {"noise_scale": self.b, "noise_sd": sd, "snr_bound": 0.0 if self.signal_free else self.bound / sd}

    def public_range(self) -> PublicRange:
        """``γ·(n + Z)``, ``|n| ≤ M``: on the grid ``γ``, ``|v| ≤ γ·(M + 42t) ≈ bound + 42·b``."""
        return dlap_range(self.name, self.gamma, self.units, self.t)

    def privacy_cost(self) -> PrivacyCost:
        if self.signal_free:  # input-independent: costs 0; charged as the requested ε (an upper bound)
            event = pure_dp_event(self.epsilon)
        else:
            # each of the d elements is clipped on its own, so the worst neighbours move every
            # element by 2M grid steps at once: d discrete Laplace events of sensitivity 2M
            # (issue 26; the 1-D event of sensitivity 2Md has the same pure ε but a ~4× looser
            # (ε, δ) at d = 64)
            event = elementwise_dlap_event(self.t, 2 * self.units, self.width)
        slack = max(self.epsilon_bound - self.sensitivity_units / self.t, 0.0)
        return PrivacyCost("laplace", event, epsilon=self.epsilon, sensitivity_l1=self.sensitivity_l1,
                           params=(("b", self.b), ("bound", self.bound), ("width", self.width),
                                   ("direction", self.direction), ("grid", self.gamma), ("t", self.t),
                                   ("sensitivity_units", int(self.sensitivity_units)),
                                   ("sampler_slack", slack)))


def _given_scale(delta_units: int, t_target: float, elements: int):
    """Noise ``DLap(t ≥ t_target)`` for a given scale, and the epsilon it costs (slack included)."""
    noise = DiscreteLaplace(t_target)
    return noise, delta_units / noise.t * (1 + CLAIM_MARGIN) + sampler_slack(noise.t, elements)


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
    identity (tanh's derivative is part of the guest's bottom model). The noise is float
    ``torch.randn``: float Gaussian samplers have the same class of issue as float Laplace ones
    (a lattice and a bounded tail), which fl_split does not fix (``docs/accounting.md``).
    """

    name = "gaussian"
    random = True

    def __init__(self, width: int, direction: str, sigma: float, bound: float = 1.0) -> None:
        self.width = check_width(width)
        self.direction = check_direction(direction)
        self.sigma = positive("sigma", sigma)
        self.bound = positive("clip-c", bound)
        if self.direction == "forward":
            self.sensitivity_l2 = 2.0 * self.bound * math.sqrt(self.width)
        else:
            self.sensitivity_l2 = 2.0 * self.bound

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = flat_batch(t, self.width, self.name)
        if self.direction == "forward":
            signal = flat.clamp(-self.bound, self.bound)
        else:
            norms = flat.norm(dim=1, keepdim=True)
            signal = flat * (self.bound / norms.clamp_min(self.bound))  # factor min(1, bound/‖δ‖)
        noise = torch.randn(flat.shape, generator=gen, device=flat.device, dtype=flat.dtype).mul_(self.sigma)
        out = (signal + noise).reshape(t.shape)
        return Release(value=out, encoding=self.encoding,
                       stats={"snr": rms(signal) / self.sigma, "noise_scale": self.sigma})

    def describe(self) -> dict:
        return {"name": self.name, "direction": self.direction, "width": self.width, "sigma": self.sigma,
                "bound": self.bound, "bounding": "clamp" if self.direction == "forward" else "l2-clip",
                "noise_scale": self.sigma, "sensitivity_l2": self.sensitivity_l2,
                "noise_multiplier": self.sigma / self.sensitivity_l2}

    def public_diagnostics(self) -> dict:
        # RMS of the signal: ≤ bound per element forward; backward the L2 ball gives ≤ bound/√d
        rms_max = self.bound if self.direction == "forward" else self.bound / math.sqrt(self.width)
        return {"noise_scale": self.sigma, "noise_sd": self.sigma, "snr_bound": rms_max / self.sigma}

    def public_range(self) -> PublicRange:
        """``|v| ≤ bound + 9σ`` per element, and the per-sample L2 bound (:func:`bounds.gaussian_range`)."""
        return gaussian_range(self.direction, self.width, self.sigma, self.bound)

    def privacy_cost(self) -> PrivacyCost:
        return PrivacyCost("gaussian", dp_accounting.GaussianDpEvent(noise_multiplier=self.sigma / self.sensitivity_l2),
                           epsilon=None, sensitivity_l2=self.sensitivity_l2,
                           params=(("sigma", self.sigma), ("bound", self.bound), ("width", self.width),
                                   ("direction", self.direction)))


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
        self.width = check_width(width)
        self.direction = check_direction(direction)
        self.epsilon = positive("epsilon", epsilon)
        self.eps_bit = self.epsilon / self.width
        self.keep_probability = 1.0 / (1.0 + math.exp(-self.eps_bit))  # e^ε_b/(1+e^ε_b)

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        flat = flat_batch(t, self.width, self.name)
        bits = flat > 0
        # keep with probability floor(q·2^32)/2^32 ≤ q (never rounded up, never exactly 1)
        keep = bernoulli_below(torch.tensor(self.keep_probability, dtype=torch.float64), gen,
                               shape=flat.shape, device=flat.device)
        out = (bits == keep).to(flat.dtype).reshape(t.shape)
        return Release(value=out, encoding=self.encoding, stats=self.public_diagnostics())

    def public_diagnostics(self) -> dict:
        # E[out | B] = (1 − q) + (2q − 1)·B: signal amplitude 2q − 1 against noise SD √(q(1 − q));
        # everything here follows from ε and d (public), so the local and public values coincide
        q = self.keep_probability
        noise_sd = math.sqrt(q * (1 - q))
        snr = (2 * q - 1) / noise_sd if noise_sd > 0 else math.inf
        return {"snr": snr, "snr_bound": snr, "keep_probability": q, "noise_scale": 1.0 - q, "noise_sd": noise_sd}

    def public_range(self) -> PublicRange:
        """Bits: every released value is 0 or 1."""
        return bits_range(self.name, "randomized response releases bits")

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
           "activation_probability", "clip_k", "geometric_epsilon"]
