"""The meta's per-block, per-object, per-server and per-lease records.

Compact on purpose (``__slots__``, no per-object dicts): the index of a fleet holds
tens of millions of objects. A :class:`BlockEntry` is one keyed block of one
namespace with a parent link; it holds at most one :class:`ObjectRecord` per layout
group. Counters are maintained incrementally, never by rescanning.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from gcache import wire
from gcache.layout import Layout
from gcache.storage.allocator import SegmentAllocator
from gcache.storage.columns import Columns
from gcache.storage.record import StoredRecord

if TYPE_CHECKING:
    from gcache.meta.session import Session

LIVE: Final = 0  # in the index, readable
EVICTED: Final = 1  # out of the index, memory held until its leases end
GONE: Final = 2  # memory freed (or its server died)


class RingNode:
    """A node of a server's ring of live objects (one ring per namespace): dropping a
    server walks its own objects only, never the whole index."""

    __slots__ = ("next_on", "prev_on")

    def __init__(self) -> None:
        self.prev_on: RingNode = self
        self.next_on: RingNode = self

    def link(self, node: RingNode) -> None:
        """Insert ``node`` after this one."""
        nxt = self.next_on
        node.prev_on = self
        node.next_on = nxt
        nxt.prev_on = node
        self.next_on = node

    def unlink(self) -> None:
        self.prev_on.next_on = self.next_on
        self.next_on.prev_on = self.prev_on
        # Not a self-loop: an object out of its ring is in no reference cycle, so
        # reference counting frees it (the rebuilt index is frozen out of the cyclic
        # collector, see meta/control.py GcPause).
        self.prev_on = self.next_on = DETACHED


DETACHED = RingNode()  # where an unlinked node points


class ObjectRecord(RingNode):
    __slots__ = (
        "entry",
        "group",
        "hits",
        "last_access",
        "length",
        "offset",
        "owner",
        "pins",
        "score",
        "server",
        "state",
        "sums",
        "tier",
    )

    def __init__(
        self,
        entry: BlockEntry,
        group: int,
        server: ServerRecord,
        offset: int,
        length: int,
        sums: bytes,
        now: float,
        owner: str = "",
        tier: int = 0,
    ) -> None:
        self.prev_on = self.next_on = DETACHED  # not in a ring yet (no reference cycle)
        self.entry = entry
        self.group = group
        self.server = server
        self.offset = offset
        self.length = length
        self.sums = sums
        self.pins = 0
        self.state = LIVE
        self.hits = 0  # leased reads while on NVMe (promotion; -1: being promoted)
        self.last_access = now
        self.owner = owner  # the tenant whose quota the bytes count against
        # The eviction policy's own figure for this object (the cost policy keeps
        # log(value per byte) here, so a touch re-keys it without recomputing).
        self.score = 0.0
        # 0: in the server's DRAM segment (``offset`` is a segment offset); 1: on its
        # NVMe tier (``offset`` is the tier address the server chose).
        self.tier = tier

    def __repr__(self) -> str:
        return (
            f"ObjectRecord(pos={self.entry.pos}, group={self.group}, tier={self.tier}, "
            f"server={self.server.server_id}, offset={self.offset}, length={self.length}, "
            f"pins={self.pins}, state={self.state})"
        )


# Block positions as shared int objects: an entry's own ``pos`` past 256 would be an
# int of its own (32 B a block at fleet scale).
_POS_INTS: Final = list(range(1 << 16))


class BlockEntry:
    __slots__ = ("children", "hot", "key", "objects", "parent", "pos")

    def __init__(self, key: bytes, parent: BlockEntry | None, pos: int, groups: int) -> None:
        self.key = key
        self.parent = parent
        self.pos = _POS_INTS[pos] if pos < 65536 else pos
        self.children = 0
        # Children whose full object is in DRAM (tier 0): a DRAM full object may be
        # demoted or dropped once none is (its other children are on NVMe, where a
        # match still reads them through this block's NVMe copy).
        self.hot = 0
        self.objects: list[ObjectRecord | None] = [None] * groups

    def empty(self) -> bool:
        return not any(self.objects)


class NamespaceRecord:
    __slots__ = (
        "descriptor",
        "entries",
        "fingerprint",
        "full_group",
        "full_holes",
        "layout",
        "max_tail",
        "ns_id",
        "windowed",
    )

    def __init__(
        self, ns_id: int, fingerprint: bytes, layout: Layout, descriptor: dict[str, object]
    ):
        self.ns_id = ns_id
        self.fingerprint = fingerprint
        self.layout = layout
        self.descriptor = descriptor
        self.entries: dict[bytes, BlockEntry] = {}
        tails = layout.group_tail_blocks
        self.full_group: int | None = tails.index(None) if None in tails else None
        # Entries whose full object is missing (created empty, or their full object
        # evicted or lost). While 0, a lookup needs no per-block scan (see match).
        self.full_holes = 0
        # (group, tail blocks) of every windowed group, and the longest tail: the
        # blocks before a match end (or checkpoint) that need windowed objects.
        self.windowed: list[tuple[int, int]] = [
            (g, t) for g, t in enumerate(tails) if t is not None
        ]
        self.max_tail = max((t for _, t in self.windowed), default=0)


@functools.lru_cache(maxsize=1024)
def group_layer_bytes(layout: Layout, group: int) -> tuple[int, ...]:
    """Byte length of each layer (K then V) of ``group``'s object, or () when they
    are all equal (the server splits an object of n checksums into n equal layers
    unless its record says otherwise; ``StoredObject.layer_bytes``)."""
    return layout.group_layer_bytes[group]


def kids(obj: ObjectRecord) -> int:
    """Children that keep ``obj``'s block from being a leaf in its tier: for a DRAM
    object those with a DRAM full object, for an NVMe one every child."""
    return obj.entry.hot if obj.tier == 0 else obj.entry.children


class ServerRecord:
    __slots__ = (
        "addr",
        "adopt_out",
        "adopt_overflow",
        "alive",
        "allocator",
        "counters",
        "deferred_bytes",
        "demote_out",
        "demote_paused_until",
        "demoted",
        "demoting",
        "demoting_bytes",
        "drain_to",
        "dram_read_gbps",
        "drop_out",
        "dropped",
        "freed",
        "grant_epoch",
        "incarnation",
        "last_seen",
        "nvme_bytes",
        "nvme_capacity",
        "nvme_objects",
        "nvme_read_gbps",
        "nvme_used_reported",
        "nvme_write_gbps",
        "objects",
        "parked",
        "pending_bytes",
        "placed_since_beat",
        "promote_out",
        "promoting",
        "promoting_bytes",
        "quarantined_bytes",
        "recent_at",
        "recent_write",
        "reported",
        "rings",
        "secret",
        "server_id",
    )

    def __init__(
        self,
        server_id: str,
        addr: wire.ServerAddr,
        secret: bytes,
        incarnation: int,
        capacity: int,
        now: float,
    ) -> None:
        self.server_id = server_id
        self.addr = addr
        self.secret = secret
        self.incarnation = incarnation
        self.allocator = SegmentAllocator(capacity)
        self.last_seen = now
        self.alive = True
        self.objects = 0
        # Bytes of evicted objects still pinned by leases: allocated, not reclaimable.
        self.deferred_bytes = 0
        # Ranges freed since the last heartbeat, reported to the server (bounded).
        self.freed: list[tuple[int, int]] = []
        self.counters: dict[str, int] = {}
        # Bytes allocated to pending puts, and freed from them but held back until
        # their write grants expired (see MetaCore's quarantine).
        self.pending_bytes = 0
        self.quarantined_bytes = 0
        # Live objects of this server, one ring per namespace id (a sentinel node).
        self.rings: dict[int, RingNode] = {}
        # -- tiers and restarts (gcache/meta/tiers.py, rebuild.py) --
        self.nvme_capacity = 0
        self.dram_read_gbps = 0.0
        self.nvme_read_gbps = 0.0
        self.nvme_write_gbps = 0.0
        self.nvme_bytes = 0  # NVMe objects in the index plus demotions in flight
        # NVMe address -> object: for objects the server reports lost.
        self.nvme_objects: dict[int, ObjectRecord] = {}
        self.nvme_used_reported = 0  # what the server says its tier holds
        # While the server's report is not complete: its reported DRAM objects by
        # offset (the allocator is built from them at the end); None once complete.
        # Nothing is placed on a server whose report is not complete.
        self.reported: dict[int, ObjectRecord] | None = None
        # Reported objects waiting for their namespace or parent (Parked),
        # DRAM ones by offset: their ranges stay allocated.
        self.parked: dict[int, Parked | ParkedChunk] = {}
        # The epoch this server's grants carry: the meta's (MetaCore.register_server).
        self.grant_epoch = 0
        # Outboxes of the next heartbeat reply (bounded, see tiers.py):
        self.adopt_out: list[tuple[ObjectRecord, NamespaceRecord]] = []  # record these
        self.adopt_overflow = 0  # commits the outbox had no room for
        # A watermark pass cut by its bound (Tiers.PASS_OBJECTS) left DRAM above
        # this target: later passes go on until it is reached (-1: none pending).
        self.drain_to = -1
        self.drop_out: list[tuple[int, int]] = []  # NVMe objects evicted: delete
        # DRAM offset -> (object, its namespace) of a demotion in flight.
        self.demoting: dict[int, tuple[ObjectRecord, NamespaceRecord]] = {}
        self.demote_out: list[tuple[ObjectRecord, NamespaceRecord]] = []  # copy to NVMe
        self.demoting_bytes = 0
        self.demote_paused_until = 0.0  # after a failed demotion: drop instead
        # Objects of this server demoted (finished) / dropped with no NVMe copy while
        # demotion is on (dropped_not_demoted), for the status table.
        self.demoted = 0
        self.dropped = 0
        # Promotions (NVMe -> DRAM): DRAM offset -> (object, namespace) in flight, the
        # commands not sent yet, and the DRAM bytes allocated to them.
        self.promoting: dict[int, tuple[ObjectRecord, NamespaceRecord]] = {}
        self.promote_out: list[tuple[ObjectRecord, NamespaceRecord, int]] = []
        self.promoting_bytes = 0
        # Bytes placed here recently (decayed), for placement's write balance.
        self.recent_write = 0.0
        self.recent_at = now
        # Bytes placed here since its last heartbeat (Heartbeats.next_beat).
        self.placed_since_beat = 0

    @property
    def ready(self) -> bool:
        """The server's report is complete: new data may be placed on it."""
        return self.reported is None

    def ring(self, ns_id: int) -> RingNode:
        r = self.rings.get(ns_id)
        if r is None:
            r = self.rings[ns_id] = RingNode()
        return r

    @property
    def reclaimable_used(self) -> int:
        """Committed bytes eviction can return: not those of pending puts, of the
        quarantine, or of evicted objects still leased (watermarks count these only,
        so an uncommitted put never drives watermark eviction)."""
        return (
            self.allocator.used
            - self.deferred_bytes
            - self.pending_bytes
            - self.quarantined_bytes
            - self.demoting_bytes
            - self.promoting_bytes
        )


