"""Where a put's objects go: dedup against the index, the SWA checkpoints the meta
asks for, and allocation on the servers' segments within a :class:`Budget` (what
one put may reserve and evict), evicting when nothing fits. No I/O, no clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from gcache.config import MetaConfig
from gcache.errors import PutWait
from gcache.meta.evictions import Evictions
from gcache.meta.membership import Membership
from gcache.meta.records import NamespaceRecord, Placed, Plan, ServerRecord

UNBOUNDED = 1 << 62


class Budget:
    """Bytes one put may still allocate (the least of its client's, the store's and
    its tenant's pending/quota room) and evict. An object past ``alloc`` is
    ``no_space`` without evicting anything, so a put over its bounds never takes
    other tenants' committed data.

    ``wait``: the put may wait for room that demotions in flight will free instead
    of evicting worth-keeping objects (the hot path's puts, see ``PutWait``);
    ``busy`` counts its objects that found no room for that reason; ``behind``:
    making room for the object being placed found demotion behind on a server (the
    bound of demotions in flight reached with objects the tier has room for), so
    room is on its way there too; ``behind_waits``: objects that waited for that."""

    __slots__ = ("alloc", "behind", "behind_waits", "busy", "evict", "wait")

    def __init__(self, alloc: int = UNBOUNDED, evict: int = UNBOUNDED, wait: bool = False) -> None:
        self.alloc = alloc
        self.evict = evict
        self.wait = wait
        self.busy = 0
        self.behind = False
        self.behind_waits = 0


def balance_key(srv: ServerRecord) -> tuple[float, int]:
    """Lower goes first: recent write load per byte of capacity over (0.5 + the free
    fraction), then the most free bytes. An empty server gets at most 3x the write
    rate of a full one (1.5 vs 0.5), so it fills without taking every new write."""
    cap = srv.allocator.capacity or 1
    free = srv.allocator.free_bytes
    return (srv.recent_write / cap) / (0.5 + free / cap), -free


# How a put's object that does not fit on a server makes room there, within the
# put's budget; returns the bytes evicted (the tiers' demotion is one such strategy).
MakeRoom = Callable[[ServerRecord, int, Budget], int]


def evict_room(evictions: Evictions) -> MakeRoom:
    """The plain strategy: evict in the DRAM policy's order until the object fits."""

    def make_room(srv: ServerRecord, size: int, budget: Budget) -> int:
        return evictions.evict(srv, need_contiguous=size, max_bytes=budget.evict)

    return make_room


class Placement:
    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        members: Membership,
        make_room: MakeRoom,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.members = members
        self.make_room = make_room

    def place(
        self,
        ns: NamespaceRecord,
        key_list: list[bytes],
        masks: list[int],
        now: float,
        checkpoint_from: int = -1,
        budget: Budget | None = None,
    ) -> Plan:
        """Plan a put of a validated request: skip stored objects (dedup), add the
        checkpoint windows the meta wants (only on blocks from ``checkpoint_from``,
        the first block whose windowed rows the client holds; -1: none), allocate
        within ``budget`` (None: unbounded). Used by ``put_begin`` and in-process
        drivers."""
        if budget is None:
            budget = Budget()
        fg = ns.full_group
        branch = 0  # how far the prompt follows blocks with their full object cached
        stored = ns.entries.stored(key_list)
        if fg is not None:
            for objs in stored:
                if objs[fg] < 0:
                    break
                branch += 1
        checkpoints: list[int] = []
        if checkpoint_from >= 0 and fg is not None:
            checkpoints = self._checkpoints(ns, stored, branch, checkpoint_from)
            if checkpoints:
                masks = ns.layout.add_windows(masks, checkpoints)
        placed: list[Placed] = []
        start = 0
        if branch and fg is not None and masks[:branch].count(1 << fg) == branch:
            # The cached prefix, offered full objects only: all present, no probe.
            start = branch
        evictions = self.counters["evictions"]
        deduped, no_space = self._place_objects(
            ns, key_list, masks, start, now, placed, budget, stored
        )
        deduped += start
        if self.counters["evictions"] != evictions:
            # Making room evicted objects this put had counted as stored: a second
            # pass over every block places them. It re-counts what is stored and what
            # found no space (the first pass's figures would count both twice).
            deduped, no_space = self._place_objects(ns, key_list, masks, 0, now, placed, budget)
        if budget.busy:
            # DRAM is full and demotions in flight will free it: place nothing now
            # (the ranges just allocated go back, no grant was minted for them) and
            # let the caller wait for the room rather than drop worth-keeping data.
            for _, _, srv, off, _ in placed:
                srv.allocator.free(off)
            self.counters["puts_told_to_wait"] += 1
            if budget.behind_waits:
                self.counters["demotion_behind_waits"] += 1
            raise PutWait(f"DRAM full: {budget.busy} objects wait for demotions in flight")
        self.counters["puts_begun"] += 1
        self.counters["objects_no_space"] += no_space
        self.counters["objects_deduped"] += deduped
        self.counters["checkpoints_placed"] += len(checkpoints)
        return Plan(placed, no_space, checkpoints)

    def _place_objects(
        self,
        ns: NamespaceRecord,
        key_list: list[bytes],
        masks: list[int],
        start: int,
        now: float,
        placed: list[Placed],
        budget: Budget,
        stored: list[list[int]] | None = None,
    ) -> tuple[int, int]:
        """Allocate every object ``masks`` asks for from block ``start`` that is
        neither stored nor in ``placed`` yet. Returns (already stored, no space).
        ``stored``: what :meth:`Entries.stored` says of ``key_list`` now, if known
        (nothing evicted since)."""
        if stored is None:
            stored = ns.entries.stored(key_list)
        sizes = ns.layout.group_object_bytes
        have = {(p[0], p[1]) for p in placed} if placed else None
        deduped = no_space = 0
        live = self.members.live_servers()
        # One server (the replayer, small deployments): allocate there directly.
        only = live[0] if len(live) == 1 else None
        alloc = only.allocator.alloc if only is not None else None
        for i in range(start, len(key_list)):
            mask = masks[i]
            if not mask:
                continue
            objs = stored[i]
            g = 0
            while mask:
                if mask & 1 and (have is None or (i, g) not in have):
                    if objs[g] >= 0:
                        deduped += 1
                    elif sizes[g] > budget.alloc:
                        no_space += 1  # past the put's bounds: nothing evicted for it
                    else:
                        size = sizes[g]
                        off = alloc(size) if alloc is not None else None
                        if off is not None and only is not None:
                            placed.append((i, g, only, off, size))
                            budget.alloc -= size
                            only.placed_since_beat += size
                        else:
                            where = self._allocate(size, budget, now)
                            if where is None:
                                no_space += 1
                            else:
                                placed.append((i, g, where[0], where[1], size))
                                budget.alloc -= size
                                self._placed(where[0], size, now)
                mask >>= 1
                g += 1
        return deduped, no_space

    def _checkpoints(
        self, ns: NamespaceRecord, stored: list[list[int]], branch: int, first: int
    ) -> list[int]:
        """:meth:`Layout.checkpoint_positions` for this prompt (``stored``: its
        blocks' objects, :meth:`Entries.stored`), dense while the store is below
        its low watermark, less the windows that are complete already."""
        layout = ns.layout
        interval = self.cfg.checkpoint_interval // layout.block_size
        if interval <= 0:
            return []
        dense = self._below_low_watermark()
        out = []
        for c in layout.checkpoint_positions(len(stored), branch, first, interval, dense):
            for g, t in ns.windowed:
                if any(stored[j][g] < 0 for j in range(max(0, c - t), c)):
                    out.append(c)
                    break
        return out

    def _below_low_watermark(self) -> bool:
        used = cap = 0
        for srv in self.members.ready_servers():
            used += srv.reclaimable_used
            cap += srv.allocator.capacity
        return used < self.cfg.low_watermark * cap

    def _placed(self, srv: ServerRecord, size: int, now: float) -> None:
        """Count ``size`` bytes placed on ``srv`` in its recent write load, which
        decays with half-life ``write_balance_s``."""
        dt = now - srv.recent_at
        if dt > 0:
            srv.recent_write *= 2.0 ** (-dt / self.cfg.write_balance_s)
            srv.recent_at = now
        srv.recent_write += size
        srv.placed_since_beat += size

    def _allocate(
        self, size: int, budget: Budget, now: float = 0.0
    ) -> tuple[ServerRecord, int] | None:
        """Place ``size`` bytes on the live server with the least recent write load
        per byte of capacity, weighed by its free space (:func:`balance_key`: a
        restarted, empty server takes a larger share of new writes, not all of
        them), evicting (within ``budget.evict``) if nothing fits."""
        live = self.members.live_servers()
        if not live:
            return None
        best = live[0] if len(live) == 1 else min(live, key=balance_key)
        off = best.allocator.alloc(size)
        if off is not None:
            return best, off
        order = sorted(live, key=lambda s: s.allocator.free_bytes, reverse=True)
        for srv in order:
            off = srv.allocator.alloc(size)
            if off is not None:
                return srv, off
        budget.behind = False
        for srv in order:
            if budget.evict <= 0:
                break
            budget.evict -= self.make_room(srv, size, budget)
            off = srv.allocator.alloc(size)
            if off is not None:
                return srv, off
        if budget.wait and budget.behind:
            budget.busy += 1  # demotion is behind: the put waits for it (place)
            budget.behind_waits += 1
        elif budget.wait and any(s.demoting_bytes >= size for s in order):
            budget.busy += 1  # room is on its way: the put waits instead (place)
        return None
