"""Flower start-up (issue 18): simulated parties built from what the driver prepared once, and a
ClientApp that imports only what it uses.

* :mod:`fl_split.flower.prepared` — a party built from its handed-over slice is bit-identical to
  one built from data the node prepared itself; a node never gets another party's slice; a run
  whose nodes build from the handoff equals the local engine and never prepares the dataset on a
  node (inline, and on Ray: ``slow``).
* :func:`fl_split.local_update.defer_dynamo_import` — the first optimizer of a process does not
  import ``torch._dynamo``, and training gives the same parameters either way.
* the import chain of a ClientApp building its party from a slice loads neither pandas, scikit-learn,
  matplotlib nor ``torch._dynamo`` (a fresh interpreter, as a Ray actor is).

No wall-clock assertions: ``experiments/bench_flower.py --only startup`` measures the times.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_split.config import RunConfig
from fl_split.errors import ProtocolError
from fl_split.flower import prepared as P
from fl_split.flower.node import NodeRole, build_party, handle, plan_of
from fl_split.parties import export_flat
from fl_split.seeding import PrivateSeed

ROOT = Path(__file__).resolve().parents[1]
PS = PrivateSeed.parse("5eed0c4f9a2e7b13d86f1a0b3c5e7d92")


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=2, epochs=2, limit=300, batch_size=32, seed=1, progress=False, device="cpu")
    base.update(kw)
    return RunConfig(**base)


def _role(party: str) -> NodeRole:
    return NodeRole("host", "host", 0, "simulation") if party == "host" else \
        NodeRole(party, "guest", int(party.split("-")[1]), "simulation")


def _same_state(a, b) -> None:
    arrays_a, skel_a = export_flat(a)
    arrays_b, skel_b = export_flat(b)
    assert skel_a == skel_b
    assert arrays_a.keys() == arrays_b.keys()
    for k in arrays_a:
        assert np.array_equal(np.asarray(arrays_a[k]), np.asarray(arrays_b[k])), k


@pytest.mark.parametrize("kw", [{}, {"defense": "gaussian", "protect": "both", "denoise": "scale"},
                                {"host_features": False, "guests": 3}])
def test_a_party_built_from_its_slice_is_bit_identical(kw):
    """Every party built from the driver's slice (pickled, as Ray's object store hands it over)
    equals the party its node builds from data it prepares itself: state, data tensors, plan."""
    cfg = _cfg(**kw)
    handoff = P.Handoff.offer([cfg], put=lambda s: pickle.loads(pickle.dumps(s)))
    for party in cfg.parties:
        role = _role(party)
        own, own_facts = build_party(cfg, role, PS)
        got, got_facts = build_party(cfg, role, PS, handoff=handoff)
        _same_state(own, got)
        for field in ("x_train", "x_test", "y_train", "y_test"):
            a, b = getattr(own.data, field, None), getattr(got.data, field, None)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (party, field)
        assert np.array_equal(own.data.train_ids, got.data.train_ids)
        plan, want = plan_of(cfg, role, handoff=handoff), plan_of(cfg, role)
        assert (plan.schedule.n_train, plan.cut_shapes, plan.input_shapes, plan.merged_shape) == \
            (want.schedule.n_train, want.cut_shapes, want.input_shapes, want.merged_shape)
        # what the setup reply says is what it said before (a guest's facts never carry the label space)
        reply = (lambda f: f.to_json() if party == "host" else f.without_labels().to_json())
        assert reply(got_facts) == reply(own_facts)
        if party != "host":
            assert got_facts.num_classes is None


def test_the_handoff_holds_only_what_it_covers_and_refuses_another_partys_slice():
    cfg = _cfg()
    handoff = P.Handoff.offer([cfg])
    assert set(next(iter(handoff.slices.values()))) == set(cfg.parties)
    assert handoff.fetch(cfg.replace(seed=2), "host") is None          # other data: the node prepares it
    assert handoff.fetch(cfg.replace(lr=0.5), "host") is not None       # same data, other training options
    assert P.Handoff.offer([cfg.replace(one_shot=True)]).slices == {}   # one-shot: not covered
    swapped = P.Handoff({P.data_key(cfg): {"guest-1": handoff.slices[P.data_key(cfg)]["guest-2"]}})
    P._FETCHED.pop((P.data_key(cfg), "guest-1"), None)
    with pytest.raises(ProtocolError, match="another party's data"):
        swapped.fetch(cfg, "guest-1")


def test_inline_run_from_the_handoff_equals_local_engine_and_never_prepares_on_a_node(monkeypatch, flower_task_identity):
    """The real strategy and ClientApp handlers (every message restores the party from its node
    state), each node building its party from the handoff: the local engine's results bit for
    bit, and no node prepared the dataset (``prepare_data`` fails if called)."""
    from tests.test_flower import InlineGrid, _local, _simulation_nodes, _strip

    from fl_split.flower.strategy import VerticalSplitStrategy

    cfg = _cfg(epochs=2)
    want = _local(cfg)
    handoff = P.Handoff.offer([cfg], put=lambda s: pickle.loads(pickle.dumps(s)))
    P._FETCHED.clear()
    P._PLANS.clear()

    def refuse(*a, **k):
        raise AssertionError("a node prepared the dataset itself")

    import fl_split.builder

    monkeypatch.setattr(fl_split.builder, "prepare_data", refuse)
    monkeypatch.setattr("fl_split.flower.node._simulation_plan", refuse)
    grid = InlineGrid(_simulation_nodes(cfg.guests + 1), app=lambda m, c: handle(m, c, PS, handoff),
                      fresh_process=True)
    # the coordinator plans from the host's public facts, never from data
    got = VerticalSplitStrategy(cfg).run(grid)
    assert _strip(got) == _strip(want)


# -- imports -------------------------------------------------------------------------------------
def _run(code: str, tmp_path: Path, *args: str) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(code)
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAVY = ("pandas", "sklearn", "matplotlib", "torch._dynamo", "scipy", "opacus", "dp_accounting", "fl_split.attacks")


def test_a_clientapp_building_from_its_slice_imports_nothing_heavy(tmp_path):
    """A fresh interpreter (as a Ray actor) that loads the ClientApp, unpickles its slice and
    answers ``setup`` imports none of the modules only data preparation, plotting, attacks or
    ``torch.compile`` need."""
    cfg = _cfg()
    handoff = P.Handoff.offer([cfg])
    (tmp_path / "slice.pkl").write_bytes(pickle.dumps(handoff.slices[P.data_key(cfg)]["guest-1"]))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    code = f"""
