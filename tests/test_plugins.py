"""Plug-in defences and attacks (issue 28, ``docs/plugins.md``).

* a plug-in mechanism written *outside the package* (a module in ``tmp_path`` put on ``sys.path``)
  that wraps the built-in Laplace mechanism trains, is charged and is audited exactly like
  ``--defense laplace``: the same private seed gives the same draws, so the training history, every
  accountant's epsilon and the audit's empirical bound are equal, not merely close;
* a plug-in without a DP event (the worked example, gradient sparsification) runs with "no privacy
  claimed" in the results and on the console, no ledger and no epsilon, and ``fl-split audit``
  refuses it;
* a bad plug-in string (no module, no attribute, not a class, wrong base class, a cost without a
  ``DpEvent``) is one line naming ``--defense`` / ``--attack`` and the string;
* a plug-in attack receives exactly its party's view (the confinement check of
  ``tests/test_attacks.py``), and the worked example beats its baseline;
* a coordinator cannot make a deployment node import a plug-in its operator did not list: the
  refusal comes before the import (a module with an import side effect stays unimported);
* ``fl-split audit`` does not trust the plug-in it audits (docs/accounting.md, "A plug-in is audited
  independently"): the red team's plug-in (claims a Gaussian event, adds half the noise, names
  near-equal canaries and a ratio of zero) is flagged by the audit's own canaries and statistic, so
  is one without audit hooks and one posing as a built-in; honest plug-ins are not (fixed seeds).
"""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from fl_split.config import RunConfig
from fl_split.errors import ConfigError
from fl_split.seeding import PartySecret, PrivateSeed
from tests.helpers import run_cli

SEED = PrivateSeed.parse("9f3c2a71e8b4d05c6a1f7e92b3d84c10")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "plugins"
QUICK = dict(dataset="digits", guests=1, limit=300, epochs=2, progress=False)
GS = "gradient_sparsification:GradientSparsification"

LAPLACE_PLUGIN = '''
import torch
from fl_split.privacy import audit
from fl_split.privacy.base import PrivacyCost
from fl_split.privacy.mechanisms import Laplace
from fl_split.privacy.plugin import PluginMechanism


class MyLaplace(PluginMechanism):
    """The built-in Laplace mechanism behind the plug-in interface (what a researcher would wrap)."""

    name = "my-laplace"
    random = True

    def __init__(self, spec):
        super().__init__(spec)
        self.lap = Laplace(spec.width, spec.direction, spec.bound, epsilon=spec.epsilon)

    def release(self, t, gen):
        return self.lap.release(t, gen)

    def local_grad(self, ctx, grad):
        return self.lap.local_grad(ctx, grad)

    def public_range(self):
        return self.lap.public_range()

    def public_diagnostics(self):
        return self.lap.public_diagnostics()

    def privacy_cost(self):
        c = self.lap.cost()
        return PrivacyCost(self.name, c.dp_event, epsilon=c.epsilon, sensitivity_l1=c.sensitivity_l1,
                           params=(("epsilon", self.lap.epsilon),))

    def canary_pair(self):
        return audit.canary_pair(self.lap)

    def log_likelihood_ratio(self, y, x0, x1):
        return audit.log_likelihood_ratio(self.lap, y, x0, x1)


class NoEvent(MyLaplace):
    def privacy_cost(self):
        return PrivacyCost(self.name, dp_event=3.0, epsilon=1.0)


def not_a_class():
    return None


class NotAMechanism:
    pass
'''

