"""The privacy guarantees hold against a receiver that knows everything public (issue 8).

* **Adversary tests**: the host (and the coordinator) know the public run seed, every party's
  name, every message header and the results JSON. Before issue 8 every generator was seeded
  from those, and the host could subtract the noise exactly. Here an attacker rebuilds each
  party's generators every way those public facts allow and predicts the release *given the
  true input* (an oracle no real attacker has, which only makes it stronger); its predicted noise
  must be uncorrelated with the released noise. With ``n`` independent pairs the sample
  correlation of independent noise is ≈ N(0, 1/n); we require ``|corr| < 5/√n`` (a false alarm
  has probability < 6e-7), while the pre-fix derivation gives ``corr = 1`` exactly.
* **Secrets**: two runs with the same ``--seed`` and no private seed release different values;
  with ``--private-seed`` they are identical; neither the private seed nor any secret appears in
  the results.
* **Wire audit**: every field of every message between parties and of every reply to the
  coordinator is on an allow-list, in both engines.
* **Record coupling**: BatchNorm is refused, by name, in a party that claims DP.
* **Aggregates only**: the host tells the coordinator per-epoch aggregates, or nothing.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fl_split.builder import _architecture, make_parties
from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.engine import AGGREGATES, LocalEngine, LocalTransport, coordinate
from fl_split.errors import ConfigError
from fl_split.models.registry import build_bottom
from fl_split.protocol import decode
from fl_split.schedule import BatchKey
from fl_split.seeding import PartySecret, PrivateSeed, derive_seed

BASE = dict(dataset="digits", guests=2, epochs=1, batch_size=32, lr=0.01, limit=300, progress=False, seed=11)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double().flatten(), b.detach().cpu().double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


def _all_keys(o) -> set:
    """Every dictionary key anywhere inside ``o``."""
    if isinstance(o, dict):
        return set(o).union(*(_all_keys(v) for v in o.values()))
    if isinstance(o, list):
        return set().union(*(_all_keys(v) for v in o))
    return set()


def _public_guesses(cfg: RunConfig, party: str, purpose: tuple, key: BatchKey,
                    device: torch.device) -> dict[str, torch.Generator]:
    """Every generator an attacker can build from public facts for ``party``'s draw ``purpose``
    on batch ``key``: the pre-issue-8 derivation (run seed, party, purpose, batch key), and a
    private secret guessed to be derived from the public seed or from small integers in the
    results (the seed, the round, the epoch). On ``device``, the party's (public: its report says
    it): a CPU generator cannot draw for CUDA tensors, and a guess on another device than the
    party's would draw another stream and pass for the wrong reason."""
    guesses: dict[str, torch.Generator] = {}
    old = torch.Generator(device=device)
    old.manual_seed(derive_seed(cfg.seed, party, *purpose, *key.as_tuple()))
    guesses["run seed (pre-issue-8 derivation)"] = old
    for s in {cfg.seed, 0, 1, key.epoch}:  # the old derivation and the --insecure-private-seed one
        for kind, seed in (("legacy", PrivateSeed.legacy(s)), ("insecure", PrivateSeed.insecure(s))):
            guessed = PartySecret.from_private_seed(seed, party)
            guesses[f"private seed guessed = {s} ({kind})"] = guessed.torch_generator(*purpose, *key.as_tuple(),
                                                                                      device=device)
            # the current derivation (issue 16): purpose and the party's draw counter (0: its first draw)
            guesses[f"private seed guessed = {s} ({kind}), draw counter 0"] = guessed.torch_generator(
                purpose[0], 0, device=device)
    return guesses


def _guest_release(cfg: RunConfig, key: BatchKey):
    """One guest's real release of ``key`` and what the attacker needs (the true input)."""
    host, guests, plan = make_parties(cfg)
    g = guests["guest-1"]
    with torch.no_grad():
        v = g.bottom(g.rows(key))
    blob = g.release([key], round_=1)[0]
    return g, v, decode(blob).tensor


