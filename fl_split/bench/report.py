"""What ``fl-split bench`` writes from its finished cells: the tidy CSV, the Markdown leaderboard and
the curves.

* ``bench.csv`` — one row per (dataset, defence, ε, seed, party, metric, value). ε is the target every
  guest was calibrated to (empty for ``none``); party is whose number it is (``host`` for utility, the
  ledger's party for ``epsilon``, the attacked party for ``ATTACK:…`` rows, ``guests`` for the calibrated
  parameter). Per-seed rows: ``utility``, ``epsilon``, ``epsilon_within_tolerance``, ``parameter:NAME``,
  ``ATTACK:METRIC`` (raw), ``ATTACK:baseline``, ``ATTACK:advantage``. Rows with seed ``mean`` hold the
  scores VFLAIR computes from seed means (:mod:`fl_split.bench.scores`): ``ATTACK:dcs``,
  ``t-dcs:TYPE`` and ``c-dcs``.
* ``leaderboard.md`` — per dataset and target ε, the defences ranked by C-DCS, with utility, each
  attack's advantage (mean ± sd over seeds) and the ε each party's ledger reported.
* ``<dataset>.png`` — utility vs ε, each attack's advantage vs ε (titled adversary → victim), and DCS
  (C-DCS) vs ε; the undefended run as a dotted line.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

from fl_split.bench.scores import attack_type, c_dcs, dcs, t_dcs

FIELDS = ["dataset", "defence", "epsilon", "seed", "party", "metric", "value"]


def _ms(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (float("nan"), 0.0)


def _fmt(m: float, s: float, d: int = 3) -> str:
    return "–" if m != m else (f"{m:.{d}f} ± {s:.{d}f}" if s else f"{m:.{d}f}")


def summarise(cells: list[dict]) -> dict[str, Any]:
    """Means over seeds per (dataset, defence, ε) and VFLAIR's scores from them."""
    attacks: dict[str, dict] = {}
    groups: dict[tuple, list[dict]] = {}
    not_applicable: dict[str, dict[str, str]] = {}
    for c in cells:
        attacks.update(c.get("attacks", {}))
        r0 = c["rows"][0]
        not_applicable.setdefault(r0["dataset"], {}).update(c.get("not_applicable", {}))
        groups.setdefault((r0["dataset"], r0["defence"], r0["epsilon"]), []).extend(c["rows"])
    summary: dict[tuple, dict] = {}
    for key, rows in groups.items():
        by: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            by.setdefault((r["party"], r["metric"]), []).append(float(r["value"]))
        s = {"utility": _ms(by.get(("host", "utility"), [])), "seeds": len(by.get(("host", "utility"), [])),
             "epsilon": {p: max(v) for (p, m), v in by.items() if m == "epsilon"},
             "within": all(v == 1.0 for (p, m), vs in by.items() if m == "epsilon_within_tolerance" for v in vs),
             "parameter": {m.split(":", 1)[1]: v[0] for (p, m), v in by.items() if m.startswith("parameter:")},
             "advantage": {m.rsplit(":", 1)[0]: _ms(v) for (p, m), v in by.items() if m.endswith(":advantage")}}
        summary[key] = s
    for (ds, d, eps), s in summary.items():
        none = summary.get((ds, "none", None))
        s["dcs"] = {}
        if none is not None:
            mp_star = none["utility"][0]
            s["dcs"] = {a: dcs(ap[0], s["utility"][0], mp_star) for a, ap in s["advantage"].items()}
        s["t_dcs"] = t_dcs(s["dcs"])
        s["c_dcs"] = c_dcs(s["t_dcs"])
    return {"summary": summary, "attacks": attacks, "not_applicable": not_applicable}


def _ran(summ: dict[str, Any], grid, ds: str) -> list[str]:
    """The grid's attacks that ran on ``ds`` (an attack refused there, e.g. feature inference on images,
    has no column)."""
    S = summ["summary"]
    return [a for a in grid.attacks if any(a in s["advantage"] for k, s in S.items() if k[0] == ds)]


