"""The meta's per-namespace, per-server, per-put and per-lease records.

Blocks and objects are rows of the compact index (``meta/compact.py``), read
through the handles of ``meta/handles.py`` (:class:`BlockEntry`,
:class:`ObjectRecord`, re-exported here): a fleet's index holds tens of millions
of them, so none has a Python object of its own. Counters are maintained
incrementally, never by rescanning.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gcache import wire
from gcache.layout import Layout
from gcache.meta.handles import (
    EVICTED,
    GONE,
    LIVE,
    BlockEntry,
    Entries,
    ObjectRecord,
    Reported,
    Store,
    kids,
)
from gcache.storage.allocator import SegmentAllocator
from gcache.storage.columns import Columns
from gcache.storage.record import StoredRecord

if TYPE_CHECKING:
    from gcache.meta.session import Session

__all__ = [
    "EVICTED",
    "GONE",
    "LIVE",
    "BlockEntry",
    "Entries",
    "Lease",
    "NamespaceRecord",
    "ObjectRecord",
    "Parked",
    "ParkedChunk",
    "PendingPut",
    "Placed",
    "Plan",
    "Reported",
    "ServerRecord",
    "group_layer_bytes",
    "kids",
]


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
        self,
        ns_id: int,
        fingerprint: bytes,
        layout: Layout,
        descriptor: dict[str, object],
        entries: Entries,
    ):
        self.ns_id = ns_id
        self.fingerprint = fingerprint
        self.layout = layout
        self.descriptor = descriptor
        self.entries = entries  # its blocks by key (the index's key map)
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
        "nvme_count",
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
        "secret",
        "server_id",
        "slot",
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
        # Its number in the index's columns (-1: none yet; gcache/meta/handles.py).
        self.slot = -1
        # -- tiers and restarts (gcache/meta/tiers.py, rebuild.py) --
        self.nvme_capacity = 0
        self.dram_read_gbps = 0.0
        self.nvme_read_gbps = 0.0
        self.nvme_write_gbps = 0.0
        self.nvme_bytes = 0  # NVMe objects in the index plus demotions in flight
        self.nvme_count = 0  # NVMe objects in the index
        self.nvme_used_reported = 0  # what the server says its tier holds
        # While the server's report is not complete: its reported DRAM objects by
        # offset (the allocator is built from them at the end); None once complete.
        # Nothing is placed on a server whose report is not complete.
        self.reported: Reported | None = None
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
    __slots__ = ("expiry", "lease_id", "ns", "oids", "owner", "st")

    def __init__(
        self,
        lease_id: int,
        ns: NamespaceRecord,
        oids: np.ndarray | list[int],
        expiry: float,
        owner: Session,
        st: Store,
    ) -> None:
        self.lease_id = lease_id
        self.ns = ns
        self.oids = oids  # the object rows it pins (int32; a small lease's: a list)
        self.expiry = expiry
        self.owner = owner  # only this session may release it
        self.st = st

    @property
    def objects(self) -> list[ObjectRecord]:
        """Its objects as handles (tests, admin)."""
        ids = self.oids if isinstance(self.oids, list) else self.oids.tolist()
        return [self.st.obj(oid) for oid in ids]


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
