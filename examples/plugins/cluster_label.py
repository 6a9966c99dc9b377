"""A plug-in attack: clustering label inference from the gradients a guest receives
(docs/plugins.md, worked example 2).

Liu & Lyu (2022), "Clustering label inference attack against practical split learning",
arXiv:2203.05222: in split learning the gradients a passive party receives for records of the same
class are close in direction, so the party clusters them (k-means on the unit gradients: cosine
distance) into as many clusters as there are classes. fl_split ships Li et al.'s norm and direction
scoring (``label-norm``, ``label-direction``), not this one.

Which cluster is which class the paper reads off the labels it knows; here the adversary is granted
``--known-labels`` labelled records per class (as ``label-direction``), names each cluster by the
majority of the known records in it (a cluster with none: the class the known records name least),
and guesses the label of every other training record of the epoch. Metric: accuracy against the
majority rate of the known labels. The adversary sees only its own party's view (its inbox of
partial losses from the host and the granted labels), like the built-in attacks.

    PYTHONPATH=$PWD/examples/plugins fl-split attack --dataset credit --attack cluster_label:ClusterLabelInference
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fl_split.attacks.base import Attack, Guess, Scored, observed_epoch
from fl_split.attacks.metrics import accuracy
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import Grant, NotObserved

#: Lloyd iterations and k-means++ restarts of the clustering
ITERATIONS = 50
RESTARTS = 4


def kmeans_cosine(x: torch.Tensor, k: int, rng: np.random.Generator) -> np.ndarray:
    """Spherical k-means (k-means++ seeding, cosine similarity) of the rows of ``x``; the labelling of
    the best of :data:`RESTARTS` runs (largest total similarity to the centres)."""
    u = F.normalize(x.double(), dim=1)
    n = len(u)
    best, best_score = None, -np.inf
    for _ in range(RESTARTS):
        centres = [u[int(rng.integers(n))]]
        for _ in range(1, k):
            d = (1 - torch.stack([u @ c for c in centres], dim=1).max(dim=1).values).clamp_min(0).cpu().numpy()
            p = d / d.sum() if d.sum() > 0 else np.full(n, 1.0 / n)
            centres.append(u[int(rng.choice(n, p=p))])
        c = torch.stack(centres)
        for _ in range(ITERATIONS):
            assign = (u @ c.T).argmax(dim=1)
            new = torch.stack([F.normalize(u[assign == j].sum(dim=0), dim=0) if (assign == j).any() else c[j]
                               for j in range(k)])
            if torch.allclose(new, c):
                break
            c = new
        sims = u @ c.T
        score = float(sims.max(dim=1).values.sum())
        if score > best_score:
            best, best_score = sims.argmax(dim=1).cpu().numpy(), score
    return best


class ClusterLabelInference(Attack):
    """Liu & Lyu (2022) clustering label inference by a guest (module docstring)."""

    name = "cluster-label"
    title = "label inference by clustering the received gradients"
    reference = "Liu & Lyu 2022 (arXiv:2203.05222)"
    adversaries = ("guest",)
    metric = "accuracy"
    baseline_name = "majority rate (the known labels' most frequent class)"
    defaults = {"known_labels": 4, "attack_epoch": "last"}

    def grants(self, referee, opts: AttackOptions) -> list[Grant]:
        return [Grant("known-labels", per_class=self.option(opts, "known_labels"))]

    def threat_summary(self, opts: AttackOptions) -> str:
        return (f"honest-but-curious {opts.guest}: the partial losses the host released to it, plus the labels of "
                f"{self.option(opts, 'known_labels')} training records per class")

    def run(self, view, opts: AttackOptions) -> Guess:
        epochs = view.epochs("gradients", "train", peer="host")
        if not epochs:
            raise NotObserved(f"{view.party} received no gradients")
        e = observed_epoch(opts, self)
        epoch = epochs[-1] if e in ("last", "all") else int(e)
        recs = view.records("gradients", "train", epoch, peer="host")
        g = recs.values.reshape(len(recs), -1).to(view.device)
        k = int(view.plan.num_outputs)
        clusters = kmeans_cosine(g, k, np.random.default_rng(20220310))
        known = view.aux.known_labels
        is_known = np.isin(recs.positions, known.positions)
        known_y = known.values[np.searchsorted(known.positions, recs.positions[is_known])]
        classes, counts = np.unique(known_y, return_counts=True)
        names = {}
        for j in range(k):
            ys = known_y[clusters[is_known] == j]
            if len(ys):
                v, c = np.unique(ys, return_counts=True)
                names[j] = int(v[np.argmax(c)])
            else:
                names[j] = int(classes[np.argmin(counts)])
        guess = np.array([names[int(j)] for j in clusters[~is_known]])
        return Guess("train", recs.positions[~is_known], guess,
                     np.full(int((~is_known).sum()), classes[np.argmax(counts)]),
                     {"epoch": epoch, "clusters": k, "known_records": int(is_known.sum())})

    def score(self, guess: Guess, referee, opts: AttackOptions) -> Scored:
        y = referee.labels("train", guess.positions)
        return Scored(accuracy(guess.values, y), accuracy(guess.baseline, y))
