"""Secure sum merge: fixed point on a ring, pairwise masks, authenticated keys, Skellam shares.

The protocol core of ``--merge sum|avg --secure-merge`` (docs/threat-model.md, "Secure merge";
docs/accounting.md, "Distributed noise"). Pure functions and small state objects, no party or
transport: :mod:`fl_split.parties` calls them.

**Fixed point.** A guest's cut-layer element ``x`` is clamped to ``[-c, c]`` (the Gaussian defence's
tanh bound ``c = 1``) and encoded as ``round(x · B / c)``, an integer in ``[-B, B]`` with
``B = 2^scale_bits`` (default ``2^10``). Deterministic rounding: one element's integer moves by at
most ``2B`` between any two records (replace-one), exactly, so the integer sensitivity needs no
rounding slack (unlike the L2-clipped randomised rounding of Kairouz, Liu, Steinke, ICML 2021, §4).
Rounding error per element and guest: ``|decode(encode(x)) − x| ≤ c / (2B)``; of a sum of ``G``
guests: ``≤ G·c/(2B)``.

**Ring.** Values travel on ``Z_{2^24}`` (:data:`RING_BITS`) as float32 numbers ``0 … 2^24 − 1``,
which float32 holds exactly: the existing frame carries them, 4 bytes an element like a plain
release. Hiding does not depend on the ring's size (a uniform mask is a one-time pad on any
``Z_m``); the ring only has to hold the centred sum. The sum wraps when
``|Σ_g x_g + N| ≥ 2^23``; ``|Σ x_g| ≤ G·B`` and ``N`` (Skellam of variance ``μ``) obeys Bennett's
inequality ``P(|N| ≥ t) ≤ 2·exp(−t² / (2(μ + t/3)))`` (the Skellam MGF ``exp(μ(cosh θ − 1))`` is
below the centred Poisson's). :func:`wrap_probability` is that bound per element; a wrap is
post-processing of the sum (it cannot hurt privacy), only utility.

**Masks** (Bonawitz et al., CCS 2017, §4): guest ``i`` adds ``PRG(k_ij)`` for every ``j > i`` and
subtracts it for ``j < i`` (guest order by name); the masks cancel in the sum mod ``2^24``. The PRG
is ChaCha20 keyed by ``k_ij`` with a 16-byte nonce ``SHA-256(session ‖ round ‖ batch)``: a mask is
never reused within a session (:class:`MaskingGuest` refuses the same nonce twice) and every
(re)keying is a new session with fresh ephemeral keys.

**Keys.** ``k_ij = HKDF-SHA256(X25519(a_i, A_j), salt = session, info = "i|j")`` from ephemeral
X25519 keys; each guest announces its public key signed by its party identity
(:class:`KeyAnnouncement`), and every guest checks every peer's signature against the identity it
pinned from the public configuration, so whoever relays the announcements (host, coordinator)
cannot substitute a key of its own (a man in the middle would otherwise learn both masks).

**Distributed noise** (Agarwal, Kairouz, Liu, NeurIPS 2021, "The Skellam Mechanism", Prop. 3.1:
Skellam variables are closed under summation). Each guest adds ``Sk(μ/(G − k))`` per element
(``Sk(μ) = Poisson(μ/2) − Poisson(μ/2)``), so the shares of ``G − k`` honest guests sum to exactly
``Sk(μ)``, ``μ = (σ·B/c)²``: the Gaussian defence's σ in integer units. Each guest is charged
(:func:`skellam_cost`) against ``Sk(μ)`` at integer shift ``2B`` per element, its ``d`` elements
composing (docs/accounting.md).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass

import numpy as np
import torch

from fl_split.errors import ConfigError, ProtocolError
from fl_split.privacy.base import Mechanism, PrivacyCost, Release

#: the ring Z_{2^RING_BITS}; float32 holds every element exactly
RING_BITS = 24
RING = 1 << RING_BITS
HALF = 1 << (RING_BITS - 1)
#: default B = 2^SCALE_BITS integer steps per clip bound
SCALE_BITS = 10
#: what every announcement's signature covers first
_CONTEXT = b"fl_split secure-merge v1"
#: the largest Bennett bound on an element's wrap-around a configuration may have
MAX_WRAP = 1e-12


# -- fixed point ------------------------------------------------------------------------------------
def encode(x: torch.Tensor, clip: float, scale: int) -> torch.Tensor:
    """Fixed point of ``x``: ``round(clamp(x, −c, c)·B/c)`` as float64 integers in ``[−B, B]``."""
    return torch.round(x.detach().double().clamp(-clip, clip) * (scale / clip))


def decode(s: torch.Tensor, clip: float, scale: int) -> torch.Tensor:
    """Centred ring element(s) back to cut-layer units (float32): ``s·c/B``."""
    return (s.double() * (clip / scale)).float()


def to_ring(v: np.ndarray) -> np.ndarray:
    """Integers (any sign) to ``Z_{2^24}`` as int64 in ``[0, 2^24)``."""
    return np.mod(np.asarray(v, dtype=np.int64), RING)


def centred(v: np.ndarray) -> np.ndarray:
    """Ring elements ``[0, 2^24)`` to the centred representatives ``[−2^23, 2^23)``."""
    v = np.asarray(v, dtype=np.int64)
    return np.where(v >= HALF, v - RING, v)


def wrap_probability(guests: int, scale: int, mu_total: float) -> float:
    """Bennett's bound on one element's sum leaving ``[−2^23, 2^23)`` (module docstring, "Ring"):
    ``|Σ x_g| ≤ G·B`` and the noise of every share, variance ``mu_total``."""
    t = HALF - 1 - guests * scale
    if t <= 0:
        return 1.0
    if mu_total <= 0:
        return 0.0
    return min(1.0, 2.0 * math.exp(-t * t / (2.0 * (mu_total + t / 3.0))))


# -- Skellam shares ----------------------------------------------------------------------------------
def skellam(shape, mu: float, gen: torch.Generator | None, device="cpu") -> torch.Tensor:
    """``Sk(μ)`` per element (``Poisson(μ/2) − Poisson(μ/2)``, variance ``μ``), float64 integers."""
    if mu <= 0:
        return torch.zeros(shape, dtype=torch.float64, device=device)
    rate = torch.full(shape, mu / 2.0, dtype=torch.float64, device=device)
    return torch.poisson(rate, generator=gen) - torch.poisson(rate, generator=gen)


def honest_shares(guests: int, collusion: int) -> int:
    """How many guests' noise shares the adversary cannot remove: ``G − k`` (at least 1: a guest's own)."""
    return max(1, int(guests) - int(collusion))


def resolve_collusion(value, guests: int) -> int:
    """``--secure-merge-collusion``: ``all`` = ``G − 1`` (every other guest), or ``k`` in ``0 … G − 1``."""
    if value in ("all", None):
        return max(0, guests - 1)
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise ConfigError("secure-merge-collusion", value, "'all' or an integer k with 0 <= k < G") from None
    if not 0 <= k < max(1, guests):
        raise ConfigError("secure-merge-collusion", value, f"'all' or an integer k with 0 <= k <= {guests - 1}",
                          reason=f"the host can collude with at most the G - 1 = {guests - 1} other guests")
    return k


# -- identities and key agreement ---------------------------------------------------------------------
def identity_from_seed(seed: bytes):
    """An Ed25519 party identity from 32 secret bytes (the local engine derives it from the party secret)."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.from_private_bytes(bytes(seed)[:32])


