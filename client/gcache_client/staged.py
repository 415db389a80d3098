"""Tier-1 reads through a local server's staging file (issue 10, round four).

For a server on this host whose segment the client maps, an NVMe object is not
sent over loopback TCP: ``READ_STAGED`` has the server read it from its disk into
a range of its staging file (a tmpfs file, mapped here once per server), then the
client copies it out into the caller's buffers and checksums it in the same pass
(``gcache._native.copy_checksums``, :meth:`MappedSegment.read_checksums`), and
gives the range back (``UNSTAGE``). Nothing is copied after the range's expiry;
a server without room answers an error and the read goes over TCP instead."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

from gcache import wire
from gcache.errors import E_BAD_REQUEST, E_BUSY, RemoteError
from gcache.transport.shm import MappedSegment
from gcache_client.conn import PipelinedConn
from gcache_client.plans import ServerPlan

Offload = Callable[..., Awaitable[Any]]


class StagingMaps:
    """The staging file of each local server, mapped on first use (a server that
    restarted names a new file: the old mapping is retired)."""

    def __init__(self) -> None:
        self._maps: dict[str, MappedSegment] = {}  # server id -> mapping
        self._lock = threading.Lock()
        self.reads = self.bytes = self.fallbacks = 0

    def get(self, server_id: str, path: str) -> MappedSegment:
        with self._lock:
            seg = self._maps.get(server_id)
            if seg is not None and seg.path == path and not seg.retired:
                return seg
        new = MappedSegment(path, populate=True)
        with self._lock:
            old = self._maps.get(server_id)
            self._maps[server_id] = new
        if old is not None:
            old.retire()
        return new

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            m.retire()

    def stats(self) -> dict[str, int]:
        return {
            "staged_reads": self.reads,
            "bytes_read_staged": self.bytes,
            "staged_fallbacks": self.fallbacks,
        }


async def read_staged(
    conn: PipelinedConn,
    server_id: str,
    sp: ServerPlan,
    maps: StagingMaps,
    offload: Offload | None,
    timeout: float,
) -> bool | None:
    """Read one server's tier-1 share of a layer through its staging file and
    verify it. True: done and verified; False: a checksum mismatch (a miss); None:
    the server has no staging room (read it over TCP instead)."""
    try:
        staged = await conn.call(wire.ReadStaged(sp.grants, sp.ranges), timeout=timeout)
    except RemoteError as exc:
        if exc.code in (E_BUSY, E_BAD_REQUEST):
            maps.fallbacks += 1
            return None
        raise
    try:
        seg = maps.get(server_id, staged.path)
        spans = [(o, n) for o, (_, _, n) in zip(staged.offsets, sp.ranges, strict=True)]
        expiry = min(staged.expiry_ms, sp.expiry)
        if offload is not None:
            sums = await offload(seg.read_checksums, spans, sp.dest, 2, expiry)
        else:
            sums = seg.read_checksums(spans, sp.dest, 2, expiry)
    finally:
        await conn.call(wire.Unstage([staged.stage_id]), timeout=timeout)
    maps.reads += 1
    maps.bytes += sp.nbytes
    return bool(sums == b"".join(c[2] for c in sp.checks))
