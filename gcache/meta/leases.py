"""Lookups and read leases: the longest valid match, the objects it reads, pins
held by the session that asked, released only by it (or by expiry or its end)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from gcache import capability, wire
from gcache.config import GRANT_MARGIN_S, MetaConfig
from gcache.errors import E_NO_SPACE, Refusal
from gcache.meta.fewrows import SMALL
from gcache.meta.ids import IdSource, wall_ms
from gcache.meta.index import Index
from gcache.meta.records import Lease, NamespaceRecord, ObjectRecord
from gcache.meta.session import LOCAL, Session

I32 = npt.NDArray[np.int32]

_LEASE_IDS = IdSource()


# Object rows: an array, or (a small lookup's: no array calls) a list.
Picked = I32 | list[int]

# Told the object rows a lookup picked (after they are touched): the tiers count
# the hits of NVMe objects for promotion.
OnPick = Callable[[NamespaceRecord, Picked], None]


def _no_pick(ns: NamespaceRecord, picked: Picked) -> None:
    pass


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
        p, bids = self.match_blocks(ns, req.keys, len(req.keys))
        if p == 0 or not req.lease:
            return wire.LookupResult(blocks=p, tokens=p * layout.block_size)
        picked = self.rows_of(ns, bids, p)
        got = self.index.lease_few(picked, ns, now) if isinstance(picked, list) else None
        if got is not None:  # (a few, LRU: pinned, touched and read in one pass)
            self.on_pick(ns, picked)
            fields = got
        else:  # (pinned first: nothing the promotion hook does may evict them)
            if isinstance(picked, list):
                self.index.pin_few(picked)
            else:
                self.index.pin(picked)
            self._touched(ns, picked, now)
            fields = self._fields(picked)
        lease_id = _LEASE_IDS.next(self.leases)
        expiry = now + self.cfg.lease_ttl_s
        expiry_ms = wall_ms(wall, now, expiry - GRANT_MARGIN_S)
        index: dict[int, int] = {}
        servers: list[wire.ServerAddr] = []
        locs: list[wire.ObjectLoc] = []
        table = self.index.store.servers
        mint, read, Grant, Loc = capability.mint, capability.KIND_READ, wire.Grant, wire.ObjectLoc
        nbytes = 0
        for slot, off, ln, tier, group, pos, sums in fields:
            si = index.get(slot)
            srv = table[slot]
            assert srv is not None
            if si is None:
                si = index[slot] = len(servers)
                servers.append(srv.addr)
            # The grant says the tier (an NVMe object is read over TCP from the
            # server's tier) and carries this meta's epoch; the tag covers both.
            ep = srv.grant_epoch
            tag = mint(srv.secret, read, off, ln, expiry_ms, tier, ep)
            locs.append(Loc(pos, group, si, Grant(off, ln, expiry_ms, tag, tier, ep), sums))
            nbytes += ln
        self.leases[lease_id] = Lease(lease_id, ns, picked, expiry, session, self.index.store)
        session.leases.add(lease_id)
        heapq.heappush(self._lease_heap, (expiry, lease_id))
        c = self.counters
        c["leases_granted"] += 1
        c["leased_objects"] += len(fields)
        c["leased_bytes"] += nbytes
        return wire.LookupResult(p, p * layout.block_size, lease_id, locs, servers)

    def _fields(self, picked: Picked) -> list[tuple[int, int, int, int, int, int, bytes]]:
        """The picked rows' reply fields, as ``FewRows.lease`` gives them."""
        cx = self.index.cx
        o, b = cx.objects.cols, cx.blocks.cols
        return list(
            zip(
                o["server"][picked].tolist(),
                o["offset"][picked].tolist(),
                o["length"][picked].tolist(),
                o["tier"][picked].tolist(),
                o["group"][picked].tolist(),
                b["pos"][o["block"][picked]].tolist(),
                self._sums(picked),
                strict=True,
            )
        )

    def _sums(self, oids: Picked) -> list[bytes]:
        """Each object's checksums, read per checksum width as one block of bytes."""
        cx = self.index.cx
        if isinstance(oids, list):  # (a few: one by one, no array calls)
            widths, slots = cx.objects.views("sums_len", "sums_slot")
            slabs = cx.sums_slabs.slabs
            out1 = []
            for oid in oids:
                w = widths[oid]
                if not w:
                    out1.append(b"")
                    continue
                at = slots[oid] * w
                out1.append(bytes(slabs[w].mv("s")[at : at + w]))
            return out1
        o = cx.objects.cols
        widths = o["sums_len"][oids]
        slots = o["sums_slot"][oids]
        out: list[bytes] = [b""] * len(oids)
        for w in np.unique(widths).tolist():
            if not w:
                continue
            at = np.flatnonzero(widths == w)
            blob = cx.sums_slabs.slabs[w].cols["s"][slots[at]].tobytes()
            for k, i in enumerate(at.tolist()):
                out[i] = blob[k * w : (k + 1) * w]
        return out

    def match(self, ns: NamespaceRecord, key_list: list[bytes], limit: int) -> int:
        """Longest valid match (blocks) among the first ``limit`` keys."""
        return self.match_blocks(ns, key_list, limit)[0]

    def match_blocks(
        self, ns: NamespaceRecord, key_list: list[bytes], limit: int
    ) -> tuple[int, I32 | list[int]]:
        """:meth:`match`, and the block ids of (at least) its first ``p`` keys:
        an array, or for a few keys a list."""
        keys_ = key_list[:limit] if limit < len(key_list) else key_list
        cx = self.index.cx
        fg = ns.full_group
        layout = ns.layout
        bids: I32 | list[int]
        if len(keys_) <= SMALL:  # (a few: one C call, no array made)
            # Entries are prefix-closed; a full object missing ends the match there.
            bids = ids = cx.keys.leading(ns.ns_id, keys_, -1 if fg is None else fg)
            p = len(ids)
            if ns.windowed:
                flat, width = cx.blocks.mv("obj"), cx.groups
                p = layout.valid_match(p, lambda j, g: flat[ids[j] * width + g] >= 0)
        else:
            bids = cx.find_keys(ns.ns_id, keys_)
            obj = cx.blocks.cols["obj"]
            gaps = np.flatnonzero(bids < 0)
            n = int(gaps[0]) if gaps.size else len(keys_)
            if fg is not None and n:
                holes = np.flatnonzero(obj[bids[:n], fg] < 0)
                if holes.size:
                    n = int(holes[0])
            rows = obj[bids[:n]] if n else obj[:0]
            p = layout.valid_match(n, lambda j, g: bool(rows[j, g] >= 0))
        c = self.counters
        c["lookups"] += 1
        c["lookup_blocks"] += limit
        c["hit_blocks"] += p
        c["hit_tokens"] += p * layout.block_size
        return p, bids

    def pick(self, ns: NamespaceRecord, bids: I32 | list[int], p: int, now: float) -> Picked:
        """The object rows a match of ``p`` blocks reads (:meth:`rows_of`),
        touched (a reuse) for the policy, then shown to ``on_pick``."""
        picked = self.rows_of(ns, bids, p)
        self._touched(ns, picked, now)
        return picked

    def _touched(self, ns: NamespaceRecord, picked: Picked, now: float) -> None:
        if isinstance(picked, list):
            self.index.touch_few(picked, ns, now)
        else:
            self.index.touch(picked, ns, now)
        self.on_pick(ns, picked)

    def rows_of(self, ns: NamespaceRecord, bids: I32 | list[int], p: int) -> Picked:
        """The object rows a match of ``p`` blocks reads, group by group, block
        by block: a list for a few (at most ``SMALL``), else an array."""
        layout = ns.layout
        if p <= SMALL:  # (a few: scalar work, no array calls)
            ids = bids[:p] if isinstance(bids, list) else bids[:p].tolist()
            flat, width = self.index.cx.blocks.mv("obj"), self.index.cx.groups
            few = [
                flat[ids[j] * width + g]
                for g in range(layout.num_groups)
                for j in layout.window_blocks(g, p)
            ]
            if few and min(few) < 0:
                raise AssertionError("a match names an object that is not there")
            if len(few) <= SMALL:
                return few
            picked = np.array(few, dtype=np.int32)
        else:
            obj = self.index.cx.blocks.cols["obj"]
            parts = []
            for g in range(layout.num_groups):
                w = layout.window_blocks(g, p)
                if len(w):
                    parts.append(obj[bids[w.start : w.stop], g])
            picked = np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)
            if picked.size and int(picked.min()) < 0:
                raise AssertionError("a match names an object that is not there")
        return picked

    def pick_keys(
        self, ns: NamespaceRecord, key_list: list[bytes], p: int, now: float
    ) -> list[ObjectRecord]:
        """:meth:`pick` for the first ``p`` keys of a prompt, as handles (in-process
        drivers: the replayer)."""
        if not p:
            return []
        bids = self.index.cx.find_keys(ns.ns_id, key_list[:p])
        picked = self.pick(ns, bids, p, now)
        ids = picked if isinstance(picked, list) else picked.tolist()
        return [self.index.obj(oid) for oid in ids]

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
        if isinstance(lease.oids, list):
            self.index.unpin_few(lease.oids)
        else:
            self.index.unpin(lease.oids, lease.ns)

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
