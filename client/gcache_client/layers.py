"""``LayerStream``: a match's layers in model order, read ahead of the consumer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gcache.errors import GCacheError, LayoutError
from gcache_client.types import KVPair, LayerKV, Match

if TYPE_CHECKING:
    from gcache_client.aio import AsyncGCacheClient


class LayerStream:
    """Yields :class:`LayerKV` in layer order. On any store failure it stops early
    and sets ``ok = False``: the engine must recompute (never wrong KV)."""

    def __init__(
        self, client: AsyncGCacheClient, match: Match, out: Sequence[KVPair] | None
    ) -> None:
        self.client = client
        self.match = match
        self.out = out
        self.ok = match.blocks > 0
        self.error: str = "" if self.ok else "no match"
        self._next = 0
        self._tasks: dict[int, asyncio.Task[LayerKV]] = {}
        self._num = match.namespace.layout.num_layers if match.blocks else 0

    def _schedule(self) -> None:
        ahead = self.client.config.layers_in_flight
        top = min(self._num, self._next + ahead)
        for layer in range(self._next, top):
            if layer not in self._tasks:
                out = None if self.out is None else self.out[layer]
                self._tasks[layer] = asyncio.create_task(
                    self.client.fetch_layer(self.match, layer, out, offload=True)
                )

    def __aiter__(self) -> LayerStream:
        return self

    async def __anext__(self) -> LayerKV:
        if not self.ok or self._next >= self._num:
            raise StopAsyncIteration
        self._schedule()
        task = self._tasks.pop(self._next)
        try:
            layer = await task
        except LayoutError:
            await self.aclose()
            raise
        except (GCacheError, TimeoutError) as exc:
            self.client._note_miss(exc)
            self.ok = False
            self.error = str(exc)
            await self.aclose()
            raise StopAsyncIteration from None
        self._next += 1
        self._schedule()
        return layer

    async def aclose(self) -> None:
        """Stop the reads still in flight and wait until they can no longer write
        into any buffer."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._next = self._num
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
