"""Boundary mechanisms, their samplers, denoising and budget allocation (spec §3; papers 001 §3–4,
002 §3, 003 §3).

Statistical tests use fixed seeds and tolerances of **5 standard errors** (``Z = 5``) of the
estimate unless stated otherwise: a correct implementation fails one such check with probability
< 6e-7, and the seeds are fixed anyway, so a failure means a real change of behaviour. Each test
also states what a wrong implementation would give, to show the tolerance can detect it.
Goodness-of-fit tests compare a chi-square statistic with its ``1 − 1e-6`` quantile (same
false-alarm rate as ``Z = 5``).

Tests that run mechanisms are parametrized over devices: ``cpu`` always, ``cuda`` when a GPU is
present (skipped cleanly otherwise).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import dp_accounting
import mpmath
import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as pld
from scipy import stats as sps
from torch import nn

from fl_split.errors import ConfigError
from fl_split.privacy import sampling
from fl_split.privacy.base import Mechanism, NoDefense
from fl_split.privacy.denoise import Mask, Scale
from fl_split.privacy.mechanisms import (Gaussian, ImportanceTracker, Laplace, R3eLU, RandomizedResponse,
                                         activation_probability, clip_k, geometric_epsilon)
from fl_split.privacy.sampling import DiscreteLaplace
from fl_split.protocol import Message, batch_digest, decode, encode
from fl_split.schedule import BatchKey

Z = 5.0
CHI2_ALPHA = 1e-6
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device"))]


def gen(seed: int = 0, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def all_mechanisms(width: int = 12) -> list:
    return [Laplace(width, "forward", 2.0, epsilon=3.0), Laplace(width, "backward", 0.5, b=0.3),
            Gaussian(width, "forward", 0.7), Gaussian(width, "backward", 0.2, bound=0.5),
            R3eLU(width, "forward", 4.0, 3.0), R3eLU(width, "backward", 4.0, 0.5, k=3),
            R3eLU(width, "forward", 4.0, 3.0, allocation="importance"),
            R3eLU(width, "backward", 4.0, 3.0, allocation="importance-tight"),
            RandomizedResponse(width, 6.0)]


def max_log_ratio_bounds(counts_a: np.ndarray, counts_b: np.ndarray, min_count: int) -> tuple[float, float]:
    """Over bins populated by ``≥ min_count`` outputs under both inputs, the largest
    ``log(p̂_a/p̂_b) − Z·se`` and ``log(p̂_a/p̂_b) + Z·se``, with the delta-method standard error
    ``se = sqrt(1/n_a + 1/n_b)`` of a log-ratio of two (approximately Poisson) bin counts."""
    a, b = counts_a.ravel().astype(float), counts_b.ravel().astype(float)
    ok = (a >= min_count) & (b >= min_count)
    assert ok.sum() >= 2, "too few well-populated bins"
    a, b = a[ok], b[ok]
    lr = np.log(a / counts_a.sum()) - np.log(b / counts_b.sum())
    se = np.sqrt(1 / a + 1 / b)
    return float((lr - Z * se).max()), float((lr + Z * se).max())


def log_ratios_match(counts_a, counts_b, prob_a, prob_b, min_count: int) -> None:
    """Empirical log-ratios of populated bins agree with the exact ones within ``Z·se``."""
    a, b = counts_a.ravel().astype(float), counts_b.ravel().astype(float)
    pa, pb = np.asarray(prob_a).ravel(), np.asarray(prob_b).ravel()
    ok = (a >= min_count) & (b >= min_count)
    assert ok.sum() >= 4
    lr = np.log(a[ok] / counts_a.sum()) - np.log(b[ok] / counts_b.sum())
    exact = np.log(pa[ok]) - np.log(pb[ok])
    se = np.sqrt(1 / a[ok] + 1 / b[ok])
    assert np.all(np.abs(lr - exact) < Z * se), float(np.max(np.abs(lr - exact) / se))


def chi2_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """``(statistic, 1 − 1e-6 quantile)`` of Pearson's chi-square for counts against probabilities."""
    n = counts.sum()
    exp = n * probs
    assert exp.min() >= 20, "bins too thin for a chi-square test"
    stat = float(((counts - exp) ** 2 / exp).sum())
    return stat, float(sps.chi2.ppf(1 - CHI2_ALPHA, len(counts) - 1))


# -- the discrete Laplace sampler ----------------------------------------------------------------------
def dlap_interval_probs(t: float, edges: np.ndarray) -> np.ndarray:
    """Exact ``P(lo ≤ Z < hi)`` of ``DLap(t)`` for consecutive integer ``edges`` (with ±inf ends):
    ``P(Z ≥ a) = r^a/(1+r)`` for ``a ≥ 1``, symmetric, ``P(Z = 0) = (1−r)/(1+r)``."""
    r = math.exp(-1.0 / t)

    def cdf_below(a):  # P(Z < a) for integer a (or ±inf)
        if a == -math.inf:
            return 0.0
        if a == math.inf:
            return 1.0
        a = int(a)
        if a <= 0:
            return r ** (-a + 1) / (1 + r)  # P(Z ≤ a − 1) = P(Z ≥ 1 − a)
        return 1.0 - r ** a / (1 + r)  # 1 − P(Z ≥ a)

    c = np.array([cdf_below(e) for e in edges])
    return np.diff(c)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t_target", [1.7, 1024.0, 1873.3])
