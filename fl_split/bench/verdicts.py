"""Verdicts on a bench table: paired tests against the undefended run, Holm over the table.

The claim table's words and rules (``experiments/verdicts.py``), applied per cell of ``fl-split
bench`` (experiments/README.md, "`fl-split bench`").

**The claim a cell is judged on**: "defence D at target ε protects the protected party against the
attacks on the channel D perturbs". For each attack the per-seed advantages of the cell and of the
undefended cell of the same dataset and seed are paired (same split, same model initialisation:
the seed sets both), and the differences are put through:

* a one-sided **paired t-test** (H1: the defence lowers the advantage). A t-test, not Wilcoxon's
  signed-rank test: with 5 pairs the signed-rank test cannot go below p = 1/32 one-sided, and no
  two-sided or Holm-corrected decision can be reached at all (the smallest two-sided p is 1/16);
  the t-test's normality assumption is on a mean of per-seed differences of bounded scores;
* an **equivalence test** (TOST, Schuirmann 1987) with margin :data:`MARGIN` (H1: the advantage is
  within ``±MARGIN`` of the undefended one): "does not protect" needs evidence of no effect, which a
  non-significant difference is not.

Each attack's test carries ``p = min(1, 2·min(p_lower, p_equal))`` (either direction may decide, so
both are paid for), and **every** such p of the table — significant or not — is in one Holm family
(Holm 1979): a verdict stands only where its adjusted p is below :data:`ALPHA`.

**Guards** (as in the claim table): fewer than 2 paired seeds → *inconclusive*; an attack the
undefended model does not lose to (its advantage not above 0 on its standard error) cannot judge a
defence → left out as *uninformative*; a defence that does not touch the channel an attack reads
(DP-SGD noises the protected party's parameter updates, not what the attacks read; ``--protect
guest`` leaves the host's gradients exact) → *not applicable* for that attack; a model not above its
constant prediction on its standard error, or keeping under a tenth of the undefended model's gain
over it, cannot earn *holds* / *partly holds* (→ *uninformative*: it learned nothing, so it proves
nothing about the defence).

**The cell's verdict**: *holds* — every judged attack lowered; *partly holds* — some lowered;
*does not hold* — none lowered and every one shown equivalent to undefended; *inconclusive* —
otherwise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

#: the claim table's words (experiments/verdicts.py; tests/test_bench_verdicts.py checks they agree)
HOLDS, PARTLY, FAILS = "holds", "partly holds", "does not hold"
INCONCLUSIVE, UNINFORMATIVE, NOT_APPLICABLE = "inconclusive", "uninformative", "not applicable"
VERDICTS = (HOLDS, PARTLY, FAILS, INCONCLUSIVE, UNINFORMATIVE, NOT_APPLICABLE)
#: family-wise level of the table's verdicts (Holm)
ALPHA = 0.05
#: equivalence margin of "does not lower the advantage", in advantage units (0 = baseline, 1 = perfect)
MARGIN = 0.05
#: the usability guard's share of the undefended model's gain over the constant prediction
USABLE_SHARE = 0.1
#: seeds the published table is run at (experiments/bench_grid.toml; the grid's default)
PUBLISHED_SEEDS = 5


def _clean(xs: Iterable[float | None]) -> list[float]:
    return [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def t_test(xs: Iterable[float | None]) -> dict[str, float]:
    """One-sample t-test of ``xs`` against 0: ``mean``, ``se``, ``n``, ``df``, one-sided ``p_above``
    / ``p_below`` (nan with n < 2; zero spread: 0 on the side of a nonzero mean, else 1)."""
    v = _clean(xs)
    n = len(v)
    m = statistics.fmean(v) if v else float("nan")
    sd = statistics.stdev(v) if n > 1 else float("nan")
    se = sd / math.sqrt(n) if n > 1 else float("nan")
    out = {"mean": m, "sd": sd, "se": se, "n": n, "df": n - 1}
    if n < 2:
        out.update(p_above=float("nan"), p_below=float("nan"))
    elif not se > 0:
        out.update(p_above=0.0 if m > 0 else 1.0, p_below=0.0 if m < 0 else 1.0)
    else:
        from scipy import stats

        t = m / se
        out.update(p_above=float(stats.t.sf(t, n - 1)), p_below=float(stats.t.cdf(t, n - 1)))
    return out


def equivalence(test: dict[str, float], margin: float) -> float:
    """TOST p-value (H1: ``|mean| < margin``) of a :func:`t_test` result; nan with n < 2."""
    m, se, n = test["mean"], test["se"], test["n"]
    if n < 2:
        return float("nan")
    if not se > 0:
        return 0.0 if abs(m) < margin else 1.0
    from scipy import stats

    return float(max(stats.t.sf((m + margin) / se, n - 1), stats.t.cdf((m - margin) / se, n - 1)))


def holm(ps: Sequence[float | None]) -> list[float | None]:
    """Holm–Bonferroni adjusted p-values (Holm 1979): the i-th smallest of the m p-values (i from 0)
    times m − i, made non-decreasing, capped at 1. Keeping a verdict only where its adjusted p is
    under α bounds the chance of any false verdict in the table by α, whatever the dependence
    between the tests. ``None`` / ``nan`` entries are not tests: they stay and do not count in m.
    (The experiments' claim table uses this one too: experiments/verdicts.py.)"""
    order = sorted((i for i, p in enumerate(ps) if p is not None and p == p), key=lambda i: ps[i])
    out: list[float | None] = list(ps)
    run = 0.0
    for k, i in enumerate(order):
        run = max(run, min(1.0, (len(order) - k) * float(ps[i])))
        out[i] = run
    return out


def defence_channel(defence: str, protect: str) -> set[str]:
    """The channels a defence perturbs: a cut-layer mechanism noises what the protected party
    releases (a guest's activations, the host's gradients; both under ``--protect both``); DP-SGD
    only the protected party's parameter updates, which no bench attack reads."""
    if defence in ("none", "", "dpsgd"):
        return set()
    return {"guest activations", "host gradients"} if protect == "both" else (
        {"guest activations"} if protect == "guest" else {"host gradients"})


def attack_channel(adversary: str) -> str:
    """What an attack reads, by its adversary: the host reads the guests' activations, a guest the
    host's gradients."""
    return "guest activations" if adversary == "host" else "host gradients"


def constant_prediction(config: dict[str, Any]) -> float | None:
    """The test metric of the best constant prediction on a cell's own split (the most frequent
    training label for accuracy, the 10 most frequent for hit@10; ``experiments/common.py``'s
    ``trivial_metric``): the level of a model that learned nothing. ``None`` for other metrics and
    for the user's own tables."""
    import numpy as np

    from fl_split.config import RunConfig
    from fl_split.data.base import positions_of, split_ids
    from fl_split.data.registry import load_dataset

    cfg = RunConfig(**config)
    if getattr(cfg, "data", None):
        return None
    ds = load_dataset(cfg.dataset, cfg.data_root)
    if ds.metric not in ("accuracy", "hit@10"):
        return None
    train, test = split_ids(ds, cfg.test_fraction, cfg.seed, cfg.limit)
    y_train, y_test = ds.labels[positions_of(ds.ids, train)], ds.labels[positions_of(ds.ids, test)]
    k = 10 if ds.metric == "hit@10" else 1
    top = np.argsort(-np.bincount(y_train, minlength=ds.num_classes), kind="stable")[:k]
    return float(np.isin(y_test, top).mean())


def judge(rows: list[dict], attacks: dict[str, dict], protect: str, alpha: float = ALPHA,
          margin: float = MARGIN) -> dict[str, Any]:
    """The verdict of every defended cell of a bench table from its per-seed rows.

    ``rows``: tidy rows (``dataset, defence, epsilon, seed, party, metric, value``; the per-seed ones
    are used: ``utility``, ``ATTACK:advantage`` and ``constant_prediction``); ``attacks``: each
    attack's ``adversary`` / ``victim``. Returns ``cells``: ``{(dataset, defence, ε): verdict}``, each with
    ``verdict``, ``seeds``, ``usable``, ``attacks`` (per attack: ``outcome`` — lowered, not lowered,
    unsettled, uninformative, not applicable — the mean paired difference, its se, the raw and
    Holm-adjusted p) and ``note``; and ``leaders`` (:func:`_leaders`), in the same Holm family."""
    per: dict[tuple, dict[int, dict[str, float]]] = {}
    for r in rows:
        if r["seed"] in ("mean", "", None):
            continue
        eps = None if r["epsilon"] in ("", None) else float(r["epsilon"])
        key = (r["dataset"], r["defence"], eps)
        per.setdefault(key, {}).setdefault(int(r["seed"]), {})[r["metric"]] = float(r["value"])
    out: dict[tuple, dict[str, Any]] = {}
    family: list[tuple[tuple, str, float]] = []
    for key, seeds in per.items():
        ds, d, eps = key
        none = per.get((ds, "none", None))
        if d == "none" or none is None:
            continue
        common = sorted(set(seeds) & set(none))
        res: dict[str, Any] = {"seeds": len(common), "attacks": {}, "note": ""}
        util = t_test([seeds[s]["utility"] - none[s]["utility"] for s in common])
        res["utility_change"] = {"mean": util["mean"], "se": util["se"]}
        triv = [s for s in common if "constant_prediction" in none[s]]  # recorded with the undefended cell
        if len(triv) == len(common) and common:
            gain = t_test([seeds[s]["utility"] - none[s]["constant_prediction"] for s in common])
            nd_gain = statistics.fmean(none[s]["utility"] - none[s]["constant_prediction"] for s in common)
            share = gain["mean"] / nd_gain if nd_gain > 0 else float("nan")
            res["usable"] = bool(gain["p_above"] < alpha and nd_gain > 0 and share >= USABLE_SHARE)
            res["usable_share"] = share
        else:
            res["usable"] = None  # no constant prediction recorded: not checked
        for a, meta in sorted(attacks.items()):  # a fixed order, whatever order the cells came in
            m = f"{a}:advantage"
            if not all(m in seeds[s] and m in none[s] for s in common) or not common:
                continue
            if attack_channel(meta["adversary"]) not in defence_channel(d, protect):
                res["attacks"][a] = {"outcome": NOT_APPLICABLE}
                continue
            base = t_test([none[s][m] for s in common])
            if base["n"] >= 2 and not base["p_above"] < alpha:  # one seed: left to the cell's n >= 2 guard
                res["attacks"][a] = {"outcome": UNINFORMATIVE, "undefended": base["mean"]}
                continue
            diff = t_test([seeds[s][m] - none[s][m] for s in common])
            p_eq = equivalence(diff, margin)
            p = (float("nan") if diff["n"] < 2 else min(1.0, 2 * min(diff["p_below"], p_eq)))
            res["attacks"][a] = {"outcome": None, "diff": diff["mean"], "se": diff["se"], "p_lower": diff["p_below"],
                                 "p_equal": p_eq, "p": p, "undefended": base["mean"]}
            family.append((res["attacks"][a], p))
        out[key] = res
    leaders = _leaders(per, out, attacks, family)
    adjusted = holm([p for _, p in family])
    for (t, _), q in zip(family, adjusted):
        t["p_holm"] = q
    for res in out.values():
        for t in res["attacks"].values():
            if "p" in t:
                q = t["p_holm"]
                t["outcome"] = ("unsettled" if q is None or not q < alpha else
                                "lowered" if t["p_lower"] <= t["p_equal"] else "not lowered")
        res["verdict"], res["note"] = _cell_verdict(res)
    for lead in leaders:
        lead["separated"] = all(c["p_holm"] is not None and c["p_holm"] < alpha and c["diff"] < 0
                                for c in lead["against"])
    return {"cells": out, "leaders": leaders}


def _leaders(per: dict, out: dict, attacks: dict, family: list) -> list[dict[str, Any]]:
    """Per dataset, ε and attack: the defence with the lowest mean advantage among those the attack
    is judged on, and a two-sided paired t-test of it against each other one (into ``family``).
    "Lowest" is claimed only where every one of those tests is significant after Holm: a wrong claim
    needs one of them wrong in its direction, which the family's correction covers."""
    from collections import defaultdict

    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for key, res in sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1], -1 if kv[0][2] is None else kv[0][2])):
        for a, t in res["attacks"].items():
            if "p" in t and res["seeds"] >= 2 and res.get("usable") is not False:  # a useless model is no leader
                groups[(key[0], key[2], a)].append(key)
    leaders = []
    for (ds, eps, a), keys in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if len(keys) < 2:
            continue
        m = f"{a}:advantage"
        mean = {k: statistics.fmean(per[k][s][m] for s in per[k] if m in per[k][s]) for k in keys}
        best = min(keys, key=lambda k: mean[k])
        lead = {"dataset": ds, "epsilon": eps, "attack": a, "defence": best[1], "mean": mean[best], "against": []}
        for k in sorted(keys, key=lambda k: k[1]):
            if k == best:
                continue
            common = sorted(set(per[best]) & set(per[k]))
            d = t_test([per[best][s][m] - per[k][s][m] for s in common])
            p = float("nan") if d["n"] < 2 else min(1.0, 2 * min(d["p_below"], d["p_above"]))
            c = {"defence": k[1], "diff": d["mean"], "se": d["se"], "p": p}
            lead["against"].append(c)
            family.append((c, p))
        leaders.append(lead)
    return leaders


