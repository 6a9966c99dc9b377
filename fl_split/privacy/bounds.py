"""Bounded trust after authentication: is a received release one the sender's mechanism can make?

An authenticated peer can still send values that are finite, of the right shape and below
``protocol.MAX_ABS``, yet that no honest release could be: a guest that multiplies its releases
by 1,000 wrecks the host's model without any protocol check noticing (issue 16). The receiver
knows the sender's mechanism and its *public* parameters (the run configuration), so it knows
what an honest release can look like, and checks every release against that before using it.

**Public range** (:class:`PublicRange`, built by each mechanism's ``public_range()`` from its
public parameters only — never from data, importances or the sender's secret):

* element bounds ``lo ≤ v ≤ hi``; for a noisy mechanism ``hi = signal bound + k·noise scale``
  with ``k`` chosen so that one honest element exceeds it with probability ``< 10⁻¹⁸``
  (:data:`GAUSS_K` = 9: ``P(|N(0,1)| > 9) = 2.3·10⁻¹⁹``; :data:`LAPLACE_K` = 42:
  ``P(|DLap(t)| ≥ 42t) ≤ e⁻⁴² = 5.7·10⁻¹⁹``). A run releasing 10⁹ elements (digits: 1 437
  records × 64 elements × 10 000 epochs) then has a false-alarm probability below 10⁻⁹;
* the per-sample L2 norm (Gaussian: ``‖clamp + N(0, σ²I_d)‖ ≤ signal + σ(√d + 9)``: Gaussian
  concentration of the 1-Lipschitz norm, ``P(‖X‖ ≥ σ√d + 9σ) ≤ e^{−81/2} = 2.6·10⁻¹⁸``);
* the grid: discrete-Laplace releases (Laplace, R3eLU) are ``γ·integer`` for a public power of
  two ``γ`` (``fl_split.privacy.sampling``), exactly, in float32;
* the alphabet: randomized response releases bits ``{0, 1}``; an exhausted geometric schedule
  releases zeros.

**Where no public bound exists** (no defence, DP-SGD only, i.e. the identity on the cut) the
receiver keeps a running statistic per peer (:class:`ScaleMonitor`): the RMS of each accepted
training release, and after a warm-up (:data:`ScaleMonitor.WARMUP` batches; a guest's check of the
host's gradients: the first epoch) a release whose RMS exceeds
:data:`ScaleMonitor.FACTOR` times the largest accepted so far is refused;
the host's monitors are ``frozen`` (issue 25): the largest RMS of the warm-up is kept as well, and a
release above the factor times it is refused, so a ramp cannot drag the reference along.
What this cannot catch: a peer that scales from its first batch (its "normal" is then the scaled
one: indistinguishable from a bottom with larger weights), or (a guest's gradients monitor, not
frozen) one that grows its scale by less than the factor per batch. In-range poisoning is the
host's :mod:`fl_split.privacy.guard`. Both are written in ``docs/robustness.md``, "Bounded trust".

A violation raises :class:`~fl_split.errors.ReleaseOutOfRange` naming the sender, the batch, the
statistic, its value and the public bound. The receiver raises it *before* any state changes
(no update, no release charged, no statistic recorded): :class:`PeerTrust` checks all of a request
first and records the statistics only once every message passed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fl_split.errors import ReleaseOutOfRange

if TYPE_CHECKING:
    from fl_split.privacy.base import Mechanism
    from fl_split.schedule import BatchKey

#: Gaussian tail multiplier: ``P(|N(0, 1)| > 9) = 2.3e-19`` per element
GAUSS_K = 9.0
#: discrete-Laplace tail multiplier: ``P(|DLap(t)| ≥ 42·t) ≤ e^-42 = 5.7e-19`` per element
LAPLACE_K = 42.0
#: relative slack for float32 rounding of a release (the bounds are computed in float64)
FLOAT_SLACK = 1e-5


@dataclass(frozen=True)
class PublicRange:
    """What every honest release of a mechanism satisfies, from public parameters only.

    ``lo``/``hi``: element bounds (``hi`` holds with probability ``≥ 1 − 10⁻¹⁸`` per element where
    noise is unbounded); ``grid``: every value is an integer multiple of it; ``alphabet``: every
    value is one of these; ``row_l2``: every sample's L2 norm is at most this. ``why`` says where
    the numbers come from, for the refusal message and ``describe()``."""

    mechanism: str
    lo: float
    hi: float
    grid: float | None = None
    alphabet: tuple[float, ...] | None = None
    row_l2: float | None = None
    why: str = ""

    def describe(self) -> dict:
        out = {"mechanism": self.mechanism, "lo": self.lo, "hi": self.hi, "why": self.why}
        if self.grid is not None:
            out["grid"] = self.grid
        if self.alphabet is not None:
            out["alphabet"] = list(self.alphabet)
        if self.row_l2 is not None:
            out["row_l2"] = self.row_l2
        return out

    def violation(self, t: torch.Tensor) -> str | None:
        """``None`` when ``t`` (a batch ``(B, …)``) is within the range; else one sentence naming the
        statistic, its value and the bound. A few vectorised passes over the float32 values (the
        bounds are Python floats, compared exactly; the L2 norm's float32 error is far below
        :data:`FLOAT_SLACK`)."""
        v = t.detach()
        if v.numel() == 0:
            return None
        v = v.reshape(v.shape[0] if v.dim() else 1, -1)
        if not v.is_floating_point():
            v = v.float()
        if self.alphabet is not None:
            ok = v == self.alphabet[0]
            for a in self.alphabet[1:]:
                ok |= v == a
            if not bool(ok.all()):
                bad = float(v[~ok][0])
                return (f"value {bad:.6g} is not in the alphabet {{{', '.join(f'{a:g}' for a in self.alphabet)}}} "
                        f"of its {self.mechanism} mechanism ({self.why})")
            return None
        vmin, vmax = (float(x) for x in torch.aminmax(v))
        if not vmax <= self.hi + FLOAT_SLACK * abs(self.hi):
            return (f"max value {vmax:.6g} exceeds the public bound {self.hi:.6g} of its {self.mechanism} mechanism "
                    f"({self.why})")
        if not vmin >= self.lo - FLOAT_SLACK * abs(self.lo):
            return (f"min value {vmin:.6g} is below the public bound {self.lo:.6g} of its {self.mechanism} mechanism "
                    f"({self.why})")
        if self.row_l2 is not None:
            norm = float(torch.linalg.vector_norm(v, dim=1).amax())
            if not norm <= self.row_l2 * (1 + FLOAT_SLACK):
                return (f"max per-sample L2 norm {norm:.6g} exceeds the public bound {self.row_l2:.6g} of its "
                        f"{self.mechanism} mechanism ({self.why})")
        if self.grid is not None:
            units = v / self.grid  # exact: the grid is a power of two
            if not torch.equal(units, torch.round(units)):
                bad = float(v[units != torch.round(units)][0])
                return (f"value {bad:.9g} is not on the grid {self.grid:g} of its {self.mechanism} mechanism "
                        f"(every release is grid·integer; {self.why})")
        return None


    def project(self, t: torch.Tensor) -> torch.Tensor:
        """The nearest tensor within the range (what a hostile sender that knows the check sends:
        the attacks' malicious host, ``fl_split.attacks.fsha``): per sample scaled into the L2
        bound, clamped to ``[lo, hi]``, snapped to the grid or the nearest alphabet value."""
        v = t.detach().reshape(t.shape[0] if t.dim() else 1, -1).to(torch.float64)
        if self.alphabet is not None:
            a = torch.tensor(self.alphabet, dtype=v.dtype, device=v.device)
            return a[(v[..., None] - a).abs().argmin(dim=-1)].reshape(t.shape).to(t.dtype)
        if self.row_l2 is not None:
            norms = torch.linalg.vector_norm(v, dim=1, keepdim=True)
            v = v * (self.row_l2 * (1 - 1e-6) / norms.clamp_min(self.row_l2))
        v = v.clamp(self.lo, self.hi)
        if self.grid is not None:
            v = torch.round(v / self.grid).mul_(self.grid).clamp_(self.lo, self.hi)
        return v.reshape(t.shape).to(t.dtype)


# -- the ranges of the shipped mechanisms (called by their ``public_range()``) ----------------------
def gaussian_range(direction: str, width: int, sigma: float, bound: float) -> PublicRange:
    """Gaussian (000/003 §3.3): forward ``clamp(v, ±bound) + N(0, σ²)``; backward a per-sample
    L2-clip to ``bound`` plus ``N(0, σ²)``. Elements ``|v| ≤ bound + 9σ``; per sample
    ``‖v‖ ≤ bound·√d + σ(√d + 9)`` forward and ``bound + σ(√d + 9)`` backward."""
    noise_row = sigma * (math.sqrt(width) + GAUSS_K)
    signal_row = bound * math.sqrt(width) if direction == "forward" else bound
    hi = bound + GAUSS_K * sigma
    return PublicRange("gaussian", -hi, hi, row_l2=signal_row + noise_row,
                       why=f"|v| <= bound + {GAUSS_K:g}·sigma = {bound:g} + {GAUSS_K:g}·{sigma:g}; per sample "
                           f"L2 <= {'bound·√d' if direction == 'forward' else 'bound'} + sigma·(√d + {GAUSS_K:g}), "
                           f"d = {width}")


def dlap_range(name: str, gamma: float, units: int, t: float, nonnegative: bool = False) -> PublicRange:
    """Discrete Laplace on the grid ``γ`` (Laplace; R3eLU uniform): ``v = γ·(n + Z)`` with
    ``|n| ≤ M`` and ``|Z| < 42·t`` (R3eLU forward: ``γ·max(n + Z, 0)·active ≥ 0``)."""
    hi = gamma * (int(units) + math.ceil(LAPLACE_K * t))
    return PublicRange(name, 0.0 if nonnegative else -hi, hi, grid=float(gamma),
                       why=f"grid·(M + {LAPLACE_K:g}·t) = {gamma:g}·({int(units)} + {LAPLACE_K:g}·{t:.6g}), i.e. "
                           f"clip + {LAPLACE_K:g}·b, b = {gamma * t:.6g}" + ("; values >= 0" if nonnegative else ""))


def bits_range(name: str, why: str) -> PublicRange:
    return PublicRange(name, 0.0, 1.0, alphabet=(0.0, 1.0), why=why)


def zeros_range(name: str, why: str) -> PublicRange:
    return PublicRange(name, 0.0, 0.0, alphabet=(0.0,), why=why)


# -- where no public bound exists --------------------------------------------------------------------
class ScaleMonitor:
    """Running scale of one peer's releases (no public bound: no defence, DP-SGD only).

    Once :data:`WARMUP` accepted training releases were seen, a release whose RMS exceeds
    :data:`FACTOR` × the *largest* RMS of every accepted training release so far is refused. The
    reference is a maximum, not a median: honest partial losses shrink by orders of magnitude as
    training converges and then spike on a badly classified batch (measured: up to 48,000× the
    running median on breast-cancer, never above 3.3× the maximum of the last 64), while
    activations stay within 2.2× of it. It is the maximum of the whole run, not of the last
    64 releases (as before): on movielens-small with R3eLU on the guest's releases, an honest partial loss
    in epoch 2 was 34× the largest of its last 64 (converged losses of ~5e-7) and stopped the run;
    a maximum that only grows cannot be dragged down by convergence (``docs/robustness.md``,
    "Bounded trust", has the runs). A ×1,000 release is refused whenever its own unscaled RMS is
    above ``FACTOR/1000`` = 1/50 of that maximum: activations always are; converged partial losses
    may not be."""

    WARMUP = 8
    FACTOR = 20.0

    def __init__(self, frozen: bool = False, warmup: int | None = None) -> None:
        #: accepted training releases before anything is refused (default :data:`WARMUP`)
        self.warmup = self.WARMUP if warmup is None else max(1, int(warmup))
        self._top = 0.0  # the largest RMS of every accepted training release
        self._seen = 0
        #: ``frozen`` (the host's check of activations, issue 25): the largest RMS of the warm-up is
        #: kept as a reference growth cannot drag (a ramp ×5 per batch follows any running maximum)
        self.frozen = frozen
        self._ref: float | None = None

    @staticmethod
    def rms(t: torch.Tensor) -> float:
        n = t.numel()
        return float(torch.linalg.vector_norm(t.detach())) / math.sqrt(n) if n else 0.0

    def violation(self, rms: float) -> str | None:
        if self._seen < self.warmup:
            return None
        if self._ref is not None and self._ref > 0 and rms > self.FACTOR * self._ref:
            return (f"batch RMS {rms:.6g} is {rms / self._ref:.3g}x the largest RMS {self._ref:.6g} of its first "
                    f"{self.warmup} training releases (allowed: {self.FACTOR:g}x; the reference is frozen after the "
                    f"warm-up; no public bound without a defence)")
        if self._top > 0 and rms > self.FACTOR * self._top:
            return (f"batch RMS {rms:.6g} is {rms / self._top:.3g}x the largest RMS {self._top:.6g} of its "
                    f"{self._seen} accepted training releases (allowed: {self.FACTOR:g}x; no public bound without "
                    "a defence)")
        return None

    def add(self, rms: float) -> None:
        rms = float(rms)
        self._seen += 1
        self._top = max(self._top, rms)
        if self.frozen and self._seen == self.warmup:  # the warm-up's largest is the run's so far
            self._ref = self._top

    @property
    def seen(self) -> int:
        return self._seen


@dataclass
class PeerTrust:
    """What a receiver checks of its peers' releases beyond the protocol (issue 16).

    ``mechanisms[peer](key)`` is the *peer's* mechanism for the batch ``key`` (built here from the
    public configuration; only its ``public_range()`` is used). ``what`` names the releases
    ("activations", "gradients"). :meth:`check` raises before anything changes; :meth:`record`
    folds accepted training releases into the per-peer statistics (call it once the whole request
    passed every check)."""

    receiver: str
    what: str
    mechanisms: dict[str, Callable[["BatchKey"], "Mechanism"]]
    #: the scale monitors keep their warm-up reference (:class:`ScaleMonitor` ``frozen``)
    frozen: bool = False
    #: training releases a scale monitor accepts before it refuses any (:class:`ScaleMonitor` ``warmup``)
    warmup: int = ScaleMonitor.WARMUP
    monitors: dict[str, ScaleMonitor] = field(default_factory=dict)
    _ranges: dict[int, tuple] = field(default_factory=dict, repr=False)
    _rms: dict[tuple, float] = field(default_factory=dict, repr=False)  # computed by check, kept by record

    def public_range(self, peer: str, key: "BatchKey") -> PublicRange | None:
        get = self.mechanisms.get(peer)
        if get is None:
            return None
        mech = get(key)
        hit = self._ranges.get(id(mech))
        if hit is None or hit[0] is not mech:  # a mechanism's parameters are fixed: its range too
            if len(self._ranges) > 64:
                self._ranges.clear()
            hit = self._ranges[id(mech)] = (mech, mech.public_range())
        return hit[1]

    def check(self, peer: str, key: "BatchKey", t: torch.Tensor, round_: int | None = None) -> None:
        rng = self.public_range(peer, key)
        if rng is not None:
            why = rng.violation(t)
        elif key.phase == "train":
            rms = self._rms[(peer, key)] = ScaleMonitor.rms(t)
            why = self.monitors.get(peer, ScaleMonitor(self.frozen, self.warmup)).violation(rms)
        else:
            why = None
        if why is not None:
            raise ReleaseOutOfRange(peer, self.receiver, self.what, str(key), round_, why)

    def record(self, peer: str, key: "BatchKey", t: torch.Tensor) -> None:
        if key.phase != "train" or self.public_range(peer, key) is not None:
            return
        rms = self._rms.pop((peer, key), None)
        self.monitors.setdefault(peer, ScaleMonitor(self.frozen, self.warmup)).add(ScaleMonitor.rms(t) if rms is None else rms)
        if len(self._rms) > 1024:  # checked but never recorded (a refused request): forget them
            self._rms.clear()


__all__ = ["GAUSS_K", "LAPLACE_K", "PeerTrust", "PublicRange", "ScaleMonitor", "bits_range", "dlap_range",
           "gaussian_range", "zeros_range"]
