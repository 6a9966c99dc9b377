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

**Label agreement** (issue 36). A guest that permutes its training releases' records within each batch
keeps every mean and norm above, but its releases no longer belong to their records — and the host holds
the records' labels. The same check therefore also compares, per guest, the within-batch cross-covariance
of the releases with the host's labels, ``C = Σ_b Σ_i (x − x̄_b)(y − ȳ_b)ᵀ / n`` (centred per batch: a
permutation keeps each batch's means, which carry the batch's label mix; ``y``: one-hot classes, the 0/1
class or the standardised target; :func:`label_matrix`), of the last :data:`RECENT` training batches with
that of the epoch's test releases: their correlation (cosine, :func:`label_agreement`) is near 1 for an
honest guest and near 0 for a permuted one (zero-mean noise, independent of the labels, changes ``C``'s
spread, not its expectation; a scale cancels). Refused below ``max(LABEL_RHO_MIN, LABEL_Z × σ₀)``, σ₀ the
correlation's standard deviation were each training batch's records permuted (exact for the projection on
the test direction). Judged only where the test releases carry the labels well above chance: ``‖C_test‖²``
against its chance level (:func:`_cross`) predicts the correlation an honest guest would show, which must
reach :data:`LABEL_JUDGE` and the threshold + :data:`LABEL_MARGIN` (Gaussian σ = 0.7, Laplace ε = 50:
releases mostly noise, and binary tasks, whose label covariance lies in one or two directions: skipped).
Both the prediction and σ₀ are computed from quantities a permutation leaves unchanged, so a permuting
guest cannot make itself unjudged. A guest holds no labels, so it cannot reorder its records and keep this
agreement.

The checks start once the guest made :data:`RECENT` training releases (a bottom with batch
normalisation releases its first test batches through running statistics still far off).

**The training-loss jump alarm** (:class:`LossJumpAlarm`; opt-in, ``--loss-alarm``: its honest margin is
thin and it costs a forward pass per batch, ``docs/threat-model.md``) looks at what a permutation of a batch's
records (every mean and norm kept) does change: the host's loss. Before it trains on a round, the
host measures each batch's loss under its current models (forward only, in evaluation mode, no
private draw: nothing of its state moves) and compares it with its last :data:`LOSS_HISTORY` batch
losses. After :data:`LOSS_WARMUP` of them, a loss above ``max(median + LOSS_K·MAD, LOSS_FACTOR ×
median)`` is a *candidate* jump; only then the host measures the batch again with each guest's
release zero-filled (what ``--on-guest-failure pad`` does). A guest is *blamed* for the batch if its
zero-fill gives the lowest loss, undoes at least :data:`LOSS_BLAME` of the jump ``loss − median``,
and every other guest's zero-fill stays at least that much above it. The alarm is raised when one
guest is blamed on :data:`LOSS_REPEAT` of the last :data:`LOSS_WINDOW` judged batches: an honest
batch alone can look exactly like that (credit under DP-SGD, measured: a loss 3.4× the median
brought back to it by zero-filling one guest), a tampering guest does it batch after batch. The
history restarts where losses stop being comparable: after a long relay round (more than
:data:`RECENT` batches: the guests' models moved by a round of updates), when a guest's public
mechanism changes (a geometric schedule: every batch, so there the alarm never judges), and when a
guest is dropped. Constants and the measured margins: ``docs/threat-model.md``
(``experiments/loss_alarm.py``).

All of it is computed by the host from the releases it already receives: no new message, nothing sent.
The scale reference frozen after the warm-up (:class:`~fl_split.privacy.bounds.ScaleMonitor`,
``frozen``) catches the ramp within the epoch's batches. A violation raises
:class:`PoisoningDetected` (a :class:`~fl_split.errors.ReleaseOutOfRange`), so the host refuses the
evaluation, or the training round, before anything changes (no model, optimizer, ledger or draw
counter moves; nothing is released) and the run answers as ``--on-guest-failure`` says: ``stop``
names the guest and the check in one line, ``pad`` zero-fills that guest from then on. The statistics
of both checks are the host's in-memory state, not exported with it (a restored host starts them
afresh). What stays undetectable is written in ``docs/threat-model.md``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable

import torch

from fl_split.errors import ReleaseOutOfRange

