"""``--merge sum|avg --secure-merge`` in the local engine: the host's sum, the message transcript, the
gradients, the refusals and a guest failing mid-run (docs/threat-model.md, "Secure merge")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fl_split.config import RunConfig
from fl_split.engine import GuestFailure, LocalEngine
from fl_split.errors import ConfigError
from fl_split.privacy import secure_merge as sm
from fl_split.protocol import open_message
from fl_split.schedule import BatchKey
from fl_split.seeding import PrivateSeed

PS = PrivateSeed.legacy(17)


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=3, merge="sum", epochs=1, batch_size=64, limit=300, progress=False,
                host_features=False, secure_merge=True, seed=3)
    base.update(kw)
    return RunConfig(**base)


class Recorder:
    """Wraps the local transport and keeps every message each party receives, as tensors."""

    def __init__(self, inner) -> None:
        self.inner, self.guests = inner, inner.guests
        self.to_host: list[dict[str, list[torch.Tensor]]] = []
        self.to_guests: list[dict[str, list[torch.Tensor]]] = []
        self.announcements: dict[str, list[bytes]] = {}

    def guest_step(self, owed, keys, round_):
        self.to_guests.append({g: [open_message(b).tensor.clone() for b in bl] for g, bl in owed.items()})
        return self.inner.guest_step(owed, keys, round_)

    def host_train(self, keys, acts, round_):
        self.to_host.append({g: [open_message(b).tensor.clone() for b in bl] for g, bl in acts.items()})
        return self.inner.host_train(keys, acts, round_)

    def secure_rekey(self, members):
        def relay(g, ann):
            self.announcements[g] = list(ann)
            return ann

        sm.rekey(self.inner.parties, members, relay=relay)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_hosts_sum_equals_the_plain_sum_to_fixed_point_precision():
    """No noise (--defense none): the host's decoded sum of the masked frames equals Σ_g bottom_g(x_g)
    within G·c/(2B) (c = 10, B = 2^10), for training and test batches, through real frames (codec)."""
    eng = LocalEngine(_cfg(), PS, codec=True)
    sm.rekey(eng.guests, list(eng.guests))
    clip, scale = eng.host.secure_merge
    for key in (BatchKey("train", 1, 0), BatchKey("test", 1, 0)):
        frames = {g: p.release([key], 1) for g, p in eng.guests.items()}
        got = sm.decode(torch.from_numpy(sm.unmask_sum([open_message(f[0]).tensor for f in frames.values()])),
                        clip, scale)
        with torch.no_grad():
            plain = sum(p.bottom(p.rows(key)) for p in eng.guests.values())
        assert plain.abs().max() < clip  # inside the clip: only rounding separates them
        err = (got - plain).abs().max().item()
        assert err <= 3 * clip / (2 * scale) + 1e-5, err
        assert err > 0  # the fixed point is really in the path


def test_transcript_no_single_view_holds_a_guests_release():
    """Every message each party receives in a run with distributed noise (σ = 0.7, k = 0): the host's
    view of each guest is uniform on the ring and uncorrelated with that guest's true release (its
    fixed point + noise share), equal to the truth only in the sum over guests; the guests receive the
    peers' signed public keys and one gradient, the same for every guest (∂L/∂h_g = ∂L/∂Σh)."""
    truth: dict[str, list[torch.Tensor]] = {}
    cfg = _cfg(defense="gaussian", sigma=0.7, secure_merge_collusion="0", epochs=1)
    holder = {}
    eng = LocalEngine(cfg, PS, transport=lambda t: holder.setdefault("rec", Recorder(t)))
    for g, party in eng.guests.items():
        mech = party.mechanisms()
        real = mech.release

        def spy(t, gen, real=real, g=g):
            rel = real(t, gen)
            truth.setdefault(g, []).append(rel.value.detach().clone())
            return rel

        mech.release = spy
    res = eng.run()
    rec = holder["rec"]
    assert res["stopped_reason"] == "completed"
    views = {g: torch.cat([r[g][0] for r in rec.to_host]).reshape(-1).double().numpy() for g in eng.guests}
    true = {g: torch.cat(truth[g][:len(rec.to_host)]).reshape(-1).numpy() for g in eng.guests}
    n = len(views["guest-1"])
    assert n > 5000
    for g in eng.guests:
        counts = np.bincount((views[g].astype(np.int64) >> (sm.RING_BITS - 5)), minlength=32)
        chi2 = float(((counts - n / 32) ** 2 / (n / 32)).sum())
        assert chi2 < 80, (g, chi2)  # 31 d.o.f.: P(chi2 > 80) < 1e-5 for a uniform view
        assert abs(np.corrcoef(views[g], true[g])[0, 1]) < 5 / math.sqrt(n)
        assert not np.array_equal(sm.centred(views[g].astype(np.int64)), true[g].astype(np.int64))
    total = sm.centred(sm.to_ring(sum(v.astype(np.int64) for v in views.values())))
    assert np.array_equal(total, sum(t.astype(np.int64) for t in true.values()))
    # the guests' views: signed announcements (public keys only) and identical gradients
    for g, ann in rec.announcements.items():
        assert sorted(sm.KeyAnnouncement.from_bytes(a).guest for a in ann) == sorted(eng.guests)
    for owed in rec.to_guests[1:]:
        grads = [owed[g][0] for g in eng.guests]
        assert all(torch.equal(grads[0], x) for x in grads[1:])
    # the report states the assumption: k and the honest shares
    mech = res["parties"]["guest-1"]["mechanism"]
    assert (mech["name"], mech["collusion"], mech["honest_shares"]) == ("skellam-share", 0, 3)
    said = res["privacy"]["guest-1"]["assumptions"]
    assert any("colludes with at most k = 0 of the other guests" in a and "3 honest shares" in a for a in said)