def test_discrete_laplace_matches_exact_pmf(device, t_target):
    dl = DiscreteLaplace(t_target)
    t = dl.t
    assert t_target <= t < t_target * (1 + 2 ** -29)  # rounded up, by < 2^-30 relative
    n = 2_000_000
    z = dl.sample((n,), gen(101, device), device).cpu().numpy()
    assert np.all(z == np.round(z))  # integers
    step = 1 if t < 10 else max(1, int(t / 4))
    inner = np.arange(-int(8 * t) // step * step, int(8 * t) + step, step)
    edges = np.concatenate([[-math.inf], inner, [math.inf]])
    probs = dlap_interval_probs(t, edges)
    counts = np.histogram(z, np.concatenate([[-1e300], inner - 0.5, [1e300]]))[0]
    stat, crit = chi2_ok(counts, probs)
    assert stat < crit, (stat, crit)
    # power: the same counts against DLap(1.02·t) (a 2% scale error) are rejected
    wrong, _ = chi2_ok(counts, dlap_interval_probs(t * 1.02, edges))
    if t > 100:
        assert wrong > crit, (wrong, crit)
    # and the moments are the exact ones: E|Z| = 2r/(1−r²), Var Z = 2r/(1−r)²
    r = math.exp(-1 / t)
    var = 2 * r / (1 - r) ** 2
    assert abs(np.abs(z).mean() - 2 * r / (1 - r * r)) < Z * math.sqrt(var / n)
    assert abs(z.mean()) < Z * math.sqrt(var / n)


@pytest.mark.parametrize("device", DEVICES)
def test_per_element_scales(device):
    dl = DiscreteLaplace(torch.tensor([1024.0, 1500.0, 3000.0]))
    assert dl.t.shape == (3,) and (dl.t >= torch.tensor([1024.0, 1500.0, 3000.0], dtype=torch.float64)).all()
    n = 400_000
    z = dl.sample((n, 3), gen(102, device), device).cpu().double()
    r = torch.exp(-1 / dl.t)
    mean_abs = 2 * r / (1 - r * r)
    sd = torch.sqrt(2 * r / (1 - r) ** 2)
    assert (torch.abs(z.abs().mean(0) - mean_abs) < Z * sd / math.sqrt(n)).all()  # se of E|Z| < sd/√n


@pytest.mark.parametrize("device", DEVICES)
def test_geometric_part_is_exactly_geometric(device):
    n = 4_000_000
    N, extended = sampling.geometric_half((n,), gen(103, device), device)
    assert not extended  # a zero 52-bit word has probability 2^-52
    counts = np.bincount(N.cpu().numpy().astype(int), minlength=60)
    k = 16  # P(N = j) = 2^-(j+1), j < 16, and the tail P(N ≥ 16) = 2^-16 (expected 61)
    probs = np.array([2.0 ** -(j + 1) for j in range(k)] + [2.0 ** -k])
    obs = np.concatenate([counts[:k], [counts[k:].sum()]])
    stat, crit = chi2_ok(obs, probs)
    assert stat < crit, (stat, crit)
    # the exponent read from the float64 bits is floor(log2 w) exactly, at every power-of-two edge
    edge = [x for j in range(53) for x in (2 ** j - 1, 2 ** j, 2 ** j + 1) if 1 <= x < 2 ** 53]
    w = torch.tensor(edge, dtype=torch.float64, device=device)
    assert sampling.floor_log2_exact(w).cpu().tolist() == [x.bit_length() - 1 for x in edge]


def test_geometric_part_extends_on_zero_words(monkeypatch):
    # a word of 52 zero bits adds 52 to N and draws the next word: the tail is never cut
    real = torch.randint
    calls = {"n": 0}

    def fake(low, high, size, **kw):
        calls["n"] += 1
        out = real(low, high, size, **kw)
        if calls["n"] <= 2:  # the first word and the first redraw are all zeros
            out.zero_()
        return out

    monkeypatch.setattr(torch, "randint", fake)
    N, extended = sampling.geometric_half((5,), gen(104), "cpu")
    assert extended and (N >= 104).all()


def test_tail_is_not_truncated():
    t = DiscreteLaplace(1024.0).t
    s = t * math.log(2)
    # N = 24, 40, 60 zero bits (probability 2^-25, 2^-41, 2^-61) map to |Z| ≥ 16.6t, 27.7t, 41.6t — the
    # old float32 sampler never exceeded 16.64·b; N ≥ 2^22 takes the exact-integer path
    for big in (24, 40, 60, 2 ** 22 + 3, 2 ** 40):
        n = torch.tensor([float(big)], dtype=torch.float64)
        y = torch.tensor([123.456], dtype=torch.float64)
        dl = DiscreteLaplace(1024.0)
        g = float(sampling.floor_s_n_plus_y(n, float(dl.s), y, dl.shift)[0])
        exact = math.floor(Fraction(float(dl.s)) * big + Fraction(123.456))
        assert g == exact and g >= 0.69 * big * t
    # and statistically: P(|Z| ≥ 10t) = 2r^m/(1+r) (≈ e^-10 = 4.5e-5) is met, not cut
    n = 4_000_000
    z = DiscreteLaplace(1024.0).sample((n,), gen(105), "cpu")
    m = math.ceil(10 * t)
    r = math.exp(-1 / t)
    p = 2 * r ** m / (1 + r)
    hits = int((z.abs() >= m).sum())
    assert abs(hits - n * p) < Z * math.sqrt(n * p)  # expected 182 ± 13.5
    # the old sampler's bound, for the record: |Lap| ≤ 24·ln 2 = 16.64 (its uniform is floored at 2^-24)
    old = sampling.unit_laplace_float((n,), gen(106), "cpu")
    assert float(old.abs().max()) <= 24 * math.log(2) + 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_float_error_of_the_sampler_is_within_the_budget(device):
    # the documented bound on the float64 part: |x' − x| ≤ 4·t·2^-52 for x = floor's argument, here
    # checked against 50-digit arithmetic on 2000 random (N, k) for three t (log1p of this platform
    # and device included); the analysis' ρ < t·2^-48 and slack t·2^-46 rest on it
    mpmath.mp.dps = 50
    g = gen(107, device)
    for t_target in (1024.0, 1531.7, 40000.0):
        dl = DiscreteLaplace(t_target)
        N, _ = sampling.geometric_half((2000,), g, device)
        k = torch.randint(0, 2 ** 52, (2000,), generator=g, device=device, dtype=torch.float64)
        y = torch.log1p(k * -2.0 ** -53).mul_(dl.t).neg_()
        sn = N * float(dl.s)
        ip = torch.floor(sn)
        x_comp = ((sn - ip) + y).cpu().tolist()
        s_exact = mpmath.mpf(float(dl.s))
        t_exact = s_exact / mpmath.log(2)
        worst = 0.0
        for nn_, kk, ipp, xc in zip(N.cpu().tolist(), k.cpu().tolist(), ip.cpu().tolist(), x_comp):
            v = 1 - mpmath.mpf(int(kk)) / mpmath.mpf(2) ** 53
            x = s_exact * int(nn_) + t_exact * (-mpmath.log(v))
            worst = max(worst, abs(float(x - (mpmath.mpf(ipp) + mpmath.mpf(xc)))))
        assert worst <= 4 * dl.t * 2.0 ** -52, (t_target, worst / (dl.t * 2.0 ** -52))


def _reference_from_words(words: torch.Tensor, dl: DiscreteLaplace, device):
    """The sampler's arithmetic spelled out with the reference helpers (the ones the float-error test
    above checks against 50-digit arithmetic): for each 63-bit word, ``N`` = leading zeros of bits
    62..53 (``None`` where all ten are zero: extended), ``S`` = bit 52, ``k`` = bits 51..0."""
    head = words >> 53
    sign = ((words >> 52) & 1) == 1
    k = (words & (2 ** 52 - 1)).to(torch.float64)
    n = (9 - sampling.floor_log2_exact(head.clamp(min=1).to(torch.float64))).to(torch.float64)
    if dl.scalar:
        s, t = float(dl.s), float(dl.t)
    else:
        s = dl.s.to(device).expand(words.shape).contiguous()
        t = dl.t.to(device).expand(words.shape)
    y = torch.log1p(k * -2.0 ** -53).mul_(t).neg_()
    g = sampling.floor_s_n_plus_y(n, s, y, dl.shift)
    return torch.where(sign, g.neg(), g), head == 0, sign & (g == 0), s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t_target", [1.7, 1500.0, "per-element"])
def test_sampler_is_the_documented_function_of_its_words(device, t_target, monkeypatch):
    # Each output element is a *function* of one 63-bit word: bit-for-bit the reference arithmetic
    # (floor_s_n_plus_y, log1p; their float error is bounded above) wherever the word decides it; the
    # ~2^-10 words with ten leading zeros continue the bit stream (|Z| ≥ floor(10·s)); rejected
    # (S = −1, G = 0) are redrawn. A sampler drawing its fields differently (other bits, another
    # rounding, a truncated tail) would differ on most of the 200 000 elements.
    dl = DiscreteLaplace(torch.tensor([1024.0, 1700.0, 40000.0, 2.5]) if t_target == "per-element" else t_target)
    shape = (50_000, 4)
    z = dl.sample(shape, gen(109, device), device)
    assert z.dtype == torch.float64 and z.shape == shape
    words = torch.empty(shape, dtype=torch.int64, device=device).random_(generator=gen(109, device))
    ref, extended, rejected, s = _reference_from_words(words, dl, device)
    decided = ~extended & ~rejected
    assert torch.equal(z[decided], ref[decided])
    assert 50 < int(extended.sum()) < 350  # 2^-10 of 200 000 = 195
    floor10 = torch.floor(10 * (s if isinstance(s, torch.Tensor) else torch.full_like(z, s)))
    assert bool((z[extended].abs() >= floor10[extended]).all())
    assert not bool((z.view(torch.int64) == -(2 ** 63)).any())  # no −0.0 (a rejected draw) survives
    # the same generator gives the same draws; on the CPU, independently of the chunk size
    assert torch.equal(dl.sample(shape, gen(109, device), device), z)
    if device == "cpu":
        monkeypatch.setattr(sampling, "CPU_CHUNK", 4097)
        monkeypatch.setattr(sampling, "CPU_CHUNK_ONE_THREAD", 4097)
        assert torch.equal(dl.sample(shape, gen(109, device), device), z)


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_tail_across_the_extension_boundary(device):
    # The word holds ten geometric bits; N ≥ 10 (|Z| ≥ floor(10·s) ≈ 6.93t) continues the bit stream
    # with fresh words. The exact tail P(|Z| ≥ m) = 2r^m/(1+r) must hold on both sides of that seam:
    # a seam that dropped or doubled the N ≥ 10 mass would miss the m ≥ 7t counts by ~100 % (30+ se).
    dl = DiscreteLaplace(1024.0)
    t, n = dl.t, 4_000_000
    z = dl.sample((n,), gen(110, device), device).abs_()
    r = math.exp(-1 / t)
    for m in (math.ceil(5 * t), math.floor(9 * math.log(2) * t), math.ceil(7 * t), math.ceil(8 * t)):
        p = 2 * r ** m / (1 + r)
        hits = int((z >= m).sum())
        assert abs(hits - n * p) < Z * math.sqrt(n * p), (m / t, hits, n * p)


def test_bernoulli_below_never_rounds_up(monkeypatch):
    p = torch.tensor([0.3, 1.0, 0.5], dtype=torch.float64)
    n = 400_000
    draws = sampling.bernoulli_below(p.expand(n, 3).contiguous(), gen(108)).double().mean(0)
    assert abs(draws[0] - 0.3) < Z * math.sqrt(0.21 / n)
    # p = 1 (a keep probability that rounded to one) still flips when the 32-bit word is 2^32 − 1
    monkeypatch.setattr(torch, "randint", lambda lo, hi, size, **kw: torch.full(size, float(hi - 1),
                                                                                 dtype=torch.float64))
    assert not bool(sampling.bernoulli_below(torch.tensor([1.0], dtype=torch.float64), None)[0])


def test_grid_choice():
    assert sampling.choose_grid(1280.0, 10.0) == 0.5  # b/1024 gives 1, but C/γ ≥ 16 needs 0.5
    assert sampling.choose_grid(1280.0, 1000.0) == 1.0  # t = 1280 ∈ [1024, 2048)
    for b in (0.3, 7.0, 1e4):
        gam = sampling.choose_grid(b, 1e9)
        assert 1024 <= b / gam < 2048 and math.log2(gam) == int(math.log2(gam))
    assert sampling.grid_units(10.0, 0.5) == 20


# -- Laplace ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_laplace_noise_has_scale_b_and_lies_on_the_grid(device):
    b = 0.5
    mech = Laplace(1000, "forward", 1.0, b=b)
    assert mech.b == pytest.approx(b, rel=1e-8)  # b given: t = b/γ, rounded up by < 2^-30
    noise = mech.release(torch.zeros(200, 1000, device=device), gen(1, device)).value.double().cpu()
    n = noise.numel()
    t, gam = mech.t, mech.gamma
    assert torch.equal(noise / gam, torch.round(noise / gam))  # γ·(n + Z), exact in float32
    r = math.exp(-1 / t)
    var = gam ** 2 * 2 * r / (1 - r) ** 2  # ≈ 2b²
    # |Z| has mean 2r/(1−r²) ≈ t: the noise's mean |x| is ≈ b (a Gaussian of this variance: 0.80 b)
    assert abs(noise.abs().mean() - gam * 2 * r / (1 - r * r)) < Z * math.sqrt(var / n)
    assert abs(noise.pow(2).mean() - var) < Z * math.sqrt(20) * b * b / math.sqrt(n)
    assert abs(noise.mean()) < Z * math.sqrt(var / n)
    assert mech.noise_sd() == pytest.approx(math.sqrt(2) * b, rel=1e-6)


def test_laplace_calibration_per_record_includes_the_grid():
    m = Laplace(64, "forward", 10.0, epsilon=1.0)  # the spec's example (spec §3): b = 2·10·64/1 = 1280
    assert m.gamma == 0.5 and m.units == 20 and m.sensitivity_units == 2 * 20 * 64
    assert m.b == pytest.approx(1280.0, rel=1e-8)  # C/γ is an integer here: no rounding inflation
    assert m.epsilon == 1.0  # what was asked, …
    assert m.sensitivity_units / m.t + sampling.sampler_slack(m.t, 64) <= 1.0  # … with snapping and slack
    assert m.epsilon_bound == pytest.approx(1.0, rel=1e-8)
    cost = m.cost()
    assert cost.mechanism == "laplace" and cost.epsilon == 1.0
    # per-element clipping: the worst pair moves all 64 elements by 2M = 40 steps (issue 26)
    assert isinstance(cost.dp_event, dp_accounting.SelfComposedDpEvent) and cost.dp_event.count == 64
    ev = cost.dp_event.event
    assert isinstance(ev, dp_accounting.dp_event.DiscreteLaplaceDpEvent)
    assert ev.sensitivity == 40 and ev.noise_parameter == pytest.approx(1 / m.t)
    assert dict(cost.params)["sampler_slack"] == pytest.approx(64 * m.t * 2.0 ** -46)
    # independent: dp_accounting's PLD of one such event is pure 2M/t, 64 of them 1 − slack
    eps = pld.from_discrete_laplace_mechanism(ev.noise_parameter, sensitivity=ev.sensitivity,
                                              value_discretization_interval=1e-6).get_epsilon_for_delta(0.0)
    assert 64 * eps == pytest.approx(1.0, abs=1e-3)
    # a clip bound that is not a multiple of the grid: the sensitivity is counted in whole steps and
    # b absorbs the rounding (here γ = 1/16, M = round(116.8) = 117 steps: b is 0.17% larger)
    m3 = Laplace(10, "forward", 7.3, epsilon=2.0)
    assert m3.units == round(7.3 / m3.gamma)
    assert m3.epsilon == 2.0 and m3.epsilon_bound <= 2.0
    assert m3.b == pytest.approx(2 * 7.3 * 10 / 2.0 * m3.units * m3.gamma / 7.3, rel=1e-8)
    m2 = Laplace(64, "forward", 10.0, b=640.0)  # b given: ε reported = Δ/t + slack
    assert m2.epsilon == pytest.approx(2.0, rel=1e-8) and m2.epsilon >= 2560 / m2.t


def test_laplace_clips_and_local_grad_is_the_clip_derivative():
    torch.manual_seed(0)
    v = torch.randn(16, 3, 5) * 3  # plenty of elements beyond the bound 2
    m = Laplace(15, "forward", 2.0, b=1e-7)  # negligible noise: the output is the clipped input
    rel = m.release(v, gen(2))
    assert rel.value.shape == v.shape
    assert torch.allclose(rel.value, v.clamp(-2, 2), atol=1e-5)
    grad = torch.randn_like(v)
    x = v.clone().requires_grad_(True)
    x.clamp(-2, 2).backward(grad)  # autograd's derivative of the clip (no ties at ±2 here)
    assert torch.equal(m.local_grad(rel.ctx, grad), x.grad)
    # the backward form keeps no context and its local gradient is the identity
    mb = Laplace(15, "backward", 2.0, b=1.0)
    relb = mb.release(v, gen(2))
    assert relb.ctx == {} and torch.equal(mb.local_grad(relb.ctx, grad), grad)
    # private stats: snr = RMS(clipped)/SD(noise)
    assert rel.stats["snr"] == pytest.approx(float(v.clamp(-2, 2).pow(2).mean().sqrt()) / m.noise_sd(), rel=1e-5)


def test_laplace_empirical_privacy_loss_one_element():
    # one-element record, bound 1, epsilon 1: b = 2·1·1/1 = 2; neighbours -1 and +1 (farthest apart).
    # The density ratio is exp((|x+1| − |x−1|)/2) ≤ e^1, equal to e^1 for |x| ≥ 1.
    m = Laplace(1, "forward", 1.0, epsilon=1.0)
    n = 1_000_000
    a = m.release(torch.full((n, 1), -1.0), gen(3)).value.numpy().ravel()
    b = m.release(torch.full((n, 1), 1.0), gen(4)).value.numpy().ravel()
    edges = np.arange(-12.0, 12.5, 0.5) + 1e-4  # off the grid points
    ha, _ = np.histogram(a, edges)
    hb, _ = np.histogram(b, edges)
    # bins with ≥ 5000 outputs under both: se of a log-ratio ≤ sqrt(2/5000) = 0.02, slack Z·se ≤ 0.1
    lower, upper = max_log_ratio_bounds(ha, hb, 5000)
    assert lower <= m.epsilon  # never more loss than claimed …
    assert upper >= m.epsilon  # … and the claim is attained (a per-element 2x error would show)


def test_laplace_empirical_privacy_loss_is_per_record():
    # two-element record, epsilon 1 for the whole record: b = 2·1·2/1 = 4 per element.
    # Neighbours (-1,-1) and (1,1): log density ratio = Σ_i (|x_i+1| − |x_i−1|)/4 ≤ 1, attained
    # on x ≥ (1,1). A per-element calibration (b = 2) would give 2.
    m = Laplace(2, "forward", 1.0, epsilon=1.0)
    assert m.b == pytest.approx(4.0, rel=1e-8)
    n = 1_000_000
    a = m.release(torch.full((n, 2), -1.0), gen(5)).value.numpy()
    b = m.release(torch.full((n, 2), 1.0), gen(6)).value.numpy()
    edges = np.arange(-14.0, 15.0, 1.0) + 1e-4
    ha, _, _ = np.histogram2d(a[:, 0], a[:, 1], [edges, edges])
    hb, _, _ = np.histogram2d(b[:, 0], b[:, 1], [edges, edges])
    lower, upper = max_log_ratio_bounds(ha, hb, 2000)  # se ≤ sqrt(2/2000) = 0.032
    assert lower <= 1.0 <= upper


# -- Gaussian -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_gaussian_forward_noise_and_sensitivity(device):
    sigma = 0.7
    m = Gaussian(400, "forward", sigma)
    torch.manual_seed(1)
    v = torch.tanh(torch.randn(300, 20, 20)).to(device)
    out = m.release(v, gen(7, device)).value
    noise = (out - v).double().cpu()
    n = noise.numel()
    # sample variance of n normals: se = σ²·sqrt(2/n)
    assert abs(noise.var() - sigma ** 2) < Z * sigma ** 2 * math.sqrt(2 / n)
    assert abs(noise.mean()) < Z * sigma / math.sqrt(n)
    assert m.sensitivity_l2 == pytest.approx(2 * math.sqrt(400))  # 003: 2√d for tanh outputs
    cost = m.cost()
    assert cost.epsilon is None and isinstance(cost.dp_event, dp_accounting.GaussianDpEvent)
    assert cost.dp_event.noise_multiplier == pytest.approx(sigma / 40)
    # values outside [-1, 1] are clamped defensively (no-op for tanh outputs)
    big = torch.full((2, 400), 5.0, device=device)
    tiny = Gaussian(400, "forward", 1e-8)
    assert torch.allclose(tiny.release(big, gen(0, device)).value, torch.ones(2, 400, device=device))
    assert torch.equal(m.local_grad({}, big), big)


def test_gaussian_backward_clips_each_sample_to_the_l2_ball():
    m = Gaussian(10, "backward", 1e-8, bound=0.5)  # negligible noise: output = clipped input
    d = torch.zeros(3, 10)
    d[0, 0] = 3.0  # norm 3 → scaled to 0.5
    d[1, :] = 0.01  # norm 0.032 → unchanged
    out = m.release(d, gen(0)).value
    assert out[0].norm() == pytest.approx(0.5, abs=1e-6)
    assert torch.allclose(out[0], d[0] * (0.5 / 3.0), atol=1e-6)
    assert torch.allclose(out[1], d[1], atol=1e-6)
    assert torch.allclose(out[2], d[2], atol=1e-6)  # zero vector: no division by zero
    assert m.sensitivity_l2 == pytest.approx(1.0)  # two vectors in a ball of radius 0.5
    assert m.cost().dp_event.noise_multiplier == pytest.approx(1e-8)


def _hockey_stick(ha: np.ndarray, hb: np.ndarray, eps: float) -> tuple[float, float]:
    """Empirical ``δ(ε) = Σ_bins max(p̂_a − e^ε p̂_b, 0)`` and its standard error (a sum of
    per-bin differences of two multinomial estimates: se ≤ sqrt((p_a + e^{2ε} p_b)/n) summed over the
    bins that count)."""
    pa, pb = ha / ha.sum(), hb / hb.sum()
    diff = pa - math.exp(eps) * pb
    on = diff > 0
    se = math.sqrt(float((pa[on] / ha.sum() + math.exp(2 * eps) * pb[on] / hb.sum()).sum()) + 1e-30)
    return float(diff[on].sum()), se


def test_gaussian_empirical_privacy_loss():
    # one element, bound 1, σ = 2: neighbours −1 and +1 are L2-distance 2 apart, noise multiplier 1.
    # The privacy-loss of output x is 2x/σ² (exact per bin from the normal CDF); the hockey-stick
    # divergence δ̂(ε) of the binned outputs must not exceed the δ(ε) the accountant derives from
    # the mechanism's GaussianDpEvent (binning is post-processing), and nearly attains it.
    sigma = 2.0
    m = Gaussian(1, "forward", sigma)
    assert m.cost().dp_event.noise_multiplier == pytest.approx(1.0)
    n = 1_000_000
    a = m.release(torch.full((n, 1), 1.0), gen(50)).value.double().numpy().ravel()
    b = m.release(torch.full((n, 1), -1.0), gen(51)).value.double().numpy().ravel()
    edges = np.concatenate([[-1e9], np.arange(-10.0, 10.25, 0.25), [1e9]])
    ha, hb = np.histogram(a, edges)[0], np.histogram(b, edges)[0]
    pa = np.diff(sps.norm.cdf(edges, loc=1.0, scale=sigma))
    pb = np.diff(sps.norm.cdf(edges, loc=-1.0, scale=sigma))
    log_ratios_match(ha, hb, pa, pb, 5000)  # the released law is the claimed Gaussian, bin by bin
    acc = pld.from_gaussian_mechanism(1.0, value_discretization_interval=1e-4)
    for eps in (0.5, 1.0, 2.0):
        delta_claim = acc.get_delta_for_epsilon(eps)
        emp, se = _hockey_stick(ha, hb, eps)
        assert emp - Z * se <= delta_claim, (eps, emp, delta_claim)  # never more than claimed
        assert emp + Z * se >= 0.9 * delta_claim  # … and close to it (σ twice too small: δ(1) 0.38, not 0.13)


def test_gaussian_empirical_privacy_loss_is_per_record():
    # two tanh elements: neighbours (1, 1) and (−1, −1) are 2√2 apart in L2, the sensitivity the
    # mechanism claims (2·bound·√d); a per-element calibration (2) would understate δ(ε)
    sigma = 2.0
    m = Gaussian(2, "forward", sigma)
    assert m.sensitivity_l2 == pytest.approx(2 * math.sqrt(2))
    n = 1_000_000
    a = m.release(torch.full((n, 2), 1.0), gen(52)).value.double().numpy()
    b = m.release(torch.full((n, 2), -1.0), gen(53)).value.double().numpy()
    edges = np.concatenate([[-1e9], np.arange(-8.0, 8.5, 0.5), [1e9]])
    ha = np.histogram2d(a[:, 0], a[:, 1], [edges, edges])[0]
    hb = np.histogram2d(b[:, 0], b[:, 1], [edges, edges])[0]
    nm = m.cost().dp_event.noise_multiplier
    eps = 1.0
    claim = pld.from_gaussian_mechanism(nm, value_discretization_interval=1e-4).get_delta_for_epsilon(eps)
    per_element = pld.from_gaussian_mechanism(sigma / 2.0, value_discretization_interval=1e-4).get_delta_for_epsilon(eps)
    emp, se = _hockey_stick(ha, hb, eps)
    assert emp - Z * se <= claim
    assert emp - Z * se > per_element  # the record's loss is larger than one element's


# -- randomized response ------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_rr_keep_rate_and_bits(device):
    m = RandomizedResponse(1000, 1000.0)  # ε_b = 1 per bit
    q = math.e / (1 + math.e)
    assert m.keep_probability == pytest.approx(q)
    torch.manual_seed(2)
    v = torch.randn(100, 1000).to(device)
    out = m.release(v, gen(8, device)).value
    assert out.dtype == torch.float32 and set(out.unique().tolist()) <= {0.0, 1.0}
    kept = (out == (v > 0).float()).double().mean().cpu()
    n = v.numel()
    assert abs(kept - q) < Z * math.sqrt(q * (1 - q) / n)  # se 0.0014; 002's ε per element misread = 0.5/0.99
    assert m.local_grad({}, v) is v  # straight-through estimator


def test_rr_cost_event_matches_dp_accounting_definition():
    m = RandomizedResponse(64, 2.0)
    cost = m.cost()
    assert cost.epsilon == 2.0 and isinstance(cost.dp_event, dp_accounting.SelfComposedDpEvent)
    bit = cost.dp_event.event
    assert cost.dp_event.count == 64 and bit.num_buckets == 2
    # dp_accounting keeps the true bucket with probability 1 − p + p/k = 1 − p/2
    assert 1 - bit.noise_parameter / 2 == pytest.approx(m.keep_probability)
    one = RandomizedResponse(1, 1.5).cost().dp_event.event
    eps = pld.from_randomized_response(one.noise_parameter, 2, neighboring_relation=REPLACE_ONE)
    assert eps.get_epsilon_for_delta(0.0) == pytest.approx(1.5, abs=1e-3)


def test_rr_empirical_privacy_loss_per_bit_and_per_record():
    n = 400_000
    # one bit, epsilon 1: neighbours B = 1 and B = 0; log ratio at output 1 is ln(q/(1−q)) = 1
    m = RandomizedResponse(1, 1.0)
    a = m.release(torch.ones(n, 1), gen(9)).value.numpy().ravel()
    b = m.release(-torch.ones(n, 1), gen(10)).value.numpy().ravel()
    ha, hb = np.bincount(a.astype(int), minlength=2), np.bincount(b.astype(int), minlength=2)
    lower, upper = max_log_ratio_bounds(ha, hb, 1000)  # counts ~1e5: se ≈ 0.0037, slack 0.019
    assert lower <= 1.0 <= upper
    # two-bit record, epsilon 1 for the record (0.5 per bit): neighbours (1,1) and (0,0); the
    # worst output (1,1) has ratio (q/(1−q))² = e^1. Per-element ε (002) would give 2.
    m2 = RandomizedResponse(2, 1.0)
    a2 = m2.release(torch.ones(n, 2), gen(11)).value.numpy().astype(int)
    b2 = m2.release(-torch.ones(n, 2), gen(12)).value.numpy().astype(int)
    ha2 = np.bincount(a2[:, 0] * 2 + a2[:, 1], minlength=4)
    hb2 = np.bincount(b2[:, 0] * 2 + b2[:, 1], minlength=4)
    lower, upper = max_log_ratio_bounds(ha2, hb2, 1000)
    assert lower <= 1.0 <= upper


@pytest.mark.parametrize("width", [13, 64])
def test_rr_bit_packing_round_trip(width):
    m = RandomizedResponse(width, 3.0)
    torch.manual_seed(3)
    rel = m.release(torch.randn(37, width), gen(13))
    key = BatchKey("train", 1, 0)
    blob = encode(Message("activations", "guest-1", "host", 0, key, batch_digest(np.arange(100, 137)), rel.value,
                          rel.encoding))
    back = decode(blob)
    assert back.encoding == "bits" and torch.equal(back.tensor, rel.value)
    as_float = encode(Message("activations", "guest-1", "host", 0, key, back.digest, rel.value, "float32"))
    # same header, payload ceil(width/8) vs 4·width bytes per sample
    assert len(as_float) - len(blob) == 37 * (4 * width - math.ceil(width / 8))
    assert len(blob) - 37 * math.ceil(width / 8) <= 18


# -- R3eLU --------------------------------------------------------------------------------------
def test_clip_k_bounds_and_top_k_selection():
    torch.manual_seed(4)
    v = torch.randn(64, 50) * 3
    k, c = 7, 1.5
    vh = clip_k(v, c, k)
    assert ((vh != 0).sum(dim=1) <= k).all()
    assert (vh >= 0).all() and (vh <= c).all()
    # independent: sort each row, the k largest positions keep clamp(v, 0, c), the rest are 0
    order = np.argsort(-v.numpy(), axis=1, kind="stable")[:, :k]
    expect = np.zeros_like(v.numpy())
    rows = np.arange(64)[:, None]
    expect[rows, order] = np.clip(v.numpy()[rows, order], 0, c)
    assert np.allclose(vh.numpy(), expect)


def test_r3elu_probabilities_eq4():
    m = R3eLU(6, "forward", 12.0, 10.0, k=3)  # ε_p = 6, ε_p/K = 2
    vh = torch.tensor([[8.0, 4.0, 2.0, 0.0, 0.0, 0.0], [0.0] * 6])
    q = math.exp(2) / (1 + math.exp(2))
    expect = 0.5 + torch.tensor([[1.0, 0.5, 0.25, 0, 0, 0], [0.0] * 6]) * (q - 0.5)
    assert torch.allclose(m.probabilities(vh), expect)
    assert activation_probability(torch.tensor(1.0), 6.0, 3) == pytest.approx(q)
    # ‖v̂‖∞ = 0 (second row): p = 1/2 everywhere


@pytest.mark.parametrize("device", DEVICES)
def test_r3elu_forward_activation_frequency(device):
    # ε = 16 → ε_p = 8, K = 4: q = e²/(1+e²) = 0.881; ε_l = 8: b = 2·4·10/8 = 10
    m = R3eLU(8, "forward", 16.0, 10.0, k=4)
    assert m.scale == pytest.approx(10.0, rel=1e-8)
    v = torch.tensor([9.0, 6.0, 3.0, 1.0, -1.0, -2.0, 12.0, 0.5])
    n = 40_000
    out = m.release(v.expand(n, 8).contiguous().to(device), gen(14, device)).value.cpu()
    vh = clip_k(v[None], 10.0, 4)[0]  # [9, 6, 3, 0, 0, 0, 10, 0]
    p = m.probabilities(vh[None])[0].double()
    # P(out > 0) = p·P(n + Z > 0), n = round(v̂/γ): P(Z ≤ −n) = r^n/(1+r) for n ≥ 0 (≈ ½e^{−v̂/b})
    r = math.exp(-1 / m.t)
    units = torch.round(vh.double() / m.gamma)
    expect = p * (1 - r ** units / (1 + r))
    freq = (out > 0).double().mean(dim=0)
    se = torch.sqrt(expect * (1 - expect) / n)
    assert (torch.abs(freq - expect) < Z * se).all(), (freq, expect)
    # Alg. 1 as printed (r ~ N(0,1), activate if r < p) would activate with Φ(p) ∈ [0.69, 0.81]
    # instead of p ∈ [0.5, 0.88]: e.g. for v̂ = 0 the frequency would be ≈ 0.35, not 0.25.
    assert abs(freq[4] - 0.25) < 0.01


def test_r3elu_forward_local_grad_mask():
    m = R3eLU(8, "forward", 40.0, 5.0, k=4)
    torch.manual_seed(5)
    v = torch.randn(500, 8) * 4  # many above C = 5, many negative, half outside the top-4
    rel = m.release(v, gen(15))
    mask = rel.ctx["mask"]
    topk = torch.zeros_like(v, dtype=torch.bool).scatter_(1, v.topk(4, dim=1).indices, True)
    # recomputed from what was released: positive output (hence activated), top-K, unclipped
    expect = (rel.value > 0) & topk & (v > 0) & (v < 5.0)
    assert torch.equal(mask, expect)
    assert mask.any() and (~mask & (rel.value > 0)).any()  # the mask really removes elements
    grad = torch.randn_like(v)
    assert torch.equal(m.local_grad(rel.ctx, grad), grad * mask)
    # outputs are non-negative, on the grid
    assert (rel.value >= 0).all()
    assert torch.equal(rel.value / m.gamma, torch.round(rel.value / m.gamma))
    assert 0 < rel.stats["mean_active_fraction"] < 1


@pytest.mark.parametrize("device", DEVICES)
def test_r3elu_backward_noise_on_every_element_and_signs(device):
    # ε = 16: ε_p = 8 (K = 4, q = 0.881), ε_l = 8: b = 2·4·1/8 = 1
    m = R3eLU(8, "backward", 16.0, 1.0, k=4)
    d = torch.tensor([0.5, -2.0, 0.1, -0.05, 3.0, -0.2, 0.0, 1.0])
    n = 40_000
    out = m.release(d.expand(n, 8).contiguous().to(device), gen(16, device)).value.double().cpu()
    mag = clip_k(d.abs()[None], 1.0, 4)[0]  # |δ̂| = [0.5, 1, 0, 0, 1, 0, 0, 1]
    signed = torch.sign(d) * mag
    p = m.probabilities(mag[None])[0]
    assert (out != 0).float().mean() > 0.999  # noise on every element (P(n + Z = 0) ≤ 1/t)
    # E[out_i] = p_i·sign(δ_i)|δ̂_i| (zero-mean noise); var ≤ 2b² + p(1−p)·|δ̂|² ≤ 2.25
    expect = (p * signed).double()
    assert (torch.abs(out.mean(dim=0) - expect) < Z * math.sqrt(2.25 / n)).all()
    # without randomized response (always keep) the means would be ±1 and 0.5, off by > 0.1
    assert torch.abs(out[:, 6].std() - math.sqrt(2)) < 0.05  # δ̂_6 = 0: pure noise, sd √2 (se ≈ 0.01)
    assert m.local_grad({}, out) is out

    # tiny Laplace noise (ε_l ≈ 2000): every clearly non-zero output keeps sign(δ) in the top-K
    m2 = R3eLU(8, "backward", 2008.0, 1.0, k=4, eps_p_fraction=8 / 2008)
    out2 = m2.release(d.expand(1000, 8).contiguous().to(device), gen(17, device)).value.cpu()
    big = out2.abs() > 0.25
    assert big.any()
    assert torch.equal(torch.sign(out2)[big], torch.sign(d).expand(1000, 8)[big])
    assert not big[:, [2, 3, 5, 6]].any()  # outside the top-4 nothing large is released


def test_r3elu_cost_is_pure_epsilon():
    m = R3eLU(64, "forward", 1.0, 10.0)
    assert m.k == 32 and m.scale == pytest.approx(2 * 32 * 10 / 0.5, rel=1e-8)  # the spec's 1280 example (spec §3)
    assert m.gamma == 0.5 and m.sensitivity_units == 2 * 32 * 20
    cost = m.cost()
    assert cost.epsilon == 1.0 and cost.sensitivity_l1 == 640.0
    rr, lap = cost.dp_event.events
    # the Laplace part's worst pair: 2K = 64 elements each moved by M = 20 steps (issue 26)
    assert isinstance(lap, dp_accounting.SelfComposedDpEvent) and lap.count == 64
    lap = lap.event
    assert isinstance(lap, dp_accounting.dp_event.DiscreteLaplaceDpEvent) and lap.sensitivity == 20
    assert 64 * lap.sensitivity * lap.noise_parameter == pytest.approx(0.5, rel=1e-6)  # Δ/t = ε_l − slack
    assert 64 * lap.sensitivity * lap.noise_parameter + dict(cost.params)["sampler_slack"] <= 0.5
    assert 1 - rr.noise_parameter / 2 == pytest.approx(math.exp(0.5) / (1 + math.exp(0.5)))
    total = pld.from_randomized_response(rr.noise_parameter, 2, neighboring_relation=REPLACE_ONE).compose(
        pld.from_discrete_laplace_mechanism(lap.noise_parameter, sensitivity=lap.sensitivity).self_compose(64))
    # pure 1.0, but at δ = 1e-6 the 64 Laplace elements compose: above the RR part's 0.5, below 1
    assert 0.5 < total.get_epsilon_for_delta(1e-6) < 0.9
    # importance allocations charge the ε_l-DP event that dominates whatever U is
    imp = R3eLU(64, "forward", 1.0, 10.0, allocation="importance").cost()
    assert imp.epsilon == 1.0 and isinstance(imp.dp_event.events[1], dp_accounting.RandomizedResponseDpEvent)


def _elem_law_forward(vhat: float, p: float, m: R3eLU, edges: np.ndarray) -> np.ndarray:
    """``[P(out = 0), P(out in (edges[j], edges[j+1]])…]`` for one forward element."""
    r = math.exp(-1 / m.t)
    n = round(vhat / m.gamma)
    # out = γ·max(n + Z, 0) if active: P(n + Z ≤ 0) = P(Z ≤ −n) = r^n/(1+r)
    zero = (1 - p) + p * r ** n / (1 + r)
    units = edges / m.gamma  # bins (lo, hi] in grid units → Z ∈ (lo − n, hi − n]
    cdf = lambda a: 1.0 - r ** (a + 1) / (1 + r) if a >= 0 else r ** (-a) / (1 + r)  # noqa: E731  P(Z ≤ a)
    inside = [p * (cdf(math.floor(hi) - n) - cdf(math.floor(lo) - n)) for lo, hi in zip(units[:-1], units[1:])]
    return np.array([zero] + inside)


def test_r3elu_empirical_privacy_loss_forward():
    # d = 2, K = 1, C = 1, ε = 4 (ε_p = ε_l = 2): neighbours v = (1, 0) and (0, 1), whose ClipK outputs
    # differ by C in both elements (L1 = 2KC) and whose activation probabilities swap (q, ½) ↔ (½, q).
    # Over 2-D bins of the outputs (an atom at 0 plus intervals), the empirical log-ratios match the
    # exact law of the implementation (computed from DLap's closed form), and none exceeds ε.
    m = R3eLU(2, "forward", 4.0, 1.0, k=1)
    n = 1_000_000
    va, vb = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    a = m.release(va.expand(n, 2).contiguous(), gen(60)).value.double().numpy()
    b = m.release(vb.expand(n, 2).contiguous(), gen(61)).value.double().numpy()
    edges = np.concatenate([np.arange(0.0, 5.0, 0.5), [1e9]])  # (0, 0.5], …, (4.5, ∞)
    bins = np.concatenate([[-1.0, 1e-12], edges[1:] + 1e-9])  # first bin: the atom at 0; (lo, hi] on the grid

    def hist(x):
        return np.histogram2d(x[:, 0], x[:, 1], [bins, bins])[0]

    ha, hb = hist(a), hist(b)
    q = m.probabilities(torch.tensor([[1.0, 0.0]]))[0].double().tolist()
    law = lambda v, p: _elem_law_forward(v, p, m, edges)  # noqa: E731
    pa = np.outer(law(1.0, q[0]), law(0.0, q[1]))
    pb = np.outer(law(0.0, q[1]), law(1.0, q[0]))
    assert pa.sum() == pytest.approx(1.0) and pb.sum() == pytest.approx(1.0)
    log_ratios_match(ha, hb, pa, pb, 2000)
    lower, _ = max_log_ratio_bounds(ha, hb, 2000)
    assert lower <= m.epsilon
    assert np.log(pa / pb).max() <= m.epsilon  # the exact law's worst bin, too


def test_r3elu_empirical_privacy_loss_backward():
    # d = 2, K = 1, C = 1, ε = 4: neighbours δ = (1, 0) and (0, −1): kept values (s₁, 0) and (0, −s₂)
    # with s ~ Bernoulli(q) plus noise on both elements. Exact law: a mixture of shifted DLap.
    m = R3eLU(2, "backward", 4.0, 1.0, k=1)
    n = 1_000_000
    a = m.release(torch.tensor([1.0, 0.0]).expand(n, 2).contiguous(), gen(62)).value.double().numpy()
    b = m.release(torch.tensor([0.0, -1.0]).expand(n, 2).contiguous(), gen(63)).value.double().numpy()
    edges = np.concatenate([[-1e9], np.arange(-4.0, 4.5, 0.5), [1e9]]) + 1e-6
    ha = np.histogram2d(a[:, 0], a[:, 1], [edges, edges])[0]
    hb = np.histogram2d(b[:, 0], b[:, 1], [edges, edges])[0]
    q = float(m.probabilities(torch.tensor([[1.0, 0.0]]))[0, 0])
    r = math.exp(-1 / m.t)
    units = np.floor(edges / m.gamma)  # Z ≤ floor(x/γ) − n  ⇔  γ(n + Z) ≤ x

    def cdf(a_):
        a_ = np.asarray(a_, dtype=float)
        with np.errstate(over="ignore"):  # np.where evaluates both branches
            return np.where(a_ >= 0, 1.0 - r ** (a_ + 1) / (1 + r), r ** (-a_) / (1 + r))

    def elem(shift_units, p):  # value γ·(n + Z), n = shift with probability p, else 0
        return p * np.diff(cdf(units - shift_units)) + (1 - p) * np.diff(cdf(units))

    one = round(1.0 / m.gamma)
    pa = np.outer(elem(one, q), elem(0, 0.5))
    pb = np.outer(elem(0, 0.5), elem(-one, q))
    log_ratios_match(ha, hb, pa, pb, 2000)
    lower, _ = max_log_ratio_bounds(ha, hb, 2000)
    assert lower <= m.epsilon and np.log(pa / pb).max() <= m.epsilon


# -- importance allocation ----------------------------------------------------------------------
def test_cor6_reduces_to_alg1():
    # 001 Cor. 6 / Eq. 16: b_i = C·ΣU/(ε_l·U_i). With equal importances and K = N/2 this is
    # C·N/ε_l = 2KC/ε_l, Alg. 1's uniform scale — to the last bit here (same grid, same t).
    d, c, eps = 16, 8.0, 3.0
    uni = R3eLU(d, "forward", eps, c)  # K = 8 = N/2
    imp = R3eLU(d, "forward", eps, c, allocation="importance")
    imp.set_importance(torch.full((d,), 1.0))
    assert torch.equal(imp.noise_scales(), uni.noise_scales())
    assert float(imp.noise_scales()[0]) == pytest.approx(2 * uni.k * c / uni.eps_l, rel=1e-6)  # float32
    # unequal importances: the published formula (floor f → 0; C a power of two so C/γ is exact)
    u = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.25, 4.0] * 2)
    for direction, per in (("forward", 1.0), ("backward", 2.0)):
        m = R3eLU(d, direction, eps, c, allocation="importance", importance_floor=1e-12)
        m.set_importance(u)
        published = per * c * u.sum() / (m.eps_l * u)  # Eq. 16 (backward: 2C, signed elements)
        assert torch.allclose(m.noise_scales().double(), published.double(), rtol=1e-6)
        # the worst neighbours (every element at full range) lose exactly ε_l, slack included
        grid = m._active_grid()
        units = per * torch.round(c / grid.gamma)
        assert float((units / grid.noise.t).sum()) <= m.eps_l
        assert grid.eps_bound == pytest.approx(m.eps_l, rel=1e-8)
    # (the formula this code used before, 2KC/(ε_l·w_i), was 2K = 16 times noisier than Eq. 16 forward)


