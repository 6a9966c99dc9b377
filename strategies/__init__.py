"""The Flower ServerApp side of fl_split: the coordinator strategy of vertical split learning.

The names below are loaded on first use, not on import: ``flwr run`` checks that
``strategies.server_app:app`` exists with ``importlib.util.find_spec``, which runs this package's
``__init__`` (not ``server_app``); importing the server app here made every ``flwr run`` import
torch first (2.4 s of CPU before it submits the run, on this machine)."""

__all__ = ["VerticalSplitStrategy", "app", "make_server_app"]


def __getattr__(name: str):
    if name in __all__:
        from strategies import server_app

        return getattr(server_app, name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
