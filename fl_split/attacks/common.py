"""Building blocks shared by the attacks: small networks, a seeded training loop, standardisation,
the adversary's model of a release, and the host's forward on observed releases.

Every module is built under the adversary's private seed (``view.seeded``) and every shuffle is
drawn from its private generator (``view.generator``): attack runs are reproducible exactly when
the training is (``--private-seed``), and otherwise as fresh as the parties' own draws. Tensors
live on the adversary's device (``view.device``): the same code runs on CPU and CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fl_split.privacy import factory as privacy_factory


def mlp(in_dim: int, hidden: tuple[int, ...], out_dim: int, out: nn.Module | None = None) -> nn.Sequential:
    """``Linear + ReLU`` layers of widths ``hidden``, then ``Linear(out_dim)`` (and ``out``, if given)."""
    layers: list[nn.Module] = []
    width = in_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_dim))
    if out is not None:
        layers.append(out)
    return nn.Sequential(*layers)


@dataclass
class Standardizer:
    """Per-feature ``(x − mean)/std`` with statistics of the data it was fitted on.

    A feature's std is floored at :data:`STD_FLOOR` × the median std of all features. A release
    unit that is (nearly) constant on the fitting records — a ReLU unit dead on the auxiliary
    records — but not on the records the model is applied to would otherwise be multiplied by up to
    10⁶. This made the reconstruction decoder's MSE on credit explode (≈ 700 against 0.16 for the
    mean sample), even though it fitted its auxiliary pairs."""

    mean: torch.Tensor
    std: torch.Tensor

    @classmethod
    def fit(cls, x: torch.Tensor) -> "Standardizer":
        x = x.reshape(len(x), -1).float()
        std = x.std(dim=0, unbiased=False)
        floor = max(1e-6, STD_FLOOR * float(std.median())) if std.numel() else 1e-6
        return cls(x.mean(dim=0), std.clamp_min(floor))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(len(x), -1).float()
        return (x - self.mean.to(x.device)) / self.std.to(x.device)


#: no feature is scaled up by more than 1 / (STD_FLOOR × the median feature std): see Standardizer
STD_FLOOR = 0.1

#: share of the auxiliary training data held out to pick the epoch (early stopping)
VALIDATION = 0.2


def fit(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, *, epochs: int, lr: float,
        batch_size: int, gen: torch.Generator, desc: str, progress: bool, weight_decay: float = 0.0,
        validation: float = 0.0) -> dict:
    """Train ``model`` with Adam on ``(inputs, targets)`` for ``epochs`` passes in mini-batches
    shuffled by ``gen``.

    ``validation > 0`` holds out that share of the rows (drawn from ``gen``) and keeps the weights
    of the epoch with the lowest validation loss (early stopping: a careful attacker never ends
    worse than its best epoch, e.g. on noisy releases). Returns ``{"train_loss": [...],
    "validation_loss": [...], "best_epoch": e}``."""
    n_all = len(inputs)
    n_val = int(round(n_all * validation)) if validation > 0 else 0
    if n_val and n_all - n_val >= 2:
        perm = torch.randperm(n_all, generator=gen, device=gen.device).to(inputs.device)
        val_idx, train_idx = perm[:n_val], perm[n_val:]
        x_val, y_val = inputs[val_idx], targets[val_idx]
        inputs, targets = inputs[train_idx], targets[train_idx]
    else:
        x_val = y_val = None
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(inputs)
    history: dict = {"train_loss": [], "validation_loss": [], "best_epoch": epochs}
    best, best_state = math.inf, None
    bar = tqdm(range(epochs), desc=desc, unit="epoch", disable=not progress, leave=False, dynamic_ncols=True)
    for epoch in bar:
        perm = torch.randperm(n, generator=gen, device=gen.device).to(inputs.device)
        total = 0.0
        for i in range(0, n, batch_size):
            idx = perm[i: i + batch_size]
            loss = loss_fn(model(inputs[idx]), targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        history["train_loss"].append(total / max(n, 1))
        if x_val is not None:
            model.eval()
            with torch.no_grad():
                v = loss_fn(model(x_val), y_val).item()
            model.train()
            history["validation_loss"].append(v)
            if v < best:
                best, best_state = v, {k: t.detach().clone() for k, t in model.state_dict().items()}
                history["best_epoch"] = epoch + 1
        bar.set_postfix(loss=f"{history['train_loss'][-1]:.4f}", refresh=False)
    bar.close()
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return history


def train_classifier(view, purpose: str, x_train: torch.Tensor, y_train: np.ndarray, *, hidden: int, epochs: int,
                     lr: float, num_classes: int | None = None, weight_decay: float = 1e-4,
                     batch_size: int = 64, validation: float = VALIDATION) -> Callable[[torch.Tensor], torch.Tensor]:
    """An MLP classifier ``x → class`` (cross-entropy, standardised inputs, early stopping on a
    ``validation`` share of its data) built and trained under the adversary's own randomness;
    returns ``predict_proba(x) -> (n, C)`` probabilities."""
    dev = view.device
    scaler = Standardizer.fit(x_train)
    xs = scaler(x_train.to(dev))
    y = torch.as_tensor(np.asarray(y_train), dtype=torch.long, device=dev)
    c = int(num_classes or int(y.max()) + 1)
    with view.seeded(purpose, "init"):
        model = mlp(xs.shape[1], (hidden,), c)
    model.to(dev)
    fit(model, xs, y, F.cross_entropy, epochs=epochs, lr=lr, batch_size=batch_size,
        gen=view.generator(purpose, "order"), desc=f"{purpose} classifier", progress=view.progress,
        weight_decay=weight_decay, validation=validation)

    @torch.no_grad()
    def predict_proba(x: torch.Tensor) -> torch.Tensor:
        return F.softmax(model(scaler(x.to(dev))), dim=1)

    return predict_proba


class ReleaseModel:
    """The adversary's model of what a guest releases for a cut-layer output ``v`` (inversion, GRN).

    The defence and its parameters are public (run configuration); its draws are not. So the
    adversary matches an observed release with the release's *noise-free part*:

    * no forward mechanism (``none``, ``dpsgd``, or ``--protect host``): ``v``;
    * ``laplace``: ``clip(v, ±C)`` (zero-mean noise); ``gaussian``: ``clip(v, ±1)`` (``v`` is the
      tanh output);
    * ``r3elu``: ``clip(v, 0, C)`` — ClipK's clip and the ReLU of Alg. 1 (the top-K selection and
      the random activation are not modelled);
    * ``rr``: bits ``1[v > 0]`` flipped at random: the loss is the logistic loss of ``v`` against
      the observed bits (a bit that was kept pushes ``v`` to its sign).
    """

    def __init__(self, cfg, width: int) -> None:
        self.mech = privacy_factory.forward_mechanism(cfg, width)
        self.name = self.mech.name

    def expected(self, v: torch.Tensor) -> torch.Tensor:
        if self.name == "laplace":
            return v.clamp(-self.mech.bound, self.mech.bound)
        if self.name == "gaussian":
            return v.clamp(-self.mech.bound, self.mech.bound)
        if self.name == "r3elu":
            return v.clamp(0.0, self.mech.c)
        return v

    def loss(self, v: torch.Tensor, released: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Distance of ``v`` (cut-layer outputs, ``(n, …)``) to the ``released`` tensors, per record
        with ``reduction="none"``."""
        v = v.reshape(len(v), -1)
        released = released.reshape(len(released), -1).to(v.device)
        if self.name == "rr":
            per = F.binary_cross_entropy_with_logits(v, released, reduction="none").mean(dim=1)
        else:
            per = ((self.expected(v) - released) ** 2).mean(dim=1)
        return per if reduction == "none" else per.mean()


