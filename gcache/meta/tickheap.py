"""An indexed binary min-heap of row ids keyed by a ``uint64`` tick column of a
:class:`~gcache.meta.rowtable.RowTable` (the compact index's eviction order: the
least recently used evictable object at the top), ties broken by the ``hseq``
column: the order rows were pushed or re-keyed in (as a lazy heap of (key,
sequence) items would rank them). Each row's place in the heap is
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
        self.rows = rows  # has "tick", "hseq" (uint64) and "hpos" (int32, filled -1) columns
        self.seq = 0  # the next push's (or re-key's) sequence number
        self.heap = np.empty(MIN_ROWS, dtype=np.int32)
        self.size = 0
        self.kernels = INDEX_KERNELS if native else None

    def _fix(self, i: int) -> None:
        """Restore the heap order around position ``i`` (up, then down)."""
        k = self.kernels
        if k is not None:
            c = self.rows.cols
            k.heap_sift(self.heap, c["tick"], c["hseq"], c["hpos"], self.size, i)
            return
        item = int(self.heap[i])
        self._sift_up(i)
        self._sift_down(int(self.rows.cols["hpos"][item]))

    def top(self) -> int:
        """The row with the smallest tick (-1: empty)."""
        return int(self.heap[0]) if self.size else -1

    def push(self, row: int) -> None:
        self.rows.mv("hseq")[row] = self.seq
        self.seq += 1
        self._push(row)

    def _push(self, row: int) -> None:
        if self.size == self.heap.size:
            grown = np.empty(2 * self.heap.size, dtype=np.int32)
            grown[: self.size] = self.heap[: self.size]
            self.heap = grown
        self.heap[self.size] = row
        self.rows.mv("hpos")[row] = self.size
        self.size += 1
        self._fix(self.size - 1)

    def push_many(self, rows: I32, sort: bool = False) -> None:
        """Push ``rows``: one by one, or (``sort``, or a batch past an eighth of the
        heap) by sorting everything by tick."""
        c = self.rows.cols
        c["hseq"][rows] = np.arange(self.seq, self.seq + rows.size, dtype=np.uint64)
        self.seq += rows.size
        if not sort and rows.size <= max(1024, self.size // 8):
            for row in rows.tolist():
                self._push(row)
            return
        items = np.concatenate([self.heap[: self.size], rows])
        items = items[np.lexsort((c["hseq"][items], c["tick"][items]))]
        if items.size > self.heap.size:
            self.heap = np.empty(max(2 * self.heap.size, items.size), dtype=np.int32)
        self.heap[: items.size] = items
        self.size = items.size
        self.rows.cols["hpos"][items] = np.arange(items.size, dtype=np.int32)

    def remove(self, row: int) -> None:
        """Take ``row`` out (it must be in the heap)."""
        hpos = self.rows.mv("hpos")
        i = hpos[row]
        hpos[row] = -1
        self.size -= 1
        if i == self.size:
            return
        last = int(self.heap[self.size])
        self.heap[i] = last
        hpos[last] = i
        self._fix(i)

    def rekey(self, row: int) -> None:
        """``row``'s tick changed (or it was used again): it ranks after every row
        of its tick pushed before; restore the heap order around it."""
        self.rows.mv("hseq")[row] = self.seq
        self.seq += 1
        self._fix(self.rows.mv("hpos")[row])

    def reseq1(self, row: int) -> None:
        """:meth:`reseq` of one row (if it is in the heap)."""
        if self.rows.mv("hpos")[row] >= 0:
            self.rekey(row)

    def reseq(self, rows: I32) -> None:
        """Rows in the heap rank, among equal ticks, in the order given (after
        every row pushed before): a batch admitted out of its order."""
        hpos = self.rows.cols["hpos"]
        for row in rows[hpos[rows] >= 0].tolist():
            self.rekey(row)

    def _key(self, row: int) -> tuple[int, int]:
        c = self.rows.cols
        return int(c["tick"][row]), int(c["hseq"][row])

    def _sift_up(self, i: int) -> None:
        heap, hpos = self.heap, self.rows.cols["hpos"]
        key = self._key
        item = int(heap[i])
        mine = key(item)
        while i:
            up = (i - 1) >> 1
            above = int(heap[up])
            if key(above) <= mine:
                break
            heap[i] = above
            hpos[above] = i
            i = up
        heap[i] = item
        hpos[item] = i

    def _sift_down(self, i: int) -> None:
        heap, hpos = self.heap, self.rows.cols["hpos"]
        key = self._key
        n = self.size
        item = int(heap[i])
        mine = key(item)
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and key(int(heap[c + 1])) < key(int(heap[c])):
                c += 1
            child = int(heap[c])
            if key(child) >= mine:
                break
            heap[i] = child
            hpos[child] = i
            i = c
        heap[i] = item
        hpos[item] = i

    def nbytes(self) -> int:
        return 4 * self.size
