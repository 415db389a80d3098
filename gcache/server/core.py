"""The storage daemon's decision logic, without I/O: which segment bytes a WRITE
may fill and which a READ may return. The asyncio layer (:mod:`gcache.server.daemon`)
only moves bytes to and from the views this returns.

Write grants are one-shot: the first ``WRITE`` (or ``SEAL``, for bytes a
shared-memory client copied itself) that presents a grant consumes it, and the
server remembers its tag until the grant expires, so a replay is refused. The
table of used grants is bounded; when it is full of unexpired grants, new writes
are refused (never forgotten: forgetting would re-open replays). A consumed grant
earns a receipt (:func:`gcache.capability.receipt`) that the client hands to the
meta with ``PutCommit``.

A write grant is bound to one object (:func:`gcache.capability.bind_digest`): the
``WRITE`` / ``SEAL`` carries the object's record, the tag is checked against it, and
the record goes to the manifest (``recorder``) after the bytes are in and before
the receipt is made: a receipt, hence a commit, implies the record is persisted."""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterator
from typing import Final

from gcache import capability, wire
from gcache.errors import (
    E_ACCESS_DENIED,
    E_BAD_REQUEST,
    E_INTERNAL,
    E_NO_SPACE,
    E_OUT_OF_RANGE,
    GCacheError,
    Refusal,
)
from gcache.server.tiered import MAX_NVME_READ, TieredReadReply
from gcache.storage.nvme import NvmeTier
from gcache.storage.record import StoredRecord, from_info
from gcache.storage.segment import Segment

MAX_READ_RANGES: Final = 1 << 16
# Views of a READ reply made at once while it is sent (one sendmsg's worth).
READ_BATCH: Final = 512
_VERIFIED_MAX: Final = 1 << 16
# Used write grants remembered until they expire. A grant lives at most the meta's
# put timeout, so this bounds the writes a server accepts per put timeout.
MAX_USED_GRANTS: Final = 1 << 20
MAX_SEAL_GRANTS: Final = 1 << 16
MAX_SUMS: Final = 8 << 12  # checksum bytes in one object's record (4096 layers)

Recorder = Callable[[list[StoredRecord]], None]


def bind_of(obj: wire.ObjectInfo | None) -> bytes:
    """The digest a write grant presented with ``obj`` must be bound to (b"": none)."""
    if obj is None:
        return b""
    return capability.bind_digest(
        obj.namespace, obj.key, obj.parent, obj.pos, obj.group, obj.layer_bytes
    )


def record_of(grant: wire.Grant, obj: wire.ObjectInfo) -> StoredRecord:
    """The manifest record of the object ``grant`` wrote (a DRAM object)."""
    return from_info(obj, tier=0, offset=grant.offset, length=grant.length)


def _check_sums(obj: wire.ObjectInfo | None) -> None:
    if obj is not None and (len(obj.sums) % 8 or len(obj.sums) > MAX_SUMS):
        raise Refusal(
            E_BAD_REQUEST, f"record checksums of {len(obj.sums)} bytes (8 per layer wanted)"
        )


def _granted(grants: list[wire.Grant]) -> int:
    """Bytes a READ's grants cover, each distinct ``(offset, length)`` once."""
    return sum(length for _, length in {(g.offset, g.length) for g in grants})


class ReadReply:
    """A checked READ's reply: ``total`` bytes, the segment ranges in order.

    The views are made :data:`READ_BATCH` at a time, as the sender asks for them
    (:meth:`batches`): until then a range costs 16 bytes in two arrays. A client that
    stops reading a 65536-range reply makes the server hold 1 MiB and one batch of
    views, not 65536 views (about 14 MiB) for as long as the send waits."""

    __slots__ = ("_lengths", "_offsets", "_seg", "total")

    def __init__(
        self, seg: memoryview, offsets: array[int], lengths: array[int], total: int
    ) -> None:
        self._seg = seg
        self._offsets = offsets
        self._lengths = lengths
        self.total = total

    def __len__(self) -> int:
        return len(self._offsets)

    def batches(self, size: int = READ_BATCH) -> Iterator[list[memoryview]]:
        """The reply's views, ``size`` at a time, each batch made when asked for."""
        seg, offsets, lengths = self._seg, self._offsets, self._lengths
        for i in range(0, len(offsets), size):
            part = zip(offsets[i : i + size], lengths[i : i + size], strict=True)
            yield [seg[off : off + n] for off, n in part]

    def views(self) -> list[memoryview]:
        """Every view at once (for tests and small replies)."""
        return [v for batch in self.batches() for v in batch]


