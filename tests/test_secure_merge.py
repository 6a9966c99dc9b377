"""Secure sum merge (fl_split/privacy/secure_merge.py): fixed point, pairwise masks, authenticated keys,
Skellam shares and their accounting (docs/threat-model.md "Secure merge", docs/accounting.md
"Distributed noise")."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from fl_split.errors import ConfigError, ProtocolError
from fl_split.privacy import secure_merge as sm

DELTA = 1e-5


def _guests(n: int, session: bytes = b"s" * 16, rng_seed: int = 0):
    """``n`` guests with Ed25519 identities, their pinned roster, keys agreed through a relay."""
    rng = np.random.default_rng(rng_seed)
    names = [f"guest-{i}" for i in range(1, n + 1)]
    ids = {g: sm.identity_from_seed(rng.bytes(32)) for g in names}
    roster = {g: sm.public_identity(k) for g, k in ids.items()}
    guests = {g: sm.MaskingGuest(g, ids[g], roster, session, names, rng.bytes(32)) for g in names}
    return guests, ids, roster


def _agree(guests):
    ann = [m.announce() for m in guests.values()]  # what the host relays, unchanged
    for m in guests.values():
        m.agree(ann)


# -- fixed point and ring ------------------------------------------------------------------------
def test_fixed_point_error_is_bounded_by_half_a_step():
    x = torch.linspace(-1.3, 1.3, 10001)
    for bits in (4, 10):
        b = 1 << bits
        enc = sm.encode(x, 1.0, b)
        assert enc.abs().max() <= b and torch.equal(enc, enc.round())
        err = (sm.decode(enc, 1.0, b).double() - x.double().clamp(-1, 1)).abs().max()
        assert err <= 1.0 / (2 * b) + 1e-7


def test_masked_sum_is_the_plain_sum_bit_exact_and_decodes_within_the_rounding_bound():
    guests, _, _ = _guests(4)
    _agree(guests)
    g = torch.Generator().manual_seed(1)
    xs = {n: torch.rand((32, 8), generator=g) * 2 - 1 for n in guests}
    scale = 1 << 10
    enc = {n: sm.encode(x, 1.0, scale).numpy().astype(np.int64) for n, x in xs.items()}
    masked = [torch.from_numpy(guests[n].mask(enc[n], 3, ("train", 1, 0)).astype(np.float32)) for n in guests]
    total = sm.unmask_sum(masked)
    assert np.array_equal(total, sum(enc.values()))  # bit-exact on the ring
    plain = sum(xs.values())
    err = (sm.decode(torch.from_numpy(total), 1.0, scale) - plain).abs().max().item()
    assert err <= 4 / (2 * scale) + 1e-6  # G·c/(2B)


def test_a_masked_release_is_uniform_on_the_ring_and_uncorrelated_with_the_truth():
    """The host's view of one guest: chi-square over 64 equal bins of Z_2^24 and the correlation with
    the guest's true (encoded) values; only the sum of all guests' views equals the truth."""
    guests, _, _ = _guests(3)
    _agree(guests)
    n = 20000
    truth = {g: np.arange(n) % 2048 - 1024 for g in guests}  # very non-uniform, strongly structured
    views = {g: guests[g].mask(truth[g], 1, ("train", 1, 0)) for g in guests}
    for g, v in views.items():
        counts = np.bincount(v >> (sm.RING_BITS - 6), minlength=64)
        chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
        assert chi2 < 120  # 63 d.o.f.: P(chi2 > 120) < 1e-5 for a uniform view
        r = np.corrcoef(v, truth[g])[0, 1]
        assert abs(r) < 5 / math.sqrt(n)
        assert not np.array_equal(sm.centred(v), truth[g])
    total = sm.centred(sm.to_ring(sum(views.values())))
    assert np.array_equal(total, sum(truth.values()))


def test_masks_are_fresh_per_round_and_batch_and_never_reused():
    guests, _, _ = _guests(2)
    _agree(guests)
    m = guests["guest-1"]
    zero = np.zeros(64, dtype=np.int64)
    a = m.mask(zero, 1, ("train", 1, 0))
    b = m.mask(zero, 2, ("train", 1, 0))
    c = m.mask(zero, 2, ("train", 1, 1))
    assert not np.array_equal(a, b) and not np.array_equal(b, c)
    with pytest.raises(ProtocolError, match="already masked in this session"):
        m.mask(zero, 1, ("train", 1, 0))


def test_a_relay_cannot_substitute_its_own_key():
    """The host relays announcements; one it forges (its own X25519 key under guest-2's name, signed
    by the host's identity) is refused by every other guest, as are replayed and missing ones."""
    guests, ids, roster = _guests(3)
    ann = {g: m.announce() for g, m in guests.items()}
    host_id = sm.identity_from_seed(os.urandom(32))
    mitm = sm.MaskingGuest("guest-2", host_id, {**roster, "guest-2": sm.public_identity(host_id)},
                           b"s" * 16, list(guests), os.urandom(32))
    forged = dict(ann, **{"guest-2": mitm.announce()})
    with pytest.raises(ProtocolError, match="not signed by guest-2's pinned identity"):
        guests["guest-1"].agree(list(forged.values()))
    assert not guests["guest-1"].ready  # nothing kept
    # a genuine announcement of another session (replayed)
    old, _, _ = _guests(3, session=b"o" * 16)
    replay = dict(ann, **{"guest-3": old["guest-3"].announce()})
    with pytest.raises(ProtocolError, match="another session"):
        guests["guest-1"].agree(list(replay.values()))
    with pytest.raises(ProtocolError, match="expected"):
        guests["guest-1"].agree([ann["guest-1"], ann["guest-2"]])
    with pytest.raises(ProtocolError, match="SK1"):
        guests["guest-1"].agree([b"junk"])
    guests["guest-1"].agree(list(ann.values()))
    assert guests["guest-1"].ready


def test_supernode_ecdsa_keys_serve_as_identities():
    from cryptography.hazmat.primitives.asymmetric import ec

    names = ["guest-1", "guest-2"]
    ids = {g: ec.generate_private_key(ec.SECP384R1()) for g in names}
    roster = {g: sm.public_identity(k) for g, k in ids.items()}
    guests = {g: sm.MaskingGuest(g, ids[g], roster, b"e" * 16, names, os.urandom(32)) for g in names}
    _agree(guests)
    v = [guests[g].mask(np.array([5, -7]), 1, ("test", 1, 0)) for g in names]
    assert list(sm.centred(sm.to_ring(v[0] + v[1]))) == [10, -14]


# -- Skellam shares ----------------------------------------------------------------------------------
def test_skellam_shares_sum_to_the_target_variance():
    """G shares of Sk(μ/G) sum to Sk(μ): variance μ (sample variance within 2%: its sd is 0.3% here)
    and the symmetric PMF at 0 of Sk(μ) (e^{-μ}·I_0(μ))."""
    from scipy.special import ive

    mu, g, n = 9.0, 4, 200_000
    gen = torch.Generator().manual_seed(5)
    total = sum(sm.skellam((n,), mu / g, gen) for _ in range(g)).numpy()
    assert abs(total.var() / mu - 1) < 0.02
    assert abs(total.mean()) < 5 * math.sqrt(mu / n)
    p0 = float(ive(0, mu))
    assert abs((total == 0).mean() - p0) < 5 * math.sqrt(p0 * (1 - p0) / n)


def test_collusion_sets_each_share_and_not_the_charge():
    """k = G − 1 (the default 'all'): every guest adds the whole μ; k = 0: μ/G. The charge is the
    same (against the honest shares' sum Sk(μ))."""
    full = sm.SkellamShare(8, 1.0, guests=4, collusion=sm.resolve_collusion("all", 4), scale_bits=6)
    none = sm.SkellamShare(8, 1.0, guests=4, collusion=0, scale_bits=6)
    assert full.share_mu() == pytest.approx(full.mu) and none.share_mu() == pytest.approx(full.mu / 4)
    assert full.cost().dp_event == none.cost().dp_event
    with pytest.raises(ConfigError, match="at most the G - 1 = 3 other guests"):
        sm.resolve_collusion(4, 4)
    with pytest.raises(ConfigError, match="'all' or an integer"):
        sm.resolve_collusion("most", 4)


def test_wrap_probability_bound():
    assert sm.wrap_probability(8, 1 << 10, (3 * 1024) ** 2 * 8) < 1e-100
    assert sm.wrap_probability(8, 1 << 20, 1.0) == 1.0  # G·B beyond the half ring
    # a noise whose sum could leave the ring is refused with one line
    with pytest.raises(ConfigError, match="would wrap with probability") as err:
        sm.SkellamShare(4, 2000.0, guests=8, collusion=7)
    assert "\n" not in str(err.value)


# -- accounting ----------------------------------------------------------------------------------
def _independent_pld(mu: float, s: int, interval: float):
    """The 1-D pair (Sk(μ), s + Sk(μ)) from scipy.stats.skellam's PMF, through dp_accounting, rounded
    optimistically (a lower bound on the exact ε: the ledger's pessimistic one must not be below it)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from scipy.stats import skellam

    half = int(12 * math.sqrt(mu)) + 1
    z = np.arange(-half, half + s + 1)
    lp = skellam.logpmf(z, mu / 2, mu / 2)
    lq = skellam.logpmf(z - s, mu / 2, mu / 2)
    return pld_lib.from_two_probability_mass_functions(
        {int(a): float(b) for a, b in zip(z, lp) if np.isfinite(b)},
        {int(a): float(b) for a, b in zip(z, lq) if np.isfinite(b)}, value_discretization_interval=interval,
        pessimistic_estimate=False)


@pytest.mark.parametrize("width", [1, 4])
def test_ledger_epsilon_matches_an_independent_pld(width):
    """A guest's ledger (PLD accountant) charged for two releases of one record under the secure merge
    with σ = 3, B = 2^4: an upper bound on, and within 2e-3 of, the ε of the exact PMFs composed
    2·width times by dp_accounting, rounded down (the two roundings differ by ≤ 2·width·2e-4)."""
    from fl_split.privacy.ledger import Ledger, LedgerEntry

    mech = sm.SkellamShare(width, 3.0, guests=3, collusion=0, scale_bits=4)
    led = Ledger("guest-1", accountant="pld", delta=DELTA)
    for epoch in (1, 2):
        led.charge([LedgerEntry(epoch, ("train", epoch, 0), "forward", mech.cost(), np.arange(4), 1.0)])
    ours = led.epsilon()
    ref = _independent_pld(mech.mu, 2 * mech.scale, 1e-4).self_compose(2 * width).get_epsilon_for_delta(DELTA)
    assert ref <= ours <= ref + 2e-3, (ours, ref)
    # close to the Gaussian of the same variance and L2 shift (Skellam → Gaussian as μ grows)
    import dp_accounting

    gauss = dp_accounting.get_epsilon_gaussian(3.0 / (2 * math.sqrt(2 * width)), DELTA)
    assert abs(ours - gauss) / gauss < 0.05


def test_the_rdp_accountant_refuses_skellam_with_one_line():
    from fl_split.privacy.ledger import Ledger, LedgerEntry

    mech = sm.SkellamShare(2, 0.5, guests=2, collusion=0, scale_bits=4)
    led = Ledger("guest-1", accountant="rdp")
    with pytest.raises(ConfigError, match="cannot account skellam-share releases") as err:
        led.charge([LedgerEntry(1, ("train", 1, 0), "forward", mech.cost(), np.arange(4), 1.0)])
    assert "\n" not in str(err.value)
    assert len(led) == 0
