"""Image grids of private inputs and their reconstructions (PNG, matplotlib only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fl_split.errors import ConfigError


def check_grid_path(path: str) -> None:
    """Refuse a ``--grid`` path that cannot be written (before any training)."""
    if not path:
        return
    p = Path(path).expanduser()
    if p.suffix.lower() != ".png":
        raise ConfigError("grid", path, "a file path ending in .png")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise ConfigError("grid", path, "a .png path in an existing directory", reason=f"{parent} does not exist")


def grid_array(rows: list[torch.Tensor], scale: int | None = None, gap: int = 1) -> np.ndarray:
    """Tile ``rows`` (each ``(n, C, H, W)`` in [0, 1], same shape) into one ``(H', W', 3)`` array:
    one row of images per tensor, separated by ``gap`` white pixels, each pixel repeated ``scale``
    times (default: enough for images at least 48 pixels high)."""
    first = rows[0]
    n, c, h, w = first.shape
    scale = scale or max(1, int(np.ceil(48 / h)))
    hh, ww = h * scale, w * scale
    out = np.ones((len(rows) * (hh + gap) - gap, n * (ww + gap) - gap, 3), dtype=np.float32)
    for r, t in enumerate(rows):
        arr = t.detach().float().clamp(0, 1).cpu().numpy()
        for i in range(n):
            img = arr[i]
            img = np.repeat(img, 3, axis=0) if c == 1 else img[:3]
            img = img.transpose(1, 2, 0).repeat(scale, axis=0).repeat(scale, axis=1)
            y, x = r * (hh + gap), i * (ww + gap)
            out[y: y + hh, x: x + ww] = img
    return out


def write_grid(path: str, truth: torch.Tensor, recon: torch.Tensor, n: int = 16) -> str:
    """Write a PNG: private inputs on the top row, reconstructions below (the first ``n``)."""
    import matplotlib.image as mpimg

    if truth.dim() != 4:
        raise ValueError(f"image grids need (n, C, H, W) images, got {tuple(truth.shape)}")
    k = min(n, len(truth))
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    mpimg.imsave(str(p), grid_array([truth[:k], recon[:k]]))
    return str(p)
