# One file (over 450 lines): every change to blocks and objects keeps the same
# books together (the columns, the per-server, per-group and per-tenant totals).
"""Index bookkeeping shared by the meta's put, lookup and eviction paths: adding
and removing blocks and objects in the compact index (``meta/compact.py``) with
incremental counters, pins, accesses and demotion marks, returning ranges to
allocators. Every other component of the meta changes blocks and objects through
it; nothing here does I/O or reads the clock.

The eviction order is the compact index's: per tier, a heap of the evictable
objects keyed by each tier's policy (``meta/eviction.py``), which says how an
object's key follows from its last access and its score."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gcache.config import MetaConfig
from gcache.errors import E_ACCESS_DENIED, E_BAD_REQUEST, E_UNKNOWN_NAMESPACE, Refusal
from gcache.keys import KEY_SIZE
from gcache.layout import Layout
from gcache.meta.compact import LEAVING_DRAM
from gcache.meta.events import EVICTED as REMOVED_EVICTED
from gcache.meta.events import RemovalFeed
from gcache.meta.eviction import EvictionPolicy
from gcache.meta.fewrows import SMALL, Freed
from gcache.meta.handles import GONE, LIVE, Entries, Ghost, Store
from gcache.meta.leaves import float_tick, float_ticks
from gcache.meta.quarantine import Quarantine
from gcache.meta.records import BlockEntry, NamespaceRecord, ObjectRecord, ServerRecord
from gcache.meta.session import Principal

__all__ = ["LEAVING_DRAM", "MAX_FREED_REPORT", "Ghost", "Index"]

I32 = npt.NDArray[np.int32]
Objs = Sequence[ObjectRecord] | I32  # handles, or object rows


def _nothing() -> None: ...


# Freed ranges reported to a server per heartbeat reply, at most (the server only
# counts them; a longer backlog is dropped rather than grown without bound).
MAX_FREED_REPORT = 1 << 16


def rows(objs: Objs) -> I32:
    """Object rows of handles or rows."""
    if isinstance(objs, np.ndarray):
        return objs.astype(np.int32, copy=False)
    return np.fromiter((o.oid for o in objs), np.int32, len(objs))


class Index:
    """The prefix index of every namespace and its store-wide totals: adding and
    removing blocks and objects with incremental counters, the eviction
    mechanics (which object goes is the policies' order; this is how it goes),
    returning ranges to allocators, and the quarantine of ranges freed from
    pending puts."""

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
        self.store = Store()
        self.cx = self.store.cx
        self._policies: list[EvictionPolicy] = [policy, nvme_policy]
        policy.bind(self, 0)  # orders DRAM (tier 0) objects
        nvme_policy.bind(self, 1)  # orders NVMe (tier 1) objects
        self.removals = removals  # removed blocks, for WatchRemovals subscribers
        self.namespaces: dict[bytes, NamespaceRecord] = {}
        self.ns_by_id = self.store.ns_by_id
        self.group_bytes: Counter[str] = Counter()
        self.tenant_bytes: Counter[str] = Counter()  # committed bytes per tenant
        self.live_bytes = 0
        # Ranges of pending puts whose write grants may still be presented; they
        # return to the allocator only after.
        self.quarantine = Quarantine(self.free_range)
        # Called when a server's manifest outbox reaches its bound (placement pauses
        # there): the wiring points it at Membership.invalidate.
        self.outbox_full: Callable[[], None] = _nothing

    # ---- policies and totals --------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self._policies[0]

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        """Replace the DRAM policy (before anything is stored: the replayer)."""
        policy.bind(self, 0)
        self._policies[0] = policy

    @property
    def nvme_policy(self) -> EvictionPolicy:
        return self._policies[1]

    def tier_policy(self, tier: int) -> EvictionPolicy:
        return self._policies[1 if tier else 0]

    def pol(self, obj: ObjectRecord | Ghost) -> EvictionPolicy:
        return self._policies[1 if obj.tier else 0]

    @property
    def entries(self) -> int:
        return self.cx.live_blocks

    @property
    def live_objects(self) -> int:
        return self.cx.live_objects

    def obj(self, oid: int) -> ObjectRecord:
        return self.store.obj(oid)

    def ns_of(self, entry: BlockEntry) -> NamespaceRecord:
        """The namespace ``entry`` is in."""
        return self.ns_by_id[entry.ns_id]

    def new_namespace(
        self, fp: bytes, layout: Layout, descriptor: dict[str, Any]
    ) -> NamespaceRecord:
        ns_id = len(self.namespaces) + 1
        ns = NamespaceRecord(ns_id, fp, layout, descriptor, Entries(self.store, ns_id))
        self.cx.widen(layout.num_groups)
        self.cx.namespace(ns_id, ns.full_group)
        self.namespaces[fp] = ns
        self.ns_by_id[ns_id] = ns
        return ns

    def ticks(self, oids: I32) -> npt.NDArray[np.uint64]:
        """The eviction keys of ``oids`` as their tiers' policies rank them."""
        o = self.cx.objects.cols
        atime, score, tier = o["atime"][oids], o["score"][oids], o["tier"][oids]
        keys = self._policies[0].keys(atime, score)
        if tier.any():
            nv = tier != 0
            keys = np.where(nv, self._policies[1].keys(atime, score), keys)
        return float_ticks(keys)

    def rekey(self, oids: I32) -> None:
        """Their policy changed their keys (a score, ``tau``): re-rank them."""
        if oids.size:
            self.cx.retick(oids, self.ticks(oids))

    def rekey_all(self) -> None:
        """Every object's key changed (the cost policy's ``tau`` moved)."""
        o = self.cx.objects
        live = np.flatnonzero(o.cols["block"][: o.rows] >= 0).astype(np.int32)
        if live.size:
            o.cols["tick"][live] = self.ticks(live)
        self.cx.leaves.rekey_all()

    def _leaf_events(self) -> None:
        """Tell the policies that want them which blocks became leaves."""
        ev = self.cx.leaf_events
        if not ev:
            return
        bids, ev[:] = list(ev), []
        if not (self._policies[0].events or self._policies[1].events):
            return
        b = self.cx.blocks.cols
        for bid in bids:
            if int(b["ns"][bid]) == 0xFFFF:
                continue  # pruned meanwhile
            entry = self.store.block(bid)
            ns = self.ns_by_id[entry.ns_id]
            for p in self._policies:
                if p.events:
                    p.became_leaf(entry, ns)

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

    # ---- blocks ------------------------------------------------------------------------

    def ensure_chain(self, ns: NamespaceRecord, key_list: list[bytes]) -> I32 | list[int]:
        """The blocks of a prompt's keys (each the parent of the next), created
        where missing; returns their ids (a list for a few keys)."""
        cx = self.cx
        if len(key_list) <= SMALL:  # (a few: scalar probes, one by one)
            nsid, n = ns.ns_id, len(key_list)
            ids = cx.keys.leading(nsid, key_list, -1)
            start = len(ids)  # (key ``start`` is not indexed)
            if not any(cx.keys.find1(nsid, k) >= 0 for k in key_list[start + 1 :]):
                # Missing: only the end (else the general path below).
                for i in range(start, n):
                    ids.append(cx.add_block1(nsid, key_list[i], ids[i - 1] if i else -1, i))
                if n > start:
                    self._created(ns, n - start)
                return ids
        bids = cx.find_keys(ns.ns_id, key_list)
        if not (bids < 0).any():
            return bids
        before = cx.live_blocks
        bids = cx.add_chain(ns.ns_id, key_list)
        self._created(ns, cx.live_blocks - before)
        return bids

    def ensure_entry(self, ns: NamespaceRecord, key_list: list[bytes], block: int) -> BlockEntry:
        return self.store.block(int(self.ensure_chain(ns, key_list[: block + 1])[block]))

    def add_blocks(
        self,
        ns: NamespaceRecord,
        k0: npt.NDArray[np.uint64],
        k1: npt.NDArray[np.uint64],
        pk0: npt.NDArray[np.uint64],
        pk1: npt.NDArray[np.uint64],
        pos: I32,
    ) -> I32:
        """Blocks of ``ns`` with their parents' keys (a report chunk's, see
        ``CompactIndex.add_blocks``); -1 for an orphan."""
        before = self.cx.live_blocks
        ids = self.cx.add_blocks(ns.ns_id, k0, k1, pk0, pk1, pos)
        self._created(ns, self.cx.live_blocks - before)
        return ids

    def new_block(self, ns: NamespaceRecord, key: bytes, parent: int, pos: int) -> int:
        """One new block of ``ns`` (its key not indexed) under ``parent`` (-1: a
        root)."""
        bid = self.cx.add_block1(ns.ns_id, key, parent, pos)
        self._created(ns, 1)
        return bid

    def _created(self, ns: NamespaceRecord, n: int) -> None:
        ns.entries.count += n
        if ns.full_group is not None:
            ns.full_holes += n

    def prune(self, ns: NamespaceRecord, entry: BlockEntry | int | None) -> None:
        """Drop an empty childless block, and its ancestors as they become so."""
        if entry is None:
            return
        bid = entry if isinstance(entry, int) else entry.bid
        if isinstance(entry, BlockEntry) and not entry.alive:
            return  # already pruned
        b = self.cx.blocks.cols
        if int(b["ns"][bid]) == 0xFFFF or b["children"][bid] or (b["obj"][bid] >= 0).any():
            return
        before = self.cx.live_blocks
        self.cx.remove_block(bid)
        n = before - self.cx.live_blocks
        ns.entries.count -= n
        if ns.full_group is not None:
            ns.full_holes -= n
        self._leaf_events()

    # ---- objects -----------------------------------------------------------------------

    def add_objects(
        self,
        ns: NamespaceRecord,
        bids: I32,
        group: int,
        srv: ServerRecord,
        offsets: Sequence[int] | npt.NDArray[np.uint64],
        length: int,
        sums: npt.NDArray[np.uint8],
        atimes: npt.NDArray[np.float64],
        owner: str = "",
        tier: int = 0,
        refresh: bool = True,
    ) -> I32:
        """Objects of ``group`` of blocks ``bids`` (none there yet) on ``srv``, each
        ``length`` bytes, counted in every total. The caller admits them
        (:meth:`admit`) once everything of its batch is added. ``refresh=False``:
        the eviction order is not told yet (the caller does it once for several
        batches, :meth:`settle`)."""
        n = len(bids)
        if not n:
            return np.empty(0, dtype=np.int32)
        if n <= SMALL:  # (a few: one by one, no array calls)
            return np.array(
                [
                    self.add_object(
                        ns,
                        bid,
                        group,
                        srv,
                        int(off),
                        length,
                        row.tobytes(),
                        at,
                        owner,
                        tier,
                        refresh,
                    )
                    for bid, off, row, at in zip(
                        bids.tolist(), list(offsets), sums, atimes.tolist(), strict=True
                    )
                ],
                dtype=np.int32,
            )
        st = self.store
        slot = st.slot_of(srv)
        # (the ticks are the policy's keys of these access times and a zero score)
        pol = self._policies[1 if tier else 0]
        ticks = float_ticks(pol.keys(atimes, np.zeros(n, dtype=np.float32)))
        oids = self.cx.add_objects(
            bids, group, slot, np.asarray(offsets, dtype=np.uint64),
            np.full(n, length, dtype=np.uint32), sums, ticks, tier, st.owner_id(owner), refresh,
        )  # fmt: skip
        self.cx.objects.cols["atime"][oids] = atimes
        self._count(ns, group, srv, slot, n, length, owner, tier)
        return oids

    def _count(
        self,
        ns: NamespaceRecord,
        group: int,
        srv: ServerRecord,
        slot: int,
        n: int,
        length: int,
        owner: str,
        tier: int,
    ) -> None:
        """``n`` objects of ``length`` bytes added: every total."""
        self.store.rows_named(slot, n)
        total = n * length
        srv.objects += n
        if tier:
            srv.nvme_bytes += total
            srv.nvme_count += n
        if group == ns.full_group:
            ns.full_holes -= n
        self.live_bytes += total
        self.group_bytes[ns.layout.group_names[group]] += total
        if owner:
            self.tenant_bytes[owner] += total

    def settle(self, oids: I32) -> None:
        """Objects added with ``refresh=False`` enter the eviction order (with
        their parents' full objects, which may have stopped being leaves)."""
        if oids.size:
            cx = self.cx
            blocks = cx.objects.cols["block"][oids]
            cx.leaves.refresh(np.concatenate([oids, cx.leaves.parents_full(blocks)]))

    def add_object(
        self,
        ns: NamespaceRecord,
        bid: int,
        group: int,
        srv: ServerRecord,
        offset: int,
        length: int,
        sums: bytes,
        atime: float,
        owner: str = "",
        tier: int = 0,
        refresh: bool = True,
    ) -> int:
        """:meth:`add_objects` of one object, without arrays (a small put)."""
        st = self.store
        slot = st.slot_of(srv)
        pol = self._policies[1 if tier else 0]
        tick = (
            float_tick(atime)
            if pol.by_access
            else int(float_ticks(pol.keys(np.array([atime]), np.zeros(1, np.float32)))[0])
        )
        oid = self.cx.add_object(
            bid, group, slot, offset, length, sums, tick, tier, st.owner_id(owner), refresh
        )
        self.cx.objects.mv("atime")[oid] = atime
        self._count(ns, group, srv, slot, 1, length, owner, tier)
        return oid

    def admit(self, ns: NamespaceRecord, oids: I32 | list[int], ordered: bool = True) -> None:
        """Newly added objects, for the policies that score them (once every
        object of the put or chunk is added, so they see the final tree).
        ``ordered``: objects whose keys tie rank in the order given (a put's;
        a report's objects have distinct access times). A list: a small put's."""
        n = len(oids)
        if not n:
            return
        pol0, pol1 = self._policies
        if n <= SMALL and not (pol0.events or pol1.events):
            if ordered and n > 1:  # (a few, LRU: ties rank in the order given;
                # one object was pushed last already)
                tier = self.cx.objects.mv("tier")
                heaps = self.cx.leaves.heaps
                for oid in oids if isinstance(oids, list) else oids.tolist():
                    heaps[tier[oid]].reseq1(oid)
            return
        oids = np.asarray(oids, dtype=np.int32)
        tiers = self.cx.objects.cols["tier"][oids]
        for t, p in enumerate(self._policies):
            mine = oids[tiers == t]
            if p.events:
                for oid in mine.tolist():
                    p.admit(self.store.obj(oid), ns)
            elif mine.size and ordered:  # ties of the key rank in the order given
                self.cx.leaves.heaps[t].reseq(mine)

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

    def unlink(
        self,
        ns: NamespaceRecord,
        entry: BlockEntry | int,
        g: int,
        why: str = REMOVED_EVICTED,
    ) -> Ghost:
        """Take object ``g`` of a block out of the index and its counters. ``why``:
        the reason told to removal subscribers. A leased object's row stays held
        (detached) until its last lease ends; the caller frees the range of one
        that is not (the returned :class:`Ghost` says which)."""
        bid = entry if isinstance(entry, int) else entry.bid
        cx, st = self.cx, self.store
        o = cx.objects.cols
        oid = int(cx.blocks.cols["obj"][bid, g])
        if oid < 0:
            raise KeyError(f"block {bid} has no object of group {g}")
        if why and self.removals.rings:
            self.removals.removed(ns.fingerprint, st.block(bid).key, g, why)
        slot, tier = int(o["server"][oid]), int(o["tier"][oid])
        srv = st.servers[slot]
        assert srv is not None
        pinned = bool(o["pins"][oid])
        ghost = Ghost(
            oid, st.block(bid), g, srv, tier, int(o["offset"][oid]), int(o["length"][oid]),
            st.owners[int(o["owner"][oid])], float(o["score"][oid]), float(o["atime"][oid]),
            pinned,
        )  # fmt: skip
        cx.remove_object(oid, prune=False)
        if not pinned:
            st.rows_named(slot, -1)
        size = ghost.length
        if g == ns.full_group:
            ns.full_holes += 1
        if tier:
            srv.nvme_bytes -= size
            srv.nvme_count -= 1
        srv.objects -= 1
        self.live_bytes -= size
        self.group_bytes[ns.layout.group_names[g]] -= size
        if ghost.owner:
            left = self.tenant_bytes[ghost.owner] - size
            if left:
                self.tenant_bytes[ghost.owner] = left
            else:
                del self.tenant_bytes[ghost.owner]
        self._leaf_events()
        return ghost

    def forget(self, ghost: Ghost) -> None:
        """An object taken out whose bytes are gone already (its server lost them
        or died): nothing is freed for it, now or when its last lease ends."""
        if ghost.pinned:
            self.store.forgotten.add(ghost.oid)
        ghost.state = GONE

    # ---- pins, accesses, demotion marks: every change to them goes through here ----------

    def pin(self, objs: Objs) -> None:
        """A lease (or a demotion, a promotion) holds ``objs``: no eviction frees them."""
        oids = rows(objs)
        if oids.size:
            self.cx.pin(oids)

    def unpin(self, objs: Objs, ns: NamespaceRecord | None = None) -> None:
        """Their holder let go. At its last pin an evicted object is freed and a live
        one may be a candidate again."""
        oids = rows(objs)
        if oids.size:
            self._unpinned(self.cx.unpin_rows(oids))

    def unpin_few(self, ids: list[int]) -> None:
        """:meth:`unpin` of a few rows given as a list (a small lease's)."""
        if ids:
            self._unpinned(self.cx.few.unpin(ids))

    def _unpinned(self, freed: list[tuple[int, Freed]]) -> None:
        """Free what a last unpin let go (detached objects)."""
        st = self.store
        for oid, (slot, tier, offset, length) in freed:
            srv = st.servers[slot]
            st.rows_named(slot, -1)
            if oid in st.forgotten:
                st.forgotten.discard(oid)
                continue
            assert srv is not None
            if tier == 0:
                srv.deferred_bytes -= length
            self.free_copy(srv, tier, offset, length)

    def touch(self, oids: I32, ns: NamespaceRecord, now: float) -> None:
        """A lookup read ``oids`` at ``now``: a reuse, for their tiers' policies."""
        if not oids.size:
            return
        if self._policies[0].by_access and self._policies[1].by_access:
            self.cx.touch(oids, float_tick(now), now)  # one key for all of them
        else:
            self.cx.objects.cols["atime"][oids] = now
            self.cx.retick(oids, self.ticks(oids))
        for p in self._policies:
            if p.events:
                p.accessed(oids, ns, now)

    def lease_few(
        self, ids: list[int], ns: NamespaceRecord, now: float
    ) -> list[tuple[int, int, int, int, int, int, bytes]] | None:
        """A small lease's rows pinned, touched and read in one pass
        (``FewRows.lease``) where the policies need nothing but the
        access (LRU); None: not done, the caller takes the general path."""
        if not self._access_only():
            return None
        return self.cx.few.lease(ids, float_tick(now), now)

    def pin_few(self, ids: list[int]) -> None:
        """:meth:`pin` of a few rows given as a list."""
        self.cx.few.pin(ids)

    def touch_few(self, ids: list[int], ns: NamespaceRecord, now: float) -> None:
        """:meth:`touch` of a few rows given as a list (a small lookup's)."""
        if self._access_only():
            self.cx.few.touch(ids, float_tick(now), now)
        elif ids:
            self.touch(np.array(ids, dtype=np.int32), ns, now)

    def _access_only(self) -> bool:
        """Both tiers' policies rank by the last access alone and want no events
        (LRU): a touch is a new tick and nothing else."""
        p0, p1 = self._policies
        return p0.by_access and p1.by_access and not (p0.events or p1.events)

    def mark_leaving(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """A full DRAM object is being demoted: its parent stops counting it as a DRAM
        child, so it may follow in the same pass (a whole prompt at once)."""
        self.cx.leaving(obj.oid, True)
        self._leaf_events()

    def end_leaving(self, obj: ObjectRecord) -> None:
        """A demotion failed: still indexed, it is its parent's DRAM child again."""
        if obj.state == LIVE and obj.hits == LEAVING_DRAM and obj.tier == 0:
            self.cx.leaving(obj.oid, False)
        elif obj.state != GONE:
            obj.hits = 0

    # ---- tiers -------------------------------------------------------------------------

    def move_tier(self, ns: NamespaceRecord, obj: ObjectRecord, offset: int, tier: int) -> bool:
        """Switch the index from ``obj`` to its copy at ``offset`` in ``tier`` on the
        same server (a finished demotion or promotion). Returns whether leases
        still hold the old copy (its row stays, detached, and its range is freed
        when the last one ends); else the caller frees the old range now."""
        cx, st = self.cx, self.store
        o = cx.objects.cols
        oid = obj.oid
        slot, old_tier, length = int(o["server"][oid]), int(o["tier"][oid]), int(o["length"][oid])
        srv = st.servers[slot]
        assert srv is not None
        pinned = bool(o["pins"][oid])
        new = cx.move_tier(oid, tier, offset)
        if pinned:
            st.rows_named(slot, 1)  # the new row; the old one stays with its leases
        if old_tier:
            srv.nvme_bytes -= length
            srv.nvme_count -= 1
        if tier:
            srv.nvme_bytes += length
            srv.nvme_count += 1
        ids = np.array([new], dtype=np.int32)
        self.rekey(ids)
        cx.leaves.refresh1(new)
        self._leaf_events()
        p = self._policies[1 if tier else 0]
        if p.events:
            p.admit(st.obj(new), ns)
        return pinned

    # ---- returning memory ----------------------------------------------------------------

    def free_copy(self, srv: ServerRecord, tier: int, offset: int, length: int) -> None:
        """Return an object's memory: a DRAM range to its allocator (and the server
        drops its record), an NVMe object to its server for deletion."""
        if tier == 0:
            self.free_range(srv, offset, length)
        elif srv.alive and len(srv.drop_out) < MAX_FREED_REPORT:
            srv.drop_out.append((offset, length))

    def free_range(self, srv: ServerRecord, offset: int, length: int) -> None:
        if not srv.alive:
            return
        reported = srv.reported
        if reported is not None and reported.pop(offset) >= 0:
            pass  # adopted from the server's report, before the allocator is built
        else:
            srv.allocator.free(offset)
        if len(srv.freed) < MAX_FREED_REPORT:
            srv.freed.append((offset, length))

    # ---- scans (a server's objects) --------------------------------------------------------

    def server_objects(self, srv: ServerRecord) -> I32:
        """Rows of the live objects on ``srv`` (one vectorised scan)."""
        if srv.slot < 0:
            return np.empty(0, dtype=np.int32)
        return self.cx.server_objects(srv.slot)
