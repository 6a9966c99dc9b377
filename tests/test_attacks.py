"""Attacks (issue 9, ``docs/attacks.md``): each beats its trivial baseline against no defence, runs
under every defence, cannot reach another party's objects, is reproducible with ``--private-seed``,
and the ``fl-split attack`` CLI writes its JSON or refuses bad flags in one line.

Margins. Every "beats its baseline" test runs with a fixed private seed, so it is deterministic;
the margins are set so the attack would still pass with a different seed, from the sampling
spread of the metric on the sizes used: accuracy on ``n`` targets has SD ≤ 0.5/√n (≈ 0.03 for the
~200–320 targets here), an AUC under no signal has SD ≈ √((n₁+n₂+1)/(12·n₁·n₂)) (≈ 0.03 for 320
candidates), and MSE/SSIM margins are ratios far from the measured values (the measured values
are in the comments and in ``docs/attacks.md``).
"""

from __future__ import annotations

import gc
import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from fl_split.attacks import metrics as M
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.runner import make_session, run_attack
from fl_split.attacks.view import Grant, Session
from fl_split.config import RunConfig
from fl_split.seeding import PrivateSeed
from tests.helpers import run_cli

SEED = PrivateSeed.legacy(7)  # the private seed of every attack run (the pre-issue-16 derivation: measured margins hold)
DIGITS = dict(dataset="digits", guests=1, limit=600, epochs=3, progress=False, public_fraction=0.3)
CREDIT = dict(dataset="credit", guests=1, limit=800, epochs=3, progress=False)
#: overfits (train on 256 records, 40 epochs, wide MLP): what membership inference feeds on
MEMBERSHIP = dict(dataset="credit", guests=1, limit=800, epochs=40, hidden="256,128", public_fraction=0.6,
                  progress=False)
#: FSHA needs a convolutional guest here (an MLP guest is matched in distribution but not aligned:
#: docs/attacks.md), the guest's Adam at 1e-3 and ~400 iterations
FSHA_CFG = dict(dataset="digits", guests=1, model="cnn-stripe", cut_layer=1, lr=1e-3, batch_size=64, epochs=22,
                progress=False)


# -- SSIM / PSNR against known values ----------------------------------------------------------------
def _naive_ssim(x: np.ndarray, y: np.ndarray, size: int = 11, sigma: float = 1.5) -> float:
    """Wang et al. (2004) Eq. 13 window by window, with explicit weighted sums (no convolution)."""
    r = np.arange(size) - (size - 1) / 2
    g = np.exp(-r ** 2 / (2 * sigma ** 2))
    w = np.outer(g, g)
    w /= w.sum()
    c1, c2 = (0.01) ** 2, (0.03) ** 2
    vals = []
    for i in range(x.shape[0] - size + 1):
        for j in range(x.shape[1] - size + 1):
            a, b = x[i:i + size, j:j + size], y[i:i + size, j:j + size]
            mx, my = (w * a).sum(), (w * b).sum()
            vx, vy = (w * (a - mx) ** 2).sum(), (w * (b - my) ** 2).sum()
            cxy = (w * (a - mx) * (b - my)).sum()
            vals.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    return float(np.mean(vals))


def test_ssim_matches_known_values():
    rng = np.random.default_rng(0)
    x = rng.random((16, 16))
    y = np.clip(x + 0.2 * rng.standard_normal((16, 16)), 0, 1)
    assert M.ssim(torch.tensor(x), torch.tensor(x)) == pytest.approx(1.0, abs=1e-12)
    # the convolution equals Wang et al.'s windowed formula computed directly
    assert M.ssim(torch.tensor(x), torch.tensor(y)) == pytest.approx(_naive_ssim(x, y), abs=1e-10)
    # constant images: only the luminance term is left, (2ab + C1)/(a² + b² + C1)
    a, b = 0.3, 0.7
    c1 = 0.01 ** 2
    assert M.ssim(torch.full((12, 12), a), torch.full((12, 12), b)) == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1),
                                                                                    rel=1e-6)
    # an inverted image is structurally anti-correlated: SSIM < 0; SSIM is symmetric
    assert M.ssim(torch.tensor(x), torch.tensor(1 - x)) < 0
    assert M.ssim(torch.tensor(x), torch.tensor(y)) == pytest.approx(M.ssim(torch.tensor(y), torch.tensor(x)))
    # 8×4 stripes: the window shrinks to 3×3 and the same formula holds
    s = rng.random((8, 4))
    t = rng.random((8, 4))
    assert M.ssim_window_size(8, 4) == 3
    assert M.ssim(torch.tensor(s), torch.tensor(t)) == pytest.approx(_naive_ssim(s, t, size=3), abs=1e-10)


