"""The Flower ServerApp side of fl_split: the coordinator strategy of vertical split learning."""

from strategies.server_app import VerticalSplitStrategy, app, make_server_app

__all__ = ["VerticalSplitStrategy", "app", "make_server_app"]
