"""Saving each party's part, ``fl-split predict`` and ``--init-from`` (issue 24, docs/serving.md).

train → save → predict on the run's own test rows gives exactly the metrics the run reported (no
defence); a guest's part holds no host parameter and no label, the host's nothing of a guest's, no
part a secret; tampered or mismatched parts are refused in one line; every prediction is a release
charged once per new record to the guest's inference ledger."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat

import numpy as np
import pandas as pd
import pytest
import torch

from fl_split.builder import make_parties, prepare_data
from fl_split.config import RunConfig
from fl_split.data.base import partition
from fl_split.data.registry import load_dataset
from fl_split.engine import run_experiment
from fl_split.errors import DataError
from fl_split.predict import predict
from fl_split.seeding import PrivateSeed

PS_HEX = "6e2b94d17a03c8f5b19e4d72c05a83f1"
PS = PrivateSeed.parse(PS_HEX)


def _tables(tmp_path, dataset="breast-cancer", guests=2, labels=None):
    """Each party's table of ``dataset`` (its rows in its own order, an ``ID`` column, the host's label ``Y``)."""
    ds = load_dataset(dataset)
    paths = {}
    for p, sl in partition(ds, guests, True, seed=4).items():
        frame = sl.table.copy()
        frame.insert(0, "ID", sl.ids * 10 + 3)
        if p == "host":
            frame["Y"] = sl.labels if labels is None else labels(sl.labels)
        paths[p] = tmp_path / f"{p}.csv"
        frame.to_csv(paths[p], index=False)
    return paths


def _train(tmp_path, paths, **kw):
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    cfg = RunConfig(data=spec, id_column="ID", label_column="Y", guests=len(paths) - 1, epochs=2, progress=False,
                    save_model=str(tmp_path / "model"), **kw)
    return cfg, run_experiment(cfg, PS)


def _rows(tmp_path, paths, ids, tag="new"):
    """Each party's new table: its rows of ``ids``, in its own order."""
    out = {}
    for p, path in paths.items():
        frame = pd.read_csv(path)
        out[p] = tmp_path / f"{tag}-{p}.csv"
        frame[frame.ID.isin(ids)].to_csv(out[p], index=False)
    return out


def test_predict_on_the_test_rows_gives_the_runs_metrics(tmp_path):
    paths = _tables(tmp_path, labels=lambda y: np.where(y == 1, "benign", "malignant"))
    cfg, res = _train(tmp_path, paths)
    test_ids = prepare_data(cfg).test_ids
    new = _rows(tmp_path, paths, test_ids)
    out = tmp_path / "pred.csv"
    s = predict(str(tmp_path / "model"), {p: str(v) for p, v in new.items()}, "ID", str(out), label_column="Y")
    assert s["records"] == len(test_ids) and s["task"] == "binary"
    assert s["metrics"] == res["final"]["metrics"]  # identical: same model, same rows, no defence
    pred = pd.read_csv(out)
    assert list(pred.columns) == ["ID", "p_0", "p_1", "predicted"] and sorted(pred.ID) == sorted(test_ids)
    assert set(pred.predicted) <= {"benign", "malignant"}  # the host's label mapping, kept by the host
    np.testing.assert_allclose(pred.p_0 + pred.p_1, 1, atol=1e-6)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    for g in ("guest-1", "guest-2"):
        assert s["privacy"][g]["covered"] is False and s["privacy"][g]["epsilon"] is None


def test_regression_predictions_in_label_units(tmp_path):
    paths = _tables(tmp_path, dataset="diabetes", guests=1)
    cfg, res = _train(tmp_path, paths, batch_size=64, task="regression")  # an integer-valued target: said explicitly
    assert res["final"]["task"] == "regression"
    new = _rows(tmp_path, paths, prepare_data(cfg).test_ids)
    s = predict(str(tmp_path / "model"), {p: str(v) for p, v in new.items()}, "ID", str(tmp_path / "p.csv"),
                label_column="Y")
    for m in ("r2", "mae", "rmse"):
        assert s["metrics"][m] == pytest.approx(res["final"]["metrics"][m], rel=1e-6)
    pred = pd.read_csv(tmp_path / "p.csv")
    assert list(pred.columns) == ["ID", "prediction"] and 25 < pred.prediction.mean() < 350


def _state_keys(path) -> dict:
    return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)


