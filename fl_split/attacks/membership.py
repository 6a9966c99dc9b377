"""Membership inference with shadow models (Shokri, Stronati, Song & Shmatikov 2017, as used by 002
§2.3 and Table 4 via Bernau et al. 2019).

The host queries the trained split model — it holds the top, its own features, the labels and, for
every record, the guests' releases — and asks, for each candidate record, whether it was in the
training set. Shokri et al.'s recipe:

1. **Shadow models**: ``--shadow-models`` copies of the split model's public architecture (every
   party's bottom, the merge, the top, initialised from the host's own randomness) are trained
   like the target (same optimizer, learning rate, batch size and epochs, the public forward
   mechanism simulated on the guests' outputs with the host's own noise, straight-through
   gradient) on a random half of the **public records** (the public split: same-domain records
   with labels); the other half is their non-members;
2. **Attack model**: an MLP classifier ``member?`` on features of a model's output for a record and
   its label: the probability of the true label, the loss, the entropy, the two largest
   probabilities and their margin; trained on the shadow models' members and non-members;
3. **Target**: the candidates are the whole test split (non-members, scored with the releases of
   the last evaluation) and as many training records (members, scored with their releases of the
   last training epoch), through the host's final model.

Metric: F1 of "member" (002), against the **always-member** F1 at the member rate, ``2m/(1+m)``
(0.667 for the balanced candidates here). AUC and accuracy are in the details.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fl_split.attacks.base import Attack, Guess, Scored
from fl_split.attacks.common import HostForward, train_classifier
from fl_split.attacks.metrics import accuracy, always_positive_f1, auc, f1
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant, architecture
from fl_split.builder import optimizer_settings
from fl_split.merge import Merge
from fl_split.models.registry import bottom_module
from fl_split.privacy import factory as privacy_factory


def output_features(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The attack model's input for each record: ``[p_y, −log p_y, entropy, p_(1), p_(2), p_(1) − p_(2)]``."""
    logp = F.log_softmax(logits.double(), dim=1)
    p = logp.exp()
    py = p.gather(1, y[:, None]).squeeze(1)
    loss = -logp.gather(1, y[:, None]).squeeze(1)
    entropy = -(p * logp).sum(dim=1)
    k = min(2, p.shape[1])
    top = p.topk(k, dim=1).values
    second = top[:, 1] if k > 1 else torch.zeros_like(py)
    return torch.stack([py, loss, entropy, top[:, 0], second, top[:, 0] - second], dim=1).float()


class ShadowModel(nn.Module):
    """The split model as one network (bottoms, merge, top) with the guests' public forward mechanism
    simulated on their outputs (the host's own draws; straight-through gradient)."""

    def __init__(self, view, k: int) -> None:
        super().__init__()
        plan, cfg = view.plan, view.cfg
        arch = architecture(plan)
        with view.seeded("shadow", k):  # one private stream for the whole shadow model
            self.bottoms = nn.ModuleDict({
                p: bottom_module(arch, p, s, plan.cut, "native" if p == "host" else plan.guest_cut_activation)
                for p, s in plan.input_shapes.items()})
            self.top = arch.top(tuple(plan.merged_shape), plan.cut, plan.num_outputs)
        self.merge = Merge(cfg.merge)
        self.mechs = {p: privacy_factory.forward_mechanism(cfg, int(np.prod(plan.cut_shapes[p])))
                      for p in plan.input_shapes if p != "host"}
        host = getattr(view.me, "party", view.me)
        self.post = host.act_postprocess
        self.gen = view.generator("shadow", k, "noise")

    def forward(self, xs: dict[str, torch.Tensor], simulate: bool = True) -> torch.Tensor:
        parts = []
        for p, bottom in self.bottoms.items():
            v = bottom(xs[p])
            if p != "host" and simulate:
                mech = self.mechs[p]
                if mech.name != "none":
                    rel = mech.release(v.detach(), self.gen if mech.random else None).value.to(v.dtype)
                    v = v + (rel - v).detach()  # the release, with a straight-through gradient
                v = self.post(v, self.gen if self.post.random else None)
            parts.append(v)
        return self.top(self.merge(parts))


