"""The meta's blocks and objects as handles over the compact index's columns.

The index holds no Python object per block or per object: blocks, objects,
their keys, checksums and eviction order are rows of
:class:`~gcache.meta.compact.CompactIndex`. The meta's hot paths (lookups, leases,
commits, adoption) work on those rows as arrays. Everything else (tiers, the
cost policy's walks, admin calls, tests) reads them through these handles: an
:class:`ObjectRecord` or :class:`BlockEntry` names one row and reads its fields
from the columns on access. A handle is made on demand and shared while anyone
holds it (a weak cache per row), so ``is`` compares them as it compared the
records they replace. Rows are reused: a handle carries its row's generation,
and once the row was freed the handle's ``state`` is ``GONE`` (its other fields
are then meaningless; callers check ``state`` first, as they did).

:class:`Store` owns the columns and what they refer to by number: servers by
slot, tenants by id, namespaces by id. No I/O.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from gcache.errors import CompactIndexError
from gcache.meta.compact import DETACHED, CompactIndex
from gcache.storage.livemap import LiveMap

if TYPE_CHECKING:
    from gcache.meta.records import NamespaceRecord, ServerRecord

LIVE: Final = 0  # in the index, readable
EVICTED: Final = 1  # out of the index, memory held until its leases end
GONE: Final = 2  # memory freed (or its server died)

MAX_SLOTS: Final = 0xFFFF  # server slots are uint16 in the columns
MAX_OWNERS: Final = 0xFFFF  # tenant ids likewise


class Store:
    """The compact columns and the tables their numbers index."""

    def __init__(self, native: bool = True) -> None:
        self.cx = CompactIndex(groups=2, native=native)
        self.cx.leaf_events = []
        self.servers: list[ServerRecord | None] = []  # by slot
        self.slot_rows: list[int] = []  # object rows naming each slot
        self.free_slots: list[int] = []
        self.owners: list[str] = [""]  # tenant id -> name (0: none)
        self.owner_ids: dict[str, int] = {"": 0}
        self.ns_by_id: dict[int, NamespaceRecord] = {}
        # Detached rows (evicted, still leased) with nothing to free when their
        # last lease ends: their server lost them or died (state GONE).
        self.forgotten: set[int] = set()
        self._objs: weakref.WeakValueDictionary[int, ObjectRecord] = weakref.WeakValueDictionary()
        self._blocks: weakref.WeakValueDictionary[int, BlockEntry] = weakref.WeakValueDictionary()

    # -- numbers ---------------------------------------------------------------------

    def slot_of(self, srv: ServerRecord) -> int:
        """``srv``'s slot, assigned on first use."""
        slot = srv.slot
        if slot >= 0:
            return slot
        if self.free_slots:
            slot = self.free_slots.pop()
            self.servers[slot] = srv
        else:
            slot = len(self.servers)
            if slot >= MAX_SLOTS:
                raise CompactIndexError(f"more than {MAX_SLOTS} servers hold objects")
            self.servers.append(srv)
            self.slot_rows.append(0)
        srv.slot = slot
        return slot

    def rows_named(self, slot: int, n: int) -> None:
        """``n`` object rows (negative: freed) name ``slot``; a dead server's slot
        with none left is free for another server."""
        left = self.slot_rows[slot] + n
        self.slot_rows[slot] = left
        if left == 0:
            srv = self.servers[slot]
            if srv is not None and not srv.alive:
                self.servers[slot] = None
                srv.slot = -1
                self.free_slots.append(slot)

    def owner_id(self, name: str) -> int:
        got = self.owner_ids.get(name)
        if got is None:
            got = len(self.owners)
            if got >= MAX_OWNERS:
                raise CompactIndexError(f"more than {MAX_OWNERS} tenants own objects")
            self.owners.append(name)
            self.owner_ids[name] = got
        return got

    # -- handles ---------------------------------------------------------------------

    def obj(self, oid: int) -> ObjectRecord:
        """The handle of object row ``oid`` (the one others hold, if any)."""
        gen = int(self.cx.objects.cols["gen"][oid])
        h = self._objs.get(oid)
        if h is None or h.gen != gen:
            h = ObjectRecord(self, oid, gen)
            self._objs[oid] = h
        return h

    def block(self, bid: int) -> BlockEntry:
        gen = int(self.cx.blocks.cols["gen"][bid])
        h = self._blocks.get(bid)
        if h is None or h.gen != gen:
            h = BlockEntry(self, bid, gen)
            self._blocks[bid] = h
        return h

    def ns_blocks(self, ns_id: int) -> np.ndarray:
        """Ids of every block of namespace ``ns_id`` (a scan: tests, admin)."""
        b = self.cx.blocks
        return np.flatnonzero(b.cols["ns"][: b.rows] == ns_id).astype(np.int32)


