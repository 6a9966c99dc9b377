"""Issue 16: what an unauthenticated peer that knows the host's data-plane address can make the host
hold — bytes, streams, seconds, refusal records and log lines — and whom the host blames.

Everything runs real gRPC on loopback. The flooding peers run in their own processes (a silent-stream
flood uses ``grpc.aio``: thousands of streams without a thread each) with a bounded number of
streams in flight and a bounded time; the host whose memory is measured runs in its own process so
that its ``VmHWM`` (peak resident memory, ``/proc/PID/status``) is its own.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from fl_split.dataplane import frames as F
from fl_split.dataplane import limits as L
from fl_split.dataplane.errors import FloodError, PeerFailure
from fl_split.dataplane.host import METHOD, HostEndpoint
from tests.test_dataplane import KEYS, SESSION, _guest_thread, _rogue, _rounds, host_keys

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20

pytestmark = pytest.mark.usefixtures("flower_task_identity")


# ------------------------------------------------------------------------------------------------
# the flooding peer (:func:`tests.floodpeer.silent_flood`, in its own process)


class Flood:
    """A :func:`silent_flood` in a child process; :attr:`lines` are its JSON lines as they arrive."""

    def __init__(self, address: str, total: int, concurrency: int, rate: float, hold: float = 15.0,
                 budget: float = 120.0) -> None:
        code = (f"from tests.floodpeer import silent_flood; "
                f"silent_flood({address!r}, {total}, {concurrency}, {hold}, {budget}, {rate})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        self.progress = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.progress:
                self.lines.append(json.loads(line))
                self.progress.notify_all()

    @property
    def opened(self) -> int:
        return self.lines[-1]["opened"] if self.lines else 0

    def wait_opened(self, n: int, timeout: float) -> None:
        with self.progress:
            self.progress.wait_for(lambda: self.opened >= n or self.proc.poll() is not None, timeout)

    def result(self, timeout: float = 240.0) -> dict:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        time.sleep(0.1)  # the reader thread takes the last line
        return self.lines[-1]


# ------------------------------------------------------------------------------------------------
# bytes


_HOST = """
import json, sys
from fl_split.dataplane import frames as F
from fl_split.dataplane.host import HostEndpoint

def status():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            d[k] = int(v.split()[0]) * 1024
    return d

