"""An empirical privacy audit: a lower bound on each mechanism's epsilon, beside the ledger's claim.

The audit plays the adversary of the DP definition itself (``docs/accounting.md``, "Empirical
audit"). It fixes a pair of neighbouring records (replace-one, privacy principle 3), *releases one
of them* through the real mechanism ``k`` times, and tries to tell which one it was. Any test that
does so with false-positive rate ``FPR`` and false-negative rate ``FNR`` bounds the epsilon of the
``k`` releases from below (Kairouz, Oh & Viswanath 2015; Jagielski et al. 2020; Nasr et al. 2021):

    ε ≥ max( log((1 − δ − FNR)/FPR), log((1 − δ − FPR)/FNR) ).

Issue 37 bounds the ratio behind it once, not each rate: trial ``i`` of each record form a pair,
and given the discordant pairs the count favouring one record is exactly binomial (McNemar's
conditional test), whose Clopper–Pearson bound on the odds ratio gives ε
(:func:`paired_lower_bound`); issue 26's two separate bounds (``FPR`` and ``FNR`` each at
``1 − α/2``) remain for the regions where one record's rate is near 1. Either holds with confidence
``1 − α``; ``α`` is shared among an audit's rows (Bonferroni, :func:`run_audit`). A lower bound above
the ledger's epsilon for the same releases means the claim is wrong: a bug, reported as a violation.

**Analysis apart from state** (design principle 5): :func:`clopper_pearson`,
:func:`epsilon_lower_bound`, :func:`paired_lower_bound`, :func:`choose_test` are pure functions of
counts and statistics; the runner (:func:`audit_mechanism`, :func:`audit_dpsgd`) produces those from real releases.

**The real code path.** Mechanisms come from :mod:`fl_split.privacy.factory`
(``forward_mechanism`` / ``backward_mechanism`` of a :class:`~fl_split.config.RunConfig`, iteration by
iteration for the geometric schedule), draws from a :class:`~fl_split.seeding.PartySecret`'s
generators, costs from ``Mechanism.cost()`` composed by a :class:`~fl_split.privacy.ledger.Ledger`
with every accountant. The guest's bottom model is *bypassed*: the canary is a chosen cut-layer
input, the worst case over all bottoms, since a mechanism's claim is over every input of its range.
DP-SGD is audited through :class:`~fl_split.local_update.DpSgdUpdate` (Opacus) with a gradient
canary: one record whose clipped gradient is ``+C·e₁`` or ``−C·e₁``, the others with zero gradient.

**The test.** The likelihood-ratio test is the most powerful (Neyman–Pearson); its statistic is the
log-likelihood ratio ``log p₁(y)/p₀(y)`` of the release, summed over the ``k`` releases (they are
independent given the record). It is exact for Laplace (discrete, on its grid), Gaussian,
randomized response and R3eLU (activation and discrete-Laplace parts, either allocation); DP-SGD
uses the projection of the step on ``e₁`` (the Gaussian shift's sufficient statistic). The
threshold, side and bound are chosen on a calibration quarter of the trials (:func:`choose_test`)
and the errors are counted on the rest, so the selection does not bias the bound.

**A plug-in is not trusted** (privacy principle 11; ``docs/accounting.md``, "A plug-in is audited
independently"). For a plug-in defence the audit picks its own canaries from the public
configuration (:func:`public_canary_pair`: opposite corners of the input box the cut activation and
the clip bound declare) and its own statistic (:func:`select_statistic`: the best on the calibration
quarter of a few fixed statistics that read nothing from the plug-in). A plug-in's own ``canary_pair`` /
``log_likelihood_ratio`` run as a second test, each test at ``α/2``; the row is flagged if either
test's bound exceeds the claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from fl_split.privacy.base import Mechanism, PrivacyCost
from fl_split.privacy.plugin import is_plugin_mechanism

#: accountants whose epsilon is listed beside the empirical bound
CLAIM_ACCOUNTANTS = ("basic", "pld", "rdp")


# -- analysis (pure functions) ----------------------------------------------------------------
def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """Two-sided exact (Clopper–Pearson) ``1 − alpha`` interval of a binomial rate from ``k`` of ``n``;
    each end is also a one-sided ``1 − alpha/2`` bound."""
    from scipy.stats import beta

    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"clopper_pearson: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def _eps_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """``max(log((1−δ−FNR)/FPR), log((1−δ−FPR)/FNR), 0)`` (0 where no side is informative)."""
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        num = 1.0 - delta - a
        if num > 0 and b > 0:
            best = max(best, math.log(num / b))
        elif num > 0 and b == 0:
            best = math.inf
    return best


def epsilon_lower_bound(fp: int, n0: int, fn: int, n1: int, delta: float, alpha: float) -> dict[str, Any]:
    """Empirical epsilon from a test's errors: ``fp`` false positives among ``n0`` trials of record 0,
    ``fn`` false negatives among ``n1`` of record 1.

    ``lower``: the bound at confidence ``1 − alpha`` (Clopper–Pearson *upper* bounds on both rates);
    ``point``: from the observed rates; ``upper``: from the CP *lower* bounds (the most this test's
    data are consistent with), so ``[lower, upper]`` is the interval reported beside the claim.
    """
    fpr_ci, fnr_ci = clopper_pearson(fp, n0, alpha), clopper_pearson(fn, n1, alpha)
    return {"lower": _eps_from_rates(fpr_ci[1], fnr_ci[1], delta),
            "point": _eps_from_rates(fp / n0, fn / n1, delta),
            "upper": _eps_from_rates(fpr_ci[0], fnr_ci[0], delta),
            "fpr": fp / n0, "fnr": fn / n1, "fpr_ci": list(fpr_ci), "fnr_ci": list(fnr_ci),
            "false_positives": int(fp), "false_negatives": int(fn), "n0": int(n0), "n1": int(n1)}


def _eps_from_rates_vec(fpr: np.ndarray, fnr: np.ndarray, delta: float) -> np.ndarray:
    """:func:`_eps_from_rates` for arrays of rates (one per threshold)."""
    best = np.zeros(np.broadcast(fpr, fnr).shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        for a, b in ((fnr, fpr), (fpr, fnr)):
            num = 1.0 - delta - a
            val = np.where(b > 0, np.log(np.where(num > 0, num, 1.0) / np.where(b > 0, b, 1.0)), np.inf)
            best = np.maximum(best, np.where(num > 0, val, 0.0))
    return best


def lower_bounds(fp: np.ndarray, n0: int, fn: np.ndarray, n1: int, delta: float, alpha: float) -> np.ndarray:
    """The ``lower`` of :func:`epsilon_lower_bound` for many tests at once (arrays of error counts)."""
    from scipy.stats import beta

    fp, fn = np.asarray(fp, dtype=np.float64), np.asarray(fn, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        hi0 = np.where(fp >= n0, 1.0, beta.ppf(1 - alpha / 2, fp + 1, np.maximum(n0 - fp, 1)))
        hi1 = np.where(fn >= n1, 1.0, beta.ppf(1 - alpha / 2, fn + 1, np.maximum(n1 - fn, 1)))
    return _eps_from_rates_vec(hi0, hi1, delta)


def _errors(s0: np.ndarray, s1: np.ndarray, taus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Errors of the tests "guess 1 iff statistic ≥ τ" for every τ: (false positives, false negatives)."""
    s0, s1 = np.sort(s0), np.sort(s1)
    fp = len(s0) - np.searchsorted(s0, taus, side="left")
    fn = np.searchsorted(s1, taus, side="left")
    return fp, fn


