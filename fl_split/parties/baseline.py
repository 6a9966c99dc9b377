"""The host's own baseline: what its features alone give, and the verdict on the joint model against it.

A guest can harm the joint model in ways no check of its releases sees: the *consistent liar* scales its
training **and** test releases alike from its first batch (issue 36: digits, ×1000, test accuracy 0.928 →
0.086–0.607, every run "completed"), so its releases agree with each other and with the host's labels up
to a scale. What the host can always tell is whether the joint model is worse than what it could have
had alone. :class:`HostAlone` is that reference: a linear model (multinomial logistic regression, or
ridge regression for a regression task; L2 :data:`L2`) fitted by the host, locally, on its own training
rows and labels — its own features flattened and standardised with its own training statistics, or,
when the host holds no features, the label prior (class frequencies, or the training mean). It uses
only data the host holds: nothing is sent, nothing is released, no ε is spent, and no model, optimizer,
draw counter or generator of the party is touched (its fit is deterministic, full-batch L-BFGS from
zeros, :func:`lbfgs`), so an honest run's numbers are those of a run without it.

:func:`verdict` compares, at each evaluation, the joint model's per-record test errors (the complement of the
task's headline metric: a wrong class, a next-item miss, the squared error) with the baseline's on the same
records, a paired one-sided test. The joint model is *degraded* when its mean error exceeds the baseline's
by more than :data:`Z` standard errors of the paired difference **and**, where the host holds features, it
gave back at least :data:`LOST` of what they gain over the label prior (a collapse gives back nearly all;
an honest run under a heavy defence may sit slightly below the baseline, which is not what this reports).
Errors, not losses: an honest DP-SGD run on credit was *more* accurate than the baseline (0.80 vs 0.79)
with a test loss far above it (miscalibration), which a loss comparison called degraded. The run's status
is ``degraded`` when its last evaluation is (:func:`apply_quality`; ``docs/threat-model.md``, "Label agreement
and the host's own baseline"). The host also fits the same model on its features and the guests' releases as
received (the release probe, :meth:`fl_split.parties.host.HostParty._release_probe`), the reference where it
holds no features"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: the one-sided z a degraded verdict needs (paired difference of per-record test errors; p ≈ 0.001)
Z = 3.09
#: where the host has features: the share of their gain over the label prior (in test error) the joint model must
#: give back to be degraded (a collapse gives back nearly all of it; a heavy defence's honest run some, within this)
LOST = 0.5
#: the ridge / weight-decay strength of the baseline (per record, on standardised features)
L2 = 1e-3
#: training rows the baseline is fitted on at most (a fixed, public subsample beyond that)
MAX_ROWS = 20_000
#: L-BFGS iterations of the logistic fit at most (:func:`lbfgs`)
MAX_ITER = 50


def per_record_error(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The task's per-record error, the complement of its headline metric: 1 for a wrong class (accuracy; binary:
    the more likely class), a miss of the top :data:`~fl_split.tasks.HIT_AT` (next-item), the squared error of
    the standardised target (regression)."""
    from fl_split.tasks import HIT_AT

    out, y = out.detach().double().cpu(), y.detach().cpu()
    if task == "regression":
        return (out.reshape(-1) - y.double()) ** 2
    if task == "next-item":
        k = min(HIT_AT, out.shape[1])
        return 1.0 - (out.topk(k, dim=1).indices == y.long()[:, None]).any(dim=1).double()
    return (out.argmax(dim=1) != y.long()).double()


