"""The fl_split ClientApp: one app for every party.

Which party a node hosts comes from its ``node_config`` (deployment: ``role``, ``guest-index``,
``data-path``; simulation: ``partition-id`` 0 = host, 1..G = guests); see
:mod:`fl_split.flower.node`, whose :func:`~fl_split.flower.node.handle` answers every message type:

=================  =========================================================================
``query.role``     which party this node hosts
``query.setup``    build the party from the run configuration sent by the coordinator
``train.step``     guest: apply the gradients it is owed, release the round's batches
``train.host``     host: train on the released activations, release the partial losses
``evaluate.host``  host: evaluate the test split
``query.report``   the party's end-of-run report (no data, no weights)
=================  =========================================================================
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from fl_split.flower import records as R
from fl_split.flower.node import handle

app = ClientApp()

# register the one handler under each "<category>.<action>" message type the coordinator sends
for _mtype in (R.MSG_ROLE, R.MSG_SETUP, R.MSG_REPORT, R.MSG_STEP, R.MSG_HOST_TRAIN, R.MSG_HOST_EVAL):
    _category, _action = _mtype.split(".")
    getattr(app, _category)(_action)(handle)
