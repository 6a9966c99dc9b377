"""Messages as a user meets them (stderr of ``fl-split``, exception text): they name the party, its file
and what was expected, show the user's own values, and do not fill a notebook cell with repeats."""

from __future__ import annotations

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
