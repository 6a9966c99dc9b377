"""One identity per party on the data plane (issue 16): a party can pose neither as another guest nor
as the host, the simulation's data plane is not plaintext, and no data-plane secret passes through
Flower (design, privacy principles 7 and 8).

Every attack runs over real gRPC on loopback (the pieces the parties run) or through the real
strategy and ClientApp handlers of an inline run; each asserts the refusal *and* that nothing
changed: the attacked party released nothing (its step was never called) or the whole run equals
the local engine's, privacy ledgers included.
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch

from fl_split.dataplane import frames as F
from fl_split.dataplane.errors import DataPlaneError, PeerFailure
from fl_split.dataplane.guest import serve
from fl_split.dataplane.host import HostEndpoint
from fl_split.dataplane.tls import ClientTLS, ServerTLS
from fl_split.flower.strategy import VerticalSplitStrategy
from tests.test_dataplane import KEYS, SESSION, _echo, _guest_thread, _rogue, _rounds, guest_keys, host_keys
from tests.test_dataplane import tls  # noqa: F401 - fixture: certificates
from tests.test_flower import InlineGrid, _cfg, _local, _simulation_nodes, _strip


pytestmark = pytest.mark.usefixtures("flower_task_identity")



def _counting(party: str):
    """An echo step that counts its calls: a party that released nothing was never asked to."""
    calls = []

    def step(owed, keys, r):
        calls.append(r)
        return _echo(party)(owed, keys, r)

    return step, calls


# ------------------------------------------------------------------------------------------------
# a guest posing as another guest


def test_guest_1_with_its_own_key_claiming_guest_2_is_refused_and_guest_2_still_connects():
    """guest-1 holds its own private key (and, being a guest of the run, the host's public key and
    the session): it claims to be guest-2. Its proof cannot match guest-2's public key, so the host
    refuses it (UNAUTHENTICATED, named) before reading anything it sent and files no link; the real
    guest-2 then connects and the rounds go on with the real guests' releases."""
    with HostEndpoint(["guest-1", "guest-2"], host_keys(["guest-1", "guest-2"]), SESSION, "127.0.0.1:0",
                      timeout=10) as ep:
        err = _rogue(ep.address, "guest-2", KEYS["guest-1"])
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "guest-2 (connecting from" in err.details() and "failed to prove it is guest-2" in err.details()
        assert ep._links == {} and len(ep.refused) == 1
        threads = [_guest_thread(g, ep.address) for g in ("guest-1", "guest-2")]
        ep.wait_for_guests()
        got = _rounds(ep, 2)
    for t, _ in threads:
        t.join(10)
    assert got[1] == {"guest-1": [b"guest-1:2:1"], "guest-2": [b"guest-2:2:1"]}
    assert [out["served"].steps for _, out in threads] == [2, 2]


def test_guest_1_claiming_guest_2_during_a_run_changes_nothing(monkeypatch):
    """The same attack inside a run: as soon as the host publishes its data plane, guest-1 — with
    the private key its own node made at setup and the session it was sent — connects as guest-2.
    It is refused, the real guest-2 connects, and the run (every epoch, every ledger) is exactly the
    local engine's: the refusal spent no budget and changed no party."""
    from fl_split.dataplane import rendezvous
    from fl_split.flower.direct import KEY_STATE

    grid = InlineGrid(_simulation_nodes(3))
    refused: list = []
    publish = rendezvous.ProcessBoard.publish

    def publish_and_attack(self, session, address):
        publish(self, session, address)
        own = bytes(grid.contexts[grid.ids[1]].state.config_records[KEY_STATE]["private"])  # guest-1's
        assert F.public_key(own) != F.public_key(bytes(grid.contexts[grid.ids[2]].state.config_records[KEY_STATE]
                                                       ["private"]))
        refused.append(_rogue(address, "guest-2", own, session=session, host_public=_host_public(grid)))

    monkeypatch.setattr(rendezvous.ProcessBoard, "publish", publish_and_attack)
    cfg = _cfg(epochs=2, defense="laplace", epsilon=50.0)
    got = VerticalSplitStrategy(cfg).run(grid)
    want = _local(cfg)
    assert _strip(got) == _strip(want)
    assert got["privacy"] == want["privacy"]
    assert len(refused) == 2  # one per epoch message
    assert all(e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED
               and "failed to prove it is guest-2" in e.details() for e in refused)


def _host_public(grid) -> str:
    from fl_split.flower.direct import KEY_STATE

    return F.public_key(bytes(grid.contexts[grid.ids[0]].state.config_records[KEY_STATE]["private"]))


# ------------------------------------------------------------------------------------------------
# a guest posing as the host