#: the red team's plug-in and honest counterparts: an L2 clip to the spec's bound plus Gaussian noise,
#: claiming the event of noise multiplier 2 (epsilon 1.99 at delta 1e-5)
RED_TEAM_PLUGIN = '''
import dp_accounting
import torch
from fl_split.privacy.base import Mechanism, PrivacyCost, Release
from fl_split.privacy.plugin import PluginMechanism


class L2Gaussian(PluginMechanism):
    """Clip each record to L2 norm spec.bound, add N(0, (NOISE * 2 * bound)^2); claim multiplier CLAIM."""

    random = True
    cut_activation = "none"
    CLAIM = 2.0
    NOISE = 2.0

    def __init__(self, spec):
        super().__init__(spec)
        self.bound = float(spec.bound)
        self.sd = self.NOISE * 2.0 * self.bound

    def release(self, t, gen):
        flat = t.reshape(t.shape[0], -1)
        sig = flat * (self.bound / flat.norm(dim=1, keepdim=True).clamp_min(self.bound))
        noise = torch.randn(sig.shape, generator=gen, dtype=sig.dtype, device=sig.device) * self.sd
        return Release(value=(sig + noise).reshape(t.shape), encoding=self.encoding)

    def public_range(self):
        return None

    def privacy_cost(self):
        return PrivacyCost(self.name, dp_accounting.GaussianDpEvent(self.CLAIM), epsilon=None,
                           sensitivity_l2=2.0 * self.bound)


class HonestGaussian(L2Gaussian):
    """What it claims, with the true worst-case pair and the exact ratio."""

    name = "honest-gaussian"

    def canary_pair(self):
        e1 = torch.zeros(1, self.width)
        e1[0, 0] = self.bound
        return -e1, e1

    def log_likelihood_ratio(self, y, x0, x1):
        return ((y - x0.double()) ** 2 - (y - x1.double()) ** 2).sum(dim=1) / (2 * self.sd ** 2)


class HalfNoise(L2Gaussian):
    """The red team's: half the claimed noise, near-equal canaries, a ratio that sees nothing."""

    name = "half-noise"
    NOISE = 1.0

    def canary_pair(self):
        x0 = torch.zeros(1, self.width)
        x1 = x0.clone()
        x1[0, 0] = 1e-3 * self.bound
        return x0, x1

    def log_likelihood_ratio(self, y, x0, x1):
        return torch.zeros(y.shape[0], dtype=torch.float64)


class HalfNoiseNoHooks(L2Gaussian):
    """Half the claimed noise and no audit hooks at all."""

    name = "half-noise-no-hooks"
    NOISE = 1.0


class PosingAsBuiltin(Mechanism):
    """Half the claimed noise, in a class that says it is fl_split's own Gaussian mechanism, with a
    tiny bound (the built-in canary would be near-equal)."""

    __module__ = "fl_split.privacy.mechanisms"
    name = "gaussian"
    random = True

    def __init__(self, spec):
        self.width, self.direction, self.c = spec.width, spec.direction, float(spec.bound)
        self.bound, self.sigma = 1e-6, 4.0 * self.c

    def release(self, t, gen):
        flat = t.reshape(t.shape[0], -1)
        sig = flat * (self.c / flat.norm(dim=1, keepdim=True).clamp_min(self.c))
        noise = torch.randn(sig.shape, generator=gen, dtype=sig.dtype) * (2.0 * self.c)
        return Release(value=(sig + noise).reshape(t.shape), encoding=self.encoding)

    def public_range(self):
        return None

    def privacy_cost(self):
        return PrivacyCost(self.name, dp_accounting.GaussianDpEvent(2.0), epsilon=None)
'''


