"""An indexed binary min-heap of row ids keyed by a ``uint64`` tick column of a
:class:`~gcache.meta.rowtable.RowTable` (the compact index's eviction order: the
least recently used evictable object at the top). Each row's place in the heap is
kept in its ``hpos`` column (-1: not in the heap), so a touched or removed row is
re-sifted or taken out in O(log n). A large batch goes in by one sort (a sorted
array is a heap). A sift runs in C over the same arrays when the native kernels
are built (``gcache._native.INDEX_KERNELS``), else in the Python loops below (the
same order; the tests run both). No I/O."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gcache._native import INDEX_KERNELS
from gcache.meta.rowtable import MIN_ROWS, RowTable

I32 = npt.NDArray[np.int32]


class TickHeap:
    def __init__(self, rows: RowTable, native: bool = True) -> None:
        self.rows = rows  # has "tick" (uint64) and "hpos" (int32, filled -1) columns
        self.heap = np.empty(MIN_ROWS, dtype=np.int32)
        self.size = 0
        self.kernels = INDEX_KERNELS if native else None

    def _fix(self, i: int) -> None:
        """Restore the heap order around position ``i`` (up, then down)."""
        k = self.kernels
        if k is not None:
            c = self.rows.cols
            k.heap_sift(self.heap, c["tick"], c["hpos"], self.size, i)
            return
        item = int(self.heap[i])
        self._sift_up(i)
        self._sift_down(int(self.rows.cols["hpos"][item]))

    def top(self) -> int:
        """The row with the smallest tick (-1: empty)."""
        return int(self.heap[0]) if self.size else -1

    def push(self, row: int) -> None:
        if self.size == self.heap.size:
            grown = np.empty(2 * self.heap.size, dtype=np.int32)
            grown[: self.size] = self.heap[: self.size]
            self.heap = grown
        self.heap[self.size] = row
        self.rows.cols["hpos"][row] = self.size
        self.size += 1
        self._fix(self.size - 1)

    def push_many(self, rows: I32, sort: bool = False) -> None:
        """Push ``rows``: one by one, or (``sort``, or a batch past an eighth of the
        heap) by sorting everything by tick."""
        if not sort and rows.size <= max(1024, self.size // 8):
            for row in rows:
                self.push(int(row))
            return
        items = np.concatenate([self.heap[: self.size], rows])
        items = items[np.argsort(self.rows.cols["tick"][items], kind="stable")]
        if items.size > self.heap.size:
            self.heap = np.empty(max(2 * self.heap.size, items.size), dtype=np.int32)
        self.heap[: items.size] = items
        self.size = items.size
        self.rows.cols["hpos"][items] = np.arange(items.size, dtype=np.int32)

    def remove(self, row: int) -> None:
        """Take ``row`` out (it must be in the heap)."""
        hpos = self.rows.cols["hpos"]
        i = int(hpos[row])
        hpos[row] = -1
        self.size -= 1
        if i == self.size:
            return
        last = int(self.heap[self.size])
        self.heap[i] = last
        hpos[last] = i
        self._fix(i)

    def rekey(self, row: int) -> None:
        """``row``'s tick changed: restore the heap order around it."""
        self._fix(int(self.rows.cols["hpos"][row]))

    def _sift_up(self, i: int) -> None:
        heap, tick, hpos = self.heap, self.rows.cols["tick"], self.rows.cols["hpos"]
        item = int(heap[i])
        key = tick[item]
        while i:
            up = (i - 1) >> 1
            above = int(heap[up])
            if tick[above] <= key:
                break
            heap[i] = above
            hpos[above] = i
            i = up
        heap[i] = item
        hpos[item] = i

    def _sift_down(self, i: int) -> None:
        heap, tick, hpos = self.heap, self.rows.cols["tick"], self.rows.cols["hpos"]
        n = self.size
        item = int(heap[i])
        key = tick[item]
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and tick[heap[c + 1]] < tick[heap[c]]:
                c += 1
            child = int(heap[c])
            if tick[child] >= key:
                break
            heap[i] = child
            hpos[child] = i
            i = c
        heap[i] = item
        hpos[item] = i

    def nbytes(self) -> int:
        return 4 * self.size
