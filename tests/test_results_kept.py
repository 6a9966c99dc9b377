"""What a researcher keeps of a run (issue 17, docs/results.md): strict JSON, a run directory by
default, TensorBoard scalars, and the refusals that stop a run that could not mean what it says
(--budget without a defense, a --device GPU that is not there)."""

from __future__ import annotations

import csv
import json
import math
import os
import stat

import pytest

from fl_split.config import RunConfig
from fl_split.errors import ConfigError
from fl_split.results import jsonable, write_json_atomic
from fl_split.secure_files import readable_by_others
from tests.helpers import run_cli

SEED = "5eed0c4f9a2e7b13d86f1a0b3c5e7d92"  # 128-bit private seed (small integers are refused)
TINY = ["--dataset", "breast-cancer", "--epochs", "2", "--no-progress", "--private-seed", SEED]


def _run(argv, capsys):
    return run_cli(argv, capsys)


# -- strict JSON -------------------------------------------------------------------------------

def test_non_finite_numbers_become_null_with_a_reason(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"final": {"value": float("nan"), "loss": float("inf")},
                             "kept": {"value": float("nan"), "value_reason": "the host keeps it"},
                             "series": [1.0, float("-inf")]})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["final"]["value"] is None and "not a finite number" in data["final"]["value_reason"]
    assert data["final"]["loss"] is None and "inf" in data["final"]["loss_reason"]
    assert data["kept"] == {"value": None, "value_reason": "the host keeps it"}  # an existing reason wins
    assert data["series"] == [1.0, None]


def test_numpy_nan_is_caught_too():
    np = pytest.importorskip("numpy")
    assert jsonable({"v": np.float32("nan")}) == {"v": None, "v_reason": "not a finite number (nan): no value was "
                                                                          "computed"}


def test_a_budget_below_one_epoch_is_refused_before_anything_is_written(tmp_path, capsys):
    """--budget below the cost of one epoch: refused when the parties are set up, one line naming
    --budget, the party and the epoch's ε, exit 2, and nothing written (no results, no run directory,
    no saved model) — before, the run exited 0 and saved a model that never trained."""
    out, run_dir, model = tmp_path / "r.json", tmp_path / "run", tmp_path / "model"
    code, stdout, stderr = _run(["train", *TINY, "--defense", "laplace", "--epsilon", "1", "--budget", "0.1",
                                 "--out", str(out), "--run-dir", str(run_dir), "--save-model", str(model)], capsys)
    last = stderr.strip().splitlines()[-1]  # after the public SNR warning, one line
    assert code == 2 and not any(ln.startswith("fl-split: error") for ln in stderr.strip().splitlines()[:-1])
    assert last.startswith("fl-split: error: --budget: got 0.1 (one epoch costs guest-1 ε 0.427 (pld"), stderr
    assert "nothing was trained, released or written" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_budget_spent_in_a_later_epoch_stops_there_and_says_why(tmp_path, capsys):
    """A budget that covers the first epoch but not the second: the run stops cleanly at the refused
    release, keeps the evaluated epoch and says why, in strict JSON."""
    out = tmp_path / "r.json"
    # Laplace ε 1 per release, tightly accounted at δ 1e-5: one epoch 0.427, two 0.626; 0.5 holds one
    code, stdout, _ = _run(["train", *TINY, "--defense", "laplace", "--epsilon", "1", "--budget", "0.5",
                            "--out", str(out)], capsys)
    assert code == 0
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["stopped_reason"] == "budget" and len(data["history"]) == 1
    assert data["final"]["value"] is not None
    assert all(p["epsilon"] <= 0.5 for p in data["privacy"].values() if p.get("epsilon") is not None)
    assert "stopped early (budget)" in stdout


# -- refusals ----------------------------------------------------------------------------------

