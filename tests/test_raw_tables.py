"""Raw tables as organisations hold them (issue 23, item 2): text categories and empty cells, each
party encoding its own columns with statistics of its own training rows
(:class:`fl_split.data.encoding.ColumnEncoder`), ``--encode`` overrides, and the acceptance run —
three raw CSVs with partly overlapping IDs, ``--align psi``: training on exactly the intersection
gives the very losses of the same rows encoded by hand with the same statistics."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.data.encoding import ColumnEncoder, parse_encode
from fl_split.errors import ConfigError, DataError

SEED = 3
OPTS = ["--seed", str(SEED), "--epochs", "2", "--batch-size", "32", "--no-progress", "--private-seed", "a7c31e95d04b68f2e1d9073b5c8a46e2"]
#: which party holds which rows (ID % k != 0): partly overlapping ID sets
KEEP = {"host": 5, "guest-1": 7, "guest-2": 11}


# -- the encoder on its own --------------------------------------------------------------------------
def _frame() -> pd.DataFrame:
    return pd.DataFrame({
        "age": [20.0, np.nan, 40.0, 30.0, 50.0, 1000.0],
        "sex": ["m", "f", None, "m", "f", "x"],
        "cls": [1, 2, 3, 1, 2, 3],
        "flag": [True, False, True, True, False, True],
    })


def test_defaults_standardise_one_hot_impute_and_flag_missing():
    f = _frame()
    enc = ColumnEncoder().fit(f.iloc[:5])
    assert enc.output_names == ["age", "age:missing", "sex=f", "sex=m", "sex:missing", "cls", "flag=False",
                                "flag=True"]
    x = enc.transform(f)
    assert x.dtype == np.float32 and x.shape == (6, 8)
    present = np.array([20.0, 40.0, 30.0, 50.0])
    z = (f["age"].fillna(np.median(present)).to_numpy() - present.mean()) / present.std()
    np.testing.assert_array_equal(x[:, 0], z.astype(np.float32))
    np.testing.assert_array_equal(x[:, 1], [0, 1, 0, 0, 0, 0])
    # an empty 'sex' cell: the most frequent training category (f and m tie at 2: the first sorted) + indicator
    np.testing.assert_array_equal(x[2, 2:5], [1, 0, 1])
    # 'x' never occurs in a training row: all zeros, no indicator (the cell is not empty)
    np.testing.assert_array_equal(x[5, 2:5], [0, 0, 0])
    cls = np.array([1, 2, 3, 1, 2], float)
    np.testing.assert_allclose(x[:, 5], (f["cls"] - cls.mean()) / cls.std(), rtol=1e-6)
    np.testing.assert_array_equal(x[:, 6:], [[0, 1], [1, 0], [0, 1], [0, 1], [1, 0], [0, 1]])


def test_booleans_are_categories_with_or_without_empty_cells():
    import io

    f = pd.read_csv(io.StringIO("a,b\ntrue,1\nfalse,2\n,3\nTrue,4\n"))
    enc = ColumnEncoder().fit(f)
    assert enc.output_names == ["a=False", "a=True", "a:missing", "b"]
    np.testing.assert_array_equal(enc.transform(f)[:, :3], [[0, 1, 0], [1, 0, 0], [0, 1, 1], [0, 1, 0]])
    assert ColumnEncoder().fit(f.dropna()).output_names[:2] == ["a=False", "a=True"]


def test_test_rows_never_change_a_statistic():
    """Every statistic comes from the rows ``fit`` sees: changing, emptying or inventing values in the
    other rows changes neither the fitted state nor the training rows' encoding."""
    f = _frame()
    enc = ColumnEncoder().fit(f.iloc[:4])
    g = f.copy()
    g.loc[4, "age"], g.loc[5, "age"] = np.nan, -1e6
    g.loc[4, "sex"], g.loc[5, "sex"] = None, "new"
    g.loc[5, "cls"] = 99
    enc2 = ColumnEncoder().fit(g.iloc[:4])
    assert enc2.to_dict() == enc.to_dict()
    np.testing.assert_array_equal(enc.transform(g)[:4], enc.transform(f)[:4])
    # an empty cell only in the other rows adds no indicator column (the width is the training rows')
    assert "cls:missing" not in enc.output_names
    g.loc[5, "cls"] = np.nan
    assert enc.transform(g).shape == (6, enc.width)


