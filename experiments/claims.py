"""Gather every experiment's ``claims.json`` into one claim table (``results/claims.md``).

Each ``experiments/expN_*.py`` writes ``results/<name>/claims.json``: per paper claim, its source,
the paper's number, ours (mean ± sd over seeds, on our datasets), the verdict — holds, partly
holds, does not hold, uninformative (cannot be judged here), inconclusive (within the seed spread), or
"new" for a question no paper answered — and the rule that decided it. This script only collects them,
in experiment order, so the table at the top of ``experiments/README.md`` can be regenerated:

    .venv/bin/python experiments/claims.py                 # writes experiments/results/claims.md
    .venv/bin/python experiments/claims.py --results DIR   # another results folder (e.g. quick runs)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
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


def table(rows: list[dict]) -> str:
    def esc(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    lines = ["| # | experiment | source | claim | paper | ours | verdict | rule |", "|---|---|---|---|---|---|---|---|"]
    for c in rows:
        exp = c["experiment"].split("_")[0].replace("exp", "")
        lines.append(f"| {esc(c['id'])} | [{exp}](#{c['experiment'].replace('_', '-')}) | {esc(c['source'])} | "
                     f"{esc(c['claim'])} | {esc(c['paper'])} | {esc(c['ours'])} | **{esc(c['verdict'])}** | "
                     f"{esc(c.get('rule') or '(no rule recorded)')} |")
    n = Counter(c["verdict"] for c in rows)
    lines.append("")
    lines.append("Verdicts: " + ", ".join(f"{k} {v}" for k, v in n.most_common()) + ".")
    lines.append("")
    lines.append("*uninformative*: the claim cannot be judged here (the model is at its constant prediction, the "
                 "undefended attack does not beat its baseline, or the comparison is equal by construction); "
                 "*inconclusive*: the difference that decides it is within the seed spread. Seeds, statistic and "
                 "threshold of each verdict are in its rule.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default="", help="default: <results>/claims.md")
    args = ap.parse_args(argv)
    rows = collect(Path(args.results))
    text = table(rows)
    out = Path(args.out) if args.out else Path(args.results) / "claims.md"
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