def test_budget_without_a_defense_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--budget"):
        RunConfig(budget=5.0)
    RunConfig(budget=5.0, defense="laplace")  # a defense charges: the budget binds
    RunConfig(budget=5.0, dp_sgd="guest")  # DP-SGD charges the same ledger
    code, _, stderr = _run(["train", *TINY, "--budget", "5", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and stderr.count("\n") == 1
    assert stderr.startswith("fl-split: error: --budget: got 5.0") and "never bind" in stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["cuda:", "cuda:-1", "cuda:x", "gpu", "cuda:01"])
def test_device_form_is_checked(value):
    with pytest.raises(ConfigError, match="--device.*cuda:N"):
        RunConfig(device=value)


def test_device_cuda_n_names_what_is_available(monkeypatch):
    import torch

    from fl_split.devices import resolve

    assert RunConfig(device="cuda:1").device == "cuda:1"  # the form is accepted; the GPU is checked where used
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"--device: got 'cuda:1'.*no CUDA device is visible"):
        resolve("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve("cuda:1") == "cuda:1" and resolve("cuda:0") == "cuda:0" and resolve("cuda") == "cuda"
    with pytest.raises(ConfigError, match=r"--device: got 'cuda:2'.*allowed: auto, cpu, cuda or cuda:0, cuda:1"):
        resolve("cuda:2")


def test_device_cuda_n_is_refused_in_a_simulation():
    from fl_split.devices import for_simulation

    with pytest.raises(ConfigError, match="--device.*Ray assigns"):
        for_simulation(RunConfig(device="cuda:0", engine="flower", num_gpus=0.5))


def test_device_cuda_n_without_a_gpu_writes_nothing(tmp_path, capsys):
    import torch

    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU number 7")
    code, _, stderr = _run(["train", *TINY, "--device", "cuda:7", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and stderr.startswith("fl-split: error: --device: got 'cuda:7'")
    assert not (tmp_path / "run").exists()


# -- run directory and tracking ----------------------------------------------------------------

def _check_run_dir(folder, epochs):
    data = json.loads((folder / "results.json").read_text())
    rows = list(csv.DictReader((folder / "epochs.csv").open()))
    assert [int(r["epoch"]) for r in rows] == list(range(1, epochs + 1))
    for r, h in zip(rows, data["history"]):
        assert math.isclose(float(r["test_accuracy"]), h["test_metric"])
        assert math.isclose(float(r["train_loss"]), h["train_loss"])
    assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left
    return data


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_train_without_out_writes_a_run_directory(tmp_path, monkeypatch, capsys, umask_022):
    monkeypatch.setenv("FL_SPLIT_RUNS", str(tmp_path / "runs"))
    code, stdout, _ = _run(["train", *TINY, "--defense", "laplace", "--epsilon", "50"], capsys)
    assert code == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.endswith("-breast-cancer-laplace")
    data = _check_run_dir(folder, 2)
    assert data["final"]["value"] == data["history"][-1]["test_metric"]
    assert f"run directory: {folder}" in stdout
    # owner-only (issue 25) under the common umask 022: the directory 0700, every file 0600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and readable_by_others(folder) == []
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()} == {0o600}
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_dir()} <= {0o700}  # model/ (issue 24)
    # each perturbing party's epsilon after each epoch: ε = 50 per epoch (each record once), composed;
    # pld reports the per-element (ε, δ), below the pure 50 and 100 (tight accounting, issue 26)
    per_epoch = data["privacy"]["guest-1"]["epsilon_by_epoch"]
    assert list(per_epoch) == ["1", "2"] and per_epoch["2"] == data["privacy"]["guest-1"]["epsilon"]
    assert 0 < per_epoch["1"] < per_epoch["2"] <= 100.0 + 1e-9 and per_epoch["1"] <= 50.0 + 1e-9
    assert data["privacy"]["guest-1"]["epsilons"]["basic"] == pytest.approx(100.0, rel=1e-3)
    assert data["privacy"]["host"]["epsilon"] is None and "epsilon_by_epoch" not in data["privacy"]["host"]
    rows = list(csv.DictReader((folder / "epochs.csv").open()))
    assert "epsilon_host" not in rows[0]
    assert [float(r["epsilon_guest-1"]) for r in rows] == [per_epoch["1"], per_epoch["2"]]


def test_out_alone_writes_no_run_directory_and_run_dir_is_never_overwritten(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FL_SPLIT_RUNS", str(tmp_path / "runs"))
    out = tmp_path / "r.json"
    assert _run(["train", *TINY, "--out", str(out)], capsys)[0] == 0
    assert out.exists() and not (tmp_path / "runs").exists()
    run = tmp_path / "mine"
    assert _run(["train", *TINY, "--run-dir", str(run)], capsys)[0] == 0
    _check_run_dir(run, 2)
    before = (run / "results.json").read_bytes()
    code, _, stderr = _run(["train", *TINY, "--run-dir", str(run)], capsys)
    assert code == 2 and stderr.startswith("fl-split: error: --run-dir") and "never overwritten" in stderr
    assert (run / "results.json").read_bytes() == before
    assert _run(["train", *TINY, "--no-run-dir"], capsys)[0] == 0
    assert not (tmp_path / "runs").exists()


def test_tensorboard_scalars_per_epoch_and_epsilon(tmp_path, capsys, umask_022):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    code, _, _ = _run(["train", *TINY, "--epochs", "3", "--defense", "laplace", "--epsilon", "50",
                       "--run-dir", str(tmp_path / "run"), "--tensorboard", str(tb)], capsys)
    assert code == 0
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    (folder,) = tb.iterdir()
    assert folder.name == "run"  # named after the run directory
    # owner-only (issue 25): TensorBoard itself writes 0755 folders and 0644 event files
    assert stat.S_IMODE(tb.stat().st_mode) == 0o700 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert readable_by_others(tb) == [] and readable_by_others(tmp_path / "run") == []
    assert [stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()] == [0o600]
    acc = EventAccumulator(str(folder))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"test/accuracy", "test/loss", "train/loss", "epsilon/guest-1"} <= tags
    assert "epsilon/host" not in tags  # the host's releases are not perturbed: no epsilon is claimed
    test = acc.Scalars("test/accuracy")
    assert [e.step for e in test] == [1, 2, 3]
    for e, h in zip(test, data["history"]):
        assert math.isclose(e.value, h["test_metric"], rel_tol=1e-6)
    eps = acc.Scalars("epsilon/guest-1")  # after each epoch; the last is the final epsilon
    assert [e.step for e in eps] == [1, 2, 3]
    per_epoch = data["privacy"]["guest-1"]["epsilon_by_epoch"]
    for e in eps:
        assert math.isclose(e.value, per_epoch[str(e.step)], rel_tol=1e-6)
    assert math.isclose(eps[-1].value, data["privacy"]["guest-1"]["epsilon"], rel_tol=1e-6)
    assert eps[0].value < eps[1].value < eps[2].value


def test_tensorboard_into_a_file_is_refused_before_the_run(tmp_path, capsys):
    bad = tmp_path / "f"
    bad.write_text("x")
    code, _, stderr = _run(["train", *TINY, "--tensorboard", str(bad), "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and stderr.startswith("fl-split: error: --tensorboard")
    assert not (tmp_path / "run").exists()


# -- deploy local: never silent ----------------------------------------------------------------

def test_deploy_local_says_each_phase_before_it_starts(tmp_path, monkeypatch):
    """A line is echoed as each phase *starts* (so a slow export or SuperLink start is never
    silent), in order; the fake deployment records which phase ran after which line."""
    import fl_split.deploy as D
    from fl_split.flower.processes import DeferredInterrupt

    events: list[str] = []

    class Fake:
        def __init__(self, cfg, workdir, *, echo, **kw):
            self.echo = lambda line: events.append(f"say {line}")
            self.workdir, self.parties, self.node_auth = tmp_path / "w", cfg.parties, True
            self.address, self.run_id, self.timeline = "127.0.0.1:1", 7, {}
            self.own_tables = None  # a built-in dataset: exported, not each node's own table
            self.interrupts = DeferredInterrupt()  # deploy_local installs its signal handler

        def __getattr__(self, name):
            return lambda *a, **k: events.append(name)

        def run(self):
            events.append("run")
            return {}

    monkeypatch.setattr(D, "LocalDeployment", Fake)
    D.deploy_local(RunConfig(engine="flower", guests=2), tmp_path / "w")
    phases = [e for e in events if not e.startswith("say ")]
    assert phases[:5] == ["prepare", "start_superlink", "register_nodes", "start_supernodes", "run"]
    said = [i for i, e in enumerate(events) if e.startswith("say ")]
    for phase in phases[:5]:  # every phase comes right after its own line
        i = events.index(phase)
        assert i - 1 in said, events
    assert "exporting one data file per party, making certificates and keys" in events[0]
    assert "3 SuperNodes (host, guest-1, guest-2)" in events[events.index("start_supernodes") - 1]