class ObjectRecord:
    """One object row (see the module docstring)."""

    __slots__ = ("__weakref__", "gen", "oid", "st")

    def __init__(self, st: Store, oid: int, gen: int) -> None:
        self.st = st
        self.oid = oid
        self.gen = gen

    def _col(self, name: str) -> int:
        return int(self.st.cx.objects.cols[name][self.oid])

    @property
    def state(self) -> int:
        o = self.st.cx.objects.cols
        oid = self.oid
        if int(o["gen"][oid]) != self.gen or oid in self.st.forgotten:
            return GONE
        return EVICTED if int(o["block"][oid]) == DETACHED else LIVE

    @property
    def entry(self) -> BlockEntry:
        """Its block (only while it is live: an evicted object has none)."""
        bid = self._col("block")
        if bid < 0:
            raise CompactIndexError(f"object {self.oid} is not in a block")
        return self.st.block(bid)

    @property
    def group(self) -> int:
        return self._col("group")

    @property
    def tier(self) -> int:
        return self._col("tier")

    @property
    def server(self) -> ServerRecord:
        srv = self.st.servers[self._col("server")]
        assert srv is not None
        return srv

    @property
    def offset(self) -> int:
        return self._col("offset")

    @property
    def length(self) -> int:
        return self._col("length")

    @property
    def sums(self) -> bytes:
        return self.st.cx.sums(self.oid)

    @property
    def pins(self) -> int:
        return self._col("pins")

    @property
    def hits(self) -> int:
        return self._col("hits")

    @hits.setter
    def hits(self, value: int) -> None:
        self.st.cx.objects.cols["hits"][self.oid] = value

    @property
    def last_access(self) -> float:
        return float(self.st.cx.objects.cols["atime"][self.oid])

    @property
    def owner(self) -> str:
        return self.st.owners[self._col("owner")]

    @property
    def score(self) -> float:
        return float(self.st.cx.objects.cols["score"][self.oid])

    @score.setter
    def score(self, value: float) -> None:
        self.st.cx.objects.cols["score"][self.oid] = value

    def __repr__(self) -> str:
        if self.state == GONE:
            return f"ObjectRecord(row={self.oid}, gone)"
        return (
            f"ObjectRecord(row={self.oid}, group={self.group}, tier={self.tier}, "
            f"server={self.server.server_id}, offset={self.offset}, length={self.length}, "
            f"pins={self.pins}, state={self.state})"
        )


class BlockEntry:
    """One block row (see the module docstring)."""

    __slots__ = ("__weakref__", "bid", "gen", "st")

    def __init__(self, st: Store, bid: int, gen: int) -> None:
        self.st = st
        self.bid = bid
        self.gen = gen

    def _col(self, name: str) -> int:
        return int(self.st.cx.blocks.cols[name][self.bid])

    @property
    def alive(self) -> bool:
        b = self.st.cx.blocks.cols
        return int(b["gen"][self.bid]) == self.gen and int(b["ns"][self.bid]) != 0xFFFF

    @property
    def ns_id(self) -> int:
        return self._col("ns")

    @property
    def key(self) -> bytes:
        b = self.st.cx.blocks.cols
        return int(b["k0"][self.bid]).to_bytes(8, "little") + int(b["k1"][self.bid]).to_bytes(
            8, "little"
        )

    @property
    def parent(self) -> BlockEntry | None:
        p = self._col("parent")
        return None if p < 0 else self.st.block(p)

    @property
    def pos(self) -> int:
        return self._col("pos")

    @property
    def children(self) -> int:
        return self._col("children")

    @property
    def hot(self) -> int:
        """Children whose full object is in DRAM (see ``kids``)."""
        return self._col("hot")

    @property
    def objects(self) -> list[ObjectRecord | None]:
        """Its object of each of its namespace's groups (None: none)."""
        st = self.st
        n = st.ns_by_id[self.ns_id].layout.num_groups
        row = st.cx.blocks.cols["obj"][self.bid, :n].tolist()
        return [None if oid < 0 else st.obj(oid) for oid in row]

    def empty(self) -> bool:
        return not bool((self.st.cx.blocks.cols["obj"][self.bid] >= 0).any())

    def __repr__(self) -> str:
        return f"BlockEntry(row={self.bid}, pos={self.pos}, children={self.children})"


class Ghost:
    """What an object was when it left the index (its row may be reused at once):
    for the policies' ``evicted`` hook and the caller that frees its range. While
    leases pin it (``pinned``), its row is held and ``oid`` still names it."""

    __slots__ = (
        *("entry", "group", "last_access", "length", "offset", "oid", "owner", "pinned"),
        *("score", "server", "state", "tier"),
    )

    def __init__(
        self,
        oid: int,
        entry: BlockEntry,
        group: int,
        server: ServerRecord,
        tier: int,
        offset: int,
        length: int,
        owner: str,
        score: float,
        last_access: float,
        pinned: bool,
    ) -> None:
        self.oid = oid
        self.entry = entry
        self.group = group
        self.server = server
        self.tier = tier
        self.offset = offset
        self.length = length
        self.owner = owner
        self.score = score
        self.last_access = last_access
        self.pinned = pinned
        self.state = EVICTED if pinned else GONE


