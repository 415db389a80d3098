"""``RouterClient`` / ``AsyncRouterClient``: the per-request calls to ``gcache-router``.

The router speaks the meta's framed hot-path protocol (:mod:`gcache.wire`):

* :meth:`AsyncRouterClient.route`: which engine instance should serve a prompt,
  given its chained block keys (or its token ids and the namespace that keys them);
  answered with :class:`gcache.wire.Routed` (instance id and URL, window-safe blocks
  held locally and those the pool adds, the cost and a one-word reason);
* :meth:`AsyncRouterClient.report_hits`: after a lookup on an instance, the tokens
  matched in the instance's own memory and those fetched from the pool;
* :meth:`AsyncRouterClient.report_load`: an instance's queue, running requests and
  tokens in flight (also its liveness signal: an instance that stops reporting
  expires at the router).

Reports are advice: a report that cannot be delivered never fails an engine's
request. ``report_*_nowait`` queue one without waiting; at most
``max_pending_reports`` are under way at once, and one past that is dropped and
counted (``reports_dropped``), so a slow or dead router costs an engine nothing but
stale routing. ``route`` raises (:class:`~gcache.errors.RemoteError` when the router
refuses, e.g. with no live instance; :class:`~gcache.errors.ConnectionLost` when it
cannot be reached): the caller decides where to send the request instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any, Final, TypeVar

import numpy as np

from gcache import keys as keymod
from gcache import wire
from gcache.errors import ClosedError, ConfigError, GCacheError
from gcache_client.conn import PipelinedConn
from gcache_client.loopthread import LoopThread
from gcache_client.types import Namespace

log = logging.getLogger("gcache.client.router")

T = TypeVar("T")
MAX_PENDING_REPORTS: Final = 256


def _split(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"router address must be host:port, got {addr!r}")
    return host, int(port)


def prompt_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """The chained GCache block keys of a prompt's full blocks in ``namespace``."""
    return keymod.block_keys(namespace.fingerprint, tokens, namespace.layout.block_size)


