"""The prediction job in a deployment (issue 24, :mod:`fl_split.flower.predicting`,
:mod:`fl_split.deploy_predict`): each SuperNode loads its own part from its node-config ``model-dir``
and reads its own new table (``data-path``), the new IDs are aligned by PSI, each guest charges its own
inference ledger, the host writes the predictions (``predict-out``).

The fast tests run the real coordinator and ClientApp handler over ``tests.test_flower.InlineGrid``
with deployment node configs and ``fresh_process=True`` (every message continues from the node's
``context.state`` alone). One slow test trains with ``fl-split deploy local --save-model`` and predicts
with ``fl-split predict --engine deploy-local`` (separate processes, PSI on the new IDs)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fl_split.builder import prepare_data
from fl_split.config import RunConfig
from fl_split.errors import PartyError
from fl_split.flower.predicting import federation_config, job_spec, predict_job
from fl_split.serving import load_part
from tests.test_deploy_align import PARTIES, RUN, RecordingGrid, _overlapping, _scan

pytestmark = pytest.mark.usefixtures("flower_task_identity")
PS_HEX = "c41f7e09b2d86a35f0e1947cd2b85a6e"


def _train(tmp_path, paths, **kw):
    from fl_split.engine import run_experiment
    from fl_split.seeding import PrivateSeed

    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    cfg = RunConfig(data=spec, align="psi", save_model=str(tmp_path / "model"), **{**RUN, "epochs": 2, **kw})
    return cfg, run_experiment(cfg, PrivateSeed.parse(PS_HEX))


def _new_tables(tmp_path, paths, ids, tag="new"):
    """Each party's new table: its rows of ``ids`` (in its own order)."""
    out = {}
    for p, path in paths.items():
        frame = pd.read_csv(path)
        out[p] = str(tmp_path / f"{tag}-{p}.csv")
        frame[frame.ID.isin(ids)].to_csv(out[p], index=False)
    return out


def _node_configs(tables, model, pred) -> list[dict]:
    """Deployment node configs: each party its own new table and the folder of its own part."""
    out = []
    for p in PARTIES:
        role = {"role": "host", "predict-out": str(pred)} if p == "host" else {"role": "guest",
                                                                               "guest-index": int(p.split("-")[1])}
        out.append({**role, "data-path": tables[p], "model-dir": str(model)})
    return out


def _job(model, align="psi", budget=None):
    host = load_part(model, "host")[0]
    return federation_config(host["config"], 2), job_spec("ID", "Y", align, budget, 2)


def test_deployment_nodes_predict_the_runs_metrics_with_psi_and_send_no_id(tmp_path):
    """Acceptance: train (PSI on three partly overlapping tables) → save → each deployment node predicts
    with its own part on its own new table, whose IDs are the run's test rows plus IDs outside the
    intersection: PSI scores exactly the test rows, with exactly the run's metrics; no message holds
    an ID (none outside the intersection, none in it) nor any weight file's bytes."""
    paths, inter, outside = _overlapping(tmp_path)
    cfg, res = _train(tmp_path, paths)
    test_ids = prepare_data(cfg).test_ids
    tables = _new_tables(tmp_path, paths, np.concatenate([test_ids, outside]))
    grid = RecordingGrid(_node_configs(tables, tmp_path / "model", tmp_path / "pred.csv"), fresh_process=True)
    s = predict_job(grid, *_job(tmp_path / "model"))
    assert s["records"] == len(test_ids) and s["alignment"]["shared_ids"] == len(test_ids)
    assert s["metrics"] == res["final"]["metrics"]
    pred = pd.read_csv(tmp_path / "pred.csv")
    assert sorted(pred.ID) == sorted(test_ids) and (tmp_path / "pred.csv").stat().st_mode & 0o077 == 0
    # open (with the PSI start), N - 1 = 2 blinding rounds, finish; then the guests release, the host scores
    assert grid.ops == [*((p, op) for op in ("open", "psi-blind", "psi-blind", "psi-finish") for p in PARTIES),
                        ("guest-1", "release"), ("guest-2", "release"), ("host", "score")]
    wire = b"".join(grid.wire)
    assert _scan(wire, outside) == [] and _scan(wire, inter) == []
    # every field that crossed, both ways: the role query, then the job's (no ID list with PSI, no weights)
    assert grid.keys == {"worker", "role", "job", "op", "manifest", "frame", "digest", "value", "privacy",
                         "released.guest-1", "released.guest-2", "summary"}
    # the host's predictions file stays its own (the role query's reply names each node's data-path, as in training)
    assert str(tmp_path / "pred.csv").encode() not in wire
    for p in PARTIES:  # nor any weight
        assert (tmp_path / "model" / p / "model.pt").read_bytes()[-4096:] not in wire


