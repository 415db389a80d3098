"""READ replies that touch the NVMe tier.

A tier-1 grant names an object on the server's NVMe tier: its bytes are not in the
segment, so the reply is read from the tier's files (``os.preadv``) into one buffer
before it is sent. :class:`TieredReadReply` keeps the same shape as
:class:`gcache.server.core.ReadReply` (``total``, ``batches()``), plus ``nvme_bytes``
and :meth:`load`, which the daemon runs on a worker thread (a disk read never
blocks the event loop). Tier-0 ranges of the same READ stay views of the segment.
The buffer is bounded by :data:`MAX_NVME_READ` per READ and, in the daemon, by a
budget of bytes read ahead for all connections (:class:`ReadBudget`). Buffers come
from :class:`ReadBuffers`, a bounded pool of page-aligned, pre-faulted mappings
reused from READ to READ: mapping and faulting in a fresh 1 MiB buffer per READ
cost about as much as the disk read itself (1 MiB reads were 0.57x raw)."""

from __future__ import annotations

import asyncio
import mmap
import threading
from array import array
from collections.abc import Iterator
from typing import Final

from gcache.storage.nvme import BLOCK, NvmeTier

# A disk job of a pipelined tier-1 reply (gcache/server/nvme_reads.py): reads of
# (file descriptor, file offset, the slice of the reply's buffer it fills), done in
# order on one disk thread.
Piece = tuple[tuple[int, int, memoryview], ...]
# A view of the reply's payload and the piece it waits for (-1: none, a segment view).
Chunk = tuple[memoryview, int]

MAX_NVME_READ: Final = 64 << 20
READ_BATCH: Final = 512
MIN_BUFFER: Final = 1 << 20  # smallest pooled buffer (size classes: powers of two)


