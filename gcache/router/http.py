"""The router's HTTP front (aiohttp): the OpenAI-compatible proxy, ``/route``,
``/healthz`` and ``/metrics`` (Prometheus text, via ``prometheus-client``).

``POST /v1/completions`` and ``/v1/chat/completions``: the prompt (text, or token
ids) is tokenized as ``router.tokenizer`` says (chat messages rendered with
``gcache_client.textcodec``, the template ``gcache-engine`` uses), keyed, routed,
and the request is forwarded unchanged to the chosen instance; the reply (an SSE
stream included) is passed through chunk by chunk as it arrives. The chosen
instance is named in the ``x-gcache-instance`` reply header. At most
``router.max_proxied`` requests are proxied at once; one past that gets 503.

Bounded like the hot path: request bodies past ``router.max_http_body`` get 413
(aiohttp ``client_max_size``); at most ``router.http_max_connections`` connections
(``http_max_connections_per_peer`` from one address) are open at once, one past
that gets a 503 with the reason and is closed (refusals logged at a bounded rate);
a connection that starts no request for ``router.idle_timeout_s`` (a half-sent
request included) is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gcache.config import parse_size
from gcache.errors import E_NO_INSTANCE, Refusal
from gcache.router.hotpath import PoolMatcher
from gcache.router.service import RouterCore
from gcache.transport.limits import Conn, ConnectionLimiter, RateLimitedLog, idle_sweeper

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("gcache.router.http")
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def busy_response(reason: str) -> bytes:
    """The whole HTTP answer to a connection refused at the limits."""
    body = json.dumps({"error": {"message": f"connection refused: {reason}", "type": "busy"}})
    raw = body.encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw
    )


class _Admitted(asyncio.Protocol):
    """One HTTP connection: admitted through the front's :class:`ConnectionLimiter`
    when it is made (else answered 503 and closed), then handed to aiohttp's
    request handler; its slot is given back when it is lost."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front
        self.inner: asyncio.Protocol | None = None
        self.conn: Conn | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        front = self.front
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        now = time.monotonic()
        conn = front.limiter.admit(host, transport.close, now)
        if isinstance(conn, str):
            front.refused_log.log(now, "router HTTP: refused a connection from %s: %s", host, conn)
            transport.write(busy_response(conn))
            transport.close()
            return
        self.conn, self.transport = conn, transport
        conn.idle_since = now  # no request yet
        front.conns[transport] = conn
        assert front.runner is not None and front.runner.server is not None
        self.inner = front.runner.server()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.front.limiter.release(self.conn)
            self.front.conns.pop(self.transport, None)
            self.conn = None
        if self.inner is not None:
            self.inner.connection_lost(exc)