class MembershipInference(Attack):
    name = "membership"
    title = "membership inference (shadow models)"
    reference = "Shokri et al. 2017; 002 §2.3, Table 4"
    adversaries = ("host",)
    metric = "f1"
    baseline_name = "always-member F1 at the member rate, 2m/(1+m)"
    public = True
    defaults = {"attack_epochs": 200, "attack_lr": 1e-3, "attack_hidden": 64}

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("public-records")]

    def threat_summary(self, opts: AttackOptions) -> str:
        return ("host querying the trained split model (its top, its features and labels, the guests' releases of "
                "each candidate), with public same-domain records to train shadow models")

    def _train_shadow(self, view, k: int, xs: dict[str, torch.Tensor], y: torch.Tensor) -> ShadowModel:
        cfg = view.cfg
        dev = view.device
        model = ShadowModel(view, k).to(dev)
        opt = optimizer_settings(cfg).make(model.parameters())
        gen = view.generator("shadow", k, "order")
        n = len(y)
        model.train()
        for _ in range(cfg.epochs):
            perm = torch.randperm(n, generator=gen, device=gen.device).to(dev)
            for i in range(0, n, cfg.batch_size):
                idx = perm[i: i + cfg.batch_size]
                loss = F.cross_entropy(model({p: x[idx] for p, x in xs.items()}), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        model.eval()
        return model

    def run(self, view, opts: AttackOptions) -> Guess:
        dev = view.device
        pub = view.aux.public
        xs = {p: x.to(dev) for p, x in pub["x"].items()}
        y = pub["y"].to(dev)
        n = len(y)
        feats, member = [], []
        rng = view.rng("shadow", "split")
        for k in tqdm(range(opts.shadow_models), desc="shadow models", unit="model", disable=not view.progress,
                      leave=False, dynamic_ncols=True):
            inside = np.zeros(n, dtype=bool)
            inside[rng.permutation(n)[: n // 2]] = True
            t_in = torch.as_tensor(inside, device=dev)
            model = self._train_shadow(view, k, {p: x[t_in] for p, x in xs.items()}, y[t_in])
            with torch.no_grad():
                logits = model(xs, simulate=True)
            feats.append(output_features(logits, y).cpu())
            member.append(inside.astype(np.int64))
        feats_t, member_a = torch.cat(feats), np.concatenate(member)
        predict = train_classifier(view, "membership", feats_t, member_a, hidden=self.option(opts, "attack_hidden"),
                                   epochs=self.option(opts, "attack_epochs"), lr=self.option(opts, "attack_lr"),
                                   num_classes=2)
        shadow_acc = accuracy(predict(feats_t).argmax(dim=1).cpu().numpy(), member_a)
        # the target: every test record (non-members) and as many training records (members)
        test = HostForward(view, "test", "last")
        train_all = HostForward(view, "train", "last")
        pick = np.sort(view.rng("membership", "members").permutation(len(train_all.positions))[: len(test.positions)])
        train = HostForward(view, "train", "last", only=train_all.positions[pick])
        host = test.host
        rows = []
        for hf, phase in ((train, "train"), (test, "test")):
            yy = (host.data.y_train if phase == "train" else host.data.y_test)
            yy = yy.index_select(0, torch.from_numpy(hf.positions)).to(dev)
            with torch.no_grad():
                rows.append(output_features(hf.logits(), yy).cpu())
        target = torch.cat(rows)
        proba = predict(target)[:, 1].cpu().numpy()
        phases = np.array(["train"] * len(train.positions) + ["test"] * len(test.positions))
        positions = np.concatenate([train.positions, test.positions])
        return Guess(phases, positions, (proba >= 0.5).astype(np.int64), np.ones(len(positions), dtype=np.int64),
                     {"scores": proba, "shadow_models": opts.shadow_models, "public_records": int(n),
                      "shadow_attack_accuracy": shadow_acc, "candidates": int(len(positions)),
                      "members": int(len(train.positions))})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        truth = (guess.phase == "train").astype(np.int64)
        scores = guess.details.pop("scores")
        rate = float(truth.mean())
        return Scored(f1(guess.values, truth), always_positive_f1(rate),
                      {"member_rate": rate, "auc": auc(scores, truth == 1), "accuracy": accuracy(guess.values, truth)})