#: the share of an audit's trials that chooses the test (threshold and side); the rest count its errors
CALIBRATION_SHARE = 0.25
#: the share of α the paired test spends on its two side bounds (``p_a`` above, ``p_b`` below; half each)
SIDE_ALPHA_SHARE = 0.1


def _cp_lower(k, n, a):
    """One-sided ``1 − a`` Clopper–Pearson lower bound of a rate (arrays; counts may be fractional)."""
    from scipy.stats import beta

    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = beta.ppf(a, np.maximum(k, 1e-300), np.maximum(n - k + 1, 1e-300))
    return np.where(k <= 0, 0.0, np.nan_to_num(out, nan=0.0))


def _cp_upper(k, n, a):
    """One-sided ``1 − a`` Clopper–Pearson upper bound of a rate (arrays)."""
    return 1.0 - _cp_lower(np.asarray(n, dtype=np.float64) - np.asarray(k, dtype=np.float64), n, a)


def paired_lower_bound(x, m, ha, hb, n, delta: float, alpha: float) -> np.ndarray:
    """The paired test's ε lower bound at confidence ``1 − alpha`` (arrays of counts, broadcast).

    ``n`` pairs (trial ``i`` of record ``a`` with trial ``i`` of record ``b``: independent pairs); a
    region ``S`` of the release (one side of a threshold) is hit ``ha`` times by ``a``'s trials and
    ``hb`` times by ``b``'s; ``m`` pairs are discordant (one member in ``S``), ``x`` of them ``a``'s.
    Given ``m``, ``x ~ Bin(m, θ)`` exactly, ``θ = p_a(1−p_b)/(p_a(1−p_b) + p_b(1−p_a))`` (McNemar's
    conditional test; the exact binomial), so the odds ratio ``OR = θ/(1−θ)`` has a Clopper–Pearson
    lower bound ``OR_lo`` that does not pay for ``p_a`` and ``p_b`` separately. (ε, δ)-DP gives
    ``p_a ≤ e^ε p_b + δ``, hence ``OR ≤ (e^ε + δ/p_b)(1−p_b)/(1−p_a)`` and

        ε ≥ log( OR_lo · (1 − p_a,hi)/(1 − p_b,lo) − δ/p_b,lo ),

    with ``OR_lo`` at ``1 − (1−s)α`` and the side bounds ``p_a,hi``, ``p_b,lo`` at ``1 − sα/2`` each
    (``s`` = :data:`SIDE_ALPHA_SHARE`): all three hold with probability ``≥ 1 − α`` (union bound).
    The bound is 0 where it says nothing (``x = 0``, ``p_b,lo = 0``)."""
    x, m, ha, hb, n = (np.asarray(v, dtype=np.float64) for v in (x, m, ha, hb, n))
    a_main, a_side = (1 - SIDE_ALPHA_SHARE) * alpha, SIDE_ALPHA_SHARE * alpha / 2
    th = _cp_lower(x, m, a_main)
    pa_hi, pb_lo = _cp_upper(ha, n, a_side), _cp_lower(hb, n, a_side)
    with np.errstate(divide="ignore", invalid="ignore"):
        odds = np.where(th >= 1, np.inf, th / np.where(th >= 1, 1.0, 1 - th))
        e = odds * (1 - pa_hi) / np.where(pb_lo < 1, 1 - pb_lo, 1.0) - delta / np.where(pb_lo > 0, pb_lo, 1.0)
        eps = np.where((pb_lo > 0) & (e > 1), np.log(np.where(e > 0, e, 1.0)), 0.0)
    return np.where(np.isnan(eps), 0.0, eps)


def _paired_counts(s0: np.ndarray, s1: np.ndarray, taus: np.ndarray) -> dict[str, tuple[np.ndarray, ...]]:
    """``(x, m, ha, hb)`` of the paired test for every threshold, on both sides: ``"upper"`` is the
    region ``statistic ≥ τ`` with ``a`` = record 1 (guess 1 there), ``"lower"`` the region
    ``statistic < τ`` with ``a`` = record 0. Pairs are ``(s0[i], s1[i])``."""
    lo, hi = np.sort(np.minimum(s0, s1)), np.sort(np.maximum(s0, s1))
    a0, a1 = np.sort(s0), np.sort(s1)
    n = len(s0)
    ge0 = n - np.searchsorted(a0, taus, side="left")
    ge1 = n - np.searchsorted(a1, taus, side="left")
    both_ge = n - np.searchsorted(lo, taus, side="left")  # min(s0, s1) ≥ τ
    both_lt = np.searchsorted(hi, taus, side="left")  # max(s0, s1) < τ
    lt0, lt1 = n - ge0, n - ge1
    up = (ge1 - both_ge, ge1 + ge0 - 2 * both_ge, ge1, ge0)
    down = (lt0 - both_lt, lt0 + lt1 - 2 * both_lt, lt0, lt1)
    return {"upper": up, "lower": down}


def _candidates(s0: np.ndarray, s1: np.ndarray, max_candidates: int = 4096) -> np.ndarray:
    """Threshold candidates: the distinct values (at most ``max_candidates`` quantiles of them, the 64
    largest and smallest kept exactly: the tails matter most), plus ``+∞``."""
    all_vals = np.unique(np.concatenate([s0, s1]))
    vals = all_vals
    if len(vals) > max_candidates:
        vals = np.unique(np.quantile(vals, np.linspace(0, 1, max_candidates)))
    return np.unique(np.concatenate([vals, all_vals[:64], all_vals[-64:], [np.inf]]))


