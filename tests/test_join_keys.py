"""Join keys of any kind (issue 23, items 1, 3, 6): text IDs, e-mail addresses, composite keys
(``--id-column name,birth_date``) in train (public and PSI alignment), export-parties and a Flower
deployment; the parties read from ``--data`` with its contradictions refused; the first-contact
slips (label column, delimiter, PSI install hint, Python version, ``--model`` from the working
directory). Keys: :mod:`fl_split.data.ids`."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fl_split.builder import prepare_data
from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.data.ids import INT63, hashed_key, key_of, keys_of, table_keys
from fl_split.data.registry import load_dataset
from fl_split.errors import ConfigError, DataError
from tests.test_own_data import write_party_tables

SEED = 5
#: no --guests: the parties are read from --data
OPTS = ["--seed", str(SEED), "--epochs", "2", "--batch-size", "64", "--no-progress"]
ROOT = Path(__file__).resolve().parent.parent



def _timeless(alignment: dict) -> dict:
    """``results["alignment"]`` without its wall time (``time_s``: each run's own)."""
    return {k: v for k, v in alignment.items() if k != "time_s"}

def _email(i: int) -> str:
    """A customer's e-mail address: text no run statistic can contain by chance."""
    return f"client.{int(i) * 7919 + 104729}@example-bank.org"


def _flags(paths: dict[str, str], id_column: str = "ID") -> list[str]:
    out = []
    for party, path in paths.items():
        out += ["--data", f"{party}={path}"]
    return out + ["--id-column", id_column, "--label-column", "Y"]


def _spec(paths: dict[str, str]) -> str:
    return ";".join(f"{p}={v}" for p, v in paths.items())


def _overlap():
    """Partly overlapping ID sets of three parties (breast-cancer's IDs), their intersection and the rest."""
    ids = np.sort(load_dataset("breast-cancer").ids)
    keep = {p: ids[ids % k != 0] for p, k in (("host", 5), ("guest-1", 7), ("guest-2", 11))}
    inter = np.intersect1d(np.intersect1d(keep["host"], keep["guest-1"]), keep["guest-2"])
    return keep, inter, np.setdiff1d(ids, inter)


def _train(tmp_path, name: str, args: list[str], extra: list[str] = ()) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    assert main(["train", *args, *OPTS, "--private-seed", "3f9d27c1b08e64a5d2c71e90b4a6f358", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text()), out.read_text()


# -- the mapping ------------------------------------------------------------------------------------
def test_keys_integers_keep_their_number_everything_else_hashes_negative():
    assert [key_of(t) for t in ("0", "12", "9" * 18, str(INT63 - 1))] == [0, 12, int("9" * 18), INT63 - 1]
    for text in ("007", "00", "-5", "+5", "1e3", str(INT63), "P-00301", "a@b.org", "12 ", "Ünïcode", "x\x1fy"):
        assert key_of(text) < 0, text
        assert key_of(text) == hashed_key(text) >= -(INT63 - 1)
    # the documented formula (every party, every version must compute the same)
    digest = hashlib.sha256(b"fl-split-id\x00" + "P-00301".encode()).digest()[:8]
    assert key_of("P-00301") == -(1 + int.from_bytes(digest, "big") % (INT63 - 1))
    assert key_of("P-00301") == -7968812374454330981  # pinned: a change would split old tables from new
    assert key_of("a@b.org") != key_of("A@b.org")  # exact (case-sensitive) matching
    # the vectorised mapping of a table equals the one-value one
    rng = np.random.default_rng(0)
    many = ["0", "7", "007", str(INT63 - 1), str(INT63), "9" * 19, "1" * 18, "-5", "a@b.org", "12.0", ""]
    many += [str(v) for v in rng.integers(0, INT63, 50)] + [f"id-{v}" for v in rng.integers(0, 10 ** 9, 50)]
    np.testing.assert_array_equal(keys_of(many), [key_of(t) for t in many])


def test_cells_become_keys_the_same_way_whatever_their_type():
    """Integer, float, text and Parquet cells of the same ID give the same key; spaces are stripped."""
    want = np.asarray([7, 12, key_of("P-1"), key_of("-5"), key_of("007")])
    text = pd.DataFrame({"id": [" 7", "12 ", " P-1", "-5", "007"]})
    np.testing.assert_array_equal(table_keys(text, ["id"], "t")[0], want)
    np.testing.assert_array_equal(table_keys(pd.DataFrame({"id": [7, 12, -5]}), ["id"], "t")[0], want[[0, 1, 3]])
    # integers read as floats (a NaN elsewhere in the export), or written so as text
    np.testing.assert_array_equal(table_keys(pd.DataFrame({"id": [7.0, 12.0]}), ["id"], "t")[0], [7, 12])
    np.testing.assert_array_equal(table_keys(pd.DataFrame({"id": ["7.0", "12.00"]}), ["id"], "t")[0], [7, 12])
    for bad, why in (([1.5, 2.0], "1.5 is not an integer"), ([2.0 ** 60, 1.0], r"\S+ is a float beyond 2\*\*53")):
        with pytest.raises(DataError, match=f"t: row 1, column 'id': {why}"):
            table_keys(pd.DataFrame({"id": bad}), ["id"], "t")
    # a composite key: the parts' texts joined by \x1f, always hashed, whatever the parts' types
    comp = pd.DataFrame({"name": ["Ann ", "Bob"], "born": pd.to_datetime(["1990-01-02", "1985-12-31"])})
    np.testing.assert_array_equal(table_keys(comp, ["name", "born"], "t")[0],
                                  [key_of("Ann\x1f1990-01-02"), key_of("Bob\x1f1985-12-31")])
    np.testing.assert_array_equal(table_keys(pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}), ["a", "b"], "t")[0],
                                  [key_of("1\x1fx"), key_of("2\x1fy")])