def test_deployment_nodes_train_save_and_predict_the_runs_metrics(tmp_path):
    """Train on deployment nodes that read their own tables (PSI), each saving its own part into its
    node-config model-dir at the end of the run; then predict on the same kind of nodes with PSI on the
    held-out rows: the parts make one model (a guest, which never sees the labels, takes the run's
    public task and outputs from the report request) and the metrics are exactly the run's."""
    from fl_split.flower.strategy import VerticalSplitStrategy
    from fl_split.seeding import PrivateSeed
    from fl_split.secure_files import write_private

    paths, inter, outside = _overlapping(tmp_path)
    seed = PrivateSeed.parse(PS_HEX)
    nodes = []
    for p in PARTIES:
        f = write_private(tmp_path / f"seed-{p}", seed.for_party(p).file_text().encode())
        role = {"role": "host"} if p == "host" else {"role": "guest", "guest-index": int(p.split("-")[1])}
        nodes.append({**role, "data-path": paths[p], "private-seed-file": str(f), "model-dir": str(tmp_path / "model")})
    cfg = RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", save_model="saved",
                    **RUN)
    res = VerticalSplitStrategy(cfg).run(RecordingGrid(nodes, fresh_process=True))
    assert {load_part(tmp_path / "model", p)[0]["task"] for p in PARTIES} == {"binary"}
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    test_ids = prepare_data(RunConfig(data=spec, align="psi", **RUN)).test_ids
    tables = _new_tables(tmp_path, paths, np.concatenate([test_ids, outside]))
    grid = RecordingGrid(_node_configs(tables, tmp_path / "model", tmp_path / "pred.csv"), fresh_process=True)
    s = predict_job(grid, *_job(tmp_path / "model"))
    assert s["records"] == len(test_ids) and s["metrics"] == res["final"]["metrics"]


def test_deployment_nodes_charge_their_own_inference_ledgers(tmp_path):
    """Each guest node charges the inference ledger beside its own part, one release per scored record;
    a second job composes on the same ledger (Laplace, ε = 2 per release: basic ε 4 exactly)."""
    from fl_split.privacy.ledger import Ledger
    from fl_split.state import unflatten

    paths, inter, _ = _overlapping(tmp_path)
    cfg, _ = _train(tmp_path, paths, defense="laplace", epsilon=2.0, accountant="basic")
    ids = prepare_data(cfg).test_ids[:40]
    tables = _new_tables(tmp_path, paths, ids)
    eps = []
    for _ in range(2):
        grid = RecordingGrid(_node_configs(tables, tmp_path / "model", tmp_path / "pred.csv"), fresh_process=True)
        s = predict_job(grid, *_job(tmp_path / "model", align="public"))
        assert [s["privacy"][g]["records"] for g in ("guest-1", "guest-2")] == [40, 40]
        assert all(s["privacy"][g]["covered"] for g in ("guest-1", "guest-2"))
        eps.append(s["privacy"]["guest-1"]["epsilon"])
    assert eps == [pytest.approx(2.0), pytest.approx(4.0)]  # basic accountant: 2 per release of a record
    for g in ("guest-1", "guest-2"):
        state = dict(np.load(tmp_path / "model" / g / "inference-ledger.npz", allow_pickle=False))
        ledger = Ledger.from_state(unflatten(state, json.loads(str(state.pop("__skeleton__")))))
        assert len(ledger) == 2 and ledger.releases == 2 * 40 and ledger.releases_per_record() == 2
    assert not (tmp_path / "model" / "host" / "inference-ledger.npz").exists()  # the host releases nothing