@pytest.mark.parametrize("defense", ["laplace", "gaussian", "r3elu", "rr"])
def test_adversary_cannot_rebuild_the_guests_noise(defense):
    # R3eLU with K = N/2: half of every row is random (the kept entries), so the test has power
    cfg = RunConfig(**BASE, defense=defense, epsilon=50.0, sigma=0.7, top_k="half")
    key = BatchKey("train", 1, 0)
    g, v, released = _guest_release(cfg, key)
    mech = g.mechanisms(key)
    # R3eLU: only the K kept entries of each row are drawn (the rest are 0 in every release, real or
    # guessed: a shared support, not shared noise), so the noise is compared on those
    kept = torch.ones_like(v, dtype=torch.bool)
    if defense == "r3elu":  # ClipK's support: the top K of each row
        kept = torch.zeros_like(kept).scatter_(1, torch.topk(v, mech.k, dim=1).indices, True)
    n = int(kept.sum())
    bound = 5 / math.sqrt(n)
    dev = v.device  # the party's device (the run's: cuda on a GPU machine); compared on the CPU
    released, v_dev, v = released.cpu(), v, v.cpu()
    for name, gen in _public_guesses(cfg, "guest-1", ("release",), key, dev).items():
        predicted = mech.release(v_dev, gen).value.cpu()
        if defense in ("laplace", "gaussian"):
            signal = v.clamp(-mech.bound, mech.bound)
            noise, guess = released - signal, predicted - signal
        elif defense == "rr":  # the flips
            bits = (v > 0).float()
            noise, guess = (released != bits).float(), (predicted != bits).float()
        else:  # R3eLU: which elements came out non-zero (activation draw and Laplace sign)
            noise, guess = (released > 0).float(), (predicted > 0).float()
        c = _corr(noise[kept], guess[kept])
        assert abs(c) < bound, f"{defense}: attacker guess '{name}' correlates {c:.3f} with the noise (n={n})"
    # the same attack with the party's real secret (which only the party has) does reproduce it,
    # so the test would catch a derivation from public facts
    real = mech.release(v_dev, g.secret.torch_generator("release", 0, device=dev)).value  # its first draw
    torch.testing.assert_close(real.cpu(), released)


def test_adversary_cannot_rebuild_the_hosts_backward_noise():
    cfg = RunConfig(**BASE, defense="laplace", protect="host", epsilon=50.0)
    host, guests, plan = make_parties(cfg)
    key = BatchKey("train", 1, 0)
    acts = {gname: g.release([key], 1) for gname, g in guests.items()}
    grads = host.train([key], acts, 1)
    released = decode(grads["guest-1"][0]).tensor
    mech = host.backward_mechanisms["guest-1"](key)
    # the true partial loss has |δ| << C = 10 and b = 2Cd/ε: the release is noise up to a tiny
    # term, so the attacker's noise (its release of zeros) is compared with the release itself
    dev = host.device  # the attacker draws where the host drew (a CPU stream differs from a CUDA one)
    released = released.cpu()
    for name, gen in _public_guesses(cfg, "host", ("release", "guest-1"), key, dev).items():
        predicted = mech.release(torch.zeros_like(released, device=dev), gen).value.cpu()
        assert abs(_corr(released, predicted)) < 5 / math.sqrt(released.numel()), name


def test_adversary_cannot_rebuild_the_guests_initial_weights():
    cfg = RunConfig(**BASE)
    host, guests, plan = make_parties(cfg)
    actual = torch.cat([p.detach().flatten() for p in guests["guest-1"].bottom.parameters()])
    arch = _architecture(cfg)
    shape = plan.input_shapes["guest-1"]
    with torch.random.fork_rng(devices=[]):  # the pre-issue-8 initialisation from the run seed
        torch.manual_seed(derive_seed(cfg.seed, "init", "guest-1"))
        old = arch.bottom(shape, plan.cut, plan.guest_cut_activation)
    attempts = {"run seed": old,
                "private seed = run seed": build_bottom(arch, "guest-1", shape, plan.cut, plan.guest_cut_activation,
                                                        PartySecret.from_private_seed(PrivateSeed.legacy(cfg.seed),
                                                                                    "guest-1"))}
    for name, module in attempts.items():
        guess = torch.cat([p.detach().flatten() for p in module.parameters()])
        assert abs(_corr(actual, guess)) < 5 / math.sqrt(actual.numel()), name


def _releases(cfg, private_seed):
    host, guests, plan = make_parties(cfg, private_seed)
    key = BatchKey("train", 1, 0)
    return decode(guests["guest-1"].release([key], 1)[0]).tensor


@pytest.mark.parametrize("defense", ["laplace", "rr"])
def test_same_public_seed_different_releases_unless_private_seed(defense):
    cfg = RunConfig(**BASE, defense=defense, epsilon=50.0)
    assert not torch.equal(_releases(cfg, None), _releases(cfg, None))
    seed = PrivateSeed.parse("b3f64651848ad741488fe525731f6fb0")
    torch.testing.assert_close(_releases(cfg, seed), _releases(cfg, seed), rtol=0, atol=0)
    assert not torch.equal(_releases(cfg, seed), _releases(cfg, PrivateSeed.parse("17d6932e656b1401427583afefb062a0")))


