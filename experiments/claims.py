"""Gather every experiment's ``claims.json`` into one claim table (``results/claims.md``).

Each ``experiments/expN_*.py`` writes ``results/<name>/claims.json``: per paper claim, its source,
the paper's number, ours (mean ± sd over seeds, on our datasets), the verdict — holds, partly
holds, does not hold, uninformative (cannot be judged here), not applicable (the defence does not touch
the channel the attack reads), inconclusive (not settled by the seeds), or "new" for a question no paper
answered — the rule that decided it, and the p-value it rests on. This script collects them in
experiment order and applies the table-wide rules (:func:`correct`: n ≥ 2 seeds, Holm–Bonferroni over
the table's p-values), so the table at the top of ``experiments/README.md`` can be regenerated:

    .venv/bin/python experiments/claims.py                 # writes experiments/results/claims.md
    .venv/bin/python experiments/claims.py --readme        # and the table + counts in experiments/README.md
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
#: Pre-registration (experiments/README.md, "Verdict rules"): the seeds each claim's verdict is read on,
#: fixed before their runs, and the seed lists it was read on before ("looks"). A claim not listed is
#: read once, on the experiments' default seeds 0, 1, 2. A claim read on k seed lists (the earlier looks
#: and, once its declared seeds are all run, those) carries min(1, k × p) into Holm's correction:
#: Bonferroni over the looks, so adding seeds after a first look cannot raise the chance of a false
#: verdict (valid whatever the dependence between the looks). A declared list not yet run is shown
#: as such; its claim is read on the seeds that were run.
SEED_PLAN: dict[str, dict] = {
    # exp2 --settle (issue 26): read on seeds 0-2, then 0-9 (fixed before that run)
    "2-digits-guest": {"seeds": tuple(range(10)), "looks": [(0, 1, 2)]},
    "2-digits-host": {"seeds": tuple(range(10)), "looks": [(0, 1, 2)]},
    "2-movielens-small-guest": {"seeds": tuple(range(10)), "looks": [(0, 1, 2)]},
    # issue 37: more seeds where more seeds can settle the verdict, declared before the runs
    "2-movielens-small-host": {"seeds": tuple(range(20)), "looks": [(0, 1, 2), tuple(range(10))]},
    "2-best": {"seeds": tuple(range(10)), "looks": [],
               "pending": "every exp2 cell at 7 more seeds: ≈ 2.7 h on this 2-core machine (71 min per 3 seeds)"},
    "4c-σ": {"seeds": tuple(range(10)), "looks": [(0, 1, 2)]},
    "4d-σ": {"seeds": tuple(range(10)), "looks": [(0, 1, 2)]},
}
DEFAULT_SEEDS = (0, 1, 2)


def looks(c: dict) -> int:
    """How many seed lists ``c``'s verdict has been read on (:data:`SEED_PLAN`): the earlier looks,
    plus the declared list once the claim rests on all of its seeds."""
    plan = SEED_PLAN.get(c["id"])
    if plan is None:
        return 1
    done = int(c.get("n", len(DEFAULT_SEEDS))) >= len(plan["seeds"])
    return max(1, len(plan["looks"]) + int(done))


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


def tested(c: dict) -> bool:
    """Whether ``c``'s verdict rests on a test that enters Holm's family: every decided or inconclusive
    verdict on ≥ 2 seeds, whatever its significance, except deterministic counts and verdicts marked
    decided without a test (``tested: false``, e.g. a ranking of means)."""
    return (c["verdict"] in (*V.DECIDED, V.INCONCLUSIVE) and int(c.get("n", 2)) >= 2 and not c.get("deterministic")
            and c.get("tested", True))


def correct(rows: list[dict]) -> list[dict]:
    """The table-wide rules (experiments/README.md, "Verdict rules"), applied to the experiments'
    own verdicts: the n ≥ 2 guard (a claim on one seed is inconclusive); Bonferroni over the looks of
    a claim whose seeds were extended (:data:`SEED_PLAN`, :func:`looks`); then Holm–Bonferroni (Holm
    1979) over the p-values of *every* tested claim (:func:`tested`), significant or not — a decided
    verdict whose corrected p is not under α becomes inconclusive. Each tested row gets ``looks``
    and ``p_holm``; the experiment's own verdict stays in ``verdict_uncorrected`` where it changed.
    A tested claim without a p-value is refused (one line naming it): a test left out of the family
    would make the correction count only what came out significant."""
    rows = [V.guard(dict(c), int(c.get("n", 2))) for c in rows]
    missing = [c["id"] for c in rows if tested(c) and c.get("p") is None]
    if missing:
        raise SystemExit(f"claims: {', '.join(missing)} rest on a test but carry no p-value (every tested claim, "
                         "significant or not, enters Holm's correction; mark a verdict decided without a test "
                         "with tested=False)")
    ps = []
    for c in rows:
        if tested(c):
            c["looks"] = looks(c)
            ps.append(min(1.0, c["looks"] * float(c["p"])))
        else:
            ps.append(None)
    for c, q in zip(rows, V.holm(ps)):
        if q is None:
            continue
        c["p_holm"] = q
        if c["verdict"] in V.DECIDED and q >= V.ALPHA:
            c["verdict_uncorrected"] = c["verdict"]
            c["verdict"] = V.INCONCLUSIVE
    return rows


def _seeds(c: dict) -> str:
    """The seeds column: the seeds the verdict rests on, the looks, a declared list not yet run."""
    plan = SEED_PLAN.get(c["id"])
    n = int(c.get("n", len(DEFAULT_SEEDS)))
    text = f"{n}"
    if plan is not None and n < len(plan["seeds"]):
        text += f" (declared: {len(plan['seeds'])}, not run: {plan.get('pending', 'pending')})"
    if c.get("looks", 1) > 1:
        text += f"; {c['looks']} looks (p × {c['looks']})"
    return text


def table(rows: list[dict]) -> str:
    """The claim table (Markdown) with its verdict counts and the rules of the correction."""
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
    lines = ["| # | experiment | source | claim | paper | ours | verdict | p / Holm p | seeds | rule |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        exp = c["experiment"].split("_")[0].replace("exp", "")
        lines.append(f"| {esc(c['id'])} | [{exp}](#{c['experiment'].replace('_', '-')}) | {esc(c['source'])} | "
                     f"{esc(c['claim'])} | {esc(c['paper'])} | {esc(c['ours'])} | {verdict(c)} | {pv(c)} | "
                     f"{esc(_seeds(c))} | {esc(c.get('rule') or '(no rule recorded)')} |")
    n = Counter(c["verdict"] for c in rows)
    lines.append("")
    lines.append("Verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(n.items(), key=lambda kv: (-kv[1], kv[0])))
                 + f" ({len(rows)} claims).")
    lines.append("")
    lines.append(f"**Multiple claims (Holm–Bonferroni).** Every claim whose verdict rests on a test carries its p-value, "
                 f"significant or not — a decided verdict the test that decided it, an inconclusive one the test that "
                 f"came closest to deciding it, a claim that needs a premise the larger of its own and the premise's. "
                 f"A claim whose seeds were extended after a first look carries its p × the number of looks (the "
                 f"seeds column). Holm's step-down correction over those {m} p-values keeps a verdict only where its "
                 f"adjusted p is under {V.ALPHA} (the chance of any false verdict among them is then at most "
                 f"{V.ALPHA}); a verdict significant alone but not after the correction reads *inconclusive* (alone: "
                 "…). A claim judged over several cells carries the largest p among the cells its verdict needs. "
                 "Verdicts decided without a test (deterministic counts, a ranking of means) and the uninformative, "
                 "not applicable and new ones show – or enter no family.")
    lines.append("")
    lines.append("*uninformative*: the claim cannot be judged here (the model is at its constant prediction or at "
                 "the host alone, the undefended attack does not beat its baseline, a premise fails, or the "
                 "comparison is equal by construction); *not applicable*: the defence credited does not touch the "
                 "channel the attack reads; *inconclusive*: the seeds do not settle it — the test on the standard "
                 "error is not significant, fewer than 2 seeds, or not significant after the correction. Seeds, "
                 "statistic and threshold of each verdict are in its rule.")
    return "\n".join(lines)


README = HERE / "README.md"
BEGIN = "<!-- claims.py: generated from here -->"
END = "<!-- claims.py: generated up to here -->"


def readme_block(text: str) -> str:
    """The claim table as it stands between the markers of experiments/README.md."""
    return f"{BEGIN}\n{text}\n{END}"


def write_readme(text: str, path: Path = README) -> None:
    """Replace the generated block of ``path`` (between :data:`BEGIN` and :data:`END`) with ``text``."""
    doc = path.read_text()
    if doc.count(BEGIN) != 1 or doc.count(END) != 1:
        raise SystemExit(f"claims: {path} needs exactly one '{BEGIN}' and one '{END}' line around the claim table")
    head, rest = doc.split(BEGIN)
    tail = rest.split(END)[1]
    path.write_text(head + readme_block(text) + tail)


def generated(results: Path = RESULTS) -> str:
    """The table and counts claims.py computes from the committed ``results`` (what the README shows)."""
    return table(correct(collect(results)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default="", help="default: <results>/claims.md")
    ap.add_argument("--readme", action="store_true",
                    help="also write the table and counts into experiments/README.md between its markers")
    args = ap.parse_args(argv)
    text = generated(Path(args.results))
    out = Path(args.out) if args.out else Path(args.results) / "claims.md"
    out.write_text(text + "\n")
    if args.readme:
        write_readme(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
