"""Named architectures (``fl_split.models``): shapes compose across parties, cuts are validated,
the guest's cut activation replaces exactly the bottom's last nonlinearity, the paper
architectures have the papers' layer sizes and parameter counts, and image models train
split ≡ monolithic and to a sensible accuracy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from fl_split.builder import plan_run
from fl_split.cli import main as cli_main
from fl_split.config import RunConfig
from fl_split.engine import LocalEngine, MonolithicEngine, run_experiment
from fl_split.errors import ConfigError
from fl_split.merge import merged_shape
from fl_split.seeding import PartySecret, PrivateSeed
from fl_split.models.registry import build_bottom, build_modules, get_architecture, model_names, output_shape
from fl_split.models.vision import CutBasicBlock, PadShortcut, stripe_pool

IMAGE_MODELS = ("cnn-stripe", "cnn-mnist", "resnet18-split", "resnet20")
MLP_MODELS = ("mlp", "movielens-mlp", "bookcrossing-mlp", "mnist-mlp-bn")


def _stripes(c: int, h: int, w: int, parties: int) -> dict[str, tuple[int, ...]]:
    """Contiguous vertical stripes of a (c, h, w) image, as the data partition makes them."""
    names = ["host"] + [f"guest-{i}" for i in range(1, parties)]
    bounds = np.linspace(0, w, parties + 1).round().astype(int)
    return {p: (c, h, int(b - a)) for p, a, b in zip(names, bounds[:-1], bounds[1:])}


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _forward(sm, shapes, batch=3, seed=0):
    """Run random inputs through the built modules; returns (cut outputs, merged, logits)."""
    gen = torch.Generator().manual_seed(seed)
    outs = {}
    for p, s in shapes.items():
        sm.bottoms[p].eval()
        outs[p] = sm.bottoms[p](torch.randn((batch, *s), generator=gen))
    merged = sm.merge([outs[p] for p in shapes])
    sm.top.eval()
    return outs, merged, sm.top(merged)


# --------------------------------------------------------------------------------------------
# registry and CLI listing


def test_registry_has_image_architectures():
    names = model_names()
    for name in IMAGE_MODELS:
        assert name in names
        arch = get_architecture(name)
        assert arch.inputs == "image"
        assert 1 <= arch.default_cut <= arch.num_layers()
    for name in MLP_MODELS:
        assert get_architecture(name).inputs == "vector"


def test_cli_models_lists_every_architecture(capsys):
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│") and
            line.split("│")[1].strip()}
    for name in IMAGE_MODELS:
        arch = get_architecture(name)
        assert name in rows, out
        assert "image" in rows[name] and f"1..{arch.num_layers()}" in rows[name]
        assert f"│ {arch.default_cut} " in rows[name]
    for name in MLP_MODELS:
        assert name in rows and "vector" in rows[name]


# --------------------------------------------------------------------------------------------
# shapes compose: bottoms -> merge -> top, for 1, 2, 3 parties, concat and sum

#: (model, cut, full image shape or vector width); resnet18 on 16x16 images keeps this fast
SHAPE_CASES = [
    ("cnn-stripe", 1, (1, 8, 8)), ("cnn-stripe", 2, (1, 8, 8)), ("cnn-stripe", 3, (1, 8, 8)),
    ("cnn-stripe", 2, (1, 28, 28)),
    ("cnn-mnist", 1, (1, 8, 8)), ("cnn-mnist", 2, (1, 28, 28)), ("cnn-mnist", 3, (1, 8, 8)),
    ("resnet20", 1, (3, 8, 8)), ("resnet20", 3, (3, 32, 32)), ("resnet20", 4, (3, 8, 8)), ("resnet20", 5, (3, 32, 32)),
    ("resnet18-split", 2, (3, 16, 16)), ("resnet18-split", 5, (3, 16, 16)), ("resnet18-split", 6, (3, 16, 16)),
]


@pytest.mark.parametrize("parties", [1, 2, 3])
@pytest.mark.parametrize("model,cut,image", SHAPE_CASES,
                         ids=[f"{m}-cut{c}-{'x'.join(map(str, i))}" for m, c, i in SHAPE_CASES])
def test_image_shapes_compose_concat(model, cut, image, parties):
    shapes = _stripes(*image, parties)
    sm = build_modules(model, cut, "concat", shapes, 10, private_seed=PrivateSeed.legacy(1))
    outs, merged, logits = _forward(sm, shapes)
    for p, s in shapes.items():
        assert tuple(outs[p].shape[1:]) == sm.cut_shapes[p] == output_shape(sm.bottoms[p], s)
    # concat re-assembles the stripes side by side: same leading axes, widths add up
    first = sm.cut_shapes["host"]
    assert all(s[:-1] == first[:-1] for s in sm.cut_shapes.values())
    assert sm.merged_shape == (*first[:-1], sum(s[-1] for s in sm.cut_shapes.values()))
    assert tuple(merged.shape[1:]) == sm.merged_shape
    assert tuple(logits.shape) == (3, 10)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model,cut,image", SHAPE_CASES[::2], ids=[f"{m}-cut{c}" for m, c, _ in SHAPE_CASES[::2]])
def test_image_shapes_compose_sum_equal_stripes(model, cut, image):
    c, h, w = image
    shapes = {"host": (c, h, w // 2), "guest-1": (c, h, w // 2), "guest-2": (c, h, w // 2)}
    sm = build_modules(model, cut, "sum", shapes, 7, private_seed=PrivateSeed.legacy(2))
    outs, merged, logits = _forward(sm, shapes)
    assert sm.merged_shape == sm.cut_shapes["host"] == tuple(merged.shape[1:])
    torch.testing.assert_close(merged, outs["host"] + outs["guest-1"] + outs["guest-2"])
    assert tuple(logits.shape) == (3, 7)


def test_sum_of_unequal_stripe_outputs_is_refused():
    shapes = {"host": (1, 8, 1), "guest-1": (1, 8, 4)}  # conv1 outputs 16x4x1 vs 16x4x2
    with pytest.raises(ConfigError, match=r"--merge.*host=16x4x1, guest-1=16x4x2"):
        build_modules("cnn-stripe", 1, "sum", shapes, 10, private_seed=PrivateSeed.legacy(0))


@pytest.mark.parametrize("model", MLP_MODELS)
@pytest.mark.parametrize("merge", ["concat", "sum"])
@pytest.mark.parametrize("parties", [1, 2, 3])
def test_mlp_shapes_compose(model, merge, parties):
    arch = get_architecture(model)
    widths = [5, 3, 4][:parties]
    shapes = {p: (w,) for p, w in zip(["host", "guest-1", "guest-2"], widths)}
    for cut in range(1, len(arch.hidden) + 1):
        sm = build_modules(model, cut, merge, shapes, 6, private_seed=PrivateSeed.legacy(0))
        outs, merged, logits = _forward(sm, shapes)
        hidden = arch.hidden[cut - 1]
        assert all(s == (hidden,) for s in sm.cut_shapes.values())
        assert sm.merged_shape == ((hidden * parties,) if merge == "concat" else (hidden,))
        assert tuple(merged.shape[1:]) == sm.merged_shape and tuple(logits.shape) == (3, 6)


def test_paper_layer_sizes():
    """The cut widths 003 Table 1 / 001 Table 10 give for one party holding the whole image,
    and what 2 parties' stripes re-assemble to."""
    one = lambda m, cut, shape: build_modules(m, cut, "concat", {"host": shape}, 10, PrivateSeed.legacy(0)).cut_shapes["host"]  # noqa: E731
    assert math.prod(one("cnn-mnist", 2, (1, 28, 28))) == 12544   # '2×Conv2d | FC - FC'
    assert one("cnn-mnist", 3, (1, 28, 28)) == (256,)              # '2×Conv2d - FC | FC'
    assert one("resnet20", 5, (3, 32, 32)) == (256,)               # 'Conv2d - 3×ResBlock | FC'
    assert one("resnet18-split", 6, (3, 32, 32)) == (512,)         # 003 'Conv2d - 4×ResBlock | FC'
    assert one("resnet18-split", 2, (3, 32, 32)) == (64, 32, 32)   # 001 Table 10 guest output
    # two 32x16 stripes: the top of 001's split gets the whole 64x32x32 map back
    sm = build_modules("resnet18-split", 2, "concat", _stripes(3, 32, 32, 2), 100, PrivateSeed.legacy(0))
    assert sm.cut_shapes == {"host": (64, 32, 16), "guest-1": (64, 32, 16)}
    assert sm.merged_shape == (64, 32, 32)
    sm = build_modules("cnn-mnist", 2, "concat", _stripes(1, 28, 28, 2), 10, PrivateSeed.legacy(0))
    assert sm.merged_shape == (64, 14, 14)