def test_a_guest_posing_as_the_host_is_refused_by_the_other_guest():
    """guest-1 listens as if it were the host (its own private key, guest-2's public key, the
    session: all it has) and guest-2 is sent to it (e.g. a forged rendezvous address). guest-2
    checks the host's proof against the host's public key before it answers: it refuses guest-1,
    naming it as not the host, and never runs a step — nothing is released."""
    fake = F.LinkKeys(KEYS["guest-1"], {"guest-2": F.public_key(KEYS["guest-2"])})
    step, calls = _counting("guest-2")
    with HostEndpoint(["guest-2"], fake, SESSION, "127.0.0.1:0", timeout=5) as ep:
        with pytest.raises(PeerFailure, match=r"guest-2 refused the data-plane peer: the host at 127\.0\.0\.1:\d+ "
                                              r"failed to prove it is the host"):
            serve("guest-2", step, ep.address, guest_keys("guest-2"), SESSION, None, 5)
        assert ep._links == {}  # guest-2 never sent its proof: the impostor holds no link to it
    assert calls == []


def test_a_guest_certificate_cannot_serve_as_the_hosts(tls):
    """With TLS a guest requires the server's certificate to name ``host``: a server certificate of
    the same CA issued for the machine's names but not to the party ``host`` does not open it."""
    wrong = ServerTLS.from_files(str(tls["nothost_cert"]), str(tls["nothost_key"]))
    step, calls = _counting("guest-1")
    with HostEndpoint(["guest-1"], host_keys(["guest-1"]), SESSION, "127.0.0.1:0", tls=wrong, timeout=5) as ep:
        with pytest.raises(PeerFailure, match=r"guest-1 refused the data-plane peer at 127\.0\.0\.1:\d+: its TLS "
                                              r"certificate does not name 'host'"):
            serve("guest-1", step, ep.address, guest_keys("guest-1"), SESSION, ClientTLS.from_files(str(tls["ca"])), 2)
    assert calls == []


# ------------------------------------------------------------------------------------------------
# mutual TLS: certificate name = party name


def test_mutual_tls_certificate_named_guest_1_claiming_guest_2_is_refused(tls):
    """Under mutual TLS the host checks the client certificate names the party of HELLO: guest-1's
    certificate claiming guest-2 is refused even with guest-2's private key (a leaked key alone
    does not make a guest-2); the real guests with their own certificates then run."""
    server = ServerTLS.from_files(str(tls["host_cert"]), str(tls["host_key"]), str(tls["ca"]))
    client = {g: ClientTLS.from_files(str(tls["ca"]), str(tls[f"{n}_cert"]), str(tls[f"{n}_key"]))
              for g, n in (("guest-1", "guest"), ("guest-2", "guest2"))}
    step, calls = _counting("guest-2")
    with HostEndpoint(["guest-1", "guest-2"], host_keys(["guest-1", "guest-2"]), SESSION, "127.0.0.1:0",
                      tls=server, timeout=10) as ep:
        with pytest.raises(PeerFailure, match=r"refused guest-2's data-plane connection \(UNAUTHENTICATED: "
                                              r"guest-2 \(connecting from .*its client certificate names guest-1, "
                                              r"not guest-2"):
            serve("guest-2", step, ep.address, guest_keys("guest-2"), SESSION, client["guest-1"], 5)
        assert calls == [] and ep._links == {}
        threads = [_guest_thread(g, ep.address, tls=client[g]) for g in ("guest-1", "guest-2")]
        ep.wait_for_guests()
        assert _rounds(ep, 1)[0] == {"guest-1": [b"guest-1:1:0"], "guest-2": [b"guest-2:1:0"]}
    for t, out in threads:
        t.join(10)
        assert out["served"].steps == 1


def test_mutual_tls_is_on_by_default_where_certificates_exist(tls):
    """A deployment host with a certificate requires the guests' certificates unless told otherwise;
    a guest with the CA must present its own certificate. Errors name the node-config key."""
    from fl_split.flower import direct
    from fl_split.flower.node import NodeRole

    host = {"dataplane-address": "127.0.0.1:1", "dataplane-certfile": str(tls["host_cert"]),
            "dataplane-keyfile": str(tls["host_key"])}
    with pytest.raises(DataPlaneError, match=r"host node-config: no dataplane-client-ca \(or dataplane-ca\); the "
                                             r"data plane uses mutual TLS by default"):
        direct._server_tls(host)
    assert direct._server_tls({**host, "dataplane-ca": str(tls["ca"])}).client_ca is not None
    assert direct._server_tls({**host, "dataplane-client-ca": str(tls["ca"])}).client_ca is not None
    assert direct._server_tls({**host, "dataplane-mutual-tls": "false"}).client_ca is None
    role = NodeRole(role="guest", party="guest-1", guest_index=1, mode="deployment", data_path="")
    with pytest.raises(DataPlaneError, match=r"guest-1 node-config: no dataplane-certfile / dataplane-keyfile; the "
                                             r"data plane uses mutual TLS by default"):
        direct.check_guest_node(role, {"dataplane-ca": str(tls["ca"])})
    direct.check_guest_node(role, {"dataplane-ca": str(tls["ca"]), "dataplane-mutual-tls": False})
    direct.check_guest_node(role, {"dataplane-ca": str(tls["ca"]), "dataplane-certfile": str(tls["guest_cert"]),
                                   "dataplane-keyfile": str(tls["guest_key"])})


