"""Every issue-9 experiment runs end to end in its ``--quick`` mode (one seed, a few records, one or
two epochs) and writes what its full run writes: CSV, a Markdown table, PNG plots, ``claims.json``
(each claim with a valid verdict) and ``run.json`` (command, date, versions). The quick runs write
into a temporary folder, never into ``experiments/results/``.
"""

from __future__ import annotations

import importlib
import json
import logging
import warnings
from pathlib import Path

import pytest

EXPERIMENTS = ("exp1_merge_padding", "exp2_utility_epsilon", "exp3_property_reconstruction", "exp4_fsha",
               "exp5_denoising", "exp6_rr_vs_laplace", "exp7_cut_layer_labels", "exp8_privacy_utility_attacks")
VERDICTS = {"holds", "partly holds", "does not hold", "new", "not measured", "uninformative", "inconclusive",
            "not applicable"}


@pytest.fixture
def isolated_logging():
    """The experiments silence fl_split's warnings (expected in noise sweeps); restore them after."""
    logger = logging.getLogger("fl_split")
    level = logger.level
    with warnings.catch_warnings():
        yield
    logger.setLevel(level)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_quick_mode(name, tmp_path, isolated_logging, capsys):
    mod = importlib.import_module(f"experiments.{name}")
    out = tmp_path / name
    assert mod.main(["--quick", "--out", str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert any(f.endswith(".csv") for f in files), files
    assert any(f.endswith(".md") for f in files), files
    assert any(f.endswith(".png") for f in files), files
    for f in files:
        if f.endswith(".png"):
            assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f
    claims = json.loads((out / "claims.json").read_text())
    assert claims, "every experiment states at least one claim"
    for c in claims:
        assert {"id", "source", "claim", "paper", "ours", "verdict", "rule"} <= set(c), c
        assert c["verdict"] in VERDICTS, c
        assert len(c["rule"]) > 20, c  # issue 19: every verdict states its rule
    # --from-runs rebuilds the same claims from runs.csv without training, and keeps the runs and provenance
    runs = {p.name: p.read_bytes() for p in out.glob("*runs.csv")}
    meta0 = (out / "run.json").read_text()
    assert mod.main(["--quick", "--out", str(out), "--from-runs"]) == 0
    assert json.loads((out / "claims.json").read_text()) == claims
    assert {p.name: p.read_bytes() for p in out.glob("*runs.csv")} == runs
    rebuilt = json.loads((out / "run.json").read_text())
    assert {k: v for k, v in rebuilt.items() if k != "rebuilt_from_runs"} == json.loads(meta0)
    assert "--from-runs" in rebuilt["rebuilt_from_runs"]["command"]
    meta = rebuilt
    assert meta["quick"] is True and meta["experiment"] == name
    assert meta["command"].startswith(".venv/bin/python experiments/") and "--quick" in meta["command"]
    assert "--from-runs" not in meta["command"]
    assert {"python", "torch", "fl_split"} <= set(meta["versions"]) and meta["date"]
    assert set(meta["files"]) <= files
    table = next(f for f in files if f.endswith(".md"))
    assert "|" in (out / table).read_text()


def test_claim_table_collects_every_experiment(tmp_path, capsys):
    from experiments import claims

    res = tmp_path / "results"
    for i, name in enumerate(EXPERIMENTS[:2]):
        (res / name).mkdir(parents=True)
        (res / name / "claims.json").write_text(json.dumps([{"id": f"{i}a", "source": "001 Table 1", "claim": "a | b",
                                                             "paper": "1", "ours": "2", "verdict": "holds",
                                                             "p": 0.001}]))
    assert claims.main(["--results", str(res)]) == 0
    text = (res / "claims.md").read_text()
    assert text.count("**holds**") == 2 and "a \\| b" in text and "Verdicts: holds 2" in text


def test_results_are_not_written_by_quick_runs():
    # the committed results folder holds no quick-mode output
    root = Path(__file__).resolve().parent.parent / "experiments" / "results"
    for run in root.glob("*/run.json"):
        assert json.loads(run.read_text()).get("quick") is False, run


def test_substitute_runs_an_experiment_on_the_real_dataset_loader(tmp_path, isolated_logging, capsys):
    # a user with MNIST on disk runs the digits configurations on it (tiny idx files in the real format)
    import numpy as np

    from experiments import common
    from tests.test_datasets import _write_idx

    rng = np.random.default_rng(0)
    raw = tmp_path / "data" / "MNIST" / "raw"
    _write_idx(raw, "train", rng.integers(0, 256, (160, 28, 28)), rng.integers(0, 10, 160))
    _write_idx(raw, "t10k", rng.integers(0, 256, (40, 28, 28)), rng.integers(0, 10, 40))
    mod = importlib.import_module("experiments.exp4_fsha")
    out = tmp_path / "out"
    try:
        argv = ["--quick", "--out", str(out), "--substitute", "digits=mnist", "--data-root", str(tmp_path / "data")]
        assert mod.main(argv) == 0
        assert common.config(0, dataset="digits").dataset == "mnist"  # every digits configuration ran on mnist
        assert "--substitute digits=mnist" in json.loads((out / "run.json").read_text())["command"]
        with pytest.raises(SystemExit, match="mnist is not under --data-root"):
            common.use_datasets(["digits=mnist"], str(tmp_path / "empty"))
        with pytest.raises(SystemExit, match="expected OFFLINE=REAL"):
            common.use_datasets(["digits"], "")
    finally:
        common.use_datasets([], "")
    assert common.config(0, dataset="digits").dataset == "digits"


def test_paired_verdict_helper_uses_the_seed_spread():
    """issue 19: a difference decides a verdict only outside the seed spread, never by its sign alone."""
    from experiments import common as C

    clear = C.paired([0.90, 0.91, 0.92], [0.80, 0.80, 0.81])  # +0.107 ± 0.006: far outside
    assert clear["clear"] and clear["diff"] > 0 and clear["p"] < 0.01
    noisy = C.paired([0.90, 0.70, 0.95], [0.80, 0.85, 0.82])  # +0.027 ± 0.16: the sign alone says "better"
    assert noisy["diff"] > 0 and not noisy["clear"]
    one = C.paired([0.9], [0.8])  # one seed cannot be judged
    assert not one["clear"] and one["p"] != one["p"]


def test_verify_reruns_seed_0_and_flags_drift(tmp_path, isolated_logging, capsys):
    """issue 19: ``--verify`` re-runs the committed configuration's seed-0 cells at the current code and
    compares them with the committed numbers; a drift beyond the stated tolerance exits 1 and says
    which cell. The CI subset: experiment 1 on credit (13 trainings, no defence: exact up to
    floating point)."""
    from experiments import common as C
    from experiments import exp1_merge_padding as exp1

    out = tmp_path / "verify"
    assert exp1.main(["--verify", "--datasets", "credit", "--out", str(out)]) is not None
    report = json.loads((out / "verify.json").read_text())
    assert report["cells"] == 13 and report["drifted"] == 0, report
    assert {"python", "torch", "fl_split"} <= set(report["versions"])
    # a committed number that does not reproduce is flagged
    old = C.read_runs(C.RESULTS / "exp1_merge_padding" / "runs.csv")
    new = [dict(r) for r in old if r["dataset"] == "credit" and r["seed"] == 0]
    new[0]["value"] += 0.2
    cells = C.verify_runs(new, old, ("dataset", "padding", "merge"), ("value",))
    assert [c["ok"] for c in cells].count(False) == 1 and not cells[0]["ok"]


# -- the claim table's rules (experiments/README.md, "Verdict rules") ------------------------------------


def _claim(cid, verdict, p=None, n=3, **kw):
    c = {"id": cid, "source": "s", "claim": "c", "paper": "1", "ours": "2", "verdict": verdict, "rule": "r" * 30,
         "n": n, "experiment": "exp1_merge_padding", **kw}
    if p is not None:
        c["p"] = p
    return c


def test_readme_claim_table_is_what_claims_py_computes():
    """The table and counts in experiments/README.md are claims.py's, from the committed results."""
    from experiments import claims

    doc = claims.README.read_text()
    assert doc.count(claims.BEGIN) == 1 and doc.count(claims.END) == 1
    block = doc[doc.index(claims.BEGIN):doc.index(claims.END) + len(claims.END)]
    assert block == claims.readme_block(claims.generated()), \
        "experiments/README.md's claim table is stale: run .venv/bin/python experiments/claims.py --readme"


def test_every_tested_claim_of_the_committed_table_enters_holm():
    """Every judged t-test claim carries a p-value and is in Holm's family, significant or not; a decided
    verdict stands only on a corrected p under alpha."""
    from experiments import claims
    from experiments import verdicts as V

    rows = claims.correct(claims.collect(claims.RESULTS))
    family = [c for c in rows if claims.tested(c)]
    assert family and all("p_holm" in c and c.get("p") is not None for c in family)
    assert any(c["verdict"] == V.INCONCLUSIVE and c["p"] >= V.ALPHA for c in family)  # non-significant ones count
    assert not any("p_holm" in c for c in rows if not claims.tested(c))
    for c in rows:
        if c["verdict"] in V.DECIDED and not c.get("deterministic") and c.get("tested", True):
            assert c["p_holm"] < V.ALPHA, c["id"]
    # the family's size is every tested claim: recompute the adjusted p independently
    ps = sorted((min(1.0, c["looks"] * c["p"]), c["id"]) for c in family)
    m, run = len(ps), 0.0
    for k, (p, cid) in enumerate(ps):
        run = max(run, min(1.0, (m - k) * p))
        assert next(c["p_holm"] for c in family if c["id"] == cid) == pytest.approx(run)


def test_holm_counts_non_significant_tests_and_refuses_a_test_without_p():
    from experiments import claims

    alone = claims.correct([_claim("a", "holds", 0.02)])
    assert alone[0]["verdict"] == "holds" and alone[0]["p_holm"] == pytest.approx(0.02)
    # a non-significant inconclusive test enters the family: 0.02 × 2 = 0.04, then 0.5
    two = claims.correct([_claim("a", "holds", 0.02), _claim("b", "inconclusive", 0.5)])
    assert [c["p_holm"] for c in two] == [pytest.approx(0.04), pytest.approx(0.5)]
    three = claims.correct([_claim("a", "holds", 0.02), _claim("b", "inconclusive", 0.5),
                            _claim("c", "inconclusive", 0.3)])
    assert three[0]["verdict"] == "inconclusive" and three[0]["verdict_uncorrected"] == "holds"
    # untested verdicts (deterministic, a ranking, uninformative, one seed) are not in the family
    rows = claims.correct([_claim("a", "holds", 0.02), _claim("d", "holds", deterministic=True),
                           _claim("e", "holds", tested=False), _claim("f", "uninformative"),
                           _claim("g", "holds", 0.001, n=1)])
    assert [("p_holm" in c) for c in rows] == [True, False, False, False, False]
    assert rows[4]["verdict"] == "inconclusive"  # one seed
    with pytest.raises(SystemExit, match="b rest on a test but carry no p-value"):
        claims.correct([_claim("a", "holds", 0.01), _claim("b", "inconclusive")])


def test_seeds_extended_after_a_look_are_corrected(monkeypatch):
    """A claim read on k seed lists carries k × p (Bonferroni over the looks); a declared list not yet run
    does not count as a look."""
    from experiments import claims

    monkeypatch.setitem(claims.SEED_PLAN, "x", {"seeds": tuple(range(10)), "looks": [(0, 1, 2)]})
    done = claims.correct([_claim("x", "holds", 0.03, n=10)])[0]
    assert done["looks"] == 2 and done["p_holm"] == pytest.approx(0.06) and done["verdict"] == "inconclusive"
    monkeypatch.setitem(claims.SEED_PLAN, "y", {"seeds": tuple(range(10)), "looks": [], "pending": "later"})
    pending = claims.correct([_claim("y", "holds", 0.03, n=3)])[0]
    assert pending["looks"] == 1 and pending["verdict"] == "holds"
    assert "declared: 10, not run: later" in claims.table([pending])
    # every declared list is longer than what the claim was read on before it
    for cid, plan in claims.SEED_PLAN.items():
        assert all(len(look) < len(plan["seeds"]) for look in plan["looks"]), cid


def _exp5_runs(drop_pts: float) -> list[dict]:
    """exp5's runs.csv rows: no noise at 95 %, Gaussian σ = 0.3/0.5/0.7 costing ``drop_pts`` points, and the
    λ = 0.1 denoiser best at every σ (by 1 point, every seed)."""
    import numpy as np

    rng = np.random.default_rng(0)
    runs = []
    for seed in range(4):
        jitter = float(rng.normal(0, 0.01))
        runs.append({"family": "gaussian", "level": 0.0, "denoise": "none", "seed": seed, "best": 0.95 + jitter,
                     "final": 0.95, "guest_epsilon": None, "snr_bound": None})
        for lvl in (0.3, 0.5, 0.7):
            noisy = 0.95 + jitter - drop_pts / 100 + float(rng.normal(0, 0.002))
            for dn, gain in (("none", 0.0), ("λ=0.1", 0.01), ("λ=0.6", 0.005), ("p=0.2", 0.002)):
                runs.append({"family": "gaussian", "level": lvl, "denoise": dn, "seed": seed, "best": noisy + gain,
                             "final": noisy + gain, "guest_epsilon": None, "snr_bound": None})
    return runs


def test_a_claim_whose_premise_fails_cannot_hold():
    """5c ("the best denoiser") is gated on the noise's cost (5a) like 5b and 5d: where the noise costs
    nothing, the same ranking that holds under a real cost is uninformative."""
    import argparse

    from experiments import exp5_denoising as E5

    def c5(runs):
        claims = E5.make_claims(E5.summarise(runs), argparse.Namespace(seeds=[0, 1, 2, 3]), runs)
        return next(c for c in claims if c["id"] == "5c")

    costly = c5(_exp5_runs(10.0))
    assert costly["verdict"] == "holds" and costly.get("tested") is False
    free = c5(_exp5_runs(0.0))
    assert free["verdict"] == "uninformative" and "p" not in free
    assert all(c["verdict"] != "holds" for c in E5.make_claims(E5.summarise(_exp5_runs(0.0)),
                                                                argparse.Namespace(seeds=[0, 1, 2, 3]),
                                                                _exp5_runs(0.0)) if c["id"].startswith(("5b", "5c")))


def test_fsha_defence_claims_carry_and_need_their_premise():
    """4b (noise alone) rests on 4a (FSHA works undefended): it carries 4a's p, and reads uninformative,
    never holds or does not hold, when FSHA does not work undefended."""
    from experiments import exp4_fsha as E4

    def runs(nd_ssim: float) -> list[dict]:
        out = []
        for seed, j in enumerate((0.0, 0.01, -0.01, 0.02)):
            for cfg, ssim, mse in (("no defence", nd_ssim + j, 0.02 if nd_ssim > 0.5 else 0.08),
                                   ("noise σ=0.7", 0.35 + j, 0.12 + j / 10)):
                out.append({"config": cfg, "seed": seed, "iterations": 400, "mse": mse, "baseline_mse": 0.08,
                            "mse_pm1": 4 * mse, "ssim": ssim, "baseline_ssim": 0.45, "psnr": 20.0, "guest_epsilon": None})
        return out

    def summary(rs):
        rows = []
        for cfg in dict.fromkeys(r["config"] for r in rs):
            sel = [r for r in rs if r["config"] == cfg]
            row = {"config": cfg, "n": len(sel), "iterations": 400, "guest_epsilon": None}
            for f in ("mse", "baseline_mse", "mse_pm1", "ssim", "baseline_ssim", "psnr"):
                row[f + "_mean"], row[f + "_sd"] = __import__("statistics").fmean(r[f] for r in sel), 0.01
            rows.append(row)
        return rows

    works = runs(0.8)
    claims = {c["id"]: c for c in E4.make_claims(summary(works), works)}
    assert claims["4a"]["verdict"] == "holds" and claims["4b"]["verdict"] == "does not hold"
    assert claims["4b"]["p"] >= claims["4a"]["p"]  # the premise's p is carried
    broken = runs(0.46)
    claims = {c["id"]: c for c in E4.make_claims(summary(broken), broken)}
    assert claims["4a"]["verdict"] != "holds" and claims["4b"]["verdict"] == "uninformative"


def test_host_protection_is_judged_against_the_host_alone():
    """2-<dataset>-host: a defended model at the host-alone level keeps none of the guest's gain, however far
    it is above the constant prediction; one that keeps the undefended level holds."""
    import argparse

    from experiments import exp2_utility_epsilon as E2

    def runs(defended: float) -> list[dict]:
        out = []
        for seed, j in enumerate((0.0, 0.004, -0.003, 0.002, -0.001)):
            for label, direction, eps, v in (("none", "none", None, 0.96), ("host-alone", "none", None, 0.85),
                                             ("r3elu", "host", 4.0, defended)):
                out.append({"dataset": "digits", "defence": label, "direction": direction, "epsilon": eps,
                            "seed": seed, "sigma": None, "metric": "accuracy", "value": v + j, "train_loss": 0.1,
                            "accounted_epsilon": 20.0 if eps else None, "snr_bound": 0.01, "host_snr_bound": None})
        return out

    args = argparse.Namespace(datasets=["digits"], seeds=[0, 1, 2, 3, 4])

    def claim(defended):
        rs = runs(defended)
        summary = E2.summarise(rs)
        for r in summary:
            r["trivial"] = 0.08
        return next(c for c in E2.make_claims(summary, args, rs) if c["id"] == "2-digits-host")

    fallback = claim(0.85)  # 88 % of the gain over the constant prediction, 0 % over the host alone
    assert fallback["verdict"] == "does not hold" and "over the host alone" in fallback["ours"]
    assert claim(0.958)["verdict"] == "holds"


def test_host_alone_baseline_sees_only_the_host(isolated_logging):
    """common.train_host_alone: the guests' inputs are zeroed (same model, epochs, seed), and refuses a host
    without features or a defence."""
    from experiments import common as C
    from fl_split import builder

    cfg = C.config(0, dataset="credit", guests=1, limit=120, epochs=1)
    wrapped = C._host_alone_data(builder.prepare_data)(cfg)
    plain = builder.prepare_data(cfg)
    assert float(wrapped.parties["guest-1"].x_train.abs().sum()) == 0.0
    assert float(plain.parties["guest-1"].x_train.abs().sum()) > 0.0
    assert (wrapped.parties["host"].x_train == plain.parties["host"].x_train).all()
    r = C.train_host_alone(0, dataset="credit", guests=1, limit=120, epochs=1)
    assert 0.0 <= r["final"]["value"] <= 1.0 and builder.prepare_data is not None
    assert builder.prepare_data.__name__ == "prepare_data"  # restored
    with pytest.raises(ValueError, match="host holds no features"):
        C.train_host_alone(0, dataset="credit", host_features=False)
    with pytest.raises(ValueError, match="undefended"):
        C.train_host_alone(0, dataset="credit", defense="laplace")


def test_committed_rr_results_carry_the_exact_accounting():
    """The committed RR rows of experiment 6 (one release per record) are charged what the ledger charges now,
    the exact binomial PLD (the issue's 256-bit row: 62.79, not the old 65.14), and keep the old value beside."""
    from experiments import common as C
    from experiments.reaccount import rr_release_epsilon

    assert rr_release_epsilon(256, 128.0) == pytest.approx(62.79, abs=0.01)
    rows = [r for r in C.read_runs(C.RESULTS / "exp6_rr_vs_laplace" / "runs.csv") if r["mechanism"] == "rr"]
    assert rows
    for r in rows:
        now = rr_release_epsilon(int(r["width"]), float(r["epsilon_per_record"]))
        assert float(r["accounted_epsilon"]) == pytest.approx(now, rel=1e-5)
        assert float(r["charged_accounted_epsilon"]) >= float(r["accounted_epsilon"])
