"""Boundary mechanisms, denoising and budget allocation (SPEC §3; papers 001 §3–4, 002 §3, 003 §3).

Statistical tests use fixed seeds and tolerances of **5 standard errors** (``Z = 5``) of the
estimate unless stated otherwise: a correct implementation fails one such check with probability
< 6e-7, and the seeds are fixed anyway, so a failure means a real change of behaviour. Each test
also states what a wrong implementation would give, to show the tolerance can detect it.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as pld
from torch import nn

from fl_split.errors import ConfigError
from fl_split.privacy.denoise import Mask, Scale
from fl_split.privacy.mechanisms import (Gaussian, ImportanceTracker, Laplace, R3eLU, RandomizedResponse,
                                         activation_probability, clip_k, geometric_epsilon)
from fl_split.protocol import Message, decode, encode
from fl_split.schedule import BatchKey

Z = 5.0
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def gen(seed: int = 0, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def all_mechanisms(width: int = 12) -> list:
    return [Laplace(width, "forward", 2.0, epsilon=3.0), Laplace(width, "backward", 0.5, b=0.3),
            Gaussian(width, "forward", 0.7), Gaussian(width, "backward", 0.2, bound=0.5),
            R3eLU(width, "forward", 4.0, 3.0), R3eLU(width, "backward", 4.0, 0.5, k=3),
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


# -- Laplace ------------------------------------------------------------------------------------
def test_laplace_noise_has_scale_b():
    b = 0.5
    mech = Laplace(1000, "forward", 1.0, b=b)
    noise = mech.release(torch.zeros(200, 1000), gen(1)).value.double()  # zero input: out = noise
    n = noise.numel()
    # |L| ~ Exp(b): mean b, sd b; L² has mean 2b², variance E[L⁴] − 4b⁴ = 24b⁴ − 4b⁴ = 20b⁴
    assert abs(noise.abs().mean() - b) < Z * b / math.sqrt(n)
    assert abs(noise.pow(2).mean() - 2 * b * b) < Z * math.sqrt(20) * b * b / math.sqrt(n)
    assert abs(noise.mean()) < Z * math.sqrt(2) * b / math.sqrt(n)
    # a Gaussian of the same variance would have mean |x| = sqrt(2b²)·sqrt(2/π) = 0.80 b: rejected
    assert (noise.abs() <= 16.7 * b).all()  # the documented tail truncation


def test_laplace_calibration_per_record():
    m = Laplace(64, "forward", 10.0, epsilon=1.0)
    assert m.sensitivity_l1 == 2 * 10.0 * 64 and m.b == pytest.approx(1280.0)
    m2 = Laplace(64, "forward", 10.0, b=640.0)
    assert m2.epsilon == pytest.approx(2.0)
    cost = m.cost()
    assert cost.mechanism == "laplace" and cost.epsilon == pytest.approx(1.0)
    assert cost.sensitivity_l1 == 1280.0
    assert isinstance(cost.dp_event, dp_accounting.LaplaceDpEvent)
    assert cost.dp_event.noise_multiplier == pytest.approx(1.0)
    # independent: the PLD of a Laplace mechanism with that noise multiplier is (almost) pure 1-DP
    eps = pld.from_laplace_mechanism(cost.dp_event.noise_multiplier).get_epsilon_for_delta(1e-6)
    assert eps == pytest.approx(1.0, abs=0.01)


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
    assert rel.stats["noise_scale"] == pytest.approx(1e-7)
    assert rel.stats["snr"] == pytest.approx(float(v.clamp(-2, 2).abs().mean()) / 1e-7, rel=1e-5)


def test_laplace_empirical_privacy_loss_one_element():
    # one-element record, bound 1, epsilon 1: b = 2·1·1/1 = 2; neighbours -1 and +1 (farthest apart).
    # The density ratio is exp((|x+1| − |x−1|)/2) ≤ e^1, equal to e^1 for |x| ≥ 1.
    m = Laplace(1, "forward", 1.0, epsilon=1.0)
    n = 1_000_000
    a = m.release(torch.full((n, 1), -1.0), gen(3)).value.numpy().ravel()
    b = m.release(torch.full((n, 1), 1.0), gen(4)).value.numpy().ravel()
    edges = np.arange(-12.0, 12.5, 0.5)
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
    assert m.b == pytest.approx(4.0)
    n = 1_000_000
    a = m.release(torch.full((n, 2), -1.0), gen(5)).value.numpy()
    b = m.release(torch.full((n, 2), 1.0), gen(6)).value.numpy()
    edges = np.arange(-14.0, 15.0, 1.0)
    ha, _, _ = np.histogram2d(a[:, 0], a[:, 1], [edges, edges])
    hb, _, _ = np.histogram2d(b[:, 0], b[:, 1], [edges, edges])
    lower, upper = max_log_ratio_bounds(ha, hb, 2000)  # se ≤ sqrt(2/2000) = 0.032
    assert lower <= 1.0 <= upper


# -- Gaussian -----------------------------------------------------------------------------------
def test_gaussian_forward_noise_and_sensitivity():
    sigma = 0.7
    m = Gaussian(400, "forward", sigma)
    torch.manual_seed(1)
    v = torch.tanh(torch.randn(300, 20, 20))
    out = m.release(v, gen(7)).value
    noise = (out - v).double()
    n = noise.numel()
    # sample variance of n normals: se = σ²·sqrt(2/n)
    assert abs(noise.var() - sigma ** 2) < Z * sigma ** 2 * math.sqrt(2 / n)
    assert abs(noise.mean()) < Z * sigma / math.sqrt(n)
    assert m.sensitivity_l2 == pytest.approx(2 * math.sqrt(400))  # 003: 2√d for tanh outputs
    cost = m.cost()
    assert cost.epsilon is None and isinstance(cost.dp_event, dp_accounting.GaussianDpEvent)
    assert cost.dp_event.noise_multiplier == pytest.approx(sigma / 40)
    # values outside [-1, 1] are clamped defensively (no-op for tanh outputs)
    big = torch.full((2, 400), 5.0)
    tiny = Gaussian(400, "forward", 1e-8)
    assert torch.allclose(tiny.release(big, gen(0)).value, torch.ones(2, 400))
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


# -- randomized response ------------------------------------------------------------------------
def test_rr_keep_rate_and_bits():
    m = RandomizedResponse(1000, 1000.0)  # ε_b = 1 per bit
    q = math.e / (1 + math.e)
    assert m.keep_probability == pytest.approx(q)
    torch.manual_seed(2)
    v = torch.randn(100, 1000)
    out = m.release(v, gen(8)).value
    assert out.dtype == torch.float32 and set(out.unique().tolist()) <= {0.0, 1.0}
    kept = (out == (v > 0).float()).double().mean()
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
    ids = np.arange(100, 137)
    key = BatchKey("train", 1, 0)
    blob = encode(Message("activations", "guest1", "host", 0, key, ids, rel.value, rel.encoding))
    back = decode(blob)
    assert back.encoding == "bits" and torch.equal(back.tensor, rel.value)
    hlen = int.from_bytes(blob[4:8], "little")
    payload = len(blob) - 8 - hlen - 8 * len(ids)  # magic+length, JSON header, int64 IDs
    assert payload == 37 * math.ceil(width / 8)
    as_float = encode(Message("activations", "guest1", "host", 0, key, ids, rel.value, "float32"))
    assert len(as_float) - len(blob) == 37 * (4 * width - math.ceil(width / 8)) + (len(b'"float32"') - len(b'"bits"'))


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


def test_r3elu_forward_activation_frequency():
    # ε = 16 → ε_p = 8, K = 4: q = e²/(1+e²) = 0.881; ε_l = 8: b = 2·4·10/8 = 10
    m = R3eLU(8, "forward", 16.0, 10.0, k=4)
    assert m.scale == pytest.approx(10.0)
    v = torch.tensor([9.0, 6.0, 3.0, 1.0, -1.0, -2.0, 12.0, 0.5])
    n = 40_000
    out = m.release(v.expand(n, 8).contiguous(), gen(14)).value
    vh = clip_k(v[None], 10.0, 4)[0]  # [9, 6, 3, 0, 0, 0, 10, 0]
    p = m.probabilities(vh[None])[0]
    # P(out > 0) = p·P(v̂ + Lap(b) > 0) = p·(1 − ½e^{−v̂/b}); for v̂ = 0 it is p/2
    expect = p * (1 - 0.5 * torch.exp(-vh / m.scale))
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
    # outputs are non-negative and at most K non-zero contributions come from the data
    assert (rel.value >= 0).all()
    assert 0 < rel.stats["mean_active_fraction"] < 1


def test_r3elu_backward_noise_on_every_element_and_signs():
    # ε = 16: ε_p = 8 (K = 4, q = 0.881), ε_l = 8: b = 2·4·1/8 = 1
    m = R3eLU(8, "backward", 16.0, 1.0, k=4)
    d = torch.tensor([0.5, -2.0, 0.1, -0.05, 3.0, -0.2, 0.0, 1.0])
    n = 40_000
    out = m.release(d.expand(n, 8).contiguous(), gen(16)).value.double()
    mag = clip_k(d.abs()[None], 1.0, 4)[0]  # |δ̂| = [0.5, 1, 0, 0, 1, 0, 0, 1]
    signed = torch.sign(d) * mag
    p = m.probabilities(mag[None])[0]
    assert (out != 0).all()  # Laplace noise on every element, including non-top-K ones
    # E[out_i] = p_i·sign(δ_i)|δ̂_i| (zero-mean noise); var ≤ 2b² + p(1−p)·|δ̂|² ≤ 2.25
    expect = (p * signed).double()
    assert (torch.abs(out.mean(dim=0) - expect) < Z * math.sqrt(2.25 / n)).all()
    # without randomized response (always keep) the means would be ±1 and 0.5, off by > 0.1
    assert torch.abs(out[:, 6].std() - math.sqrt(2)) < 0.05  # δ̂_6 = 0: pure Lap(1), sd √2 (se ≈ 0.01)
    assert m.local_grad({}, out) is out

    # tiny Laplace noise (ε_l ≈ 2000): every clearly non-zero output keeps sign(δ) in the top-K
    m2 = R3eLU(8, "backward", 2008.0, 1.0, k=4, eps_p_fraction=8 / 2008)
    out2 = m2.release(d.expand(1000, 8).contiguous(), gen(17)).value
    big = out2.abs() > 0.25
    assert big.any()
    assert torch.equal(torch.sign(out2)[big], torch.sign(d).expand(1000, 8)[big])
    assert not big[:, [2, 3, 5, 6]].any()  # outside the top-4 nothing large is released


def test_r3elu_cost_is_pure_epsilon():
    m = R3eLU(64, "forward", 1.0, 10.0)
    assert m.k == 32 and m.scale == pytest.approx(2 * 32 * 10 / 0.5)  # SPEC's 1280 example
    cost = m.cost()
    assert cost.epsilon == 1.0 and cost.sensitivity_l1 == 640.0
    rr, lap = cost.dp_event.events
    assert lap.noise_multiplier == pytest.approx(2.0)  # 1/ε_l
    assert 1 - rr.noise_parameter / 2 == pytest.approx(math.exp(0.5) / (1 + math.exp(0.5)))
    total = pld.from_randomized_response(rr.noise_parameter, 2, neighboring_relation=REPLACE_ONE).compose(
        pld.from_laplace_mechanism(lap.noise_multiplier))
    assert total.get_epsilon_for_delta(1e-6) == pytest.approx(1.0, abs=0.01)


# -- importance allocation ----------------------------------------------------------------------
def test_importance_changes_probabilities_and_scales_as_cor6():
    m = R3eLU(6, "backward", 4.0, 1.0, k=3, allocation="importance")
    u = torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0, 0.0])
    m.set_importance(u)
    q = 1 / (1 + math.exp(-2.0 / 3))  # ε_p = 2, K = 3
    vh = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(m.probabilities(vh)[0], 0.5 + u / 4 * (q - 0.5))  # Eq. 10: data ignored
    w = 0.9 * u / 8 + 0.1 / 6  # floor f = 0.1
    assert torch.allclose(m.feature_weights(), w)
    assert m.feature_epsilons().sum().item() == pytest.approx(m.eps_l)  # total Laplace budget kept
    assert torch.allclose(m.noise_scales(), 2 * 3 * 1.0 / (m.eps_l * w))
    assert torch.isfinite(m.noise_scales()).all()  # zero-importance features: finite (floored)
    assert m.cost().epsilon == 4.0
    # empirical: δ = 0 releases pure noise Lap(b_i) per feature, mean |out_i| = b_i
    n = 20_000
    out = m.release(torch.zeros(n, 6), gen(18)).value.double()
    b = m.noise_scales().double()
    assert (torch.abs(out.abs().mean(dim=0) - b) < Z * b / math.sqrt(n)).all()


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


def _worst_loss(scales: torch.Tensor, c: float, k: int, direction: str, trials: int = 20000) -> float:
    """Largest Σ|Δ_i|/b_i over random neighbour pairs of admissible ClipK outputs."""
    g = gen(21)
    d = scales.numel()
    worst = 0.0
    for _ in range(4):
        a = torch.zeros(trials // 4, d)
        b = torch.zeros(trials // 4, d)
        ia = torch.rand(trials // 4, d, generator=g).topk(k, dim=1).indices
        ib = torch.rand(trials // 4, d, generator=g).topk(k, dim=1).indices
        va = torch.rand(trials // 4, k, generator=g).mul(c)
        vb = torch.rand(trials // 4, k, generator=g).mul(c)
        if direction == "backward":
            va = va * torch.where(torch.rand(va.shape, generator=g) < 0.5, -1.0, 1.0)
            vb = vb * torch.where(torch.rand(vb.shape, generator=g) < 0.5, -1.0, 1.0)
        a.scatter_(1, ia, va)
        b.scatter_(1, ib, vb)
        worst = max(worst, float(((a - b).abs() / scales).sum(dim=1).max()))
    return worst


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_importance_tight_variant_spends_exactly_eps_l(direction):
    c, k, eps = 2.0, 2, 3.0
    m = R3eLU(6, direction, eps, c, k=k, allocation="importance-tight")
    m.set_importance(torch.ones(6))  # equal importances → the uniform scale 2KC/ε_l
    assert torch.allclose(m.noise_scales(), torch.full((6,), m.scale))
    u = torch.tensor([5.0, 3.0, 1.0, 0.5, 0.0, 0.0])
    m.set_importance(u)
    s = m.noise_scales()
    assert (s[:-1] <= s[1:]).all()  # more important → less noise
    # the worst neighbour pair, built by hand: full ±C on the features with the smallest scales
    inv = (1 / s).sort(descending=True).values
    worst = c * float(inv[: 2 * k].sum()) if direction == "forward" else 2 * c * float(inv[:k].sum())
    assert worst == pytest.approx(m.eps_l, rel=1e-5)
    assert _worst_loss(s, c, k, direction) <= m.eps_l * (1 + 1e-5)  # random pairs never exceed it
    # the published Cor. 6 calibration is valid but spends at most this much of ε_l
    paper = R3eLU(6, direction, eps, c, k=k, allocation="importance")
    paper.set_importance(u)
    assert _worst_loss(paper.noise_scales(), c, k, direction) <= paper.eps_l * (1 + 1e-5)
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
    assert torch.equal(tr.values, torch.zeros(3))
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


# -- denoising ----------------------------------------------------------------------------------
def test_scale_is_exact_and_differentiable():
    s = Scale(0.2)
    x = torch.randn(4, 5, requires_grad=True)
    y = s(x, None)
    assert torch.equal(y, x * 0.2)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 0.2))
    assert s.describe() == {"name": "scale", "lambda": 0.2} and not s.random


def test_mask_keep_rate_without_rescaling():
    m = Mask(0.2)
    assert m.random
    x = torch.full((400, 500), 3.0, requires_grad=True)
    y = m(x, gen(22))
    kept = y != 0
    assert torch.equal(y[kept], x.detach()[kept])  # kept values are unchanged: no 1/p
    n = x.numel()
    rate = kept.double().mean()
    assert abs(rate - 0.2) < Z * math.sqrt(0.2 * 0.8 / n)  # se 0.0009
    y.sum().backward()
    assert torch.equal(x.grad, kept.float())  # gradient flows through the kept entries only


# -- common behaviour ---------------------------------------------------------------------------
def test_determinism_same_seed_same_output():
    torch.manual_seed(8)
    v = torch.randn(20, 3, 4)
    for m in all_mechanisms(12):
        a = m.release(v, gen(30)).value
        b = m.release(v, gen(30)).value
        c = m.release(v, gen(31)).value
        assert torch.equal(a, b), m.name
        assert not torch.equal(a, c), m.name
        assert a.shape == v.shape and a.dtype == v.dtype
    assert torch.equal(Mask(0.5)(v, gen(3)), Mask(0.5)(v, gen(3)))


def test_describe_and_cost_are_reportable():
    for m in all_mechanisms(12):
        d = m.describe()
        json.dumps(d)
        assert {"name", "width", "direction", "noise_scale"} <= set(d) and d["name"] == m.name
        assert m.random
        cost = m.cost()
        assert cost.mechanism == m.name
        assert (cost.sensitivity_l1 is not None) or (cost.sensitivity_l2 is not None)
        if cost.epsilon is not None:  # the pure-DP ones: the event's RDP epsilon is close to ε
            acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
            acc.compose(cost.dp_event)
            assert acc.get_epsilon(1e-9) <= cost.epsilon * 1.05 + 0.05


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mechanisms_run_on_cuda():
    v = torch.randn(16, 12, device="cuda")
    for m in all_mechanisms(12):
        a = m.release(v, gen(40, "cuda"))
        b = m.release(v, gen(40, "cuda"))
        assert a.value.device.type == "cuda" and torch.equal(a.value, b.value)
        for t in a.ctx.values():
            assert t.device.type == "cuda"
    im = R3eLU(12, "forward", 2.0, 1.0, allocation="importance")
    im.set_importance(torch.arange(12.0))
    assert im.release(v, gen(41, "cuda")).value.device.type == "cuda"
    assert Mask(0.3)(v, gen(42, "cuda")).device.type == "cuda"