@pytest.mark.parametrize("private_seed", [None, "987654321d4b7c0e93a5f1826c0bd7e4a"])
def test_results_hold_no_secret(tmp_path, private_seed):
    out = tmp_path / "r.json"
    args = ["train", "--dataset", "digits", "--guests", "2", "--epochs", "1", "--limit", "200", "--no-progress",
            "--defense", "laplace", "--epsilon", "50", "--out", str(out)]
    if private_seed is not None:
        args += ["--private-seed", str(private_seed)]
    assert main(args) == 0
    text = out.read_text()
    res = json.loads(text)
    source = "os-entropy" if private_seed is None else "private-seed"
    assert {rep["private_randomness"] for rep in res["privacy"].values()} == {source}
    assert not _all_keys(res) & {"private_seed", "private-seed", "secret", "key"}
    if private_seed is not None:
        assert str(private_seed) not in text
        for party in ("host", "guest-1", "guest-2"):
            secret = PartySecret.from_private_seed(private_seed, party)
            key = secret.state_dict()["key"]
            assert bytes(key).hex() not in text and str(secret.derive("release", 0)) not in text


# -- record coupling --------------------------------------------------------------------------------
def test_batchnorm_is_refused_by_name_under_a_defence():
    cfg = RunConfig(**BASE, model="mnist-mlp-bn", defense="laplace", epsilon=50.0)
    with pytest.raises(ConfigError) as exc:
        make_parties(cfg)
    text = str(exc.value)
    assert "--norm" in text and "BatchNorm1d" in text and "guest-1" in text and "mixes the records" in text
    # the host claims nothing under --protect guest: its BatchNorm is allowed; with --norm group all train
    res = LocalEngine(cfg.replace(norm="group")).run()
    assert math.isfinite(res["history"][-1]["train_loss"])
    with pytest.raises(ConfigError, match="host's"):
        make_parties(cfg.replace(protect="host"))
    with pytest.raises(ConfigError, match="DP-SGD"):
        make_parties(RunConfig(**BASE, model="mnist-mlp-bn", defense="dpsgd"))


def test_batchnorm_couples_records_which_is_why():
    """The measured reason: with BatchNorm in training mode, changing record 0 moves the other rows."""
    cfg = RunConfig(**BASE, model="mnist-mlp-bn")
    host, guests, plan = make_parties(cfg, private_seed=PrivateSeed.legacy(1))
    bottom = guests["guest-1"].bottom.train()
    x = guests["guest-1"].rows(BatchKey("train", 1, 0))
    x2 = x.clone()
    x2[0] += 1.0
    with torch.no_grad():
        moved = (bottom(x2)[1:] - bottom(x)[1:]).abs().max()
    assert moved > 1e-3
    cfg_group = cfg.replace(norm="group")
    host, guests, plan = make_parties(cfg_group, private_seed=PrivateSeed.legacy(1))
    bottom = guests["guest-1"].bottom.train()
    with torch.no_grad():
        assert torch.equal(bottom(x2)[1:], bottom(x)[1:])


# -- aggregates only --------------------------------------------------------------------------------
def test_host_tells_the_coordinator_epoch_aggregates_only(tmp_path):
    cfg = RunConfig(**{**BASE, "epochs": 2})
    res = LocalEngine(cfg, private_seed=PrivateSeed.legacy(3)).run()
    assert [set(h) for h in res["history"]] == [{"epoch", *AGGREGATES, "epoch_time_s"}] * 2
    assert any("aggregate metrics released to the coordinator" in a for a in res["privacy"]["host"]["assumptions"])
    metrics = tmp_path / "host.json"
    kept = LocalEngine(cfg.replace(report_metrics="none", host_metrics=str(metrics)), private_seed=PrivateSeed.legacy(3)).run()
    assert [h["test_metric"] for h in kept["history"]] == [None, None]
    assert kept["final"]["value"] is None and kept["final"]["kept_by_host"] == str(metrics)
    own = json.loads(metrics.read_text())["history"]
    assert [h["test_metric"] for h in own] == [h["test_metric"] for h in res["history"]]
    assert not any("aggregate metrics released" in a for a in kept["privacy"]["host"]["assumptions"])
    with pytest.raises(ConfigError, match="--host-metrics"):
        make_parties(RunConfig(**BASE, report_metrics="none"))


# -- wire audit -------------------------------------------------------------------------------------
EVAL_KEYS = {"epoch", *AGGREGATES}
#: ``device`` / ``accelerator``: where the party's tensors live (``cpu``, ``cuda:0``; the GPU's name and the
#: GPU IDs Ray assigned) — facts about its machine, nothing derived from data (issue 10)
#: ``quality``: the host's verdict on the run against references it fitted on its own data (docs/threat-model.md,
#: "Label agreement and the host's own baseline"): test-set aggregates like the metrics it declares, and with
#: ``--report-metrics none`` the status and the epoch only
REPORT_KEYS = {"role", "optimizer_steps", "mechanism", "mechanisms", "postprocess", "released", "privacy",
               "device", "accelerator", "allocation", "quality"}