def lbfgs(f, theta: torch.Tensor, iters: int | None = None, memory: int = 10) -> torch.Tensor:
    """Minimise the smooth convex ``f(θ) -> (value, gradient)`` from ``theta`` by L-BFGS (Nocedal & Wright,
    *Numerical Optimization*, Algorithm 7.4, two-loop recursion) with a backtracking Armijo line search.
    Written out rather than ``torch.optim.LBFGS``: no optimizer state, and no first use of torch's optimizer
    machinery from a party's thread (its lazy import of ``torch._dynamo`` is not thread-safe)."""
    iters = MAX_ITER if iters is None else iters
    value, grad = f(theta)
    ss: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for _ in range(iters):
        if float(grad.abs().max()) < 1e-7:
            break
        q, alphas = grad.clone(), []
        for s_, y_ in zip(reversed(ss), reversed(ys)):
            a = float(s_ @ q) / float(y_ @ s_)
            alphas.append(a)
            q -= a * y_
        if ys:
            q *= float(ss[-1] @ ys[-1]) / float(ys[-1] @ ys[-1])
        for (s_, y_), a in zip(zip(ss, ys), reversed(alphas)):
            q += s_ * (a - float(y_ @ q) / float(y_ @ s_))
        step, slope = 1.0, -float(grad @ q)
        if slope >= 0:  # not a descent direction: restart from the gradient
            ss.clear()
            ys.clear()
            q, slope = grad.clone(), -float(grad @ grad)
        while True:
            new = theta - step * q
            new_value, new_grad = f(new)
            if new_value <= value + 1e-4 * step * slope or step < 1e-10:
                break
            step *= 0.5
        s_, y_ = new - theta, new_grad - grad
        if float(y_ @ s_) > 1e-12:
            ss.append(s_)
            ys.append(y_)
            if len(ss) > memory:
                ss.pop(0)
                ys.pop(0)
        converged = abs(value - new_value) <= 1e-12 * max(1.0, abs(value))
        theta, value, grad = new, new_value, new_grad
        if converged:
            break
    return theta