def test_a_party_keeps_its_own_values_and_names_them_in_its_errors():
    keys, names = table_keys(pd.DataFrame({"id": ["P-1", "P-2", 3]}), ["id"], "t")
    assert names is not None and names.name(key_of("P-2")) == "'P-2'" and names.name(3) == "3"
    assert table_keys(pd.DataFrame({"id": [1, 2]}), ["id"], "t")[1] is None  # integers: the key is the value
    with pytest.raises(DataError, match=r"duplicate IDs in column 'id' \(ID 'P-1' in rows 1, 3\)"):
        table_keys(pd.DataFrame({"id": ["P-1", "P-2", " P-1"]}), ["id"], "t")
    with pytest.raises(DataError, match=r"row 2, column 'born': missing ID"):
        table_keys(pd.DataFrame({"name": ["a", "b"], "born": ["x", "  "]}), ["name", "born"], "t")


def test_a_collision_inside_one_table_names_both_rows(monkeypatch):
    """Two different values with one key (a 62-bit hash collision, forced here) are refused, naming
    both rows and values: they would otherwise become one person."""
    import fl_split.data.ids as ids

    forced = {"alice@x.org": -42, "bob@y.org": -42}
    monkeypatch.setattr(ids, "keys_of", lambda texts: np.asarray([forced.get(t, key_of(t)) for t in texts], np.int64))
    with pytest.raises(DataError, match=r"t: rows 2 and 4, column 'mail': the different IDs 'alice@x.org' and "
                                        r"'bob@y.org' hash to the same key -42"):
        table_keys(pd.DataFrame({"mail": ["c@z.org", "alice@x.org", "7", "bob@y.org"]}), ["mail"], "t")


# -- text IDs train like integer IDs ---------------------------------------------------------------
def _ranked(texts_of) -> callable:
    """Integer IDs in the order of the text IDs' keys: the sorted shared list, hence the split and every
    batch, is the same as the text run's, so the two runs must give the same numbers, bit for bit."""
    ids = np.sort(load_dataset("breast-cancer").ids)
    keys = np.asarray([key_of(t) for t in texts_of(ids)])
    rank = dict(zip(ids.tolist(), np.argsort(np.argsort(keys)).tolist()))
    return lambda a: np.asarray([1000 + rank[int(i)] for i in a], np.int64)


