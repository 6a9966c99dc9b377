"""Discrete Laplace noise on a power-of-two grid, with an epsilon that holds on floats.

Why not ``Lap(0, b)`` in floating point (what fl_split did before): inverting the CDF of a float
uniform gives noise on a lattice with a truncated tail, so two neighbouring inputs have outputs
that only one of them can produce (Mironov 2012, "On significance of the least significant bits
for differential privacy"), and the pure epsilon is false. Here a Laplace release is

    ``γ·(n + Z)``,  ``n = round(v/γ)`` (deterministic),  ``Z ~ DLap(t)``: ``P(Z = z) ∝ exp(−|z|/t)``,

with ``γ`` a power of two and ``t = b/γ`` (:func:`choose_grid`). On the integers ``n`` this is the
discrete Laplace mechanism, whose epsilon is ``Δ_units/t`` for an L1 sensitivity of ``Δ_units``
grid steps; scaling by ``γ`` and casting to float32 afterwards is post-processing.

**The sampler** (:class:`DiscreteLaplace`), vectorised, on the input's device, every bit from the
caller's generator:

* ``Z = S·G`` with ``S = ±1`` a fair bit and ``G = floor(t·E)``, ``E ~ Exp(1)``, redrawing the
  pair ``(S = −1, G = 0)`` so that 0 is not counted twice: ``G`` is geometric with ratio
  ``e^{−1/t}`` and ``Z`` is exactly ``DLap(t)`` when ``E`` is exact;
* ``E/ln 2 = N + F`` with ``N ~ Geometric(1/2)`` (``P(N = j) = 2^{−j−1}``) and, independent of it,
  ``F = −log2(V)``, ``V ~ U(1/2, 1]`` (an exponential split into its integer and fractional parts in
  base 2: memorylessness). ``N`` counts the leading zero bits of a stream of fair bits (the tail is
  never truncated). ``V = 1 − k·2^{−53}``, ``k`` uniform on 52 bits;
* **Bits**: one uniform 63-bit word per element (``random_()`` on int64, ``random64() mod 2^63``)
  holds, in disjoint (hence independent) fields, the first 10 bits of ``N``'s stream (bits 62..53),
  ``S`` (bit 52) and ``k`` (bits 51..0). A field of ten zeros (probability 2^-10) continues the
  stream with :func:`geometric_half` — 52-bit words ``w ≠ 0`` give ``51 − floor(log2 w)``, read
  exactly from the float64 exponent field, a zero word adds 52 and draws the next — and that element
  takes fresh ``S`` and ``V`` (independent of ``N``, so the joint law is unchanged). ``N < 10`` and
  its ``floor(s·N)``, ``frac(s·N)`` come from 2048-entry tables indexed by the word's top 11 bits;
  on the CPU the tensor is processed in chunks (:data:`CPU_CHUNK`; the output does not depend
  on it). The arithmetic on ``y`` is that of :func:`floor_s_n_plus_y`;
* ``s = t·ln 2`` is a dyadic number of 31 significant bits (the constructor rounds ``t`` *up*, so
  the noise only grows), hence ``s·N`` is **exact** in float64 while ``N < 2^22`` (and in Python
  integers beyond, an event of probability ``2^{−2^22}``): ``G = floor(s·N) + floor(frac(s·N) +
  t·(−ln V))``, and only that bounded second part (``< 1 + s``) carries rounding error.

**Error analysis** (``docs/accounting.md``, "Sampling Laplace noise on floats"). Couple the sampled
``V`` with an exact uniform ``V*`` (``V`` is ``V*`` rounded up to the 2^-53 grid). For every outcome
the computed argument of the floor differs from the exact ``t·E*`` by at most ``e = 4·t·2^{−52}``:
the grid ``< t·2^{−52}`` (``ln(V/V*) < 2^{−53}/V* < 2^{−52}``), ``log1p`` within 2 ulp ``≤ t·2^{−52}``,
``t`` in float64 and the product ``< 1.04·t·2^{−52}``, the final sum ``< 0.85·t·2^{−52}``. Hence
every ``P(G = g)`` is sampled with relative error ``ρ ≤ e·(e^{(1+e)/t} + 1) ≤ 2.002·e ≈ t·2^{−49}``
(``t ≥ 1024``), ``P(Z = z)`` within ``[(1−ρ)/(1+ρ), (1+ρ)/(1−ρ)]`` after the redraw. An element whose
grid value ``n`` is the same under both neighbours has *identical* output laws; one that differs
has a privacy loss of at most ``|Δn|/t + 2·ln((1+ρ)/(1−ρ)) < |Δn|/t + t·2^{−47}``, charged as
``t·2^{−46}`` (a factor 2 of margin). A release's pure
epsilon is therefore ``Δ_units/t + m·t·2^{−46}``, ``m`` the number of elements that can differ
(:func:`sampler_slack`), which the mechanisms charge, with ``δ = 0``. (Ideal random bits are
assumed, as everywhere in DP; the generator is the caller's.)
"""

