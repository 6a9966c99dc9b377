"""``--merge sum|avg --secure-merge`` on the Flower relay (``--engine flower --data-plane flower``): the
same numbers as the local engine, the Flower message transcript, a coordinator that substitutes a key,
and the combinations accepted and refused (docs/flower.md, "Secure merge on Flower"; docs/threat-model.md,
"Secure merge")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.errors import ConfigError, PartyError
from fl_split.flower import records as R
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.privacy import secure_merge as sm
from fl_split.protocol import open_message
from tests.test_flower import PS, InlineGrid, _simulation_nodes, _strip

pytestmark = pytest.mark.usefixtures("flower_task_identity")


def _cfg(**kw) -> RunConfig:
    base = dict(dataset="digits", guests=3, merge="sum", epochs=1, batch_size=64, limit=300, progress=False,
                host_features=False, secure_merge=True, seed=3, device="cpu", engine="flower", data_plane="flower",
                defense="gaussian", sigma=0.7, secure_merge_collusion="0")
    base.update(kw)
    return RunConfig(**base)


class RecordingGrid(InlineGrid):
    """An :class:`InlineGrid` keeping every message a node receives and every reply the coordinator
    receives; ``tamper(message)`` may change a message before its node sees it (a dishonest coordinator)."""

    def __init__(self, *a, tamper=None, **kw) -> None:
        super().__init__(*a, **kw)
        self.received: list[tuple[int, str, dict]] = []
        self.answers: list[tuple[int, str, dict]] = []
        self.tamper = tamper

    def _answer(self, m):
        if self.tamper is not None:
            self.tamper(m)
        node, mtype = m.metadata.dst_node_id, m.metadata.message_type
        if R.REQUEST in m.content.config_records:
            self.received.append((node, mtype, dict(m.content.config_records[R.REQUEST])))
        reply = super()._answer(m)
        if R.REPLY in reply.content.config_records:
            self.answers.append((node, mtype, dict(reply.content.config_records[R.REPLY])))
        return reply


def _local_truth(cfg: RunConfig) -> tuple[dict, dict[str, list[torch.Tensor]]]:
    """The local engine's run of ``cfg`` and each guest's true releases (fixed point + noise share)."""
    truth: dict[str, list[torch.Tensor]] = {}
    eng = LocalEngine(cfg.replace(engine="local"), PS)
    for g, party in eng.guests.items():
        mech = party.mechanisms()
        real = mech.release

        def spy(t, gen, real=real, g=g):
            rel = real(t, gen)
            truth.setdefault(g, []).append(rel.value.detach().clone())
            return rel

        mech.release = spy
    return eng.run(), truth


def _no_view_holds_a_release(views: dict[str, np.ndarray], true: dict[str, np.ndarray]) -> None:
    """Each guest's view at the host is uniform on the ring (χ²) and uncorrelated with the guest's true
    release; only the views' sum on the ring equals the true releases' sum."""
    n = len(views["guest-1"])
    assert n > 5000
    for g in views:
        counts = np.bincount(views[g].astype(np.int64) >> (sm.RING_BITS - 5), minlength=32)
        chi2 = float(((counts - n / 32) ** 2 / (n / 32)).sum())
        assert chi2 < 80, (g, chi2)  # 31 d.o.f.: P(chi2 > 80) < 1e-5 for a uniform view
        assert abs(np.corrcoef(views[g], true[g])[0, 1]) < 5 / math.sqrt(n)
        assert not np.array_equal(sm.centred(views[g].astype(np.int64)), true[g].astype(np.int64))
    total = sm.centred(sm.to_ring(sum(v.astype(np.int64) for v in views.values())))
    assert np.array_equal(total, sum(t.astype(np.int64) for t in true.values()))


def test_flower_relay_equals_the_local_engine_and_no_view_holds_a_guests_release():
    """The relay with secure merge and distributed noise (σ = 0.7, k = 0) gives the local engine's
    results exactly (same seeds and private seed; each message handled by a fresh process, so the
    session survives ``context.state``). In the Flower transcript, each guest's release reaches the host
    uniform on the ring and uncorrelated with its true value (fixed point + share), equal to the truth
    only in the sum; the coordinator relays only signed X25519 public keys."""
    cfg = _cfg()
    local, truth = _local_truth(cfg)
    grid = RecordingGrid(_simulation_nodes(4), fresh_process=True)
    got = VerticalSplitStrategy(cfg).run(grid)
    assert got["stopped_reason"] == "completed"
    assert _strip(got) == _strip(local)
    host_node = grid.ids[0]
    train = [req for node, mtype, req in grid.received if node == host_node and mtype == R.MSG_HOST_TRAIN]
    guests = ["guest-1", "guest-2", "guest-3"]
    views = {g: np.concatenate([open_message(req[f"acts.{g}"][0]).tensor.reshape(-1).double().numpy()
                                for req in train]) for g in guests}
    true = {g: torch.cat(truth[g][:len(train)]).reshape(-1).numpy() for g in guests}
    _no_view_holds_a_release(views, true)
    # the guests' releases reach the coordinator as the same masked frames (no other copy)
    steps = [rep for node, mtype, rep in grid.answers if mtype == R.MSG_STEP]
    for rep in steps:
        for blob in rep.get("blobs", []):
            v = open_message(blob).tensor.reshape(-1).double().numpy()
            assert v.min() >= 0 and v.max() < sm.RING and np.array_equal(v, np.round(v))
    # the key agreement: one session, each guest announced one signed public key, relayed unchanged
    anns = [rep["announcement"][0] for _, mtype, rep in grid.answers if mtype == R.MSG_SECURE_ANNOUNCE]
    parsed = [sm.KeyAnnouncement.from_bytes(a) for a in anns]
    assert sorted(a.guest for a in parsed) == guests and len({a.session for a in parsed}) == 1
    agree = [req for _, mtype, req in grid.received if mtype == R.MSG_SECURE_AGREE]
    assert len(agree) == 3 and all(sorted(req["announcements"]) == sorted(anns) for req in agree)
    # what the coordinator receives in the key agreement: the announcement alone, then nothing
    for _, mtype, rep in grid.answers:
        if mtype == R.MSG_SECURE_ANNOUNCE:
            assert set(rep) - {"worker"} == {"announcement"} and len(rep["announcement"]) == 1
        elif mtype == R.MSG_SECURE_AGREE:
            assert set(rep) - {"worker"} == set()
    assert all(len(a.public) == 32 for a in parsed)
    assert got["parties"]["guest-1"]["mechanism"]["honest_shares"] == 3


def test_a_coordinator_that_substitutes_a_key_is_refused():
    """The coordinator replaces guest-2's announcement with a key of its own, signed by an identity of
    its own: every guest that checks it refuses (it is not signed by guest-2's pinned identity) before
    any release; the run stops with that line."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    mine = ed25519.Ed25519PrivateKey.generate()

    def tamper(m):
        if m.metadata.message_type != R.MSG_SECURE_AGREE:
            return
        rec = m.content.config_records[R.REQUEST]
        out = []
        for blob in rec["announcements"]:
            a = sm.KeyAnnouncement.from_bytes(blob)
            if a.guest == "guest-2":
                forged = sm.MaskingGuest("guest-2", mine, {"guest-2": sm.public_identity(mine)}, a.session,
                                         ["guest-2"], bytes(range(32)))
                blob = forged.announce()
            out.append(blob)
        rec["announcements"] = out

    grid = RecordingGrid(_simulation_nodes(4), tamper=tamper)
    with pytest.raises(PartyError) as err:
        VerticalSplitStrategy(_cfg(defense="none")).run(grid)
    assert "guest-2's key is not signed by guest-2's pinned identity" in str(err.value)
    assert R.MSG_STEP not in grid.types  # nothing was released


def test_a_session_without_every_guest_is_refused():
    """A coordinator that leaves guests out of the session (guest-1 alone would mask towards nobody:
    its release would reach the host unmasked) is refused by the guest before it announces a key."""
    def tamper(m):
        if m.metadata.message_type == R.MSG_SECURE_ANNOUNCE:
            m.content.config_records[R.REQUEST]["members"] = R.dumps(["guest-1"])

    grid = RecordingGrid(_simulation_nodes(4), tamper=tamper)
    with pytest.raises(PartyError) as err:
        VerticalSplitStrategy(_cfg(defense="none")).run(grid)
    assert "secure merge: a session of ['guest-1']; refused" in str(err.value)
    assert R.MSG_SECURE_AGREE not in grid.types and R.MSG_STEP not in grid.types


def test_a_node_without_the_private_seed_pins_no_roster():
    """A simulated guest without the run's private seed cannot pin its peers' identities: its setup
    fails with one line (the coordinator is never asked for them); the in-process simulation refuses
    before Ray starts."""
    from fl_split.flower import FlowerEngine

    with pytest.raises(ConfigError) as err:
        FlowerEngine(_cfg()).run()
    text = str(err.value)
    assert text.startswith("--private-seed-file: got ") and "pins the other guests' identities" in text
    from fl_split.flower.node import handle

    grid = InlineGrid(_simulation_nodes(4), app=lambda message, context: handle(message, context, None))
    with pytest.raises(PartyError) as err:
        VerticalSplitStrategy(_cfg(defense="none")).run(grid)
    assert "pins every guest's identity from the run's private seed" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_direct_data_plane_equals_the_local_engine():
    """The direct data plane (the default): the coordinator agrees the session over Flower before the
    first ``train.epoch``, the guests' masked releases travel over the data plane, and the results
    equal the local engine's; every training release the host receives in its data-plane frames passes
    the same transcript checks as the relay's."""
    from fl_split.dataplane.host import HostDataPlane

    cfg = _cfg(data_plane="direct", sigma=1.0)
    local, truth = _local_truth(cfg)
    seen: list[dict[str, list[bytes]]] = []
    real = HostDataPlane.guest_step

    def spy(self, owed, keys, round_):
        out = real(self, owed, keys, round_)
        if all(k.phase == "train" for k in keys):
            seen.append({g: list(b) for g, b in out.items()})
        return out

    grid = RecordingGrid(_simulation_nodes(4))
    HostDataPlane.guest_step = spy
    try:
        got = VerticalSplitStrategy(cfg).run(grid)
    finally:
        HostDataPlane.guest_step = real
    assert got["stopped_reason"] == "completed"
    assert _strip(got) == _strip(local)
    guests = ["guest-1", "guest-2", "guest-3"]
    views = {g: np.concatenate([open_message(r[g][0]).tensor.reshape(-1).double().numpy() for r in seen])
             for g in guests}
    _no_view_holds_a_release(views, {g: torch.cat(truth[g][:len(seen)]).reshape(-1).numpy() for g in guests})
    order = [t for t in grid.types if t in (R.MSG_SECURE_ANNOUNCE, R.MSG_SECURE_AGREE, R.MSG_EPOCH)]
    assert order[:6] == [R.MSG_SECURE_ANNOUNCE] * 3 + [R.MSG_SECURE_AGREE] * 3 and R.MSG_EPOCH in order


def test_pad_and_checkpoints_are_accepted_on_flower_and_the_relay_still_refuses_checkpoints():
    """``pad`` (the guests left re-key mid-round and release it again) and checkpoints (a resume agrees a
    new session) run on Flower (tests/test_secure_merge_flower_pad.py); the relay's general refusal of
    checkpoints stays, in one line."""
    from fl_split.flower.strategy import check_options

    check_options(_cfg(on_guest_failure="pad"))  # the relay pads under --secure-merge
    _cfg(on_guest_failure="pad", data_plane="direct")
    _cfg(checkpoint_dir="ckpt", data_plane="direct")
    with pytest.raises(ConfigError) as err:
        _cfg(checkpoint_dir="ckpt")
    text = str(err.value)
    assert text.startswith("--checkpoint-dir: got ") and "--data-plane flower" in text and "\n" not in text


def _deployment_nodes(tmp_path, cfg: RunConfig, roster: bool = True) -> list[dict]:
    """Deployment node configs as ``fl-split deploy local`` writes them: each party's own file and own
    seed, every guest the path of the public roster (relay data plane: no data-plane settings)."""
    import json

    from fl_split.party_files import export_parties
    from fl_split.secure_files import write_private

    files = export_parties(cfg.replace(engine="local"), tmp_path)
    path = tmp_path / "roster.json"
    path.write_text(json.dumps({g: k.hex() for g, k in sm.roster_from_seed(PS, cfg.guests).items()}))
    nodes = []
    for p in ["host"] + [f"guest-{i}" for i in range(1, cfg.guests + 1)]:
        seed = write_private(tmp_path / f"{p}.seed", PS.for_party(p).file_text().encode())
        node = {"role": "host"} if p == "host" else {"role": "guest", "guest-index": int(p.split("-")[1])}
        node.update({"data-path": str(files[p]), "private-seed-file": str(seed)})
        if roster and p != "host":
            node["secure-merge-roster"] = str(path)
        nodes.append(node)
    return nodes


def test_deployment_nodes_pin_the_roster_from_their_own_node_config(tmp_path):
    """Deployment nodes (each its own party file and seed file, as deploy local writes them): each guest
    pins the roster from its own node-config file (per-party seeds cannot give the others' identities),
    and the results equal the local engine's; a guest without the file fails its setup in one line, and
    ``fl-split deploy local`` without a private seed refuses before writing anything."""
    from fl_split.deploy import deploy_local
    from fl_split.flower.node import handle

    cfg = _cfg(defense="none", guests=2)
    app = lambda message, context: handle(message, context, None)  # noqa: E731 - seeds from the node configs
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_deployment_nodes(tmp_path / "a", cfg), app=app,
                                                    fresh_process=True))
    assert _strip(got) == _strip(LocalEngine(cfg.replace(engine="local"), PS).run())
    with pytest.raises(PartyError) as err:
        VerticalSplitStrategy(cfg).run(InlineGrid(_deployment_nodes(tmp_path / "b", cfg, roster=False), app=app))
    assert "has no pinned roster of the guests' identities" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        deploy_local(_cfg(), tmp_path / "work")
    assert str(err.value).startswith("--secure-merge: got ") and "with --private-seed-file" in str(err.value)
    assert not (tmp_path / "work").exists()
