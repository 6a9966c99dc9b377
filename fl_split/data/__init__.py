"""Datasets, vertical partitioning, ID alignment and per-party encoding.

Names are imported lazily: ``fl_split.data.registry`` (read by ``fl-split --help``) must not pull
in PyTorch and pandas through this package.
"""

_NAMES = {
    "fl_split.data.base": ("PartyData", "PartySlice", "VerticalDataset", "apply_padding", "partition",
                           "positions_of", "prepare_party", "split_ids"),
    "fl_split.data.registry": ("dataset_info", "dataset_names", "load_dataset"),
}
__all__ = [n for names in _NAMES.values() for n in names]


def __getattr__(name):
    import importlib

    for module, names in _NAMES.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'fl_split.data' has no attribute {name!r}")
