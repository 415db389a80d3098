"""Index bookkeeping shared by the meta's put, lookup and eviction paths: dropping
objects and entries with incremental counters, returning ranges to allocators, and
the prefix search. :class:`~gcache.meta.core.MetaCore` builds on it; nothing here
does I/O or reads the clock."""

from __future__ import annotations

from collections import Counter

from gcache.config import MetaConfig
from gcache.meta.eviction import EvictionPolicy
from gcache.meta.records import (
    EVICTED,
    GONE,
    BlockEntry,
    NamespaceRecord,
    ObjectRecord,
    ServerRecord,
)

# Freed ranges reported to a server per heartbeat reply, at most (the server only
# counts them; a longer backlog is dropped rather than grown without bound).
MAX_FREED_REPORT = 1 << 16


def present_prefix(entries: dict[bytes, BlockEntry], key_list: list[bytes]) -> int:
    """How many leading keys of ``key_list`` have an entry. Entries are prefix-closed
    (an entry is created only under its parent, and a parent with children is never
    dropped) and a key names its whole prefix, so presence is monotone along a
    prompt: binary search, O(log n) dict lookups instead of n."""
    lo, hi = 0, len(key_list)  # key_list[:lo] present; key_list[hi:] absent
    if hi and key_list[hi - 1] in entries:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if key_list[mid] in entries:
            lo = mid + 1
        else:
            hi = mid
    return lo


class IndexStore:
    """The counters and the eviction mechanics of the index (which object goes is
    the policy's decision; this is how it goes)."""

    cfg: MetaConfig
    policy: EvictionPolicy
    counters: Counter[str]
    group_bytes: Counter[str]
    entries: int
    live_objects: int
    live_bytes: int

    def _check_watermark(self, srv: ServerRecord) -> None:
        cap = srv.allocator.capacity
        if srv.reclaimable_used > self.cfg.high_watermark * cap:
            self._evict(srv, target_used=int(self.cfg.low_watermark * cap))

    def _evict(self, srv: ServerRecord, target_used: int = -1, need_contiguous: int = 0) -> int:
        """Evict from ``srv`` until its reclaimable usage is at most ``target_used``
        or a ``need_contiguous``-byte allocation would fit. Returns objects evicted."""
        evicted = 0
        allocator = srv.allocator
        evict_object = self._evict_object
        for obj, ns in self.policy.candidates(srv):
            entry = obj.entry
            if obj.group == ns.full_group:
                # Without its full object a block serves no match: take all of it.
                for g, o in enumerate(entry.objects):
                    if o is not None:
                        evict_object(ns, entry, g)
                        evicted += 1
            else:
                evict_object(ns, entry, obj.group)
                evicted += 1
            if entry.children == 0 and not any(entry.objects):
                self._prune(ns, entry)
            if need_contiguous and allocator.largest_free() >= need_contiguous:
                break
            if target_used >= 0 and allocator.used - srv.deferred_bytes <= target_used:
                break
        return evicted

    def _evict_object(self, ns: NamespaceRecord, entry: BlockEntry, g: int) -> None:
        # _unlink and _free_range inlined: this runs once per evicted object.
        obj = entry.objects[g]
        assert obj is not None
        entry.objects[g] = None
        if g == ns.full_group:
            ns.full_holes += 1
        srv = obj.server
        size = obj.length
        srv.objects -= 1
        self.live_objects -= 1
        self.live_bytes -= size
        self.group_bytes[ns.layout.group_names[g]] -= size
        obj.state = EVICTED
        counters = self.counters
        counters["evictions"] += 1
        counters["evicted_bytes"] += size
        self.policy.evicted(obj, ns)
        if obj.pins > 0:
            srv.deferred_bytes += size
        else:
            obj.state = GONE
            if srv.alive:
                srv.allocator.free(obj.offset)
                if len(srv.freed) < MAX_FREED_REPORT:
                    srv.freed.append((obj.offset, size))

    def _unlink(self, ns: NamespaceRecord, entry: BlockEntry, g: int) -> ObjectRecord:
        obj = entry.objects[g]
        assert obj is not None
        entry.objects[g] = None
        if g == ns.full_group:
            ns.full_holes += 1
        obj.server.objects -= 1
        self.live_objects -= 1
        self.live_bytes -= obj.length
        self.group_bytes[ns.layout.group_names[g]] -= obj.length
        obj.state = EVICTED
        return obj

    def _prune(self, ns: NamespaceRecord, entry: BlockEntry | None) -> None:
        """Drop empty childless entries, walking up; tell the policy about new leaves."""
        entries = ns.entries
        while entry is not None and entry.children == 0 and not any(entry.objects):
            if entries.get(entry.key) is not entry:
                return  # already pruned
            del entries[entry.key]
            self.entries -= 1
            if ns.full_group is not None:
                ns.full_holes -= 1
            parent = entry.parent
            if parent is None:
                return
            parent.children -= 1
            if parent.children == 0:
                self.policy.became_leaf(parent, ns)
            entry = parent

    def _free_object(self, obj: ObjectRecord) -> None:
        obj.state = GONE
        self._free_range(obj.server, obj.offset, obj.length)

    def _free_range(self, srv: ServerRecord, offset: int, length: int) -> None:
        if not srv.alive:
            return
        srv.allocator.free(offset)
        if len(srv.freed) < MAX_FREED_REPORT:
            srv.freed.append((offset, length))

    def _ensure_entry(self, ns: NamespaceRecord, key_list: list[bytes], block: int) -> BlockEntry:
        entries = ns.entries
        entry = entries.get(key_list[block])
        if entry is not None:
            return entry
        # Walk back to the nearest existing ancestor, then create the chain forward.
        start = block
        while start > 0 and key_list[start - 1] not in entries:
            start -= 1
        if start == block and start > 0:  # the common case: the parent exists
            up = entries[key_list[block - 1]]
            entry = entries[key_list[block]] = BlockEntry(
                key_list[block], up, block, len(up.objects)
            )
            up.children += 1
            self.entries += 1
            if ns.full_group is not None:
                ns.full_holes += 1
            return entry
        parent = entries.get(key_list[start - 1]) if start > 0 else None
        groups = ns.layout.num_groups
        for i in range(start, block + 1):
            entry = BlockEntry(key_list[i], parent, i, groups)
            entries[key_list[i]] = entry
            self.entries += 1
            if ns.full_group is not None:
                ns.full_holes += 1
            if parent is not None:
                parent.children += 1
            parent = entry
        assert entry is not None
        return entry
