# One file (over 450 lines): the demotion rule and both tiers' watermarks are one policy.
"""The NVMe tier, seen from the meta: which DRAM objects are demoted (copied to
their server's NVMe tier) and which are dropped when DRAM passes its high
watermark, the NVMe watermarks (evicting from NVMe deletes), finished demotions
reported by the servers, the outboxes of each server's next heartbeat reply, and
placement's balance between free space and recent write load. No I/O; ``now``
comes from the caller.

The rule for a DRAM object leaving DRAM (in the DRAM policy's order), on its
own server (:meth:`Tiers._leaving`):

* no NVMe tier that takes demotions now (none, the server not alive or its report
  incomplete, a demotion failed there in the last ``DEMOTE_PAUSE_S``): drop it
  (``dropped_no_tier``);
* the tier has room for it (its NVMe bytes, demotions in flight included, stay at
  or below the NVMe low watermark with it): demote it, whatever it is worth;
* the tier is short of room: demote it only if it is worth a disk write
  (``meta/worth.py``: recomputing its block takes at least ``demote_min_gain``
  times as long as reading it back from NVMe, or cached descendants need it),
  evicting NVMe objects down to the low watermark to make room for it; else drop
  it (``dropped_not_worth``, or ``dropped_tier_full`` when the tier cannot be made
  room in);
* an object it would demote while ``max_demotions_in_flight`` demotions are
  pending on its server is not dropped: demotion is behind. A watermark pass stops
  there (``demotion_behind``: DRAM stays above its watermark a while) and a put
  that needs the room waits for the demotions in flight (``PutWait``,
  ``demotion_behind_waits``).

``dropped_not_demoted`` counts every object that left DRAM for room with no copy
on NVMe while demotion is on: the drops above, and what a put that could not wait
(any more) evicted (``dropped_put_could_not_wait``, or ``dropped_no_tier`` on a
server whose tier takes no demotions); the four ``dropped_*`` reasons add up to
it. Each server counts its own (``ServerRecord.dropped``, ``demoted``) for the
status table.

A demotion pins the object (it stays readable from DRAM, and nothing reuses its
range) until the server reports it done; only then is the index switched to the
NVMe copy and the DRAM range freed (after the last read lease on it ends).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gcache.config import MetaConfig
from gcache.meta.evictions import Evictions
from gcache.meta.index import Index
from gcache.meta.placement import Budget, evict_room
from gcache.meta.records import (
    LIVE,
    NamespaceRecord,
    ObjectRecord,
    ServerRecord,
)
from gcache.meta.worth import Worth

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
# Objects one watermark pass takes at most (~10 us each): the pass runs on the
# meta's event loop beside the etcd keepalives, so a store of millions of blocks
# drains in bounded steps (each commit and heartbeat goes on) instead of one call
# of seconds.
PASS_OBJECTS = 16384
PROMOTING = -1  # ObjectRecord.hits of an object being promoted

# What the rule says of a DRAM object leaving DRAM (Tiers._leaving): demote it,
# leave it for now (demotion is behind), or drop it for one of these reasons (each
# also a counter; together they make up ``dropped_not_demoted``).
DEMOTE = "demote"
BEHIND = "behind"
NO_TIER = "dropped_no_tier"
NOT_WORTH = "dropped_not_worth"
TIER_FULL = "dropped_tier_full"
PUT_COULD_NOT_WAIT = "dropped_put_could_not_wait"
DROP_REASONS = (NO_TIER, NOT_WORTH, TIER_FULL, PUT_COULD_NOT_WAIT)


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
    # > 0: the server heartbeats again within this many seconds (DRAM pressure)
    next_beat_s: float = 0.0


def held(srv: ServerRecord, length: int) -> int:
    """DRAM bytes an object of ``length`` holds in ``srv``'s allocator (aligned), as
    ``allocator.used`` counts them."""
    mask = srv.allocator.align - 1
    return (length + mask) & ~mask


class Tiers:
    """Demotion and the watermarks of both tiers; :meth:`make_room` is placement's
    strategy for a put whose object does not fit."""

    def __init__(
        self, cfg: MetaConfig, counters: Counter[str], index: Index, evictions: Evictions
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.evictions = evictions
        self.now_s = 0.0  # the latest ``now`` seen (tick, heartbeat): demotion pauses
        self.worth = Worth(cfg, index)  # the value side of the rule
        self.recompute_s = self.worth.recompute_s
        self._evict_room = evict_room(evictions)

    # ---- DRAM watermark: demote or drop --------------------------------------------

    def check_watermark(self, srv: ServerRecord) -> None:
        cfg = self.cfg
        cap = srv.allocator.capacity
        used = srv.reclaimable_used
        if used > cfg.high_watermark * cap or 0 <= srv.drain_to < used:
            target = int(cfg.low_watermark * cap)
            if cfg.demote:
                taken = self.drain(srv, target, PASS_OBJECTS)[1]
            else:
                taken = self.evictions.evict_pass(srv, target, 0, cap, PASS_OBJECTS)[1]
            cut = taken >= PASS_OBJECTS
            srv.drain_to = target if cut and srv.reclaimable_used > target else -1
            self.counters["watermark_passes_cut"] += 1 if srv.drain_to >= 0 else 0
        elif cfg.demote and srv.nvme_capacity and used > cfg.demote_watermark * cap:
            self._demote_ahead(srv, int(cfg.demote_watermark * cap))
        ncap = srv.nvme_capacity
        if ncap and srv.nvme_bytes > cfg.nvme_high_watermark * ncap:
            self._evict_nvme(srv, int(cfg.nvme_low_watermark * ncap))

    def demote_or_drop(self, srv: ServerRecord, target_used: int) -> int:
        """:meth:`drain` without a bound; returns the bytes that left DRAM."""
        return self.drain(srv, target_used)[0]

    def drain(
        self, srv: ServerRecord, target_used: int, max_objects: int = 1 << 62
    ) -> tuple[int, int]:
        """Take DRAM objects in the policy's store-wide order until ``srv``'s
        reclaimable usage is at most ``target_used``: each is demoted or dropped by
        :meth:`_leaving`. One whose server is behind (``max_demotions_in_flight``
        pending) is neither: it stays, and the pass stops once ``srv`` itself is
        behind (``demotion_behind``), or after ``max_objects`` candidates. Returns
        (bytes that left or are leaving DRAM, candidates taken)."""
        moved = taken = 0
        limit = srv.allocator.capacity
        held: list[tuple[ObjectRecord, NamespaceRecord]] = []
        for obj, ns in self.evictions.candidates(0):
            taken += 1
            why = self._leaving(obj, ns)
            if why == DEMOTE:
                self._demote(obj, ns)
                moved += obj.length
            elif why == BEHIND:
                held.append((obj, ns))
                if obj.server is srv or len(held) >= SKIP_AHEAD:
                    self.counters["demotion_behind"] += 1
                    break
                continue
            else:
                moved += self._drop(obj, ns, why)
            if srv.reclaimable_used <= target_used or moved >= limit or taken >= max_objects:
                break
        for obj, _ in held:  # popped from the policy's order: back in it
            self.evictions.requeue(obj)
        return moved, taken

    def _demote_ahead(self, srv: ServerRecord, target_used: int) -> int:
        """Continuous demotion (between ``demote_watermark`` and the high watermark):
        demote DRAM objects in the policy's order as :meth:`_leaving` says, until
        ``srv``'s reclaimable usage is at most ``target_used``, so the server's disk
        has a batch queued while puts arrive. Nothing is dropped here: objects it
        would drop (not worth a disk write while the tier is short of room; at most
        ``SKIP_AHEAD`` of them per call) are put back in the policy's order and wait
        for the high watermark; the scan stops at the first object that cannot be
        demoted now (bound of demotions in flight, NVMe full, a pause after a
        failure). Returns the bytes being demoted."""
        if not self._tier_open(srv):
            return 0
        moved = 0
        limit = srv.allocator.capacity
        skipped: list[tuple[ObjectRecord, NamespaceRecord]] = []
        for obj, ns in self.evictions.candidates(0):
            why = self._leaving(obj, ns)
            if why == NOT_WORTH:
                skipped.append((obj, ns))
                if len(skipped) >= SKIP_AHEAD:
                    break
                continue
            if why != DEMOTE:
                skipped.append((obj, ns))
                break
            self._demote(obj, ns)
            moved += obj.length
            if srv.reclaimable_used <= target_used or moved >= limit:
                break
        for obj, _ in skipped:  # popped from the policy's order: back in it
            self.evictions.requeue(obj)
        self.counters["demotions_ahead"] += 1 if moved else 0
        return moved

    def make_room(self, srv: ServerRecord, size: int, budget: Budget) -> int:
        """A put's object does not fit on ``srv``. While the put may wait
        (``budget.wait``) and ``srv``'s tier takes demotions: objects are demoted or
        dropped as :meth:`_leaving` says until the demotions in flight on ``srv``
        cover ``size``; placement then asks the put to wait for them
        (``Budget.busy``). Where demotion is behind (the bound of demotions in
        flight reached) the put waits too (``Budget.behind``) rather than drop
        objects the tier has room for. Otherwise, or when demoting cannot make the
        room (NVMe full, a failure pause), the objects are evicted as before, each
        counted as dropped (``dropped_put_could_not_wait``, or ``dropped_no_tier``
        where its server's tier takes no demotions). Returns the bytes dropped
        (against ``budget.evict``)."""
        if not self.cfg.demote:
            return self._evict_room(srv, size, budget)
        if not (budget.wait and self._tier_open(srv)):
            return self._evict_for_put(srv, size, budget.evict)
        dropped = 0
        held: list[tuple[ObjectRecord, NamespaceRecord]] = []
        allocator = srv.allocator
        for obj, ns in self.evictions.candidates(0):
            covered = srv.demoting_bytes >= size  # no NVMe room made for a demotion then
            why = self._leaving(obj, ns, make_nvme_room=not covered)
            if why in (DEMOTE, BEHIND) and covered:
                held.append((obj, ns))  # wait for the demotions in flight instead
                break
            if why == DEMOTE:
                self._demote(obj, ns)
                continue
            if why == BEHIND:
                held.append((obj, ns))
                if obj.server is srv or len(held) >= SKIP_AHEAD:
                    budget.behind = True
                    break
                continue
            dropped += self._drop(obj, ns, why)
            if allocator.largest_free() >= size or dropped >= budget.evict:
                break
        for obj, _ in held:
            self.evictions.requeue(obj)
        left = budget.evict - dropped
        room_coming = srv.demoting_bytes >= size or budget.behind
        if allocator.largest_free() < size and not room_coming and left > 0:
            # Nothing in flight will make this room: evict as a put always did.
            dropped += self._evict_for_put(srv, size, left)
        return dropped

    def _evict_for_put(self, srv: ServerRecord, size: int, max_bytes: int) -> int:
        """Evict in the policy's order until ``size`` bytes fit on ``srv`` (a put
        that cannot wait for demotions, or ``srv``'s tier takes none), counting what
        goes as dropped: ``dropped_no_tier`` where that tier takes no demotions,
        else ``dropped_put_could_not_wait``. Candidates on other servers (the order
        is store-wide: they make room here by making their parents leaves) follow
        :meth:`_leaving`; those whose server is behind are passed over, at most
        ``SKIP_AHEAD`` of them."""
        evicted = 0
        allocator = srv.allocator
        held: list[tuple[ObjectRecord, NamespaceRecord]] = []
        for obj, ns in self.evictions.candidates(0):
            why = PUT_COULD_NOT_WAIT if self._tier_open(obj.server) else NO_TIER
            if obj.server is not srv:
                why = self._leaving(obj, ns)
                if why == DEMOTE:
                    self._demote(obj, ns)
                    continue
                if why == BEHIND and len(held) < SKIP_AHEAD:
                    held.append((obj, ns))
                    continue
                if why == BEHIND:
                    why = PUT_COULD_NOT_WAIT
            evicted += self._drop(obj, ns, why)
            if allocator.largest_free() >= size or evicted >= max_bytes:
                break
        for obj, _ in held:  # popped from the policy's order: back in it
            self.evictions.requeue(obj)
        return evicted

    def _drop(self, obj: ObjectRecord, ns: NamespaceRecord, why: str) -> int:
        """Drop a DRAM object leaving DRAM with no NVMe copy, counted with its
        reason. Returns the bytes that left the index."""
        c = self.counters
        c["dropped_not_demoted"] += 1
        c[why] += 1
        obj.server.dropped += 1
        return self.evictions.drop(obj, ns)

    def _leaving(self, obj: ObjectRecord, ns: NamespaceRecord, make_nvme_room: bool = True) -> str:
        """The rule (module docstring) for DRAM object ``obj`` leaving DRAM:
        ``DEMOTE``, ``BEHIND`` (it would be demoted, but its server has
        ``max_demotions_in_flight`` pending: neither demote nor drop it now), or
        the reason to drop it (``NO_TIER``, ``NOT_WORTH``, ``TIER_FULL``).
        ``make_nvme_room``: evict NVMe objects for one worth it past the NVMe high
        watermark (else say ``DEMOTE`` for it without: the caller will not demote
        it now)."""
        srv = obj.server
        cfg = self.cfg
        if not (cfg.demote and self._tier_open(srv)):
            return NO_TIER
        room = self.has_room(srv, obj.length)
        if not room and not self.worth.a_disk_write(obj, ns):
            return NOT_WORTH
        if len(srv.demoting) >= cfg.max_demotions_in_flight:
            return BEHIND
        if not room and make_nvme_room:
            high = cfg.nvme_high_watermark * srv.nvme_capacity
            if srv.nvme_bytes + obj.length > high:
                self._evict_nvme(srv, int(cfg.nvme_low_watermark * srv.nvme_capacity))
                if srv.nvme_bytes + obj.length > high:
                    return TIER_FULL
        return DEMOTE

    def has_room(self, srv: ServerRecord, length: int) -> bool:
        """``srv``'s NVMe tier holds at most its low watermark with ``length`` more
        bytes (demotions in flight count): everything demotable is demoted."""
        return srv.nvme_bytes + length <= self.cfg.nvme_low_watermark * srv.nvme_capacity

    def _tier_open(self, srv: ServerRecord) -> bool:
        """``srv`` takes demotions now: an NVMe tier, alive, its report complete, and
        no failed demotion in the last ``DEMOTE_PAUSE_S``."""
        return (
            bool(srv.nvme_capacity)
            and srv.alive
            and srv.ready
            and self.now_s >= srv.demote_paused_until
        )

    def _demote(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """Ask ``obj``'s server to copy it to NVMe. The object stays readable from
        DRAM and pinned (its range is not reused) until the server reports back."""
        srv = obj.server
        self.index.pin([obj])
        self.index.mark_leaving(obj, ns)  # its parent may follow in this same pass
        srv.demoting[obj.offset] = (obj, ns)
        srv.demoting_bytes += held(srv, obj.length)
        srv.nvme_bytes += obj.length  # reserved until the report
        srv.demote_out.append((obj, ns))
        self.counters["demotions_issued"] += 1

    def _evict_nvme(self, srv: ServerRecord, target: int) -> int:
        """Evict NVMe objects in the NVMe policy's order until ``srv``'s tier holds
        at most ``target`` bytes; evicting from NVMe deletes (``drop_nvme``)."""
        evicted = 0
        for obj, ns in self.evictions.candidates(1):
            evicted += self.evictions.drop(obj, ns)
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
        if not done.ok:
            self.index.end_leaving(obj)  # it stays in DRAM: a DRAM child again
        if not done.ok or obj.state != LIVE:
            if done.ok:  # evicted while it was being copied: delete the copy
                srv.drop_out.append((done.nvme_offset, length))
                c["demotions_void"] += 1
            else:
                c["demotions_failed"] += 1
                srv.demote_paused_until = now + DEMOTE_PAUSE_S
            self.index.unpin([obj], ns)
            return None if done.ok else (done.error or "unknown error")
        # Switch the index to the NVMe copy, then let the DRAM range go.
        self.index.unpin([obj], ns)
        dram_offset = obj.offset
        if self.index.move_tier(ns, obj, done.nvme_offset, 1):
            srv.deferred_bytes += length  # freed when its last read lease ends
        else:
            self.index.free_copy(srv, 0, dram_offset, length)
        c["demotions_done"] += 1
        c["demoted_bytes"] += length
        srv.demoted += 1
        return None

    def nvme_lost(self, srv: ServerRecord, ranges: list[tuple[int, int]]) -> int:
        """The server dropped these NVMe objects by itself (a region evicted whole):
        forget them without asking it to delete anything (their addresses may hold
        new objects already). Returns the objects forgotten."""
        index = self.index
        o = index.cx.objects.cols
        mine = index.server_objects(srv)
        mine = mine[o["tier"][mine] == 1]
        at = dict(zip(o["offset"][mine].tolist(), mine.tolist(), strict=True))
        n = 0
        hit: list[tuple[NamespaceRecord, int, int]] = []
        for off, length in ranges:  # first forget every lost one...
            oid = at.pop(off, None)
            if oid is None or int(o["length"][oid]) != length or int(o["block"][oid]) < 0:
                continue
            bid, g = int(o["block"][oid]), int(o["group"][oid])
            ns = index.ns_by_id[int(index.cx.blocks.cols["ns"][bid])]
            ghost = index.unlink(ns, bid, g)
            index.forget(ghost)  # nothing to free: the server has deleted it
            pol = index.pol(ghost)
            if pol.events:
                pol.evicted(ghost, ns)
            hit.append((ns, bid, g))
            n += 1
            o = index.cx.objects.cols
        b = index.cx.blocks.cols
        for ns, bid, g in hit:  # ...then what a lost full object leaves useless
            if int(b["ns"][bid]) != ns.ns_id:
                continue  # pruned already
            if g == ns.full_group:
                for g2, oid in enumerate(b["obj"][bid, : ns.layout.num_groups].tolist()):
                    if oid >= 0:
                        self.evictions.evict_object(ns, bid, g2)
            index.prune(ns, bid)
            b = index.cx.blocks.cols
        self.counters["nvme_lost"] += n
        return n
