"""Property inference, both directions (001 §2.3, Eq. 1; 001 Tables 4–5).

``A_PIA = argmin_F Σ_i L_F(F(T(x_i)), l_i)``, ``l_i ∈ {0, 1}``: the adversary trains an inference
model ``F`` on what it observes of the other party's records, ``T(x_i)``, labelled with a binary
property ``l_i`` of that party's data, for the records where it knows the property (its labelled
auxiliary data), and predicts the property of the other records.

* **host → guest**: ``T(x_i)`` is guest ``g``'s released cut-layer output for record ``i`` (what the
  host received: perturbed under ``--protect guest``);
* **guest → host**: ``T(x_i)`` is the partial loss the host released to the guest for record
  ``i`` (perturbed under ``--protect host``): it carries the host's label and features through
  the top model.

``F`` is an MLP (one hidden layer, standardised inputs, Adam, cross-entropy, early stopping on a
held-out fifth) trained on the ``--aux-fraction`` of the training records whose property the threat
model grants; the metric is
its accuracy on the remaining training records, against the **majority rate** (always guessing
the property value most frequent in the auxiliary part). ``--attack-epoch`` picks the epoch whose
messages form ``T(x_i)``: ``all`` concatenates a record's messages of every epoch; by default the
host uses the last epoch's release and a guest all its partial losses.
"""

from __future__ import annotations

import numpy as np

from fl_split.attacks.base import Attack, Guess, Scored, observed
from fl_split.attacks.common import train_classifier
from fl_split.attacks.metrics import accuracy
from fl_split.attacks.options import AUTO, AttackOptions
from fl_split.attacks.view import Grant
from fl_split.errors import ConfigError


class PropertyInference(Attack):
    name = "property"
    title = "property inference"
    reference = "Mao et al. (001) §2.3 Eq. 1, Tables 4-5"
    adversaries = ("host", "guest")
    metric = "accuracy"
    baseline_name = "majority rate (the auxiliary part's most frequent property value)"
    defaults = {"attack_epochs": 200, "attack_lr": 1e-3, "attack_hidden": 64}

    def property_name(self, referee, opts: AttackOptions) -> str:
        _, victim = self.parties(opts)
        return referee.default_property(victim) if opts.property == AUTO else opts.property

    def check(self, referee, plan, opts: AttackOptions) -> None:
        adversary, victim = self.parties(opts)
        if adversary != "host" and plan.cfg.one_shot:
            raise ConfigError("one-shot", True, "false for a guest's property inference",
                              reason="one-shot guests receive no gradients")
        referee.check_property(self.property_name(referee, opts), victim)

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        _, victim = self.parties(opts)
        return [Grant("property-labels", victim=victim, fraction=opts.aux_fraction,
                      prop=self.property_name(referee, opts))]

    def epoch(self, opts: AttackOptions, role: str):
        """``--attack-epoch``; ``auto``: the last epoch's releases for the host (the trained
        embedding), every epoch's gradients for a guest (each epoch's partial loss is a fresh, weak
        signal: stacking them measured 0.77 vs 0.67 accuracy on digits' patch-ink)."""
        if opts.attack_epoch == AUTO:
            return "last" if role == "host" else "all"
        return opts.attack_epoch

    def threat_summary(self, opts: AttackOptions) -> str:
        adversary, victim = self.parties(opts)
        seen = "the releases it received from " + victim if adversary == "host" else "the partial losses the host sent it"
        return (f"honest-but-curious {adversary}: {seen}, plus the property of {opts.aux_fraction:.0%} of the "
                f"training records")

    def run(self, view, opts: AttackOptions) -> Guess:
        aux = view.aux.property_labels
        if view.role == "host":
            obs = observed(view, "activations", opts.guest, self.epoch(opts, "host"))
        else:
            obs = observed(view, "gradients", "host", self.epoch(opts, "guest"))
        known = np.isin(obs.positions, aux.positions)
        train, targets = obs.subset(known), obs.subset(~known)
        labels = aux.values[np.searchsorted(aux.positions, train.positions)]
        predict = train_classifier(view, "property", train.values, labels, hidden=self.option(opts, "attack_hidden"),
                                   epochs=self.option(opts, "attack_epochs"), lr=self.option(opts, "attack_lr"),
                                   num_classes=2)
        pred = predict(targets.values).argmax(dim=1).cpu().numpy()
        values, counts = np.unique(aux.values, return_counts=True)
        trivial = np.full(len(targets), values[np.argmax(counts)])
        return Guess("train", targets.positions, pred, trivial,
                     {"property": view.aux.property_name, "auxiliary_records": int(len(train)),
                      "target_records": int(len(targets)), "input_width": int(train.values.shape[1]),
                      "auxiliary_positive_rate": float(np.mean(aux.values)),
                      "train_accuracy": float(accuracy(predict(train.values).argmax(dim=1).cpu().numpy(), labels))})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        _, victim = self.parties(opts)
        truth = referee.property(guess.details["property"], victim, "train", guess.positions)
        return Scored(accuracy(guess.values, truth), accuracy(guess.baseline, truth),
                      {"target_positive_rate": float(truth.mean())})