def test_round_trip_through_json_gives_the_same_transform():
    f = _frame()
    enc = ColumnEncoder({"cls": "categorical", "flag": "drop"}).fit(f.iloc[:5])
    again = ColumnEncoder.from_dict(json.loads(json.dumps(enc.to_dict())))
    assert again == enc and again.output_names == enc.output_names
    new = pd.DataFrame({"cls": [3, 7, 1.0], "sex": ["f", "zz", None], "age": [33.0, None, 1e5],
                        "extra": ["ignored", "ignored", "ignored"]})
    np.testing.assert_array_equal(again.transform(new), enc.transform(new))
    # 1.0 and 1 spell the same category; 7 is unseen: zeros
    assert enc.output_names[-3:] == ["cls=1", "cls=2", "cls=3"]
    np.testing.assert_array_equal(enc.transform(new)[:, -3:], [[0, 0, 1], [0, 0, 0], [1, 0, 0]])
    with pytest.raises(DataError, match="not an fl_split column encoder"):
        ColumnEncoder.from_dict({**enc.to_dict(), "columns": [{"name": "a", "kind": "bogus"}]})


def test_builtin_policy_is_the_builtin_datasets_encoding():
    from fl_split.data.base import _encode_table

    f = _frame().drop(columns="flag")
    train = np.array([0, 2, 3, 5])
    x, names = _encode_table(f, ["sex"], train)
    # no indicators; an empty cell is no category (and encodes as zeros); 'cls' stays numeric
    assert names == ["age", "sex=m", "sex=x", "cls"]
    np.testing.assert_array_equal(x[:, 1:3], [[1, 0], [0, 0], [0, 0], [1, 0], [0, 0], [0, 1]])
    tr = f["age"].to_numpy()[train]
    assert x[1, 0] == np.float32(0.0)  # an empty numeric cell: the training mean
    assert x[0, 0] == np.float32((20.0 - tr.mean()) / tr.std())


def test_encoder_errors_are_one_line_and_name_the_column():
    f = _frame()
    many = pd.DataFrame({"name": [f"passenger {i}" for i in range(150)]})
    with pytest.raises(DataError, match=r"column 'name': 150 distinct text values .*--encode 'name=drop'"):
        ColumnEncoder(where="guest-1 (g.csv)").fit(many)
    assert ColumnEncoder({"name": "categorical"}).fit(many).width == 150  # declared: the limit is lifted
    numeric = r"^g1: row 1, column 'sex': 'm' is not a number, but --encode declares .* \(4 more such cells\)$"
    with pytest.raises(DataError, match=numeric):
        ColumnEncoder({"sex": "numeric"}, where="g1").fit(f)
    stray = pd.DataFrame({"x": ["1", "2", "n/a?", "4", "5"]})
    with pytest.raises(DataError, match=r"row 3, column 'x': 'n/a\?' is not a number, but most of the column"):
        ColumnEncoder().fit(stray)
    enc = ColumnEncoder().fit(f[["age"]].iloc[:4])
    with pytest.raises(DataError, match=r"row 2, column 'age': 'old' is not a number .*'age=categorical'"):
        enc.transform(pd.DataFrame({"age": [1.0, "old"]}, dtype=object))
    with pytest.raises(DataError, match=r"column \['age'\] missing; expected the 1 column\(s\) the encoder was fitted on "
                                        r"\['age'\], found \['sex'\]"):
        enc.transform(pd.DataFrame({"sex": ["m"]}))
    with pytest.raises(DataError, match="not a finite number"):
        ColumnEncoder().fit(pd.DataFrame({"v": [1.0, np.inf]}))


