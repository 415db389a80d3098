"""``GCacheClient``: the blocking face of :class:`AsyncGCacheClient`.

It runs the async client on a private event loop in a daemon thread, so that
``get_layers`` keeps layer reads in flight while the caller computes on the
previous layer (the overlap an engine wants), and sync callers never block an
event loop of their own.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, Final, TypeVar

import numpy as np

from gcache import layout as laymod
from gcache.config import ClientConfig
from gcache_client.aio import AsyncGCacheClient, LayerStream
from gcache_client.loopthread import LoopThread
from gcache_client.types import KVPair, LayerKV, Match, Namespace, PutResult

T = TypeVar("T")


class GCacheClient:
    def __init__(self, config: ClientConfig | None = None, **kwargs: Any) -> None:
        self._lt = LoopThread("gcache-client")
        self.aio = AsyncGCacheClient(config, **kwargs)
        try:
            self._run(self.aio.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._lt.run(coro)

    def __enter__(self) -> GCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._lt.close(self.aio.close, 5)

    @property
    def config(self) -> ClientConfig:
        return self.aio.config

    def register_namespace(
        self, model: str, layout: laymod.LayoutSpec | str, **kw: Any
    ) -> Namespace:
        return self._run(self.aio.register_namespace(model, layout, **kw))

    def put(
        self, ns: Namespace, tokens: Sequence[int] | np.ndarray, kv: Sequence[KVPair], **kw: Any
    ) -> PutResult:
        return self._run(self.aio.put(ns, tokens, kv, **kw))

    def evict(
        self, ns: Namespace, tokens: Sequence[int] | np.ndarray, **kw: Any
    ) -> tuple[int, int]:
        return self._run(self.aio.evict(ns, tokens, **kw))

    def lookup(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        *,
        extras: Sequence[bytes] | None = None,
    ) -> int:
        return self._run(self.aio.lookup(ns, tokens, extras=extras))

    def match(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        *,
        local_tokens: int = 0,
        extras: Sequence[bytes] | None = None,
    ) -> Match:
        return self._run(self.aio.match(ns, tokens, local_tokens=local_tokens, extras=extras))

    def release(self, match: Match) -> None:
        self._run(self.aio.release(match))

    def get(self, match: Match, out: Sequence[KVPair] | None = None) -> list[LayerKV] | None:
        return self._run(self.aio.get(match, out))

    def get_layers(self, match: Match, out: Sequence[KVPair] | None = None) -> SyncLayerStream:
        """Reads start now (layer 0 first), not at the first ``next``."""
        stream = SyncLayerStream(self, self.aio.get_layers(match, out))
        stream.start()
        return stream

    def layer_rows(self, match: Match, layer: int) -> tuple[int, int]:
        return self.aio.layer_rows(match, layer)

    def stats(self) -> dict[str, int]:
        return self.aio.stats()


class SyncLayerStream:
    """Iterator over layers; reads run ahead on the client's loop thread.

    A task on the loop (the *pump*) takes layers off the async stream as they
    arrive and queues them here, at most ``layers_in_flight`` ahead of the caller;
    taking a layer that already arrived costs no round trip through the loop
    thread (a thread wake-up each way, milliseconds on a loaded machine), only a
    credit posted back to the pump."""

    _END: Final = object()

    def __init__(self, client: GCacheClient, stream: LayerStream) -> None:
        self._client = client
        self._stream = stream
        self._ready: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._credit: asyncio.Semaphore | None = None
        self._pump: asyncio.Task[None] | None = None
        self._done = False

    @property
    def ok(self) -> bool:
        return self._stream.ok

    @property
    def error(self) -> str:
        return self._stream.error

    def __iter__(self) -> Iterator[LayerKV]:
        return self

    async def _start(self) -> None:
        self._credit = asyncio.Semaphore(self._client.config.layers_in_flight)
        self._pump = asyncio.create_task(self._run_pump(self._credit))

    async def _run_pump(self, credit: asyncio.Semaphore) -> None:
        try:
            async for layer in self._stream:
                self._ready.put(layer)
                await credit.acquire()
        except BaseException as exc:  # handed to the caller (LayoutError), or cancelled
            self._ready.put(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._ready.put(self._END)

    def start(self) -> None:
        """Start the pump (and with it the reads) if it has not started."""
        if self._pump is None and not self._done:
            self._client._run(self._start())

    def __next__(self) -> LayerKV:
        if self._done:
            raise StopIteration
        self.start()
        item = self._ready.get()
        if item is self._END or isinstance(item, asyncio.CancelledError):
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        credit = self._credit
        assert credit is not None
        self._client._lt.loop.call_soon_threadsafe(credit.release)
        return item  # type: ignore[return-value]

    async def _close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        await self._stream.aclose()

    def close(self) -> None:
        self._done = True
        self._client._run(self._close())

    def __enter__(self) -> SyncLayerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