def test_psnr_auc_f1_known_values():
    assert M.psnr(torch.zeros(4, 4), torch.full((4, 4), 0.1, dtype=torch.float64)) == pytest.approx(20.0, abs=1e-9)
    assert M.psnr(torch.zeros(4, 4), torch.zeros(4, 4)) == pytest.approx(100.0)  # MSE floored at 1e-10
    assert M.auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert M.f1(np.ones(10), np.r_[np.ones(5), np.zeros(5)]) == pytest.approx(M.always_positive_f1(0.5))
    assert M.always_positive_f1(0.5) == pytest.approx(2 / 3)
    assert M.majority_rate(np.array([1, 1, 0]), np.array([1, 0, 0, 0])) == pytest.approx(0.25)


# -- shared observed runs (no defence) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits_session():
    s = make_session(RunConfig(**DIGITS), AttackOptions(attack="membership"), SEED)  # with the public split
    s.run()
    return s


@pytest.fixture(scope="module")
def credit_session():
    s = make_session(RunConfig(**CREDIT), AttackOptions(attack="feature"), SEED)
    s.run()
    return s


def _attack(session, **opts):
    r = run_attack(session.cfg, AttackOptions(**opts), session=session)
    json.dumps(r, allow_nan=True, default=float)  # the result is JSON-able as written by the CLI
    assert {"attack", "adversary", "metric", "value", "baseline", "threat_model", "final", "privacy"} <= set(r)
    return r


# -- each attack beats its baseline against no defence ---------------------------------------------
def test_property_inference_host_from_embeddings(digits_session, credit_session):
    # digits patch-ink from guest-1's 64-d embeddings: measured 0.90 vs 0.51 (~240 targets, SD ≤ 0.033)
    r = _attack(digits_session, attack="property", attack_epochs=60)
    assert (r["adversary"], r["victim"], r["details"]["property"]) == ("host", "guest-1", "patch-ink")
    assert r["value"] >= r["baseline"] + 0.2
    # credit: the partner's age-over-40 from its embeddings: measured 0.96 vs 0.67 (320 targets)
    r = _attack(credit_session, attack="property", attack_epochs=60)
    assert r["details"]["property"] == "age-over-40" and r["value"] >= r["baseline"] + 0.15


def test_property_inference_guest_from_gradients(digits_session):
    # the host's patch-ink from the partial losses of all 3 epochs: measured 0.82 vs 0.48
    r = _attack(digits_session, attack="property", adversary="guest", attack_epochs=60)
    assert (r["adversary"], r["victim"]) == ("guest-1", "host")
    assert r["value"] >= r["baseline"] + 0.15


def test_reconstruction_decoder(digits_session, tmp_path):
    # measured MSE 0.010 vs 0.076 for the mean sample; SSIM 0.90 vs 0.48
    grid = tmp_path / "grid.png"
    r = _attack(digits_session, attack="reconstruction", attack_epochs=60, grid=str(grid))
    assert r["value"] <= 0.4 * r["baseline"]
    assert r["details"]["ssim"] >= r["details"]["baseline_ssim"] + 0.2
    assert grid.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_white_box_inversion(digits_session):
    # measured SSIM 0.80 vs 0.06 for uniform noise; PSNR 19 dB vs 6
    r = _attack(digits_session, attack="inversion", inversion_steps=200, attack_records=16)
    assert r["metric"] == "ssim" and r["value"] >= r["baseline"] + 0.4
    assert r["details"]["psnr"] >= r["details"]["baseline_psnr"] + 6
    assert any("weights" in g for g in r["threat_model"]["granted"])


def test_feature_inference_grn(credit_session):
    # the partner's 16 encoded columns: measured per-feature MSE 0.07 vs 0.32 for U(0,1)
    r = _attack(credit_session, attack="feature", attack_epochs=100)
    assert r["value"] <= 0.5 * r["baseline"]
    assert len(r["details"]["per_feature"]) == 16


def test_membership_inference_shadow_models():
    # overfit credit model; measured F1 0.75 vs 0.667 (always member), AUC 0.72 (null SD 0.032)
    r = run_attack(RunConfig(**MEMBERSHIP), AttackOptions(attack="membership", shadow_models=2, attack_epochs=100),
                   SEED)
    assert r["baseline"] == pytest.approx(2 / 3)
    assert r["value"] >= r["baseline"] + 0.025
    assert r["details"]["auc"] >= 0.62


