"""Prometheus text exposition of the meta's stats on a small HTTP endpoint.

Only ``GET /metrics``, ``/healthz`` (the process is up) and ``/ready`` (200 on
a serving leader or a standby in touch with etcd, else 503) are served; anything else gets 404. The
body is rendered from :meth:`MetaCore.stats` and the per-server records, so
``gcache status``, gRPC ``GetStats`` and Prometheus always agree; the hot path's
connection counters (:meth:`HotPathServer.stats`) come as ``gcache_meta_hotpath_*``.

The endpoint is bounded like the daemons' listeners: at most
:data:`MAX_CONNECTIONS` connections at once and :data:`MAX_PER_PEER` from one
address (an excess one gets a ``503`` and is closed at once), and each connection
has :data:`EXCHANGE_TIMEOUT_S` to send its request and take the whole answer;
past it the connection is closed and what it did not take is dropped. Its own
counters come as ``gcache_meta_metrics_http_*``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gcache.meta.core import COUNTERS, MetaCore
from gcache.meta.records import ServerRecord
from gcache.startup import listen_tcp
from gcache.transport.limits import ConnectionLimiter, RateLimitedLog, peer_host

log = logging.getLogger("gcache.meta.metrics")


# Hot-path connection stats that are levels, not monotonic counters.
HOTPATH_GAUGES = frozenset({"connections_open", "peers_connected"})
# A scraper needs one short connection; these bound what anyone else can hold.
MAX_CONNECTIONS = 64
MAX_PER_PEER = 8
EXCHANGE_TIMEOUT_S = 5.0  # to send the request and take the whole answer
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def render(
    core: MetaCore,
    hotpath: Callable[[], Mapping[str, int]] | None = None,
    http: Callable[[], Mapping[str, int]] | None = None,
) -> str:
    lines: list[str] = []
    for name, value in sorted(core.stats().items()):
        metric = f"gcache_meta_{name}" + ("_total" if name in COUNTERS else "")
        kind = "counter" if name in COUNTERS else "gauge"
        lines += [f"# TYPE {metric} {kind}", f"{metric} {float(value)}"]
    for name, value in sorted((hotpath() if hotpath else {}).items()):
        gauge = name in HOTPATH_GAUGES
        metric = f"gcache_meta_hotpath_{name}" + ("" if gauge else "_total")
        lines += [f"# TYPE {metric} {'gauge' if gauge else 'counter'}", f"{metric} {float(value)}"]
    for name, value in sorted((http() if http else {}).items()):
        gauge = name == "http_connections_open"
        metric = f"gcache_meta_metrics_{name}" + ("" if gauge else "_total")
        lines += [f"# TYPE {metric} {'gauge' if gauge else 'counter'}", f"{metric} {float(value)}"]
    now = time.monotonic()
    per_server: dict[str, Callable[[ServerRecord], float]] = {
        "gcache_server_capacity_bytes": lambda s: s.allocator.capacity,
        "gcache_server_used_bytes": lambda s: s.allocator.used,
        "gcache_server_objects": lambda s: s.objects,
        "gcache_server_heartbeat_age_seconds": lambda s: now - s.last_seen,
        "gcache_server_fragmentation": lambda s: s.allocator.stats()["fragmentation"],
        "gcache_server_nvme_capacity_bytes": lambda s: s.nvme_capacity,
        "gcache_server_nvme_used_bytes": lambda s: s.nvme_bytes,
        "gcache_server_nvme_objects": lambda s: s.nvme_count,
        "gcache_server_demotions_in_flight": lambda s: len(s.demoting),
    }
    for metric, get in per_server.items():
        lines.append(f"# TYPE {metric} gauge")
        for s in core.servers.values():
            lines.append(f'{metric}{{server="{s.server_id}"}} {float(get(s))}')
    per_server_counters: dict[str, Callable[[ServerRecord], float]] = {
        "gcache_server_demotions_total": lambda s: s.demoted,
        "gcache_server_dropped_not_demoted_total": lambda s: s.dropped,
    }
    for metric, get in per_server_counters.items():
        lines.append(f"# TYPE {metric} counter")
        for s in core.servers.values():
            lines.append(f'{metric}{{server="{s.server_id}"}} {float(get(s))}')
    lines.append("# TYPE gcache_server_ops_total counter")
    for s in core.servers.values():
        for key, val in s.counters.items():
            lines.append(f'gcache_server_ops_total{{server="{s.server_id}",kind="{key}"}} {val}')
    return "\n".join(lines) + "\n"


class MetricsServer:
    def __init__(
        self,
        core: MetaCore,
        hotpath: Callable[[], Mapping[str, int]] | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_PER_PEER,
        timeout_s: float = EXCHANGE_TIMEOUT_S,
    ) -> None:
        self.core = core
        self.hotpath = hotpath  # HotPathServer.stats
        self.server: asyncio.Server | None = None
        self.timeout_s = timeout_s
        self.limiter = ConnectionLimiter(max_connections, max_per_peer, timeout_s)
        self.refused_log = RateLimitedLog(log)
        self.served = 0
        # /ready: None (a single meta) is always ready; HA sets the election's.
        self.ready: Callable[[], bool] | None = None
        self.timeouts = 0  # closed: no whole request and answer within timeout_s

    def stats(self) -> dict[str, int]:
        lim = self.limiter
        return {
            "http_connections_open": len(lim),
            "http_served": self.served,
            "http_refused": lim.refused_total + lim.refused_peer,
            "http_timeouts": self.timeouts,
        }

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        now = time.monotonic()
        peer = peer_host(writer.get_extra_info("peername"))
        conn = self.limiter.admit(peer, transport.abort, now)
        if isinstance(conn, str):  # a short answer that fits the socket: never waited on
            self.refused_log.log(now, "metrics endpoint refused a connection: %s", conn)
            transport.write(_BUSY)
            transport.abort()
            return
        # drain() returns only once every byte is with the kernel: a peer that
        # stops reading holds nothing of ours past the deadline.
        transport.set_write_buffer_limits(high=0)
        try:
            async with asyncio.timeout(self.timeout_s):
                request = await reader.readuntil(b"\r\n\r\n")
                parts = request.split(b" ", 2)
                path = parts[1].decode("latin-1") if len(parts) > 1 else ""
                if parts[0] == b"GET" and path == "/metrics":
                    status, body = "200 OK", render(self.core, self.hotpath, self.stats).encode()
                elif parts[0] == b"GET" and path == "/healthz":
                    status, body = "200 OK", b"ok\n"
                elif parts[0] == b"GET" and path == "/ready":
                    ok = self.ready is None or self.ready()
                    status = "200 OK" if ok else "503 Service Unavailable"
                    body = b"ready\n" if ok else b"not ready\n"
                else:
                    status, body = "404 Not Found", b"not found\n"
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            self.served += 1
        except TimeoutError:
            self.timeouts += 1
            transport.abort()  # drop what the peer did not take
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            self.limiter.release(conn)
            writer.close()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); a failure is a one-line
        :class:`BindError` naming the address and ``meta.metrics_port``."""
        sock = listen_tcp(host, port, "meta.metrics_port, --metrics-port (-1: off)", 128)
        self.server = await asyncio.start_server(self.handle, sock=sock, limit=16384)
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
