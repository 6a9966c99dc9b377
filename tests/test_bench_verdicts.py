"""Verdicts on the bench table (issue 37, item 5; ``fl_split/bench/verdicts.py``): computed from the
per-seed numbers by paired tests against the undefended run, Holm over the table, in the claim
table's words; the committed README block is what the committed results give."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from fl_split.bench import report, tables
from fl_split.bench import verdicts as V
from fl_split.bench.grid import make_grid

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = {"property": {"adversary": "host", "victim": "guest-1"},
           "reconstruction": {"adversary": "host", "victim": "guest-1"},
           "label-direction": {"adversary": "guest-1", "victim": "host"}}


def _rows(cells: dict[str, dict[str, list[float]]], seeds: int, eps: float = 8.0) -> list[dict]:
    """Tidy per-seed rows: ``cells[defence][metric] = per-seed values`` (the undefended cell has
    ``epsilon`` None and carries the constant prediction)."""
    rows = []
    for d, metrics in cells.items():
        for m, vals in metrics.items():
            assert len(vals) == seeds
            for s, v in enumerate(vals):
                rows.append(dict(dataset="toy", defence=d, epsilon=None if d == "none" else eps, seed=s,
                                 party="host", metric=m, value=v))
    return rows


def _noise(seed: int, n: int, sd: float) -> list[float]:
    return list(np.random.default_rng(seed).normal(0, sd, n))


def _synthetic(n: int = 5) -> dict[str, dict[str, list[float]]]:
    rng = np.random.default_rng(0)
    u = list(0.9 + rng.normal(0, 0.005, n))
    none = {"utility": u, "constant_prediction": [0.1] * n, "property:advantage": list(0.8 + rng.normal(0, 0.01, n)),
            "reconstruction:advantage": list(0.7 + rng.normal(0, 0.01, n)),
            "label-direction:advantage": list(0.9 + rng.normal(0, 0.01, n))}

    def like(**over):
        out = {k: list(v) for k, v in none.items() if k != "constant_prediction"}
        for k, v in over.items():
            out[k.replace("_", "-") + ":advantage" if k != "utility" else k] = v
        return out

    p, r = none["property:advantage"], none["reconstruction:advantage"]
    return {
        "none": none,
        # lowers both attacks on the activations far beyond the seed spread: holds
        "strong": like(property=[x - 0.7 for x in p], reconstruction=[x - 0.6 for x in r],
                       utility=[x - 0.1 for x in u]),
        # lowers property, leaves reconstruction exactly where it was: partly holds
        "half": like(property=[x - 0.7 for x in p], utility=[x - 0.05 for x in u]),
        # the undefended numbers to within 0.005 on every seed: does not hold (shown equivalent)
        "useless": like(property=[x + e for x, e in zip(p, _noise(1, n, 0.003))],
                        reconstruction=[x + e for x, e in zip(r, _noise(2, n, 0.003))]),
        # a 0.1 drop buried in a 0.3 seed spread: neither shown: inconclusive
        "noisy": like(property=[x - 0.1 + e for x, e in zip(p, _noise(3, n, 0.3))],
                      reconstruction=[x + e for x, e in zip(r, _noise(4, n, 0.3))]),
        # lowers everything, but the model is at the constant prediction: uninformative
        "broken": like(property=[x - 0.7 for x in p], reconstruction=[x - 0.6 for x in r],
                       utility=[0.1 + e for e in _noise(5, n, 0.005)]),
        # DP-SGD noises the guest's parameter updates, which none of these attacks read
        "dpsgd": like(property=[x - 0.7 for x in p]),
    }


def test_verdicts_come_from_the_per_seed_numbers():
    cells = _synthetic()
    res = V.judge(_rows(cells, 5), ATTACKS, "guest")
    got = {k[1]: v["verdict"] for k, v in res["cells"].items()}
    assert got == {"strong": V.HOLDS, "half": V.PARTLY, "useless": V.FAILS, "noisy": V.INCONCLUSIVE,
                   "broken": V.UNINFORMATIVE, "dpsgd": V.NOT_APPLICABLE}
    strong = res["cells"][("toy", "strong", 8.0)]
    assert strong["attacks"]["label-direction"]["outcome"] == V.NOT_APPLICABLE  # --protect guest: gradients exact
    # the difference is the mean of the per-seed differences, recomputed here
    assert strong["attacks"]["property"]["diff"] == pytest.approx(-0.7)
    assert strong["seeds"] == 5 and strong["usable"] is True and res["cells"][("toy", "broken", 8.0)]["usable"] is False
    # "strong" and "half" lower property equally (0.7 on every seed): no leader is separated there
    prop = next(lead for lead in res["leaders"] if lead["attack"] == "property")
    assert not prop["separated"]


def test_same_means_other_seeds_other_verdict():
    """The verdict reads the per-seed numbers, not the means: the same per-defence means with the
    differences spread over seeds (one seed carries the whole drop) are not a clear drop."""
    cells = _synthetic()
    p = cells["none"]["property:advantage"]
    cells["strong"]["property:advantage"] = [p[0] - 3.5] + p[1:]  # mean drop 0.7, as before
    res = V.judge(_rows(cells, 5), ATTACKS, "guest")
    assert res["cells"][("toy", "strong", 8.0)]["attacks"]["property"]["diff"] == pytest.approx(-0.7)
    assert res["cells"][("toy", "strong", 8.0)]["verdict"] == V.PARTLY  # reconstruction still lowered


def test_one_seed_is_inconclusive_and_holm_counts_every_test():
    one = {d: {m: v[:1] for m, v in ms.items()} for d, ms in _synthetic().items()}
    res = V.judge(_rows(one, 1), ATTACKS, "guest")
    assert res["cells"][("toy", "strong", 8.0)]["verdict"] == V.INCONCLUSIVE
    # Holm: the adjusted p of the smallest of m p-values is m times it, non-significant ones counted
    assert V.holm([0.01, 0.5, None, 0.04]) == [0.03, 0.5, None, 0.08]
    # step-down by hand: 0.001×5, 0.03×4, 0.04×3 → 0.12, 0.2×2, 0.5×1 → max(0.4, 0.5); nan is no test
    got = V.holm([0.001, 0.2, 0.03, 0.04, float("nan"), 0.5])
    want = [0.005, 0.4, 0.12, 0.12, None, 0.5]
    assert all(abs(a - b) < 1e-12 if b is not None else a != a for a, b in zip(got, want)), got


def test_vocabulary_and_paired_test_are_the_claim_tables():
    from experiments import verdicts as E

    for word in V.VERDICTS:
        assert word in E.VERDICTS
    a, b = [0.1, 0.3, 0.2, 0.4, 0.35], [0.5, 0.6, 0.45, 0.7, 0.5]
    mine, theirs = V.t_test([x - y for x, y in zip(a, b)]), E.paired(a, b)
    assert mine["p_below"] == pytest.approx(theirs["p_below"]) and mine["se"] == pytest.approx(theirs["se"])
    assert V.equivalence(mine, 0.5) == pytest.approx(E.within(theirs, 0.5)["p_within"])


def test_table_carries_the_verdict_column():
    cells = _synthetic()
    rows = _rows(cells, 5)
    grid = make_grid({"datasets": ["credit"], "defences": ["laplace"], "epsilons": [8.0]})
    assert grid.seeds == (0, 1, 2, 3, 4)  # the default: five seeds
    for r in rows:  # the toy table as a real grid's: credit, the strong defence as laplace
        r["dataset"] = "credit"
        if r["defence"] == "strong":
            r["defence"] = "laplace"
    rows = [r for r in rows if r["defence"] in ("none", "laplace")]
    judged = V.judge(rows, ATTACKS, "guest")
    summ = report.summarise([{"rows": [r for r in rows if r["defence"] == d and r["metric"] != "constant_prediction"],
                              "attacks": ATTACKS, "not_applicable": {}} for d in ("none", "laplace")])
    md = report.leaderboard(grid, summ, {"tolerance": 0.01, "delta": 1e-5}, judged)
    line = next(x for x in md.splitlines() if x.startswith("| 1 | laplace"))
    assert line.rstrip(" |").endswith("holds")
    assert "laplace: **holds** (label-direction not applicable, property lowered -0.70" in md


def _committed():
    out = ROOT / "experiments" / "results" / "bench"
    meta = json.loads((out / "bench.json").read_text())
    grid = make_grid({k: v for k, v in meta["grid"].items()})
    cells = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    return out, grid, [c for c in cells if int(c["key"].rsplit("__", 1)[1]) in grid.seeds]


def test_published_table_has_five_seeds_and_the_readme_agrees():
    """The committed bench (experiments/results/bench) ran at ≥ 5 seeds, and experiments/README.md's
    sentences about it are the block its verdicts give, between the markers, word for word."""
    out, grid, cells = _committed()
    assert len(grid.seeds) >= V.PUBLISHED_SEEDS
    summ, rows, judged = tables(grid, cells)
    block = report.verdict_block(grid, summ, judged)
    assert block == (out / "verdicts.md").read_text()
    readme = (ROOT / "experiments" / "README.md").read_text()
    start, end = readme.index(report.BLOCK_START), readme.index(report.BLOCK_END)
    assert readme[start:end + len(report.BLOCK_END)] + "\n" == block
    with (out / "bench.csv").open() as fh:
        committed = list(csv.DictReader(fh))
    assert sum(1 for r in committed if r["metric"] == "constant_prediction") == len(grid.datasets) * len(grid.seeds)
