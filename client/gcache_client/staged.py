"""Tier-1 reads through a local server's staging file.

For a server on this host whose segment the client maps, an NVMe object is not
sent over loopback TCP: ``READ_STAGED`` has the server read it from its disk into
a range of its staging file (a tmpfs file, mapped here once per server), then the
client copies it out into the caller's buffers and checksums it in the same pass
(``gcache._native.copy_checksums``, :meth:`MappedSegment.read_checksums`), and
gives the range back: on its next ``READ_STAGED`` to that server
(``ReadStaged.release``), or with an ``UNSTAGE`` within :data:`RELEASE_DELAY_S`
when no read came. Nothing is copied after the range's expiry;
a server without room answers an error and the read goes over TCP instead."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from gcache import wire
from gcache.errors import E_BAD_REQUEST, E_BUSY, GCacheError, RemoteError
from gcache.transport.shm import MappedSegment
from gcache_client.conn import PipelinedConn
from gcache_client.plans import ServerPlan

Offload = Callable[..., Awaitable[Any]]
RELEASE_DELAY_S = 0.002  # a range not given back with a read by then: UNSTAGE
# A plan of at most this many blocks is made on the event loop (a few us a block),
# not on a copy thread: one thread hop fewer per read of a large 1-block object.
STAGED_INLINE_BLOCKS = 64


class StagingMaps:
    """The staging file of each local server, mapped on first use (a server that
    restarted names a new file: the old mapping is retired)."""

    def __init__(self) -> None:
        self._maps: dict[str, MappedSegment] = {}  # server id -> mapping
        self._lock = threading.Lock()
        self.reads = self.bytes = self.fallbacks = self.unstages = 0
        # Ranges done with, per connection, not yet given back (event loop only).
        self._done: dict[PipelinedConn, list[int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def take_done(self, conn: PipelinedConn) -> list[int]:
        return self._done.pop(conn, [])

    def done_with(self, conn: PipelinedConn, stage_id: int, timeout: float) -> None:
        """Give ``stage_id`` back with the connection's next read, or an ``UNSTAGE``
        shortly after."""
        ids = self._done.get(conn)
        if ids is not None:
            ids.append(stage_id)
            return
        self._done[conn] = [stage_id]

        async def flush() -> None:
            await asyncio.sleep(RELEASE_DELAY_S)
            ids = self._done.pop(conn, [])
            if ids and not conn.closed:
                self.unstages += 1
                try:
                    await conn.call(wire.Unstage(ids), timeout=timeout)
                except (GCacheError, TimeoutError):
                    pass  # the server frees them at expiry or when the connection closes

        task = asyncio.get_running_loop().create_task(flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        for t in list(self._tasks):
            t.cancel()

    def stats(self) -> dict[str, int]:
        return {
            "staged_reads": self.reads,
            "bytes_read_staged": self.bytes,
            "staged_fallbacks": self.fallbacks,
            "staged_unstage_calls": self.unstages,
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
        msg = wire.ReadStaged(sp.grants, sp.ranges, maps.take_done(conn))
        staged = await conn.call(msg, timeout=timeout)
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
        maps.done_with(conn, staged.stage_id, timeout)
    maps.reads += 1
    maps.bytes += sp.nbytes
    return bool(sums == b"".join(c[2] for c in sp.checks))
