"""Bounded trust, second part: a guest poisoning its *training* releases (issue 25, item 5).

The public range (:mod:`fl_split.privacy.bounds`) refuses what no honest release can be. A guest
can stay inside it and still wreck the host's model: it multiplies its activations by a factor
that grows slowly (no defence: the running scale's window follows it), by a constant ×10 (below
the monitor's factor), releases a constant, or flips the sign (under Gaussian σ = 0.7 a flipped
tanh release is as likely as an honest one). The audit measured digits test accuracy 0.775 → 0.237
(ramp), 0.550 (×10), 0.450 (constant), 0.762 → 0.263 (in-range flip), every run ``completed``.

Such a guest tampers with its training releases only: its test releases decide the accuracy the
host reports and are the ones a poisoner keeps honest. The host receives both, from the same
bottom model through the same mechanism, so the honest test releases of an epoch are a reference
for the training releases just before them. :class:`TrainTestGuard` compares, per guest, at each
evaluation (before anything of the evaluation changes):

* the Pearson correlation, across the cut's elements, of the per-element mean of the last
  :data:`RECENT` training batches and the per-element mean of the epoch's test releases. Zero-mean
  noise does not change the expected means, so the statistic is robust to every defence; a sign
  flip inverts it (ρ ≈ −1). Alarm below :data:`RHO_MIN`. The check is skipped when either side's
  means spread across elements by less than :data:`SPREAD_SE` standard errors of the noise
  (nothing to compare: an exhausted schedule, or a bottom ending in batch normalisation, whose
  training outputs are centred per batch);
* the ratio of the mean per-record L2 norm (training / test): a constant ×10 gives ≈ 10, and the
  ratio of the mean per-element standard deviation: a constant release gives 0. Alarm outside
  ``[1/NORM_RATIO, NORM_RATIO]``. Under a defence (the guest's mechanism has a public range) the
  noise's scale may differ between training and test releases (a geometric schedule: measured
  0.24×) and the range already bounds the scale, so only a degenerate release is refused there:
  a standard-deviation ratio below :data:`DEGENERATE` (no noisy mechanism releases a constant).

**Like with like.** The check needs training and test releases from (nearly) the same bottom model.
With one batch per round the last :data:`RECENT` training batches are at most that many updates
older than the test releases. A relay round of more batches (``--batches-per-round 64`` or
``epoch``, FedBCD-style) releases its whole round from the model at the round's start, so at
evaluation the recent training releases are a round of updates older than the test releases (an
honest digits run with one round per epoch measured a norm ratio of 0.24 in epoch 1, refused). There
the host *defers* the comparison (:meth:`TrainTestGuard.check_test` with ``defer``): it keeps the
epoch's test releases and compares them with the next epoch's first training round
(:meth:`TrainTestGuard.check_deferred`), which the guest releases from the very model that produced
those test releases — before the host trains on that round. The first epoch's training releases
then have no test reference (the public range and the frozen scale monitor still apply).

The checks start once the guest made :data:`RECENT` training releases (a bottom with batch
normalisation releases its first test batches through running statistics still far off).

Both are computed by the host from the releases it already receives: no new message, nothing sent.
The scale reference frozen after the warm-up (:class:`~fl_split.privacy.bounds.ScaleMonitor`,
``frozen``) catches the ramp within the epoch's batches. A violation raises
:class:`PoisoningDetected` (a :class:`~fl_split.errors.ReleaseOutOfRange`), so the host refuses the
evaluation before anything changes and the run answers as ``--on-guest-failure`` says: ``stop``
names the guest and the check in one line, ``pad`` zero-fills that guest from then on.
What stays undetectable is written in ``docs/threat-model.md``.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from fl_split.errors import ReleaseOutOfRange

#: training batches (the most recent) compared with an epoch's test releases
RECENT = 8
#: correlation of the per-element means (training vs test) below which the host raises the alarm
RHO_MIN = 0.5
#: mean per-record norm ratio (training / test) beyond which the host raises the alarm
NORM_RATIO = 4.0
#: under a defence: the standard-deviation ratio below which a training release is degenerate (a constant)
DEGENERATE = 0.01
#: the test means must spread across elements by this many standard errors for ρ to mean anything
SPREAD_SE = 3.0


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


def _spread_se(mu: torch.Tensor, var: torch.Tensor, n: int) -> float:
    """Spread of the per-element means across elements, in standard errors of one mean."""
    se, spread = math.sqrt(float(var.mean()) / n), float(mu.std())
    return spread / se if se > 0 else (math.inf if spread > 0 else 0.0)


class PoisoningDetected(ReleaseOutOfRange):
    """A guest's training releases disagree with its own test releases (:class:`TrainTestGuard`)
    or its scale outgrew the frozen reference: the host refuses, naming the guest and the check."""


class TrainTestGuard:
    """Per-guest training-release statistics kept by the host, compared with each epoch's test releases."""

    def __init__(self, receiver: str = "host") -> None:
        self.receiver = receiver
        #: guest → last RECENT training batches as (sum over rows, sum of squares, sum of row norms, rows)
        self._recent: dict[str, deque] = {}
        #: guest → (test releases, their batch name, noisy) kept for the next training round (``defer``)
        self._pending: dict[str, tuple[list[torch.Tensor], str, bool]] = {}

    @staticmethod
    def _moments(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        x = t.detach().reshape(t.shape[0], -1).double()
        return x.sum(0), (x * x).sum(0), float(torch.linalg.vector_norm(x, dim=1).sum()), int(x.shape[0])

    def record_train(self, guest: str, t: torch.Tensor) -> None:
        if t.numel():
            self._recent.setdefault(guest, deque(maxlen=RECENT)).append(self._moments(t))

    def check_test(self, guest: str, tensors: list[torch.Tensor], batch: str, round_: int | None,
                   noisy: bool = False, defer: bool = False) -> None:
        """Raise :class:`PoisoningDetected` if ``guest``'s recent training releases disagree with
        its test releases ``tensors`` (one epoch's); nothing recorded either way. ``noisy``: the
        guest's mechanism has a public range (a defence). ``defer``: the recent training releases
        came from an older model (a long relay round): keep ``tensors`` for :meth:`check_deferred`."""
        if defer:
            self._pending[guest] = ([t.detach() for t in tensors], batch, noisy)
            return
        why = self.violation(guest, tensors, noisy)
        if why is not None:
            raise PoisoningDetected(guest, self.receiver, "activations", batch, round_, why)

    def check_deferred(self, guest: str, train: list[torch.Tensor], batch: str, round_: int | None) -> None:
        """The deferred comparison: ``guest``'s training releases ``train`` (the first round after a
        deferred evaluation, released by the model that produced the kept test releases) against
        those test releases; raise :class:`PoisoningDetected` before the host uses the round."""
        pending = self._pending.pop(guest, None)
        if pending is None:
            return
        test, test_batch, noisy = pending
        fresh = TrainTestGuard(self.receiver)
        for t in train[-RECENT:]:
            fresh.record_train(guest, t)
        why = fresh.violation(guest, test, noisy)
        if why is not None:
            raise PoisoningDetected(guest, self.receiver, "activations", batch, round_,
                                    f"{why}; compared with the test releases of {test_batch}, from the same model")

    def statistics(self, guest: str, tensors: list[torch.Tensor]) -> dict[str, float] | None:
        """``{"rho", "norm_ratio", "sd_ratio", "spread_se"}`` of ``guest``'s recent training releases against
        ``tensors``; None where there is nothing to compare."""
        recent = self._recent.get(guest)
        tensors = [t for t in tensors if t.numel()]
        if not recent or len(recent) < RECENT or not tensors:
            return None
        tr = [sum(m[i] for m in recent) for i in range(4)]
        te = [sum(m[i] for m in (self._moments(t) for t in tensors)) for i in range(4)]
        if tr[3] < 2 or te[3] < 2 or tr[0].numel() != te[0].numel() or tr[0].numel() < 2:
            return None
        mu_tr, mu_te = tr[0] / tr[3], te[0] / te[3]
        var_te = (te[1] / te[3] - mu_te ** 2).clamp_min(0)
        var_tr = (tr[1] / tr[3] - mu_tr ** 2).clamp_min(0)
        spread_se = [_spread_se(mu, var, n) for mu, var, n in ((mu_tr, var_tr, tr[3]), (mu_te, var_te, te[3]))]
        sd_tr, sd_te = float(var_tr.sqrt().mean()), float(var_te.sqrt().mean())
        n_tr, n_te = tr[2] / tr[3], te[2] / te[3]
        out = {"norm_ratio": _ratio(n_tr, n_te), "sd_ratio": _ratio(sd_tr, sd_te), "spread_se": spread_se[1],
               "rho": math.nan}
        if min(spread_se) >= SPREAD_SE:
            a, b = mu_tr - mu_tr.mean(), mu_te - mu_te.mean()
            den = float(torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
            out["rho"] = float(a @ b) / den if den > 0 else 0.0
        return out

    def violation(self, guest: str, tensors: list[torch.Tensor], noisy: bool = False) -> str | None:
        s = self.statistics(guest, tensors)
        if s is None:
            return None
        rows = sum(m[3] for m in self._recent[guest])
        if not math.isnan(s["rho"]) and s["rho"] < RHO_MIN:
            return (f"poisoning check (train vs test): the per-element mean of its last {rows} training records "
                    f"correlates {s['rho']:.3f} with that of its test releases (allowed: ≥ {RHO_MIN:g}; "
                    f"an honest guest releases both from the same bottom model)")
        checks = (("sd_ratio", "mean per-element standard deviation", DEGENERATE, math.inf),) if noisy else (
            ("norm_ratio", "mean per-record norm", 1 / NORM_RATIO, NORM_RATIO),
            ("sd_ratio", "mean per-element standard deviation", 1 / NORM_RATIO, NORM_RATIO))
        for key, what, lo, hi in checks:
            r = s[key]
            if not lo <= r <= hi:
                allowed = f"{lo:g}x to {hi:g}x" if hi < math.inf else f"at least {lo:g}x under a defence"
                return (f"poisoning check (train vs test): the {what} of its last {rows} training records is {r:.3g}x "
                        f"that of its test releases (allowed: {allowed})")
        return None


__all__ = ["DEGENERATE", "NORM_RATIO", "PoisoningDetected", "RECENT", "RHO_MIN", "SPREAD_SE", "TrainTestGuard"]