import json, pickle, sys
from fl_split.flower.node import make_client_app, build_party, NodeRole
from fl_split.config import RunConfig
from fl_split.flower.prepared import Handoff, data_key
from fl_split.seeding import PrivateSeed
after_import = sorted(m for m in {HEAVY!r} if m in sys.modules)
cfg = RunConfig.from_mapping(json.load(open("cfg.json")))
handoff = Handoff({{data_key(cfg): {{"guest-1": pickle.load(open("slice.pkl", "rb"))}}}})
make_client_app(PrivateSeed.parse("5eed0c4f9a2e7b13d86f1a0b3c5e7d92"), handoff)
party, _ = build_party(cfg, NodeRole("guest-1", "guest", 1, "simulation"), PrivateSeed.parse("5eed0c4f9a2e7b13d86f1a0b3c5e7d92"),
                       handoff=handoff)
party.update.zero_grad()
party.update.state_dict()
print(json.dumps({{"after_import": after_import,
                  "after_setup": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
    got = _run(code, tmp_path)
    assert got == {"after_import": [], "after_setup": []}


DYNAMO_PROBE = """
import hashlib, json, sys
import torch
if sys.argv[1] == "dynamo-first":
    import torch._dynamo
from fl_split.local_update import OptimizerSettings, OptimizerUpdate
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
update = OptimizerUpdate([model], OptimizerSettings("adam", lr=0.01))  # a party's own update policy
x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))

def train(steps):
    for _ in range(steps):
        update.zero_grad()
        update.backward(torch.nn.functional.cross_entropy(model(x), y))
        update.step()

train(5)
update.load_state_dict(update.state_dict())
loaded_before = "torch._dynamo" in sys.modules
import torch._dynamo  # from now on the optimizer's wrappers behave as PyTorch's own
train(2)
update.load_state_dict(update.state_dict())
h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(json.dumps({"dynamo_loaded_by_training": loaded_before, "params": h}))
"""


def test_the_first_optimizer_does_not_import_dynamo_and_trains_the_same(tmp_path):
    """A party's update policy (Adam's construction, steps, ``zero_grad``, a ``state_dict`` round
    trip) leaves
    ``torch._dynamo`` unimported; the parameters equal those of a process that imported it first
    (PyTorch's own wrappers), also after ``torch._dynamo`` is imported mid-way."""
    lazy = _run(DYNAMO_PROBE, tmp_path, "lazy")
    eager = _run(DYNAMO_PROBE, tmp_path, "dynamo-first")
    assert lazy["dynamo_loaded_by_training"] is False
    assert eager["dynamo_loaded_by_training"] is True
    assert lazy["params"] == eager["params"]


def _grads_after(backward, module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    backward(module(x), grad)
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("shape", ["mlp", "cnn"])
def test_backward_through_the_cut_equals_backward_with_the_gradient_bit_for_bit(shape):
    """A party's backward with the gradient it received (the split backward) is taken as the
    backward of sum(out ⊙ grad): every parameter gradient is bit-identical to ``out.backward(grad)``,
    over gradients spanning 12 orders of magnitude, zeros and signed zeros included."""
    from fl_split.local_update import backward_through

    torch.manual_seed(3)
    if shape == "mlp":
        module, x = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)), \
            torch.randn(16, 20)
    else:
        module, x = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten()), \
            torch.randn(8, 1, 8, 8)
    out_shape = module(x).shape
    grad = torch.randn(out_shape) * torch.logspace(-6, 6, out_shape.numel()).reshape(out_shape)
    grad.view(-1)[:5] = torch.tensor([0.0, -0.0, 0.0, 1e-38, -1e-38])
    want = _grads_after(lambda out, g: out.backward(g), module, x, grad)
    got = _grads_after(backward_through, module, x, grad)
    for w, g in zip(want, got):
        assert torch.equal(w, g) and w.dtype == g.dtype


def test_backward_through_refuses_a_gradient_of_another_shape():
    from fl_split.local_update import backward_through

    out = torch.nn.Linear(4, 3)(torch.randn(5, 4))
    for bad in (torch.ones(5, 1), torch.ones(3), torch.ones(5, 3, 1)):  # a product would broadcast these
        with pytest.raises(RuntimeError, match=r"Mismatch in shape: grad_output\[0\] has a shape of"):
            backward_through(out, bad)


def test_a_guest_s_steps_import_neither_symbolic_shapes_nor_sympy(tmp_path):
    """A fresh interpreter (as a Ray actor) that builds a guest and runs its backward with a received
    gradient never imports ``torch.fx.experimental.symbolic_shapes`` or sympy (what
    ``out.backward(grad)`` imports the first time in a process)."""
    code = """
import json, sys
import torch
from fl_split.local_update import OptimizerSettings, OptimizerUpdate
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
update = OptimizerUpdate([model], OptimizerSettings("sgd", lr=0.1))
for _ in range(3):
    update.zero_grad()
    out = model(torch.randn(4, 8))
    update.backward(out, torch.randn(4, 16))
    update.step()
print(json.dumps(sorted(m for m in ("sympy", "torch.fx.experimental.symbolic_shapes") if m in sys.modules)))
"""
    assert _run(code, tmp_path) == []


# -- on Ray ------------------------------------------------------------------------------------------
def recording_client_app(private_seed=None, handoff=None):
    """The fl_split ClientApp, each reply also recorded to ``$FL_SPLIT_TEST_RECORD``: whether this
    actor prepared the dataset itself, what it fetched from the handoff, heavy modules loaded."""
    from fl_split.flower.node import client_app_for

    def _handle(message, context):
        import os

        import fl_split.builder
        from fl_split.flower import prepared

        reply = handle(message, context, private_seed, handoff)
        with open(os.environ["FL_SPLIT_TEST_RECORD"], "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "type": message.metadata.message_type,
                                 "prepared_here": fl_split.builder._prepare.cache_info().currsize,
                                 "fetched": prepared.stats["fetched"],
                                 "heavy": [m for m in HEAVY if m in sys.modules]}) + "\n")
        return reply

    return client_app_for(_handle)


