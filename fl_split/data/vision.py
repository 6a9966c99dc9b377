"""Downloadable image datasets via torchvision: ``mnist``, ``fashion-mnist``, ``cifar10``, ``cifar100``.

Each loader reads the official training and test sets with torchvision
(``torchvision.datasets.MNIST(root, train=..., download=...)`` etc.) from the data root
(``--data-root`` / ``$FL_SPLIT_DATA`` / ``~/.cache/fl_split``) and merges them into one
:class:`~fl_split.data.base.VerticalDataset`: training images get IDs ``0 … n_train-1``, test
images ``n_train … n_train+n_test-1``, and ``fixed_split`` returns the **official train/test
split** (so ``--test-fraction`` does not apply; ``--limit`` subsamples both parts in proportion).
Images are float32 in ``[0, 1]`` (uint8 / 255), shape ``(N, C, H, W)``; the atomic columns are
the pixel columns, split into vertical stripes (001 splits MNIST into two 28×14 halves).

On first use the files are downloaded by torchvision unless ``FL_SPLIT_NO_DOWNLOAD`` is set,
in which case a missing dataset is a :class:`~fl_split.errors.DataError` naming the dataset, the
folder looked in and how to get the files. ``present(root)`` checks the files torchvision
itself checks: MNIST-style sets need the four uncompressed idx files in ``<root>/<Class>/raw/``;
CIFAR sets need the python-pickle batches in ``<root>/cifar-10-batches-py/`` or
``<root>/cifar-100-python/`` (torchvision also verifies their MD5 when reading them; a corrupted
file is reported as a DataError).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fl_split.data.base import VerticalDataset
from fl_split.data.registry import NO_DOWNLOAD_ENV
from fl_split.errors import DataError

#: CIFAR-10 classes 2–7 (bird, cat, deer, dog, frog, horse) are animals; 0, 1, 8, 9 are vehicles
CIFAR10_ANIMALS = (2, 3, 4, 5, 6, 7)


@dataclass(frozen=True)
class VisionSpec:
    name: str
    #: attribute of ``torchvision.datasets``
    cls: str
    num_classes: int
    default_model: str
    description: str
    #: official split sizes, for the docs
    n_train: int
    n_test: int


SPECS = {
    "mnist": VisionSpec("mnist", "MNIST", 10, "cnn-mnist",
                        "MNIST handwritten digits (70,000 28x28 grey images, 10 classes), vertical stripes",
                        60000, 10000),
    "fashion-mnist": VisionSpec("fashion-mnist", "FashionMNIST", 10, "cnn-mnist",
                                "Fashion-MNIST (70,000 28x28 grey images, 10 classes), vertical stripes",
                                60000, 10000),
    "cifar10": VisionSpec("cifar10", "CIFAR10", 10, "resnet18-split",
                          "CIFAR-10 (60,000 32x32 colour images, 10 classes), vertical stripes", 50000, 10000),
    "cifar100": VisionSpec("cifar100", "CIFAR100", 100, "resnet18-split",
                           "CIFAR-100 (60,000 32x32 colour images, 100 fine classes), vertical stripes",
                           50000, 10000),
}


def _tv_class(spec: VisionSpec):
    import torchvision.datasets

    return getattr(torchvision.datasets, spec.cls)


def expected_files(spec: VisionSpec, root: Path) -> list[Path]:
    """The files torchvision needs under ``root`` (derived from torchvision's own lists)."""
    cls = _tv_class(spec)
    root = Path(root)
    if hasattr(cls, "resources"):  # MNIST family: <root>/<ClassName>/raw/<name without .gz>
        raw = root / cls.__name__ / "raw"
        return [raw / os.path.splitext(os.path.basename(url))[0] for url, _ in cls.resources]
    folder = root / cls.base_folder  # CIFAR family
    return [folder / f for f, _ in (*cls.train_list, *cls.test_list)] + [folder / cls.meta["filename"]]


def present(spec: VisionSpec, root: Path) -> bool:
    return all(p.is_file() for p in expected_files(spec, root))


def _images(ds) -> np.ndarray:
    """torchvision's ``data`` as uint8 ``(n, C, H, W)``: MNIST keeps (n, H, W) tensors, CIFAR
    (n, H, W, C) arrays."""
    data = ds.data
    data = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    if data.ndim == 3:
        return data[:, None, :, :]
    return data.transpose(0, 3, 1, 2)


def load_vision(name: str, root: Path, download: bool = False) -> VerticalDataset:
    """Official train + test sets of ``name`` merged, with the official split as ``fixed_split``."""
    spec = SPECS[name]
    root = Path(root)
    on_disk = present(spec, root)
    if not on_disk and not download:
        missing = [str(p) for p in expected_files(spec, root) if not p.is_file()]
        raise DataError(
            f"{name}: not found under {root} (missing {', '.join(missing[:3])}"
            f"{' …' if len(missing) > 3 else ''}) and downloads are disabled ({NO_DOWNLOAD_ENV} is set); "
            f"unset {NO_DOWNLOAD_ENV} to let torchvision download it there, or run "
            f"`python -c \"import torchvision; torchvision.datasets.{spec.cls}('{root}', download=True)\"`")
    cls = _tv_class(spec)
    try:
        if not on_disk:
            root.mkdir(parents=True, exist_ok=True)
        train = cls(str(root), train=True, download=not on_disk)
        test = cls(str(root), train=False, download=False)
    except (RuntimeError, OSError, ValueError) as exc:
        raise DataError(f"{name}: torchvision could not {'read' if on_disk else 'download'} it under {root}: {exc}"
                        ) from exc
    tr, te = _images(train), _images(test)
    n_tr, n_te = len(tr), len(te)
    images = np.empty((n_tr + n_te, *tr.shape[1:]), dtype=np.float32)
    images[:n_tr] = tr  # uint8 -> float32 in place, no float64 temporaries (CIFAR is 737 MB as float32)
    images[n_tr:] = te
    images *= np.float32(1 / 255)
    labels = np.concatenate([np.asarray(train.targets, dtype=np.int64), np.asarray(test.targets, dtype=np.int64)])
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise DataError(f"{name}: labels outside 0..{spec.num_classes - 1} in the files under {root}")

    def official_split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        return ids[ids < n_tr], ids[ids >= n_tr]

    half = images.shape[3] // 2
    # property targets (all owned by the party holding pixel column 0, as for `digits`)
    left_more = (images[..., :half].sum(axis=(1, 2, 3)) > images[..., half:].sum(axis=(1, 2, 3))).astype(np.int64)
    if spec.cls in ("MNIST", "FashionMNIST"):
        properties = {"ink-left": ("0", left_more)}
    else:
        properties = {"bright-left": ("0", left_more)}
        if spec.cls == "CIFAR10":
            properties["animal"] = ("0", np.isin(labels, CIFAR10_ANIMALS).astype(np.int64))
    return VerticalDataset(
        name=name, task="classification", ids=np.arange(n_tr + n_te), labels=labels,
        num_classes=spec.num_classes, images=images, fixed_split=official_split, properties=properties,
        metric="accuracy", description=spec.description,
    )