def test_issued_certificates_name_the_parties(tmp_path):
    """``fl-split certs`` / ``deploy local``: the data-plane server certificate names ``host``, each
    client certificate its party."""
    from cryptography import x509

    from fl_split.certs import write_deployment_certificates

    files = write_deployment_certificates(tmp_path, clients=["guest-1", "guest-2"])

    def names(path):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return cert.subject.rfc4514_string(), san.get_values_for_type(x509.DNSName)

    assert names(files["dataplane-host_cert"]) == ("CN=host", ["host", "localhost"])
    assert names(files["guest-2_cert"]) == ("CN=guest-2", ["guest-2"])


# ------------------------------------------------------------------------------------------------
# the simulation's data plane is not plaintext


class _Recorder:
    """A TCP proxy on loopback that forwards to ``target`` and keeps every byte it carries."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.data = bytearray()
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    self.data += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_what_crosses_the_simulation_plane_is_not_plaintext():
    """The simulation's data plane has no TLS: a process on the network that records the bytes
    between guest and host finds neither a release's float32 activations nor the host's gradients
    in them (every frame after the handshake is sealed). The recording is checked in 16-byte
    windows: a window of random float32 bytes recurring by chance has probability ~2^-128."""
    torch.manual_seed(0)
    acts = torch.randn(64, 16).numpy().tobytes()
    grads = torch.randn(64, 16).numpy().tobytes()
    with HostEndpoint(["guest-1"], host_keys(["guest-1"]), SESSION, "127.0.0.1:0", timeout=10) as ep:
        proxy = _Recorder(ep.address)
        t, out = _guest_thread("guest-1", proxy.address, step=lambda owed, keys, r: [acts])
        ep.wait_for_guests()
        for r in (1, 2):
            ep.send("guest-1", F.STEP, {"round": r, "keys": [["train", 1, r - 1]]}, [grads])
            got, failed, _ = ep.collect(r, ["guest-1"])
            assert not failed and got["guest-1"] == [acts]
    t.join(10)
    proxy.close()
    seen = bytes(proxy.data)
    assert len(seen) > 2 * (len(acts) + len(grads))  # the proxy did carry both rounds
    for blob in (acts, grads):
        assert not any(blob[i:i + 16] in seen for i in range(0, len(blob), 16))
    assert b'"round"' not in seen and b"train" not in seen  # the headers are sealed too


# ------------------------------------------------------------------------------------------------
# no secret in Flower's records


class _AuditedGrid(InlineGrid):
    """An inline grid that keeps the serialised bytes of every message the coordinator sends and
    every reply it receives (what a SuperLink would store)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.wire: list[bytes] = []
        self.keys: set[str] = set()

    def _record(self, m) -> None:
        from flwr.common.serde import message_to_proto

        self.wire.append(message_to_proto(m).SerializeToString())
        for rec in m.content.config_records.values():
            self.keys.update(rec.keys())

    def push_messages(self, messages):  # noqa: D102
        messages = list(messages)
        for m in messages:
            self._record(m)
        return super().push_messages(messages)

    def _answer(self, m):
        reply = super()._answer(m)
        self._record(reply)
        return reply


def test_no_data_plane_secret_is_in_any_flower_message(monkeypatch):
    """Audit every record of a direct-plane run, both ways: no party's private key (raw or hex), no
    link secret of any handshake (proof key, direction keys), no 'credential' field — only public
    keys and the (public) session identifiers pass through the coordinator."""
    from fl_split.flower.direct import KEY_STATE

    derived: list = []
    link_secrets = F.link_secrets

    def recording(*a, **k):
        out = link_secrets(*a, **k)
        derived.append(out)
        return out

    monkeypatch.setattr(F, "link_secrets", recording)
    cfg = _cfg(epochs=2, epochs_per_message=1)
    grid = _AuditedGrid(_simulation_nodes(3))
    got = VerticalSplitStrategy(cfg).run(grid)
    assert _strip(got) == _strip(_local(cfg))
    assert len(derived) == 2 * 2 * 2  # per epoch message, each guest and the host derive one link's secrets
    secrets = []
    for ctx in grid.contexts.values():
        private = bytes(ctx.state.config_records[KEY_STATE]["private"])
        secrets += [private, private.hex().encode()]
    for s in derived:
        for k in (s.proof_key, s.to_guest, s.to_host):
            secrets += [k, k.hex().encode()]
    wire = b"".join(grid.wire)
    assert wire and all(s not in wire for s in secrets)
    assert not any("credential" in k for k in grid.keys)
    # the public keys did travel: each party's, as its setup reply gave it
    for ctx in grid.contexts.values():
        assert F.public_key(bytes(ctx.state.config_records[KEY_STATE]["private"])).encode() in wire
