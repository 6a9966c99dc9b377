"""The direct data plane (issue 10): frames, the per-party handshake, TLS, failures, resources,
devices and the package layering (the adversarial identity tests: ``tests/test_adversary_identity.py``).

Most tests run the real pieces over loopback gRPC in this process (fast); the run-level ones use the
inline Flower grid of ``tests/test_flower.py`` (the real strategy and ClientApp handlers, epoch
messages in threads). The guest killed mid-epoch is a real process, SIGKILLed while it serves a
round. The Ray-simulation versions are in ``tests/test_flower.py`` (``slow``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from fl_split.config import RunConfig
from fl_split.dataplane import frames as F
from fl_split.dataplane.errors import CredentialError, FrameError, PeerFailure
from fl_split.dataplane.guest import serve
from fl_split.dataplane.host import GRPC_OPTIONS, METHOD, HostEndpoint
from fl_split.dataplane.limits import pieces
from fl_split.dataplane.tls import ClientTLS, ServerTLS
from fl_split.errors import ConfigError, PartyError
from fl_split.flower import node as node_mod
from fl_split.flower import records as R
from fl_split.flower.node import handle, node_role
from fl_split.flower.strategy import VerticalSplitStrategy
from tests.test_flower import PS, InlineGrid, _cfg, _local, _simulation_nodes, _strip

ROOT = Path(__file__).resolve().parents[1]
SESSION = "0123456789abcdef"
#: every party's own data-plane private key (as its node makes one at setup)
KEYS = {p: F.new_private_key() for p in ("host", "guest-1", "guest-2", "guest-3")}


def host_keys(guests=("guest-1", "guest-2", "guest-3")) -> F.LinkKeys:
    """The host's identity: its private key, the guests' public keys (as the coordinator relays them)."""
    return F.LinkKeys(KEYS["host"], {g: F.public_key(KEYS[g]) for g in guests})


def guest_keys(party: str) -> F.LinkKeys:
    """A guest's identity: its private key, the host's public key."""
    return F.LinkKeys(KEYS[party], {"host": F.public_key(KEYS["host"])})


pytestmark = pytest.mark.usefixtures("flower_task_identity")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    from tests.tlsutil import make_certificates

    return make_certificates(tmp_path_factory.mktemp("tls"))


# ------------------------------------------------------------------------------------------------
# frames


def test_frame_round_trip_sealed():
    key = os.urandom(32)
    sealer, opener = F.Sealer(key), F.Opener(key, "guest-1")
    blobs = [b"", b"\x00" * 7, os.urandom(4096)]
    for i in range(3):
        data = sealer.seal(F.RELEASE, {"round": i}, blobs)
        frame = opener.open(data, allowed=(F.RELEASE,))
        assert (frame.type, frame.seq, frame.header, frame.blobs) == (F.RELEASE, i + 1, {"round": i}, blobs)


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("tamper,match", [
    (lambda d: _flip(d, len(d) - 40), "bad authentication tag"),  # a tensor byte
    (lambda d: _flip(d, 20), "bad authentication tag"),           # the (encrypted) header
    (lambda d: _flip(d, 5), "bad authentication tag"),            # the frame type (associated data)
    (lambda d: _flip(d, len(d) - 1), "bad authentication tag"),   # the tag itself
    (lambda d: d[:-1], "bad authentication tag"),                 # truncated
    (lambda d: d[:10], "shorter than a sealed frame"),
    (lambda d: b"garbage", "shorter than a sealed frame"),
])
def test_tampered_frame_is_refused_before_it_is_read(tamper, match):
    key = os.urandom(32)
    data = F.Sealer(key).seal(F.RELEASE, {"round": 1}, [os.urandom(256)])
    with pytest.raises(FrameError, match=match) as err:
        F.Opener(key, "guest-3").open(tamper(data))
    assert "guest-3" in str(err.value)


def test_replayed_or_foreign_frames_are_refused():
    key = os.urandom(32)
    sealer, opener = F.Sealer(key), F.Opener(key, "guest-1")
    first = sealer.seal(F.RELEASE, {"round": 1})
    opener.open(first)
    with pytest.raises(FrameError, match="sequence number 1, expected 2"):
        opener.open(first)  # replayed
    foreign = F.Sealer(os.urandom(32))  # another session's key, at the expected sequence number
    foreign.seq = 1
    with pytest.raises(FrameError, match="bad authentication tag"):
        opener.open(foreign.seal(F.RELEASE, {"round": 2}))
    with pytest.raises(FrameError, match="STEP before the handshake"):
        F.unpack(F.pack(F.STEP, {"round": 1}), "a connection from ipv4:1.2.3.4:5")
    with pytest.raises(FrameError, match="unexpected data-plane frame from guest-1: END, expected RELEASE or ERROR"):
        opener.open(sealer.seal(F.END, {}), allowed=(F.RELEASE, F.ERROR))


def test_sealed_frames_hide_the_tensors():
    """A sealed frame carries no byte of its blobs or header in clear (AES-GCM), unlike a handshake
    frame; the frame type and sequence number stay visible (associated data)."""
    key = os.urandom(32)
    blob = torch.arange(64, dtype=torch.float32).numpy().tobytes()
    data = F.Sealer(key).seal(F.RELEASE, {"round": 17}, [blob])
    assert blob[8:40] not in data and b'"round"' not in data
    assert data[:4] == F.MAGIC and data[5] == F.RELEASE
    assert blob[8:40] in F.pack(F.RELEASE, {"round": 17}, [blob])


def _secrets(role, party="guest-1", session=SESSION, ng=b"g" * 16, nh=b"h" * 16, eg=None, eh=None, host=None,
             guest=None):
    eg, eh = eg or KEYS["guest-3"], eh or KEYS["guest-2"]  # stand-ins for the ephemeral keys
    host, guest = host or KEYS["host"], guest or KEYS[party]
    if role == "host":
        return F.link_secrets("host", host, bytes.fromhex(F.public_key(guest)), eh, bytes.fromhex(F.public_key(eg)),
                              session, party, ng, nh, "x")
    return F.link_secrets("guest", guest, bytes.fromhex(F.public_key(host)), eg, bytes.fromhex(F.public_key(eh)),
                          session, party, ng, nh, "x")


def test_handshake_secrets_bind_both_keys_session_party_and_nonces():
    """Host and guest derive the same link secrets only from their own private keys and each other's
    public keys; a proof does not verify under another party, session, nonce or key."""
    h, g = _secrets("host"), _secrets("guest")
    assert h == g and h.to_guest != h.to_host
    F.check_proof(h, "guest", F.proof(g, "guest"), "guest-1", "guest-1")
    F.check_proof(g, "host", F.proof(h, "host"), "the host", "the host")
    others = [_secrets("host", "guest-2", guest=KEYS["guest-1"]), _secrets("host", session="ffff0000"),
              _secrets("host", ng=b"x" * 16), _secrets("host", nh=b"x" * 16),
              _secrets("host", guest=F.new_private_key())]
    for other in others:
        with pytest.raises(CredentialError, match="guest-1 failed to prove it is guest-1"):
            F.check_proof(other, "guest", F.proof(g, "guest"), "guest-1", "guest-1")
    with pytest.raises(CredentialError, match="its guest proof does not match"):
        F.check_proof(h, "guest", F.proof(g, "host"), "guest-1", "guest-1")  # a role's proof is not the other's
    with pytest.raises(CredentialError, match="low-order"):
        F.link_secrets("host", KEYS["host"], bytes(32), KEYS["guest-2"], bytes(32), SESSION, "guest-1",
                       b"g" * 16, b"h" * 16, "guest-1")


# ------------------------------------------------------------------------------------------------
# the endpoint and the guests over loopback


def _echo(name: str):
    return lambda owed, keys, r: [f"{name}:{r}:{len(owed)}".encode()]


def _guest_thread(party, address, keys=None, session=SESSION, tls=None, timeout=10.0, step=None):
    out: dict = {}

    def run():
        try:
            out["served"] = serve(party, step or _echo(party), address, keys or guest_keys(party), session, tls,
                                  timeout)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _rounds(endpoint: HostEndpoint, n: int):
    got = []
    for r in range(1, n + 1):
        for g in endpoint.guests:
            endpoint.send(g, F.STEP, {"round": r, "keys": [["train", 1, r - 1]]}, [b"grad"] * (r > 1))
        out, failed, errors = endpoint.collect(r, endpoint.guests)
        assert not failed and not errors
        got.append(out)
    return got


def test_host_and_guests_exchange_over_loopback():
    with HostEndpoint(["guest-1", "guest-2"], host_keys(), SESSION, "127.0.0.1:0", timeout=10) as ep:
        threads = [_guest_thread(g, ep.address) for g in ep.guests]
        ep.wait_for_guests()
        got = _rounds(ep, 3)
    for t, _ in threads:
        t.join(10)
    assert got[2] == {"guest-1": [b"guest-1:3:1"], "guest-2": [b"guest-2:3:1"]}
    assert [out["served"].steps for _, out in threads] == [3, 3]
    assert all(out["served"].end_reason == "done" for _, out in threads)


def _rogue(address: str, party: str = "guest-1", private: bytes | None = None, session: str = SESSION,
           after=None, tls=None, host_public: str | None = None) -> grpc.RpcError | None:
    """A client that runs the handshake as ``party`` with the private key ``private`` (default: a key
    of its own, not ``party``'s) without checking the host's proof, and then, if it gets that far,
    sends ``after(link secrets)``."""
    channel = grpc.secure_channel(address, tls.credentials(), options=GRPC_OPTIONS + tls.channel_options()) if tls \
        else grpc.insecure_channel(address, options=GRPC_OPTIONS)
    private = private or F.new_private_key()
    ng, eph = F.new_nonce(), F.new_private_key()
    sent = [F.pack(F.HELLO, {"party": party, "session": session, "nonce": ng.hex(), "eph": F.public_key(eph)})]
    ready = threading.Event()

    def requests():
        yield sent[0]
        ready.wait(10)
        yield from sent[1:]

    try:
        call = channel.stream_stream(METHOD)(requests())
        welcome = F.unpack(next(call), "host")
        nh, eh = F.parse_welcome(welcome, "host")
        host_public = host_public or F.public_key(KEYS["host"])
        secrets = F.link_secrets("guest", private, bytes.fromhex(host_public), eph, eh, session, party, ng, nh, "host")
        sent.append(F.pack(F.PROOF, {"proof": F.proof(secrets, "guest")}))
        if after is not None:  # after the handshake a frame travels as pieces
            sent.extend(pieces(after(secrets)))
        ready.set()
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc
    finally:
        channel.close()
    return None


def test_wrong_key_is_refused_and_the_host_keeps_waiting():
    """A peer without guest-1's private key is refused (UNAUTHENTICATED, named) before anything it
    sends is read; the endpoint keeps waiting and the real guest then joins as if nothing happened."""
    with HostEndpoint(["guest-1"], host_keys(["guest-1"]), SESSION, "127.0.0.1:0", timeout=10) as ep:
        err = _rogue(ep.address, "guest-1")
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "guest-1 (connecting from" in err.details() and "failed to prove it is guest-1" in err.details()
        stale = _rogue(ep.address, "guest-1", KEYS["guest-1"], session="ffffffff00000000")
        assert stale is not None and "session ffffffff00000000" in stale.details()
        stranger = _rogue(ep.address, "guest-7", KEYS["guest-1"])
        assert stranger is not None and "guest-7" in stranger.details() and "not a guest of this run" in stranger.details()
        t, out = _guest_thread("guest-1", ep.address)
        ep.wait_for_guests()
        assert _rounds(ep, 2)[1] == {"guest-1": [b"guest-1:2:1"]}
        assert len(ep.refused) == 3 and "failed to prove it is guest-1" in ep.refused[0]
    t.join(10)
    assert out["served"].steps == 2


def test_a_guest_refuses_a_host_without_the_hosts_key():
    """The host proves it is the host first: a guest never answers a peer that cannot (here an
    endpoint with a private key other than the one whose public half the guest was given)."""
    impostor = F.LinkKeys(F.new_private_key(), {"guest-1": F.public_key(KEYS["guest-1"])})
    with HostEndpoint(["guest-1"], impostor, SESSION, "127.0.0.1:0", timeout=5) as ep:
        with pytest.raises(PeerFailure, match=r"guest-1 refused the data-plane peer: the host at 127.0.0.1:\d+ "
                                              r"failed to prove it is the host"):
            serve("guest-1", _echo("guest-1"), ep.address, guest_keys("guest-1"), SESSION, None, 5)


@pytest.fixture
def slow_proof_check(monkeypatch):
    """The host takes 0.3 s to check a PROOF, so a guest's next messages arrive before it is accepted."""
    check = F.check_proof

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return check(*args, **kwargs)

    monkeypatch.setattr(F, "check_proof", slow)


def _rogue_round(ep, after) -> tuple[dict, dict, dict]:
    t = threading.Thread(target=lambda: _rogue(ep.address, "guest-1", KEYS["guest-1"], after=after), daemon=True)
    t.start()
    ep.wait_for_guests()
    ep.send("guest-1", F.STEP, {"round": 1, "keys": [["train", 1, 0]]})
    got = ep.collect(1, ["guest-1"])
    return got, t


@pytest.mark.parametrize("slow", [False, True], ids=["prompt", "frame-before-proof-checked"])
def test_malformed_frame_from_an_authenticated_guest_is_refused(slow, request):
    """After a valid handshake a frame that fails its tag is refused, named, and the guest dropped:
    nothing of it reaches the host's round — also when it arrives before the host has checked the
    guest's PROOF (it is then read as pieces once the PROOF is accepted, never as a raw frame)."""
    if slow:
        request.getfixturevalue("slow_proof_check")
    with HostEndpoint(["guest-1"], host_keys(["guest-1"]), SESSION, "127.0.0.1:0", timeout=5) as ep:
        def bad_release(secrets):
            good = F.pack(F.RELEASE, {"round": 1}, [b"x" * 100], 1, secrets.to_host)
            return _flip(good, 40)

        (out, failed, errors), t = _rogue_round(ep, bad_release)
        assert out == {} and not errors
        assert "refused a data-plane frame from guest-1: bad authentication tag" in failed["guest-1"]
    t.join(10)


def test_a_frame_sent_before_the_proof_is_checked_arrives_whole(slow_proof_check):
    """A guest may send its first frame right behind its PROOF: the host reads it only after it has
    accepted the PROOF, reassembled from its pieces (here two: 300 kB), intact."""
    blob = os.urandom(300_000)
    with HostEndpoint(["guest-1"], host_keys(["guest-1"]), SESSION, "127.0.0.1:0", timeout=5) as ep:
        (out, failed, errors), t = _rogue_round(
            ep, lambda secrets: F.pack(F.RELEASE, {"round": 1}, [blob], 1, secrets.to_host))
        assert not failed and not errors
        assert [bytes(b) for b in out["guest-1"]] == [blob]
    t.join(10)


def test_tls_on_loopback(tls):
    """The data plane over TLS with certificates made here: the guest trusts the CA that signed the
    host's certificate; a guest trusting another CA, or speaking plaintext, cannot connect."""
    server = ServerTLS.from_files(str(tls["host_cert"]), str(tls["host_key"]))
    with HostEndpoint(["guest-1", "guest-2"], host_keys(), SESSION, "127.0.0.1:0", tls=server, timeout=10) as ep:
        with pytest.raises(PeerFailure, match=r"guest-1 cannot reach the host's data plane at 127.0.0.1:\d+ within 2 s"):
            serve("guest-1", _echo("guest-1"), ep.address, guest_keys("guest-1"), SESSION,
                  ClientTLS.from_files(str(tls["other_ca"])), 2)
        with pytest.raises(PeerFailure, match=r"cannot reach the host's data plane"):
            serve("guest-1", _echo("guest-1"), ep.address, guest_keys("guest-1"), SESSION, None, 2)
        threads = [_guest_thread(g, ep.address, tls=ClientTLS.from_files(str(tls["ca"]))) for g in ep.guests]
        ep.wait_for_guests()
        assert _rounds(ep, 2)[1]["guest-2"] == [b"guest-2:2:1"]
    for t, out in threads:
        t.join(10)
        assert out["served"].steps == 2


def test_mutual_tls(tls):
    """The host requires client certificates signed by its client CA (a guest without one cannot
    connect) naming the party (``tests/test_adversary_identity.py``)."""
    server = ServerTLS.from_files(str(tls["host_cert"]), str(tls["host_key"]), str(tls["ca"]))
    with HostEndpoint(["guest-1"], host_keys(["guest-1"]), SESSION, "127.0.0.1:0", tls=server, timeout=10) as ep:
        with pytest.raises(PeerFailure, match="cannot reach the host's data plane"):
            serve("guest-1", _echo("guest-1"), ep.address, guest_keys("guest-1"), SESSION,
                  ClientTLS.from_files(str(tls["ca"])), 2)
        client = ClientTLS.from_files(str(tls["ca"]), str(tls["guest_cert"]), str(tls["guest_key"]))
        t, out = _guest_thread("guest-1", ep.address, tls=client)
        ep.wait_for_guests()
        _rounds(ep, 1)
    t.join(10)
    assert out["served"].steps == 1


def test_tls_material_errors_name_the_file(tmp_path):
    from fl_split.dataplane.errors import DataPlaneError

    (tmp_path / "x.crt").write_text("not a certificate")
    with pytest.raises(DataPlaneError, match=r"dataplane-ca: .*x.crt' is not a PEM file"):
        ClientTLS.from_files(str(tmp_path / "x.crt"))
    with pytest.raises(DataPlaneError, match=r"dataplane-certfile: cannot read '.*nope.crt'"):
        ServerTLS.from_files(str(tmp_path / "nope.crt"), str(tmp_path / "nope.key"))


def test_process_board_publishes_and_times_out():
    from fl_split.dataplane.rendezvous import ProcessBoard

    board = ProcessBoard()
    assert board.lookup("feedbeef00000000", 0.05) is None
    threading.Timer(0.1, lambda: board.publish("feedbeef00000000", "127.0.0.1:1234")).start()
    assert board.lookup("feedbeef00000000", 5) == "127.0.0.1:1234"
    board.withdraw("feedbeef00000000")
    assert board.lookup("feedbeef00000000", 0) is None


# ------------------------------------------------------------------------------------------------
# whole runs through the real strategy and ClientApp handlers


def test_rogue_peer_during_a_run_changes_nothing(monkeypatch):
    """While a run is on, a peer that knows the host's address but not guest-1's private key connects
    as guest-1: it is refused, and the run is exactly the local engine's."""
    from fl_split.dataplane import rendezvous

    refused: list = []
    publish = rendezvous.ProcessBoard.publish

    def publish_and_attack(self, session, address):
        publish(self, session, address)
        refused.append(_rogue(address, "guest-1", session=session))

    monkeypatch.setattr(rendezvous.ProcessBoard, "publish", publish_and_attack)
    cfg = _cfg(epochs=1)
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3)))
    assert _strip(got) == _strip(_local(cfg))
    assert refused and all(e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED for e in refused)


