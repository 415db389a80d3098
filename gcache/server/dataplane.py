"""The storage server's data plane: the framed-daemon skeleton
(:mod:`gcache.transport.daemon`) with one handler per message type.

:class:`~gcache.server.core.DataPlaneCore` decides; the handlers here only move
bytes. WRITE payloads go straight into the segment (``recv_into``); READ replies
leave as ``sendmsg`` batches of segment views; tier-1 (NVMe) READ replies are read
in pieces and sent in request order by one sender task per connection
(:class:`~gcache.server.nvme_reads.NvmeReplies`), so any other reply of the
connection first waits for them (:meth:`ServerConnection.handle`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any, ClassVar

from gcache import wire
from gcache.config import ServerConfig
from gcache.errors import E_BAD_REQUEST, Refusal, SendTimeout
from gcache.server import nvme_reads
from gcache.server.core import DataPlaneCore
from gcache.server.nvme_reads import NvmeReplies, StagedReplies, new_counters
from gcache.server.staging import StagingArea
from gcache.server.tiered import ReadBudget, ReadBuffers, TieredReadReply
from gcache.transport.daemon import Connection, FramedDaemon, Handler, Reply
from gcache.transport.limits import Conn, ConnectionLimiter, RateLimitedLog
from gcache.transport.stream import FrameStream

log = logging.getLogger("gcache.server")

# A refused WRITE's payload is drained (keeping the connection) up to this size;
# past it the connection is closed instead of reading gigabytes of junk.
MAX_DRAIN = 64 << 20


def _now_ms() -> int:
    return int(time.time() * 1000)


async def write(c: ServerConnection, head: wire.FrameHead, msg: wire.Write) -> None:
    """``WRITE``: the payload goes straight into the segment; the object's record is
    persisted before its receipt."""
    core, stream = c.core, c.stream
    try:
        target = core.write_target(msg, head.payload_len, _now_ms())
    except Refusal as r:
        c.daemon.refused_request(c, head, r)
        if head.payload_len > MAX_DRAIN:
            await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
            c.finished = True  # too much to drain: the connection closes
            return
        await stream.discard(head.payload_len)
        await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
        return
    await stream.recv_into(target)
    if c.conn is not None:
        c.conn.idle_since = None  # the payload is in: the frame is whole
    try:
        rc = core.write_done(msg)
    except Refusal as r:
        c.daemon.request_log_line("WRITE from %s: %s", stream.peer, r.message)
        await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
        return
    await stream.send_msg(wire.Ok(rc), head.req_id)


async def read(c: ServerConnection, head: wire.FrameHead, msg: wire.Read) -> None:
    """``READ``: DRAM ranges as ``sendmsg`` batches of segment views; tier-1 ranges
    read in pieces and sent in request order by the connection's sender task."""
    stream, nvme = c.stream, c.nvme
    try:
        reply = c.core.read_views(msg, _now_ms())
    except Refusal as r:
        c.daemon.refused_request(c, head, r)
        if nvme is not None:
            await nvme.drain()
        await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
        return
    # The decoded ranges (a tuple each) are spent: not held while a large reply
    # takes its time to go out; its views are made a batch at a time as the socket
    # takes them.
    del msg
    if isinstance(reply, TieredReadReply) and reply.nvme_bytes:
        if nvme is None:
            nvme = c.nvme = c.daemon.nvme_replies(stream, c.replies_out)
        await nvme.submit(reply, head.req_id)  # read in pieces, sent in order
        return
    if nvme is not None:
        await nvme.drain()
    await stream.send_msg_batches(
        wire.ReadData(reply.total), head.req_id, reply.batches(), reply.total
    )


def seal(c: ServerConnection, head: wire.FrameHead, msg: wire.Seal) -> wire.Msg:
    return wire.Sealed(c.core.seal(msg, _now_ms()))


def ping(c: ServerConnection, head: wire.FrameHead, msg: wire.Ping) -> wire.Msg:
    return wire.Ok(0)


async def read_staged(c: ServerConnection, head: wire.FrameHead, msg: wire.ReadStaged) -> None:
    """``READ_STAGED``: tier-1 ranges read into the staging file (staging.py).
    Checked here, in request order; the disk reads overlap for several requests
    of a connection (:class:`StagedReplies`), their replies leave in order."""
    staged = c.staged
    if staged is None:
        staged = c.staged = StagedReplies(c.stream, c.daemon.nvme_reply_counters, c.replies_out)
    await staged.room()  # at most STAGED_AHEAD being read
    staged.put(c.daemon.read_staged(c, head, msg, _now_ms()), head.req_id)


def unstage(c: ServerConnection, head: wire.FrameHead, msg: wire.Unstage) -> wire.Msg:
    staging = c.daemon.staging
    n = 0
    if staging is not None:
        n = sum(staging.release(id(c.stream), i) for i in msg.stage_ids)
    return wire.Ok(n)


def server_stats(c: ServerConnection, head: wire.FrameHead, msg: wire.ServerStats) -> wire.Msg:
    stats = {**c.daemon.stats_source(), **c.core.stats()}
    return wire.ServerStatsReply({k: float(v) for k, v in stats.items()})


