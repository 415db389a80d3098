"""The storage daemon's decision logic, without I/O: which segment bytes a WRITE
may fill and which a READ may return. The asyncio layer (:mod:`.dataplane`) only
moves bytes to and from the views this returns."""

from __future__ import annotations

from typing import Final

from gcache import capability, wire
from gcache.errors import E_ACCESS_DENIED, E_BAD_REQUEST, E_OUT_OF_RANGE, Refusal
from gcache.storage.segment import Segment

MAX_READ_RANGES: Final = 1 << 16
_VERIFIED_MAX: Final = 1 << 16


class DataPlaneCore:
    __slots__ = (
        "_verified",
        "bytes_read",
        "bytes_written",
        "freed_bytes",
        "reads",
        "refused",
        "secret",
        "segment",
        "writes",
    )

    def __init__(self, segment: Segment, secret: bytes) -> None:
        self.segment = segment
        self.secret = secret
        # Tags already checked: a lease's grants are presented once per layer, so
        # only the first READ of a lease pays for the MACs.
        self._verified: dict[bytes, tuple[bytes, int, int, int]] = {}
        self.reads = self.writes = self.bytes_read = self.bytes_written = 0
        self.refused = self.freed_bytes = 0

    def _check_grant(self, kind: bytes, grant: wire.Grant, now_ms: int) -> None:
        if not self.segment.in_bounds(grant.offset, grant.length):
            raise Refusal(
                E_OUT_OF_RANGE,
                f"range [{grant.offset}, +{grant.length}) lies outside the "
                f"{self.segment.capacity}-byte segment",
            )
        if grant.expiry_ms <= now_ms:
            raise Refusal(E_ACCESS_DENIED, "grant expired")
        seen = self._verified.get(grant.tag)
        if seen == (kind, grant.offset, grant.length, grant.expiry_ms):
            return
        if not capability.check(
            self.secret, kind, grant.offset, grant.length, grant.expiry_ms, grant.tag
        ):
            raise Refusal(E_ACCESS_DENIED, "range not covered by a valid grant")
        if len(self._verified) >= _VERIFIED_MAX:
            self._verified.clear()
        self._verified[grant.tag] = (kind, grant.offset, grant.length, grant.expiry_ms)

    def write_target(self, msg: wire.Write, payload_len: int, now_ms: int) -> memoryview:
        """The segment view a WRITE's payload goes into, or :class:`Refusal`."""
        try:
            g = msg.grant
            if payload_len != g.length:
                raise Refusal(
                    E_BAD_REQUEST,
                    f"payload of {payload_len} bytes does not match the granted {g.length} bytes",
                )
            self._check_grant(capability.KIND_WRITE, g, now_ms)
        except Refusal:
            self.refused += 1
            raise
        self.writes += 1
        self.bytes_written += payload_len
        return self.segment.view[g.offset : g.offset + g.length]

    def read_views(self, msg: wire.Read, now_ms: int) -> tuple[list[memoryview], int]:
        """The segment views a READ returns, in order, and their total size."""
        try:
            if len(msg.ranges) > MAX_READ_RANGES:
                raise Refusal(E_BAD_REQUEST, f"more than {MAX_READ_RANGES} ranges")
            for grant in msg.grants:
                self._check_grant(capability.KIND_READ, grant, now_ms)
            views: list[memoryview] = []
            total = 0
            seg = self.segment.view
            grants = msg.grants
            for gi, off, length in msg.ranges:
                if not 0 <= gi < len(grants):
                    raise Refusal(E_BAD_REQUEST, f"range names grant {gi} of {len(grants)}")
                g = grants[gi]
                if length <= 0 or off < g.offset or off + length > g.offset + g.length:
                    raise Refusal(
                        E_OUT_OF_RANGE,
                        f"range [{off}, +{length}) is not inside its grant "
                        f"[{g.offset}, +{g.length})",
                    )
                views.append(seg[off : off + length])
                total += length
        except Refusal:
            self.refused += 1
            raise
        self.reads += 1
        self.bytes_read += total
        return views, total

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
        }

    def __repr__(self) -> str:
        return f"DataPlaneCore({self.stats()})"
