"""From the run configuration to the mechanisms on each crossing (spec §3 "protect").

``--defense`` names the mechanism, ``--protect`` the direction(s) it covers: ``guest`` = the
guests' forward releases (their features), ``host`` = the host's backward releases (its labels
and features, through the partial losses), ``both``. ``dpsgd`` is not a boundary mechanism: the
protected party trains its own parameters with DP-SGD (Opacus) and both crossings stay identity.

``--dp-sgd guest|host|both`` adds DP-SGD on those parties' own models to whatever ``--defense``
puts on their releases (one ledger per party accounts both).

Epsilon is per record and per release (``docs/mechanisms.md``); with ``--schedule geometric``
training iteration ``i`` (counted over the whole run) gets ``ε/2^i`` (001 §3.4), so a record's
total over any number of iterations stays below ``ε``. Once ``ε/2^i`` falls below
``ε·2^-40`` (noise a trillion times the signal bound) the party releases zeros instead
(:class:`Exhausted`): a constant release costs nothing, carries as much as that noise, and keeps
the numbers finite.
"""

from __future__ import annotations

import torch

from fl_split.config import AUTO, RunConfig
from fl_split.errors import ConfigError
from fl_split.privacy.base import Mechanism, NoDefense, PostProcess, Release

#: defences that perturb what crosses the cut (the others: none, dpsgd); a plug-in class
#: (``--defense package.module:Class``, :mod:`fl_split.privacy.plugin`) is one too: :func:`is_boundary`
BOUNDARY = ("laplace", "gaussian", "r3elu", "rr")


def plugin_class(cfg: RunConfig):
    """The plug-in mechanism class ``--defense`` names, or ``None`` for a built-in defence (imported
    and checked as :func:`fl_split.plugins.resolve` does, one line naming --defense)."""
    from fl_split.config import is_user_model  # ``package.module:Class`` syntax
    from fl_split.privacy.plugin import mechanism_class

    return mechanism_class(cfg.defense) if is_user_model(cfg.defense) else None


def is_boundary(cfg: RunConfig) -> bool:
    """``--defense`` perturbs what crosses the cut (a built-in boundary mechanism or a plug-in)."""
    from fl_split.config import is_user_model

    return cfg.defense in BOUNDARY or is_user_model(cfg.defense)


def protects_guests(cfg: RunConfig) -> bool:
    return cfg.defense != "none" and cfg.protect in ("guest", "both")


def protects_host(cfg: RunConfig) -> bool:
    return cfg.defense != "none" and cfg.protect in ("host", "both")


def check(cfg: RunConfig) -> None:
    """Combinations of privacy options that cannot work, named as the user typed them; a plug-in
    ``--defense`` is imported and checked here, before anything runs (in each process that builds a
    party: under Flower, every ClientApp process must be able to import it)."""
    cls = plugin_class(cfg)
    if cls is not None and cfg.budget != AUTO and cfg.dp_sgd == "none":
        from fl_split.privacy.plugin import claims_privacy

        if not claims_privacy(cls):
            raise ConfigError("budget", cfg.budget, "auto with a plug-in --defense that claims no privacy",
                              reason=f"{cls.__name__} defines no privacy_cost, so nothing is charged and the budget "
                                     "would never bind")
    if cfg.defense == "rr" and protects_host(cfg):
        raise ConfigError("protect", cfg.protect, "guest (randomized response binarises forward "
                          "releases; it has no meaningful backward form)")
    if cfg.one_shot and not (cfg.defense == "none" or is_boundary(cfg)):
        raise ConfigError("one-shot", True, "a boundary defence (laplace, gaussian, rr, r3elu) or none",
                          reason=f"--defense {cfg.defense} trains the guest, which one-shot freezes")
    if cfg.one_shot and protects_host(cfg):
        raise ConfigError("protect", cfg.protect, "guest (in one-shot mode nothing flows back to the guests)")
    if cfg.laplace_b != AUTO and cfg.schedule == "geometric" and cfg.defense == "laplace":
        raise ConfigError("schedule", cfg.schedule, "constant when --laplace-b fixes the noise scale")
    if cfg.allocation != "uniform" and cfg.defense != "r3elu":
        raise ConfigError("allocation", cfg.allocation, "uniform (importance allocation is R3eLU's, 001 Eq. 8-10)",
                          reason=f"--defense is {cfg.defense}")
    if cfg.one_shot and cfg.dp_sgd in ("guest", "both"):
        raise ConfigError("dp-sgd", cfg.dp_sgd, "none or host (one-shot freezes the guests' bottoms)")
    if cfg.defense == "dpsgd" and cfg.dp_sgd != "none":
        raise ConfigError("dp-sgd", cfg.dp_sgd, "none with --defense dpsgd (which is DP-SGD alone on the --protect "
                          "parties); use --dp-sgd with a boundary defence to combine both")
    if cfg.report_metrics == "none" and not cfg.host_metrics:
        raise ConfigError("host-metrics", cfg.host_metrics, "a file path for the host's own metrics",
                          reason="--report-metrics none keeps every metric at the host, which writes them there")


