"""Plumbing of experiments/exp9_secure_merge_attacks.py: under the secure merge the host's decoder reads
the ring sum of every guest's masked release (recomputed here independently, mod 2^24), never guest-1's
part; without it, the ``sum`` feed is the float sum of the releases and the ``release`` feed guest-1's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments import exp9_secure_merge_attacks as E
from experiments.exp9_secure_merge import ARMS, BASE

TINY = {**BASE, "limit": 120, "epochs": 1, "guests": 2, "sigma": 0.25}


def _view(arm: str):
    from fl_split.attacks.reconstruction import Reconstruction
    from fl_split.attacks.options import AttackOptions

    s = E.session(0, **{**TINY, **ARMS[arm]})
    s.run()
    o = AttackOptions(attack="reconstruction")
    return s, s.view("host", Reconstruction().grants(s.referee, o))


def test_secure_feed_is_the_ring_sum_never_guest_1s_part():
    from fl_split.privacy.factory import fixed_point_of
    from fl_split.privacy.secure_merge import RING

    s, view = _view("secure")
    fed = E.HostSumView(view, "guest-1").records("activations", peer="guest-1")
    parts = [view.records("activations", peer=g) for g in ("guest-1", "guest-2")]
    assert np.array_equal(fed.positions, parts[0].positions)
    # independent recomputation: masked float32 ring elements, summed mod 2^24, centred, divided by the scale
    ring = sum(p.values.double().numpy().astype(np.int64) for p in parts) % RING
    centred = np.where(ring >= RING // 2, ring - RING, ring)
    _, scale = fixed_point_of(s.cfg)
    assert torch.allclose(fed.values.double(), torch.from_numpy(centred / scale), atol=1e-6)
    # guest-1's part alone is masked ring elements: nothing like the decoded sum (|sum| ≲ 2 + noise)
    assert fed.values.abs().max() < 10
    assert parts[0].values.abs().max() > 1e5
    own = torch.from_numpy(np.where(parts[0].values.double().numpy() >= RING // 2,
                                    parts[0].values.double().numpy() - RING, parts[0].values.double().numpy()) / scale)
    assert not torch.allclose(fed.values.double(), own, atol=1.0)


def test_local_feeds_release_or_float_sum_and_leaves_other_records_alone():
    _, view = _view("local")
    g1, g2 = (view.records("activations", peer=g) for g in ("guest-1", "guest-2"))
    wrapped = E.HostSumView(view, "guest-1")
    assert torch.equal(wrapped.records("activations", peer="guest-1").values, g1.values + g2.values)
    assert torch.equal(wrapped.records("activations", peer="guest-2").values, g2.values)  # not the victim
    with pytest.raises(Exception):  # a feed that names no victim's activations is refused by the inner view
        wrapped.records("no-such-kind", peer="guest-1")


def _spy(monkeypatch, module, name):
    """Wrap ``module.name`` so that every value it returns is kept in the returned list."""
    seen, inner = [], getattr(module, name)

    def wrapper(*a, **kw):
        out = inner(*a, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(module, name, wrapper)
    return seen


def test_secure_arms_feed_the_new_attacks_the_decoded_sum():
    """In both secure arms, what the property and the feature (GRN) attacks read as guest-1's releases is
    the host's decoded ring sum (``host_sum``), never guest-1's own masked part."""
    assert all(feed == "sum" for arm, (train, feed) in E.ATTACK_ARMS.items() if train.startswith("secure"))
    assert E.ATTACK_ARMS["alone"] == ("local", "release")
    import fl_split.attacks.feature as feature
    import fl_split.attacks.property as prop
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.property import PropertyInference

    # property: digits, the training epoch's records the classifier reads
    s, _ = _view("secure")
    with pytest.MonkeyPatch.context() as mp:
        read = _spy(mp, prop, "observed")
        r = E.property_arm(s, E.ATTACK_ARMS["secure-k0"][1], {"attack_epochs": 2})
    assert 0.0 <= r["attack_accuracy"] <= 1.0 and len(read) == 1
    view = s.view("host", PropertyInference().grants(s.referee, AttackOptions(attack="property")))
    total = E.host_sum(view, "train")
    own = view.records("activations", "train", peer="guest-1")
    assert np.array_equal(read[0].positions, total.positions)
    assert torch.equal(read[0].values, total.values.reshape(len(total), -1))
    assert not torch.allclose(read[0].values, own.select(total.positions).values.reshape(len(total), -1), atol=1.0)

    # feature (GRN): credit with host features, the test records' releases the generator is fitted to
    s = E.session(0, attack="feature", **{**TINY, **E.SETTING["feature"], "limit": 300, **ARMS["secure"]})
    s.run()
    forwards = []

    class Spy(feature.HostForward):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            forwards.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(feature, "HostForward", Spy)
        r = E.feature_arm(s, E.ATTACK_ARMS["secure-kall"][1], {"attack_epochs": 2})
    assert r["attack_mse"] < 1.0 and len(forwards) == 1
    view = s.view("host", feature.FeatureInference().grants(s.referee, AttackOptions(attack="feature")))
    total = E.host_sum(view, "test")
    own = view.records("activations", "test", peer="guest-1").select(forwards[0].positions)
    fed = forwards[0].releases["guest-1"].cpu()
    assert np.array_equal(forwards[0].positions, total.positions)
    assert torch.equal(fed, total.values)
    assert fed.abs().max() < 10 and own.values.abs().max() > 1e5  # decoded sum vs masked ring elements