def test_a_deployment_node_takes_its_files_from_its_own_node_config(tmp_path):
    """The coordinator does not choose a party's files: a job naming paths is refused by the node; a
    node without model-dir (or a host without predict-out) says which node-config key is missing."""
    paths, _, _ = _overlapping(tmp_path)
    cfg, _ = _train(tmp_path, paths, epochs=1)
    tables = _new_tables(tmp_path, paths, prepare_data(cfg).test_ids)
    conf, spec = _job(tmp_path / "model")
    with pytest.raises(PartyError, match="names files; in a deployment each SuperNode takes its own"):
        bad = {**spec, "model": str(tmp_path / "model"), "tables": tables, "out": str(tmp_path / "x.csv")}
        predict_job(RecordingGrid(_node_configs(tables, tmp_path / "model", tmp_path / "p.csv")), conf, bad)
    nodes = _node_configs(tables, tmp_path / "model", tmp_path / "p.csv")
    nodes[1].pop("model-dir")
    with pytest.raises(PartyError, match="guest-1 node-config: no model-dir"):
        predict_job(RecordingGrid(nodes), conf, spec)
    nodes = _node_configs(tables, tmp_path / "model", tmp_path / "p.csv")
    nodes[0].pop("predict-out")
    with pytest.raises(PartyError, match="host node-config: no predict-out"):
        predict_job(RecordingGrid(nodes), conf, spec)


@pytest.mark.slow
def test_deploy_local_trains_saves_and_predicts_the_runs_metrics(tmp_path):
    """End to end (separate processes): ``deploy local --save-model DIR`` trains on three partly
    overlapping tables (PSI), each SuperNode writes its own part (node-config model-dir) and the
    results record the saved model as ``train``'s do;
    ``fl-split predict --engine deploy-local`` then scores the held-out rows — new tables that also
    hold IDs outside the intersection, aligned by PSI — with exactly the metrics the deployment
    reported; the guests say their releases are not covered (no defence); no log, result or SuperLink
    database holds an ID outside the intersection; nothing is left running; the recorded model, loaded
    in the test's process, predicts the same rows as the deployment's nodes."""
    import subprocess
    import sys

    from fl_split.deploy_predict import deploy_predict
    from fl_split.seeding import PrivateSeed
    from fl_split.secure_files import write_private
    from tests.test_deploy import _deployment_pids, _kill
    from tests.test_own_data import data_flags

    paths, inter, outside = _overlapping(tmp_path)
    seed = write_private(tmp_path / "seed", PrivateSeed.generate().file_text().encode())
    run = ["--guests", "2", "--seed", str(RUN["seed"]), "--epochs", "1", "--batch-size", "64", "--private-seed-file",
           str(seed), "--node-timeout", "600"]
    model, out = tmp_path / "model", tmp_path / "dep.json"
    proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "local", "--insecure", *data_flags(paths),
                           "--align", "psi", *run, "--save-model", str(model), "--workdir", str(tmp_path / "train"),
                           "--out", str(out)], capture_output=True, text=True, timeout=1500)
    left = _deployment_pids(tmp_path / "train")
    _kill(left)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dep = json.loads(out.read_text())
    saved = dep["saved_model"]  # recorded as `fl-split train --save-model` records it
    assert saved == {"dir": str(model.resolve()), "parties": list(PARTIES)}
    assert sorted(q.name for q in model.iterdir()) == sorted(PARTIES)  # each node wrote its own part
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    test_ids = prepare_data(RunConfig(data=spec, align="psi", **RUN)).test_ids
    tables = _new_tables(tmp_path, paths, np.concatenate([test_ids, outside]))
    lines: list[str] = []
    workdir = tmp_path / "predict"
    s = deploy_predict(saved["dir"], tables, "ID", str(tmp_path / "pred.csv"), align="psi", label_column="Y",
                       workdir=str(workdir), tls=False, echo=lines.append)
    left = _deployment_pids(workdir)
    _kill(left)
    assert left == []
    assert s["records"] == len(test_ids) and s["alignment"]["shared_ids"] == len(test_ids)
    assert s["metrics"] == dep["final"]["metrics"]
    assert not any(s["privacy"][g]["covered"] for g in ("guest-1", "guest-2"))
    assert sorted(pd.read_csv(tmp_path / "pred.csv").ID) == sorted(test_ids)
    # the recorded model, loaded in this process, predicts what the deployment's nodes predicted
    from fl_split.predict import predict

    here = predict(saved["dir"], tables, "ID", str(tmp_path / "here.csv"), align="psi", label_column="Y")
    assert here["metrics"] == pytest.approx(s["metrics"])
    mine, theirs = (pd.read_csv(tmp_path / f).sort_values("ID").reset_index(drop=True) for f in ("here.csv", "pred.csv"))
    assert list(mine.columns) == ["ID", "p_0", "p_1", "predicted"]
    pd.testing.assert_frame_equal(mine, theirs)
    run_config = (workdir / "run-config.toml").read_text()
    assert "predict-job = " in run_config and "new-host.csv" not in run_config and str(model) not in run_config
    seen = "\n".join(lines).encode() + json.dumps(s).encode()
    seen += b"".join(p.read_bytes() for p in (workdir / "logs").glob("*.log"))
    seen += b"".join(p.read_bytes() for p in workdir.glob("superlink.db*"))
    assert _scan(seen, outside) == []


