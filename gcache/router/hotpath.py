"""The router's framed hot path (same wire module and transport as the meta):
``ROUTE``, ``REPORT_HITS``, ``REPORT_LOAD``, ``PING``; and its own client of the
meta's hot path for the pool match (``LOOKUP`` without a lease)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence

from gcache import wire
from gcache.errors import (
    E_BAD_REQUEST,
    E_INTERNAL,
    E_NOT_LEADER,
    GCacheError,
    InvalidBody,
    ProtocolError,
    Refusal,
    SendTimeout,
)
from gcache.leader import MetaFinder, is_etcd
from gcache.router.service import RouterCore
from gcache.transport.framing import peek_array_field
from gcache.transport.limits import (
    Conn,
    ConnectionLimiter,
    RateLimitedLog,
    accept_admitted,
)
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


class RouterHotPath:
    def __init__(self, core: RouterCore, listener: socket.socket, pool: PoolMatcher | None) -> None:
        self.core = core
        self.listener = listener
        self.pool = pool
        cfg = core.cfg
        self.max_body = cfg.max_body_bytes
        self.send_timeout = cfg.send_timeout_s
        self.limiter = ConnectionLimiter(
            cfg.max_connections, cfg.max_connections_per_peer, cfg.idle_timeout_s
        )
        self.connections: set[asyncio.Task[None]] = set()
        self.protocol_errors = 0
        self.bad_frame_log = RateLimitedLog(log)
        self.refused_log = RateLimitedLog(log)
        self.check_body = route_key_check(MAX_ROUTE_KEYS)

    def stats(self) -> dict[str, int]:
        return {
            **self.limiter.stats(),
            "protocol_errors": self.protocol_errors,
            **self.bad_frame_log.stats("bad_frames"),
            **self.refused_log.stats("refused_connections"),
        }

    async def route(self, msg: wire.Route) -> wire.Routed:
        pool = await self.pool.match(msg.keys) if self.pool is not None else 0
        return self.core.route(msg.keys, msg.tokens, time.monotonic(), pool, msg.request_id)

    async def handle(self, msg_type: int, msg: object) -> wire.Msg:
        if msg_type == wire.T_ROUTE:
            assert isinstance(msg, wire.Route)
            return await self.route(msg)
        return self.core.dispatch(msg_type, msg, time.monotonic())

    async def serve_connection(self, sock: socket.socket, conn: Conn | None = None) -> None:
        stream = FrameStream(sock, max_body=self.max_body, send_timeout=self.send_timeout)
        if conn is not None:
            conn.close = stream.close
        try:
            while True:
                if conn is not None:
                    conn.idle_since = time.monotonic()
                head = await stream.recv_head()
                if head is None:
                    return
                try:
                    msg = await stream.recv_body(head, self.check_body)
                    if conn is not None:
                        conn.idle_since = None
                except InvalidBody as exc:
                    self.core.counters["refused"] += 1
                    await stream.send_msg(wire.Error(E_BAD_REQUEST, str(exc)), head.req_id)
                    continue
                try:
                    reply = await self.handle(head.msg_type, msg)
                except Refusal as r:
                    self.core.counters["refused"] += 1
                    reply = wire.Error(r.code, r.message)
                except Exception as exc:  # a bug must not take the router down
                    log.exception("internal error handling message type %d", head.msg_type)
                    reply = wire.Error(E_INTERNAL, f"internal error: {exc!r}")
                del msg
                await stream.send_msg(reply, head.req_id)
        except ProtocolError as exc:
            self.protocol_errors += 1
            self.bad_frame_log.log(
                time.monotonic(), "closing router connection from %s: %s", stream.peer, exc
            )
        except SendTimeout as exc:
            self.limiter.send_timeouts += 1
            self.refused_log.log(time.monotonic(), "closing router connection: %s", exc)
        except GCacheError as exc:
            log.debug("router connection from %s ended: %s", stream.peer, exc)
        except Exception:
            log.exception("internal error on router connection from %s", stream.peer)
        finally:
            stream.close()
            if conn is not None:
                self.limiter.release(conn)

    async def accept_loop(self) -> None:
        """Accept, admit through the connection limits, serve (``accept_admitted``)."""
        await accept_admitted(
            self.listener,
            self.limiter,
            self.refused_log,
            "router",
            self.serve_connection,
            self.connections,
            lambda: self.listener.fileno() < 0,
        )

    async def close(self) -> None:
        self.listener.close()
        for t in self.connections:
            t.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