def tidy_rows(cells: list[dict], summ: dict[str, Any]) -> list[dict]:
    rows = [r for c in cells for r in c["rows"]]
    for (ds, d, eps), s in summ["summary"].items():
        base = dict(dataset=ds, defence=d, epsilon=eps, seed="mean")
        for a, v in s["dcs"].items():
            rows.append(dict(base, party=summ["attacks"][a]["victim"], metric=f"{a}:dcs", value=v))
        for t, v in s["t_dcs"].items():
            rows.append(dict(base, party="all", metric=f"t-dcs:{t}", value=v))
        if s["c_dcs"] is not None:
            rows.append(dict(base, party="all", metric="c-dcs", value=s["c_dcs"]))
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else (repr(r[k]) if isinstance(r[k], float) else r[k])) for k in FIELDS})


def leaderboard(grid, summ: dict[str, Any], meta: dict[str, Any], verdicts: dict[tuple, dict] | None = None) -> str:
    from fl_split.bench import verdicts as V

    verdicts = (verdicts or {}).get("cells", {})
    S, A = summ["summary"], summ["attacks"]
    lines = [f"# fl-split bench leaderboard\n",
             f"Seeds {list(grid.seeds)}, {grid.guests} guest(s), {grid.epochs} epochs, `--protect {grid.protect}`; "
             f"every defence calibrated (no training, the real ledger) so that each guest's ε after training is the "
             f"target within {meta['tolerance']:.0%}, never above (PLD, δ = {meta['delta']:g}, no amplification). "
             "Utility = the host's test metric; for each attack its advantage over its trivial baseline (0 = the "
             "baseline, 1 = perfect), mean ± sd over seeds, with adversary → victim. DCS is VFLAIR's Defense "
             "Capability Score (Zou et al. 2023; β = 0.5, AP* = 0, MP* = the undefended utility, one-sided "
             "distances, from seed means); T-DCS averages it per attack type, C-DCS over types. Our AP is the "
             "advantage, VFLAIR's the raw attack metric. Ranked by C-DCS (higher is better); **ε reported** is the "
             "largest ε each party's ledger reported over the seeds (– = no claim for that party). **Verdict**: "
             "\"protects against the attacks on the channel it perturbs\", from paired t-tests of each attack's "
             "per-seed advantage against the undefended run on the same seeds (and an equivalence test, margin "
             f"{V.MARGIN}), Holm over the table at {V.ALPHA} (fl_split/bench/verdicts.py; the published table "
             f"has ≥ {V.PUBLISHED_SEEDS} seeds).\n"]
    if meta.get("failed"):
        lines.append(f"**{len(meta['failed'])} cell(s) failed** and are missing: "
                     + "; ".join(meta["failed"]) + "\n")
    for ds in grid.datasets:
        lines.append(f"## {ds}\n")
        names = _ran(summ, grid, ds)
        for a, why in sorted(summ["not_applicable"].get(ds, {}).items()):
            lines.append(f"*{a}* is not applicable here: {why}\n")
        none = S.get((ds, "none", None))
        for eps in grid.epsilons or [None]:
            keys = [(ds, d, eps) for d in grid.defences if d != "none" and (ds, d, eps) in S]
            keys.sort(key=lambda k: -(S[k]["c_dcs"] if S[k]["c_dcs"] is not None else -1))
            if eps is not None:
                lines.append(f"### target ε = {eps:g}\n")
            hdr = ["rank", "defence", "parameter", "utility"] + [
                f"{a} ({A[a]['adversary']} → {A[a]['victim']})" for a in names] + \
                [f"DCS {a}" for a in names] + ["C-DCS", "ε reported", "verdict"]
            out = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
            # defences without a DP event (plug-ins: "no privacy claimed") ran once, uncalibrated: shown
            # under every ε beside the undefended run, never ranked against an ε they do not claim
            unclaimed = [("no claim", (ds, d, None)) for d in grid.defences if d != "none" and (ds, d, None) in S]
            rows = ([("–", (ds, "none", None))] if none else []) + unclaimed + \
                [(str(i + 1), k) for i, k in enumerate(keys)]
            for rank, k in rows:
                s = S[k]
                eps_rep = ", ".join(f"{p} {v:.3g}" for p, v in sorted(s["epsilon"].items())) or "–"
                if k[1] != "none" and not s["within"]:
                    eps_rep += " (outside tolerance)"
                cells = [rank, k[1], ", ".join(f"{n} {v:.4g}" for n, v in s["parameter"].items()) or "–",
                         _fmt(*s["utility"])]
                cells += [_fmt(*s["advantage"][a]) if a in s["advantage"] else "–" for a in names]
                cells += [f"{s['dcs'][a]:.3f}" if a in s["dcs"] else "–" for a in names]
                cells += [f"**{s['c_dcs']:.3f}**" if s["c_dcs"] is not None else "–", eps_rep]
                cells.append(verdicts[k]["verdict"] if k in verdicts else "–")
                out.append("| " + " | ".join(cells) + " |")
            lines.append("\n".join(out) + "\n")
            if keys:
                lines.append(_winners(S, keys, names) + "\n")
            judged = [k for _, k in rows if k in verdicts]
            if judged:
                lines.append("Verdicts — " + "; ".join(
                    f"{k[1]}: **{verdicts[k]['verdict']}** ("
                    + ", ".join(V.outcome_text(a, t) for a, t in verdicts[k]["attacks"].items())
                    + (f"; {verdicts[k]['note']}" if verdicts[k]["note"] else "") + ")" for k in judged) + ".\n")
    return "\n".join(lines)