def own_modules(view, host) -> tuple[nn.Module | None, nn.Module]:
    """Frozen eval-mode copies of the host's own bottom (if any) and top: fresh modules of the public
    architecture loaded with the host's final weights (an Opacus DP-SGD wrapper is left behind)."""
    from fl_split.attacks.view import architecture
    from fl_split.models.registry import bottom_module

    plan = view.plan
    arch = architecture(plan)
    dev = view.device

    def copy(src: nn.Module, fresh: nn.Module) -> nn.Module:
        src = getattr(src, "_module", src)
        fresh.load_state_dict({k: v.detach().clone() for k, v in src.state_dict().items()})
        for p in fresh.parameters():
            p.requires_grad_(False)
        return fresh.to(dev).eval()

    bottom = None
    if host.bottom is not None:
        with torch.random.fork_rng(devices=[]):
            bottom = copy(host.bottom, bottom_module(arch, "host", plan.input_shapes["host"], plan.cut, "native"))
    with torch.random.fork_rng(devices=[]):
        top = copy(host.top, arch.top(tuple(plan.merged_shape), plan.cut, plan.num_outputs))
    return bottom, top


class HostForward:
    """The host's own forward (eval mode, final weights) on the releases it received in ``phase`` of
    ``epoch``: its bottom on its own rows, its receiver-side post-processing of each guest's
    release, the merge and its top. Only an adversarial host builds one (it uses its own models).

    ``positions`` are the shared positions of the records every guest released in that epoch
    (optionally restricted to ``only``); :meth:`logits` recomputes the top, differentiably, with
    some guests' releases replaced (rows aligned with ``positions``).
    """

    def __init__(self, view, phase: str, epoch: int | str = "last", only: np.ndarray | None = None) -> None:
        host = getattr(view.me, "party", view.me)  # a malicious host keeps its honest party object
        self.host = host
        recs = {g: view.records("activations", phase, epoch, peer=g) for g in host.guests}
        common = None
        for r in recs.values():
            common = r.positions if common is None else np.intersect1d(common, r.positions)
        if only is not None:
            common = np.intersect1d(common, np.asarray(only))
        self.positions = common
        self.phase = phase
        dev = view.device
        self.releases = {g: r.select(common).values.to(dev) for g, r in recs.items()}
        # the attack works on a frozen copy of the host's own modules (no DP-SGD hooks, no
        # gradients accumulated into the trained model)
        self.bottom, self.top = own_modules(view, host)
        self._own = None
        if self.bottom is not None:
            x = host.data.x_train if phase == "train" else host.data.x_test
            with torch.no_grad():
                self._own = self.bottom(x.index_select(0, torch.from_numpy(common)).to(dev))
        # the receiver's random post-processing (masking, 003) is drawn once per record and kept:
        # a fixed mask per release, as the honest host drew one when the release arrived
        self._masks = {}
        if host.act_postprocess.random:
            for g, a in self.releases.items():
                self._masks[g] = host.act_postprocess(torch.ones_like(a), view.generator("denoise", g, phase))

    def _post(self, g: str, a: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if g in self._masks:
            m = self._masks[g]
            return a * (m if rows is None else m[rows])
        return self.host.act_postprocess(a, None)

    def logits(self, replace: dict[str, torch.Tensor] | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The host's logits for the records ``rows`` (indices into :attr:`positions`; all by
        default), with ``replace[g]`` (rows aligned) instead of guest ``g``'s releases."""
        host = self.host
        parts = []
        if self._own is not None:
            parts.append(self._own if rows is None else self._own[rows])
        for g in host.guests:
            if replace and g in replace:
                a = replace[g]
            else:
                a = self.releases[g] if rows is None else self.releases[g][rows]
            parts.append(self._post(g, a, rows))
        return self.top(host.merge(parts))


def frozen_victim_model(view) -> nn.Module:
    """The granted copy of the victim's bottom (``victim-model``) on the view's device, in eval mode
    with its parameters frozen: the white-box attacks optimise inputs, never the model."""
    f = view.aux.victim_model.to(view.device).eval()
    for p in f.parameters():
        p.requires_grad_(False)
    return f


def resolve(value, default):
    """``default`` when ``value`` is ``"auto"``."""
    return default if value == "auto" else value


def finite(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
