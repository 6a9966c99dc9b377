"""From the run configuration to the mechanisms on each crossing (SPEC §3 "protect").

``--defense`` names the mechanism, ``--protect`` the direction(s) it covers: ``guest`` = the
guests' forward releases (their features), ``host`` = the host's backward releases (its labels
and features, through the partial losses), ``both``. ``dpsgd`` is not a boundary mechanism: the
protected party trains its own parameters with DP-SGD (Opacus) and both crossings stay identity.

Epsilon is per record and per release (``docs/mechanisms.md``); with ``--schedule geometric`` the
release in epoch ``i`` gets ``ε/2^i`` (001 §3.4), so the total over any number of epochs stays
below ``ε``.
"""

from __future__ import annotations

from fl_split.config import AUTO, RunConfig
from fl_split.errors import ConfigError
from fl_split.privacy.base import Mechanism, NoDefense, PostProcess

#: defences that perturb what crosses the cut (the others: none, dpsgd)
BOUNDARY = ("laplace", "gaussian", "r3elu", "rr")


def protects_guests(cfg: RunConfig) -> bool:
    return cfg.defense != "none" and cfg.protect in ("guest", "both")


def protects_host(cfg: RunConfig) -> bool:
    return cfg.defense != "none" and cfg.protect in ("host", "both")


def check(cfg: RunConfig) -> None:
    """Combinations of privacy options that cannot work, named as the user typed them."""
    if cfg.defense == "rr" and protects_host(cfg):
        raise ConfigError("protect", cfg.protect, "guest (randomized response binarises forward "
                          "releases; it has no meaningful backward form)")
    if cfg.one_shot and cfg.defense not in ("none", "laplace", "gaussian", "rr", "r3elu"):
        raise ConfigError("one-shot", True, "a boundary defence (laplace, gaussian, rr, r3elu) or none",
                          reason=f"--defense {cfg.defense} trains the guest, which one-shot freezes")
    if cfg.one_shot and protects_host(cfg):
        raise ConfigError("protect", cfg.protect, "guest (in one-shot mode nothing flows back to the guests)")
    if cfg.laplace_b != AUTO and cfg.schedule == "geometric" and cfg.defense == "laplace":
        raise ConfigError("schedule", cfg.schedule, "constant when --laplace-b fixes the noise scale")
    if cfg.allocation != "uniform" and cfg.defense != "r3elu":
        raise ConfigError("allocation", cfg.allocation, "uniform (importance allocation is R3eLU's, 001 Eq. 8-10)",
                          reason=f"--defense is {cfg.defense}")


def guest_cut_activation(cfg: RunConfig) -> str:
    """How a guest's bottom ends when its forward release is protected.

    R3eLU *is* the activation (bare last layer, 001 Table 10); the Gaussian mechanism needs a
    ``tanh``-bounded layer (003); randomized response binarises the pre-activation (002:
    ``1[A > 0]`` is the same bit before or after a ReLU, and the bare value keeps the
    straight-through gradient informative). Everything else keeps the architecture's own.
    """
    if not protects_guests(cfg):
        return "native"
    return {"r3elu": "none", "gaussian": "tanh", "rr": "none"}.get(cfg.defense, "native")


def epoch_epsilon(cfg: RunConfig, epoch: int) -> float:
    """The per-release epsilon of ``epoch`` (1-based) under the configured schedule."""
    if cfg.schedule == "geometric":
        from fl_split.privacy.mechanisms import geometric_epsilon

        return geometric_epsilon(cfg.epsilon, epoch)
    return cfg.epsilon


def _mechanism(cfg: RunConfig, width: int, direction: str, epoch: int) -> Mechanism:
    from fl_split.privacy import mechanisms as m

    eps = epoch_epsilon(cfg, epoch)
    bound = cfg.clip_c if direction == "forward" or cfg.clip_c_backward == AUTO else float(cfg.clip_c_backward)
    if cfg.defense == "laplace":
        if cfg.laplace_b != AUTO:
            return m.Laplace(width, direction, bound, b=float(cfg.laplace_b))
        return m.Laplace(width, direction, bound, epsilon=eps)
    if cfg.defense == "gaussian":
        return m.Gaussian(width, direction, cfg.sigma, bound=1.0 if direction == "forward" else bound)
    if cfg.defense == "r3elu":
        k = None if cfg.top_k == AUTO else int(cfg.top_k)
        alloc = cfg.allocation if direction == "forward" else "uniform"
        return m.R3eLU(width, direction, eps, bound, k=k, allocation=alloc)
    if cfg.defense == "rr":
        return m.RandomizedResponse(width, eps, direction=direction)
    return NoDefense()


def forward_mechanism(cfg: RunConfig, width: int, epoch: int = 1) -> Mechanism:
    """What a guest applies to its cut-layer output of ``width`` elements per record."""
    if cfg.defense in BOUNDARY and protects_guests(cfg):
        return _mechanism(cfg, width, "forward", epoch)
    return NoDefense()


def backward_mechanism(cfg: RunConfig, width: int, epoch: int = 1) -> Mechanism:
    """What the host applies to the partial loss it sends a guest."""
    if cfg.defense in BOUNDARY and protects_host(cfg):
        return _mechanism(cfg, width, "backward", epoch)
    return NoDefense()


def postprocess(cfg: RunConfig, side: str) -> PostProcess:
    """Receiver-side denoising of ``side`` ("forward" releases at the host, "backward" at guests)."""
    if cfg.denoise == "none" or cfg.denoise_side not in (side, "both"):
        return PostProcess()
    from fl_split.privacy.denoise import Mask, Scale

    return Scale(cfg.denoise_param) if cfg.denoise == "scale" else Mask(cfg.denoise_param)


def uses_dpsgd(cfg: RunConfig, role: str) -> bool:
    """Whether the party with ``role`` ("guest" / "host") trains with DP-SGD."""
    if cfg.defense != "dpsgd":
        return False
    return protects_guests(cfg) if role == "guest" else protects_host(cfg)
