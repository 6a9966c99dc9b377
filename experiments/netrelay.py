"""A userspace TCP relay that adds a one-way delay, for emulating a link's round-trip time.

``tc netem`` (the kernel's delay emulator) is not available on the benchmark machine (no
``sch_netem`` module); ``tc … tbf`` (rate) is. :class:`DelayRelay` supplies the delay: it accepts TCP
connections on one address and opens one to a target for each, and forwards every chunk it reads
``one_way_s`` seconds after reading it, in each direction, in order. A request and its answer
therefore cross the relay with at least ``2 * one_way_s`` added: the round-trip time of the
emulated link. Bytes are never changed, merged out of order or dropped; an end of stream (EOF) is
forwarded after the same delay, as a half-close.

What it does not emulate (stated with the benchmark's numbers, experiments/README.md):

* It terminates TCP (two connections per link, "split TCP"): the endpoints' congestion windows and
  TCP acknowledgements see the loopback/veth leg, not the delayed path. Application-level round
  trips (gRPC/HTTP/2 frames, TLS handshakes, HTTP/2 window updates, the data plane's STEP/RELEASE)
  all cross the relay and are delayed; TCP slow start over the delayed path is not. With the
  per-round messages of a split-learning step (kilobytes) that difference is small; it is not for
  bulk transfers far larger than the initial congestion window (10 segments).
* No loss, no jitter beyond the relay's own scheduling (measured at 0 ms, see the benchmark).
* At most ``max_queued`` chunks wait per direction: a reader ahead of a slow writer stops reading,
  so TCP back-pressure still reaches the sender (the relay does not absorb unbounded data).

Threads, not asyncio: the event loop's selector rounds every timeout up to whole milliseconds (epoll),
which turned a 1 ms RTT into 2.4-3.2 ms; ``time.sleep`` wakes within ~0.1 ms of the due time on an
idle machine. Per connection, each direction has a reader thread (stamps each chunk with when it
is due) and a writer thread (forwards it then); :meth:`set_delay` may be called from any thread and
applies to the bytes read from then on.
"""

from __future__ import annotations

import queue
import socket
import socketserver
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field

#: bytes read per chunk
CHUNK = 64 * 1024
#: bytes of the link check's transfer each way
PROBE_BYTES = 1_000_000


@dataclass
class RelayStats:
    connections: int = 0
    bytes_forward: int = 0   # client -> target
    bytes_backward: int = 0  # target -> client
    errors: list[str] = field(default_factory=list)


class DelayRelay:
    """Listen on ``listen`` (``(host, port)``; port 0: any free port) and relay every connection to
    ``target`` with ``one_way_s`` seconds held in each direction."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], one_way_s: float = 0.0,
                 max_queued: int = 64) -> None:
        self.listen = listen
        self.target = target
        self.set_delay(one_way_s)
        self.max_queued = int(max_queued)
        self.stats = RelayStats()
        self.address: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._closed = False

    # -- control (any thread) ---------------------------------------------------------------------
    def set_delay(self, one_way_s: float) -> None:
        if one_way_s < 0:
            raise ValueError(f"one-way delay {one_way_s} s: must be >= 0")
        self.one_way_s = float(one_way_s)

    def start(self) -> tuple[str, int]:
        """Start listening; returns the address bound."""
        self._server = socket.create_server(self.listen, reuse_port=False)
        self.address = self._server.getsockname()[:2]
        threading.Thread(target=self._accept, name=f"delay-relay-{self.address[1]}", daemon=True).start()
        return self.address

    def close(self) -> None:
        """Stop listening and cut every relayed connection."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        with self._lock:
            live = list(self._open)
        for s in live:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "DelayRelay":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the threads ------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def _connection(self, client: socket.socket) -> None:
        with self._lock:
            self.stats.connections += 1
        try:
            target = socket.create_connection(self.target, timeout=30)
            target.settimeout(None)
        except OSError as exc:
            with self._lock:
                self.stats.errors.append(f"connect {self.target}: {exc}")
            client.close()
            return
        for s in (client, target):  # a delayed small write must not wait for Nagle on top
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._open.update((client, target))
        pipes = [threading.Thread(target=self._pipe, args=(a, b, counter), daemon=True)
                 for a, b, counter in ((client, target, "bytes_forward"), (target, client, "bytes_backward"))]
        for t in pipes:
            t.start()
        for t in pipes:
            t.join()
        with self._lock:
            self._open.difference_update((client, target))
        client.close()
        target.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        """One direction: this thread reads and stamps each chunk with when it is due, a writer
        thread forwards it then; an end of stream (or a broken source) is forwarded as a half-close."""
        chunks: queue.Queue = queue.Queue(self.max_queued)  # full: the reader stops reading (back-pressure)
        broken = threading.Event()

        def write() -> None:
            while True:
                due, data = chunks.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    with self._lock:
                        setattr(self.stats, counter, getattr(self.stats, counter) + len(data))  # handed on
                    dst.sendall(data)
                except OSError:
                    broken.set()
                    try:  # the other side is gone: stop this direction's reader too
                        src.shutdown(socket.SHUT_RD)
                    except OSError:
                        pass
                    return

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            if broken.is_set():
                break
            while True:  # a full queue behind a dead writer must not block this thread forever
                try:
                    chunks.put((time.monotonic() + self.one_way_s, data), timeout=0.5)
                    break
                except queue.Full:
                    if broken.is_set():
                        break
            if not data or broken.is_set():
                break
        writer.join()


# -- the link check: an echo/sink server on the host's side, a probe on the guest's --------------
class ProbeHandler(socketserver.BaseRequestHandler):
    """Requests ``mode (1 byte) + length (8 bytes)``: E = echo that many bytes, U = read them and
    answer one byte, D = send that many bytes."""

    def handle(self) -> None:
        s = self.request
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = _recv_exact(s, 9)
            if head is None:
                return
            mode, n = head[:1], struct.unpack("<Q", head[1:])[0]
            if mode == b"D":
                s.sendall(bytes(n))
                continue
            data = _recv_exact(s, n)
            if data is None:
                return
            s.sendall(data if mode == b"E" else b"k")


def _recv_exact(s, n: int):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def probe(address: str, pings: int = 15) -> dict:
    """Round trip of a 64-byte echo (median of ``pings``) and 1 MB each way, through the link."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            s.sendall(b"E" + struct.pack("<Q", 64) + bytes(64))
            _recv_exact(s, 64)
            rtts.append(time.perf_counter() - t)
        rtt = statistics.median(rtts)
        t = time.perf_counter()
        s.sendall(b"U" + struct.pack("<Q", PROBE_BYTES) + bytes(PROBE_BYTES))
        _recv_exact(s, 1)
        up = time.perf_counter() - t
        t = time.perf_counter()
        s.sendall(b"D" + struct.pack("<Q", PROBE_BYTES))
        _recv_exact(s, PROBE_BYTES)
        down = time.perf_counter() - t
    # one round trip of each transfer is latency, not rate
    mbit = lambda secs: 8 * PROBE_BYTES / max(secs - rtt, 1e-6) / 1e6  # noqa: E731
    return {"rtt_ms": 1e3 * rtt, "rtt_min_ms": 1e3 * min(rtts), "up_mbit_s": mbit(up), "down_mbit_s": mbit(down),
            "up_s": up, "down_s": down}
