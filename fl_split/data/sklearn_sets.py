"""Offline datasets shipped with scikit-learn: ``digits`` (images), ``breast-cancer`` (table) and
``diabetes`` (table, regression)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fl_split.data.base import VerticalDataset


def load_digits(root: Path | None = None, download: bool = False) -> VerticalDataset:
    """8×8 handwritten digits, 1,797 images, 10 classes; pixels scaled from 0..16 to [0, 1].

    Atomic columns are the 8 pixel columns; the default partition gives each feature-holding
    party a contiguous vertical stripe (as 001 splits MNIST into 28×14 halves). Property for
    inference attacks: ``ink-left`` — the left half holds more ink than the right half.
    """
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    images = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    ink_left = images[:, 0, :, :4].sum(axis=(1, 2)) > images[:, 0, :, 4:].sum(axis=(1, 2))
    return VerticalDataset(
        name="digits", task="classification", ids=np.arange(len(images)), labels=bunch.target,
        num_classes=10, images=images, metric="accuracy",
        properties={"ink-left": ("0", ink_left.astype(np.int64))},
        description="scikit-learn 8x8 digits (1,797 images, 10 classes), vertical pixel stripes",
    )


def load_breast_cancer(root: Path | None = None, download: bool = False) -> VerticalDataset:
    """Wisconsin breast cancer, 569 × 30 numeric features, binary (1 = benign).

    Columns keep scikit-learn's order: 10 ``mean …`` measurements, 10 ``… error``, 10
    ``worst …``; the default partition is contiguous near-equal blocks in that order.
    Property: ``large-radius`` — ``mean radius`` above its median.
    """
    from sklearn.datasets import load_breast_cancer as _load

    bunch = _load()
    table = pd.DataFrame(bunch.data, columns=list(bunch.feature_names))
    large = (table["mean radius"] > table["mean radius"].median()).to_numpy().astype(np.int64)
    return VerticalDataset(
        name="breast-cancer", task="classification", ids=np.arange(len(table)), labels=bunch.target,
        num_classes=2, table=table, metric="accuracy",
        properties={"large-radius": ("mean radius", large)},
        description="scikit-learn breast cancer (569 x 30, binary), column groups",
    )


def load_diabetes(root: Path | None = None, download: bool = False) -> VerticalDataset:
    """Diabetes (Efron et al. 2004), 442 patients × 10 baseline variables, regression: a quantitative
    measure of disease progression one year later (25–346).

    The raw (unscaled) features (``scaled=False``: age, sex, bmi, bp and six blood serum measurements
    s1–s6); each party standardises its own columns with its training rows. Sex is coded 1/2 and
    used as a number. The default partition is contiguous blocks in scikit-learn's column order
    (host: age, sex, bmi, bp …). Property: ``high-bmi`` — bmi above its median.
    """
    from sklearn.datasets import load_diabetes as _load

    bunch = _load(scaled=False)
    table = pd.DataFrame(bunch.data, columns=list(bunch.feature_names))
    high = (table["bmi"] > table["bmi"].median()).to_numpy().astype(np.int64)
    return VerticalDataset(
        name="diabetes", task="regression", ids=np.arange(len(table)), labels=bunch.target.astype(np.float64),
        num_classes=1, table=table, metric="r2", properties={"high-bmi": ("bmi", high)},
        description="scikit-learn diabetes (442 x 10, regression: disease progression), column groups",
    )
