"""The Flower app: strategy, ClientApp, FlowerEngine, federation checks, failures, Ray clusters.

Two kinds of tests:

* **inline** — the real ServerApp strategy and the real ClientApp handler, with the nodes in this
  process (:class:`InlineGrid`): every message and reply goes through Flower's protobuf
  serialisation, and with ``fresh_process=True`` every message finds only ``context.state``
  (as a deployment ClientApp process does). Fast; covers deployment node configs and failures.
* **simulation** (``slow``) — Flower's simulation runtime on Ray, as ``fl-split train --engine
  flower`` runs it, including a loopback Ray cluster of two nodes started and stopped here.

Both data planes are covered: ``direct`` (the default: one ``train.epoch`` control message per
party per epoch, tensors over gRPC streams between the parties — the inline grid runs those
messages concurrently, as a simulation or deployment does) and ``flower`` (relay). Every
equivalence pins ``device="cpu"`` (tests are device-independent; ``--device auto`` resolves to the
GPU on a GPU machine) and ``--private-seed``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto, recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

from fl_split.config import RunConfig, key_of, option_fields
from fl_split.engine import LocalEngine
from fl_split.errors import BudgetExceeded, ConfigError, PartyError
from fl_split.flower import FederationError, FlowerEngine, validate_federation
from fl_split.flower import node as node_mod
from fl_split.flower import records as R
from fl_split.flower.node import handle, node_role
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.party_files import export_parties
from fl_split.seeding import PrivateSeed

ROOT = Path(__file__).resolve().parents[1]
#: every equivalence below runs both sides with this private seed (the parties' secrets derive from it)
PS_HEX = "5eed0c4f9a2e7b13d86f1a0b3c5e7d92"  # a 128-bit private seed (the CLI takes it as --private-seed HEX)
PS = PrivateSeed.parse(PS_HEX)


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=2, epochs=2, limit=300, batch_size=32, seed=1, progress=False, device="cpu")
    base.update(kw)
    return RunConfig(**base)


def _sim_cpus(parties: int) -> float:
    """``--num-cpus`` with which ``parties`` ClientApps fit at once on this machine's Ray."""
    from fl_split.flower.resources import local_cpus

    return max(0.01, int(100 * min(1.0, local_cpus() / parties)) / 100)


# ------------------------------------------------------------------------------------------------
# an in-process Grid


@pytest.fixture(scope="module")
def tls_material(tmp_path_factory):
    """A CA, a host certificate for 127.0.0.1 signed by it, a guest client certificate."""
    from tests.tlsutil import make_certificates

    return make_certificates(tmp_path_factory.mktemp("tls"))


pytestmark = pytest.mark.usefixtures("flower_task_identity")


class InlineGrid(Grid):
    """Nodes in this process, answering through ``app`` (the ClientApp's handler).

    ``node_configs`` gives each node's ``node_config``; ``silent`` node IDs never reply to
    ``silent_types``; ``fresh_process`` forgets the node's live party before each message, so it
    continues from ``context.state`` alone (serialised through protobuf, as a SuperNode stores it).
    ``train.epoch`` messages (direct data plane) run concurrently in threads — every party works for
    the whole epoch and the host waits for its guests over the data plane — the others one by one
    when pushed (party construction draws from torch's process-wide RNG, which threads would share).
    """

    def __init__(self, node_configs, app=None, fresh_process=False, silent=(), silent_types=(R.MSG_STEP,)):
        app = app or (lambda message, context: handle(message, context, PS))
        self.ids = [1000 + 17 * i for i in range(len(node_configs))]
        self.contexts = {n: Context(run_id=7, node_id=n, node_config=dict(c), state=RecordDict(), run_config={})
                         for n, c in zip(self.ids, node_configs)}
        self.app, self.fresh, self.silent, self.silent_types = app, fresh_process, set(silent), set(silent_types)
        self.replies: dict[str, concurrent.futures.Future] = {}
        self.pushed = 0
        self.types: list[str] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="inline-node")

    def set_run(self, run):  # noqa: D102
        pass

    @property
    def run(self):  # noqa: D102
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: D102
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self):  # noqa: D102
        return list(self.ids)

    def _answer(self, m):
        node = m.metadata.dst_node_id
        ctx = self.contexts[node]
        if self.fresh:
            node_mod._PARTIES.pop((ctx.run_id, node), None)
            ctx.state = recorddict_from_proto(recorddict_to_proto(ctx.state))
        wire_in = message_from_proto(message_to_proto(m))
        reply = self.app(wire_in, ctx)
        reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        return message_from_proto(message_to_proto(reply))

    def push_messages(self, messages):  # noqa: D102
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(m.metadata.message_id)
            self.pushed += 1
            self.types.append(m.metadata.message_type)
            if m.metadata.dst_node_id in self.silent and m.metadata.message_type in self.silent_types:
                continue
            if m.metadata.message_type == R.MSG_EPOCH:
                self.replies[m.metadata.message_id] = self._pool.submit(self._answer, m)
            else:
                done = concurrent.futures.Future()
                done.set_result(self._answer(m))
                self.replies[m.metadata.message_id] = done
        return ids

    def pull_messages(self, message_ids):  # noqa: D102
        out = []
        for i in list(message_ids):
            f = self.replies.get(i)
            if f is not None and f.done():
                out.append(self.replies.pop(i).result())
        return out

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        return self.pull_messages(self.push_messages(messages))


def _simulation_nodes(n: int) -> list[dict]:
    return [{"partition-id": i, "num-partitions": n} for i in range(n)]


def _strip(results: dict) -> dict:
    """Results minus what legitimately differs between engines (engine name, wall times)."""
    out = json.loads(json.dumps(results, default=str))
    out["config"].pop("engine")
    out["plan"].pop("engine")
    out.pop("time_s")
    for h in out["history"]:
        h.pop("epoch_time_s")
    return out


def _local(cfg: RunConfig) -> dict:
    return LocalEngine(cfg.replace(engine="local"), PS).run()


# ------------------------------------------------------------------------------------------------
# pyproject / app config


def test_pyproject_app_config_is_runconfig():
    """[tool.flwr.app.config] has exactly RunConfig's keys with RunConfig's defaults (the main
    job's privacy settings aside: a defence is on), and the generated block is current; no
    federations table (Flower would rewrite the file)."""
    from fl_split.flower.appconfig import MAIN_JOB

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    flwr = conf["tool"]["flwr"]
    app_cfg = dict(flwr["app"]["config"])
    # the parties' private seed file (simulation only) is the one key that is not a RunConfig option:
    # the ServerApp drops it, only the ClientApps read it; a seed value is never a key (issue 16)
    assert app_cfg.pop("private-seed-file") == "" and "private-seed" not in app_cfg
    # the prediction job (fl-split predict --engine deploy-local): empty = train; the ServerApp drops it
    assert app_cfg.pop("predict-job") == ""
    want = {key_of(f.name): MAIN_JOB.get(f.name, f.default) for f in option_fields()}
    assert list(app_cfg) == list(want)
    for k, v in want.items():
        assert app_cfg[k] == v and type(app_cfg[k]) is type(v), k
    assert RunConfig.from_mapping(app_cfg) == RunConfig(**MAIN_JOB)
    assert RunConfig(**MAIN_JOB).defense != "none"
    assert flwr["app"]["components"] == {"serverapp": "strategies.server_app:app",
                                         "clientapp": "clients.client_app:app"}
    assert "federations" not in flwr
    from fl_split.flower.appconfig import main as appconfig_main

    assert appconfig_main(["--check", str(ROOT / "pyproject.toml")]) == 0