def choose_test(s0: np.ndarray, s1: np.ndarray, delta: float, alpha: float, n_eval: int) -> tuple[float, str]:
    """The threshold ``τ`` and side (``"upper"``: the region statistic ≥ τ, scored for record 1;
    ``"lower"``: the region below ``τ``, scored for record 0; ``"unpaired"``: issue 26's two separate
    Clopper–Pearson bounds, :func:`lower_bounds`) chosen on these (calibration) statistics for a count
    on ``n_eval`` other pairs.

    Each candidate's counts are scaled to ``n_eff = c·n_eval/(c + n_eval)`` pairs (``c`` the pairs
    here) and put through :func:`paired_lower_bound` (or :func:`lower_bounds`); the largest wins. The
    unpaired bound wins only where the record's region is nearly certain (``p_a → 1``, which the
    paired bound's ``1 − p_a,hi`` factor cannot use): perfectly separated statistics, claims near the
    sampling limit. ``n_eff`` charges a region
    for the noise of its calibration estimate as well as of its evaluation (the variance of a
    log-ratio estimated twice is ∝ 1/c + 1/n_eval): scaling to ``n_eval`` alone prefers far tails
    whose calibration counts were lucky, and those regress on the evaluation (winner's curse;
    measured in docs/accounting.md, "Detection power"). Only these statistics are read, so the
    choice does not bias the bound counted on the other trials."""
    n = min(len(s0), len(s1))
    s0, s1 = np.asarray(s0[:n], dtype=np.float64), np.asarray(s1[:n], dtype=np.float64)
    taus = _candidates(s0, s1)
    n_eff = n * n_eval / (n + n_eval)
    best = (-1.0, 0.0, "upper")
    for side, counts in _paired_counts(s0, s1, taus).items():
        scaled = [np.asarray(c, dtype=np.float64) * (n_eff / n) for c in counts]
        b = paired_lower_bound(*scaled, n_eff, delta, alpha)
        i = int(np.argmax(b))
        if b[i] > best[0]:
            best = (float(b[i]), float(taus[i]), side)
    fp, fn = _errors(s0, s1, taus)
    b = lower_bounds(fp * (n_eff / n), n_eff, fn * (n_eff / n), n_eff, delta, alpha)
    i = int(np.argmax(b))
    if b[i] > best[0]:
        best = (float(b[i]), float(taus[i]), "unpaired")
    return best[1], best[2]


def _projected(s0: np.ndarray, s1: np.ndarray, tau: float, side: str, n_eff: float, delta: float,
               alpha: float) -> float:
    """The bound of the test ``(tau, side)`` on these statistics with their counts scaled to ``n_eff``."""
    k = n_eff / min(len(s0), len(s1))
    if side == "unpaired":
        fp, fn = _errors(np.asarray(s0), np.asarray(s1), np.array([tau]))
        return float(lower_bounds(fp * k, n_eff, fn * k, n_eff, delta, alpha)[0])
    x, m, ha, hb = (float(v[0]) * k for v in _paired_counts(np.asarray(s0), np.asarray(s1), np.array([tau]))[side])
    return float(paired_lower_bound(x, m, ha, hb, n_eff, delta, alpha))


def max_certifiable_epsilon(n: int, delta: float, alpha: float) -> float:
    """The largest ε lower bound :func:`paired_lower_bound` gives on any outcome of ``n`` pairs: no
    sampling audit of this size can certify more, whatever the mechanism.

    Searched over the outcomes that favour record ``a`` most (every discordant pair ``a``'s; the
    ``b`` hits all concordant, or all discordant), ``h_a`` and ``h_b`` on log grids. Why a limit
    exists at all: a region record ``b`` reaches with probability ``p`` goes unseen in ``n`` trials
    with probability ``(1−p)^n``, so no test bounds ``p_b`` away from 0 below ``~1/n`` while
    ``p_a ≤ 1``: any sampling audit stops near ``ln n``. The paired bound stops at about
    ``ln(n/(4·ln(1/((1−s)α))))`` (at ``h_a ≈ n/2``), the unpaired one (no error seen on either
    record) at ``ln((1−δ−u)/u)``, ``u = 1 − (α/2)^{1/n} ≈ ln(2/α)/n``: the larger is the limit
    (docs/accounting.md, "At the defaults, and where no sampling audit reaches")."""
    ha = np.unique(np.round(np.geomspace(1, n, 240)))
    best = 0.0
    for hb in np.unique(np.round(np.geomspace(1, n, 80))):
        a = ha[ha >= hb]
        if not len(a):
            continue
        for x, m in ((a - hb, a - hb), (a, a + hb)):  # b's hits concordant / discordant
            b = paired_lower_bound(x, m, a, hb, n, delta, alpha)
            best = max(best, float(np.max(b)))
    return max(best, float(lower_bounds(np.array([0.0]), n, np.array([0.0]), n, delta, alpha)[0]))


def calibration_size(n: int) -> int:
    """How many of ``n`` trials per record choose the test (:data:`CALIBRATION_SHARE`, at least 1)."""
    return max(1, int(round(CALIBRATION_SHARE * n)))


def audit_statistics(s0: np.ndarray, s1: np.ndarray, delta: float, alpha: float) -> dict[str, Any]:
    """Choose the test on the first :func:`calibration_size` trials of each record, count its errors
    on the rest, paired trial by trial: the paired bound (:func:`paired_lower_bound`) as ``lower``,
    beside :func:`epsilon_lower_bound`'s rates, point estimate and upper end for the same test, plus
    ``threshold``, ``side`` and the paired counts."""
    n = min(len(s0), len(s1))
    c = calibration_size(n)
    if n - c < 1:
        raise ValueError("audit_statistics: need at least 2 trials per record")
    s0, s1 = np.asarray(s0[:n], dtype=np.float64), np.asarray(s1[:n], dtype=np.float64)
    tau, side = choose_test(s0[:c], s1[:c], delta, alpha, n - c)
    e0, e1 = s0[c:], s1[c:]
    x, m, ha, hb = (int(v[0]) for v in _paired_counts(e0, e1, np.array([tau]))["upper" if side == "unpaired" else side])
    out = epsilon_lower_bound(int((e0 >= tau).sum()), len(e0), int((e1 < tau).sum()), len(e1), delta, alpha)
    if side != "unpaired":  # else the two separate bounds epsilon_lower_bound gave
        out["lower"] = float(paired_lower_bound(x, m, ha, hb, n - c, delta, alpha))
        out["upper"] = max(out["upper"], out["lower"])
    out.update(threshold=tau, side=side, pairs=n - c,
               test="two Clopper-Pearson bounds" if side == "unpaired" else "paired (McNemar, exact binomial)",
               discordant=m, discordant_favoured=x, hits_favoured=ha, hits_other=hb)
    return out


# -- canaries and likelihood ratios --------------------------------------------------------------
def _inner(mech: Mechanism) -> Mechanism:
    if isinstance(mech, MisAccounted):
        return mech.inner
    return mech if is_plugin_mechanism(mech) else getattr(mech, "inner", mech)


def _plugin_hook(mech: Mechanism, name: str):
    """A plug-in mechanism's own audit method (``canary_pair`` / ``log_likelihood_ratio``), through
    the audit's :class:`MisAccounted` wrapper; ``None`` for a built-in or a plug-in without it."""
    m = _inner(mech)
    fn = getattr(m, name, None)
    return fn if is_plugin_mechanism(m) and callable(fn) else None


