"""The compact index (gcache/meta/compact.py) against a model made of dicts: a
hypothesis state machine adds prompts (chains of blocks, shared prefixes), objects,
touches, evicts the LRU leaf, removes objects and drops servers; after every step
the index's invariants hold: every indexed key finds its block, lookups match the
model's prefix, the victim is the model's least recently used leaf, checksums read
back, counts agree, and a block has children or objects or is gone."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gcache._native import INDEX_KERNELS
from gcache.errors import CompactIndexError
from gcache.meta.compact import CompactIndex
from gcache.meta.keymap import split_keys
from gcache.meta.leaves import float_ticks
from gcache.meta.rowtable import RowTable
from gcache.meta.tickheap import TickHeap

GROUPS = 2


def key(ns: int, tokens: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(repr((ns, tokens)).encode(), digest_size=16).digest()


def chain(ns: int, tokens: list[int]) -> list[bytes]:
    return [key(ns, tuple(tokens[: i + 1])) for i in range(len(tokens))]


def test_chain_lookup_objects_and_eviction_order() -> None:
    ix = CompactIndex(groups=GROUPS)
    ix.namespace(1, 0)
    a = ix.add_chain(1, chain(1, [1, 2, 3]))
    b = ix.add_chain(1, chain(1, [1, 2, 4]))  # shares two blocks
    assert list(a[:2]) == list(b[:2]) and a[2] != b[2]
    assert ix.stats()["blocks"] == 4
    oids = {}
    for t, bid in enumerate([*a, b[2]]):
        oids[int(bid)] = ix.add_object(int(bid), 0, 7, 4096 * t, 4096, bytes([t]) * 16, tick=t)
    assert ix.prefix(1, chain(1, [1, 2, 3, 9]), 0) == 3
    assert ix.prefix(1, chain(1, [1, 2, 3]), 1) == 0
    assert ix.prefix(2, chain(1, [1, 2, 3]), 0) == 0  # another namespace
    # Leaves only: a[2] (tick 2) and b[2] (tick 3); a[2] is older.
    assert ix.victim() == oids[int(a[2])]
    ix.touch(np.array([oids[int(a[2])]], dtype=np.int32), tick=10)
    assert ix.victim() == oids[int(b[2])]
    assert ix.sums(oids[int(b[2])]) == bytes([3]) * 16
    assert ix.remove_object(oids[int(b[2])]) == (7, 0, 4096 * 3, 4096)
    assert ix.stats()["blocks"] == 3  # b[2] had nothing else: removed
    assert ix.victim() == oids[int(a[2])]
    ix.remove_object(oids[int(a[2])])
    assert ix.victim() == oids[int(a[1])]  # the parent became a leaf
    with pytest.raises(CompactIndexError):
        ix.remove_object(oids[int(a[2])])
    with pytest.raises(CompactIndexError):
        split_keys([b"short"])
    with pytest.raises(CompactIndexError):
        ix.add_chain(0xFFFF, chain(1, [1]))


def test_a_large_batch_of_leaves_heapifies_by_sort() -> None:
    ix = CompactIndex(groups=1)
    ix.namespace(0, 0)
    n = 5_000
    bids = np.concatenate([ix.add_chain(0, [key(0, (i,))]) for i in range(n)])
    rng = np.random.default_rng(1)
    ticks = rng.permutation(n).astype(np.uint64)
    ix.add_objects(bids, 0, 1, ticks, np.full(n, 64, np.uint32), np.zeros((n, 8), np.uint8), ticks)
    order = []
    while (v := ix.victim()) >= 0:
        order.append(int(ix.objects.cols["tick"][v]))
        ix.remove_object(v)
    assert order == list(range(n)) and ix.stats()["blocks"] == 0


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=8),
    chunks=st.integers(1, 3),
    orphaned=st.sets(st.integers(0, 7), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_report_chunks_in_bulk_match_chains_put_one_by_one(
    prompts: list[list[int]], chunks: int, orphaned: set[int], seed: int
) -> None:
    """Blocks reported as rows (key, parent key, position) in chunks, shuffled
    within a chunk, build the same index as the prompts' chains put one by one;
    a row whose parent was never reported is left out with its descendants; the
    eviction order built at the end of the bulk load is the LRU order of leaves."""
    rows: dict[bytes, tuple[bytes | None, int]] = {}
    for tokens in prompts:
        ks = chain(0, tokens)
        for i, k in enumerate(ks):
            rows.setdefault(k, (ks[i - 1] if i else None, i))
    keys_ = list(rows)
    lost = {keys_[i] for i in orphaned if i < len(keys_)}  # never reported
    reported = [k for k in keys_ if k not in lost]

    def reachable(k: bytes) -> bool:
        while k is not None:
            if k in lost:
                return False
            k = rows[k][0]  # type: ignore[assignment]
        return True

    rng = np.random.default_rng(seed)
    order = sorted(reported, key=lambda k: rows[k][1])  # by position, as the merge
    ix = CompactIndex(groups=1)
    ix.namespace(0, 0)
    ix.begin_bulk()
    got: dict[bytes, int] = {}
    for part in np.array_split(np.arange(len(order)), chunks):
        ks = [order[i] for i in rng.permutation(part)]
        k0, k1 = split_keys(ks)
        pk = [rows[k][0] or bytes(16) for k in ks]
        pk0, pk1 = split_keys(pk)
        pos = np.array([rows[k][1] for k in ks], dtype=np.int32)
        ids = ix.add_blocks(0, k0, k1, pk0, pk1, pos)
        for k, bid in zip(ks, ids, strict=True):
            got[k] = int(bid)
        live = [i for i, bid in enumerate(ids) if bid >= 0]
        ticks = np.array([keys_.index(ks[i]) for i in live], dtype=np.uint64)
        ix.add_objects(ids[live], 0, 0, ticks, np.full(len(live), 64, np.uint32),
                       np.zeros((len(live), 8), np.uint8), ticks)  # fmt: skip
    ix.end_bulk()
    want = {k for k in reported if reachable(k)}
    assert {k for k, bid in got.items() if bid >= 0} == want
    assert ix.stats()["blocks"] == len(want)
    for k in want:
        parent = rows[k][0]
        p_id = int(ix.blocks.cols["parent"][got[k]])
        assert p_id == (got[parent] if parent is not None else -1)
    # Evicting everything goes leaves first, oldest first: each victim is the
    # least recently used object with no children left.
    left = set(want)
    while left:
        leaves = [k for k in left if not any(rows[c][0] == k for c in left)]
        oldest = min(leaves, key=keys_.index)
        v = ix.victim()
        assert int(ix.objects.cols["block"][v]) == got[oldest]
        ix.remove_object(v)
        left.remove(oldest)
    assert ix.victim() == -1 and ix.stats()["blocks"] == 0


def test_table_grows_and_tombstones_are_rehashed() -> None:
    ix = CompactIndex(groups=1)
    keys = [key(0, (i,)) for i in range(20_000)]
    ids = np.concatenate([ix.add_chain(0, [k]) for k in keys])  # 20,000 roots
    assert ix.stats()["table_slots"] >= 2 * 20_000  # at most half full
    k0, k1 = split_keys(keys)
    assert (ix.find(0, k0, k1) == ids).all()
    # Tombstones pass a quarter of the table and are rehashed away.
    for bid in ids[5_000:]:
        ix.remove_block(int(bid))
    assert ix.stats()["blocks"] == 5_000
    assert 4 * ix.stats()["tombstones"] <= ix.stats()["table_slots"]
    found = ix.find(0, k0, k1)
    assert (found[:5_000] == ids[:5_000]).all() and (found[5_000:] == -1).all()
    # A chain of empty blocks goes whole when its leaf goes.
    chain_ids = ix.add_chain(0, chain(3, list(range(300))))
    ix.remove_block(int(chain_ids[-1]))
    assert ix.stats()["blocks"] == 5_000


# The model's namespaces: their full (prefix-closed) group, or None (all windowed).
FULL = {0: 0, 1: None, 2: 1}
Rec = dict[str, int | bytes | bool]


class CompactModel(RuleBasedStateMachine):
    """Prompts with shared prefixes in three namespaces (full group 0, none, 1),
    objects on two tiers, leases pinning objects (evicted while pinned: detached
    until unpinned), demotions marked leaving, tier moves; against dicts."""

    native = True  # the C kernels (heap sifts, probes, match); the subclass: Python

    def __init__(self) -> None:
        super().__init__()
        self.ix = CompactIndex(groups=GROUPS, native=self.native)
        for ns, fg in FULL.items():
            self.ix.namespace(ns, fg)
        self.tick = 0
        # model: key -> (ns, parent key or None); objects: (key, group) -> record
        self.blocks: dict[bytes, tuple[int, bytes | None]] = {}
        self.objs: dict[tuple[bytes, int], Rec] = {}
        self.detached: dict[int, Rec] = {}  # oid -> record of an evicted pinned object
        self.leases: list[list[int]] = []
        self.prompts: list[tuple[int, list[int]]] = []

    def _children(self, k: bytes) -> list[bytes]:
        return [c for c, (_, p) in self.blocks.items() if p == k]

    def _bid(self, k: bytes) -> int:
        ns = self.blocks[k][0]
        k0, k1 = split_keys([k])
        return int(self.ix.find(ns, k0, k1)[0])

    def _hot(self, k: bytes) -> int:
        """Children whose full object is in DRAM and not leaving."""
        fg = FULL[self.blocks[k][0]]
        n = 0
        for c in self._children(k):
            r = self.objs.get((c, fg)) if fg is not None else None
            n += r is not None and r["tier"] == 0 and not r["leaving"]
        return n

    def _evictable(self, k: bytes, g: int) -> bool:
        r = self.objs[(k, g)]
        if r["pins"]:
            return False
        if g != FULL[self.blocks[k][0]]:
            return True
        return (self._hot(k) if r["tier"] == 0 else len(self._children(k))) == 0

    def _new(self, k: bytes, i: int, keys: list[bytes], ns: int) -> None:
        self.blocks.setdefault(k, (ns, keys[i - 1] if i else None))

    def _prune(self, keys: list[bytes]) -> None:
        # Blocks given no object and no children are left to the caller (as the
        # meta's puts abort): remove them here as the meta's prune would.
        for k in reversed(keys):
            if k in self.blocks and not self._children(k) and not self._objects_of(k):
                self.ix.remove_block(self._bid(k))
                self._forget(k)

    @rule(
        ns=st.integers(0, 2),
        tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        groups=st.sets(st.integers(0, GROUPS - 1), max_size=GROUPS),
        server=st.integers(0, 2),
        tier=st.integers(0, 1),
    )
    def put_prompt(
        self, ns: int, tokens: list[int], groups: set[int], server: int, tier: int
    ) -> None:
        keys = chain(ns, tokens)
        ids = self.ix.add_chain(ns, keys)
        for i, k in enumerate(keys):
            self._new(k, i, keys, ns)
        self.prompts.append((ns, tokens))
        for g in sorted(groups):
            for i, k in enumerate(keys):
                if (k, g) in self.objs:
                    continue
                self.tick += 1
                sums = hashlib.sha256(k + bytes([g])).digest()[: 8 * (g + 1)]
                oid = self.ix.add_object(
                    int(ids[i]), g, server, self.tick, 64, sums, self.tick, tier=tier
                )
                self.objs[(k, g)] = {"oid": oid, "tick": self.tick, "server": server,
                                     "offset": self.tick, "sums": sums, "tier": tier,
                                     "pins": 0, "leaving": False}  # fmt: skip
        self._prune(keys)

    @rule(
        ns=st.integers(0, 2),
        tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        g=st.integers(0, GROUPS - 1),
        server=st.integers(0, 2),
        tier=st.integers(0, 1),
    )
    def put_prompt_batched(
        self, ns: int, tokens: list[int], g: int, server: int, tier: int
    ) -> None:
        """A whole prompt's objects of one group in one add_objects call."""
        keys = chain(ns, tokens)
        ids = self.ix.add_chain(ns, keys)
        for i, k in enumerate(keys):
            self._new(k, i, keys, ns)
        self.prompts.append((ns, tokens))
        todo = [i for i, k in enumerate(keys) if (k, g) not in self.objs]
        width = 8 * (g + 1)
        sums = np.zeros((len(todo), width), dtype=np.uint8)
        ticks = np.arange(self.tick + 1, self.tick + 1 + len(todo), dtype=np.uint64)
        for r, i in enumerate(todo):
            sums[r] = np.frombuffer(hashlib.sha256(keys[i] + bytes([g])).digest()[:width], np.uint8)
        oids = self.ix.add_objects(ids[todo], g, server, ticks, np.full(len(todo), 64, np.uint32),
                                   sums, ticks, tier)  # fmt: skip
        for r, i in enumerate(todo):
            self.objs[(keys[i], g)] = {"oid": int(oids[r]), "tick": int(ticks[r]),
                                       "server": server, "offset": int(ticks[r]),
                                       "sums": sums[r].tobytes(), "tier": tier, "pins": 0,
                                       "leaving": False}  # fmt: skip
        self.tick += len(todo)
        self._prune(keys)

    def _objects_of(self, k: bytes) -> list[int]:
        return [g for g in range(GROUPS) if (k, g) in self.objs]

    def _forget(self, k: bytes | None) -> None:
        """Model: block ``k`` removed, and empty ancestors pruned."""
        while k is not None:
            parent = self.blocks.pop(k)[1]
            if parent is None or self._children(parent) or self._objects_of(parent):
                return
            k = parent

    def _remove(self, k: bytes, g: int) -> None:
        rec = self.objs.pop((k, g))
        server, tier, offset, length = self.ix.remove_object(int(rec["oid"]))
        assert (server, tier, offset, length) == (rec["server"], rec["tier"], rec["offset"], 64)
        if rec["pins"]:
            self.detached[int(rec["oid"])] = rec
        if not self._children(k) and not self._objects_of(k):
            self._forget(k)

    def _pick(self, data: st.DataObject) -> tuple[bytes, int]:
        return data.draw(st.sampled_from(sorted(self.objs)))

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        k, g = self._pick(data)
        self.tick += 1
        rec = self.objs[(k, g)]
        rec["tick"] = self.tick
        self.ix.touch(np.array([rec["oid"]], dtype=np.int32), self.tick)

    @rule(tier=st.integers(0, 1))
    def evict_victim(self, tier: int) -> None:
        oid = self.ix.victim(tier)
        if oid < 0:
            return
        ((k, g),) = [kg for kg, r in self.objs.items() if r["oid"] == oid]
        assert self._evictable(k, g) and self.objs[(k, g)]["tier"] == tier
        self._remove(k, g)

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def remove_any(self, data: st.DataObject) -> None:
        """An eviction the meta may ask for (an admin's, a drop): any object of a
        block without children, pinned or not."""
        k, g = self._pick(data)
        if self._children(k):
            return  # the meta evicts leaves only; an inner object stays
        self._remove(k, g)

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        picked = data.draw(st.lists(st.sampled_from(sorted(self.objs)), min_size=1, max_size=4))
        oids = [int(self.objs[kg]["oid"]) for kg in picked]
        self.ix.pin(np.array(oids, dtype=np.int32))
        for kg in picked:
            self.objs[kg]["pins"] = int(self.objs[kg]["pins"]) + 1
        self.leases.append(oids)

    @precondition(lambda self: self.objs)
    @rule(data=st.data(), bad=st.sampled_from([None, -1, 1 << 20]))
    def lease_few(self, data: st.DataObject, bad: int | None) -> None:
        """A small lease in one pass (the C kernel or its Python twin): pinned,
        touched, and read for the reply; a row that is not live refuses it
        whole."""
        picked = data.draw(st.lists(st.sampled_from(sorted(self.objs)), min_size=1, max_size=4))
        oids = [int(self.objs[kg]["oid"]) for kg in picked]
        self.tick += 1
        if bad is not None:
            pins = self.ix.objects.cols["pins"].copy()
            with pytest.raises(CompactIndexError):
                self.ix.few.lease([*oids, bad], self.tick, float(self.tick))
            assert (self.ix.objects.cols["pins"] == pins).all(), "refused: nothing pinned"
            return
        fields = self.ix.few.lease(oids, self.tick, float(self.tick))
        for (k, g), got in zip(picked, fields, strict=True):
            rec = self.objs[(k, g)]
            rec["pins"] = int(rec["pins"]) + 1
            rec["tick"] = self.tick
            want = (rec["server"], rec["offset"], 64, rec["tier"], g, self._depth(k), rec["sums"])
            assert got == want
        self.leases.append(oids)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        oids = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        live = {int(r["oid"]): r for r in self.objs.values()}
        freed = self.ix.unpin(np.array(oids, dtype=np.int32))
        want = []
        for oid in oids:
            rec = live.get(oid) or self.detached[oid]
            rec["pins"] = int(rec["pins"]) - 1
            if oid in self.detached and rec["pins"] == 0:
                del self.detached[oid]
                want.append((rec["server"], rec["tier"], rec["offset"], 64))
        assert sorted(freed) == sorted(want)  # type: ignore[type-var]

    @precondition(lambda self: self.objs)
    @rule(data=st.data(), offset=st.integers(0, 1 << 30))
    def move_tier(self, data: st.DataObject, offset: int) -> None:
        k, g = self._pick(data)
        rec = self.objs[(k, g)]
        tier = 1 - int(rec["tier"])
        oid = self.ix.move_tier(int(rec["oid"]), tier, offset)
        if rec["pins"]:  # the leases keep the old copy (detached); the object moves on
            assert oid != rec["oid"]
            self.detached[int(rec["oid"])] = dict(rec)
            rec["oid"], rec["pins"] = oid, 0
        else:
            assert oid == rec["oid"]
        rec["tier"], rec["offset"], rec["leaving"] = tier, offset, False

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def mark_leaving(self, data: st.DataObject) -> None:
        k, g = self._pick(data)
        rec = self.objs[(k, g)]
        if rec["tier"] != 0:
            with pytest.raises(CompactIndexError):
                self.ix.leaving(int(rec["oid"]), True)
            return
        rec["leaving"] = not rec["leaving"]
        self.ix.leaving(int(rec["oid"]), bool(rec["leaving"]))

    @rule(server=st.integers(0, 2))
    def drop_server(self, server: int) -> None:
        oids = set(self.ix.server_objects(server).tolist())
        assert oids == {r["oid"] for r in self.objs.values() if r["server"] == server}
        # Deepest first, so a block's children go before it.
        order = sorted(
            ((k, g) for (k, g), r in self.objs.items() if r["server"] == server),
            key=lambda kg: -self._depth(kg[0]),
        )
        for k, g in order:
            if self._children(k):
                # Its children still hold objects on other servers: drop the object,
                # keep the block (the meta marks such an object gone the same way).
                rec = self.objs.pop((k, g))
                self.ix.remove_object(int(rec["oid"]))
                if rec["pins"]:
                    self.detached[int(rec["oid"])] = rec
            else:
                self._remove(k, g)

    def _depth(self, k: bytes) -> int:
        d = 0
        p = self.blocks[k][1]
        while p is not None:
            d, p = d + 1, self.blocks[p][1]
        return d

    @invariant()
    def agrees_with_the_model(self) -> None:
        st_ = self.ix.stats()
        assert st_["blocks"] == len(self.blocks)
        assert st_["objects"] == len(self.objs)
        assert st_["detached"] == len(self.detached)
        b = self.ix.blocks.cols
        for k in self.blocks:
            bid = self._bid(k)
            assert bid >= 0
            assert b["children"][bid] == len(self._children(k))
            assert b["hot"][bid] == self._hot(k)
        for rec in self.objs.values():
            assert self.ix.sums(int(rec["oid"])) == rec["sums"]
        total = 0
        for tier in (0, 1):
            cands = [r for (k, g), r in self.objs.items()
                     if r["tier"] == tier and self._evictable(k, g)]  # fmt: skip
            total += len(cands)
            if cands:
                oldest = min(int(r["tick"]) for r in cands)  # (a lease ties its rows)
                assert self.ix.victim(tier) in {r["oid"] for r in cands if r["tick"] == oldest}
            else:
                assert self.ix.victim(tier) == -1
        assert st_["evictable"] == total
        for ns, tokens in self.prompts[-3:]:
            keys = chain(ns, tokens)
            ids = self.ix.find_keys(ns, keys)
            assert (ids == self.ix.find(ns, *split_keys(keys))).all()
            assert [int(i) >= 0 for i in ids] == [k in self.blocks for k in keys]
            for g in range(GROUPS):
                want = 0
                while want < len(keys) and (keys[want], g) in self.objs:
                    want += 1
                assert self.ix.prefix(ns, keys, g) == want
                if not any((k, g) in self.objs for k in keys[want:]):  # no holes: closed
                    assert self.ix.match(ns, keys, g) == want


