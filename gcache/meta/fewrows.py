"""A small lease's rows (at most ``SMALL``, given as a list): pinned, touched,
read for the reply and unpinned, each in one pass with no array calls, or in one
C call each with the native kernels (``lease_rows``, ``unpin_rows`` in
``gcache/_native/_index.c``). A leased lookup of a few objects is the meta's
most frequent request; as numpy calls per object it cost about twice what the
per-object records did. The same rules as :class:`CompactIndex`'s array methods
(lazy pins: a pinned row stays in its heap until it reaches the top). No I/O."""

from __future__ import annotations

from typing import Any, Final, Protocol

from gcache.errors import CompactIndexError
from gcache.meta.leaves import Leaves
from gcache.meta.rowtable import RowTable, Slabs

SMALL: Final = 16  # batches up to this size go through scalar loops (no array calls)

Fields = tuple[int, int, int, int, int, int, bytes]
# the object columns lease_rows reads and writes, in its argument order
_LEASE_COLS = ("pins", "block", "tick", "atime", "hpos", "hseq", "tier", "server", "offset",
               "length", "group", "sums_len", "sums_slot")  # fmt: skip
Freed = tuple[int, int, int, int]  # (server, tier, offset, length) of an object gone


class CompactIndex(Protocol):
    """What of :class:`gcache.meta.compact.CompactIndex` the steps use."""

    objects: RowTable
    blocks: RowTable
    leaves: Leaves
    sums_slabs: Slabs
    kernels: Any

    def last_unpins(self, left: list[int]) -> list[tuple[int, Freed]]: ...


class FewRows:
    """The small-lease steps over one :class:`CompactIndex` (its ``few``)."""

    def __init__(self, cx: CompactIndex) -> None:
        self.cx = cx
        # The kernels' column arguments as flat memoryviews (their buffers cost a
        # kernel less than arrays'), made again when a table's columns are replaced.
        self._gens = (-1, -1)
        self._lease_cols: tuple[Any, ...] = ()
        self._unpin_cols: tuple[Any, ...] = ()

    def _cols(self) -> None:
        o, b = self.cx.objects, self.cx.blocks
        if self._gens != (o.gen, b.gen):
            self._lease_cols = (*o.views(*_LEASE_COLS), b.mv("pos"))
            self._unpin_cols = (
                *o.views("pins", "block", "hpos", "group", "tier"),
                *b.views("ns", "hot", "children"),
            )
            self._gens = (o.gen, b.gen)

    def pin(self, ids: list[int]) -> None:
        """:meth:`CompactIndex.pin` of a few rows given as a list (scalar work, no arrays)."""
        pins, block = self.cx.objects.views("pins", "block")
        rows = self.cx.objects.rows
        if any(not 0 <= oid < rows or block[oid] < 0 for oid in ids):
            raise CompactIndexError("unknown object ids")
        for oid in ids:  # (lazy: a pinned object leaves its heap at its top)
            pins[oid] += 1

    def lease(self, ids: list[int], tick: int, atime: float) -> list[Fields]:
        """A small lease in one pass over ``ids`` (rows given as a list): each
        pinned, touched at ``tick`` (and ``atime``) as :meth:`CompactIndex.touch`, and read for
        the reply: (server, offset, length, tier, group, block position,
        checksums). Refused whole (nothing pinned) when a row is not live. One C
        call with the native kernels."""
        k = self.cx.kernels
        if k is not None and len(ids) <= SMALL:
            h0, h1 = self.cx.leaves.heaps
            self._cols()
            try:
                fields, h0.seq, h1.seq = k.lease_rows(
                    ids, tick, atime, *self._lease_cols, self.cx.sums_slabs.arrays(),
                    h0.heap, h0.size, h0.seq, h1.heap, h1.size, h1.seq,
                )  # fmt: skip
            except ValueError as exc:
                raise CompactIndexError(str(exc)) from exc
            return fields  # type: ignore[no-any-return]
        (pins, block, ticks, at, hpos, server, offset, length, tier, group, slen, sslot) = (
            self.cx.objects.views("pins", "block", "tick", "atime", "hpos", "server", "offset",
                               "length", "tier", "group", "sums_len", "sums_slot")
        )  # fmt: skip
        rows = self.cx.objects.rows
        if any(not 0 <= oid < rows or block[oid] < 0 for oid in ids):
            raise CompactIndexError("unknown object ids")
        bpos = self.cx.blocks.mv("pos")
        slabs = self.cx.sums_slabs.slabs
        heaps = self.cx.leaves.heaps
        out = []
        for oid in ids:
            pins[oid] += 1  # (lazy: a pinned object leaves its heap at its top)
            ticks[oid] = tick
            at[oid] = atime
            t = tier[oid]
            if hpos[oid] >= 0:
                heaps[t].rekey(oid)
            w = slen[oid]
            if w:
                a = sslot[oid] * w
                sums = bytes(slabs[w].mv("s")[a : a + w])
            else:
                sums = b""
            out.append(
                (server[oid], offset[oid], length[oid], t, group[oid], bpos[block[oid]], sums)
            )
        return out

    def unpin(self, ids: list[int]) -> list[tuple[int, Freed]]:
        """:meth:`CompactIndex.unpin_rows` of a few rows given as a list (no array calls; one
        C call with the native kernels)."""
        k = self.cx.kernels
        if k is not None and len(ids) <= SMALL:
            self._cols()
            try:
                left = k.unpin_rows(ids, *self._unpin_cols, self.cx.leaves.full)
            except ValueError as exc:
                raise CompactIndexError(str(exc)) from exc
            return self.cx.last_unpins(left)
        pins, hpos = self.cx.objects.views("pins", "hpos")
        rows = self.cx.objects.rows
        if len(set(ids)) == len(ids):  # (each once: a lease's objects)
            want = dict.fromkeys(ids, 1)
            if any(not 0 <= oid < rows or pins[oid] < 1 for oid in ids):
                raise CompactIndexError("unpin of an object no lease holds")
        else:
            want = {}
            for oid in ids:
                want[oid] = want.get(oid, 0) + 1
            if any(not 0 <= oid < rows or pins[oid] < n for oid, n in want.items()):
                raise CompactIndexError("unpin of an object no lease holds")
        left = []
        for oid, n in want.items():
            pins[oid] -= n
            if not pins[oid] and hpos[oid] < 0:  # (in its heap: pins are lazy, it stays)
                left.append(oid)
        return self.cx.last_unpins(left)

    def touch(self, ids: list[int], tick: int, atime: float | None = None) -> None:
        """:meth:`CompactIndex.touch` of a few rows given as a list (scalar work, no arrays)."""
        heaps = self.cx.leaves.heaps
        ticks, hpos, tier, at = self.cx.objects.views("tick", "hpos", "tier", "atime")
        for oid in ids:
            ticks[oid] = tick
            if atime is not None:
                at[oid] = atime
            if hpos[oid] >= 0:
                heaps[tier[oid]].rekey(oid)
