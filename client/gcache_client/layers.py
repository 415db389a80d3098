"""``LayerStream``: a match's layers in model order, read ahead of the consumer.

Read-ahead: at least ``layers_in_flight`` layers, and
beyond them as many as fit in ``layer_bytes_in_flight`` bytes. A hybrid model's
bytes sit in a few full-attention layers (MiMo-V2-Flash at 32k tokens: 9 layers
of 84 MB, 39 sliding layers of ~0.3 MB), so a count of layers alone left the copy
idle between full layers while the consumer worked through the sliding ones. The
caller's buffers are preallocated, so reading further ahead costs no memory; with
``out=None`` the fresh arrays in flight are what the byte bound limits.

Large shared-memory copies run one at a time in layer order (:class:`LayerReads`),
back to back on one thread: each uses every core the native kernel splits it
across, so layer 0 arrives after one layer's copy instead of sharing the memory
bus with the next full layer. The
stream also keeps the match's group plans (:func:`gcache_client.plans.plan_group`):
every layer of a group reads the same objects, so they are planned once.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from gcache import _native as native
from gcache.config import ClientConfig
from gcache.errors import GCacheError, LayoutError
from gcache_client.plans import GroupPlans, layer_rows
from gcache_client.pool import run_whole
from gcache_client.types import KVPair, LayerKV, Match

T = TypeVar("T")


class LayerReads:
    """One stream's shared state: its match's group plans, and the ordered copy
    thread its large shared-memory copies run on.

    The copy thread is one per process, first in first out: the stream's tasks
    start in layer order and plan inline, so their copies reach it in layer order
    and run back to back, each at the speed of every core the native kernel
    splits it across, with no event-loop pass between two of them."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: GroupPlans = {}

    @property
    def ordered(self) -> bool:
        """Whether large copies go to the ordered thread: with the native kernel
        (which splits a copy across threads itself), not with the Python one
        (whose halves run on the pool's two copy threads)."""
        return native.NATIVE

    async def copy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the ordered copy thread. Cancellation waits for ``fn`` to
        finish: it may be writing into the caller's buffers, which must be left
        alone once we return."""
        return await run_whole(_ordered_copier(), fn, *args)


_COPIER: ThreadPoolExecutor | None = None
_COPIER_LOCK = threading.Lock()


def _ordered_copier() -> ThreadPoolExecutor:
    global _COPIER
    with _COPIER_LOCK:
        if _COPIER is None:
            _COPIER = ThreadPoolExecutor(1, thread_name_prefix="gcache-layer-copy")
        return _COPIER


def _forget_copier() -> None:
    """A forked child has no copy thread: it makes its own on first use."""
    global _COPIER, _COPIER_LOCK
    _COPIER, _COPIER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_copier)


def layer_nbytes(match: Match, layer: int) -> int:
    """Bytes of ``layer``'s K and V in ``match`` (the rows ``layer_rows`` gives)."""
    layout = match.namespace.layout
    _, kb, vb = layout.layer_range(layer)
    return layer_rows(match, layer)[1] // layout.block_size * (kb + vb)


class LayerSource(Protocol):
    """What a stream reads its layers from (:class:`gcache_client.reads.Reader`)."""

    config: ClientConfig

    async def fetch_layer(
        self,
        match: Match,
        layer: int,
        out: KVPair | None = None,
        *,
        offload: bool = False,
        reads: LayerReads | None = None,
    ) -> LayerKV: ...

    def note_miss(self, exc: BaseException) -> None: ...


class LayerStream:
    """Yields :class:`LayerKV` in layer order. On any store failure it stops early
    and sets ``ok = False``: the engine must recompute (never wrong KV)."""

    def __init__(self, source: LayerSource, match: Match, out: Sequence[KVPair] | None) -> None:
        self.source = source
        self.config = source.config
        self.match = match
        self.out = out
        self.ok = match.blocks > 0
        self.error: str = "" if self.ok else "no match"
        self._next = 0  # the next layer to hand over
        self._top = 0  # the next layer to start reading
        self._ahead = 0  # bytes of layers started and not handed over
        self._tasks: dict[int, asyncio.Task[LayerKV]] = {}
        self._num = match.namespace.layout.num_layers if match.blocks else 0
        self._bytes = [layer_nbytes(match, i) for i in range(self._num)]
        self.reads = LayerReads()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # made off the loop (the blocking client): reads start with its pump
        self._schedule()  # layer 0's read starts now, not at the first __anext__

    def _schedule(self) -> None:
        """Start reads: ``layers_in_flight`` ahead, and once layer 0 was handed over
        (it is not shared with deeper reads: over TCP they would share its socket
        and its verification threads) as far as ``layer_bytes_in_flight`` allows."""
        cfg = self.config
        budget = cfg.layer_bytes_in_flight if self._next > 0 else 0
        while self._top < self._num and (
            self._top - self._next < cfg.layers_in_flight
            or self._ahead + self._bytes[self._top] <= budget
        ):
            layer = self._top
            out = None if self.out is None else self.out[layer]
            self._tasks[layer] = asyncio.create_task(self._read(layer, out))
            self._ahead += self._bytes[layer]
            self._top += 1

    async def _read(self, layer: int, out: KVPair | None) -> LayerKV:
        return await self.source.fetch_layer(self.match, layer, out, offload=True, reads=self.reads)

    @property
    def started(self) -> int:
        """Layers whose reads were started (handed over or in flight)."""
        return self._top

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
            self.source.note_miss(exc)
            self.ok = False
            self.error = str(exc)
            await self.aclose()
            raise StopAsyncIteration from None
        self._ahead -= self._bytes[self._next]
        self._next += 1
        self._schedule()
        return layer

    async def aclose(self) -> None:
        """Stop the reads still in flight and wait until they can no longer write
        into any buffer."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._next = self._top = self._num
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
