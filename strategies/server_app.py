"""The fl_split ServerApp (``flwr run .``): a thin shell over :mod:`fl_split.flower.strategy`,
where the coordinator strategy of vertical split learning lives."""

from __future__ import annotations

from fl_split.flower.strategy import VerticalSplitStrategy, flwr_run_app, make_server_app

app = flwr_run_app()

__all__ = ["VerticalSplitStrategy", "app", "make_server_app"]