def test_label_inference_norm_and_direction(credit_session, digits_session):
    # credit is binary: norm scoring measured AUC 0.81, direction 1.00 (320 targets, null SD ~0.03)
    norm = _attack(credit_session, attack="label-norm")
    assert norm["value"] >= 0.65 and norm["baseline"] == 0.5
    assert len(norm["details"]["per_epoch"]) == 3
    direction = _attack(credit_session, attack="label-direction")
    assert direction["value"] >= 0.85
    # digits: 10 classes one-vs-rest: measured 0.99
    assert _attack(digits_session, attack="label-direction")["value"] >= 0.8


def test_label_inference_model_completion(digits_session):
    # 4 known labels per class: measured 0.70 vs 0.11
    r = _attack(digits_session, attack="label-completion", attack_epochs=60)
    assert r["value"] >= r["baseline"] + 0.3


def test_fsha_hijacks_an_honest_guest(tmp_path):
    # ~400 iterations: measured MSE 0.029 (seeds 1, 7, 11: 0.026-0.032) vs 0.079 for the mean sample
    grid = tmp_path / "fsha.png"
    r = run_attack(RunConfig(**FSHA_CFG), AttackOptions(attack="fsha", fsha_every=100, grid=str(grid)), SEED)
    assert r["details"]["iterations"] >= 390
    assert r["value"] <= 0.6 * r["baseline"]
    assert r["details"]["ssim"] >= r["details"]["baseline_ssim"] + 0.1
    assert r["details"]["mse_pm1"] == pytest.approx(4 * r["value"])
    assert [c["iteration"] for c in r["details"]["curve"]] == [100, 200, 300]
    assert r["final"]["value"] is None  # the hijacked run trains no task model
    assert grid.exists()


# -- under every defence ---------------------------------------------------------------------------------
DEFENCES = {
    "laplace": dict(defense="laplace", protect="both", epsilon=50.0),
    "gaussian": dict(defense="gaussian", protect="both", sigma=0.7, denoise="mask", denoise_param=0.5),
    "r3elu": dict(defense="r3elu", protect="both", epsilon=1.0),
    "rr": dict(defense="rr", protect="guest", epsilon=50.0),
    "dpsgd": dict(defense="dpsgd", protect="both", sigma=1.0),
}
QUICK = dict(limit=200, epochs=2)


@pytest.mark.parametrize("defence", list(DEFENCES))
def test_every_attack_runs_under_each_defence(defence):
    d = DEFENCES[defence]
    digits = RunConfig(**{**DIGITS, **QUICK, **d})
    s = make_session(digits, AttackOptions(attack="membership"), SEED)
    results = {}
    for opts in (dict(attack="property", attack_epochs=5), dict(attack="property", adversary="guest", attack_epochs=5),
                 dict(attack="reconstruction", attack_epochs=5),
                 dict(attack="inversion", inversion_steps=10, attack_records=4),
                 dict(attack="membership", shadow_models=1, attack_epochs=5),
                 dict(attack="label-direction"), dict(attack="label-completion", attack_epochs=5)):
        name = opts["attack"] + ("-guest" if opts.get("adversary") else "")
        results[name] = _attack(s, **opts)
    credit = RunConfig(**{**CREDIT, **QUICK, **d})
    s2 = make_session(credit, AttackOptions(attack="feature"), SEED)
    for opts in (dict(attack="feature", attack_epochs=3), dict(attack="feature", attack_epochs=3, grn_target="prediction"),
                 dict(attack="label-norm")):
        results[opts["attack"] + opts.get("grn_target", "")] = _attack(s2, **opts)
    results["fsha"] = run_attack(RunConfig(**{**FSHA_CFG, **QUICK, **d, "denoise": "none"}),
                                 AttackOptions(attack="fsha"), SEED)
    for name, r in results.items():
        assert math.isfinite(r["value"]) and math.isfinite(r["baseline"]), name
        assert r["training"]["config"]["defense"] == d["defense"], name
    assert results["fsha"]["details"]["iterations"] > 0
    if defence == "r3elu":
        # R3eLU-backward at epsilon = 1 (Laplace scale 2KC/eps_l = 1280 against partial losses of ~1e-3):
        # the guest's label scores are noise (paper 001's open question, measured)
        assert abs(results["label-direction"]["value"] - 0.5) < 0.15
        assert abs(results["label-norm"]["value"] - 0.5) < 0.15


# -- the adversary's view is structurally limited to what its party holds ----------------------------
def _reachable(root):
    """Every object reachable from ``root`` through references an attack could follow: instance
    attributes, containers, closures and default arguments — not module globals or classes."""
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen, stack, out = set(), [root], []
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        out.append(o)
        if isinstance(o, (types.ModuleType, type, types.CodeType, types.BuiltinFunctionType)) or id(o) in module_dicts:
            continue
        if isinstance(o, types.FunctionType):
            refs = [o.__closure__ or (), o.__defaults__ or (), o.__kwdefaults__ or {}]
        else:
            refs = gc.get_referents(o)
        stack.extend(refs)
    return out


