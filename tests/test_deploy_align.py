"""``--align psi`` / ``public`` between deployed SuperNodes (``data = "node-tables"``,
:mod:`fl_split.flower.alignment`): each node reads only its own raw table; the ServerApp routes the
PSI frames of :mod:`fl_split.psi` as Flower messages, then the parties are built as from party files.

Most tests run the real ServerApp strategy and the real ClientApp handler over
``tests.test_flower.InlineGrid`` with *deployment* node configs (role, guest-index, data-path = the
party's table, its own private seed file) and ``fresh_process=True`` (every message continues from
the node's ``context.state`` alone, as a SuperNode's fresh ClientApp process does). One slow test runs
``fl-split deploy local`` end to end (separate processes)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.common.serde import recorddict_to_proto

from fl_split.config import RunConfig
from fl_split.data.registry import load_dataset
from fl_split.errors import DataError, PartyError, ProtocolError
from fl_split.flower import records as R
from fl_split.flower.alignment import ALIGNED, MSG_ALIGN, PSI_STATE, handle_align
from fl_split.flower.node import NodeRole
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.seeding import PrivateSeed
from fl_split.secure_files import write_private
from tests.test_adversary_identity import _AuditedGrid
from tests.test_flower import InlineGrid, _strip
from tests.test_own_data import _distinct, data_flags, write_party_tables

SEED = 5
RUN = dict(guests=2, seed=SEED, epochs=1, batch_size=64, id_column="ID", label_column="Y", progress=False)
PARTIES = ("host", "guest-1", "guest-2")


def _overlapping(tmp_path):
    """Three tables whose ID sets overlap partly (13-digit IDs: a scan means something); returns the
    paths, the intersection and the IDs outside it."""
    ids = np.sort(load_dataset("breast-cancer").ids)
    keep = {p: ids[ids % k != 0] for p, k in (("host", 5), ("guest-1", 7), ("guest-2", 11))}
    inter = np.intersect1d(np.intersect1d(keep["host"], keep["guest-1"]), keep["guest-2"])
    outside = np.setdiff1d(ids, inter)
    paths = write_party_tables(tmp_path, keep=keep, id_map=_distinct)
    return paths, _distinct(inter), _distinct(outside)


def _nodes(tmp_path, paths: dict[str, str], seed: PrivateSeed) -> list[dict]:
    """Deployment node configs: each party its table and its own seed file (as deploy local writes)."""
    out = []
    for p in PARTIES:
        f = write_private(tmp_path / f"seed-{p}", seed.for_party(p).file_text().encode())
        cfg = {"role": "host"} if p == "host" else {"role": "guest", "guest-index": int(p.split("-")[1])}
        out.append({**cfg, "data-path": paths[p], "private-seed-file": str(f)})
    return out


class RecordingGrid(_AuditedGrid):
    """The audit grid of tests/test_adversary_identity.py (every message both ways, serialised as a
    SuperLink stores it, in ``wire``) that also notes each alignment step and who got it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ops: list[tuple[str, str]] = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == MSG_ALIGN:
                conf = self.contexts[m.metadata.dst_node_id].node_config
                party = "host" if conf["role"] == "host" else f"guest-{conf['guest-index']}"
                self.ops.append((party, str(R.request_of(m.content)["op"])))
        return super().push_messages(messages)


def _scan(blob: bytes, ids: np.ndarray) -> list[int]:
    """IDs of ``ids`` found in ``blob`` as int64 (little endian) or as decimal text."""
    text = {int(x) for x in re.findall(rb"\d{13}", blob)}
    return [int(i) for i in ids if int(i) in text or int(i).to_bytes(8, "little", signed=True) in blob]


pytestmark = pytest.mark.usefixtures("flower_task_identity")


@pytest.fixture
def psi_keys(monkeypatch):
    """Every ECDH key openmined-psi makes in this process (host: client, guests: server)."""
    import private_set_intersection.python as psi

    keys: list[bytes] = []
    for side in (psi.client, psi.server):
        made = side.CreateWithNewKey

        def create(reveal, _made=made):
            obj = _made(reveal)
            keys.append(bytes(obj.GetPrivateKeyBytes()))
            return obj

        monkeypatch.setattr(side, "CreateWithNewKey", create)
    return keys


