"""Prometheus text exposition of the meta's stats on a small HTTP endpoint.

Only ``GET /metrics`` (and ``/healthz``) are served; anything else gets 404. The
body is rendered from :meth:`MetaCore.stats` and the per-server records, so
``gcache status``, gRPC ``GetStats`` and Prometheus always agree; the hot path's
connection counters (:meth:`HotPathServer.stats`) come as ``gcache_meta_hotpath_*``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gcache.meta.core import COUNTERS, MetaCore
from gcache.meta.records import ServerRecord
from gcache.startup import listen_tcp

log = logging.getLogger("gcache.meta.metrics")


# Hot-path connection stats that are levels, not monotonic counters.
HOTPATH_GAUGES = frozenset({"connections_open", "peers_connected"})


def render(core: MetaCore, hotpath: Callable[[], Mapping[str, int]] | None = None) -> str:
    lines: list[str] = []
    for name, value in sorted(core.stats().items()):
        metric = f"gcache_meta_{name}" + ("_total" if name in COUNTERS else "")
        kind = "counter" if name in COUNTERS else "gauge"
        lines += [f"# TYPE {metric} {kind}", f"{metric} {float(value)}"]
    for name, value in sorted((hotpath() if hotpath else {}).items()):
        gauge = name in HOTPATH_GAUGES
        metric = f"gcache_meta_hotpath_{name}" + ("" if gauge else "_total")
        lines += [f"# TYPE {metric} {'gauge' if gauge else 'counter'}", f"{metric} {float(value)}"]
    now = time.monotonic()
    per_server: dict[str, Callable[[ServerRecord], float]] = {
        "gcache_server_capacity_bytes": lambda s: s.allocator.capacity,
        "gcache_server_used_bytes": lambda s: s.allocator.used,
        "gcache_server_objects": lambda s: s.objects,
        "gcache_server_heartbeat_age_seconds": lambda s: now - s.last_seen,
        "gcache_server_fragmentation": lambda s: s.allocator.stats()["fragmentation"],
    }
    for metric, get in per_server.items():
        lines.append(f"# TYPE {metric} gauge")
        for s in core.servers.values():
            lines.append(f'{metric}{{server="{s.server_id}"}} {float(get(s))}')
    lines.append("# TYPE gcache_server_ops_total counter")
    for s in core.servers.values():
        for key, val in s.counters.items():
            lines.append(f'gcache_server_ops_total{{server="{s.server_id}",kind="{key}"}} {val}')
    return "\n".join(lines) + "\n"


class MetricsServer:
    def __init__(
        self, core: MetaCore, hotpath: Callable[[], Mapping[str, int]] | None = None
    ) -> None:
        self.core = core
        self.hotpath = hotpath  # HotPathServer.stats
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = request.split(b" ", 2)
            path = parts[1].decode("latin-1") if len(parts) > 1 else ""
            if parts[0] == b"GET" and path == "/metrics":
                status, body = "200 OK", render(self.core, self.hotpath).encode()
            elif parts[0] == b"GET" and path == "/healthz":
                status, body = "200 OK", b"ok\n"
            else:
                status, body = "404 Not Found", b"not found\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            pass
        finally:
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
