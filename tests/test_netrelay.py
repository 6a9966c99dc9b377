"""The delay relay of experiments/bench_network.py (experiments/netrelay.py), on loopback, no root.

It must forward every byte unchanged and in order in both directions (the benchmark runs the
data plane's authenticated, sealed frames through it: one altered or reordered byte would fail
the run, and a silently lossy relay would make the numbers meaningless), forward a half-close,
and hold each direction at least its one-way delay (lower bounds only: a loaded machine can only
add time)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from experiments.netrelay import DelayRelay


class _Server:
    """A loopback TCP server running ``handler(conn)`` for each connection in a thread."""

    def __init__(self, handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.errors: list[BaseException] = []
        self._handler = handler
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn) -> None:
        try:
            with conn:
                self._handler(conn)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def close(self) -> None:
        self.sock.close()


def _recv_exact(conn, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 16, n - len(buf)))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _echo(conn) -> None:
    while True:
        data = conn.recv(1 << 16)
        if not data:
            conn.shutdown(socket.SHUT_WR)
            return
        conn.sendall(data)


@pytest.fixture
def echo_server():
    server = _Server(_echo)
    yield server
    server.close()
    assert not server.errors


def test_relay_forwards_every_byte_in_order_both_ways(echo_server):
    """Random payloads in irregular pieces, several connections at once, written while the echo
    flows back: what comes back through the relay is exactly what went in, and the half-close
    arrives after the last byte."""
    with DelayRelay(("127.0.0.1", 0), echo_server.address, one_way_s=0.002) as relay:
        results: dict[int, tuple[str, str, bytes]] = {}

        def client(i: int) -> None:
            payload = os.urandom(300_000 + 7919 * i)
            with socket.create_connection(relay.address) as c:
                def send() -> None:
                    pos, step = 0, 1
                    while pos < len(payload):  # pieces of 1 byte up to ~64 kB
                        c.sendall(payload[pos:pos + step])
                        pos += step
                        step = step * 3 % 65_521 + 1
                    c.shutdown(socket.SHUT_WR)

                sender = threading.Thread(target=send)
                sender.start()
                got = _recv_exact(c, len(payload))
                tail = c.recv(1)  # the echo server's half-close, forwarded
                sender.join()
            results[i] = (hashlib.sha256(payload).hexdigest(), hashlib.sha256(got).hexdigest(), tail)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == [0, 1, 2, 3]
        for sent, got, tail in results.values():
            assert got == sent and tail == b""
        total = sum(300_000 + 7919 * i for i in range(4))
        assert relay.stats.bytes_forward == total and relay.stats.bytes_backward == total
        assert relay.stats.connections == 4 and not relay.stats.errors


def test_relay_holds_each_direction_its_one_way_delay(echo_server):
    """A request and its echo cross the relay twice: the round trip is at least twice the one-way
    delay, for each of a burst of small messages (each one delayed, not only the first), and the
    delay set while the relay runs applies to the bytes read after it."""
    with DelayRelay(("127.0.0.1", 0), echo_server.address, one_way_s=0.03) as relay, \
            socket.create_connection(relay.address) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(5):
            t = time.perf_counter()
            c.sendall(bytes([i]) * 100)
            assert _recv_exact(c, 100) == bytes([i]) * 100
            assert time.perf_counter() - t >= 0.06
        relay.set_delay(0.1)
        t = time.perf_counter()
        c.sendall(b"x" * 10)
        assert _recv_exact(c, 10) == b"x" * 10
        assert time.perf_counter() - t >= 0.2
        with pytest.raises(ValueError, match="must be >= 0"):
            relay.set_delay(-1)


def test_relay_to_a_closed_port_closes_the_client_and_says_why():
    probe = socket.create_server(("127.0.0.1", 0))
    dead = probe.getsockname()
    probe.close()
    with DelayRelay(("127.0.0.1", 0), dead) as relay, socket.create_connection(relay.address) as c:
        c.settimeout(10)
        assert c.recv(1) == b""
        deadline = time.monotonic() + 5
        while not relay.stats.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.stats.errors and relay.stats.errors[0].startswith(f"connect {dead}")