class CompactModelPython(CompactModel):
    native = False


TestCompactModel = CompactModel.TestCase
TestCompactModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCompactModelPython = CompactModelPython.TestCase
TestCompactModelPython.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_native_kernels_are_built_in_ci() -> None:
    """CI builds the package with its C kernels: the state machine above must run
    them there, not only the Python fallback."""
    if os.environ.get("CI") == "true":
        assert INDEX_KERNELS is not None, "gcache._native._index was not built"


@pytest.mark.skipif(INDEX_KERNELS is None, reason="native kernels not built (CI requires them)")
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("ptr"), st.integers(0, 63), st.integers(0, 1 << 40))))
def test_native_heap_orders_as_the_python_heap(ops: list[tuple[str, int, int]]) -> None:
    """The C sift and the Python sift leave the same heap after the same pushes,
    re-keys and removals (the positions, not only the top)."""
    heaps = []
    for native in (True, False):
        rows = RowTable({"tick": ("<u8", 0), "hseq": ("<u8", 0), "hpos": ("<i4", 0)}, {"hpos": -1})
        rows.take(64)
        heaps.append(TickHeap(rows, native=native))
    for op, row, tick in ops:
        for h in heaps:
            hpos = h.rows.cols["hpos"]
            if op == "p" and hpos[row] < 0:
                h.rows.cols["tick"][row] = tick
                h.push(row)
            elif op == "t" and hpos[row] >= 0:
                h.rows.cols["tick"][row] = tick
                h.rekey(row)
            elif op == "r" and hpos[row] >= 0:
                h.remove(row)
        a, b = heaps
        assert a.size == b.size
        assert (a.heap[: a.size] == b.heap[: b.size]).all()
        assert (a.rows.cols["hpos"][:64] == b.rows.cols["hpos"][:64]).all()


