"""The scenario matrix (tests/scenarios.py; tests/README.md, "The scenario matrix"): every allowed pair
of the product's axes — the user's key kind, file format, columns, task, defence, protected party,
engine and next step — in at least one end-to-end run, made and read the way a user does.

Each scenario writes a user's own tables to disk (three parties, partly overlapping rows, the key
in the user's own column(s)), trains with the CLI, and checks what the user sees: the exit code, the
task's headline metric above a floor (clearly better than predicting a constant), each party's ε
(a number exactly for the parties a differential-privacy defence protects), then its lifecycle step:
predictions on new rows joined back on the user's own key with pandas, 1:1 with the same values and
types; a run continued from the saved model; or a run SIGKILLed mid-way and resumed to the same
releases and ε as an uninterrupted run. Failures write nothing: a budget below one epoch (local
engine) and a predict whose guest table lacks a column leave no file behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.scenarios import AXES, COVERED_ELSEWHERE, EXCLUDED, SCENARIOS, Scenario, required_pairs

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "examples" / "plugins"
SEED = "5eed0c4f9a2e7b13d86f1a0b3c5e7d92"  # a 128-bit private seed (research reproducibility)
PARTIES = ("host", "guest-1", "guest-2")

#: the defences as a user writes them (parameters that learn on these small tables)
DEFENCE_FLAGS = {
    "none": [],
    "laplace": ["--defense", "laplace", "--epsilon", "8"],
    "gaussian": ["--defense", "gaussian", "--sigma", "0.7"],
    "rr": ["--defense", "rr", "--epsilon", "8"],
    "r3elu": ["--defense", "r3elu", "--epsilon", "8"],
    "dpsgd": ["--defense", "dpsgd", "--sigma", "1.0"],
    # examples/plugins/gradient_sparsification.py: a user's own class, no DP claim
    "plugin": ["--defense", "gradient_sparsification:GradientSparsification", "--defense-options", "rate=0.5"],
}
#: the task's headline metric and its floor: clearly above a constant predictor on these tables
#: (binary: the majority class of breast-cancer is 0.63; multiclass: wine's is 0.40; regression: R² 0)
FLOOR = {"binary": ("accuracy", 0.80), "multiclass": ("accuracy", 0.60), "regression": ("r2", 0.10)}


# -- the user's tables ------------------------------------------------------------------------------
def _dataset(task: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from sklearn import datasets

    load = {"binary": datasets.load_breast_cancer, "multiclass": datasets.load_wine,
            "regression": datasets.load_diabetes}[task]
    d = load()
    names = [str(n).replace(" ", "_") for n in d.feature_names]
    return np.asarray(d.data, dtype=np.float64), np.asarray(d.target), names


def _key_columns(kind: str, rows: np.ndarray) -> dict[str, list]:
    """The user's own key of each row (its column name(s) and values)."""
    if kind == "int":
        return {"customer_id": [int(i) * 7919 + 100003 for i in rows]}
    if kind == "text":
        return {"email": [f"client.{int(i) * 31 + 7}@example-bank.org" for i in rows]}
    if kind == "long-text":  # over 40 characters, non-ASCII
        return {"kundennummer": [f"Kündin Nº {int(i)} — Zweigstelle Görlitz-Süd, Straße {int(i) % 17}" for i in rows]}
    return {"branch": [f"Filiale {int(i) % 7}" for i in rows], "account_no": [int(i) // 7 for i in rows]}


def _id_flag(kind: str) -> str:
    return ",".join(_key_columns(kind, np.arange(1)))


def _write(frame: pd.DataFrame, path: Path, fmt: str) -> str:
    p = path.with_suffix(f".{fmt}")
    if fmt == "csv":
        frame.to_csv(p, index=False)
    else:
        frame.to_parquet(p, index=False)
    return str(p)


def _read_as_user(path: str) -> pd.DataFrame:
    """The table the way its owner reads it with pandas (default options)."""
    return pd.read_csv(path) if path.endswith(".csv") else pd.read_parquet(path)


def user_tables(s: Scenario, where: Path, align: str) -> tuple[dict[str, str], dict[str, str], np.ndarray]:
    """Each party's training table and new table (rows never trained on, no label at the host), and
    the rows every party's new table holds. ``align public``: every guest holds each of the host's
    rows; ``psi``: the parties' rows overlap partly."""
    x, y, names = _dataset(s.task)
    n = len(y)
    rows = np.arange(n)
    new_rows = rows[rows % 10 == 3]
    train_rows = rows[rows % 10 != 3]
    cols = np.array_split(np.arange(x.shape[1]), 3)
    rng = np.random.default_rng(len(s.name))
    keep = {"host": train_rows % 9 != 1, "guest-1": train_rows % 11 != 2, "guest-2": train_rows % 13 != 4}
    if align == "public":
        keep = {"host": train_rows % 9 != 1, "guest-1": np.ones(len(train_rows), bool),
                "guest-2": np.ones(len(train_rows), bool)}
    train, new = {}, {}
    (where / "new").mkdir(parents=True, exist_ok=True)
    for p, c in zip(PARTIES, cols):
        def table(r: np.ndarray, labelled: bool) -> pd.DataFrame:
            f = pd.DataFrame(_key_columns(s.ids, r))
            for j in c:
                f[names[j]] = x[r, j]
            if s.columns == "categories":  # the party's first column as text categories, empty cells in two
                first, second = names[c[0]], names[c[1]]
                f[first] = pd.cut(x[r, c[0]], bins=np.quantile(x[:, c[0]], [0, 1 / 3, 2 / 3, 1]),
                                  labels=["low", "mid", "high"], include_lowest=True).astype(object)
                blank = rng.random(len(r)) < 0.08
                f.loc[blank, first] = None
                f.loc[rng.random(len(r)) < 0.08, second] = np.nan
            if p == "host" and labelled:
                f["target"] = y[r] if s.task != "multiclass" else [f"cultivar {v}" for v in y[r]]
            return f
        train[p] = _write(table(train_rows[keep[p]], True), where / p, s.file)
        # a guest's new table holds a few rows more than the host's (psi); the host's has no label
        extra = rows[(rows % 10 == 7)][:5] if (p != "host" and align == "psi") else np.zeros(0, int)
        new[p] = _write(table(np.sort(np.concatenate([new_rows, extra])), False), where / "new" / p, s.file)
    return train, new, new_rows


# -- running it as the user does --------------------------------------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, "FL_SPLIT_NO_DOWNLOAD": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(PLUGINS)])}


def fl_split(args: list[str], timeout: float = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``fl-split ARGS`` as a separate process (the user's shell): the Flower and deployment runs."""
    return subprocess.run([sys.executable, "-m", "fl_split.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=cwd)


class _Here:
    """``fl-split ARGS`` in this process (the same ``main`` the shell runs; no interpreter start-up,
    ~3 s of imports saved per call): the local engine's runs and predict. ``capsys`` captures."""

    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def __call__(self, args: list[str], timeout: float = 0, cwd: Path | None = None) -> subprocess.CompletedProcess:
        from tests.helpers import run_cli

        self.capsys.readouterr()
        code, out, err = run_cli(args, self.capsys)
        return subprocess.CompletedProcess(args, code, out, err)


def _said(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def _seed_file(tables: dict[str, str]) -> str:
    """The private seed in an owner-only file beside the tables (a deployment refuses one on argv)."""
    path = Path(tables["host"]).parent / "private-seed"
    if not path.exists():
        path.write_text(SEED + "\n")
        path.chmod(0o600)
    return str(path)


def _train_args(s: Scenario, tables: dict[str, str], align: str, epochs: int = 3) -> list[str]:
    args = [a for p, t in tables.items() for a in ("--data", f"{p}={t}")]
    args += ["--id-column", _id_flag(s.ids), "--label-column", "target", "--align", align,
             "--epochs", str(epochs), "--batch-size", "32", "--private-seed-file", _seed_file(tables),
             "--no-progress"]
    args += DEFENCE_FLAGS[s.defence]
    if s.defence != "none":
        args += ["--protect", s.protect]
    return args


def _command(s: Scenario) -> list[str]:
    return {"local": ["train"], "flower": ["train", "--engine", "flower"], "deploy": ["deploy", "local"]}[s.engine]


def _protected(s: Scenario) -> set[str]:
    """The parties whose ε is a number: those a differential-privacy defence protects."""
    if s.defence in ("none", "plugin"):
        return set()
    return {"guest": {"guest-1", "guest-2"}, "host": {"host"}, "both": set(PARTIES)}[s.protect]


def check_results(s: Scenario, res: dict) -> None:
    metric, floor = FLOOR[s.task]
    final = res["final"]
    value = final["value"]  # the task's headline metric (docs/results.md)
    assert final.get("metric", metric) == metric, final
    assert value is not None and value >= floor, f"{metric} {value} < {floor}: {final}"
    eps = {p: res["privacy"][p].get("epsilon") for p in PARTIES}
    protected = _protected(s)
    assert {p for p, e in eps.items() if e is not None} == protected, eps
    assert all(e > 0 and np.isfinite(e) for p, e in eps.items() if p in protected), eps


def _no_new_files(where: Path, before: set[Path]) -> list[Path]:
    return sorted(set(where.rglob("*")) - before)


# -- the lifecycle steps ----------------------------------------------------------------------------
def predict_and_join(run, s: Scenario, where: Path, model: Path, new: dict[str, str], new_rows: np.ndarray,
                     align: str) -> None:
    """Predict the new rows and join them back on the user's own key, the user's way."""
    out = where / "predictions.csv"
    args = ["predict", "--model", str(model), *[a for p, t in new.items() for a in ("--data", f"{p}={t}")],
            "--id-column", _id_flag(s.ids), "--label-column", "target", "--align", align, "--out", str(out)]
    # first a refusal: a guest's new table without one of its columns predicts nothing, writes nothing
    broken = _read_as_user(new["guest-1"]).iloc[:, :-1]
    broken_path = _write(broken, where / "broken", s.file)
    bad_out = where / "bad-predictions.csv"
    refused = run(["predict", "--model", str(model), "--data", f"host={new['host']}", "--data",
                        f"guest-1={broken_path}", "--data", f"guest-2={new['guest-2']}", "--id-column",
                        _id_flag(s.ids), "--align", align, "--out", str(bad_out)], timeout=300)
    assert refused.returncode != 0 and not bad_out.exists(), _said(refused)
    assert "guest-1" in refused.stderr, _said(refused)
    done = run(args, timeout=300)
    assert done.returncode == 0, _said(done)
    pred = pd.read_csv(out)
    host_new = _read_as_user(new["host"])
    keys = _id_flag(s.ids).split(",")
    if s.file == "csv":  # both read by pandas from CSV: the same dtypes
        for k in keys:
            assert pred[k].dtype == host_new[k].dtype, (k, pred[k].dtype, host_new[k].dtype)
    else:  # a CSV of predictions beside a Parquet table: the user converts as they would any CSV
        pred = pred.astype({k: host_new[k].dtype for k in keys})
    joined = host_new.merge(pred, on=keys, how="inner", validate="one_to_one")
    assert len(joined) == len(pred) == len(new_rows), (len(joined), len(pred), len(new_rows))
    want = set(map(tuple, pd.DataFrame(_key_columns(s.ids, new_rows))[keys].itertuples(index=False)))
    assert set(map(tuple, joined[keys].itertuples(index=False))) == want
    score = "prediction" if s.task == "regression" else "predicted"
    assert joined[score].notna().all()


def continue_from(run, s: Scenario, where: Path, model: Path, tables: dict[str, str], align: str) -> None:
    """Train again from the saved model (``--init-from``), one epoch, with the local engine: the saved
    format is the same whichever engine wrote it (docs/serving.md)."""
    out = where / "continued.json"
    proc = run(["train", *_train_args(s, tables, align, epochs=1), "--init-from", str(model),
                     "--out", str(out)], timeout=300)
    assert proc.returncode == 0, _said(proc)
    res = json.loads(out.read_text())
    assert res["config"]["init_from"] == str(model)
    check_results(s, res)


def kill_and_resume(run, s: Scenario, where: Path, tables: dict[str, str], align: str) -> None:
    """SIGKILL a checkpointed run once its first checkpoint is on disk, resume it with the same
    command plus ``--resume``: the same releases and ε as the same run uninterrupted."""
    from fl_split.checkpoint import COORDINATOR, load_coordinator

    ck, killed = where / "ck", where / "killed.json"
    args = _train_args(s, tables, align, epochs=12)
    proc = subprocess.Popen([sys.executable, "-m", "fl_split.cli", "train", *args, "--checkpoint-dir", str(ck),
                             "--out", str(killed)], env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "the run ended before it was killed: " + proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            if (ck / COORDINATOR).exists() and load_coordinator(ck).round >= 1:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL and not killed.exists()
    resumed = run(["train", *args, "--checkpoint-dir", str(ck), "--resume", "--out", str(where / "res.json")],
                       timeout=600)
    assert resumed.returncode == 0, _said(resumed)
    whole = run(["train", *args, "--out", str(where / "whole.json")], timeout=600)
    assert whole.returncode == 0, _said(whole)
    res, ref = (json.loads((where / f).read_text()) for f in ("res.json", "whole.json"))
    assert [h["epoch"] for h in res["history"]] == list(range(1, 13))
    assert res["checkpoint"]["resumed_from_round"] >= 1
    assert {p: r.get("releases") for p, r in res["privacy"].items()} == \
        {p: r.get("releases") for p, r in ref["privacy"].items()}
    assert {p: r.get("epsilon") for p, r in res["privacy"].items()} == \
        {p: r.get("epsilon") for p, r in ref["privacy"].items()}
    check_results(s, res)


# -- the tests --------------------------------------------------------------------------------------
def test_the_matrix_covers_every_allowed_pair():
    """Checked independently of the generator: every pair of values of two axes is in a scenario,
    unless excluded with a reason; every "covered elsewhere" names a test that exists."""
    covered = set().union(*(s.pairs() for s in SCENARIOS))
    assert required_pairs() - covered == set()
    n_pairs = sum(len(AXES[a]) * len(AXES[b]) for i, a in enumerate(AXES) for b in list(AXES)[i + 1:])
    assert len(required_pairs()) == n_pairs - len(EXCLUDED)
    for pair, reason in EXCLUDED.items():
        assert pair not in covered, pair
        if reason == "covered elsewhere":
            file, name = COVERED_ELSEWHERE[pair].split("::")
            assert f"def {name}(" in (ROOT / file).read_text(), COVERED_ELSEWHERE[pair]
    # the expensive engines appear no more often than their pairs need (one per defence)
    assert sum(s.engine == "deploy" for s in SCENARIOS) <= len(AXES["defence"]) + 1
    assert sum(s.engine == "flower" for s in SCENARIOS) <= len(AXES["defence"]) + 1


def _marks(s: Scenario):
    return [pytest.mark.slow] if s.engine != "local" else []


@pytest.mark.parametrize("s", [pytest.param(s, id=s.name, marks=_marks(s)) for s in SCENARIOS])
def test_scenario(s: Scenario, tmp_path, capsys, monkeypatch):
    align = "public" if SCENARIOS.index(s) % 2 == 0 else "psi"
    tables, new, new_rows = user_tables(s, tmp_path / "data", align)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # where a run directory would go: nothing lands in the checkout
    monkeypatch.syspath_prepend(str(PLUGINS))  # the plug-in defence, as PYTHONPATH gives it to a shell
    run = _Here(capsys)
    if s.engine == "local":  # a budget below one epoch (or one without a defence): refused, nothing written
        before = set(work.rglob("*"))
        refused = run(["train", *_train_args(s, tables, align), "--budget", "0.0001", "--out",
                            str(work / "r.json"), "--save-model", str(work / "m")], cwd=work, timeout=300)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
            "fl-split: error: --budget"), _said(refused)
        assert _no_new_files(work, before) == []
    if s.lifecycle == "resume":
        kill_and_resume(run, s, work, tables, align)
        return
    model, out = work / "model", work / "results.json"
    extra = ["--workdir", str(tmp_path / "deployment")] if s.engine == "deploy" else []
    train = run if s.engine == "local" else fl_split
    proc = train([*_command(s), *_train_args(s, tables, align), "--save-model", str(model), "--out", str(out),
                  *extra], timeout=900)
    assert proc.returncode == 0, _said(proc)
    res = json.loads(out.read_text())
    check_results(s, res)
    assert sorted(p.name for p in model.iterdir()) == sorted(PARTIES)
    if s.lifecycle == "predict":
        predict_and_join(run, s, work, model, new, new_rows, align)
    else:
        continue_from(run, s, work, model, tables, align)