#: the markers of the generated block in experiments/README.md (tests/test_bench_verdicts.py)
BLOCK_START = "<!-- fl-split bench verdicts: generated, do not edit -->"
BLOCK_END = "<!-- end of fl-split bench verdicts -->"


def verdict_block(grid, summ: dict[str, Any], judged: dict[str, Any]) -> str:
    """The README's sentences about a bench table, produced from its verdicts (between
    :data:`BLOCK_START` and :data:`BLOCK_END`): per dataset and ε, which defences hold, partly hold,
    do not hold or are inconclusive, with each attack's paired difference and Holm p."""
    from fl_split.bench import verdicts as V

    S = summ["summary"]
    verdicts, leaders = judged["cells"], judged["leaders"]
    seeds = sorted({v["seeds"] for v in verdicts.values()})
    n_tests = (sum(1 for v in verdicts.values() for t in v["attacks"].values() if "p" in t)
               + sum(len(lead["against"]) for lead in leaders))
    lines = [BLOCK_START, "",
             f"Verdicts from `fl_split/bench/verdicts.py` on {', '.join(map(str, seeds))} paired seeds "
             f"(seeds {list(grid.seeds)}); {n_tests} paired tests in one Holm family at {V.ALPHA} (each defence "
             "against the undefended run, and the lowest advantage against each other defence); a difference "
             "is the defended advantage minus the undefended one, mean ± se over seeds.", ""]
    order = (V.HOLDS, V.PARTLY, V.FAILS, V.INCONCLUSIVE, V.UNINFORMATIVE, V.NOT_APPLICABLE)
    for ds in grid.datasets:
        for eps in grid.epsilons:
            keys = [(ds, d, eps) for d in grid.defences if (ds, d, eps) in verdicts]
            if not keys:
                continue
            parts = []
            for word in order:
                ks = [k for k in keys if verdicts[k]["verdict"] == word]
                if not ks:
                    continue
                said = []
                for k in ks:
                    v = verdicts[k]
                    tested = [V.outcome_text(a, t) for a, t in v["attacks"].items()
                              if t["outcome"] not in (V.NOT_APPLICABLE, V.UNINFORMATIVE)]
                    u = S[k]["utility"][0]
                    extra = (f": {', '.join(tested)}" if tested and word != V.NOT_APPLICABLE else "")
                    note = f" — {v['note']}" if v["note"] and word in (V.UNINFORMATIVE, V.INCONCLUSIVE) else ""
                    said.append(f"{k[1]} (utility {u:.3f}{extra}{note})")
                parts.append(f"*{word}*: " + "; ".join(said))
            for lead in (x for x in leaders if x["dataset"] == ds and x["epsilon"] == eps):
                vs = ", ".join(f"{c['defence']} {c['diff']:+.2f} ± {c['se']:.2f} (Holm p {c['p_holm']:.3g})"
                               for c in lead["against"])
                parts.append(f"lowest {lead['attack']} advantage on the means: {lead['defence']} ({lead['mean']:.2f}; "
                             + ("below each other defence" if lead["separated"] else "not below each other defence")
                             + f", difference to each: {vs})")
            lines.append(f"* **{ds}, ε = {eps:g}** — " + ". ".join(parts) + ".")
    sep = [f"{x['defence']} on {x['attack']} ({x['dataset']}, ε = {x['epsilon']:g})"
           for x in leaders if x["separated"]]
    counts = {w: sum(1 for v in verdicts.values() if v["verdict"] == w) for w in order}
    lines += ["", "In all: " + ", ".join(f"{w} {n}" for w, n in counts.items() if n) + f" of {len(verdicts)} defended "
              f"cells; the lowest advantage is below each other defence in {len(sep)} of {len(leaders)} (dataset, ε, "
              "attack) comparisons" + (": " + "; ".join(sep) if sep else "") + ".", "", BLOCK_END, ""]
    return "\n".join(lines)