def test_collusion_all_charges_the_same_epsilon_as_each_guest_noising_alone():
    """k = G − 1 (the default): each guest adds the whole σ², and its ε is the local Gaussian's (the
    Skellam upper bound within 0.1%)."""
    sec = LocalEngine(_cfg(defense="gaussian", sigma=4.0, batch_size=150), PS).run()
    loc = LocalEngine(_cfg(defense="gaussian", sigma=4.0, batch_size=150, secure_merge=False), PS).run()
    for g in ("guest-1", "guest-2", "guest-3"):
        e_sec, e_loc = sec["privacy"][g]["epsilon"], loc["privacy"][g]["epsilon"]
        assert e_loc <= e_sec <= e_loc * 1.001, (e_sec, e_loc)
    assert sec["parties"]["guest-1"]["mechanism"]["collusion"] == 2


@pytest.mark.parametrize("kw, key, why", [
    (dict(merge="concat"), "merge", "the host unmasks only the guests' sum"),
    (dict(merge="max"), "merge", "need each guest's own part"),
    (dict(merge="mul"), "merge", "allowed: sum or avg"),
    (dict(defense="laplace"), "defense", "another mechanism would noise each guest's part"),
    (dict(defense="r3elu"), "defense", "allowed: gaussian or none"),
    (dict(guests=1), "guests", "the sum of one guest is that guest's release"),
    (dict(loss_alarm=True), "loss-alarm", "zero-fills one guest at a time"),
    (dict(one_shot=True), "one-shot", "caches each guest's own release"),
    (dict(secure_merge_collusion="3"), "secure-merge-collusion", "at most the G - 1 = 2 other guests"),
    (dict(defense="gaussian", accountant="rdp"), "accountant", "accounted from their exact distribution"),
])
def test_bad_combinations_are_one_line(kw, key, why):
    with pytest.raises(ConfigError) as err:
        _cfg(**kw)
    text = str(err.value)
    assert text.startswith(f"--{key}: got ") and why in text and "\n" not in text