@pytest.fixture
def plugdir(tmp_path, monkeypatch):
    """A directory outside the package holding the test plug-ins and the worked examples, on sys.path."""
    (tmp_path / "my_plugins.py").write_text(textwrap.dedent(LAPLACE_PLUGIN))
    (tmp_path / "red_team_plugins.py").write_text(textwrap.dedent(RED_TEAM_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield tmp_path
    for name in ("my_plugins", "red_team_plugins", "recording_attack", "evil_plugin"):
        sys.modules.pop(name, None)


def _train(cfg: RunConfig) -> dict:
    from fl_split.engine import run_experiment

    return run_experiment(cfg, private_seed=SEED)


# -- a DP plug-in is a built-in's equal ---------------------------------------------------------------
def test_plugin_laplace_trains_and_is_charged_like_the_builtin(plugdir):
    common = dict(QUICK, protect="both", epsilon=8.0, clip_c=0.01)
    builtin = _train(RunConfig(**common, defense="laplace"))
    plugin = _train(RunConfig(**common, defense="my_plugins:MyLaplace"))
    for party in ("host", "guest-1"):
        b, p = builtin["privacy"][party], plugin["privacy"][party]
        assert p["epsilon"] is not None and p["epsilon"] == b["epsilon"]
        assert p["epsilons"] == b["epsilons"] and p["releases"] == b["releases"]
        assert p["epsilon_by_epoch"] == b["epsilon_by_epoch"]
        assert p["mechanism"]["name"] == "my-laplace" and p["mechanisms"][0]["name"] == "my-laplace"
        assert p["mechanisms"][0]["dp_event"] == b["mechanisms"][0]["dp_event"]
    # the same draws from the same party secrets: the same training, step for step
    assert [h["train_loss"] for h in plugin["history"]] == [h["train_loss"] for h in builtin["history"]]
    assert plugin["final"]["value"] == builtin["final"]["value"]


def test_plugin_budget_refuses_like_the_builtin(plugdir):
    # a budget between the guest's epsilon after epoch 1 and after epoch 2 (the built-in's, unbudgeted):
    # its ledger refuses a release of epoch 2
    free = _train(RunConfig(**QUICK, epsilon=1.0, clip_c=0.01, defense="laplace"))["privacy"]["guest-1"]
    e1, e2 = (free["epsilon_by_epoch"][k] for k in sorted(free["epsilon_by_epoch"], key=int))
    assert e1 < e2
    common = dict(QUICK, epsilon=1.0, clip_c=0.01, budget=(e1 + e2) / 2)
    builtin = _train(RunConfig(**common, defense="laplace"))
    plugin = _train(RunConfig(**common, defense="my_plugins:MyLaplace"))
    assert plugin["stopped_reason"] == builtin["stopped_reason"] == "budget"
    assert plugin["stopped_round"] == builtin["stopped_round"]
    assert plugin["privacy"]["guest-1"]["epsilon"] == builtin["privacy"]["guest-1"]["epsilon"] <= (e1 + e2) / 2


def test_plugin_laplace_is_audited_like_the_builtin(plugdir):
    from fl_split.privacy.audit import STAT_CLIPPED, audit_mechanism, mechanisms_for, public_canary_pair, run_audit

    rows = {}
    for name, alpha in (("laplace", 0.025), ("my_plugins:MyLaplace", 0.05)):
        cfg = RunConfig(defense=name, epsilon=2.0, clip_c=1.0)
        # the same generator keys for both (the label keys the draws): the same releases
        mechs = mechanisms_for(cfg, 2, 3)
        rows[name] = audit_mechanism(mechs, 4000, PartySecret.for_party("audit", SEED), delta=1e-5, alpha=alpha,
                                     label="same", public_pair=public_canary_pair("forward", 2, 1.0)).to_json("pld")
    b, p = rows["laplace"], rows["my_plugins:MyLaplace"]
    assert p["claimed_epsilon_by_accountant"] == b["claimed_epsilon_by_accountant"]
    assert p["claimed_epsilon_by_accountant"]["basic"] == pytest.approx(6.0)
    # a plug-in gets two tests at alpha/2 each: the audit's own, and its own pair and ratio, which is
    # the built-in's test (the same releases) at alpha/2
    ind, own = p["tests"]
    assert ind["test"] == "independent" and own["test"] == "plug-in's own" and ind["alpha"] == own["alpha"] == 0.025
    assert own["empirical_epsilon_lower"] == b["empirical_epsilon_lower"] > 0 and not p["violation"]
    # the independent test's best statistic is the Laplace likelihood ratio's shape (clipped projection)
    assert ind["statistic"] == STAT_CLIPPED and 0.5 * own["empirical_epsilon_lower"] < ind["empirical_epsilon_lower"]
    assert p["empirical_epsilon_lower"] == max(ind["empirical_epsilon_lower"], own["empirical_epsilon_lower"])
    # fl-split audit's own runner: the independent test, and the plug-in's canary_pair and log_likelihood_ratio
    doc = run_audit(RunConfig(defense="my_plugins:MyLaplace", epsilon=2.0, clip_c=1.0, protect="both"), width=2,
                    releases=[1], trials=4000, alpha=0.05, secret=PartySecret.for_party("audit", SEED))
    assert [r["mechanism"] for r in doc["results"]] == ["my_plugins:MyLaplace/forward/1",
                                                         "my_plugins:MyLaplace/backward/1"]
    assert not doc["violations"]
    assert all(r["claimed_epsilon_by_accountant"]["basic"] == pytest.approx(2.0) for r in doc["results"])
    # a mis-accounted plug-in is caught as a built-in is (the audit's own test, through its wrapper)
    cfg = RunConfig(defense="my_plugins:MyLaplace", epsilon=2.0, clip_c=1.0)
    doc = run_audit(cfg, width=2, releases=[1], trials=20000, alpha=0.05, secret=PartySecret.for_party("audit", SEED),
                    mis_account=4.0)
    assert doc["violations"]


def test_cli_audit_of_a_plugin(plugdir, tmp_path, capsys):
    out = tmp_path / "a.json"
    code, _, err = run_cli(["audit", "--defense", "my_plugins:MyLaplace", "--epsilon", "2", "--clip-c", "1",
                            "--trials", "2000", "--releases", "1", "--out", str(out),
                            "--private-seed", "9f3c2a71e8b4d05c6a1f7e92b3d84c10"], capsys)
    assert code == 0, err
    row = json.loads(out.read_text())["results"][0]
    assert row["mechanism"] == "my_plugins:MyLaplace/forward/1"
    assert row["claimed_epsilon_by_accountant"]["basic"] == pytest.approx(2.0) and not row["violation"]
    assert [t["violation"] for t in row["tests"]] == [False, False]


# -- the audit does not trust the plug-in it audits ---------------------------------------------------
AUDIT_SEED = "c4e1a9073fb25d86e0a47b93d1f6285c"


def _audit_cli(capsys, tmp_path, defense, *extra):
    out = tmp_path / "audit.json"
    code, stdout, err = run_cli(["audit", "--defense", defense, "--releases", "1", "--trials", "100000",
                                 "--private-seed", AUDIT_SEED, "--out", str(out), *extra], capsys)
    return code, " ".join(stdout.split()), err, json.loads(out.read_text())["results"][0]


def test_public_canaries_come_from_the_public_configuration():
    import torch

    from fl_split.privacy.audit import public_canary_pair

    x0, x1 = public_canary_pair("forward", 3, 0.5, "tanh")  # tanh's range, whatever the clip bound
    assert torch.equal(x0, -torch.ones(1, 3)) and torch.equal(x1, torch.ones(1, 3))
    x0, x1 = public_canary_pair("forward", 3, 0.5, "relu")
    assert torch.equal(x0, torch.zeros(1, 3)) and torch.equal(x1, torch.full((1, 3), 0.5))
    for direction, act in (("forward", "none"), ("forward", "native"), ("backward", "tanh")):
        x0, x1 = public_canary_pair(direction, 3, 2.0, act)
        assert torch.equal(x0, torch.full((1, 3), -2.0)) and torch.equal(x1, torch.full((1, 3), 2.0))


def test_cli_audit_flags_a_plugin_that_hides_half_its_noise(plugdir, tmp_path, capsys):
    # before: its own canaries and ratio gave a lower bound of 0.000 and "ok" (exit 0)
    code, out, err, row = _audit_cli(capsys, tmp_path, "red_team_plugins:HalfNoise")
    ind, own = row["tests"]
    assert own["test"] == "plug-in's own" and own["empirical_epsilon_lower"] == 0.0 and not own["violation"]
    assert ind["test"] == "independent" and ind["violation"]
    claim = row["claimed_epsilon_by_accountant"]["pld"]
    assert claim == pytest.approx(1.993, abs=1e-3) and ind["empirical_epsilon_lower"] > claim + 0.1
    assert code == 1 and row["violation"] and row["empirical_epsilon_lower"] == ind["empirical_epsilon_lower"]
    lines = [ln for ln in err.splitlines() if "PRIVACY AUDIT VIOLATION" in ln]
    assert len(lines) == 1 and "red_team_plugins:HalfNoise/forward/1" in lines[0]
    assert "by the independent test" in lines[0] and "plug-in's own" not in lines[0]
    assert "VIOLATION" in out and "independent test" in out


def test_cli_audit_flags_half_noise_without_hooks_or_posing_as_a_builtin(plugdir, tmp_path, capsys):
    # no canary_pair is no longer a refusal: the audit needs nothing from the plug-in
    code, _, err, row = _audit_cli(capsys, tmp_path, "red_team_plugins:HalfNoiseNoHooks")
    assert code == 1 and [t["test"] for t in row["tests"]] == ["independent"] and row["tests"][0]["alpha"] == 0.05
    assert row["empirical_epsilon_lower"] > row["claimed_epsilon"] and "by the independent test" in err
    # a class whose __module__ and name say "fl_split's Gaussian": the configuration names a plug-in
    code, _, err, row = _audit_cli(capsys, tmp_path, "red_team_plugins:PosingAsBuiltin")
    assert code == 1 and row["tests"][0]["test"] == "independent" and row["tests"][0]["violation"], row


def test_cli_audit_passes_honest_plugins(plugdir, tmp_path, capsys):
    # the honest Gaussian (the red team's mechanism with the noise it claims): no false alarm, and
    # the independent test has power (a bound near its own test's)
    code, out, err, row = _audit_cli(capsys, tmp_path, "red_team_plugins:HonestGaussian")
    assert code == 0 and not row["violation"] and "VIOLATION" not in err + out, row
    ind, own = row["tests"]
    assert ind["empirical_epsilon_lower"] > 0.6 and own["empirical_epsilon_lower"] > 0.6
    assert max(ind["empirical_epsilon_lower"], own["empirical_epsilon_lower"]) < row["claimed_epsilon"]
    # the Laplace plug-in at 64 elements, both directions
    code, out, err, row = _audit_cli(capsys, tmp_path, "my_plugins:MyLaplace", "--epsilon", "4", "--clip-c", "1",
                                     "--width", "64", "--protect", "both")
    assert code == 0 and "VIOLATION" not in err + out


# -- no DP event: no privacy claimed ------------------------------------------------------------------
def test_plugin_without_dp_event_claims_no_privacy(plugdir, tmp_path, capsys):
    res = _train(RunConfig(**QUICK, defense=GS, protect="host", defense_options="rate=0.5"))
    host = res["privacy"]["host"]
    assert host["privacy_claim"] == "none" and host["epsilon"] is None and host["epsilons"] == {}
    assert "no privacy claimed" in host["assumptions"][0]
    assert host["mechanism"]["name"] == "gradient-sparsification" and host["mechanism"]["rate"] == 0.5
    assert "privacy_claim" not in res["privacy"]["guest-1"]  # unprotected, and said so as before
    from fl_split.rundir import curves_png, final_epsilons

    assert final_epsilons(res) == {} and curves_png(res)[:4] == b"\x89PNG"  # the run directory's plot: no epsilon
    # the console says it too, and prints no epsilon for the host
    code, out, err = run_cli(["train", "--dataset", "digits", "--limit", "300", "--epochs", "1", "--defense", GS,
                              "--protect", "host", "--no-progress", "--out", str(tmp_path / "run.json")], capsys)
    assert code == 0, err
    assert "no privacy claimed: host" in " ".join(out.split())
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["privacy"]["host"]["epsilon"] is None
    # nothing to charge: a budget would never bind
    code, _, err = run_cli(["train", "--defense", GS, "--protect", "host", "--budget", "2"], capsys)
    assert code == 2 and err.strip().startswith("fl-split: error: --budget: got 2.0") and "no privacy" in err
    # nothing to audit
    code, _, err = run_cli(["audit", "--defense", GS, "--protect", "host"], capsys)
    assert code == 2 and "--defense" in err and "no privacy claimed" in err and len(err.strip().splitlines()) == 1


def test_sparsification_keeps_the_largest_entries(plugdir):
    import torch

    from fl_split.privacy import factory

    cfg = RunConfig(defense=GS, protect="both", defense_options="rate=0.75")
    m = factory.backward_mechanism(cfg, 8)
    t = torch.tensor([[0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 0.05, 1.0]])
    out = m.release(t, None).value
    assert torch.equal(out, torch.tensor([[0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]]))
    assert factory.claims_dp(cfg, "host") is False and factory.claims_dp(cfg, "guest") is False
    with pytest.raises(ConfigError, match=r"--defense: got .*rate=1\.5"):
        factory.forward_mechanism(cfg.replace(defense_options="rate=1.5"), 8)


def test_plugin_gets_the_runs_public_parameters(plugdir):
    from fl_split.privacy import factory
    from fl_split.privacy.factory import Exhausted

    cfg = RunConfig(defense="my_plugins:MyLaplace", epsilon=4.0, clip_c=0.5, clip_c_backward=2.0, protect="both",
                    schedule="geometric", defense_options="a=1,b=0.5,mode=x")
    fwd, bwd = factory.forward_mechanism(cfg, 6, iteration=2), factory.backward_mechanism(cfg, 6, iteration=2)
    assert (fwd.spec.direction, fwd.spec.width, fwd.spec.bound, bwd.spec.bound) == ("forward", 6, 0.5, 2.0)
    assert fwd.spec.epsilon == 1.0 and fwd.spec.iteration == 2  # the geometric schedule's 4/2^2
    assert fwd.spec.options == {"a": 1, "b": 0.5, "mode": "x"}
    # past the schedule's exhaustion the party releases zeros (free), as for the built-ins
    assert isinstance(factory.forward_mechanism(cfg, 6, iteration=45), Exhausted)
    with pytest.raises(ConfigError, match="--defense-options: got 'a=1'.*plug-in"):
        RunConfig(defense="laplace", defense_options="a=1")
    with pytest.raises(ConfigError, match="--defense-options: got 'a'"):
        factory.forward_mechanism(cfg.replace(defense_options="a"), 6)


# -- bad plug-in strings: one line naming the flag ------------------------------------------------------
@pytest.mark.parametrize("value,fragment", [
    ("no_such_module_xyz:Cls", "cannot import module 'no_such_module_xyz'"),
    ("my_plugins:Missing", "has no 'Missing'"),
    ("my_plugins:not_a_class", "not a class"),
    ("my_plugins:NotAMechanism", "does not subclass fl_split.privacy.base.Mechanism"),
    ("my_plugins:NoEvent", "privacy_cost() returned a PrivacyCost whose dp_event is float"),
])
def test_bad_defense_plugin_is_one_line(plugdir, value, fragment, capsys):
    from fl_split.privacy import factory

    cfg = RunConfig(defense=value)
    with pytest.raises(ConfigError) as e:
        factory.check(cfg)
        factory.forward_mechanism(cfg, 4)
    text = str(e.value)
    assert text.startswith(f"--defense: got {value!r}") and fragment in text and "\n" not in text
    code, _, err = run_cli(["train", "--defense", value, "--epochs", "1", "--limit", "100"], capsys)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value,fragment", [
    ("my_plugins:MyLaplace", "does not subclass fl_split.attacks.base.Attack"),
    ("no_such_module_xyz:Attack", "cannot import module"),
    ("label-norms", "'package.module:Class'"),
])
def test_bad_attack_plugin_is_one_line(plugdir, value, fragment, capsys):
    from fl_split.attacks.runner import get_attack

    with pytest.raises(ConfigError) as e:
        get_attack(value)
    assert str(e.value).startswith(f"--attack: got {value!r}") and fragment in str(e.value)
    code, _, err = run_cli(["attack", "--attack", value, "--epochs", "1", "--limit", "100", "--no-progress"], capsys)
    assert code == 2 and f"--attack: got {value!r}" in err and len(err.strip().splitlines()) == 1