@pytest.mark.skipif(INDEX_KERNELS is None, reason="native kernels not built (CI requires them)")
def test_native_kernels_refuse_out_of_range_input() -> None:
    """A wrong caller gets an error, never a read or write past an array."""
    assert INDEX_KERNELS is not None
    heap = np.array([0, 5], dtype=np.int32)  # row 5 past the 2-row columns
    tick = np.zeros(2, dtype=np.uint64)
    seq = np.zeros(2, dtype=np.uint64)
    hpos = np.zeros(2, dtype=np.int32)
    with pytest.raises(IndexError):
        INDEX_KERNELS.heap_sift(heap, tick, seq, hpos, 2, 1)
    with pytest.raises(IndexError):
        INDEX_KERNELS.heap_sift(heap, tick, seq, hpos, 3, 0)  # size past the heap
    ix = CompactIndex(groups=1)
    with pytest.raises(CompactIndexError):
        ix.match(0, [b"short"], 0)
    with pytest.raises(CompactIndexError):
        ix.keys.find1(0, b"short")
    with pytest.raises(CompactIndexError):
        ix.find_keys(0, [bytes(16), b"short"])
    # the small-lease kernels: rows checked before anything is written
    ix.namespace(0, None)
    bids = ix.add_chain(0, [key(0, (1,))])
    (oid,) = ix.add_objects(bids, 0, 0, np.zeros(1, np.uint64), np.full(1, 64, np.uint32),
                            np.zeros((1, 8), np.uint8), np.ones(1, np.uint64)).tolist()  # fmt: skip
    o, b = ix.objects.cols, ix.blocks.cols
    h0, h1 = ix.leaves.heaps
    args = (o["pins"], o["block"], o["tick"], o["atime"], o["hpos"], o["hseq"], o["tier"],
            o["server"], o["offset"], o["length"], o["group"], o["sums_len"], o["sums_slot"],
            b["pos"], {8: ix.sums_slabs.slabs[8].cols["s"]})  # fmt: skip
    with pytest.raises(IndexError):
        INDEX_KERNELS.lease_rows([oid], 2, 2.0, *args, h0.heap, h0.heap.size + 1, 0,
                                 h1.heap, 0, 0)  # fmt: skip
    with pytest.raises(ValueError, match="at most"):
        INDEX_KERNELS.lease_rows([oid] * 65, 2, 2.0, *args, h0.heap, h0.size, 0, h1.heap, 0, 0)
    with pytest.raises(TypeError):
        INDEX_KERNELS.lease_rows((oid,), 2, 2.0, *args, h0.heap, h0.size, 0, h1.heap, 0, 0)
    with pytest.raises(ValueError, match="no checksum slab"):
        INDEX_KERNELS.lease_rows([oid], 2, 2.0, *args[:-1], {}, h0.heap, h0.size, 0,
                                 h1.heap, 0, 0)  # fmt: skip
    assert o["pins"][oid] == 0
    with pytest.raises(ValueError, match="no lease holds"):
        INDEX_KERNELS.unpin_rows(
            [oid], o["pins"], o["block"], o["hpos"], o["group"], o["tier"], b["ns"], b["hot"],
            b["children"], ix.leaves.full,
        )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=50))
