"""The fl_split ClientApp: one app for every party.

Which party a node hosts comes from its ``node_config`` (deployment: ``role``, ``guest-index``,
``data-path`` and optionally the node's own ``private-seed``; simulation: ``partition-id`` 0 =
host, 1..G = guests); see :mod:`fl_split.flower.node`, whose :func:`~fl_split.flower.node.handle`
answers every message type:

=================  =========================================================================
``query.role``     which party this node hosts
``query.setup``    build the party (with a secret of its own) from the run configuration
``train.step``     guest: apply the gradients it is owed, release the round's batches
``train.host``     host: train on the released activations, release the partial losses
``evaluate.host``  host: evaluate the test split, return the epoch's aggregate metrics
``query.report``   the party's end-of-run report (no data, no weights, no secret)
=================  =========================================================================
"""

from __future__ import annotations

from fl_split.flower.node import make_client_app

app = make_client_app()