def _winners(S: dict, keys: list[tuple], names: list[str]) -> str:
    """Which defence has the best utility, which the lowest attack advantage per attack, and which the
    best C-DCS at this ε (means over seeds; ties listed together)."""
    def best(f, low=False):
        vals = {k[1]: f(S[k]) for k in keys if f(S[k]) is not None and f(S[k]) == f(S[k])}
        if not vals:
            return "–"
        b = (min if low else max)(vals.values())  # ties at the shown precision are listed together
        return ", ".join(d for d, v in vals.items() if f"{v:.3f}" == f"{b:.3f}") + f" ({b:.3f})"

    parts = [f"best utility: {best(lambda s: s['utility'][0])}"]
    parts += [f"lowest {a} advantage: {best(lambda s, a=a: s['advantage'].get(a, (None,))[0], low=True)}"
              for a in names]
    parts.append(f"best C-DCS: {best(lambda s: s['c_dcs'])}")
    return "At this ε — " + "; ".join(parts) + "."


def plot(grid, summ: dict[str, Any], path_of) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S, A = summ["summary"], summ["attacks"]
    written = []
    for ds in grid.datasets:
        names = _ran(summ, grid, ds)
        panels = [("utility", "utility (host's test metric)")] + \
                 [(a, f"{a} advantage ({A[a]['adversary']} → {A[a]['victim']})") for a in names] + \
                 ([("c_dcs", "C-DCS (VFLAIR, higher is better)")] if names else [])
        ncols = min(3, len(panels))
        nrows = -(-len(panels) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), dpi=110, squeeze=False)
        flat = [ax for row in axes for ax in row]
        for ax in flat[len(panels):]:
            ax.set_visible(False)
        none = S.get((ds, "none", None))
        for ax, (what, title) in zip(flat, panels):
            for d in grid.defences:
                if d == "none":
                    continue
                pts = []
                for eps in grid.epsilons:
                    s = S.get((ds, d, eps))
                    if s is None:
                        continue
                    m, sd = (s["utility"] if what == "utility" else (s["c_dcs"], 0.0) if what == "c_dcs"
                             else s["advantage"].get(what, (float("nan"), 0.0)))
                    if m is not None:
                        pts.append((eps, m, sd))
                if pts:
                    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                                capsize=3, label=d)
            if none is not None:
                ref = (none["utility"][0] if what == "utility" else none["c_dcs"] if what == "c_dcs"
                       else none["advantage"].get(what, (None,))[0])
                if ref is not None:
                    ax.axhline(ref, color="grey", ls=":", lw=1, label="no defence")
            for d in grid.defences:  # no privacy claimed: one uncalibrated run, a dashed line
                s = S.get((ds, d, None)) if d != "none" else None
                if s is not None:
                    ref = (s["utility"][0] if what == "utility" else s["c_dcs"] if what == "c_dcs"
                           else s["advantage"].get(what, (None,))[0])
                    if ref is not None:
                        ax.axhline(ref, ls="--", lw=1, color="black", alpha=0.6, label=f"{d} (no privacy claimed)")
            ax.set_xscale("log")
            ax.set_xlabel(f"target ε per guest (PLD, δ = {1e-5:g})", fontsize=8)
            ax.set_title(title, fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7, loc="best")
        fig.suptitle(f"{ds}: matched accounted ε, seeds {list(grid.seeds)}", fontsize=10)
        fig.tight_layout()
        p = path_of(ds)
        fig.savefig(p)
        plt.close(fig)
        written.append(p)
    return written


__all__ = ["BLOCK_END", "BLOCK_START", "FIELDS", "summarise", "tidy_rows", "verdict_block", "write_csv",
           "leaderboard", "plot"]