def guest_cut_activation(cfg: RunConfig) -> str:
    """How a guest's bottom ends when its forward release is protected.

    R3eLU *is* the activation (bare last layer, 001 Table 10); the Gaussian mechanism needs a
    ``tanh``-bounded layer (003); randomized response binarises the pre-activation (002:
    ``1[A > 0]`` is the same bit before or after a ReLU, and the bare value keeps the
    straight-through gradient informative). Everything else keeps the architecture's own.
    """
    if not protects_guests(cfg):
        return "native"
    cls = plugin_class(cfg)
    if cls is not None:  # a plug-in says how the bottom must end (fl_split.privacy.plugin)
        return getattr(cls, "cut_activation", "native")
    return {"r3elu": "none", "gaussian": "tanh", "rr": "none"}.get(cfg.defense, "native")


#: geometric schedule: below this fraction of the total budget a release is replaced by zeros
EXHAUSTED_FRACTION = 2.0 ** -40


class Exhausted(Mechanism):
    """A release of zeros: what the geometric schedule sends once ``ε_T/2^i < ε_T·2^-40``.

    A constant output is 0-DP (no cost is charged), and the receiver learns from it exactly as
    much as from noise ``2^40`` times the signal bound, without overflowing floats. Its local
    derivative is zero (the output does not depend on the input)."""

    name = "exhausted"

    def __init__(self, iteration: int) -> None:
        self.iteration = int(iteration)

    def release(self, t, gen):
        return Release(value=torch.zeros_like(t.detach()), encoding=self.encoding)

    def local_grad(self, ctx, grad):
        return grad * 0.0

    def public_range(self):
        from fl_split.privacy.bounds import zeros_range

        return zeros_range(self.name, f"the geometric schedule's iteration {self.iteration} releases zeros")

    def describe(self) -> dict:
        return {"name": self.name, "iteration": self.iteration,
                "reason": f"geometric schedule: epsilon/2^{self.iteration} is below epsilon*2^-40"}


def iteration_epsilon(cfg: RunConfig, iteration: int) -> float:
    """The per-release epsilon of training ``iteration`` (1-based) under the configured schedule."""
    if cfg.schedule == "geometric":
        from fl_split.privacy.mechanisms import geometric_epsilon

        return geometric_epsilon(cfg.epsilon, iteration)
    return cfg.epsilon


#: ``--clip-c auto`` per defence. The noise of Laplace (b = 2·C·d/ε) and R3eLU (2·K·C/ε per kept
#: entry) grows with C while the signal is capped at C, and a bottom model learns activations
#: beyond any small C, so at a fixed ε a small C keeps the sign of each element and loses little.
#: Measured on the default data (digits, 1 guest, 5 epochs, ε = 1, three seeds;
#: docs/mechanisms.md "Settings that train on the default data"): Laplace C = 10 → 0.10 (chance),
#: C = 0.01 → 0.78; R3eLU C = 10, K = 32 → 0.08, C = 0.1, K = 2 → 0.84. Every other defence
#: keeps C = 10 (of those, only the Gaussian defence's backward clip reads it).
AUTO_CLIP_C = {"laplace": 0.01, "r3elu": 0.1}
DEFAULT_CLIP_C = 10.0
#: ``--top-k auto``: R3eLU keeps width / 32 entries per record (2 of a 64-wide cut), at least 1
TOP_K_DIVISOR = 32


def clip_bound(cfg: RunConfig, direction: str = "forward") -> float:
    """The clipping bound C of ``direction``'s releases: ``--clip-c`` (``--clip-c-backward`` for
    backward releases when given); ``auto`` resolves per defence (:data:`AUTO_CLIP_C`)."""
    if direction == "backward" and cfg.clip_c_backward != AUTO:
        return float(cfg.clip_c_backward)
    if cfg.clip_c == AUTO:
        return AUTO_CLIP_C.get(cfg.defense, DEFAULT_CLIP_C)
    return float(cfg.clip_c)


