"""Offset allocator for one preallocated storage segment (metadata only).

The meta service places variable-size KV objects into a storage server's
segment and only needs offsets back; this module never touches memory.

Why a TLSF-style segregated fit with immediate coalescing:

* Object sizes come from a handful of layout groups (full-attention blocks,
  sliding-window blocks, ...), so a segment sees many objects of just 2-3
  distinct sizes. Exact-size free blocks land in the same bin and are reused
  first, which keeps splits (and hence fragmentation) rare.
* Coalescing with both neighbours on every free, via ``start -> size`` and
  ``end -> start`` maps, means two adjacent free blocks never coexist, so
  eviction of neighbours rebuilds large blocks immediately instead of needing
  a compaction pass.
* Power-of-two classes split into 8 linear sub-bins bound the waste of a
  "good fit" taken from a larger bin to ~12.5%, and a bitmap of non-empty bins
  finds the next usable bin with a couple of integer ops: alloc and free are
  O(1) apart from a short bounded scan inside one bin.
* Everything is rounded to ``align`` (4 KiB by default) so every range is page
  aligned: servers can mmap/shared-memory map it and demote it with O_DIRECT.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from gcache.storage.livemap import LiveMap

_SL_BITS = 3  # 8 linear sub-bins per power-of-two class
_SL = 1 << _SL_BITS
# Blocks in one bin may be smaller than the request (a bin spans a size range);
# scanning a few finds exact-size reuse without degrading to a linear search.
_SCAN = 16


def _bin_of(units: int) -> int:
    """Bin index for a size in align units; sizes below 2*_SL get exact bins."""
    if units < _SL:
        return units
    fl = units.bit_length() - 1
    return (fl - _SL_BITS + 1) * _SL + (units >> (fl - _SL_BITS)) - _SL


class SegmentAllocator:
    """Hands out ``align``-aligned byte ranges of a ``capacity``-byte segment.

    ``capacity`` is rounded down to a multiple of ``align``; a tail shorter
    than one alignment unit is never handed out.
    """

    __slots__ = (
        "_align",
        "_bins",
        "_bitmap",
        "_capacity",
        "_free_end",
        "_free_start",
        "_live",
        "_shift",
        "_used",
    )

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._align = align
        self._shift = align.bit_length() - 1
        self._capacity = capacity & ~(align - 1)
        self._used = 0
        # start unit -> size in units of each live allocation (compact: millions)
        self._live = LiveMap()
        self._free_start: dict[int, int] = {}  # start -> size of free blocks
        self._free_end: dict[int, int] = {}  # end -> start of free blocks
        # dicts (not sets) so iteration order is insertion order: deterministic.
        self._bins: list[dict[int, None]] = [
            {} for _ in range(_bin_of(self._capacity >> self._shift) + 1)
        ]
        self._bitmap = 0
        if self._capacity:
            self._insert(0, self._capacity)

    # -- free-list plumbing ------------------------------------------------

    def _insert(self, start: int, size: int) -> None:
        self._free_start[start] = size
        self._free_end[start + size] = start
        b = _bin_of(size >> self._shift)
        self._bins[b][start] = None
        self._bitmap |= 1 << b

    def _remove(self, start: int) -> int:
        size = self._free_start.pop(start)
        del self._free_end[start + size]
        b = _bin_of(size >> self._shift)
        bin_ = self._bins[b]
        del bin_[start]
        if not bin_:
            self._bitmap &= ~(1 << b)
        return size

    def _find(self, size: int) -> int | None:
        b = _bin_of(size >> self._shift)
        bin_ = self._bins[b]
        sizes = self._free_start
        for i, start in enumerate(bin_):
            if i >= _SCAN:
                break
            if sizes[start] >= size:
                return start
        higher = self._bitmap >> (b + 1) << (b + 1)
        if higher:
            # every block in a strictly higher bin is larger than any size in bin b
            nb = (higher & -higher).bit_length() - 1
            return next(iter(self._bins[nb]))
        # Last resort, so "size <= largest_free() => success" holds exactly.
        for i, start in enumerate(bin_):
            if i >= _SCAN and sizes[start] >= size:
                return start
        return None

    @classmethod
    def with_used(
        cls,
        capacity: int,
        align: int,
        used: Iterator[tuple[int, int]] | list[tuple[int, int]] | tuple[Any, Any],
    ) -> SegmentAllocator:
        """An allocator whose live allocations are ``used``: ``(offset, size)`` by
        offset, aligned, not overlapping (the caller checked), sizes rounded up to
        ``align``; the gaps between them are its free blocks. One pass, no
        allocation per range (a restarted meta rebuilding a server's allocator from
        its report). ``used`` may be two integer arrays instead, offsets (sorted)
        and lengths."""
        self = cls(0, align)
        self._capacity = capacity & ~(align - 1)
        self._bins = [{} for _ in range(_bin_of(self._capacity >> self._shift) + 1)]
        mask = align - 1
        if isinstance(used, tuple):  # (offsets, lengths) arrays: checked at once
            offs, lens = used
            sizes = (lens + mask) & ~mask
            ends = offs + sizes
            bad = (offs & mask) != 0
            bad |= ends > self._capacity
            bad[1:] |= offs[1:] < ends[:-1]
            if len(offs) and bool(bad.any()):
                i = int(bad.argmax())
                raise ValueError(
                    f"range ({int(offs[i])}, {int(sizes[i])}) overlaps, is misaligned or outside"
                )
            shift = self._shift
            self._live.put_many(offs >> shift, sizes >> shift)
            before = np.concatenate([np.zeros(1, ends.dtype), ends[:-1]])
            for i in np.flatnonzero(offs > before).tolist():  # the gaps: free blocks
                self._insert(int(before[i]), int(offs[i] - before[i]))
            cursor = int(ends[-1]) if len(ends) else 0
            if cursor < self._capacity:
                self._insert(cursor, self._capacity - cursor)
            self._used = int(sizes.sum())
            return self
        live = self._live
        cursor = 0
        total = 0
        for off, size in used:
            size = (size + mask) & ~mask
            if off < cursor or off & mask or off + size > self._capacity:
                raise ValueError(f"range ({off}, {size}) overlaps, is misaligned or outside")
            if off > cursor:
                self._insert(cursor, off - cursor)
            live.put(off >> self._shift, size >> self._shift)
            total += size
            cursor = off + size
        if cursor < self._capacity:
            self._insert(cursor, self._capacity - cursor)
        self._used = total
        return self

    # -- public API ----------------------------------------------------------

    def alloc(self, size: int) -> int | None:
        """Allocate ``size`` bytes (rounded up to ``align``); offset or ``None`` if full."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        size = (size + self._align - 1) & ~(self._align - 1)
        if size > self._capacity - self._used:
            return None
        start = self._find(size)
        if start is None:
            return None
        block = self._remove(start)
        if block > size:
            self._insert(start + size, block - size)
        self._live.put(start >> self._shift, size >> self._shift)
        self._used += size
        return start

    def free(self, offset: int) -> None:
        """Free the allocation starting at ``offset``, merging with free neighbours."""
        units = (
            -1
            if offset < 0 or offset & (self._align - 1)
            else self._live.pop(offset >> self._shift)
        )
        if units < 0:
            raise ValueError(
                f"offset {offset} is not a live allocation (double free or foreign offset)"
            )
        size = units << self._shift
        self._used -= size
        start, end = offset, offset + size
        if end in self._free_start:
            end += self._remove(end)
        left = self._free_end.get(start)
        if left is not None:
            self._remove(left)
            start = left
        self._insert(start, end - start)

    def size_of(self, offset: int) -> int:
        """Size in bytes (after alignment round-up) of the live allocation at ``offset``."""
        units = (
            -1
            if offset < 0 or offset & (self._align - 1)
            else self._live.get(offset >> self._shift)
        )
        if units < 0:
            raise ValueError(f"offset {offset} is not a live allocation")
        return units << self._shift

    def live_nbytes(self) -> int:
        """Bytes the live map's arrays take."""
        return self._live.nbytes()

    def largest_free(self) -> int:
        """Size of the largest free block (scans only the highest non-empty bin)."""
        if not self._bitmap:
            return 0
        sizes = self._free_start
        return max(sizes[s] for s in self._bins[self._bitmap.bit_length() - 1])

    def free_ranges(self) -> Iterator[tuple[int, int]]:
        """``(offset, size)`` of every free block, by offset; O(n), for debugging/tests."""
        return iter(sorted(self._free_start.items()))

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def align(self) -> int:
        return self._align

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def live(self) -> int:
        return len(self._live)

    def stats(self) -> dict[str, int | float]:
        free = self.free_bytes
        largest = self.largest_free()
        return {
            "capacity": self._capacity,
            "used": self._used,
            "free": free,
            "live": len(self._live),
            "free_blocks": len(self._free_start),
            "largest_free": largest,
            "fragmentation": 1.0 - largest / free if free else 0.0,
        }

    def __repr__(self) -> str:
        s = self.stats()
        body = ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()
        )
        return f"{type(self).__name__}({body})"