class ReadBuffer:
    """One page-aligned buffer lent by :class:`ReadBuffers`."""

    __slots__ = ("map", "pooled", "size", "view")

    def __init__(self, size: int, pooled: bool) -> None:
        self.size = size
        self.pooled = pooled
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
        self.view = memoryview(self.map)

    def unmap(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a view of it still alive somewhere: unmapped when freed
            pass


class ReadBuffers:
    """A bounded pool of page-aligned, pre-faulted read buffers (thread-safe: lent on
    the read workers, returned on the loop). Size classes are powers of two from
    :data:`MIN_BUFFER`; at most ``limit`` bytes are pooled (lent or free). A READ
    whose class has no free buffer gets a new one while the pool has room, else
    free buffers of other classes are unmapped to make room, else (every pooled
    byte lent: the read budget bounds this) a one-off buffer unmapped on return."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pooled = 0  # bytes of pooled buffers, lent or free
        self.lent = 0
        self.hits = self.misses = self.one_off = self.unmapped = 0
        self._free: dict[int, list[ReadBuffer]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def size_class(n: int) -> int:
        return max(MIN_BUFFER, 1 << (max(n, 1) - 1).bit_length())

    def try_acquire(self, n: int) -> ReadBuffer | None:
        """A free pooled buffer for ``n`` bytes, or None (then :meth:`acquire`, which
        may map one: on a worker thread). Cheap enough for the event loop."""
        size = self.size_class(n)
        with self._lock:
            free = self._free.get(size)
            if not free:
                return None
            self.hits += 1
            self.lent += size
            return free.pop()

    def acquire(self, n: int) -> ReadBuffer:
        size = self.size_class(n)
        drop: list[ReadBuffer] = []
        with self._lock:
            free = self._free.get(size)
            if free:
                self.hits += 1
                self.lent += size
                return free.pop()
            self.misses += 1
            for cls in sorted(self._free, reverse=True):  # make room: largest first
                bufs = self._free[cls]
                while bufs and self.pooled + size > self.limit:
                    drop.append(bufs.pop())
                    self.pooled -= cls
            pooled = self.pooled + size <= self.limit
            if pooled:
                self.pooled += size
                self.lent += size
            else:
                self.one_off += 1
            self.unmapped += len(drop)
        for b in drop:
            b.unmap()
        try:
            return ReadBuffer(size, pooled)  # mapped and faulted in outside the lock
        except BaseException:
            if pooled:
                with self._lock:
                    self.pooled -= size
                    self.lent -= size
            raise

    def release(self, buf: ReadBuffer) -> None:
        if not buf.pooled:
            buf.unmap()
            return
        with self._lock:
            self.lent -= buf.size
            self._free.setdefault(buf.size, []).append(buf)

    def close(self) -> None:
        with self._lock:
            bufs = [b for free in self._free.values() for b in free]
            self._free.clear()
            self.pooled -= sum(b.size for b in bufs)
        for b in bufs:
            b.unmap()

    def stats(self) -> dict[str, int]:
        return {
            "nvme_read_buffers_pooled_bytes": self.pooled,
            "nvme_read_buffers_lent_bytes": self.lent,
            "nvme_read_buffer_hits": self.hits,
            "nvme_read_buffer_misses": self.misses,
            "nvme_read_buffer_one_off": self.one_off,
        }


class TieredReadReply:
    __slots__ = (
        "_buf",
        "_lease",
        "_lengths",
        "_offsets",
        "_pool",
        "_seg",
        "_tier",
        "_tiers",
        "nvme_bytes",
        "total",
    )

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
        self._lease: ReadBuffer | None = None
        self._pool: ReadBuffers | None = None

    def __len__(self) -> int:
        return len(self._offsets)

    def load(self, pool: ReadBuffers | None = None) -> None:
        """Read every tier-1 range from the NVMe files into one page-aligned buffer
        (``O_DIRECT`` where the file system takes it; blocking: a worker thread),
        lent by ``pool`` (give it back with :meth:`release` once the reply is sent),
        else a fresh mapping."""
        ranges = [
            (off, n)
            for off, n, t in zip(self._offsets, self._lengths, self._tiers, strict=True)
            if t
        ]
        if pool is None:
            self._buf = self._tier.read_many(ranges)
            return
        lease = pool.acquire(self._tier.read_span(ranges))
        try:
            self._buf = self._tier.read_many(ranges, lease.view)
        except BaseException:
            pool.release(lease)
            raise
        self._lease, self._pool = lease, pool

    def release(self) -> None:
        """The reply went out (or never will): its buffer goes back to the pool.
        Idempotent; the reply's views must not be used after it."""
        self._buf = None
        lease, pool = self._lease, self._pool
        self._lease = self._pool = None
        if lease is not None and pool is not None:
            pool.release(lease)

    def tier1_ranges(self) -> list[tuple[int, int]]:
        return [
            (off, n)
            for off, n, t in zip(self._offsets, self._lengths, self._tiers, strict=True)
            if t
        ]

    def span(self) -> int:
        """Bytes of page-aligned buffer the tier-1 ranges need."""
        return self._tier.read_span(self.tier1_ranges())

    def plan_pieces(self, buf: memoryview, piece: int) -> tuple[list[Piece], list[Chunk]]:
        """Cut the reply into disk reads of at most ``piece`` bytes (page aligned, so
        ``O_DIRECT`` takes them) into ``buf`` (page aligned, :meth:`span` bytes), and
        the reply's payload into chunks in order: ``(view, piece index)``, -1 for a
        tier-0 view of the segment. A chunk may go out once its piece has landed.
        Consecutive small reads (a block's K and V spans) share one piece while it
        stays within 1.5 ``piece``: a thread hop per 512 KiB cost more than it saved
        on 2 busy cores."""
        if piece <= 0 or piece % BLOCK:
            raise ValueError(f"piece {piece} must be a positive multiple of {BLOCK}")
        tier = self._tier
        ranges = self.tier1_ranges()
        spans = iter(tier._spans(ranges))
        reads: list[tuple[int, int, memoryview]] = []
        chunks: list[Chunk] = []
        pos = 0
        seg = self._seg
        for off, n, t in zip(self._offsets, self._lengths, self._tiers, strict=True):
            if not t:
                chunks.append((seg[off : off + n], -1))
                continue
            f, start, span, skip = next(spans)
            fd = f.fd if f.direct else f.rfd
            lo, hi = pos + skip, pos + skip + n  # the range's bytes in buf
            for k in range(0, span, piece):
                a, b = pos + k, pos + min(k + piece, span)
                idx = len(reads)
                reads.append((fd, start + k, buf[a:b]))
                if max(a, lo) < min(b, hi):
                    chunks.append((buf[max(a, lo) : min(b, hi)], idx))
            pos += (span + BLOCK - 1) // BLOCK * BLOCK
            tier.reads += 1
            tier.read_bytes += n
        pieces: list[Piece] = []
        group: list[tuple[int, int, memoryview]] = []
        where: list[int] = []  # read index -> piece index
        size = 0
        for r in reads:
            if group and size + len(r[2]) > piece * 3 // 2:
                pieces.append(tuple(group))
                group, size = [], 0
            group.append(r)
            size += len(r[2])
            where.append(len(pieces))
        if group:
            pieces.append(tuple(group))
        return pieces, [(v, where[p] if p >= 0 else -1) for v, p in chunks]

    def buffer_offsets(self) -> list[int]:
        """Where each tier-1 range lands in the buffer :meth:`plan_pieces` fills."""
        out: list[int] = []
        pos = 0
        for _f, _start, span, skip in self._tier._spans(self.tier1_ranges()):
            out.append(pos + skip)
            pos += (span + BLOCK - 1) // BLOCK * BLOCK
        return out

    @property
    def all_tier1(self) -> bool:
        return all(self._tiers)

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
