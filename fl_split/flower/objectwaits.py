"""Shorter first waits where Flower pulls a message's objects (the warm party, issue 25).

A leaf module (imports nothing of fl_split): the SuperNode's loop (:mod:`fl_split.flower.warm`), the
party runtime and the ServerApp's deployment transport (:mod:`fl_split.flower.transport`) all use it.
This replaces a private default of flwr 1.41 (``pull_objects``' 1 s first wait): checked by
``tests/test_warm.py``.
"""

from __future__ import annotations

import sys
import types

#: first wait (s) when a message's objects are not in the SuperNode's store yet: the SuperNode
#: creates the task before it has pulled the message's objects from the SuperLink, and Flower's
#: default first wait is 1 s (``PULL_INITIAL_BACKOFF``), doubling — a second on every message
PULL_BACKOFF = 0.02


def short_object_waits(grid) -> None:
    """:data:`PULL_BACKOFF` where Flower pulls a message's objects from the SuperLink: the SuperLink
    lists a message before its sender has pushed all its objects, and ``pull_objects`` then waits
    1 s, doubling. ``grid``: the ServerApp's deployment grid (flwr 1.41 ``HttpGrid.pull_messages``,
    the replies) or a module (the SuperNode's loop, :func:`supernode`); its module's ``pull_objects``
    gets a 0.02 s first wait (0.5 s cap). The simulation's in-memory grid has no such wait and is
    left as it is."""
    import functools

    module = grid if isinstance(grid, types.ModuleType) else sys.modules.get(type(grid).__module__)
    pull = getattr(module, "pull_objects", None)
    if pull is None or getattr(pull, "_fl_split_short", False):
        return
    short = functools.partial(pull, initial_backoff=PULL_BACKOFF, backoff_cap=0.5, max_tries_per_object=None)
    short._fl_split_short = True  # type: ignore[attr-defined]
    module.pull_objects = short  # type: ignore[union-attr]
