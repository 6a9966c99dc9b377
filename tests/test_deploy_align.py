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
from fl_split.flower.predicting import MSG_PREDICT
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
    SuperLink stores it, in ``wire``) that also notes each alignment (or prediction) step and who got it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ops: list[tuple[str, str]] = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type in (MSG_ALIGN, MSG_PREDICT):  # (the prediction job's steps too)
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
    """Every PSI secret (key, permutation seed) a party makes in this process."""
    import fl_split.psi as psi

    keys: list[bytes] = []
    made = psi.fresh_secret

    def fresh():
        keys.append(made())
        return keys[-1]

    monkeypatch.setattr(psi, "fresh_secret", fresh)
    return keys


def _timeless(alignment: dict) -> dict:
    return {k: v for k, v in alignment.items() if k != "time_s"}


def test_psi_between_deployment_nodes_trains_on_the_intersection_like_the_local_engine(tmp_path, psi_keys):
    """Acceptance (issue 17): three tables with partly overlapping IDs, each node reading only its own,
    PSI routed by the ServerApp: the run trains on exactly the intersection, with the same numbers as
    ``fl-split train --data … --align psi`` (local engine, same seeds); no message holds an ID (the
    intersection neither: each node maps its positions itself) or a PSI secret; no secret is left in
    any node's state."""
    from fl_split.engine import run_experiment

    paths, inter, outside = _overlapping(tmp_path)
    seed = PrivateSeed.generate()
    grid = RecordingGrid(_nodes(tmp_path, paths, seed), fresh_process=True)
    cfg = RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", **RUN)
    dep = VerticalSplitStrategy(cfg).run(grid)
    keys = list(psi_keys)  # the deployment's: a key and a permutation seed per node

    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    local = run_experiment(RunConfig(data=spec, align="psi", **RUN), private_seed=seed)
    assert _timeless(dep["alignment"]) == _timeless(local["alignment"])
    assert dep["alignment"]["time_s"] > 0 and local["alignment"]["time_s"] > 0
    # N (N + 1) frames for N = 3: 3 starts, 3 lists in each of 2 rounds, 3 position lists
    assert dep["alignment"]["shared_ids"] == len(inter) and dep["alignment"]["psi_messages"] == 12
    assert dep["plan"]["n_train"] + dep["plan"]["n_test"] == len(inter)
    a, b = _strip(dep), _strip(local)
    for res in (a, b):
        res["config"].pop("data")
    assert a["history"] == b["history"] and a["final"] == b["final"] and a["privacy"] == b["privacy"]
    # the protocol's rounds, each one message to every node (the start rides on 'open'), then the widths
    # after each party's own encoding (known once the list is agreed): G + 3 round trips
    every = ("host", "guest-1", "guest-2")
    assert grid.ops == [(p, op) for op in ("open", "psi-blind", "psi-blind", "psi-finish", "shapes") for p in every]
    wire = b"".join(grid.wire)
    assert _scan(wire, outside) == [] and _scan(wire, inter) == []
    assert _scan(np.asarray(inter[:3], "<i8").tobytes(), inter[:3]) != []  # the scan finds what is there
    assert len(keys) == 6 and all(len(k) >= 16 and k not in wire and k.hex().encode() not in wire for k in keys)
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
        capsys.readouterr()  # the previous table's in-process nodes told their operators (stderr) why they failed
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


def test_nodes_enforce_the_protocols_order(tmp_path):
    """A node takes the PSI steps only in the protocol's order: one start (with 'open'), one list per
    round from its ring predecessor, the positions once after its last round; its state between
    messages holds its key only until its last round; nothing is accepted after the list is agreed."""
    from fl_split.psi import COORDINATOR, encode, list_frame, read_list, sizes_frame

    paths, inter, _ = _overlapping(tmp_path)
    cfg = RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", **RUN)
    roles = {p: NodeRole(p, "host" if p == "host" else "guest", i, "deployment", paths[p])
             for i, p in enumerate(PARTIES)}
    ctx = {p: _ctx({}) for p in PARTIES}

    def step(p, op, **kw):
        return handle_align(cfg, roles[p], _req(cfg, op=op, **kw), ctx[p].state)

    with pytest.raises(ProtocolError, match="before this node's PSI start"):
        step("host", "psi-blind", frame=b"x")
    with pytest.raises(ProtocolError, match="'shapes' before this node agreed"):
        step("guest-1", "shapes", **{"input-shapes": R.dumps({})})
    frames = {p: step(p, "open", **{"psi-start": True})["frame"] for p in PARTIES}
    assert set(ctx["host"].state.config_records[PSI_STATE]) == {"round", "perm-seed", "key"}
    with pytest.raises(ProtocolError, match="second PSI start"):
        step("host", "open", **{"psi-start": True})
    with pytest.raises(ProtocolError, match="before its last round"):
        step("host", "psi-finish", frame=encode("positions", COORDINATOR, "host", b""), **{"input-shapes": "{}"})
    # round 1: the coordinator's announced sizes, around the list; without them nothing is blinded
    sizes = [len(read_list(frames[p], p, PARTIES[(i + 1) % 3])[2]) for i, p in enumerate(PARTIES)]
    with pytest.raises(ProtocolError, match="expected 'sizes'"):
        step("host", "psi-blind", frame=frames["guest-2"])
    # the host blinds guest-2's list (its ring predecessor's), not guest-1's
    with pytest.raises(ProtocolError, match="expected guest-2 to host"):
        step("host", "psi-blind", frame=sizes_frame("host", sizes, frames["guest-1"]))
    out = step("host", "psi-blind", frame=sizes_frame("host", sizes, frames["guest-2"]))["frame"]
    g1 = step("guest-1", "psi-blind", frame=sizes_frame("guest-1", sizes, frames["host"]))["frame"]
    n2 = sizes[2]
    # a replayed start list of the host (origin 0, hop 1) is not guest-1's round-2 list
    with pytest.raises(ProtocolError, match="expected origin 2 after 2"):
        step("guest-1", "psi-blind", frame=list_frame("host", "guest-1", 0, 1, np.zeros((3, 32), np.uint8)))
    # a list longer than its origin announced is refused before any of it is blinded
    with pytest.raises(ProtocolError, match=f"guest-2 with {n2 + 1:,} values, but guest-2 announced {n2:,}"):
        step("guest-1", "psi-blind", frame=list_frame("host", "guest-1", 2, 2, np.zeros((n2 + 1, 32), np.uint8)))
    # a value of small order (u = 0) or not canonical (bit 255 set) is refused
    with pytest.raises(ProtocolError, match="small order"):
        step("guest-1", "psi-blind", frame=list_frame("host", "guest-1", 2, 2, np.zeros((n2, 32), np.uint8)))
    with pytest.raises(ProtocolError, match="not canonical"):
        step("guest-1", "psi-blind", frame=list_frame("host", "guest-1", 2, 2, np.full((n2, 32), 0xFF, np.uint8)))
    step("guest-1", "psi-blind", frame=out)
    assert set(ctx["guest-1"].state.config_records[PSI_STATE]) == {"round", "perm-seed", "sizes"}  # its key is gone
    with pytest.raises(ProtocolError, match="one list per round"):  # a third list: no oracle
        step("guest-1", "psi-blind", frame=g1)
    with pytest.raises(ProtocolError, match="not sorted, unique and inside"):
        step("guest-1", "psi-finish", frame=encode("positions", COORDINATOR, "guest-1",
                                                  np.asarray([10**6], "<u4").tobytes()), **{"input-shapes": "{}"})
    # a node reading a party file (not its own table) takes no alignment step
    with pytest.raises(ProtocolError, match="node-tables"):
        handle_align(RunConfig(**{**RUN, "id_column": "id", "label_column": "label"}), roles["host"],
                     _req(cfg, op="open"), _ctx({}).state)
    assert ALIGNED not in ctx["guest-1"].state.config_records


