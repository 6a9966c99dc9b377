"""The dataset registry: names, loaders, and whether each is usable offline.

A loader takes the data root (for downloadable datasets) and returns a
:class:`~fl_split.data.base.VerticalDataset`. Loaded datasets are cached per process: they are
read-only inputs to :func:`~fl_split.data.base.partition`, which copies what it hands out.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fl_split.data.catalog import CATALOG, DatasetEntry
from fl_split.errors import ConfigError, DataError

if TYPE_CHECKING:
    from fl_split.data.base import VerticalDataset

#: Environment variable that forbids downloads (set by tests and CI): a missing file is an error.
NO_DOWNLOAD_ENV = "FL_SPLIT_NO_DOWNLOAD"


@dataclass(frozen=True)
class DatasetInfo:
    """A catalog entry (:mod:`fl_split.data.catalog`) with its loader resolved on first use."""

    entry: DatasetEntry

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def description(self) -> str:
        return self.entry.description

    @property
    def offline(self) -> bool:
        return self.entry.offline

    @property
    def default_model(self) -> str:
        return self.entry.default_model

    def load(self, root: Path, download: bool) -> "VerticalDataset":
        module, func = self.entry.loader.split(":")
        return getattr(importlib.import_module(module), func)(*self.entry.args, root=root, download=download)

    def present(self, root: Path) -> bool:
        """Whether every file of one of the entry's alternatives is on disk under ``root``."""
        root = Path(root)
        return any(all((root / f).is_file() for f in files) for files in self.entry.files)

    def available(self, root: Path | None = None) -> bool:
        if self.offline:
            return True
        return self.present(root or data_root())


_REGISTRY: dict[str, DatasetInfo] = {e.name: DatasetInfo(e) for e in CATALOG}


def dataset_names() -> list[str]:
    return list(_REGISTRY)


def dataset_info(name: str) -> DatasetInfo:
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
    return info.load(path, downloads_allowed())


def load_dataset(name: str, root: str = "") -> VerticalDataset:
    """Load (once per process) the dataset ``name``; downloadable ones fetch on first use."""
    return _load_cached(name, str(root or ""))
