"""The page operations on the client's loop: each SGLang call runs there bounded
by ``batch_timeout_s`` with at most ``max_pages_in_flight`` pages in flight, and a
store that is down, slow or returns bytes failing their checksum makes pages
missing, never an exception into SGLang."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from gcache.transport.limits import RateLimitedLog
from gcache_client.aio import AsyncGCacheClient
from gcache_client.engines.sglang.config import HiCacheGCacheConfig
from gcache_client.engines.sglang.metrics import Metrics
from gcache_client.engines.sglang.namespaces import PAGE_TOKENS, Tracked
from gcache_client.loopthread import LoopThread
from gcache_client.types import KVPair, Namespace

__all__ = ["PageOps", "fail_log", "log"]

log = logging.getLogger("gcache.client.sglang")
fail_log = RateLimitedLog(log)
T = TypeVar("T")


class PageOps:
    """The client, its loop thread and the per-page operations on them; records
    what it stores (:class:`Tracked`) and counts into ``metrics``."""

    def __init__(self, cfg: HiCacheGCacheConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.tracked = Tracked(cfg.max_tracked_pages)
        self.closed = False
        self._lt = LoopThread("gcache-sglang")
        self.aio = AsyncGCacheClient(cfg.client)
        self._sem = asyncio.Semaphore(cfg.max_pages_in_flight)

    def run(self, make: Callable[[], Awaitable[T]], default: T, what: str) -> T:
        """Run ``make()`` on the client's loop, bounded by ``batch_timeout_s``; any
        failure is logged (rate-limited) and gives ``default`` (a miss)."""
        if self.closed:
            return default

        async def bounded() -> T:
            return await asyncio.wait_for(make(), self.cfg.batch_timeout_s)

        try:
            return self._lt.run(bounded())
        except Exception as exc:  # a store failure is a miss, never SGLang's problem
            self.metrics.count(f"{what}_errors")
            fail_log.log(time.monotonic(), "gcache sglang backend: %s failed (miss): %r", what, exc)
            return default

    # ---- per page, on the loop ---------------------------------------------------------

    async def present(self, ns: Namespace, key: bytes) -> bool:
        async with self._sem:
            return await self.aio.lookup(ns, PAGE_TOKENS, extras=[key]) > 0

    async def put(self, pool: str, fmt: str, ns: Namespace, key: bytes, kv: list[KVPair]) -> bool:
        async with self._sem:
            res = await self.aio.put(ns, PAGE_TOKENS, kv, extras=[key])
        ok = not res.error and not res.failed and not res.no_space
        if ok:
            self.tracked.add(pool, fmt, key)
            self.metrics.count("pages_stored" if res.stored else "pages_deduped")
            self.metrics.count("bytes_stored", res.bytes_written)
        else:
            self.metrics.count("pages_not_stored")
        return ok

    async def get(self, ns: Namespace, key: bytes, kv: list[KVPair]) -> bool:
        async with self._sem:
            m = await self.aio.match(ns, PAGE_TOKENS, extras=[key])
            if m.blocks < 1:
                return False
            try:
                got = await self.aio.get(m, kv)
            finally:
                await self.aio.release(m)
        if got is None:
            self.metrics.count("pages_failed_read")
            return False
        self.metrics.count("pages_read")
        return True

    async def evict(self, ns: Namespace, key: bytes) -> None:
        async with self._sem:
            await self.aio.evict(ns, PAGE_TOKENS, windows_only=False, extras=[key])

    async def gather(self, jobs: Sequence[Awaitable[bool]]) -> list[bool]:
        done = await asyncio.gather(*jobs, return_exceptions=True)
        out = []
        for r in done:
            if isinstance(r, BaseException):
                self.metrics.count("page_errors")
                fail_log.log(time.monotonic(), "gcache sglang backend: page failed (miss): %r", r)
            out.append(r is True)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._lt.close(self.aio.close, 5)
        except Exception as exc:  # closing must not fail SGLang's shutdown
            log.warning("gcache sglang backend: close: %r", exc)
