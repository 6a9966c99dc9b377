"""Tasks (issue 24): ``--task auto|binary|multiclass|regression``, class weights, the host's task
metrics against scikit-learn's, own tables with a numeric target, the run directory following the task."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fl_split.builder import prepare_data
from fl_split.config import RunConfig
from fl_split.engine import run_experiment
from fl_split.errors import ConfigError
from fl_split.seeding import PrivateSeed
from fl_split.tasks import Objective, balanced_weights, binary_metrics, looks_numeric_target, resolve, task_metrics

PS = PrivateSeed.legacy(24)


def test_auto_rule():
    assert resolve("auto", "classification", 2, "x") == "binary"
    assert resolve("auto", "classification", 10, "x") == "multiclass"
    assert resolve("multiclass", "classification", 2, "x") == "multiclass"
    assert resolve("auto", "regression", 1, "x") == "regression"
    assert resolve("auto", "next-item", 200, "x") == "next-item"
    # own tables (docs/results.md): numeric, a non-integer value and more than 10 distinct values
    assert looks_numeric_target(np.linspace(0, 1, 50))
    assert looks_numeric_target(np.arange(50.0))  # whole numbers, 50 values of one row each: a target
    assert not looks_numeric_target(np.arange(200) % 10)  # 0…9: classes
    assert not looks_numeric_target(np.arange(400) % 20)  # 20 values: classes
    with pytest.raises(ConfigError, match=r"--task: got 'auto' \(label column 'age' holds 30 distinct"):
        looks_numeric_target(np.arange(600) % 30, "age")  # 30 values of 20 rows: either, --task says which
    assert not looks_numeric_target(np.array([0.5, 1.5] * 20))  # two values
    assert not looks_numeric_target(np.array(["a", "b"] * 20))


@pytest.mark.parametrize("requested,declared,k,word", [("binary", "classification", 10, "binary needs 2"),
                                                       ("regression", "classification", 2, "not a numeric"),
                                                       ("binary", "regression", 1, "numeric target"),
                                                       ("regression", "next-item", 200, "next-item")])
def test_impossible_tasks_are_one_line(requested, declared, k, word):
    with pytest.raises(ConfigError) as exc:
        resolve(requested, declared, k, "ds")
    assert str(exc.value).startswith("--task") and word in str(exc.value) and "\n" not in str(exc.value)


def test_config_refuses_unknown_task_and_weights_on_regression():
    with pytest.raises(ConfigError, match="--task"):
        RunConfig(task="ranking")
    with pytest.raises(ConfigError, match="class-weight"):
        run_experiment(RunConfig(dataset="diabetes", class_weight="balanced", epochs=1, progress=False), PS)


def test_binary_metrics_equal_sklearn():
    from sklearn.metrics import f1_score, precision_score, recall_score, roc_auc_score, roc_curve

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    p = np.clip(0.3 * y + rng.random(400) * 0.7, 0, 1).round(2)  # rounded: ties in the scores
    m = binary_metrics(p, y)
    pred = (p > 0.5).astype(int)
    assert m["auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    assert m["f1"] == pytest.approx(f1_score(y, pred)) and m["precision"] == pytest.approx(precision_score(y, pred))
    assert m["recall"] == pytest.approx(recall_score(y, pred)) and m["accuracy"] == pytest.approx((pred == y).mean())
    fpr, tpr, _ = roc_curve(y, p)
    assert m["ks"] == pytest.approx(np.max(tpr - fpr), abs=1e-12)
    assert math.isnan(binary_metrics(p, np.ones(400, int))["auc"])  # one class: AUC does not exist


def test_regression_metrics_are_in_label_units():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    rng = np.random.default_rng(1)
    true = rng.normal(150, 70, 200)
    pred = true + rng.normal(0, 30, 200)
    mean, sd = 152.0, 77.0
    m = task_metrics("regression", (pred - mean) / sd, (true - mean) / sd, (mean, sd))
    assert m["r2"] == pytest.approx(r2_score(true, pred)) and m["mae"] == pytest.approx(mean_absolute_error(true, pred))
    assert m["rmse"] == pytest.approx(math.sqrt(mean_squared_error(true, pred)))


def test_balanced_weights_and_objective():
    y = torch.tensor([0, 0, 0, 1])
    w = balanced_weights(y, 2)
    assert torch.allclose(w, torch.tensor([4 / 6, 4 / 2]))
    logits = torch.randn(4, 2)
    want = torch.nn.functional.cross_entropy(logits, y, weight=w)
    assert torch.allclose(Objective("binary", w)(logits, y), want)
    out = torch.randn(4, 1)
    assert torch.allclose(Objective("regression")(out, torch.ones(4)), ((out[:, 0] - 1) ** 2).mean())


def test_diabetes_is_regression_standardised_by_the_host():
    prepared = prepare_data(RunConfig(dataset="diabetes", guests=2))
    host = prepared.parties["host"]
    assert prepared.task == "regression" and prepared.metric == "r2" and prepared.num_classes == 1
    assert host.y_train.dtype == torch.float32 and abs(float(host.y_train.mean())) < 1e-5
    assert abs(float(host.y_train.std(unbiased=False)) - 1) < 1e-4
    mean, sd = host.target_scale
    assert 100 < mean < 200 and 50 < sd < 100
    for g in ("guest-1", "guest-2"):  # the target and its scaling stay with the host
        assert prepared.parties[g].y_train is None and prepared.parties[g].target_scale is None


def test_credit_binary_run_reports_auc_and_writes_task_columns(tmp_path):
    from fl_split.rundir import write_run_dir

    res = run_experiment(RunConfig(dataset="credit", epochs=2, progress=False, class_weight="balanced"), PS)
    final = res["final"]
    assert final["task"] == "binary" and final["metric"] == "accuracy"
    assert set(final["metrics"]) == {"accuracy", "auc", "f1", "precision", "recall", "ks"}
    assert 0.6 < final["metrics"]["auc"] <= 1 and 0 < final["metrics"]["ks"] <= 1
    assert res["history"][-1]["test_auc"] == final["metrics"]["auc"]
    folder = write_run_dir(res, tmp_path / "run")
    header = (folder / "epochs.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["epoch", "train_loss", "test_accuracy"] and "test_auc" in header and "test_ks" in header


def test_own_table_with_a_numeric_target_is_regression(tmp_path):
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes(scaled=False)
    frame = pd.DataFrame(bunch.data, columns=bunch.feature_names)
    frame.insert(0, "ID", np.arange(len(frame)) * 3 + 7)
    host = frame[["ID", "age", "sex", "bmi", "bp"]].assign(Y=bunch.target + 0.25)  # non-integer: auto → regression
    guest = frame[["ID", "s1", "s2", "s3", "s4", "s5", "s6"]].sample(frac=1, random_state=0)
    host.to_csv(tmp_path / "h.csv", index=False)
    guest.to_csv(tmp_path / "g.csv", index=False)
    spec = f"host={tmp_path / 'h.csv'};guest-1={tmp_path / 'g.csv'}"
    # the default batch of 32: the first epoch's honest MSE partial losses can grow 23x in one batch, which the
    # guest's running-scale check refused until its warm-up became the first epoch (bounds.ScaleMonitor)
    cfg = RunConfig(data=spec, id_column="ID", label_column="Y", epochs=3, progress=False)
    res = run_experiment(cfg, PS)
    assert res["final"]["task"] == "regression" and res["final"]["metric"] == "r2"
    assert res["final"]["value"] > 0.2 and res["final"]["metrics"]["mae"] < 70
    # diabetes' own whole-number target (214 values in 442 rows, 2 rows each): regression under auto too;
    # --task multiclass still reads it as classes
    host.assign(Y=bunch.target.astype(int)).to_csv(tmp_path / "h.csv", index=False)
    from fl_split.builder import _prepare

    _prepare.cache_clear()  # the same paths, new contents
    assert prepare_data(cfg.replace(task="regression")).task == "regression"
    assert prepare_data(cfg.replace(task="auto")).task == "regression"
    assert prepare_data(cfg.replace(task="multiclass")).task == "multiclass"


def _ames_like(tmp_path, n: int = 600, label=None) -> list[str]:
    """Two parties' tables shaped like R's Ames housing: ``Sale_Price`` in whole dollars (hundreds of
    distinct values) at the host, other house features at the guest; the CLI's --data flags."""
    rng = np.random.default_rng(3)
    area = rng.integers(600, 3500, n)
    year = rng.integers(1900, 2010, n)
    qual = rng.integers(1, 11, n)
    lot = rng.integers(2000, 20000, n)
    price = np.round(20000 + 60 * area + 300 * (year - 1900) + 9000 * qual + rng.normal(0, 15000, n)).astype(int)
    ids = np.arange(n) + 1000
    host = pd.DataFrame({"PID": ids, "Gr_Liv_Area": area, "Overall_Qual": qual,
                         "Sale_Price": price if label is None else label})
    guest = pd.DataFrame({"PID": ids, "Year_Built": year, "Lot_Area": lot}).sample(frac=1, random_state=1)
    host.to_csv(tmp_path / "ames_host.csv", index=False)
    guest.to_csv(tmp_path / "ames_guest.csv", index=False)
    return ["--data", f"host={tmp_path / 'ames_host.csv'}", "--data", f"guest-1={tmp_path / 'ames_guest.csv'}",
            "--id-column", "PID", "--label-column", "Sale_Price"]