keys = F.LinkKeys(bytes.fromhex(sys.argv[1]), {"guest-1": sys.argv[2]})
ep = HostEndpoint(["guest-1"], keys, sys.argv[3], "127.0.0.1:0", timeout=60, max_frame=1 << 20)
print(json.dumps({"address": ep.address, **status()}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "status":
        print(json.dumps({**status(), "kinds": dict(ep.refusals.kinds), "links": len(ep._links)}), flush=True)
    elif cmd == "round":
        ep.wait_for_guests()
        ep.send("guest-1", F.STEP, {"round": 1, "keys": [["train", 1, 0]]})
        out, failed, errors = ep.collect(1, ["guest-1"])
        print(json.dumps({"out": {g: [b.decode() for b in v] for g, v in out.items()}, "failed": failed}), flush=True)
    else:
        break
ep.close()
"""


class _HostProcess:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOST, KEYS["host"].hex(), F.public_key(KEYS["guest-1"]), SESSION], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.first = json.loads(self.proc.stdout.readline())
        self.address = self.first["address"]

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def _send_raw(address: str, messages, timeout: float = 60.0) -> grpc.RpcError | None:
    """Send ``messages`` (one gRPC message each) on one stream, without any handshake."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                      ("grpc.max_receive_message_length", -1)])
    try:
        for _ in channel.stream_stream(METHOD)(iter(messages), timeout=timeout):
            pass
    except grpc.RpcError as exc:
        return exc
    finally:
        channel.close()
    return None


def test_an_unauthenticated_300_mb_frame_does_not_grow_the_host():
    """A 300 MB HELLO as one gRPC message (the issue's attack: +0.9-1.2 GB of RSS with the old
    2 GiB limit), and 300 MB of pieces before any handshake: the host's peak resident memory
    (VmHWM) stays within 64 MB of its resident memory before the attack; each is refused, the host's
    links are unchanged, and the real guest then joins and plays a round."""
    host = _HostProcess()
    try:
        assert _rogue(host.address, "guest-1").code() == grpc.StatusCode.UNAUTHENTICATED  # warm-up
        before = host.ask("status")
        big = F.pack(F.HELLO, {"party": "guest-1", "session": SESSION, "nonce": "00" * 16}, [bytes(300 * MB)])
        err = _send_raw(host.address, [big])
        # gRPC refuses it from its length prefix ("larger than max"), unless the client took longer
        # than the handshake deadline to start sending it (copying 300 MB on a loaded machine)
        assert err is not None and err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        view = memoryview(big)
        err = _send_raw(host.address, (b"\x00" + view[i: i + L.PIECE_BYTES] for i in range(0, len(big), L.PIECE_BYTES)))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"a handshake frame has at most {L.HANDSHAKE_FRAME_BYTES} bytes (refused before it was parsed)" in err.details()
        del big, view
        after = host.ask("status")
        assert after["VmHWM"] - before["VmRSS"] < 64 * MB, (before, after)
        assert after["links"] == 0 and after["kinds"].get("oversized") == 1
        t, out = _guest_thread("guest-1", host.address)
        got = host.ask("round")
        t.join(30)
        assert got == {"out": {"guest-1": ["guest-1:1:0"]}, "failed": {}}
    finally:
        host.stop()


def test_a_16_mib_header_is_refused_without_parsing(monkeypatch):
    """A HELLO whose JSON header is 16 MiB (the old MAX_HEADER; 355 ms of parsing) is refused by the
    transport from its length; one of 100 KB, under the gRPC limit, by the handshake cap — neither
    reaches the frame parser, and the real guest then joins as if nothing happened."""
    parsed = []
    unpack = F.unpack
    monkeypatch.setattr(F, "unpack", lambda data, *a, **k: parsed.append(len(data)) or unpack(data, *a, **k))
    with HostEndpoint(["guest-1"], host_keys(("guest-1",)), SESSION, "127.0.0.1:0", timeout=20) as ep:
        huge = F.pack(F.HELLO, {"party": "guest-1", "session": SESSION, "nonce": "00" * 16, "pad": "x" * (16 * MB)})
        err = _send_raw(ep.address, [huge])
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.details()
        mid = F.pack(F.HELLO, {"party": "guest-1", "session": SESSION, "nonce": "00" * 16, "pad": "x" * 100_000})
        err = _send_raw(ep.address, [mid])
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sent a {len(mid)}-byte message before authenticating" in err.details()
        assert parsed == []
        t, out = _guest_thread("guest-1", ep.address)
        ep.wait_for_guests()
        assert _rounds(ep, 1)[0] == {"guest-1": [b"guest-1:1:0"]}
        assert set(ep._links) == {"guest-1"} and ep.refusals.kinds["oversized"] >= 1
    t.join(10)


def test_an_authenticated_frame_over_the_plan_limit_is_refused_before_it_is_buffered():
    """After the handshake a frame may be as large as the run's plan allows, not 2 GiB: a guest that
    sends more (here 8 MB against a 64 KiB plan) is refused, named, and dropped; nothing reaches the
    host's round."""
    with HostEndpoint(["guest-1"], host_keys(("guest-1",)), SESSION, "127.0.0.1:0", timeout=10, max_frame=64 * 1024) as ep:
        def oversized(secrets):
            return F.Sealer(secrets.to_host).seal(F.RELEASE, {"round": 1}, [bytes(8 * MB)])

        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("err", _rogue(ep.address, "guest-1", KEYS["guest-1"], after=oversized)),
                             daemon=True)
        t.start()
        ep.wait_for_guests()
        ep.send("guest-1", F.STEP, {"round": 1, "keys": [["train", 1, 0]]})
        out, failed, errors = ep.collect(1, ["guest-1"])
        assert out == {} and not errors
        assert failed["guest-1"].startswith("data plane: refused a data-plane frame from guest-1: more than 65536 bytes, "
                                            "the largest frame this run's plan allows")
    t.join(10)


def test_largest_frame_follows_the_plan_and_a_whole_epoch_round_fits(monkeypatch):
    """The host's and the guests' frame limit comes from the run's plan (batch size, cut width,
    batches per round, the test split): a run with a whole epoch per round — the largest frames a
    run sends — equals the local engine, and every frame is within the limit and not far below it."""
    from fl_split.flower.strategy import VerticalSplitStrategy
    from fl_split.schedule import BatchSchedule
    from tests.test_flower import InlineGrid, _cfg, _local, _simulation_nodes, _strip

    s = BatchSchedule(n_train=1000, n_test=300, batch_size=32, seed=1)
    one = L.largest_frame(s, 1, [(16,)])
    assert L.largest_frame(s, 4, [(16,)]) > one and L.largest_frame(s, 1, [(16,), (64,)]) > one
    assert L.largest_frame(s, "epoch", [(16,)]) >= 4 * 1000 * 16  # every training row of one guest

    seen: dict = {}
    add = L.Assembler.add

    def recording(self, piece):
        frame = add(self, piece)
        if frame is not None:
            seen.setdefault(self.limit, []).append(len(frame))
        return frame

    monkeypatch.setattr(L.Assembler, "add", recording)
    cfg = _cfg(epochs=1, batches_per_round="epoch")
    assert _strip(VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3)))) == _strip(_local(cfg))
    assert seen and max(len(v) for v in seen.values()) > 1
    for limit, sizes in seen.items():
        assert max(sizes) <= limit < 2 * max(sizes) + 2 * L.FRAME_SLACK, (limit, max(sizes))