from __future__ import annotations

import math

import torch

#: the grid makes ``t = b/γ ≥ T_MIN`` (``t ∈ [1024, 2048)`` unless :data:`M_MIN` binds)
T_MIN = 1024.0
#: … and makes the clip bound span at least this many grid steps (``bound/γ ≥ 16``): the snapping
#: then moves a value by at most ``bound/32`` and changes the sensitivity by at most 1/32 …
M_MIN = 16.0
#: … unless that would make ``t`` exceed ``T_CAP`` (per-element slack ``t·2^-46 ≤ 2^-30``): then the
#: grid is coarser, down to one step per bound (``M ≥ 1`` always, so some signal survives); this
#: happens only when ``b/bound > 4096`` (Laplace: ``d/ε > 2048``), where one element's signal is
#: below 1/4096 of the noise anyway, and ``t`` exceeds ``T_CAP`` only when ``b/bound > 2^15``
T_CAP = 2.0 ** 16
#: largest ``t`` the sampler supports (``s = t·ln 2 < 2^30``)
T_MAX = 2.0 ** 30
#: per-element slack: privacy loss ≤ ``|Δn|/t + t·SLACK_COEF`` (module docstring)
SLACK_COEF = 2.0 ** -46
#: relative margin for the float64 evaluation of ``Δ/t`` in the calibrations (``t = s/ln 2``)
CLAIM_MARGIN = 2.0 ** -40

_S_BITS = 31  # significant bits of s = t·ln 2
_LN2 = math.log(2.0)
_WORD_BITS = 52  # geometric words: torch.randint(0, 2**52), exact in float64
_N_EXACT = 2 ** 22  # s·N exact in float64 below this (31 + 22 = 53 bits)
_P52 = float(2 ** 52)
_P53_INV = 2.0 ** -53


# -- grid ----------------------------------------------------------------------------------------
def pow2_floor(x: float) -> float:
    """The largest power of two ``≤ x`` (``x > 0``), exactly."""
    _, e = math.frexp(x)  # x = f·2^e, f in [0.5, 1)
    return math.ldexp(1.0, e - 1)


def choose_grid(b, bound: float):
    """Grid step ``γ`` (a power of two) for a Laplace scale ``b`` on values bounded by ``bound``: the
    largest power of two with ``b/γ ≥ T_MIN`` and ``bound/γ ≥ M_MIN``; coarsened if ``b/γ`` would
    exceed :data:`T_CAP`, but never beyond ``bound`` (``bound/γ ≥ 1``). ``b`` a float or a float64
    tensor."""
    if isinstance(b, torch.Tensor):
        b = b.to(torch.float64)
        if not bool(torch.isfinite(b).all()) or bool((b <= 0).any()) or not (bound > 0 and math.isfinite(bound)):
            raise ValueError("choose_grid needs finite scales b > 0 and a finite bound > 0")
        p2 = lambda x: torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 1)  # noqa: E731
        gamma = torch.clamp(p2(b / T_MIN), max=pow2_floor(bound / M_MIN))
        return torch.clamp(torch.maximum(gamma, 2 * p2(b / T_CAP)), max=pow2_floor(bound))
    if not (b > 0 and bound > 0 and math.isfinite(b) and math.isfinite(bound)):
        raise ValueError(f"choose_grid needs finite b > 0 and bound > 0, got b={b!r}, bound={bound!r}")
    gamma = min(pow2_floor(b / T_MIN), pow2_floor(bound / M_MIN))
    return min(max(gamma, 2 * pow2_floor(b / T_CAP)), pow2_floor(bound))


