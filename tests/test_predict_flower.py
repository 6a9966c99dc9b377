"""``fl-split predict`` as a Flower job (issue 24, docs/serving.md "Prediction as a Flower job"):
in a simulation each virtual SuperNode loads its own saved part and reads its own new table; PSI on
the new IDs scores their intersection; the metrics equal the training run's on the same rows; each
guest's inference ledger is charged one release per new record, the same ledger a one-process
``predict`` adds to."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fl_split.builder import prepare_data
from fl_split.errors import ConfigError
from tests.test_save_predict import _rows, _tables, _train


def _with_extra_rows(paths, new, train_ids):
    """The host's new table gets 4 training IDs the guest's lacks, the guest's 6 the host's lacks."""
    host = pd.concat([pd.read_csv(new["host"]), pd.read_csv(paths["host"]).query("ID in @train_ids[:4]")])
    guest = pd.concat([pd.read_csv(new["guest-1"]), pd.read_csv(paths["guest-1"]).query("ID in @train_ids[4:10]")])
    host.to_csv(new["host"], index=False)
    guest.to_csv(new["guest-1"], index=False)
    return {p: str(v) for p, v in new.items()}


def test_flower_predict_with_psi_gives_the_runs_metrics(tmp_path):
    from fl_split.flower.predict_sim import predict_flower

    paths = _tables(tmp_path, guests=1)
    cfg, res = _train(tmp_path, paths)
    prepared = prepare_data(cfg)
    tables = _with_extra_rows(paths, _rows(tmp_path, paths, prepared.test_ids), prepared.train_ids)
    s = predict_flower(str(tmp_path / "model"), tables, "ID", str(tmp_path / "pf.csv"), align="psi",
                       label_column="Y")
    assert s["records"] == len(prepared.test_ids) and s["alignment"]["shared_ids"] == len(prepared.test_ids)
    assert s["alignment"]["align"] == "psi" and s["alignment"]["psi_messages"] > 0
    assert s["metrics"] == res["final"]["metrics"]  # the same modules on the same rows: exactly
    pred = pd.read_csv(tmp_path / "pf.csv")
    assert list(pred.columns) == ["ID", "p_0", "p_1", "predicted"] and sorted(pred.ID) == sorted(prepared.test_ids)
    assert (tmp_path / "pf.csv").stat().st_mode & 0o077 == 0  # the host's, owner-only
    assert not s["privacy"]["guest-1"]["covered"]  # --defense none: said plainly


def test_flower_predict_charges_each_guests_inference_ledger(tmp_path):
    from fl_split.flower.predict_sim import predict_flower
    from fl_split.predict import predict
    from fl_split.privacy.ledger import Ledger
    from fl_split.state import unflatten

    paths = _tables(tmp_path, guests=1)
    cfg, _ = _train(tmp_path, paths, defense="laplace", epsilon=2.0)
    ids = prepare_data(cfg).test_ids[:40]
    new = {p: str(v) for p, v in _rows(tmp_path, paths, ids).items()}
    model = str(tmp_path / "model")
    s = predict_flower(model, new, "ID", str(tmp_path / "pf.csv"), label_column="Y")
    g = s["privacy"]["guest-1"]
    assert g["covered"] and g["records"] == 40 and 0 < g["epsilon"] <= 2.0 + 1e-9
    s2 = predict(model, new, "ID", str(tmp_path / "p.csv"), label_column="Y")  # the same ledger, one process
    state = dict(np.load(tmp_path / "model" / "guest-1" / "inference-ledger.npz", allow_pickle=False))
    ledger = Ledger.from_state(unflatten(state, json.loads(str(state.pop("__skeleton__")))))
    assert len(ledger) == 2 and ledger.releases == 2 * 40 and ledger.releases_per_record() == 2
    assert ledger.epsilon("basic") == pytest.approx(4.0, rel=1e-12)  # ε = 2 per release, basic composition
    assert g["epsilon"] < s2["privacy"]["guest-1"]["epsilon"] <= 4.0 + 1e-9


def test_flower_predict_refuses_a_missing_party_table(tmp_path):
    from fl_split.flower.predicting import job_spec
    from fl_split.flower.predict_sim import predict_flower

    paths = _tables(tmp_path, guests=1)
    _train(tmp_path, paths)
    with pytest.raises(ConfigError, match="one new table per party"):
        predict_flower(str(tmp_path / "model"), {"host": str(paths["host"])}, "ID", str(tmp_path / "p.csv"))
    with pytest.raises(ConfigError, match="align"):
        job_spec("ID", "Y", "hash", None, 1)


def test_predict_deploy_local_needs_a_workdir(tmp_path, capsys):
    from fl_split.cli import main

    code = main(["predict", "--engine", "deploy-local", "--model", str(tmp_path / "m"), "--data", "host=h.csv",
                 "--out", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err
    assert code == 2 and "--workdir" in err and "deploy-local" in err and len(err.strip().splitlines()) == 1


def test_flower_predict_guest_limits_hold_when_the_job_sends_a_huge_budget(tmp_path, monkeypatch):
    """In a Flower simulation the guests' own limits (``--max-queries-per-id``, ``--budget``: the job's
    ``limits``, as one user runs every party) hold even when the coordinator's job carries a huge
    budget and cap: with a cap of 1 the second call on the same IDs is refused, one line naming the
    guest, no predictions written, its ledger and query files unchanged (docs/serving.md "Inference
    limits")."""
    import fl_split.flower.predict_sim as sim
    from fl_split.errors import FlSplitError
    from fl_split.flower.predict_sim import predict_flower
    from tests.test_threat_model import _files_of

    real = sim.job_spec
    monkeypatch.setattr(sim, "job_spec", lambda *a, **kw: {**real(*a, **kw), "budget": 1e12,
                                                           "max_queries_per_id": 10**6})
    paths = _tables(tmp_path, guests=1)
    cfg, _ = _train(tmp_path, paths, defense="laplace", epsilon=2.0)
    new = {p: str(v) for p, v in _rows(tmp_path, paths, prepare_data(cfg).test_ids[:20]).items()}
    model = str(tmp_path / "model")
    s = predict_flower(model, new, "ID", str(tmp_path / "p1.csv"), label_column="Y", max_queries_per_id=1)
    assert s["privacy"]["guest-1"]["limits"]["max_queries_per_id"] == 1
    before = _files_of(tmp_path / "model" / "guest-1")
    with pytest.raises(FlSplitError) as refused:
        predict_flower(model, new, "ID", str(tmp_path / "p2.csv"), label_column="Y", max_queries_per_id=1)
    text = str(refused.value)
    assert len(text.splitlines()) == 1 and "guest-1" in text and "per-ID query cap reached" in text
    assert _files_of(tmp_path / "model" / "guest-1") == before and not (tmp_path / "p2.csv").exists()