def test_encode_option_syntax(tmp_path):
    spec = tmp_path / "guest-1.encode"
    spec.write_text("# guest-1's overrides\nZip=categorical\nName=drop; Age=numeric\n")
    assert parse_encode(f"Pclass=categorical;@{spec}") == {"Pclass": "categorical", "Zip": "categorical",
                                                           "Name": "drop", "Age": "numeric"}
    for bad, why in (("Age", "has no '='"), ("Age=number", "unknown kind 'number'"), ("=drop", "names no column"),
                     ("Age=drop;Age=numeric", "given two kinds"), ("@/nonexistent/f", "cannot read")):
        with pytest.raises(ConfigError, match=rf"^--encode: got .*{why}.*; allowed: 'COLUMN=KIND"):
            parse_encode(bad)
    with pytest.raises(ConfigError, match="empty without --data"):
        RunConfig(encode="Age=drop")
    with pytest.raises(ConfigError, match="'ID' is the ID column"):
        RunConfig(data="host=a.csv;guest-1=b.csv", guests=1, id_column="ID", encode="ID=categorical")


# -- three raw tables ------------------------------------------------------------------------------------
def raw_world(n: int = 700, seed: int = 0) -> dict[str, pd.DataFrame]:
    """Three parties' raw tables over IDs ``1000 …``: text categories, empty cells, a label that
    depends on every party's columns; each party holds the IDs with ``ID % k != 0`` (:data:`KEEP`), in
    its own row order."""
    rng = np.random.default_rng(seed)
    ids = np.arange(1000, 1000 + n)
    region = rng.choice(["north", "south", "east"], n)
    income = rng.normal(50, 15, n)
    job = rng.choice(["clerk", "nurse", "pilot", "farmer"], n, p=[0.4, 0.3, 0.2, 0.1])
    age = rng.integers(18, 80, n).astype(float)
    score = rng.normal(0, 1, n)
    plan = rng.choice(["basic", "plus"], n)
    logit = (1.2 * (region == "north") - 0.8 * (job == "pilot") + 0.04 * (age - 50) + 1.5 * score
             + 0.7 * (plan == "plus") + 0.02 * (income - 50))
    y = np.where(rng.random(n) < 1 / (1 + np.exp(-logit)), "yes", "no")

    def holes(values, frac):
        v = values.astype(object).copy()
        v[rng.random(n) < frac] = None
        return v

    frames = {
        "host": pd.DataFrame({"ID": ids, "region": holes(region, 0.05), "income": holes(income, 0.1), "Y": y}),
        "guest-1": pd.DataFrame({"ID": ids, "job": holes(job, 0.08), "age": holes(age, 0.15)}),
        "guest-2": pd.DataFrame({"ID": ids, "score": score, "plan": holes(plan, 0.03)}),
    }
    out = {}
    for i, (party, frame) in enumerate(frames.items()):
        frame = frame[frame["ID"] % KEEP[party] != 0]
        out[party] = frame.sample(frac=1.0, random_state=i).reset_index(drop=True)
    return out


def write_raw(tmp_path, frames: dict[str, pd.DataFrame], guests: bool = True) -> list[str]:
    flags = []
    for party, frame in frames.items():
        path = tmp_path / f"{party}.csv"
        frame.to_csv(path, index=False)
        flags += ["--data", f"{party}={path}"]
    return [*flags, "--id-column", "ID", "--label-column", "Y", *(["--guests", "2"] if guests else [])]


def text_ids(frames: dict[str, pd.DataFrame]) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """The same tables with text IDs (``cust-001042@example.org``), and copies keyed by the int64 key
    each party derives from them (:func:`fl_split.data.ids.key_of`), for :func:`by_hand`."""
    from fl_split.data.ids import key_of

    texts, keyed = {}, {}
    for party, frame in frames.items():
        t = frame.assign(ID=[f"cust-{i:06d}@example.org" for i in frame["ID"]])
        texts[party] = t
        keyed[party] = t.assign(ID=[key_of(v) for v in t["ID"]])
    return texts, keyed