def test_appconfig_check_detects_a_stale_block(tmp_path, capsys):
    from fl_split.flower.appconfig import main as appconfig_main

    p = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text().replace('dataset = "digits"', 'dataset = "credit"')
    p.write_text(text)
    assert appconfig_main(["--check", str(p)]) == 1
    assert "stale" in capsys.readouterr().err
    assert appconfig_main(["--write", str(p)]) == 0
    assert p.read_text() == (ROOT / "pyproject.toml").read_text()


# ------------------------------------------------------------------------------------------------
# roles, federation validation, records


@pytest.mark.parametrize("node_config,party", [
    ({"partition-id": 0, "num-partitions": 3}, "host"),
    ({"partition-id": 2, "num-partitions": 3}, "guest-2"),
    ({"role": "host", "data-path": "p/host.npz"}, "host"),
    ({"role": "Guest", "guest-index": 3, "data-path": "p/guest-3.npz"}, "guest-3"),
])
def test_node_role(node_config, party):
    role = node_role(node_config)
    assert role.party == party
    assert role.mode == ("deployment" if "role" in node_config else "simulation")


@pytest.mark.parametrize("node_config,match", [
    ({"role": "guest", "data-path": "g.npz"}, "guest-index is None"),
    ({"role": "guest", "guest-index": 0, "data-path": "g.npz"}, "guest-index is 0"),
    ({"role": "guest", "guest-index": "two", "data-path": "g.npz"}, "guest-index is 'two'"),
    ({"role": "label-holder", "data-path": "h.npz"}, "role is 'label-holder'; allowed: 'host' or 'guest'"),
    ({"role": "host"}, "'data-path' is missing"),
    ({}, "neither 'role'.*nor 'partition-id'"),
])
def test_node_role_errors(node_config, match):
    with pytest.raises(FederationError, match=match):
        node_role(node_config)


def _roles(*spec):
    return {100 + i: {"role": "host" if s == "h" else "guest", "guest-index": 0 if s == "h" else int(s)}
            for i, s in enumerate(spec)}


def test_validate_federation_maps_parties_to_nodes():
    assert validate_federation(_roles("2", "h", "1"), 2) == {"host": 101, "guest-1": 102, "guest-2": 100}


@pytest.mark.parametrize("spec,guests,match", [
    (("h", "h", "1"), 1, r"2 host nodes \[100, 101\] \(exactly one is needed\)"),
    (("1", "2"), 2, r"0 host nodes \(exactly one is needed\)$"),
    (("h", "1", "1"), 2, r"duplicate guest indices 1 on nodes \[101, 102\]; no node for guest indices \[2\]"),
    (("h", "1", "2", "3"), 2, r"guest indices \[3\] outside 1..2"),
    (("h", "2"), 2, r"no node for guest indices \[1\]"),
])
def test_validate_federation_errors(spec, guests, match):
    with pytest.raises(FederationError, match=match) as err:
        validate_federation(_roles(*spec), guests)
    assert f"1 host + {guests} guests" in str(err.value)


def test_error_records_round_trip():
    rd = recorddict_from_proto(recorddict_to_proto(R.error_record(BudgetExceeded("guest-2", 1.5, 2.25, 2.0, "rdp"),
                                                                   "guest-2", 9)))
    with pytest.raises(BudgetExceeded) as err:
        R.raise_error_record(rd, "guest-2", 9)
    e = err.value
    assert (e.party, e.spent, e.would_be, e.budget, e.accountant) == ("guest-2", 1.5, 2.25, 2.0, "rdp")
    rd = R.error_record(ValueError("bad thing"), "host", 4)
    with pytest.raises(PartyError, match=r"^host failed in round 4: ValueError: bad thing$") as err:
        R.raise_error_record(rd, "host", 4)
    assert (err.value.party, err.value.round) == ("host", 4)
    R.raise_error_record(R.reply_content(blobs=[]), "host", 4)  # a normal reply raises nothing


@pytest.mark.parametrize("reason,line", [
    ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()\n  File \"x.py\", "
     "line 3, in h\n    raise\n    ^^^^^\nClientAppException: \nException ClientAppException occurred. "
     "Message: disk full'>", "disk full"),
    ("<class 'ValueError'>:<'boom'>", "ValueError: boom"),
    ("plain text", "plain text"),
])
def test_flower_error_reasons_become_one_line(reason, line):
    from fl_split.flower.transport import flower_reason

    assert flower_reason(reason) == line


# ------------------------------------------------------------------------------------------------
# inline: the strategy and the ClientApp handler without a runtime


@pytest.mark.parametrize("guests", [1, 3])
@pytest.mark.parametrize("defense", ["none", "gaussian"])
def test_inline_direct_data_plane_equals_local_engine(guests, defense):
    """The default path (direct data plane): the real strategy and ClientApp handlers, the host's
    coordinator loop reaching its guests over gRPC streams — bit-identical to the local engine, with
    and without a defence, 1 and 3 guests; Flower carries role, setup, one ``train.epoch`` per party
    per epoch and the reports, nothing per batch."""
    extra = {"protect": "both", "denoise": "scale"} if defense != "none" else {}
    cfg = _cfg(guests=guests, defense=defense, **extra)
    assert cfg.data_plane == "direct"
    grid = InlineGrid(_simulation_nodes(guests + 1), fresh_process=True)
    got = VerticalSplitStrategy(cfg).run(grid)
    assert _strip(got) == _strip(_local(cfg))
    parties = guests + 1
    assert grid.types.count(R.MSG_EPOCH) == parties * cfg.epochs
    assert grid.pushed == parties * (3 + cfg.epochs)  # role, setup, report + one per epoch
    assert not {R.MSG_STEP, R.MSG_HOST_TRAIN, R.MSG_HOST_EVAL} & set(grid.types)
    assert all(p["device"] == "cpu" for p in got["parties"].values())


