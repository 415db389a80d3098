"""The client's connections: the meta's hot path, the gRPC control channel, one
pipelined connection per data server, the shared-memory mappings of local
servers, and the copy threads.

* The meta connection is created under a lock: concurrent first calls share one
  connection (and one ``Hello``) instead of racing to open several.
* Each data server's connection is opened under that server's own lock, so a
  connect to a dead or black-holed server holds up only the calls to that server,
  never connects to healthy ones.
* A server's mapping is keyed by its incarnation: when the meta hands out a new
  incarnation (the server restarted) or the segment file goes away (the server was
  dropped; a restarted one removes its dead predecessor's file), the old mapping is
  retired and unmapped once no copy uses it, so a client never pins a dead
  server's segment in tmpfs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from gcache import wire
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import aio_channel, load_client_token
from gcache.config import ClientConfig
from gcache.errors import ClosedError, ConnectionLost, GCacheError
from gcache.leader import MetaFinder
from gcache.transport import shm
from gcache.transport.shm import MappedSegment
from gcache_client.conn import PipelinedConn

log = logging.getLogger("gcache.client")

T = TypeVar("T")


async def run_whole(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` on ``executor``. Cancellation waits for ``fn`` to finish before
    it propagates: ``fn`` may be writing into the caller's buffers, which must be
    left alone once we return."""
    fut = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                continue
        raise


COPY_THREADS: Final = 2
# Mapped segments whose file vanished are looked for at most this often.
SWEEP_S: Final = 1.0


def host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


class _Mapping:
    __slots__ = ("incarnation", "path", "seg")

    def __init__(self, incarnation: int, path: str, seg: MappedSegment | None) -> None:
        self.incarnation = incarnation
        self.path = path
        self.seg = seg