def canary_pair(mech: Mechanism) -> tuple[torch.Tensor, torch.Tensor]:
    """Two neighbouring cut-layer inputs ``(x0, x1)``, each ``(1, width)``, at the extremes of the
    mechanism's public range (what maximises its privacy loss):

    * Laplace: every element at ``−bound`` vs ``+bound`` (L1 distance ``2·bound·d``, the sensitivity);
    * Gaussian forward: the two ``tanh`` extremes ``∓1·bound``; backward: ``∓bound·e₁`` (L2 ``2·bound``);
    * randomized response: every bit 0 vs every bit 1;
    * R3eLU forward: ``C`` on the ``K`` elements of smallest noise scale (the first ``K`` under
      ``uniform``) vs ``C`` on the ``K`` of largest scale (``−C`` elsewhere, clipped to 0): ``2K``
      elements differ by ``C`` and the activation probabilities swap between ``q`` and ``½``
      (Eq. 4) — the rising elements carry the loss, the output being cut at 0 below; backward:
      ``+C`` vs ``−C`` on the ``K`` elements of smallest noise scale (same magnitudes, so the same
      activation probabilities; the Laplace part sees ``2KC``).
    """
    hook = _plugin_hook(mech, "canary_pair")
    if hook is not None:  # a plug-in defence names its own worst-case pair (fl_split.privacy.plugin)
        x0, x1 = hook()
        return x0.reshape(1, -1).float(), x1.reshape(1, -1).float()
    m = _inner(mech)
    if is_plugin_mechanism(m):
        raise ValueError(f"audit: the plug-in defence {m.name!r} has no canary_pair() (two neighbouring inputs at "
                         "the extremes of its range); fl-split audit needs it (docs/plugins.md)")
    d = int(m.width)
    one = torch.ones(1, d, dtype=torch.float32)
    if m.name == "laplace":
        return -m.bound * one, m.bound * one
    if m.name == "gaussian":
        if m.direction == "forward":
            return -m.bound * one, m.bound * one
        e1 = torch.zeros(1, d)
        e1[0, 0] = m.bound
        return -e1, e1
    if m.name == "rr":
        return -one, one.clone()
    if m.name == "r3elu":
        k, c = m.k, m.c
        if m.direction == "forward":
            # the K elements with the smallest noise scales rise (the release's upper tail carries
            # the loss: the lower one is cut at 0), the K largest-scale ones fall
            order = torch.argsort(m.noise_scales().double(), stable=True)
            x1 = torch.full((1, d), -c)
            x1[0, order[:k]] = c
            x0 = torch.full((1, d), -c)
            x0[0, order[d - k:]] = c
            return x0, x1
        x1 = torch.zeros(1, d)
        x1[0, torch.argsort(m.noise_scales().double(), stable=True)[:k]] = c
        return -x1, x1
    raise ValueError(f"audit: no canary for mechanism {m.name!r}; allowed: laplace, gaussian, rr, r3elu")


def _dlap_logpmf(z: torch.Tensor, t) -> torch.Tensor:
    """``log P(Z = z)`` of ``DLap(t)``: ``log((1−r)/(1+r)) − |z|/t``, ``r = e^{−1/t}`` (float64)."""
    t = torch.as_tensor(t, dtype=torch.float64)
    r = torch.exp(-1.0 / t)
    return torch.log1p(-r) - torch.log1p(r) - z.abs() / t


def _r3elu_loglik(m, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``log P(release = y | input x)`` per element of R3eLU (Alg. 1/2 on its grid), ``(N, d)``."""
    from fl_split.privacy.r3elu import clip_k
    from fl_split.privacy.sampling import snap

    grid = m._active_grid()  # the uniform grid, or the one the importances U gave
    gamma, units = grid.on(x.device)
    t = grid.noise.t
    k = torch.round(y.double() / gamma)
    if m.direction == "forward":
        vhat = clip_k(x, m.c, m.k)
        p = m._probabilities64(vhat).double()
        n = snap(vhat, gamma, 0, units)
        tt = torch.as_tensor(t, dtype=torch.float64)
        r = torch.exp(-1.0 / tt)
        # out = 0: not activated, or activated with n + Z <= 0 (P(Z <= -n) = r^n/(1+r) for n >= 0)
        p_zero = (1 - p) + p * torch.exp(n * torch.log(r)) / (1 + r)
        pos = torch.log(p) + _dlap_logpmf(k - n, t)
        return torch.where(k > 0, pos, torch.log(p_zero).expand_as(pos))
    mag = clip_k(x.abs(), m.c, m.k)
    p = m._probabilities64(mag).double()
    n = snap(torch.sign(x) * mag, gamma, -units, units)
    a = torch.log(p) + _dlap_logpmf(k - n, t)
    b = torch.log1p(-p) + _dlap_logpmf(k, t)
    return torch.logaddexp(a, b)


def log_likelihood_ratio(mech: Mechanism, y: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """``log p₁(y)/p₀(y)`` of each release ``y`` (``(N, d)``) of ``x1`` against ``x0``: the
    Neyman–Pearson statistic. Computed from the mechanism's public parameters (R3eLU: its active
    grid, which under an importance allocation follows ``U``); returns ``(N,)`` float64."""
    from fl_split.privacy.sampling import snap

    y = y.reshape(y.shape[0], -1).double()
    m = _inner(mech)
    if is_plugin_mechanism(m):
        hook = _plugin_hook(mech, "log_likelihood_ratio")
        if hook is not None:
            return hook(y, x0, x1).reshape(-1).double()
        # no exact ratio: the release's projection on the canaries' difference (any statistic gives a
        # valid lower bound; this one is the sufficient statistic of an additive Gaussian shift)
        return (y * (x1 - x0).reshape(1, -1).double()).sum(dim=1)
    if m.name == "exhausted":  # the geometric schedule's constant release: the same law for both
        return torch.zeros(y.shape[0], dtype=torch.float64)
    if m.name == "laplace":
        n0 = snap(x0.clamp(-m.bound, m.bound), m.gamma, -m.units, m.units)
        n1 = snap(x1.clamp(-m.bound, m.bound), m.gamma, -m.units, m.units)
        k = torch.round(y / m.gamma)
        return (((k - n0).abs() - (k - n1).abs()) / m.t).sum(dim=1)
    if m.name == "gaussian":
        def signal(x):
            if m.direction == "forward":
                return x.clamp(-m.bound, m.bound).double()
            return (x * (m.bound / x.norm(dim=1, keepdim=True).clamp_min(m.bound))).double()
        s0, s1 = signal(x0), signal(x1)
        return (((y - s0) ** 2 - (y - s1) ** 2) / (2 * m.sigma ** 2)).sum(dim=1)
    if m.name == "rr":
        q = m.keep_probability
        b0, b1 = (x0 > 0).double(), (x1 > 0).double()
        lq, lnq = math.log(q), math.log1p(-q)
        ll = lambda b: torch.where(y == b, lq, lnq)  # noqa: E731
        return (ll(b1) - ll(b0)).sum(dim=1)
    if m.name == "r3elu":
        if not (hasattr(m, "_active_grid") and hasattr(m, "_probabilities64")):
            # R3eLU's internals changed: any statistic still gives a valid (weaker) bound; this one
            # is linear in the release along the canary's difference
            import warnings

            warnings.warn("audit: R3eLU has no _active_grid/_probabilities64; using a linear statistic "
                          "(a valid but weaker test) instead of the exact likelihood ratio", stacklevel=2)
            return (y * torch.sign(x1 - x0).double()).sum(dim=1)
        return (_r3elu_loglik(m, y, x1) - _r3elu_loglik(m, y, x0)).sum(dim=1)
    raise ValueError(f"audit: no likelihood ratio for mechanism {m.name!r}")


# -- the independent test of a plug-in (privacy principle 11) ---------------------------------------
#: names of the audit's own statistics for a plug-in (:func:`independent_statistics`)
STAT_PROJECTION = "projection on the canary difference"
STAT_CLIPPED = "clipped projection on the canary difference"
STAT_FITTED = "linear, fitted on the calibration quarter"
#: what the independent test's canaries are, for the JSON
PUBLIC_CANARY = "the audit's own: opposite corners of the public input box (cut activation, clip bound)"


def public_canary_pair(direction: str, width: int, bound: float, cut_activation: str = "none"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The audit's own canary pair for a plug-in, from public facts only.

    Opposite corners of the input box the claim covers, each ``(1, width)``. ``tanh`` (a forward
    release whose bottom ends in ``tanh``): every element at ``−1`` vs ``+1``; ``relu``: ``0`` vs
    ``bound``; otherwise (a bare or native last layer, every backward release: any real input)
    ``−bound`` vs ``+bound``, ``bound`` being the direction's clip bound. A clip to
    any norm ball centred at 0 with radius ``≤ bound`` maps the corners to antipodal points of the
    ball, the largest distance it allows, so the pair is worst-case for every such bounding.
    """
    one = torch.ones(1, int(width), dtype=torch.float32)
    if direction == "forward" and cut_activation == "tanh":
        return -one, one.clone()
    if direction == "forward" and cut_activation == "relu":
        return torch.zeros(1, int(width)), float(bound) * one
    return -float(bound) * one, float(bound) * one