log = logging.getLogger("fl_split.party")

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
#: label agreement: judged only when the test side predicts an honest correlation of at least this
LABEL_JUDGE = 0.7
#: label agreement: the training side's correlation with the test side below which the host raises the alarm
LABEL_RHO_MIN = 0.3
#: label agreement: judged only where the honest correlation predicted exceeds the refusal threshold by this much
LABEL_MARGIN = 0.3
#: label agreement: a correlation within this many null standard deviations of 0 is a permutation's (refused)
LABEL_Z = 3.0
#: label agreement: classification tasks with more classes than this are not judged (one-hot too wide)
LABEL_MAX_CLASSES = 64
#: loss-jump alarm: the host's per-batch training losses it keeps (the most recent)
LOSS_HISTORY = 32
#: loss-jump alarm: losses needed before a batch is judged (the guard's :data:`RECENT`)
LOSS_WARMUP = RECENT
#: a batch's loss above ``median + LOSS_K·MAD`` of the history and above ``LOSS_FACTOR × median`` is a candidate jump
LOSS_K = 10.0
LOSS_FACTOR = 3.0
#: the blamed guest's zero-fill must undo at least this share of the jump ``loss − median``
LOSS_BLAME = 0.25
#: the alarm: the same guest blamed on LOSS_REPEAT of the last LOSS_WINDOW judged batches
LOSS_REPEAT = 2
LOSS_WINDOW = 3


def _same(a: tuple | None, b: tuple | None) -> bool:
    """The same public mechanisms (by identity: a constant schedule gives one object; the regime keeps
    references, so an id is never reused while it is compared)."""
    return a is b or (a is not None and b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b)))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


def _spread_se(mu: torch.Tensor, var: torch.Tensor, n: int) -> float:
    """Spread of the per-element means across elements, in standard errors of one mean."""
    se, spread = math.sqrt(float(var.mean()) / n), float(mu.std())
    return spread / se if se > 0 else (math.inf if spread > 0 else 0.0)