Placed = tuple[int, int, "ServerRecord", int, int]  # (block, group, server, offset, length)


class Plan:
    """What ``MetaCore.place`` decided for one put."""

    __slots__ = ("checkpoints", "no_space", "placements")

    def __init__(self, placements: list[Placed], no_space: int, checkpoints: list[int]) -> None:
        self.placements = placements
        self.no_space = no_space
        self.checkpoints = checkpoints  # block positions of the windows added


class PendingPut:
    """A begun put. ``deadline``: when it is reclaimed, which is also when its write
    grants have expired plus the margin (their ranges stay quarantined until then).
    ``owner``: the session that began it, the only one that may commit or abort it."""

    __slots__ = ("deadline", "expiry_ms", "keys", "nbytes", "ns", "owner", "placements", "put_id")

    def __init__(
        self,
        put_id: int,
        ns: NamespaceRecord,
        keys: list[bytes],
        placements: list[Placed],
        deadline: float,
        owner: Session,
        expiry_ms: int,
    ) -> None:
        self.put_id = put_id
        self.ns = ns
        self.keys = keys
        self.placements = placements
        self.deadline = deadline
        self.owner = owner
        self.expiry_ms = expiry_ms  # of every write grant of the put (wall ms)
        self.nbytes = sum(p[4] for p in placements)