def test_float_ticks_keep_the_order_of_float_keys(xs: list[float]) -> None:
    """The cost policy's float keys (``last_access + tau * score``) as heap ticks:
    the order of the floats, equal floats equal ticks."""
    t = float_ticks(xs)
    for i in range(len(xs)):
        for j in range(len(xs)):
            assert (xs[i] < xs[j]) == (t[i] < t[j])
            assert (xs[i] == xs[j]) == (t[i] == t[j])
    with pytest.raises(ValueError):
        float_ticks([1.0, float("nan")])


def test_a_float_keyed_heap_picks_the_least_key_after_a_rekey() -> None:
    """Keys from a cost-like policy: each object's tick is its float key; after
    every key moves (``tau`` changed), ``rekey_all`` re-sorts and the victim is the
    new least key."""
    ix = CompactIndex(groups=1)
    ix.namespace(0, None)  # windowed only: every object evictable
    bids = np.concatenate([ix.add_chain(0, [key(0, (i,))]) for i in range(200)])
    rng = np.random.default_rng(3)
    last, score = rng.uniform(0, 100, 200), rng.normal(0, 3, 200)
    n = bids.size
    oids = ix.add_objects(bids, 0, 0, np.arange(n, dtype=np.uint64), np.full(n, 64, np.uint32),
                          np.zeros((n, 8), np.uint8), float_ticks(last + 1.0 * score))  # fmt: skip
    assert ix.victim() == oids[np.argmin(last + 1.0 * score)]
    ix.objects.cols["tick"][oids] = float_ticks(last + 25.0 * score)
    ix.leaves.rekey_all()
    assert ix.victim() == oids[np.argmin(last + 25.0 * score)]


