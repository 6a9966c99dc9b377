"""fl_split: vertical split learning with privacy protection, on Flower, PyTorch and Ray.

The public Python API (``docs/api.md``, :mod:`fl_split.api`)::

    import fl_split
    run = fl_split.train(dataset="breast-cancer", guests=2, defense="laplace", epsilon=1.0, epochs=3)
    run.history, run.privacy, run.metrics      # pandas DataFrames and a dict
    run.attack("label-norm")                   # mounted on the finished run, from the attacker's view
    run.model.predict({"host": ..., "guest-1": ..., "guest-2": ...})

Citations in docstrings resolve in ``docs/references.md``: papers by id (000–003: e.g. "001 §3.4,
Eq. 10"), the specification's sections ("spec §3") and the design and privacy principles
("design principle 1", "privacy principle 4").
"""

__version__ = "0.1.0"

__all__ = ["ATTACK_NAMES", "ConfigError", "DataError", "FlSplitError", "ModelSpec", "PrivateSeed", "Run",
           "RunConfig", "SavedModel", "__version__", "attack", "load_model", "train"]

#: where each public name lives (imported on first use: ``import fl_split`` stays light, no torch)
_LAZY = {
    "train": "fl_split.api", "attack": "fl_split.api", "load_model": "fl_split.api", "Run": "fl_split.api",
    "SavedModel": "fl_split.api", "RunConfig": "fl_split.config", "ConfigError": "fl_split.errors",
    "DataError": "fl_split.errors", "FlSplitError": "fl_split.errors", "PrivateSeed": "fl_split.seeding",
    "ModelSpec": "fl_split.models.user", "ATTACK_NAMES": "fl_split.attacks.options",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fl_split' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
