"""The NVMe tier, seen from the meta: which DRAM objects are demoted (copied to
their server's NVMe tier) and which are dropped when DRAM passes its high
watermark, the NVMe watermarks (evicting from NVMe deletes), finished demotions
reported by the servers, the outboxes of each server's next heartbeat reply, and
placement's balance between free space and recent write load. No I/O; ``now``
comes from the caller.

The rule for a DRAM object leaving DRAM (in the DRAM policy's order):

* demote it when its server has an NVMe tier with room (below the NVMe high
  watermark after evicting down to the low one), fewer than
  ``max_demotions_in_flight`` demotions are pending there, no demotion failed there
  in the last ``DEMOTE_PAUSE_S``, and it is worth a disk write: recomputing its
  block takes at least ``demote_min_gain`` times as long as reading it back from
  NVMe at the server's measured bandwidth (recompute FLOPs from the compute model
  of docs/eviction.md at ``compute_tflops``; a model of unknown cost is always
  worth it). A block with cached descendants is always worth it (they need it).
  Under the cost policy an object that serves no match (score ``ZERO``) is never
  worth it;
* otherwise drop it.

A demotion pins the object (it stays readable from DRAM, and nothing reuses its
range) until the server reports it done; only then is the index switched to the
NVMe copy and the DRAM range freed (after the last read lease on it ends).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gcache.config import MetaConfig
from gcache.meta.eviction import (
    UNIT_COMPUTE,
    ZERO,
    CostPolicy,
    ModelCompute,
    compute_for_layout,
)
from gcache.meta.index import LEAVING_DRAM, Index
from gcache.meta.placement import Budget, evict_room
from gcache.meta.records import (
    EVICTED,
    GONE,
    LIVE,
    NamespaceRecord,
    ObjectRecord,
    ServerRecord,
)

# Assumed NVMe read bandwidth of a server that reported none (GB/s).
DEFAULT_NVME_READ_GBPS = 2.0
# After a failed demotion on a server, drop instead of demoting there for this long.
DEMOTE_PAUSE_S = 10.0
# Items per heartbeat reply, at most (a reply stays well inside gRPC's 4 MiB).
MAX_ADOPT_PER_REPLY = 4096
MAX_DEMOTE_PER_REPLY = 4096
MAX_DROP_PER_REPLY = 1 << 16
MAX_PROMOTE_PER_REPLY = 1024
# Promotions sent to a server and not reported done yet, at most.
MAX_PROMOTIONS_IN_FLIGHT = 1024
# Objects not worth a disk write that continuous demotion passes over per call (they
# wait for the high watermark, where they are dropped).
SKIP_AHEAD = 64
PROMOTING = -1  # ObjectRecord.hits of an object being promoted


@dataclass
class Demotion:
    """A finished demotion a server reports (proto ``Demoted``)."""

    dram_offset: int
    length: int
    nvme_offset: int
    ok: bool
    error: str = ""


@dataclass
class Promotion:
    """A finished promotion a server reports (proto ``Promoted``)."""

    nvme_offset: int
    length: int
    dram_offset: int
    ok: bool
    error: str = ""


@dataclass
class HeartbeatOut:
    """What the meta answers a heartbeat (proto ``HeartbeatReply``)."""

    reregister: bool = False
    free: list[tuple[int, int]] = field(default_factory=list)
    adopt: list[tuple[ObjectRecord, NamespaceRecord]] = field(default_factory=list)
    demote: list[tuple[ObjectRecord, NamespaceRecord]] = field(default_factory=list)
    drop_nvme: list[tuple[int, int]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # errors of failed demotions
    # (NVMe object, namespace, DRAM offset): copy it into DRAM there
    promote: list[tuple[ObjectRecord, NamespaceRecord, int]] = field(default_factory=list)
    # records still queued past this reply's bounds: the server heartbeats again now
    more: bool = False


def held(srv: ServerRecord, length: int) -> int:
    """DRAM bytes an object of ``length`` holds in ``srv``'s allocator (aligned), as
    ``allocator.used`` counts them."""
    mask = srv.allocator.align - 1
    return (length + mask) & ~mask


class Tiers:
    """Demotion and the watermarks of both tiers; :meth:`make_room` is placement's
    strategy for a put whose object does not fit."""

    def __init__(self, cfg: MetaConfig, counters: Counter[str], index: Index) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.now_s = 0.0  # the latest ``now`` seen (tick, heartbeat): demotion pauses
        self._compute: dict[int, ModelCompute] = {}
        self._evict_room = evict_room(index)

    # ---- DRAM watermark: demote or drop --------------------------------------------

    def check_watermark(self, srv: ServerRecord) -> None:
        cfg = self.cfg
        cap = srv.allocator.capacity
        used = srv.reclaimable_used
        if used > cfg.high_watermark * cap:
            target = int(cfg.low_watermark * cap)
            if cfg.demote:
                self.demote_or_drop(srv, target)
            else:
                self.index.evict(srv, target_used=target, max_bytes=cap)
        elif cfg.demote and srv.nvme_capacity and used > cfg.demote_watermark * cap:
            self._demote_ahead(srv, int(cfg.demote_watermark * cap))
        ncap = srv.nvme_capacity
        if ncap and srv.nvme_bytes > cfg.nvme_high_watermark * ncap:
            self._evict_nvme(srv, int(cfg.nvme_low_watermark * ncap))

    def demote_or_drop(self, srv: ServerRecord, target_used: int) -> int:
        """Take DRAM objects in the policy's store-wide order until ``srv``'s
        reclaimable usage is at most ``target_used``: each is demoted on its own
        server if worth it there, else dropped. Returns the bytes that left (or are
        leaving) DRAM."""
        moved = 0
        limit = srv.allocator.capacity
        for obj, ns in self.index.policy.candidates(srv):
            if self._worth_demoting(obj, ns):
                self._demote(obj, ns)
                moved += obj.length
            else:
                moved += self.index.drop(obj, ns)
                self.counters["dropped_not_demoted"] += 1
            if srv.reclaimable_used <= target_used or moved >= limit:
                break
        return moved

    def _demote_ahead(self, srv: ServerRecord, target_used: int) -> int:
        """Continuous demotion (between ``demote_watermark`` and the high watermark):
        demote DRAM objects worth a disk write, in the policy's order, until
        ``srv``'s reclaimable usage is at most ``target_used``, so the server's disk
        has a batch queued while puts arrive. Nothing is dropped here: objects not
        worth a disk write (at most ``SKIP_AHEAD`` of them per call) are put back
        in the policy's order and wait for the high watermark; the scan stops at
        the first object that cannot be demoted now (bound of demotions in flight,
        NVMe full, a pause after a failure). Returns the bytes being demoted."""
        moved = 0
        limit = srv.allocator.capacity
        skipped: list[tuple[ObjectRecord, NamespaceRecord]] = []
        for obj, ns in self.index.policy.candidates(srv):
            if not self._worth_a_disk_write(obj, ns):
                skipped.append((obj, ns))
                if len(skipped) >= SKIP_AHEAD:
                    break
                continue
            if not self._can_demote(obj):
                skipped.append((obj, ns))
                break
            self._demote(obj, ns)
            moved += obj.length
            if srv.reclaimable_used <= target_used or moved >= limit:
                break
        for obj, ns in skipped:  # popped from the policy's order: back in it
            self.index.policy.unpinned(obj, ns)
        self.counters["demotions_ahead"] += 1 if moved else 0
        return moved

    def make_room(self, srv: ServerRecord, size: int, budget: Budget) -> int:
        """A put's object does not fit on ``srv``. While the put may wait
        (``budget.wait``) and ``srv`` can demote: objects not worth a disk write are
        dropped at once, worth-keeping ones are demoted (not dropped) until the
        demotions in flight on ``srv`` cover ``size``; placement then asks the put
        to wait for them (``Budget.busy``). Otherwise, or when demoting cannot make
        the room (NVMe full, a failure pause, the bound of demotions in flight
        reached with too little in flight), the objects are evicted as before.
        Returns the bytes dropped (against ``budget.evict``)."""
        if not (budget.wait and self.cfg.demote and self._tier_open(srv)):
            return self._evict_room(srv, size, budget)
        dropped = 0
        held: list[tuple[ObjectRecord, NamespaceRecord]] = []
        allocator = srv.allocator
        for obj, ns in self.index.policy.candidates(srv):
            if not self._worth_a_disk_write(obj, ns):
                dropped += self.index.drop(obj, ns)
                self.counters["dropped_not_demoted"] += 1
                if allocator.largest_free() >= size or dropped >= budget.evict:
                    break
                continue
            if srv.demoting_bytes >= size or not self._can_demote(obj):
                held.append((obj, ns))  # wait for the demotions in flight instead
                break
            self._demote(obj, ns)
        for obj, ns in held:
            self.index.policy.unpinned(obj, ns)
        left = budget.evict - dropped
        if allocator.largest_free() < size and srv.demoting_bytes < size and left > 0:
            # Nothing in flight will make this room: evict as a put always did.
            dropped += self._evict_room(srv, size, Budget(budget.alloc, left))
        return dropped

    def _compute_of(self, ns: NamespaceRecord) -> ModelCompute:
        c = self._compute.get(ns.ns_id)
        if c is None:
            c = self._compute[ns.ns_id] = compute_for_layout(ns.layout)
        return c

    def recompute_s(self, ns: NamespaceRecord, pos: int) -> float:
        """Seconds to recompute block ``pos`` of a prompt at ``compute_tflops``."""
        bs = ns.layout.block_size
        flops = self._compute_of(ns).span(pos * bs, (pos + 1) * bs)
        return flops / (self.cfg.compute_tflops * 1e12)

    def _worth_demoting(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        return self._worth_a_disk_write(obj, ns) and self._can_demote(obj)

    def _tier_open(self, srv: ServerRecord) -> bool:
        """``srv`` takes demotions now: an NVMe tier, alive, its report complete, and
        no failed demotion in the last ``DEMOTE_PAUSE_S``."""
        return (
            bool(srv.nvme_capacity)
            and srv.alive
            and srv.ready
            and self.now_s >= srv.demote_paused_until
        )

    def _can_demote(self, obj: ObjectRecord) -> bool:
        """``obj``'s server can take its demotion now: :meth:`_tier_open`, fewer
        than ``max_demotions_in_flight`` in flight, and room on its NVMe tier (below
        the NVMe high watermark after evicting down to the low one)."""
        srv = obj.server
        cfg = self.cfg
        if not self._tier_open(srv) or len(srv.demoting) >= cfg.max_demotions_in_flight:
            return False
        high = cfg.nvme_high_watermark * srv.nvme_capacity
        if srv.nvme_bytes + obj.length > high:
            self._evict_nvme(srv, int(cfg.nvme_low_watermark * srv.nvme_capacity))
            if srv.nvme_bytes + obj.length > high:
                return False
        return True

    def _worth_a_disk_write(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        """The value side of the rule: recomputing ``obj``'s block takes at least
        ``demote_min_gain`` times as long as reading it back from NVMe, or its
        cached descendants need it."""
        srv = obj.server
        cfg = self.cfg
        if obj.group != ns.full_group or obj.entry.children == 0:
            # Not a block whose cached descendants need it: judge it by value.
            if isinstance(self.index.policy, CostPolicy) and obj.score <= ZERO / 2:
                return False  # it serves no match as things stand
            gbps = srv.nvme_read_gbps or DEFAULT_NVME_READ_GBPS
            read_s = obj.length / (gbps * 1e9)
            known = self._compute_of(ns) is not UNIT_COMPUTE  # unknown: keep what fits
            if known and self.recompute_s(ns, obj.entry.pos) < cfg.demote_min_gain * read_s:
                return False
        return True

    def _demote(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """Ask ``obj``'s server to copy it to NVMe. The object stays readable from
        DRAM and pinned (its range is not reused) until the server reports back."""
        srv = obj.server
        obj.pins += 1
        parent = obj.entry.parent
        if obj.group == ns.full_group and parent is not None:
            # Leaving DRAM: its parent may follow in this same pass (not one block
            # of a prompt per heartbeat round trip).
            obj.hits = LEAVING_DRAM
            parent.hot -= 1
            if parent.hot == 0:
                self.index.leaf_now(parent, ns)
        srv.demoting[obj.offset] = (obj, ns)
        srv.demoting_bytes += held(srv, obj.length)
        srv.nvme_bytes += obj.length  # reserved until the report
        srv.demote_out.append((obj, ns))
        self.counters["demotions_issued"] += 1

    def _evict_nvme(self, srv: ServerRecord, target: int) -> int:
        """Evict NVMe objects in the NVMe policy's order until ``srv``'s tier holds
        at most ``target`` bytes; evicting from NVMe deletes (``drop_nvme``)."""
        evicted = 0
        for obj, ns in self.index.nvme_policy.candidates(srv):
            evicted += self.index.drop(obj, ns)
            if srv.nvme_bytes <= target:
                break
        return evicted

    def demoted(self, srv: ServerRecord, done: Demotion, now: float) -> str | None:
        """A server finished (or failed) a demotion. Returns a failure to log, if
        any."""
        got = srv.demoting.pop(done.dram_offset, None)
        c = self.counters
        if got is None or got[0].length != done.length:
            c["demotions_unknown"] += 1
            if got is not None:  # not the object we asked for: put it back
                srv.demoting[done.dram_offset] = got
            if done.ok:
                srv.drop_out.append((done.nvme_offset, done.length))
            return None
        obj, ns = got
        length = obj.length
        srv.demoting_bytes -= held(srv, length)
        srv.nvme_bytes -= length  # the reservation; the NVMe record counts from here
        obj.pins -= 1
        if not done.ok and obj.state == LIVE and obj.hits == LEAVING_DRAM:
            parent = obj.entry.parent  # it stays in DRAM: a DRAM child again
            if parent is not None:
                parent.hot += 1
        if not done.ok:
            obj.hits = 0
        if not done.ok or obj.state != LIVE:
            if done.ok:  # evicted while it was being copied: delete the copy
                srv.drop_out.append((done.nvme_offset, length))
                c["demotions_void"] += 1
            else:
                c["demotions_failed"] += 1
                srv.demote_paused_until = now + DEMOTE_PAUSE_S
            if obj.pins == 0:
                if obj.state == EVICTED:
                    self.index.release_evicted(obj)
                elif obj.state == LIVE:
                    self.index.policy.unpinned(obj, ns)
            return None if done.ok else (done.error or "unknown error")
        # Switch the index to the NVMe copy, then let the DRAM range go.
        self.index.move_tier(ns, obj, done.nvme_offset, 1)
        if obj.pins:
            srv.deferred_bytes += length  # freed when its last read lease ends
        else:
            self.index.free_object(obj)
        c["demotions_done"] += 1
        c["demoted_bytes"] += length
        return None

    def nvme_lost(self, srv: ServerRecord, ranges: list[tuple[int, int]]) -> int:
        """The server dropped these NVMe objects by itself (a region evicted whole):
        forget them without asking it to delete anything (their addresses may hold
        new objects already). Returns the objects forgotten."""
        n = 0
        hit: list[tuple[NamespaceRecord, ObjectRecord]] = []
        for off, length in ranges:  # first forget every lost one...
            got = srv.nvme_objects.get(off)
            if got is None or got[0].length != length or got[0].state != LIVE:
                continue
            obj, ns = got
            self.index.unlink(ns, obj.entry, obj.group)
            obj.state = GONE  # nothing to free: the server has deleted it
            self.index.pol(obj).evicted(obj, ns)
            hit.append((ns, obj))
            n += 1
        for ns, obj in hit:  # ...then what a lost full object leaves useless
            entry = obj.entry
            if obj.group == ns.full_group:
                for g, o in enumerate(entry.objects):
                    if o is not None:
                        self.index.evict_object(ns, entry, g)
            if entry.children == 0 and not any(entry.objects):
                self.index.prune(ns, entry)
        self.counters["nvme_lost"] += n
        return n