def _restored(grid: InlineGrid, node: int):
    """The party of ``node`` as its saved state holds it (what a next message, or a resume, sees)."""
    node_mod._PARTIES.clear()
    ctx = grid.contexts[node]
    party, _ = node_mod._restore(ctx, node_role(ctx.node_config))
    return party


def _consistent(party) -> None:
    """Every release that left the party is in its ledger, once."""
    rep = party.report()["privacy"]
    assert rep["releases"] == party.released["records"] > 0


def test_bad_frame_mid_run_is_refused_and_the_host_unchanged(monkeypatch):
    """guest-1's RELEASE of round 3 arrives altered on the wire: the host refuses it before reading
    a tensor, names guest-1 and the round, and stops; its saved state is exactly the local engine's
    after round 2 (nothing of the bad frame reached it), its ledger holding every release once."""
    from fl_split.dataplane import guest as guest_mod

    send = guest_mod._Stream.send
    marker = threading.local()

    def step_marking(party, step):
        def s(owed, keys, r):
            marker.flip = party == "guest-1" and r == 3
            return step(owed, keys, r)
        return s

    serve_ = guest_mod.serve
    monkeypatch.setattr(guest_mod, "serve", lambda party, step, *a, **k: serve_(party, step_marking(party, step), *a, **k))

    def sending(self, data):
        if getattr(marker, "flip", False) and data[5] == F.RELEASE:  # magic (4), version (1), type
            marker.flip = False
            data = _flip(data, len(data) - 50)
        return send(self, data)

    monkeypatch.setattr(guest_mod._Stream, "send", sending)
    cfg = _cfg(epochs=1, defense="laplace", protect="both", epsilon=50.0)
    grid = InlineGrid(_simulation_nodes(3))
    with pytest.raises(PartyError, match=r"^guest-1 failed in round 3: .*refused a data-plane frame from guest-1: "
                                         r"bad authentication tag") as err:
        VerticalSplitStrategy(cfg).run(grid)
    assert (err.value.party, err.value.round) == ("guest-1", 3)
    host = _restored(grid, grid.ids[0])
    assert host.steps == 2
    _consistent(host)
    want = _local_after_rounds(cfg, 2)
    assert host.report()["privacy"] == want.report()["privacy"]
    assert host.released == want.released