def grid_units(bound: float, gamma: float) -> int:
    """``M = round(bound/γ)``, the largest ``|n|`` that ``n = round(v/γ)`` takes for ``|v| ≤ bound``
    (``γ`` a power of two so ``bound/γ`` is exact; Python and torch both round half to even and
    rounding is monotone). :func:`snap` clamps to ``[−M, M]`` as well, so the range is a fact."""
    return int(round(bound / gamma))


def snap(v: torch.Tensor, gamma, lo, hi) -> torch.Tensor:
    """``n = clamp(round(v/γ), lo, hi)`` in float64 (integers; ``v/γ`` exact for a power of two).
    ``gamma``, ``lo`` and ``hi`` are numbers or per-element tensors (on ``v``'s device)."""
    n = torch.round(v.to(torch.float64) / gamma)
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        ref = lo if isinstance(lo, torch.Tensor) else hi
        lo = lo if isinstance(lo, torch.Tensor) else torch.full_like(ref, float(lo))
        hi = hi if isinstance(hi, torch.Tensor) else torch.full_like(ref, float(hi))
    return torch.clamp(n, lo, hi)


def sampler_slack(t_max: float, elements: int) -> float:
    """Extra privacy loss of this sampler over the exact ``DLap``: ``elements·t_max·2^{−46}``
    (``elements`` = how many elements can differ between neighbouring inputs)."""
    return float(elements) * float(t_max) * SLACK_COEF


def dlap_sd(t: float) -> float:
    """Standard deviation of ``DLap(t)`` in grid units: ``√(2r)/(1 − r)``, ``r = e^{−1/t}`` (≈ √2·t)."""
    r = math.exp(-1.0 / t)
    return math.sqrt(2.0 * r) / -math.expm1(-1.0 / t)


# -- the sampler ---------------------------------------------------------------------------------
class DiscreteLaplace:
    """``DLap(t)`` noise, ``P(z) ∝ exp(−|z|/t)``, for one ``t`` or one per element.

    ``t_target`` (a float, or a 1-D tensor of per-element values in ``[1, 2^30]``) is rounded *up*
    so that ``t·ln 2 = m·2^{−shift}`` with integers ``m < 2^31`` and one ``shift`` for all elements.
    :attr:`t` holds the values used (float or float64 CPU tensor) and :attr:`t_exact_inv` helps
    claims: ``1/t = ln 2·2^{shift}/m``.
    """

    def __init__(self, t_target) -> None:
        tt = torch.as_tensor(t_target, dtype=torch.float64).detach().cpu()
        if tt.numel() == 0 or not bool(torch.isfinite(tt).all()) or bool((tt < 1.0).any()) \
                or bool((tt > T_MAX).any()):
            raise ValueError(f"discrete Laplace parameter t must be in [1, 2^30], got {t_target!r}")
        self.scalar = tt.dim() == 0
        s = tt * _LN2
        _, e = math.frexp(float(s.max()))  # s_max in [2^(e-1), 2^e)
        self.shift = _S_BITS - e
        m = torch.ceil(torch.ldexp(s * (1 + 2.0 ** -50), torch.tensor(self.shift)))
        t = m * 2.0 ** -self.shift / _LN2
        while bool((t < tt).any()):  # float guard, never taken in practice
            m = m + (t < tt).to(m.dtype)
            t = m * 2.0 ** -self.shift / _LN2
        self.m = m  # float64 integers < 2^31
        self.s = m * 2.0 ** -self.shift  # exact
        self.t = float(t) if self.scalar else t
        self.t_max = float(t.max())
        self.t_min = float(t.min())
        self._dev: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _on(self, device) -> tuple:
        if self.scalar:
            return float(self.s), float(self.t)
        key = str(device)
        if key not in self._dev:
            self._dev[key] = (self.s.to(device), self.t.to(device))
        return self._dev[key]

    def sample(self, shape, gen: torch.Generator | None, device) -> torch.Tensor:
        """Integer-valued float64 tensor of ``DLap(t)`` draws; per-element ``t`` broadcasts over
        ``shape`` (its last dimensions). One 63-bit word per element (module docstring, "Bits")."""
        shape = tuple(shape)
        count = math.prod(shape)
        if self.scalar:
            s, t = float(self.s), float(self.t)
        else:
            s_dev, t_dev = self._on(device)
            s = s_dev.expand(shape).reshape(-1)
            t = t_dev.expand(shape).reshape(-1)
        z = _dlap_words(count, s, t, self.shift, self._tables(device), gen, device)
        return z.reshape(shape)

    def _tables(self, device) -> tuple:
        """Per-device lookup tables over the top 11 bits of a word (``_HEAD_BITS`` geometric bits,
        then the sign bit): ``N``, and for one ``t`` also ``floor(s·N)`` and ``frac(s·N)`` (exact),
        and the sign ``±1`` (NaN marks the all-zero geometric field, extended afterwards)."""
        key = "tab:" + str(device)
        if key not in self._dev:
            self._dev[key] = _word_tables(float(self.s) if self.scalar else None, device)
        return self._dev[key]


