"""Every issue-9 experiment runs end to end in its ``--quick`` mode (one seed, a few records, one or
two epochs) and writes what its full run writes: CSV, a Markdown table, PNG plots, ``claims.json``
(each claim with a valid verdict) and ``run.json`` (command, date, versions). The quick runs write
into a temporary folder, never into ``experiments/results/``.
"""

from __future__ import annotations

import importlib
import json
import logging
import warnings
from pathlib import Path

import pytest

EXPERIMENTS = ("exp1_merge_padding", "exp2_utility_epsilon", "exp3_property_reconstruction", "exp4_fsha",
               "exp5_denoising", "exp6_rr_vs_laplace", "exp7_cut_layer_labels", "exp8_privacy_utility_attacks")
VERDICTS = {"holds", "partly holds", "does not hold", "new", "not measured", "uninformative", "inconclusive",
            "not applicable"}


@pytest.fixture
def isolated_logging():
    """The experiments silence fl_split's warnings (expected in noise sweeps); restore them after."""
    logger = logging.getLogger("fl_split")
    level = logger.level
    with warnings.catch_warnings():
        yield
    logger.setLevel(level)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_quick_mode(name, tmp_path, isolated_logging, capsys):
    mod = importlib.import_module(f"experiments.{name}")
    out = tmp_path / name
    assert mod.main(["--quick", "--out", str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert any(f.endswith(".csv") for f in files), files
    assert any(f.endswith(".md") for f in files), files
    assert any(f.endswith(".png") for f in files), files
    for f in files:
        if f.endswith(".png"):
            assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f
    claims = json.loads((out / "claims.json").read_text())
    assert claims, "every experiment states at least one claim"
    for c in claims:
        assert {"id", "source", "claim", "paper", "ours", "verdict", "rule"} <= set(c), c
        assert c["verdict"] in VERDICTS, c
        assert len(c["rule"]) > 20, c  # issue 19: every verdict states its rule
    # --from-runs rebuilds the same claims from runs.csv without training, and keeps the runs and provenance
    runs = {p.name: p.read_bytes() for p in out.glob("*runs.csv")}
    meta0 = (out / "run.json").read_text()
    assert mod.main(["--quick", "--out", str(out), "--from-runs"]) == 0
    assert json.loads((out / "claims.json").read_text()) == claims
    assert {p.name: p.read_bytes() for p in out.glob("*runs.csv")} == runs
    rebuilt = json.loads((out / "run.json").read_text())
    assert {k: v for k, v in rebuilt.items() if k != "rebuilt_from_runs"} == json.loads(meta0)
    assert "--from-runs" in rebuilt["rebuilt_from_runs"]["command"]
    meta = rebuilt
    assert meta["quick"] is True and meta["experiment"] == name
    assert meta["command"].startswith(".venv/bin/python experiments/") and "--quick" in meta["command"]
    assert "--from-runs" not in meta["command"]
    assert {"python", "torch", "fl_split"} <= set(meta["versions"]) and meta["date"]
    assert set(meta["files"]) <= files
    table = next(f for f in files if f.endswith(".md"))
    assert "|" in (out / table).read_text()


def test_claim_table_collects_every_experiment(tmp_path, capsys):
    from experiments import claims

    res = tmp_path / "results"
    for i, name in enumerate(EXPERIMENTS[:2]):
        (res / name).mkdir(parents=True)
        (res / name / "claims.json").write_text(json.dumps([{"id": f"{i}a", "source": "001 Table 1", "claim": "a | b",
                                                             "paper": "1", "ours": "2", "verdict": "holds",
                                                             "p": 0.001}]))
    assert claims.main(["--results", str(res)]) == 0
    text = (res / "claims.md").read_text()
    assert text.count("**holds**") == 2 and "a \\| b" in text and "Verdicts: holds 2" in text


def test_results_are_not_written_by_quick_runs():
    # the committed results folder holds no quick-mode output
    root = Path(__file__).resolve().parent.parent / "experiments" / "results"
    for run in root.glob("*/run.json"):
        assert json.loads(run.read_text()).get("quick") is False, run


def test_substitute_runs_an_experiment_on_the_real_dataset_loader(tmp_path, isolated_logging, capsys):
    # a user with MNIST on disk runs the digits configurations on it (tiny idx files in the real format)
    import numpy as np

    from experiments import common
    from tests.test_datasets import _write_idx

    rng = np.random.default_rng(0)
    raw = tmp_path / "data" / "MNIST" / "raw"
    _write_idx(raw, "train", rng.integers(0, 256, (160, 28, 28)), rng.integers(0, 10, 160))
    _write_idx(raw, "t10k", rng.integers(0, 256, (40, 28, 28)), rng.integers(0, 10, 40))
    mod = importlib.import_module("experiments.exp4_fsha")
    out = tmp_path / "out"
    try:
        argv = ["--quick", "--out", str(out), "--substitute", "digits=mnist", "--data-root", str(tmp_path / "data")]
        assert mod.main(argv) == 0
        assert common.config(0, dataset="digits").dataset == "mnist"  # every digits configuration ran on mnist
        assert "--substitute digits=mnist" in json.loads((out / "run.json").read_text())["command"]
        with pytest.raises(SystemExit, match="mnist is not under --data-root"):
            common.use_datasets(["digits=mnist"], str(tmp_path / "empty"))
        with pytest.raises(SystemExit, match="expected OFFLINE=REAL"):
            common.use_datasets(["digits"], "")
    finally:
        common.use_datasets([], "")
    assert common.config(0, dataset="digits").dataset == "digits"


def test_paired_verdict_helper_uses_the_seed_spread():
    """issue 19: a difference decides a verdict only outside the seed spread, never by its sign alone."""
    from experiments import common as C

    clear = C.paired([0.90, 0.91, 0.92], [0.80, 0.80, 0.81])  # +0.107 ± 0.006: far outside
    assert clear["clear"] and clear["diff"] > 0 and clear["p"] < 0.01
    noisy = C.paired([0.90, 0.70, 0.95], [0.80, 0.85, 0.82])  # +0.027 ± 0.16: the sign alone says "better"
    assert noisy["diff"] > 0 and not noisy["clear"]
    one = C.paired([0.9], [0.8])  # one seed cannot be judged
    assert not one["clear"] and one["p"] != one["p"]


def test_verify_reruns_seed_0_and_flags_drift(tmp_path, isolated_logging, capsys):
    """issue 19: ``--verify`` re-runs the committed configuration's seed-0 cells at the current code and
    compares them with the committed numbers; a drift beyond the stated tolerance exits 1 and says
    which cell. The CI subset: experiment 1 on credit (13 trainings, no defence: exact up to
    floating point)."""
    from experiments import common as C
    from experiments import exp1_merge_padding as exp1

    out = tmp_path / "verify"
    assert exp1.main(["--verify", "--datasets", "credit", "--out", str(out)]) is not None
    report = json.loads((out / "verify.json").read_text())
    assert report["cells"] == 13 and report["drifted"] == 0, report
    assert {"python", "torch", "fl_split"} <= set(report["versions"])
    # a committed number that does not reproduce is flagged
    old = C.read_runs(C.RESULTS / "exp1_merge_padding" / "runs.csv")
    new = [dict(r) for r in old if r["dataset"] == "credit" and r["seed"] == 0]
    new[0]["value"] += 0.2
    cells = C.verify_runs(new, old, ("dataset", "padding", "merge"), ("value",))
    assert [c["ok"] for c in cells].count(False) == 1 and not cells[0]["ok"]
