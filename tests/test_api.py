"""The public Python API (issue 28, fl_split/api.py, docs/api.md).

* ``fl_split.train(**options)`` is ``fl-split train`` with the same options and private seed: the same
  per-epoch history, final metrics and every party's accounted ε (the API observes the run through
  frames, the CLI hands tensors over in process: bit-identical by the engine's own contract);
* a RunConfig, a mapping and keyword arguments give the same run;
* bad options are refused with the CLI's one line (unknown option, wrong type, out of range, a seed
  that is short or guessable, a lambda model under Flower);
* a model given as a function == the same model given as ``package.module:function``, including a
  lambda that only exists in this process (local engine), and its saved model predicts;
* ``Run.attack`` on the finished run == ``fl-split attack``'s own training and attack (same view,
  same score), and attacks that need their own run are refused in one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import fl_split
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.runner import run_attack
from fl_split.builder import prepare_data
from fl_split.cli import main as cli_main
from fl_split.config import RunConfig
from fl_split.data.base import partition
from fl_split.data.registry import load_dataset
from fl_split.errors import ConfigError, PrivateSeedError
from fl_split.seeding import PrivateSeed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:  # as a user runs it: PYTHONPATH=examples (docs/models.md)
    sys.path.insert(0, str(EXAMPLES))

import own_mlp  # noqa: E402

HEX = "4db201dac50f5aa5b07d82c5cd58f93a"
BASE = dict(dataset="breast-cancer", guests=2, epochs=2, progress=False, device="cpu")


def _strip(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "epoch_time_s"} for row in history]


def _epsilons(results: dict) -> dict:
    return {p: (r["epsilon"], r["delta"], r.get("epsilons")) for p, r in results["privacy"].items()}


def test_api_equals_cli_for_the_same_config_and_seed(tmp_path, capsys):
    out = tmp_path / "cli.json"
    rc = cli_main(["train", "--dataset", "breast-cancer", "--guests", "2", "--epochs", "2", "--device", "cpu",
                   "--defense", "laplace", "--epsilon", "2", "--no-progress", "--private-seed", HEX,
                   "--out", str(out)])
    assert rc == 0
    cli = json.loads(out.read_text())
    run = fl_split.train(**BASE, defense="laplace", epsilon=2.0, private_seed=HEX)
    assert _strip(run.results["history"]) == _strip(cli["history"])
    assert run.results["final"] == cli["final"]
    assert _epsilons(run.results) == _epsilons(cli)
    # the pandas views are the same numbers
    assert list(run.history.index) == [1, 2]
    assert run.history["test_metric"].tolist() == [h["test_metric"] for h in cli["history"]]
    priv = run.privacy
    assert list(priv.index) == ["host", "guest-1", "guest-2"]
    for g in ("guest-1", "guest-2"):
        assert priv.loc[g, "epsilon"] == cli["privacy"][g]["epsilon"] and priv.loc[g, "covered"]
        assert priv.loc[g, "mechanism"] == "laplace" and priv.loc[g, "accountant"] == "pld"
    assert np.isnan(priv.loc["host", "epsilon"]) and not priv.loc["host", "covered"]  # protect=guest: none claimed
    assert run.metrics["accuracy"] == cli["final"]["metrics"]["accuracy"]
    assert run.metrics["train_loss"] == cli["final"]["train_loss"]
    # results JSON as the CLI writes it
    saved = json.loads(run.save(tmp_path / "api.json").read_text())
    assert _strip(saved["history"]) == _strip(cli["history"])


def test_runconfig_mapping_and_keywords_give_the_same_run():
    cfg = RunConfig(**BASE, defense="gaussian", sigma=2.0)
    a = fl_split.train(cfg, private_seed=PrivateSeed.parse(HEX), observe=False)
    b = fl_split.train({"dataset": "breast-cancer", "guests": "2", "epochs": 2, "progress": False, "device": "cpu",
                        "defense": "gaussian", "sigma": "2"}, private_seed=HEX)
    c = fl_split.train(RunConfig(**BASE), defense="gaussian", sigma=2.0, private_seed=HEX)  # keywords override
    for other in (b, c):
        assert _strip(other.results["history"]) == _strip(a.results["history"])
        assert _epsilons(other.results) == _epsilons(a.results)
    assert a.config == cfg.replace(save_model=a.config.save_model)


@pytest.mark.parametrize("kwargs, message", [
    (dict(epoch=3), "--epoch: got 3 (unknown option; did you mean epochs?); allowed: a RunConfig option"),
    (dict(epochs="3"), "--epochs: got '3'; allowed: an integer >= 1"),
    (dict(epochs=0), "--epochs: got 0; allowed: an integer >= 1"),
    (dict(defense="mid"), "--defense: got 'mid'; allowed: one of none, laplace, gaussian, r3elu, rr, dpsgd"),
    (dict(epsilon=-1.0), "--epsilon: got -1.0; allowed: a number > 0"),
    (dict(engine="ray"), "--engine: got 'ray'; allowed: one of local, flower"),
    (dict(model=42), "--model: got 42; allowed: one of auto"),
])
def test_bad_options_are_one_line_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        fl_split.train(**{**BASE, **kwargs})
    text = str(exc.value)
    assert text.startswith(message) and "\n" not in text


def test_bad_private_seeds_and_configs_are_refused():
    with pytest.raises(PrivateSeedError, match="--private-seed"):
        fl_split.train(**BASE, private_seed="1234")  # short and guessable
    with pytest.raises(PrivateSeedError):
        fl_split.train(**BASE, private_seed="0" * 32)  # patterned
    with pytest.raises(ConfigError, match=r"--private-seed: got '<hidden>' \(got a int\)"):
        fl_split.train(**BASE, private_seed=1234)
    with pytest.raises(ConfigError, match="--config: got 'list'"):
        fl_split.train(["dataset", "digits"])
    with pytest.raises(ConfigError, match="--epochss: got 2 \\(unknown option\\)"):
        fl_split.train({"epochss": 2})


def test_lambda_model_under_flower_is_refused_and_module_functions_are_named():
    factory = lambda spec: own_mlp.build(spec)  # noqa: E731 - exists only in this process
    with pytest.raises(ConfigError) as exc:
        RunConfig(**BASE, model=factory, engine="flower")
    text = str(exc.value)
    assert text.startswith("--model: got 'tests.test_api:test_lambda_model_under_flower_is_refused_and_module_"
                           "functions_are_named.<locals>.<lambda>' (a lambda, a local function or one defined in "
                           "__main__") and "\n" not in text
    # a module-level function is its importable name: the ClientApps import it (every engine, every file)
    assert RunConfig(**BASE, model=own_mlp.build, engine="flower").model == "own_mlp:build"
    assert RunConfig(**BASE, model=factory).model is factory  # local: the function itself
    assert RunConfig.from_mapping({"model": factory}).model is factory  # a mapping (a config dict) too
    assert RunConfig(**BASE, model=factory).to_dict()["model"].endswith("<locals>.<lambda>")  # JSON: its label


def _tables(tmp_path, guests=2):
    """Each party's own table of breast-cancer (its columns, an ``ID`` column; the host's label ``Y``)."""
    ds = load_dataset("breast-cancer")
    frames = {}
    for p, sl in partition(ds, guests, True, seed=4).items():
        frame = sl.table.copy()
        frame.insert(0, "ID", sl.ids * 10 + 3)
        if p == "host":
            frame["Y"] = np.where(sl.labels == 1, "benign", "malignant")
        frames[p] = frame
        frame.to_csv(tmp_path / f"{p}.csv", index=False)
    return frames, ";".join(f"{p}={tmp_path / p}.csv" for p in frames)


def test_model_factory_equals_module_function_and_its_saved_model_predicts(tmp_path):
    frames, data = _tables(tmp_path)
    own = dict(data=data, id_column="ID", label_column="Y", guests=2, epochs=2, progress=False, device="cpu")
    by_name = fl_split.train(**own, model="own_mlp:build", private_seed=HEX, observe=False)
    by_function = fl_split.train(**own, model=own_mlp.build, private_seed=HEX, observe=False)
    factory = lambda spec: own_mlp.build(spec)  # noqa: E731 - not importable: the local engine calls it
    by_lambda = fl_split.train(**own, model=factory, private_seed=HEX)
    assert by_function.config.model == "own_mlp:build"
    assert by_lambda.results["config"]["model"].endswith("<locals>.<lambda>")
    for run in (by_function, by_lambda):
        assert _strip(run.results["history"]) == _strip(by_name.results["history"])
        assert run.results["final"] == by_name.results["final"]
    # the saved model of the lambda run predicts the run's own test rows with its reported metrics
    test_ids = prepare_data(by_lambda.config).test_ids
    new = {p: f[f.ID.isin(test_ids)].sample(frac=1.0, random_state=1) for p, f in frames.items()}
    pred = by_lambda.model.predict(new, id_column="ID", label_column="Y")
    summary = pred.attrs["summary"]
    assert summary["metrics"] == by_lambda.results["final"]["metrics"]  # no defence: the same numbers
    assert sorted(pred.ID) == sorted(test_ids) and set(pred.predicted) <= {"benign", "malignant"}
    assert list(pred.columns) == ["ID", "p_0", "p_1", "predicted"]
    # loaded from its folder, a lambda's model needs the function back (it was saved by its label)
    with pytest.raises(ConfigError, match="^--model: got 'tests.test_api:"):
        fl_split.load_model(by_lambda.model.path).predict(new, id_column="ID", label_column="Y")
    again = fl_split.load_model(by_lambda.model.path, model=factory).predict(new, id_column="ID", label_column="Y")
    assert again.attrs["summary"]["metrics"] == summary["metrics"]
    # a run's temporary model folder goes when the run and its models are gone
    folder = by_name.model.path
    assert folder.is_dir()
    del by_name
    import gc

    gc.collect()
    assert not folder.exists()


def test_attack_on_the_finished_run_equals_fl_split_attack():
    cfg = RunConfig(**BASE, defense="laplace", epsilon=4.0)
    run = fl_split.train(cfg, private_seed=HEX)
    mounted = run.attack("label-norm", guest="guest-2")
    alone = run_attack(cfg, AttackOptions(attack="label-norm", guest="guest-2"), PrivateSeed.parse(HEX))
    assert mounted["adversary"] == "guest-2" and mounted["victim"] == "host"
    assert mounted["value"] == alone["value"] and mounted["baseline"] == alone["baseline"]
    assert mounted["threat_model"] == alone["threat_model"]
    assert _strip(mounted["training"]["history"]) == _strip(run.results["history"])
    top = fl_split.attack("label-norm", cfg, private_seed=HEX, attack_options={"guest": "guest-2"})
    assert top["value"] == mounted["value"]  # fl_split.attack: its own observed run, the same numbers
    # a second attack on the same run, from another party's view
    other = run.attack("label-norm", guest="guest-1")
    assert other["adversary"] == "guest-1" and 0 <= other["value"] <= 1
    for name, need in (("membership", "public records taken out of training"), ("fsha", "a malicious host")):
        with pytest.raises(ConfigError, match=f"its threat model needs {need}: fl_split.attack"):
            run.attack(name)
    with pytest.raises(ConfigError, match="--attack-epochs: got 0"):
        run.attack("label-completion", attack_epochs=0)
    with pytest.raises(ConfigError, match="--guests: got 'guest-9'|--guest: got 'guest-9'"):
        run.attack("label-norm", guest="guest-9")
    unobserved = fl_split.train(cfg, private_seed=HEX, observe=False)
    with pytest.raises(ConfigError, match="nobody's view of this run was kept: it was trained with observe=False"):
        unobserved.attack("label-norm")


def test_public_surface_is_documented():
    assert sorted(fl_split.__all__) == sorted(set(fl_split.__all__))
    for name in fl_split.__all__:
        obj = getattr(fl_split, name)
        if name in ("__version__", "ATTACK_NAMES"):
            continue
        assert (obj.__doc__ or "").strip(), f"fl_split.{name} has no docstring"
    from fl_split import api

    for cls in (api.Run, api.SavedModel):
        for attr, value in vars(cls).items():
            if not attr.startswith("_"):
                assert (getattr(value, "__doc__", None) or "").strip(), f"{cls.__name__}.{attr} has no docstring"
    with pytest.raises(AttributeError):
        fl_split.no_such_name  # noqa: B018


@pytest.mark.slow
def test_flower_engine_through_the_api_equals_local():
    """``engine="flower"`` (a Ray simulation, every party in its own actor): a module-level model
    function is imported by name in the ClientApps; the run, each party's saved part and an attack
    mounted afterwards (from the recordings each party kept on its own node) equal the local engine's."""
    kw = dict(BASE, defense="laplace", epsilon=2.0, model=own_mlp.build)
    flower = fl_split.train(**kw, engine="flower", private_seed=HEX)
    local = fl_split.train(**kw, private_seed=HEX)
    assert flower.config.model == "own_mlp:build" and flower.results["plan"]["engine"] == "flower"
    assert _strip(flower.results["history"]) == _strip(local.results["history"])
    assert _epsilons(flower.results) == _epsilons(local.results)
    assert flower.model.parties == ["host", "guest-1", "guest-2"]
    assert flower.attack("label-norm")["value"] == local.attack("label-norm")["value"]


