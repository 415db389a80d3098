"""Lookups and read leases: the longest valid match, the objects it reads, pins
held by the session that asked, released only by it (or by expiry or its end)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from operator import attrgetter, itemgetter

from gcache import capability, wire
from gcache.config import GRANT_MARGIN_S, MetaConfig
from gcache.errors import E_NO_SPACE, Refusal
from gcache.meta.ids import IdSource, wall_ms
from gcache.meta.index import Index
from gcache.meta.records import BlockEntry, Lease, NamespaceRecord, ObjectRecord
from gcache.meta.session import LOCAL, Session

_OBJECTS = attrgetter("objects")


_LEASE_IDS = IdSource()


# Told the objects a lookup picked (after they are touched): the tiers count the
# hits of NVMe objects for promotion.
OnPick = Callable[[NamespaceRecord, list[ObjectRecord]], None]


def _no_pick(ns: NamespaceRecord, picked: list[ObjectRecord]) -> None:
    pass


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


class Leases:
    def __init__(
        self, cfg: MetaConfig, counters: Counter[str], index: Index, on_pick: OnPick = _no_pick
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.on_pick = on_pick
        self.leases: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []

    def lookup(
        self, req: wire.Lookup, now: float, wall: float, session: Session = LOCAL
    ) -> wire.LookupResult:
        ns = self.index.namespace(req.namespace, session.principal)
        self.index.check_keys(req.keys)
        layout = ns.layout
        if req.lease and len(session.leases) >= self.cfg.max_leases_per_client:
            raise Refusal(
                E_NO_SPACE, f"{len(session.leases)} leases held: release some before asking more"
            )
        p = self.match(ns, req.keys, len(req.keys))
        if p == 0 or not req.lease:
            return wire.LookupResult(blocks=p, tokens=p * layout.block_size)
        chain = list(map(ns.entries.__getitem__, req.keys[:p]))
        picked = self.pick(ns, chain, p, now)
        lease_id = _LEASE_IDS.next(self.leases)
        expiry = now + self.cfg.lease_ttl_s
        expiry_ms = wall_ms(wall, now, expiry - GRANT_MARGIN_S)
        index: dict[str, int] = {}
        servers: list[wire.ServerAddr] = []
        locs: list[wire.ObjectLoc] = []
        self.index.pin(picked)
        for obj in picked:
            srv = obj.server
            si = index.get(srv.server_id)
            if si is None:
                si = index[srv.server_id] = len(servers)
                servers.append(srv.addr)
            # The grant says the tier (an NVMe object is read over TCP from the
            # server's tier) and carries this meta's epoch; the tag covers both.
            ep = srv.grant_epoch
            tag = capability.mint(
                srv.secret, capability.KIND_READ, obj.offset, obj.length, expiry_ms, obj.tier, ep
            )
            grant = wire.Grant(obj.offset, obj.length, expiry_ms, tag, obj.tier, ep)
            locs.append(wire.ObjectLoc(obj.entry.pos, obj.group, si, grant, obj.sums))
        self.leases[lease_id] = Lease(lease_id, ns, picked, expiry, session)
        session.leases.add(lease_id)
        heapq.heappush(self._lease_heap, (expiry, lease_id))
        c = self.counters
        c["leases_granted"] += 1
        c["leased_objects"] += len(picked)
        c["leased_bytes"] += sum(obj.length for obj in picked)
        return wire.LookupResult(p, p * layout.block_size, lease_id, locs, servers)

    def match(self, ns: NamespaceRecord, key_list: list[bytes], limit: int) -> int:
        """Longest valid match (blocks) among the first ``limit`` keys."""
        entries = ns.entries
        keys_ = key_list[:limit] if limit < len(key_list) else key_list
        n = present_prefix(entries, keys_)
        fg = ns.full_group
        if fg is not None and ns.full_holes and n:
            # Some entry lacks its full object: find the first such on this chain.
            fulls = list(map(itemgetter(fg), map(_OBJECTS, map(entries.__getitem__, keys_[:n]))))
            if None in fulls:
                n = fulls.index(None)
        layout = ns.layout
        p = layout.valid_match(n, lambda j, g: entries[keys_[j]].objects[g] is not None)
        c = self.counters
        c["lookups"] += 1
        c["lookup_blocks"] += limit
        c["hit_blocks"] += p
        c["hit_tokens"] += p * layout.block_size
        return p

    def pick(
        self, ns: NamespaceRecord, chain: list[BlockEntry], p: int, now: float
    ) -> list[ObjectRecord]:
        """The objects a match of ``p`` blocks reads, touched (a reuse) for the policy,
        then shown to ``on_pick``."""
        picked: list[ObjectRecord] = []
        layout = ns.layout
        for g in range(layout.num_groups):
            for j in layout.window_blocks(g, p):
                obj = chain[j].objects[g]
                assert obj is not None
                picked.append(obj)
        self.index.touch(picked, ns, now)
        self.on_pick(ns, picked)
        return picked

    def release(self, lease_id: int, session: Session = LOCAL) -> bool:
        """End a lease ``session`` holds; another session's lease is left alone."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        if lease.owner is not session:
            self.counters["foreign_refused"] += 1
            return False
        self._end_lease(lease)
        return True

    def _end_lease(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        lease.owner.leases.discard(lease.lease_id)
        self.index.unpin(lease.objects, lease.ns)

    def end_session(self, session: Session) -> None:
        """Release the leases of a closed session."""
        for lease_id in list(session.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.owner is session:
                self._end_lease(lease)
                self.counters["session_leases_released"] += 1
        session.leases.clear()

    def expire(self, now: float) -> None:
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expiry <= now:
                self._end_lease(lease)
                self.counters["leases_expired"] += 1