class ServerConnection(Connection):
    """One client connection of the data plane: its pipelined tier-1 replies."""

    daemon: DataPlane
    # Message type -> the function that serves it.
    handlers: ClassVar[Mapping[int, Handler]] = {
        wire.T_WRITE: write,
        wire.T_READ: read,
        wire.T_SEAL: seal,
        wire.T_PING: ping,
        wire.T_READ_STAGED: read_staged,
        wire.T_UNSTAGE: unstage,
        wire.T_SERVER_STATS: server_stats,
    }

    def __init__(self, daemon: FramedDaemon, stream: FrameStream, conn: Conn | None) -> None:
        super().__init__(daemon, stream, conn)
        core = self.daemon.core
        assert core is not None
        self.core: DataPlaneCore = core
        self.nvme: NvmeReplies | None = None  # tier-1 replies being read and sent
        self.staged: StagedReplies | None = None  # READ_STAGED replies being read

    @property
    def busy(self) -> bool:
        return (self.nvme is not None and self.nvme.busy) or (
            self.staged is not None and self.staged.busy
        )

    def replies_out(self) -> None:
        """The queued tier-1 replies went out: idle again (if waiting for a frame)."""
        conn = self.conn
        if conn is not None and self.at_head and conn.idle_since is None:
            conn.idle_since = time.monotonic()

    def handle(self, head: wire.FrameHead, msg: Any) -> Reply:
        t = head.msg_type
        if (self.nvme is not None and t != wire.T_READ) or (
            self.staged is not None and t != wire.T_READ_STAGED
        ):
            return self._in_order(head, msg)
        return super().handle(head, msg)

    async def _in_order(self, head: wire.FrameHead, msg: Any) -> wire.Msg | None:
        """Replies leave in request order: the queued tier-1 ones go out first."""
        t = head.msg_type
        if self.nvme is not None and t != wire.T_READ:
            await self.nvme.drain()
        if self.staged is not None and t != wire.T_READ_STAGED:
            await self.staged.drain()
        out = super().handle(head, msg)
        if out is None or isinstance(out, wire.Msg):
            return out
        return await out

    def unknown(self, head: wire.FrameHead) -> Reply:
        return wire.Error(E_BAD_REQUEST, f"message type {head.msg_type} not served here")

    async def closed(self) -> None:
        d = self.daemon
        if self.nvme is not None and isinstance(await self.nvme.close(), SendTimeout):
            d.limiter.send_timeouts += 1  # the tier-1 sender's peer stopped reading
        if self.staged is not None and isinstance(await self.staged.close(), SendTimeout):
            d.limiter.send_timeouts += 1
        if d.staging is not None:
            d.staging.release_owner(id(self.stream))  # its staging ranges, if any


class DataPlane(FramedDaemon):
    """The server's framed listener and what its connections share (the tier-1
    read pool, budget and buffers, the staging area)."""

    connection_class = ServerConnection

    def __init__(self, cfg: ServerConfig) -> None:
        super().__init__(
            None,
            what="",
            log=log,
            limiter=ConnectionLimiter.of(cfg),
            max_body=cfg.max_body_bytes,
            send_timeout=cfg.send_timeout_s,
            internal_error_reply=False,
            # Refused requests and connections that end badly: a client sends those
            # at will too (one line each flooded the log), so they share a bounded rate.
            request_log=RateLimitedLog(log, level=logging.INFO),
        )
        self.core: DataPlaneCore | None = None
        self.read_budget = ReadBudget(256 << 20)  # NVMe reply bytes read ahead
        self.read_buffers = ReadBuffers(256 << 20)  # their buffers, reused
        self.read_pool = concurrent.futures.ThreadPoolExecutor(4, "nvme-read")
        self.nvme_reply_counters = new_counters()  # pipelined tier-1 replies
        self.staging: StagingArea | None = None  # same-host tier-1 reads (staging.py)
        self.stats_source = self.stats  # what SERVER_STATS reports besides the core

    def stats(self) -> dict[str, int | float]:  # type: ignore[override]
        return {
            **super().stats(),
            "nvme_read_budget_waits": self.read_budget.waits,
            **self.read_buffers.stats(),
            **self.nvme_reply_counters,
            **(self.staging.stats(time.monotonic()) if self.staging is not None else {}),
        }

    def request_log_line(self, msg: str, *args: object) -> None:
        assert self.request_log is not None
        self.request_log.log(time.monotonic(), msg, *args)

    def read_staged(
        self, c: ServerConnection, head: wire.FrameHead, msg: wire.ReadStaged, now_ms: int
    ) -> Awaitable[wire.Msg] | wire.Msg:
        """Check a ``READ_STAGED`` in request order; the disk reads are the returned
        awaitable (or the refusal, the reply)."""
        assert self.core is not None
        if self.staging is None:
            return wire.Error(E_BAD_REQUEST, "no staging area")
        owner = id(c.stream)
        for rid in msg.release:  # ranges the client is done with (instead of UNSTAGE)
            self.staging.release(owner, rid)
        try:
            reply = self.core.read_views(wire.Read(msg.grants, msg.ranges), now_ms)
        except Refusal as r:
            self.refused_request(c, head, r)
            return wire.Error(r.code, r.message)
        if not isinstance(reply, TieredReadReply):
            return wire.Error(E_BAD_REQUEST, "READ_STAGED is for tier-1 ranges only")
        return nvme_reads.read_staged(reply, self.staging, self.read_pool, owner)

    def nvme_replies(self, stream: FrameStream, on_idle: Any) -> NvmeReplies:
        def failed(line: str) -> None:
            self.request_log_line("%s (peer %s)", line, stream.peer)

        return NvmeReplies(
            stream,
            self.read_pool,
            self.read_buffers,
            self.read_budget,
            self.nvme_reply_counters,
            failed,
            on_idle,
        )

    async def close(self) -> None:
        await super().close()
        self.read_pool.shutdown(wait=True)
        self.read_buffers.close()
        if self.staging is not None:
            self.staging.close()  # removes the staging file