def test_psi_state_survives_a_fresh_process():
    """Each party restored from its exported state after every step (what a fresh ClientApp process
    of a deployment node does) finds the same intersection as the live objects."""
    from fl_split.psi import PsiParty, align_by_psi, ids_digest, run_psi

    ids = {"host": np.arange(0, 60), "guest-1": np.arange(30, 90), "guest-2": np.arange(20, 50)}
    order = list(ids)
    state: dict[str, dict] = {}

    class Restarting:
        found: dict[str, np.ndarray] = {}

        def _run(self, p, step, blob=None):
            party = PsiParty.import_state(p, ids[p], order, state[p]) if p in state else PsiParty(p, ids[p], order)
            out = step(party) if blob is None else step(party, blob)
            state[p] = party.export_state()
            return out

        def start(self, parties):
            return {p: self._run(p, PsiParty.start) for p in parties}

        def hop(self, frames):  # round 1's lists come inside the coordinator's announced sizes
            return {p: self._run(p, PsiParty.hop, b) for p, b in frames.items()}

        def finish(self, frames):
            self.found = {p: self._run(p, PsiParty.finish, b) for p, b in frames.items()}
            return {p: ids_digest(v) for p, v in self.found.items()}

    route = Restarting()
    assert run_psi(route, order) == 20
    for p in order:
        np.testing.assert_array_equal(route.found[p], np.arange(30, 50))
    np.testing.assert_array_equal(align_by_psi(ids), np.arange(30, 50))
    with pytest.raises(ProtocolError, match="damaged PSI state"):
        PsiParty.import_state("host", ids["host"], order, {"round": 1, "perm-seed": b"x" * 32})  # its key is due


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
def test_deploy_local_aligns_own_tables_between_the_nodes(psi_table_deployment):
    """End to end (separate processes, a SuperLink, three SuperNodes): ``deploy local --data host=…
    --data guest-1=… --data guest-2=… --align psi``; each SuperNode gets its own table (node-config
    data-path), the run config names no table, nothing is exported; the run trains on exactly the
    intersection, equals the local engine on the same tables and seed, and no result, log line, output
    or SuperLink database holds an ID outside the intersection. (The session's shared run on e-mail
    IDs, tests/shared_runs.py, which tests/test_join_keys.py checks for text IDs; the scan looks for
    each outside ID as text and as its int64 key.)"""
    from tests.test_join_keys import _scan as _scan_texts

    run = psi_table_deployment
    workdir = run.workdir
    assert run.proc.returncode == 0, run.proc.stdout[-3000:] + run.proc.stderr[-3000:]
    assert run.left == []
    assert not (workdir / "parties").exists()
    run_config = (workdir / "run-config.toml").read_text()
    assert "data = \"node-tables\"" in run_config and "host.csv" not in run_config
    dep, local = run.dep, run.local
    assert local is not None, "the local engine's run failed"
    assert _timeless(dep["alignment"]) == _timeless(local["alignment"])
    assert dep["alignment"]["shared_ids"] == len(run.inter)
    assert dep["plan"]["n_train"] + dep["plan"]["n_test"] == len(run.inter)
    assert dep["final"]["value"] == local["final"]["value"]
    assert dep["final"]["train_loss"] == pytest.approx(local["final"]["train_loss"], rel=1e-6)
    assert "alignment: private set intersection" in run.proc.stdout
    assert (workdir / "logs").is_dir() and list(workdir.glob("superlink.db*")) == []  # its state in memory
    assert _scan_texts(run.seen, run.outside) == []
