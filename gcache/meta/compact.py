"""A compact index: blocks, objects and the LRU eviction order in columnar arrays
sized for 100M blocks, instead of one Python object per block and per object.

Not wired into :class:`~gcache.meta.core.MetaCore` yet (see docs/performance.md,
"The compact index"): this module is the data structure and its invariants, tested
against a model (tests/unit/test_compact_index.py, a hypothesis state machine) and
measured by ``python -m bench.compact_index``.

Layout (ids are ``int32`` row numbers, reused through free stacks):

* **blocks**: the 16-byte key as two ``uint64`` (``k0``, ``k1``), namespace id
  (``uint16``: namespaces interned by the caller), parent block (-1: a root),
  position, children count, and one object id per layout group (``obj[b, g]``,
  -1: none).
* **the key map**: an open-addressing table of block ids (linear probing, the
  key's first 8 bytes mixed with the namespace as the hash: block keys are chained
  hashes already), probed for a whole prompt at once with numpy; deletions leave
  tombstones, rehashed away when they pass a quarter of the table.
* **objects**: block, group, tier, server (``uint16``), offset, length, access
  tick (``uint64``, a counter: no ties), and the per-layer checksums in a slab per
  checksum length (``sums[L][slot]``).
* **eviction order**: an indexed binary min-heap of the *evictable* objects (those
  whose block has no children) keyed by access tick: ``victim()`` is the least
  recently used leaf, as the meta's LRU policy picks it; a block becomes a leaf
  when its last child goes (its objects enter the heap), and stops being one when
  a child is added (they leave it).

A lookup of the prefix-closed full group is a binary search of scalar probes
(``match``, as the meta's ``present_prefix``); a report chunk is loaded as columns
(``add_blocks`` + ``add_objects`` between ``begin_bulk`` and ``end_bulk``, the heap
built once by a sort). Namespace ids are 0..65534 (65535 marks a removed block).
No I/O, no clock (ticks are the caller's), nothing per block outside the arrays.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gcache.errors import CompactIndexError
from gcache.meta.keymap import KeyMap, split_keys
from gcache.meta.rowtable import RowTable
from gcache.meta.tickheap import TickHeap

I32 = npt.NDArray[np.int32]
U64 = npt.NDArray[np.uint64]


def _check_ns(ns: int) -> None:
    if not 0 <= ns < 0xFFFF:
        raise CompactIndexError(f"namespace id must be in 0..65534, got {ns}")


class CompactIndex:
    """Blocks and objects of many namespaces in columns; see the module docstring."""

    def __init__(self, groups: int = 4) -> None:
        if not 1 <= groups <= 255:
            raise CompactIndexError(f"groups must be in 1..255, got {groups}")
        self.groups = groups
        self.blocks = RowTable(
            {
                "k0": ("<u8", 0),
                "k1": ("<u8", 0),
                "ns": ("<u2", 0),
                "parent": ("<i4", 0),
                "pos": ("<u4", 0),
                "children": ("<i4", 0),
                "obj": ("<i4", groups),
            },
            {"children": 0, "obj": -1},
        )
        self.objects = RowTable(
            {
                "block": ("<i4", 0),
                "group": ("u1", 0),
                "tier": ("u1", 0),
                "server": ("<u2", 0),
                "offset": ("<u8", 0),
                "length": ("<u4", 0),
                "tick": ("<u8", 0),
                "sums_len": ("<u2", 0),
                "sums_slot": ("<i4", 0),
                "hpos": ("<i4", 0),
            },
            {"hpos": -1},
        )
        self._sums: dict[int, RowTable] = {}  # checksum slabs by checksum length
        self.keys = KeyMap(self.blocks)
        self.live_blocks = 0
        self.live_objects = 0
        self.heap = TickHeap(self.objects)
        self.bulk = False  # see begin_bulk

    # -- blocks --------------------------------------------------------------------

    def begin_bulk(self) -> None:
        """Bulk loading (a rebuild from the servers' reports): the eviction heap is
        not kept while blocks and objects arrive, and is built once, by one sort,
        in :meth:`end_bulk` (``victim`` answers -1 meanwhile)."""
        self.bulk = True
        hpos = self.objects.cols["hpos"]
        hpos[self.heap.heap[: self.heap.size]] = -1
        self.heap.size = 0

    def end_bulk(self) -> None:
        """The eviction heap of every object whose block has no children."""
        self.bulk = False
        rows = self.objects.rows
        o = self.objects.cols
        live = np.flatnonzero(o["block"][:rows] >= 0).astype(np.int32)
        leaves = live[self.blocks.cols["children"][o["block"][live]] == 0]
        self.heap.size = 0
        self.heap.push_many(leaves, sort=True)

    def add_blocks(self, ns: int, k0: U64, k1: U64, pk0: U64, pk1: U64, pos: I32) -> I32:
        """Blocks of a report chunk, each with its parent's key (``pk0 == pk1 ==
        0``: a root), in any order within the chunk; parents are found in the index
        or in the chunk. Returns their ids; -1 for a row whose parent is in
        neither (an orphan, with its descendants in the chunk: not added; the
        caller parks them). Keys already indexed keep their block."""
        _check_ns(ns)
        n = len(k0)
        ids = self.keys.find(ns, k0, k1)
        missing = np.flatnonzero(ids < 0)
        pairs = np.stack([k0[missing], k1[missing]], axis=1)
        if missing.size and np.unique(pairs, axis=0).shape[0] != missing.size:
            raise CompactIndexError("a block key twice in one chunk")
        b = self.blocks.cols
        new = np.empty(0, dtype=np.int32)
        if missing.size:
            self.keys.fit(self.live_blocks + missing.size)
            new = self.blocks.take(missing.size)
            b = self.blocks.cols
            ids[missing] = new
            b["k0"][new], b["k1"][new], b["ns"][new] = k0[missing], k1[missing], ns
            b["pos"][new] = pos[missing]
            self.keys.place(new)
            self.live_blocks += missing.size
        is_new = np.zeros(n, dtype=bool)
        is_new[missing] = True
        rooted = (pk0 == 0) & (pk1 == 0)
        pid = np.full(n, -1, dtype=np.int32)
        has = np.flatnonzero(~rooted & is_new)
        pid[has] = self.keys.find(ns, pk0[has], pk1[has])
        orphan = is_new & ~rooted & (pid < 0)
        while orphan.any():  # an orphan's children in the chunk are orphans too
            more = is_new & ~orphan & np.isin(pid, ids[orphan])
            if not more.any():
                break
            orphan |= more
        for r in np.flatnonzero(orphan):
            self._unindex(int(ids[r]))
            ids[r] = -1
        take = np.flatnonzero(is_new & ~orphan)
        b["parent"][ids[take]] = pid[take]
        parents = pid[take][pid[take] >= 0]
        if parents.size:
            if not self.bulk:
                hpos = self.objects.cols["hpos"]
                leafs = np.unique(parents[b["children"][parents] == 0])
                for o in b["obj"][leafs].ravel():
                    if o >= 0 and hpos[o] >= 0:
                        self.heap.remove(int(o))
            np.add.at(b["children"], parents, 1)
        return ids

    def _unindex(self, bid: int) -> None:
        """Take a block's key and row back (its parent's books are the caller's)."""
        self.keys.remove(bid)
        self.live_blocks -= 1
        self.blocks.cols["ns"][bid] = 0xFFFF  # never matches a lookup again
        self.blocks.give1(bid)

    def add_chain(self, ns: int, keys: list[bytes]) -> I32:
        """The blocks of one prompt (the first a root, each the parent of the next),
        created where missing (:meth:`add_blocks`); returns their ids."""
        k0, k1 = split_keys(keys)
        pk0, pk1 = np.zeros_like(k0), np.zeros_like(k1)
        pk0[1:], pk1[1:] = k0[:-1], k1[:-1]
        return self.add_blocks(ns, k0, k1, pk0, pk1, np.arange(len(keys), dtype=np.int32))

    def remove_block(self, bid: int) -> None:
        """Remove a block with no objects and no children. Its parent may become a
        leaf (the parent's objects enter the eviction order), or, holding no
        object either, is removed too (and so on up: empty ancestors are pruned)."""
        b = self.blocks.cols
        self._check_block(bid)
        if b["children"][bid] or (b["obj"][bid] >= 0).any():
            raise CompactIndexError(f"block {bid} has children or objects")
        while bid >= 0:
            parent = int(b["parent"][bid])
            self._unindex(bid)
            bid = -1
            if parent >= 0:
                b["children"][parent] -= 1
                if b["children"][parent] == 0:
                    objs = b["obj"][parent]
                    live = objs[objs >= 0]
                    for o in live if not self.bulk else ():
                        self.heap.push(int(o))
                    if not live.size:
                        bid = parent  # nothing left in it: pruned
        self.keys.fit(self.live_blocks)

    def _check_block(self, bid: int) -> None:
        if not 0 <= bid < self.blocks.rows or self.blocks.cols["ns"][bid] == 0xFFFF:
            raise CompactIndexError(f"no block {bid}")

    def find(self, ns: int, k0: U64, k1: U64) -> I32:
        """Block ids of keys given as columns (-1: not indexed); see ``KeyMap``."""
        return self.keys.find(ns, k0, k1)

    def match(self, ns: int, keys: list[bytes], group: int) -> int:
        """How many leading keys have an object of ``group``, for a group whose
        objects are prefix-closed (the full-attention group: only leaves are
        evicted): a binary search of :meth:`find1` probes, as the meta's
        ``present_prefix``. :meth:`prefix` is the general (vectorised) form."""
        obj = self.blocks.cols["obj"]

        def has(i: int) -> bool:
            bid = self.keys.find1(ns, keys[i])
            return bid >= 0 and int(obj[bid, group]) >= 0

        lo, hi = 0, len(keys)
        if hi and has(hi - 1):
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if has(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def prefix(self, ns: int, keys: list[bytes], group: int) -> int:
        """How many leading keys have an object of ``group`` (a lookup's match)."""
        k0, k1 = split_keys(keys)
        ids = self.keys.find(ns, k0, k1)
        have = ids >= 0
        objs = np.where(have, self.blocks.cols["obj"][np.where(have, ids, 0), group], -1)
        gaps = np.flatnonzero(objs < 0)
        return int(gaps[0]) if gaps.size else len(keys)

    # -- objects -------------------------------------------------------------------

    def add_object(
        self,
        bid: int,
        group: int,
        server: int,
        offset: int,
        length: int,
        sums: bytes,
        tick: int,
        tier: int = 0,
    ) -> int:
        """Record the object of ``group`` of block ``bid``; returns its id."""
        width = len(sums)
        (oid,) = self.add_objects(
            np.array([bid], dtype=np.int32), group, server,
            np.array([offset], dtype=np.uint64), np.array([length], dtype=np.uint32),
            np.frombuffer(sums, dtype=np.uint8).reshape(1, width), np.array([tick], np.uint64),
            tier,
        )  # fmt: skip
        return int(oid)

    def add_objects(
        self,
        bids: I32,
        group: int,
        server: int,
        offsets: U64,
        lengths: npt.NDArray[np.uint32],
        sums: npt.NDArray[np.uint8],
        ticks: U64,
        tier: int = 0,
    ) -> I32:
        """:meth:`add_object` for many blocks at once (a put's prompt, a server's
        report): ``sums`` is one row of checksum bytes per object. A large batch of
        leaves rebuilds the eviction heap by one sort instead of one push each."""
        n = len(bids)
        b = self.blocks.cols
        if n == 0:
            return np.empty(0, dtype=np.int32)
        ok = (bids >= 0) & (bids < self.blocks.rows)
        if not ok.all() or (b["ns"][bids] == 0xFFFF).any():
            raise CompactIndexError("unknown block ids")
        if not 0 <= group < self.groups or (b["obj"][bids, group] >= 0).any():
            raise CompactIndexError(f"group {group}: no such group, or an object is there")
        if np.unique(bids).size != n:
            raise CompactIndexError("a block named twice")
        oids = self.objects.take(n)
        o = self.objects.cols
        o["block"][oids], o["group"][oids], o["tier"][oids] = bids, group, tier
        o["server"][oids], o["offset"][oids], o["length"][oids] = server, offsets, lengths
        o["tick"][oids] = ticks
        width = sums.shape[1] if sums.ndim == 2 else 0
        o["sums_len"][oids] = width
        if width:
            slab = self._sums.get(width)
            if slab is None:
                slab = self._sums[width] = RowTable({"s": ("u1", width)}, {})
            slots = slab.take(n)
            slab.cols["s"][slots] = sums
            o["sums_slot"][oids] = slots
        else:
            o["sums_slot"][oids] = -1
        b["obj"][bids, group] = oids
        self.live_objects += n
        if not self.bulk:
            self.heap.push_many(oids[b["children"][bids] == 0])
        return oids

    def remove_object(self, oid: int) -> tuple[int, int, int, int]:
        """Remove an object; returns (server, tier, offset, length) to free. Its
        block is removed too when it holds nothing else and has no children."""
        o = self.objects.cols
        if not 0 <= oid < self.objects.rows or o["block"][oid] < 0:
            raise CompactIndexError(f"no object {oid}")
        if o["hpos"][oid] >= 0:
            self.heap.remove(int(oid))
        bid, group = int(o["block"][oid]), int(o["group"][oid])
        b = self.blocks.cols
        b["obj"][bid, group] = -1
        out = (int(o["server"][oid]), int(o["tier"][oid]), int(o["offset"][oid]),
               int(o["length"][oid]))  # fmt: skip
        self._sums_free(int(o["sums_len"][oid]), int(o["sums_slot"][oid]))
        o["block"][oid] = -1
        self.objects.give1(oid)
        self.live_objects -= 1
        if b["children"][bid] == 0 and not (b["obj"][bid] >= 0).any():
            self.remove_block(bid)
        return out

    def sums(self, oid: int) -> bytes:
        o = self.objects.cols
        n = int(o["sums_len"][oid])
        return self._sums[n].cols["s"][o["sums_slot"][oid]].tobytes() if n else b""

    def touch(self, oids: I32, tick: int) -> None:
        """Mark objects used at ``tick`` (a lookup's hits): later victims."""
        o = self.objects.cols
        o["tick"][oids] = tick
        hpos = o["hpos"]
        for oid in oids[hpos[oids] >= 0]:
            self.heap.rekey(int(oid))

    def victim(self) -> int:
        """The least recently used object whose block has no children (-1: none)."""
        return self.heap.top()

    def server_objects(self, server: int) -> I32:
        """Ids of the live objects on ``server`` (one vectorised scan)."""
        o = self.objects.cols
        rows = self.objects.rows
        return np.flatnonzero((o["server"][:rows] == server) & (o["block"][:rows] >= 0)).astype(
            np.int32
        )

    # -- checksum slabs ------------------------------------------------------------

    def _sums_free(self, n: int, slot: int) -> None:
        if n:
            self._sums[n].give1(slot)

    # -- accounting ----------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes the index's arrays hold for the rows in use."""
        sums = sum(slab.nbytes() for slab in self._sums.values())
        return (
            self.blocks.nbytes()
            + self.objects.nbytes()
            + sums
            + self.keys.nbytes()
            + self.heap.nbytes()
        )

    def stats(self) -> dict[str, int]:
        return {
            "blocks": self.live_blocks,
            "objects": self.live_objects,
            "evictable": self.heap.size,
            "table_slots": int(self.keys.table.size),
            "tombstones": self.keys.tombs,
            "bytes": self.nbytes(),
        }