def _texts(ids) -> np.ndarray:
    return np.asarray([_email(i) for i in ids], dtype=object)


def test_text_ids_with_psi_train_like_integer_ids_without_guests_flag(tmp_path):
    """Acceptance: three tables with e-mail addresses as IDs, partly overlapping, ``--align psi`` and
    no ``--guests``: the run trains on exactly the intersection, with the same numbers as the same
    tables with integer IDs in the keys' order."""
    keep, inter, _ = _overlap()
    (tmp_path / "text").mkdir()
    (tmp_path / "int").mkdir()
    text = write_party_tables(tmp_path / "text", keep=keep, id_map=_texts)
    ints = write_party_tables(tmp_path / "int", keep=keep, id_map=_ranked(_texts))
    assert pd.read_csv(text["guest-1"])["ID"].iloc[0].startswith("client.")
    a, _ = _train(tmp_path, "text", [*_flags(text), "--align", "psi"])
    b, _ = _train(tmp_path, "int", [*_flags(ints), "--align", "psi"])
    assert a["config"]["guests"] == 2  # read from --data
    assert _timeless(a["alignment"]) == _timeless(b["alignment"]) and a["alignment"]["shared_ids"] == len(inter)
    assert a["plan"]["n_train"] + a["plan"]["n_test"] == len(inter)
    assert [h["train_loss"] for h in a["history"]] == [h["train_loss"] for h in b["history"]]
    assert a["final"] == b["final"]
    # and the shared list is exactly the keys of the intersection's e-mail addresses
    loaded = prepare_data(RunConfig(data=_spec(text), id_column="ID", label_column="Y", align="psi", seed=SEED))
    got = np.sort(np.concatenate([loaded.train_ids, loaded.test_ids]))
    np.testing.assert_array_equal(got, np.sort([key_of(t) for t in _texts(inter)]))


def _composite(tmp_path, keep=None, fmt="csv") -> dict[str, str]:
    """breast-cancer's tables keyed by (name, birth date): the host's in Parquet with a date column,
    the guests' as CSV text (the same key at every party)."""
    paths = write_party_tables(tmp_path, keep=keep)
    out = {}
    for party, path in paths.items():
        frame = pd.read_csv(path)
        ids = frame.pop("ID").to_numpy()
        frame.insert(0, "birth_date", [f"{1940 + i % 60}-{1 + i % 12:02d}-{1 + i % 28:02d}" for i in ids])
        frame.insert(0, "name", [f"Person {i // 3}" for i in ids])  # names alone repeat: the date tells them apart
        if party == "host":
            frame["birth_date"] = pd.to_datetime(frame["birth_date"])
            p = Path(path).with_suffix(".parquet")
            frame.to_parquet(p, index=False)
        else:
            p = Path(path)
            frame.to_csv(p, index=False)
        out[party] = str(p)
    return out