def test_one_resolver_for_builtins_and_plugins(plugdir):
    from fl_split.attacks.label import NormScoring
    from fl_split.plugins import resolve

    assert resolve("defense", "laplace") == "laplace"
    assert resolve("defense", "my_plugins:MyLaplace").__name__ == "MyLaplace"
    assert resolve("attack", "label-norm") is NormScoring
    assert resolve("attack", "cluster_label:ClusterLabelInference").name == "cluster-label"


# -- a plug-in attack sees its party's view only ------------------------------------------------------
RECORDING_ATTACK = '''
from cluster_label import ClusterLabelInference

SEEN = []


class Recording(ClusterLabelInference):
    name = "recording"

    def run(self, view, opts):
        SEEN.append(view)
        return super().run(view, opts)
'''


def test_plugin_attack_gets_exactly_its_partys_view(plugdir):
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import make_session, run_attack
    from tests.test_attacks import _assert_confined

    (plugdir / "recording_attack.py").write_text(RECORDING_ATTACK)
    cfg = RunConfig(dataset="credit", guests=2, limit=500, epochs=2, progress=False, defense="laplace",
                    protect="both", epsilon=50.0)
    opts = AttackOptions(attack="recording_attack:Recording", guest="guest-2")
    session = make_session(cfg, opts, SEED)
    res = run_attack(cfg, opts, SEED, session=session)
    import recording_attack

    (view,) = recording_attack.SEEN
    assert view.party == "guest-2" and res["adversary"] == "guest-2" and res["attack"] == "recording"
    _assert_confined(view, session)
    assert {o.receiver for o in view.inbox} == {"guest-2"} and {o.sender for o in view.outbox} == {"guest-2"}
    assert len(view.aux.known_labels) == 2 * 4  # the granted labels, nothing else


