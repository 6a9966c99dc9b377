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