def test_psi_between_deployment_nodes_trains_on_the_intersection_like_the_local_engine(tmp_path, psi_keys):
    """Acceptance (issue 17): three tables with partly overlapping IDs, each node reading only its own,
    PSI routed by the ServerApp: the run trains on exactly the intersection, with the same numbers as
    ``fl-split train --data … --align psi`` (local engine, same seeds); no message holds an ID outside
    the intersection or a PSI key; no key is left in any node's state."""
    from fl_split.engine import run_experiment

    paths, inter, outside = _overlapping(tmp_path)
    seed = PrivateSeed.generate()
    grid = RecordingGrid(_nodes(tmp_path, paths, seed), fresh_process=True)
    cfg = RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", **RUN)
    dep = VerticalSplitStrategy(cfg).run(grid)
    keys = list(psi_keys)  # the deployment's: one per request (host) and per answer (guests)

    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    local = run_experiment(RunConfig(data=spec, align="psi", **RUN), private_seed=seed)
    assert dep["alignment"] == local["alignment"]
    assert dep["alignment"]["shared_ids"] == len(inter) and dep["alignment"]["psi_messages"] == 8
    assert dep["plan"]["n_train"] + dep["plan"]["n_test"] == len(inter)
    a, b = _strip(dep), _strip(local)
    for res in (a, b):
        res["config"].pop("data")
    assert a["history"] == b["history"] and a["final"] == b["final"] and a["privacy"] == b["privacy"]
    # the protocol's steps, in order, each at the party that performs it
    # (a guest's answer reaches the host with its next step; the widths after each party's encoding
    # are known once the lists are agreed: 2G + 3 round trips)
    assert grid.ops == [("host", "open"), ("guest-1", "open"), ("guest-2", "open"),
                        ("host", "psi-request"), ("guest-1", "psi-answer"),
                        ("host", "psi-request"), ("guest-2", "psi-answer"),
                        ("host", "psi-shared"), ("guest-1", "psi-accept"), ("guest-2", "psi-accept"),
                        ("host", "shapes"), ("guest-1", "shapes"), ("guest-2", "shapes")]
    wire = b"".join(grid.wire)
    assert _scan(wire, outside) == []
    assert _scan(wire, inter[:20]) != []  # the scan finds what is there: I is sent to the guests
    assert len(keys) == 4 and all(len(k) >= 16 and k not in wire and k.hex().encode() not in wire for k in keys)
    for ctx in grid.contexts.values():
        assert PSI_STATE not in ctx.state.config_records
        state = recorddict_to_proto(ctx.state).SerializeToString()
        assert not any(k in state for k in keys)


def test_public_alignment_between_deployment_nodes_publishes_the_hosts_ids(tmp_path):
    """``--align public`` in a deployment: the host's ID list goes to every guest (the built-in
    datasets' assumption), the same run as in one process; a guest missing some of the host's IDs
    fails with train's one line (inside the party's error)."""
    from fl_split.engine import run_experiment

    ids = np.sort(load_dataset("breast-cancer").ids)
    keep = {"host": ids[ids % 3 != 0], "guest-1": ids, "guest-2": ids[ids % 3 != 1]}
    paths = write_party_tables(tmp_path, keep=keep)
    seed = PrivateSeed.generate()
    grid = RecordingGrid(_nodes(tmp_path, paths, seed), fresh_process=True)
    with pytest.raises(PartyError) as err:
        VerticalSplitStrategy(RunConfig(data="node-tables", engine="flower", data_plane="flower", **RUN)).run(grid)
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    with pytest.raises(DataError) as want:
        run_experiment(RunConfig(data=spec, **RUN))
    assert err.value.party == "guest-2" and str(want.value) in str(err.value)

    keep["guest-2"] = ids
    paths = write_party_tables(tmp_path, keep=keep)
    grid = RecordingGrid(_nodes(tmp_path, paths, seed), fresh_process=True)
    dep = VerticalSplitStrategy(RunConfig(data="node-tables", engine="flower", data_plane="flower", **RUN)).run(grid)
    local = run_experiment(RunConfig(data=";".join(f"{p}={v}" for p, v in paths.items()), **RUN), private_seed=seed)
    assert dep["alignment"] == local["alignment"] == {"align": "public", "shared_ids": len(keep["host"])}
    assert dep["final"] == local["final"] and dep["history"][0]["train_loss"] == local["history"][0]["train_loss"]
    assert [op for _, op in grid.ops] == ["open"] * 3 + ["public-ids", "public-accept", "public-accept"] + ["shapes"] * 3