def test_paper_parameter_counts():
    # 001 Table 10, CIFAR100 model: guest = 1728 + 128 + 2 x 73984; host top after the merge =
    # 230144 + 295424 + 919040 + 1180672 + 3673088 + 4720640 + 51300
    sm = build_modules("resnet18-split", 2, "concat", {"host": (3, 32, 16), "guest-1": (3, 32, 16)}, 100, PrivateSeed.legacy(0))
    assert _params(sm.bottoms["guest-1"]) == 1728 + 128 + 2 * 73984
    assert _params(sm.top) == 230144 + 295424 + 919040 + 1180672 + 3673088 + 4720640 + 51300
    # ResNet-20 (He et al. 2016, option A): 0.27M = 269,722 with a 64->10 head; 003's head reads
    # the 2x2 max-pooled map, 256 -> 10
    sm = build_modules("resnet20", 1, "concat", {"host": (3, 32, 32)}, 10, PrivateSeed.legacy(0))
    assert _params(sm.bottoms["host"]) + _params(sm.top) == 269722 - 650 + 2570
    # CNN-MNIST of 003: conv 1->32, conv 32->64, FC 12544->256, FC 256->10
    sm = build_modules("cnn-mnist", 2, "concat", {"host": (1, 28, 28)}, 10, PrivateSeed.legacy(0))
    assert _params(sm.bottoms["host"]) == (9 * 32 + 32) + (9 * 32 * 64 + 64)
    assert _params(sm.top) == (12544 * 256 + 256) + (256 * 10 + 10)