def test_importance_changes_probabilities_and_scales_as_cor6():
    m = R3eLU(6, "backward", 4.0, 1.0, k=3, allocation="importance")
    u = torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0, 0.0])
    m.set_importance(u)
    q = 1 / (1 + math.exp(-2.0 / 3))  # ε_p = 2, K = 3
    vh = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(m.probabilities(vh)[0], 0.5 + u / 4 * (q - 0.5))  # Eq. 10, backward too
    w = 0.9 * u / 8 + 0.1 / 6  # floor f = 0.1
    assert torch.allclose(m.feature_weights().float(), w)
    assert m.feature_epsilons().sum().item() == pytest.approx(m.eps_l)  # total Laplace budget kept
    assert torch.allclose(m.noise_scales(), 2 * 1.0 / (m.eps_l * w), rtol=1e-6)  # 2C/(ε_l·w_i)
    assert torch.isfinite(m.noise_scales()).all()  # zero-importance features: finite (floored)
    assert m.cost().epsilon == 4.0
    # empirical: δ = 0 releases pure noise per feature, mean |out_i| = γ_i·2r/(1−r²) ≈ b_i
    n = 20_000
    out = m.release(torch.zeros(n, 6), gen(18)).value.double()
    grid = m._active_grid()
    r = torch.exp(-1 / grid.noise.t)
    mean_abs = grid.gamma * 2 * r / (1 - r * r)
    sd = grid.gamma * torch.sqrt(2 * r) / (1 - r)
    assert (torch.abs(out.abs().mean(dim=0) - mean_abs) < Z * sd / math.sqrt(n)).all()