def test_cluster_label_example_beats_its_baseline(plugdir):
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import run_attack

    cfg = RunConfig(dataset="credit", guests=1, limit=800, epochs=2, progress=False)
    res = run_attack(cfg, AttackOptions(attack="cluster_label:ClusterLabelInference"), SEED)
    # measured 1.00 vs a majority rate of 0.72 on ~630 targets (binary task, gradients of a class share
    # a direction); accuracy SD on that many targets is <= 0.02, so 0.1 above the baseline is a wide margin
    assert res["value"] > res["baseline"] + 0.1, res["value"]


# -- the coordinator cannot inject code into a deployment node ------------------------------------------
EVIL = '''
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the module ran")
from fl_split.privacy.plugin import PluginMechanism


class Evil(PluginMechanism):
    pass
'''


def _setup(node_config: dict, cfg: dict):
    """The reply of a Flower node (``fl_split.flower.node.handle``, the ClientApp's work) to the
    coordinator's setup message carrying run config ``cfg``."""
    from flwr.app import Context, Message, RecordDict
    from flwr.common.serde import message_from_proto, message_to_proto

    from fl_split.flower import records as R
    from fl_split.flower.node import _PARTIES, handle

    ctx = Context(run_id=7, node_id=1001, node_config=dict(node_config), state=RecordDict(), run_config={})
    msg = Message(R.content(config=R.dumps(cfg), party="guest-1"), dst_node_id=1001, message_type=R.MSG_SETUP,
                  group_id="0")
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    try:
        return handle(message_from_proto(message_to_proto(msg)), ctx, PrivateSeed.legacy(3)).content
    finally:
        _PARTIES.clear()