def test_a_guests_node_config_limits_hold_against_the_coordinators_job(tmp_path):
    """The repeated-predict attack on deployment nodes (docs/serving.md "Inference limits"): a
    coordinator whose jobs carry a huge budget and cap asks for the same 20 IDs 50 times. Each guest's
    own node config (guest-1: max-queries-per-id 2; guest-2: none set, the default 3) refuses past its
    cap: a one-line PartyError at the coordinator naming the guest, the same line in the guest's log,
    nothing released (the host writes no predictions) and its ledger and query files unchanged (on the
    call where guest-1 first refuses, guest-2, still under its own cap, released and stays charged:
    each guest's limits are its own).
    A job that sets the guests' own limits, and a node-config limit that is not one, are refused."""
    import logging

    from tests.test_threat_model import _files_of

    paths, _, _ = _overlapping(tmp_path)
    cfg, _ = _train(tmp_path, paths, defense="gaussian", protect="guest", sigma=0.7)
    tables = _new_tables(tmp_path, paths, prepare_data(cfg).test_ids[:20])
    nodes = _node_configs(tables, tmp_path / "model", tmp_path / "pred.csv")
    nodes[1]["max-queries-per-id"] = 2
    conf, _ = _job(tmp_path / "model")
    job = job_spec("ID", "Y", "public", 1e12, 2, max_queries_per_id=10**6)  # the coordinator's: no tightening
    done, refused = [], []
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("fl_split.flower").addHandler(handler)
    try:
        for _ in range(50):
            before = {g: _files_of(tmp_path / "model" / g) for g in ("guest-1", "guest-2")}
            (tmp_path / "pred.csv").unlink(missing_ok=True)
            try:
                done.append(predict_job(RecordingGrid(nodes, fresh_process=True), conf, job))
            except PartyError as exc:
                refused.append(str(exc))
                assert {g: _files_of(tmp_path / "model" / g) for g in before} == before or len(refused) == 1
                assert not (tmp_path / "pred.csv").exists()
    finally:
        logging.getLogger("fl_split.flower").removeHandler(handler)
    assert len(done) == 2 and len(refused) == 48
    assert all(len(r.splitlines()) == 1 and "guest-1" in r and "per-ID query cap reached" in r for r in refused)
    assert sum("guest-1: release refused, per-ID query cap reached" in line for line in logs) == 48
    assert [d["privacy"]["guest-1"]["limits"]["max_queries_per_id"] for d in done] == [2, 2]
    assert [d["privacy"]["guest-2"]["limits"]["max_queries_per_id"] for d in done] == [3, 3]
    # the coordinator does not set a guest's own limits; a node-config value that is not a limit is one line
    with pytest.raises(PartyError, match="sets the guests' own inference limits"):
        predict_job(RecordingGrid(nodes), conf, {**job, "limits": {"budget": 1e12, "max_queries_per_id": 10**6}})
    nodes[2]["max-queries-per-id"] = 0
    with pytest.raises(PartyError, match="guest-2 node-config: inference-budget='', max-queries-per-id='0'"):
        predict_job(RecordingGrid(nodes), conf, job)