def _local_after_rounds(cfg: RunConfig, rounds: int):
    """The local engine's host after ``rounds`` rounds of epoch 1 (K = 1)."""
    from fl_split.builder import make_parties
    from fl_split.engine import LocalTransport
    from fl_split.schedule import plan_rounds

    host, guests, plan = make_parties(cfg, PS)
    t = LocalTransport(host, guests)
    owed = {g: [] for g in guests}
    for rnd in list(plan_rounds(plan.schedule, 1, 1))[:rounds]:
        acts = t.guest_step(owed, rnd.keys, rnd.round)
        owed = t.host_train(rnd.keys, acts, rnd.round)
    return host


def test_stalled_guest_is_named_after_the_timeout():
    """guest-1 stops answering in round 2: the host gives up after --dataplane-timeout, names it and
    the round, and the run stops (the other guest is told the session ended)."""
    release = threading.Event()

    def app(message, context):
        if message.metadata.message_type == R.MSG_EPOCH and node_role(context.node_config).party == "guest-1":
            party, _ = node_mod._restore(context, node_role(context.node_config))
            step = party.step

            def stalling(owed, keys, r):
                if r == 2:
                    release.wait(30)
                return step(owed, keys, r)

            party.step = stalling
        return handle(message, context, PS)

    t0 = time.monotonic()
    try:
        with pytest.raises(PartyError, match=r"^guest-1 failed in round 2: .*no reply from guest-1 within 1 s "
                                             r"\(--dataplane-timeout\)"):
            VerticalSplitStrategy(_cfg(dataplane_timeout=1.0)).run(InlineGrid(_simulation_nodes(3), app=app))
        assert time.monotonic() - t0 < 20
    finally:
        release.set()


