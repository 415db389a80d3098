"""A :class:`~gcache.meta.compact.CompactIndex` that follows a running
:class:`~gcache.meta.core.MetaCore`'s index, step by step, and checks that both
agree: the differential test of the compact index against the meta's own index
under the meta's real operations (puts, leases, evictions, demotions, promotions,
server drops), driven by the meta's hypothesis state machines.

After each step :meth:`CompactShadow.sync` reads the meta's records (blocks,
objects, pins, tiers, demotions in flight, access times) and applies what changed
through the compact index's own API, in the order the meta's components would
(pins, tier moves, removals deepest first, new blocks parents first, new
objects, demotion marks, touches). :meth:`CompactShadow.check` then compares what
the compact index *derived* incrementally with what the meta holds: every block's
children and hot counts, which objects are evictable (the meta's own rule,
``gcache.meta.eviction.evictable``, against the compact heaps' membership), each
tier's least recently used victim, the prefix of every chain, and the objects
evicted while leased (detached) until their last lease ends.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from gcache.meta.compact import DETACHED, LEAVING_DRAM, CompactIndex
from gcache.meta.core import MetaCore
from gcache.meta.eviction import evictable
from gcache.meta.index import LEAVING_DRAM as META_LEAVING
from gcache.meta.keymap import split_keys
from gcache.meta.records import LIVE, BlockEntry, NamespaceRecord, ObjectRecord

GROUPS = 8
Slot = tuple[int, bytes, int]  # (namespace id, block key, group)


def tick_of(t: float) -> int:
    """An access time as the compact index's tick (microseconds, kept positive)."""
    return round(t * 1e6) + (1 << 40)