# --------------------------------------------------------------------------------------------
# narrow stripes


def test_narrow_stripes_width_one_to_four():
    """Digits with many parties: stripes 1..4 pixels wide go through every cut."""
    shapes = {"host": (1, 8, 1), "guest-1": (1, 8, 2), "guest-2": (1, 8, 3), "guest-3": (1, 8, 4)}
    for model in ("cnn-stripe", "cnn-mnist", "resnet20"):
        for cut in range(1, get_architecture(model).num_layers() + 1):
            sm = build_modules(model, cut, "concat", shapes, 10, private_seed=PrivateSeed.legacy(0))
            _, _, logits = _forward(sm, shapes)
            assert tuple(logits.shape) == (3, 10)
    # the pooled widths are ceil(w / 2) per pooling stage (1 -> 1, 3 -> 2 -> 1)
    sm = build_modules("cnn-stripe", 2, "concat", shapes, 10, private_seed=PrivateSeed.legacy(0))
    assert [s[-1] for s in sm.cut_shapes.values()] == [1, 1, 1, 1]
    assert sm.merged_shape == (32, 2, 4)


def test_stripe_pool_keeps_narrow_axes():
    assert stripe_pool((4, 8, 1)).kernel_size == (2, 1)
    assert stripe_pool((4, 1, 1)).kernel_size == (1, 1)
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(1, 2, 8, 3)
    y = stripe_pool((2, 8, 3))(x)
    assert tuple(y.shape) == (1, 2, 4, 2)
    torch.testing.assert_close(y[0, 0, :, 1], x[0, 0, 1::2, 2])  # the odd last column kept alone


def test_digits_with_seven_guests_plans_a_cnn_run():
    """The real partition: 8 parties x 1 pixel column each."""
    plan = plan_run(RunConfig(dataset="digits", model="cnn-stripe", guests=7, progress=False))
    assert all(s == (1, 8, 1) for s in plan.input_shapes.values())
    assert all(s == (32, 2, 1) for s in plan.cut_shapes.values())
    assert plan.merged_shape == (32, 2, 8)


# --------------------------------------------------------------------------------------------
# invalid cuts


@pytest.mark.parametrize("model", IMAGE_MODELS + MLP_MODELS)
def test_invalid_cut_names_allowed_range(model):
    arch = get_architecture(model)
    n = arch.num_layers() if arch.inputs == "image" else len(arch.hidden)
    for bad in (0, n + 1):
        with pytest.raises(ConfigError, match=rf"--cut-layer: got {bad}.*an integer in 1\.\.{n} for model '{model}'"):
            arch.check_cut(bad, "concat")
    shape = (1, 8, 8) if arch.inputs == "image" else (8,)
    with pytest.raises(ConfigError, match=rf"1\.\.{n}"):
        build_modules(model, n + 1, "concat", {"host": shape}, 10, private_seed=PrivateSeed.legacy(0))
    arch.check_cut(n, "concat")  # the last bottom layer is a valid cut with any merge


def test_invalid_cut_from_run_config():
    with pytest.raises(ConfigError) as exc:
        plan_run(RunConfig(dataset="digits", model="resnet20", cut_layer=6, progress=False))
    msg = str(exc.value)
    assert msg.startswith("--cut-layer: got 6") and "1..5" in msg and "5=pool" in msg