def public_canary_pair_of(cfg, direction: str, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`public_canary_pair` of a run configuration.

    Its facts: the direction's clip bound (:func:`~fl_split.privacy.factory.clip_bound`) and,
    forward, the cut activation the guests' bottoms are built to end with
    (:func:`~fl_split.privacy.factory.guest_cut_activation`), which fl_split enforces."""
    from fl_split.privacy import factory

    act = factory.guest_cut_activation(cfg) if direction == "forward" else "none"
    return public_canary_pair(direction, width, factory.clip_bound(cfg, direction), act)


def independent_statistics(y0: torch.Tensor, y1: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor
                           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The audit's own statistics of releases of the public pair; nothing read from the mechanism.

    ``y0``, ``y1``: ``(N, d')``, one release of each of ``N`` copies of ``x0`` and ``x1``. Returns
    ``{name: (s0, s1)}``, each ``(N,)``:

    * :data:`STAT_PROJECTION` ``⟨y, x1 − x0⟩``: the likelihood ratio of any additive isotropic
      Gaussian noise (whatever its scale);
    * :data:`STAT_CLIPPED` ``Σ clamp((y − m)·sign(x1 − x0), ±|x1 − x0|/2)``, ``m`` the midpoint:
      the likelihood ratio of any additive i.i.d. Laplace noise;
    * :data:`STAT_FITTED` ``⟨y, w⟩`` with ``w = (ȳ₁ − ȳ₀)/v`` per element, means and pooled
      variance from the **calibration quarter** (the first :func:`calibration_size` rows) only,
      cross-fitted inside it (each half of those rows scored with the other's weights): a release
      that is rescaled, permuted or noised unequally per element.

    The first two need ``d' = d`` (the release in the input's space) and are left out otherwise.
    """
    y0, y1 = y0.reshape(y0.shape[0], -1).double(), y1.reshape(y1.shape[0], -1).double()
    diff = (x1 - x0).reshape(-1).double()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if y0.shape[1] == diff.numel():
        mid, half, sgn = ((x0 + x1) / 2).reshape(-1).double(), diff.abs() / 2, torch.sign(diff)
        out[STAT_PROJECTION] = ((y0 * diff).sum(dim=1), (y1 * diff).sum(dim=1))
        clip = lambda y: torch.maximum(torch.minimum((y - mid) * sgn, half), -half).sum(dim=1)  # noqa: E731
        out[STAT_CLIPPED] = (clip(y0), clip(y1))

    def fit(c0: torch.Tensor, c1: torch.Tensor) -> torch.Tensor:
        var = (c0.var(dim=0, unbiased=False) + c1.var(dim=0, unbiased=False)) / 2
        w = (c1.mean(dim=0) - c0.mean(dim=0)) / var.clamp_min(1e-30)
        return torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)

    def fitted(y: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, w: torch.Tensor, q: int, h: int) -> torch.Tensor:
        return torch.cat([y[:q] @ wb, y[q:h] @ wa, y[h:] @ w])

    # cross-fitted on the calibration quarter: its rows get the weights fitted on the calibration rows of
    # the other quarter (so the choice between statistics sees an honest score), the evaluation half
    # the weights fitted on the whole calibration quarter
    h0, h1 = calibration_size(y0.shape[0]), calibration_size(y1.shape[0])
    q0, q1 = h0 // 2, h1 // 2
    if q0 >= 1 and q1 >= 1:
        w = fit(y0[:h0], y1[:h1])
        wa, wb = fit(y0[:q0], y1[:q1]), fit(y0[q0:h0], y1[q1:h1])
        out[STAT_FITTED] = (fitted(y0, wa, wb, w, q0, h0), fitted(y1, wa, wb, w, q1, h1))
    return out


def select_statistic(cands: dict[str, tuple[np.ndarray, np.ndarray]], delta: float, alpha: float) -> dict[str, Any]:
    """Choose a statistic on the calibration quarter, count its errors on the rest.

    The choice: the largest projected bound on the calibration quarter (as :func:`choose_test` scores
    it), each statistic at its own best test there. Returns :func:`audit_statistics` of the chosen statistic plus
    ``statistic`` (its name) and ``calibration_lower``. The choice sees only the calibration quarter,
    so the bound stays valid."""
    best: tuple[float, str] | None = None
    for name, (s0, s1) in cands.items():
        n = min(len(s0), len(s1))
        c = calibration_size(n)
        if n - c < 1:
            raise ValueError("select_statistic: need at least 2 trials per record")
        tau, side = choose_test(s0[:c], s1[:c], delta, alpha, n - c)
        cal = _projected(s0[:c], s1[:c], tau, side, c * (n - c) / n, delta, alpha)  # as choose_test scores it
        if best is None or cal > best[0]:
            best = (cal, name)
    if best is None:
        raise ValueError("select_statistic: no statistic to choose from")
    out = audit_statistics(*cands[best[1]], delta, alpha)
    out["statistic"], out["calibration_lower"] = best[1], best[0]
    return out