def test_a_chunk_naming_a_key_twice_is_refused_whole() -> None:
    ix = CompactIndex(groups=1)
    ix.namespace(0, 0)
    ix.add_chain(0, chain(0, [1, 2]))
    before = ix.stats()
    ks = [key(0, (9,)), key(0, (8,)), key(0, (9,))]
    k0, k1 = split_keys(ks)
    zero = np.zeros(3, np.uint64)
    with pytest.raises(CompactIndexError, match="twice"):
        ix.add_blocks(0, k0, k1, zero, zero, np.zeros(3, np.int32))
    assert ix.stats() == before
    # Keys equal in their first 8 bytes only are two keys.
    a, b = bytes(8) + b"\x01" * 8, bytes(8) + b"\x02" * 8
    k0, k1 = split_keys([a, b])
    assert (ix.add_blocks(0, k0, k1, zero[:2], zero[:2], np.zeros(2, np.int32)) >= 0).all()


def test_pins_are_lazy_a_pinned_top_is_skipped_and_returns_at_its_last_unpin() -> None:
    """A lease pins by counting only: the pinned object stays in its heap until it
    reaches the top, where ``victim`` takes it out; its last unpin puts it back,
    in the order of its tick."""
    ix = CompactIndex(groups=1)
    ix.namespace(0, None)  # windowed only: every object evictable
    bids = np.concatenate([ix.add_chain(0, [key(0, (i,))]) for i in range(5)])
    n = bids.size
    oids = ix.add_objects(bids, 0, 0, np.arange(n, dtype=np.uint64), np.full(n, 64, np.uint32),
                          np.zeros((n, 8), np.uint8), np.arange(n, dtype=np.uint64))  # fmt: skip
    first, second = int(oids[0]), int(oids[1])
    ix.pin(np.array([first, first], dtype=np.int32))  # two leases
    heap = ix.leaves.heaps[0]
    assert heap.size == n, "a pin costs no heap operation"
    assert ix.stats()["evictable"] == n - 1
    assert ix.victim() == second, "the pinned top is skipped"
    assert heap.size == n - 1 and ix.objects.cols["hpos"][first] == -1
    ix.unpin(np.array([first], dtype=np.int32))
    assert ix.objects.cols["hpos"][first] == -1, "still pinned by the other lease"
    ix.few.unpin([first])
    assert ix.victim() == first, "back, ranked by its tick"
    with pytest.raises(CompactIndexError):
        ix.few.unpin([first])  # no lease holds it now: refused, nothing changed
    assert ix.objects.cols["pins"][first] == 0


