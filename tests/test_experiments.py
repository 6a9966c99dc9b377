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
VERDICTS = {"holds", "partly holds", "does not hold", "new", "not measured"}


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
        assert {"id", "source", "claim", "paper", "ours", "verdict"} <= set(c), c
        assert c["verdict"] in VERDICTS, c
    meta = json.loads((out / "run.json").read_text())
    assert meta["quick"] is True and meta["experiment"] == name
    assert meta["command"].startswith(".venv/bin/python experiments/") and "--quick" in meta["command"]
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
                                                             "paper": "1", "ours": "2", "verdict": "holds"}]))
    assert claims.main(["--results", str(res)]) == 0
    text = (res / "claims.md").read_text()
    assert text.count("**holds**") == 2 and "a \\| b" in text and "Verdicts: holds 2" in text


def test_results_are_not_written_by_quick_runs():
    # the committed results folder holds no quick-mode output
    root = Path(__file__).resolve().parent.parent / "experiments" / "results"
    for run in root.glob("*/run.json"):
        assert json.loads(run.read_text()).get("quick") is False, run
