"""FrameStream's send timeout over a real socket pair: a peer that takes no byte
for ``send_timeout`` seconds fails the send with SendTimeout; a peer that reads,
however slowly, keeps restarting the clock."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from gcache.errors import ConnectionLost, SendTimeout
from gcache.transport.stream import FrameStream

BIG = 32 << 20  # far more than both socket buffers hold


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    return a, b


def test_send_to_a_peer_that_stops_reading_times_out() -> None:
    async def main() -> float:
        a, b = pair()
        stream = FrameStream(a, send_timeout=0.3)
        t0 = time.monotonic()
        try:
            with pytest.raises(SendTimeout) as info:
                await stream.send_views([memoryview(bytearray(BIG))])
            assert isinstance(info.value, ConnectionLost)  # the client's family of misses
            return time.monotonic() - t0
        finally:
            stream.close()
            b.close()

    elapsed = asyncio.run(main())
    assert 0.25 <= elapsed < 3.0


def test_a_slow_but_steady_reader_is_not_timed_out() -> None:
    """It takes bytes every 0.1 s: the 0.3 s clock restarts with each progress, so
    a send lasting far longer than the timeout completes."""

    async def main() -> float:
        a, b = pair()
        total = 4 << 20
        got = 0

        def reader() -> None:
            nonlocal got
            while got < total:
                chunk = b.recv(256 << 10)
                if not chunk:
                    return
                got += len(chunk)
                time.sleep(0.1)

        t = threading.Thread(target=reader)
        t.start()
        stream = FrameStream(a, send_timeout=0.3)
        t0 = time.monotonic()
        try:
            await stream.send_views([memoryview(bytearray(total))])
            return time.monotonic() - t0
        finally:
            await asyncio.to_thread(t.join)
            stream.close()
            b.close()
            assert got == total

    assert asyncio.run(main()) > 0.3  # longer than the timeout, yet not cut


def test_send_timeout_must_be_positive() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        try:
            with pytest.raises(ValueError):
                FrameStream(a, send_timeout=0)
        finally:
            a.close()
            b.close()

    asyncio.run(main())
