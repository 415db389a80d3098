"""Belady's rule for the replayer: evict the evictable object whose next use is
farthest in the future. It reads the trace ahead, so it is a reference that shows
the headroom, never a policy for live use.

"Next use" comes from one pass over the trace with an unbounded cache: request
``r`` shares a prefix of ``b_r`` index blocks with earlier requests, so it uses the
full objects of its first ``b_r`` blocks and the windowed objects of the ``tail``
blocks before ``b_r`` (where its match would end). Same rules as every policy: a
full object goes only from a leaf, a leased object never.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from bisect import bisect_right
from collections.abc import Iterator

from gcache.meta.eviction import evictable
from gcache.meta.records import BlockEntry, NamespaceRecord, ObjectRecord, ServerRecord
from gcache.replay.trace import Trace

NEVER = float(1 << 60)
# (-next use, -bytes, sequence, object, namespace): farthest first, then largest.
Item = tuple[float, int, int, ObjectRecord, NamespaceRecord]


class Oracle:
    """Per block key, the requests that use its full object and its window piece."""

    def __init__(self, trace: Trace, tail: int) -> None:
        self.full: dict[bytes, array[int]] = {}
        self.window: dict[bytes, array[int]] = {}
        self.shared: list[int] = []  # b_r per request
        seen: set[bytes] = set()
        bs = trace.block_size
        for r, (keys, length) in enumerate(zip(trace.keys, trace.lengths, strict=True)):
            limit = min(len(keys), (length - 1) // bs)
            b = 0
            while b < limit and keys[b] in seen:
                b += 1
            self.shared.append(b)
            for k in keys[:b]:
                self.full.setdefault(k, array("i")).append(r)
            for k in keys[max(0, b - tail) : b] if tail else ():
                self.window.setdefault(k, array("i")).append(r)
            seen.update(keys)

    def next_use(self, key: bytes, window: bool, after: int) -> float:
        uses = (self.window if window else self.full).get(key)
        if uses is None:
            return NEVER
        i = bisect_right(uses, after)
        return float(uses[i]) if i < len(uses) else NEVER


class BeladyPolicy:
    name = "belady"

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.clock = -1  # the request being replayed; the runner sets it
        self._heaps: dict[int, list[Item]] = {}
        self._seq = itertools.count()
        self.pushes = 0

    def _push(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        nxt = self.oracle.next_use(obj.entry.key, obj.group != ns.full_group, self.clock)
        obj.score = nxt
        heap = self._heaps.get(id(obj.server))
        if heap is None:
            heap = self._heaps[id(obj.server)] = []
        heapq.heappush(heap, (-nxt, -obj.length, next(self._seq), obj, ns))
        self.pushes += 1

    def refresh(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        """Re-key the objects of ``entry`` (a predicted use passed without a touch)."""
        for obj in entry.objects:
            if obj is not None and evictable(obj, ns):
                self._push(obj, ns)

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        if evictable(obj, ns):
            self._push(obj, ns)

    def admit_many(self, objs: list[ObjectRecord], ns: NamespaceRecord) -> None:
        for obj in objs:
            self.admit(obj, ns)

    def touch(self, obj: ObjectRecord, ns: NamespaceRecord, age: float) -> None:
        if evictable(obj, ns):
            self._push(obj, ns)

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        self.refresh(entry, ns)

    def evicted(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        pass

    def unpinned(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        if evictable(obj, ns):
            self._push(obj, ns)

    def candidates(self, server: ServerRecord) -> Iterator[tuple[ObjectRecord, NamespaceRecord]]:
        heap = self._heaps.get(id(server))
        while heap:
            key, _, _, obj, ns = heapq.heappop(heap)
            if obj.server is not server or not evictable(obj, ns):
                continue
            if -key != obj.score:
                continue  # re-keyed since
            if obj.score <= self.clock:  # its predicted use passed unused: re-key
                self._push(obj, ns)
                continue
            yield obj, ns

    def forget_server(self, server: ServerRecord) -> None:
        self._heaps.pop(id(server), None)

    def stats(self) -> dict[str, int]:
        return {"pushes": self.pushes}
