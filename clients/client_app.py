"""The fl_split ClientApp: one app for every party — a thin shell over :mod:`fl_split.flower.node`.

Which party a node hosts comes from its ``node_config`` (deployment: ``role``, ``guest-index``,
``data-path``, the ``dataplane-*`` keys and optionally the node's own ``private-seed-file``; simulation:
``partition-id`` 0 = host, 1..G = guests); :func:`fl_split.flower.node.handle` answers every
message type:

=================  =========================================================================
``query.role``     which party this node hosts
``query.setup``    build the party (with a secret of its own) from the run configuration
``train.epoch``    direct data plane: host plays, guests serve the epochs of the message
``train.step``     relay: a guest applies the gradients it is owed, releases the round's batches
``train.host``     relay: the host trains on the released activations
``evaluate.host``  relay: the host evaluates the test split, returns the epoch's aggregate metrics
``query.report``   the party's end-of-run report (no data, no weights, no secret)
``query.align``    deployment with its own table: one step of the ID alignment
``query.predict``  the prediction job: one step (its own saved part, its own new table)
=================  =========================================================================
"""

from __future__ import annotations

from fl_split.flower.node import make_client_app

app = make_client_app()