@pytest.mark.parametrize("k,fresh,epochs_per_message", [(1, False, 1), (3, True, 2), ("epoch", False, 1)])
def test_inline_direct_batches_and_epochs_per_message(k, fresh, epochs_per_message):
    """K batches per round and several epochs per control message change nothing but the number
    of control messages."""
    cfg = _cfg(batches_per_round=k, epochs=3, epochs_per_message=epochs_per_message)
    grid = InlineGrid(_simulation_nodes(3), fresh_process=fresh)
    got = VerticalSplitStrategy(cfg).run(grid)
    assert _strip(got) == _strip(_local(cfg))
    assert grid.types.count(R.MSG_EPOCH) == 3 * -(-cfg.epochs // epochs_per_message)
    assert [h["epoch"] for h in got["history"]] == [1, 2, 3]


@pytest.mark.parametrize("k,fresh", [(1, False), (1, True), (3, True), ("epoch", False)])
def test_inline_relay_equals_local_engine(k, fresh):
    """Relay mode (``--data-plane flower``): every tensor in a Flower message; same parties, same
    coordinator loop, also when every message restores the party from context.state (deployment:
    a fresh process per message)."""
    cfg = _cfg(batches_per_round=k, data_plane="flower")
    grid = InlineGrid(_simulation_nodes(3), fresh_process=fresh)
    got = VerticalSplitStrategy(cfg).run(grid)
    assert _strip(got) == _strip(_local(cfg))
    rounds = got["wire"]["rounds"]
    # role + setup + report, and per round one message per guest plus one to the host
    assert grid.pushed == 3 * 3 + rounds * (cfg.guests + 1)


@pytest.mark.parametrize("plane", ["direct", "flower"])
def test_inline_epoch_lines_are_logged_as_each_epoch_ends(plane):
    """`flwr run --stream` shows fl_split's per-epoch lines as each epoch ends, on both data planes:
    the epoch-1 line is logged before any message of epoch 2 is pushed."""
    import logging

    grid = InlineGrid(_simulation_nodes(3))
    seen: list[tuple[str, int]] = []

    class Spy(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("epoch "):
                seen.append((record.getMessage(), grid.pushed))

    logger = logging.getLogger("fl_split.flower")
    spy, level = Spy(), logger.level
    logger.addHandler(spy)
    logger.setLevel(logging.INFO)
    try:
        VerticalSplitStrategy(_cfg(data_plane=plane)).run(grid)
    finally:
        logger.removeHandler(spy)
        logger.setLevel(level)
    assert [m.split(":")[0] for m, _ in seen] == ["epoch 1", "epoch 2"], seen
    assert seen[0][1] < seen[1][1], seen  # epoch 2's messages went out after the epoch-1 line
    assert "train loss" in seen[0][0] and "test accuracy" in seen[0][0]


@pytest.mark.parametrize("plane", ["direct", "flower"])
@pytest.mark.parametrize("kw", [
    {"defense": "laplace", "budget": 40.0},
    {"defense": "gaussian", "protect": "both", "denoise": "mask"},
    {"defense": "rr"},
    {"defense": "dpsgd"},
    {"defense": "laplace", "one_shot": True},
])
def test_inline_private_runs_survive_state_restore(kw, plane):
    """Ledgers, DP-SGD optimizers, one-shot caches and mechanism state all travel through
    context.state: a node restored before every message trains, accounts and reports exactly
    like the in-process parties (on both data planes)."""
    cfg = _cfg(batches_per_round=3, data_plane=plane, **kw)
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    assert _strip(got) == _strip(_local(cfg))
    assert got["privacy"]


@pytest.mark.parametrize("plane", ["direct", "flower"])
def test_inline_budget_refusal_by_a_real_ledger(plane):
    """A party's own ledger refuses a release: BudgetExceeded crosses Flower (relay: an error
    record; direct: an ERROR frame to the host, then the host's epoch reply) with its fields and the
    run stops exactly where the local engine stops."""
    cfg = _cfg(defense="laplace", epsilon=1.0, budget=1.5, accountant="basic", batches_per_round=4, data_plane=plane)
    want = _local(cfg)
    assert want["stopped_reason"] == "budget"
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    assert _strip(got) == _strip(want)
    assert got["stopped_detail"] == want["stopped_detail"] and "release refused" in got["stopped_detail"]


def test_inline_deployment_from_party_files(tmp_path, tls_material):
    """Deployment node configs (role, guest-index, data-path, and the data plane over mutual TLS):
    each node reads only its own file, the coordinator rebuilds the plan from public facts, the host
    listens at its configured address with its certificate (named ``host``), the guests trust the CA
    and present certificates named after them; results equal the local engine's."""
    from tests.services import free_port

    cfg = _cfg(guests=3, epochs=1, batches_per_round=4)
    files = export_parties(cfg, tmp_path)
    address = f"127.0.0.1:{free_port()}"
    def tls(g: int) -> dict:
        name = "guest" if g == 1 else f"guest{g}"
        return {"dataplane-ca": str(tls_material["ca"]), "dataplane-certfile": str(tls_material[f"{name}_cert"]),
                "dataplane-keyfile": str(tls_material[f"{name}_key"])}

    # in a deployment each SuperNode reads its own seed file (here each party's seed derived from PS,
    # as deploy local writes them: the same secrets as the local engine's)
    from fl_split.secure_files import write_private

    seeds = {p: str(write_private(tmp_path / f"{p}.seed", PS.for_party(p).file_text().encode()))
             for p in ("host", "guest-1", "guest-2", "guest-3")}
    configs = [{"role": "guest", "guest-index": 2, "data-path": str(files["guest-2"]),
                "private-seed-file": seeds["guest-2"], **tls(2)},
               {"role": "host", "data-path": str(files["host"]), "private-seed-file": seeds["host"],
                "dataplane-address": address, "dataplane-certfile": str(tls_material["host_cert"]),
                "dataplane-keyfile": str(tls_material["host_key"]), "dataplane-client-ca": str(tls_material["ca"])},
               {"role": "guest", "guest-index": 3, "data-path": str(files["guest-3"]),
                "private-seed-file": seeds["guest-3"], **tls(3)},
               {"role": "guest", "guest-index": 1, "data-path": str(files["guest-1"]),
                "private-seed-file": seeds["guest-1"], **tls(1)}]
    got = VerticalSplitStrategy(cfg).run(InlineGrid(configs, fresh_process=True))
    assert _strip(got) == _strip(_local(cfg))
    relay = VerticalSplitStrategy(cfg.replace(data_plane="flower")).run(InlineGrid(configs, fresh_process=True))
    assert _strip(relay) == _strip(_local(cfg.replace(data_plane="flower")))


@pytest.mark.parametrize("change,match", [
    ({}, r"^host failed in round 0: DataPlaneError: host node-config: dataplane-address is ''"),
    ({"host": {"dataplane-address": "127.0.0.1:1"}},
     r"^host failed in round 0: DataPlaneError: host node-config: no dataplane-certfile / dataplane-keyfile; "
     r"a deployment's data plane uses TLS"),
    ({"host": {"dataplane-address": "127.0.0.1:1", "dataplane-certfile": "missing.crt",
               "dataplane-keyfile": "missing.key"}},
     r"^host failed in round 0: DataPlaneError: dataplane-certfile: cannot read '.*missing.crt'"),
    ({"host": {"dataplane-address": "127.0.0.1:1", "dataplane-insecure": True}},
     r"^guest-1 failed in round 0: DataPlaneError: guest-1 node-config: no dataplane-ca"),
])
def test_inline_deployment_dataplane_setup_errors(tmp_path, change, match):
    """A deployment's data-plane settings are checked at setup, before any training, with an error
    naming the node-config key."""
    cfg = _cfg(guests=1, epochs=1)
    files = export_parties(cfg, tmp_path)
    configs = [{"role": "host", "data-path": str(files["host"]), **change.get("host", {})},
               {"role": "guest", "guest-index": 1, "data-path": str(files["guest-1"])}]
    with pytest.raises(PartyError, match=match):
        VerticalSplitStrategy(cfg).run(InlineGrid(configs))


@pytest.mark.parametrize("change,match", [
    ({"seed": 2}, r"^host failed in round 0: ConfigError: --seed: got 2 \(party file .*host.npz' was exported with seed=1"),
    # what a loopback deployment whose party files were exported with another --limit says (the CLI
    # test in test_deploy.py checks that a ServerApp failure reaches the user as one line)
    ({"limit": 120}, r"^host failed in round 0: ConfigError: --limit: got 120 \(party file .*host.npz' was exported "
                     r"with limit=300"),
    ({"missing": "guest-1"}, r"^guest-1 failed in round 0: DataError: (guest-1: )?party data file .*does not exist"),
    ({"swap": True}, r"failed in round 0: FederationError: node-config says this node is guest-1, but .*guest-2"),
])
def test_inline_deployment_setup_errors(tmp_path, change, match):
    cfg = _cfg(epochs=1)
    files = export_parties(cfg, tmp_path)
    if "missing" in change:
        files[change["missing"]].unlink()
    g1, g2 = (files["guest-2"], files["guest-1"]) if change.get("swap") else (files["guest-1"], files["guest-2"])
    plain = {"dataplane-insecure": True}  # the data-plane settings are fine: the data are not
    configs = [{"role": "host", "data-path": str(files["host"]), "dataplane-address": "127.0.0.1:1", **plain},
               {"role": "guest", "guest-index": 1, "data-path": str(g1), **plain},
               {"role": "guest", "guest-index": 2, "data-path": str(g2), **plain}]
    run_cfg = cfg.replace(**{k: v for k, v in change.items() if k in ("seed", "limit")})
    with pytest.raises(PartyError, match=match):
        VerticalSplitStrategy(run_cfg).run(InlineGrid(configs))


@pytest.mark.parametrize("n_nodes,guests,match", [
    (4, 2, r"guest indices \[3\] outside 1..2"),
    (3, 1, r"guest indices \[2\] outside 1..1"),
])
def test_inline_federation_mismatch(n_nodes, guests, match):
    with pytest.raises(FederationError, match=match):
        VerticalSplitStrategy(_cfg(guests=guests)).run(InlineGrid(_simulation_nodes(n_nodes)))


def test_inline_two_hosts():
    configs = [{"role": "host", "data-path": "a.npz"}, {"role": "host", "data-path": "b.npz"},
               {"role": "guest", "guest-index": 1, "data-path": "c.npz"}]
    with pytest.raises(FederationError, match="2 host nodes"):
        VerticalSplitStrategy(_cfg(guests=1)).run(InlineGrid(configs))


def test_inline_missing_node_times_out():
    t0 = time.monotonic()
    with pytest.raises(FederationError, match=r"waited 0.3 s for 3 nodes \(1 host \+ 2 guests\), 2 registered"):
        VerticalSplitStrategy(_cfg(node_timeout=0.3)).run(InlineGrid(_simulation_nodes(2)))
    assert time.monotonic() - t0 < 5


def test_inline_silent_node_times_out():
    grid = InlineGrid(_simulation_nodes(3), silent={1034})  # node of partition 2 = guest-2
    t0 = time.monotonic()
    with pytest.raises(FederationError, match=r"no reply from guest-2 \(node 1034\) within 0.5 s in round 1 \(train.step\)"):
        VerticalSplitStrategy(_cfg(node_timeout=0.5, data_plane="flower")).run(grid)
    assert time.monotonic() - t0 < 10


def test_inline_direct_guest_that_never_starts_is_named():
    """Direct data plane: guest-2's ClientApp never runs its epoch message; the host waits
    --dataplane-timeout for it to connect and the run stops naming it."""
    grid = InlineGrid(_simulation_nodes(3), silent={1034}, silent_types=(R.MSG_EPOCH,))
    t0 = time.monotonic()
    with pytest.raises(PartyError, match=r"^guest-2 failed in round 1: data plane: guest-2 did not connect to the host's data "
                                         r"plane at 127.0.0.1:\d+ within 1 s \(--dataplane-timeout\)"):
        VerticalSplitStrategy(_cfg(dataplane_timeout=1.0)).run(grid)
    assert time.monotonic() - t0 < 15


def _corrupt_owed(party: str, round_: int):
    """A handler that mangles the gradients a guest receives in one round (a faulty peer/wire):
    the guest itself must refuse them with an error reply."""

    def app(message, context):
        req = message.content.config_records.get(R.REQUEST)
        if (message.metadata.message_type == R.MSG_STEP and node_role(context.node_config).party == party
                and int(req["round"]) == round_):
            req["owed"] = [b"FLS1" + b"\x00" * 12 for _ in req["owed"]]
        return handle(message, context, PS)

    return app


def test_inline_party_error_propagates():
    cfg = _cfg(data_plane="flower")
    with pytest.raises(PartyError, match=r"^guest-1 failed in round 3: ProtocolError: malformed message") as err:
        VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), app=_corrupt_owed("guest-1", 3)))
    assert (err.value.party, err.value.round) == ("guest-1", 3)