# ------------------------------------------------------------------------------------------------
# streams and seconds


def test_4000_silent_streams_do_not_lock_the_guests_out(caplog):
    """The issue's attack: streams that open and send nothing and hold on for 15 s (3,990 in 26 s
    made both guests fail with RESOURCE_EXHAUSTED). 4,000 of them, 200 per second and at most 200 at
    a time, from the guests' own address (loopback: the per-address share protects nobody here, only
    eviction does): the guests connect while the flood runs — with the old 10 s deadline and
    guests + 8 slots they got in only once it stopped — and play three rounds; the refusal records
    and log lines stay bounded."""
    caplog.set_level(logging.WARNING, logger="fl_split.dataplane")
    t0 = time.monotonic()
    with HostEndpoint(["guest-1", "guest-2"], host_keys(("guest-1", "guest-2")), SESSION, "127.0.0.1:0", timeout=60) as ep:
        flood = Flood(ep.address, total=4000, concurrency=200, rate=200)
        try:
            flood.wait_opened(500, 120)
            threads = [_guest_thread(g, ep.address, timeout=60) for g in ep.guests]
            ep.wait_for_guests()
            during = flood.opened
            got = _rounds(ep, 3)
        finally:
            summary = flood.result()
        assert len(ep._pool) <= ep._pool.capacity
        assert len(ep.refused) <= L.RECENT_REFUSALS and len(ep.refusals.addresses) <= L.MAX_ADDRESSES + 1
        refusals = ep.refusals
    for t, out in threads:
        t.join(20)
        assert out.get("served") is not None and out["served"].steps == 3, out
    assert got[2] == {"guest-1": [b"guest-1:3:1"], "guest-2": [b"guest-2:3:1"]}
    assert summary["opened"] == 4000 and during < 4000, summary  # the guests connected during the flood
    assert sum(summary["codes"].values()) == 4000
    assert refusals.anonymous >= 1000 and refusals.kinds["evicted"] >= 1000, refusals.describe()
    lines = [r for r in caplog.records if r.name == "fl_split.dataplane" and "refused" in r.getMessage()]
    elapsed = time.monotonic() - t0
    assert len(lines) <= L.LOG_FIRST + elapsed / L.LOG_EVERY + 2, len(lines)
    assert any("more connection(s)" in r.getMessage() and "ipv4:127.0.0.1 (" in r.getMessage() for r in lines)


def test_eviction_takes_the_oldest_silent_stream_of_the_busiest_address():
    class M:
        def __init__(self, address, spoke=False):
            self.address, self.spoke = address, spoke

    pool = L.Admission(capacity=4, per_address=3)
    a1, a2, b1 = M("A", spoke=True), M("A"), M("B")
    for m in (a1, a2, b1):
        assert pool.admit(m) is None
    a3 = M("A")
    assert pool.admit(a3) is None and len(pool) == 4
    assert pool.admit(M("C")) is a2        # full: the busiest address loses its oldest silent stream
    a4 = M("A")
    assert pool.admit(a4) is a3            # A is still the busiest
    assert pool.admit(M("B")) is a4        # and again: its speaking stream a1 is spared
    assert not pool.leave(a3) and pool.leave(b1) and pool.leave(a1)
    small = L.Admission(capacity=10, per_address=2)
    x1, x2, y1 = M("X"), M("X"), M("Y")
    for m in (x1, x2, y1):
        assert small.admit(m) is None
    assert small.admit(M("X")) is x1 and len(small) == 3  # X at its share: its own oldest goes, not Y's