class Entries:
    """A namespace's blocks by key, read-only (``NamespaceRecord.entries``): the
    mapping the records' dict was, answered by the key map. Changes go through
    :class:`~gcache.meta.index.Index`."""

    __slots__ = ("count", "ns_id", "st")

    def __init__(self, st: Store, ns_id: int) -> None:
        self.st = st
        self.ns_id = ns_id
        self.count = 0  # blocks of this namespace (kept by the index)

    def find(self, key: bytes) -> int:
        """The block id of ``key`` (-1: none)."""
        if len(key) != 16:
            return -1
        return self.st.cx.keys.find1(self.ns_id, key)

    def stored(self, key_list: list[bytes]) -> list[list[int]]:
        """Per key, the object row of each group (-1: none; all -1 for a key with
        no block): one vectorised probe for a whole prompt."""
        cx = self.st.cx
        n = self.st.ns_by_id[self.ns_id].layout.num_groups
        if not key_list:
            return []
        if len(key_list) <= 16:  # (a few: scalar probes, no arrays)
            find, obj, width = cx.keys.find1, cx.blocks.mv("obj"), cx.groups
            out1: list[list[int]] = []
            for key in key_list:
                bid = find(self.ns_id, key)
                if bid < 0:
                    out1.append([-1] * n)
                else:
                    at = bid * width
                    out1.append(list(obj[at : at + n]))
            return out1
        bids = cx.find_keys(self.ns_id, key_list)
        rows = cx.blocks.cols["obj"][np.where(bids >= 0, bids, 0), :n]
        rows[bids < 0] = -1
        out: list[list[int]] = rows.tolist()
        return out

    def get(self, key: bytes, default: BlockEntry | None = None) -> BlockEntry | None:
        bid = self.find(key)
        return default if bid < 0 else self.st.block(bid)

    def __getitem__(self, key: bytes) -> BlockEntry:
        bid = self.find(key)
        if bid < 0:
            raise KeyError(key)
        return self.st.block(bid)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.find(key) >= 0

    def __len__(self) -> int:
        return self.count

    def values(self) -> Iterator[BlockEntry]:
        st = self.st
        return iter([st.block(bid) for bid in st.ns_blocks(self.ns_id).tolist()])

    def keys(self) -> Iterator[bytes]:
        return (e.key for e in self.values())

    def items(self) -> Iterator[tuple[bytes, BlockEntry]]:
        return ((e.key, e) for e in self.values())

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()


class Reported:
    """A server's adopted DRAM objects while its report is in progress: offset ->
    object row, in a :class:`~gcache.storage.livemap.LiveMap` (no Python object
    per object: a rebuild adopts millions). Offsets are ``align``-aligned (others
    are never in it)."""

    __slots__ = ("map", "mask", "shift")

    def __init__(self, align: int) -> None:
        self.map = LiveMap()
        self.shift = align.bit_length() - 1
        self.mask = align - 1

    def __contains__(self, offset: object) -> bool:
        return self.get(offset) >= 0  # type: ignore[arg-type]

    def get(self, offset: int) -> int:
        """The object row at ``offset``, or -1."""
        if offset < 0 or offset & self.mask:
            return -1
        return self.map.get(offset >> self.shift)

    def any_of(self, offsets: npt.NDArray[np.int64]) -> bool:
        """Whether an object is at any of ``offsets`` (aligned, as an array)."""
        return self.map.any_of(offsets >> self.shift)

    def add(self, offset: int, oid: int) -> None:
        self.map.put(offset >> self.shift, oid)

    def add_many(self, offsets: list[int], oids: list[int]) -> None:
        shift = self.shift
        self.map.put_many(
            np.array([o >> shift for o in offsets], dtype=np.int64), np.array(oids, np.int64)
        )

    def pop(self, offset: int) -> int:
        if offset < 0 or offset & self.mask:
            return -1
        return self.map.pop(offset >> self.shift)

    def __len__(self) -> int:
        return len(self.map)

    def arrays(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(offsets, object rows) of every one, as arrays, in no order."""
        units, oids = self.map.arrays()
        return units << self.shift, oids

    def items(self) -> Iterator[tuple[int, int]]:
        """``(offset, object row)`` of each, in no order."""
        shift = self.shift
        return ((u << shift, oid) for u, oid in self.map.items())


def kids(obj: ObjectRecord) -> int:
    """Children that keep ``obj``'s block from being a leaf in its tier: for a DRAM
    object those with a DRAM full object, for an NVMe one every child."""
    return obj.entry.hot if obj.tier == 0 else obj.entry.children