def test_inline_direct_party_error_is_named(monkeypatch):
    """Direct data plane: the host puts a mangled gradient into guest-1's STEP frame of round 3 (a
    valid frame, a malformed message inside): guest-1 refuses it (its party unchanged) with an ERROR
    frame and the run stops naming guest-1 and the round."""
    from fl_split.dataplane import host as host_mod

    send = host_mod.HostEndpoint.send

    def corrupting(self, party, type_, header, blobs=()):
        if party == "guest-1" and header.get("round") == 3:
            blobs = [b"FLS1" + b"\x00" * 12 for _ in blobs]
        return send(self, party, type_, header, blobs)

    monkeypatch.setattr(host_mod.HostEndpoint, "send", corrupting)
    with pytest.raises(PartyError, match=r"^guest-1 failed in round 3: ProtocolError: malformed message") as err:
        VerticalSplitStrategy(_cfg()).run(InlineGrid(_simulation_nodes(3)))
    assert (err.value.party, err.value.round) == ("guest-1", 3)


def _refuse(party: str, round_: int):
    """A handler where ``party`` refuses its release in ``round_`` (as its ledger would)."""

    def app(message, context):
        req = message.content.config_records.get(R.REQUEST, {})
        if node_role(context.node_config).party == party and int(req.get("round", -1)) == round_:
            return Message(R.error_record(BudgetExceeded(party, 0.9, 1.2, 1.0, "pld"), party, round_),
                           reply_to=message)
        return handle(message, context, PS)

    return app


def test_inline_budget_exceeded_stops_cleanly():
    cfg = _cfg(epochs=2, data_plane="flower")
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), app=_refuse("host", 4)))
    assert got["stopped_reason"] == "budget" and got["stopped_round"] == 4
    assert got["stopped_detail"].startswith("host: release refused, privacy budget exhausted: epsilon would reach 1.2")
    assert got["history"] == [] and got["wire"]["rounds"] == 4
    assert sorted(got["parties"]) == ["guest-1", "guest-2", "host"]


def test_pad_on_the_relay_is_refused_before_ray_starts():
    """--on-guest-failure pad needs the direct data plane (a relay round ends at the first error
    reply and loses the other guests' releases): refused up front, naming the flag and the way out."""
    with pytest.raises(ConfigError, match=r"^--on-guest-failure: got 'pad' \(a relay round .*pad runs on the direct "
                                          r"data plane\); allowed: stop with --data-plane flower$"):
        FlowerEngine.check(_cfg(engine="flower", data_plane="flower", on_guest_failure="pad"))
    FlowerEngine.check(_cfg(engine="flower", on_guest_failure="pad", num_cpus=_sim_cpus(3)))  # direct: accepted


def _failing_ray_init(monkeypatch, failures: int) -> list[subprocess.Popen]:
    """Replace ``ray.init`` by one that starts a child process (as Ray's GCS would) and then raises,
    ``failures`` times, before it succeeds."""
    import ray

    started: list[subprocess.Popen] = []

    def init(**kw):
        if len(started) < failures:
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
            raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return started


@pytest.mark.parametrize("failures", [1, 2])
def test_ray_start_that_fails_half_way_leaves_nothing_and_is_retried_once(monkeypatch, failures):
    """A local Ray start that times out half-way (seen on a loaded CI machine): what it started is
    ended; one more attempt is made; after two failures the run stops with Ray's reason and the
    ways out, and nothing is left running."""
    started = _failing_ray_init(monkeypatch, failures)
    engine = FlowerEngine(_cfg(engine="flower"))
    if failures == 1:
        assert engine._start_ray() is True
    else:
        with pytest.raises(FederationError, match=r"Ray did not start on this machine \(2 attempts\): The current "
                                                  r"node timed out during startup\..*--num-cpus.*--ray-address"):
            engine._start_ray()
    assert len(started) == failures
    for p in started:
        assert p.wait(timeout=10) is not None  # ended by the engine, not by this test


def test_inline_direct_capacity_check(monkeypatch):
    """Direct data plane in a simulation: the host's setup reply says what its Ray actor reserved
    and what the cluster has; too little to run every ClientApp at once stops the run before the
    first epoch, saying what was asked, what Ray has and which flag to change."""
    from fl_split.flower import resources

    monkeypatch.setattr(resources, "capacity_here",
                        lambda: {"num_cpus": 1.0, "num_gpus": 0.0, "nodes": [{"CPU": 2.0, "GPU": 0.0}]})
    grid = InlineGrid(_simulation_nodes(3))
    with pytest.raises(ConfigError, match=r"^--num-cpus: got 1.0 \(the direct data plane runs all 3 ClientApps "
                                          r"\(1 host \+ 2 guests\) at once, but only 2 fit: each reserves --num-cpus 1, "
                                          r"and Ray has 2 CPU\(s\) on 1 node \(measured by the host's ClientApp\)\); "
                                          r"allowed: --num-cpus 0.66 or less"):
        VerticalSplitStrategy(_cfg()).run(grid)
    assert R.MSG_EPOCH not in grid.types