def test_bad_tables_give_trains_one_line_errors_in_a_deployment(tmp_path, capsys):
    """Missing ID column, duplicate IDs, a label column at a guest: the node's error is train's line
    (party, file, row, column), and ``deploy local`` refuses the tables with the same one line, exit 2,
    before anything is written or started."""
    import subprocess
    import sys

    import pandas as pd

    from fl_split.cli import main

    paths = write_party_tables(tmp_path)
    g1 = pd.read_csv(paths["guest-1"])
    dup = g1.copy()
    dup.loc[4, "ID"] = dup.loc[2, "ID"]
    labelled = g1.assign(Y=0)
    seed = PrivateSeed.generate()
    for name, frame in (("noid", g1.drop(columns=["ID"])), ("dup", dup), ("label", labelled)):
        bad = tmp_path / name / "guest-1.csv"
        bad.parent.mkdir()
        frame.to_csv(bad, index=False)
        tables = {**paths, "guest-1": str(bad)}
        code = main(["train", *data_flags(tables), "--guests", "2", "--align", "psi", "--no-progress"])
        line = capsys.readouterr().err.strip()
        assert code == 2 and len(line.splitlines()) == 1
        message = line.removeprefix("fl-split: error: ")
        grid = InlineGrid(_nodes(tmp_path / name, tables, seed))
        with pytest.raises(PartyError) as err:
            VerticalSplitStrategy(RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", **RUN)).run(grid)
        assert err.value.party == "guest-1" and message in str(err.value)
        workdir = tmp_path / name / "dep"
        proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "local", "--insecure",
                               *data_flags(tables), "--guests", "2", "--align", "psi", "--workdir", str(workdir)],
                              capture_output=True, text=True, timeout=300)
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("fl-split: warning: --insecure")]
        assert proc.returncode == 2 and errors == [line]
        assert not workdir.exists()


def _ctx(node_config):
    return Context(run_id=1, node_id=2, node_config=node_config, state=RecordDict(), run_config={})


def _req(cfg, **values):
    return R.request_of(R.content(config=R.dumps(cfg.to_flower()), **values))


def _shared_frame(host_role, cfg, inter):
    from fl_split.psi import encode

    return encode("shared-ids", "host", "guest-1", np.ascontiguousarray(inter, "<i8").tobytes())


def test_nodes_enforce_the_protocols_order(tmp_path):
    """A node answers the alignment steps only in the protocol's order: the host requests from the
    guests in turn and gives out the intersection only after every guest answered; a guest answers one
    request and accepts one intersection; nothing is accepted after the list is agreed."""
    from fl_split.psi import PsiParty

    paths, inter, _ = _overlapping(tmp_path)
    cfg = RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", **RUN)
    host_role = NodeRole("host", "host", 0, "deployment", paths["host"])
    g1_role = NodeRole("guest-1", "guest", 1, "deployment", paths["guest-1"])
    host, g1 = _ctx({}), _ctx({})
    with pytest.raises(ProtocolError, match="out of order"):
        handle_align(cfg, host_role, _req(cfg, op="psi-request", guest="guest-2"), host.state)
    with pytest.raises(ProtocolError, match="before every guest answered"):
        handle_align(cfg, host_role, _req(cfg, op="psi-shared"), host.state)
    with pytest.raises(ProtocolError, match="is for a guest"):
        handle_align(cfg, host_role, _req(cfg, op="psi-answer", frame=b"x"), host.state)
    req = handle_align(cfg, host_role, _req(cfg, op="psi-request", guest="guest-1"), host.state)["frame"]
    with pytest.raises(ProtocolError, match="out of order"):  # one request at a time
        handle_align(cfg, host_role, _req(cfg, op="psi-request", guest="guest-1"), host.state)
    ans = handle_align(cfg, g1_role, _req(cfg, op="psi-answer", frame=req), g1.state)
    with pytest.raises(ProtocolError, match="a guest answers one"):
        handle_align(cfg, g1_role, _req(cfg, op="psi-answer", frame=req), g1.state)
    # the host's state between messages: its candidates and, while a request is open, its key only
    assert set(host.state.config_records[PSI_STATE]) == {"candidates", "done", "key.guest-1"}
    with pytest.raises(ProtocolError, match="without a request"):  # an answer from a guest it did not ask
        handle_align(cfg, host_role, _req(cfg, op="psi-request", guest="guest-2", **{"receive-guest": "guest-2"},
                                          setup=ans["setup"], response=ans["response"]), host.state)
    handle_align(cfg, host_role, _req(cfg, op="psi-request", guest="guest-2", **{"receive-guest": "guest-1"},
                                      setup=ans["setup"], response=ans["response"]), host.state)
    assert set(host.state.config_records[PSI_STATE]) == {"candidates", "done", "key.guest-2"}
    with pytest.raises(ProtocolError, match="'shapes' before this node agreed"):
        handle_align(cfg, g1_role, _req(cfg, op="shapes", **{"input-shapes": R.dumps({})}), g1.state)
    with pytest.raises(ProtocolError, match="not int64s|does not hold|not sorted"):
        handle_align(cfg, g1_role, _req(cfg, op="psi-accept", frame=PsiParty("host", [1]).shared_ids("guest-1")),
                     g1.state)
    # a node reading a party file (not its own table) takes no alignment step
    with pytest.raises(ProtocolError, match="node-tables"):
        handle_align(RunConfig(**{**RUN, "id_column": "id", "label_column": "label"}), host_role,
                     _req(cfg, op="open"), _ctx({}).state)
    assert ALIGNED not in g1.state.config_records
    # the accept answers with the width of the guest's own encoding; the coordinator's list must agree
    shape = R.loads(handle_align(cfg, g1_role, _req(cfg, op="psi-accept", frame=_shared_frame(host_role, cfg, inter)),
                                 g1.state)["input-shape"])
    assert len(shape) == 1 and shape[0] > 0
    with pytest.raises(ProtocolError, match=r"lists input shape \[1\] for this party"):
        handle_align(cfg, g1_role, _req(cfg, op="shapes", **{"input-shapes": R.dumps({"guest-1": [1]})}), g1.state)
    handle_align(cfg, g1_role, _req(cfg, op="shapes", **{"input-shapes": R.dumps({"guest-1": shape})}), g1.state)
    with pytest.raises(ProtocolError, match="'shapes' again after"):
        handle_align(cfg, g1_role, _req(cfg, op="shapes", **{"input-shapes": R.dumps({"guest-1": shape})}), g1.state)


