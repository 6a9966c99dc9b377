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