def test_auto_reads_whole_dollar_prices_as_regression(tmp_path, capsys):
    """An Ames-shaped table (integer prices, ~600 distinct values) under ``--task auto`` is a regression
    with R² (it used to be a 600-class task at accuracy 0.0000); labels 0…9 stay classes; a column that
    could be either is refused with one line naming it and ``--task``."""
    from fl_split.cli import main

    flags = _ames_like(tmp_path)
    assert pd.read_csv(tmp_path / "ames_host.csv")["Sale_Price"].nunique() > 500
    run = tmp_path / "run"
    assert main(["train", *flags, "--task", "auto", "--epochs", "4", "--seed", "2", "--no-progress",
                 "--private-seed", "8c9e2d44d0ce787253e1ed754fe13786", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "final test r2:" in out and "task regression (chosen by --task auto" in out
    epochs = pd.read_csv(run / "epochs.csv")
    assert "test_r2" in epochs.columns and "test_accuracy" not in epochs.columns
    assert epochs["test_r2"].iloc[-1] > 0.5
    # genuine small-integer class labels (0…9) are classes, as before
    from fl_split.builder import _prepare

    digits = np.arange(600) % 10
    flags = _ames_like(tmp_path, label=digits)
    _prepare.cache_clear()  # the same paths, new contents
    cfg = RunConfig(data=f"{flags[1]};{flags[3]}", id_column="PID", label_column="Sale_Price", progress=False)
    assert prepare_data(cfg).task == "multiclass" and prepare_data(cfg).num_classes == 10
    # 30 whole numbers of 20 rows each: classes or a target? --task says
    _ames_like(tmp_path, label=np.arange(600) % 30)
    _prepare.cache_clear()
    assert main(["train", *flags, "--epochs", "1", "--no-progress", "--no-run-dir"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--task" in err[0] and "'Sale_Price' holds 30 distinct" in err[0] and "multiclass" in err[0] \
        and "regression" in err[0]


def test_attacks_refuse_a_regression_run(capsys):
    from fl_split.cli import main

    code = main(["attack", "--attack", "label-direction", "--dataset", "diabetes", "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "task is regression" in err[0]
