"""``fl-split bench`` (issue 28): every defence against every attack at matched, tightly accounted ε.

A grid (:mod:`~fl_split.bench.grid`: datasets × defences × attacks × target ε × seeds, from a TOML/JSON
file or flags) is calibrated (:mod:`~fl_split.bench.calibrate`, issue 26: each defence's noise
parameter bisected through the real ledger so that every guest's ε after training is the target),
run cell by cell, resumably and in parallel over Ray (:mod:`~fl_split.bench.run`), and scored
(:mod:`~fl_split.bench.scores`: each attack's advantage over its trivial baseline; VFLAIR's DCS, T-DCS
and C-DCS beside it) into a tidy CSV, a Markdown leaderboard and curves (:mod:`~fl_split.bench.report`).

    from fl_split.bench import bench, make_grid
    bench(make_grid({"datasets": ["credit"], "defences": ["laplace", "rr"], "attacks": ["property"],
                     "epsilons": [1, 8]}), "bench-out", workers=2)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fl_split.bench.grid import Grid, load, make_grid

__all__ = ["Grid", "make_grid", "load", "bench", "tables"]


def bench(grid: Grid, out: str | Path, workers: int | None = None, progress: bool = True, plots: bool = True,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``grid`` into ``out`` (finished cells are kept) and write ``bench.csv``, ``leaderboard.md``,
    ``<dataset>.png`` and ``bench.json`` (grid, calibration, seconds, versions). Returns the summary with
    ``ran`` / ``skipped`` / ``failed`` counts."""
    from fl_split.bench import calibrate as cal
    from fl_split.bench import report
    from fl_split.bench.run import PRIVATE_SEED, run_grid

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    res = run_grid(grid, out, workers=workers, progress=progress, log=log)
    summ, rows, verdicts = tables(grid, res["cells"])
    report.write_csv(rows, out / "bench.csv")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "grid": grid.to_dict(), "accountant": "pld", "delta": 1e-5, "tolerance": cal.TOLERANCE,
            "private_seed": PRIVATE_SEED, "workers": workers, "cells": res["total"], "ran": res["ran"],
            "skipped": res["skipped"], "failed": res["failed"], "seconds": round(time.perf_counter() - t0, 1),
            "cell_seconds": round(sum(c.get("seconds", 0.0) for c in res["cells"]), 1),
            "python": sys.version.split()[0], "versions": _versions()}
    (out / "leaderboard.md").write_text(report.leaderboard(grid, summ, meta, verdicts))
    (out / "verdicts.md").write_text(report.verdict_block(grid, summ, verdicts))
    if plots:
        report.plot(grid, summ, lambda ds: out / f"{ds}.png")
    # every invocation on this directory, oldest first (a resumed run's own counts and seconds)
    this = {k: meta[k] for k in ("date", "workers", "cells", "ran", "skipped", "failed", "seconds")}
    runs = []
    if (out / "bench.json").is_file():
        old = json.loads((out / "bench.json").read_text())
        runs = old.get("runs") or [{k: old.get(k) for k in this}]
    meta["runs"] = runs + [this]
    (out / "bench.json").write_text(json.dumps(meta, indent=1) + "\n")
    return {**res, "summary": summ, "meta": meta}


def tables(grid: Grid, cells: list[dict]) -> tuple[dict[str, Any], list[dict], dict[tuple, dict]]:
    """From finished cells: the summary (:func:`~fl_split.bench.report.summarise`), the tidy rows with
    each seed's constant-prediction utility (``constant_prediction`` rows, the usability guard's
    reference) and the verdicts (:func:`fl_split.bench.verdicts.judge`)."""
    from fl_split.bench import report
    from fl_split.bench import verdicts as V

    summ = report.summarise(cells)
    rows = report.tidy_rows(cells, summ)
    for ds in grid.datasets:
        if (ds, "none", None) not in summ["summary"]:
            continue
        for seed in grid.seeds:
            c = V.constant_prediction({**grid.base(ds), "seed": seed})
            if c is not None:
                rows.append(dict(dataset=ds, defence="none", epsilon=None, seed=seed, party="host",
                                 metric="constant_prediction", value=c))
    return summ, rows, V.judge(rows, summ["attacks"], grid.protect)


def _versions() -> dict[str, str]:
    out = {}
    for mod in ("torch", "numpy", "dp_accounting", "ray"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:  # pragma: no cover - optional
            out[mod] = "not installed"
    return out