def label_matrix(task: str, num_classes: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """The host's labels as the ``(n, K)`` matrix the label agreement correlates with a guest's releases:
    one-hot classes (multiclass / next-item, up to :data:`LABEL_MAX_CLASSES`), the 0/1 class or the
    standardised target as one column (binary, regression); None: the task is not judged."""
    k = int(num_classes)

    def encode(y: torch.Tensor) -> torch.Tensor | None:
        if task in ("binary", "regression"):
            return y.reshape(-1, 1).double()
        if k > LABEL_MAX_CLASSES or y.numel() == 0 or int(y.min()) < 0 or int(y.max()) >= k:
            return None
        return torch.nn.functional.one_hot(y.reshape(-1).long(), k).double()

    return encode


class _Labelled:
    """One batch's releases and labels for the label agreement, its moments computed when first asked for (only
    the batches a check compares are: most training batches leave the window unread)."""

    __slots__ = ("x", "y", "encode", "_value")

    def __init__(self, x: torch.Tensor, y: torch.Tensor, encode: Callable) -> None:
        self.x, self.y, self.encode, self._value = x, y, encode, False

    def value(self) -> tuple | None:
        """``(Xᵀ Y, ‖X‖², ‖Y‖², n, X, Y)`` of the batch's releases ``X`` and encoded labels ``Y``, both centred
        within the batch (a permutation keeps the batch's means, so only the within-batch covariance can tell,
        and it has expectation 0 under one); None where the labels are not judged."""
        if self._value is False:
            z = self.encode(self.y)
            x = self.x
            if z is None or len(z) != len(x) or len(x) < 2:
                self._value = None
            else:
                xc, zc = x - x.mean(0), z.to(x.device).double()
                zc = zc - zc.mean(0)
                self._value = (xc.T @ zc, float((xc * xc).sum()), float((zc * zc).sum()), int(x.shape[0]), xc, zc)
            self.x = self.y = None
        return self._value


def _cross(moments: list[tuple]) -> tuple[torch.Tensor, float, int] | None:
    """The within-batch cross-covariance ``C = Σ_b Σ_i (x − x̄_b)(y − ȳ_b)ᵀ / n`` of releases and labels from
    per-batch moments, its expected energy were each batch's records randomly permuted,
    ``E‖C‖² = Σ_b ‖x − x̄_b‖² ‖y − ȳ_b‖² / (n_b − 1) / n²`` (exact for a permutation of the batch), and ``n``."""
    lab = [m[4].value() if m[4] is not None else None for m in moments]
    if not lab or any(v is None for v in lab):
        return None
    n = sum(v[3] for v in lab)
    c = sum(v[0] for v in lab) / n
    null = sum(v[1] * v[2] / (v[3] - 1) for v in lab) / n ** 2
    return c, float(null), n


def label_agreement(train: list[tuple], test: list[tuple]) -> dict[str, float]:
    """The label agreement of one guest (module docstring, "Label agreement"): ``label_rho``, the correlation
    (cosine) of the within-batch cross-covariance with the host's labels (:func:`_cross`) of its recent
    training releases and of its test releases; ``label_snr``, ``‖C_test‖²`` over its chance level;
    ``label_expected``, the correlation an honest guest would show, ``S / √((S + N_train)(S + N_test))`` with
    ``S = ‖C_test‖² − N_test`` and ``N`` the chance levels (what a permutation of each batch would give);
    ``label_null_sd``, the standard deviation of ``label_rho`` were each training batch's records permuted
    (exact for the projection on the test direction ``D``: ``Σ_b ‖X_b D Y_bᵀ‖²_F / (n_b − 1)``, the variance of
    a permuted bilinear form of centred rows), taken over the chance norm ``√N_train``; ``label_threshold``,
    the correlation below which the host refuses, ``max(LABEL_RHO_MIN, LABEL_Z · label_null_sd)``; and
    ``label_judged``: whether ``label_expected`` is at least :data:`LABEL_JUDGE` and at least the threshold
    plus :data:`LABEL_MARGIN` (else nothing is refused, whatever ``label_rho``)."""
    nan = {"label_rho": math.nan, "label_snr": math.nan, "label_expected": math.nan, "label_null_sd": math.nan,
           "label_threshold": math.nan, "label_judged": False}
    a, b = _cross(train), _cross(test)
    if a is None or b is None or a[0].shape != b[0].shape:
        return nan
    (c_tr, null_tr, n_tr), (c_te, null_te, _) = a, b
    energy = float((c_te * c_te).sum())
    signal = energy - null_te
    out = dict(nan, label_snr=_ratio(energy, null_te))
    norm_tr, norm_te = float(torch.linalg.vector_norm(c_tr)), math.sqrt(energy)
    if signal <= 0 or norm_tr <= 0:
        return out
    out["label_expected"] = signal / math.sqrt((signal + null_tr) * (signal + null_te))
    d = c_te / norm_te
    batches = [m[4].value() for m in train]
    var = sum(float(((v[4] @ d) @ v[5].T).square().sum()) / (v[3] - 1) for v in batches) / n_tr ** 2
    # over the chance norm √N_train, not the observed one: both are what a permutation leaves unchanged, so
    # whether the check is judged cannot depend on whether the guest permutes
    out["label_null_sd"] = math.sqrt(var / null_tr) if null_tr > 0 else math.inf
    out["label_threshold"] = max(LABEL_RHO_MIN, LABEL_Z * out["label_null_sd"])
    out["label_rho"] = float((c_tr * c_te).sum()) / (norm_tr * norm_te)
    out["label_judged"] = out["label_expected"] >= max(LABEL_JUDGE, out["label_threshold"] + LABEL_MARGIN)
    return out


class PoisoningDetected(ReleaseOutOfRange):
    """A guest's training releases disagree with its own test releases (:class:`TrainTestGuard`), or
    the host's training loss jumped and zero-filling that guest undoes it (:class:`LossJumpAlarm`):
    the host refuses, naming the guest and the check."""


class TrainTestGuard:
    """Per-guest training-release statistics kept by the host, compared with each epoch's test releases."""

    def __init__(self, receiver: str = "host",
                 encode: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        self.receiver = receiver
        #: the host's labels as an ``(n, K)`` matrix for the label agreement (:func:`label_matrix`); None: not judged
        self.encode = encode
        #: guest → last RECENT training batches as (sum over rows, sum of squares, sum of row norms, rows,
        #: label moments or None: (Σ x yᵀ, Σ y, Σ y²))
        self._recent: dict[str, deque] = {}
        #: guest → (test releases, their batch name, noisy, their labels) kept for the next training round (``defer``)
        self._pending: dict[str, tuple[list[torch.Tensor], str, bool, list | None]] = {}

    def _moments(self, t: torch.Tensor, y: torch.Tensor | None = None) -> tuple:
        x = t.detach().reshape(t.shape[0], -1).double()
        labelled = _Labelled(x, y.detach(), self.encode) if y is not None and self.encode is not None else None
        return x.sum(0), (x * x).sum(0), float(torch.linalg.vector_norm(x, dim=1).sum()), int(x.shape[0]), labelled

    def record_train(self, guest: str, t: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """Keep the moments of one training release of ``guest`` (``y``: the host's labels of its records)."""
        if t.numel():
            self._recent.setdefault(guest, deque(maxlen=RECENT)).append(self._moments(t, y))

    def check_test(self, guest: str, tensors: list[torch.Tensor], batch: str, round_: int | None,
                   noisy: bool = False, defer: bool = False, labels: list[torch.Tensor] | None = None) -> None:
        """Raise :class:`PoisoningDetected` if ``guest``'s recent training releases disagree with
        its test releases ``tensors`` (one epoch's); nothing recorded either way. ``noisy``: the
        guest's mechanism has a public range (a defence). ``defer``: the recent training releases
        came from an older model (a long relay round): keep ``tensors`` for :meth:`check_deferred`.
        ``labels``: the host's labels of the test records (the label agreement)."""
        if defer:
            self._pending[guest] = ([t.detach() for t in tensors], batch, noisy,
                                    None if labels is None else [y.detach() for y in labels])
            return
        why = self.violation(guest, tensors, noisy, labels)
        if why is not None:
            raise PoisoningDetected(guest, self.receiver, "activations", batch, round_, why)

    def check_deferred(self, guest: str, train: list[torch.Tensor], batch: str, round_: int | None,
                       labels: list[torch.Tensor] | None = None) -> None:
        """The deferred comparison: ``guest``'s training releases ``train`` (the first round after a
        deferred evaluation, released by the model that produced the kept test releases; ``labels``: the
        host's labels of their records) against those test releases; raise :class:`PoisoningDetected`
        before the host uses the round."""
        pending = self._pending.pop(guest, None)
        if pending is None:
            return
        test, test_batch, noisy, test_labels = pending
        fresh = TrainTestGuard(self.receiver, self.encode)
        ys = list(labels)[-RECENT:] if labels is not None else [None] * len(train[-RECENT:])
        for t, y in zip(train[-RECENT:], ys):
            fresh.record_train(guest, t, y)
        why = fresh.violation(guest, test, noisy, test_labels)
        if why is not None:
            raise PoisoningDetected(guest, self.receiver, "activations", batch, round_,
                                    f"{why}; compared with the test releases of {test_batch}, from the same model")

    def statistics(self, guest: str, tensors: list[torch.Tensor],
                   labels: list[torch.Tensor] | None = None) -> dict[str, float] | None:
        """``{"rho", "norm_ratio", "sd_ratio", "spread_se"}`` of ``guest``'s recent training releases against
        ``tensors``, and with ``labels`` (the test records' labels) the label agreement's ``{"label_rho",
        "label_expected", "label_snr"}`` (nan where not judged); None where there is nothing to compare."""
        recent = self._recent.get(guest)
        keep = [i for i, t in enumerate(tensors) if t.numel()]
        tensors = [tensors[i] for i in keep]
        if not recent or len(recent) < RECENT or not tensors:
            return None
        ys = [labels[i] for i in keep] if labels is not None else [None] * len(tensors)
        test_moments = [self._moments(t, y) for t, y in zip(tensors, ys)]
        tr = [sum(m[i] for m in recent) for i in range(4)]
        te = [sum(m[i] for m in test_moments) for i in range(4)]
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
        out.update(label_agreement(list(recent), test_moments))
        return out

    def violation(self, guest: str, tensors: list[torch.Tensor], noisy: bool = False,
                  labels: list[torch.Tensor] | None = None) -> str | None:
        s = self.statistics(guest, tensors, labels)
        if s is None:
            return None
        rows = sum(m[3] for m in self._recent[guest])
        if not math.isnan(s["rho"]) and s["rho"] < RHO_MIN:
            return (f"poisoning check (train vs test): the per-element mean of its last {rows} training records "
                    f"correlates {s['rho']:.3f} with that of its test releases (allowed: ≥ {RHO_MIN:g}; "
                    f"an honest guest releases both from the same bottom model)")
        if s["label_judged"] and s["label_rho"] < s["label_threshold"]:
            return (f"label check (train vs test): the covariance of its last {rows} training releases with the "
                    f"host's labels correlates {s['label_rho']:.3f} with that of its test releases (allowed: ≥ "
                    f"{LABEL_RHO_MIN:g}; judged because its test releases carry the labels {s['label_snr']:.3g}x "
                    f"above chance, so an honest guest's would correlate about {s['label_expected']:.2f}: its "
                    f"training releases no longer belong to their records)")
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


class LossJumpAlarm:
    """The host's training-loss jump alarm, attributed to one guest (issue 25; see the module docstring).

    The host keeps its last :data:`LOSS_HISTORY` per-batch training losses, each measured before it trains on
    the batch (:meth:`check`, then :meth:`record` once the round is accepted). After :data:`LOSS_WARMUP` of
    them a batch whose loss exceeds the *threshold* ``max(median + LOSS_K·MAD, LOSS_FACTOR × median)`` of the
    history is a candidate jump; for a candidate only, ``without(i)`` gives the batch's loss with each guest's
    release zero-filled (what ``--on-guest-failure pad`` would do). The guest whose zero-fill lowers the loss
    most (and alone) is *blamed* for the batch if that undoes at least :data:`LOSS_BLAME` of the jump
    ``loss − median``. The alarm is raised on a batch for which the same guest is blamed on
    :data:`LOSS_REPEAT` of the last :data:`LOSS_WINDOW` judged batches; a blamed batch alone is logged (info)."""

    def __init__(self, receiver: str = "host", warmup: int = LOSS_WARMUP) -> None:
        self.receiver = receiver
        self.warmup = max(int(warmup), 1)
        self._history: deque = deque(maxlen=LOSS_HISTORY)
        #: who was blamed for each of the last LOSS_WINDOW judged batches (None: nobody)
        self._blamed: deque = deque(maxlen=LOSS_WINDOW)
        self._staged: tuple | None = None  # what check() judged, for record()
        self._regime: tuple | None = None  # the guests' public mechanisms of the history's batches
        self._last_round = 0  # batches in the last accepted round (a long one: the next starts a new history)
        #: batches judged, candidate jumps, batches blamed on a guest, and the largest statistic
        #: ``loss / threshold`` seen (above 1: a candidate) with its batch
        self.judged = 0
        self.candidates = 0
        self.blamed = 0
        self.largest: tuple[float, str] = (0.0, "")
        #: experiments: a list to which every judged batch appends its numbers (None: nothing kept), and the
        #: statistic above which a batch's zero-fill losses are computed for it too (None: candidates only)
        self.trace: list[dict] | None = None
        self.explore: float | None = None

    def reset(self) -> None:
        """Forget the history (the set of guests changed: the loss is another quantity from now on)."""
        self._history.clear()
        self._blamed.clear()
        self._staged = None
        self._regime = None
        self._last_round = 0

    @staticmethod
    def threshold(history) -> tuple[float, float, float]:
        """``(median, MAD, threshold)`` of the losses ``history``."""
        med = float(statistics.median(history))
        mad = float(statistics.median([abs(x - med) for x in history]))
        return med, mad, max(med + LOSS_K * mad, LOSS_FACTOR * med)

    @staticmethod
    def blame(loss: float, med: float, without: dict[str, float]) -> str | None:
        """The guest to blame for a candidate jump ``loss`` over the median ``med``, or None: the one whose
        zero-fill (``without``) gives the lowest loss, undoing at least LOSS_BLAME of the jump, with every
        other guest's zero-fill at least LOSS_BLAME of the jump above it."""
        if not without:
            return None
        ranked = sorted(without.items(), key=lambda kv: kv[1])
        guest, best = ranked[0]
        margin = LOSS_BLAME * (loss - med)
        if not math.isfinite(best) or loss - best < margin or loss <= best:
            return None  # dropping it does not undo enough of the jump
        if len(ranked) > 1 and ranked[1][1] - best < margin:
            return None  # another guest's zero-fill does nearly as well: not one guest to blame
        return guest

    def check(self, names: list[str], losses: list[float], without, round_: int | None,
              regimes: list[tuple] | None = None) -> None:
        """Judge the batches ``names`` of one round (in training order) with losses ``losses``; ``without(i)``:
        ``{guest: loss of batch i with that guest's release zero-filled}``; ``regimes[i]``: the guests' public
        mechanisms of batch i (the losses of other mechanisms are not compared). Raise
        :class:`PoisoningDetected` naming the guest; nothing is recorded until :meth:`record`."""
        # after a long round (more than RECENT batches) every guest applies that many updates before this
        # round's releases, so the earlier losses are of other models: the history starts with this round
        carry = self._last_round <= RECENT
        hist = deque(self._history if carry else (), maxlen=LOSS_HISTORY)
        blamed = deque(self._blamed if carry else (), maxlen=LOSS_WINDOW)
        regime = self._regime
        for i, (name, loss) in enumerate(zip(names, losses)):
            if regimes is not None and not _same(regimes[i], regime):
                # another public mechanism (a schedule's next step): its losses start a new history
                hist.clear()
                blamed.clear()
                regime = regimes[i]
            if len(hist) >= self.warmup and math.isfinite(loss):
                med, mad, thr = self.threshold(hist)
                stat = _ratio(loss, thr) if loss > 0 else 0.0
                self.judged += 1
                if stat > self.largest[0]:
                    self.largest = (stat, name)
                row = {"batch": name, "round": round_, "loss": loss, "median": med, "mad": mad, "threshold": thr,
                       "stat": stat}
                guest = None
                if loss > thr or (self.trace is not None and self.explore is not None and stat > self.explore):
                    alt = without(i)
                    row["without"] = dict(alt)
                    if loss > thr:
                        self.candidates += 1
                        guest = self.blame(loss, med, alt)
                if self.trace is not None:
                    self.trace.append(row)
                if guest is None:
                    blamed.append(None)
                else:
                    self.blamed += 1
                    before = [b for b in blamed if b is not None and b[0] == guest]
                    blamed.append((guest, name, loss, alt[guest], med))
                    if len(before) + 1 >= LOSS_REPEAT:
                        raise PoisoningDetected(guest, self.receiver, "activations", name, round_,
                                                self._reason(guest, loss, med, thr, alt, len(before) + 1,
                                                             before[-1] if before else None))
                    log.info("%s: the training loss of %s jumped to %.4g (recent median %.4g); zero-filling "
                                "%s's release gives %.4g (the alarm needs %d of %d batches)", self.receiver,
                                name, loss, med, guest, alt[guest], LOSS_REPEAT, LOSS_WINDOW)
            if math.isfinite(loss):
                hist.append(loss)
        self._staged = (hist, blamed, regime)

    @staticmethod
    def _reason(guest: str, loss: float, med: float, thr: float, alt: dict[str, float], times: int,
                before: tuple | None) -> str:
        others = "".join(f", {g} zero-filled: {v:.4g}" for g, v in sorted(alt.items()) if g != guest)
        prev = (f" (also {before[1]}: {before[2]:.4g}, zero-filled {before[3]:.4g}, median {before[4]:.4g})"
                if before is not None else "")
        return (f"loss-jump check: the host's training loss on this batch is {loss:.4g}, above its recent median "
                f"{med:.4g} (threshold {thr:.4g} = max(median + {LOSS_K:g}·MAD, {LOSS_FACTOR:g}× median)); with "
                f"{guest}'s release zero-filled it is {alt[guest]:.4g}{others}; the jump was blamed on {guest} in "
                f"{times} of the last {LOSS_WINDOW} batches{prev}")

    def record(self, losses: list[float]) -> None:
        """The accepted round (the one :meth:`check` judged last) joins the history."""
        if self._staged is not None:
            self._history, self._blamed, self._regime = self._staged
        else:
            if self._last_round > RECENT:
                self._history.clear()
                self._blamed.clear()
            self._history.extend(x for x in losses if math.isfinite(x))
        self._staged = None
        self._last_round = len(losses)


__all__ = ["DEGENERATE", "LABEL_JUDGE", "LABEL_MAX_CLASSES", "LABEL_RHO_MIN", "LABEL_MARGIN", "LABEL_Z", "LOSS_BLAME",
           "LOSS_FACTOR", "LOSS_HISTORY", "LOSS_K", "LOSS_REPEAT", "LOSS_WARMUP", "LOSS_WINDOW", "LossJumpAlarm",
           "NORM_RATIO", "PoisoningDetected", "RECENT", "RHO_MIN", "SPREAD_SE", "TrainTestGuard", "label_agreement",
           "label_matrix"]
