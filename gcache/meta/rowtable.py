"""Rows of named numpy columns sharing one capacity (the compact index's blocks,
objects and checksum slabs): grown by doubling, row ids reused through a free
stack. Pages past the rows in use are never touched (``np.empty``), so RSS follows
the rows, not the capacity. No I/O."""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

I32 = npt.NDArray[np.int32]

MIN_ROWS: Final = 1024


def unique_ids(ids: I32) -> I32:
    """The distinct values of ``ids``, sorted (one sort: faster than ``np.unique``'s
    hash path for the few thousand ids of a prompt)."""
    s = np.sort(ids)
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class RowTable:
    """``spec``: column name -> (dtype, width; 0 for a 1-D column); ``fill``: the
    value a column takes in every row handed out (others are left as they were);
    ``init``: the value a column takes in a row handed out for the first time
    (a generation count, kept across reuse)."""

    def __init__(
        self,
        spec: dict[str, tuple[str, int]],
        fill: dict[str, int],
        init: dict[str, int] | None = None,
    ) -> None:
        self.spec = spec
        self.fill = fill
        self.init = init or {}
        # fill as Python numbers of each column's kind (memoryview stores want them)
        self._fill1: list[tuple[str, float | int]] = [
            (name, float(v) if np.dtype(spec[name][0]).kind == "f" else int(v))
            for name, v in fill.items()
            if not spec[name][1]
        ]
        self._fill2 = self._row_patterns()
        self.cap = 0
        self.gen = 0  # bumped when the columns are replaced (their views are stale)
        self.rows = 0  # high-water mark of row ids handed out
        self.free = np.empty(0, dtype=np.int32)
        self.nfree = 0
        self.cols: dict[str, np.ndarray] = {}
        self._mv: dict[str, Any] = {}  # flat memoryviews of the columns
        self._views: dict[tuple[str, ...], tuple[Any, ...]] = {}
        self._arrs: dict[tuple[str, ...], tuple[np.ndarray, ...]] = {}
        self._take_views: tuple[list[tuple[Any, int]], list[tuple[Any, float | int]]] | None
        self._take_views = None
        self._grow(MIN_ROWS)

    def _row_patterns(self) -> list[tuple[str, bytes]]:
        """The fill of each 2-D column as one row's bytes (written into the
        column's byte view: no array made per row)."""
        return [
            (name, np.full(self.spec[name][1], value, dtype=self.spec[name][0]).tobytes())
            for name, value in self.fill.items()
            if self.spec[name][1]
        ]

    def arrays(self, *names: str) -> tuple[np.ndarray, ...]:
        """The columns ``names`` (one call for a kernel's arguments; valid until the
        table grows, as :meth:`mv`)."""
        v = self._arrs.get(names)
        if v is None:
            v = self._arrs[names] = tuple(self.cols[n] for n in names)
        return v

    def views(self, *names: str) -> tuple[Any, ...]:
        """:meth:`mv` of several columns at once (one call for a scalar path)."""
        v = self._views.get(names)
        if v is None:
            v = self._views[names] = tuple(self.mv(n) for n in names)
        return v

    def mv(self, name: str) -> Any:
        """Column ``name`` as a flat memoryview (a 2-D column row-major): element
        reads and writes twice as fast as a numpy scalar's, giving Python numbers.
        Valid until the table grows (:meth:`take` of new rows, :meth:`widen`):
        for scalar work between two such calls."""
        v = self._mv.get(name)
        if v is None:
            arr = self.cols[name]
            raw: Any = memoryview(arr.data).cast("B")  # (typeshed: a cast to one letter)
            v = self._mv[name] = raw.cast(arr.dtype.char)
        return v

    def _grow(self, cap: int) -> None:
        self.gen += 1
        self._mv.clear()
        self._views.clear()
        self._arrs.clear()
        self._take_views = None
        for name, (dtype, width) in self.spec.items():
            shape = (cap, width) if width else (cap,)
            new = np.empty(shape, dtype=dtype)
            old = self.cols.get(name)
            if old is not None:
                new[: self.rows] = old[: self.rows]
            self.cols[name] = new
        self.cap = cap

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows now, in one growth (a rebuild that knows how many
        objects are coming): the pages past the rows in use stay untouched, so
        this costs address space, not memory. Best effort: where the system
        refuses the address space, the table grows as it fills."""
        if rows > self.cap:
            try:
                self._grow(rows)
            except MemoryError:
                pass

    def take(self, n: int) -> I32:
        """``n`` row ids: freed ones first, then new rows. A column array may be
        replaced (grown): read ``cols`` again after a take."""
        reuse = min(n, self.nfree)
        ids = np.empty(n, dtype=np.int32)
        ids[:reuse] = self.free[self.nfree - reuse : self.nfree]
        self.nfree -= reuse
        more = n - reuse
        if self.rows + more > self.cap:
            self._grow(max(2 * self.cap, self.rows + more))
        ids[reuse:] = np.arange(self.rows, self.rows + more, dtype=np.int32)
        for name, value in self.init.items():
            self.cols[name][self.rows : self.rows + more] = value
        self.rows += more
        for name, value in self.fill.items():
            self.cols[name][ids] = value
        return ids

    def take1(self) -> int:
        """One row id (:meth:`take` without arrays)."""
        if self.nfree:
            self.nfree -= 1
            row = int(self.free[self.nfree])
        else:
            if self.rows + 1 > self.cap:
                self._grow(2 * self.cap)
            row = self.rows
            self.rows += 1
            for view, value in self._stores()[0]:
                view[row] = value
        for view, v in self._stores()[1]:
            view[row] = v
        for name, pattern in self._fill2:
            w = len(pattern)
            self.byte_view(name)[row * w : (row + 1) * w] = pattern
        return row

    def byte_view(self, name: str) -> Any:
        """Column ``name``'s bytes as a flat memoryview (valid as :meth:`mv`)."""
        key = name + ":B"
        v = self._mv.get(key)
        if v is None:
            v = self._mv[key] = memoryview(self.cols[name].data).cast("B")
        return v

    def _stores(self) -> tuple[list[tuple[Any, int]], list[tuple[Any, float | int]]]:
        """(init, fill of the 1-D columns) as (memoryview, value) pairs: what
        :meth:`take1` writes, made once per growth."""
        v = self._take_views
        if v is None:
            v = self._take_views = (
                [(self.mv(name), value) for name, value in self.init.items()],
                [(self.mv(name), value) for name, value in self._fill1],
            )
        return v

    def widen(self, name: str, width: int, value: int) -> None:
        """Column ``name`` (2-D) grows to ``width`` per row, new cells ``value``."""
        dtype, old = self.spec[name]
        if width <= old:
            return
        new = np.empty((self.cap, width), dtype=dtype)  # (rows past ``rows``: untouched)
        new[: self.rows, :old] = self.cols[name][: self.rows]
        new[: self.rows, old:] = value
        self.gen += 1
        self._mv.clear()
        self._views.clear()
        self._arrs.clear()
        self._take_views = None
        self.cols[name] = new
        self.spec[name] = (dtype, width)
        self._fill2 = self._row_patterns()

    def give(self, ids: I32) -> None:
        """Row ids back to the free stack."""
        if self.nfree + len(ids) > self.free.size:
            grown = np.empty(max(2 * self.free.size, self.nfree + len(ids), 64), np.int32)
            grown[: self.nfree] = self.free[: self.nfree]
            self.free = grown
        self.free[self.nfree : self.nfree + len(ids)] = ids
        self.nfree += len(ids)

    def give1(self, row: int) -> None:
        """One row id back to the free stack (no array made for it)."""
        if self.nfree == self.free.size:
            grown = np.empty(max(2 * self.free.size, 64), np.int32)
            grown[: self.nfree] = self.free[: self.nfree]
            self.free = grown
        self.free[self.nfree] = row
        self.nfree += 1

    def nbytes(self) -> int:
        """Bytes of the rows in use (what RSS holds for them) and the free stack."""
        per_row = sum(np.dtype(d).itemsize * max(1, w) for d, w in self.spec.values())
        return per_row * self.rows + 4 * self.free.size