def test_host_psi_state_survives_a_fresh_process():
    """The host's candidates and its pending key restored from its exported state give the same
    intersection as the live object (what a fresh ClientApp process of a deployment node does)."""
    from fl_split.psi import PsiParty, align_by_psi

    host_ids, guest_ids = np.arange(0, 60), np.arange(30, 90)
    live = PsiParty("host", host_ids)
    req = live.request("guest-1")
    restored = PsiParty.import_host("host", host_ids, live.export_host())
    setup, response = PsiParty("guest-1", guest_ids).answer(req)
    assert restored.receive("guest-1", setup, response) == 30
    np.testing.assert_array_equal(restored.intersection, align_by_psi({"host": host_ids, "guest-1": guest_ids}))
    with pytest.raises(ProtocolError, match="damaged PSI state"):
        PsiParty.import_host("host", host_ids, {"candidates": np.asarray([5, 500], "<i8").tobytes()})


def test_node_tables_is_for_a_deployment(tmp_path):
    from fl_split.builder import prepare_data
    from fl_split.errors import ConfigError

    with pytest.raises(ConfigError, match="for a Flower deployment"):
        prepare_data(RunConfig(data="node-tables", guests=2))
    with pytest.raises(ConfigError, match="padding"):
        RunConfig(data="node-tables", padding=True)
    with pytest.raises(ConfigError, match="columns"):
        RunConfig(data="node-tables", columns="host=a;guest-1=b")


@pytest.mark.slow
def test_deploy_local_aligns_own_tables_between_the_nodes(tmp_path):
    """End to end (separate processes, a SuperLink, three SuperNodes): ``deploy local --data host=…
    --data guest-1=… --data guest-2=… --align psi``; each SuperNode gets its own table (node-config
    data-path), the run config names no table, nothing is exported; the run trains on exactly the
    intersection, equals the local engine on the same tables and seed, and no result, log line, output
    or SuperLink database holds an ID outside the intersection."""
    import subprocess
    import sys

    from tests.test_deploy import _deployment_pids, _kill

    paths, inter, outside = _overlapping(tmp_path)
    seed = write_private(tmp_path / "seed", PrivateSeed.generate().file_text().encode())
    run = ["--guests", "2", "--seed", str(SEED), "--epochs", "1", "--batch-size", "64", "--private-seed-file", str(seed)]
    workdir, out = tmp_path / "dep", tmp_path / "dep.json"
    proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "local", "--insecure", *data_flags(paths),
                           "--align", "psi", *run, "--workdir", str(workdir), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    left = _deployment_pids(workdir)
    _kill(left)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == []
    assert not (workdir / "parties").exists()
    run_config = (workdir / "run-config.toml").read_text()
    assert "data = \"node-tables\"" in run_config and "host.csv" not in run_config
    dep = json.loads(out.read_text())
    local_out = tmp_path / "local.json"
    from fl_split.cli import main

    assert main(["train", *data_flags(paths), "--align", "psi", *run, "--no-progress", "--out", str(local_out)]) == 0
    local = json.loads(local_out.read_text())
    assert dep["alignment"] == local["alignment"] and dep["alignment"]["shared_ids"] == len(inter)
    assert dep["plan"]["n_train"] + dep["plan"]["n_test"] == len(inter)
    assert dep["final"]["value"] == local["final"]["value"]
    assert dep["final"]["train_loss"] == pytest.approx(local["final"]["train_loss"], rel=1e-6)
    assert "alignment: private set intersection" in proc.stdout
    seen = out.read_bytes() + proc.stdout.encode() + proc.stderr.encode()
    seen += b"".join(p.read_bytes() for p in (workdir / "logs").glob("*.log"))
    seen += b"".join(p.read_bytes() for p in workdir.glob("superlink.db*"))
    assert _scan(seen, outside) == []