class _CoreCollector:
    """Exports the core's counters and per-instance state at scrape time."""

    def __init__(
        self,
        core: RouterCore,
        clock: Callable[[], float],
        fronts: Callable[[], dict[str, dict[str, int]]],
    ) -> None:
        self.core = core
        self.clock = clock
        self.fronts = fronts

    def collect(self) -> Any:
        now = self.clock()
        core = self.core
        live = set(core.index.live(now))
        c = CounterMetricFamily(
            "gcache_router_events", "KV events applied or rejected", labels=["what"]
        )
        ing = core.ingestor
        c.add_metric(["batches"], ing.batches)
        c.add_metric(["events"], ing.events)
        c.add_metric(["blocks"], ing.blocks)
        for reason, n in ing.rejected.items():
            c.add_metric([f"rejected_{reason}"], n)
        yield c
        idx = CounterMetricFamily("gcache_router_index", "index activity", labels=["what"])
        for k, v in core.index.counters.items():
            idx.add_metric([k], v)
        yield idx
        pidx = CounterMetricFamily(
            "gcache_router_pool_index",
            "GCache pool blocks announced by KV events (medium GCACHE)",
            labels=["what"],
        )
        for k, v in core.pool_index.counters.items():
            pidx.add_metric([k], v)
        yield pidx
        g_pool = GaugeMetricFamily(
            "gcache_router_pool_blocks", "GCACHE blocks announced", labels=["instance"]
        )
        for inst in core.pool_index.instances.values():
            g_pool.add_metric([inst.name], len(inst.blocks))
        yield g_pool
        r = CounterMetricFamily("gcache_router_decisions", "routing decisions", labels=["reason"])
        for reason, n in core.by_reason.items():
            r.add_metric([reason], n)
        yield r
        req = CounterMetricFamily("gcache_router_requests", "hot-path requests", labels=["what"])
        for k, v in core.counters.items():
            req.add_metric([k], v)
        yield req
        g_live = GaugeMetricFamily("gcache_router_instance_live", "1 if live", labels=["instance"])
        g_blocks = GaugeMetricFamily(
            "gcache_router_instance_blocks", "blocks indexed", labels=["instance"]
        )
        g_load = GaugeMetricFamily(
            "gcache_router_instance_load", "last reported load", labels=["instance", "what"]
        )
        routed = CounterMetricFamily(
            "gcache_router_routed", "requests routed to the instance", labels=["instance"]
        )
        for inst in core.index.instances.values():
            g_live.add_metric([inst.name], 1.0 if inst.name in live else 0.0)
            g_blocks.add_metric([inst.name], len(inst.blocks))
            g_load.add_metric([inst.name, "queued"], inst.load.queued)
            g_load.add_metric([inst.name, "running"], inst.load.running)
            g_load.add_metric([inst.name, "tokens_in_flight"], inst.load.tokens_in_flight)
            routed.add_metric([inst.name], core.routed_to.get(inst.name, 0))
        yield g_live
        yield g_blocks
        yield g_load
        yield routed
        conns = CounterMetricFamily(
            "gcache_router_connections",
            "connections of the hot path and the HTTP front (accepted, refused, closed "
            "idle, send timeouts, bad frames) and the pool match's meta lookups",
            labels=["front", "what"],
        )
        now_open = GaugeMetricFamily(
            "gcache_router_connections_open",
            "connections open now (what: connections_open, peers_connected)",
            labels=["front", "what"],
        )
        for front, stats in self.fronts().items():
            for k, v in stats.items():
                gauge = k in ("connections_open", "peers_connected")
                (now_open if gauge else conns).add_metric([front, k], v)
        yield conns
        yield now_open