class Slabs:
    """Byte strings of a few fixed lengths (an object's checksums), one
    :class:`RowTable` slab per length: ``put`` returns slots, ``get`` one back."""

    def __init__(self) -> None:
        self.slabs: dict[int, RowTable] = {}
        self.hint = 0  # rows a slab is made with room for (RowTable.reserve)

    def arrays(self) -> dict[int, np.ndarray]:
        """Each slab's bytes column by width."""
        return {w: t.cols["s"] for w, t in self.slabs.items()}

    def _slab(self, width: int) -> RowTable:
        slab = self.slabs.get(width)
        if slab is None:
            slab = self.slabs[width] = RowTable({"s": ("u1", width)}, {})
            slab.reserve(self.hint)
        return slab

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in every slab, made or to be made."""
        self.hint = rows
        for slab in self.slabs.values():
            slab.reserve(rows)

    def put(self, rows: npt.NDArray[np.uint8]) -> I32:
        """Store each row of ``rows`` (n x width bytes); returns their slots (-1
        for a width of 0: nothing stored)."""
        n, width = rows.shape if rows.ndim == 2 else (len(rows), 0)
        if not width:
            return np.full(n, -1, dtype=np.int32)
        slab = self._slab(width)
        slots = slab.take(n)
        slab.cols["s"][slots] = rows
        return slots

    def put1(self, data: bytes) -> int:
        """Store one byte string; returns its slot (-1 for an empty one)."""
        width = len(data)
        if not width:
            return -1
        slab = self._slab(width)
        slot = slab.take1()
        slab.mv("s")[slot * width : (slot + 1) * width] = data
        return slot

    def get(self, width: int, slot: int) -> bytes:
        return self.slabs[width].cols["s"][slot].tobytes() if width else b""

    def free(self, width: int, slot: int) -> None:
        if width:
            self.slabs[width].give1(slot)

    def nbytes(self) -> int:
        return sum(slab.nbytes() for slab in self.slabs.values())