# ------------------------------------------------------------------------------------------------
# Flower simulation runtime (Ray)


def _fault_app(kind: str, party: str, round_: int, seconds: float = 0.0):
    """The fl_split ClientApp with one injected fault in ``round_``: ``raise`` (the ClientApp
    crashes, Flower replies with its own error), ``hang`` (the party never answers) — relay
    messages — or ``kill`` (direct data plane: the party's process is SIGKILLed mid-epoch, while it
    serves that round)."""

    def h(message, context):
        req = message.content.config_records.get(R.REQUEST, {})
        me = node_role(context.node_config).party
        if kind == "kill" and me == party and message.metadata.message_type == R.MSG_EPOCH:
            import fl_split.dataplane.guest as guest_mod

            serve = guest_mod.serve

            def dying(name, step, *args, **kw):
                def s(owed, keys, r):
                    if r == round_:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return step(owed, keys, r)

                return serve(name, s, *args, **kw)

            guest_mod.serve = dying
        elif me == party and int(req.get("round", -1)) == round_:
            if kind == "raise":
                raise RuntimeError("injected failure")
            time.sleep(seconds)
        return handle(message, context, PS)

    return node_mod.client_app_for(h)


def _our_leftovers() -> list[str]:
    from fl_split.flower.processes import descendants

    return [c for c in descendants(os.getpid()).values() if "ray" in c or "flower" in c or "flwr" in c]