def test_composite_key_public_alignment_and_export(tmp_path):
    """``--id-column name,birth_date`` (a Parquet date at the host, CSV text at the guests): public
    alignment trains on every row; ``export-parties`` writes each party's file keyed by the same keys."""
    paths = _composite(tmp_path)
    res, _ = _train(tmp_path, "comp", _flags(paths, "name,birth_date"))
    assert res["alignment"] == {"align": "public", "shared_ids": 569} and res["config"]["guests"] == 2
    out = tmp_path / "parties"
    assert main(["export-parties", *_flags(paths, "name,birth_date"), "--seed", str(SEED), "--out", str(out)]) == 0
    from fl_split.party_files import load_party

    ids = load_dataset("breast-cancer").ids
    want = np.sort([key_of(f"Person {i // 3}\x1f{1940 + i % 60}-{1 + i % 12:02d}-{1 + i % 28:02d}") for i in ids])
    for p in ("host", "guest-1", "guest-2"):
        data, _ = load_party(out / f"{p}.npz", p)
        np.testing.assert_array_equal(np.sort(np.concatenate([data.train_ids, data.test_ids])), want)
    # a guest missing some of the host's (composite) IDs: train's one line, keys named as keys
    g2 = pd.read_csv(paths["guest-2"]).iloc[:-2]
    g2.to_csv(tmp_path / "short.csv", index=False)
    # (the host names its own missing IDs: one process holds both tables; docs/datasets.md "Join keys")
    with pytest.raises(DataError, match=r"short\.csv\): 2 of the host's 569 IDs are not in its rows; host \(.*\) holds "
                                        r"them: 'Person \d+ \| \d{4}-\d\d-\d\d', 'Person"):
        prepare_data(RunConfig(data=_spec({**paths, "guest-2": str(tmp_path / "short.csv")}),
                               id_column="name,birth_date", label_column="Y"))


def test_one_table_with_text_ids(tmp_path):
    """``--data ONE_TABLE --columns …`` keyed by text: every row shared, split by the keys."""
    ds = load_dataset("breast-cancer")
    frame = ds.table.copy()
    frame.insert(0, "customer", [f"C-{i:06d}" for i in ds.ids])  # leading zeros: text, hashed
    frame["Y"] = ds.labels
    frame.to_csv(tmp_path / "all.csv", index=False)
    cols = list(ds.table.columns)
    prepared = prepare_data(RunConfig(data=str(tmp_path / "all.csv"), id_column="customer", label_column="Y",
                                      columns=f"host={','.join(cols[:10])};guest-1={','.join(cols[10:])}"))
    ids = np.concatenate([prepared.train_ids, prepared.test_ids])
    np.testing.assert_array_equal(np.sort(ids), np.sort([key_of(f"C-{i:06d}") for i in ds.ids]))
    assert (ids < 0).all() and prepared.parties["guest-1"].x_train.shape[0] == len(prepared.train_ids)


def test_text_ids_outside_the_intersection_appear_nowhere(tmp_path, capsys):
    """PSI on e-mail addresses: no ID outside the intersection — as text, as its key (int64 bytes or
    decimal) — in the PSI messages, the results, the run directory, the checkpoints or the console."""
    from fl_split.data.own import load_own

    keep, inter, outside = _overlap()
    paths = write_party_tables(tmp_path, keep=keep, id_map=_texts)
    transcript = []
    cfg = RunConfig(data=_spec(paths), id_column="ID", label_column="Y", align="psi", seed=SEED)
    load_own(cfg, transcript=lambda *m: transcript.append(m))
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    _, text = _train(tmp_path, "psi", [*_flags(paths), "--align", "psi"],
                     ["--run-dir", str(run_dir), "--checkpoint-dir", str(ckpt)])
    captured = capsys.readouterr()
    seen = b"".join(m[3] for m in transcript) + text.encode() + captured.out.encode() + captured.err.encode()
    files = [p for d in (run_dir, ckpt) for p in d.rglob("*") if p.is_file()]
    assert len(files) >= 3
    seen += b"".join(p.read_bytes() for p in files)
    assert _scan(seen, _texts(outside)) == []
    # the scan finds what is there (the N-party PSI sends no ID at all, not even the shared ones)
    assert _scan(_keys_blob(_texts(inter[:3])), _texts(inter[:3])) != []


def _keys_blob(texts) -> bytes:
    """The int64 keys of ``texts`` as a message would carry them (a check that :func:`_scan` can find)."""
    return np.asarray([key_of(t) for t in texts], "<i8").tobytes()


def _scan(blob: bytes, texts) -> list[str]:
    """Of ``texts``, those found in ``blob``: the value itself, or its key as int64 or in decimal."""
    decimals = {int(x) for x in re.findall(rb"-?\d{15,19}", blob)}
    found = []
    for t in texts:
        k = key_of(t)
        if t.encode() in blob or k in decimals or k.to_bytes(8, "little", signed=True) in blob:
            found.append(t)
    return found