def _child_guest(cfg_json: str, party: str, address: str, private: bytes, host_public: str, session: str,
                 kill_round: int) -> None:
    """A guest in its own process: built as its node builds it, serving the host until it kills
    itself (SIGKILL) on receiving round ``kill_round``."""
    import torch as _torch

    from fl_split.flower.node import build_party
    from fl_split.flower.node import node_role as _role

    _torch.set_num_threads(1)
    cfg = RunConfig.from_mapping(json.loads(cfg_json))
    p, _ = build_party(cfg, _role({"partition-id": int(party.split("-")[1])}), PS)

    def step(owed, keys, r):
        if r == kill_round:
            os.kill(os.getpid(), signal.SIGKILL)
        return p.step(owed, keys, r)

    serve(party, step, address, F.LinkKeys(private, {"host": host_public}), session, None, 60.0)


def test_guest_killed_mid_epoch_is_named_and_ledgers_stay_consistent():
    """guest-2 runs in its own process and is killed (SIGKILL) while it serves round 3. The host sees
    the stream break at once and stops, naming guest-2 and the round; the host and guest-1 save
    their states with every release that left them in their ledgers, exactly once — the same
    ledgers the local engine has when guest-2 fails in round 3."""
    from fl_split.dataplane.rendezvous import ProcessBoard

    children: list = []

    def app(message, context):
        if message.metadata.message_type == R.MSG_EPOCH and node_role(context.node_config).party == "guest-2":
            req = message.content.config_records[R.REQUEST]
            address = ProcessBoard().lookup(str(req["session"]), 30)
            config = R.loads(str(context.state.config_records[R.STATE_META]["skeleton"])) and \
                str(context.state.config_records[R.STATE_META]["config"])
            # the guest's own key, from its node state (the child process stands in for its ClientApp)
            from fl_split.flower.direct import party_keys

            keys = party_keys(context.state, "guest-2", R.loads(str(req["dataplane"]))["keys"], ["host"])
            proc = multiprocessing.get_context("spawn").Process(
                target=_child_guest, args=(config, "guest-2", address, keys.private, keys.peers["host"],
                                           str(req["session"]), 3))
            proc.start()
            children.append(proc)
            proc.join(120)
            from flwr.app import Message

            return Message(R.error_record(RuntimeError(f"the ClientApp's process died (exit code {proc.exitcode})"),
                                          "guest-2", None), reply_to=message)
        return handle(message, context, PS)

    cfg = _cfg(epochs=1, defense="laplace", protect="both", epsilon=50.0)
    grid = InlineGrid(_simulation_nodes(3), app=app)
    t0 = time.monotonic()
    with pytest.raises(PartyError, match=r"^guest-2 failed in round 3: .*lost the connection to guest-2") as err:
        VerticalSplitStrategy(cfg).run(grid)
    assert (err.value.party, err.value.round) == ("guest-2", 3)
    assert children and children[0].exitcode == -signal.SIGKILL
    assert time.monotonic() - t0 < 150
    host, guest1 = _restored(grid, grid.ids[0]), _restored(grid, grid.ids[1])
    for p in (host, guest1):
        _consistent(p)
    assert host.steps == 2 and guest1.released["batches"] == 3  # guest-1 released round 3 before the loss
    # the local engine, guest-2 failing in round 3: the same ledgers
    from fl_split.engine import GuestFailure, LocalEngine

    local = LocalEngine(cfg.replace(engine="local"), PS)
    step = local.guests["guest-2"].step
    local.guests["guest-2"].step = lambda owed, keys, r, **kw: (_ for _ in ()).throw(RuntimeError("gone")) if r == 3 \
        else step(owed, keys, r, **kw)
    with pytest.raises(GuestFailure):
        local.run()
    assert host.report()["privacy"] == local.host.report()["privacy"]
    assert guest1.report()["privacy"] == local.guests["guest-1"].report()["privacy"]


