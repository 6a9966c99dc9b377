"""The fl_split ClientApp: one app for every party.

Which party a node hosts comes from its ``node_config`` (deployment: ``role``, ``guest-index``,
``data-path``; simulation: ``partition-id`` 0 = host, 1..G = guests); see
:mod:`fl_split.flower.node`, which does the work. Message types:

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

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fl_split.flower.node import handle

app = ClientApp()


@app.query("role")
def role(message: Message, context: Context) -> Message:
    return handle(message, context)


@app.query("setup")
def setup(message: Message, context: Context) -> Message:
    return handle(message, context)


@app.query("report")
def report(message: Message, context: Context) -> Message:
    return handle(message, context)


@app.train("step")
def step(message: Message, context: Context) -> Message:
    return handle(message, context)


@app.train("host")
def host_train(message: Message, context: Context) -> Message:
    return handle(message, context)


@app.evaluate("host")
def host_evaluate(message: Message, context: Context) -> Message:
    return handle(message, context)
