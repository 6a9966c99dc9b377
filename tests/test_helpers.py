"""The comparison helpers of tests/helpers.py: tolerant where one side was computed on another
machine, never so tolerant that a real difference passes."""

from __future__ import annotations

import pytest

from tests.helpers import REL_TOL, assert_same_rows, assert_same_text, close, same_cell

ROWS = [{"dataset": "credit", "defence": "laplace", "epsilon": "8.0", "seed": "0", "metric": "epsilon",
         "value": "7.988415183574826"},
        {"dataset": "credit", "defence": "none", "epsilon": "", "seed": "0", "metric": "utility",
         "value": "0.0"}]


def _with(value: str, row: int = 0, key: str = "value") -> list[dict]:
    rows = [dict(r) for r in ROWS]
    rows[row][key] = value
    return rows


def test_rows_pass_at_rounding_noise_and_fail_on_a_real_difference():
    assert_same_rows(_with("7.988415183574831"), ROWS)  # the AMD EPYC run's ε: 6e-16 relative
    assert_same_rows(_with(repr(7.988415183574826 * (1 + 1e-15))), ROWS)
    assert_same_rows(_with("1e-17", row=1), ROWS)  # a zero's rounding residue
    with pytest.raises(AssertionError, match="row 0 value: '7.988423"):
        assert_same_rows(_with(repr(7.988415183574826 * (1 + 1e-6))), ROWS)
    with pytest.raises(AssertionError):
        assert_same_rows(_with(repr(7.988415183574826 * (1 + 10 * REL_TOL))), ROWS)
    with pytest.raises(AssertionError):
        assert_same_rows(_with("1e-6", row=1), ROWS)
    with pytest.raises(AssertionError):  # text exactly
        assert_same_rows(_with("rr", key="defence"), ROWS)
    with pytest.raises(AssertionError):  # integers exactly
        assert_same_rows(_with("1", key="seed"), ROWS)
    with pytest.raises(AssertionError):  # an empty cell is text
        assert_same_rows(_with("0", row=1, key="epsilon"), ROWS)
    with pytest.raises(AssertionError, match="rows"):
        assert_same_rows(ROWS[:1], ROWS)


def test_cells_and_numbers():
    assert same_cell("nan", "nan") and not same_cell("nan", "0.0") and not same_cell("inf", "1e308")
    assert close(1.0, 1.0 + 1e-15) and not close(1.0, 1.0 + 1e-6)


LEADERBOARD = """# fl-split bench leaderboard

Seeds [0], 1 guest(s), 1 epochs; (PLD, δ = 1e-05); β = 0.5.

| rank | defence | parameter | utility | C-DCS | ε reported |
|---|---|---|---|---|---|
| 1 | rr | epsilon 13.62 | 0.833 | **0.793** | guest-1 7.99 |
"""


def test_text_masks_numbers_and_allows_one_unit_of_a_printed_digit():
    assert_same_text(LEADERBOARD, LEADERBOARD)
    # a value on a rounding boundary (0.8335) may print either way on another machine
    assert_same_text(LEADERBOARD.replace("0.833", "0.834"), LEADERBOARD)
    assert_same_text(LEADERBOARD.replace("7.99", "7.98"), LEADERBOARD)
    full = "ε 7.988415183574826"  # a number printed in full: REL_TOL, not its last digit's unit
    assert_same_text("ε " + repr(7.988415183574826 * (1 + 1e-15)), full)
    with pytest.raises(AssertionError):
        assert_same_text("ε " + repr(7.988415183574826 * (1 + 1e-6)), full)
    for changed in (LEADERBOARD.replace("0.833", "0.835"),    # two units: a real difference
                    LEADERBOARD.replace("13.62", "13.64"),
                    LEADERBOARD.replace("| 1 | rr", "| 2 | rr"),  # integers exactly
                    LEADERBOARD.replace("1e-05", "2e-05"),
                    LEADERBOARD.replace("guest-1", "guest-2"),
                    LEADERBOARD.replace("| rr |", "| laplace |"),  # text exactly
                    LEADERBOARD + "\nmore\n"):
        with pytest.raises(AssertionError):
            assert_same_text(changed, LEADERBOARD)