def test_reserve_grows_each_table_once_and_is_bounded() -> None:
    """A rebuild told how many objects are coming makes room once (no copy per
    doubling); a claim past RESERVE_MAX is cut to it; rows past those in use are
    never written (RSS follows the rows)."""
    from gcache.meta.compact import RESERVE_MAX

    ix = CompactIndex(groups=1)
    ix.namespace(0, None)
    ix.reserve(5000)
    caps = ix.objects.cap, ix.blocks.cap
    assert caps[0] >= 5000 and caps[1] >= 5000
    bids = np.concatenate([ix.add_chain(0, [key(0, (i,))]) for i in range(4000)])
    n = bids.size
    ix.add_objects(bids, 0, 0, np.arange(n, dtype=np.uint64), np.full(n, 64, np.uint32),
                   np.zeros((n, 8), np.uint8), np.arange(n, dtype=np.uint64))  # fmt: skip
    assert (ix.objects.cap, ix.blocks.cap) == caps, "no growth within the reservation"
    assert ix.sums_slabs.slabs[8].cap >= 5000, "a slab made after the reserve has room too"
    ix.reserve(1 << 62)  # a server's absurd claim: cut to RESERVE_MAX (address space only)
    assert ix.objects.cap <= max(caps[0], RESERVE_MAX)
    ix.widen(3)  # a wider namespace later: existing rows keep their objects, new are -1
    assert ix.blocks.cols["obj"].shape[1] == 3
    assert (ix.blocks.cols["obj"][bids, 0] >= 0).all() and (
        ix.blocks.cols["obj"][bids, 1:] == -1
    ).all()
    (more,) = ix.add_chain(0, [key(0, (99_999,))])
    assert (ix.blocks.cols["obj"][more] == -1).all()


