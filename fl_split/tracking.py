"""Experiment tracking: a run's per-epoch metrics and each party's epsilon as TensorBoard scalars
(``fl-split train --tensorboard DIR``; docs/results.md).

Scalars, one event file per run under ``DIR/<run name>/`` (the run directory's name, so runs sit
side by side in ``tensorboard --logdir DIR``):

* ``test/<metric>``, ``test/loss``, ``train/loss``, ``time/epoch_s`` at step = epoch;
* ``epsilon/<party>`` for each party whose releases are perturbed, at step = epoch: its ledger's
  epsilon after that epoch's releases (``epsilon_by_epoch``; the final epsilon at the last epoch).

The run's folder is owner-only (0700, its event files 0600; ``DIR`` too when this creates it).
They are written from the results after the run, so a tracker sees exactly what the results JSON
says and nothing more (the host's declared aggregates and the parties' public reports); a run whose
host keeps its metrics (``--report-metrics none``) logs no metric scalars.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fl_split.errors import ConfigError


def check_tensorboard(directory: str) -> None:
    """Refuse ``--tensorboard DIR`` before the run when it cannot work (package or directory)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError as exc:
        raise ConfigError("tensorboard", directory, "a directory, with the tensorboard package installed "
                          "(pip install tensorboard)", reason=str(exc)) from None
    p = Path(directory).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError("tensorboard", directory, "a directory (created if missing)", reason="it is a file")


def log_tensorboard(results: dict[str, Any], directory: str, name: str | None = None) -> Path:
    """Write the run's scalars into ``directory/<name>``; returns that folder."""
    from torch.utils.tensorboard import SummaryWriter

    from fl_split.rundir import epsilons_per_epoch, final_epsilons, run_name, task_columns

    from fl_split.secure_files import make_owner_only, private_dir

    root = Path(directory).expanduser()
    if not root.exists():
        private_dir(root)  # created here: owner-only (an existing one keeps the mode its owner gave it)
    folder = private_dir(root / (name or run_name(results)))  # 0700 before any event file exists in it
    metric = results["final"]["metric"]
    tags = {"test_metric": f"test/{metric}", "test_loss": "test/loss", "train_loss": "train/loss",
            "epoch_time_s": "time/epoch_s", **{k: "test/" + k[5:] for k in task_columns(results)}}
    writer = SummaryWriter(log_dir=str(folder))
    try:
        last = 0
        for row in results["history"]:
            last = int(row["epoch"])
            for key, tag in tags.items():
                v = row.get(key)
                if v is not None and math.isfinite(float(v)):
                    writer.add_scalar(tag, float(v), global_step=last)
        per_epoch = epsilons_per_epoch(results)
        for party, eps in final_epsilons(results).items():
            values = {int(e): v for e, v in per_epoch.get(party, {}).items() if v is not None}
            values.setdefault(last, eps)
            for epoch in sorted(values):
                writer.add_scalar(f"epsilon/{party}", float(values[epoch]), global_step=epoch)
    finally:
        writer.close()
        make_owner_only(folder)  # TensorBoard writes its event files 0644: 0600 (never readable: the folder is 0700)
    return folder
