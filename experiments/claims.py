"""Gather every experiment's ``claims.json`` into one claim table (``results/claims.md``).

Each ``experiments/expN_*.py`` writes ``results/<name>/claims.json``: per paper claim, its source,
the paper's number, ours (mean ± sd over seeds, on our datasets), the verdict — holds, partly
holds, does not hold, uninformative (cannot be judged here), not applicable (the defence does not touch
the channel the attack reads), inconclusive (not settled by the seeds), or "new" for a question no paper
answered — the rule that decided it, and the p-value it rests on. This script collects them in
experiment order and applies the table-wide rules (:func:`correct`: n ≥ 2 seeds, Holm–Bonferroni over
the table's p-values), so the table at the top of ``experiments/README.md`` can be regenerated:

    .venv/bin/python experiments/claims.py                 # writes experiments/results/claims.md
    .venv/bin/python experiments/claims.py --results DIR   # another results folder (e.g. quick runs)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
if str(HERE.parent) not in sys.path:  # run as `python experiments/claims.py`
    sys.path.insert(0, str(HERE.parent))
from experiments import verdicts as V  # noqa: E402
ORDER = ("exp1_merge_padding", "exp2_utility_epsilon", "exp3_property_reconstruction", "exp4_fsha", "exp5_denoising",
         "exp6_rr_vs_laplace", "exp7_cut_layer_labels", "exp8_privacy_utility_attacks")


def collect(results: Path) -> list[dict]:
    rows = []
    for name in ORDER:
        p = results / name / "claims.json"
        if p.exists():
            for c in json.loads(p.read_text()):
                rows.append({**c, "experiment": name})
    return rows


def correct(rows: list[dict]) -> list[dict]:
    """The table-wide rules (issue 26), applied to the experiments' own verdicts: the n ≥ 2 guard
    (a claim on one seed is inconclusive), then Holm–Bonferroni over the p-values the decided
    verdicts rest on — a verdict whose test is significant alone (p < 0.05) but not after the
    correction over the table's m tests becomes inconclusive. Each row gets ``p_holm``; the
    experiment's own verdict stays in ``verdict_uncorrected`` where it changed."""
    rows = [V.guard(dict(c), int(c.get("n", 2))) for c in rows]
    adjusted = V.holm([c.get("p") if c["verdict"] in V.DECIDED else None for c in rows])
    for c, q in zip(rows, adjusted):
        if q is None:
            continue
        c["p_holm"] = q
        if c["p"] < V.ALPHA <= q:
            c["verdict_uncorrected"] = c["verdict"]
            c["verdict"] = V.INCONCLUSIVE
    return rows


def table(rows: list[dict]) -> str:
    def esc(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    def pv(c: dict) -> str:
        if c.get("p") is None:
            return "–"
        return f"{c['p']:.2g} / {c['p_holm']:.2g}" if "p_holm" in c else f"{c['p']:.2g}"

    def verdict(c: dict) -> str:
        was = c.get("verdict_uncorrected")
        if c["verdict"] == V.NOT_APPLICABLE:
            return f"**{V.NOT_APPLICABLE}**: the defence does not touch the channel the attack reads"
        return f"**{esc(c['verdict'])}**" + (f" (alone: {esc(was)}; not after Holm)" if was else "")

    m = sum("p_holm" in c for c in rows)
    lines = ["| # | experiment | source | claim | paper | ours | verdict | p / Holm p | rule |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        exp = c["experiment"].split("_")[0].replace("exp", "")
        lines.append(f"| {esc(c['id'])} | [{exp}](#{c['experiment'].replace('_', '-')}) | {esc(c['source'])} | "
                     f"{esc(c['claim'])} | {esc(c['paper'])} | {esc(c['ours'])} | {verdict(c)} | {pv(c)} | "
                     f"{esc(c.get('rule') or '(no rule recorded)')} |")
    n = Counter(c["verdict"] for c in rows)
    lines.append("")
    lines.append("Verdicts: " + ", ".join(f"{k} {v}" for k, v in n.most_common()) + ".")
    lines.append("")
    lines.append(f"**Multiple claims (Holm–Bonferroni).** The {m} verdicts that rest on a test carry its p-value; "
                 f"Holm's step-down correction over those {m} p-values keeps a verdict only where its adjusted p "
                 f"is under {V.ALPHA} (the chance of any false verdict among them is then at most {V.ALPHA}); a "
                 "verdict significant alone but not after the correction reads *inconclusive* (alone: …). A claim "
                 "judged over several cells carries the largest p among the cells its verdict needs. Verdicts "
                 "decided without a test (thresholds on means, deterministic counts, uninformative) show –.")
    lines.append("")
    lines.append("*uninformative*: the claim cannot be judged here (the model is at its constant prediction, the "
                 "undefended attack does not beat its baseline, or the comparison is equal by construction); "
                 "*not applicable*: the defence credited does not touch the channel the attack reads; "
                 "*inconclusive*: the seeds do not settle it — the test on the standard error is not significant, "
                 "fewer than 2 seeds, or not significant after Holm. Seeds, statistic and threshold of each "
                 "verdict are in its rule.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default="", help="default: <results>/claims.md")
    args = ap.parse_args(argv)
    rows = correct(collect(Path(args.results)))
    text = table(rows)
    out = Path(args.out) if args.out else Path(args.results) / "claims.md"
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