# -- the vectorised sampler: one 63-bit word per element -----------------------------------------
_HEAD_BITS = 10  # geometric bits at the top of a 63-bit word (bits 62..53)
_SIGN_SHIFT = 52  # bit 52: the sign; bits 51..0: k
_MASK52 = 2 ** 52 - 1
_NEG_ZERO_BITS = -(2 ** 63)  # int64 view of the float64 −0.0: the rejected (S = −1, G = 0)
#: elements per chunk on the CPU with several torch threads, and with one: the output does not
#: depend on it (the words are one mt19937 sequence; extensions and redraws are drawn after all
#: chunks). With one thread the temporaries of a chunk (512 KiB each) stay in cache; with several,
#: each op of a chunk is an OpenMP region (float64 log1p/floor parallelise from 2048 elements), and
#: on an oversubscribed machine every region waits for a descheduled thread, so fewer, larger chunks
#: (measured in experiments/README.md, "Exact Laplace sampler"). Other devices take the whole tensor.
CPU_CHUNK = 1 << 20
CPU_CHUNK_ONE_THREAD = 1 << 16


def _word_tables(s: float | None, device) -> tuple:
    idx = torch.arange(2 ** (_HEAD_BITS + 1), dtype=torch.int64)
    head = idx >> 1  # the geometric field, its first bit (bit 62) read first
    n = torch.where(head > 0, (_HEAD_BITS - 1) - floor_log2_exact(head.clamp(min=1).to(torch.float64)),
                    torch.zeros_like(head)).to(torch.float64)
    sign = torch.where((idx & 1) == 1, -1.0, 1.0).to(torch.float64)
    sign[head == 0] = math.nan  # N ≥ _HEAD_BITS: finished after the chunks (_dlap_words)
    if s is None:
        return n.to(device), sign.to(device)
    sn = n * s  # exact: N < 10, s has 31 significant bits
    ip = torch.floor(sn)
    return (sn - ip).to(device), ip.to(device), sign.to(device)