class AsyncRouterClient:
    """One pipelined connection to a router, opened on first use and again after a
    failure. Use it from one event loop."""

    def __init__(
        self,
        addr: str,
        *,
        timeout_s: float = 2.0,
        max_pending_reports: int = MAX_PENDING_REPORTS,
    ) -> None:
        self.host, self.port = _split(addr)
        self.addr = addr
        if timeout_s <= 0:
            raise ConfigError(f"router timeout_s must be > 0, got {timeout_s!r}")
        if max_pending_reports < 1:
            raise ConfigError(f"max_pending_reports must be >= 1, got {max_pending_reports}")
        self.timeout_s = timeout_s
        self.max_pending_reports = max_pending_reports
        self._conn: PipelinedConn | None = None
        self._lock: asyncio.Lock | None = None
        self._reports: set[asyncio.Task[None]] = set()
        self._closed = False
        self.counters: Counter[str] = Counter()

    # ---- connection ------------------------------------------------------------------

    async def _connection(self) -> PipelinedConn:
        if self._closed:
            raise ClosedError("router client closed")
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._closed:
                raise ClosedError("router client closed")
            if self._conn is None or self._conn.closed:
                self._conn = await PipelinedConn.open(self.host, self.port, self.timeout_s)
                self.counters["connects"] += 1
            return self._conn

    async def _call(self, msg: wire.Msg) -> Any:
        conn = await self._connection()
        return await conn.call(msg, timeout=self.timeout_s)

    async def connect(self) -> AsyncRouterClient:
        await self._connection()
        return self

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Let reports under way finish (up to the timeout), then close."""
        if self._closed:
            return
        if self._reports:
            await asyncio.wait(list(self._reports), timeout=self.timeout_s)
        self._closed = True
        for task in list(self._reports):
            task.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- route -------------------------------------------------------------------------

    async def route(
        self,
        keys: Sequence[bytes] | None = None,
        *,
        tokens: Sequence[int] | np.ndarray | None = None,
        namespace: Namespace | None = None,
        prompt_tokens: int | None = None,
        request_id: str = "",
    ) -> wire.Routed:
        """Ask which instance should serve a prompt: give its block ``keys`` (and
        ``prompt_tokens``, its length), or its token ids as ``tokens`` with the
        ``namespace`` that keys them."""
        if (keys is None) == (tokens is None):
            raise ValueError("route: give either keys or tokens")
        if tokens is not None:
            if namespace is None:
                raise ValueError("route(tokens=...) needs the namespace that keys them")
            keys = prompt_keys(namespace, tokens)
            if prompt_tokens is None:
                prompt_tokens = len(tokens)
        assert keys is not None
        if prompt_tokens is None:
            raise ValueError("route(keys=...) needs prompt_tokens (the prompt's length)")
        self.counters["routes"] += 1
        reply: wire.Routed = await self._call(
            wire.Route(list(keys), int(prompt_tokens), request_id)
        )
        return reply

    # ---- reports ------------------------------------------------------------------------

    async def report_hits(
        self, instance: str, prompt_tokens: int, local_tokens: int, pool_tokens: int
    ) -> None:
        """Tell the router what a lookup on ``instance`` found: ``local_tokens`` in
        its own memory, ``pool_tokens`` more fetched from the GCache pool. Raises on
        failure (use :meth:`report_hits_nowait` on a request path)."""
        await self._call(wire.ReportHits(instance, prompt_tokens, local_tokens, pool_tokens))
        self.counters["hits_reported"] += 1

    async def report_load(
        self,
        instance: str,
        *,
        queued: int,
        running: int,
        tokens_in_flight: int,
        active_blocks: int = 0,
        url: str = "",
    ) -> None:
        """Report ``instance``'s load (and that it is alive, reachable at ``url``)."""
        await self._call(
            wire.ReportLoad(instance, queued, running, tokens_in_flight, active_blocks, url)
        )
        self.counters["loads_reported"] += 1

    def report_hits_nowait(
        self, instance: str, prompt_tokens: int, local_tokens: int, pool_tokens: int
    ) -> bool:
        """Queue a hit report without waiting; False when it was dropped (too many
        under way, or closed). Call from the client's event loop."""
        return self._spawn(self.report_hits(instance, prompt_tokens, local_tokens, pool_tokens))

    def report_load_nowait(self, instance: str, **load: Any) -> bool:
        return self._spawn(self.report_load(instance, **load))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> bool:
        if self._closed or len(self._reports) >= self.max_pending_reports:
            coro.close()
            self.counters["reports_dropped"] += 1
            return False
        task = asyncio.get_running_loop().create_task(self._report(coro))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)
        return True

    async def _report(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except GCacheError as exc:
            self.counters["reports_failed"] += 1
            if self.counters["reports_failed"] <= 3 or self.counters["reports_failed"] % 1000 == 0:
                log.warning(
                    "router %s: report not delivered (%d so far): %s",
                    self.addr,
                    self.counters["reports_failed"],
                    exc,
                )

    def stats(self) -> dict[str, int]:
        return {**self.counters, "reports_pending": len(self._reports)}


class RouterClient:
    """The blocking face of :class:`AsyncRouterClient`, on a private loop thread."""

    def __init__(self, addr: str, **kwargs: Any) -> None:
        self.aio = AsyncRouterClient(addr, **kwargs)
        self._lt = LoopThread("router client")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._lt.run(coro)

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._lt.close(self.aio.close, self.aio.timeout_s + 5)

    def route(
        self,
        keys: Sequence[bytes] | None = None,
        *,
        tokens: Sequence[int] | np.ndarray | None = None,
        namespace: Namespace | None = None,
        prompt_tokens: int | None = None,
        request_id: str = "",
    ) -> wire.Routed:
        return self._run(
            self.aio.route(
                keys,
                tokens=tokens,
                namespace=namespace,
                prompt_tokens=prompt_tokens,
                request_id=request_id,
            )
        )

    def report_hits(
        self, instance: str, prompt_tokens: int, local_tokens: int, pool_tokens: int
    ) -> None:
        self._run(self.aio.report_hits(instance, prompt_tokens, local_tokens, pool_tokens))

    def report_load(self, instance: str, **load: Any) -> None:
        self._run(self.aio.report_load(instance, **load))

    def stats(self) -> dict[str, int]:
        return self.aio.stats()
