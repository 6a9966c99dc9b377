"""The verdict rules of the claim table (issues 19 and 26): verdict names, the tests a verdict rests
on, and the guards every claim passes before it can hold.

Issue 26 made the rules ones that more seeds can settle:

* decisions on the **standard error** (:func:`t_test`, :func:`paired`, :func:`welch`): a margin is
  clear when its t-test says so — ``se = sd/√n`` shrinks with more seeds, where the old "margin ≥
  2 × the per-seed sd" never did;
* **n ≥ 2** seeds or the verdict is *inconclusive* (:func:`guard`; a one-seed ``--verify`` no longer
  prints "partly holds");
* **Holm–Bonferroni** over the table's p-values (:func:`holm`; ``experiments/claims.py``): each
  claim records the p-value its verdict rests on, and a verdict that rests on a significance which
  does not survive the correction becomes *inconclusive*;
* the **usability guard** on every claim that credits a defence (:func:`usable`): a model at its
  constant prediction cannot earn a "holds";
* the **channel check** (:func:`touches`): a defence credited against an attack on a channel it
  never perturbs is *not applicable* (DP-SGD noises the protected party's parameter updates, not
  the activations or gradients the attacks read).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from fl_split.bench.verdicts import holm  # noqa: F401 - one Holm for the claim table and the bench

HOLDS, PARTLY, FAILS = "holds", "partly holds", "does not hold"
#: a measurement no paper made (an open question answered), and a claim we could not measure
NEW, NOT_MEASURED = "new", "not measured"
#: the claim cannot be judged here: the model is at its trivial level, the undefended attack does not
#: beat its baseline (so no defence can be judged), or the comparison is equal by construction
UNINFORMATIVE = "uninformative"
#: the difference that decides the claim is not settled by the seeds: its t-test (on the standard
#: error) is not significant, fewer than 2 seeds, or significant alone but not after Holm's correction
INCONCLUSIVE = "inconclusive"
#: the defence credited does not touch the channel the attack reads (issue 26)
NOT_APPLICABLE = "not applicable"
NOT_APPLICABLE_WHY = "not applicable: the defence does not touch the channel the attack reads"
VERDICTS = (HOLDS, PARTLY, FAILS, NEW, NOT_MEASURED, UNINFORMATIVE, INCONCLUSIVE, NOT_APPLICABLE)
#: the verdicts a measurement decides (and so need n ≥ 2 seeds and survive Holm's correction)
DECIDED = (HOLDS, PARTLY, FAILS)
#: significance level of every test a verdict rests on (family-wise, after Holm, over the table)
ALPHA = 0.05


def mean_sd(xs: Iterable[float | None]) -> tuple[float, float]:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return float("nan"), float("nan")
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def _sided(out: dict, diff: float, t_stat: float | None, df: float | None) -> dict:
    """p-values of ``diff`` (two-sided, above 0, below 0) from a t statistic; n < 2 gives nan and a
    zero standard error p = 0 on the side of a nonzero difference."""
    if out["n"] < 2:
        out.update(p=float("nan"), p_above=float("nan"), p_below=float("nan"))
    elif t_stat is None:  # zero spread
        out.update(p=0.0 if diff else 1.0, p_above=0.0 if diff > 0 else 1.0, p_below=0.0 if diff < 0 else 1.0)
    else:
        from scipy import stats

        out.update(p=float(2 * stats.t.sf(abs(t_stat), df)), p_above=float(stats.t.sf(t_stat, df)),
                   p_below=float(stats.t.cdf(t_stat, df)))
    # nan < ALPHA is False: one seed is never clear, above or below
    out.update(above=out["p_above"] < ALPHA, below=out["p_below"] < ALPHA, clear=out["p"] < ALPHA)
    return out


def t_test(xs: Iterable[float | None], ref: float = 0.0) -> dict:
    """One-sample t-test of the per-seed values ``xs`` against ``ref``: the decision on the
    standard error. Returns ``mean``, ``sd``, ``se = sd/√n``, ``n``, two-sided ``p``, one-sided
    ``p_above`` (H1: mean > ref) and ``p_below`` (H1: mean < ref), and ``clear`` / ``above`` /
    ``below`` (that p under :data:`ALPHA`; never with n < 2)."""
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    m, sd = mean_sd(v)
    n = len(v)
    se = sd / math.sqrt(n) if n else float("nan")
    out = {"mean": m, "sd": sd, "se": se, "n": n, "ref": ref, "diff": m - ref, "df": n - 1}
    return _sided(out, m - ref, (m - ref) / se if n > 1 and se > 0 else None, n - 1)


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
    """Per-seed paired comparison of ``a`` against ``b`` (same seeds, same order): :func:`t_test`
    of the differences against 0, with ``diff`` = their mean and ``clear`` = outside the seed spread
    (two-sided p < :data:`ALPHA`; ``nan`` p with fewer than 2 pairs). Verdicts on a difference use
    this, never the sign alone (issue 19)."""
    r = t_test([float(x) - float(y) for x, y in zip(a, b)])
    r["diff"] = r["mean"]
    return r


def welch(a: Sequence[float], b: Sequence[float]) -> dict:
    """Welch's t-test of ``a`` against ``b`` (independent samples, unequal variances), for
    comparisons whose seeds are not paired: ``diff`` = mean(a) − mean(b), ``se = √(s_a²/n_a +
    s_b²/n_b)``, Welch–Satterthwaite degrees of freedom, ``n`` = the smaller sample."""
    a = [float(x) for x in a]
    b = [float(x) for x in b]
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    n = min(len(a), len(b))
    out = {"diff": ma - mb, "n": n, "se": float("nan"), "df": float("nan")}
    if n >= 2:
        va, vb = sa ** 2 / len(a), sb ** 2 / len(b)
        out["se"] = math.sqrt(va + vb)
        if out["se"] > 0:
            out["df"] = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t_stat = out["diff"] / out["se"] if n >= 2 and out["se"] > 0 else None
    return _sided(out, out["diff"], t_stat, out["df"])


def within(test: dict, delta: float) -> dict:
    """Equivalence on the standard error (TOST, Schuirmann 1987) for "no difference" claims: a
    non-significant difference is no evidence of none, and never settles with more seeds, so these
    claims are judged against an equivalence margin ``delta``. From a :func:`t_test` /
    :func:`paired` / :func:`welch` result: ``p_within`` (H1: |diff| < delta — both one-sided tests
    at once) and ``p_beyond`` (H1: |diff| > delta on the side of the observed difference), with
    ``inside`` / ``outside`` = that p under :data:`ALPHA` (never with n < 2)."""
    d, se, df = test["diff"], test["se"], test["df"]
    if test["n"] < 2:
        p_in = p_out = float("nan")
    elif not se > 0:  # zero spread (df nan for Welch)
        p_in, p_out = (0.0, 1.0) if abs(d) < delta else (1.0, 0.0 if abs(d) > delta else 1.0)
    else:
        from scipy import stats

        p_in = float(max(stats.t.sf((d + delta) / se, df), stats.t.cdf((d - delta) / se, df)))
        p_out = float(stats.t.sf((abs(d) - delta) / se, df))
    return {"diff": d, "delta": delta, "p_within": p_in, "p_beyond": p_out, "inside": p_in < ALPHA,
            "outside": p_out < ALPHA}



def guard(claim: dict, n: int) -> dict:
    """The n ≥ 2 guard: a verdict decided by a measurement (holds / partly / does not hold) on fewer
    than 2 seeds becomes *inconclusive* — one seed has no standard error. Claims marked
    ``deterministic`` (bytes of encoded messages, equal by construction) need no seeds."""
    if n < 2 and claim["verdict"] in DECIDED and not claim.get("deterministic"):
        claim["note"] = (f"{n} seed: would read '{claim['verdict']}', but one seed has no standard error; "
                         + (claim.get("note") or "")).rstrip("; ")
        claim["verdict"] = INCONCLUSIVE
    return claim


#: the usability guard every claim that credits a defence applies (issue 26): a model at its constant
#: prediction "stops" every attack — it learned nothing, so it proves nothing about the defence
USABLE_RULE = ("usable = utility above the constant prediction on its standard error (one-sided paired t-test over "
               "seeds, p < 0.05) and keeping ≥ a tenth of the undefended model's gain over it")


def usable(utility: Sequence[float], trivial: Sequence[float] | float, undefended: float) -> dict:
    """The usability guard (:data:`USABLE_RULE`): per-seed ``utility`` of the defended model against
    the constant prediction (``trivial``, per seed or one number) and the undefended model's mean
    utility. ``ok`` needs n ≥ 2, the gain over the constant prediction clear on its standard error,
    and at least a tenth of the undefended gain."""
    u = [float(x) for x in utility]
    tr = [float(trivial)] * len(u) if isinstance(trivial, (int, float)) else [float(x) for x in trivial]
    test = t_test([a - b for a, b in zip(u, tr)])
    nd_gain = float(undefended) - (statistics.fmean(tr) if tr else float("nan"))
    share = test["mean"] / nd_gain if nd_gain > 0 else float("nan")
    return {"ok": bool(test["above"] and nd_gain > 0 and share >= 0.1), "p": test["p_above"], "gain": test["mean"],
            "se": test["se"], "share": share, "n": test["n"]}


def channel_of(defence: str, protect: str) -> str:
    """The channel a defence perturbs, by the party it protects: the cut-layer mechanisms (Laplace,
    Gaussian, R3eLU, RR) noise what that party releases — a guest's activations, the host's
    gradients — while DP-SGD noises only the protected party's parameter updates
    (``fl_split/local_update.py``): the activations and gradients it sends stay exact functions of
    its records."""
    if defence in ("none", ""):
        return "none"
    if defence == "dpsgd":
        return f"{protect} parameters"
    return "guest activations" if protect == "guest" else "host gradients"


#: what each attack reads: the host's property inference, reconstruction, FSHA, inversion and
#: membership inference read the guests' activations; the guest's property inference and the label
#: attacks read the host's gradients
ATTACK_CHANNEL = {"property-host": "guest activations", "reconstruction": "guest activations",
                  "fsha": "guest activations", "inversion": "guest activations", "membership": "guest activations",
                  "property-guest": "host gradients", "label": "host gradients"}


def touches(defence: str, protect: str, attack: str) -> bool:
    """Whether ``defence`` protecting ``protect`` perturbs the channel ``attack`` reads: a defence
    credited (or discredited) against an attack on a channel it never touches is *not applicable* —
    "DP-SGD does not stop the host's property inference" cannot fail."""
    return channel_of(defence, protect) == ATTACK_CHANNEL[attack]