# ------------------------------------------------------------------------------------------------
# resources: every ClientApp at once


def test_capacity_follows_flowers_pool_rule():
    from fl_split.flower.resources import slots

    assert slots([{"CPU": 2.0}], 1.0, 0.0) == 2
    assert slots([{"CPU": 2.0}], 0.66, 0.0) == 3
    assert slots([{"CPU": 1.0}, {"CPU": 1.0}], 0.5, 0.0) == 4
    assert slots([{"CPU": 16.0, "GPU": 1.0}], 1.0, 0.25) == 4
    assert slots([{"CPU": 16.0, "GPU": 0.0}], 1.0, 0.25) == 0


@pytest.mark.parametrize("capacity,guests,match", [
    ({"num_cpus": 1.0, "num_gpus": 0.0, "nodes": [{"CPU": 2.0, "GPU": 0.0}]}, 2,
     r"^--num-cpus: got 1.0 \(the direct data plane runs all 3 ClientApps \(1 host \+ 2 guests\) at once, but only 2 "
     r"fit: each reserves --num-cpus 1, and Ray has 2 CPU\(s\) on 1 node\); allowed: --num-cpus 0.66 or less "
     r"\(flwr run: fl-split flwr-run derives a federation that fits, or --federation-config .*\), more Ray nodes, "
     r"or --data-plane flower"),
    ({"num_cpus": 1.0, "num_gpus": 0.0, "nodes": [{"CPU": 1.0}, {"CPU": 1.0}]}, 2,
     r"only 2 fit: .*Ray has 2 CPU\(s\) on 2 nodes\); allowed: --num-cpus 0.5 or less"),
    ({"num_cpus": 1.0, "num_gpus": 0.5, "nodes": [{"CPU": 8.0, "GPU": 1.0}]}, 2,
     r"^--num-gpus: got 0.5 \(.*only 2 fit: each reserves --num-cpus 1 and --num-gpus 0.5, and Ray has 8 CPU\(s\) "
     r"and 1 GPU\(s\) on 1 node\); allowed: --num-gpus 0.33 or less"),
])
def test_capacity_message_says_what_to_change(capacity, guests, match):
    from fl_split.flower.resources import check_capacity

    with pytest.raises(ConfigError, match=match):
        check_capacity(guests, capacity)
    check_capacity(guests - 1, capacity)  # one party fewer fits