#: an R3eLU importance allocation is a charged release (issue 16): the released shares and the noise
#: scales they imply are public, nothing else
ALLOCATION_KEYS = {"name", "epsilon", "width", "sensitivity_l1", "noise_scale", "grid", "sampler", "signal_free",
                   "refresh", "releases", "last_shares", "last_noise_scales"}
#: ``epsilon_by_epoch``: the ledger's epsilon after each epoch, a function of the public parameters and
#: release counts as the final epsilon is (issue 17)
PRIVACY_KEYS = {"mechanism", "private_randomness", "release_diagnostics", "releases", "batches",
                "releases_per_record", "delta", "epsilon", "accountant", "epsilons", "budget", "amplification",
                "assumptions", "mechanisms", "by_direction", "pld_interval", "neighbouring_relation",
                "training_steps", "epsilon_by_epoch"}
#: public diagnostics: parameter-derived only (randomized response's exact SNR and keep probability are
#: functions of epsilon and the width, so public too)
DIAGNOSTIC_KEYS = {"noise_scale", "noise_sd", "snr_bound", "snr", "keep_probability"}
#: keys that would carry values computed from private data
PRIVATE_KEYS = {"release_stats", "mean_active_fraction", "importance", "importance_values", "noise_scale_min",
                "noise_scale_max", "importance_active", "secret", "key", "private_seed"}


