"""White-box model inversion (He, Zhang & Lee 2019, "Model inversion attacks against collaborative
inference", §3 rMLE; 002 §2.3 and Table 3).

The host knows guest ``g``'s bottom model ``f`` — architecture **and weights**: this is the one
attack whose threat model grants the victim's weights (a copy taken at the end of training, as
in a deployment where the trained bottom is published or leaks; never its secret, optimizer or
data). For each target record it observed the release ``ã = M(f(x))``, and it solves

    x* = argmin_x  ℓ(f(x), ã) + λ·TV(x)

by gradient descent (Adam, ``--inversion-steps``, learning rate ``--attack-lr``, default 0.05), where
``ℓ`` compares ``f(x)`` with the release through the adversary's model of the public mechanism
(:class:`~fl_split.attacks.common.ReleaseModel`: the noise-free part of the release; the logistic
loss against randomized-response bits) and ``TV`` is the total variation (``--tv-weight``,
He et al.'s image prior; 0 by default). Images are parametrised as ``x = sigmoid(z)`` so they stay
in [0, 1], starting from grey (``z = 0``); table rows start at the training mean (0 after
standardisation).

Targets: the releases of the last evaluation (test records, released with the final weights —
the very weights the copy holds), ``--attack-records`` of them (default 32). Metric: SSIM for
images (with PSNR), against a **random guess** (uniform noise images); MSE for tables, against the
mean sample (zeros after standardisation).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from fl_split.attacks.base import Attack, Guess, Scored
from fl_split.attacks.common import ReleaseModel, frozen_victim_model
from fl_split.attacks.images import write_grid
from fl_split.attacks.metrics import mse, psnr, ssim, ssim_window_size
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation per image, ``Σ|x_{i+1,j} − x_{i,j}| + |x_{i,j+1} − x_{i,j}|``
    (mean over pixels), for ``(n, C, H, W)``; returns ``(n,)``."""
    tv = torch.zeros(len(x), device=x.device)
    if x.shape[2] > 1:
        tv = tv + (x[:, :, 1:, :] - x[:, :, :-1, :]).abs().flatten(1).mean(dim=1)
    if x.shape[3] > 1:
        tv = tv + (x[:, :, :, 1:] - x[:, :, :, :-1]).abs().flatten(1).mean(dim=1)
    return tv


class WhiteBoxInversion(Attack):
    name = "inversion"
    title = "white-box model inversion (rMLE)"
    reference = "He, Zhang & Lee 2019 (ACSAC) §3; 002 §2.3, Table 3"
    adversaries = ("host",)
    metric = "ssim"
    baseline_name = "random guess (uniform noise images): SSIM"
    defaults = {"attack_lr": 0.05, "attack_records": 32}

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("victim-model", victim=opts.guest)]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"host with white-box access to {opts.guest}'s bottom model (architecture and final weights), "
                f"inverting the releases it received; no auxiliary data")

    def run(self, view, opts: AttackOptions) -> Guess:
        dev = view.device
        f = frozen_victim_model(view)
        obs = view.records("activations", "test", "last", peer=opts.guest)
        k = min(self.option(opts, "attack_records"), len(obs))
        pick = np.sort(view.rng("inversion", "targets").permutation(len(obs))[:k])
        targets = obs.subset(pick)
        released = targets.values.to(dev)
        shape = tuple(view.plan.input_shapes[opts.guest])
        image = len(shape) == 3
        width = int(np.prod(view.plan.cut_shapes[opts.guest]))
        model = ReleaseModel(view.cfg, width)
        z = torch.zeros((k, *shape), device=dev, requires_grad=True)
        opt = torch.optim.Adam([z], lr=self.option(opts, "attack_lr"))
        tv = float(opts.tv_weight)
        steps = int(opts.inversion_steps)
        history = []
        bar = tqdm(range(steps), desc="white-box inversion", unit="step", disable=not view.progress, leave=False,
                   dynamic_ncols=True)
        for step in bar:
            x = torch.sigmoid(z) if image else z
            per = model.loss(f(x), released, reduction="none")
            if image and tv > 0:
                per = per + tv * total_variation(x)
            loss = per.sum()  # records are independent: each gets its own full gradient
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % max(1, steps // 10) == 0 or step == steps - 1:
                history.append({"step": step + 1, "loss": per.mean().item()})
        bar.close()
        with torch.no_grad():
            x = (torch.sigmoid(z) if image else z).detach().cpu()
        gen = view.generator("inversion", "baseline", device="cpu")
        trivial = torch.rand(x.shape, generator=gen) if image else torch.zeros_like(x)
        return Guess("test", targets.positions, x, trivial,
                     {"target_records": k, "image": image, "mechanism_model": model.name, "steps": steps,
                      "loss_history": history})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        truth = referee.features(opts.guest, "test", guess.positions)
        if not guess.details["image"]:
            return Scored(mse(guess.values, truth), mse(guess.baseline, truth), {}, metric="mse",
                          baseline_name="mean-sample MSE (the standardised mean, zeros)")
        details = {"psnr": psnr(guess.values, truth), "baseline_psnr": psnr(guess.baseline, truth),
                   "mse": mse(guess.values, truth), "baseline_mse": mse(guess.baseline, truth),
                   "ssim_window": ssim_window_size(truth.shape[-2], truth.shape[-1])}
        return Scored(ssim(guess.values, truth), ssim(guess.baseline, truth), details)

    def write_grid(self, guess: Guess, referee, opts: AttackOptions, path: str) -> None:
        if guess.details["image"]:
            write_grid(path, referee.features(opts.guest, "test", guess.positions), guess.values)