def _no_leftovers(timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _our_leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow
def test_simulation_direct_and_relay_equal_local_engine():
    """The Flower simulation on Ray (one ClientApp per party, each its own process): the direct data
    plane with and without a defence, and the relay with one batch per round, give the local
    engine's per-epoch losses, metrics and wire bytes bit for bit (3 guests; one simulation runs the
    three configurations, so Ray starts once); each party records its device."""
    base = _cfg(guests=3, engine="flower", num_cpus=_sim_cpus(4))
    cfgs = [base, base.replace(defense="gaussian", protect="both", denoise="scale"),
            base.replace(data_plane="flower")]
    engine = FlowerEngine(base, private_seed=PS)
    results = engine.run_series(cfgs)
    for cfg, got in zip(cfgs, results):
        want = _local(cfg)
        assert len(got["history"]) == cfg.epochs
        assert got["wire"] == want["wire"] and got["plan"]["engine"] == "flower"
        assert _strip(got) == _strip(want), cfg.data_plane  # bit-identical
        assert {p: r["device"] for p, r in got["parties"].items()} == {p: "cpu" for p in cfg.parties}
    assert all(t.stats.workers for t in engine.transports)  # the parties answered from Ray actors
    assert engine.startup()["before_first_batch"] > 0
    import ray

    assert not ray.is_initialized()


@pytest.mark.slow
def test_cli_flower_engine_one_host_four_guests(tmp_path, capsys):
    """`fl-split train --engine flower` end to end with 1 host + 4 guests on the direct data plane
    and 4 batches per round; the results JSON equals the local engine's with the same K, and nothing
    is left running."""
    out = tmp_path / "r.json"
    cpus = _sim_cpus(5)
    argv = ["train", "--engine", "flower", "--guests", "4", "--batches-per-round", "4", "--epochs", "2",
            "--limit", "300", "--seed", "1", "--no-progress", "--out", str(out), "--private-seed", PS_HEX,
            "--num-cpus", str(cpus), "--device", "cpu"]
    from fl_split.cli import main

    assert main(argv) == 0
    got = json.loads(out.read_text())
    assert got["plan"]["engine"] == "flower" and got["config"]["guests"] == 4
    assert sorted(got["parties"]) == ["guest-1", "guest-2", "guest-3", "guest-4", "host"]
    want = _local(_cfg(guests=4, batches_per_round=4, out=str(out), num_cpus=cpus))
    assert _strip(got) == _strip(want)
    assert "final test accuracy" in capsys.readouterr().out
    assert _no_leftovers() == []


@pytest.mark.slow
def test_cli_flower_party_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """Relay: a ClientApp that crashes in round 3: the run stops, the CLI prints one line naming the
    party and the round, exits 1, writes no results, and leaves nothing running."""
    monkeypatch.setattr(node_mod, "make_client_app", lambda private_seed=None, handoff=None: _fault_app("raise", "guest-2", 3))
    from fl_split.cli import main

    out = tmp_path / "r.json"
    code = main(["train", "--engine", "flower", "--guests", "2", "--epochs", "1", "--limit", "300",
                 "--no-progress", "--out", str(out), "--data-plane", "flower", "--num-cpus", str(_sim_cpus(3))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1, err
    assert err[0].startswith("fl-split: failed: guest-2 failed in round 3: the ClientApp crashed (Flower error 2): "
                             "injected failure"), err
    assert not out.exists()
    assert _no_leftovers() == []


@pytest.mark.slow
def test_cli_flower_guest_killed_mid_epoch(tmp_path, capsys, monkeypatch):
    """Direct data plane: guest-2's process is killed (SIGKILL) while it serves round 3 of the
    first epoch. The host notices the broken stream at once, names the guest, ends the epoch for
    the others; the CLI prints one line, exits 1, writes no results and leaves nothing running."""
    monkeypatch.setattr(node_mod, "make_client_app", lambda private_seed=None, handoff=None: _fault_app("kill", "guest-2", 3))
    from fl_split.cli import main

    out = tmp_path / "r.json"
    t0 = time.monotonic()
    code = main(["train", "--engine", "flower", "--guests", "2", "--epochs", "2", "--limit", "300",
                 "--no-progress", "--out", str(out), "--num-cpus", str(_sim_cpus(3)), "--dataplane-timeout", "60"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1, err
    assert err[0].startswith("fl-split: failed: guest-2 failed"), err
    assert "round 3" in err[0] and ("lost the connection to guest-2" in err[0] or "crashed" in err[0]), err
    assert not out.exists()
    assert _no_leftovers() == []
    assert time.monotonic() - t0 < 200


@pytest.mark.slow
def test_cli_flower_guest_killed_mid_epoch_pad_goes_on_as_the_local_engine(tmp_path, capsys, monkeypatch):
    """Direct data plane, --on-guest-failure pad: guest-2's process is SIGKILLed while it serves
    round 3. The host goes on with guest-2's embedding zero-filled, the coordinator sends guest-2
    nothing more (epoch 2 runs with the host and guest-1 only), and the results are the local
    engine's when guest-2 fails in round 3: the same losses, metrics, wire counts and ledgers;
    guest-2 has no entry in privacy or parties; nothing is left running."""
    from tests.test_checkpoint import GuestDiesAt

    monkeypatch.setattr(node_mod, "make_client_app", lambda private_seed=None, handoff=None: _fault_app("kill", "guest-2", 3))
    from fl_split.cli import main

    out = tmp_path / "r.json"
    cpus = _sim_cpus(3)
    code = main(["train", "--engine", "flower", "--guests", "2", "--epochs", "2", "--limit", "300", "--seed", "1",
                 "--no-progress", "--out", str(out), "--num-cpus", str(cpus), "--dataplane-timeout", "60",
                 "--on-guest-failure", "pad", "--private-seed", PS_HEX, "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    got = json.loads(out.read_text())
    assert [(f["guest"], f["round"], f["action"]) for f in got["guest_failures"]] == [("guest-2", 3, "pad")]
    assert "guest-2" in got["guest_failures"][0]["reason"]
    assert len(got["history"]) == 2 and got["stopped_reason"] == "completed"
    assert "guest-2" not in got["privacy"] and "guest-2" not in got["parties"]
    cfg = _cfg(on_guest_failure="pad", num_cpus=cpus, engine="local")
    want = LocalEngine(cfg, PS, transport=lambda t: GuestDiesAt(t, "guest-2", 3)).run()
    got, want = _strip(got), _strip(want)
    for r in (got, want):
        for f in r["guest_failures"]:
            f.pop("reason")  # how the failure showed (a broken stream / a raised ConnectionError)
        for p in r["parties"].values():
            p.pop("worker", None)
    assert got["history"] == want["history"] and got["wire"] == want["wire"]
    assert got["privacy"] == want["privacy"] and got["guest_failures"] == want["guest_failures"]
    assert got["final"] == want["final"]
    assert _no_leftovers() == []


@pytest.mark.slow
def test_simulation_node_that_never_answers_times_out():
    """Relay: guest-1 hangs in round 2: the coordinator gives up after --node-timeout with a message
    naming it, and the engine returns (the stuck ClientApp actor is ended) instead of hanging."""
    cfg = _cfg(guests=1, epochs=1, node_timeout=25.0, engine="flower", data_plane="flower")
    engine = FlowerEngine(cfg, client_app=_fault_app("hang", "guest-1", 2, seconds=600), stop_grace=3.0)
    t0 = time.monotonic()
    with pytest.raises(FederationError, match=r"no reply from guest-1 \(node \d+\) within 25 s in round 2 \(train.step\)"):
        engine.run()
    assert time.monotonic() - t0 < 200
    assert _no_leftovers() == []


@pytest.mark.slow
def test_simulation_on_a_two_node_ray_cluster():
    """Multi-node Ray: a head and one worker on loopback (own temp dir, ports, sessions); the
    simulation joins it via --ray-address, its ClientApps run on both nodes and find each other's
    data plane through the cluster's key-value store; stopping the cluster ends exactly the
    processes of its two sessions."""
    from tests.services import LoopbackRayCluster, session_pids

    cluster = LoopbackRayCluster(workers=1, cpus_per_node=1)
    try:
        sessions = list(cluster.sessions)
        assert len(sessions) == 2 and all(session_pids(s) for s in sessions)
        # the direct data plane: 3 ClientApps at once on two 1-CPU nodes (0.5 CPU each)
        cfg = _cfg(ray_address=cluster.address, engine="flower", num_cpus=0.5)
        engine = FlowerEngine(cfg, private_seed=PS)
        got = engine.run()
        assert _strip(got) == _strip(_local(cfg))
        ray_nodes = {w for w in engine.transport.stats.workers if w.startswith("ray:")}
        assert len(ray_nodes) == 2, engine.transport.stats.workers
        assert all(session_pids(s) for s in sessions)  # the cluster outlives the run
    finally:
        signalled = cluster.stop(grace=10)
        cluster.cleanup()
    assert signalled and all(not session_pids(s) for s in sessions)
    for pid in signalled:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_flwr_run_cli_against_our_own_superlink(tmp_path):
    """`flwr run .` from the repository: the app metadata works offline against a SuperLink this
    test starts (private FLWR_HOME and ports), pyproject.toml is left untouched, results are
    written to --run-config out, and the SuperLink (and its SuperExec) are stopped."""
    from tests.services import LocalSuperLink, session_pids

    before = (ROOT / "pyproject.toml").read_bytes()
    out = tmp_path / "flwr-run.json"
    from fl_split.secure_files import write_private

    seed_file = write_private(tmp_path / "private-seed", PS.file_text().encode())  # a path, never the seed
    link = LocalSuperLink()
    try:
        cmd = [str(Path(sys.executable).parent / "flwr"), "run", ".", "--stream",
               # flwr run reserves whole CPUs: let Ray count 3, so the 3 ClientApps run at once (the
               # direct data plane needs them together; they share this machine's cores)
               "--federation-config", "num-supernodes=3 client-resources-num-cpus=1 init-args-num-cpus=3",
               "--run-config", f"guests=2 epochs=1 limit=200 batches-per-round='epoch' out='{out}' "
                               f"private-seed-file='{seed_file}'"]
        proc = subprocess.run(cmd, cwd=ROOT, env=link.env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "epoch 1: train loss" in proc.stdout + proc.stderr
        assert "guest-1: gaussian" in proc.stdout + proc.stderr  # each party's epsilon is logged
    finally:
        sessions = list(link.sessions)
        link.stop()
        link.cleanup()
    assert all(not session_pids(s) for s in sessions)
    assert (ROOT / "pyproject.toml").read_bytes() == before
    got = json.loads(out.read_text())
    assert got["plan"]["engine"] == "flower" and len(got["history"]) == 1
    from fl_split.flower.appconfig import MAIN_JOB

    # the ServerApp cannot see the parties' machines: each resolved --device auto itself (the CPU
    # here: a simulation actor without --num-gpus sees no GPU), and says so in its report
    assert {p: r["device"] for p, r in got["parties"].items()} == {"host": "cpu", "guest-1": "cpu", "guest-2": "cpu"}
    want = _local(_cfg(epochs=1, limit=200, seed=0, batches_per_round="epoch", out=str(out), **MAIN_JOB))
    assert got["config"]["device"] == "auto"  # flwr run's config; the parties resolved it (above)
    got["config"]["device"] = "cpu"
    assert _strip(got) == _strip(want)


# ------------------------------------------------------------------------------------------------
# issue 17: defaults that fit the machine; failures are non-zero and leave nothing behind


class _Watch:
    """Runs ``argv`` (``python -m fl_split.cli …``) in a session of its own and records every
    descendant it ever had (polled), so a test can check that all of them ended. Its stdout and
    stderr are read while it runs (a full pipe would block it; a failed wait shows what it said)."""

    def __init__(self, argv: list[str], cwd: Path | None = None) -> None:
        import threading

        from fl_split.flower.processes import descendants

        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "fl_split.cli", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
                                     cwd=cwd or ROOT)
        self.seen: dict[int, str] = {}
        self.poll_error: BaseException | None = None
        self._stop = threading.Event()
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}

        def poll() -> None:
            try:
                while not self._stop.is_set():
                    for pid, cmd in descendants(self.proc.pid).items():
                        if cmd or pid not in self.seen:  # a zombie's command line reads empty: keep the real one
                            self.seen[pid] = cmd
                    self._stop.wait(0.25)
            except BaseException as exc:  # noqa: BLE001 - reported by wait_for_actors / finish, not lost
                self.poll_error = exc

        def drain(name: str) -> None:
            for line in getattr(self.proc, name):
                self._out[name].append(line)

        self._threads = [threading.Thread(target=poll, daemon=True),
                         *(threading.Thread(target=drain, args=(n,), daemon=True) for n in self._out)]
        for t in self._threads:
            t.start()

    def actors(self) -> int:
        return sum(c.startswith("ray::ClientAppActor") for c in self.seen.values())

    def actors_started(self) -> int:
        """ClientApp actors that started, for a wait: :meth:`actors`, plus Ray workers whose title Ray
        never set (measured: one of three busy ClientApp actors kept its ``default_worker.py``
        command line for minutes while the other two read ``ray::ClientAppActor.run``; the wait timed
        out). An idle worker reads ``ray::IDLE`` and does not count."""
        return sum(c.startswith("ray::ClientAppActor") or "ray/_private/workers/default_worker.py" in c
                   for c in self.seen.values())

    def stderr(self) -> str:
        return "".join(self._out["stderr"])

    def wait_for_actors(self, n: int, timeout: float, ray_may_not_start: bool = False) -> bool:
        """Wait until ``n`` ClientApp actors were seen (:meth:`actors_started`; ``True``); fail saying why not: the command
        exited (its status), the wait timed out, or the process poller broke, with the command's
        stderr and the descendants seen. With ``ray_may_not_start``, a command that gave up with the
        engine's own "Ray did not start on this machine" line returns ``False`` instead."""
        deadline = time.monotonic() + timeout
        while self.actors_started() < n and self.proc.poll() is None and self.poll_error is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        if self.actors_started() >= n:
            return True
        code = self.proc.poll()
        if code is not None and ray_may_not_start:
            self.finish(timeout=10)
            if "fl-split: failed: Ray did not start on this machine" in self.stderr():
                return False
        why = (f"the poller failed: {self.poll_error!r}" if self.poll_error is not None else
               f"the command exited with status {code}" if code is not None else f"still running after {timeout:g} s")
        time.sleep(0.5)  # the rest of its stderr
        seen = sorted({c[:60] for c in self.seen.values()})
        pytest.fail(f"{self.actors_started()} of {n} ClientApp actors started ({why}; "
                    f"{time.monotonic() - self.started:.0f} s after the start); descendants seen: {seen}; "
                    f"stderr:\n{self.stderr()[-3000:]}")

    def finish(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the command's exit; its status, stdout and stderr (``TimeoutExpired`` after ``timeout`` s)."""
        end = time.monotonic() + timeout
        self.proc.wait(timeout=timeout)
        self._stop.set()
        for t in self._threads:  # EOF once no process it started holds the pipes any more
            t.join(timeout=max(1.0, end - time.monotonic()))
        assert self.poll_error is None, f"the process poller failed: {self.poll_error!r}"
        return self.proc.returncode, "".join(self._out["stdout"]), self.stderr()

    def left(self, timeout: float = 20.0) -> list[str]:
        """Recorded descendants (and members of its session) still running after ``timeout`` s."""
        from fl_split.flower.processes import alive, process_table

        def still() -> list[str]:
            table = process_table(cmdline=True)
            mine = {p for p, (st, _, sid, _) in table.items() if sid == self.proc.pid and st != "Z"}
            # a recorded PID counts only while it runs the same command (not a recycled PID)
            same = {p for p in alive(set(self.seen)) if p in table and table[p][3] == self.seen[p]}
            return [f"{p} {self.seen.get(p, '')[:80]}" for p in sorted(same | mine)]

        deadline = time.monotonic() + timeout
        while (rest := still()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return rest

    def kill(self) -> None:
        """Clean-up after a failed test only: end the command and its current descendants."""
        from fl_split.flower.processes import descendants, end_processes

        if self.proc.poll() is None:
            end_processes(set(descendants(self.proc.pid)) | {self.proc.pid}, grace=2)
            self.proc.wait(timeout=10)


@pytest.mark.slow
def test_cli_flower_engine_fits_a_small_machine_with_no_resource_flags(tmp_path):
    """`fl-split train --engine flower --guests 2` with no --num-cpus on this (2-core) machine: the
    CPUs Ray sees are shared by the 3 ClientApps (one line says so), the run completes and nothing
    is left running."""
    from fl_split.flower.resources import auto_share, local_cpus

    out = tmp_path / "r.json"
    run = _Watch(["train", "--engine", "flower", "--guests", "2", "--epochs", "1", "--limit", "200", "--no-progress",
                  "--device", "cpu", "--out", str(out)])
    try:
        code, stdout, stderr = run.finish(timeout=500)
    finally:
        run.kill()
    assert code == 0, stderr[-3000:]
    share = auto_share(3, [float(local_cpus())])
    assert f"fl-split: --num-cpus auto: {share:g} CPU per ClientApp ({local_cpus()} CPU(s) on this machine shared " \
           f"by 3 ClientApps: 1 host + 2 guests)" in stderr
    got = json.loads(out.read_text())
    assert got["config"]["num_cpus"] == share and len(got["history"]) == 1
    # every party in its own Ray actor; counted as the waits count them (actors_started): Ray may never
    # set a busy worker's title (tests/README.md; this assertion saw 0 titled actors once in a
    # fresh-clone CI run while another Flower run loaded the machine, the run itself complete)
    assert run.actors_started() >= 3
    assert run.left() == []


def _interrupted_program(code: str, timeout: float) -> tuple[int, str, str]:
    """Run ``code`` in a fresh interpreter; once it prints ``ready``, send it SIGINT; its exit
    status, stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_an_interrupt_swallowed_by_another_handler_still_ends_the_run():
    """Ray defers SIGINT inside some calls (its handler only notes it, and drops it when the call
    fails, as it does when the same Ctrl-C killed the actors): the run must still end with 130. Here
    a handler that ignores SIGINT stands in for Ray's; the wakeup-fd watcher ends the process."""
    code = ("import signal, time\n"
            "from fl_split.flower.processes import exit_on_signals\n"
            "with exit_on_signals('fl-split: interrupted; no results written'):\n"
            "    signal.signal(signal.SIGINT, lambda *a: None)\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(30)\n"
            "print('not interrupted', flush=True)\n")
    code_, out, err = _interrupted_program(code, timeout=10)
    assert code_ == 130 and "not interrupted" not in out
    assert err.strip().splitlines()[-1] == "fl-split: interrupted; no results written"


def test_a_run_that_fails_while_the_interrupt_is_being_handled_still_exits_130():
    """The clean-up after a signal takes time (here a child that ignores SIGTERM holds it for the
    2 s grace); the run meanwhile fails on its own — as it does when the clean-up kills its Ray actors —
    and leaves the block with an error. It must wait for the clean-up: exit 130, the one line, no
    traceback (measured before: exit 1, in 1 of 4 SIGTERM runs of the CLI test below)."""
    code = ("import signal, subprocess, sys, time\n"
            "from fl_split.flower.processes import exit_on_signals\n"
            "stubborn = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], "
            "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)\n"
            "stubborn.stdout.readline()\n"
            "seen = []\n"
            "with exit_on_signals('fl-split: interrupted; no results written'):\n"
            "    signal.signal(signal.SIGINT, lambda *a: seen.append(1))  # Ray's deferral: the watcher handles it\n"
            "    print('ready', flush=True)\n"
            "    while not seen:\n"
            "        time.sleep(0.01)\n"
            "    raise RuntimeError('the actors died')\n")
    code_, _, err = _interrupted_program(code, timeout=20)
    assert code_ == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "fl-split: interrupted; no results written"


def _exit_on_signals_program(body: str, prelude: str = "") -> tuple[int, str, str, float]:
    """``body`` inside ``exit_on_signals`` in a fresh interpreter (after ``prelude``): its exit
    status, stdout, stderr and seconds."""
    code = ("import os, signal, sys, time\n"
            "import fl_split.flower.processes as P\n" + prelude +
            "with P.exit_on_signals('fl-split: interrupted; no results written'):\n" +
            "".join(f"    {line}\n" for line in body.splitlines()))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def test_an_interrupt_whose_byte_is_not_yet_read_when_the_block_fails_still_exits_130():
    """The race of the test above without its timing: the signal's byte is in the wakeup pipe, a
    swallowing handler (Ray's deferral) took the Python side, and the block fails at once — before
    the watcher thread has read the byte. The block's end reads the pipe up to a sentinel first:
    exit 130, the one line (before: exit 1 with the traceback, 20 of 20 runs)."""
    code, _, err, _ = _exit_on_signals_program("signal.signal(signal.SIGINT, lambda *a: None)\n"
                                               "os.kill(os.getpid(), signal.SIGINT)\n"
                                               "raise RuntimeError('the actors died')")
    assert code == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "fl-split: interrupted; no results written"


def test_an_interrupt_after_the_wakeup_fd_is_stopped_still_exits_130():
    """A signal landing after the block's end has stopped the wakeup fd (its byte goes nowhere) but
    before the caller's handlers are back, while a swallowing handler was left installed: the block's
    end put its own handler back first, which ends the run with 130."""
    prelude = ("real = signal.set_wakeup_fd\n"
               "def stop_then_signal(fd, **kw):\n"
               "    old = real(fd, **kw)\n"
               "    if fd == -1:  # the block's end stops the wakeup fd; a signal lands right then\n"
               "        os.kill(os.getpid(), signal.SIGINT)\n"
               "    return old\n"
               "signal.set_wakeup_fd = stop_then_signal\n")
    code, _, err, _ = _exit_on_signals_program("signal.signal(signal.SIGINT, lambda *a: None)\n"
                                               "raise RuntimeError('the actors died')", prelude)
    assert code == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "fl-split: interrupted; no results written"


def test_a_block_without_a_signal_ends_at_once_and_restores_the_handlers():
    """No signal: the block's end waits only for the watcher to read the sentinel (not the 5 s bound),
    the caller's handlers and wakeup fd are back, and the block's own error propagates unchanged."""
    # (SIGINT's own handler as the interpreter started: default_int_handler, or SIG_IGN where the
    # test runs as a background job of a non-interactive shell, which starts its children ignoring it)
    prelude = ("mine = lambda *a: None\nsignal.signal(signal.SIGTERM, mine)\nimport atexit\n"
               "int_before = signal.getsignal(signal.SIGINT)\n"
               "atexit.register(lambda: print(signal.getsignal(signal.SIGTERM) is mine, "
               "signal.getsignal(signal.SIGINT) is int_before, signal.set_wakeup_fd(-1), "
               "time.monotonic() - ended[0] < 4, flush=True))\n")
    code, out, err = _exit_on_signals_program("print('in', flush=True)\nended = [time.monotonic()]", prelude)[:3]
    assert (code, out) == (0, "in\nTrue True -1 True\n"), err
    code, _, err = _exit_on_signals_program("raise ValueError('its own error')")[:3]
    assert code == 1 and err.strip().splitlines()[-1] == "ValueError: its own error"


def test_watch_says_why_the_clientapps_did_not_start():
    """The ClientApp wait of the Flower CLI tests names the reason and shows the command's stderr
    (CI once reported only "the ClientApps never started"); only the engine's own "Ray did not
    start" line counts as a start to repeat."""
    run = _Watch(["train", "--engine", "flower", "--epochs", "0", "--no-progress"])
    with pytest.raises(pytest.fail.Exception) as failed:
        run.wait_for_actors(3, timeout=120, ray_may_not_start=True)
    message = str(failed.value)
    assert message.startswith("0 of 3 ClientApp actors started (the command exited with status 2; "), message
    assert message.endswith("fl-split: error: --epochs: got 0; allowed: an integer >= 1\n"), message
    assert run.finish(timeout=10)[0] == 2


def _training(argv: list[str], starts: int = 3) -> _Watch:
    """``fl-split ARGV`` (``--engine flower``, 2 guests) once its 3 ClientApp actors run.

    Started again (at most ``starts`` times in all) only when the command gave up with the engine's
    "Ray did not start on this machine (2 attempts)": Ray gives a starting raylet a fixed 30 s to
    register with its GCS, which a loaded 2-core machine can exceed twice in a row (measured on the
    shared machine: a bare ``ray.init()`` timed out at load 27; in CI the test then failed as "the
    ClientApps never started"). That is the machine, not the behaviour tested here; the engine's own
    handling of it (a clear line, nothing left running) is checked each time and by
    test_ray_start_that_fails_half_way_leaves_nothing_and_is_retried_once."""
    for start in range(1, starts + 1):
        run = _Watch(argv)
        try:
            if run.wait_for_actors(3, timeout=400, ray_may_not_start=start < starts):
                return run
        except BaseException:
            run.kill()
            raise
        assert run.proc.returncode == 1 and run.left() == [], run.stderr()[-3000:]
    raise AssertionError("unreachable")


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_cli_flower_engine_interrupted_exits_130_and_leaves_nothing(tmp_path, sig):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) or SIGTERM while `--engine flower`
    trains: exit 130 within 10 s (issue 17's bound; a hang measured 180 s+ before), one line and no
    traceback on stderr, no results file, and every process it started (Ray's daemons and actors) ended."""
    import signal as signal_mod

    out = tmp_path / "r.json"
    run = _training(["train", "--engine", "flower", "--guests", "2", "--epochs", "500", "--no-progress", "--device",
                     "cpu", "--out", str(out)])
    try:
        time.sleep(3)  # the parties are set up and training
        assert run.proc.poll() is None
        if sig == "SIGINT":
            os.killpg(run.proc.pid, signal_mod.SIGINT)
        else:
            run.proc.send_signal(signal_mod.SIGTERM)
        try:
            code, _, stderr = run.finish(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 10 s after {sig}")
    finally:
        run.kill()
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "fl-split: interrupted; no results written"
    assert not out.exists() and not list(tmp_path.iterdir())
    assert run.left(timeout=5) == []


@pytest.mark.slow
def test_flwr_run_wrapper_completes_and_leaves_nothing(tmp_path):
    """The README's Flower command, `fl-split flwr-run`: `flwr run . --stream` with its own SuperLink
    and a federation derived from the job (2 guests on this machine's CPUs, no federation flag), exit
    0, results written (a relative `out` lands in the caller's directory), pyproject.toml untouched,
    and its SuperLink, SuperExec, ServerApp and Ray processes all ended."""
    from fl_split.secure_files import write_private

    before = (ROOT / "pyproject.toml").read_bytes()
    seed = write_private(tmp_path / "seed", PS.file_text().encode())  # a seed value in a run config is refused
    run = _Watch(["flwr-run", "--run-config", f"guests=2 epochs=1 limit=200 batches-per-round='epoch' out='r.json' "
                                              f"private-seed-file='{seed}'", "--workdir", str(tmp_path / "work")],
                 cwd=tmp_path)
    try:
        code, stdout, stderr = run.finish(timeout=500)
    finally:
        run.kill()
    text = stdout + stderr
    assert code == 0, text[-3000:]
    assert 'federation-config "num-supernodes=3 ' in text
    assert "epoch 1: train loss" in text and "guest-1: gaussian" in text
    assert "completed; its SuperLink and every process it started have ended" in stderr
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["plan"]["engine"] == "flower" and got["config"]["guests"] == 2
    assert any("flower-superlink" in c for c in run.seen.values()), run.seen
    assert run.left() == []
    assert (ROOT / "pyproject.toml").read_bytes() == before


@pytest.mark.slow
def test_flwr_run_wrapper_failed_run_exits_non_zero_and_leaves_nothing(tmp_path):
    """A run whose ServerApp fails (here: 3 SuperNodes for a 1-guest job, which the coordinator
    refuses) — `flwr run` itself exits 0 — makes `fl-split flwr-run` exit 1 with the SuperLink's
    reason; nothing is left running, and the work directory keeps the logs."""
    work = tmp_path / "work"
    run = _Watch(["flwr-run", "--run-config", "epochs=1 limit=200", "--federation-config", "num-supernodes=3",
                  "--workdir", str(work)], cwd=tmp_path)
    try:
        code, stdout, stderr = run.finish(timeout=500)
    finally:
        run.kill()
    assert code == 1, (stdout + stderr)[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("fl-split: failed: run ") and " failed: " in last, last
    assert (work / "logs" / "flwr-run.log").exists()
    assert run.left() == []
