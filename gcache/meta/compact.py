# One file (over 450 lines): every mutation of blocks or objects updates the same
# books together (children, hot, heap membership, pins).
"""A compact index: blocks, objects and the LRU eviction order in columnar arrays
sized for 100M blocks, instead of one Python object per block and per object.

Not wired into :class:`~gcache.meta.core.MetaCore` yet (docs/performance.md, "The
compact index"): tested against a model (tests/unit/test_compact_index.py, hypothesis
state machines) and measured by ``python -m bench.compact_index``.

Layout (ids are ``int32`` row numbers, reused through free stacks):

* **blocks**: the 16-byte key as two ``uint64`` (``k0``, ``k1``), namespace id
  (``uint16``: namespaces interned by the caller), parent block (-1: a root),
  position, children count, and one object id per layout group (``obj[b, g]``,
  -1: none).
* **the key map** (:class:`~gcache.meta.keymap.KeyMap`): an open-addressing table
  of block ids, probed for a whole prompt at once; it answers lookups.
* **objects**: block, group, tier, server (``uint16``), offset, length, access
  tick (``uint64``, a counter: no ties), and the per-layer checksums in a slab per
  checksum length (``sums[L][slot]``).
* **eviction order** (:class:`~gcache.meta.leaves.Leaves`): per tier, an indexed
  binary min-heap of the *evictable* objects keyed by access tick (and, pins
  being lazy, perhaps pinned ones, skipped at the top), with the
  meta's rules: unpinned, and windowed, or the full object of a block with no
  child in its tier (``hot``: children whose full object is in DRAM; for NVMe any
  child). ``victim(tier)`` is the least recently used of them, as the meta's LRU
  policy picks it.
* **what the meta keeps per object** besides: lease pins, the promotion hits
  (``LEAVING_DRAM`` marks a full DRAM object being demoted: its parent no longer
  counts it as hot), the owning tenant (an id the caller interns) and the cost
  policy's score. An object evicted while pinned is *detached*: out of its block
  and the heaps, its row (and range) held until its last pin goes (``unpin``).

A report chunk is loaded as columns (``add_blocks`` + ``add_objects`` between
``begin_bulk`` and ``end_bulk``, the heaps built once by a sort). Namespace ids
are 0..65534 (65535 marks a removed block).
No I/O, no clock (ticks are the caller's), nothing per block outside the arrays.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from gcache._native import INDEX_KERNELS
from gcache.errors import CompactIndexError
from gcache.meta.fewrows import SMALL, FewRows, Freed
from gcache.meta.keymap import KeyMap, split_keys
from gcache.meta.leaves import NO_FULL, Leaves
from gcache.meta.rowtable import RowTable, Slabs, unique_ids

I32 = npt.NDArray[np.int32]
U64 = npt.NDArray[np.uint64]

RESERVE_MAX: Final = 1 << 27  # objects a reserve makes room for, at most
DETACHED: Final = -2  # an object's block once evicted while pinned (-1: a free row)

LEAVING_DRAM: Final = -2  # ``hits`` of a full DRAM object being demoted


def _check_ns(ns: int) -> None:
    if not 0 <= ns < 0xFFFF:
        raise CompactIndexError(f"namespace id must be in 0..65534, got {ns}")


class CompactIndex:
    """Blocks and objects of many namespaces in columns; see the module docstring."""

    def __init__(self, groups: int = 4, native: bool = True) -> None:
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
                "hot": ("<i4", 0),
                "obj": ("<i4", groups),
                "gen": ("<u4", 0),
            },
            {"children": 0, "hot": 0, "obj": -1},
            {"gen": 0},
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
                "hseq": ("<u8", 0),
                "sums_len": ("<u2", 0),
                "sums_slot": ("<i4", 0),
                "hpos": ("<i4", 0),
                "pins": ("<i4", 0),
                "hits": ("<i2", 0),
                "owner": ("<u2", 0),
                "score": ("<f4", 0),
                "atime": ("<f8", 0),
                "gen": ("<u4", 0),
            },
            {"hpos": -1, "pins": 0, "hits": 0, "score": 0},
            {"gen": 0},
        )
        self.sums_slabs = Slabs()  # each object's checksums, a slab per length
        self.keys = KeyMap(self.blocks, native)
        self.kernels = INDEX_KERNELS if native else None
        self.few = FewRows(self)  # a small lease's steps
        self.live_blocks = 0
        self.live_objects = 0
        self.leaves = Leaves(self.blocks, self.objects, native)
        self.detached = 0  # objects evicted while pinned, rows held
        # Blocks whose ``children`` or ``hot`` count fell to 0 (their full object
        # may now be a leaf of its tier), for a caller that wants to hear of them
        # (the cost policy re-scores such a block); None: not kept.
        self.leaf_events: list[int] | None = None

    def widen(self, groups: int) -> None:
        """Room for ``groups`` objects per block (a namespace with more groups
        than any before)."""
        if groups > 255:
            raise CompactIndexError(f"groups must be at most 255, got {groups}")
        if groups > self.groups:
            self.blocks.widen("obj", groups, -1)
            self.groups = groups

    def namespace(self, ns: int, full_group: int | None) -> None:
        """Declare namespace ``ns``'s prefix-closed (full-attention) group (None:
        every group windowed), before its first object."""
        _check_ns(ns)
        if full_group is not None and not 0 <= full_group < self.groups:
            raise CompactIndexError(f"full group {full_group} of {self.groups}")
        self.leaves.full[ns] = NO_FULL if full_group is None else full_group

    @property
    def bulk(self) -> bool:
        return self.leaves.bulk

    # -- blocks --------------------------------------------------------------------

    def reserve(self, objects: int) -> None:
        """Room for ``objects`` objects in all (and as many blocks) in one growth
        of each table: a rebuild told how many objects its servers will report.
        At most ``RESERVE_MAX``; address space only (the key map, whose slots are
        all written, still grows with the keys)."""
        n = min(max(objects, 0), RESERVE_MAX)
        if not n:
            return
        self.objects.reserve(n)
        self.blocks.reserve(n)
        self.sums_slabs.reserve(n)

    def begin_bulk(self) -> None:
        """Bulk loading (a rebuild from the servers' reports): the eviction heap is
        not kept while blocks and objects arrive, and is built once, by one sort,
        in :meth:`end_bulk` (or by the first :meth:`victim`, which ends it)."""
        self.leaves.begin_bulk()

    def end_bulk(self) -> None:
        """The eviction heaps of every evictable object, by one sort each."""
        self.leaves.rebuild()

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
        if missing.size > 1:  # a key twice in the chunk: adjacent once sorted by key
            m0, m1 = k0[missing], k1[missing]
            order = np.lexsort((m1, m0))
            s0, s1 = m0[order], m1[order]
            if ((s0[1:] == s0[:-1]) & (s1[1:] == s1[:-1])).any():
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
            np.add.at(b["children"], parents, 1)  # an NVMe full object: no more a leaf
            self.leaves.refresh(b["obj"][unique_ids(parents)].ravel())
        return ids

    def add_block1(self, ns: int, key: bytes, parent: int, pos: int) -> int:
        """One new block (its key not indexed) under block ``parent`` (-1: a
        root); returns its id. Scalar work only (adoption record by record)."""
        if len(key) != 16:
            raise CompactIndexError(f"block keys are 16 bytes, got {len(key)}")
        bt = self.blocks
        if parent >= 0:
            self._check_block(parent)
            if bt.mv("ns")[parent] != ns:
                raise CompactIndexError(f"parent {parent} is in another namespace")
        self.keys.fit(self.live_blocks + 1)
        bid = bt.take1()
        k0, k1, bns, bpar, bpos, kids = bt.views("k0", "k1", "ns", "parent", "pos", "children")
        k0[bid] = int.from_bytes(key[:8], "little")
        k1[bid] = int.from_bytes(key[8:], "little")
        bns[bid], bpar[bid], bpos[bid] = ns, parent, pos
        self.keys.place1(bid)
        self.live_blocks += 1
        if parent >= 0:
            kids[parent] += 1
            if kids[parent] == 1:  # an NVMe full object: no more a leaf
                full = self.leaves.full_of(parent)
                if full != NO_FULL:
                    self.leaves.refresh1(bt.mv("obj")[parent * self.groups + full])
        return bid

    def _unindex(self, bid: int) -> None:
        """Take a block's key and row back (its parent's books are the caller's)."""
        self.keys.remove(bid)
        self.live_blocks -= 1
        b = self.blocks.cols
        b["ns"][bid] = 0xFFFF  # never matches a lookup again
        b["gen"][bid] += 1  # handles to the old block see it gone
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
                    if self.leaf_events is not None:
                        self.leaf_events.append(parent)
                    objs = b["obj"][parent]
                    live = objs[objs >= 0]
                    self.leaves.refresh(live)
                    if not live.size:
                        bid = parent  # nothing left in it: pruned
        self.keys.fit(self.live_blocks)

    def _check_block(self, bid: int) -> None:
        if not 0 <= bid < self.blocks.rows or self.blocks.cols["ns"][bid] == 0xFFFF:
            raise CompactIndexError(f"no block {bid}")

    def find(self, ns: int, k0: U64, k1: U64) -> I32:
        """Block ids of keys given as columns (-1: not indexed); see ``KeyMap``."""
        return self.keys.find(ns, k0, k1)

    def find_keys(self, ns: int, keys: list[bytes]) -> I32:
        """Block ids of a list of keys (-1: not indexed; ``KeyMap.find_keys``)."""
        return self.keys.find_keys(ns, keys)

    def match(self, ns: int, keys: list[bytes], group: int) -> int:
        """How many leading keys have an object of ``group``, a prefix-closed
        group (binary search; ``KeyMap.match``)."""
        return self.keys.match(ns, keys, group)

    def prefix(self, ns: int, keys: list[bytes], group: int) -> int:
        """How many leading keys have an object of ``group`` (vectorised)."""
        return self.keys.prefix(ns, keys, group)

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
        owner: int = 0,
        refresh: bool = True,
    ) -> int:
        """Record the object of ``group`` of block ``bid``; returns its id
        (:meth:`add_objects` of one, without arrays)."""
        bt = self.blocks
        bns, bpar, bhot = bt.views("ns", "parent", "hot")
        if not 0 <= bid < bt.rows or bns[bid] == 0xFFFF:
            raise CompactIndexError("unknown block ids")
        bobj = bt.mv("obj")
        at = bid * self.groups + group
        if not 0 <= group < self.groups or bobj[at] >= 0:
            raise CompactIndexError(f"group {group}: no such group, or an object is there")
        if tier not in (0, 1):
            raise CompactIndexError(f"tier {tier}: 0 (DRAM) or 1 (NVMe)")
        oid = self.objects.take1()
        o = self.objects.views(
            "block", "group", "tier", "server", "offset", "length", "tick", "owner",
            "sums_len", "sums_slot",
        )  # fmt: skip
        o[0][oid], o[1][oid], o[2][oid], o[3][oid] = bid, group, tier, server
        o[4][oid], o[5][oid], o[6][oid], o[7][oid] = offset, length, tick, owner
        o[8][oid], o[9][oid] = len(sums), self.sums_slabs.put1(sums)
        bobj[at] = oid
        self.live_objects += 1
        full = int(self.leaves.full[bns[bid]])
        parent = bpar[bid]
        if tier == 0 and full == group and parent >= 0:  # a DRAM full object: hot
            bhot[parent] += 1
        if refresh:
            self.leaves.refresh1(oid)
            if parent >= 0 and full != NO_FULL:
                self.leaves.refresh1(bobj[parent * self.groups + full])
        return oid

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
        owner: int = 0,
        refresh: bool = True,
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
        if tier not in (0, 1):
            raise CompactIndexError(f"tier {tier}: 0 (DRAM) or 1 (NVMe)")
        if unique_ids(bids).size != n:
            raise CompactIndexError("a block named twice")
        oids = self.objects.take(n)
        o = self.objects.cols
        o["block"][oids], o["group"][oids], o["tier"][oids] = bids, group, tier
        o["server"][oids], o["offset"][oids], o["length"][oids] = server, offsets, lengths
        o["tick"][oids], o["owner"][oids] = ticks, owner
        o["sums_len"][oids] = sums.shape[1] if sums.ndim == 2 else 0
        o["sums_slot"][oids] = self.sums_slabs.put(sums)
        b["obj"][bids, group] = oids
        self.live_objects += n
        if tier == 0:  # full DRAM objects make their parents' blocks hot
            hot = bids[self.leaves.full[b["ns"][bids]] == group]
            parents = b["parent"][hot]
            np.add.at(b["hot"], parents[parents >= 0], 1)
        if refresh:  # (else the caller refreshes them, with a batch's others)
            self.leaves.refresh(np.concatenate([oids, self.leaves.parents_full(bids)]))
        return oids

    def _hot_step(self, oid: int, step: int) -> None:
        """A full DRAM object arrives in (+1) or leaves (-1) its parent's hot
        count; the parent's full object may become or stop being a DRAM leaf."""
        o, b = self.objects.cols, self.blocks.cols
        bid = int(o["block"][oid])
        if int(o["group"][oid]) != self.leaves.full_of(bid):
            return
        parent = int(b["parent"][bid])
        if parent >= 0:
            b["hot"][parent] += step
            self.leaves.refresh1(int(b["obj"][parent, self.leaves.full_of(bid)]))
            if step < 0 and self.leaf_events is not None and b["hot"][parent] == 0:
                self.leaf_events.append(parent)

    def remove_object(self, oid: int, prune: bool = True) -> Freed:
        """Take an object out of the index (an eviction); returns (server, tier,
        offset, length). Its block is removed too when it holds nothing else and
        has no children. An object a lease pins is *detached*: its row and range
        stay held (``detached``) until :meth:`unpin` lets its last pin go, which
        returns it to be freed then; the caller frees nothing now."""
        o = self.objects.cols
        if not 0 <= oid < self.objects.rows or o["block"][oid] < 0:
            raise CompactIndexError(f"no object {oid}")
        self.leaves.take_out(oid)
        if o["tier"][oid] == 0 and o["hits"][oid] != LEAVING_DRAM:
            self._hot_step(oid, -1)
        bid, group = int(o["block"][oid]), int(o["group"][oid])
        b = self.blocks.cols
        b["obj"][bid, group] = -1
        out = (int(o["server"][oid]), int(o["tier"][oid]), int(o["offset"][oid]),
               int(o["length"][oid]))  # fmt: skip
        self.live_objects -= 1
        if o["pins"][oid]:
            o["block"][oid] = DETACHED
            self.detached += 1
        else:
            self._free_row(oid)
        if prune and b["children"][bid] == 0 and not (b["obj"][bid] >= 0).any():
            self.remove_block(bid)
        return out

    def _free_row(self, oid: int) -> None:
        o = self.objects.cols
        self.sums_slabs.free(int(o["sums_len"][oid]), int(o["sums_slot"][oid]))
        o["block"][oid] = -1
        o["gen"][oid] += 1  # handles to the old object see it gone
        self.objects.give1(oid)

    def pin(self, oids: I32) -> None:
        """A lease holds ``oids`` (each as often as named): not evictable until
        unpinned."""
        if oids.size <= SMALL:  # (a few: scalar work, no array calls)
            self.few.pin(oids.tolist())
            return
        self._check_live(oids)
        u, n = np.unique(oids, return_counts=True)
        self.objects.cols["pins"][u] += n.astype(np.int32)

    def unpin(self, oids: I32) -> list[Freed]:
        """A lease on ``oids`` ended. Returns (server, tier, offset, length) of the
        detached objects whose last pin this was: theirs to free now."""
        return [f for _, f in self.unpin_rows(oids)]

    def unpin_rows(self, oids: I32) -> list[tuple[int, Freed]]:
        """:meth:`unpin`, each freed object with its (former) id."""
        o = self.objects.cols
        if oids.size <= SMALL:  # (a few: scalar work, no array calls)
            return self.few.unpin(oids.tolist())
        if oids.size and not ((oids >= 0) & (oids < self.objects.rows)).all():
            raise CompactIndexError("unpin of an object no lease holds")
        u, n = np.unique(oids, return_counts=True)
        if (o["pins"][u] < n).any():
            raise CompactIndexError("unpin of an object no lease holds")
        o["pins"][u] -= n.astype(np.int32)
        free = u[o["pins"][u] == 0]
        freed = []
        for oid in free[o["block"][free] == DETACHED].tolist():
            freed.append((oid, (int(o["server"][oid]), int(o["tier"][oid]),
                          int(o["offset"][oid]), int(o["length"][oid]))))  # fmt: skip
            self._free_row(oid)
            self.detached -= 1
        self.leaves.refresh(free[o["block"][free] >= 0])
        return freed

    def last_unpins(self, left: list[int]) -> list[tuple[int, Freed]]:
        """Rows whose last pin went, out of their heap: a detached one freed (and
        returned), a live one back in its heap if evictable."""
        o = self.objects.cols
        block = self.objects.mv("block")
        freed = []
        for oid in left:
            if block[oid] == DETACHED:
                freed.append((oid, (int(o["server"][oid]), int(o["tier"][oid]),
                              int(o["offset"][oid]), int(o["length"][oid]))))  # fmt: skip
                self._free_row(oid)
                self.detached -= 1
            else:
                self.leaves.refresh1(oid)
        return freed

    def move_tier(self, oid: int, tier: int, offset: int) -> int:
        """A finished demotion (to 1, NVMe) or promotion (to 0, DRAM): the object
        is now its copy at ``offset`` of ``tier`` on the same server. Returns its
        id: ``oid``, or, when leases still pin the old copy, a new row (the old one
        stays detached for them until :meth:`unpin`)."""
        o = self.objects.cols
        self._check_live(np.array([oid], dtype=np.int32))
        if tier not in (0, 1):
            raise CompactIndexError(f"tier {tier}: 0 (DRAM) or 1 (NVMe)")
        if o["pins"][oid]:
            bid, group = int(o["block"][oid]), int(o["group"][oid])
            width, tick = int(o["sums_len"][oid]), int(o["tick"][oid])
            sums = np.frombuffer(self.sums(oid), np.uint8).reshape(1, width)
            row = [int(o[c][oid]) for c in ("server", "length", "owner")]
            score, atime = float(o["score"][oid]), float(o["atime"][oid])
            self.remove_object(oid, prune=False)  # detached: its pins, its old range
            (oid,) = self.add_objects(
                np.array([bid], np.int32), group, row[0], np.array([offset], np.uint64),
                np.array([row[1]], np.uint32), sums, np.array([tick], np.uint64), tier, row[2],
            )  # fmt: skip
            self.objects.cols["score"][oid] = score
            self.objects.cols["atime"][oid] = atime
            return int(oid)
        self.leaves.take_out(oid)
        if o["tier"][oid] == 0 and o["hits"][oid] != LEAVING_DRAM:
            self._hot_step(oid, -1)
        o["tier"][oid], o["offset"][oid], o["hits"][oid] = tier, offset, 0
        if tier == 0:
            self._hot_step(oid, 1)
        self.leaves.refresh1(oid)
        return oid

    def leaving(self, oid: int, on: bool) -> None:
        """Mark a full DRAM object as being demoted (its parent stops counting it
        as hot, so a whole prompt demotes in one pass), or unmark it (the
        demotion failed)."""
        o = self.objects.cols
        self._check_live(np.array([oid], dtype=np.int32))
        if o["tier"][oid] != 0 or (o["hits"][oid] == LEAVING_DRAM) == on:
            raise CompactIndexError(f"object {oid}: not a DRAM object to mark leaving={on}")
        o["hits"][oid] = LEAVING_DRAM if on else 0
        self._hot_step(oid, -1 if on else 1)

    def _check_live(self, oids: I32) -> None:
        o = self.objects.cols
        if oids.size and (
            not ((oids >= 0) & (oids < self.objects.rows)).all() or (o["block"][oids] < 0).any()
        ):
            raise CompactIndexError("unknown object ids")

    def sums(self, oid: int) -> bytes:
        o = self.objects.cols
        return self.sums_slabs.get(int(o["sums_len"][oid]), int(o["sums_slot"][oid]))

    def touch(self, oids: I32, tick: int, atime: float | None = None) -> None:
        """Mark objects used at ``tick`` (a lookup's hits): later victims.
        ``atime``: their access time too."""
        heaps = self.leaves.heaps
        if oids.size <= SMALL:  # (a few: scalar work, no array calls)
            self.few.touch(oids.tolist(), tick, atime)
            return
        c = self.objects.cols
        c["tick"][oids] = tick
        if atime is not None:
            c["atime"][oids] = atime
        for oid in oids[c["hpos"][oids] >= 0].tolist():
            heaps[int(c["tier"][oid])].rekey(oid)

    def retick(self, oids: I32, ticks: U64) -> None:
        """New eviction keys for ``oids`` (a policy re-scored them)."""
        o = self.objects.cols
        o["tick"][oids] = ticks
        hpos, tier = o["hpos"], o["tier"]
        heaps = self.leaves.heaps
        for oid in oids[hpos[oids] >= 0].tolist():
            heaps[int(tier[oid])].rekey(oid)

    def victim(self, tier: int = 0) -> int:
        """The least recently used evictable object of ``tier`` (-1: none)."""
        return self.leaves.victim(tier)

    def server_objects(self, server: int) -> I32:
        """Ids of the live objects on ``server`` (one vectorised scan)."""
        o = self.objects.cols
        rows = self.objects.rows
        return np.flatnonzero((o["server"][:rows] == server) & (o["block"][:rows] >= 0)).astype(
            np.int32
        )

    # -- accounting ----------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes the index's arrays hold for the rows in use."""
        sums = self.sums_slabs.nbytes()
        return (
            self.blocks.nbytes()
            + self.objects.nbytes()
            + sums
            + self.keys.nbytes()
            + self.leaves.nbytes()
        )

    def stats(self) -> dict[str, int]:
        return {
            "blocks": self.live_blocks,
            "objects": self.live_objects,
            "evictable": self.leaves.evictable_count(),
            "detached": self.detached,
            "table_slots": int(self.keys.table.size),
            "tombstones": self.keys.tombs,
            "bytes": self.nbytes(),
        }
