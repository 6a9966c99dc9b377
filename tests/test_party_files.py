"""Party data files for a Flower deployment: round trip, no labels in guest files, plan from facts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fl_split.builder import plan_run, prepare_data
from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.errors import ConfigError, DataError
from fl_split.party_files import (
    DATA_KEYS, check_facts, export_parties, load_party, plan_from_facts, public_facts, save_party,
)


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=2, limit=300, seed=3, progress=False)
    base.update(kw)
    return RunConfig(**base)


def _same_tensor(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kw", [{}, {"host_features": False, "guests": 3}, {"padding": True}])
def test_round_trip_equals_prepared_data(tmp_path, kw):
    cfg = _cfg(**kw)
    files = export_parties(cfg, tmp_path)
    prepared = prepare_data(cfg)
    assert sorted(files) == sorted(prepared.parties) == sorted(["host", *[f"guest-{i}" for i in range(1, cfg.guests + 1)]])
    for party, path in files.items():
        assert path == tmp_path / f"{party}.npz"
        data, facts = load_party(path)
        want = prepared.parties[party]
        assert data.party == party
        np.testing.assert_array_equal(data.train_ids, want.train_ids)
        np.testing.assert_array_equal(data.test_ids, want.test_ids)
        for name in ("x_train", "x_test", "y_train", "y_test"):
            assert _same_tensor(getattr(data, name), getattr(want, name)), (party, name)
        assert data.feature_names == want.feature_names and data.padded == want.padded
        assert facts.data_config == {k: getattr(cfg, k) for k in DATA_KEYS}
        assert facts.n_train == len(prepared.train_ids) and facts.n_test == len(prepared.test_ids)


def test_guest_file_holds_no_labels(tmp_path):
    cfg = _cfg()
    files = export_parties(cfg, tmp_path)
    y_host = prepare_data(cfg).parties["host"].y_train.numpy()
    for party in ("guest-1", "guest-2"):
        with np.load(files[party], allow_pickle=False) as z:
            names = set(z.files)
            meta = json.loads(z["__meta__"].tobytes().decode("utf-8"))
            arrays = [z[n] for n in z.files if n != "__meta__"]
        assert names == {"train_ids", "test_ids", "x_train", "x_test", "__meta__"}
        # nor anything that could be the label column under another name, nor the label space
        assert not any(a.shape == y_host.shape and np.array_equal(a, y_host) for a in arrays)
        assert meta["num_classes"] == 0 and meta["facts"]["num_classes"] is None
        data, facts = load_party(files[party])
        assert data.y_train is None and data.y_test is None and facts.num_classes is None
    with np.load(files["host"], allow_pickle=False) as z:
        assert {"y_train", "y_test"} <= set(z.files)
        np.testing.assert_array_equal(z["y_train"], y_host)


def test_save_refuses_a_guest_with_labels(tmp_path):
    cfg = _cfg()
    prepared = prepare_data(cfg)
    bad = prepared.parties["guest-1"]
    import dataclasses

    bad = dataclasses.replace(bad, y_train=prepared.parties["host"].y_train)
    with pytest.raises(ValueError, match="guest.*must not hold labels"):
        save_party(tmp_path / "g.npz", bad, public_facts(cfg, prepared))
    assert not (tmp_path / "g.npz").exists()


@pytest.mark.parametrize("kw", [{}, {"model": "mlp", "hidden": "32,16", "cut_layer": 2, "merge": "sum"},
                                {"host_features": False}])
def test_plan_from_facts_equals_plan_from_data(tmp_path, kw):
    cfg = _cfg(**kw)
    files = export_parties(cfg, tmp_path)
    want = plan_run(cfg)
    for path in files.values():
        _, facts = load_party(path)
        got = plan_from_facts(cfg, facts)
        assert (got.arch, got.cut, got.input_shapes, got.cut_shapes, got.merged_shape, got.metric,
                got.guest_cut_activation) == (want.arch, want.cut, want.input_shapes, want.cut_shapes,
                                              want.merged_shape, want.metric, want.guest_cut_activation)
        assert (got.schedule.n_train, got.schedule.n_test) == (want.schedule.n_train, want.schedule.n_test)
        np.testing.assert_array_equal(got.schedule.order(2), want.schedule.order(2))
    _, host_facts = load_party(files["host"])
    assert plan_from_facts(cfg, host_facts).num_outputs == want.num_outputs == 10


def test_run_config_must_match_the_export(tmp_path):
    cfg = _cfg()
    _, facts = load_party(export_parties(cfg, tmp_path)["guest-1"])
    check_facts(cfg.replace(epochs=9, lr=0.5, batch_size=7), facts, "guest-1.npz")  # training options are free
    with pytest.raises(ConfigError, match=r"^--seed: got 4 \(guest-1.npz was exported with seed=3"):
        check_facts(cfg.replace(seed=4), facts, "guest-1.npz")
    with pytest.raises(ConfigError, match="--guests"):
        check_facts(cfg.replace(guests=1), facts, "guest-1.npz")


def test_missing_or_foreign_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist.*export-parties"):
        load_party(tmp_path / "nope.npz")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(DataError, match="not an fl_split party file"):
        load_party(tmp_path / "other.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not an fl_split party file"):
        load_party(tmp_path / "junk.npz")


def test_cli_export_parties(tmp_path, capsys):
    out = tmp_path / "parties"
    code = main(["export-parties", "--dataset", "digits", "--guests", "3", "--limit", "200", "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["guest-1.npz", "guest-2.npz", "guest-3.npz", "host.npz"]
    printed = capsys.readouterr().out
    assert f"guest-3: {out / 'guest-3.npz'}" in printed
    _, facts = load_party(out / "guest-2.npz")
    assert facts.data_config["guests"] == 3 and facts.data_config["limit"] == 200


def test_cli_export_parties_bad_input_is_one_line(tmp_path, capsys):
    afile = tmp_path / "f"
    afile.write_text("x")
    assert main(["export-parties", "--out", str(afile)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fl-split: error: --out") and "directory" in err[0]
    assert main(["export-parties", "--guests", "99", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fl-split: error: --guests")
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").iterdir())


# -- tables an organisation holds: CSV / Parquet with an ID column -------------------------------------------
import shutil  # noqa: E402

import pandas as pd  # noqa: E402

from fl_split.engine import run_experiment  # noqa: E402
from fl_split.party_files import check_parties, load_parties  # noqa: E402
from fl_split.seeding import PrivateSeed  # noqa: E402


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("kw", [{}, {"dataset": "credit", "guests": 1}, {"padding": True}])
def test_table_files_round_trip_exactly(tmp_path, fmt, kw):
    cfg = _cfg(**kw)
    files = export_parties(cfg, tmp_path, fmt)
    prepared = prepare_data(cfg)
    for party, path in files.items():
        assert path == tmp_path / f"{party}.{fmt}" and (tmp_path / f"{party}.meta.json").is_file()
        table = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
        assert table.columns[0] == "id" and ("label" in table.columns) == (party == "host")
        # the organisation's own row order, not the shared lists'
        want_ids = np.concatenate([prepared.parties[party].train_ids, prepared.parties[party].test_ids])
        assert sorted(table["id"]) == sorted(want_ids) and list(table["id"]) != list(want_ids)
        data, facts = load_party(path, party)
        want = prepared.parties[party]
        for name in ("x_train", "x_test", "y_train", "y_test"):
            assert _same_tensor(getattr(data, name), getattr(want, name)), (party, name)
        np.testing.assert_array_equal(data.train_ids, want.train_ids)
        assert data.feature_names == want.feature_names and facts.data_config["seed"] == cfg.seed


def test_local_engine_from_party_files_equals_prepared_data(tmp_path):
    cfg = _cfg(epochs=1, defense="gaussian", sigma=0.7)
    export_parties(cfg, tmp_path, "csv")
    a = run_experiment(cfg, private_seed=PrivateSeed.legacy(4))
    b = run_experiment(cfg.replace(party_files=str(tmp_path)), private_seed=PrivateSeed.legacy(4))
    assert a["final"] == b["final"] and a["privacy"]["guest-1"]["epsilon"] == b["privacy"]["guest-1"]["epsilon"]


def _edit_csv(path, fn):
    t = pd.read_csv(path)
    fn(t).to_csv(path, index=False, float_format="%.9g")


def _edit_meta(path, fn):
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def test_table_file_errors_name_the_party_and_the_problem(tmp_path):
    cfg = _cfg()
    src = tmp_path / "src"
    export_parties(cfg, src, "csv")

    def fresh():
        d = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        shutil.copytree(src, d)
        return d

    d = fresh()
    (d / "guest-2.csv").unlink()
    with pytest.raises(DataError, match=r"^guest-2: no data file in .* \(looked for guest-2\.npz, \.csv, \.parquet"):
        load_parties(cfg, d)
    d = fresh()
    (d / "guest-1.meta.json").unlink()
    with pytest.raises(DataError, match=r"^guest-1: .*guest-1\.csv has no metadata file guest-1\.meta\.json"):
        load_parties(cfg, d)
    d = fresh()  # a shared ID missing from a party's rows
    _edit_csv(d / "guest-1.csv", lambda t: t.iloc[1:])
    with pytest.raises(DataError, match=r"^guest-1 \(guest-1\.csv\): 1 shared IDs are missing from its rows: \d+$"):
        load_parties(cfg, d)
    d = fresh()  # an ID twice
    _edit_csv(d / "guest-2.csv", lambda t: pd.concat([t, t.iloc[:1]]))
    with pytest.raises(DataError, match=r"^guest-2: .*IDs \d+ appear more than once"):
        load_parties(cfg, d)
    d = fresh()  # a feature column missing
    _edit_csv(d / "guest-1.csv", lambda t: t.drop(columns=[t.columns[2]]))
    with pytest.raises(DataError, match=r"^guest-1: .*lacks the column\(s\) 'c0_r"):
        load_parties(cfg, d)
    d = fresh()  # a non-finite value
    _edit_csv(d / "guest-2.csv", lambda t: t.assign(**{t.columns[3]: np.nan}))
    with pytest.raises(DataError, match=r"^guest-2: .*x_train holds NaN or infinite values"):
        load_parties(cfg, d)
    d = fresh()  # labels in a guest's file
    _edit_csv(d / "guest-1.csv", lambda t: t.assign(label=0))
    with pytest.raises(DataError, match=r"^guest-1: .*has a 'label' column; a guest's file must not hold labels"):
        load_parties(cfg, d)
    d = fresh()  # two parties claim a column (names are public metadata here)
    host_names = json.loads((d / "host.meta.json").read_text())["feature_names"]
    _edit_meta(d / "guest-2.meta.json", lambda m: m.update(feature_names=[host_names[0], *m["feature_names"][1:]]))
    with pytest.raises(DataError, match=r"^guest-2: feature column\(s\) \['0'\] are also host's; each column "
                                        r"belongs to one party"):
        load_parties(cfg, d)
    d = fresh()  # another party's file under this party's name
    shutil.copy(d / "guest-1.csv", d / "guest-2.csv")
    shutil.copy(d / "guest-1.meta.json", d / "guest-2.meta.json")
    with pytest.raises(DataError, match=r"^guest-2: .*guest-2\.csv holds guest-1's data, not guest-2's"):
        load_parties(cfg, d)
    d = fresh()  # run options that differ from the export
    with pytest.raises(ConfigError, match=r"^--seed: got 9 \(host's file host\.csv was exported with seed=3"):
        load_parties(cfg.replace(seed=9), d)
    d = fresh()  # two formats for one party
    export_parties(cfg, d, "npz")
    with pytest.raises(DataError, match=r"^host: several data files .*host\.npz, host\.csv|host\.csv, host\.npz"):
        load_parties(cfg, d)


def test_parties_from_different_exports_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    export_parties(_cfg(), a, "npz")
    export_parties(_cfg(test_fraction=0.3), b, "npz")
    loaded = {"host": load_party(a / "host.npz", "host"), "guest-1": load_party(b / "guest-1.npz", "guest-1")}
    with pytest.raises(DataError, match=r"^guest-1: its file disagrees with host's about the data options"):
        check_parties(loaded)


def test_party_files_option_errors_before_training(tmp_path, capsys):
    code = main(["train", "--party-files", str(tmp_path), "--guests", "2", "--limit", "300", "--seed", "3",
                 "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("fl-split: error: host: no data file in")
    with pytest.raises(ConfigError, match=r"^--party-files: .*empty with --engine flower"):
        _cfg(party_files=str(tmp_path), engine="flower")


def test_cli_export_parties_csv(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["export-parties", "--guests", "2", "--limit", "200", "--format", "csv", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["guest-1.csv", "guest-1.meta.json", "guest-2.csv",
                                                     "guest-2.meta.json", "host.csv", "host.meta.json"]
    assert "guest-2: " in capsys.readouterr().out
