"""Control messages sent ahead (``--epochs-ahead``, issue 25): in a deployment the coordinator pushes
the next epoch's ``train.epoch`` messages while the current epoch trains, so Flower's round trip
overlaps training. Each node here runs its messages one after another, as a SuperNode does (flwr
1.41 pulls a node's next message once its reply is pushed); the nodes are deployment nodes (role,
data-path, their own data-plane address) on loopback.

What must hold: the same results as one message at a time and as the local engine; a stop (budget)
with a message already delivered ends the run where the local engine ends it, and the delivered
message plays nothing (no release, no checkpoint); a guest the host went on without (pad) is not
waited for; a coordinator that dies with a message already delivered resumes to the same accounting;
a node that runs messages out of order or two at once refuses them."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from flwr.app import Message

from fl_split.checkpoint import load_coordinator, party_checkpoints
from fl_split.flower import direct
from fl_split.flower import node as node_mod
from fl_split.flower import records as R
from fl_split.flower.node import handle
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.party_files import export_parties
from fl_split.secure_files import write_private
from tests.test_flower import PS, InlineGrid, _cfg, _local, _strip

pytestmark = pytest.mark.usefixtures("flower_task_identity")


class SuperNodeGrid(InlineGrid):
    """:class:`InlineGrid` whose nodes each run their ``train.epoch`` messages one at a time, in the
    order pushed (a single worker per node, like a SuperNode); records how many of a node's
    ``train.epoch`` messages were pushed and not yet answered (``most_waiting``)."""

    def __init__(self, node_configs, app=None, **kw):
        super().__init__(node_configs, app=app, **kw)
        self._nodes = {n: concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"node-{n}")
                       for n in self.ids}
        self._lock = threading.Lock()
        self.waiting = {n: 0 for n in self.ids}
        self.most_waiting = {n: 0 for n in self.ids}
        self.epoch_replies: list[tuple[int, Message]] = []
        self.before_push = None

    def _answer_in_order(self, m):
        node = m.metadata.dst_node_id
        try:
            reply = self._answer(m)
            with self._lock:
                self.epoch_replies.append((node, reply))
            return reply
        finally:
            with self._lock:
                self.waiting[node] -= 1

    def push_messages(self, messages):  # noqa: D102
        messages = list(messages)
        if self.before_push is not None:
            self.before_push(messages)
        ids = []
        for m in messages:
            if m.metadata.message_type != R.MSG_EPOCH:
                ids += super().push_messages([m])
                continue
            m.metadata.__dict__["_message_id"] = f"epoch-{self.pushed}-{m.metadata.dst_node_id}"
            ids.append(m.metadata.message_id)
            self.pushed += 1
            self.types.append(m.metadata.message_type)
            node = m.metadata.dst_node_id
            with self._lock:
                self.waiting[node] += 1
                self.most_waiting[node] = max(self.most_waiting[node], self.waiting[node])
            self.replies[m.metadata.message_id] = self._nodes[node].submit(self._answer_in_order, m)
        return ids


def _deployment(tmp_path, cfg, checkpoints: bool = False) -> list[dict]:
    """Deployment node configs for ``cfg``'s parties: their own files and seed files, the host's data
    plane on a loopback port (plaintext, one machine), and with ``checkpoints`` each party's own
    checkpoint directory."""
    from tests.services import free_port

    files = export_parties(cfg, tmp_path / "files")
    address = f"127.0.0.1:{free_port()}"
    configs = []
    for p in ["host", *[f"guest-{i}" for i in range(1, cfg.guests + 1)]]:
        seed = write_private(tmp_path / f"{p}.seed", PS.for_party(p).file_text().encode())
        c = {"role": "host" if p == "host" else "guest", "data-path": str(files[p]), "private-seed-file": str(seed),
             "dataplane-insecure": True}
        if p == "host":
            c["dataplane-address"] = address
        else:
            c["guest-index"] = int(p.split("-")[1])
        if checkpoints:
            c["checkpoint-dir"] = str(tmp_path / "parties" / p)
        configs.append(c)
    return configs


def _party_of(grid, node: int) -> str:
    c = grid.contexts[node].node_config
    return "host" if c["role"] == "host" else f"guest-{c['guest-index']}"


def test_sent_ahead_equals_one_at_a_time_and_the_local_engine(tmp_path):
    cfg = _cfg(epochs=3, defense="gaussian", protect="both")
    configs = _deployment(tmp_path, cfg)
    runs = {}
    for ahead in (1, 0):
        grid = SuperNodeGrid(configs, fresh_process=True)
        runs[ahead] = (VerticalSplitStrategy(cfg.replace(epochs_ahead=ahead)).run(grid), grid)
    want = _strip(_local(cfg))
    for ahead, (got, grid) in runs.items():
        assert _strip(got) == {**want, "config": {**want["config"], "epochs_ahead": ahead}}
        assert grid.types.count(R.MSG_EPOCH) == 3 * cfg.epochs
        # with 1 ahead every node had the next epoch's message waiting while it trained
        assert set(grid.most_waiting.values()) == {1 + ahead}


def test_a_simulation_never_sends_ahead():
    from tests.test_flower import _simulation_nodes

    cfg = _cfg(epochs=3)
    grid = SuperNodeGrid(_simulation_nodes(3))
    VerticalSplitStrategy(cfg).run(grid)
    assert set(grid.most_waiting.values()) == {1}


def test_a_budget_stop_with_the_next_epoch_delivered(tmp_path):
    """guest-1's ledger stops the run at the first round of epoch 2; epoch 3's messages were already
    delivered (sent once epoch 1 was committed). The run ends as the local engine's does, the host
    answers the delivered message ``skipped`` after ending its session at once (each guest's reply
    says so), and no party checkpoints a round it did not train."""
    cfg = _cfg(epochs=3, defense="laplace", epsilon=1.0, budget=1.5, accountant="basic", batches_per_round=4)
    plan = _local_plan(cfg)
    want = _local(cfg)
    assert want["stopped_reason"] == "budget" and want["stopped_round"] == direct.last_round(plan, cfg, 1) + 1
    configs = _deployment(tmp_path, cfg, checkpoints=True)
    grid = SuperNodeGrid(configs, fresh_process=True)
    got = VerticalSplitStrategy(cfg.replace(checkpoint_dir=str(tmp_path / "coord"))).run(grid)
    assert got["stopped_reason"] == "budget" and got["stopped_detail"] == want["stopped_detail"]
    assert got["privacy"] == want["privacy"] and got["history"][0]["test_metric"] == want["history"][0]["test_metric"]
    assert len(got["history"]) == 1 and set(grid.most_waiting.values()) == {2}
    replies = {}
    for node, reply in grid.epoch_replies:
        rec = R.reply_of(reply.content)
        replies.setdefault(_party_of(grid, node), []).append(R.loads(str(rec["outcome"] if "outcome" in rec
                                                                          else rec["served"])))
    assert replies["host"][1]["stopped"]["stopped_reason"] == "budget"
    assert replies["host"][2]["skipped"] is True and replies["host"][2]["history"] == []
    for g in ("guest-1", "guest-2"):
        assert replies[g][2] == {"steps": 0, "errors": 0, "end": direct.AFTER_STOP}
    assert len(grid.epoch_replies) == 9
    # each party's two newest checkpoints: epochs 1 and 2 (saved as their messages ended), none of epoch 3
    for p in ("host", "guest-1", "guest-2"):
        assert party_checkpoints(tmp_path / "parties" / p, p) == [direct.last_round(plan, cfg, e) for e in (1, 2)]
    coordinator = load_coordinator(tmp_path / "coord")
    assert coordinator.finished["reason"] == "budget" and coordinator.round == direct.last_round(plan, cfg, 1)


def _local_plan(cfg):
    from fl_split.builder import plan_run

    return plan_run(cfg.replace(engine="local", checkpoint_dir=""))


def test_a_padded_guest_is_not_waited_for_with_its_next_message_delivered(tmp_path):
    """guest-2's process dies in epoch 1 (its connection drops); the host goes on without it
    (``--on-guest-failure pad``). Its epoch-2 message was already delivered: the coordinator does not
    wait for that reply, and the run equals the one-at-a-time run with the same failure."""

    class Died(BaseException):
        pass

    def app(message, context):
        c = context.node_config
        if c.get("guest-index") == 2 and message.metadata.message_type == R.MSG_EPOCH:
            first = int(R.request_of(message.content)["first-epoch"])
            if first == 1:
                party = node_mod._restore(context, node_mod.node_role(dict(c)))[0]
                real = party.step

                def step(owed, keys, round_):
                    if round_ >= 3:
                        raise Died()
                    return real(owed, keys, round_)

                party.step = step
                try:
                    return handle(message, context, PS)
                except Died:
                    return Message(R.error_record(ConnectionError("guest-2's process died"), "guest-2", 3),
                                   reply_to=message)
            return Message(R.error_record(ConnectionError("guest-2 is gone"), "guest-2", None), reply_to=message)
        return handle(message, context, PS)

    cfg = _cfg(epochs=3, on_guest_failure="pad", dataplane_timeout=20.0)
    configs = _deployment(tmp_path, cfg)
    runs = {}
    for ahead in (1, 0):
        grid = SuperNodeGrid(configs, app=app)
        runs[ahead] = VerticalSplitStrategy(cfg.replace(epochs_ahead=ahead)).run(grid)
        node_mod._PARTIES.clear()
    a, b = runs[1], runs[0]
    assert [(f["guest"], f["action"]) for f in a["guest_failures"]] == [("guest-2", "pad")]
    assert a["stopped_reason"] == "completed" and len(a["history"]) == 3
    assert _strip(a) == {**_strip(b), "config": {**_strip(b)["config"], "epochs_ahead": 1}}


def test_a_coordinator_that_dies_with_the_next_epoch_delivered_resumes(tmp_path):
    """Epoch 1 committed, epoch 2's messages delivered and played to their end (every party saved
    epoch 2's checkpoint), then the coordinator dies before it committed epoch 2. The resume restores
    the committed epoch 1 — which the parties kept beside epoch 2's — replays epoch 2's logged
    releases and ends with the accounting of the uninterrupted run."""
    from tests.test_checkpoint import _resumed_like

    class Crash(Exception):
        pass

    cfg = _cfg(epochs=3, defense="gaussian", protect="both", checkpoint_dir=str(tmp_path / "coord"))
    configs = _deployment(tmp_path, cfg, checkpoints=True)
    grid = SuperNodeGrid(configs, fresh_process=True)

    def crash_before_epoch_3(messages):
        if any(m.metadata.message_type == R.MSG_EPOCH and int(R.request_of(m.content)["first-epoch"]) == 3
               for m in messages):
            for f in list(grid.replies.values()):
                f.result(120)  # epoch 2 ran to its end on every node
            raise Crash()

    grid.before_push = crash_before_epoch_3
    with pytest.raises(Crash):
        VerticalSplitStrategy(cfg).run(grid)
    plan = _local_plan(cfg)
    e1, e2 = direct.last_round(plan, cfg, 1), direct.last_round(plan, cfg, 2)
    assert load_coordinator(tmp_path / "coord").round == e1
    for p in ("host", "guest-1", "guest-2"):
        assert party_checkpoints(tmp_path / "parties" / p, p) == [e1, e2]
    node_mod._PARTIES.clear()
    resumed = VerticalSplitStrategy(cfg.replace(resume=True)).run(SuperNodeGrid(configs, fresh_process=True))
    assert resumed["checkpoint"]["resumed_from_round"] == e1
    _resumed_like(resumed, _local(cfg.replace(checkpoint_dir="")))


def test_a_node_refuses_epochs_out_of_order_or_two_at_once():
    from flwr.app import RecordDict

    from fl_split.errors import ProtocolError

    def req(first, last):
        return R.request_of(R.content(**{"first-epoch": first, "last-epoch": last, "session": "ab" * 8,
                                          "dataplane": R.dumps({"address": "", "keys": {}})}))

    state = RecordDict()
    assert direct.check_epoch_order(state, "guest-1", req(1, 2)) == 2
    with pytest.raises(ProtocolError, match=r"^guest-1: train.epoch for epochs 3-3 arrived while epochs up to 2 are "
                                            r"still running on this node \(two messages at once\)$"):
        direct.check_epoch_order(state, "guest-1", req(3, 3))
    direct.epoch_ended(state)
    with pytest.raises(ProtocolError, match=r"arrived after epoch 2; the next message must start at epoch 3"):
        direct.check_epoch_order(state, "guest-1", req(4, 4))
    assert direct.check_epoch_order(state, "guest-1", req(3, 3)) == 3
