"""Bring your own model (``--model package.module:function``, fl_split.models.user) and one-way
layers (no import cycles in the package).

``examples/own_mlp.py`` (``--model own_mlp:build`` with ``examples`` on the path) re-creates the built-in ``mlp`` from plain ``torch.nn`` layers in the same
construction order; called under each party's private seeded RNG it must give the same initial
weights, hence bit-identical training (CPU, one thread) to ``--model mlp`` — in the local engine,
the monolithic reference and the Flower app (inline, the real strategy and ClientApp handler).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fl_split.builder import make_parties, plan_run
from fl_split.config import RunConfig
from fl_split.engine import LocalEngine, MonolithicEngine
from fl_split.errors import ConfigError
from fl_split.models.user import ModelSpec, UserArchitecture
from fl_split.seeding import PrivateSeed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:  # as a user runs it: PYTHONPATH=examples (docs/models.md)
    sys.path.insert(0, str(EXAMPLES))

OWN = "own_mlp:build"
PS = PrivateSeed.legacy(23)
BASE = dict(dataset="digits", guests=2, epochs=2, batch_size=32, lr=0.01, limit=300, progress=False, seed=5,
            device="cpu")


def _strip(results: dict) -> dict:
    """Results minus what differs between two runs of the same model (names, wall times)."""
    out = json.loads(json.dumps(results, default=str))
    for part in ("config", "plan"):
        out[part].pop("model", None)
        out[part].pop("cut_layer", None)
    out.pop("time_s", None)
    for h in out["history"]:
        h.pop("epoch_time_s", None)
    return out


def _state(module: nn.Module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kw", [{}, {"cut_layer": 2}, {"host_features": False, "merge": "sum"},
                                {"defense": "gaussian", "protect": "guest", "epsilon": 4.0}])
def test_user_model_has_the_builtin_initial_weights(kw):
    """Every party's modules: same structure and same private initial weights as ``--model mlp``
    (the Gaussian defence asks both for a tanh-ended guest bottom)."""
    cfg_b = RunConfig(**BASE, model="mlp", **kw)
    cfg_u = cfg_b.replace(model=OWN)
    hb, gb, plan_b = make_parties(cfg_b, PS)
    hu, gu, plan_u = make_parties(cfg_u, PS)
    assert plan_u.cut_shapes == plan_b.cut_shapes and plan_u.merged_shape == plan_b.merged_shape
    for g in gb:
        assert str(gu[g].update.modules[0]) == str(gb[g].update.modules[0])
        sb, su = _state(gb[g].update.modules[0]), _state(gu[g].update.modules[0])
        assert sb.keys() == su.keys() and all(torch.equal(sb[k], su[k]) for k in sb)
    assert len(hu.update.modules) == len(hb.update.modules)
    for mb, mu in zip(hb.update.modules, hu.update.modules):
        assert str(mu) == str(mb)
        assert all(torch.equal(a, b) for a, b in zip(mb.state_dict().values(), mu.state_dict().values()))
    # another private seed gives other weights (the equality above is not vacuous)
    other, _, _ = make_parties(cfg_u, PrivateSeed.legacy(24))
    assert not torch.equal(other.update.modules[-1][-1].weight, hu.update.modules[-1][-1].weight)


def test_user_model_trains_bit_identically_to_the_builtin_local_and_monolithic():
    cfg_b = RunConfig(**BASE, model="mlp")
    cfg_u = cfg_b.replace(model=OWN)
    builtin, own = LocalEngine(cfg_b, PS).run(), LocalEngine(cfg_u, PS).run()
    assert _strip(own) == _strip(builtin)
    assert own["config"]["model"] == OWN
    losses = [h["train_loss"] for h in own["history"]]
    assert losses[-1] < losses[0]
    mono = MonolithicEngine(cfg_u, private_seed=PS).run()
    np.testing.assert_allclose([h["train_loss"] for h in mono["history"]], losses, rtol=1e-6, atol=0)


@pytest.mark.parametrize("attack", ["inversion", "membership", "fsha"])
def test_attacks_on_a_user_model_equal_the_builtin(attack):
    """``fl-split attack --model module:function``: the white-box copy (inversion), the shadow models
    (membership) and FSHA's pilot are built from the user's function as the parties' modules are, so
    on a copy of ``mlp`` every attack scores exactly as on ``--model mlp``."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import run_attack

    opts = AttackOptions(attack=attack, attack_epochs=2, attack_records=8)
    cfg_b = RunConfig(**{**BASE, "epochs": 1}, model="mlp")
    builtin = run_attack(cfg_b, opts, PS)
    own = run_attack(cfg_b.replace(model=OWN), opts, PS)
    assert (own["metric"], own["value"], own["baseline"]) == (builtin["metric"], builtin["value"], builtin["baseline"])
    assert own["details"] == builtin["details"]


def test_user_model_in_the_flower_app_equals_the_builtin(flower_task_identity):
    """The Flower app (inline: real strategy and ClientApp handler, each node building its own party
    from the run config's ``model`` key) with the user model ≡ the local engine with ``mlp``."""
    tf = pytest.importorskip("tests.test_flower")
    from fl_split.flower.strategy import VerticalSplitStrategy

    cfg = tf._cfg(model=OWN)
    got = VerticalSplitStrategy(cfg).run(tf.InlineGrid(tf._simulation_nodes(3), fresh_process=True))
    ref = tf._local(cfg.replace(model="mlp"))
    assert _strip(tf._strip(got)) == _strip(tf._strip(ref))