class CompactShadow:
    def __init__(self, core: MetaCore) -> None:
        self.core = core
        self.ix = CompactIndex(groups=GROUPS)
        self.slots: dict[Slot, ObjectRecord] = {}  # what the compact index holds
        self.oid: dict[ObjectRecord, int] = {}  # live and detached records followed
        self.detached: set[ObjectRecord] = set()  # out of the index, still leased
        self.servers: dict[str, int] = {}
        self.namespaces: set[int] = set()
        self.steps = 0
        self.moves = 0
        self.detached_seen = 0

    # -- reading the meta ------------------------------------------------------------

    def _snapshot(
        self,
    ) -> tuple[dict[tuple[int, bytes], tuple[bytes | None, int]], dict[Slot, ObjectRecord]]:
        blocks: dict[tuple[int, bytes], tuple[bytes | None, int]] = {}
        objs: dict[Slot, ObjectRecord] = {}
        for ns in self.core.index.namespaces.values():
            if ns.ns_id not in self.namespaces:
                self.ix.namespace(ns.ns_id, ns.full_group)
                self.namespaces.add(ns.ns_id)
            for key, e in ns.entries.items():
                blocks[(ns.ns_id, key)] = (e.parent.key if e.parent is not None else None, e.pos)
                for g, o in enumerate(e.objects):
                    if o is not None:
                        objs[(ns.ns_id, key, g)] = o
        return blocks, objs

    def _bid(self, ns: int, key: bytes) -> int:
        k0, k1 = split_keys([key])
        return int(self.ix.find(ns, k0, k1)[0])

    def _server(self, rec: ObjectRecord) -> int:
        return self.servers.setdefault(rec.server.server_id, len(self.servers))

    # -- following it ----------------------------------------------------------------

    def _add_blocks(self, blocks: dict[tuple[int, bytes], tuple[bytes | None, int]]) -> None:
        new: dict[int, list[tuple[bytes, bytes | None, int]]] = {}
        for (ns, key), (parent, pos) in blocks.items():
            if self._bid(ns, key) < 0:
                new.setdefault(ns, []).append((key, parent, pos))
        for ns, rows in new.items():
            rows.sort(key=lambda r: r[2])
            k0, k1 = split_keys([r[0] for r in rows])
            pk0, pk1 = split_keys([r[1] or bytes(16) for r in rows])
            ids = self.ix.add_blocks(ns, k0, k1, pk0, pk1, np.array([r[2] for r in rows], np.int32))
            assert (ids >= 0).all(), "a block of the meta whose parent the compact index lacks"

    def _sync_pins(self, recs: Iterable[ObjectRecord]) -> None:
        pins = self.ix.objects.cols["pins"]
        for rec in list(recs):
            oid = self.oid[rec]
            d = rec.pins - int(pins[oid])
            if d > 0:
                self.ix.pin(np.full(d, oid, np.int32))
            elif d < 0:
                self.ix.unpin(np.full(-d, oid, np.int32))
                if self.ix.objects.cols["block"][oid] == -1:  # a detached copy freed
                    del self.oid[rec]
                    self.detached.discard(rec)

    def sync(self) -> None:
        blocks, objs = self._snapshot()
        self._add_blocks(blocks)
        self._sync_pins(self.oid)
        o = self.ix.objects.cols
        # Tier moves: the meta links a new record for the moved object (same
        # server, checksums and length, the other tier).
        for slot, old in list(self.slots.items()):
            new = objs.get(slot)
            if (
                new is not None
                and new is not old
                and new.tier != old.tier
                and new.server is old.server
                and new.sums == old.sums
                and new.length == old.length
                and new not in self.oid
            ):
                oid = self.oid[old]
                moved = self.ix.move_tier(oid, new.tier, new.offset)
                self.moves += 1
                # Leases still on the old copy keep it (and its range) apart.
                assert (moved != oid) == (old.pins > 0), (moved, oid, old.pins)
                if moved == oid:
                    del self.oid[old]
                else:
                    self.detached.add(old)  # the old copy stays for its leases
                    self.detached_seen += 1
                self.oid[new] = moved
                self.slots[slot] = new
                o = self.ix.objects.cols
                o["tick"][moved] = tick_of(new.last_access)
        # Removals, deepest first (a block's children go before it).
        gone = [s for s, rec in self.slots.items() if objs.get(s) is not rec]
        for slot in sorted(gone, key=lambda s: -self.slots[s].entry.pos):
            rec = self.slots.pop(slot)
            oid = self.oid[rec]
            self.ix.remove_object(oid)
            # Evicted while leased: its row (and range) stays until the last release.
            assert (self.ix.objects.cols["block"][oid] == DETACHED) == (rec.pins > 0)
            if rec.pins:
                self.detached.add(rec)
                self.detached_seen += 1
            else:
                del self.oid[rec]
        self._add_blocks(blocks)  # blocks the compact index pruned that the meta keeps
        # New objects, parents first.
        fresh = [s for s in objs if s not in self.slots]
        for slot in sorted(fresh, key=lambda s: objs[s].entry.pos):
            rec = objs[slot]
            ns, key, g = slot
            oid = self.ix.add_object(
                self._bid(ns, key), g, self._server(rec), rec.offset, rec.length, rec.sums,
                tick_of(rec.last_access), rec.tier,
            )  # fmt: skip
            self.slots[slot] = rec
            self.oid[rec] = oid
            if rec.pins:
                self.ix.pin(np.full(rec.pins, oid, np.int32))
        o = self.ix.objects.cols
        for rec in self.slots.values():
            oid = self.oid[rec]
            leaving = rec.tier == 0 and rec.hits == META_LEAVING
            if (o["hits"][oid] == LEAVING_DRAM) != leaving:
                self.ix.leaving(oid, leaving)
            t = tick_of(rec.last_access)
            if int(o["tick"][oid]) != t:
                self.ix.touch(np.array([oid], np.int32), t)
        # Blocks the meta pruned (empty and childless by now), deepest first.
        b = self.ix.blocks.cols
        extra = [
            bid
            for bid in range(self.ix.blocks.rows)
            if b["ns"][bid] != 0xFFFF and not self._in(blocks, bid)
        ]
        for bid in sorted(extra, key=lambda i: -int(b["pos"][i])):
            if b["ns"][bid] != 0xFFFF:  # not pruned with a child just now
                self.ix.remove_block(bid)
        self.steps += 1

    def _in(self, blocks: dict[tuple[int, bytes], tuple[bytes | None, int]], bid: int) -> bool:
        b = self.ix.blocks.cols
        key = int(b["k0"][bid]).to_bytes(8, "little") + int(b["k1"][bid]).to_bytes(8, "little")
        return (int(b["ns"][bid]), key) in blocks

    # -- comparing -------------------------------------------------------------------

    def check(self) -> None:
        blocks, objs = self._snapshot()
        st = self.ix.stats()
        assert st["blocks"] == len(blocks), (st, len(blocks))
        assert st["objects"] == len(objs), (st, len(objs))
        b, o = self.ix.blocks.cols, self.ix.objects.cols
        by_id = {ns.ns_id: ns for ns in self.core.index.namespaces.values()}
        for (ns_id, key), _ in blocks.items():
            bid = self._bid(ns_id, key)
            assert bid >= 0
            e = by_id[ns_id].entries[key]
            assert int(b["children"][bid]) == e.children, ("children", e.pos)
            assert int(b["hot"][bid]) == e.hot, ("hot", e.pos, int(b["hot"][bid]), e.hot)
        lru: dict[int, list[ObjectRecord]] = {0: [], 1: []}
        for slot, rec in objs.items():
            oid = self.oid[rec]
            assert self.slots[slot] is rec
            want = evictable(rec, by_id[slot[0]])
            assert (int(o["hpos"][oid]) >= 0) == want, (rec, want)
            assert int(o["pins"][oid]) == rec.pins and int(o["tier"][oid]) == rec.tier
            assert int(o["offset"][oid]) == rec.offset and self.ix.sums(oid) == rec.sums
            if want:
                lru[rec.tier].append(rec)
        for tier, cands in lru.items():
            v = self.ix.victim(tier)
            if not cands:
                assert v == -1
                continue
            oldest = min(r.last_access for r in cands)
            assert int(o["tick"][v]) == tick_of(oldest), (tier, int(o["tick"][v]), oldest)
        for rec in self.detached:
            oid = self.oid[rec]
            assert rec.state != LIVE or rec not in objs.values()
            assert int(o["block"][oid]) == DETACHED and int(o["pins"][oid]) == rec.pins > 0
        assert st["detached"] == len(self.detached)
        assert len(self.oid) == len(self.slots) + len(self.detached)
        for nsr in by_id.values():
            self._check_prefixes(nsr)

    def _check_prefixes(self, ns: NamespaceRecord) -> None:
        """Every leaf's chain: the compact index's prefix of each group equals the
        meta's (leading blocks holding an object of that group)."""
        leaves = [e for e in ns.entries.values() if e.children == 0]
        for leaf in leaves:
            chain: list[BlockEntry] = []
            e: BlockEntry | None = leaf
            while e is not None:
                chain.append(e)
                e = e.parent
            chain.reverse()
            keys = [x.key for x in chain]
            for g in range(ns.layout.num_groups):
                want = 0
                while want < len(chain) and chain[want].objects[g] is not None:
                    want += 1
                assert self.ix.prefix(ns.ns_id, keys, g) == want
                if g == ns.full_group and all(x.objects[g] is None for x in chain[want:]):
                    assert self.ix.match(ns.ns_id, keys, g) == want