def top_k(cfg: RunConfig, width: int) -> int:
    """R3eLU's K for a cut of ``width``: ``--top-k``; ``auto`` = max(1, width // 32); ``half`` =
    max(1, width // 2), 001's K = N/2."""
    if cfg.top_k == AUTO:
        return max(1, width // TOP_K_DIVISOR)
    if cfg.top_k == "half":
        return max(1, width // 2)
    return int(cfg.top_k)


def _mechanism(cfg: RunConfig, width: int, direction: str, iteration: int) -> Mechanism:
    from fl_split.privacy import mechanisms as m

    eps = iteration_epsilon(cfg, iteration)
    cls = plugin_class(cfg)
    if (cfg.schedule == "geometric" and (cfg.defense in ("laplace", "r3elu", "rr") or cls is not None)
            and eps < cfg.epsilon * EXHAUSTED_FRACTION):
        return Exhausted(iteration)
    bound = clip_bound(cfg, direction)
    if cls is not None:
        from fl_split.privacy import plugin

        spec = plugin.MechanismSpec(direction=direction, width=int(width), epsilon=float(eps), delta=float(cfg.delta),
                                    bound=float(bound), sigma=float(cfg.sigma), iteration=int(iteration),
                                    options=plugin.parse_options(cfg.defense_options))
        return plugin.build(cfg.defense, cls, spec)
    if cfg.defense == "laplace":
        if cfg.laplace_b != AUTO:
            return m.Laplace(width, direction, bound, b=float(cfg.laplace_b))
        return m.Laplace(width, direction, bound, epsilon=eps)
    if cfg.defense == "gaussian":
        return m.Gaussian(width, direction, cfg.sigma, bound=1.0 if direction == "forward" else bound)
    if cfg.defense == "r3elu":
        return m.R3eLU(width, direction, eps, bound, k=top_k(cfg, width), allocation=cfg.allocation)
    if cfg.defense == "rr":
        return m.RandomizedResponse(width, eps, direction=direction)
    return NoDefense()


def forward_mechanism(cfg: RunConfig, width: int, iteration: int = 1) -> Mechanism:
    """What a guest applies to its cut-layer output of ``width`` elements per record."""
    if cfg.secure_merge:  # fixed point + Skellam share (fl_split/privacy/secure_merge.py), masked by the guest
        from fl_split.privacy.secure_merge import SkellamShare, resolve_collusion

        noisy = cfg.defense == "gaussian" and protects_guests(cfg)
        clip = 1.0 if noisy else (10.0 if cfg.clip_c == AUTO else float(cfg.clip_c))
        return SkellamShare(width, float(cfg.sigma) if noisy else 0.0, guests=int(cfg.guests),
                            collusion=resolve_collusion(cfg.secure_merge_collusion, int(cfg.guests)), clip=clip)
    if is_boundary(cfg) and protects_guests(cfg):
        return _mechanism(cfg, width, "forward", iteration)
    return NoDefense()


def backward_mechanism(cfg: RunConfig, width: int, iteration: int = 1) -> Mechanism:
    """What the host applies to the partial loss it sends a guest."""
    if is_boundary(cfg) and protects_host(cfg):
        return _mechanism(cfg, width, "backward", iteration)
    return NoDefense()


def postprocess(cfg: RunConfig, side: str) -> PostProcess:
    """Receiver-side denoising of ``side`` ("forward" releases at the host, "backward" at guests)."""
    if cfg.denoise == "none" or cfg.denoise_side not in (side, "both"):
        return PostProcess()
    from fl_split.privacy.denoise import Mask, Scale

    return Scale(cfg.denoise_param) if cfg.denoise == "scale" else Mask(cfg.denoise_param)


def uses_dpsgd(cfg: RunConfig, role: str) -> bool:
    """Whether the party with ``role`` ("guest" / "host") trains its own model with DP-SGD."""
    if cfg.dp_sgd in (role, "both"):
        return True
    if cfg.defense != "dpsgd":
        return False
    return protects_guests(cfg) if role == "guest" else protects_host(cfg)


def dpsgd_sigma(cfg: RunConfig) -> float:
    """The DP-SGD noise multiplier: ``--dp-sgd-sigma``, or ``--sigma`` (also ``--defense dpsgd``'s)."""
    return float(cfg.sigma) if cfg.dp_sgd_sigma == AUTO else float(cfg.dp_sgd_sigma)


def claims_dp(cfg: RunConfig, role: str) -> bool:
    """Whether the party with ``role`` claims differential privacy for something it releases
    (its boundary releases, or its model through DP-SGD): it then keeps a ledger. A plug-in
    defence claims it only when its class defines ``privacy_cost`` (:mod:`fl_split.privacy.plugin`)."""
    protected = protects_guests(cfg) if role == "guest" else protects_host(cfg)
    if protected and is_boundary(cfg):
        cls = plugin_class(cfg)
        if cls is None:
            return True
        from fl_split.privacy.plugin import claims_privacy

        if claims_privacy(cls):
            return True
    return uses_dpsgd(cfg, role)


def fixed_point_of(cfg) -> tuple[float, int]:
    """``(clip, scale)`` of the guests' secure-merge releases under ``cfg`` (what the host decodes with,
    ``fl_split/privacy/secure_merge.py``), from the factory that builds a guest's ``SkellamShare``."""
    mech = forward_mechanism(cfg, 1)
    return float(mech.clip), int(mech.scale)
