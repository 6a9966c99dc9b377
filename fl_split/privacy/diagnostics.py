"""A party's own view of what its releases carry, and the warning when they carry only noise.

Two kinds of release diagnostics exist (privacy principle 2):

* **local** — computed from the party's *private* values (the signal-to-noise ratio of each
  release: RMS of the clipped signal over the noise's standard deviation, see
  :class:`~fl_split.privacy.base.Release`). They stay with the party: in its own state and its
  own log, never in a message, a reply or a report;
* **public** — computed from public parameters only (:meth:`Mechanism.public_diagnostics`: noise
  scale, the largest SNR the mechanism allows). They go into the party's privacy report.

**The warning.** A release of ``d`` elements with per-element SNR ``ρ`` carries, after the best
linear combination of its elements (a matched filter), a per-record SNR of ``ρ·√d``. Below 1 the
receiver cannot tell one record's release from pure noise better than a single noise standard
deviation allows (for Gaussian noise, a test between "signal" and "no signal" has advantage at
most ``2Φ(ρ√d/2) − 1 < 0.38``), and what the host learns about a test record at prediction time
is bounded the same way: training may still average many releases, but prediction cannot. R3eLU
at ε = 1 on digits trains to chance with ``ρ√d ≈ 2e-3``. When a party's releases of an epoch fall
below :data:`RECORD_SNR_WARN`, the party's own process logs one warning naming the mechanism,
the SNR, and what would raise it.
"""

from __future__ import annotations

import logging
import math

from fl_split.privacy.base import ReleaseStats

log = logging.getLogger("fl_split.party")

#: per-record signal-to-noise ratio (per-element SNR × √d) below which a party warns
RECORD_SNR_WARN = 1.0

#: what raises the SNR, per mechanism
_ADVICE = {
    "laplace": "raise --epsilon (or lower --laplace-b), lower --clip-c toward the activations' range, or use "
               "a narrower cut layer",
    "gaussian": "lower --sigma or use a narrower cut layer",
    "r3elu": "raise --epsilon, lower --top-k (the Laplace scale is 2KC/eps_l), or lower --clip-c",
    "rr": "raise --epsilon (each of the d bits gets epsilon/d) or use a narrower cut layer",
}


class LocalDiagnostics:
    """Per-epoch statistics of a party's releases, from its private values (kept locally)."""

    def __init__(self, party: str, width: int) -> None:
        self.party = party
        self.width = int(width)
        self.stats = ReleaseStats()
        self.warned = False

    def add(self, epoch: int, stats: dict[str, float]) -> None:
        self.stats.add(epoch, stats)

    def record_snr(self, epoch: int) -> float | None:
        """Mean per-record SNR (``snr·√d``) of the epoch's releases; ``None`` without diagnostics."""
        agg = self.stats.state_dict().get(int(epoch), {}).get("snr")
        if not agg:
            return None
        return (agg[0] / agg[3]) * math.sqrt(self.width)

    def check(self, epoch: int, mechanism: str, snr_bound: float | None = None) -> None:
        """Warn once per run if the releases of ``epoch`` are below :data:`RECORD_SNR_WARN`.

        ``snr_bound``: the mechanism's public per-element bound. When it already puts every release
        below the threshold, the run's one public line (:func:`hopeless_releases`) has said so and
        the party logs its measurement at INFO (kept in its log, not repeated on the console)."""
        snr = self.record_snr(epoch)
        if self.warned or snr is None or not snr < RECORD_SNR_WARN:
            return
        self.warned = True
        known = snr_bound is not None and snr_bound * math.sqrt(self.width) < RECORD_SNR_WARN
        log.log(logging.INFO if known else logging.WARNING, "%s: its %s releases in epoch %d are mostly noise: per-record signal-to-noise ratio %.3g "
                    "(< %g; per element %.3g over %d elements). The receiver learns little from them; to raise "
                    "it, %s.", self.party, mechanism, epoch, snr, RECORD_SNR_WARN, snr / math.sqrt(self.width),
                    self.width, _ADVICE.get(mechanism, "lower the noise"))

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict(), "warned": bool(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state.get("stats", {}))
        self.warned = bool(state.get("warned", False))


def hopeless_releases(plan) -> list[str]:
    """The run's one warning (a list of at most one line), from public facts alone, when some crossing's
    mechanism cannot carry a record's signal: even the largest signal its parameters allow
    (``snr_bound``) gives a per-record SNR below :data:`RECORD_SNR_WARN`. Anyone can compute it before
    training (the CLI and the Python API print it, the ServerApp logs it); the bounds stay in each
    party's privacy report (``release_diagnostics.snr_bound``, the summary's "SNR bound" column).

    One line per run, naming the parties (docs/mechanisms.md "Signal-to-noise warnings"): such a run
    can still learn by averaging many releases (breast-cancer under Laplace at ε = 4 reaches 0.956
    at a bound of 0.177), so the line says what the bound means rather than that nothing is learnt."""
    from fl_split.privacy import factory

    cfg = plan.cfg
    groups: dict[tuple[str, str, str], list[str]] = {}  # (mechanism, direction, bound) -> receivers' peers
    for g in plan.guests:
        width = int(math.prod(plan.cut_shapes[g]))
        for direction, mech in (("forward", factory.forward_mechanism(cfg, width)),
                                ("backward", factory.backward_mechanism(cfg, width))):
            bound = mech.public_diagnostics().get("snr_bound")
            if bound is None or bound * math.sqrt(width) >= RECORD_SNR_WARN:
                continue
            groups.setdefault((mech.name, direction, f"{bound * math.sqrt(width):.3g}"), []).append(g)
    if not groups:
        return []
    parts = []
    for (name, direction, bound), guests in groups.items():
        who = ", ".join(guests) if direction == "forward" else f"the host to {', '.join(guests)}"
        parts.append(f"{who} ({name}, at most {bound})")
    advice = "; ".join(dict.fromkeys(_ADVICE.get(name, "lower the noise") for name, _, _ in groups))
    return [f"releases below a per-record signal-to-noise ratio of {RECORD_SNR_WARN:g} (public bound): "
            f"{'; '.join(parts)}. One release says little about its record; training can still learn by "
            f"averaging many (see the test metric). To raise it, {advice}"]