def public_identity(identity) -> bytes:
    """The raw public key bytes of an identity (what the configuration pins)."""
    from cryptography.hazmat.primitives import serialization as ser

    pub = identity.public_key()
    try:
        return pub.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    except ValueError:  # an EC key (a SuperNode authentication key): its compressed point
        return pub.public_bytes(ser.Encoding.X962, ser.PublicFormat.CompressedPoint)


def _sign(identity, data: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    if isinstance(identity, ed25519.Ed25519PrivateKey):
        return identity.sign(data)
    if isinstance(identity, ec.EllipticCurvePrivateKey):
        return identity.sign(data, ec.ECDSA(hashes.SHA256()))
    raise TypeError(f"a party identity is an Ed25519 or EC private key, not {type(identity).__name__}")


def _verify(public: bytes, signature: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    try:
        if len(public) == 32:
            ed25519.Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
        else:
            curve = {33: ec.SECP256R1(), 49: ec.SECP384R1()}.get(len(public))
            if curve is None:
                return False
            key = ec.EllipticCurvePublicKey.from_encoded_point(curve, public)
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError):
        return False


def _signed(session: bytes, guest: str, public: bytes) -> bytes:
    name = guest.encode("utf-8")
    return _CONTEXT + len(session).to_bytes(2, "little") + session + len(name).to_bytes(2, "little") + name + public


@dataclass(frozen=True)
class KeyAnnouncement:
    """A guest's ephemeral X25519 public key for one session, signed by its party identity."""

    guest: str
    session: bytes
    public: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        """The frame ``SK1 | len·guest | len·session | len·public | len·signature`` (2-byte lengths)."""
        name = self.guest.encode("utf-8")
        out = b"SK1" + len(name).to_bytes(2, "little") + name
        for part in (self.session, self.public, self.signature):
            out += len(part).to_bytes(2, "little") + part
        return out

    @classmethod
    def from_bytes(cls, blob: object) -> "KeyAnnouncement":
        """Parse :meth:`to_bytes`; anything else raises :class:`ProtocolError` (a peer's bytes never crash)."""
        if not isinstance(blob, (bytes, bytearray)) or bytes(blob[:3]) != b"SK1":
            raise ProtocolError("secure merge: a key announcement is not an SK1 frame")
        blob, pos, parts = bytes(blob), 3, []
        for _ in range(4):
            if pos + 2 > len(blob):
                raise ProtocolError("secure merge: a truncated key announcement")
            n = int.from_bytes(blob[pos:pos + 2], "little")
            if pos + 2 + n > len(blob) or n > 512:
                raise ProtocolError("secure merge: a truncated key announcement")
            parts.append(blob[pos + 2:pos + 2 + n])
            pos += 2 + n
        if pos != len(blob):
            raise ProtocolError("secure merge: trailing bytes after a key announcement")
        try:
            guest = parts[0].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("secure merge: a key announcement's guest name is not UTF-8") from None
        return cls(guest, parts[1], parts[2], parts[3])


def _nonce(session: bytes, round_: int, key: tuple) -> bytes:
    text = "|".join(str(p) for p in (int(round_), *key)).encode("ascii")
    return hashlib.sha256(b"mask" + session + b"|" + text).digest()[:16]


def prg_mask(pair_key: bytes, nonce: bytes, n: int) -> np.ndarray:
    """``n`` uniform elements of ``Z_{2^24}`` from ChaCha20(``pair_key``, ``nonce``) (4 bytes each, low
    24 bits: 2^24 divides 2^32, so each is exactly uniform)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    stream = Cipher(algorithms.ChaCha20(pair_key, nonce), mode=None).encryptor().update(bytes(4 * n))
    return (np.frombuffer(stream, dtype="<u4").astype(np.int64) & (RING - 1))


class MaskingGuest:
    """One guest's side of a secure-merge session: its ephemeral key, the pairwise keys it agreed on,
    and the masks it adds (Bonawitz et al. 2017, §4, "masking with one-time pads").

    ``identity``: the guest's signing key; ``roster``: every guest's pinned public identity (from the
    public configuration); ``ephemeral_seed``: 32 secret bytes for this session's X25519 key (fresh
    for every session)."""

    def __init__(self, name: str, identity, roster: dict[str, bytes], session: bytes, members: list[str],
                 ephemeral_seed: bytes) -> None:
        from cryptography.hazmat.primitives.asymmetric import x25519

        if name not in members:
            raise ProtocolError(f"{name}: secure merge session {session.hex()[:12]} does not list this guest")
        missing = [g for g in members if g not in roster]
        if missing:
            raise ProtocolError(f"{name}: secure merge: no pinned identity for {missing}")
        self.name = name
        self.session = bytes(session)
        self.members = sorted(members, key=_guest_order)
        self.roster = dict(roster)
        self._eph = x25519.X25519PrivateKey.from_private_bytes(bytes(ephemeral_seed)[:32])
        self._identity = identity
        self._pairs: dict[str, bytes] | None = None
        self._used: set[bytes] = set()

    def announce(self) -> bytes:
        """This guest's signed ephemeral public key (what the host relays to the other guests)."""
        from cryptography.hazmat.primitives import serialization as ser

        pub = self._eph.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        signature = _sign(self._identity, _signed(self.session, self.name, pub))
        return KeyAnnouncement(self.name, self.session, pub, signature).to_bytes()

    def agree(self, announcements: list[bytes]) -> None:
        """Check every peer's announcement (its session, its signature under its pinned identity) and
        derive the pairwise keys. Anything wrong raises :class:`ProtocolError` naming it; nothing is kept."""
        from cryptography.hazmat.primitives.asymmetric import x25519

        if not isinstance(announcements, (list, tuple)):
            raise ProtocolError(f"{self.name}: secure merge: expected a list of key announcements")
        got: dict[str, KeyAnnouncement] = {}
        for blob in announcements:
            a = KeyAnnouncement.from_bytes(blob)
            if a.guest in got:
                raise ProtocolError(f"{self.name}: secure merge: two key announcements for {a.guest}")
            got[a.guest] = a
        peers = [g for g in self.members if g != self.name]
        if sorted(g for g in got if g != self.name) != sorted(peers):
            raise ProtocolError(f"{self.name}: secure merge: key announcements from {sorted(got)}, expected {peers}")
        pairs = {}
        for g in peers:
            a = got[g]
            if a.session != self.session:
                raise ProtocolError(f"{self.name}: secure merge: {g}'s key announcement is for another session; "
                                    f"refused (a replayed key)")
            if len(a.public) != 32 or not _verify(self.roster[g], a.signature, _signed(a.session, g, a.public)):
                raise ProtocolError(f"{self.name}: secure merge: {g}'s key is not signed by {g}'s pinned identity; "
                                    f"refused (whoever relayed it may have substituted its own)")
            try:
                shared = self._eph.exchange(x25519.X25519PublicKey.from_public_bytes(a.public))
            except ValueError:
                raise ProtocolError(f"{self.name}: secure merge: {g}'s key is a small-order point; refused") from None
            lo, hi = sorted((self.name, g), key=_guest_order)
            pairs[g] = _hkdf(shared, self.session, f"{lo}|{hi}".encode("utf-8"))
        self._pairs = pairs

    @property
    def ready(self) -> bool:
        return self._pairs is not None

    def state_dict(self) -> dict:
        """What a Flower node keeps between messages (``context.state``, beside the party's secret):
        the session, its members, the ephemeral key, the agreed pair keys and the nonces used."""
        from cryptography.hazmat.primitives import serialization as ser

        eph = self._eph.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
        return {"session": self.session.hex(), "members": list(self.members), "ephemeral": eph.hex(),
                "pairs": None if self._pairs is None else {g: k.hex() for g, k in sorted(self._pairs.items())},
                "used": sorted(n.hex() for n in self._used)}

    @classmethod
    def from_state(cls, name: str, identity, roster: dict[str, bytes], state: dict) -> "MaskingGuest":
        """:meth:`state_dict` back (the same session: its used nonces are still refused)."""
        out = cls(name, identity, roster, bytes.fromhex(state["session"]), list(state["members"]),
                  bytes.fromhex(state["ephemeral"]))
        pairs = state.get("pairs")
        out._pairs = None if pairs is None else {str(g): bytes.fromhex(k) for g, k in pairs.items()}
        out._used = {bytes.fromhex(n) for n in state["used"]}
        return out

    def masked(self, round_: int, key: tuple) -> bool:
        """Whether this session already masked ``(round, batch)``."""
        return _nonce(self.session, round_, key) in self._used

    def mask(self, values: np.ndarray, round_: int, key: tuple, fresh: bool = True) -> np.ndarray:
        """``values`` (integers, any sign) plus this guest's masks for ``(round, batch)``, on the ring.
        The same ``(round, batch)`` twice in a session is refused: a repeated mask would leave the
        difference of two releases unmasked (``fresh=False``: the caller discarded the first value
        unsent and replaces it)."""
        if self._pairs is None:
            raise ProtocolError(f"{self.name}: secure merge: release before the key agreement")
        nonce = _nonce(self.session, round_, key)
        if fresh and nonce in self._used:  # masked(), with the nonce already at hand
            raise ProtocolError(f"{self.name}: secure merge: round {round_} batch {key} was already masked in this "
                                f"session; refused (a mask is never used twice)")
        self._used.add(nonce)
        flat = np.asarray(values, dtype=np.int64).reshape(-1)
        total = flat.copy()
        me = _guest_order(self.name)
        for g, k in self._pairs.items():
            m = prg_mask(k, nonce, flat.size)
            total = total + m if _guest_order(g) > me else total - m
        return to_ring(total).reshape(np.shape(values))


