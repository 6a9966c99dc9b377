"""Deterministic seeds derived from (run seed, party, round, batch, purpose).

Every random draw in fl_split (shuffling, initialisation, mechanism noise, masks) uses a
generator seeded by :func:`derive_seed`, never the global RNG state, so the same
configuration and seed give the same numbers on any transport (DESIGN principle 3).
Python's ``hash()`` is salted per process, so seeds are derived with SHA-256 instead.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed that depends only on ``seed`` and the string forms of ``parts``."""
    text = "\x1f".join([str(int(seed)), *(str(p) for p in parts)])
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def torch_generator(seed: int, *parts: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded by ``derive_seed(seed, *parts)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, *parts))
    return gen


def numpy_rng(seed: int, *parts: object) -> np.random.Generator:
    """A fresh NumPy generator seeded by ``derive_seed(seed, *parts)``."""
    return np.random.default_rng(derive_seed(seed, *parts))


@contextlib.contextmanager
def seeded_torch(seed: int, *parts: object) -> Iterator[None]:
    """Run a block (e.g. module construction) under a derived global torch seed.

    ``nn.Module`` initialisers draw from the global generator; this forks the RNG state so the
    caller's state is untouched and the block is reproducible on its own.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, *parts))
        yield
