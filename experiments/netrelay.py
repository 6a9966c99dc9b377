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

It runs an asyncio loop in one daemon thread; :meth:`set_delay` may be called from any thread and
applies to the bytes read from then on.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, field

#: bytes read per chunk
CHUNK = 64 * 1024


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
        self.one_way_s = float(one_way_s)
        self.max_queued = int(max_queued)
        self.stats = RelayStats()
        self.address: tuple[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- control (any thread) ---------------------------------------------------------------------
    def set_delay(self, one_way_s: float) -> None:
        if one_way_s < 0:
            raise ValueError(f"one-way delay {one_way_s} s: must be >= 0")
        self.one_way_s = float(one_way_s)

    def start(self) -> tuple[str, int]:
        """Start listening; returns the address bound."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, self.listen[0], self.listen[1], reuse_address=True))
                self.address = self._server.sockets[0].getsockname()[:2]
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"delay-relay-{self.listen[1]}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        assert self.address is not None
        return self.address

    def close(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.sleep(0)

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        except Exception:  # noqa: BLE001 - the loop is going away anyway
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "DelayRelay":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop ---------------------------------------------------------------------------------
    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.stats.connections += 1
        try:
            try:
                target_r, target_w = await asyncio.open_connection(*self.target)
            except OSError as exc:
                self.stats.errors.append(f"connect {self.target}: {exc}")
                client_w.close()
                return
            for w in (client_w, target_w):
                sock = w.get_extra_info("socket")
                if sock is not None:  # a delayed small write must not wait for Nagle on top
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(self._pipe(client_r, target_w, "bytes_forward"),
                                 self._pipe(target_r, client_w, "bytes_backward"))
            for w in (client_w, target_w):
                w.close()
        except asyncio.CancelledError:
            client_w.close()
        finally:
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """One direction: a reader stamps each chunk with when it is due, a writer forwards it then."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(self.max_queued)

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(CHUNK)
                except (ConnectionError, OSError):
                    data = b""
                await queue.put((loop.time() + self.one_way_s, data))
                if not data:
                    return

        async def write() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    if not data:  # EOF: half-close the other side after the same delay
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    setattr(self.stats, counter, getattr(self.stats, counter) + len(data))  # handed on
                    writer.write(data)
                    await writer.drain()
                except (ConnectionError, OSError):
                    return

        reading = asyncio.ensure_future(read())
        try:
            await write()
        finally:
            if not reading.done():  # the writer failed: stop reading (the reader may wait on a full queue)
                reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