# -- a deliberately mis-accounted mechanism (the audit's own test) -------------------------------
class MisAccounted(Mechanism):
    """The mechanism ``inner`` whose ledger cost is accounted as if its noise were ``factor`` times
    larger (a deliberately 2×-under-noised mechanism for ``factor = 2``): a deliberate accounting bug
    the audit must flag (``--mis-account``). Releases are ``inner``'s; the cost is ``inner``'s event
    through :func:`~fl_split.privacy.events.noisier_event` (Gaussian / Laplace multipliers × factor,
    a randomized response's or pure event's ε ÷ factor), the stated pure ε ÷ factor. Since the
    events are tight (issue 26), this is the claim of the same mechanism at ``factor``× the noise."""

    def __init__(self, inner: Mechanism, factor: float) -> None:
        if not (isinstance(factor, (int, float)) and factor > 1):
            raise ValueError(f"mis-account factor {factor!r}; allowed: a number > 1")
        self.inner = inner
        self.factor = float(factor)
        self.name = inner.name
        self.random = inner.random
        self.encoding = inner.encoding

    def release(self, t, gen):
        return self.inner.release(t, gen)

    def local_grad(self, ctx, grad):
        return self.inner.local_grad(ctx, grad)

    def describe(self) -> dict:
        return {**self.inner.describe(), "mis_accounted_factor": self.factor}

    def privacy_cost(self) -> PrivacyCost:
        from fl_split.privacy.events import noisier_event

        real = self.inner.cost()
        eps = None if real.epsilon is None else float(real.epsilon) / self.factor
        return PrivacyCost(real.mechanism, noisier_event(real.dp_event, self.factor), epsilon=eps,
                           params=(("mis_accounted", self.factor),))


# -- claims ----------------------------------------------------------------------------------------
def claimed_epsilons(costs: list[PrivacyCost | None], delta: float, direction: str = "forward") -> dict[str, float | None]:
    """The ledger's epsilon of one record released once per cost, per accountant (``None``: the
    accountant does not apply). One :class:`Ledger`, charged as a party charges its releases."""
    from fl_split.privacy.ledger import Ledger, LedgerEntry

    ledger = Ledger("audit", accountant="basic", delta=delta)
    entries = [LedgerEntry(j + 1, ("train", 1, j), direction, c, np.array([0]), 1.0)
               for j, c in enumerate(costs) if c is not None]
    if entries:
        ledger.charge(entries)
    out: dict[str, float | None] = {}
    for name in CLAIM_ACCOUNTANTS:
        v = ledger.epsilon(name) if entries else 0.0  # None: the accountant does not apply
        out[name] = None if v is None else float(v)
    return out


# -- runners ---------------------------------------------------------------------------------------
@dataclass
class AuditResult:
    """One row of the audit: a mechanism, a number of releases, the claim and the empirical bound."""

    label: str
    releases: int
    trials: int
    claimed: dict[str, float | None]
    stats: dict[str, Any]
    describe: dict[str, Any] = field(default_factory=dict)
    statistic: str = "log-likelihood ratio"
    #: a plug-in's tests, each ``{"test", "canaries", "statistic", "alpha", "stats"}``: the
    #: independent one first, then the plug-in's own; ``stats`` above is the one of largest bound
    tests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lower(self) -> float:
        return float(self.stats["lower"])

    @property
    def violated(self) -> list[str]:
        """Accountants whose epsilon is below the empirical lower bound (a wrong claim)."""
        return [n for n, v in self.claimed.items() if v is not None and self.lower > v]

    def to_json(self, reported: str) -> dict[str, Any]:
        claim = self.claimed.get(reported)
        if claim is None:
            claim = min((v for v in self.claimed.values() if v is not None), default=None)
        lo = self.lower
        return {"mechanism": self.label, "releases": self.releases, "trials_per_record": self.trials,
                "claimed_epsilon": claim, "claimed_accountant": reported, "claimed_epsilon_by_accountant": self.claimed,
                "empirical_epsilon_lower": lo if math.isfinite(lo) else None,
                "empirical_epsilon_point": _finite(self.stats["point"]),
                "empirical_epsilon_ci": [_finite(lo), _finite(self.stats["upper"])],
                "fpr": self.stats["fpr"], "fnr": self.stats["fnr"], "fpr_ci": self.stats["fpr_ci"],
                "fnr_ci": self.stats["fnr_ci"], "threshold": self.stats["threshold"],
                "statistic": self.statistic, "ratio_to_claim": (lo / claim) if claim else None,
                "violation": bool(self.violated), "violated_accountants": self.violated,
                "tests": [self._test_json(t) for t in self.tests],
                "mechanism_parameters": self.describe}

    def _test_json(self, t: dict[str, Any]) -> dict[str, Any]:
        """One of a plug-in's tests as JSON, with its own verdict against the claim."""
        st = t["stats"]
        lo = float(st["lower"])
        flagged = [n for n, v in self.claimed.items() if v is not None and lo > v]
        return {"test": t["test"], "canaries": t["canaries"], "statistic": t["statistic"], "alpha": t["alpha"],
                "empirical_epsilon_lower": _finite(lo), "empirical_epsilon_ci": [_finite(lo), _finite(st["upper"])],
                "fpr": st["fpr"], "fnr": st["fnr"], "threshold": st["threshold"],
                "violation": bool(flagged), "violated_accountants": flagged}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def audit_mechanism(mechs: list[Mechanism], trials: int, secret, *, delta: float, alpha: float,
                    label: str = "", direction: str = "forward",
                    progress: Callable[[int], None] | None = None,
                    public_pair: tuple[torch.Tensor, torch.Tensor] | None = None,
                    plugin: bool | None = None) -> AuditResult:
    """Release the canary pair of ``mechs[0]`` through each mechanism of ``mechs`` in turn (one
    release per mechanism: ``k = len(mechs)`` releases, e.g. a geometric schedule's iterations),
    ``trials`` times per record, and bound the epsilon of the ``k`` releases from below.

    The ``trials`` releases of one record through one mechanism are one batch of ``trials`` copies
    of the record (each sample gets independent draws: one record per sample), drawn from
    ``secret``'s generator keyed by ``("audit", label, release, record)``.

    A plug-in (``plugin``; by default: any of ``mechs`` is one) is audited with ``public_pair``
    (required; :func:`public_canary_pair`) and the audit's own statistics
    (:func:`select_statistic`), and, if it defines ``canary_pair``, with its own pair and ratio as a
    second test; each test at ``alpha/2`` when there are two. ``stats`` is the test of largest bound,
    ``tests`` lists both.
    """
    if trials < 4:
        raise ValueError(f"audit trials {trials!r}; allowed: an integer >= 4")
    claimed = claimed_epsilons([m.cost() for m in mechs], delta, direction)
    if plugin is None:
        plugin = any(is_plugin_mechanism(_inner(m)) for m in mechs)
    if not plugin:
        x0, x1 = canary_pair(mechs[0])
        stats = audit_statistics(*_llr_totals(mechs, x0, x1, trials, secret, label, progress), delta, alpha)
        return AuditResult(label, len(mechs), trials - calibration_size(trials), claimed, stats,
                           describe=mechs[0].describe())
    # a plug-in: the independent test always, the plug-in's own pair and ratio in addition
    if public_pair is None:
        raise ValueError("audit_mechanism: a plug-in is audited with the audit's own canaries: pass public_pair "
                         "(public_canary_pair / public_canary_pair_of)")
    own = next((getattr(_inner(m), "canary_pair") for m in mechs
                if is_plugin_mechanism(_inner(m)) and callable(getattr(_inner(m), "canary_pair", None))), None)
    a = alpha / 2 if own is not None else alpha  # either test may flag: the verdict's false alarms stay <= alpha
    p0, p1 = (t.reshape(1, -1).float() for t in public_pair)
    ind = select_statistic(_independent_totals(mechs, p0, p1, trials, secret, label, progress), delta, a)
    tests = [{"test": "independent", "canaries": PUBLIC_CANARY, "statistic": ind["statistic"], "alpha": a,
              "stats": ind}]
    if own is not None:
        x0, x1 = (t.reshape(1, -1).float() for t in own())
        has_ratio = any(callable(getattr(_inner(m), "log_likelihood_ratio", None)) for m in mechs)
        st = audit_statistics(*_llr_totals(mechs, x0, x1, trials, secret, label, progress), delta, a)
        tests.append({"test": "plug-in's own", "canaries": "the plug-in's canary_pair()",
                      "statistic": "the plug-in's log_likelihood_ratio()" if has_ratio else STAT_PROJECTION,
                      "alpha": a, "stats": st})
    top = max(tests, key=lambda t: float(t["stats"]["lower"]))  # the first (independent) on a tie
    return AuditResult(label, len(mechs), trials - calibration_size(trials), claimed, top["stats"],
                       describe=mechs[0].describe(),
                       statistic=f"{top['test']}: {top['statistic']}", tests=tests)


