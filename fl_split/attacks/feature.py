"""Feature inference for tables by a generative regression network (Luo, Wu, Xiao & Ooi 2021,
"Feature inference attack on model predictions in vertical federated learning", ICDE, §V).

The host (the active party of Luo et al.) regresses guest ``g``'s feature values from what the
model outputs for each record. Luo et al.'s adversary knows the trained model's parameters and,
for every record, its own features ``x_adv`` and the model output ``v``; it trains a generator
``G(x_adv, r)`` (``r`` random noise) so that the model fed ``(x_adv, G(x_adv, r))`` reproduces
``v``, needing no ground truth of the target's features. In split learning:

* the threat model grants the host guest ``g``'s bottom ``f`` (architecture and final weights:
  Luo et al.'s "known model"; the same grant as white-box inversion — never its secret or data);
* ``--grn-target embedding`` (default): the output to reproduce is what the guest **released** for
  the record, ``ã``, matched through the public mechanism's noise-free part
  (:class:`~fl_split.attacks.common.ReleaseModel`): ``min_G Σ ℓ(f(G(x_h, r)), ã)``;
* ``--grn-target prediction``: Luo et al.'s own target, the model's prediction: the host's softmax
  output on the real releases, against its softmax output when ``g``'s release is replaced by
  ``f(G(x_h, r))`` (the other guests' releases unchanged): ``min_G Σ ‖softmax(top(…)) − v‖²``.

``G`` is an MLP on ``[x_h, r]`` (``x_h``: the host's own features, if it has any; ``r ~ N(0, I)``
of the guest's width), ``--attack-hidden`` wide (default 256), trained with Adam for
``--attack-epochs``; the guess for a record is the mean of ``G`` over 16 draws of ``r``. Records:
those released in the last evaluation (the test split, released with the final weights that ``f``
holds).

Metric (Luo et al. §VI): each feature is min–max normalised to [0, 1] with the victim's training
range; the **per-feature MSE** of the guess (clipped to [0, 1]), averaged over features, against a
**random guess** ``u ~ U(0, 1)`` whose expected MSE is ``E[(u − x)²] = x² − x + 1/3`` (≈ 0.17 for
uniform features; the public reference on a 2-party table: GRN 0.045 vs random 0.172).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fl_split.attacks.base import Attack, Guess, Scored
from fl_split.attacks.common import HostForward, ReleaseModel, frozen_victim_model, mlp
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant
from fl_split.errors import ConfigError

DRAWS = 16


class FeatureInference(Attack):
    name = "feature"
    title = "feature inference (generative regression network)"
    reference = "Luo et al. 2021 (ICDE) §V, GRN"
    adversaries = ("host",)
    metric = "per-feature mse"
    better = "lower"
    baseline_name = "random guess U(0,1) on min-max normalised features (expected MSE)"
    defaults = {"attack_epochs": 300, "attack_lr": 1e-3, "attack_hidden": 256}

    def check(self, referee, plan, opts: AttackOptions) -> None:
        if len(plan.input_shapes[opts.guest]) != 1:
            raise ConfigError("attack", "feature", "a table dataset for feature inference (Luo et al. 2021 infer "
                              "table columns); for images use inversion, reconstruction or fsha",
                              reason=f"{plan.cfg.dataset} is an image dataset")

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("victim-model", victim=opts.guest)]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"host knowing {opts.guest}'s trained bottom model (Luo et al.'s known model), its own features, "
                f"top model and the releases it received; no ground truth of {opts.guest}'s features")

    def run(self, view, opts: AttackOptions) -> Guess:
        dev = view.device
        f = frozen_victim_model(view)
        hf = HostForward(view, "test", "last")
        host = hf.host
        n = len(hf.positions)
        own = host.data.x_test.index_select(0, torch.from_numpy(hf.positions)).to(dev) if host.data.has_features \
            else torch.zeros((n, 0), device=dev)
        own = own.reshape(n, -1)
        width_in = int(np.prod(view.plan.input_shapes[opts.guest]))
        width_cut = int(np.prod(view.plan.cut_shapes[opts.guest]))
        noise_dim = width_in
        h = self.option(opts, "attack_hidden")
        with view.seeded("feature", "init"):
            gen_net = mlp(own.shape[1] + noise_dim, (h, h), width_in)
        gen_net.to(dev)
        release = ReleaseModel(view.cfg, width_cut)
        target_kind = opts.grn_target
        with torch.no_grad():
            v = F.softmax(hf.logits(), dim=1) if target_kind == "prediction" else None
        released = hf.releases[opts.guest]
        g = view.generator("feature", "draws")
        opt = torch.optim.Adam(gen_net.parameters(), lr=self.option(opts, "attack_lr"))
        epochs = self.option(opts, "attack_epochs")
        batch = 64
        losses = []
        bar = tqdm(range(epochs), desc="feature inference (GRN)", unit="epoch", disable=not view.progress,
                   leave=False, dynamic_ncols=True)
        for _ in bar:
            perm = torch.randperm(n, generator=g, device=g.device).to(dev)
            total = 0.0
            for i in range(0, n, batch):
                idx = perm[i: i + batch]
                r = torch.randn((len(idx), noise_dim), generator=g, device=g.device).to(dev)
                x_hat = gen_net(torch.cat([own[idx], r], dim=1))
                out = f(x_hat.reshape(len(idx), *view.plan.input_shapes[opts.guest]))
                if target_kind == "prediction":
                    rows = {opts.guest: release.expected(out).reshape(len(idx), *released.shape[1:])}
                    logits = hf.logits(replace={opts.guest: rows[opts.guest]}, rows=idx)
                    loss = ((F.softmax(logits, dim=1) - v[idx]) ** 2).sum(dim=1).mean()
                else:
                    loss = release.loss(out, released[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
            losses.append(total / n)
            bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)
        bar.close()
        with torch.no_grad():
            guesses = []
            for _ in range(DRAWS):
                r = torch.randn((n, noise_dim), generator=g, device=g.device).to(dev)
                guesses.append(gen_net(torch.cat([own, r], dim=1)))
            guess = torch.stack(guesses).mean(dim=0).cpu()
        return Guess("test", hf.positions, guess, None,
                     {"target_records": int(n), "grn_target": target_kind, "mechanism_model": release.name,
                      "generator_final_loss": losses[-1] if losses else None,
                      "host_features": int(own.shape[1])})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        train = referee.features(opts.guest, "train", np.arange(referee.n("train"))).reshape(referee.n("train"), -1)
        lo, hi = train.min(dim=0).values, train.max(dim=0).values
        span = (hi - lo).clamp_min(1e-12)
        truth = referee.features(opts.guest, "test", guess.positions).reshape(len(guess.positions), -1)
        t = ((truth - lo) / span).clamp(0, 1).double()
        gss = ((guess.values.reshape(len(t), -1).cpu() - lo) / span).clamp(0, 1).double()
        per_feature = ((gss - t) ** 2).mean(dim=0).numpy()
        random = (t ** 2 - t + 1.0 / 3.0).mean(dim=0).numpy()
        names = referee._party(opts.guest).feature_names
        return Scored(float(per_feature.mean()), float(random.mean()),
                      {"per_feature": {str(nm): float(v) for nm, v in zip(names, per_feature)},
                       "per_feature_random": {str(nm): float(v) for nm, v in zip(names, random)}})