class HostAlone:
    """The host's features-only reference model (module docstring); ``fit`` once, then ``outputs``."""

    def __init__(self, task: str, num_classes: int, x_train: torch.Tensor | None, y_train: torch.Tensor) -> None:
        self.task = task
        self.k = 1 if task == "regression" else int(num_classes)
        y = y_train.detach().cpu()
        x = None if x_train is None or x_train.numel() == 0 else x_train.detach().cpu().reshape(len(y), -1).double()
        if x is not None and len(x) > MAX_ROWS:  # a public, fixed subsample: the fit is local either way
            keep = torch.from_numpy(np.sort(np.random.default_rng(0).choice(len(x), MAX_ROWS, replace=False)))
            x, y = x[keep], y[keep]
        self.has_features = x is not None
        if x is not None:
            self.mean = x.mean(0)
            self.sd = x.std(0, unbiased=False).clamp_min(1e-8)
            x = (x - self.mean) / self.sd
        self.weight, self.bias = self._fit(x, y)
        #: the label prior (class frequencies, or the training mean): the baseline of a host without features
        self.prior = self.bias if self.weight is None else self._fit(None, y)[1]

    def _fit(self, x: torch.Tensor | None, y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.task == "regression":
            yd = y.double().reshape(-1)
            if x is None:
                return None, yd.mean().reshape(1)
            xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
            reg = L2 * len(x) * torch.eye(xa.shape[1], dtype=x.dtype)
            reg[-1, -1] = 0.0
            w = torch.linalg.solve(xa.T @ xa + reg, xa.T @ yd)
            return w[:-1].reshape(-1, 1), w[-1:].clone()
        counts = torch.bincount(y.long().reshape(-1), minlength=self.k).double()
        prior = torch.log((counts + 0.5) / (counts.sum() + 0.5 * self.k))
        if x is None:
            return None, prior
        n, d = x.shape
        onehot = F.one_hot(y.long().reshape(-1), self.k).double()

        def loss_grad(theta: torch.Tensor) -> tuple[float, torch.Tensor]:  # the gradient by hand: no autograd
            w, b = theta[:d * self.k].reshape(d, self.k), theta[d * self.k:]
            logp = torch.log_softmax(x @ w + b, dim=1)
            g = (logp.exp() - onehot) / n
            loss = -float((logp * onehot).sum()) / n + 0.5 * L2 * float((w * w).sum())
            return loss, torch.cat([(x.T @ g + L2 * w).reshape(-1), g.sum(0)])

        theta = lbfgs(loss_grad, torch.cat([torch.zeros(d * self.k, dtype=torch.float64), prior]))
        return theta[:d * self.k].reshape(d, self.k), theta[d * self.k:]

    @torch.no_grad()
    def outputs(self, x: torch.Tensor | None, n: int) -> torch.Tensor:
        """The baseline's outputs (logits, or the standardised prediction) for ``n`` records ``x``."""
        if self.weight is None or x is None:
            return self.bias.reshape(1, -1).expand(n, -1).clone()
        z = (x.detach().cpu().reshape(n, -1).double() - self.mean) / self.sd
        return z @ self.weight + self.bias

    def errors(self, x: torch.Tensor | None, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(per-record errors, outputs, the label prior's per-record errors)`` on ``x`` with labels ``y``."""
        out = self.outputs(x, len(y))
        y = y.detach().cpu()
        return (per_record_error(self.task, out, y), out,
                per_record_error(self.task, self.prior.reshape(1, -1).expand(len(y), -1), y))


def verdict(joint: torch.Tensor, base: torch.Tensor, prior: torch.Tensor | None = None) -> dict[str, Any]:
    """The paired comparison of per-record test errors (:func:`per_record_error`), joint model vs baseline (and
    the label prior's): ``{"joint_error", "baseline_error", "prior_error", "z", "lost", "degraded", "records"}``.
    ``z``: the mean difference in standard errors (a paired t statistic); ``lost``: the share of the baseline's
    gain over the prior the joint model gave back, ``(joint − baseline) / (prior − baseline)`` (nan where the
    baseline is the prior, or no better). Degraded: ``z`` above :data:`Z` and, where the host has features (a
    ``prior`` given), ``lost`` at least :data:`LOST`."""
    d = (joint.double().cpu() - base.double().cpu()).reshape(-1)
    n = d.numel()
    je, be = (float(joint.double().mean()), float(base.double().mean())) if n else (math.nan, math.nan)
    pe = float(prior.double().mean()) if prior is not None and n else be
    out = {"joint_error": je, "baseline_error": be, "prior_error": pe, "z": math.nan, "lost": math.nan,
           "degraded": False, "records": n}
    if n < 2:
        return out
    mean, se = float(d.mean()), float(d.std(unbiased=True)) / math.sqrt(n)
    out["z"] = mean / se if se > 0 else (math.inf if mean > 0 else 0.0)
    if prior is not None and pe > be:
        out["lost"] = (je - be) / (pe - be)
    out["degraded"] = bool(out["z"] > Z and (prior is None or (not math.isnan(out["lost"]) and out["lost"] >= LOST)))
    return out


def apply_quality(results: dict[str, Any]) -> dict[str, Any]:
    """Set ``results["status"]`` and ``results["quality"]`` from the host's end-of-run report: ``degraded`` when
    a run that ran to its end (``stopped_reason`` ``completed``) has a last evaluation whose joint model the host
    found worse than its own baseline; otherwise the ``stopped_reason`` (``docs/results.md``)."""
    host = (results.get("parties") or {}).get("host") or {}
    quality = host.get("quality") if isinstance(host, dict) else None
    results["quality"] = quality
    stopped = results.get("stopped_reason", "completed")
    degraded = stopped == "completed" and isinstance(quality, dict) and quality.get("status") == "degraded"
    results["status"] = "degraded" if degraded else stopped
    if degraded:
        results["status_detail"] = f"the host's verdict: {quality.get('reason', '')}"
    return results


__all__ = ["HostAlone", "L2", "LOST", "MAX_ITER", "MAX_ROWS", "Z", "apply_quality", "lbfgs", "per_record_error",
           "verdict"]