@pytest.mark.parametrize("native", [True, False])
def test_leading_keys_stop_at_the_first_missing_block_or_full_object(native: bool) -> None:
    """``KeyMap.leading`` (a small lookup's match: the ``key_prefix`` kernel, or its
    Python twin): the block ids of the leading indexed keys, cut at the first block
    without an object of the full group when one is named."""
    ix = CompactIndex(groups=2, native=native)
    ix.namespace(3, 0)
    keys = chain(3, [1, 2, 3, 4, 5])
    bids = ix.add_chain(3, keys[:4]).tolist()
    for bid in bids[:2]:
        ix.add_object(bid, 0, 0, 64 * bid, 64, bytes(8), tick=bid)
    ix.add_object(bids[3], 0, 0, 640, 64, bytes(8), tick=9)  # past a hole
    assert ix.keys.leading(3, keys, -1) == bids  # key 5 is not indexed
    assert ix.keys.leading(3, keys, 0) == bids[:2]  # block 3 has no full object
    assert ix.keys.leading(3, keys, 1) == []
    assert ix.keys.leading(4, keys, -1) == []  # another namespace
    assert ix.keys.leading(3, [], 0) == []
    with pytest.raises(CompactIndexError):
        ix.keys.leading(3, [keys[0], b"short"], -1)


@pytest.mark.skipif(INDEX_KERNELS is None, reason="native kernels not built (CI requires them)")
def test_the_key_prefix_kernel_refuses_out_of_range_input() -> None:
    assert INDEX_KERNELS is not None
    ix = CompactIndex(groups=2)
    ix.namespace(0, 0)
    keys = chain(0, [1, 2])
    bids = ix.add_chain(0, keys).tolist()
    ix.add_object(bids[0], 0, 0, 0, 64, bytes(8), tick=1)
    b = ix.blocks.cols
    args = (ix.keys.table, b["k0"], b["k1"], b["ns"])
    with pytest.raises(IndexError):  # an obj column shorter than the blocks
        INDEX_KERNELS.key_prefix(*args, b["obj"][:1], 2, 0, keys, 0)
    with pytest.raises(ValueError, match="group"):
        INDEX_KERNELS.key_prefix(*args, b["obj"], 2, 0, keys, 2)
    with pytest.raises(TypeError):
        INDEX_KERNELS.key_prefix(*args, b["obj"], 2, 0, tuple(keys), 0)
    assert INDEX_KERNELS.key_prefix(*args, b["obj"], 2, 0, keys, -1) == ix.find_keys(
        0, keys
    ).tolist()
