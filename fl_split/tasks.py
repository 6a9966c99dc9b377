"""Learning tasks (issue 24): what the host's top model predicts, its loss and its metrics.

A run's task is one of

* ``multiclass`` — K ≥ 2 classes, softmax cross-entropy, metric accuracy;
* ``binary`` — 2 classes, the same two-logit softmax cross-entropy (so binary ≡ multiclass with
  K = 2 on the wire and in the models), metric accuracy **and** ROC AUC, F1, precision, recall
  (class 1 is the positive class) and the Kolmogorov–Smirnov statistic of the positive-class
  scores; optional class weights ``n / (K · n_k)`` from the host's training labels
  (``--class-weight balanced``, scikit-learn's "balanced");
* ``regression`` — one output, MSE loss on the label standardised with the host's training rows
  (the mean and standard deviation stay with the host), metrics in the label's own units: R²
  (the headline), MAE and RMSE;
* ``next-item`` — movielens' next item among the top N, hit@10.

``--task auto`` (:func:`resolve`): a dataset that declares regression or next-item keeps it; a
label with **2 classes is binary, more is multiclass**. For your own tables (:func:`looks_numeric_target`,
docs/results.md "Tasks and their metrics"): a numeric label column with at least one non-integer value
and more than :data:`REGRESSION_MIN_DISTINCT` distinct values is regression; an integer-valued one is
classes up to :data:`AUTO_MAX_CLASSES` distinct values, regression beyond that when its values hold
fewer than :data:`AUTO_MIN_ROWS_PER_CLASS` rows each on average (whole-dollar prices), and refused
otherwise with one line asking for ``--task multiclass`` or ``--task regression``.

Everything here runs at the host (the labels' owner): the metrics are its aggregates, declared in
its privacy report like the accuracy always was.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fl_split.errors import ConfigError, DataError

TASK_CHOICES = ("auto", "binary", "multiclass", "regression")
#: a dataset's declared task (``VerticalDataset.task``): ``classification`` means "classes, binary
#: or multiclass by their count"; a resolved task is one of the other four
KINDS = ("binary", "multiclass", "regression", "next-item")
#: own tables, ``--task auto``: a numeric label needs more distinct values than this to be read as a target
REGRESSION_MIN_DISTINCT = 10
#: own tables, ``--task auto``: an integer-valued numeric label with at most this many distinct values is classes
AUTO_MAX_CLASSES = 20
#: … and with more, a regression target when its values hold fewer rows than this each on average (too few
#: to learn each as a class); between the two the column is ambiguous and ``--task`` must say which
AUTO_MIN_ROWS_PER_CLASS = 5
HIT_AT = 10
#: the headline metric of each task (``final.metric``)
HEADLINE = {"binary": "accuracy", "multiclass": "accuracy", "regression": "r2", "next-item": "hit@10"}
#: every metric each task reports (``history`` rows: ``test_<name>``; ``final.metrics``)
METRICS = {"binary": ("accuracy", "auc", "f1", "precision", "recall", "ks"), "multiclass": ("accuracy",),
           "regression": ("r2", "mae", "rmse"), "next-item": ("hit@10",)}


def kind_of(task: str, num_classes: int) -> str:
    """A resolved task; the legacy ``classification`` (party files written before issue 24) is binary
    for 2 classes, otherwise multiclass."""
    if task in KINDS:
        return task
    if task == "classification":
        return "binary" if int(num_classes) == 2 else "multiclass"
    raise DataError(f"unknown task {task!r}; expected one of {KINDS}")


def looks_numeric_target(raw: Any, column: str = "label") -> bool:
    """``--task auto`` on an own table's label column ``column``: whether it is a regression target.

    Numeric with a non-integer value: a target when it has more than :data:`REGRESSION_MIN_DISTINCT`
    distinct values. Integer-valued: classes up to :data:`AUTO_MAX_CLASSES` distinct values; beyond,
    a target when the values hold fewer than :data:`AUTO_MIN_ROWS_PER_CLASS` rows each on average
    (prices in whole dollars: most values once or twice, no class could be learnt), else a
    :class:`ConfigError` naming the column and asking for ``--task multiclass`` or ``--task regression``.
    Text labels are always classes."""
    import pandas as pd

    num = pd.to_numeric(pd.Series(raw), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    if not np.isfinite(num).all():
        return False
    distinct = len(np.unique(num))
    if (num != np.round(num)).any():
        return distinct > REGRESSION_MIN_DISTINCT
    if distinct <= AUTO_MAX_CLASSES:
        return False
    per = len(num) / distinct
    if per < AUTO_MIN_ROWS_PER_CLASS:
        return True
    raise ConfigError("task", "auto", "multiclass (each value a class) or regression (a numeric target)",
                      reason=f"label column {column!r} holds {distinct} distinct whole numbers, {per:.0f} rows each on "
                      f"average: classes or a numeric target cannot be told apart; more than {AUTO_MAX_CLASSES} "
                      f"values with {AUTO_MIN_ROWS_PER_CLASS} or more rows each, see docs/results.md")


def resolve(requested: str, declared: str, num_classes: int, dataset: str) -> str:
    """The run's task from ``--task`` and the dataset's declared task (see the module docstring)."""
    if requested not in TASK_CHOICES:
        raise ConfigError("task", requested, "one of " + ", ".join(TASK_CHOICES))
    if declared == "next-item":
        if requested not in ("auto", "multiclass"):
            raise ConfigError("task", requested, "auto for dataset '" + dataset + "'",
                              reason="its task is next-item prediction (hit@10)")
        return "next-item"
    if declared == "regression":
        if requested not in ("auto", "regression"):
            raise ConfigError("task", requested, f"auto or regression for dataset '{dataset}'",
                              reason="its label is a numeric target, not classes")
        return "regression"
    if requested == "regression":
        raise ConfigError("task", requested, f"auto, binary or multiclass for dataset '{dataset}'",
                          reason=f"its label holds {num_classes} classes, not a numeric target")
    if requested == "binary" and int(num_classes) != 2:
        raise ConfigError("task", requested, f"auto or multiclass for dataset '{dataset}'",
                          reason=f"its label holds {num_classes} classes, binary needs 2")
    if requested == "auto":
        return "binary" if int(num_classes) == 2 else "multiclass"
    return requested


def num_outputs(task: str, num_classes: int) -> int:
    return 1 if task == "regression" else int(num_classes)


def balanced_weights(y_train: torch.Tensor, num_classes: int) -> torch.Tensor:
    """scikit-learn's ``balanced`` class weights ``n / (K · n_k)`` from the host's training labels
    (a class absent from them gets weight 0: it contributes no loss term anyway)."""
    counts = torch.bincount(y_train.long().cpu(), minlength=int(num_classes)).double()
    w = torch.where(counts > 0, counts.sum() / (int(num_classes) * counts.clamp(min=1)), torch.zeros_like(counts))
    return w.float()


class Objective:
    """The host's loss for its task (the monolithic reference uses the same object).

    ``class_weights`` (classification only) come from the host's own training labels and never
    leave it. Regression outputs are ``(n, 1)``; the target is the host's standardised label."""

    def __init__(self, task: str, class_weights: torch.Tensor | None = None) -> None:
        if task not in KINDS:
            raise ValueError(f"task must be one of {KINDS}, got {task!r}")
        if class_weights is not None and task not in ("binary", "multiclass"):
            raise ConfigError("class-weight", "balanced", "none for a " + task + " task",
                              reason="class weights weigh classes")
        self.task = task
        self.class_weights = class_weights

    def __call__(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.task == "regression":
            return F.mse_loss(out.reshape(-1), y.to(out.dtype), reduction=reduction)
        w = self.class_weights
        if w is not None and w.device != out.device:
            w = self.class_weights = w.to(out.device)
        if w is not None and reduction == "sum":
            # the weighted "sum" that matches the weighted mean's normaliser per batch is not a plain sum;
            # the evaluation reports the unweighted loss (comparable across weightings)
            return F.cross_entropy(out, y, reduction="sum")
        return F.cross_entropy(out, y, weight=w, reduction=reduction)


class Scorer:
    """Accumulates the test outputs of one evaluation and computes the task's metrics.

    ``target_scale = (mean, sd)`` turns standardised regression outputs back into the label's units."""

    def __init__(self, task: str, target_scale: tuple[float, float] | None = None) -> None:
        self.task = task
        self.scale = target_scale or (0.0, 1.0)
        self._out: list[np.ndarray] = []
        self._y: list[np.ndarray] = []

    def add(self, out: torch.Tensor, y: torch.Tensor) -> None:
        out = out.detach().float().cpu()
        if self.task == "binary":
            out = torch.softmax(out, dim=1)[:, 1:2]
        elif self.task == "multiclass":
            out = out.argmax(dim=1, keepdim=True).float()
        elif self.task == "next-item":
            k = min(HIT_AT, out.shape[1])
            out = (out.topk(k, dim=1).indices == y.cpu()[:, None]).any(dim=1, keepdim=True).float()
        self._out.append(out.numpy().reshape(len(out), -1))
        self._y.append(y.detach().cpu().numpy())

    def metrics(self) -> dict[str, float]:
        if not self._out:
            return {m: math.nan for m in METRICS[self.task]}
        out = np.concatenate(self._out)[:, 0].astype(np.float64)
        y = np.concatenate(self._y)
        return task_metrics(self.task, out, y, self.scale)


def task_metrics(task: str, out: np.ndarray, y: np.ndarray, scale: tuple[float, float] = (0.0, 1.0)) -> dict[str, float]:
    """The task's metrics of ``out`` (binary: P(class 1); multiclass: the predicted class;
    regression: the standardised prediction; next-item: 1 per hit) against the labels ``y``."""
    if task == "next-item":
        return {"hit@10": float(out.mean())}
    if task == "multiclass":
        return {"accuracy": float((out == y).mean())}
    if task == "regression":
        mean, sd = scale
        pred, true = out * sd + mean, y.astype(np.float64) * sd + mean
        err = pred - true
        ss_tot = float(((true - true.mean()) ** 2).sum())
        r2 = 1.0 - float((err ** 2).sum()) / ss_tot if ss_tot > 0 else math.nan
        return {"r2": r2, "mae": float(np.abs(err).mean()), "rmse": float(np.sqrt((err ** 2).mean()))}
    return binary_metrics(out, y)


def binary_metrics(p1: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy, precision, recall, F1 at threshold ½ (= the argmax of two logits), ROC AUC (ties
    counted ½: the Mann–Whitney statistic) and KS = max |TPR − FPR| over thresholds."""
    y = np.asarray(y).astype(np.int64)
    pred = (p1 > 0.5).astype(np.int64)  # argmax of 2 softmax outputs; an exact tie goes to class 0, as argmax does
    tp = int(((pred == 1) & (y == 1)).sum())
    fp = int(((pred == 1) & (y == 0)).sum())
    fn = int(((pred == 0) & (y == 1)).sum())
    precision = tp / (tp + fp) if tp + fp else math.nan
    recall = tp / (tp + fn) if tp + fn else math.nan
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    auc = ks = math.nan
    if n_pos and n_neg:
        from scipy.stats import rankdata

        ranks = rankdata(p1)  # average ranks: ties count one half
        auc = float((ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
        order = np.argsort(-p1, kind="stable")
        s, yy = p1[order], y[order]
        last = np.r_[s[1:] != s[:-1], True]  # evaluate only after a whole group of tied scores
        tpr = np.cumsum(yy == 1)[last] / n_pos
        fpr = np.cumsum(yy == 0)[last] / n_neg
        ks = float(np.max(np.abs(tpr - fpr)))
    return {"accuracy": float((pred == y).mean()), "auc": auc, "f1": f1, "precision": precision,
            "recall": recall, "ks": ks}


def epoch_metrics(task: str, metrics: dict[str, float]) -> dict[str, float]:
    """An evaluation's metrics as ``history`` keys: the headline as ``test_metric`` (what every engine,
    the results and the run directory read), the others as ``test_<name>``."""
    head = HEADLINE[task]
    return {"test_metric": metrics[head], **{f"test_{m}": v for m, v in metrics.items() if m != head}}
