"""Feature-space hijacking (FSHA; Pasquini, Ateniese & Bernaschi 2021, "Unleashing the tiger:
inference attacks on split learning", CCS, §3; 001 §2.3 and Figs. 3–4; 003 §4.3 and Fig. 5).

A **malicious host** replaces its honest training by the hijack. It never trains the task: from
public same-domain records ``X_pub`` (the public split, victim ``g``'s columns) it trains

* a pilot encoder ``f̃`` and a decoder ``f̃⁻¹`` as an autoencoder, ``min d(f̃⁻¹(f̃(X_pub)), X_pub)``;
* a discriminator ``D`` on the feature space, telling the pilot's features ``f̃(X_pub)`` from the
  features ``f(X_priv)`` guest ``g`` releases (Wasserstein loss with gradient penalty, as the
  official code: ``L_D = E[D(f̃(x_pub))] − E[D(f(x_priv))] + w·GP``);

and instead of the task's partial loss it sends the guest the gradient of
``L_f = E[D(f(X_priv))]`` (001's ``log(1 − D(f(X_priv)))`` in its WGAN form) with respect to the
release, so the honest guest's own optimizer pulls ``f`` into the pilot's feature space, where
``f̃⁻¹`` inverts it: ``x̂ = f̃⁻¹(ã)``. All four updates of one iteration use the same forward, as the
official ``train_step``.

Our choices where the paper leaves room (``docs/attacks.md``):

* the guest's optimizer and learning rate are its own (``--optimizer``, ``--lr``): a malicious
  host cannot set them (the official code trains ``f`` with Adam at 1e-5);
* pilot = the public architecture of the guest's bottom (the run configuration names it) with the
  host's own initialisation; decoder and discriminator: MLPs ``width → h → h → out``
  (``--attack-hidden``, default 256; sigmoid output for images in [0, 1]); all three Adam at
  ``--fsha-lr``; gradient-penalty weight ``--fsha-gp`` (official: 500);
* the host's receiver-side post-processing (denoising by scaling or masking, 003) is applied to
  what it receives before ``D`` and ``f̃⁻¹``, as in 003 Fig. 5's FSHA rows (a host that skipped it
  would attack the noisy release itself); its backward defence (``--protect host``) protects the
  host's own data and is not applied — a malicious host sends what it wants, *within* the public
  range of its declared backward mechanism, which the honest guest checks (issue 16,
  ``fl_split.privacy.bounds``): its gradient is projected into that range (``PublicRange.project``);
* the hijacked run trains no task model: ``final`` has no metric.

Metric: MSE of the reconstructions of the test records' last releases (inputs in [0, 1]; the
official code reports images in [−1, 1], whose MSE is 4× ours: ``mse_pm1``), against the
**mean-sample baseline** (the public records' mean input); SSIM and PSNR in the details; and the
MSE of the attacker's reconstruction of its training batch every ``--fsha-every`` iterations (the
official MNIST reference: 0.15 after 500 iterations, 0.019 after 9,500, in [−1, 1]).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from fl_split.attacks.base import Attack, Guess, Scored
from fl_split.attacks.common import mlp
from fl_split.attacks.images import write_grid
from fl_split.attacks.metrics import mse, psnr, ssim, ssim_window_size
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant, architecture
from fl_split.models.registry import bottom_module
from fl_split.errors import ConfigError
from fl_split.protocol import Message, encode, handoff

HIDDEN = 256


class _Reshape(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.reshape(len(x), *self.shape)


class FSHAHost:
    """A malicious host running FSHA during training (see the module docstring).

    It is built from the honest :class:`~fl_split.parties.HostParty`'s own objects (``party``: its
    data, schedule, secret, device; it decodes the guests' messages with the honest host's checks)
    and the public records its threat model grants, and it answers the coordinator as a host does.
    """

    role = "host"

    def __init__(self, party, plan, aux, victim: str, opts: AttackOptions, hidden: int = HIDDEN) -> None:
        self.party = party
        self.name = "host"
        self.guests = list(party.guests)
        self.victim = victim
        self.plan = plan
        cfg = plan.cfg
        self.device = party.device
        self.shape = tuple(plan.input_shapes[victim])
        self.image = len(self.shape) == 3
        width = int(np.prod(plan.cut_shapes[victim]))
        self.public_x = aux.public["x"][victim].to(self.device)
        arch = architecture(plan)
        with party.secret.seeded_torch("attack", "fsha", "init"):
            self.pilot = bottom_module(arch, victim, self.shape, plan.cut, plan.guest_cut_activation)
            self.decoder = nn.Sequential(nn.Flatten(), mlp(width, (hidden, hidden), math.prod(self.shape),
                                                           nn.Sigmoid() if self.image else None), _Reshape(self.shape))
            self.disc = nn.Sequential(nn.Flatten(), mlp(width, (hidden, hidden), 1))
        for m in (self.pilot, self.decoder, self.disc):
            m.to(self.device)
        self.opt_ae = torch.optim.Adam([*self.pilot.parameters(), *self.decoder.parameters()], lr=opts.fsha_lr)
        self.opt_d = torch.optim.Adam(self.disc.parameters(), lr=opts.fsha_lr)
        self.gp_weight = float(opts.fsha_gp)
        self.every = int(opts.fsha_every)
        self.post = party.act_postprocess
        self.iterations = 0
        #: the attacker's own reconstructions of its current training batch, every ``every`` iterations
        self.snapshots: list[dict[str, Any]] = []
        self.losses: list[dict[str, float]] = []

    # -- what a party object offers the view -------------------------------------------------------
    @property
    def data(self):
        return self.party.data

    @property
    def secret(self):
        return self.party.secret

    def _gen(self, *parts: object) -> torch.Generator:
        return self.party.secret.torch_generator("attack", "fsha", *parts, device=self.device)

    def features(self, released: torch.Tensor, key=None) -> torch.Tensor:
        """The host's view of a release after its own receiver-side post-processing."""
        gen = self._gen("denoise", *key.as_tuple()) if (self.post.random and key is not None) else \
            (self._gen("denoise") if self.post.random else None)
        return self.post(released, gen)

    @torch.no_grad()
    def reconstruct(self, released: torch.Tensor) -> torch.Tensor:
        """``f̃⁻¹`` of received releases (post-processed as during training)."""
        self.decoder.eval()
        out = self.decoder(self.features(released.to(self.device)))
        self.decoder.train()
        return out

    def _gradient_penalty(self, z_priv: torch.Tensor, z_pub: torch.Tensor) -> torch.Tensor:
        eps = torch.rand((len(z_priv), *([1] * (z_priv.dim() - 1))), generator=self._gen("gp", self.iterations),
                         device=self.device)
        z_hat = (eps * z_priv + (1 - eps) * z_pub).requires_grad_(True)
        grad, = torch.autograd.grad(self.disc(z_hat).sum(), z_hat, create_graph=True)
        return ((grad.flatten(1).norm(dim=1) - 1.0) ** 2).mean()

    # -- the coordinator's calls --------------------------------------------------------------------
    def train(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int,
              in_process: bool = False) -> dict[str, list[bytes]]:
        """``in_process``: the guests are in this process (hand the gradients over, issue 18)."""
        keys = list(keys)
        out = handoff if in_process else encode
        msgs = self.party._received(keys, blobs_by_guest, round_)  # the honest host's decoding and checks
        grads: dict[str, list[bytes]] = {g: [] for g in self.guests}
        for i, key in enumerate(keys):
            released = msgs[self.victim][i].to(self.device).requires_grad_(True)
            z_priv = self.features(released, key)
            n = len(released)
            pick = torch.randint(len(self.public_x), (n,), generator=self._gen("public", self.iterations),
                                 device=self.device)
            x_pub = self.public_x[pick]
            z_pub = self.pilot(x_pub)
            ae_loss = torch.mean((self.decoder(z_pub) - x_pub) ** 2)
            f_loss = self.disc(z_priv).mean()
            delta, = torch.autograd.grad(f_loss, released)
            d_loss = self.disc(z_pub.detach()).mean() - self.disc(z_priv.detach()).mean()
            if self.gp_weight > 0:
                d_loss = d_loss + self.gp_weight * self._gradient_penalty(z_priv.detach(), z_pub.detach())
            self.opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            self.opt_d.step()
            self.opt_ae.zero_grad(set_to_none=True)
            ae_loss.backward()
            self.opt_ae.step()
            self.iterations += 1
            digest = self.party.digest(key)
            for g in self.guests:
                t = delta.detach() if g == self.victim else torch.zeros_like(msgs[g][i])
                rng = self.party.backward_mechanisms[g](key).public_range()
                if rng is not None:  # the guest refuses what its mechanism cannot make: stay inside it
                    t = rng.project(t)
                grads[g].append(out(Message("gradients", "host", g, round_, key, digest, t.float(), "float32")))
            if self.iterations % self.every == 0:
                with torch.no_grad():
                    self.decoder.eval()
                    recon = self.decoder(z_priv.detach()).cpu()
                    self.decoder.train()
                self.snapshots.append({"iteration": self.iterations, "key": key, "recon": recon})
                self.losses.append({"iteration": self.iterations, "autoencoder": ae_loss.item(),
                                    "discriminator": d_loss.item(), "hijack": f_loss.item()})
        return grads

    def evaluate(self, keys, blobs_by_guest: dict[str, list[bytes]], round_: int | None = None) -> dict[str, Any]:
        """The hijacked run has no task model: nothing to report but the epoch."""
        keys = list(keys)
        self.party._received(keys, blobs_by_guest, round_)
        return {"epoch": int(keys[0].epoch) if keys else 0}

    def drop_guest(self, guest: str, round_: int) -> None:
        self.party.drop_guest(guest, round_)

    def report(self) -> dict[str, Any]:
        rep = self.party.report()
        rep["malicious"] = {"attack": "fsha", "iterations": self.iterations,
                            "note": "replaced its honest training; sent unperturbed hijacking gradients"}
        return rep