def test_importance_before_any_update_is_uniform():
    uni = R3eLU(10, "forward", 3.0, 2.0, k=4)
    imp = R3eLU(10, "forward", 3.0, 2.0, k=4, allocation="importance")
    v = torch.randn(50, 10, generator=gen(19))
    assert torch.equal(uni.release(v, gen(20)).value, imp.release(v, gen(20)).value)
    imp.set_importance(torch.zeros(10))
    assert torch.equal(uni.release(v, gen(20)).value, imp.release(v, gen(20)).value)
    uni.set_importance(torch.arange(10.0))  # a uniform mechanism stores but ignores importances
    assert torch.equal(uni.release(v, gen(20)).value, imp.release(v, gen(20)).value)
    imp.set_importance(torch.arange(10.0))
    assert not torch.equal(uni.release(v, gen(20)).value, imp.release(v, gen(20)).value)


def _worst_loss(m: R3eLU, trials: int = 20000) -> float:
    """Largest ``Σ|Δn_i|/t_i`` over random neighbour pairs of admissible snapped ClipK outputs."""
    g = gen(21)
    grid = m._active_grid()
    d, k = m.width, m.k
    units = torch.round(m.c / grid.gamma).expand(d) if isinstance(grid.gamma, torch.Tensor) else \
        torch.full((d,), float(grid.units), dtype=torch.float64)
    t = grid.noise.t if isinstance(grid.noise.t, torch.Tensor) else torch.full((d,), grid.noise.t)
    worst = 0.0
    for _ in range(4):
        n = trials // 4
        a = torch.zeros(n, d, dtype=torch.float64)
        b = torch.zeros(n, d, dtype=torch.float64)
        ia = torch.rand(n, d, generator=g).topk(k, dim=1).indices
        ib = torch.rand(n, d, generator=g).topk(k, dim=1).indices
        va = torch.rand(n, k, generator=g, dtype=torch.float64) * units[ia]
        vb = torch.rand(n, k, generator=g, dtype=torch.float64) * units[ib]
        va[:, 0], vb[:, 0] = units[ia[:, 0]], units[ib[:, 0]]  # one full-range element each side
        if m.direction == "backward":
            va = va * torch.where(torch.rand(va.shape, generator=g) < 0.5, -1.0, 1.0).double()
            vb = vb * torch.where(torch.rand(vb.shape, generator=g) < 0.5, -1.0, 1.0).double()
        a.scatter_(1, ia, va.round())
        b.scatter_(1, ib, vb.round())
        worst = max(worst, float(((a - b).abs() / t).sum(dim=1).max()))
    return worst


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_importance_tight_variant_spends_exactly_eps_l(direction):
    c, k, eps = 2.0, 2, 3.0
    m = R3eLU(6, direction, eps, c, k=k, allocation="importance-tight")
    m.set_importance(torch.ones(6))  # equal importances → the uniform scale 2KC/ε_l
    assert torch.allclose(m.noise_scales(), torch.full((6,), m.scale), rtol=1e-6)
    u = torch.tensor([5.0, 3.0, 1.0, 0.5, 0.0, 0.0])
    m.set_importance(u)
    s = m.noise_scales()
    assert (s[:-1] <= s[1:]).all()  # more important → less noise
    # the worst neighbour pair, built by hand in grid units: full range on the smallest t_i
    grid = m._active_grid()
    per_unit = (torch.round(c / grid.gamma) / grid.noise.t).sort(descending=True).values
    worst = float(per_unit[: 2 * k].sum()) if direction == "forward" else 2 * float(per_unit[:k].sum())
    assert worst == pytest.approx(m.eps_l, rel=1e-6) and grid.eps_bound <= m.eps_l * (1 + 1e-12)
    assert _worst_loss(m) <= m.eps_l  # random pairs never exceed it
    # the published Cor. 6 calibration is valid but spends at most ε_l and is noisier
    paper = R3eLU(6, direction, eps, c, k=k, allocation="importance")
    paper.set_importance(u)
    assert _worst_loss(paper) <= paper.eps_l
    assert (paper.noise_scales() > s).all()