def test_cli_refuses_a_simulation_that_cannot_run_every_clientapp(tmp_path, capsys):
    """Before Ray starts: one line naming the flag, what the parties ask and what the machine has."""
    from fl_split.cli import main
    from fl_split.flower.resources import local_cpus

    cpus = local_cpus()
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    code = main(["train", "--engine", "flower", "--guests", "2", "--num-cpus", str(cpus), "--out", str(out),
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"fl-split: error: --num-cpus: got {float(cpus)!r} (the direct data plane runs all 3 "
                             f"ClientApps (1 host + 2 guests) at once, but only 1 fit"), err
    assert f"Ray has {cpus} CPU(s) on 1 node (this machine)" in err[0] and "--data-plane flower" in err[0]
    assert not out.exists() and time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------------------------
# --device auto: one rule in every engine


def test_device_auto_is_one_rule_and_recorded(monkeypatch):
    """Local engine, monolithic baseline and in-process simulation resolve --device auto alike (the
    GPU when this machine has one); a simulation whose parties would use CUDA needs --num-gpus, and
    says so instead of silently running them on the CPU; each party records where it ran."""
    from fl_split import devices
    from fl_split.engine import LocalEngine

    res = LocalEngine(_cfg(epochs=1, device="auto"), PS).run()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert res["config"]["device"] == want
    assert {r["device"].split(":")[0] for r in res["parties"].values()} == {want}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = _cfg(engine="flower", device="auto")
    assert devices.resolve("auto") == "cuda" and devices.with_device(cfg).device == "cuda"
    with pytest.raises(ConfigError, match=r"^--num-gpus: got 0.0 \(--device auto chose cuda \(this machine has 1 "
                                          r"GPU\(s\), as the local engine would use\), but a Flower ClientApp sees a "
                                          r"GPU only when Ray reserves one for it\); allowed: a share of a GPU per "
                                          r"ClientApp, e.g. --num-gpus 0.33 \(3 parties on 1 GPU\(s\)\), or --device cpu"):
        devices.for_simulation(cfg)
    assert devices.for_simulation(cfg.replace(num_gpus=0.33)).device == "cuda"
    assert devices.for_simulation(cfg.replace(device="cpu")).device == "cpu"


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_simulation_parties_use_the_gpus_ray_assigned():
    """With --num-gpus every party's tensors are on the GPU Ray assigned to its actor, recorded in
    the results; the run matches the local engine on the GPU."""
    from fl_split.flower import FlowerEngine

    from tests.test_flower import _sim_cpus

    cfg = _cfg(engine="flower", device="auto", num_gpus=0.3, num_cpus=_sim_cpus(3))
    got = FlowerEngine(cfg, private_seed=PS).run()
    assert got["config"]["device"] == "cuda"
    for name, rep in got["parties"].items():
        assert rep["device"].startswith("cuda:"), (name, rep)
        assert rep["accelerator"]["ray_gpu_ids"], (name, rep)
    want = _local(cfg.replace(device="cuda"))
    for g, w in zip(got["history"], want["history"]):
        assert g["train_loss"] == pytest.approx(w["train_loss"], rel=1e-4)


# ------------------------------------------------------------------------------------------------
# layers one way


def test_the_library_does_not_import_the_apps_or_the_tests():
    import ast

    offenders = []
    for path in (ROOT / "fl_split").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[0] in ("strategies", "clients", "tests")]
    assert offenders == []