class Lease:
    __slots__ = ("expiry", "lease_id", "ns", "objects", "owner")

    def __init__(
        self,
        lease_id: int,
        ns: NamespaceRecord,
        objects: list[ObjectRecord],
        expiry: float,
        owner: Session,
    ) -> None:
        self.lease_id = lease_id
        self.ns = ns
        self.objects = objects
        self.expiry = expiry
        self.owner = owner  # only this session may release it


class Parked(StoredRecord):
    """A reported record (:class:`gcache.storage.record.StoredRecord`) of a server
    that waits on the parked books for its namespace or its parent block."""

    server: ServerRecord | None = None
    since: float = 0.0
    allocated: bool = False  # its DRAM range is in the allocator (report complete)


@dataclass(slots=True, eq=False)
class ParkedChunk:
    """A whole reported chunk waiting for its namespace, kept in its columns (no
    object per record): its DRAM ranges by offset (in its server's ``parked``, kept
    allocated), its expiry from ``since``."""

    cols: Columns
    server: ServerRecord
    since: float
    ranges: dict[int, int]  # DRAM offset -> length, of the records still parked
    allocated: bool = False  # its DRAM ranges are in the allocator (report complete)
    # DRAM offsets of rows whose range turned out to be another's: never adopted
    skip: set[int] = field(default_factory=set)