def test_image_model_on_table_dataset_is_refused():
    with pytest.raises(ConfigError, match="needs image inputs"):
        plan_run(RunConfig(dataset="breast-cancer", model="cnn-stripe", progress=False))
    with pytest.raises(ConfigError, match=r"\(channels, height, width\)"):
        get_architecture("resnet20").bottom((30,), 1, "native")


# --------------------------------------------------------------------------------------------
# cut activation


#: (model, cut, input shape); the pooling cuts check that the activation goes before the pool
ACT_CASES = [
    ("cnn-stripe", 1, (1, 8, 4)), ("cnn-stripe", 2, (1, 8, 4)), ("cnn-stripe", 3, (1, 8, 4)),
    ("cnn-mnist", 2, (1, 8, 4)), ("cnn-mnist", 3, (1, 8, 4)),
    ("resnet20", 1, (3, 8, 4)), ("resnet20", 2, (3, 8, 4)), ("resnet20", 4, (3, 8, 4)), ("resnet20", 5, (3, 8, 4)),
    ("resnet18-split", 2, (3, 8, 4)), ("resnet18-split", 6, (3, 16, 16)),
    ("mlp", 1, (6,)), ("mlp", 2, (6,)), ("movielens-mlp", 3, (6,)), ("mnist-mlp-bn", 2, (6,)),
]


def _guest_outputs(model, cut, shape):
    arch = get_architecture(model)
    x = torch.randn((64, *shape), generator=torch.Generator().manual_seed(5))
    out = {}
    for act in ("native", "none", "relu", "tanh"):
        bottom = build_bottom(arch, "guest-1", shape, cut, act, PartySecret.from_private_seed(PrivateSeed.legacy(4), "guest-1"))  # same weights for every act
        bottom.eval()
        with torch.no_grad():
            out[act] = bottom(x)
    return out


@pytest.mark.parametrize("model,cut,shape", ACT_CASES, ids=[f"{m}-cut{c}" for m, c, _ in ACT_CASES])
def test_cut_activation_bounds(model, cut, shape):
    out = _guest_outputs(model, cut, shape)
    assert out["tanh"].abs().max() <= 1.0 and out["tanh"].min() < 0     # tanh-bounded, not ReLU'd
    assert out["none"].min() < 0                                         # bare: negatives stay
    assert out["native"].min() >= 0 and out["relu"].min() >= 0


@pytest.mark.parametrize("model,cut,shape", [c for c in ACT_CASES if c[:2] != ("resnet18-split", 6)],
                         ids=[f"{m}-cut{c}" for m, c, _ in ACT_CASES if (m, c) != ("resnet18-split", 6)])
def test_cut_activation_replaces_exactly_the_last_nonlinearity(model, cut, shape):
    """relu(bare) == native and tanh(bare) == the tanh bottom: nothing else changed (max-pooling
    commutes with monotone activations, so this holds at resnet20's pooling cut too)."""
    out = _guest_outputs(model, cut, shape)
    torch.testing.assert_close(out["native"], torch.relu(out["none"]))
    torch.testing.assert_close(out["relu"], out["native"])
    torch.testing.assert_close(out["tanh"], torch.tanh(out["none"]))


def test_avgpool_cut_activation_goes_before_the_pool():
    """resnet18's pooling cut averages the replaced activation: tanh outputs are means of tanh
    values, the bare output the mean of the pre-activation."""
    shape = (3, 16, 16)  # layer4 output 2x2: the pool averages 4 positions
    out = _guest_outputs("resnet18-split", 6, shape)
    assert not torch.allclose(out["native"], torch.relu(out["none"]))  # avg does not commute with relu
    arch = get_architecture("resnet18-split")
    x = torch.randn((64, *shape), generator=torch.Generator().manual_seed(5))
    stage = build_bottom(arch, "guest-1", shape, 5, "tanh", PartySecret.from_private_seed(PrivateSeed.legacy(4), "guest-1")).eval()   # same weights, no pool
    with torch.no_grad():
        torch.testing.assert_close(out["tanh"], stage(x).mean(dim=(2, 3)))


def test_host_bottom_keeps_native_activation():
    arch = get_architecture("cnn-stripe")
    host = build_bottom(arch, "host", (1, 8, 4), 2, "tanh", PartySecret.from_private_seed(PrivateSeed.legacy(0), "host"))
    assert not any(isinstance(m, nn.Tanh) for m in host.modules())
    guest = build_bottom(arch, "guest-1", (1, 8, 4), 2, "tanh", PartySecret.from_private_seed(PrivateSeed.legacy(0), "guest-1"))
    assert sum(isinstance(m, nn.Tanh) for m in guest.modules()) == 1