def _cell_verdict(res: dict[str, Any]) -> tuple[str, str]:
    outcomes = [t["outcome"] for t in res["attacks"].values()]
    judged = [o for o in outcomes if o not in (NOT_APPLICABLE, UNINFORMATIVE)]
    if not outcomes or all(o == NOT_APPLICABLE for o in outcomes):
        return NOT_APPLICABLE, "the defence does not touch the channel any attack here reads"
    if res["seeds"] < 2:  # before the attacks' guard, which needs a standard error too
        return INCONCLUSIVE, f"{res['seeds']} seed: no standard error"
    if not judged:
        return UNINFORMATIVE, "no attack beats its baseline undefended"
    low = judged.count("lowered")
    if low == len(judged):
        verdict = HOLDS
    elif low:
        verdict = PARTLY
    elif judged.count("not lowered") == len(judged):
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    if verdict in (HOLDS, PARTLY) and res.get("usable") is False:
        return UNINFORMATIVE, (f"would read '{verdict}', but the model is not usable (keeps "
                               f"{res.get('usable_share', float('nan')):.0%} of the undefended gain over the "
                               "constant prediction): it learned nothing, so it proves nothing about the defence")
    note = ("" if res["seeds"] >= PUBLISHED_SEEDS
            else f"{res['seeds']} seeds (the published table has ≥ {PUBLISHED_SEEDS})")
    return verdict, note


def outcome_text(a: str, t: dict[str, Any]) -> str:
    """One attack's outcome for a table cell: ``property lowered −0.84 ± 0.02 (Holm p 0.001)``."""
    if t["outcome"] in (NOT_APPLICABLE, UNINFORMATIVE):
        return f"{a} {t['outcome']}"
    se = t["se"]
    sd = f" ± {se:.2f}" if se == se else ""
    q = t.get("p_holm")
    return f"{a} {t['outcome']} {t['diff']:+.2f}{sd}" + (f" (Holm p {q:.3g})" if q is not None and q == q else "")


__all__ = ["ALPHA", "MARGIN", "PUBLISHED_SEEDS", "VERDICTS", "attack_channel", "constant_prediction", "defence_channel",
           "equivalence",
           "holm", "judge", "outcome_text", "t_test"]