# -- errors: one line naming --model, the value and what is allowed --------------------------------

@pytest.mark.parametrize("value,reason", [
    ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
    ("own_mlp:no_such_function", "has no 'no_such_function'"),
    ("own_mlp:HIDDEN", "is not callable"),
    ("own_mlp:not_a_module", "a function that returns a torch.nn.Module"),
])
def test_user_model_errors_name_the_flag(value, reason):
    cfg = RunConfig(**BASE, model=value)
    with pytest.raises(ConfigError, match="--model") as e:
        make_parties(cfg, PS)
    msg = str(e.value)
    assert value in msg and reason in msg and "\n" not in msg
    assert "package.module:function" in msg or "nn.Module" in msg


@pytest.mark.parametrize("value", ["no-colon", "a:b:c", "examples/own_mlp.py:build", "mod:", ":fn", "1mod:fn"])
def test_malformed_model_values_are_refused_by_the_config(value):
    with pytest.raises(ConfigError, match="--model") as e:
        RunConfig(**BASE, model=value)
    assert "package.module:function" in str(e.value) and "mlp" in str(e.value)


def test_hidden_and_norm_are_refused_for_a_user_model():
    with pytest.raises(ConfigError, match="--hidden"):
        plan_run(RunConfig(**BASE, model=OWN, hidden="16"))


def test_a_guest_bottom_that_ignores_the_defence_activation_is_refused():
    """R3eLU owns the cut-layer activation (bare last layer): a bottom ending with ReLU is refused."""
    def relu_always(spec):
        return nn.Sequential(nn.Linear(spec.in_shape[0], 4), nn.ReLU()) if spec.part == "bottom" \
            else nn.Linear(spec.in_shape[0], spec.num_outputs)

    sys.modules[__name__].relu_always = relu_always
    arch = UserArchitecture(f"{__name__}:relu_always")
    with pytest.raises(ConfigError, match="--model.*ends with ReLU.*cut_activation 'none'"):
        arch.bottom_for("guest-1", (8,), "none")
    with pytest.raises(ConfigError, match="cut_activation 'tanh'"):
        arch.bottom_for("guest-1", (8,), "tanh")
    assert isinstance(arch.bottom_for("host", (8,), "none")[-1], nn.ReLU)  # the host's own bottom: native


def test_spec_tells_party_role_shapes_and_task():
    seen: list[ModelSpec] = []

    def record(spec):
        seen.append(spec)
        from own_mlp import build
        return build(spec)

    sys.modules[__name__].record = record
    make_parties(RunConfig(**BASE, model=f"{__name__}:record", cut_layer=2), PS)
    parts = {(s.party, s.part) for s in seen}
    assert {("host", "bottom"), ("guest-1", "bottom"), ("guest-2", "bottom"), ("host", "top")} <= parts
    top = next(s for s in seen if s.part == "top")
    assert top.num_outputs == 10 and top.metric == "accuracy" and top.cut == 2 and top.role == "host"
    g1 = next(s for s in seen if s.party == "guest-1")
    assert g1.role == "guest" and g1.cut_activation == "native" and len(g1.in_shape) in (1, 3)


@pytest.mark.parametrize("defense", ["gaussian", "dpsgd"])
def test_batchnorm_in_a_user_model_is_refused_under_a_defence(defense):
    """BatchNorm mixes the records of a batch: a party claiming DP refuses it, as for built-ins."""
    cfg = RunConfig(**BASE, model="own_mlp:build_batchnorm", defense=defense, protect="guest", epsilon=4.0)
    with pytest.raises(ConfigError, match="BatchNorm|batch"):
        make_parties(cfg, PS)
    # without a defence the same module is fine (it trains like --norm batch would)
    make_parties(cfg.replace(defense="none"), PS)


# -- one-way layers ---------------------------------------------------------------------------------

def _import_graph() -> dict[str, set[str]]:
    """Module → the fl_split modules it imports, from the source (``ast``): module-level *and*
    function-level imports count (a lazy import is still an arrow a reader must follow); imports
    under ``if TYPE_CHECKING:`` do not (they never run). ``from a.b import c`` points at ``a.b.c``
    when that is a module, else at ``a.b``; a package's ``__init__`` is not implied."""
    root = Path(__file__).resolve().parents[1]
    mods = {}
    for f in (root / "fl_split").rglob("*.py"):
        rel = f.relative_to(root).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[m] |= {t for t in map(resolve, targets) if t and t != m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), i.e. every import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    """The package reads bottom-up (docs/design.md, "One-way layers"): no import circle at all,
    lazy (function-level) imports included."""
    graph = _import_graph()
    # the walker sees the arrows it must (guards against a vacuous pass)
    assert "fl_split.builder" in graph["fl_split.engine"] and "fl_split.builder" in graph["fl_split.party_files"]
    assert "fl_split.cli_support" in graph["fl_split.attacks.cli"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles(graph) == []
    # the three circles of issue 17 are gone in both directions' worst arrow
    assert "fl_split.engine" not in graph["fl_split.builder"]
    assert "fl_split.cli" not in graph["fl_split.attacks.cli"] | graph["fl_split.privacy.audit_cli"]
    assert "fl_split.privacy.ledger" not in graph["fl_split.privacy.report"]