@pytest.mark.usefixtures("flower_task_identity")
def test_a_clientapp_checks_the_plugin_when_it_is_set_up(plugdir):
    from fl_split.flower import records as R

    node = {"partition-id": 1, "num-partitions": 2}
    base = dict(dataset="digits", guests=1, limit=160, batch_size=16, protect="both", progress=False)
    ok = _setup(node, RunConfig(**base, defense="my_plugins:MyLaplace").to_flower())
    assert R.ERROR not in ok.config_records
    # a ClientApp process that cannot import the class says so at set-up, before any training
    bad = _setup(node, RunConfig(**base, defense="no_such_module_xyz:Cls").to_flower()).config_records[R.ERROR]
    assert bad["type"] == "ConfigError" and bad["message"].startswith("--defense: got 'no_such_module_xyz:Cls'")
    assert "every ClientApp process must be able to import it" in bad["message"]


@pytest.mark.usefixtures("flower_task_identity")
def test_coordinator_cannot_make_a_deployment_node_load_a_plugin(plugdir, monkeypatch):
    from fl_split.flower import records as R
    from fl_split.plugins import ENV_ALLOW, check_node_plugins

    (plugdir / "evil_plugin.py").write_text(EVIL)
    monkeypatch.delenv(ENV_ALLOW, raising=False)
    node = {"role": "guest", "guest-index": 1, "data-path": str(plugdir / "guest-1.npz")}
    for key, value in (("defense", "evil_plugin:Evil"), ("model", "evil_plugin:Evil"), ("defense", "os:system")):
        cfg = RunConfig(**QUICK).to_flower()
        cfg[key] = value
        reply = _setup(node, cfg)
        err = reply.config_records[R.ERROR]
        assert err["type"] == "ConfigError" and f"--{key}: got {value!r}" in err["message"]
        assert "node-config 'plugins'" in err["message"]
    assert not (plugdir / "IMPORTED").exists() and "evil_plugin" not in sys.modules
    # its operator's own list (node-config or environment) lets the same string through the check
    check_node_plugins({"defense": "evil_plugin:Evil"}, {**node, "plugins": "x:Y, evil_plugin:Evil"})
    check_node_plugins({"defense": "evil_plugin:Evil"}, node, environ={ENV_ALLOW: "evil_plugin:Evil"})
    with pytest.raises(ConfigError, match="--defense"):
        check_node_plugins({"defense": "evil_plugin:Evil"}, node, environ={ENV_ALLOW: "evil_plugin:Other"})
    # a simulation node runs the user's own config in the user's own process: not restricted
    check_node_plugins({"defense": "evil_plugin:Evil"}, {"partition-id": 1})
    assert not (plugdir / "IMPORTED").exists()