class DataPlaneCore:
    __slots__ = (
        "_expiries",
        "_used",
        "_verified",
        "bytes_read",
        "bytes_sealed",
        "bytes_written",
        "epoch",
        "freed_bytes",
        "max_used",
        "nvme",
        "old_epoch",
        "reads",
        "record_failures",
        "recorded",
        "recorder",
        "refused",
        "replays",
        "seals",
        "secret",
        "segment",
        "writes",
    )

    def __init__(
        self,
        segment: Segment,
        secret: bytes,
        max_used_grants: int = MAX_USED_GRANTS,
        nvme: NvmeTier | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.segment = segment
        # Persists the records of consumed bound write grants (the manifest's
        # ``record_writes``), called before a receipt is returned; None: not kept.
        self.recorder = recorder
        self.recorded = self.record_failures = 0
        # The NVMe tier (tier-1 read grants), and the epoch of the meta this
        # server is registered with: grants minted by an older meta are refused.
        self.nvme = nvme
        self.epoch = 0
        self.old_epoch = 0  # grants refused for their epoch
        self.secret = secret
        self.max_used = max_used_grants
        # Consumed write grants: tag -> expiry (ms), with a min-heap of expiries to
        # forget them once they can no longer pass the expiry check anyway.
        self._used: dict[bytes, int] = {}
        self._expiries: list[tuple[int, bytes]] = []
        self.seals = self.bytes_sealed = self.replays = 0
        # Tags already checked: a lease's grants are presented once per layer, so
        # only the first READ of a lease pays for the MACs.
        self._verified: dict[bytes, tuple[bytes, int, int, int, int, int]] = {}
        self.reads = self.writes = self.bytes_read = self.bytes_written = 0
        self.refused = self.freed_bytes = 0

    def _check_grant(self, kind: bytes, grant: wire.Grant, now_ms: int, bind: bytes = b"") -> None:
        if grant.tier:
            nvme = self.nvme
            if grant.tier != 1 or kind != capability.KIND_READ or nvme is None:
                raise Refusal(E_BAD_REQUEST, f"no tier {grant.tier} to {kind.decode()} here")
            if not nvme.covers(grant.offset, grant.length):
                raise Refusal(
                    E_OUT_OF_RANGE,
                    f"no object at [{grant.offset}, +{grant.length}) on the NVMe tier",
                )
        elif not self.segment.in_bounds(grant.offset, grant.length):
            raise Refusal(
                E_OUT_OF_RANGE,
                f"range [{grant.offset}, +{grant.length}) lies outside the "
                f"{self.segment.capacity}-byte segment",
            )
        if grant.expiry_ms <= now_ms:
            raise Refusal(E_ACCESS_DENIED, "grant expired")
        if grant.epoch < self.epoch:
            self.old_epoch += 1
            raise Refusal(
                E_ACCESS_DENIED,
                f"grant of meta epoch {grant.epoch}, older than this server's meta "
                f"(epoch {self.epoch})",
            )
        seen = self._verified.get(grant.tag)
        g = (kind, grant.offset, grant.length, grant.expiry_ms, grant.tier, grant.epoch)
        if seen == g:
            return
        if not capability.check(
            self.secret,
            kind,
            grant.offset,
            grant.length,
            grant.expiry_ms,
            grant.tag,
            grant.tier,
            grant.epoch,
            bind,
        ):
            raise Refusal(
                E_ACCESS_DENIED,
                "range not covered by a valid grant"
                + (" for this object" if kind == capability.KIND_WRITE else ""),
            )
        if kind != capability.KIND_READ:
            return  # write grants are one-shot: nothing to gain from caching them
        if len(self._verified) >= _VERIFIED_MAX:
            self._verified.clear()
        self._verified[grant.tag] = g

    def _prune(self, now_ms: int) -> None:
        heap, used = self._expiries, self._used
        while heap and heap[0][0] <= now_ms:
            _, tag = heapq.heappop(heap)
            used.pop(tag, None)

    def _check_unused(self, grant: wire.Grant, now_ms: int, extra: int = 0) -> None:
        """Refuse a write grant already consumed, or any new one while the table of
        used grants is full (``extra``: grants of the same request taken before)."""
        if grant.tag in self._used:
            self.replays += 1
            raise Refusal(E_ACCESS_DENIED, "write grant already used (a grant writes once)")
        self._prune(now_ms)
        if len(self._used) + extra >= self.max_used:
            raise Refusal(
                E_NO_SPACE,
                f"server remembers {self.max_used} unexpired used write grants; "
                "refusing new writes until some expire",
            )

    def _consume(self, grant: wire.Grant) -> None:
        self._used[grant.tag] = grant.expiry_ms
        heapq.heappush(self._expiries, (grant.expiry_ms, grant.tag))

    def receipt(self, grant: wire.Grant) -> int:
        """The receipt of a consumed write grant (``WRITE``'s ``Ok`` value)."""
        return capability.receipt(self.secret, grant.offset, grant.length, grant.expiry_ms)

    def _persist(self, recs: list[StoredRecord]) -> None:
        """Hand written objects' records to the manifest (one append); a failure
        refuses the receipts (the put stores fewer objects, nothing is acknowledged
        that was not persisted)."""
        if not recs or self.recorder is None:
            return
        try:
            self.recorder(recs)
        except GCacheError as exc:
            self.record_failures += 1
            raise Refusal(E_INTERNAL, f"written, but not recorded: {exc}") from exc
        self.recorded += len(recs)

    def write_done(self, msg: wire.Write) -> int:
        """A WRITE's payload is in the segment: record its object, then return the
        receipt (``Ok`` value). Raises :class:`Refusal` when the record could not be
        persisted (no receipt: the object is not committed)."""
        if msg.obj is not None:
            self._persist([record_of(msg.grant, msg.obj)])
        return self.receipt(msg.grant)

    def write_target(self, msg: wire.Write, payload_len: int, now_ms: int) -> memoryview:
        """The segment view a WRITE's payload goes into, or :class:`Refusal`."""
        try:
            g = msg.grant
            if payload_len != g.length:
                raise Refusal(
                    E_BAD_REQUEST,
                    f"payload of {payload_len} bytes does not match the granted {g.length} bytes",
                )
            _check_sums(msg.obj)
            self._check_grant(capability.KIND_WRITE, g, now_ms, bind_of(msg.obj))
            self._check_unused(g, now_ms)
        except Refusal:
            self.refused += 1
            raise
        self._consume(g)
        self.writes += 1
        self.bytes_written += payload_len
        return self.segment.view[g.offset : g.offset + g.length]

    def seal(self, msg: wire.Seal, now_ms: int) -> list[int]:
        """Consume the write grants of bytes a shared-memory client copied itself,
        all or none: one invalid, expired or already used grant refuses the whole
        ``SEAL``. The records of the sealed objects are persisted (one manifest
        append) before the receipts are returned, one per grant, in order; the bytes
        count as writes."""
        grants = msg.grants
        objs: list[wire.ObjectInfo] | list[None] = msg.objs or [None] * len(grants)
        try:
            if len(grants) > MAX_SEAL_GRANTS:
                raise Refusal(E_BAD_REQUEST, f"more than {MAX_SEAL_GRANTS} grants in one SEAL")
            if len(objs) != len(grants):
                raise Refusal(
                    E_BAD_REQUEST, f"{len(msg.objs)} object records for {len(grants)} grants"
                )
            tags: set[bytes] = set()
            for i, (g, obj) in enumerate(zip(grants, objs, strict=True)):
                _check_sums(obj)
                self._check_grant(capability.KIND_WRITE, g, now_ms, bind_of(obj))
                self._check_unused(g, now_ms, i)
                if g.tag in tags:
                    self.replays += 1
                    raise Refusal(E_ACCESS_DENIED, "write grant sealed twice in one SEAL")
                tags.add(g.tag)
        except Refusal:
            self.refused += 1
            raise
        nbytes = 0
        for g in grants:
            self._consume(g)
            nbytes += g.length
        if msg.objs:
            self._persist([record_of(g, o) for g, o in zip(grants, msg.objs, strict=True)])
        self.seals += 1
        self.writes += len(grants)
        self.bytes_written += nbytes
        self.bytes_sealed += nbytes
        return [self.receipt(g) for g in grants]

    def read_views(self, msg: wire.Read, now_ms: int) -> ReadReply | TieredReadReply:
        """Check a READ whole (grants, every range, the reply size) and return its
        reply, whose views are made only as it is sent (:class:`ReadReply`).

        A reply is at most the bytes its distinct grants cover: ranges may repeat
        a granted byte, but not so often that a small request asks for a reply
        larger than everything it was granted (65536 copies of a 128 KiB grant made
        a 0.5 MiB request ask for 8 GiB)."""
        try:
            ranges = msg.ranges
            if len(ranges) > MAX_READ_RANGES:
                raise Refusal(E_BAD_REQUEST, f"more than {MAX_READ_RANGES} ranges")
            grants = msg.grants
            for grant in grants:
                self._check_grant(capability.KIND_READ, grant, now_ms)
            offsets = array("Q")
            lengths = array("Q")
            total = 0
            for gi, off, length in ranges:
                if not 0 <= gi < len(grants):
                    raise Refusal(E_BAD_REQUEST, f"range names grant {gi} of {len(grants)}")
                g = grants[gi]
                if length <= 0 or off < g.offset or off + length > g.offset + g.length:
                    raise Refusal(
                        E_OUT_OF_RANGE,
                        f"range [{off}, +{length}) is not inside its grant "
                        f"[{g.offset}, +{g.length})",
                    )
                offsets.append(off)
                lengths.append(length)
                total += length
            if total > _granted(grants):
                raise Refusal(
                    E_BAD_REQUEST,
                    f"READ asks for {total} bytes, more than the {_granted(grants)} bytes "
                    "its distinct grants cover",
                )
            tiers = None
            if self.nvme is not None and any(g.tier for g in grants):
                # NVMe ranges are read from the tier's files into the reply.
                tiers = bytearray(grants[gi].tier for gi, _, _ in ranges)
                disk = sum(n for n, t in zip(lengths, tiers, strict=True) if t)
                if disk > MAX_NVME_READ:
                    raise Refusal(
                        E_BAD_REQUEST,
                        f"READ asks for {disk} NVMe bytes, more than {MAX_NVME_READ} at once",
                    )
        except Refusal:
            self.refused += 1
            raise
        self.reads += 1
        self.bytes_read += total
        if tiers is not None and self.nvme is not None:
            return TieredReadReply(self.segment.view, self.nvme, offsets, lengths, tiers, total)
        return ReadReply(self.segment.view, offsets, lengths, total)

    def free(self, offset: int, length: int) -> None:
        """The meta freed this range. Its pages stay mapped: the meta may already
        have handed the range to a new put, so touching them here would race with
        that writer. Only counted, for ``stats()``; demotion to NVMe hooks in here."""
        if self.segment.in_bounds(offset, length):
            self.freed_bytes += length

    def stats(self) -> dict[str, int]:
        return {
            "capacity": self.segment.capacity,
            "reads": self.reads,
            "writes": self.writes,
            "read_bytes": self.bytes_read,
            "write_bytes": self.bytes_written,
            "refused": self.refused,
            "freed_bytes": self.freed_bytes,
            "seals": self.seals,
            "sealed_bytes": self.bytes_sealed,
            "replays_refused": self.replays,
            "old_epoch_refused": self.old_epoch,
            "epoch": self.epoch,
            "used_grants": len(self._used),
            "records_persisted": self.recorded,
            "record_failures": self.record_failures,
        }

    def __repr__(self) -> str:
        return f"DataPlaneCore({self.stats()})"
