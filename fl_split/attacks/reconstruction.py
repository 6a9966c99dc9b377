"""Data reconstruction by a learned inversion decoder (host → guest; 001 §2.3, Tables 6–7).

The host learns a decoder ``D: ã ↦ x`` from guest ``g``'s released cut-layer outputs back to the
guest's inputs, on auxiliary pairs ``(ã_i, x_i)`` — the guest's raw inputs of ``--aux-fraction`` of
the training records, matched by ID with what the host received for them (leaked or purchased
records: the strongest "auxiliary data" a passive host can have). It then decodes the releases of
the other training records. This is the learning-based inversion of He et al. (2019, §4 "inverse
network") in the known-pairs setting.

**Not built: the GAN of 001 Eq. 2** (Hitaj et al. 2017). Its game needs the adversary to inject
generated samples into the victim's training and use the joint model as a discriminator of the
victim's *classes*; a vertical guest has no labels and the host cannot feed inputs to a guest's
bottom, so the attack does not transfer as stated, and 001 does not say how it adapted it (its
host MSEs, 0.96 on MNIST, are those of an unsuccessful reconstruction, as 001 notes). The decoder
here is the stronger, well-defined attack.

Decoder: an MLP ``width → h → h → prod(input shape)`` (``--attack-hidden``, default 256), sigmoid
output for images (inputs in [0, 1], public), linear for tables (standardised); Adam on the MSE,
keeping the epoch with the lowest MSE on a held-out fifth of the pairs (early stopping: on noisy
releases a decoder trained to the end fits the noise and ends worse than the mean sample).
Metric: MSE on the target records against the **mean-sample baseline** (predict the auxiliary
records' mean input for everyone); for images also SSIM and PSNR.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_split.attacks.base import Attack, Guess, Scored, observed, observed_epoch
from fl_split.attacks.common import VALIDATION, Standardizer, fit, mlp
from fl_split.attacks.images import write_grid
from fl_split.attacks.metrics import mse, psnr, ssim, ssim_window_size
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant


def image_scores(recon: torch.Tensor, truth: torch.Tensor, baseline: torch.Tensor | None) -> dict:
    """SSIM/PSNR of reconstructions (and of a baseline guess) for image inputs."""
    out = {"ssim": ssim(recon, truth), "psnr": psnr(recon, truth),
           "ssim_window": ssim_window_size(truth.shape[-2], truth.shape[-1])}
    if baseline is not None:
        out.update(baseline_ssim=ssim(baseline, truth), baseline_psnr=psnr(baseline, truth))
    return out


class Reconstruction(Attack):
    name = "reconstruction"
    title = "data reconstruction (learned inversion decoder)"
    reference = "Mao et al. (001) §2.3, Tables 6-7; He et al. 2019 inverse network"
    adversaries = ("host",)
    metric = "mse"
    better = "lower"
    baseline_name = "mean-sample MSE (the auxiliary records' mean input for every target)"
    defaults = {"attack_epochs": 200, "attack_lr": 1e-3, "attack_hidden": 256, "attack_epoch": "last"}

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("victim-features", victim=opts.guest, fraction=opts.aux_fraction)]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"honest-but-curious host: the releases of {opts.guest} it received, plus {opts.guest}'s raw inputs "
                f"for {opts.aux_fraction:.0%} of the training records (known pairs)")

    def run(self, view, opts: AttackOptions) -> Guess:
        aux = view.aux.victim_features
        obs = observed(view, "activations", opts.guest, observed_epoch(opts, self))
        known = np.isin(obs.positions, aux.positions)
        train, targets = obs.subset(known), obs.subset(~known)
        x_aux = aux.values[torch.as_tensor(np.searchsorted(aux.positions, train.positions))]
        shape = tuple(x_aux.shape[1:])
        image = len(shape) == 3
        dev = view.device
        scaler = Standardizer.fit(train.values)
        h = self.option(opts, "attack_hidden")
        with view.seeded("reconstruction", "init"):
            decoder = mlp(train.values.shape[1], (h, h), math.prod(shape), nn.Sigmoid() if image else None)
        decoder.to(dev)
        xs, ys = scaler(train.values.to(dev)), x_aux.reshape(len(x_aux), -1).to(dev)
        history = fit(decoder, xs, ys, F.mse_loss, epochs=self.option(opts, "attack_epochs"),
                      lr=self.option(opts, "attack_lr"), batch_size=64, gen=view.generator("reconstruction", "order"),
                      desc="reconstruction decoder", progress=view.progress, validation=VALIDATION)
        with torch.no_grad():
            recon = decoder(scaler(targets.values.to(dev))).reshape(len(targets), *shape).cpu()
        mean = x_aux.mean(dim=0, keepdim=True).expand(len(targets), *shape).clone()
        return Guess("train", targets.positions, recon, mean,
                     {"auxiliary_records": int(len(train)), "target_records": int(len(targets)),
                      "decoder_validation_mse": min(history["validation_loss"], default=None),
                      "decoder_best_epoch": history["best_epoch"], "image": image})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        truth = referee.features(opts.guest, "train", guess.positions)
        details = image_scores(guess.values, truth, guess.baseline) if guess.details["image"] else {}
        return Scored(mse(guess.values, truth), mse(guess.baseline, truth), details)

    def write_grid(self, guess: Guess, referee, opts: AttackOptions, path: str) -> None:
        if guess.details["image"]:
            write_grid(path, referee.features(opts.guest, "train", guess.positions), guess.values)