def test_a_clientapp_loads_neither_the_simulation_driver_nor_process_management():
    code = ("import sys, clients.client_app, strategies.server_app; "
            "bad = [m for m in sys.modules if m in ('fl_split.flower.engine', 'fl_split.flower.processes', "
            "'tests.services') or m.startswith('flwr.simulation') or m == 'ray']; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_flower_thread_pool_limit_is_lifted_in_process_and_named_under_flwr_run(monkeypatch):
    # Flower's simulation hands messages to ClientApps from a default-size thread pool: min(32, CPUs + 4)
    # at once. A direct-data-plane epoch needs all G + 1; on 2 cores G = 8 guests never all connected.
    import os
    from concurrent.futures import ThreadPoolExecutor

    from flwr.server.superlink.fleet.vce import vce_api

    from fl_split.errors import ConfigError
    from fl_split.flower import resources

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert resources.flower_worker_threads() == 6
    resources.check_worker_threads(5)  # 6 ClientApps fit
    with pytest.raises(ConfigError) as err:
        resources.check_worker_threads(8)
    msg = str(err.value)
    assert "min(32, CPUs + 4) = 6" in msg and "all 9" in msg and "--data-plane flower" in msg and "guests" in msg
    # the in-process engine widens the pool while its simulation runs, and restores it
    assert vce_api.ThreadPoolExecutor is ThreadPoolExecutor and not resources.pool_widened_here()
    with resources.widened_worker_pool(9) as widened:
        assert widened and resources.pool_widened_here()
        with vce_api.ThreadPoolExecutor() as pool:
            assert pool._max_workers == 9
    assert vce_api.ThreadPoolExecutor is ThreadPoolExecutor and not resources.pool_widened_here()
    with resources.widened_worker_pool(4) as widened:
        assert not widened