def test_set_importance_broadcasts_per_channel_and_validates():
    m = R3eLU(12, "forward", 2.0, 1.0, allocation="importance")  # cut tensor (3, 2, 2)
    m.set_importance(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(m.importance, torch.tensor([1.0] * 4 + [2.0] * 4 + [3.0] * 4))
    with pytest.raises(ValueError, match="5 importances for a cut width of 12"):
        m.set_importance(torch.ones(5))
    with pytest.raises(ValueError, match=">= 0"):
        m.set_importance(-torch.ones(12))


def test_importance_tracker_eq8_eq9_linear():
    torch.manual_seed(6)
    layer = nn.Linear(5, 3)
    tr = ImportanceTracker(layer)
    assert tr.side == "output" and torch.equal(tr.values, torch.zeros(3))
    snaps = []
    for _ in range(2):
        layer.zero_grad()
        layer(torch.randn(8, 5)).pow(2).sum().backward()
        w, b = layer.weight, layer.bias
        snaps.append(((w.grad * w) ** 2).sum(dim=1) + (b.grad * b) ** 2)  # Eq. 8 summed per neuron
        tr.update()
    assert torch.allclose(tr.values, (snaps[0] + snaps[1]).detach() / 2)  # running mean (Eq. 9)
    state = tr.state_dict()
    tr2 = ImportanceTracker(layer)
    tr2.load_state_dict(state)
    assert torch.equal(tr2.values, tr.values) and tr2.count == 2
    layer.zero_grad(set_to_none=True)
    tr.update()  # no gradient: nothing to fold in
    assert tr.count == 2
    with pytest.raises(ValueError, match="side"):
        ImportanceTracker(layer, side="input").load_state_dict(state)


def test_importance_tracker_input_side_scores_received_features():
    # the host scores the cut features it receives with the first layer of its top model: per
    # INPUT feature, the column sums of (∇W·W)² (biases are not connected to an input)
    torch.manual_seed(9)
    layer = nn.Linear(6, 4)
    tr = ImportanceTracker(layer, side="input")
    layer(torch.randn(8, 6)).pow(2).sum().backward()
    tr.update()
    w = layer.weight
    assert tr.values.shape == (6,)
    assert torch.allclose(tr.values, ((w.grad * w) ** 2).sum(dim=0).detach())
    # conv: per input channel, respecting groups (input channel g·(in/groups) + j)
    conv = nn.Conv2d(4, 6, 3, groups=2)
    tr2 = ImportanceTracker(conv, side="input")
    conv(torch.randn(2, 4, 5, 5)).sum().backward()
    tr2.update()
    imp = (conv.weight.grad * conv.weight).detach() ** 2  # (6, 2, 3, 3): out 0–2 see in 0–1, out 3–5 in 2–3
    expect = torch.cat([imp[:3].sum(dim=(0, 2, 3)), imp[3:].sum(dim=(0, 2, 3))])
    assert torch.allclose(tr2.values, expect)
    # and a backward R3eLU takes these as its U (Eq. 10 and the per-feature scales)
    m = R3eLU(6, "backward", 2.0, 1.0, allocation="importance")
    m.set_importance(tr.values)
    assert m._uses_importance()
    with pytest.raises(ValueError, match="side must be"):
        ImportanceTracker(layer, side="middle")


def test_importance_tracker_conv_is_per_channel():
    torch.manual_seed(7)
    conv = nn.Conv2d(2, 4, 3)
    tr = ImportanceTracker(conv)
    conv(torch.randn(3, 2, 6, 6)).sum().backward()
    tr.update()
    expect = ((conv.weight.grad * conv.weight) ** 2).sum(dim=(1, 2, 3)) + (conv.bias.grad * conv.bias) ** 2
    assert torch.allclose(tr.values, expect.detach())
    with pytest.raises(ValueError, match="Linear or nn.Conv"):
        ImportanceTracker(nn.ReLU())


def test_geometric_schedule_stays_within_total():
    eps = 3.0
    parts = [geometric_epsilon(eps, i) for i in range(1, 60)]
    assert parts[0] == 1.5 and parts[1] == 0.75
    assert sum(parts) <= eps
    assert sum(parts[:5]) == pytest.approx(eps * (1 - 2 ** -5))
    with pytest.raises(ValueError, match="1-based"):
        geometric_epsilon(eps, 0)


# -- diagnostics that do not leak ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_public_diagnostics_depend_on_parameters_only(device):
    torch.manual_seed(10)
    for m in all_mechanisms(12):
        pub, desc = m.public_diagnostics(), m.describe()
        assert {"noise_scale", "noise_sd", "snr_bound"} <= set(pub)
        json.dumps(pub)
        json.dumps(desc)
        for scale in (0.01, 1.0, 100.0):  # releases of very different data change nothing public
            v = torch.randn(64, 12, device=device) * scale
            rel = m.release(v, gen(11, device))
            # a release's private SNR never exceeds the public bound — up to the float32 rounding of
            # the signal on the device: Gaussian-backward's L2 clip v·(C/‖v‖) has ‖·‖ within
            # (12/2 + 2)·2^-24 of C (the sum of 12 squares in any order ≤ 12u, halved by the sqrt; the
            # division and the product 1u each), so 2^-20 = 16u bounds it on any device (CUDA sums in
            # another order than the CPU: a 1e-9 tolerance failed there, issue 18)
            assert rel.stats["snr"] <= pub["snr_bound"] * (1 + 2.0 ** -20), (m.name, rel.stats, pub)
            if isinstance(m, R3eLU):
                m.set_importance(torch.rand(12) * scale)  # data-dependent state
            assert m.public_diagnostics() == pub and m.describe() == desc, m.name
    # R3eLU reports its uniform scale publicly, the importance-derived ones only locally
    r = R3eLU(12, "forward", 4.0, 3.0, allocation="importance")
    r.set_importance(torch.arange(12.0))
    assert r.public_diagnostics()["noise_scale"] == r.scale
    loc = r.local_diagnostics()
    assert loc["importance_active"] and loc["noise_scale_min"] < loc["noise_scale_max"]
    assert not any(key.startswith("noise_scale_") or key == "importance_active" for key in r.describe())
    assert NoDefense().public_diagnostics() == {} and Mechanism().describe() == {"name": "none"}


def test_snr_definitions():
    v = torch.full((4, 8), 0.5)
    lap = Laplace(8, "forward", 1.0, epsilon=2.0)
    assert lap.release(v, gen(0)).stats["snr"] == pytest.approx(0.5 / lap.noise_sd(), rel=1e-6)
    assert lap.public_diagnostics()["snr_bound"] == pytest.approx(1.0 / (math.sqrt(2) * lap.b), rel=1e-6)
    g = Gaussian(8, "forward", 0.5)
    assert g.release(v, gen(0)).stats["snr"] == pytest.approx(1.0)
    assert g.public_diagnostics()["snr_bound"] == pytest.approx(2.0)
    gb = Gaussian(8, "backward", 0.5, bound=2.0)  # L2 ball of radius 2: RMS ≤ 2/√8
    assert gb.public_diagnostics()["snr_bound"] == pytest.approx(2.0 / math.sqrt(8) / 0.5)
    r = R3eLU(8, "forward", 4.0, 1.0, k=4)
    vh = clip_k(v, 1.0, 4)
    assert r.release(v, gen(0)).stats["snr"] == pytest.approx(float(vh.pow(2).mean().sqrt()) / r.noise_sd(), rel=1e-6)
    assert r.public_diagnostics()["snr_bound"] == pytest.approx(1.0 * math.sqrt(4 / 8) / r.noise_sd())
    rr = RandomizedResponse(8, 8.0)
    q = rr.keep_probability
    assert rr.public_diagnostics()["snr"] == pytest.approx((2 * q - 1) / math.sqrt(q * (1 - q)))


# -- denoising ----------------------------------------------------------------------------------
def test_scale_is_exact_and_differentiable():
    s = Scale(0.2)
    x = torch.randn(4, 5, requires_grad=True)
    y = s(x, None)
    assert torch.equal(y, x * 0.2)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 0.2))
    assert s.describe() == {"name": "scale", "lambda": 0.2} and not s.random