def _forbidden(session, adversary):
    """Objects (and tensor storages) of every party but ``adversary``, and the world's ground truth."""
    objs, ptrs = [session, session.referee, session.referee._parties], set()
    for name, p in session.parties.items():
        if name == adversary:
            continue
        mods = [m for m in (getattr(p, "bottom", None), getattr(p, "top", None)) if m is not None]
        objs += [p, p.secret, p.data, p.update, p.update.optimizer, p.ledger, *mods]
        tensors = [t for t in (p.data.x_train, p.data.x_test, p.data.y_train, p.data.y_test) if t is not None]
        tensors += [q for m in mods for q in m.parameters()]
        objs += tensors
        ptrs |= {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    return {id(o) for o in objs if o is not None}, ptrs


def _assert_confined(view, session):
    forbidden, ptrs = _forbidden(session, view.party)
    reached = _reachable(view)
    assert any(o is view.me for o in reached)  # the walk does follow attributes
    assert any(o is view.inbox[0].tensor for o in reached)
    leaks = [type(o).__name__ for o in reached if id(o) in forbidden]
    assert not leaks, f"{view.party}'s view reaches another party's objects: {leaks[:5]}"
    shared = [o for o in reached if isinstance(o, torch.Tensor) and o.numel()
              and o.untyped_storage().data_ptr() in ptrs]
    assert not shared, f"{view.party}'s view shares storage with another party's tensors"


def test_adversary_view_holds_only_its_own_party():
    cfg = RunConfig(**{**DIGITS, **QUICK, "guests": 2, "defense": "laplace", "protect": "both", "epsilon": 50.0})
    s = Session(cfg, SEED, public=True)
    s.run()
    grants = {"host": [Grant("property-labels", victim="guest-1", fraction=0.5, prop="patch-ink"),
                       Grant("victim-features", victim="guest-1", fraction=0.5), Grant("public-records"),
                       Grant("victim-model", victim="guest-1")],
              "guest-1": [Grant("known-labels", per_class=2), Grant("property-labels", victim="host", fraction=0.5,
                                                                    prop="patch-ink")],
              "guest-2": []}
    for party, g in grants.items():
        view = s.view(party, g)
        _assert_confined(view, s)
        assert {o.receiver for o in view.inbox} == {party} and {o.sender for o in view.outbox} == {party}
    # the check can fail: a view handed another party's model (or the ground truth) is caught
    leaky = s.view("guest-2")
    leaky.aux.victim_model = s.guests["guest-1"].bottom
    with pytest.raises(AssertionError, match="reaches another party"):
        _assert_confined(leaky, s)
    leaky = s.view("guest-2")
    leaky.aux.public = {"truth": s.referee}
    with pytest.raises(AssertionError, match="reaches another party"):
        _assert_confined(leaky, s)
    # every message the host received is a guest's release, placed by the public schedule
    host = s.view("host")
    rec = host.records("activations", "train", 1, peer="guest-2")
    assert len(rec) == s.plan.schedule.n_train and np.array_equal(rec.ids, s.host.data.train_ids)
    # the granted victim model is a copy: same outputs, no shared parameters
    model = s.view("host", [Grant("victim-model", victim="guest-1")]).aux.victim_model
    x = s.guests["guest-1"].data.x_test[:5]
    with torch.no_grad():
        torch.testing.assert_close(model(x), s.guests["guest-1"].bottom.eval()(x))


def test_fsha_view_holds_only_the_malicious_host():
    s = make_session(RunConfig(**{**FSHA_CFG, **QUICK, "epochs": 1}), AttackOptions(attack="fsha"), SEED)
    s.run()
    view = s.view("host", [Grant("public-records")])
    assert type(view.me).__name__ == "FSHAHost"
    _assert_confined(view, s)


# -- reproducibility --------------------------------------------------------------------------------
def test_private_seed_makes_an_attack_reproducible():
    cfg = RunConfig(**{**DIGITS, **QUICK, "defense": "gaussian", "sigma": 0.7})
    opts = AttackOptions(attack="reconstruction", attack_epochs=10)
    a, b = run_attack(cfg, opts, PrivateSeed.legacy(123)), run_attack(cfg, opts, PrivateSeed.legacy(123))
    assert a["value"] == b["value"] and a["details"]["ssim"] == b["details"]["ssim"]
    assert run_attack(cfg, opts, PrivateSeed.legacy(124))["value"] != a["value"]


# -- the command line -------------------------------------------------------------------------------
def _cli(argv, capsys):
    return run_cli(argv, capsys)


def _keys(o) -> set:
    if isinstance(o, dict):
        return set(o).union(*(_keys(v) for v in o.values()))
    if isinstance(o, list):
        return set().union(*(_keys(v) for v in o))
    return set()


def test_cli_attack_writes_json(tmp_path, capsys):
    out = tmp_path / "attack.json"
    code, stdout, stderr = _cli(["attack", "--attack", "label-direction", "--dataset", "breast-cancer", "--epochs", "2",
                                 "--no-progress", "--private-seed", "5eed0c4f9a2e7b13d86f1a0b3c5e7d92", "--defense", "laplace", "--epsilon", "50",
                                 "--out", str(out)], capsys)
    assert code == 0, stderr
    res = json.loads(out.read_text())
    assert res["attack"] == "label-direction" and res["adversary"] == "guest-1" and res["metric"] == "auc"
    assert 0 <= res["value"] <= 1 and res["baseline"] == 0.5
    assert res["threat_model"]["summary"] and res["threat_model"]["received"] == ["gradients from host"]
    assert res["final"]["metric"] == "accuracy" and set(res["privacy"]) == {"host", "guest-1"}
    assert res["privacy"]["guest-1"]["private_randomness"] == "private-seed"
    assert not _keys(res) & {"private_seed", "private-seed", "secret"}  # the private seed is never written
    assert "label inference" in stdout and "auc" in stdout


@pytest.mark.parametrize("argv,flag", [
    (["--attack", "bogus"], "--attack"),
    ([], "the following arguments are required: --attack"),
    (["--attack", "property", "--aux-fraction", "1.5"], "--aux-fraction"),
    (["--attack", "property", "--attack-epoch", "zero"], "--attack-epoch"),
    (["--attack", "property", "--attack-epoch", "9"], "--attack-epoch"),
    (["--attack", "property", "--guest", "guest-3"], "--guest"),
    (["--attack", "property", "--property", "nope"], "--property"),
    (["--attack", "property", "--adversary", "guest", "--property", "ink-left"], "--property"),
    (["--attack", "inversion", "--adversary", "guest"], "--adversary"),
    (["--attack", "label-norm"], "--attack"),
    (["--attack", "feature"], "--attack"),
    (["--attack", "membership", "--engine", "flower"], "--engine"),
    (["--attack", "fsha", "--engine", "flower"], "--engine"),
    (["--attack", "inversion", "--grid", "grid.txt"], "--grid"),
    (["--attack", "property", "--grid", "grid.png"], "--grid"),
    (["--attack", "fsha", "--one-shot"], "--one-shot"),
    (["--attack", "label-direction", "--one-shot"], "--one-shot"),
    (["--attack", "membership", "--shadow-models", "0"], "--shadow-models"),
    (["--attack", "reconstruction", "--guests", "2", "--merge", "sum", "--secure-merge", "--defense", "gaussian"],
     "--secure-merge: got True (under secure merge"),
])
def test_cli_attack_refuses_bad_flags(argv, flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "attack.json"
    code, _, stderr = _cli(["attack", "--dataset", "digits", "--epochs", "1", "--limit", "100", "--no-progress",
                            "--out", str(out), *argv], capsys)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fl-split: error: ") and flag in lines[0], stderr
    assert "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_fsha_defaults_pick_the_guest_it_works_on():
    """issue 19: against the default ``mlp`` stripe FSHA decodes the wrong records (worse than the mean
    image), so ``--attack fsha`` with ``--model auto`` trains a convolutional guest cut after its first
    block, says so in the results, and leaves an explicit ``--model`` alone."""
    from fl_split.attacks.runner import attack_defaults

    cfg, chosen = attack_defaults(RunConfig(dataset="digits"), AttackOptions(attack="fsha"))
    assert (cfg.model, cfg.cut_layer) == ("cnn-stripe", 1) and chosen == {"model": "cnn-stripe", "cut_layer": 1}
    cfg, chosen = attack_defaults(RunConfig(dataset="digits", model="mlp"), AttackOptions(attack="fsha"))
    assert cfg.model == "mlp" and chosen == {}
    cfg, chosen = attack_defaults(RunConfig(dataset="digits"), AttackOptions(attack="property"))
    assert cfg.model == "auto" and chosen == {}
    cfg, chosen = attack_defaults(RunConfig(dataset="credit"), AttackOptions(attack="fsha"))
    assert chosen == {}  # a table: no image decoder to aim at
