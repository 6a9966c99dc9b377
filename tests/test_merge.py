"""Merge layer: forward values and gradients against hand computations (001 Table 1 ops)."""

from __future__ import annotations

import pytest
import torch

from fl_split.errors import ConfigError
from fl_split.merge import Merge, merged_shape

A = [[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]]
B = [[2.0, -2.0, -1.0], [0.5, 1.0, 2.0]]
C = [[0.0, 5.0, 3.0], [-3.0, 2.0, 1.0]]
UP = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # upstream gradient


def _run(op, *inputs, upstream=None):
    xs = [torch.tensor(x, requires_grad=True) for x in inputs]
    out = Merge(op)(xs)
    up = torch.tensor(upstream if upstream is not None else UP) if op != "concat" else torch.ones_like(out)
    out.backward(up)
    return out.detach(), [x.grad for x in xs]


def t(x):
    return torch.tensor(x)


def test_concat_forward_and_gradient_slices():
    out, (ga, gb) = _run("concat", A, B)
    assert torch.equal(out, t([A[0] + B[0], A[1] + B[1]]))
    xs = [torch.tensor(A, requires_grad=True), torch.tensor(B, requires_grad=True)]
    up = torch.arange(12.0).reshape(2, 6)
    Merge("concat")(xs).backward(up)
    assert torch.equal(xs[0].grad, up[:, :3]) and torch.equal(xs[1].grad, up[:, 3:])


def test_concat_feature_maps_along_width():
    a, b = torch.zeros(2, 4, 5, 3), torch.ones(2, 4, 5, 2)
    out = Merge("concat")([a, b])
    assert out.shape == (2, 4, 5, 5)
    assert torch.equal(out[..., 3:], b)


def test_sum():
    out, grads = _run("sum", A, B, C)
    assert torch.equal(out, t(A) + t(B) + t(C))
    for g in grads:
        assert torch.equal(g, t(UP))


def test_avg():
    out, grads = _run("avg", A, B)
    assert torch.allclose(out, (t(A) + t(B)) / 2)
    for g in grads:
        assert torch.allclose(g, t(UP) / 2)


def test_mul():
    out, (ga, gb, gc) = _run("mul", A, B, C)
    assert torch.allclose(out, t(A) * t(B) * t(C))
    assert torch.allclose(ga, t(UP) * t(B) * t(C))
    assert torch.allclose(gb, t(UP) * t(A) * t(C))
    assert torch.allclose(gc, t(UP) * t(A) * t(B))


def test_max_routes_gradient_to_argmax_and_splits_ties():
    out, (ga, gb) = _run("max", A, B)
    assert torch.equal(out, torch.maximum(t(A), t(B)))
    # element [0,1]: -2 vs -2 tie -> half each; [1,0]: 0.5 vs 0.5 tie -> half each
    exp_a = [[0.0, 1.0, 3.0], [2.0, 5.0, 0.0]]
    exp_b = [[1.0, 1.0, 0.0], [2.0, 0.0, 6.0]]
    assert torch.equal(ga, t(exp_a)) and torch.equal(gb, t(exp_b))


def test_min_routes_gradient_to_argmin():
    out, (ga, gb, gc) = _run("min", A, B, C)
    assert torch.equal(out, torch.minimum(torch.minimum(t(A), t(B)), t(C)))
    # argmin per element: [0,0] C=0; [0,1] A,B tie at -2 (half each); [0,2] B=-1; [1,0] C=-3; [1,1] B=1; [1,2] A=-1
    exp_a = [[0.0, 1.0, 0.0], [0.0, 0.0, 6.0]]
    exp_b = [[0.0, 1.0, 3.0], [0.0, 5.0, 0.0]]
    exp_c = [[1.0, 0.0, 0.0], [4.0, 0.0, 0.0]]
    assert torch.equal(ga, t(exp_a)) and torch.equal(gb, t(exp_b)) and torch.equal(gc, t(exp_c))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "mul"])
def test_elementwise_unequal_widths_error_names_widths(op):
    with pytest.raises(ConfigError) as exc:
        merged_shape(op, {"host": (64,), "guest-1": (32,)})
    msg = str(exc.value)
    assert "--merge" in msg and "host=64" in msg and "guest-1=32" in msg and "concat" in msg


def test_merged_shapes():
    assert merged_shape("concat", {"host": (64,), "guest-1": (32,)}) == (96,)
    assert merged_shape("max", {"host": (64,), "guest-1": (64,)}) == (64,)
    assert merged_shape("concat", {"a": (8, 5, 3), "b": (8, 5, 2)}) == (8, 5, 5)
    with pytest.raises(ConfigError, match="last axis"):
        merged_shape("concat", {"a": (8, 5, 3), "b": (4, 5, 2)})
    with pytest.raises(ConfigError, match="one of concat"):
        Merge("median")
