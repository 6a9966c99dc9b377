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
from fl_split.config import RunConfig


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


# -- issue 17: defaults that fit the machine (fast parts; the Flower runs are in tests/test_flower.py) --
@pytest.mark.parametrize("parties,node_cpus,share", [
    (3, [2.0], 0.66),         # the 2-core machine, 2 guests: what users computed by hand before
    (2, [2.0], 1.0),          # the main job (1 guest) on 2 cores
    (3, [16.0], 5.33),
    (2, [4.0], 2.0),
    (3, [1.0, 1.0], 0.5),     # two 1-CPU Ray nodes: a share that fits on each node, not on the sum
    (9, [2.0], 0.22),
])
def test_num_cpus_auto_shares_the_cpus_among_the_clientapps(parties, node_cpus, share):
    from fl_split.flower.resources import auto_share, slots

    got = auto_share(parties, node_cpus)
    assert got == share
    nodes = [{"CPU": c} for c in node_cpus]
    assert slots(nodes, got, 0) >= parties  # every ClientApp runs at once (the direct data plane)
    assert slots(nodes, got + 0.01, 0) < parties or got == max(node_cpus)  # and no larger 2-decimal share fits


def test_num_cpus_auto_is_the_default_and_resolved_with_one_line():
    from fl_split.flower.resources import resolve_num_cpus, share_line

    cfg = RunConfig(guests=2)
    assert cfg.num_cpus == "auto" and cfg.threads == "auto"
    got = resolve_num_cpus(cfg, 3, [2.0])
    assert got.num_cpus == 0.66 and resolve_num_cpus(got, 3, [2.0]) is got
    assert RunConfig(num_cpus=0.5).num_cpus == 0.5  # an explicit value is kept
    line = share_line(got, 3, [2.0], "on this machine")
    assert "\n" not in line
    assert line == ("--num-cpus auto: 0.66 CPU per ClientApp (2 CPU(s) on this machine shared by 3 ClientApps: "
                    "1 host + 2 guests); 1 torch thread(s) each")


@pytest.mark.parametrize("setting,cpus,threads", [("auto", None, 1), ("auto", 0.66, 1), ("auto", 1.0, 1),
                                                  ("auto", 5.33, 5), (4, None, 4), (2, 0.5, 2)])
def test_party_threads(setting, cpus, threads):
    from fl_split.devices import party_threads

    assert party_threads(setting, cpus) == threads
    assert party_threads(setting, cpus, limit=1) == (threads if setting != "auto" else 1)  # limit caps auto only


@pytest.mark.parametrize("threads,want", [("auto", 1), ("2", 2)])
def test_cli_local_engine_trains_with_the_chosen_threads_and_restores_them(threads, want, monkeypatch, capsys,
                                                                          tmp_path):
    """The CLI's parties use --threads torch threads (auto: 1, not torch's one per core, which stalls
    when another process takes a core: issue 17); the caller's setting is restored afterwards."""
    import torch

    import fl_split.engine as engine_mod

    seen = []
    real = engine_mod.LocalEngine.run

    def run(self):
        seen.append(torch.get_num_threads())
        return real(self)

    monkeypatch.setattr(engine_mod.LocalEngine, "run", run)
    torch.set_num_threads(3)
    try:
        code, _, err = _run_main(["train", "--epochs", "1", "--limit", "100", "--no-progress", "--threads", threads],
                                 capsys)
        assert code == 0, err
        assert seen == [want]
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)


def test_bad_threads_and_num_cpus_are_one_line(capsys, tmp_path):
    for argv, flag in ((["--threads", "0"], "--threads"), (["--threads", "1.5"], "--threads"),
                       (["--num-cpus", "0"], "--num-cpus"), (["--num-cpus", "some"], "--num-cpus")):
        code, _, err = _run_main(["train", "--no-progress", "--out", str(tmp_path / "r.json"), *argv], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"fl-split: error: {flag}: got ") and "allowed: 'auto' or " in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("guests,cpus,fed", [
    (1, 2, {"num-supernodes": 2, "client-resources-num-cpus": 1, "init-args-num-cpus": 2}),
    (2, 2, {"num-supernodes": 3, "client-resources-num-cpus": 1, "init-args-num-cpus": 3}),
    (2, 16, {"num-supernodes": 3, "client-resources-num-cpus": 5, "init-args-num-cpus": 16}),
])
def test_flwr_run_federation_fits_the_machine(guests, cpus, fed):
    from fl_split.flower.flwrrun import federation_for
    from fl_split.flower.resources import slots

    assert federation_for(guests, cpus) == fed
    nodes = [{"CPU": fed["init-args-num-cpus"]}]
    assert slots(nodes, fed["client-resources-num-cpus"], 0) >= guests + 1  # all ClientApps at once


@pytest.mark.parametrize("argv,flag", [
    (["--run-config", "guests=0"], "--guests"),
    (["--run-config", "epoch=3"], "--epoch"),
    (["--run-config", "guests=="], "--run-config"),
    (["--timeout", "0"], "--timeout"),
])
def test_flwr_run_bad_options_start_nothing(argv, flag, capsys):
    """`fl-split flwr-run` checks the job before it starts a SuperLink: one line, exit 2, nothing started."""
    from fl_split.flower.processes import descendants

    before = set(descendants(os.getpid()))
    code, _, err = _run_main(["flwr-run", *argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"fl-split: error: {flag}"), err
    assert set(descendants(os.getpid())) - before == set()


def test_flwr_run_relative_out_is_made_absolute(tmp_path):
    from fl_split.flower.flwrrun import job_config, parse_pairs

    cfg, values = job_config(parse_pairs("guests=2 out='r.json'", "run-config"), tmp_path)
    assert cfg.guests == 2 and cfg.defense == "gaussian"  # the app's main job, with the overrides
    assert values == {"guests": 2, "out": str(tmp_path / "r.json")}