@pytest.mark.parametrize("device", DEVICES)
def test_mask_keep_rate_without_rescaling(device):
    m = Mask(0.2)
    assert m.random
    x = torch.full((400, 500), 3.0, requires_grad=True, device=device)
    y = m(x, gen(22, device))
    kept = y != 0
    assert torch.equal(y[kept], x.detach()[kept])  # kept values are unchanged: no 1/p
    n = x.numel()
    rate = kept.double().mean().cpu()
    assert abs(rate - 0.2) < Z * math.sqrt(0.2 * 0.8 / n)  # se 0.0009
    y.sum().backward()
    assert torch.equal(x.grad, kept.float())  # gradient flows through the kept entries only


# -- common behaviour ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_determinism_same_seed_same_output(device):
    torch.manual_seed(8)
    v = torch.randn(20, 3, 4).to(device)
    for m in all_mechanisms(12):
        if isinstance(m, R3eLU):
            m.set_importance(torch.arange(12.0))
        a = m.release(v, gen(30, device))
        b = m.release(v, gen(30, device))
        c = m.release(v, gen(31, device))
        assert torch.equal(a.value, b.value), m.name
        assert not torch.equal(a.value, c.value), m.name
        assert a.value.shape == v.shape and a.value.dtype == v.dtype and a.value.device == v.device
        for t in a.ctx.values():
            assert t.device == v.device
    assert torch.equal(Mask(0.5)(v, gen(3, device)), Mask(0.5)(v, gen(3, device)))


