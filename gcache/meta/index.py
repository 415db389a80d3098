"""Index bookkeeping shared by the meta's put, lookup and eviction paths: linking
and dropping objects and entries with incremental counters, pins, accesses and
demotion marks, returning ranges to allocators. Every other component of the meta
changes records through it; nothing here does I/O or reads the clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from gcache.config import MetaConfig
from gcache.errors import E_ACCESS_DENIED, E_BAD_REQUEST, E_UNKNOWN_NAMESPACE, Refusal
from gcache.keys import KEY_SIZE
from gcache.meta.events import EVICTED as REMOVED_EVICTED
from gcache.meta.events import RemovalFeed
from gcache.meta.eviction import EvictionPolicy
from gcache.meta.quarantine import Quarantine
from gcache.meta.records import (
    EVICTED,
    GONE,
    LIVE,
    BlockEntry,
    NamespaceRecord,
    ObjectRecord,
    ServerRecord,
)
from gcache.meta.session import Principal

LEAVING_DRAM = -2  # ObjectRecord.hits of a full DRAM object being demoted (mark_leaving)


def _nothing() -> None: ...


# Freed ranges reported to a server per heartbeat reply, at most (the server only
# counts them; a longer backlog is dropped rather than grown without bound).
MAX_FREED_REPORT = 1 << 16


class Index:
    """The prefix index of every namespace and its store-wide totals: linking and
    unlinking objects with incremental counters, the eviction mechanics (which
    object goes is the policy's decision; this is how it goes), returning ranges to
    allocators, and the quarantine of ranges freed from pending puts."""

    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        policy: EvictionPolicy,
        nvme_policy: EvictionPolicy,
        removals: RemovalFeed,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.policy = policy  # orders DRAM (tier 0) objects
        self.nvme_policy = nvme_policy  # orders NVMe (tier 1) objects
        self.removals = removals  # removed blocks, for WatchRemovals subscribers
        self.namespaces: dict[bytes, NamespaceRecord] = {}
        self.ns_by_id: dict[int, NamespaceRecord] = {}
        self.group_bytes: Counter[str] = Counter()
        self.tenant_bytes: Counter[str] = Counter()  # committed bytes per tenant
        self.entries = 0
        self.live_objects = 0
        self.live_bytes = 0
        # Ranges of pending puts whose write grants may still be presented; they
        # return to the allocator only after.
        self.quarantine = Quarantine(self.free_range)
        # Called when a server's manifest outbox reaches its bound (placement pauses
        # there): the wiring points it at Membership.invalidate.
        self.outbox_full: Callable[[], None] = _nothing

    def pol(self, obj: ObjectRecord) -> EvictionPolicy:
        return self.nvme_policy if obj.tier else self.policy

    def leaf_now(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        """``entry`` may have become a leaf of its full object's tier: tell that
        tier's policy."""
        fg = ns.full_group
        if fg is None:
            return
        full = entry.objects[fg]
        if full is not None:
            self.pol(full).became_leaf(entry, ns)

    def link_object(self, ns: NamespaceRecord, entry: BlockEntry, obj: ObjectRecord) -> None:
        """Put ``obj`` (not yet counted) into ``entry`` and the per-server books."""
        g = obj.group
        entry.objects[g] = obj
        srv = obj.server
        srv.ring(ns.ns_id).link(obj)
        srv.objects += 1
        if g == ns.full_group:
            ns.full_holes -= 1
            if obj.tier == 0 and entry.parent is not None:
                entry.parent.hot += 1
        if obj.tier:
            srv.nvme_bytes += obj.length
            srv.nvme_objects[obj.offset] = obj

    def record(self, ns: NamespaceRecord, obj: ObjectRecord) -> None:
        """Queue a committed DRAM object for its server's manifest (the next
        heartbeat reply's ``adopt``). Lossless and bounded: past ``adopt_outbox``
        waiting, the server takes no new placements until a heartbeat drains it;
        puts placed before may still add (``adopt_overflow``)."""
        srv = obj.server
        out = srv.adopt_out
        out.append((obj, ns))
        n = len(out)
        bound = self.cfg.adopt_outbox
        if n == bound:
            self.outbox_full()  # placement pauses on this server
            self.counters["adopt_paused"] += 1
        elif n > bound:
            srv.adopt_overflow += 1
            self.counters["adopt_overflow"] += 1

    def ns_of(self, entry: BlockEntry) -> NamespaceRecord:
        """The namespace ``entry`` is in (a scan of the namespaces: for rare paths,
        the records do not point back to it)."""
        return next(n for n in self.namespaces.values() if n.entries.get(entry.key) is entry)

    # ---- requests: namespace, keys, access -------------------------------------------

    def namespace(self, fp: bytes, who: Principal | None = None) -> NamespaceRecord:
        ns = self.namespaces.get(fp)
        if ns is None:
            raise Refusal(E_UNKNOWN_NAMESPACE, "unknown namespace (register it first)")
        if who is not None and not who.may_use(str(ns.descriptor.get("cache_salt", ""))):
            raise Refusal(E_ACCESS_DENIED, f"tenant {who.name!r} may not use this namespace")
        return ns

    def check_keys(self, key_list: list[bytes]) -> None:
        n = len(key_list)
        if n > self.cfg.max_keys_per_request:
            raise Refusal(E_BAD_REQUEST, f"{n} keys exceed {self.cfg.max_keys_per_request}")
        # Frames from the wire were checked key by key in the decoder; this one
        # C-speed pass catches in-process callers' wrong sizes.
        if len(b"".join(key_list)) != n * KEY_SIZE:
            bad = next((len(k) for k in key_list if len(k) != KEY_SIZE), 0)
            raise Refusal(E_BAD_REQUEST, f"block keys are {KEY_SIZE} bytes, got {bad}")

    # ---- eviction ----------------------------------------------------------------------

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
        for obj, ns in self.policy.candidates(srv):
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
        entry = obj.entry
        evicted = 0
        if obj.group == ns.full_group:
            # Without its full object a block serves no match: take all of it.
            for g, o in enumerate(entry.objects):
                if o is not None:
                    evicted += o.length
                    self.evict_object(ns, entry, g)
        else:
            evicted += obj.length
            self.evict_object(ns, entry, obj.group)
        if entry.children == 0 and not any(entry.objects):
            self.prune(ns, entry)
        return evicted

    def evict_keys(
        self, fp: bytes, key_list: list[bytes], groups: int, who: Principal | None = None
    ) -> tuple[int, int]:
        """Admin eviction of named objects (``who``: the tenant asking, checked for
        access to the namespace; None: the operator). A full object goes only from a
        leaf (with its whole block); windowed objects may go from any block. Returns
        (evicted, refused)."""
        ns = self.namespace(fp, who)
        self.check_keys(key_list)
        evicted = refused = 0
        for key in key_list:
            entry = ns.entries.get(key)
            if entry is None:
                continue
            for g in range(ns.layout.num_groups):
                if not groups >> g & 1 or entry.objects[g] is None:
                    continue
                if g == ns.full_group:
                    if entry.children:
                        refused += 1
                        continue
                    for g2 in range(len(entry.objects)):
                        if entry.objects[g2] is not None:
                            self.evict_object(ns, entry, g2)
                            evicted += 1
                    break
                self.evict_object(ns, entry, g)
                evicted += 1
            if key in ns.entries:
                self.prune(ns, entry)
        return evicted, refused

    def evict_object(self, ns: NamespaceRecord, entry: BlockEntry, g: int) -> None:
        obj = self.unlink(ns, entry, g)
        size = obj.length
        srv = obj.server
        counters = self.counters
        counters["evictions"] += 1
        counters["evicted_bytes"] += size
        if obj.tier:
            counters["nvme_evictions"] += 1
        self.pol(obj).evicted(obj, ns)
        if obj.pins > 0:
            if obj.tier == 0:
                srv.deferred_bytes += size
        else:
            # A committed object's write grant was consumed (its receipt proves it):
            # its range may be re-used at once.
            self.free_object(obj)

    def unlink(
        self, ns: NamespaceRecord, entry: BlockEntry, g: int, why: str = REMOVED_EVICTED
    ) -> ObjectRecord:
        """Take object ``g`` of ``entry`` out of the index and its counters. ``why``:
        the reason told to removal subscribers; empty for an object moving between
        tiers (still in GCache, not a removal)."""
        obj = entry.objects[g]
        assert obj is not None
        if why and self.removals.rings:
            self.removals.removed(ns.fingerprint, entry.key, g, why)
        entry.objects[g] = None
        srv = obj.server
        if g == ns.full_group:
            ns.full_holes += 1
            parent = entry.parent
            if obj.tier == 0 and parent is not None and obj.hits != LEAVING_DRAM:
                parent.hot -= 1
                if parent.hot == 0:
                    self.leaf_now(parent, ns)
        if obj.tier:
            srv.nvme_bytes -= obj.length
            if srv.nvme_objects.get(obj.offset) is obj:
                del srv.nvme_objects[obj.offset]
        srv.objects -= 1
        obj.unlink()
        size = obj.length
        self.live_objects -= 1
        self.live_bytes -= size
        self.group_bytes[ns.layout.group_names[g]] -= size
        if obj.owner:
            left = self.tenant_bytes[obj.owner] - size
            if left:
                self.tenant_bytes[obj.owner] = left
            else:
                del self.tenant_bytes[obj.owner]
        obj.state = EVICTED
        return obj

    def prune(self, ns: NamespaceRecord, entry: BlockEntry | None) -> None:
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
                self.leaf_now(parent, ns)
            entry = parent

    # ---- pins, accesses, demotion marks: every change to them goes through here ----------

    def pin(self, objs: list[ObjectRecord]) -> None:
        """A lease (or a demotion, a promotion) holds ``objs``: no eviction frees them."""
        for obj in objs:
            obj.pins += 1

    def unpin(self, objs: list[ObjectRecord], ns: NamespaceRecord, requeue: bool = True) -> None:
        """Their holder let go. At its last pin an evicted object is freed and a live
        one may be a candidate again (``requeue=False``: the caller moves or frees
        it now itself, as a finished demotion or promotion does)."""
        for obj in objs:
            obj.pins -= 1
            if obj.pins == 0 and requeue:
                if obj.state == EVICTED:
                    self.release_evicted(obj)
                elif obj.state == LIVE:
                    self.pol(obj).unpinned(obj, ns)

    def touch(self, objs: list[ObjectRecord], ns: NamespaceRecord, now: float) -> None:
        """A lookup read ``objs`` at ``now``: a reuse, for their tiers' policies."""
        for obj in objs:
            age = now - obj.last_access
            obj.last_access = now
            self.pol(obj).touch(obj, ns, age)

    def mark_leaving(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """A full DRAM object is being demoted: its parent stops counting it as a DRAM
        child, so it may follow in the same pass (a whole prompt at once)."""
        parent = obj.entry.parent
        if obj.group == ns.full_group and parent is not None:
            obj.hits = LEAVING_DRAM
            parent.hot -= 1
            if parent.hot == 0:
                self.leaf_now(parent, ns)

    def end_leaving(self, obj: ObjectRecord) -> None:
        """A demotion failed: still indexed, it is its parent's DRAM child again."""
        if obj.hits == LEAVING_DRAM and obj.state == LIVE and obj.entry.parent is not None:
            obj.entry.parent.hot += 1
        obj.hits = 0

    # ---- returning memory ----------------------------------------------------------------

    def free_object(self, obj: ObjectRecord) -> None:
        """Return an object's memory: a DRAM range to its allocator (and the server
        drops its record), an NVMe object to its server for deletion."""
        obj.state = GONE
        srv = obj.server
        if obj.tier == 0:
            self.free_range(srv, obj.offset, obj.length)
        elif srv.alive and len(srv.drop_out) < MAX_FREED_REPORT:
            srv.drop_out.append((obj.offset, obj.length))

    def release_evicted(self, obj: ObjectRecord) -> None:
        """The last pin of an evicted object ended: free it now."""
        if obj.tier == 0:
            obj.server.deferred_bytes -= obj.length
        self.free_object(obj)

    def free_range(self, srv: ServerRecord, offset: int, length: int) -> None:
        if not srv.alive:
            return
        reported = srv.reported
        if reported is not None and offset in reported:
            # Adopted from the server's report, before the allocator is built.
            del reported[offset]
        else:
            srv.allocator.free(offset)
        if len(srv.freed) < MAX_FREED_REPORT:
            srv.freed.append((offset, length))

    # ---- index entries -----------------------------------------------------------------

    def ensure_entry(self, ns: NamespaceRecord, key_list: list[bytes], block: int) -> BlockEntry:
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

    def count_in(self, ns: NamespaceRecord, obj: ObjectRecord) -> None:
        """Count a newly linked object in the store-wide totals."""
        self.live_objects += 1
        self.live_bytes += obj.length
        self.group_bytes[ns.layout.group_names[obj.group]] += obj.length
        if obj.owner:
            self.tenant_bytes[obj.owner] += obj.length

    def count_adopted(self, created: int, objects: int, nbytes: int) -> None:
        """Count entries and objects adopted in bulk (reported objects have no
        tenant; their group bytes go through :meth:`add_group_bytes`)."""
        self.entries += created
        self.live_objects += objects
        self.live_bytes += nbytes

    def add_group_bytes(self, ns: NamespaceRecord, gbytes: list[int]) -> None:
        """Count ``gbytes`` (bytes per group of ``ns``) and zero them."""
        names = ns.layout.group_names
        for g, n in enumerate(gbytes):
            if n:
                self.group_bytes[names[g]] += n
                gbytes[g] = 0

    def move_tier(self, ns: NamespaceRecord, obj: ObjectRecord, offset: int, tier: int) -> None:
        """Switch the index from ``obj`` to its copy at ``offset`` in ``tier`` on the
        same server (a finished demotion or promotion); the caller frees ``obj``."""
        entry = obj.entry
        self.unlink(ns, entry, obj.group, why="")  # moved, not removed
        new = ObjectRecord(
            entry, obj.group, obj.server, offset, obj.length, obj.sums, obj.last_access,
            obj.owner, tier=tier,
        )  # fmt: skip
        new.score = obj.score
        self.link_object(ns, entry, new)
        self.count_in(ns, new)
        (self.nvme_policy if tier else self.policy).admit(new, ns)
