"""A private event loop on a daemon thread: what the blocking clients
(:class:`~gcache_client.sync.GCacheClient`, :class:`~gcache_client.router.RouterClient`)
run their async twins on, so sync callers never block an event loop of their own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from gcache.errors import ClosedError

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.closed = False

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        if self.closed:
            coro.close()
            raise ClosedError(f"{self.name} closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self, last: Callable[[], Awaitable[object]], timeout: float) -> None:
        """Await ``last()`` on the loop (at most ``timeout`` s), then stop the loop
        and its thread. Idempotent."""
        if self.closed:
            return

        async def _last() -> None:
            await last()

        try:
            asyncio.run_coroutine_threadsafe(_last(), self.loop).result(timeout)
        finally:
            self.closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()
