"""The router's framed hot path (same wire module and transport as the meta):
``ROUTE``, ``REPORT_HITS``, ``REPORT_LOAD``, ``PING``; and its own client of the
meta's hot path for the pool match (``LOOKUP`` without a lease)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from typing import ClassVar

from gcache import wire
from gcache.errors import (
    E_NOT_LEADER,
    GCacheError,
    InvalidBody,
    Refusal,
)
from gcache.leader import MetaFinder, is_etcd
from gcache.router.service import RouterCore
from gcache.transport.daemon import Connection, FramedDaemon, Handler
from gcache.transport.framing import peek_array_field
from gcache.transport.limits import ConnectionLimiter, RateLimitedLog
from gcache.transport.stream import BodyCheck, FrameStream

log = logging.getLogger("gcache.router.hotpath")
MAX_ROUTE_KEYS = 1 << 17


class PoolMatcher:
    """Window-safe blocks the GCache pool holds for a prompt: one lease-free
    ``LOOKUP`` on the meta's hot path, one request at a time on one connection.
    A failure or a timeout counts as no pool hit (and drops the connection, so a
    late reply can never answer the next request); failures are logged at a
    bounded rate. With ``token`` set, each new connection first sends ``HELLO``
    with it, so a meta with a tenant table serves the lookups (the token's tenant
    must be allowed the namespace).

    ``addr``: the meta's hot path ``H:P``, several as ``H:P,H:P`` or
    ``etcd://HOST:PORT/PREFIX``: with more than one meta the matcher follows the
    leader (a standby's ``E_NOT_LEADER`` names it; etcd names it), and a lookup
    while none answers counts as no pool hit."""

    def __init__(
        self, addr: str, namespace: bytes, timeout_s: float, token: str | None = None
    ) -> None:
        self.finder = MetaFinder(addr, "" if is_etcd(addr) else addr)
        self.host, self.port = "", 0
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._token = token
        self._stream: FrameStream | None = None
        self._lock = asyncio.Lock()
        self._req = 0
        self.lookups = 0
        self.failures = 0
        self.last_error = ""
        self.fail_log = RateLimitedLog(log)

    async def _request(self, stream: FrameStream, msg: wire.Msg) -> tuple[int, object]:
        self._req = (self._req + 1) & 0xFFFFFFFF
        await stream.send_msg(msg, self._req)
        frame = await stream.recv_frame()
        if frame is None:
            raise GCacheError("meta closed the connection")
        head, reply = frame
        if head.req_id != self._req:
            raise GCacheError("reply out of order")
        return head.msg_type, reply

    async def _connect(self) -> FrameStream:
        found = await self.finder.find(self.timeout_s)
        if found is None:
            raise GCacheError("no meta leader named in etcd")
        host, _, port = found[0].rpartition(":")
        self.host, self.port = host, int(port)
        try:
            stream = await FrameStream.connect(self.host, self.port, self.timeout_s)
        except OSError:
            self.finder.failed()  # the next match tries the next meta of a list
            raise
        if self._token is not None:
            try:
                _, reply = await self._request(stream, wire.Hello(self._token))
            except BaseException:
                stream.close()
                raise
            if not isinstance(reply, wire.Ok):
                stream.close()
                why = reply.message if isinstance(reply, wire.Error) else "unexpected reply"
                raise GCacheError(f"meta refused the router's access token (HELLO): {why}")
        return stream

    async def _call(self, keys: Sequence[bytes]) -> int:
        if self._stream is None or self._stream.closed:
            self._stream = await self._connect()
        stream = self._stream
        msg_type, reply = await self._request(stream, wire.Lookup(self.namespace, list(keys)))
        if isinstance(reply, wire.Error):
            if reply.code == E_NOT_LEADER:  # a standby: the next match asks the leader
                self.finder.failed(reply.message)
            raise GCacheError(f"meta refused the lookup: {reply.message}")
        if not isinstance(reply, wire.LookupResult):
            raise GCacheError(f"unexpected reply type {msg_type}")
        return int(reply.blocks)

    async def match(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        async with self._lock:
            self.lookups += 1
            try:
                return await asyncio.wait_for(self._call(keys), self.timeout_s)
            except (TimeoutError, GCacheError, OSError) as exc:
                self.failures += 1
                self.last_error = str(exc) or type(exc).__name__
                self.fail_log.log(
                    time.monotonic(),
                    "router: pool match at meta %s:%d failed (routed with no pool hit): %s",
                    self.host,
                    self.port,
                    self.last_error,
                )
                if self._stream is not None:
                    self._stream.close()
                    self._stream = None
                return 0

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def stats(self) -> dict[str, int]:
        return {
            "lookups": self.lookups,
            "failures": self.failures,
            **self.fail_log.stats("failures"),
        }


def route_key_check(max_keys: int) -> BodyCheck:
    def check(head: wire.FrameHead, body: memoryview) -> None:
        if head.msg_type == wire.T_ROUTE:
            n = peek_array_field(body, 0)
            if n is not None and n > max_keys:
                raise InvalidBody(f"{n} keys exceed the router's limit ({max_keys})")

    return check


async def route(c: RouterConnection, head: wire.FrameHead, msg: wire.Route) -> wire.Msg:
    """``ROUTE``: the pool match (a lookup on the meta) then the core's choice."""
    d = c.daemon
    pool = await d.pool.match(msg.keys) if d.pool is not None else 0
    return d.core.route(msg.keys, msg.tokens, time.monotonic(), pool, msg.request_id)


def report_hits(c: RouterConnection, head: wire.FrameHead, msg: wire.ReportHits) -> wire.Msg:
    return c.daemon.core.report_hits(msg, time.monotonic())


def report_load(c: RouterConnection, head: wire.FrameHead, msg: wire.ReportLoad) -> wire.Msg:
    return c.daemon.core.report_load(msg, time.monotonic())


def ping(c: RouterConnection, head: wire.FrameHead, msg: wire.Ping) -> wire.Msg:
    return wire.Ok(0)


class RouterConnection(Connection):
    daemon: RouterHotPath
    # Message type -> the function that serves it.
    handlers: ClassVar[Mapping[int, Handler]] = {
        wire.T_ROUTE: route,
        wire.T_REPORT_HITS: report_hits,
        wire.T_REPORT_LOAD: report_load,
        wire.T_PING: ping,
    }


class RouterHotPath(FramedDaemon):
    connection_class = RouterConnection

    def __init__(self, core: RouterCore, listener: socket.socket, pool: PoolMatcher | None) -> None:
        cfg = core.cfg
        super().__init__(
            listener,
            what="router",
            log=log,
            limiter=ConnectionLimiter.of(cfg),
            max_body=cfg.max_body_bytes,
            send_timeout=cfg.send_timeout_s,
            check_body=route_key_check(MAX_ROUTE_KEYS),
        )
        self.core = core
        self.pool = pool

    def refused_request(self, c: Connection, head: wire.FrameHead, r: Refusal) -> None:
        self.core.counters["refused"] += 1
