"""``fl-split`` command line: results JSON, listings, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_split.cli import main


def _run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors exit directly
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,flag", [
    (["--dataset", "imagenet"], "--dataset"),
    (["--merge", "median"], "--merge"),
    (["--guests", "0"], "--guests"),
    (["--guests", "8"], "--guests"),
    (["--guests", "two"], "--guests"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "-3"], "--batch-size"),
    (["--lr", "0"], "--lr"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--test-fraction", "1.5"], "--test-fraction"),
    (["--model", "resnet-9000"], "--model"),
    (["--cut-layer", "9"], "--cut-layer"),
    (["--model", "mlp", "--hidden", "16", "--cut-layer", "2"], "--cut-layer"),
    (["--hidden", "64,x"], "--hidden"),
    (["--model", "movielens-mlp", "--hidden", "8"], "--hidden"),
    (["--columns", "host=0:4"], "--columns"),
    (["--out", "/nonexistent-dir/r.json"], "--out"),
])
def test_bad_values_one_line_exit_2_no_results(argv, flag, capsys, tmp_path):
    out = tmp_path / "r.json"
    args = ["train", "--epochs", "1", "--no-progress", "--out", str(out), *argv]
    code, stdout, stderr = _run_main(args, capsys)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"fl-split: error: {flag}"), lines[0]
    assert "allowed" in lines[0]
    assert "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_unknown_flag_is_one_line(capsys):
    code, _, stderr = _run_main(["train", "--bogus", "1"], capsys)
    assert code == 2 and stderr.count("\n") == 1 and "--bogus" in stderr


def test_train_writes_results_json(tmp_path, capsys):
    out = tmp_path / "res.json"
    code, stdout, _ = _run_main(["train", "--dataset", "breast-cancer", "--guests", "2", "--merge", "avg",
                                 "--epochs", "2", "--no-progress", "--out", str(out)], capsys)
    assert code == 0
    res = json.loads(out.read_text())
    cfg = res["config"]
    assert cfg["dataset"] == "breast-cancer" and cfg["guests"] == 2 and cfg["merge"] == "avg"
    assert cfg["model"] == "mlp" and cfg["cut_layer"] == 1  # "auto" resolved
    assert [h["epoch"] for h in res["history"]] == [1, 2]
    for h in res["history"]:
        assert math.isfinite(h["train_loss"]) and 0 <= h["test_metric"] <= 1
    assert res["final"]["metric"] == "accuracy" and 0.8 <= res["final"]["value"] <= 1
    assert res["wire"]["bytes_to_host"] > 0 and res["wire"]["bytes_to_guests"] > 0
    assert res["time_s"] > 0 and res["stopped_reason"] == "completed"
    assert "final test accuracy" in stdout
    assert not [p for p in tmp_path.iterdir() if p.name != "res.json"]  # no temp file left behind


def test_datasets_lists_offline_availability(capsys):
    code, stdout, _ = _run_main(["datasets"], capsys)
    assert code == 0
    for name in ("digits", "breast-cancer"):
        assert name in stdout


def test_console_script_end_to_end(tmp_path):
    """The installed entry point (what the README runs), in a fresh interpreter."""
    out = tmp_path / "r.json"
    env = {**os.environ, "FL_SPLIT_NO_DOWNLOAD": "1"}
    proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "train", "--epochs", "1", "--guests", "3",
                           "--no-host-features", "--merge", "max", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["final"]["value"] > 0.5
    bad = subprocess.run([sys.executable, "-m", "fl_split.cli", "train", "--guests", "0"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "fl-split: error: --guests: got 0; allowed: an integer >= 1 (and at most the dataset's feature columns)")


@pytest.mark.parametrize("argv", [["--help"], ["datasets"], ["models"], ["train", "--help"]])
def test_listing_commands_do_not_import_torch(argv):
    """Issue 10: the command line answers at once. --help, datasets and models read the light
    catalogs; PyTorch (and pandas, numpy) are imported only by commands that train. (Speed itself is
    measured, not asserted: machines are noisy.)"""
    code = ("import sys\nfrom fl_split.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'pandas', 'numpy', 'torchvision', 'flwr') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n" % (argv,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "HEAVY []" in out, out[-500:]


def test_catalogs_match_what_the_registries_build():
    from fl_split.data.catalog import CATALOG as DATASETS
    from fl_split.data.vision import SPECS, expected_files
    from fl_split.models.catalog import CATALOG as MODELS
    from fl_split.models.registry import get_architecture

    for m in MODELS:
        arch = get_architecture(m.name)
        assert (arch.inputs, arch.num_layers(), arch.default_cut, arch.description) == \
            (m.inputs, m.num_layers, m.default_cut, m.description), m.name
    root = Path("/r")
    for d in DATASETS:
        if d.name in SPECS:  # the files torchvision itself checks
            assert d.files == (tuple(str(p.relative_to(root)) for p in expected_files(SPECS[d.name], root)),)
            assert d.description == SPECS[d.name].description and d.default_model == SPECS[d.name].default_model


def test_negative_flags_say_what_they_do(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-progress do not show progress bars" in text
    assert "--no-host-features the host holds no feature columns" in text
