"""The compact index's eviction order: which objects may be evicted, and in what
order, as the meta's policies see it (``gcache/meta/eviction.py``), kept for the
columns of :class:`~gcache.meta.compact.CompactIndex`.

An object is *evictable* when it is live (in its block), no lease pins it, and it
is a windowed object (any block: a window is not needed by longer matches), or
the full object of a block that is a leaf *of its tier*: for a DRAM object no
child whose full object is in DRAM (the block's ``hot`` count; a DRAM block whose
children are all on NVMe may leave DRAM), for an NVMe one no child at all. Each
tier has its own heap of evictable objects keyed by access tick (the DRAM and the
NVMe policies rank separately); an object is in at most one of them, so one
``hpos`` column serves both. Every mutation of the index calls :meth:`refresh`
on the objects whose evictability it may have changed: the object itself and
its parent's full object.

Pins are lazy: a lease pins its objects by counting only (a lookup and its
release cost no heap operation), so a heap holds every evictable object and
perhaps some pinned ones that would be evictable unpinned; :meth:`victim` takes
a pinned object out when it reaches the top, and its last unpin puts it back.
No I/O.
"""

from __future__ import annotations

import struct
from typing import Final

import numpy as np
import numpy.typing as npt

from gcache.meta.rowtable import RowTable
from gcache.meta.tickheap import TickHeap

I32 = npt.NDArray[np.int32]

NO_FULL: Final = 255  # a namespace with no prefix-closed (full-attention) group
TIERS: Final = 2  # 0: DRAM, 1: NVMe


