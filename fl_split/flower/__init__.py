"""fl_split on Flower: the transport, the per-node party host and the simulation engine.

* :mod:`fl_split.flower.records` — what goes into Flower records (requests, replies, errors, state);
* :mod:`fl_split.flower.transport` — :class:`FlowerTransport` (the coordinator's side) and
  federation discovery / validation;
* :mod:`fl_split.flower.node` — one node hosting one party (the ClientApp's work);
* :mod:`fl_split.flower.engine` — :class:`FlowerEngine`, a Flower simulation in this process.

The Flower apps themselves are thin: ``strategies/server_app.py`` and ``clients/client_app.py``.
"""

from fl_split.flower.engine import FlowerEngine
from fl_split.flower.records import FederationError
from fl_split.flower.transport import FlowerTransport, validate_federation

__all__ = ["FederationError", "FlowerEngine", "FlowerTransport", "validate_federation"]
