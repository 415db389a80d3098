"""The storage server's control loop: find the meta (the one configured, or the
leader of several), register with it over gRPC, heartbeat (counters, tier
reports) and apply what the replies carry (frees, adoptions, demotions)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from typing import Any

import grpc

from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import aio_channel, load_cluster_token
from gcache.config import ServerConfig
from gcache.errors import GCacheError
from gcache.leader import MetaFinder
from gcache.server.core import DataPlaneCore
from gcache.server.dataplane import DataPlane
from gcache.server.tiers import TierState
from gcache.storage.segment import Segment

log = logging.getLogger("gcache.server")

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


class ControlLoop:
    """Registration and heartbeats of one server. ``server_id``, ``port``,
    ``segment``, ``core`` and ``tiers`` are set by the lifecycle once the data
    plane is listening and the segment is open."""

    def __init__(self, cfg: ServerConfig, dataplane: DataPlane, stopping: asyncio.Event) -> None:
        self.cfg = cfg
        self.dataplane = dataplane
        self._stopping = stopping
        # The meta (or metas, or etcd) to follow (gcache/leader.py).
        self.finder = MetaFinder(cfg.meta)
        self.meta_switches = 0  # times it looked for the leader again
        self.old_epoch_replies = 0  # heartbeat replies of an older meta, ignored
        self.secret = os.urandom(16)
        self.incarnation = random.getrandbits(63)
        self.server_id = cfg.server_id
        self.port = cfg.port
        self.segment: Segment | None = None
        self.core: DataPlaneCore | None = None
        self.tiers: TierState | None = None
        # Read before anything starts, so a bad token file fails fast.
        self.cluster_token = load_cluster_token(cfg.cluster_token_file)
        self.fatal: GCacheError | None = None  # why the control loop gave up
        self.registrations = 0
        self.heartbeat_failures = 0
        self.beat_soon = asyncio.Event()  # a demotion batch finished: heartbeat now

    def stats(self) -> dict[str, int]:
        return {"meta_switches": self.meta_switches, "old_epoch_replies": self.old_epoch_replies}

    def _counters(self) -> pb.ServerCounters:
        core = self.core
        dp = self.dataplane
        assert core is not None
        return pb.ServerCounters(
            reads=core.reads,
            writes=core.writes,
            read_bytes=core.bytes_read,
            write_bytes=core.bytes_written,
            errors=core.refused + dp.protocol_errors,
            connections=len(dp.connections),
            freed_bytes=core.freed_bytes,
            connections_accepted=dp.limiter.accepted,
            connections_refused=dp.limiter.refused_total + dp.limiter.refused_peer,
            connections_idle_closed=dp.limiter.idle_closed,
            connections_send_timeouts=dp.limiter.send_timeouts,
            protocol_errors=dp.protocol_errors,
            bad_frames_suppressed=dp.bad_frame_log.suppressed,
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
                    self.tiers.registered()
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
        soon = self.beat_soon
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
        soon_s = 0.0  # > 0: the last reply asked for the next beat this soon (DRAM pressure)
        while not self._stopping.is_set():
            if more:
                await asyncio.sleep(0)  # yield to the data path, then heartbeat
                if self._stopping.is_set():
                    return
            elif await self._pause(min(interval, soon_s) if soon_s > 0 else interval, failing > 0):
                return
            more = False
            self.beat_soon.clear()  # this beat carries every result so far
            beat = pb.HeartbeatRequest(
                server_id=self.server_id,
                incarnation=self.incarnation,
                counters=self._counters(),
            )
            if self.tiers is not None:
                self.tiers.fill_heartbeat(beat)
                self.tiers.beat_sent()
            try:
                reply = await stub.Heartbeat(beat, timeout=max(interval, 1.0))
            except grpc.aio.AioRpcError as exc:
                if self.tiers is not None:
                    self.tiers.unsent(beat)  # reported again in the next heartbeat
                self.heartbeat_failures += 1
                if not failing:  # one line per outage, not one per beat
                    log.warning("heartbeat to meta %s failed: %s", where, exc.details())
                failing += 1
                soon_s = 0.0
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
                self.tiers.beat_answered()
            if reply.reregister:
                log.warning("meta does not know this server; registering again")
                await self.register(stub, where)
            else:
                more = reply.more
                soon_s = reply.next_beat_s