def test_describe_and_cost_are_reportable():
    for m in all_mechanisms(12):
        d = m.describe()
        json.dumps(d)
        assert {"name", "width", "direction", "noise_scale"} <= set(d) and d["name"] == m.name
        assert m.random
        cost = m.cost()
        assert cost.mechanism == m.name
        assert (cost.sensitivity_l1 is not None) or (cost.sensitivity_l2 is not None)
        if cost.epsilon is not None:  # the pure-DP ones: the event's PLD epsilon (δ → 0) is ≤ ε
            acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
            acc.compose(cost.dp_event)
            assert acc.get_epsilon(1e-12) <= cost.epsilon * 1.01 + 1e-3, (m.name, acc.get_epsilon(1e-12))


def test_wrong_width_is_refused():
    with pytest.raises(ValueError, match="built for width 8"):
        Laplace(8, "forward", 1.0, epsilon=1.0).release(torch.zeros(2, 9), gen())


@pytest.mark.parametrize("make, key", [
    (lambda: Laplace(4, "forward", 1.0, epsilon=0.0), "--epsilon"),
    (lambda: Laplace(4, "forward", 1.0, epsilon=float("nan")), "--epsilon"),
    (lambda: Laplace(4, "forward", -1.0, epsilon=1.0), "--clip-c"),
    (lambda: Laplace(4, "forward", 1.0, b=-2.0), "--laplace-b"),
    (lambda: Gaussian(4, "forward", 0.0), "--sigma"),
    (lambda: R3eLU(4, "forward", 1.0, 0.0), "--clip-c"),
    (lambda: R3eLU(4, "forward", 1.0, 1.0, k=5), "--top-k"),
    (lambda: R3eLU(4, "forward", 1.0, 1.0, k=0), "--top-k"),
    (lambda: R3eLU(4, "forward", -1.0, 1.0), "--epsilon"),
    (lambda: R3eLU(4, "forward", 1.0, 1.0, allocation="magic"), "--allocation"),
    (lambda: RandomizedResponse(4, float("inf")), "--epsilon"),
    (lambda: Scale(1.0), "--denoise-param"),
    (lambda: Mask(0.0), "--denoise-param"),
])
def test_parameter_validation(make, key):
    with pytest.raises(ConfigError, match=key) as err:
        make()
    assert "allowed" in str(err.value)