class HttpFront:
    def __init__(
        self,
        core: RouterCore,
        pool: PoolMatcher | None,
        hot_stats: Callable[[], dict[str, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.pool = pool
        self.hot_stats = hot_stats
        self.clock = clock
        cfg = core.cfg
        self.max_proxied = cfg.max_proxied
        self.proxying = 0
        self.registry = CollectorRegistry()
        self.registry.register(
            _CoreCollector(core, clock, self._front_stats)  # type: ignore[arg-type]
        )
        self.m_decision = Histogram(
            "gcache_router_decision_seconds",
            "time to route one request (pool lookup included)",
            registry=self.registry,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self.m_proxy = Counter(
            "gcache_router_proxied", "proxied HTTP requests", ["status"], registry=self.registry
        )
        self.m_inflight = Gauge(
            "gcache_router_proxy_inflight", "requests being proxied", registry=self.registry
        )
        self.limiter = ConnectionLimiter(
            cfg.http_max_connections, cfg.http_max_connections_per_peer, cfg.idle_timeout_s
        )
        self.conns: dict[asyncio.Transport | None, Conn] = {}
        self.refused_log = RateLimitedLog(log)
        self.listener: asyncio.Server | None = None
        self.sweeper: asyncio.Task[None] | None = None
        self.app = web.Application(
            client_max_size=parse_size(cfg.max_http_body), middlewares=[self._in_flight]
        )
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/route", self.route_only)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/metrics", self.metrics)
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None

    @web.middleware
    async def _in_flight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A connection serving a request is not idle; it is again once answered."""
        conn = self.conns.get(request.transport)  # type: ignore[arg-type]
        if conn is not None:
            conn.idle_since = None
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.idle_since = time.monotonic()

    async def start(self, listener: socket.socket) -> int:
        """Serve on ``listener`` (bound by the daemon); the port it is bound to."""
        timeout = aiohttp.ClientTimeout(total=self.core.cfg.proxy_timeout_s, sock_connect=5.0)
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(lambda: _Admitted(self), sock=listener)
        self.sweeper = asyncio.create_task(idle_sweeper(self.limiter))
        return int(listener.getsockname()[1])

    def stats(self) -> dict[str, int]:
        return {**self.limiter.stats(), **self.refused_log.stats("refused_connections")}

    def _front_stats(self) -> dict[str, dict[str, int]]:
        out = {"http": self.stats()}
        if self.hot_stats is not None:
            out["hotpath"] = self.hot_stats()
        if self.pool is not None:
            out["pool"] = self.pool.stats()
        return out

    async def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.listener is not None:
            self.listener.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    # ---- prompts ----------------------------------------------------------------

    def _tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        from gcache import textcodec

        if chat:
            if self.core.cfg.tokenizer != "bytes":
                raise textcodec.PromptError("chat needs router.tokenizer = bytes")
            return textcodec.encode(textcodec.render_chat(body.get("messages") or []))
        prompt = body.get("prompt")
        if isinstance(prompt, str) and self.core.cfg.tokenizer != "bytes":
            raise textcodec.PromptError("text prompts need router.tokenizer = bytes")
        return textcodec.prompt_ids(prompt)

    async def _decide(self, tokens: list[int], rid: str) -> Any:
        t0 = time.perf_counter()
        keys = self.core.keys_of(tokens)
        pool = await self.pool.match(keys) if self.pool is not None else 0
        d = self.core.route(keys, len(tokens), self.clock(), pool, rid)
        self.m_decision.observe(time.perf_counter() - t0)
        return d

    async def _read(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise web.HTTPBadRequest(reason=f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(reason="body must be a JSON object")
        return body

    # ---- handlers -------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        live = self.core.index.live(self.clock())
        status = 200 if live else 503
        return web.json_response(
            {"status": "ok" if live else "no live instance", "live": live}, status=status
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), content_type="text/plain", charset="utf-8"
        )

    async def route_only(self, request: web.Request) -> web.Response:
        from gcache.textcodec import PromptError

        body = await self._read(request)
        chat = "messages" in body
        try:
            d = await self._decide(self._tokens(body, chat), str(body.get("request_id", "")))
        except PromptError as exc:
            return _error(400, str(exc), "invalid_request_error")
        except Refusal as r:
            return _error(503 if r.code == E_NO_INSTANCE else 400, r.message, "unavailable")
        return web.json_response(
            {
                "instance": d.instance,
                "url": d.url,
                "local_blocks": d.local_blocks,
                "pool_blocks": d.pool_blocks,
                "cost": d.cost,
                "reason": d.reason,
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/chat/completions", chat=True)

    async def _proxy(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        from gcache.textcodec import PromptError

        if self.proxying >= self.max_proxied:
            self.m_proxy.labels("503").inc()
            return _error(503, f"router busy: {self.max_proxied} requests in flight", "busy")
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            tokens = self._tokens(body, chat)
            d = await self._decide(tokens, str(body.get("user", "")))
        except (ValueError, PromptError) as exc:
            self.m_proxy.labels("400").inc()
            return _error(400, str(exc), "invalid_request_error")
        except Refusal as r:
            status = 503 if r.code == E_NO_INSTANCE else 400
            self.m_proxy.labels(str(status)).inc()
            return _error(status, r.message, "unavailable")
        if not d.url:
            self.m_proxy.labels("502").inc()
            return _error(502, f"instance {d.instance} has no URL to proxy to", "bad_gateway")
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        self.proxying += 1
        self.m_inflight.inc()
        try:
            try:
                upstream = await self.session.post(d.url + path, data=raw, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.m_proxy.labels("502").inc()
                return _error(
                    502, f"instance {d.instance} ({d.url}) failed: {exc!r}", "bad_gateway"
                )
            async with upstream:
                resp = web.StreamResponse(status=upstream.status)
                for k, v in upstream.headers.items():
                    if k.lower() not in HOP_HEADERS:
                        resp.headers[k] = v
                resp.headers["x-gcache-instance"] = d.instance
                await resp.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await resp.write(chunk)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.info("stream from %s broke off: %r", d.instance, exc)
                await resp.write_eof()
                self.m_proxy.labels(str(upstream.status)).inc()
                return resp
        finally:
            self.proxying -= 1
            self.m_inflight.dec()
