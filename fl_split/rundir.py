"""A run directory: what a researcher keeps of every ``fl-split train`` (docs/results.md).

``fl-split train`` writes, after the run, one directory holding

* ``results.json`` — the results dictionary (strict JSON, :func:`fl_split.results.write_json_atomic`);
* ``epochs.csv`` — one row per evaluated epoch: ``epoch, train_loss, test_<metric>, test_loss,
  epoch_time_s`` (an empty cell where the host keeps its metrics, ``--report-metrics none``, or no
  value exists) and ``epsilon_<party>`` for each perturbing party: its ledger's epsilon after
  that epoch's releases (``epsilon_by_epoch`` of its privacy report);
* ``curves.png`` — the test metric and the train/test loss per epoch, with each party's final
  epsilon in the title, and below them each party's epsilon per epoch.

By default the directory is ``$FL_SPLIT_RUNS/<UTC time>-<dataset>-<defense>`` (``$FL_SPLIT_RUNS``
unset: ``./runs``); ``--run-dir DIR`` names it, ``--no-run-dir`` writes none. Every file is written
atomically (temporary file + rename) and only after the run ended, so a failed or interrupted run
leaves no half-written file; the directory is created only then, owner-only (mode 0700, each file
0600: the results name the run's data, model and privacy settings). A name already taken gets a
``-2``, ``-3`` … suffix: a run never overwrites another's directory by default.

Everything here is derived from the results the coordinator already holds (the host's declared
per-epoch aggregates and the parties' end-of-run reports): a run directory discloses nothing the
results JSON does not.
"""

from __future__ import annotations

import csv
import io
import os
import time
from pathlib import Path
from typing import Any

from fl_split.results import write_bytes_atomic, write_json_atomic
from fl_split.secure_files import private_dir

COLUMNS = ("epoch", "train_loss", "test_metric", "test_loss", "epoch_time_s")


def default_run_dir(results: dict[str, Any], root: str | os.PathLike | None = None) -> Path:
    """``<root>/<UTC yyyymmdd-HHMMSS>-<dataset>-<defense>``, with a ``-N`` suffix if taken."""
    root = Path(root if root is not None else os.environ.get("FL_SPLIT_RUNS") or "runs").expanduser()
    base = run_name(results)
    path, n = root / base, 1
    while path.exists():
        n += 1
        path = root / f"{base}-{n}"
    return path


def run_name(results: dict[str, Any]) -> str:
    """``<UTC yyyymmdd-HHMMSS>-<dataset>-<defense>`` of a run that ends now."""
    cfg = results["config"]
    data = cfg.get("data_name") if cfg.get("data") else cfg.get("dataset")
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{data}-{str(cfg.get('defense', 'none')).replace(':', '-')}"


def epochs_csv(results: dict[str, Any]) -> str:
    """The per-epoch history as CSV text (header names the metric: ``test_accuracy`` …), then one
    ``epsilon_<party>`` column per perturbing party: its ledger's epsilon after that epoch."""
    metric = results["final"]["metric"]
    per_epoch = epsilons_per_epoch(results)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    extra = task_columns(results)
    cols = [*COLUMNS[:-1], *extra, COLUMNS[-1]]
    w.writerow([c if c != "test_metric" else f"test_{metric}" for c in cols] + [f"epsilon_{p}" for p in per_epoch])
    for row in results["history"]:
        cells = ["" if row.get(c) is None or row.get(c) != row.get(c) else row[c] for c in cols]
        eps = [per_epoch[p].get(str(row.get("epoch"))) for p in per_epoch]
        w.writerow(cells + ["" if e is None else e for e in eps])
    return buf.getvalue()


def task_columns(results: dict[str, Any]) -> list[str]:
    """The task's other per-epoch metrics (``test_auc`` … for binary, ``test_mae``, ``test_rmse`` for
    regression; fl_split/tasks.py), in the order the host reports them."""
    out: list[str] = []
    for row in results["history"]:
        out += [k for k in row if k.startswith("test_") and k not in COLUMNS and k not in out]
    return out


def epsilons_per_epoch(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each perturbing party's ``{epoch: epsilon}`` (``epsilon_by_epoch`` of its privacy report)."""
    return {p: dict(r.get("epsilon_by_epoch") or {}) for p, r in (results.get("privacy") or {}).items()
            if r.get("epsilon") is not None}


def final_epsilons(results: dict[str, Any]) -> dict[str, float]:
    """Each perturbing party's final epsilon (parties that release unperturbed have none)."""
    return {p: float(r["epsilon"]) for p, r in (results.get("privacy") or {}).items()
            if r.get("epsilon") is not None}


def curves_png(results: dict[str, Any]) -> bytes:
    """A PNG of the test metric (left axis) and train / test loss (right axis) per epoch."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    hist = results["history"]
    metric = results["final"]["metric"]
    per_epoch = {p: v for p, v in epsilons_per_epoch(results).items() if v}
    fig = Figure(figsize=(6.4, 6.4 if per_epoch else 4.0), dpi=100)
    ax = fig.add_subplot(2 if per_epoch else 1, 1, 1)
    ep = [h["epoch"] for h in hist]

    def series(key):
        return [float("nan") if h.get(key) is None else h[key] for h in hist]

    ax.plot(ep, series("test_metric"), "o-", color="tab:blue", label=f"test {metric}")
    ax.set_xlabel("epoch")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"test {metric}")
    ax2 = ax.twinx()
    ax2.plot(ep, series("train_loss"), "s--", color="tab:red", label="train loss")
    ax2.plot(ep, series("test_loss"), "^:", color="tab:orange", label="test loss")
    ax2.set_ylabel("loss")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize="small")
    cfg = results["config"]
    eps = final_epsilons(results)
    title = f"{cfg.get('dataset')} · defense {cfg.get('defense')}"
    if eps:
        title += " · final ε " + ", ".join(f"{p} {e:.3g}" for p, e in eps.items())
    unclaimed = [p for p, r in (results.get("privacy") or {}).items() if r.get("privacy_claim") == "none"]
    if unclaimed:  # a plug-in defence with no DP event (docs/plugins.md): said, never an ε
        title += " · no privacy claimed: " + ", ".join(unclaimed)
    if not hist:
        title += f" · no epoch evaluated ({results.get('stopped_reason', '')})"
    ax.set_title(title, fontsize="small")
    if per_epoch:  # each party's epsilon after each epoch, below
        ax3 = fig.add_subplot(2, 1, 2, sharex=ax)
        for p, values in per_epoch.items():
            xs = sorted(int(e) for e in values)
            ax3.plot(xs, [float("nan") if values[str(e)] is None else values[str(e)] for e in xs], "o-", label=p)
        ax3.set_xlabel("epoch")
        ax3.set_ylabel("ε (after the epoch)")
        ax3.legend(loc="best", fontsize="small")
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_run_dir(results: dict[str, Any], directory: str | os.PathLike) -> Path:
    """Write ``results.json``, ``epochs.csv`` and ``curves.png`` into ``directory`` (created);
    returns it. Each file is rendered in memory first and then written atomically."""
    directory = Path(directory).expanduser()
    csv_text, png = epochs_csv(results), curves_png(results)
    # owner-only (issue 25): 0700, and each file 0600 (mkstemp's mode, kept by the rename)
    private_dir(directory)
    write_json_atomic(directory / "results.json", results)
    write_bytes_atomic(directory / "epochs.csv", csv_text.encode("utf-8"))
    write_bytes_atomic(directory / "curves.png", png)
    return directory