class ConnectionPool:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._token = load_client_token(config.token, config.token_file)
        self._meta: PipelinedConn | None = None
        self._meta_lock = asyncio.Lock()
        self._channel: Any = None
        # The meta (or the leader of several, or the one etcd names; gcache/leader.py)
        # and the (hot, grpc) addresses in use.
        self.finder = MetaFinder(
            config.meta, "" if config.meta.startswith("etcd://") else config.meta_grpc
        )
        self._addr: tuple[str, str] | None = None
        self.leader_changes = 0
        self._data: dict[tuple[str, str, int], PipelinedConn] = {}
        self._data_locks: dict[tuple[str, str, int], asyncio.Lock] = {}
        self._maps: dict[str, _Mapping] = {}
        self._swept = time.monotonic()
        self._copier: ThreadPoolExecutor | None = None
        self._closed = False
        self.retired_mappings = 0

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client closed")

    # ---- meta ------------------------------------------------------------------------

    async def meta(self) -> PipelinedConn:
        self._check_open()
        conn = self._meta
        if conn is not None and not conn.closed:
            return conn
        async with self._meta_lock:
            self._check_open()
            if self._meta is None or self._meta.closed:
                addr = await self._resolve()
                host, port = host_port(addr[0])
                conn = await PipelinedConn.open(host, port, self.config.timeout_s)
                if self._token:  # authenticate before anyone else may use the connection
                    try:
                        await conn.call(wire.Hello(self._token), timeout=self.config.timeout_s)
                    except GCacheError:
                        conn.close()
                        raise
                self._meta = conn
            return self._meta

    async def _resolve(self) -> tuple[str, str]:
        if self._addr is None:
            found = await self.finder.find(min(self.config.timeout_s, 1.0))
            if found is None:
                raise ConnectionLost(f"no meta leader at {self.config.meta} now")
            self._addr = found
        return self._addr

    async def control_stub(self) -> Any:
        """The gRPC stub of the meta in use (the leader, when there are several)."""
        self._check_open()
        if self._channel is None:
            addr = await self._resolve()
            self._channel = aio_channel(addr[1], token=self._token, tls_ca=self.config.tls_ca)
        return pb_grpc.ControlStub(self._channel)

    def control(self) -> Any:
        """The gRPC stub of the configured meta (the first of a list; not for etcd)."""
        self._check_open()
        if self._channel is None:
            grpc_addr = self._addr[1] if self._addr else self.config.meta_grpc.split(",")[0]
            self._channel = aio_channel(grpc_addr, token=self._token, tls_ca=self.config.tls_ca)
        return pb_grpc.ControlStub(self._channel)

    async def meta_failed(self, refusal: str = "") -> None:
        """The meta in use did not serve (dead, paused, a standby): drop its
        connections; the next call finds the leader (``refusal`` may name it)."""
        self.leader_changes += 1
        self._addr = None
        self.finder.failed(refusal)
        conn, self._meta = self._meta, None
        if conn is not None:
            conn.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    # ---- data servers ------------------------------------------------------------------

    async def server(self, addr: wire.ServerAddr) -> PipelinedConn:
        self._check_open()
        key = (addr.server_id, addr.host, addr.port)
        conn = self._data.get(key)
        if conn is not None and not conn.closed:
            return conn
        lock = self._data_locks.get(key)
        if lock is None:
            lock = self._data_locks[key] = asyncio.Lock()
        async with lock:
            self._check_open()
            conn = self._data.get(key)
            if conn is None or conn.closed:
                if conn is not None:
                    del self._data[key]
                conn = await PipelinedConn.open(addr.host, addr.port, self.config.timeout_s)
                self._data[key] = conn
        self._prune_locks()
        return conn

    def _prune_locks(self) -> None:
        """Locks of servers with no connection and nobody waiting go (bounded map)."""
        if len(self._data_locks) <= 2 * len(self._data) + 16:
            return
        for key in [k for k, lk in self._data_locks.items() if not lk.locked()]:
            if key not in self._data:
                del self._data_locks[key]

    # ---- shared memory -----------------------------------------------------------------

    def mapped(self, addr: wire.ServerAddr) -> MappedSegment | None:
        """The server's segment mapped into this process, when the data path is
        shared memory (``transport`` shm, or auto and the server is local). Raises
        :class:`ConnectionLost` when ``addr`` names an incarnation older than the
        one mapped (a lease from before the server restarted: a miss)."""
        mode = self.config.transport
        if mode == "tcp":
            return None
        self.sweep()
        m = self._maps.get(addr.server_id)
        if m is not None and (m.incarnation, m.path) != (addr.incarnation, addr.shm_path):
            if m.seg is not None and m.seg.same_file():
                raise ConnectionLost(
                    f"{addr.server_id}: incarnation {addr.incarnation} is gone "
                    f"(mapped: {m.incarnation})"
                )
            self._retire(addr.server_id)
            m = None
        if m is None:
            seg = None
            if mode == "shm":
                seg = MappedSegment(addr.shm_path, self.config.shm_populate)  # or ConnectionLost
            elif shm.is_local(addr.hostname, addr.shm_path):
                try:
                    seg = MappedSegment(addr.shm_path, self.config.shm_populate)
                except ConnectionLost as exc:
                    log.warning("using TCP for %s: %s", addr.server_id, exc)
            m = self._maps[addr.server_id] = _Mapping(addr.incarnation, addr.shm_path, seg)
        return m.seg

    def sweep(self, now: float | None = None) -> None:
        """Retire mappings whose segment file is gone (at most every ``SWEEP_S``)."""
        now = time.monotonic() if now is None else now
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for sid in [s for s, m in self._maps.items() if m.seg is not None]:
            seg = self._maps[sid].seg
            if seg is not None and not seg.same_file():
                self._retire(sid)

    def _retire(self, server_id: str) -> None:
        m = self._maps.pop(server_id, None)
        if m is not None and m.seg is not None:
            log.info("unmapping the segment of %s (server restarted or gone)", server_id)
            m.seg.retire()
            self.retired_mappings += 1

    # ---- copy threads ------------------------------------------------------------------

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the client's copy threads, so a large copy or checksum does
        not hold up the event loop (and layers already fetched reach the caller).
        Cancellation waits for ``fn`` to finish: it may be writing into the
        caller's buffers, which must be left alone once we return."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="gcache-copy")
        return await run_whole(self._copier, fn, *args)

    # ---- lifecycle ---------------------------------------------------------------------

    async def close(self) -> None:
        self._closed = True
        if self._meta is not None:
            self._meta.close()
        for conn in self._data.values():
            conn.close()
        self._data.clear()
        self._data_locks.clear()
        for sid in list(self._maps):
            self._retire(sid)
        if self._channel is not None:
            await self._channel.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def stats(self) -> dict[str, int]:
        return {
            "data_connections": sum(1 for c in self._data.values() if not c.closed),
            "mapped_segments": sum(1 for m in self._maps.values() if m.seg is not None),
            "retired_mappings": self.retired_mappings,
            "meta_leader_changes": self.leader_changes,
            "abandoned_replies": sum(c.abandoned for c in self._data.values())
            + (self._meta.abandoned if self._meta is not None else 0),
        }