def test_deploy_local_lists_the_users_own_plugins_on_its_nodes(tmp_path):
    from fl_split.deploy import LocalDeployment

    cfg = RunConfig(dataset="digits", defense="my_plugins:MyLaplace", model="own_mlp:build")
    dep = LocalDeployment(cfg, tmp_path, tls=False)
    dep.party_file = lambda party: tmp_path / f"{party}.npz"
    text = dep.node_config("guest-1")
    assert "plugins='my_plugins:MyLaplace,own_mlp:build'" in text
    assert np.all([s in text for s in ("role='guest'", "guest-index=1")])


@pytest.mark.slow
def test_deploy_local_runs_a_plugin_defence_on_its_nodes(plugdir, tmp_path):
    """The whole deployment path as separate processes (a SuperLink, one SuperNode per party): each
    node is allowed the user's own plug-in by its node-config, imports it (PYTHONPATH, inherited) and
    charges it like a built-in; every process gone afterwards."""
    import os
    import subprocess

    from tests.test_deploy import FLSPLIT, _deployment_pids, _kill

    workdir, out_path = tmp_path / "dep", tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), str(plugdir)])}
    env.pop("FL_SPLIT_PLUGINS", None)
    proc = subprocess.run([*FLSPLIT, "deploy", "local", "--dataset", "digits", "--guests", "1", "--epochs", "1",
                           "--limit", "150", "--defense", "my_plugins:MyLaplace", "--epsilon", "8", "--clip-c", "0.01",
                           "--workdir", str(workdir), "--out", str(out_path)],
                          capture_output=True, text=True, timeout=900, env=env)
    left = _deployment_pids(workdir)
    _kill(left)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == [], f"processes left running: {left}"
    guest = json.loads(out_path.read_text())["privacy"]["guest-1"]
    assert guest["mechanism"]["name"] == "my-laplace" and guest["epsilon"] > 0