def by_hand(frame: pd.DataFrame, train_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``frame``'s rows of ``ids`` encoded by hand with statistics of its rows of ``train_ids`` (taken in
    sorted-ID order, the order the pipeline aligns them in): median/mode imputation, missing
    indicators, standardised numbers, sorted one-hot categories."""
    indexed = frame.set_index("ID")
    train = indexed.loc[np.sort(train_ids)]
    rows = indexed.loc[ids]
    blocks = []
    for col in [c for c in frame.columns if c not in ("ID", "Y")]:
        tr = train[col]
        empty_tr = tr.isna().to_numpy()
        empty = rows[col].isna().to_numpy()
        if pd.to_numeric(tr.dropna(), errors="coerce").notna().all():
            present = tr.dropna().to_numpy(dtype=np.float64)
            v = rows[col].to_numpy(dtype=np.float64, na_value=np.nan)
            v = np.where(empty, np.median(present), v)
            blocks.append(((v - present.mean()) / present.std()).astype(np.float32)[:, None])
        else:
            counts = tr.dropna().value_counts()
            cats = sorted(counts.index)
            mode = sorted(counts.index[counts == counts.max()])[0]
            v = rows[col].where(~rows[col].isna(), mode).to_numpy()
            blocks.append(np.stack([v == c for c in cats], axis=1).astype(np.float32))
        if empty_tr.any():
            blocks.append(empty.astype(np.float32)[:, None])
    return np.concatenate(blocks, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("ids", ["integer", "text"])
def test_raw_tables_by_psi_train_like_the_same_rows_encoded_by_hand(tmp_path, ids):
    """Acceptance (issue 23): three raw CSVs — text IDs (e-mail addresses) or integer IDs, text
    categories, empty cells, partly overlapping IDs — ``--align psi``, one command without
    ``--guests`` (the parties are read from ``--data``): the run trains on exactly the intersection,
    each party's matrix is its rows encoded by hand with its own training rows' statistics, and
    training on those hand-encoded matrices (party files) gives the very same losses and accuracy."""
    from fl_split.builder import prepare_data
    from fl_split.party_files import load_party, save_party

    frames = raw_world()
    if ids == "text":
        written, frames = text_ids(frames)  # frames: keyed by the parties' int64 keys, for by_hand
    else:
        written = frames
    flags = write_raw(tmp_path, written, guests=False)
    inter = np.sort(np.intersect1d(np.intersect1d(frames["host"]["ID"], frames["guest-1"]["ID"]),
                                   frames["guest-2"]["ID"]))
    assert 0 < len(inter) < min(len(f) for f in frames.values())  # partly overlapping

    raw_out = tmp_path / "raw.json"
    assert main(["train", *flags, "--align", "psi", *OPTS, "--out", str(raw_out)]) == 0
    raw = json.loads(raw_out.read_text())
    assert raw["alignment"]["align"] == "psi" and raw["alignment"]["shared_ids"] == len(inter)
    assert raw["plan"]["n_train"] + raw["plan"]["n_test"] == len(inter)

    cfg = RunConfig(data=";".join(flags[i + 1] for i in range(0, 6, 2)), id_column="ID", label_column="Y",
                    align="psi", seed=SEED)
    assert cfg.guests == 2
    prepared = prepare_data(cfg)
    np.testing.assert_array_equal(np.sort(np.concatenate([prepared.train_ids, prepared.test_ids])), inter)
    widths = {"host": 3 + 1 + 1 + 1, "guest-1": 4 + 1 + 1 + 1, "guest-2": 1 + 2 + 1}  # one-hots + numbers + indicators
    for party, frame in frames.items():
        d = prepared.parties[party]
        assert d.width == widths[party] and d.encoder.width == widths[party]
        np.testing.assert_array_equal(d.x_train.numpy(), by_hand(frame, d.train_ids, d.train_ids))
        np.testing.assert_array_equal(d.x_test.numpy(), by_hand(frame, d.train_ids, d.test_ids))

    # the pre-encoded equivalent: the hand-encoded matrices as party files, trained without any encoding
    exported = tmp_path / "exported"
    assert main(["export-parties", *flags, "--align", "psi", "--seed", str(SEED), "--out", str(exported)]) == 0
    hand_dir = tmp_path / "hand"
    for party, frame in frames.items():
        data, facts = load_party(exported / f"{party}.npz", party)
        assert data.encoder == prepared.parties[party].encoder  # the party file keeps the fitted encoder
        import torch

        hand = dataclasses.replace(data, x_train=torch.from_numpy(by_hand(frame, data.train_ids, data.train_ids)),
                                   x_test=torch.from_numpy(by_hand(frame, data.train_ids, data.test_ids)),
                                   encoder=None)
        save_party(hand_dir / f"{party}.npz", hand, facts)
    hand_out = tmp_path / "hand.json"
    assert main(["train", "--party-files", str(hand_dir), "--guests", "2", *OPTS, "--out", str(hand_out)]) == 0
    hand_res = json.loads(hand_out.read_text())
    assert [h["train_loss"] for h in hand_res["history"]] == [h["train_loss"] for h in raw["history"]]
    assert hand_res["final"]["value"] == raw["final"]["value"]
    assert raw["final"]["value"] > 0.6  # the run learns (the label depends on every party's columns)


def test_encode_overrides_apply_at_the_party_owning_the_column(tmp_path, capsys):
    from fl_split.builder import prepare_data

    frames = raw_world(n=200)
    flags = write_raw(tmp_path, frames)
    spec = ";".join(flags[i + 1] for i in range(0, 6, 2))
    cfg = RunConfig(data=spec, id_column="ID", label_column="Y", align="psi", guests=2, seed=SEED,
                    encode="age=categorical;region=drop;plan=drop")
    parties = prepare_data(cfg).parties
    assert all(n.startswith("income") for n in parties["host"].feature_names)
    names = parties["guest-1"].feature_names
    assert all(n.startswith(("age=", "age:missing", "job")) for n in names) and "age" not in names
    assert sum(n.startswith("age=") for n in names) > 20  # one column per age in the training rows
    assert parties["guest-2"].feature_names == ["score"]
    bad = tmp_path / "bad.json"
    code = main(["train", *flags, "--align", "psi", "--encode", "Age=drop", *OPTS, "--out", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not bad.exists() and len(err.splitlines()) == 1
    assert ("--encode: got 'Age=drop' (no party's table has a column 'Age' (host: region, income; guest-1: job, "
            "age") in err
    code = main(["train", *flags, "--align", "psi", "--encode", "job=numeric", *OPTS, "--out", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "guest-1 (guest-1.csv): row" in err and "column 'job'" in err
    assert "declares the column numeric" in err


def test_a_resumed_run_refuses_another_encoding(tmp_path):
    """The fitted encoder is part of a party's checkpointed state: resuming after the party's table
    changed (here one training cell, so its statistics differ) is refused before anything trains; the
    unchanged table resumes."""
    from fl_split import builder
    from fl_split.checkpoint import CheckpointError
    from fl_split.engine import LocalEngine
    from fl_split.seeding import PrivateSeed
    from tests.test_checkpoint import Crash, CrashAfterGuests

    frames = raw_world(n=200)
    flags = write_raw(tmp_path, frames)
    spec = ";".join(flags[i + 1] for i in range(0, 6, 2))
    cfg = RunConfig(data=spec, id_column="ID", label_column="Y", align="psi", guests=2, seed=SEED, epochs=2,
                    batch_size=16, progress=False, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    ps = PrivateSeed.legacy(11)
    with pytest.raises(Crash):
        LocalEngine(cfg, ps, transport=lambda t: CrashAfterGuests(t, 5)).run()
    g1 = frames["guest-1"].copy()
    g1["age"] = g1["age"].where(g1["age"].isna(), g1["age"] + 1.0)  # every age one year more: another mean
    g1.to_csv(tmp_path / "guest-1.csv", index=False)
    builder._prepare.cache_clear()
    with pytest.raises(CheckpointError, match=r"guest-1 encodes its columns differently from the checkpointed run"):
        LocalEngine(cfg.replace(resume=True), ps).run()
    frames["guest-1"].to_csv(tmp_path / "guest-1.csv", index=False)
    builder._prepare.cache_clear()
    res = LocalEngine(cfg.replace(resume=True), ps).run()
    assert res["checkpoint"]["resumed_from_round"] >= 1


@pytest.mark.usefixtures("flower_task_identity")
def test_deployment_nodes_encode_their_raw_tables_like_one_process(tmp_path):
    """A Flower deployment (``data = "node-tables"``, each node reading only its own raw table): every
    node encodes its columns as ``fl-split train --data`` does (the same numbers), and no message
    carries a category, an encoded column's name or another party's width before ``shapes``."""
    from fl_split.engine import run_experiment
    from fl_split.flower.strategy import VerticalSplitStrategy
    from fl_split.seeding import PrivateSeed
    from tests.test_deploy_align import RecordingGrid, _nodes
    from tests.test_flower import _strip

    frames = raw_world(n=300)
    flags = write_raw(tmp_path, frames)
    paths = {flags[i + 1].split("=", 1)[0]: flags[i + 1].split("=", 1)[1] for i in range(0, 6, 2)}
    run = dict(guests=2, seed=SEED, epochs=1, batch_size=32, id_column="ID", label_column="Y", progress=False,
               align="psi", encode="age=numeric")
    seed = PrivateSeed.generate()
    grid = RecordingGrid(_nodes(tmp_path, paths, seed), fresh_process=True)
    dep = VerticalSplitStrategy(RunConfig(data="node-tables", engine="flower", data_plane="flower", **run)).run(grid)
    local = run_experiment(RunConfig(data=";".join(f"{p}={v}" for p, v in paths.items()), **run), private_seed=seed)
    assert dep["plan"]["input_shapes"] == local["plan"]["input_shapes"]
    assert local["plan"]["input_shapes"]["guest-1"] == [4 + 1 + 1 + 1]
    a, b = _strip(dep), _strip(local)
    assert a["history"] == b["history"] and a["final"] == b["final"]
    wire = b"".join(grid.wire)
    assert b"guest-1.csv" in wire  # the scan finds what is there (the file's name is public)
    for private in (b"farmer", b"pilot", b"nurse", b"job=", b"region=", b":missing"):
        assert private not in wire


@pytest.mark.parametrize("fmt", ["npz", "csv"])
def test_party_files_keep_the_encoder_for_a_later_predict(tmp_path, fmt):
    """``export-parties`` writes each party's fitted encoder into its own file (and no other party's):
    ``ColumnEncoder.from_dict`` on it encodes new raw rows exactly as the run encoded its rows."""
    from fl_split.builder import prepare_data
    from fl_split.party_files import load_party

    frames = raw_world(n=200)
    flags = write_raw(tmp_path, frames)
    assert main(["export-parties", *flags, "--align", "psi", "--seed", str(SEED), "--format", fmt,
                 "--out", str(tmp_path / "parts")]) == 0
    cfg = RunConfig(data=";".join(flags[i + 1] for i in range(0, 6, 2)), id_column="ID", label_column="Y",
                    align="psi", seed=SEED)
    assert cfg.guests == 2
    prepared = prepare_data(cfg).parties
    for party, frame in frames.items():
        data, _ = load_party(tmp_path / "parts" / f"{party}.{fmt}", party)
        assert data.encoder == prepared[party].encoder
        again = ColumnEncoder.from_dict(json.loads(json.dumps(data.encoder.to_dict())))
        rows = frame.set_index("ID").loc[data.test_ids].reset_index()
        np.testing.assert_array_equal(again.transform(rows), prepared[party].x_test.numpy())
        if fmt == "csv":  # a party's categories are in its own file only
            meta = (tmp_path / "parts" / f"{party}.meta.json").read_text()
            own = {"host": "north", "guest-1": "pilot", "guest-2": "plus"}
            assert all((f'"{v}"' in meta) == (p == party) for p, v in own.items())