@pytest.mark.slow
def test_simulation_actors_build_their_parties_from_the_driver_s_slices(tmp_path, monkeypatch):
    """On Ray, ``fl-split train --engine flower``'s actors fetch their party's slice and never
    prepare the dataset or import pandas / scikit-learn / ``torch._dynamo``; the results equal the
    local engine's."""
    from tests.test_flower import _local, _sim_cpus, _strip

    from fl_split.flower import FlowerEngine

    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FL_SPLIT_TEST_RECORD", str(record))  # the actors inherit this process's environment
    monkeypatch.setattr("fl_split.flower.node.make_client_app", recording_client_app)
    cfg = _cfg(engine="flower", num_cpus=_sim_cpus(3), epochs=1)
    got = FlowerEngine(cfg, private_seed=PS).run()
    assert _strip(got) == _strip(_local(cfg))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert {r["type"] for r in rows} >= {"query.setup", "train.epoch"}
    assert all(r["prepared_here"] == 0 and r["heavy"] == [] for r in rows), rows
    assert all(r["fetched"] >= 1 for r in rows if r["type"] != "query.role"), rows


# -- Flower's in-process runtime made prompt, Ray's shutdown without the monitor's grace ----------
class _Recorded:
    """Stands in for the object a wrapper hands a timed wait to; records the timeout."""

    def __init__(self) -> None:
        self.timeouts: list = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        return False

    def is_set(self):
        return False