class GuestDiesAt:
    def __init__(self, inner, guest: str, at: int) -> None:
        self.inner, self.guests = inner, inner.guests
        party = inner.parties[guest]
        real = party.step

        def step(owed, keys, round_, **kw):
            if round_ >= at:
                # it released, then died: its masked release never reaches the host
                real(owed, keys, round_, **kw)
                raise ConnectionError(f"{guest} is unreachable")
            return real(owed, keys, round_, **kw)

        party.step = step

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_failed_guest_is_padded_after_rekeying_and_the_redone_round_is_charged():
    cfg = _cfg(defense="gaussian", sigma=4.0, on_guest_failure="pad", merge="avg")
    full = LocalEngine(cfg, PS).run()
    res = LocalEngine(cfg, PS, transport=lambda t: GuestDiesAt(t, "guest-2", 2)).run()
    assert res["stopped_reason"] == "completed"
    assert [(f["guest"], f["round"], f["action"]) for f in res["guest_failures"]] == [("guest-2", 2, "pad")]
    # guests 1 and 3 released round 2's batch (64 records) twice: the first masked with guest-2's masks,
    # never opened, and charged all the same
    for g in ("guest-1", "guest-3"):
        assert res["privacy"][g]["releases"] == full["privacy"][g]["releases"] + 64
        assert res["privacy"][g]["epsilon"] > full["privacy"][g]["epsilon"]
    assert 0.0 < res["final"]["value"] <= 1.0


def test_a_failed_guest_stops_the_run_with_one_line():
    cfg = _cfg(defense="gaussian", sigma=4.0)
    with pytest.raises(GuestFailure, match=r"^guest-2 failed in round 2: ConnectionError: guest-2 is unreachable$"):
        LocalEngine(cfg, PS, transport=lambda t: GuestDiesAt(t, "guest-2", 2)).run()


def test_a_resumed_run_rekeys_and_charges_the_remade_round(tmp_path):
    """The guests released round 5 (epoch 1's test batch, 60 records), then the process died before the
    host used it. The resumed run agrees on a new session; the round's releases are re-made under new
    masks (never the logged bytes), so each is a new release and charged: 60 more records released."""
    from tests.test_checkpoint import Crash, CrashAfterGuests

    cfg = _cfg(defense="gaussian", sigma=4.0, epochs=2, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    full = LocalEngine(cfg.replace(checkpoint_dir=""), PS).run()
    with pytest.raises(Crash):
        LocalEngine(cfg, PS, transport=lambda t: CrashAfterGuests(t, 5)).run()
    res = LocalEngine(cfg.replace(resume=True), PS).run()
    assert res["stopped_reason"] == "completed" and len(res["history"]) == 2
    for g in ("guest-1", "guest-2", "guest-3"):
        assert res["privacy"][g]["releases"] == full["privacy"][g]["releases"] + 60
        assert res["privacy"][g]["epsilon"] > full["privacy"][g]["epsilon"]


def test_a_share_never_leaves_unmasked():
    """A guest built with the secure merge's mechanism but no session (no key agreement ran) refuses to
    release: its share is charged against the honest shares' sum, so alone it would be under-accounted."""
    from fl_split.errors import ProtocolError

    eng = LocalEngine(_cfg(defense="gaussian", sigma=4.0, secure_merge_collusion="0"), PS)
    guest = eng.guests["guest-1"]
    with pytest.raises(ProtocolError, match="before the key agreement"):
        guest.release([BatchKey("train", 1, 0)], 1)
    guest.secure_identity = None  # as a process that never pinned the roster
    with pytest.raises(ProtocolError, match="before the key agreement"):
        guest.release([BatchKey("train", 1, 1)], 2)
    assert len(guest.ledger) == 0 and guest.released["batches"] == 0  # nothing charged, nothing left


def test_the_avg_merge_feeds_the_top_the_mean_of_the_guests_outputs():
    """--merge avg: what the host's top receives from the masked releases is (Σ_g h_g)/G, to the fixed
    point's precision (G·c/(2B)/G per element), the same input as a plain avg merge."""
    eng = LocalEngine(_cfg(merge="avg"), PS)
    sm.rekey(eng.guests, list(eng.guests))
    key = BatchKey("train", 1, 0)
    acts = {g: open_message(p.release([key], 1, in_process=True)[0]).tensor for g, p in eng.guests.items()}
    seen = []
    top = eng.host.top
    eng.host.top = lambda z: seen.append(z.detach().clone()) or top(z)
    with torch.no_grad():
        eng.host._forward(key, acts, train=False)
        plain = sum(p.bottom(p.rows(key)) for p in eng.guests.values()) / 3
    clip, scale = eng.host.secure_merge
    assert (seen[0] - plain).abs().max().item() <= clip / (2 * scale) + 1e-5
