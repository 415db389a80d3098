"""The eviction mechanics over the index (``meta/index.py``): candidates in the
policies' store-wide order (the compact index's heaps), evicting them until a
server has room, admin evictions of named objects, and a dead server's objects
taken out. Which object goes is the policies' order; this is how it goes. No
I/O, no clock."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from gcache.meta.compact import DETACHED
from gcache.meta.handles import LIVE
from gcache.meta.records import BlockEntry, NamespaceRecord, ObjectRecord, ServerRecord
from gcache.meta.session import Principal

if TYPE_CHECKING:
    from gcache.meta.index import Index


class Evictions:
    """Eviction over one :class:`~gcache.meta.index.Index` (its ``evictions``)."""

    def __init__(self, ix: Index) -> None:
        self.ix = ix

    def candidates(self, tier: int = 0) -> Iterator[tuple[ObjectRecord, NamespaceRecord]]:
        """Evictable objects of ``tier``, store-wide, best victim first. Each is
        taken out of the order as it is yielded: the caller evicts it, or puts it
        back (:meth:`requeue`)."""
        cx = self.ix.cx
        o, b = cx.objects.cols, cx.blocks.cols
        pol = self.ix.tier_policy(tier)
        while True:
            oid = cx.victim(tier)
            if oid < 0:
                return
            cx.leaves.take_out(oid)
            obj = self.ix.store.obj(oid)
            ns = self.ix.ns_by_id[int(b["ns"][int(o["block"][oid])])]
            if pol.events and pol.stale(obj, ns):
                self.ix.rekey(np.array([oid], dtype=np.int32))
                cx.leaves.refresh1(oid)
                continue
            yield obj, ns
            o, b = cx.objects.cols, cx.blocks.cols  # (grown meanwhile)

    def requeue(self, obj: ObjectRecord) -> None:
        """A candidate taken and not evicted: back in the order (if evictable)."""
        if obj.state == LIVE:
            self.ix.cx.leaves.refresh1(obj.oid)

    def evict(
        self,
        srv: ServerRecord,
        target_used: int = -1,
        need_contiguous: int = 0,
        max_bytes: int = 1 << 62,
    ) -> int:
        """Evict in the policy's store-wide order until ``srv``'s reclaimable usage is
        at most ``target_used`` or a ``need_contiguous``-byte allocation fits there,
        or ``max_bytes`` went. The policy ranks objects of every server together (an
        old prompt split across servers goes before a fresh one). Returns bytes
        evicted."""
        return self.evict_pass(srv, target_used, need_contiguous, max_bytes)[0]

    def evict_pass(
        self,
        srv: ServerRecord,
        target_used: int = -1,
        need_contiguous: int = 0,
        max_bytes: int = 1 << 62,
        max_objects: int = 1 << 62,
    ) -> tuple[int, int]:
        """:meth:`evict`, taking at most ``max_objects`` candidates. Returns (bytes
        evicted, candidates taken)."""
        evicted = taken = 0
        allocator = srv.allocator
        drop = self.drop
        for obj, ns in self.candidates(0):
            evicted += drop(obj, ns)
            taken += 1
            if need_contiguous and allocator.largest_free() >= need_contiguous:
                break
            if target_used >= 0 and srv.reclaimable_used <= target_used:
                break
            if evicted >= max_bytes or taken >= max_objects:
                break
        return evicted, taken

    def drop(self, obj: ObjectRecord, ns: NamespaceRecord) -> int:
        """Evict a policy's candidate; returns the bytes that left the index."""
        bid = int(self.ix.cx.objects.cols["block"][obj.oid])
        group = obj.group
        evicted = 0
        b = self.ix.cx.blocks.cols
        if group == ns.full_group:
            # Without its full object a block serves no match: take all of it.
            for g, oid in enumerate(b["obj"][bid, : ns.layout.num_groups].tolist()):
                if oid >= 0:
                    evicted += self.evict_object(ns, bid, g)
        else:
            evicted += self.evict_object(ns, bid, group)
        self.ix.prune(ns, bid)
        return evicted

    def evict_keys(
        self, fp: bytes, key_list: list[bytes], groups: int, who: Principal | None = None
    ) -> tuple[int, int]:
        """Admin eviction of named objects (``who``: the tenant asking, checked for
        access to the namespace; None: the operator). A full object goes only from a
        leaf (with its whole block); windowed objects may go from any block. Returns
        (evicted, refused)."""
        ns = self.ix.namespace(fp, who)
        self.ix.check_keys(key_list)
        evicted = refused = 0
        b = self.ix.cx.blocks.cols
        n = ns.layout.num_groups
        for key in key_list:
            bid = ns.entries.find(key)
            if bid < 0:
                continue
            for g in range(n):
                if not groups >> g & 1 or b["obj"][bid, g] < 0:
                    continue
                if g == ns.full_group:
                    if b["children"][bid]:
                        refused += 1
                        continue
                    for g2 in range(n):
                        if b["obj"][bid, g2] >= 0:
                            self.evict_object(ns, bid, g2)
                            evicted += 1
                    break
                self.evict_object(ns, bid, g)
                evicted += 1
            self.ix.prune(ns, bid)
        return evicted, refused

    def evict_object(self, ns: NamespaceRecord, entry: BlockEntry | int, g: int) -> int:
        """Evict object ``g`` of a block; returns its bytes."""
        ghost = self.ix.unlink(ns, entry, g)
        size = ghost.length
        counters = self.ix.counters
        counters["evictions"] += 1
        counters["evicted_bytes"] += size
        if ghost.tier:
            counters["nvme_evictions"] += 1
        pol = self.ix.pol(ghost)
        if pol.events:
            pol.evicted(ghost, ns)
        if ghost.pinned:
            if ghost.tier == 0:
                ghost.server.deferred_bytes += size
        else:
            # A committed object's write grant was consumed (its receipt proves it):
            # its range may be re-used at once.
            self.ix.free_copy(ghost.server, ghost.tier, ghost.offset, size)
        return size

    def drop_server_objects(self, srv: ServerRecord, why: str) -> None:
        """Take every object of a dead server out of the index (nothing to free:
        its memory is gone); leased ones are forgotten, not freed, when their
        leases end."""
        o = self.ix.cx.objects.cols
        for oid in self.ix.server_objects(srv).tolist():
            bid = int(o["block"][oid])
            if bid < 0:
                continue  # its block went with an earlier one of the same block
            ns = self.ix.ns_by_id[int(self.ix.cx.blocks.cols["ns"][bid])]
            ghost = self.ix.unlink(ns, bid, int(o["group"][oid]), why)
            self.ix.forget(ghost)
            self.ix.prune(ns, bid)
            o = self.ix.cx.objects.cols

    def detached_of(self, srv: ServerRecord) -> list[int]:
        """Rows of ``srv``'s objects evicted while leased (their rows held)."""
        if srv.slot < 0:
            return []
        o = self.ix.cx.objects
        n = o.rows
        hit = (o.cols["server"][:n] == srv.slot) & (o.cols["block"][:n] == DETACHED)
        return np.flatnonzero(hit).tolist()
