"""The scenario matrix: the product's axes tested together, as a user meets them (tests/README.md,
"The scenario matrix").

Each feature of fl_split is tested alone elsewhere; a user runs their cross-product — their own key
kind × file format × columns × task × defence × whom it protects × engine × what they do next. This
module names those axes, the pairs of values that cannot meet (with the reason), and builds a
**pairwise covering array**: a list of scenarios in which every allowed pair of values of any two
axes occurs at least once. :mod:`tests.test_scenarios` runs each scenario end to end and checks the
coverage independently.

The array is generated (greedy, AETG-style: each new scenario is the candidate that covers the most
uncovered pairs per second of expected run time), deterministically from a fixed seed, so a reviewer
reads the same list the tests run. It is cost-aware because the engines differ by an order of
magnitude (a loopback deployment ~30-60 s, a Flower simulation ~30 s, the local engine ~3 s): the
expensive engines appear in few scenarios (the minimum their pairs need), the local engine in the rest.

Where an axis value is not a separate run of the matrix, the pair is covered by a named test
elsewhere (:data:`COVERED_ELSEWHERE`), and the coverage test checks that test still exists.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

#: every axis and its values, in the order the scenario ids print them
AXES: dict[str, tuple[str, ...]] = {
    # integer IDs; e-mail text; text over 40 characters with non-ASCII; a two-column key (text + integer)
    "ids": ("int", "text", "long-text", "composite"),
    "file": ("csv", "parquet"),
    # numbers only; text categories with empty cells in every party's table
    "columns": ("numeric", "categories"),
    "task": ("binary", "multiclass", "regression"),
    "defence": ("none", "laplace", "gaussian", "rr", "r3elu", "dpsgd", "plugin"),
    "protect": ("guest", "host", "both"),
    "engine": ("local", "flower", "deploy"),
    # after training with --save-model: predict new rows and join them back on the user's own key; or
    # continue from the saved model (--init-from); or be killed mid-run and --resume
    "lifecycle": ("predict", "init-from", "resume"),
}

#: pairs that cannot meet in one run, with the reason (the coverage test skips exactly these)
EXCLUDED: dict[tuple[tuple[str, str], tuple[str, str]], str] = {
    (("defence", "none"), ("protect", "host")): "--protect says whom a defence protects: without one it means nothing",
    (("defence", "none"), ("protect", "both")): "--protect says whom a defence protects: without one it means nothing",
    (("defence", "rr"), ("protect", "host")): "randomized response binarises forward releases; it has no backward form",
    (("defence", "rr"), ("protect", "both")): "randomized response binarises forward releases; it has no backward form",
    # a kill and --resume of a Flower simulation or a deployment costs two runs of that engine: those
    # pairs are covered by the dedicated tests below, the resume pairs of every other axis here
    (("engine", "flower"), ("lifecycle", "resume")): "covered elsewhere",
    (("engine", "deploy"), ("lifecycle", "resume")): "covered elsewhere",
    # --init-from of a deployment is a second deployment: covered by the dedicated test below
    (("engine", "deploy"), ("lifecycle", "init-from")): "covered elsewhere",
}

#: the test that covers each pair marked "covered elsewhere" (file::name; checked to exist)
COVERED_ELSEWHERE: dict[tuple[tuple[str, str], tuple[str, str]], str] = {
    (("engine", "flower"), ("lifecycle", "resume")):
        "tests/test_flower_checkpoint.py::test_flower_run_killed_mid_epoch_resumes_to_the_same_accounting",
    (("engine", "deploy"), ("lifecycle", "resume")):
        "tests/test_warm.py::test_deployment_with_a_sigkilled_party_stops_in_one_line_and_resumes",
    (("engine", "deploy"), ("lifecycle", "init-from")):
        "tests/test_init_from_flower.py::test_deployment_nodes_read_their_own_part_from_their_node_config",
}

#: expected seconds of one scenario per engine (measured on the 2-core machine; only ratios matter)
COST = {"local": 4.0, "flower": 35.0, "deploy": 45.0}
SEED = 20261129


@dataclass(frozen=True)
class Scenario:
    """One combination of axis values: what one user run (train, then its lifecycle step) uses."""

    ids: str
    file: str
    columns: str
    task: str
    defence: str
    protect: str
    engine: str
    lifecycle: str

    @property
    def name(self) -> str:
        return "-".join(getattr(self, a.replace("-", "_")) for a in AXES)

    def pairs(self) -> set[tuple[tuple[str, str], tuple[str, str]]]:
        items = [(a, getattr(self, a)) for a in AXES]
        return {(x, y) for x, y in itertools.combinations(items, 2)}


def _allowed(items: dict[str, str]) -> bool:
    """No excluded pair among the (partly) chosen values."""
    chosen = [(a, v) for a, v in items.items() if v is not None]
    return not any((x, y) in EXCLUDED for x, y in itertools.combinations(chosen, 2))


def required_pairs() -> set[tuple[tuple[str, str], tuple[str, str]]]:
    """Every pair of values of two different axes that the matrix must cover (axes in :data:`AXES`'s
    order within a pair), less :data:`EXCLUDED`."""
    names = list(AXES)
    out = set()
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for va in AXES[a]:
                for vb in AXES[b]:
                    pair = ((a, va), (b, vb))
                    if pair not in EXCLUDED:
                        out.add(pair)
    return out


def generate(candidates: int = 60) -> list[Scenario]:
    """The covering array (module docstring): deterministic for :data:`SEED`."""
    rng = random.Random(SEED)
    todo = required_pairs()
    names = list(AXES)
    rows: list[Scenario] = []
    while todo:
        best, best_score = None, -1.0
        # seed each candidate with an uncovered pair (so every step makes progress), fill the other
        # axes one at a time in random order with the value that covers most uncovered pairs
        seeds = sorted(todo)
        for _ in range(candidates):
            (a, va), (b, vb) = seeds[rng.randrange(len(seeds))]
            row: dict[str, str | None] = {n: None for n in names}
            row[a], row[b] = va, vb
            order = [n for n in names if row[n] is None]
            rng.shuffle(order)
            for n in order:
                options = list(AXES[n])
                rng.shuffle(options)
                scored = []
                for v in options:
                    row[n] = v
                    if not _allowed(row):
                        continue
                    gain = sum(1 for m in names if m != n and row[m] is not None
                               and (tuple(sorted([(n, v), (m, row[m])], key=lambda p: names.index(p[0]))))
                               in todo)
                    scored.append((gain / (COST[row["engine"]] if n == "engine" else 1.0), v))
                row[n] = max(scored)[1] if scored else None
            if any(v is None for v in row.values()):
                continue
            s = Scenario(**{k.replace("-", "_"): v for k, v in row.items()})
            gain = len(s.pairs() & todo)
            score = gain / COST[s.engine]
            if gain and score > best_score:
                best, best_score = s, score
        if best is None:
            raise RuntimeError("no allowed scenario covers the remaining pairs: check EXCLUDED")
        rows.append(best)
        todo -= best.pairs()
    return rows


SCENARIOS = generate()
