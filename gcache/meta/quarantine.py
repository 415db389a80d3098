"""Ranges freed from pending puts, held until every write grant to them has
expired (grants end ``GRANT_MARGIN_S`` before their put's deadline): a stale grant
can then never write into a range the allocator gave to someone else. A heap by
release time; nothing here reads the clock or does I/O."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from gcache.meta.records import ServerRecord

Held = tuple[float, int, ServerRecord, int, int]  # (release at, seq, server, offset, length)


class Quarantine:
    def __init__(self, free_range: Callable[[ServerRecord, int, int], None]) -> None:
        self.free_range = free_range  # Index.free_range: the range back to its allocator
        self.heap: list[Held] = []
        self._seq = itertools.count()

    def hold(self, srv: ServerRecord, offset: int, length: int, until: float) -> None:
        """Hold a range freed from a pending put (abort, reclaim, session end, or
        left unwritten at commit) until ``until``."""
        if not srv.alive:
            return
        srv.quarantined_bytes += length
        heapq.heappush(self.heap, (until, next(self._seq), srv, offset, length))

    def release(self, now: float) -> None:
        """Free the ranges whose time has come."""
        q = self.heap
        while q and q[0][0] <= now:
            _, _, srv, offset, length = heapq.heappop(q)
            if srv.alive:
                srv.quarantined_bytes -= length
                self.free_range(srv, offset, length)

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self) -> Iterator[Held]:
        return iter(self.heap)