# -- the parties from --data ------------------------------------------------------------------------
def _tables(tmp_path, names=("host", "guest-1", "guest-2")) -> dict[str, str]:
    return {p: str(tmp_path / f"{p}.csv") for p in names}


def test_parties_are_read_from_data_and_contradictions_refused(tmp_path):
    three = _spec(_tables(tmp_path))
    assert RunConfig(data=three).guests == 2 and RunConfig(data=three).parties == ["host", "guest-1", "guest-2"]
    assert RunConfig(data=three, guests=2).guests == 2
    # the Flower run config always holds every key (guests = 1 from pyproject.toml): 1 counts as not given
    assert RunConfig.from_mapping({"guests": 1, "dataset": "digits", "data": three}).guests == 2
    assert RunConfig(data=_spec(_tables(tmp_path, ("host", "guest-1")))).guests == 1
    with pytest.raises(ConfigError, match=r"--data: .*unknown party 'guest-2'; this run's parties are host, guest-1 "
                                          r"\(--guests 1"):
        main_config(["--guests", "1", "--data", three])  # given on the command line: 1 counts
    cases = [
        (dict(data=three, guests=3), r"--data: .*no table for guest-3 \(--guests 3; without --guests the parties are "
                                     r"read from --data\)"),
        (dict(data=three, dataset="credit"), r"--dataset: got 'credit' \(--data trains on your own tables, --dataset "
                                             r"on a built-in one; --data-name names your data in the results\); "
                                             r"allowed: no --dataset with --data"),
        (dict(data=_spec(_tables(tmp_path, ("host", "guest-1", "guest-3")))),
         r"no table for guest-2: guests are numbered guest-1 … guest-G without gaps \(given: guest-1, guest-3\)"),
        (dict(data=_spec(_tables(tmp_path, ("host", "guest-0")))), r"unknown party 'guest-0'; the parties are host, "),
        (dict(data=_spec(_tables(tmp_path, ("host", "guests-1")))), r"unknown party 'guests-1'"),
        (dict(data=_spec(_tables(tmp_path, ("host", "guest-01")))), r"unknown party 'guest-01'"),
        (dict(data=_spec(_tables(tmp_path, ("guest-1", "guest-2")))), r"no table for host"),
        (dict(data=_spec(_tables(tmp_path, ("host",)))), r"no guest's table"),
        (dict(data=three, id_column="a,,b"), r"--id-column: got 'a,,b'; allowed: a column name, or several"),
        (dict(data=three, id_column="name,Y", label_column="Y"), r"--label-column: got 'Y'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            RunConfig(**kwargs)


def main_config(argv: list[str]) -> RunConfig:
    """``fl-split train ARGV``'s RunConfig (the CLI knows which flags were given)."""
    from fl_split.cli import build_parser
    from fl_split.cli_support import config_from_args

    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_cli_refuses_dataset_and_a_disagreeing_guests_even_at_their_defaults(tmp_path, capsys):
    """On the command line a flag that was given counts, whatever its value: ``--dataset digits`` (the
    default) with ``--data`` was silently ignored before; ``--guests 1`` with three tables is refused."""
    paths = write_party_tables(tmp_path)
    for extra, message in ((["--dataset", "digits"], "--dataset: got 'digits' (--data trains on your own tables"),
                           (["--guests", "1"], "unknown party 'guest-2'; this run's parties are host, guest-1 "
                                               "(--guests 1; without --guests the parties are read from --data)"),
                           (["--guests", "3"], "no table for guest-3 (--guests 3")):
        out = tmp_path / "x.json"
        assert main(["train", *_flags(paths, "ID"), *extra, *OPTS, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert not out.exists()
    assert main_config([*_flags(paths), "--guests", "2"]).guests == 2
    assert main_config(_flags(paths)).guests == 2


# -- first-contact slips ----------------------------------------------------------------------------
def _one_line(tmp_path, capsys, args: list[str]) -> str:
    out = tmp_path / "bad.json"
    code = main(["train", *args, *OPTS, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and err.startswith("fl-split: error:"), err
    return err


def test_a_misspelt_label_or_id_column_is_named_with_close_names(tmp_path, capsys):
    """Issue 23: ``--label-column malignant`` said ``'malignant' is not a number … one-hot encode`` (the
    label column was read as a feature); now the label column is checked first and close names offered."""
    paths = write_party_tables(tmp_path)
    host = pd.read_csv(paths["host"]).rename(columns={"Y": "Diagnosis"})
    host["Diagnosis"] = np.where(host["Diagnosis"] == 1, "benign", "malignant")
    host.to_csv(paths["host"], index=False)
    flags = [a for a in _flags(paths) if a not in ("--label-column", "Y")]
    err = _one_line(tmp_path, capsys, [*flags, "--label-column", "diagnosis"])
    assert "host (host.csv): no label column 'diagnosis' (--label-column); did you mean 'Diagnosis'?" in err
    err = _one_line(tmp_path, capsys, flags)  # the default 'label': the table's columns are listed
    assert "no label column 'label' (--label-column); its columns are 'ID'," in err and "not a number" not in err
    err = _one_line(tmp_path, capsys, [*flags, "--label-column", "Diagnosis", "--id-column", "id"])
    assert "host (host.csv): no ID column 'id' (--id-column); did you mean 'ID'?" in err


@pytest.mark.parametrize("sep,name", [("\t", "tab"), (";", "semicolon")])
def test_a_tab_or_semicolon_separated_csv_gets_a_hint(tmp_path, capsys, sep, name):
    paths = write_party_tables(tmp_path)
    pd.read_csv(paths["guest-1"]).to_csv(paths["guest-1"], sep=sep, index=False)
    err = _one_line(tmp_path, capsys, _flags(paths))
    assert f"guest-1: guest-1.csv looks {name}-separated" in err and "fl-split reads comma-separated .csv" in err


def test_psi_needs_no_package_outside_the_install(monkeypatch):
    """The old hint (``pip install openmined-psi``) downgraded protobuf below Flower's: --align psi now
    runs on the package's own dependencies (X25519 from ``cryptography``), the fast backend is the
    optional extra, and no install line of the README names openmined-psi."""
    from fl_split.psi import align_by_psi

    monkeypatch.setenv("FL_SPLIT_PSI_BACKEND", "cryptography")
    shared = align_by_psi({"host": np.arange(0, 20), "guest-1": np.arange(10, 30), "guest-2": np.arange(5, 15)})
    assert list(shared) == list(range(10, 15))
    assert "openmined" not in (ROOT / "README.md").read_text() and "openmined" not in (ROOT / ".ci" / "run").read_text()


def test_python_version_matches_flowers():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["requires-python"] == ">=3.11"  # flwr 1.41 needs 3.11
    readme = (ROOT / "README.md").read_text()
    assert "Python ≥ 3.11" in readme and "3.10" not in readme


def test_model_module_in_the_working_directory(tmp_path, monkeypatch):
    """``--model my_models:build`` with ``my_models.py`` in the working directory imports it (the
    directory goes on the import path, as ``python -m`` does); a module found nowhere says PYTHONPATH."""
    import os

    from fl_split.models.user import load_function

    name = "fl_split_test_models_cwd"
    (tmp_path / f"{name}.py").write_text("def build(spec):\n    return spec\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert load_function(f"{name}:build")("x") == "x"
        assert sys.path[0] == str(tmp_path)
    finally:
        sys.modules.pop(name, None)
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_models_here'.*put its directory on "
                                          r"PYTHONPATH"):
        load_function("no_such_models_here:build")


# -- the Flower app --------------------------------------------------------------------------------
@pytest.mark.usefixtures("flower_task_identity")
def test_text_ids_in_the_flower_app_from_its_run_config(tmp_path):
    """``--engine flower`` (the ServerApp and the simulation's ClientApps, in process): a run config as
    Flower hands it over (every key, ``guests = 1`` from pyproject.toml) with e-mail-ID tables and
    ``align = "psi"``: two guests read from ``data``, the same numbers as the local engine."""
    import tests.test_flower as tf
    from fl_split.flower.appconfig import app_config
    from fl_split.flower.strategy import VerticalSplitStrategy

    keep, inter, _ = _overlap()
    paths = write_party_tables(tmp_path, keep=keep, id_map=_texts)
    values = {**app_config(), "defense": "none", "denoise": "none", "data": _spec(paths), "id-column": "ID",
              "label-column": "Y", "align": "psi", "engine": "flower", "epochs": 1, "batch-size": 64,
              "seed": SEED, "progress": False, "device": "cpu"}
    cfg = RunConfig.from_mapping(values)
    assert cfg.guests == 2
    got = VerticalSplitStrategy(cfg).run(tf.InlineGrid(tf._simulation_nodes(3), fresh_process=True))
    ref = tf._local(cfg)
    assert got["plan"]["n_train"] + got["plan"]["n_test"] == len(inter)
    assert tf._strip(got) == tf._strip(ref)


# -- a Flower deployment ----------------------------------------------------------------------------
@pytest.mark.usefixtures("flower_task_identity")
def test_text_ids_between_deployment_nodes(tmp_path):
    """Each SuperNode reads its own table with e-mail IDs (``data = "node-tables"``), the ServerApp
    routes the PSI: the same run as the local engine on the same tables, and no message, both ways,
    holds an ID outside the intersection (as text or as its key)."""
    from fl_split.engine import run_experiment
    from fl_split.flower.strategy import VerticalSplitStrategy
    from fl_split.seeding import PrivateSeed
    from tests.test_deploy_align import RUN, RecordingGrid, _nodes

    keep, inter, outside = _overlap()
    paths = write_party_tables(tmp_path, keep=keep, id_map=_texts)
    seed = PrivateSeed.generate()
    grid = RecordingGrid(_nodes(tmp_path, paths, seed), fresh_process=True)
    dep = VerticalSplitStrategy(RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower",
                                          **RUN)).run(grid)
    local = run_experiment(RunConfig(data=_spec(paths), align="psi", **RUN), private_seed=seed)
    assert _timeless(dep["alignment"]) == _timeless(local["alignment"]) and dep["alignment"]["shared_ids"] == len(inter)
    assert dep["final"] == local["final"]
    for key in ("train_loss", "test_metric", "test_loss"):
        assert [h[key] for h in dep["history"]] == [h[key] for h in local["history"]]
    wire = b"".join(grid.wire)
    assert _scan(wire, _texts(outside)) == []
    assert _scan(_keys_blob(_texts(inter[:3])), _texts(inter[:3])) != []  # the scan finds what is there


@pytest.mark.slow
def test_deploy_local_with_text_ids(psi_table_deployment):
    """End to end (a SuperLink and three SuperNodes, separate processes): ``deploy local --data …
    --id-column ID --align psi`` on e-mail IDs, no ``--guests``; the run trains on exactly the
    intersection, like the local engine, and no result, log, output or SuperLink database holds an ID
    outside it. (The session's shared run, tests/shared_runs.py; tests/test_deploy_align.py checks
    the node tables on it.)"""
    run = psi_table_deployment
    assert run.proc.returncode == 0, run.proc.stdout[-3000:] + run.proc.stderr[-3000:]
    assert run.left == []
    dep, local = run.dep, run.local
    assert local is not None, "the local engine's run failed"
    assert dep["config"]["guests"] == 2
    assert _timeless(dep["alignment"]) == _timeless(local["alignment"]) and dep["alignment"]["shared_ids"] == len(run.inter)
    assert dep["final"]["value"] == local["final"]["value"]
    assert _scan(run.seen, run.outside) == []
    assert _scan(_keys_blob(run.inter[:3]), run.inter[:3]) != []  # the scan finds what is there
