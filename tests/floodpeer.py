"""A peer that floods a data-plane address with silent streams (issue 16), run in its own process by
``tests/test_adversary_flood.py``; it imports only gRPC, so it starts fast."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

METHOD = "/fl_split.dataplane.v1.DataPlane/Session"


def silent_flood(address: str, total: int, concurrency: int, hold: float, budget: float, rate: float) -> None:
    """Open ``total`` streams to ``address`` that never send a byte, ``rate`` per second and at most
    ``concurrency`` at once (the issue's attacker: 3,990 in 26 s); each is given up after ``hold``
    seconds (longer than any handshake deadline), and no new one is opened after ``budget`` seconds. Prints
    ``{"opened": n}`` every 100 streams and finally ``{"opened", "codes"}``."""
    import grpc.aio

    async def main() -> None:
        channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
        codes: Counter = Counter()
        sem = asyncio.Semaphore(concurrency)
        t0 = time.monotonic()
        stop = t0 + budget
        opened = 0

        async def one(i: int) -> None:
            nonlocal opened
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            async with sem:
                if time.monotonic() > stop:
                    codes["not opened (budget)"] += 1
                    return
                call = channels[i % len(channels)].stream_stream(METHOD)()
                opened += 1
                if opened % 100 == 0:
                    print(json.dumps({"opened": opened}), flush=True)
                try:
                    codes[(await asyncio.wait_for(call.code(), hold)).name] += 1
                except asyncio.TimeoutError:
                    call.cancel()
                    codes["held"] += 1

        await asyncio.gather(*(one(i) for i in range(total)))
        for ch in channels:
            await ch.close()
        print(json.dumps({"opened": opened, "codes": dict(codes)}), flush=True)

    asyncio.run(main())
