"""Messages as a user meets them (stderr of ``fl-split``, exception text): they name the party, its file
and what was expected, show the user's own values, and do not fill a notebook cell with repeats."""

from __future__ import annotations

import re

import pytest

from fl_split.cli import main

SEED = ["--private-seed", "8c9e2d44d0ce787253e1ed754fe13786"]


def test_snr_warning_is_one_line_per_run(capsys):
    """breast-cancer under Laplace ε = 4 on both crossings learns (accuracy > 0.9) with a public SNR bound
    of 0.177: one warning line naming every party, not one per guest and direction plus each party's own
    "mostly noise" (docs/mechanisms.md "Signal-to-noise warnings")."""
    code = main(["train", "--dataset", "breast-cancer", "--guests", "2", "--defense", "laplace", "--epsilon", "4",
                 "--protect", "both", "--epochs", "3", "--no-progress", "--no-run-dir", *SEED])
    out, err = capsys.readouterr()
    assert code == 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("fl-split: warning: releases below a per-record signal-to-noise ratio of 1")
    assert "guest-1, guest-2 (laplace, at most 0.177)" in line and "the host to guest-1, guest-2" in line
    assert "raise --epsilon" in line and "mostly noise" not in err
    assert "SNR bound" in out  # the bounds stay in the summary (and each party's report)


def test_snr_warning_from_python_is_one_line(capsys):
    """``fl_split.train`` prints the same single line (a notebook cell shows stderr)."""
    import fl_split

    run = fl_split.train(dataset="breast-cancer", guests=2, defense="laplace", epsilon=4.0, epochs=2, progress=False,
                         observe=False, private_seed="8c9e2d44d0ce787253e1ed754fe13786")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "guest-1, guest-2 (laplace, at most 0.177)" in err[0], err
    assert run.results["privacy"]["guest-1"]["release_diagnostics"]["snr_bound"] * 8 == pytest.approx(0.177, abs=1e-3)


def _houses(tmp_path, n: int = 240):
    """Two parties' tables of houses keyed by a text ID (``P-00001`` …): the host's ``Gr_Liv_Area`` and
    label ``Y`` (binary), the guest's ``Year_Built`` and ``Lot_Area``; the frames and their paths."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(8)
    ids = [f"P-{i:05d}" for i in range(1, n + 1)]
    area, year = rng.integers(600, 3500, n), rng.integers(1900, 2010, n)
    y = np.where(area / 1000 + (year - 1900) / 50 + rng.normal(0, 0.5, n) > 3.6, "high", "low")
    host = pd.DataFrame({"PID": ids, "Gr_Liv_Area": area, "Y": y})
    guest = pd.DataFrame({"PID": ids, "Year_Built": year, "Lot_Area": rng.integers(2000, 20000, n)})
    paths = {"host": tmp_path / "host.csv", "guest-1": tmp_path / "guest.csv"}
    host.to_csv(paths["host"], index=False)
    guest.sample(frac=1, random_state=2).to_csv(paths["guest-1"], index=False)
    return host, guest, paths


def _flags(paths) -> list[str]:
    return [*(a for p, v in paths.items() for a in ("--data", f"{p}={v}")), "--id-column", "PID"]


def test_predict_schema_mismatch_names_the_party_file_and_columns(tmp_path, capsys):
    """A new table without a column the model was trained on: the line names the party, its table's path,
    its saved part, the missing column, what the saved part expects and what the table has."""
    host, guest, paths = _houses(tmp_path)
    model = tmp_path / "model"
    assert main(["train", *_flags(paths), "--label-column", "Y", "--epochs", "1", "--no-progress", "--no-run-dir",
                 *SEED, "--save-model", str(model)]) == 0
    capsys.readouterr()
    new = tmp_path / "new-guest.csv"
    guest.drop(columns=["Year_Built"]).to_csv(new, index=False)
    code = main(["predict", "--model", str(model), "--data", f"host={paths['host']}", "--data", f"guest-1={new}",
                 "--id-column", "PID", "--out", str(tmp_path / "pred.csv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"fl-split: error: guest-1 (table {new}, saved part {model / 'guest-1'}): column ['Year_Built'] "
                      f"missing; expected the 2 column(s) the encoder was fitted on ['Year_Built', 'Lot_Area'], found "
                      f"['PID', 'Lot_Area']")
    assert not (tmp_path / "pred.csv").exists() and not (model / "guest-1" / "inference-ledger.npz").exists()


def test_missing_public_ids_are_shown_as_the_hosts_own_values(tmp_path, capsys):
    """``--align public`` with a guest lacking three of the host's text IDs: the host names them as its table
    writes them (``'P-00007'``), not as negative hash keys; the guest's part names only the guest and its file.
    The same at ``predict``. A guest alone (a deployment node) shows the keys and says why."""
    import numpy as np

    from fl_split.data.ids import key_of
    from fl_split.data.own import check_public_ids
    from fl_split.errors import DataError

    host, guest, paths = _houses(tmp_path)
    short = tmp_path / "short.csv"
    guest[~guest.PID.isin(["P-00007", "P-00100", "P-00233"])].to_csv(short, index=False)
    flags = _flags({"host": paths["host"], "guest-1": short})
    code = main(["train", *flags, "--label-column", "Y", "--epochs", "1", "--no-progress", "--no-run-dir", *SEED])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("fl-split: error: guest-1 (short.csv): 3 of the host's 240 IDs are not in its rows; host "
                      "(host.csv) holds them: 'P-00007', 'P-00100', 'P-00233' (with --align public every guest holds "
                      "each of the host's IDs; --align psi uses the intersection)")
    assert not re.search(r"-\d{6,}", err[0])  # no negative hash key anywhere
    # predict: the same, before any release
    model = tmp_path / "model"
    assert main(["train", *_flags(paths), "--label-column", "Y", "--epochs", "1", "--no-progress", "--no-run-dir",
                 *SEED, "--save-model", str(model)]) == 0
    capsys.readouterr()
    assert main(["predict", "--model", str(model), *flags, "--out", str(tmp_path / "pred.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 of the host's 240 IDs are not in its rows; host (table " in err[0], err
    assert "holds them: 'P-00007', 'P-00100', 'P-00233'" in err[0]
    assert not (model / "guest-1" / "inference-ledger.npz").exists()
    # a guest on its own knows the host's IDs as keys only: it says so rather than print bare numbers
    keys = np.sort([key_of(f"P-{i:05d}") for i in (1, 2, 3)])
    with pytest.raises(DataError, match=r"^guest-1 \(g\.csv\): 1 of the host's 3 IDs is not in its rows; their keys "
                                        r"-\d+ \(text IDs travel as hashed keys, fl_split\.data\.ids: the host's own"):
        check_public_ids(keys[:2], keys, "guest-1 (g.csv)")
