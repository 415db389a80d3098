"""How a layer's bytes move from a server into the caller's arrays: one
:class:`Transport` per way, behind one interface, chosen per server and tier by
:meth:`Transports.route`.

* :class:`ShmTransport`: a local server's DRAM objects, copied out of its mapped
  segment and verified in one native call (no socket, no server CPU).
* :class:`StagedTransport`: a local server's NVMe objects, which the server reads
  into its staging file (:mod:`gcache_client.staged`) for the client to copy out.
* :class:`TcpTransport`: everything else, ``READ`` over the server's pipelined
  connection, verified after it lands.

A transport reads and verifies its shares of a layer, raises
:class:`~gcache.errors.IntegrityError` on a checksum mismatch, and hands back the
shares it could not take (a server without staging room), which the next
transport in order reads; TCP takes everything. This is where a future transport
goes (RDMA, GPU-direct): a class with ``read_layer``, placed before TCP in
:attr:`Transports.order` and chosen by :meth:`Transports.route`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from gcache import wire
from gcache.errors import IntegrityError
from gcache.transport.shm import MappedSegment
from gcache_client.conn import gather_or_cancel
from gcache_client.plans import PlanKey, ServerPlan, copy_verify, halves, verify
from gcache_client.pool import ConnectionPool
from gcache_client.staged import STAGED_INLINE_BLOCKS, StagingMaps, read_staged

T = TypeVar("T")


class OrderedCopies(Protocol):
    """A stream's ordered copy thread (:class:`gcache_client.layers.LayerReads`)."""

    @property
    def ordered(self) -> bool: ...

    async def copy(self, fn: Callable[..., T], *args: Any) -> T: ...


class Share(NamedTuple):
    """One server's (and tier's) part of a layer read."""

    addr: wire.ServerAddr
    plan: ServerPlan
    nvme: bool  # tier 1: the server reads its disk
    seg: MappedSegment | None  # the server's segment, mapped here (shared memory)


class LayerJob(NamedTuple):
    """What every transport needs to know of the layer being read."""

    layer: int
    nbytes: int  # K and V of the layer
    big: bool  # large and offloaded: copy and verify on the copy threads
    reads: OrderedCopies | None  # a stream's ordered copy thread


class Transport(Protocol):
    async def read_layer(self, job: LayerJob, shares: list[Share]) -> list[Share]:
        """Read and verify ``shares`` into the caller's arrays; return the shares
        this transport could not take (the next one in order reads them)."""
        ...


def _mismatch(job: LayerJob) -> IntegrityError:
    return IntegrityError(f"layer {job.layer}: checksum mismatch")


class ShmTransport:
    """Copy out of a mapped segment and verify, in one native call per share:
    inline for small layers, on the stream's ordered copy thread or split across
    the copy threads for large offloaded ones."""

    def __init__(self, pool: ConnectionPool, counters: Counter[str]) -> None:
        self.pool = pool
        self.counters = counters

    async def read_layer(self, job: LayerJob, shares: list[Share]) -> list[Share]:
        reads = job.reads
        for share in shares:
            seg, sp = share.seg, share.plan
            assert seg is not None
            if job.big and reads is not None and reads.ordered:  # a stream's, in layer order
                ok = await reads.copy(copy_verify, seg, sp, 0, sp.count)
            elif job.big:  # copy + verify, half of the blocks on each copy thread
                parts = halves(sp.count, sp.nbytes)
                ok = all(
                    await gather_or_cancel(
                        *(self.pool.offload(copy_verify, seg, sp, a, b) for a, b in parts)
                    )
                )
            else:
                ok = copy_verify(seg, sp, 0, sp.count)
            if not ok:
                raise _mismatch(job)
            self.counters["bytes_read_shm"] += sp.nbytes
        return []


class StagedTransport:
    """Tier-1 objects of a server on this host through its staging file; a server
    without room hands its shares on (to TCP)."""

    def __init__(
        self, pool: ConnectionPool, staging: StagingMaps, counters: Counter[str], timeout_s: float
    ) -> None:
        self.pool = pool
        self.staging = staging
        self.counters = counters
        self.timeout_s = timeout_s

    async def read_layer(self, job: LayerJob, shares: list[Share]) -> list[Share]:
        left: list[Share] = []
        for share in shares:
            sp = share.plan
            if job.big and sp.count > STAGED_INLINE_BLOCKS:  # else a thread hop costs more
                await self.pool.offload(sp.materialize)
            conn = await self.pool.server(share.addr)
            offload = self.pool.offload if job.big else None
            ok = await read_staged(
                conn, share.addr.server_id, sp, self.staging, offload, self.timeout_s
            )
            if ok is None:
                left.append(share)
                continue
            if not ok:
                raise _mismatch(job)
            self.counters["bytes_read_nvme"] += sp.nbytes
        return left


class TcpTransport:
    """``READ`` from every share's server at once, into the caller's views; then
    every block verified (split across the copy threads for a large layer)."""

    def __init__(self, pool: ConnectionPool, counters: Counter[str], timeout_s: float) -> None:
        self.pool = pool
        self.counters = counters
        self.timeout_s = timeout_s

    async def read_layer(self, job: LayerJob, shares: list[Share]) -> list[Share]:
        if not shares:
            return []
        conns = []
        for share in shares:
            conns.append(await self.pool.server(share.addr))
            if share.nvme:
                self.counters["bytes_read_nvme"] += share.plan.nbytes
        if job.big:
            for share in shares:
                await self.pool.offload(share.plan.materialize)
        timeout = self.timeout_s
        await gather_or_cancel(
            *(
                conn.call(
                    wire.Read(s.plan.grants, s.plan.ranges), dest=s.plan.dest, timeout=timeout
                )
                for conn, s in zip(conns, shares, strict=True)
            )
        )
        checks = [c for s in shares for c in s.plan.checks]
        if job.big:
            parts = halves(len(checks), job.nbytes)
            jobs = (self.pool.offload(verify, checks[a:b]) for a, b in parts)
            ok = all(await gather_or_cancel(*jobs))
        else:
            ok = verify(checks)
        if not ok:
            raise _mismatch(job)
        return []


class Transports:
    """The client's transports, in the order a layer's shares go through them
    (each hands what it cannot take to the next), and the rule that picks one."""

    def __init__(
        self, pool: ConnectionPool, staging: StagingMaps, counters: Counter[str], timeout_s: float
    ) -> None:
        self.pool = pool
        self.shm = ShmTransport(pool, counters)
        self.staged = StagedTransport(pool, staging, counters, timeout_s)
        self.tcp = TcpTransport(pool, counters, timeout_s)
        self.order: tuple[Transport, ...] = (self.shm, self.staged, self.tcp)

    def route(
        self, servers: list[wire.ServerAddr], plans: dict[PlanKey, ServerPlan]
    ) -> dict[Transport, list[Share]]:
        """Each share's transport: a server whose segment is mapped here reads
        DRAM over shared memory and NVMe through its staging file; others TCP.
        Raises :class:`~gcache.errors.ConnectionLost` for a lease from before a
        local server restarted (a miss)."""
        out: dict[Transport, list[Share]] = {}
        for key, sp in plans.items():
            addr = servers[key.server]
            seg = self.pool.mapped(addr)
            t: Transport = self.tcp if seg is None else self.staged if key.nvme else self.shm
            out.setdefault(t, []).append(Share(addr, sp, key.nvme, seg))
        return out
