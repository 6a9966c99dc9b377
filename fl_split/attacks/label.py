"""Label inference by a guest from the gradients it receives (beyond the papers: spec §4; the open
question of 001 §6 — does R3eLU-backward stop it?).

A guest holds features only; the host's labels leak through the partial losses ``δ̃ = M_bwd(∂L/∂ã)``
it receives for every record of every training batch.

* :class:`NormScoring` — Li, Sun, Wang, Song, Zhang, Wang & Xie (2022), "Label leakage and
  protection in two-party split learning", ICLR, §3.1 norm scoring: with a cross-entropy loss the
  gradient of a record of the rare (positive) class is larger, so ``‖δ̃_i‖₂`` scores "positive".
  Binary tasks only. Which class that is, is domain knowledge in Li et al.; here the guest takes the
  class whose known-label records rank higher by norm (pooled over epochs). Metric: AUC of the
  score for that class.
* :class:`DirectionScoring` — Li et al. (2022) §3.2 direction scoring: records of the same class
  receive gradients pointing the same way (for a linear top, exactly ``±`` one direction in a
  binary task). With the gradients of its known-label records as references, the guest scores
  record ``i`` for class ``c`` by the cosine between ``δ̃_i`` and the mean unit gradient of the
  known class-``c`` records of the same epoch. Binary: AUC for class 1; multi-class: the macro
  average of the one-vs-rest AUCs.

Both score every training record (but the known ones) in each epoch, with that epoch's gradients,
and report the mean over the epochs ``--attack-epoch`` selects (``all`` by default; per-epoch AUCs
in the details); the baseline is 0.5 (an uninformative score).

* :class:`ModelCompletion` — Fu, Zhang, Ji, Chen, Wu, Guo, Zhou, Liu & Wang (2022), "Label inference
  attacks against vertical federated learning", USENIX Security, §4.2 passive model completion: the
  guest stacks a small classifier on its own trained bottom model and fits it with a few known
  labels (``--known-labels`` per class). Fu et al. fine-tune with MixMatch; we freeze the bottom and
  use self-training instead (three rounds of adding the unlabelled records predicted with
  confidence ≥ 0.95 as pseudo-labels), named as such in the results. Metric: accuracy on the other
  training records against the majority rate of the known labels. ``raw_input_accuracy`` (details)
  is the same completion on the guest's raw inputs: what its own columns tell about the labels
  without any training signal from the host; the leak due to split training is the difference.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fl_split.attacks.base import Attack, Guess, Scored, observed_epoch
from fl_split.attacks.common import train_classifier
from fl_split.attacks.metrics import accuracy, auc
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant, NotObserved
from fl_split.errors import ConfigError

PSEUDO_ROUNDS = 3
PSEUDO_CONFIDENCE = 0.95


def _epochs(view, opts: AttackOptions, attack: Attack) -> list[int]:
    available = view.epochs("gradients", "train", peer="host")
    if not available:
        raise NotObserved(f"{view.party} received no gradients (one-shot runs send none back)")
    e = observed_epoch(opts, attack)
    if e == "all":
        return available
    if e == "last":
        return [available[-1]]
    if int(e) not in available:
        raise ConfigError("attack-epoch", e, f"one of the observed epochs {available}, last or all")
    return [int(e)]


class _GradientScoring(Attack):
    adversaries = ("guest",)
    metric = "auc"
    baseline_name = "0.5 (an uninformative score)"
    defaults = {"known_labels": 4, "attack_epoch": "all"}

    def check(self, referee, plan, opts: AttackOptions) -> None:
        if plan.cfg.one_shot:
            raise ConfigError("one-shot", True, f"false for {self.name}",
                              reason="one-shot guests receive no gradients")

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("known-labels", per_class=self.option(opts, "known_labels"))]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"honest-but-curious {opts.guest}: the partial losses the host released to it, plus the labels of "
                f"{self.option(opts, 'known_labels')} training records per class")

    def scores(self, grads: torch.Tensor, known_grads: torch.Tensor, known_y: np.ndarray) -> dict[int, np.ndarray]:
        raise NotImplementedError

    def run(self, view, opts: AttackOptions) -> Guess:
        known = view.aux.known_labels
        epochs = _epochs(view, opts, self)
        per_epoch = []
        positions = None
        for e in epochs:
            recs = view.records("gradients", "train", e, peer="host")
            g = recs.values.reshape(len(recs), -1).to(view.device).double()
            is_known = np.isin(recs.positions, known.positions)
            known_y = known.values[np.searchsorted(known.positions, recs.positions[is_known])]
            scores = self.scores(g[torch.as_tensor(~is_known, device=g.device)],
                                 g[torch.as_tensor(is_known, device=g.device)], known_y)
            per_epoch.append({"epoch": e, "scores": {c: s for c, s in scores.items()}})
            if positions is None:
                positions = recs.positions[~is_known]
            elif not np.array_equal(positions, recs.positions[~is_known]):
                raise RuntimeError("records differ between epochs")
        return Guess("train", positions, per_epoch, None, {"epochs": epochs, "known_records": int(len(known))})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        y = referee.labels("train", guess.positions)
        rows = []
        for ep in guess.values:
            aucs = [auc(s, y == c) for c, s in ep["scores"].items()]
            aucs = [a for a in aucs if not np.isnan(a)]
            rows.append({"epoch": ep["epoch"], "auc": float(np.mean(aucs)) if aucs else float("nan")})
        value = float(np.nanmean([r["auc"] for r in rows]))
        return Scored(value, 0.5, {"per_epoch": rows, "classes_scored": sorted(int(c) for c in guess.values[0]["scores"])})


class NormScoring(_GradientScoring):
    name = "label-norm"
    title = "label inference by gradient norm scoring"
    reference = "Li et al. 2022 (ICLR) §3.1"

    def check(self, referee, plan, opts: AttackOptions) -> None:
        super().check(referee, plan, opts)
        if plan.num_outputs != 2 or plan.metric != "accuracy":
            raise ConfigError("attack", "label-norm", "label-direction or label-completion for a task with "
                              f"{plan.num_outputs} classes (norm scoring needs a binary task: breast-cancer, credit)",
                              reason=f"{plan.cfg.dataset} is not binary")

    def scores(self, grads, known_grads, known_y):
        return {1: grads.norm(dim=1).cpu().numpy()}

    def run(self, view, opts: AttackOptions) -> Guess:
        """Norms score class 1; then the orientation: Li et al. score the rare (positive) class by
        a larger norm, and which class that is the guest reads off its known records — the class
        whose known records rank higher by norm, pooled over the epochs scored (per-epoch ranks,
        so the shrinking norms of later epochs weigh the same). A mean would be dominated by a
        few badly fitted records, whose norms are far above their class's."""
        guess = super().run(view, opts)
        known = view.aux.known_labels
        ranks, labels = [], []
        for e in guess.details["epochs"]:
            recs = view.records("gradients", "train", e, peer="host")
            keep = np.isin(recs.positions, known.positions)
            norms = recs.values.reshape(len(recs), -1)[torch.as_tensor(keep)].norm(dim=1).numpy()
            ranks.append(norms.argsort().argsort() / max(len(norms) - 1, 1))
            labels.append(known.values[np.searchsorted(known.positions, recs.positions[keep])])
        large = 1 if auc(np.concatenate(ranks), np.concatenate(labels) == 1) >= 0.5 else 0
        for ep in guess.values:
            ep["scores"] = {large: ep["scores"][1]}
        guess.details["larger_norm_class"] = large
        return guess


