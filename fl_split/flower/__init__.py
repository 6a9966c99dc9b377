"""fl_split on Flower: the coordinator strategy, the per-node party host, the transports and the
simulation engine.

* :mod:`fl_split.flower.records` — what goes into Flower records (requests, replies, errors, state);
* :mod:`fl_split.flower.transport` — federation discovery / validation and :class:`FlowerTransport`
  (relay: every tensor in a Flower message);
* :mod:`fl_split.flower.direct` — the direct data plane under Flower (one control message per
  party per epoch; the tensors go over :mod:`fl_split.dataplane`);
* :mod:`fl_split.flower.node` — one node hosting one party (the ClientApp's work);
* :mod:`fl_split.flower.strategy` — :class:`VerticalSplitStrategy` and the ServerApps;
* :mod:`fl_split.flower.resources` — can a simulation run every ClientApp at once;
* :mod:`fl_split.flower.prepared` — each simulated party's data slice, prepared once by the driver;
* :mod:`fl_split.flower.engine` — :class:`FlowerEngine`, a Flower simulation in this process.

The Flower apps themselves are thin shells: ``strategies/server_app.py`` and
``clients/client_app.py``. Importing this package is light: a ClientApp loads only what it uses,
and the simulation driver (:class:`FlowerEngine`) is imported on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FederationError", "FlowerEngine", "FlowerTransport", "VerticalSplitStrategy", "validate_federation"]

_LAZY = {
    "FederationError": "fl_split.flower.records",
    "FlowerTransport": "fl_split.flower.transport",
    "validate_federation": "fl_split.flower.transport",
    "VerticalSplitStrategy": "fl_split.flower.strategy",
    "FlowerEngine": "fl_split.flower.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fl_split.flower' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