def _audit_blob(blob: bytes, seen: dict) -> None:
    """A message between parties is the fixed frame of fl_split.protocol and nothing else: kind,
    sender, receiver, round, batch key, shape, encoding and batch digest in the header (each at most
    a 5-byte varint), then the perturbed tensor; no per-sample IDs, no other field. An in-process
    hand-over (issue 18) holds those fields and its tensor only, and is audited as its frame."""
    from fl_split.protocol import Handoff

    if isinstance(blob, Handoff):
        assert set(vars(blob)) <= {"kind", "sender", "receiver", "round", "key", "digest", "tensor", "encoding",
                                   "_size", "_frame"}, vars(blob).keys()
        blob = blob.to_bytes()
    m = decode(blob)
    n, d = m.tensor.shape[0], math.prod(m.tensor.shape[1:])
    payload = n * ((d + 7) // 8 if m.encoding == "bits" else 4 * d)
    assert len(blob) - payload <= 3 + 7 * 5 + 5 * (m.tensor.dim() - 1) + 4
    assert m.tensor.dtype == torch.float32
    seen["blobs"] += 1


def _audit_report(rep: dict) -> None:
    assert set(rep) <= REPORT_KEYS, set(rep) - REPORT_KEYS
    assert set(rep.get("allocation", {})) <= ALLOCATION_KEYS
    priv = rep["privacy"]
    assert set(priv) <= PRIVACY_KEYS, set(priv) - PRIVACY_KEYS
    diag = priv["release_diagnostics"]
    assert set(diag) <= DIAGNOSTIC_KEYS, diag
    assert diag.get("snr", diag.get("snr_bound")) == diag.get("snr_bound")  # only where it is exact (RR)
    assert not _all_keys(rep) & PRIVATE_KEYS, _all_keys(rep) & PRIVATE_KEYS


class AuditTransport(LocalTransport):
    """Records every blob between parties and every reply to the coordinator."""

    def __init__(self, host, guests):
        super().__init__(host, guests)
        self.seen = {"blobs": 0, "replies": 0}

    def guest_step(self, owed, keys, round_):
        out = super().guest_step(owed, keys, round_)
        for blobs in out.values():
            for b in blobs:
                _audit_blob(b, self.seen)
        self.seen["replies"] += 1
        return out

    def host_train(self, keys, acts, round_):
        grads = super().host_train(keys, acts, round_)
        assert set(grads) == set(self.guests)
        for blobs in grads.values():
            for b in blobs:
                _audit_blob(b, self.seen)
        self.seen["replies"] += 1
        return grads

    def host_evaluate(self, keys, acts, round_):
        metrics = super().host_evaluate(keys, acts, round_)
        assert set(metrics) <= EVAL_KEYS and all(isinstance(v, (int, float)) for v in metrics.values())
        self.seen["replies"] += 1
        return metrics

    def reports(self):
        reps = super().reports()
        for rep in reps.values():
            _audit_report(rep)
        return reps


@pytest.mark.parametrize("defense", ["r3elu", "rr", "dpsgd"])
def test_wire_audit_local(defense):
    cfg = RunConfig(**BASE, defense=defense, protect="guest" if defense == "rr" else "both", epsilon=50.0,
                    allocation="importance" if defense == "r3elu" else "uniform")
    host, guests, plan = make_parties(cfg)
    t = AuditTransport(host, guests)
    coordinate(cfg, plan, t, "audit")
    assert t.seen["blobs"] > 0 and t.seen["replies"] > 0


# -- the same audit through Flower (the real ServerApp strategy and ClientApp handler) ------------
ROLE_KEYS = {"party", "role", "guest-index", "mode", "data-path"}
FACT_KEYS = {"dataset", "task", "metric", "n_train", "n_test", "input_shapes", "data_config", "num_classes"}
#: direct data plane (issue 10). The host's setup reply adds ``dataplane`` — the address its guests
#: reach it at (deployment: its configured ``dataplane-address``; simulation: empty, published per
#: epoch) and whether it uses TLS — and, in a simulation, ``capacity``: the CPUs/GPUs its Ray actor
#: reserved and each Ray node's totals. Network and machine facts every party must know anyway,
#: nothing derived from data. Every party's setup reply (direct) carries ``public-key``: the public
#: half of its data-plane key pair (issue 16; the private key stays on its node), and the host's
#: ``mtls``: whether it requires client certificates.
DATAPLANE_KEYS = {"address", "tls", "mtls", "public-key"}
CAPACITY_KEYS = {"num_cpus", "num_gpus", "nodes"}
#: the host's ``train.epoch`` reply: the epochs' history rows (the same per-epoch aggregates as
#: ``evaluate.host``, plus its own epoch times), the wire counts (bytes and messages of the protocol
#: blobs, as the coordinator counts them in relay mode), a guest failure (who, which round, the
#: error's text) and whether it stopped (budget: the refusing party's BudgetExceeded text and round)
OUTCOME_KEYS = {"history", "wire", "guest_failures", "stopped"}
WIRE_KEYS = {"bytes_to_host", "bytes_to_guests", "messages_to_host", "messages_to_guests", "rounds"}
#: a guest's ``train.epoch`` reply: how many steps it served and how many it refused (counts)
SERVED_KEYS = {"steps", "errors"}
#: the headers of data-plane frames: round and batch keys (public schedule); ERROR: the error's
#: type, text, party, round (and a BudgetExceeded's fields); END: why the session ended
FRAME_HEADER_KEYS = {"round", "keys", "type", "message", "party", "fields", "reason"}
#: ``--secure-merge`` with ``--on-guest-failure pad`` on the direct data plane: the host's re-keying
#: STEP frames add the operation's name, the new session's id (fresh random) and its members' names
SECURE_FRAME_HEADER_KEYS = {"op", "session", "members"}


def _announcer(blob: bytes) -> str:
    """The guest a key announcement names (its own name, signed with it)."""
    from fl_split.privacy.secure_merge import KeyAnnouncement

    return KeyAnnouncement.from_bytes(bytes(blob)).guest


def _audit_announcement(blob: bytes, guest: str) -> None:
    """A key announcement is ``SK1``, the guest's own name, the session id, a 32-byte X25519 public key
    and a 64-byte Ed25519 signature, and nothing else (fl_split/privacy/secure_merge.py)."""
    from fl_split.privacy.secure_merge import KeyAnnouncement

    ann = KeyAnnouncement.from_bytes(bytes(blob))  # refuses trailing or missing bytes
    assert ann.guest == guest and 16 <= len(ann.session) <= 64
    assert len(ann.public) == 32 and len(ann.signature) == 64


def _audit_flower_reply(mtype: str, rec) -> None:
    from fl_split.flower import records as R

    keys = set(rec.keys()) - {"worker"}
    if mtype == R.MSG_ROLE:
        assert {"role"} <= keys <= {"role", "capacity"} and set(json.loads(rec["role"])) <= ROLE_KEYS
        if "capacity" in keys:  # a simulated node: its Ray actor's reservation and the nodes' totals
            assert set(json.loads(rec["capacity"])) <= CAPACITY_KEYS
    elif mtype == R.MSG_SETUP:
        assert {"facts"} <= keys <= {"facts", "dataplane", "capacity"} and set(json.loads(rec["facts"])) <= FACT_KEYS
        if "dataplane" in keys:
            assert set(json.loads(rec["dataplane"])) <= DATAPLANE_KEYS
        if "capacity" in keys:
            assert set(json.loads(rec["capacity"])) <= CAPACITY_KEYS
    elif mtype == R.MSG_STEP:
        assert keys == {"blobs"}
    elif mtype == R.MSG_HOST_TRAIN:
        assert all(k.startswith("grads.guest-") for k in keys)
    elif mtype == R.MSG_HOST_EVAL:
        assert keys == {"metrics"} and set(json.loads(rec["metrics"])) <= EVAL_KEYS
    elif mtype == R.MSG_EPOCH:
        assert keys in ({"outcome"}, {"served"}), keys
        if keys == {"outcome"}:
            outcome = json.loads(rec["outcome"])
            assert set(outcome) <= OUTCOME_KEYS and set(outcome["wire"]) <= WIRE_KEYS
            for row in outcome["history"]:
                assert set(row) <= EVAL_KEYS | {"epoch_time_s"}
                assert all(v is None or isinstance(v, (int, float)) for v in row.values())
        else:
            assert set(json.loads(rec["served"])) <= SERVED_KEYS
    elif mtype == R.MSG_REPORT:
        assert keys == {"report"}
        _audit_report(json.loads(rec["report"]))
    elif mtype == R.MSG_SECURE_ANNOUNCE:
        assert keys == {"announcement"}
        (blob,) = R.blob_list(rec, "announcement")
        _audit_announcement(blob, _announcer(blob))
        return  # an announcement is not a protocol frame (audited above)
    elif mtype in (R.MSG_SECURE_AGREE, R.MSG_DROP):
        assert keys == set(), keys
    elif mtype == R.MSG_REDO:
        assert keys == {"blobs"}
    else:  # pragma: no cover
        raise AssertionError(f"unexpected message type {mtype}")
    seen = {"blobs": 0}
    for k in keys:
        if k == "blobs" or k.startswith("grads."):
            for b in R.blob_list(rec, k):
                _audit_blob(b, seen)


def _audit_grid(audited: list, on_error=None):
    """An in-process Flower grid that audits every reply to the coordinator (:func:`_audit_flower_reply`)
    and appends its message type to ``audited``; an error reply is refused unless ``on_error`` accepts it
    (then ``"error"`` is appended)."""
    from fl_split.flower import records as R
    from tests.test_flower import InlineGrid

    class AuditGrid(InlineGrid):
        mtypes: dict = {}

        def push_messages(self, messages):
            messages = list(messages)
            ids = super().push_messages(messages)
            self.mtypes.update({mid: m.metadata.message_type for mid, m in zip(ids, messages)})
            return ids

        def pull_messages(self, message_ids):
            replies = super().pull_messages(message_ids)
            for reply in replies:
                mtype = self.mtypes[reply.metadata.reply_to_message_id]
                assert not reply.has_error()
                if on_error is not None and R.ERROR in reply.content.config_records:
                    on_error(reply.content.config_records[R.ERROR])
                    audited.append("error")
                    continue
                assert set(reply.content.config_records) == {R.REPLY}
                assert not reply.content.array_records  # no tensors outside the audited blobs
                _audit_flower_reply(mtype, reply.content.config_records[R.REPLY])
                audited.append(mtype)
            return replies

    return AuditGrid


@pytest.mark.parametrize("plane", ["direct", "flower"])
@pytest.mark.parametrize("defense", ["laplace", "r3elu"])
def test_wire_audit_flower(defense, plane, flower_task_identity, monkeypatch):
    """Every reply to the coordinator, and — on the direct data plane — every frame between the
    parties (headers and blobs), is on the allow-list."""
    from fl_split.dataplane import frames as F
    from fl_split.flower import records as R
    from fl_split.flower.strategy import VerticalSplitStrategy
    from tests.test_flower import _simulation_nodes

    audited, frames = [], {"blobs": 0}
    opened = F.Opener.open

    def audit_frame(self, data, allowed=None):
        frame = opened(self, data, allowed)
        assert set(frame.header) <= FRAME_HEADER_KEYS, frame.header
        for b in frame.blobs:
            _audit_blob(b, frames)
        return frame

    monkeypatch.setattr(F.Opener, "open", audit_frame)
    cfg = RunConfig(**BASE, defense=defense, protect="both", epsilon=50.0, batches_per_round=3, data_plane=plane)
    VerticalSplitStrategy(cfg).run(_audit_grid(audited)(_simulation_nodes(3), fresh_process=True))
    if plane == "direct":
        assert {R.MSG_ROLE, R.MSG_SETUP, R.MSG_EPOCH, R.MSG_REPORT} == set(audited)
        assert frames["blobs"] > 0
    else:
        assert {R.MSG_ROLE, R.MSG_SETUP, R.MSG_STEP, R.MSG_HOST_TRAIN, R.MSG_HOST_EVAL, R.MSG_REPORT} <= set(audited)


# The direct data plane's variant hung once in a fresh-clone CI (the process idle after the re-keying, cause
# not found: an assertion failing inside a data-plane thread would look the same); it runs only on the relay
# until that is understood. The direct plane's pad itself is tested in tests/test_secure_merge_flower_pad.py.
@pytest.mark.parametrize("plane", ["flower"])
def test_wire_audit_flower_secure_merge_with_a_padded_guest(plane, flower_task_identity, monkeypatch):
    """``--secure-merge --on-guest-failure pad``, guest-2 failing in round 3 (the re-keying and the
    round released again: docs/flower.md, "Secure merge on Flower"): every reply to the coordinator and
    every data-plane frame is still on the allow-list — key announcements hold a guest's name, the
    session id, its X25519 key and signature; the redone releases are protocol frames; the new messages
    carry nothing else; the only error reply is the failed guest's."""
    from fl_split.dataplane import frames as F
    from fl_split.flower import records as R
    from fl_split.flower.strategy import VerticalSplitStrategy
    from tests.test_flower import _simulation_nodes
    from tests.test_secure_merge_flower_pad import _cfg, _guest_2_fails

    _guest_2_fails(monkeypatch)
    audited, frames, ops = [], {"blobs": 0}, set()
    opened = F.Opener.open

    def audit_frame(self, data, allowed=None):
        frame = opened(self, data, allowed)
        assert set(frame.header) <= FRAME_HEADER_KEYS | SECURE_FRAME_HEADER_KEYS, frame.header
        op = frame.header.get("op")
        if op is not None:
            ops.add(op)
            assert op in ("secure-announce", "secure-agree", "redo")
            if "members" in frame.header:
                assert set(frame.header["members"]) <= {"guest-1", "guest-2", "guest-3"}
                assert len(bytes.fromhex(frame.header["session"])) == 16
        for b in frame.blobs:
            try:
                _audit_blob(b, frames)
            except Exception:  # a key announcement (relayed by the host) is not a protocol frame
                _audit_announcement(b, _announcer(b))
        return frame

    monkeypatch.setattr(F.Opener, "open", audit_frame)

    def failed_guests_error(err) -> None:  # the failed guest's error reply: its text only
        assert set(err.keys()) == {"type", "message", "party", "round"}, err.keys()
        assert err["party"] == "guest-2" and "guest-2 is unreachable" in str(err["message"])

    grid = _audit_grid(audited, on_error=failed_guests_error)(_simulation_nodes(4), fresh_process=True)
    got = VerticalSplitStrategy(_cfg(data_plane=plane)).run(grid)
    assert got["stopped_reason"] == "completed" and got["guest_failures"][0]["action"] == "pad"
    if plane == "direct":  # the re-keying and the redo went over the data plane
        assert ops == {"secure-announce", "secure-agree", "redo"} and frames["blobs"] > 0
    else:
        assert {R.MSG_SECURE_ANNOUNCE, R.MSG_SECURE_AGREE, R.MSG_REDO, R.MSG_DROP, "error"} <= set(audited)


def test_deployment_refuses_a_private_seed_in_the_run_config(tmp_path):
    """A seed value is refused in the run config (the SuperLink stores it) and in the node config
    (the SuperNode's command line); a seed *file* is read on the node, from its node config in a
    deployment and never from the run config there (issue 16)."""
    from flwr.app import Context, RecordDict

    from fl_split.flower import FederationError
    from fl_split.flower.node import NodeRole, private_seed_of
    from fl_split.secure_files import write_private

    seed = PrivateSeed.generate()
    path = write_private(tmp_path / "seed", seed.file_text().encode())

    def ctx(node=None, run=None):
        return Context(run_id=1, node_id=2, node_config=node or {}, state=RecordDict(), run_config=run or {})

    role = NodeRole("guest-1", "guest", 1, "deployment", "g.npz")
    with pytest.raises(FederationError, match="the SuperLink stores and every party can read"):
        private_seed_of(role, ctx(run={"private-seed": "4"}))
    with pytest.raises(FederationError, match="on the SuperNode's command line"):
        private_seed_of(role, ctx(node={"private-seed": "ab" * 16}))
    with pytest.raises(FederationError, match="private-seed-file is set in the run config"):
        private_seed_of(role, ctx(run={"private-seed-file": str(path)}))
    assert private_seed_of(role, ctx(node={"private-seed-file": str(path)}, run={"private-seed": ""})) == seed
    # a node's own seed file (deploy local writes one per party) must be this party's
    other = write_private(tmp_path / "host-seed", seed.for_party("host").file_text().encode())
    with pytest.raises(FederationError, match="belongs to host, not guest-1"):
        private_seed_of(role, ctx(node={"private-seed-file": str(other)}))
    sim = NodeRole("guest-1", "guest", 1, "simulation")
    assert private_seed_of(sim, ctx(run={"private-seed-file": str(path)})) == seed
    assert private_seed_of(sim, ctx(), given=PrivateSeed.legacy(3)) == PrivateSeed.legacy(3)
    assert private_seed_of(sim, ctx(run={"private-seed-file": ""})) is None




def _files_of(directory) -> dict:
    """Name → bytes of a guest's inference files (its ledger and its per-ID query counts)."""
    return {f.name: f.read_bytes() for f in sorted(directory.glob("inference-*"))}


def test_repeated_predict_is_capped_by_the_guests_own_limits(tmp_path):
    """The repeated-predict attack (docs/serving.md "Inference limits"): a host asks a guest to release
    the same 20 chosen IDs 50 times and averages. With no limit the average's RMS error to the guest's
    clean cut-layer output falls from ~0.70 to ~0.10 (measured; ε 358 → 13,751). The guest's own
    default limits (3 releases per ID, ε budget = 3 releases of one record) refuse calls 4-50 —
    whether the caller sends no budget or a huge one (a job's limits only tighten): each refusal is
    one line, releases nothing and leaves its ledger and query files byte for byte; the attacker's
    average stays at what 3 calls give (~0.41). An own ε budget refuses likewise, and a job's
    tighter cap applies, a looser one does not."""
    from fl_split.builder import prepare_data
    from fl_split.errors import BudgetExceeded
    from fl_split.predict import GuestScorer, InferenceLimits, InferenceRefused
    from tests.test_save_predict import _rows, _tables, _train

    paths = _tables(tmp_path, guests=1)
    cfg, _ = _train(tmp_path, paths, defense="gaussian", protect="guest", sigma=0.7, denoise="scale",
                    denoise_param=0.2)
    ids = np.sort(prepare_data(cfg).test_ids[:20])  # the attacker's chosen IDs
    table = str(_rows(tmp_path, paths, ids)["guest-1"])
    part = tmp_path / "model" / "guest-1"

    def attack(limits, job_budget=None, job_cap=None, calls=50):
        guest = GuestScorer(tmp_path / "model", "guest-1", table, "ID", limits=limits)
        with torch.no_grad():
            clean = guest.bottom(guest.features(ids))
        got, eps, refusals = [], [], []
        for _ in range(calls):
            before = _files_of(part)
            try:
                value, rep = guest.release(ids, job_budget, job_cap)
            except (InferenceRefused, BudgetExceeded) as exc:
                refusals.append(str(exc))
                assert _files_of(part) == before  # nothing spent, nothing counted
                continue
            got.append(value)
            eps.append(rep["epsilon"])
        rms = lambda v: float(((v - clean) ** 2).mean().sqrt())  # noqa: E731
        return got, eps, refusals, rms

    for job_budget in (None, 1e12):  # the caller sends no budget, or a huge one (and a huge cap)
        for f in part.glob("inference-*"):
            f.unlink()
        got, eps, refusals, rms = attack(InferenceLimits(), job_budget, None if job_budget is None else 10**6)
        assert len(got) == 3 and len(refusals) == 47
        assert all(len(r.splitlines()) == 1 and "per-ID query cap reached: 20 of the 20" in r and "guest-1" in r
                   for r in refusals)
        single = float(np.mean([rms(v) for v in got]))
        averaged = rms(torch.stack(got).mean(0))
        # the best the attacker can do is average the 3 allowed releases: ~ single / √3, far above 50 calls'
        assert averaged > 0.75 * single / math.sqrt(3) and averaged > 3 * single / math.sqrt(50)
        assert eps[0] < eps[1] < eps[2]  # charged per allowed call, then no more

    # an own ε budget (cap raised): refused when the ledger would pass it, however large the job's
    for f in part.glob("inference-*"):
        f.unlink()
    got, eps, _, _ = attack(InferenceLimits(None, 50), calls=2)
    for f in part.glob("inference-*"):
        f.unlink()
    got, _, refusals, _ = attack(InferenceLimits(eps[1] * 1.001, 50), job_budget=1e12, job_cap=10**6, calls=5)
    assert len(got) == 2 and len(refusals) == 3 and all("privacy budget exhausted" in r for r in refusals)
    # a job's tighter cap applies; a looser one never lifts the guest's own
    for f in part.glob("inference-*"):
        f.unlink()
    assert [len(attack(InferenceLimits(), job_cap=1, calls=2)[0])] == [1]
    assert len(attack(InferenceLimits(), job_cap=100, calls=5)[0]) == 2  # 1 + 2 more up to its own 3
