"""Eviction policies behind one small interface.

What may be evicted: any windowed (``swa``) object on its own (an interior one
becomes a tombstone that still serves longer matches), and a ``full`` object only
on a *leaf* block (no cached descendants), since every longer match needs it. The
meta asks a policy for candidates on one server in the order it prefers; the policy
keeps its own bookkeeping current through the hooks below.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Protocol

from gcache.meta.records import LIVE, BlockEntry, NamespaceRecord, ObjectRecord, ServerRecord


def evictable(obj: ObjectRecord, ns: NamespaceRecord) -> bool:
    if obj.state != LIVE:
        return False
    if obj.group != ns.full_group:
        return True
    return obj.entry.children == 0


class EvictionPolicy(Protocol):
    name: str

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """A newly committed object."""

    def touch(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """An object returned by a lookup (``obj.last_access`` already updated)."""

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        """``entry`` lost its last cached child: its full object is now evictable."""

    def candidates(self, server: ServerRecord) -> Iterator[tuple[ObjectRecord, NamespaceRecord]]:
        """Evictable objects on ``server``, best victim first. The caller evicts as
        it iterates, so implementations re-check each candidate lazily."""
        ...

    def stats(self) -> dict[str, int]: ...


class LRUPolicy:
    """Least recently used among the evictable objects of each server.

    One lazy-deletion heap per server keyed by ``last_access``: a touch pushes a new
    item instead of re-heapifying; stale items are skipped when popped and the heap
    is rebuilt when stale items outnumber live ones.
    """

    name = "lru"

    def __init__(self) -> None:
        self._heaps: dict[int, list[tuple[float, int, ObjectRecord, NamespaceRecord]]] = {}
        self._seq = itertools.count()
        self.pushes = 0

    def _heap(self, server: ServerRecord) -> list[tuple[float, int, ObjectRecord, NamespaceRecord]]:
        heap = self._heaps.get(id(server))
        if heap is None:
            heap = self._heaps[id(server)] = []
        return heap

    def _push(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        heap = self._heap(obj.server)
        heapq.heappush(heap, (obj.last_access, next(self._seq), obj, ns))
        self.pushes += 1
        if len(heap) > 4096 and len(heap) > 4 * max(obj.server.objects, 1):
            self._compact(heap)

    def _compact(self, heap: list[tuple[float, int, ObjectRecord, NamespaceRecord]]) -> None:
        best: dict[int, tuple[float, int, ObjectRecord, NamespaceRecord]] = {}
        for item in heap:
            obj = item[2]
            if obj.state == LIVE and item[0] == obj.last_access:
                best[id(obj)] = item
        heap[:] = list(best.values())
        heapq.heapify(heap)

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        if evictable(obj, ns):
            self._push(obj, ns)

    def touch(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        if evictable(obj, ns):
            self._push(obj, ns)

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        if ns.full_group is not None:
            obj = entry.objects[ns.full_group]
            if obj is not None and obj.state == LIVE:
                self._push(obj, ns)

    def candidates(self, server: ServerRecord) -> Iterator[tuple[ObjectRecord, NamespaceRecord]]:
        heap = self._heap(server)
        while heap:
            stamp, _, obj, ns = heapq.heappop(heap)
            if stamp != obj.last_access or obj.server is not server or not evictable(obj, ns):
                continue  # stale: touched since, evicted, or has children now
            yield obj, ns

    def forget_server(self, server: ServerRecord) -> None:
        self._heaps.pop(id(server), None)

    def stats(self) -> dict[str, int]:
        return {"heap_items": sum(len(h) for h in self._heaps.values()), "pushes": self.pushes}


def make_policy(name: str) -> LRUPolicy:
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown eviction policy {name!r}")
