"""READ replies that touch the NVMe tier (issue 10).

A tier-1 grant names an object on the server's NVMe tier: its bytes are not in the
segment, so the reply is read from the tier's files (``os.preadv``) into one buffer
before it is sent. :class:`TieredReadReply` keeps the same shape as
:class:`gcache.server.core.ReadReply` (``total``, ``batches()``), plus ``nvme_bytes``
and :meth:`load`, which the daemon runs on a worker thread (a disk read never
blocks the event loop). Tier-0 ranges of the same READ stay views of the segment.
The buffer is bounded by :data:`MAX_NVME_READ` per READ and, in the daemon, by a
budget of bytes read ahead for all connections (:class:`ReadBudget`)."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Iterator
from typing import Final

from gcache.storage.nvme import NvmeTier

MAX_NVME_READ: Final = 64 << 20
READ_BATCH: Final = 512


class TieredReadReply:
    __slots__ = ("_buf", "_lengths", "_offsets", "_seg", "_tier", "_tiers", "nvme_bytes", "total")

    def __init__(
        self,
        seg: memoryview,
        tier: NvmeTier,
        offsets: array[int],
        lengths: array[int],
        tiers: bytearray,
        total: int,
    ) -> None:
        self._seg = seg
        self._tier = tier
        self._offsets = offsets
        self._lengths = lengths
        self._tiers = tiers
        self.total = total
        self.nvme_bytes = sum(n for n, t in zip(lengths, tiers, strict=True) if t)
        self._buf: list[memoryview] | None = None

    def __len__(self) -> int:
        return len(self._offsets)

    def load(self) -> None:
        """Read every tier-1 range from the NVMe files into one page-aligned buffer
        (``O_DIRECT`` where the file system takes it; blocking: a worker thread)."""
        ranges = [
            (off, n)
            for off, n, t in zip(self._offsets, self._lengths, self._tiers, strict=True)
            if t
        ]
        self._buf = self._tier.read_many(ranges)

    def batches(self, size: int = READ_BATCH) -> Iterator[list[memoryview]]:
        assert self._buf is not None or not self.nvme_bytes, "load() first"
        seg = self._seg
        disk = iter(self._buf or [])
        out: list[memoryview] = []
        for off, n, t in zip(self._offsets, self._lengths, self._tiers, strict=True):
            if t:
                out.append(next(disk))
            else:
                out.append(seg[off : off + n])
            if len(out) >= size:
                yield out
                out = []
        if out:
            yield out

    def views(self) -> list[memoryview]:
        return [v for batch in self.batches() for v in batch]


class ReadBudget:
    """Bytes of NVMe replies read ahead across all connections: a READ waits
    (backpressure) until its bytes fit; one larger than the whole budget waits for
    an empty budget and then goes alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waits = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            if self.used and self.used + n > self.limit:
                self.waits += 1
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()