# --------------------------------------------------------------------------------------------
# building blocks against independent computations


def test_cut_basic_block_native_is_torchvision_basic_block():
    torch.manual_seed(0)
    ours = CutBasicBlock(8, 16, 2, nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16)))
    ref = BasicBlock(8, 16, 2, nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16)))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 8, 6, 5)
    torch.testing.assert_close(ours.train()(x), ref.train()(x))
    torch.testing.assert_close(ours.eval()(x), ref.eval()(x))


def test_pad_shortcut_is_option_a():
    x = torch.randn(2, 16, 7, 5)
    y = PadShortcut(16, 32, 2)(x)
    assert tuple(y.shape) == (2, 32, 4, 3)
    torch.testing.assert_close(y[:, 8:24], x[:, :, ::2, ::2])
    assert y[:, :8].abs().sum() == 0 and y[:, 24:].abs().sum() == 0


def test_construction_is_seeded_per_party():
    arch = get_architecture("resnet20")
    a = build_bottom(arch, "guest-1", (3, 8, 4), 2, "native", PartySecret.from_private_seed(PrivateSeed.legacy(9), "guest-1")).state_dict()
    b = build_bottom(arch, "guest-1", (3, 8, 4), 2, "native", PartySecret.from_private_seed(PrivateSeed.legacy(9), "guest-1")).state_dict()
    c = build_bottom(arch, "guest-2", (3, 8, 4), 2, "native", PartySecret.from_private_seed(PrivateSeed.legacy(9), "guest-2")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv1.0.weight"], c["conv1.0.weight"])


# --------------------------------------------------------------------------------------------
# training: split ≡ monolithic, and the end-to-end accuracy


@pytest.mark.parametrize("model,cut,guests", [("cnn-stripe", 2, 2), ("resnet20", 3, 1)])
def test_split_equals_monolithic_image_models(model, cut, guests):
    """Same modules, same initial weights, same batches: one epoch of split training leaves the
    same losses and the same trained weights (and BatchNorm statistics) as the monolithic model."""
    cfg = RunConfig(dataset="digits", model=model, cut_layer=cut, guests=guests, epochs=1, limit=200,
                    batch_size=32, optimizer="adam", progress=False, seed=3)
    split_engine, mono_engine = LocalEngine(cfg, private_seed=PrivateSeed.legacy(3)), MonolithicEngine(cfg, private_seed=PrivateSeed.legacy(3))
    init = {k: v.clone() for k, v in mono_engine.model.top.state_dict().items()}
    split, mono = split_engine.run(), mono_engine.run()
    np.testing.assert_allclose([h["train_loss"] for h in split["history"]],
                               [h["train_loss"] for h in mono["history"]], rtol=1e-6)
    assert split["final"]["value"] == pytest.approx(mono["final"]["value"], abs=1e-12)
    trained = {"host": split_engine.host.bottom, "top": split_engine.host.top,
               **{g: p.bottom for g, p in split_engine.guests.items()}}
    reference = {**mono_engine.model.bottoms, "top": mono_engine.model.top}
    assert set(trained) == set(reference)
    for name, module in trained.items():
        ours, theirs = module.state_dict(), reference[name].state_dict()
        assert ours.keys() == theirs.keys()
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=f"{name}.{k}")
    # guard against comparing two untrained models
    assert any(not torch.equal(init[k], v) for k, v in mono_engine.model.top.state_dict().items())


def test_cnn_stripe_digits_end_to_end_accuracy():
    """2 guests + host, 2 epochs, defaults otherwise (Adam, lr 0.01, batch 32). Over seeds 0..19
    the test accuracy was 0.836–0.939 (mean 0.90, sd 0.02; seed 0: 0.911) — 0.8 is ~5 sd below
    the mean, chance is 0.1."""
    res = run_experiment(RunConfig(dataset="digits", model="cnn-stripe", guests=2, epochs=2, progress=False))
    assert res["final"]["metric"] == "accuracy"
    assert res["final"]["value"] > 0.8
    losses = [h["train_loss"] for h in res["history"]]
    assert losses[1] < losses[0]


def test_merged_shape_matches_plan_for_real_digits_partition():
    plan = plan_run(RunConfig(dataset="digits", model="resnet20", guests=2, cut_layer=4, progress=False))
    assert plan.merged_shape == merged_shape("concat", plan.cut_shapes)
    assert plan.merged_shape[:2] == (64, 2)