def _dlap_words(count: int, s, t, shift: int, tables: tuple, gen, device) -> torch.Tensor:
    """``count`` draws of ``DLap(t)`` (flat float64); ``s``/``t`` floats or flat per-element tensors.

    Word ``w`` (``random_()`` on int64: ``random64() mod 2^63``, 63 uniform bits): its top
    :data:`_HEAD_BITS` bits start the fair bit stream of ``N``, bit 52 is ``S``, the low 52 bits are
    ``k`` (``V = 1 − k·2^-53``): disjoint fields of a uniform word, hence independent. Then
    ``G = floor(frac(s·N) + t·(−ln V)) + floor(s·N)`` — the same float64 operations as
    :func:`floor_s_n_plus_y` on the same ``y``, so the module's error analysis applies verbatim.
    An all-zero geometric field (``N ≥ 10``, probability 2^-10) is finished after all chunks with
    fresh ``S``, ``V`` (independent of ``N``) and ``N = 10 + geometric_half``; the rejected
    ``(S = −1, G = 0)`` come out as ``−0.0`` and are redrawn, as a batch, until none is left."""
    out = torch.empty(count, dtype=torch.float64, device=device)
    scalar = isinstance(t, float)
    if torch.device(device).type == "cpu":
        chunk = CPU_CHUNK if torch.get_num_threads() > 1 else CPU_CHUNK_ONE_THREAD
    else:
        chunk = max(count, 1)
    width = min(chunk, count)
    words = torch.empty(width, dtype=torch.int64, device=device)
    idx = torch.empty_like(words)
    buf = torch.empty(width, dtype=torch.float64, device=device)
    special = []
    for a in range(0, count, chunk):
        m = min(chunk, count - a)
        w, ix, b, z = words[:m], idx[:m], buf[:m], out[a:a + m]
        w.random_(generator=gen)
        torch.bitwise_right_shift(w, _SIGN_SHIFT, out=ix)
        z.copy_(w.bitwise_and_(_MASK52)).mul_(-_P53_INV).log1p_()  # ln V, V = 1 − k·2^-53
        if scalar:
            frac_t, ip_t, sign_t = tables
            z.mul_(-t)  # y = t·(−ln V) ∈ [0, s)
            z.add_(torch.index_select(frac_t, 0, ix, out=b)).floor_()
            z.add_(torch.index_select(ip_t, 0, ix, out=b))
        else:
            n_t, sign_t = tables
            z.mul_(t[a:a + m]).neg_()
            sn = torch.index_select(n_t, 0, ix, out=b).mul_(s[a:a + m])  # exact
            ip = torch.floor(sn)
            z.add_(sn.sub_(ip)).floor_().add_(ip)
        z.mul_(torch.index_select(sign_t, 0, ix, out=b))
        flag = torch.isnan(z).logical_or_(z.view(torch.int64) == _NEG_ZERO_BITS)
        pos = flag.nonzero().squeeze(1)
        if pos.numel():
            special.append(pos.add_(a))
    if not special:
        return out
    pos = torch.cat(special)
    ext = torch.isnan(out[pos])
    if bool(ext.any()):  # N ≥ _HEAD_BITS: continue the bit stream; fresh S and V
        pe = pos[ext]
        se, te = (s, t) if scalar else (s[pe], t[pe])
        w = torch.empty(pe.numel(), dtype=torch.int64, device=device).random_(generator=gen)
        n, _ = geometric_half((pe.numel(),), gen, device)
        n.add_(_HEAD_BITS)
        y = torch.log1p(w.bitwise_and(_MASK52).to(torch.float64).mul_(-_P53_INV)).mul_(te).neg_()
        g = floor_s_n_plus_y(n, se, y, shift, extended=True)  # ≥ floor(10·s) > 0: never rejected
        out[pe] = torch.where((w >> _SIGN_SHIFT) & 1 == 1, g.neg(), g)
    rej = pos[~ext]
    if rej.numel():  # (S = −1, G = 0): probability (1 − e^{−1/t})/2 ≤ 1/(2t)
        sr, tr = (s, t) if scalar else (s[rej], t[rej])
        out[rej] = _dlap_words(rej.numel(), sr, tr, shift, tables, gen, device)
    return out


def geometric_half(shape, gen: torch.Generator | None, device) -> tuple[torch.Tensor, bool]:
    """``N`` with ``P(N = j) = 2^{−j−1}`` exactly (float64 integers): the leading zero bits of a
    stream of fair bits. Also says whether any word was all zeros (only then can ``N`` exceed 51)."""
    w = torch.randint(0, 2 ** _WORD_BITS, shape, generator=gen, device=device, dtype=torch.float64)
    extra = None
    zero = w == 0
    while bool(zero.any()):  # probability 2^-52 per element: extend the bit stream, never truncate
        if extra is None:
            extra = torch.zeros(shape, dtype=torch.float64, device=device)
        idx = zero.nonzero(as_tuple=True)
        extra[idx] += _WORD_BITS
        w[idx] = torch.randint(0, 2 ** _WORD_BITS, (idx[0].numel(),), generator=gen, device=device,
                               dtype=torch.float64)
        zero = w == 0
    # 51 − floor(log2 w), read from the exponent field (biased by 1023) of the exact float64 w
    n = torch.bitwise_right_shift(w.view(torch.int64), 52).neg_().add_(1074).to(torch.float64)
    return (n, False) if extra is None else (n.add_(extra), True)


def floor_log2_exact(w: torch.Tensor) -> torch.Tensor:
    """``floor(log2 w)`` of positive integers ``< 2^53`` held in float64: the exponent field."""
    return torch.bitwise_right_shift(w.to(torch.float64).view(torch.int64), 52) - 1023


