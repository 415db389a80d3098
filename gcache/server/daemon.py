"""``gcache-server``: one DRAM segment served over the framed TCP data plane.

Structure (uvicorn-style): :class:`StorageServer` owns the listening socket, the
per-connection tasks and the control loop (register + heartbeat over gRPC);
:class:`~gcache.server.core.DataPlaneCore` decides; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gcache import config as cfgmod
from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import aio_channel, load_cluster_token
from gcache.config import ServerConfig
from gcache.errors import (
    E_BAD_REQUEST,
    GCacheError,
    ProtocolError,
    Refusal,
    SendTimeout,
)
from gcache.leader import MetaFinder
from gcache.server.core import DataPlaneCore
from gcache.server.nvme_reads import NvmeReplies, StagedReplies, new_counters, read_staged
from gcache.server.staging import StagingArea, remove_dead_staging_files, staging_path
from gcache.server.tiered import ReadBudget, ReadBuffers, TieredReadReply
from gcache.server.tiers import TierState
from gcache.startup import OneLineParser, install_uvloop, listen_tcp, run_main, setup_logging
from gcache.storage.segment import Segment
from gcache.transport.limits import (
    Conn,
    ConnectionLimiter,
    RateLimitedLog,
    accept_admitted,
)
from gcache.transport.stream import FrameStream

log = logging.getLogger("gcache.server")

# A refused WRITE's payload is drained (keeping the connection) up to this size;
# past it the connection is closed instead of reading gigabytes of junk.
_MAX_DRAIN = 64 << 20


# Registration refusals that retrying cannot fix: the server exits with one line.
_REFUSED = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class _Switch(Exception):
    """The meta tried is not (or no longer) the leader: find it again."""

    def __init__(self, refusal: str) -> None:
        super().__init__(refusal)
        self.refusal = refusal


class StorageServer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        # The meta (or metas, or etcd) to follow (gcache/leader.py).
        self.finder = MetaFinder(cfg.meta)
        self.meta_switches = 0  # times it looked for the leader again
        self.old_epoch_replies = 0  # heartbeat replies of an older meta, ignored
        self.secret = os.urandom(16)
        self.incarnation = random.getrandbits(63)
        self.segment: Segment | None = None
        self.core: DataPlaneCore | None = None
        self.listener: socket.socket | None = None
        self.server_id = cfg.server_id
        self.port = cfg.port
        self.connections: set[asyncio.Task[None]] = set()
        self.total_connections = 0
        self.protocol_errors = 0
        self.limiter = ConnectionLimiter(
            cfg.max_connections, cfg.max_connections_per_peer, cfg.idle_timeout_s
        )
        # Lines a remote peer can provoke at will: bounded rate.
        self.bad_frame_log = RateLimitedLog(log)
        self.refused_log = RateLimitedLog(log)
        # Refused requests and connections that end badly: a client sends those at
        # will too (one line each flooded the log), so they share a bounded rate.
        self.request_log = RateLimitedLog(log, level=logging.INFO)
        self._stopping = asyncio.Event()
        # Control plane: read before anything starts, so a bad token file fails fast.
        self.cluster_token = load_cluster_token(cfg.cluster_token_file)
        self.fatal: GCacheError | None = None  # why the control loop gave up
        self.registrations = 0
        self.heartbeat_failures = 0
        # Issue 10: manifest, NVMe tier, demotions, epoch (gcache/server/tiers.py).
        self.tiers: TierState | None = None
        self._beat_soon = asyncio.Event()  # a demotion batch finished: heartbeat now
        self.read_budget = ReadBudget(256 << 20)  # NVMe reply bytes read ahead
        self.read_buffers = ReadBuffers(256 << 20)  # their buffers, reused
        self.read_pool = concurrent.futures.ThreadPoolExecutor(4, "nvme-read")
        self.nvme_reply_counters = new_counters()  # pipelined tier-1 replies (nvme_reads.py)
        self.staging: StagingArea | None = None  # same-host tier-1 reads (staging.py)

    # ---- data plane --------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Connection counters of the data plane (the core keeps its own), and the
        tiers' (manifest, NVMe, demotions, epoch)."""
        return {
            **self.limiter.stats(),
            "protocol_errors": self.protocol_errors,
            **self.bad_frame_log.stats("bad_frames"),
            **self.refused_log.stats("refused_connections"),
            **self.request_log.stats("refused_requests"),
            "meta_switches": self.meta_switches,
            "old_epoch_replies": self.old_epoch_replies,
            **(self.tiers.stats() if self.tiers is not None else {}),
            "nvme_read_budget_waits": self.read_budget.waits,
            **self.read_buffers.stats(),
            **self.nvme_reply_counters,
            **(self.staging.stats(time.monotonic()) if self.staging is not None else {}),
        }

    async def serve_connection(self, sock: socket.socket, conn: Conn | None = None) -> None:
        stream = FrameStream(
            sock, max_body=self.cfg.max_body_bytes, send_timeout=self.cfg.send_timeout_s
        )
        if conn is not None:
            conn.close = stream.close  # the idle sweeper closes the stream
        core = self.core
        assert core is not None
        nvme: NvmeReplies | None = None  # tier-1 replies being read and sent (issue 10)
        staged: StagedReplies | None = None  # READ_STAGED replies being read (issue 10)
        at_head = False  # waiting for the next frame's header

        def replies_out() -> None:  # the queued tier-1 replies went out: idle again
            if conn is not None and at_head and conn.idle_since is None:
                conn.idle_since = time.monotonic()

        try:
            while True:
                if conn is not None:
                    busy = (nvme is not None and nvme.busy) or (staged is not None and staged.busy)
                    conn.idle_since = None if busy else time.monotonic()
                at_head = True
                head = await stream.recv_head()
                at_head = False
                if head is None:
                    return
                msg = await stream.recv_body(head)
                if nvme is not None and head.msg_type != wire.T_READ:
                    await nvme.drain()  # replies leave in request order
                if staged is not None and head.msg_type != wire.T_READ_STAGED:
                    await staged.drain()
                if conn is not None and not head.payload_len:
                    conn.idle_since = None  # a whole frame: in flight until answered
                now_ms = int(time.time() * 1000)
                if head.msg_type == wire.T_WRITE:
                    try:
                        target = core.write_target(msg, head.payload_len, now_ms)
                    except Refusal as r:
                        self.request_log.log(
                            time.monotonic(), "refused WRITE from %s: %s", stream.peer, r.message
                        )
                        if head.payload_len > _MAX_DRAIN:
                            await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
                            return
                        await stream.discard(head.payload_len)
                        await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
                        continue
                    await stream.recv_into(target)
                    if conn is not None:
                        conn.idle_since = None  # the payload is in: the frame is whole
                    await stream.send_msg(wire.Ok(core.receipt(msg.grant)), head.req_id)
                elif head.msg_type == wire.T_READ:
                    try:
                        reply = core.read_views(msg, now_ms)
                    except Refusal as r:
                        self.request_log.log(
                            time.monotonic(), "refused READ from %s: %s", stream.peer, r.message
                        )
                        if nvme is not None:
                            await nvme.drain()
                        await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
                        continue
                    # The decoded ranges (a tuple each) are spent: not held while a
                    # large reply takes its time to go out; its views are made a
                    # batch at a time as the socket takes them.
                    msg = None
                    if isinstance(reply, TieredReadReply) and reply.nvme_bytes:
                        if nvme is None:
                            nvme = self._nvme_replies(stream, replies_out)
                        await nvme.submit(reply, head.req_id)  # read in pieces, sent in order
                        del reply
                        continue
                    if nvme is not None:
                        await nvme.drain()
                    await stream.send_msg_batches(
                        wire.ReadData(reply.total), head.req_id, reply.batches(), reply.total
                    )
                    del reply
                elif head.msg_type == wire.T_SEAL:
                    try:
                        receipts = core.seal(msg, now_ms)
                    except Refusal as r:
                        self.request_log.log(
                            time.monotonic(), "refused SEAL from %s: %s", stream.peer, r.message
                        )
                        await stream.send_msg(wire.Error(r.code, r.message), head.req_id)
                        continue
                    await stream.send_msg(wire.Sealed(receipts), head.req_id)
                elif head.msg_type == wire.T_PING:
                    await stream.send_msg(wire.Ok(0), head.req_id)
                elif head.msg_type == wire.T_READ_STAGED:
                    if staged is None:
                        staged = StagedReplies(stream, self.nvme_reply_counters, replies_out)
                    await staged.room()  # at most STAGED_AHEAD being read
                    staged.put(self._read_staged(stream, msg, now_ms), head.req_id)
                elif head.msg_type == wire.T_UNSTAGE:
                    n = 0
                    if self.staging is not None:
                        n = sum(self.staging.release(id(stream), i) for i in msg.stage_ids)
                    await stream.send_msg(wire.Ok(n), head.req_id)
                elif head.msg_type == wire.T_SERVER_STATS:
                    values = {k: float(v) for k, v in {**self.stats(), **core.stats()}.items()}
                    await stream.send_msg(wire.ServerStatsReply(values), head.req_id)
                else:
                    await stream.send_msg(
                        wire.Error(E_BAD_REQUEST, f"message type {head.msg_type} not served here"),
                        head.req_id,
                    )
        except ProtocolError as exc:
            self.protocol_errors += 1
            self.bad_frame_log.log(
                time.monotonic(), "closing connection from %s: protocol error: %s", stream.peer, exc
            )
        except SendTimeout as exc:  # a client that stopped reading its replies
            self.limiter.send_timeouts += 1
            self.refused_log.log(time.monotonic(), "closing connection: %s", exc)
        except GCacheError as exc:
            self.request_log.log(time.monotonic(), "connection from %s ended: %s", stream.peer, exc)
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("internal error on connection from %s", stream.peer)
        finally:
            stream.close()
            if nvme is not None and isinstance(await nvme.close(), SendTimeout):
                self.limiter.send_timeouts += 1  # the tier-1 sender's peer stopped reading
            if staged is not None and isinstance(await staged.close(), SendTimeout):
                self.limiter.send_timeouts += 1
            if self.staging is not None:
                self.staging.release_owner(id(stream))  # its staging ranges, if any
            if conn is not None:
                self.limiter.release(conn)

    def _read_staged(
        self, stream: FrameStream, msg: wire.ReadStaged, now_ms: int
    ) -> Awaitable[wire.Msg] | wire.Msg:
        """``READ_STAGED``: tier-1 ranges read into the staging file (staging.py).
        Checked here, in request order; the disk reads are the returned awaitable
        (:class:`StagedReplies` overlaps several of a connection)."""
        assert self.core is not None
        if self.staging is None:
            return wire.Error(E_BAD_REQUEST, "no staging area")
        for rid in msg.release:  # ranges the client is done with (instead of UNSTAGE)
            self.staging.release(id(stream), rid)
        try:
            reply = self.core.read_views(wire.Read(msg.grants, msg.ranges), now_ms)
        except Refusal as r:
            self.request_log.log(
                time.monotonic(), "refused READ_STAGED from %s: %s", stream.peer, r.message
            )
            return wire.Error(r.code, r.message)
        if not isinstance(reply, TieredReadReply):
            return wire.Error(E_BAD_REQUEST, "READ_STAGED is for tier-1 ranges only")
        return read_staged(reply, self.staging, self.read_pool, id(stream))

    def _nvme_replies(self, stream: FrameStream, on_idle: Callable[[], None]) -> NvmeReplies:
        def failed(line: str) -> None:
            self.request_log.log(time.monotonic(), "%s (peer %s)", line, stream.peer)

        return NvmeReplies(
            stream,
            self.read_pool,
            self.read_buffers,
            self.read_budget,
            self.nvme_reply_counters,
            failed,
            on_idle,
        )

    async def accept_loop(self) -> None:
        """Accept, admit through the connection limits, serve (``accept_admitted``)."""
        assert self.listener is not None

        async def serve(sock: socket.socket, conn: Conn) -> None:
            self.total_connections += 1
            await self.serve_connection(sock, conn)

        await accept_admitted(
            self.listener,
            self.limiter,
            self.refused_log,
            "",
            serve,
            self.connections,
            self._stopping.is_set,
        )

    # ---- control plane -----------------------------------------------------------

    def _counters(self) -> pb.ServerCounters:
        core = self.core
        assert core is not None
        return pb.ServerCounters(
            reads=core.reads,
            writes=core.writes,
            read_bytes=core.bytes_read,
            write_bytes=core.bytes_written,
            errors=core.refused + self.protocol_errors,
            connections=len(self.connections),
            freed_bytes=core.freed_bytes,
            connections_accepted=self.limiter.accepted,
            connections_refused=self.limiter.refused_total + self.limiter.refused_peer,
            connections_idle_closed=self.limiter.idle_closed,
            connections_send_timeouts=self.limiter.send_timeouts,
            protocol_errors=self.protocol_errors,
            bad_frames_suppressed=self.bad_frame_log.suppressed,
        )

    async def register(self, stub: Any, where: str = "") -> float:
        """Register (again) with the meta; retries while it is unreachable. A refusal
        (bad cluster token, server id held by another live server) is fatal. With
        several metas (``self.finder.several``) a meta that is not the leader (or
        unreachable, or of an older epoch than this server saw) raises
        :class:`_Switch` so the loop finds the leader."""
        assert self.segment is not None
        where = where or self.cfg.meta
        req = pb.RegisterServerRequest(
            server_id=self.server_id,
            host=self.cfg.advertise_host or self.cfg.host,
            port=self.port,
            hostname=socket.gethostname(),
            shm_path=self.segment.path,
            capacity=self.segment.capacity,
            secret=self.secret,
            incarnation=self.incarnation,
        )
        if self.tiers is not None:
            self.tiers.fill_registration(req)
        several = self.finder.several
        delay = 0.1
        while not self._stopping.is_set():
            try:
                reply = await stub.RegisterServer(req, timeout=5.0 if not several else 2.0)
                assert self.core is not None
                if several and reply.epoch < self.core.epoch:
                    raise _Switch(
                        f"meta {where} has epoch {reply.epoch}, older than {self.core.epoch}"
                    )
                self.registrations += 1
                log.info(
                    "registered with meta %s as %s (epoch %d)", where, self.server_id, reply.epoch
                )
                # Older metas' grants and commands are refused from now on.
                self.core.epoch = max(self.core.epoch, reply.epoch) if several else reply.epoch
                if self.tiers is not None:
                    await self.tiers.report(
                        stub, self.server_id, self.incarnation, reply.epoch, reply.report_columns
                    )
                return float(reply.heartbeat_interval_s) or self.cfg.heartbeat_interval_s
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _REFUSED:
                    raise GCacheError(
                        f"meta {where} refused to register server {self.server_id!r}: "
                        f"{exc.details()}"
                    ) from exc
                log.warning("register with meta %s failed: %s", where, exc.details())
                if several:
                    raise _Switch(exc.details() or "") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
        return self.cfg.heartbeat_interval_s

    async def _pause(self, interval: float, failing: bool) -> bool:
        """Wait for the next heartbeat: ``interval``, or less once a demotion batch
        finished (``TierState.on_report``): its report frees DRAM in the meta and
        the reply carries the next batch. The loop sends one beat at a time, so at
        most one early beat is in flight; none while the meta is unreachable. True
        when the server is stopping."""
        soon = self._beat_soon
        if failing or not soon.is_set():
            stop = asyncio.ensure_future(self._stopping.wait())
            waits = {stop} if failing else {stop, asyncio.ensure_future(soon.wait())}
            try:
                await asyncio.wait(waits, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return self._stopping.is_set()

    async def control_loop(self, ready: asyncio.Event) -> None:
        try:
            await self._control_loop(ready)
        except GCacheError as exc:
            self.fatal = exc
            self._stopping.set()

    async def _control_loop(self, ready: asyncio.Event) -> None:
        """Find the meta (the one configured, or the leader of several), register,
        heartbeat; with several metas a failed or refused registration or
        heartbeat sends it to the leader again."""
        finder = self.finder
        while not self._stopping.is_set():
            found = await finder.find()
            if found is None:  # etcd names no leader yet, or is unreachable
                self.meta_switches += 1
                await asyncio.sleep(0.2)
                continue
            where = found[1]
            # The channel reconnects at least every 500 ms whatever the outage length
            # (auth.RECONNECT_OPTIONS), so after a meta restart the next heartbeat gets
            # through and is told to re-register: within one interval of the meta.
            async with aio_channel(
                where, token=self.cluster_token, tls_ca=self.cfg.tls_ca
            ) as channel:
                stub = pb_grpc.ControlStub(channel)
                try:
                    await self.register(stub, where)
                    ready.set()
                    await self._heartbeats(stub, where)
                    return
                except _Switch as sw:
                    self.meta_switches += 1
                    finder.failed(sw.refusal)
                    log.info("looking for the meta leader (%s)", sw.refusal or "no answer")
                    await asyncio.sleep(0.05)

    async def _heartbeats(self, stub: Any, where: str) -> None:
        several = self.finder.several
        interval = self.cfg.heartbeat_interval_s
        failing = 0
        more = False  # the last reply was cut by its bounds: ask again at once
        while not self._stopping.is_set():
            if more:
                await asyncio.sleep(0)  # yield to the data path, then heartbeat
                if self._stopping.is_set():
                    return
            elif await self._pause(interval, failing > 0):
                return
            more = False
            self._beat_soon.clear()  # this beat carries every result so far
            beat = pb.HeartbeatRequest(
                server_id=self.server_id,
                incarnation=self.incarnation,
                counters=self._counters(),
            )
            if self.tiers is not None:
                self.tiers.fill_heartbeat(beat)
            try:
                reply = await stub.Heartbeat(beat, timeout=max(interval, 1.0))
            except grpc.aio.AioRpcError as exc:
                if self.tiers is not None:
                    self.tiers.unsent(beat)  # reported again in the next heartbeat
                self.heartbeat_failures += 1
                if not failing:  # one line per outage, not one per beat
                    log.warning("heartbeat to meta %s failed: %s", where, exc.details())
                failing += 1
                if several:  # the leader died, paused or stepped down: find it
                    raise _Switch(exc.details() or "") from exc
                continue
            assert self.core is not None
            if reply.epoch and reply.epoch < self.core.epoch:
                # A reply of an older meta: none of its commands is applied.
                self.old_epoch_replies += 1
                if several:
                    raise _Switch(f"heartbeat reply of epoch {reply.epoch}")
                continue
            if failing:
                log.info("meta %s reachable again", where)
                failing = 0
            for r in reply.free:
                self.core.free(r.offset, r.length)
            if self.tiers is not None:
                self.tiers.apply(reply)  # free -> adopt, drop_nvme, demote
            if reply.reregister:
                log.warning("meta does not know this server; registering again")
                await self.register(stub, where)
            else:
                more = reply.more

    # ---- lifecycle ---------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.cfg
        # SIGINT/SIGTERM from here on, start-up included, end in the cleanup below:
        # the segment is made (reserved, pre-faulted) on a worker thread a signal
        # cannot cut short, so a stop asked meanwhile is honoured right after it.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        self.listener = listen_tcp(cfg.host, cfg.port, "server.port, --port", 512)
        self.port = self.listener.getsockname()[1]
        if not self.server_id:
            self.server_id = f"{socket.gethostname()}:{self.port}"
        path = os.path.join(cfg.shm_dir, Segment.file_name(self.server_id))
        # A killed predecessor's staging file (with or without a tier now).
        for name in remove_dead_staging_files(cfg.shm_dir, path):
            log.warning("removed staging file %s of a dead process", name)
        try:
            self.tiers = await TierState.open(cfg, self.server_id, path)  # off the loop
        except BaseException:
            self.listener.close()
            raise
        ready = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            await self._start_serving(path, ready, tasks)
            if ready.is_set() and cfg.ready_file:
                with open(cfg.ready_file + ".tmp", "w") as fh:
                    fh.write(f"{cfg.host} {self.port}\n")
                os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
            await self._stopping.wait()
            if self.fatal is not None:
                raise self.fatal
        finally:
            log.info(
                "gcache-server %s stopping%s",
                self.server_id,
                "" if ready.is_set() else " (before it was ready)",
            )
            self.listener.close()
            for t in [*tasks, *self.connections]:
                t.cancel()
            await asyncio.gather(*tasks, *self.connections, return_exceptions=True)
            self.read_pool.shutdown(wait=True)
            self.read_buffers.close()
            if self.staging is not None:
                self.staging.close()  # removes the staging file
            # Keeps the segment and its manifest for the next start, unless this start
            # made it and stopped before registering: then it holds nothing.
            self.tiers.close(keep=ready.is_set() or self.tiers.segment.reused)

    async def _start_serving(
        self, path: str, ready: asyncio.Event, tasks: list[asyncio.Task[None]]
    ) -> None:
        """The rest of start-up (staging file, data and control loops), then wait
        until registered or stopped (``ready``; ``tasks`` gets the loops)."""
        cfg = self.cfg
        assert self.tiers is not None
        self.tiers.on_report = self._beat_soon.set
        self.segment = self.tiers.segment
        self.core = DataPlaneCore(self.segment, self.secret, nvme=self.tiers.nvme)
        if self.tiers.nvme is not None and cfg.staging_size_bytes and not self._stopping.is_set():
            self.staging = await asyncio.to_thread(  # reserves and faults in: off the loop
                StagingArea,
                staging_path(self.segment.path),
                cfg.staging_size_bytes,
                cfg.staging_ttl_s,
                max(cfg.staging_size_bytes // 2, 4096),
            )
        if self._stopping.is_set():
            return
        log.info(
            "gcache-server %s: %d-byte segment at %s, data plane on %s:%d",
            self.server_id,
            self.segment.capacity,
            path,
            cfg.host,
            self.port,
        )
        tasks += [
            asyncio.create_task(self.accept_loop()),
            asyncio.create_task(self.control_loop(ready)),
        ]
        await asyncio.wait(
            [asyncio.create_task(ready.wait()), asyncio.create_task(self._stopping.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="gcache-server",
        description="GCache storage daemon: one DRAM segment in shared memory served "
        "over framed TCP; registers with and heartbeats to gcache-meta.",
    )
    cfgmod.add_arguments(parser, ServerConfig)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)

    def body() -> None:
        cfg = cfgmod.from_args(ServerConfig, args)
        install_uvloop()
        asyncio.run(StorageServer(cfg).run())

    run_main("gcache-server", log, body)


if __name__ == "__main__":
    main()