def test_prompt_stop_caps_timed_waits_only():
    """The delivery thread's ``f_stop.wait(0.1)`` becomes a wait of at most DELIVERY_POLL; an
    untimed wait and a shorter one are passed on unchanged; setting and reading reach the real event."""
    import threading

    from fl_split.flower.vce import DELIVERY_POLL, PromptStop

    rec = _Recorded()
    stop = PromptStop(rec)
    stop.wait(0.1), stop.wait(None), stop.wait(DELIVERY_POLL / 4)
    assert rec.timeouts == [DELIVERY_POLL, None, DELIVERY_POLL / 4]
    event = threading.Event()
    wrapped = PromptStop(event)
    assert not wrapped.is_set()
    wrapped.set()
    assert event.is_set() and wrapped.is_set() and wrapped.wait(0.1) is True


def test_prompt_queue_caps_timed_gets_and_returns_items_at_once(monkeypatch):
    import queue

    from fl_split.flower.vce import STOP_POLL, PromptQueue

    seen = []
    real_get = queue.Queue.get
    monkeypatch.setattr(queue.Queue, "get", lambda self, block=True, timeout=None: (seen.append(timeout),
                                                                                     real_get(self, block, timeout))[1])
    q = PromptQueue()
    with pytest.raises(queue.Empty):
        q.get(timeout=1.0)
    q.put("message")
    assert q.get(timeout=1.0) == "message"
    q.put("next")
    assert q.get() == "next"
    assert seen == [STOP_POLL, STOP_POLL, None]


def test_prompt_runtime_substitutes_for_the_block_and_only_a_runtime_of_the_expected_shape(monkeypatch):
    """Inside the block Flower's ``run_api`` gets the wrapped stop event (the same call otherwise) and
    its queues are PromptQueues; after it Flower's own are back. A runtime whose ``run_api`` takes no
    ``f_stop`` is left alone."""
    import queue
    import threading

    from flwr.server.superlink.fleet.vce import vce_api

    from fl_split.flower.vce import PromptQueue, PromptStop, prompt_runtime

    calls = []

    def run_api(app_fn, backend_fn, nodes_mapping, state_factory, node_info_stores, f_stop, metrics):
        calls.append((app_fn, metrics, f_stop, vce_api.Queue))

    monkeypatch.setattr(vce_api, "run_api", run_api)
    event = threading.Event()
    with prompt_runtime() as made:
        assert made is True
        vce_api.run_api("app", "backend", {}, "state", {}, event, metrics="m")
    app_fn, metrics, f_stop, queue_class = calls[0]
    assert (app_fn, metrics, queue_class) == ("app", "m", PromptQueue)
    assert isinstance(f_stop, PromptStop) and f_stop.event is event
    assert vce_api.run_api is run_api and vce_api.Queue is queue.Queue

    monkeypatch.setattr(vce_api, "run_api", lambda app_fn, backend_fn, stop_event: None)
    with prompt_runtime() as made:
        assert made is False and vce_api.Queue is queue.Queue


def test_shutdown_ends_only_the_monitor_without_grace(monkeypatch):
    """Ray's shutdown of the engine's local instance SIGKILLs the autoscaler monitor at once (it
    used Ray's whole second of grace every time); every other daemon keeps its graceful end."""
    from ray._private import ray_constants
    from ray._private import worker as ray_worker

    from fl_split.flower.engine import _end_monitor_without_grace

    class Node:
        def __init__(self) -> None:
            self.calls = []

        def _kill_process_impl(self, process_type, allow_graceful=False, check_alive=True, wait=False):
            self.calls.append((process_type, allow_graceful, check_alive, wait))

    node = Node()
    monkeypatch.setattr(ray_worker, "_global_node", node)
    _end_monitor_without_grace()
    for kind in (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_MONITOR,
                 ray_constants.PROCESS_TYPE_GCS_SERVER):
        node._kill_process_impl(kind, allow_graceful=True, check_alive=False, wait=False)
    assert node.calls == [(ray_constants.PROCESS_TYPE_RAYLET, True, False, False),
                          (ray_constants.PROCESS_TYPE_MONITOR, False, False, False),
                          (ray_constants.PROCESS_TYPE_GCS_SERVER, True, False, False)]
    monkeypatch.setattr(ray_worker, "_global_node", None)
    _end_monitor_without_grace()  # no local node: nothing to change, no error


def test_a_data_error_stops_the_run_before_ray_starts(monkeypatch, flower_task_identity):
    """A configuration only the data can refuse (a cut layer the model does not have) stops the run
    with the data's error before Ray is started (the engine checks the data first; overlapping the
    two was tried and dropped, docs/flower.md "Issue 18, second pass")."""
    from fl_split.errors import ConfigError
    from fl_split.flower import FlowerEngine

    def no_ray(self):
        raise AssertionError("Ray was started for a run its data refuse")

    monkeypatch.setattr(FlowerEngine, "_start_ray", no_ray)
    with pytest.raises(ConfigError, match=r"^--cut-layer: got 99; allowed: an integer in 1\.\.2 for model 'mlp'"):
        FlowerEngine(_cfg(engine="flower", cut_layer=99), private_seed=PS).run()