def test_a_regression_run_trains_and_refuses_attacks_in_one_line():
    run = fl_split.train(dataset="diabetes", task="regression", guests=1, epochs=1, progress=False, device="cpu",
                         private_seed=HEX)
    assert run.results["final"]["task"] == "regression" and set(run.metrics) >= {"r2", "mae", "rmse"}
    assert len(run.history) == 1
    with pytest.raises(ConfigError, match="its task is regression, and the attacks are built for class labels"):
        run.attack("label-norm")


def _readme_python_example() -> str:
    """The README's Python-API example, as a user copies it: the ```python block after "From Python"."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    after = text[text.index("From Python"):]
    start = after.index("```python\n") + len("```python\n")
    return after[start:after.index("```", start)]


def test_readme_python_example_runs_as_written(capsys):
    """The README's snippet, executed exactly as it stands there (it once trained digits under Laplace at
    ε = 1 to 0.593 and then raised "digits is not binary" from ``run.attack("label-norm")``)."""
    code = _readme_python_example()
    assert "fl_split.train(" in code and ".attack(" in code
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the documented example itself
    out = capsys.readouterr().out.splitlines()
    run = scope["run"]
    assert run.metrics["accuracy"] > 0.9  # "about 0.95": the settings learn
    assert float(out[0]) == run.metrics["accuracy"]
    assert "laplace" in "\n".join(out) and 0.0 <= float(out[-1]) <= 1.0  # the attack's AUC