def _guest_order(name: str):
    tail = name.rsplit("-", 1)[-1]
    return (0, int(tail), name) if tail.isdigit() else (1, 0, name)


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def unmask_sum(parts: list[torch.Tensor]) -> np.ndarray:
    """The host's only view: the centred sum mod ``2^24`` of the guests' masked vectors (float32 ring
    elements, every one an integer in ``[0, 2^24)``: :class:`ProtocolError` otherwise)."""
    total = None
    for t in parts:
        a = t.detach().cpu().double().numpy()
        if not (np.all(a == np.floor(a)) and np.all(a >= 0) and np.all(a < RING)):
            raise ProtocolError("secure merge: a masked release holds values that are not ring elements "
                                f"(integers in [0, 2^{RING_BITS}))")
        total = a.astype(np.int64) if total is None else total + a.astype(np.int64)
    return centred(to_ring(total))


# -- the guest's mechanism -----------------------------------------------------------------------------


class SkellamShare(Mechanism):
    """A guest's secure-merge release before masking: fixed point plus its share of Skellam noise.

    ``x ↦ round(clamp(x, −c, c)·B/c) + Sk(μ/(G_active − k))`` per element (module docstring), float64
    integers; the guest then masks it (:meth:`MaskingGuest.mask`). ``sigma = 0``: secure aggregation
    without noise (``--defense none``): no privacy is claimed, the host learns the exact sum.

    Cost (docs/accounting.md, "Distributed noise"): the honest guests' shares sum to exactly
    ``Sk(μ)``, ``μ = (σB/c)²`` (Agarwal, Kairouz, Liu 2021, Prop. 3.1); one record's release moves
    each of its ``d`` elements by at most ``2B`` (replace-one, deterministic rounding), so it is
    charged ``d`` composed :class:`~fl_split.privacy.events.SkellamDpEvent` ``(μ, 2B)`` — whatever
    ``G`` is, under the assumption that the host colludes with at most ``k`` guests.
    """

    name = "skellam-share"
    random = True

    def __init__(self, width: int, sigma: float, *, guests: int, collusion: int, clip: float = 1.0,
                 scale_bits: int = SCALE_BITS) -> None:
        self.width = int(width)
        self.sigma = float(sigma)
        self.clip = float(clip)
        self.scale = 1 << int(scale_bits)
        self.guests = int(guests)
        self.collusion = int(collusion)
        self.active = self.guests
        #: the variance (integer units) the honest shares sum to
        self.mu = (self.sigma * self.scale / self.clip) ** 2
        all_shares = self.mu * self.guests / honest_shares(self.guests, self.collusion)
        wrap = wrap_probability(self.guests, self.scale, all_shares)
        if wrap > MAX_WRAP:
            raise ConfigError("sigma", self.sigma, f"a noise whose sum stays on the ring Z_2^{RING_BITS} (wrap-around "
                              f"probability <= {MAX_WRAP:g} per element)",
                              reason=f"with {self.guests} guests the sum would wrap with probability up to {wrap:.2g}")

    def share_mu(self) -> float:
        """This guest's share of ``μ`` among the guests now active: ``μ / (G_active − k)``."""
        return self.mu / honest_shares(self.active, min(self.collusion, self.active - 1))

    def release(self, t: torch.Tensor, gen: torch.Generator | None) -> Release:
        """Fixed point of ``t`` plus this guest's share ``Sk(μ/(G_active − k))`` (float64 integers, unmasked:
        the guest masks them before they leave)."""
        inside = (t.detach().abs() <= self.clip)
        enc = encode(t, self.clip, self.scale)
        mu = self.share_mu()
        noise = skellam(enc.shape, mu, gen, device=enc.device)
        sd = math.sqrt(mu) * self.clip / self.scale
        signal = float(enc.pow(2).mean().sqrt()) * self.clip / self.scale
        stats = {"snr": signal / sd if sd > 0 else math.inf, "noise_scale": sd}
        return Release(value=enc + noise, ctx={"inside": inside}, stats=stats)

    def local_grad(self, ctx: dict[str, torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
        """The clamp's derivative (rounding and noise pass the gradient straight through)."""
        inside = ctx.get("inside")
        return grad if inside is None else grad * inside.to(grad.dtype)

    def describe(self) -> dict:
        """Public parameters, the collusion assumption, and the rounding and wrap-around bounds."""
        return {"name": self.name, "width": self.width, "sigma": self.sigma, "bound": self.clip,
                "scale": self.scale, "ring_bits": RING_BITS, "guests": self.guests, "collusion": self.collusion,
                "honest_shares": honest_shares(self.guests, self.collusion), "mu": self.mu,
                "rounding_error_per_element": self.clip / (2 * self.scale),
                "wrap_probability_per_element": wrap_probability(self.guests, self.scale,
                                                                 self.mu * self.guests
                                                                 / honest_shares(self.guests, self.collusion))}

    def assumptions(self) -> list[str]:
        """What this guest's guarantee rests on, for its privacy report (docs/threat-model.md, "Secure merge")."""
        h = honest_shares(self.guests, self.collusion)
        masks = (f"secure merge: the host receives this guest's cut-layer output only inside the sum of the "
                 f"{self.guests} guests' masked releases (pairwise ChaCha20 masks from X25519 keys under pinned "
                 f"identities; hidden computationally)")
        if self.sigma <= 0:
            return [masks + "; no noise, no epsilon claimed"]
        return [masks, f"distributed noise: this guest's epsilon is accounted against the Skellam noise of {h} "
                       f"honest share{'s' if h != 1 else ''} (sum variance (sigma*B/c)^2, sigma {self.sigma:g}); it "
                       f"holds if the host colludes with at most k = {self.collusion} of the other guests "
                       f"(--secure-merge-collusion)"]

    def public_diagnostics(self) -> dict:
        """Each share's noise, σ/√(G − k) per element, and the SNR bound against it; empty without noise."""
        if self.sigma <= 0:
            return {}
        sd = self.sigma / math.sqrt(honest_shares(self.guests, self.collusion))
        return {"noise_scale": sd, "noise_sd": sd, "snr_bound": self.clip / sd}

    def public_range(self):
        """Masked releases are ring elements: integers in ``[0, 2^24)``."""
        from fl_split.privacy.bounds import PublicRange

        return PublicRange(self.name, 0.0, float(RING - 1), grid=1.0,
                           why=f"secure merge: masked elements of Z_2^{RING_BITS}")

    def privacy_cost(self) -> PrivacyCost | None:
        """``d`` composed ``SkellamDpEvent(μ, 2B)``: one record's release against the honest shares' sum."""
        if self.sigma <= 0:
            return None
        from dp_accounting import dp_event as dpe

        from fl_split.privacy.events import SkellamDpEvent

        one = SkellamDpEvent(mu=self.mu, sensitivity=2 * self.scale)
        ev = one if self.width == 1 else dpe.SelfComposedDpEvent(one, self.width)
        return PrivacyCost(self.name, ev, epsilon=None, sensitivity_l1=2 * self.clip * self.width,
                           sensitivity_l2=2 * self.clip * math.sqrt(self.width),
                           params=(("collusion", self.collusion), ("guests", self.guests),
                                   ("honest_shares", honest_shares(self.guests, self.collusion)),
                                   ("scale", self.scale), ("sigma", self.sigma)))


# -- parties of one process ----------------------------------------------------------------------------
def setup_parties(host, guests: dict) -> None:
    """Give each guest its identity (Ed25519 from its own secret) and the pinned roster of every guest's
    public identity (what a deployment's kit pins from the configuration), and tell the host the fixed
    point of the guests' releases. The keys themselves are agreed per session (:func:`rekey`)."""
    for g in guests.values():
        g.secure_identity = identity_from_seed(g.secret.derive_bytes("secure-merge identity"))
    roster = {name: public_identity(g.secure_identity) for name, g in guests.items()}
    for g in guests.values():
        g.secure_roster = dict(roster)
    mech = next(iter(guests.values())).mechanisms()
    host.secure_merge = (float(mech.clip), int(mech.scale))


def roster_from_seed(private_seed, guests: int) -> dict[str, bytes]:
    """The pinned roster of a Flower simulation: every guest's public identity recomputed from the
    run's private seed, as :func:`setup_parties` derives it from each guest's secret (the secrets are
    ``HKDF(seed, party)``), so no coordinator message can change it. A per-party seed (a deployment
    node's own) cannot give the other guests' identities: :class:`ProtocolError`."""
    from fl_split.seeding import PartySecret, PrivateSeedError

    if private_seed is None:
        raise ProtocolError("secure merge: a Flower simulation pins every guest's identity from the run's private "
                            "seed (--private-seed-file); without one no roster can be pinned (the coordinator "
                            "relays the keys and must not choose them)")
    try:
        secrets_ = {f"guest-{i}": PartySecret.from_private_seed(private_seed, f"guest-{i}")
                    for i in range(1, int(guests) + 1)}
    except PrivateSeedError as exc:
        raise ProtocolError(f"secure merge: the other guests' identities cannot be pinned from this node's own "
                            f"seed ({exc})") from None
    return {g: public_identity(identity_from_seed(s.derive_bytes("secure-merge identity")))
            for g, s in secrets_.items()}


def read_roster(path: str, guests: int, own: str, own_identity) -> dict[str, bytes]:
    """A deployment guest's pinned roster from its own node-config file (``secure-merge-roster``: JSON
    ``{"guest-i": hex public identity}``, public, written by whoever set the nodes up — ``fl-split
    deploy local`` — never sent by the coordinator). Every guest of the run must be listed, and this
    guest's own entry must be its own identity; anything else: :class:`ProtocolError` in one line."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        roster = {str(g): bytes.fromhex(str(k)) for g, k in dict(raw).items()}
    except (OSError, ValueError, TypeError) as exc:
        raise ProtocolError(f"{own}: secure-merge-roster {path!r} is not a JSON object of hex public identities "
                            f"({type(exc).__name__})") from None
    want = [f"guest-{i}" for i in range(1, int(guests) + 1)]
    if sorted(roster) != sorted(want):
        raise ProtocolError(f"{own}: secure-merge-roster {path!r} lists {sorted(roster)}, the run's guests are {want}")
    if roster[own] != public_identity(own_identity):
        raise ProtocolError(f"{own}: secure-merge-roster {path!r} does not pin this guest's own identity (a roster "
                            f"of another run or other seeds)")
    return roster


#: the comment of a kit's public identity line (``ssh-ed25519 KEY fl-split-secure-merge-guest-i``)
IDENTITY_COMMENT = "fl-split-secure-merge-"


def new_identity_pem() -> bytes:
    """A fresh long-term Ed25519 identity as unencrypted PKCS#8 PEM (a kit's ``keys/secure-merge-<guest>.key``,
    docs/deploy.md "Secure merge in a deployment"): independent of the party secret, so a kit's runs
    need no persistent private seed (whose draws would repeat from run to run)."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.generate().private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                              ser.NoEncryption())


def public_identity_line(identity, guest: str) -> str:
    """``identity``'s public key as one OpenSSH line (what a kit sends; ``ssh-keygen -l -f FILE`` prints
    its SHA-256 fingerprint, the same as ``fl_split.kit.fingerprint``)."""
    from cryptography.hazmat.primitives import serialization as ser

    key = identity.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode("ascii")
    return f"{key} {IDENTITY_COMMENT}{guest}\n"


def read_identity(path: str, own: str):
    """A deployment guest's own long-term identity from an owner-only PEM file (node-config
    ``secure-merge-identity``); a file the group or others can access, or not an Ed25519 key:
    :class:`ProtocolError` in one line."""
    import os
    import stat

    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            data = fh.read(1 << 16)
    except OSError as exc:
        raise ProtocolError(f"{own}: secure-merge-identity {path!r} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode) or mode & 0o077:  # its private key: a reader could sign as this guest
        raise ProtocolError(f"{own}: secure-merge-identity {path!r} has mode {stat.S_IMODE(mode):04o}; "
                            f"allowed: an owner-only regular file (chmod 600)")
    try:
        key = ser.load_pem_private_key(data, None)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{own}: secure-merge-identity {path!r} is not a PEM private key "
                            f"({type(exc).__name__})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ProtocolError(f"{own}: secure-merge-identity {path!r} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def read_public_identity(path, guest: str) -> bytes:
    """The raw public identity of ``guest`` from its OpenSSH line (:func:`public_identity_line`);
    anything but one ``ssh-ed25519`` key: :class:`ProtocolError` in one line naming the file."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        with open(path, "rb") as fh:
            key = ser.load_ssh_public_key(fh.read(1 << 16).strip().split(b"\n")[0])
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ProtocolError(f"{path}: not {guest}'s public secure-merge identity (one ssh-ed25519 line; "
                            f"{type(exc).__name__})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ProtocolError(f"{path}: not {guest}'s public secure-merge identity (a {type(key).__name__}, "
                            f"not ssh-ed25519)")
    return key.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)


def rekey(guests: dict, members: list[str], relay=None) -> bytes:
    """A new session among ``members``: each announces a fresh key, the relay (the host's role; ``relay``
    may change what it passes on: tests play a dishonest host) hands every announcement to every member,
    each checks them against its pinned roster. Returns the session id (fresh random)."""
    import os

    session = os.urandom(16)
    ann = [guests[g].secure_announce(session, list(members)) for g in members]
    for g in members:
        guests[g].secure_agree(list(ann) if relay is None else relay(g, list(ann)))
    return session