def _llr_totals(mechs, x0, x1, trials, secret, label, progress) -> tuple[np.ndarray, np.ndarray]:
    """The likelihood-ratio statistics of ``trials`` releases of each of ``x0``, ``x1``.

    One release through each mechanism in turn, :func:`log_likelihood_ratio` summed over them."""
    total = {0: torch.zeros(trials, dtype=torch.float64), 1: torch.zeros(trials, dtype=torch.float64)}
    for j, mech in enumerate(mechs):
        for b, x in ((0, x0), (1, x1)):
            gen = secret.torch_generator("audit", label, j, b)
            rel = mech.release(x.expand(trials, -1).contiguous(), gen)
            total[b] += log_likelihood_ratio(mech, rel.value, x0, x1)
            if progress is not None:
                progress(1)
    return total[0].numpy(), total[1].numpy()


def _independent_totals(mechs, x0, x1, trials, secret, label, progress) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The independent statistics of ``trials`` releases of each of the public pair.

    One release through each mechanism in turn (draws of their own, keyed ``("audit", label,
    "public", release, record)``), :func:`independent_statistics` summed over them."""
    total: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    for j, mech in enumerate(mechs):
        ys = {}
        for b, x in ((0, x0), (1, x1)):
            gen = secret.torch_generator("audit", label, "public", j, b)
            ys[b] = mech.release(x.expand(trials, -1).contiguous(), gen).value.reshape(trials, -1)
            if progress is not None:
                progress(1)
        stats = independent_statistics(ys[0], ys[1], x0, x1)
        # only statistics every release offered (a release outside the input's space drops the projections)
        total = stats if total is None else {n: (total[n][0] + v[0], total[n][1] + v[1])
                                             for n, v in stats.items() if n in total}
    assert total is not None
    return {n: (v[0].numpy(), v[1].numpy()) for n, v in total.items()}


#: DP-SGD canaries audited in one step (each on its own coordinate: independent trials)
DPSGD_CANARIES_PER_STEP = 1024


def audit_dpsgd(noise_multiplier: float, max_grad_norm: float, trials: int, secret, *, releases: int = 1,
                delta: float, alpha: float, width: int = 2, batch: int = DPSGD_CANARIES_PER_STEP,
                label: str = "dpsgd", mis_account: float | None = None,
                progress: Callable[[int], None] | None = None) -> AuditResult:
    """DP-SGD through :class:`~fl_split.local_update.DpSgdUpdate` (Opacus), with gradient canaries.

    Many canaries per step (issue 26; Steinke, Nasr & Jagielski 2023 audit many canaries in one
    run): the model is ``Linear(T, 1, bias=False)`` and a step's batch holds ``T`` records (``T`` =
    ``batch``, default :data:`DPSGD_CANARIES_PER_STEP`, or ``trials`` if smaller), record ``i`` with input
    ``±10·C·e_i``. The guest path backpropagates a received gradient of 1 per sample, so record
    ``i``'s per-sample gradient is ``±10·C·T·e_i`` (Opacus scales by the batch for
    ``loss_reduction="mean"``), clipped to ``±C·e_i``: the replace-one neighbours at distance ``2C``
    along their own coordinate. Opacus adds independent ``N(0, σ²C²)`` noise per coordinate, so the
    ``T`` coordinates of one step are ``T`` independent trials of the same Gaussian pair (the other
    canaries add nothing to coordinate ``i``). Each trial runs ``releases`` steps with SGD (lr 1) and
    its statistic is ``−Σ Δθ_i`` (the sufficient statistic of the Gaussian shift along ``e_i``).
    ``width`` is kept for the interface (the canaries set it). ``mis_account``:
    the claim of a ``factor``× noisier DP-SGD (:class:`MisAccounted`'s reading).
    """
    from torch import nn

    from fl_split.local_update import DpSgdUpdate, OptimizerSettings

    if trials < 4:
        raise ValueError(f"audit trials {trials!r}; allowed: an integer >= 4")
    per_step = max(1, min(int(trials), int(batch)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(per_step, 1, bias=False)
    upd = DpSgdUpdate([model], OptimizerSettings(name="sgd", lr=1.0), noise_multiplier, max_grad_norm,
                      expected_batch_size=per_step)
    module = upd.modules[0]
    weight = next(module.parameters())
    stats = {}
    for b, sign in ((0, -1.0), (1, 1.0)):
        x = sign * 10.0 * max_grad_norm * torch.eye(per_step)
        chunks, done, i = [], 0, 0
        while done < trials:
            s = torch.zeros(per_step, dtype=torch.float64)
            for j in range(releases):
                before = weight.detach()[0].double().clone()
                upd.zero_grad()
                upd.backward(module(x), torch.ones(per_step, 1))
                upd.step(secret.torch_generator("audit", label, b, i, j))
                s -= weight.detach()[0].double() - before
            take = min(per_step, trials - done)
            chunks.append(s[:take].numpy())
            done += take
            i += 1
            if progress is not None:
                progress(take)
        stats[b] = np.concatenate(chunks)
    res = audit_statistics(stats[0], stats[1], delta, alpha)
    cost = upd.cost()
    if mis_account:
        from fl_split.privacy.events import noisier_event

        cost = PrivacyCost(cost.mechanism, noisier_event(cost.dp_event, mis_account), epsilon=None,
                           params=(("mis_accounted", float(mis_account)),))
    claimed = claimed_epsilons([cost] * releases, delta, "update")
    describe = {**upd.describe(), "canaries_per_step": per_step}
    if mis_account:
        describe["mis_accounted_factor"] = float(mis_account)
    return AuditResult(label, releases, trials - calibration_size(trials), claimed, res, describe=describe,
                       statistic="projection of the step on each canary's coordinate")


def mechanisms_for(cfg, width: int, releases: int, direction: str = "forward", importance=None,
                   mis_account: float | None = None) -> list[Mechanism]:
    """The mechanisms of the first ``releases`` training iterations of ``cfg`` (the factory's, as a
    party builds them: the geometric schedule's ``ε/2^i``), with ``importance`` set on R3eLU (a
    fixed ``U``) and, for the audit's own test, wrapped in :class:`MisAccounted`."""
    from fl_split.privacy import factory

    make = factory.forward_mechanism if direction == "forward" else factory.backward_mechanism
    out = []
    for i in range(1, releases + 1):
        m = make(cfg, width, iteration=i)
        if importance is not None and hasattr(m, "set_importance"):
            m.set_importance(importance)
        out.append(MisAccounted(m, mis_account) if mis_account else m)
    return out


def default_importance(width: int) -> torch.Tensor:
    """The ``U`` the audit gives an importance allocation: ``(i+1)²``, unequal shares (uniform ``U``
    would reduce Cor. 6 to Alg. 1)."""
    return (torch.arange(width, dtype=torch.float32) + 1.0) ** 2




# -- one audit run (what ``fl-split audit`` does) -------------------------------------------------
def directions_of(cfg) -> list[str]:
    """The directions whose releases ``cfg`` protects (``--protect``): forward for guests, backward
    for the host; DP-SGD (``--defense dpsgd``) is audited as one "update" direction."""
    from fl_split.privacy import factory

    if cfg.defense == "dpsgd":
        return ["update"]
    out = []
    if factory.protects_guests(cfg):
        out.append("forward")
    if factory.protects_host(cfg):
        out.append("backward")
    return out


def run_audit(cfg, *, width: int, releases: list[int], trials: int, alpha: float, secret,
              mis_account: float | None = None, batch: int = DPSGD_CANARIES_PER_STEP,
              progress: Callable[[int], None] | None = None, family: int | None = None) -> dict[str, Any]:
    """Audit every protected direction of ``cfg`` at each number of ``releases``; the JSON document
    ``fl-split audit`` writes (``results``: one :meth:`AuditResult.to_json` row each; ``violations``:
    the rows whose empirical lower bound exceeds an accountant's epsilon).

    **Family-wise.** ``alpha`` is shared among the rows (Bonferroni): each row's bound holds at
    ``1 − alpha/F``, ``F`` = ``family`` (a table of several commands declares its total) or this
    command's rows, so a correctly accounted mechanism is flagged anywhere in the family with
    probability ``≤ alpha``. Holm's step-down would flag no row Bonferroni does not until one row is
    already flagged, and Bonferroni keeps "bound above the claim" and "flagged" one statement."""
    from fl_split.privacy import factory

    n_rows = len(directions_of(cfg)) * len(releases)
    if family is not None and family < n_rows:
        raise ValueError(f"audit family {family!r}; allowed: an integer >= this command's {n_rows} rows")
    family = family or n_rows
    alpha_all, alpha = alpha, alpha / family
    rows = []
    for direction in directions_of(cfg):
        for k in releases:
            if direction == "update":
                label = f"dpsgd/update/{k}"
                res = audit_dpsgd(factory.dpsgd_sigma(cfg), cfg.max_grad_norm, trials, secret, releases=k,
                                  delta=cfg.delta, alpha=alpha, width=width, batch=batch, label=label,
                                  mis_account=mis_account, progress=progress)
            else:
                u = default_importance(width) if cfg.allocation != "uniform" else None
                mechs = mechanisms_for(cfg, width, k, direction, importance=u, mis_account=mis_account)
                label = f"{cfg.defense}/{direction}/{k}"
                # a plug-in is named by the configuration, not by what its class says of itself
                plugin = factory.plugin_class(cfg) is not None
                res = audit_mechanism(mechs, trials, secret, delta=cfg.delta, alpha=alpha, label=label,
                                      direction=direction, progress=progress, plugin=plugin,
                                      public_pair=public_canary_pair_of(cfg, direction, width) if plugin else None)
            row = res.to_json(cfg.accountant)
            row.update({"defense": cfg.defense, "direction": direction, "schedule": cfg.schedule,
                        "allocation": cfg.allocation if cfg.defense == "r3elu" else None, "width": width})
            # the most any outcome of this row's trials could show: a claim above it cannot be checked
            reach = max_certifiable_epsilon(res.trials, cfg.delta, res.tests[0]["alpha"] if res.tests else alpha)
            row["max_certifiable_epsilon"] = reach
            row["claim_beyond_reach"] = bool(row["claimed_epsilon"] is not None and row["claimed_epsilon"] > reach)
            rows.append(row)
    return {"audit": "empirical epsilon lower bound (docs/accounting.md, 'Empirical audit')",
            "delta": cfg.delta, "confidence": 1 - alpha_all, "family_rows": family, "confidence_per_row": 1 - alpha,
            "correction": "Bonferroni over the family's rows", "width": width, "trials_per_record": trials,
            "canary": "a chosen cut-layer input pair (the guest's bottom bypassed); DP-SGD: a gradient canary"
                      + ("; a plug-in: the audit's own pair from the public configuration, its own in addition"
                         if factory.plugin_class(cfg) is not None else ""),
            "mis_accounted_factor": mis_account, "results": rows,
            "violations": [r for r in rows if r["violation"]]}


def progress_steps(cfg, releases: list[int], trials: int) -> int:
    """How many progress units :func:`run_audit` reports (for a progress bar's total)."""
    from fl_split.privacy import factory

    cls = factory.plugin_class(cfg) if cfg.defense != "dpsgd" else None
    tests = 2 if cls is not None and callable(getattr(cls, "canary_pair", None)) else 1
    n = 0
    for direction in directions_of(cfg):
        for k in releases:
            n += 2 * trials if direction == "update" else 2 * k * tests
    return n


__all__ = ["AuditResult", "MisAccounted", "audit_dpsgd", "audit_mechanism", "audit_statistics", "canary_pair",
           "calibration_size", "choose_test", "claimed_epsilons", "clopper_pearson", "default_importance", "directions_of",
           "epsilon_lower_bound", "independent_statistics", "log_likelihood_ratio", "mechanisms_for",
           "max_certifiable_epsilon", "paired_lower_bound", "progress_steps", "public_canary_pair", "public_canary_pair_of", "run_audit", "select_statistic"]