def floor_s_n_plus_y(n: torch.Tensor, s, y: torch.Tensor, shift: int, extended: bool = True) -> torch.Tensor:
    """``floor(s·N + y)`` with ``s·N`` exact: float64 while ``N < 2^22``, Python integers beyond
    (``s = m·2^{−shift}``, ``m < 2^31``; ``0 ≤ y < s``). ``extended=False`` promises ``N ≤ 51``."""
    sn = n * s  # exact: 31 + 22 bits
    ip = torch.floor(sn)
    g = sn.sub_(ip).add_(y).floor_().add_(ip)  # sn − ip exact; the sum (< 1 + s) is the only rounding
    if extended:
        big = n >= _N_EXACT
        if bool(big.any()):  # N ≥ 2^22: probability 2^-(2^22) per element
            idx = big.nonzero(as_tuple=True)
            for j in range(idx[0].numel()):
                pos = tuple(i[j] for i in idx)
                sj = s if isinstance(s, float) else float(s[pos])
                m = int(round(math.ldexp(sj, shift)))  # exact: s was built as m·2^-shift
                whole = m * int(n[pos])
                ipj = whole >> shift
                frac = math.ldexp(whole - (ipj << shift), -shift)  # < 1, at most 30 bits: exact
                g[pos] = float(ipj + math.floor(frac + float(y[pos])))
    return g


def unit_laplace_float(shape, gen: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    """The sampler fl_split used before (inverse CDF of one float32 uniform floored at 2^-24: a
    2^-24 lattice, ``|noise| ≤ 16.64``), kept only to benchmark against and to show the truncated
    tail in the tests; **no mechanism uses it**."""
    w = torch.rand(shape, generator=gen, device=device, dtype=dtype) - 0.5
    mag = w.abs().mul_(-2.0).add_(1.0).clamp_min_(2.0 ** -24).log_()
    return mag.copysign_(w)


def bernoulli_below(p: torch.Tensor, gen: torch.Generator | None, shape=None, device=None) -> torch.Tensor:
    """Boolean draws with ``P(True) = min(floor(p·2^32), 2^32 − 1)/2^32 ≤ p`` exactly (``p`` in
    float64; a 0-dim ``p`` with ``shape``/``device`` for a constant): a uniform 32-bit integer
    compared with an integer threshold. ``torch.rand(float32) < p`` would round the probability up
    as often as down (a randomized response that keeps more often than it claims spends more
    epsilon than it reports) and, once ``1 − p < 2^-24``, never flips at all."""
    thr = torch.floor(p.to(torch.float64) * 2.0 ** 32).clamp_(max=2.0 ** 32 - 1)
    shape = p.shape if shape is None else tuple(shape)
    device = p.device if device is None else device
    u = torch.randint(0, 2 ** 32, shape, generator=gen, device=device, dtype=torch.float64)
    return u < (thr.to(device) if thr.dim() else float(thr))


# -- calibration and checks shared by the mechanisms -------------------------------------------------
class EpsilonTooSmall(ValueError):
    """The requested epsilon cannot carry a signal through the grid sampler (its slack would not
    fit, or ``t`` would exceed :data:`T_MAX`): the mechanism then releases data-independent noise."""


def solve_t(t_unit, epsilon: float, elements: int) -> tuple[DiscreteLaplace, float]:
    """``DLap`` parameters ``t = t_unit/ε'`` (a float or a tensor of ``t_unit``) with
    ``ε' = epsilon − slack``: the noise and the slack it carries, so that a release whose loss
    without slack is ``≤ Σ range_i/t_i = ε'`` costs at most ``epsilon`` in all.

    The slack grows with ``t`` (``elements·t_max·2^-46``), so it solves ``s = c/(ε − s)``,
    ``c = elements·max(t_unit)·2^-46`` (the smaller root, with margin for the rounding of ``t``).
    Raises :class:`EpsilonTooSmall` when there is no root below ``ε/2`` or ``t`` would exceed
    :data:`T_MAX`."""
    tu = torch.as_tensor(t_unit, dtype=torch.float64)
    c = float(elements) * float(tu.max()) * SLACK_COEF * (1 + 2.0 ** -20)
    disc = epsilon * epsilon - 4.0 * c
    if not disc > 0:
        raise EpsilonTooSmall(f"epsilon {epsilon!r} is too small for the discrete Laplace sampler")
    # the smaller root of s² − εs + c = 0 in the form without cancellation ((ε − √disc)/2 loses every
    # digit when c << ε², e.g. ε = 100)
    slack = 2.0 * c / (epsilon + math.sqrt(disc)) * (1 + 2.0 ** -20)
    if not (slack < epsilon / 2 and float(tu.max()) / (epsilon - slack) * (1 + 2.0 ** -20) <= T_MAX):
        raise EpsilonTooSmall(f"epsilon {epsilon!r} is too small for the discrete Laplace sampler")
    target = tu / (epsilon - slack) * (1 + CLAIM_MARGIN)
    noise = DiscreteLaplace(float(target) if target.dim() == 0 else target)
    need = sampler_slack(noise.t_max, elements)
    if not need <= slack:  # pragma: no cover - the margins above make this impossible
        raise AssertionError(f"sampler slack {need} exceeds its budget {slack}")
    return noise, need


def calibrate(delta_units: float, epsilon: float, elements: int, t_fallback: float):
    """``DLap`` noise whose release costs at most ``epsilon`` *including* the sampler's slack, for
    an L1 sensitivity of ``delta_units`` grid steps and ``elements`` elements that can differ.

    Returns ``(noise, epsilon_bound, signal_free)``: ``epsilon_bound = Δ/t·(1 + CLAIM_MARGIN) +
    slack ≤ epsilon``. When ``epsilon`` is too small for the sampler (:class:`EpsilonTooSmall`:
    about ``ε < 2·√(elements·Δ)·2^-23``, e.g. 2e-5 for a 64-wide Laplace release, where one element's
    signal is below 1e-6 of the noise), ``signal_free`` is true: the caller must snap every element
    to 0, so the release is independent of the input and costs exactly 0; the noise then has
    ``t = t_fallback`` clamped to ``[T_MIN, T_CAP]``.
    """
    if delta_units > 0:
        try:
            noise, slack = solve_t(float(delta_units), epsilon, elements)
        except EpsilonTooSmall:
            pass
        else:
            bound = delta_units / noise.t_min * (1 + CLAIM_MARGIN) + slack
            if not bound <= epsilon * (1 + 1e-12):  # pragma: no cover - guarded by construction
                raise AssertionError(f"calibration overshoots: {bound} > {epsilon}")
            return noise, bound, False
    return DiscreteLaplace(min(max(t_fallback, T_MIN), T_CAP)), 0.0, True


def positive(key: str, value, what: str = "a finite number > 0") -> float:
    """``value`` as a finite float > 0, or a :class:`ConfigError` naming the option ``key``."""
    from fl_split.errors import ConfigError

    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, value, what) from None
    if not (math.isfinite(x) and x > 0):
        raise ConfigError(key, value, what)
    return x