def test_each_part_holds_only_its_own_and_no_secret(tmp_path):
    paths = _tables(tmp_path, labels=lambda y: np.where(y == 1, "benign", "malignant"))
    cfg, _ = _train(tmp_path, paths, defense="gaussian")
    model = tmp_path / "model"
    assert sorted(os.listdir(model)) == ["guest-1", "guest-2", "host"]
    host_state = _state_keys(model / "host" / "model.pt")
    assert set(host_state) == {"bottom", "top"}
    host_tensors = [t for part in host_state.values() for t in part.values()]
    labels = pd.read_csv(paths["host"])["Y"]
    for g in ("guest-1", "guest-2"):
        folder = model / g
        assert sorted(os.listdir(folder)) == ["manifest.json", "mechanism.json", "model.pt", "preprocessing.json"]
        state = _state_keys(folder / "model.pt")
        assert set(state) == {"bottom"}  # no top, no host bottom
        for t in state["bottom"].values():  # no host parameter, not even an equal one
            assert not any(t.shape == h.shape and torch.equal(t, h) for h in host_tensors)
        pre = json.loads((folder / "preprocessing.json").read_text())
        own = [c for c in pd.read_csv(paths[g]).columns if c != "ID"]
        assert [c["name"] for c in pre["columns"]] == own  # its own columns only: no label, no host column
        text = b"".join((folder / f).read_bytes() for f in os.listdir(folder) if f != "model.pt")
        # no label, no label mapping or scaling (the label column's *name* is in the public configuration only)
        assert b"target_scale" not in text and b'"classes"' not in text and b"task.json" not in text
        assert b"benign" not in text and b'"Y"' not in (folder / "preprocessing.json").read_bytes()
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["config"]["data"] == "" and "guest_shapes" not in manifest
        assert json.loads((folder / "mechanism.json").read_text())["name"] == "gaussian"
        for f in os.listdir(folder):
            assert stat.S_IMODE(os.stat(folder / f).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    guest_tensors = [t for g in ("guest-1", "guest-2") for t in _state_keys(model / g / "model.pt")["bottom"].values()]
    for h in host_tensors:  # the host's part holds nothing of a guest's
        assert not any(h.shape == t.shape and torch.equal(h, t) for t in guest_tensors)
    assert json.loads((model / "host" / "task.json").read_text())["classes"] == sorted(set(labels.tolist()))
    everything = b"".join((model / p / f).read_bytes() for p in os.listdir(model) for f in os.listdir(model / p))
    assert PS_HEX.encode() not in everything and bytes.fromhex(PS_HEX) not in everything
    assert b"secret" not in everything.lower() and b"private_seed" not in everything


def test_tampered_and_mismatched_parts_are_refused(tmp_path, capsys):
    paths = _tables(tmp_path)
    cfg, _ = _train(tmp_path, paths)
    model = tmp_path / "model"
    new = {p: str(v) for p, v in _rows(tmp_path, paths, prepare_data(cfg).test_ids).items()}

    def refused(match, tables=new):
        with pytest.raises(DataError, match=match) as exc:
            predict(str(model), tables, "ID", str(tmp_path / "p.csv"), label_column="Y")
        assert "\n" not in str(exc.value)

    blob = bytearray((model / "guest-1" / "model.pt").read_bytes())
    blob[-20] ^= 1
    original = (model / "guest-1" / "model.pt").read_bytes()
    (model / "guest-1" / "model.pt").write_bytes(bytes(blob))
    refused("guest-1: model.pt does not match the SHA-256")
    from fl_split.cli import main

    code = main(["predict", "--model", str(model), *[a for p, v in new.items() for a in ("--data", f"{p}={v}")],
                 "--id-column", "ID", "--out", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "model.pt does not match the SHA-256" in err[0]
    assert not (tmp_path / "p.csv").exists()  # refused before anything is released or written
    (model / "guest-1" / "model.pt").write_bytes(original)
    refused("the parts given are", {p: v for p, v in new.items() if p != "guest-2"})
    # a guest part of another model (another cut-layer width) does not fit the host's top
    other = tmp_path / "other"
    other.mkdir()
    _train(other, _tables(other), hidden="32,16")
    shutil.rmtree(model / "guest-2")
    shutil.copytree(other / "model" / "guest-2", model / "guest-2")
    refused("guest-2's manifest has another")


def test_predict_charges_each_new_record_once(tmp_path):
    from fl_split.privacy.ledger import Ledger

    paths = _tables(tmp_path)
    cfg, res = _train(tmp_path, paths, defense="laplace", epsilon=2.0)
    ids = prepare_data(cfg).test_ids[:40]
    new = {p: str(v) for p, v in _rows(tmp_path, paths, ids).items()}
    eps = []
    for _ in range(2):
        s = predict(str(tmp_path / "model"), new, "ID", str(tmp_path / "p.csv"), label_column="Y")
        eps.append(s["privacy"]["guest-1"]["epsilon"])
        assert s["privacy"]["guest-1"]["covered"] and s["privacy"]["guest-1"]["records"] == 40
    state = dict(np.load(tmp_path / "model" / "guest-1" / "inference-ledger.npz", allow_pickle=False))
    from fl_split.state import unflatten

    skeleton = json.loads(str(state.pop("__skeleton__")))
    ledger = Ledger.from_state(unflatten(state, skeleton))
    assert len(ledger) == 2 and ledger.releases == 2 * 40 and ledger.releases_per_record() == 2
    from fl_split.errors import BudgetExceeded

    with pytest.raises(BudgetExceeded):  # a third call would go past what two spent: refused, nothing written
        predict(str(tmp_path / "model"), new, "ID", str(tmp_path / "p3.csv"), label_column="Y", budget=eps[1] + 1e-3)
    assert not (tmp_path / "p3.csv").exists()
    # pure epsilon = 2 per release of one record's whole cut-layer tensor: basic composition over the 2 calls
    # is 4 exactly; the reported accountant (pld) composes the 64 elements' Laplace events tightly (issue 26):
    # at most the pure values, and growing with each call
    assert ledger.epsilon("basic") == pytest.approx(4.0, rel=1e-12)
    assert 0 < eps[0] <= 2.0 + 1e-9 and eps[0] < eps[1] <= 4.0 + 1e-9


def test_init_from_loads_each_partys_own_part(tmp_path):
    paths = _tables(tmp_path)
    cfg, _ = _train(tmp_path, paths)
    host, guests, _ = make_parties(cfg.replace(save_model="", init_from=str(tmp_path / "model")))
    saved = _state_keys(tmp_path / "model" / "guest-1" / "model.pt")["bottom"]
    for k, v in guests["guest-1"].bottom.state_dict().items():
        assert torch.equal(v, saved[k])
    saved_top = _state_keys(tmp_path / "model" / "host" / "model.pt")["top"]
    for k, v in host.top.state_dict().items():
        assert torch.equal(v, saved_top[k])
    with pytest.raises(DataError, match="init-from .*host's saved part has guest_shapes .*; refused"):
        make_parties(cfg.replace(save_model="", init_from=str(tmp_path / "model"), hidden="32,16"))


@pytest.mark.usefixtures("flower_task_identity")
def test_flower_nodes_save_their_own_parts_like_the_local_engine(tmp_path):
    """The ClientApp handlers (inline grid, no Ray): each node writes its own part when it reports;
    with the same seeds the parts hold the local engine's weights."""
    from tests.test_flower import PS as FLOWER_PS  # the private seed the simulated nodes derive theirs from
    from tests.test_flower import InlineGrid, _cfg, _simulation_nodes

    from fl_split.engine import LocalEngine
    from fl_split.flower.strategy import VerticalSplitStrategy

    cfg = _cfg(guests=1, save_model=str(tmp_path / "flower"))
    VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(2), fresh_process=True))
    LocalEngine(cfg.replace(save_model=str(tmp_path / "local")), FLOWER_PS).run()
    for p in ("host", "guest-1"):
        a, b = _state_keys(tmp_path / "flower" / p / "model.pt"), _state_keys(tmp_path / "local" / p / "model.pt")
        assert a.keys() == b.keys()
        for part in a:
            for k in a[part]:
                assert torch.equal(a[part][k], b[part][k]), (p, part, k)


def test_train_saves_the_model_into_its_run_directory_by_default(tmp_path, monkeypatch, capsys):
    from fl_split.cli import main

    monkeypatch.setenv("FL_SPLIT_RUNS", str(tmp_path / "runs"))
    assert main(["train", "--dataset", "breast-cancer", "--epochs", "1", "--limit", "200", "--no-progress"]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert sorted(os.listdir(folder)) == ["curves.png", "epochs.csv", "model", "results.json"]
    assert sorted(os.listdir(folder / "model")) == ["guest-1", "host"]
    assert json.loads((folder / "results.json").read_text())["saved_model"]["dir"] == str(folder / "model")
    assert "model/: each party's saved part" in capsys.readouterr().out
    # --out without --run-dir: no run directory, and no model unless --save-model names one
    assert main(["train", "--dataset", "breast-cancer", "--epochs", "1", "--limit", "200", "--no-progress",
                 "--out", str(tmp_path / "r.json")]) == 0
    assert "saved_model" not in json.loads((tmp_path / "r.json").read_text())


def test_predict_with_psi_scores_the_intersection(tmp_path):
    paths = _tables(tmp_path, guests=1)
    cfg, res = _train(tmp_path, paths)
    prepared = prepare_data(cfg)
    test_ids, train_ids = prepared.test_ids, prepared.train_ids
    new = _rows(tmp_path, paths, test_ids)
    # the host holds 5 IDs the guest does not, the guest 7 the host does not
    host = pd.concat([pd.read_csv(new["host"]), pd.read_csv(paths["host"]).query("ID in @train_ids[:5]")])
    guest = pd.concat([pd.read_csv(new["guest-1"]), pd.read_csv(paths["guest-1"]).query("ID in @train_ids[5:12]")])
    host.to_csv(new["host"], index=False)
    guest.to_csv(new["guest-1"], index=False)
    tables = {p: str(v) for p, v in new.items()}
    with pytest.raises(DataError, match=r"^guest-1 \(table .*new-guest-1\.csv, saved part .*guest-1\): 5 of the host's "
                                        r"\d+ IDs are not in its rows; IDs \d+"):  # public: every host ID needed
        predict(str(tmp_path / "model"), tables, "ID", str(tmp_path / "p.csv"), label_column="Y")
    s = predict(str(tmp_path / "model"), tables, "ID", str(tmp_path / "p.csv"), align="psi", label_column="Y")
    assert s["records"] == len(test_ids) and s["metrics"] == res["final"]["metrics"]
    assert sorted(pd.read_csv(tmp_path / "p.csv").ID) == sorted(test_ids)


def test_predictions_join_back_on_the_users_own_composite_key(tmp_path):
    """A composite key (text name + a Parquet date at the host; CSV text at the guests), long
    non-ASCII names: the CLI's predictions CSV carries the key as the host's own columns and values
    (no quotes, no truncation), and :meth:`SavedModel.predict` given the host's DataFrame returns them
    with that DataFrame's own dtypes — a pandas merge on the user's columns matches every row, 1:1."""
    import fl_split
    from fl_split.cli import main
    from tests.test_join_keys import _composite

    paths = _composite(tmp_path)
    for party, path in paths.items():  # long, non-ASCII names: over 40 characters
        frame = pd.read_parquet(path) if path.endswith(".parquet") else pd.read_csv(path)
        frame["name"] = "Frau Dr. Ünal-Čapek, geb. Øster—" + frame["name"].astype(str)
        frame.to_parquet(path, index=False) if path.endswith(".parquet") else frame.to_csv(path, index=False)
    flags = [a for p, v in paths.items() for a in ("--data", f"{p}={v}")]
    flags += ["--id-column", "name,birth_date", "--label-column", "Y"]
    model = tmp_path / "model"
    assert main(["train", *flags, "--epochs", "1", "--defense", "gaussian", "--no-progress",
                 "--private-seed", "3f9d27c1b08e64a5d2c71e90b4a6f358", "--save-model", str(model),
                 "--out", str(tmp_path / "r.json")]) == 0
    out = tmp_path / "pred.csv"
    assert main(["predict", "--model", str(model), *flags, "--out", str(out)]) == 0
    host = pd.read_parquet(paths["host"])
    pred = pd.read_csv(out, parse_dates=["birth_date"])
    assert list(pred.columns[:2]) == ["name", "birth_date"] and len(pred) == len(host)
    assert pred["name"].str.len().max() > 40 and not pred["name"].str.startswith("'").any()
    joined = host.merge(pred, on=["name", "birth_date"], validate="one_to_one")
    assert len(joined) == len(host)
    # the Python API: the host's own DataFrame in, its own dtypes out
    frame = fl_split.load_model(model).predict({"host": host, **{g: paths[g] for g in ("guest-1", "guest-2")}},
                                                id_column="name,birth_date", label_column="Y")
    assert frame[["name", "birth_date"]].dtypes.tolist() == host[["name", "birth_date"]].dtypes.tolist()
    assert len(host.merge(frame, on=["name", "birth_date"], validate="one_to_one")) == len(host)
    assert frame["p_1"].dtype == np.float64 and set(frame["predicted"]) <= {0, 1}


def test_predict_cli_and_api_apply_the_guests_own_limits(tmp_path, capsys):
    """``--max-queries-per-id N`` (default 3) and ``--budget E`` are each guest's own inference limits
    in one process (docs/serving.md "Inference limits"): past the cap the call is refused with one
    line, exit code 1, no predictions written and the guests' ledger and query files unchanged; a cap
    that is not an integer >= 1 is one usage line; ``SavedModel.predict`` takes the same limits."""
    import fl_split
    from fl_split.cli import main
    from tests.test_threat_model import _files_of

    paths = _tables(tmp_path)
    cfg, _ = _train(tmp_path, paths, defense="laplace", epsilon=2.0)
    new = _rows(tmp_path, paths, prepare_data(cfg).test_ids[:20])
    model = tmp_path / "model"
    flags = ["predict", "--model", str(model), *[a for p, v in new.items() for a in ("--data", f"{p}={v}")],
             "--id-column", "ID", "--label-column", "Y"]
    assert main([*flags, "--out", str(tmp_path / "p1.csv"), "--max-queries-per-id", "1"]) == 0
    capsys.readouterr()
    before = {g: _files_of(model / g) for g in ("guest-1", "guest-2")}
    assert set(before["guest-1"]) == {"inference-ledger.npz", "inference-queries.npz"}
    assert main([*flags, "--out", str(tmp_path / "p2.csv"), "--max-queries-per-id", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "guest-1: release refused, per-ID query cap reached: 20 of the 20" in err
    assert {g: _files_of(model / g) for g in before} == before and not (tmp_path / "p2.csv").exists()
    assert main([*flags, "--out", str(tmp_path / "p2.csv"), "--max-queries-per-id", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max-queries-per-id" in err
    # the default cap (3): two more calls, then refused; the API the same
    frame = fl_split.load_model(model).predict({p: str(v) for p, v in new.items()}, id_column="ID", label_column="Y")
    assert frame.attrs["summary"]["privacy"]["guest-1"]["limits"]["max_queries_per_id"] == 3
    assert main([*flags, "--out", str(tmp_path / "p3.csv")]) == 0
    assert main([*flags, "--out", str(tmp_path / "p4.csv")]) == 1 and not (tmp_path / "p4.csv").exists()
    assert main([*flags, "--out", str(tmp_path / "p4.csv"), "--max-queries-per-id", "4"]) == 0  # its own to raise


@pytest.mark.parametrize("engine", ["local", "flower"])
def test_a_secure_merge_model_is_refused_by_predict_before_anything_is_released(tmp_path, engine):
    """Train → save → predict with ``--secure-merge`` (a user's cross-product): the host only ever held the
    guests' masked sum, and predict has no masking session, so the model is refused in one line by every
    engine's entry and by each guest's own part — no prediction file, no inference ledger, no query count."""
    from fl_split.errors import ConfigError
    from fl_split.flower.predict_sim import predict_flower
    from fl_split.predict import GuestScorer

    paths = _tables(tmp_path, guests=2)
    cfg, res = _train(tmp_path, paths, merge="sum", secure_merge=True, defense="gaussian", sigma=1.0)
    assert res["config"]["secure_merge"] and (tmp_path / "model" / "guest-1").is_dir()
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "model").rglob("*"))
    new = _rows(tmp_path, paths, pd.read_csv(paths["host"]).ID[:40])
    run = predict if engine == "local" else predict_flower
    tables = {p: str(v) for p, v in new.items()}
    with pytest.raises(ConfigError) as err:
        run(str(tmp_path / "model"), tables, "ID", str(tmp_path / "pred.csv"), label_column="Y")
    text = str(err.value)
    assert text.startswith("--model: got ") and "masked sum" in text and "\n" not in text
    assert "allowed: a model trained without --secure-merge" in text
    with pytest.raises(ConfigError, match="masked sum"):  # a guest's node refuses its own part as well
        GuestScorer(str(tmp_path / "model"), "guest-1", tables["guest-1"], "ID")
    assert not (tmp_path / "pred.csv").exists()
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "model").rglob("*")) == before  # nothing written
