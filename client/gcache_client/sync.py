"""``GCacheClient``: the blocking face of :class:`AsyncGCacheClient`.

It runs the async client on a private event loop in a daemon thread, so that
``get_layers`` keeps layer reads in flight while the caller computes on the
previous layer (the overlap an engine wants), and sync callers never block an
event loop of their own.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

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

    def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        return self._run(self.aio.lookup(ns, tokens))

    def match(
        self, ns: Namespace, tokens: Sequence[int] | np.ndarray, *, local_tokens: int = 0
    ) -> Match:
        return self._run(self.aio.match(ns, tokens, local_tokens=local_tokens))

    def release(self, match: Match) -> None:
        self._run(self.aio.release(match))

    def get(self, match: Match, out: Sequence[KVPair] | None = None) -> list[LayerKV] | None:
        return self._run(self.aio.get(match, out))

    def get_layers(self, match: Match, out: Sequence[KVPair] | None = None) -> SyncLayerStream:
        return SyncLayerStream(self, self.aio.get_layers(match, out))

    def layer_rows(self, match: Match, layer: int) -> tuple[int, int]:
        return self.aio.layer_rows(match, layer)

    def stats(self) -> dict[str, int]:
        return self.aio.stats()


class SyncLayerStream:
    """Iterator over layers; reads run ahead on the client's loop thread."""

    def __init__(self, client: GCacheClient, stream: LayerStream) -> None:
        self._client = client
        self._stream = stream

    @property
    def ok(self) -> bool:
        return self._stream.ok

    @property
    def error(self) -> str:
        return self._stream.error

    def __iter__(self) -> Iterator[LayerKV]:
        return self

    def __next__(self) -> LayerKV:
        try:
            return self._client._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._client._run(self._stream.aclose())

    def __enter__(self) -> SyncLayerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
