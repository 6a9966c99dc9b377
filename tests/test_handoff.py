"""The in-process hot path (issue 18): parties in one process hand their released tensors over
(:class:`fl_split.protocol.Handoff`) instead of encoding, sending and decoding frames.

What must not change (``docs/design.md``, "The in-process hot path"): the training (losses,
metrics, final weights bit for bit), what is charged (every party's privacy report and ledger),
what is counted on the wire (the frames' sizes), the checks (the same refusals, with the same
error types and messages) and checkpoints (a run resumed on either path equals the uninterrupted
run). And the released object must be the sender's no more: a copy, on its own storage, with no
autograd history. ``LocalEngine(codec=True)`` is the wire path in one process, the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_split.builder import make_parties
from fl_split.config import RunConfig
from fl_split.engine import GuestFailure, LocalEngine, LocalTransport, run_experiment
from fl_split.errors import ProtocolError, ReleaseOutOfRange
from fl_split.protocol import Handoff, Message, blob_list, decode, encode, handoff, open_message, receive_expected
from fl_split.schedule import BatchKey
from fl_split.seeding import PrivateSeed

from tests.helpers import tampered

PS = PrivateSeed.legacy(23)
BASE = dict(dataset="digits", epochs=2, batch_size=32, limit=240, progress=False, seed=4)

#: (id, options): every defence, denoising, 1 and 3 guests, every merge op, K > 1, one-shot, DP-SGD
CASES = [
    ("none-1g", dict(guests=1)),
    ("none-3g", dict(guests=3)),
    *[(f"none-{m}", dict(guests=2, merge=m)) for m in ("sum", "avg", "max", "min", "mul")],
    ("laplace-both", dict(guests=2, defense="laplace", protect="both", epsilon=20.0)),
    ("gaussian-denoise-3g", dict(guests=3, defense="gaussian", sigma=0.7, denoise="scale", protect="both",
                                 denoise_side="both")),
    ("gaussian-mask", dict(guests=2, defense="gaussian", sigma=0.7, denoise="mask")),
    ("r3elu-1g", dict(guests=1, defense="r3elu", epsilon=20.0, protect="both")),
    ("r3elu-importance", dict(guests=2, defense="r3elu", epsilon=20.0, allocation="importance")),
    ("rr", dict(guests=2, defense="rr", epsilon=5.0, protect="guest")),
    ("dpsgd", dict(guests=2, defense="dpsgd", sigma=1.0, accountant="pld")),
    ("laplace-K3", dict(guests=2, defense="laplace", epsilon=20.0, batches_per_round=3)),
    ("one-shot", dict(guests=2, one_shot=True, pretrain_epochs=1, epochs=3)),
    ("one-shot-rr", dict(guests=2, one_shot=True, pretrain_epochs=1, epochs=3, defense="rr", epsilon=64.0,
                         accountant="basic")),
    ("no-host-features", dict(guests=2, host_features=False, merge="max")),
]


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{**BASE, **kw})


def _weights(engine: LocalEngine) -> dict[str, list[torch.Tensor]]:
    parties = {"host": engine.host, **engine.guests}
    return {n: [p.detach().clone() for m in party.update.modules for p in m.parameters()]
            for n, party in parties.items()}


def _comparable(res: dict) -> dict:
    """Everything a run reports but its clock."""
    out = dict(res)
    out["history"] = [{k: v for k, v in h.items() if k != "epoch_time_s"} for h in res["history"]]
    out.pop("time_s")
    return out


def _both(cfg: RunConfig):
    """The same run on the in-process path and on the wire path (same private seed)."""
    runs = {}
    for codec in (False, True):
        eng = LocalEngine(cfg, PS, codec=codec)
        res = eng.run()
        runs[codec] = (eng, res)
    return runs


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_in_process_equals_the_wire_bit_for_bit(kw):
    runs = _both(_cfg(**kw))
    (eng_h, res_h), (eng_c, res_c) = runs[False], runs[True]
    assert res_h["stopped_reason"] == "completed"
    # losses, metrics, wire counts (frame sizes), every party's report (privacy, released counts)
    assert _comparable(res_h) == _comparable(res_c)
    assert res_h["wire"]["bytes_to_host"] > 0
    for name, ws in _weights(eng_h).items():  # the same training, bit for bit
        for a, b in zip(ws, _weights(eng_c)[name]):
            assert torch.equal(a, b), name
    for name, party in {"host": eng_h.host, **eng_h.guests}.items():
        other = eng_c.host if name == "host" else eng_c.guests[name]
        assert party.released == other.released and party.draws == other.draws
        if party.ledger is not None:
            assert party.ledger.report() == other.ledger.report()
            assert len(party.ledger) == len(other.ledger) > 0


# -- the released object is the sender's no more ---------------------------------------------------------
def _parties(**kw):
    cfg = _cfg(guests=1, **kw)
    host, guests, plan = make_parties(cfg, PS)
    return host, guests["guest-1"], plan


@pytest.mark.parametrize("defense", ["none", "gaussian", "rr"])
def test_a_handoff_is_a_detached_copy(defense):
    kw = {"none": {}, "gaussian": dict(defense="gaussian", sigma=0.7, protect="both"),
          "rr": dict(defense="rr", epsilon=5.0)}[defense]
    host, guest, plan = _parties(**kw)
    key = BatchKey("train", 1, 0)
    (h,) = guest.step([], (key,), 1, in_process=True)
    assert type(h) is Handoff and h.tensor.dtype == torch.float32 and h.tensor.is_contiguous()
    assert not h.tensor.requires_grad and h.tensor.grad_fn is None
    out = guest._pending[key].out  # the guest's live graph of this batch
    assert out is not None and out.requires_grad
    assert h.tensor.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    for t in guest._pending[key].ctx.values():
        if isinstance(t, torch.Tensor):
            assert h.tensor.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    kept = out.detach().clone()
    (g,) = host.train((key,), {"guest-1": [h]}, 1, in_process=True)["guest-1"]
    assert out.grad_fn is not None and torch.equal(out.detach(), kept)  # the host's graph is its own
    assert all(p.grad is None for p in guest.bottom.parameters())  # no backward reached the guest
    leaf = h.tensor  # the host made it a leaf of its graph; the gradient it sends is a copy
    assert not g.tensor.requires_grad and g.tensor.untyped_storage().data_ptr() != leaf.grad.untyped_storage().data_ptr()
    # the message is the frame the wire path sends, byte for byte
    assert h.to_bytes() == encode(h) and len(h) == len(h.to_bytes())
    assert torch.equal(decode(h.to_bytes()).tensor, h.tensor)


def test_a_tensor_with_a_graph_never_lets_the_receiver_backprop_into_it():
    # a hostile party in the process hands over a tensor that is part of its own graph
    host, guest, plan = _parties()
    key = BatchKey("train", 1, 0)
    (h,) = guest.step([], (key,), 1, in_process=True)
    secret = torch.nn.Parameter(torch.ones(()))
    bad = Handoff(h.kind, h.sender, h.receiver, h.round, h.key, h.digest, h.tensor * secret, h.encoding)
    host.train((key,), {"guest-1": [bad]}, 1, in_process=True)
    assert secret.grad is None


def test_a_transport_hands_over_only_to_parties_it_holds():
    # the direct data plane's host: its guests are in other processes, so it sends frames
    host, guests, plan = make_parties(_cfg(guests=2), PS)
    key = BatchKey("train", 1, 0)
    acts = {g: p.step([], (key,), 1) for g, p in guests.items()}
    assert all(type(b) is bytes for bl in acts.values() for b in bl)  # the parties' default: frames
    grads = LocalTransport(host, {}).host_train((key,), acts, 1)
    assert set(grads) == set(guests) and all(type(b) is bytes for bl in grads.values() for b in bl)
    both = LocalTransport(host, guests)
    acts = both.guest_step(grads, (BatchKey("train", 1, 1),), 2)
    assert all(type(b) is Handoff for bl in acts.values() for b in bl)
    assert all(type(b) is Handoff for bl in both.host_train((BatchKey("train", 1, 1),), acts, 2).values() for b in bl)


def test_the_wire_refuses_a_handoff():
    m = handoff(Message("activations", "guest-1", "host", 1, BatchKey("train", 1, 0), 7, torch.zeros(2, 3)))
    with pytest.raises(ProtocolError, match="item 0 is Handoff, expected bytes"):
        blob_list([m])


def test_handoff_checks_what_encode_checks():
    key = BatchKey("train", 1, 0)
    with pytest.raises(ValueError, match="bits encoding needs a tensor of zeros and ones"):
        handoff(Message("activations", "guest-1", "host", 1, key, 7, torch.full((2, 3), 0.5), "bits"))
    with pytest.raises(ValueError, match=r"round -1 outside"):
        handoff(Message("activations", "guest-1", "host", -1, key, 7, torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="dimensions"):
        handoff(Message("activations", "guest-1", "host", 1, key, 7, torch.zeros(())))
    # what the frame decodes to: float32 (from float64), bits as exact 0.0 / 1.0
    for t, enc in ((torch.randn(3, 5, dtype=torch.float64), "float32"), (-torch.zeros(3, 9), "bits")):
        msg = Message("activations", "guest-1", "host", 1, key, 7, t, enc)
        got = handoff(msg).tensor
        want = decode(encode(msg)).tensor
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # same bits (no -0.0)
        assert len(handoff(msg)) == len(encode(msg))


def test_receive_expected_accepts_only_the_exact_message():
    key = BatchKey("train", 1, 0)
    h = handoff(Message("gradients", "host", "guest-1", 3, key, 7, torch.randn(4, 2)))
    want = dict(kind="gradients", sender="host", receiver="guest-1", round_=3, key=key, rows=4, sample_shape=(2,),
                digest=7)
    assert receive_expected(h, **want) is h
    for change in (dict(round_=2), dict(key=BatchKey("train", 1, 1)), dict(rows=5), dict(sample_shape=(3,)),
                   dict(digest=8), dict(kind="activations"), dict(receiver="guest-2")):
        assert receive_expected(h, **{**want, **change}) is None, change
    # a "bits" message holds zeros and ones, as every bits frame decodes to (else it could not be checkpointed)
    half = Handoff("gradients", "host", "guest-1", 3, key, 7, torch.full((4, 2), 0.5), "bits")
    assert receive_expected(half, **want) is None
    with pytest.raises(ProtocolError, match="malformed message: encoding 'bits' with values"):
        open_message(half)
    bits = Handoff("gradients", "host", "guest-1", 3, key, 7, torch.ones(4, 2), "bits")
    assert receive_expected(bits, **want) is bits
    nan = Handoff("gradients", "host", "guest-1", 3, key, 7, torch.full((4, 2), float("nan")))
    assert receive_expected(nan, **want) is None
    with pytest.raises(ProtocolError, match="contains NaN"):
        open_message(nan).check(kind="gradients", sender="host", receiver="guest-1", key=key, ids=np.arange(4),
                                sample_shape=(2,), digest=nan.digest, round_=3)


# -- the same refusals, with the same messages ---------------------------------------------------------------
def _wider(m):
    m.tensor = torch.cat([m.tensor, m.tensor[:, :1]], dim=1)


def _narrower(m):
    m.tensor = m.tensor[:, :-1].contiguous()


def _nan(m):
    m.tensor = m.tensor.clone()
    m.tensor[0, 0] = float("nan")


def _huge(m):
    m.tensor = m.tensor.clone()
    m.tensor[1, 2] = 1e10


def _scaled(m):
    m.tensor = m.tensor * 1000.0


def _stale(m):
    m.round -= 1


def _other_batch(m):
    m.key = BatchKey(m.key.phase, m.key.epoch, m.key.index + 1)


def _fewer_rows(m):
    m.tensor = m.tensor[:-1].contiguous()


TAMPER = {"wider": _wider, "narrower": _narrower, "nan": _nan, "huge": _huge, "scaled": _scaled, "stale": _stale,
          "other-batch": _other_batch, "fewer-rows": _fewer_rows}


class Tamper:
    """A transport in which guest-1 (``side="guest"``) or the host changes its messages of round 3."""

    def __init__(self, local, change, side: str) -> None:
        self.local, self.change, self.side, self.guests = local, change, side, local.guests

    def guest_step(self, owed, keys, round_):
        out = self.local.guest_step(owed, keys, round_)
        if self.side == "guest" and round_ == 3:
            out["guest-1"] = [tampered(b, self.change) for b in out["guest-1"]]
        return out

    def host_train(self, keys, acts, round_):
        grads = self.local.host_train(keys, acts, round_)
        if self.side == "host" and round_ == 3:
            grads = {g: [tampered(b, self.change) for b in bl] for g, bl in grads.items()}
        return grads

    def __getattr__(self, name):
        return getattr(self.local, name)


def _refusal(codec: bool, change, side: str):
    cfg = _cfg(guests=2, epochs=1, defense="gaussian", sigma=0.7, protect="both")
    eng = LocalEngine(cfg, PS, transport=lambda t: Tamper(t, change, side), codec=codec)
    with pytest.raises(Exception) as err:
        eng.run()
    charged = {n: p.ledger.report()["releases"] for n, p in {"host": eng.host, **eng.guests}.items()}
    return err.value, charged, eng.host.steps


@pytest.mark.parametrize("side", ["guest", "host"])
@pytest.mark.parametrize("what", list(TAMPER))
def test_the_same_checks_refuse_with_the_same_errors(what, side):
    hand, charged_h, steps_h = _refusal(False, TAMPER[what], side)
    wire, charged_c, steps_c = _refusal(True, TAMPER[what], side)
    assert type(hand) is type(wire) and str(hand) == str(wire)
    assert charged_h == charged_c and steps_h == steps_c  # refused at the same point: nothing more charged
    if what == "scaled":
        assert isinstance(hand, ReleaseOutOfRange)
    elif side == "guest":
        assert isinstance(hand, ProtocolError)
    else:
        assert isinstance(hand, GuestFailure) and "ProtocolError" in str(hand)  # the guest refused the host
    expected = {"wider": "oversized message", "narrower": "per-sample shape", "nan": "NaN or infinite",
                "huge": "values beyond", "scaled": "exceeds the public bound", "stale": "round",
                "other-batch": "", "fewer-rows": "rows for a batch"}[what]
    assert expected in str(hand)


# -- checkpoints: the log's digests are the frames' digests on either path --------------------------------------
class _Crash(BaseException):
    pass


class _CrashAfterGuests:
    def __init__(self, inner, at: int) -> None:
        self.inner, self.at, self.guests = inner, at, inner.guests

    def guest_step(self, owed, keys, round_):
        out = self.inner.guest_step(owed, keys, round_)
        if round_ == self.at:
            raise _Crash()
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("crashed_codec,resumed_codec", [(False, True), (True, False), (False, False)])
def test_a_run_crashed_on_one_path_resumes_on_the_other(tmp_path, crashed_codec, resumed_codec):
    kw = dict(guests=2, epochs=2, defense="laplace", protect="both", epsilon=50.0, checkpoint_every=4)
    ref = _comparable(run_experiment(_cfg(**kw), private_seed=PS))
    cfg = _cfg(**kw, checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(_Crash):
        LocalEngine(cfg, PS, transport=lambda t: _CrashAfterGuests(t, 10), codec=crashed_codec).run()
    res = LocalEngine(_cfg(**kw, checkpoint_dir=str(tmp_path / "ck"), resume=True), PS, codec=resumed_codec).run()
    # the releases made after the last checkpoint were re-made bit for bit and not charged again
    assert res["checkpoint"]["replayed"] and all(n == 0 for n in res["checkpoint"]["pending_replays"].values())
    got = _comparable(res)
    for k in ("wire", "privacy"):
        assert got[k] == ref[k], k
    # the epochs evaluated before the crash too; later draws carry the resume salt (issue 25: other,
    # independent noise), so later numbers are not compared
    done = res["checkpoint"]["resumed_from_round"] // (res["wire"]["rounds"] // len(res["history"]))
    assert got["history"][:done] == ref["history"][:done]


# -- on a GPU: the tensors stay there ---------------------------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_on_the_run_device_the_handoff_stays_there_and_equals_the_wire(device):
    cfg = _cfg(guests=2, device=device, defense="gaussian", sigma=0.7, protect="both")
    host, guests, plan = make_parties(cfg, PS)
    key = BatchKey("train", 1, 0)
    (h,) = guests["guest-1"].step([], (key,), 1, in_process=True)
    assert h.tensor.device.type == device  # no copy to the host
    (g,) = host.train((key,), {"guest-1": [h], "guest-2": guests["guest-2"].step([], (key,), 1, in_process=True)},
                      1, in_process=True)["guest-1"]
    assert g.tensor.device.type == device
    runs = _both(cfg)
    assert _comparable(runs[False][1]) == _comparable(runs[True][1])