def test_refusal_records_and_log_lines_stay_bounded(monkeypatch, caplog):
    """100,000 refusals from 1,000 addresses over ten simulated minutes: counters exact, at most
    MAX_ADDRESSES addresses and RECENT_REFUSALS messages kept, LOG_FIRST lines and then one summary
    per LOG_EVERY seconds."""
    now = [1000.0]
    monkeypatch.setattr(L.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.WARNING, logger="fl_split.dataplane")
    r = L.Refusals(logging.getLogger("fl_split.dataplane"))
    for i in range(100_000):
        now[0] += 0.006
        r.record(f"a connection from ipv4:10.0.{i % 1000 // 256}.{i % 256}:1: silent", f"ipv4:10.0.{i % 1000}",
                 "silent" if i % 2 else "evicted", named=i % 10 == 0)
    r.flush()
    assert (r.total, r.anonymous, r.kinds["silent"]) == (100_000, 90_000, 50_000)
    assert len(r.addresses) == L.MAX_ADDRESSES + 1 and sum(r.addresses.values()) == 100_000
    assert len(r.recent) == L.RECENT_REFUSALS
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) <= L.LOG_FIRST + 600 / L.LOG_EVERY + 2
    assert lines[L.LOG_FIRST].startswith("data plane: refused ") and "more connection(s) in the last 10 s" in lines[L.LOG_FIRST]


# ------------------------------------------------------------------------------------------------
# blame


def test_the_blame_names_the_flood_not_the_guest():
    """guest-2 connects, guest-1 never does, while silent streams flood the host: the error is a
    FloodError naming the flood (how many, which kinds, from where), not 'guest-1 failed'. Without
    a flood the missing guest is named as before; a connection claiming guest-1 with another key is
    guest-1's own refusal, not a flood."""
    with HostEndpoint(["guest-1", "guest-2"], host_keys(("guest-1", "guest-2")), SESSION, "127.0.0.1:0", timeout=4) as ep:
        flood = Flood(ep.address, total=600, concurrency=60, rate=100, budget=20)
        flood.wait_opened(100, 60)
        t, out = _guest_thread("guest-2", ep.address, timeout=30)
        with pytest.raises(FloodError) as err:
            ep.wait_for_guests()
        flood.result()
    msg = str(err.value)
    assert not isinstance(err.value, PeerFailure)
    assert msg.startswith("guest-1 did not connect to the host's data plane at 127.0.0.1:")
    assert "unauthenticated connection(s) that never named a guest of this run" in msg
    assert "ipv4:127.0.0.1 (" in msg and "evicted" in msg and "not in itself a failure of guest-1" in msg
    t.join(10)
    with HostEndpoint(["guest-1"], host_keys(("guest-1",)), SESSION, "127.0.0.1:0", timeout=1) as ep:
        with pytest.raises(PeerFailure, match=r"guest-1 did not connect .* within 1 s \(--dataplane-timeout\)$") as e:
            ep.wait_for_guests()
        assert e.value.party == "guest-1"
    with HostEndpoint(["guest-1"], host_keys(("guest-1",)), SESSION, "127.0.0.1:0", timeout=2) as ep:
        _rogue(ep.address, "guest-1")
        with pytest.raises(PeerFailure, match=r"refused 1 connection\(s\): guest-1 \(connecting from .*failed to prove "
                                              r"it is guest-1") as e:
            ep.wait_for_guests()
        assert e.value.party == "guest-1" and ep.refusals.anonymous == 0


def test_refused_floods_during_a_run_leave_the_host_unchanged(monkeypatch):
    """While a whole run is on, its data-plane address gets silent streams, oversized and malformed
    handshakes and a wrong credential: each is refused and recorded, and the run — the host's
    training, metrics, ledgers, wire counts — is exactly the local engine's."""
    from fl_split.dataplane import host as host_mod
    from fl_split.dataplane import rendezvous
    from fl_split.flower.strategy import VerticalSplitStrategy
    from tests.test_flower import InlineGrid, _cfg, _local, _simulation_nodes, _strip

    endpoints: list = []
    floods: list = []

    class Recording(host_mod.HostEndpoint):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            endpoints.append(self)

    monkeypatch.setattr(host_mod, "HostEndpoint", Recording)
    publish = rendezvous.ProcessBoard.publish

    def publish_and_attack(self, session, address):
        publish(self, session, address)
        floods.append(Flood(address, total=200, concurrency=50, rate=100, budget=20))
        _send_raw(address, [bytes(300 * 1024)])                       # over the gRPC limit
        _send_raw(address, [F.pack(F.HELLO, {"pad": "x" * 20_000})])  # over the handshake cap
        _send_raw(address, [b"garbage"])                              # malformed
        _rogue(address, "guest-1", session=session)                  # not guest-1's key

    monkeypatch.setattr(rendezvous.ProcessBoard, "publish", publish_and_attack)
    cfg = _cfg(epochs=1, defense="laplace", protect="both", epsilon=50.0)
    try:
        got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3)))
    finally:
        for f in floods:
            f.result()
    assert _strip(got) == _strip(_local(cfg))
    kinds = Counter()
    for ep in endpoints:
        kinds.update(ep.refusals.kinds)
    assert kinds["oversized"] >= 1 and kinds["malformed"] >= 1 and kinds["credential"] >= 1, kinds
