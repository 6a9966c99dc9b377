"""Metrics of attack success (spec §7): MSE, SSIM, PSNR, AUC, F1, accuracy.

SSIM is Wang, Bovik, Sheikh & Simoncelli (2004), "Image quality assessment: from error visibility
to structural similarity", Eq. 13 with the paper's defaults: an ``11×11`` circular-symmetric
Gaussian window of standard deviation ``1.5`` (normalised to sum 1), ``K1 = 0.01``, ``K2 = 0.03``,
dynamic range ``L = 1`` (images in ``[0, 1]``), local statistics weighted by the window (no
``N − 1`` correction) and computed at every position where the window fits inside the image
(MATLAB ``filter2(…, 'valid')`` as in the authors' ``ssim_index.m``); the index of an image is
the mean of its SSIM map, averaged over channels.

**Small images.** Vertical stripes of the 8×8 ``digits`` are 8 pixels high and 2–4 wide, smaller
than the 11-pixel window. The window then shrinks to the largest odd size that fits
(``min(11, H, W)``, made odd), keeping σ = 1.5; a 1-pixel-wide stripe gets a 1×1 window, where SSIM
reduces to the per-pixel luminance term. :func:`ssim_window_size` reports the size used, and the
attack results record it.

PSNR is ``10·log10(L² / MSE)`` per image (``L = 1``), averaged over images, with the MSE floored at
``1e-10`` (so identical images give 100 dB instead of infinity, which JSON cannot hold portably).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

K1, K2 = 0.01, 0.03
WINDOW, SIGMA = 11, 1.5
MSE_FLOOR = 1e-10


def _as_images(x: torch.Tensor) -> torch.Tensor:
    """``(N, C, H, W)`` float64 from ``(H, W)``, ``(N, H, W)`` or ``(N, C, H, W)``."""
    x = torch.as_tensor(x).detach().to(torch.float64)
    if x.dim() == 2:
        x = x[None, None]
    elif x.dim() == 3:
        x = x[:, None]
    if x.dim() != 4:
        raise ValueError(f"SSIM/PSNR need images of shape (H, W), (N, H, W) or (N, C, H, W), got {tuple(x.shape)}")
    return x


def ssim_window_size(height: int, width: int, window: int = WINDOW) -> int:
    """The Gaussian window side used for an ``height × width`` image: ``window`` if it fits, else
    the largest odd size that does."""
    w = min(int(window), int(height), int(width))
    return max(1, w if w % 2 == 1 else w - 1)


def gaussian_window(size: int, sigma: float = SIGMA) -> torch.Tensor:
    """The ``size × size`` Gaussian window of Wang et al. (2004), normalised to sum 1 (float64)."""
    r = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(r ** 2) / (2 * sigma ** 2))
    w = g[:, None] * g[None, :]
    return w / w.sum()


def ssim_map(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0, window: int = WINDOW,
             sigma: float = SIGMA) -> torch.Tensor:
    """The SSIM map of each image pair, ``(N, C, H − w + 1, W − w + 1)`` (Wang et al. 2004, Eq. 13)."""
    x, y = _as_images(x), _as_images(y)
    if x.shape != y.shape:
        raise ValueError(f"SSIM needs images of equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    n, c, h, w = x.shape
    size = ssim_window_size(h, w, window)
    win = gaussian_window(size, sigma).to(x.device)[None, None].expand(c, 1, size, size).contiguous()

    def filt(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, win, groups=c)

    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    mu_x, mu_y = filt(x), filt(y)
    sxx = filt(x * x) - mu_x ** 2
    syy = filt(y * y) - mu_y ** 2
    sxy = filt(x * y) - mu_x * mu_y
    return ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))


def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0, window: int = WINDOW, sigma: float = SIGMA,
         reduction: str = "mean") -> torch.Tensor | float:
    """SSIM of ``x`` against ``y`` (images in ``[0, data_range]``); ``reduction="none"`` gives one
    value per image, ``"mean"`` their mean as a float."""
    per_image = ssim_map(x, y, data_range, window, sigma).mean(dim=(1, 2, 3))
    return per_image if reduction == "none" else float(per_image.mean())


def psnr(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0, reduction: str = "mean") -> torch.Tensor | float:
    """Peak signal-to-noise ratio in dB per image, ``10·log10(L²/MSE)`` (MSE floored at 1e-10)."""
    x, y = _as_images(x), _as_images(y)
    mse_i = ((x - y) ** 2).mean(dim=(1, 2, 3)).clamp_min(MSE_FLOOR)
    per_image = 10 * torch.log10(data_range ** 2 / mse_i)
    return per_image if reduction == "none" else float(per_image.mean())


def mse(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error over every element."""
    x = torch.as_tensor(x).detach().to(torch.float64)
    y = torch.as_tensor(y).detach().to(torch.float64).to(x.device)
    return float(((x - y) ** 2).mean())


def per_feature_mse(x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """MSE of each feature (last axis flattened per record), averaged over records."""
    x = torch.as_tensor(x).detach().to(torch.float64).reshape(len(x), -1)
    y = torch.as_tensor(y).detach().to(torch.float64).to(x.device).reshape(len(y), -1)
    return ((x - y) ** 2).mean(dim=0).cpu().numpy()


def accuracy(pred: np.ndarray, truth: np.ndarray) -> float:
    pred, truth = np.asarray(pred), np.asarray(truth)
    return float((pred == truth).mean()) if len(truth) else math.nan


def majority_rate(train_labels: np.ndarray, test_labels: np.ndarray) -> float:
    """Accuracy on ``test_labels`` of always predicting the most frequent of ``train_labels``
    (ties: the smallest label) — the trivial baseline of a classification attack."""
    train_labels = np.asarray(train_labels)
    if not len(train_labels):
        return math.nan
    values, counts = np.unique(train_labels, return_counts=True)
    return accuracy(np.full(len(test_labels), values[np.argmax(counts)]), test_labels)


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for the binary truth ``positive`` (NaN if one class
    is absent)."""
    from sklearn.metrics import roc_auc_score

    positive = np.asarray(positive).astype(bool)
    if positive.all() or not positive.any():
        return math.nan
    return float(roc_auc_score(positive, np.asarray(scores, dtype=np.float64)))


def f1(pred: np.ndarray, truth: np.ndarray) -> float:
    """F1 score of binary predictions (positive = 1)."""
    from sklearn.metrics import f1_score

    return float(f1_score(np.asarray(truth).astype(int), np.asarray(pred).astype(int), zero_division=0))


def always_positive_f1(rate: float) -> float:
    """F1 of predicting every candidate positive when a fraction ``rate`` is: precision ``rate``,
    recall 1, so ``2·rate/(1 + rate)`` (the membership-inference baseline)."""
    return 2 * rate / (1 + rate) if rate > 0 else 0.0


__all__ = ["accuracy", "always_positive_f1", "auc", "f1", "gaussian_window", "majority_rate", "mse",
           "per_feature_mse", "psnr", "ssim", "ssim_map", "ssim_window_size"]