def test_other_invalid_arguments():
    with pytest.raises(ValueError, match="exactly one of epsilon .*--epsilon.* and b .*--laplace-b"):
        Laplace(4, "forward", 1.0)
    with pytest.raises(ValueError, match="exactly one of"):
        Laplace(4, "forward", 1.0, epsilon=1.0, b=1.0)
    with pytest.raises(ValueError, match="direction"):
        Gaussian(4, "sideways", 1.0)
    with pytest.raises(ValueError, match="width"):
        RandomizedResponse(0, 1.0)
    with pytest.raises(ValueError, match="eps_p_fraction"):
        R3eLU(4, "forward", 1.0, 1.0, eps_p_fraction=1.0)
    with pytest.raises(ValueError, match="discrete Laplace parameter"):
        DiscreteLaplace(0.5)


def test_r3elu_module_reexported():
    from fl_split.privacy import r3elu

    assert R3eLU is r3elu.R3eLU and ImportanceTracker is r3elu.ImportanceTracker and clip_k is r3elu.clip_k


def test_tiny_epsilon_releases_input_independent_noise():
    # below ≈ 2·√(d·Δ)·2^-23 (2e-5 here) the sampler's slack cannot fit: every element snaps to 0,
    # so the output law does not depend on the input at all (0-DP ≤ ε), and the same generator state
    # gives bit-identical releases for different inputs
    v1, v2 = torch.randn(8, 64), torch.randn(8, 64) * 100
    for m in (Laplace(64, "forward", 1.0, epsilon=1e-9), R3eLU(64, "backward", 1e-9, 1.0)):
        assert m.signal_free and m.describe()["signal_free"] and m.public_diagnostics()["snr_bound"] == 0.0
        if isinstance(m, R3eLU):  # the randomized response part still looks at the data (ε_p)
            m = R3eLU(64, "backward", 1e-9, 1.0, eps_p_fraction=1e-6)
        a, b = m.release(v1, gen(70)), m.release(v2, gen(70))
        if isinstance(m, Laplace):
            assert torch.equal(a.value, b.value) and a.stats["snr"] == 0.0
        assert m.cost().epsilon == pytest.approx(1e-9)
    lap = Laplace(64, "forward", 1.0, epsilon=1e-9)
    assert isinstance(lap.cost().dp_event, dp_accounting.RandomizedResponseDpEvent)  # pure 1e-9, an upper bound
    ok = Laplace(64, "forward", 1.0, epsilon=1e-3)  # still carries a (tiny) signal
    assert not ok.signal_free and ok.units >= 1 and ok.epsilon_bound <= 1e-3


@pytest.mark.parametrize("epsilon", [1e-3, 0.5, 1.0, 8.0, 100.0, 1e3, 1e5])
@pytest.mark.parametrize("width", [1, 64, 1000])
def test_calibration_holds_for_every_epsilon_and_width(epsilon, width):
    """The grid calibration (slack included) never claims more than the requested epsilon, for
    epsilons where the sampler's slack is a tiny fraction of epsilon squared (ε = 100 once broke a
    cancelling quadratic root)."""
    from fl_split.privacy.mechanisms import R3eLU

    for mech in (Laplace(width, "forward", 10.0, epsilon=epsilon), R3eLU(width, "forward", epsilon, 10.0),
                 R3eLU(width, "backward", epsilon, 10.0)):
        cost = mech.cost()
        assert cost.epsilon <= epsilon * (1 + 1e-12)
        assert cost.epsilon == pytest.approx(epsilon, rel=1e-6)