class FSHA(Attack):
    name = "fsha"
    title = "feature-space hijacking attack"
    reference = "Pasquini et al. 2021 (CCS) §3; 001 §2.3, Figs. 3-4; 003 §4.3, Fig. 5"
    adversaries = ("host",)
    metric = "mse"
    better = "lower"
    baseline_name = "mean-sample MSE (the public records' mean input for every target)"
    public = True
    malicious = True
    defaults = {"attack_hidden": HIDDEN}

    def check(self, referee, plan, opts: AttackOptions) -> None:
        if plan.cfg.one_shot:
            raise ConfigError("one-shot", True, "false for fsha",
                              reason="a one-shot guest is frozen and receives no gradients to hijack")

    def grants(self, referee, opts: AttackOptions, before_training: bool = False) -> list[Grant]:
        return [Grant("public-records")]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"malicious host replacing its training by the hijack of {opts.guest}, with public same-domain "
                f"records (no labels needed); it knows the public architecture, not {opts.guest}'s weights")

    def hijacker(self, opts: AttackOptions):
        def factory(party, plan, aux):
            return FSHAHost(party, plan, aux, opts.guest, opts, hidden=self.option(opts, "attack_hidden"))
        return factory

    def run(self, view, opts: AttackOptions) -> Guess:
        me: FSHAHost = view.me
        obs = view.records("activations", "test", "last", peer=opts.guest)
        recon = me.reconstruct(obs.values).cpu()
        mean = view.aux.public["x"][opts.guest].mean(dim=0, keepdim=True).expand_as(recon).clone()
        snaps = []
        for s in me.snapshots:
            pos = view.plan.schedule.positions(s["key"])
            snaps.append({"iteration": s["iteration"], "positions": pos, "recon": s["recon"]})
        return Guess("test", obs.positions, recon, mean,
                     {"iterations": me.iterations, "image": me.image, "snapshots": snaps, "losses": me.losses,
                      "public_records": int(len(view.aux.public["y"]))})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        truth = referee.features(opts.guest, "test", guess.positions)
        value = mse(guess.values, truth)
        curve = []
        for s in guess.details.pop("snapshots"):
            t = referee.features(opts.guest, "train", s["positions"])
            m = mse(s["recon"], t)
            curve.append({"iteration": s["iteration"], "mse": m, "mse_pm1": 4 * m})
        details = {"mse_pm1": 4 * value, "baseline_mse_pm1": 4 * mse(guess.baseline, truth), "curve": curve}
        if guess.details["image"]:
            details.update(ssim=ssim(guess.values, truth), psnr=psnr(guess.values, truth),
                           baseline_ssim=ssim(guess.baseline, truth), baseline_psnr=psnr(guess.baseline, truth),
                           ssim_window=ssim_window_size(truth.shape[-2], truth.shape[-1]))
        return Scored(value, mse(guess.baseline, truth), details)

    def write_grid(self, guess: Guess, referee, opts: AttackOptions, path: str) -> None:
        if guess.details["image"]:
            write_grid(path, referee.features(opts.guest, "test", guess.positions), guess.values)