DIRECTIONS = ("forward", "backward")


def check_width(width) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"mechanism width must be a positive int (elements per record), got {width!r}")
    return int(width)


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"mechanism direction must be one of {DIRECTIONS}, got {direction!r}")
    return direction


def flat_batch(t: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """``t`` as ``(B, d)`` after checking that each sample has ``width`` elements."""
    if t.dim() < 2:
        raise ValueError(f"{name}: expected a batch of shape (B, *sample_shape), got shape {tuple(t.shape)}")
    d = t[0].numel() if t.shape[0] else int(math.prod(t.shape[1:]))
    if d != width:
        raise ValueError(f"{name}: samples have {d} elements, the mechanism was built for width {width}")
    return t.detach().reshape(t.shape[0], width)


def rms(x: torch.Tensor) -> float:
    """Root mean square of all elements (0 for an empty tensor)."""
    return float(x.double().pow(2).mean().sqrt()) if x.numel() else 0.0


__all__ = ["CLAIM_MARGIN", "DIRECTIONS", "DiscreteLaplace", "M_MIN", "SLACK_COEF", "T_CAP", "T_MAX", "T_MIN",
           "EpsilonTooSmall", "bernoulli_below", "calibrate", "solve_t", "check_direction", "check_width", "choose_grid", "dlap_sd", "flat_batch",
           "floor_log2_exact", "floor_s_n_plus_y", "geometric_half", "grid_units", "positive", "pow2_floor", "rms",
           "sampler_slack", "snap", "unit_laplace_float"]