class DirectionScoring(_GradientScoring):
    name = "label-direction"
    title = "label inference by gradient direction scoring"
    reference = "Li et al. 2022 (ICLR) §3.2"

    def scores(self, grads, known_grads, known_y):
        unit = F.normalize(grads, dim=1)
        known_unit = F.normalize(known_grads, dim=1)
        classes = sorted(int(c) for c in np.unique(known_y))
        out = {}
        for c in classes:
            ref = known_unit[torch.as_tensor(known_y == c, device=known_unit.device)].mean(dim=0)
            out[c] = (unit @ F.normalize(ref, dim=0)).cpu().numpy()
        if len(classes) == 2:  # binary: one score (the other class's AUC is its mirror image)
            return {classes[1]: out[classes[1]] - out[classes[0]]}
        return out


class ModelCompletion(Attack):
    name = "label-completion"
    title = "label inference by passive model completion (self-training)"
    reference = "Fu et al. 2022 (USENIX Security) §4.2"
    adversaries = ("guest",)
    metric = "accuracy"
    baseline_name = "majority rate (the known labels' most frequent class)"
    defaults = {"known_labels": 4, "attack_epochs": 200, "attack_lr": 1e-3, "attack_hidden": 64}

    def check(self, referee, plan, opts: AttackOptions) -> None:
        if plan.metric != "accuracy":
            raise ConfigError("attack", "label-completion", "a classification dataset",
                              reason=f"{plan.cfg.dataset} is a recommendation task")

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("known-labels", per_class=self.option(opts, "known_labels"))]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"{opts.guest} with its own trained bottom model and data, plus the labels of "
                f"{self.option(opts, 'known_labels')} training records per class")

    def run(self, view, opts: AttackOptions) -> Guess:
        me = view.me
        dev = view.device
        bottom = me.bottom
        was = bottom.training
        bottom.eval()
        try:
            with torch.no_grad():
                x = me.data.x_train
                emb = torch.cat([bottom(x[i: i + 1024].to(dev)).reshape(len(x[i: i + 1024]), -1).cpu()
                                 for i in range(0, len(x), 1024)])
        finally:
            bottom.train(was)
        known = view.aux.known_labels
        is_known = np.zeros(len(emb), dtype=bool)
        is_known[known.positions] = True
        targets = np.flatnonzero(~is_known)
        proba, pseudo = self._complete(view, opts, "completion", emb, known, is_known)
        # the same completion on the guest's raw inputs: what its own columns reveal about the
        # labels without any training signal from the host (Fu et al.'s leak is the difference)
        raw = me.data.x_train.reshape(len(me.data.x_train), -1).float()
        raw_proba, _ = self._complete(view, opts, "completion-raw", raw, known, is_known)
        values, counts = np.unique(known.values, return_counts=True)
        return Guess("train", targets, proba.argmax(dim=1).numpy()[targets],
                     np.full(len(targets), values[np.argmax(counts)]),
                     {"known_records": int(is_known.sum()), "pseudo_labelled_per_round": pseudo,
                      "semi_supervised": "self-training (Fu et al. use MixMatch)",
                      "raw_predictions": raw_proba.argmax(dim=1).numpy()[targets]})

    def _complete(self, view, opts: AttackOptions, purpose: str, emb: torch.Tensor, known, is_known: np.ndarray):
        """Self-training of a classifier on ``emb`` from the known labels; returns its probabilities
        for every record and the number of pseudo-labels added per round."""
        labels = np.full(len(emb), -1, dtype=np.int64)
        labels[known.positions] = known.values
        epochs = self.option(opts, "attack_epochs")
        # a few labels: no validation split (early stopping would waste a fifth of them)
        hp = dict(hidden=self.option(opts, "attack_hidden"), lr=self.option(opts, "attack_lr"),
                  num_classes=int(view.plan.num_outputs), batch_size=32, validation=0.0)
        use = is_known.copy()
        pseudo = []
        for r in range(PSEUDO_ROUNDS + 1):
            # every round takes about as many optimizer steps as the first (epochs scaled to the set size)
            n_epochs = max(min(epochs, 30), round(epochs * is_known.sum() / use.sum()))
            predict = train_classifier(view, f"{purpose}-{r}", emb[use], labels[use], epochs=n_epochs, **hp)
            proba = predict(emb).cpu()
            if r == PSEUDO_ROUNDS:
                break
            conf, pred = proba.max(dim=1)
            add = (~is_known) & (conf.numpy() >= PSEUDO_CONFIDENCE)
            labels = np.where(is_known, labels, np.where(add, pred.numpy(), -1))
            use = is_known | add
            pseudo.append(int(add.sum()))
        return proba, pseudo

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        y = referee.labels("train", guess.positions)
        raw = guess.details.pop("raw_predictions")
        return Scored(accuracy(guess.values, y), accuracy(guess.baseline, y), {"raw_input_accuracy": accuracy(raw, y)})