def float_ticks(x: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """Float keys as ``uint64`` ticks in the same order (negative ones first): the
    heaps rank by any float a policy computes (the cost policy's ``last_access +
    tau * score``) with the same integer sift. NaN is refused."""
    f = np.ascontiguousarray(x, dtype=np.float64)
    if np.isnan(f).any():
        raise ValueError("a NaN eviction key")
    f = f + 0.0  # -0.0 -> +0.0: equal keys, equal ticks
    u = f.view(np.uint64)
    neg = (u >> np.uint64(63)).astype(bool)
    out: npt.NDArray[np.uint64] = np.where(neg, ~u, u | np.uint64(1 << 63))
    return out


def float_tick(x: float) -> int:
    """:func:`float_ticks` of one float, without arrays."""
    if x != x:
        raise ValueError("a NaN eviction key")
    u: int = struct.unpack("<Q", struct.pack("<d", x + 0.0))[0]
    return (~u & 0xFFFF_FFFF_FFFF_FFFF) if u >> 63 else u | (1 << 63)


class Leaves:
    def __init__(self, blocks: RowTable, objects: RowTable, native: bool = True) -> None:
        self.blocks = blocks  # "ns", "children", "hot", "obj" columns
        self.objects = objects  # "block", "group", "tier", "pins", "tick", "hpos" columns
        self.heaps = [TickHeap(objects, native) for _ in range(TIERS)]
        # The full group of each namespace id (NO_FULL: none), set by the caller.
        self.full = np.full(1 << 16, NO_FULL, dtype=np.uint8)
        self.bulk = False  # heaps not kept (a rebuild): built once by rebuild()

    def full_of(self, bid: int) -> int:
        return int(self.full[self.blocks.cols["ns"][bid]])

    def evictable(self, oids: I32, pins: bool = True) -> npt.NDArray[np.bool_]:
        """Which of ``oids`` may be evicted now (see the module docstring);
        ``pins=False``: would be, unpinned (may stay in a heap)."""
        o, b = self.objects.cols, self.blocks.cols
        bid = o["block"][oids]
        live = bid >= 0
        safe = np.where(live, bid, 0)
        full = o["group"][oids] == self.full[b["ns"][safe]]
        kids = np.where(o["tier"][oids] == 0, b["hot"][safe], b["children"][safe])
        out: npt.NDArray[np.bool_] = live & (~full | (kids == 0))
        if pins:
            out &= o["pins"][oids] == 0
        return out

    def evictable1(self, oid: int, pins: bool = True) -> bool:
        block, pinned, group, tier = self.objects.views("block", "pins", "group", "tier")
        bid = block[oid]
        if bid < 0 or (pins and pinned[oid]):
            return False
        ns, hot, children = self.blocks.views("ns", "hot", "children")
        if group[oid] != self.full[ns[bid]]:
            return True
        return bool((hot[bid] if tier[oid] == 0 else children[bid]) == 0)

    def refresh1(self, oid: int) -> None:
        """Put ``oid`` into its tier's heap or take it out, as it is now evictable
        or not (-1: none, ignored)."""
        if self.bulk or oid < 0:
            return
        hpos, tier, pins = self.objects.views("hpos", "tier", "pins")
        if hpos[oid] >= 0:
            if not self.evictable1(oid, pins=False):
                self.heaps[tier[oid]].remove(oid)
        elif not pins[oid] and self.evictable1(oid):
            self.heaps[tier[oid]].push(oid)

    def refresh(self, oids: I32) -> None:
        """:meth:`refresh1` for many objects (-1 entries ignored), vectorised."""
        if self.bulk or not oids.size:
            return
        if oids.size <= 16:  # (a few: one by one, no array calls)
            seen: set[int] = set()
            for oid in oids.tolist():
                if oid >= 0 and oid not in seen:
                    seen.add(oid)
                    self.refresh1(oid)
            return
        oids = oids[oids >= 0]
        if oids.size > 1:  # each once, in the order given (their pushes' order)
            _, first = np.unique(oids, return_index=True)
            oids = oids[np.sort(first)]
        if oids.size <= 4:
            for oid in oids.tolist():
                self.refresh1(oid)
            return
        o = self.objects.cols
        want = self.evictable(oids, pins=False)
        has = o["hpos"][oids] >= 0
        tier = o["tier"][oids]
        drop = has & ~want
        for oid, t in zip(oids[drop].tolist(), tier[drop].tolist(), strict=True):
            self.heaps[t].remove(oid)
        add = want & ~has & (o["pins"][oids] == 0)
        for t in range(TIERS):
            rows = oids[add & (tier == t)]
            if rows.size:
                self.heaps[t].push_many(rows)

    def parents_full(self, bids: I32) -> I32:
        """The full objects of ``bids``' parents (-1 where none)."""
        b = self.blocks.cols
        parent = b["parent"][bids]
        ok = parent >= 0
        safe = np.where(ok, parent, 0)
        fg = self.full[b["ns"][safe]]
        has = ok & (fg != NO_FULL)
        out = np.full(bids.size, -1, dtype=np.int32)
        out[has] = b["obj"][safe[has], fg[has]]
        return out

    def take_out(self, oid: int) -> None:
        """Out of its heap before its tier or block changes."""
        if self.objects.cols["hpos"][oid] >= 0:
            self.heaps[int(self.objects.cols["tier"][oid])].remove(oid)

    def begin_bulk(self) -> None:
        self.bulk = True
        hpos = self.objects.cols["hpos"]
        for h in self.heaps:
            hpos[h.heap[: h.size]] = -1
            h.size = 0

    def rebuild(self) -> None:
        """Every heap from scratch, by one sort each (the end of a bulk load)."""
        self.bulk = False
        rows = self.objects.rows
        live = np.flatnonzero(self.objects.cols["block"][:rows] >= 0).astype(np.int32)
        ok = live[self.evictable(live)]
        tier = self.objects.cols["tier"][ok]
        for t, h in enumerate(self.heaps):
            self.objects.cols["hpos"][h.heap[: h.size]] = -1
            h.size = 0
            h.push_many(ok[tier == t], sort=True)

    def rekey_all(self) -> None:
        """Every object's tick changed (the cost policy's ``tau`` moved): re-sort
        the heaps, one sort each."""
        if not self.bulk:
            self.rebuild()

    def victim(self, tier: int = 0) -> int:
        """The least recently used evictable object of ``tier`` (-1: none). In a
        bulk load, the heaps are built first (the load goes on with them kept)."""
        if self.bulk:
            self.rebuild()
        h = self.heaps[tier]
        pins = self.objects.mv("pins")
        while h.size:
            top = h.top()
            if not pins[top]:
                return top
            h.remove(top)  # (pinned: back at its last unpin)
        return -1

    def size(self) -> int:
        """Heap entries (the evictable objects, and perhaps pinned ones)."""
        return sum(h.size for h in self.heaps)

    def evictable_count(self) -> int:
        """The evictable objects (heap entries less the pinned ones: a scan)."""
        pins = self.objects.cols["pins"]
        return sum(h.size - int(np.count_nonzero(pins[h.heap[: h.size]])) for h in self.heaps)

    def nbytes(self) -> int:
        return sum(h.nbytes() for h in self.heaps)
