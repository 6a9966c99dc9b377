"""``fl-split export-model`` (issue 24, docs/serving.md "Serving outside fl_split").

The exported TorchScript and ONNX (onnxruntime) modules give the fl_split modules' outputs on the
same inputs, for a guest and the host, binary and regression; the host's exported pipeline on the
exported guests' cut outputs gives ``fl-split predict``'s predictions (no mechanism) and, on the
same noisy releases, the fl_split host's; each input is built from raw columns with the schema's
encoder alone. The exported files hold no secret and nothing of another party's; tampered and
mismatched parts are refused in one line.

Tolerances: TorchScript runs the very aten kernels of the eager module (differences only from a
traced graph's op order: 1e-6 absolute); onnxruntime has its own float32 kernels (MLAS GEMM with
another summation order, exp in the softmax): each op differs by a few ulp (~1e-7 relative), a
3-layer MLP of width <= 128 sums <= 128 products per output, so 2e-5 absolute on probabilities
and on the standardised regression output (times the target's sd in label units) bounds it with
room; ``fl-split predict``'s CSV is float64 printed from float32 values (exact to 1e-7)."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import warnings

import numpy as np
import onnx
import pandas as pd
import pytest
import torch
from onnx import numpy_helper

import fl_split
from fl_split.builder import prepare_data
from fl_split.cli import main
from fl_split.data.encoding import ColumnEncoder
from fl_split.errors import DataError
from fl_split.export import export_model, run_exported
from fl_split.predict import GuestScorer, HostScorer, predict
from fl_split.privacy import factory
from fl_split.serving import load_part

from tests.test_save_predict import PS_HEX, _rows, _tables, _train

TOL = {"torchscript": 1e-6, "onnx": 2e-5}


def _schema(out, party) -> dict:
    return json.loads((out / party / "schema.json").read_text())


def _module_bytes(out, party) -> tuple[str, bytes]:
    s = _schema(out, party)
    return s["module_format"], (out / party / s["file"]).read_bytes()


def _raw_input(schema_input: dict, table_path, ids) -> torch.Tensor:
    """A features input built from the party's raw table with the schema's encoder alone, rows in ``ids`` order."""
    frame = pd.read_csv(table_path).set_index("ID").loc[ids].reset_index(drop=True)
    enc = ColumnEncoder.from_dict(schema_input["encoder"])  # the schema's own recipe, as it stands
    assert enc.output_names == schema_input["columns"]
    return torch.from_numpy(enc.transform(frame))


def _serve(out, new, ids) -> np.ndarray:
    """The exported pipeline: each guest's module on its raw rows, the host's on its rows and theirs."""
    host = _schema(out, "host")
    inputs = []
    for i in host["inputs"]:
        if i["name"] == "host_features":
            inputs.append(_raw_input(i, new["host"], ids))
        else:
            g = _schema(out, i["party"])
            x = _raw_input(g["inputs"][0], new[i["party"]], ids)
            cut = run_exported(*_module_bytes(out, i["party"]), (x,), ["features"])
            assert list(cut.shape[1:]) == i["shape"][1:] == g["output"]["shape"][1:]
            inputs.append(torch.from_numpy(cut))
    return run_exported(*_module_bytes(out, "host"), tuple(inputs), [i["name"] for i in host["inputs"]])


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_binary_exports_equal_the_fl_split_modules_and_predict(tmp_path, fmt):
    paths = _tables(tmp_path, guests=1, labels=lambda y: np.where(y == 1, "benign", "malignant"))
    cfg, _ = _train(tmp_path, paths)
    model, out = str(tmp_path / "model"), tmp_path / "exported"
    export_model(model, "all", fmt, str(out))
    new = _rows(tmp_path, paths, prepare_data(cfg).test_ids)
    predict(model, {p: str(v) for p, v in new.items()}, "ID", str(tmp_path / "pred.csv"), label_column="Y")
    pred = pd.read_csv(tmp_path / "pred.csv")
    ids = pred.ID.to_numpy()  # predict's row order: the sorted shared IDs
    # the guest: exported bottom vs fl_split's on the same encoded rows
    g = GuestScorer(model, "guest-1", str(new["guest-1"]), "ID")
    x = g.features(ids)
    with torch.no_grad():
        want = g.bottom(x).numpy()
    got = run_exported(*_module_bytes(out, "guest-1"), (x,), ["features"])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[fmt])
    # the host's exported pipeline on the exported guest's outputs = fl-split predict (no mechanism)
    prob = _serve(out, new, ids)
    schema = _schema(out, "host")
    assert schema["output"]["classes"] == ["benign", "malignant"] and schema["task"] == "binary"
    np.testing.assert_allclose(prob, pred[["p_0", "p_1"]].to_numpy(), rtol=0, atol=TOL[fmt])
    predicted = np.asarray(schema["output"]["classes"], dtype=object)[prob.argmax(1)]
    assert (predicted == pred.predicted.to_numpy()).mean() >= 0.99  # only exact near-ties may flip
    assert _schema(out, "guest-1")["release"]["included"] is False
    if fmt == "onnx":  # the opset the schema states is the file's
        opsets = {o.domain: o.version for o in onnx.load_from_string(_module_bytes(out, "host")[1]).opset_import}
        assert opsets[""] == _schema(out, "host")["versions"]["onnx_opset"] == 18
    assert _schema(out, "guest-1")["release"]["mechanism"]["name"] == "none"


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_regression_exports_give_predict_in_label_units(tmp_path, fmt):
    paths = _tables(tmp_path, dataset="diabetes", guests=1)
    cfg, _ = _train(tmp_path, paths, batch_size=64, task="regression")
    model, out = str(tmp_path / "model"), tmp_path / "exported"
    export_model(model, "all", fmt, str(out))
    new = _rows(tmp_path, paths, prepare_data(cfg).test_ids)
    predict(model, {p: str(v) for p, v in new.items()}, "ID", str(tmp_path / "p.csv"), label_column="Y")
    pred = pd.read_csv(tmp_path / "p.csv")
    served = _serve(out, new, pred.ID.to_numpy())
    sd = json.loads((tmp_path / "model" / "host" / "task.json").read_text())["target_scale"][1]
    assert served.shape == (len(pred), 1) and _schema(out, "host")["output"]["name"] == "prediction"
    np.testing.assert_allclose(served[:, 0], pred.prediction.to_numpy(), rtol=0, atol=TOL[fmt] * sd * 4)


def test_host_export_on_the_same_noisy_releases_equals_fl_split(tmp_path):
    """Gaussian releases (tanh cut) and the host's scale denoising inside its module: the exported
    host on the very releases the fl_split host receives gives its probabilities."""
    paths = _tables(tmp_path, guests=2)
    cfg, _ = _train(tmp_path, paths, defense="gaussian", sigma=0.5, denoise="scale", denoise_param=0.3)
    model, out = str(tmp_path / "model"), tmp_path / "exported"
    export_model(model, "all", "onnx", str(out))
    new = _rows(tmp_path, paths, prepare_data(cfg).test_ids)
    host = HostScorer(model, "host", str(new["host"]), "ID", "Y")
    ids = np.sort(host.ids)
    released, inputs = {}, [host.features(ids)]
    gen = torch.Generator().manual_seed(5)
    for g in ("guest-1", "guest-2"):
        s = GuestScorer(model, g, str(new[g]), "ID")
        x = s.features(ids)
        cut = torch.from_numpy(run_exported(*_module_bytes(out, g), (x,), ["features"]))
        with torch.no_grad():
            np.testing.assert_allclose(cut.numpy(), s.bottom(x).numpy(), rtol=0, atol=TOL["onnx"])
        assert float(cut.abs().max()) <= 1.0  # the tanh cut layer is part of the exported bottom
        mech = factory.forward_mechanism(s.cfg, cut.shape[1], 1)
        released[g] = mech.release(cut, gen).value  # the same noisy release for both hosts
        inputs.append(released[g])
        assert _schema(out, g)["release"]["mechanism"]["sigma"] == 0.5
        assert "DOES NOT PROTECT" in _schema(out, g)["release"]["warning"]
    want = torch.softmax(host.predict(ids, released)["out"].float(), dim=1).numpy()
    got = run_exported(*_module_bytes(out, "host"), tuple(inputs), [i["name"] for i in _schema(out, "host")["inputs"]])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL["onnx"])
    assert _schema(out, "host")["denoise"] == {"name": "scale", "lambda": 0.3}
    assert _schema(out, "host")["merge_order"] == ["host", "guest-1", "guest-2"]


def _exported_tensors(out, party) -> list[torch.Tensor]:
    fmt, data = _module_bytes(out, party)
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
            return list(torch.jit.load(io.BytesIO(data)).state_dict().values())
    graph = onnx.load_from_string(data).graph
    consts = [a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    return [torch.from_numpy(numpy_helper.to_array(t).copy()) for t in [*graph.initializer, *consts]]


def _saved_tensors(model, party) -> list[torch.Tensor]:
    state = torch.load(io.BytesIO((model / party / "model.pt").read_bytes()), weights_only=True)
    return [t for part in state.values() for t in part.values() if t.dim() == 2]  # the weight matrices


def _holds(tensors, t) -> bool:
    return any(u.shape == s.shape and torch.equal(u.float(), s.float()) for u in tensors for s in (t, t.T))


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_exports_hold_no_secret_and_nothing_of_another_party(tmp_path, fmt):
    paths = _tables(tmp_path, guests=2, labels=lambda y: np.where(y == 1, "benign", "malignant"))
    _train(tmp_path, paths, defense="laplace", epsilon=4.0)
    model, out = tmp_path / "model", tmp_path / "exported"
    export_model(str(model), "all", fmt, str(out))
    parties = ("host", "guest-1", "guest-2")
    columns = {p: [c for c in pd.read_csv(paths[p]).columns if c not in ("ID", "Y")] for p in parties}
    for p in parties:
        mine = _exported_tensors(out, p)
        assert any(_holds(mine, t) for t in _saved_tensors(model, p))  # the detector finds its own weights
        for other in parties:
            if other != p:
                assert not any(_holds(mine, t) for t in _saved_tensors(model, other)), (p, other)
        files = sorted(os.listdir(out / p))
        assert files == sorted([f"{p}.{'pt' if fmt == 'torchscript' else 'onnx'}", "schema.json"])
        blob = b"".join((out / p / f).read_bytes() for f in files)
        assert PS_HEX.encode() not in blob and bytes.fromhex(PS_HEX) not in blob and b"secret" not in blob.lower()
        assert str(tmp_path).encode() not in blob  # no path of the exporting machine (ONNX stack traces stripped)
        assert os.path.dirname(fl_split.__file__).encode() not in blob
        schema = (out / p / "schema.json").read_bytes()
        for other in parties:  # no other party's column, statistic or name in a schema
            if other != p:
                assert not any(json.dumps(c).encode() in schema for c in columns[other]), (p, other)
        if p != "host":  # a guest's files: no label, label mapping or scaling
            assert b"benign" not in blob and b"target_scale" not in blob and b'"classes"' not in schema
        for f in files:
            assert stat.S_IMODE(os.stat(out / p / f).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(out / p).st_mode) == 0o700
    assert _schema(out, "host")["output"]["classes"] == ["benign", "malignant"]  # the host's own mapping


def test_tampered_or_mismatched_parts_are_refused_in_one_line(tmp_path, capsys):
    paths = _tables(tmp_path, guests=1)
    _train(tmp_path, paths, denoise="mask", defense="gaussian")
    model = tmp_path / "model"
    # a party on its own machine holds only its own folder: exported after its own checks
    alone = tmp_path / "alone"
    shutil.copytree(model / "guest-1", alone / "guest-1")
    assert main(["export-model", "--model", str(alone), "--party", "guest-1", "--format", "torchscript",
                 "--out", str(tmp_path / "e1")]) == 0
    assert "RAW activations" in capsys.readouterr().out
    # --format onnx without the export extra: one line saying what to install
    import sys

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "onnxscript", None)  # import onnxscript -> ImportError
        assert main(["export-model", "--model", str(alone), "--party", "guest-1", "--out", str(tmp_path / "e7")]) == 2
    assert "pip install 'fl-split[export]'" in capsys.readouterr().err and not (tmp_path / "e7").exists()
    # alone, a manifest its weights do not fit (no other part to compare it with): one line
    m = json.loads((alone / "guest-1" / "manifest.json").read_text())
    (alone / "guest-1" / "manifest.json").write_text(json.dumps({**m, "input_shape": [m["input_shape"][0] + 1]}))
    assert main(["export-model", "--model", str(alone), "--party", "guest-1", "--format", "torchscript",
                 "--out", str(tmp_path / "e6")]) == 2
    err = capsys.readouterr().err.strip()
    assert "guest-1" in err and "refused" in err and "\n" not in err and not (tmp_path / "e6").exists()
    # the host's random mask denoising has no deterministic module: refused, nothing written
    with pytest.raises(DataError, match="random mask"):
        export_model(str(model), "all", "torchscript", str(tmp_path / "e2"))  # the guest first: nothing written
    assert not (tmp_path / "e2").exists()
    # a manifest that does not fit the others
    manifest = json.loads((model / "guest-1" / "manifest.json").read_text())
    (model / "guest-1" / "manifest.json").write_text(json.dumps({**manifest, "cut": manifest["cut"] + 1}))
    capsys.readouterr()
    assert main(["export-model", "--model", str(model), "--party", "guest-1", "--out", str(tmp_path / "e3")]) == 2
    err = capsys.readouterr().err.strip()
    assert "guest-1's manifest has another cut than the host's" in err and "\n" not in err
    (model / "guest-1" / "manifest.json").write_text(json.dumps(manifest))
    # a tampered weight file
    data = bytearray((model / "guest-1" / "model.pt").read_bytes())
    data[-40] ^= 1
    (model / "guest-1" / "model.pt").write_bytes(bytes(data))
    assert main(["export-model", "--model", str(model), "--party", "all", "--format", "torchscript",
                 "--out", str(tmp_path / "e4")]) == 2
    err = capsys.readouterr().err.strip()
    assert "guest-1: model.pt does not match the SHA-256 in its manifest" in err and "\n" not in err
    assert not (tmp_path / "e3").exists() and not (tmp_path / "e4").exists()
    assert main(["export-model", "--model", str(model), "--party", "guest-x", "--out", str(tmp_path / "e5")]) == 2
    assert "--party: got 'guest-x'" in capsys.readouterr().err


def test_image_parts_export_and_reproduce_the_runs_accuracy(tmp_path):
    """A CNN on images (digits, cnn-stripe): the exported guest and host, on the run's own test
    images, give exactly the accuracy the training run reported (same modules, same rows)."""
    from fl_split.config import RunConfig
    from fl_split.engine import run_experiment
    from tests.test_save_predict import PS

    cfg = RunConfig(dataset="digits", model="cnn-stripe", guests=1, epochs=2, progress=False,
                    save_model=str(tmp_path / "model"))
    res = run_experiment(cfg, PS)
    out = tmp_path / "exported"
    export_model(str(tmp_path / "model"), "all", "torchscript", str(out))
    data = prepare_data(cfg).parties
    g, h = _schema(out, "guest-1"), _schema(out, "host")
    assert g["inputs"][0]["shape"] == [-1, *data["guest-1"].x_test.shape[1:]]
    cut = run_exported(*_module_bytes(out, "guest-1"), (data["guest-1"].x_test,), ["features"])
    prob = run_exported(*_module_bytes(out, "host"), (data["host"].x_test, torch.from_numpy(cut)),
                        [i["name"] for i in h["inputs"]])
    accuracy = float((prob.argmax(1) == data["host"].y_test.numpy()).mean())
    assert accuracy == pytest.approx(res["final"]["metrics"]["accuracy"], abs=1e-12)
    assert h["task"] == "multiclass" and h["output"]["shape"] == [-1, 10]


def test_schema_encoder_recipe_works_as_written(tmp_path):
    """A user's own tables with text categories and empty cells, trained with ``--save-model`` and exported:
    the recipe in the guest's ``schema.json`` (``ColumnEncoder.from_dict(raw).transform(table)`` on the
    schema's own ``encoder``) encodes a new pandas table exactly as ``fl-split predict`` does. It used to
    fail on the schema's own dict (``format None, expected 'fl_split.encoder/1'``)."""
    import re

    import fl_split.data.encoding  # noqa: F401 - the recipe names the module

    rng = np.random.default_rng(6)
    n = 240
    ids = np.arange(n) * 7 + 11
    hood = rng.choice(["North Ames", "College Creek", "Old Town", "Edwards"], n).astype(object)
    hood[rng.random(n) < 0.1] = None  # empty cells in a text column
    lot = rng.normal(9000, 2500, n).round()
    lot[rng.random(n) < 0.1] = np.nan  # and in a numeric one
    area = rng.normal(1500, 400, n).round()
    y = np.where(area + rng.normal(0, 200, n) > 1500, "high", "low")
    pd.DataFrame({"ID": ids, "Gr_Liv_Area": area, "Y": y}).to_csv(tmp_path / "host.csv", index=False)
    guest = pd.DataFrame({"ID": ids, "Neighborhood": hood, "Lot_Area": lot})
    guest.to_csv(tmp_path / "guest.csv", index=False)
    model, served = tmp_path / "model", tmp_path / "served"
    assert main(["train", "--data", f"host={tmp_path / 'host.csv'}", "--data", f"guest-1={tmp_path / 'guest.csv'}",
                 "--id-column", "ID", "--label-column", "Y", "--epochs", "1", "--no-progress", "--no-run-dir",
                 "--private-seed", PS_HEX, "--save-model", str(model)]) == 0
    assert main(["export-model", "--model", str(model), "--party", "guest-1", "--format", "torchscript",
                 "--out", str(served)]) == 0
    with open(served / "guest-1" / "schema.json") as f:
        schema = json.load(f)
    entry = schema["inputs"][0]
    raw = entry["encoder"]
    recipe = re.search(r"fl_split\.data\.encoding\.ColumnEncoder\.from_dict\(raw\)\.transform\(table\)", raw["how"])
    assert recipe is not None, raw["how"]
    assert raw["format"] == "fl_split.encoder/1" and [c["name"] for c in raw["columns"]] == ["Neighborhood", "Lot_Area"]
    # new rows, as a user has them: a category never seen, empty cells, the columns in another order
    new = pd.DataFrame({"Lot_Area": [8000.0, np.nan, 12000.0, np.nan],
                        "ID": [5001, 5002, 5003, 5004],
                        "Neighborhood": ["Old Town", None, "Somerset", "Edwards"]})
    new.to_csv(tmp_path / "new-guest.csv", index=False)
    table = pd.read_csv(tmp_path / "new-guest.csv")
    got = eval(recipe.group(0), {"fl_split": fl_split, "raw": raw, "table": table})  # noqa: S307 - the recipe
    assert got.shape == (4, len(entry["columns"])) and any(":missing" in c for c in entry["columns"])
    want = GuestScorer(str(model), "guest-1", str(tmp_path / "new-guest.csv"), "ID").features(table["ID"].to_numpy())
    np.testing.assert_array_equal(got, want.numpy())  # what predict encodes, bit for bit
    # a schema.json written before the writer and the reader agreed ('raw_columns', no 'format') still reads
    old = {"policy": raw["policy"], "raw_columns": raw["columns"], "how": "…"}
    np.testing.assert_array_equal(ColumnEncoder.from_dict(old).transform(table), got)
