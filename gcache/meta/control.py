"""The meta's control plane: gRPC service driving :class:`MetaCore`."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import grpc
import msgspec

from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.errors import LayoutError, Refusal
from gcache.layout import decode_spec
from gcache.meta.core import MetaCore

log = logging.getLogger("gcache.meta.control")


class ControlService(pb_grpc.ControlServicer):  # type: ignore[misc]
    def __init__(self, core: MetaCore, heartbeat_interval_s: float = 1.0) -> None:
        self.core = core
        self.heartbeat_interval_s = heartbeat_interval_s

    async def RegisterServer(self, request: Any, context: Any) -> Any:
        if not request.server_id or not request.port or request.capacity < (1 << 20):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "server_id, port and a capacity of at least 1MiB are required",
            )
        if len(request.secret) < 16:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "secret must be at least 16 bytes"
            )
        addr = wire.ServerAddr(
            request.server_id,
            request.host,
            request.port,
            request.hostname,
            request.shm_path,
            request.incarnation,
        )
        self.core.register_server(
            addr, bytes(request.secret), request.incarnation, request.capacity, time.monotonic()
        )
        log.info(
            "server %s registered at %s:%d (%d bytes)",
            request.server_id,
            request.host,
            request.port,
            request.capacity,
        )
        return pb.RegisterServerReply(
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.core.cfg.heartbeat_timeout_s,
        )

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        c = request.counters
        counters = {f.name: int(getattr(c, f.name)) for f in c.DESCRIPTOR.fields}
        rereg, freed = self.core.heartbeat(
            request.server_id, request.incarnation, counters, time.monotonic()
        )
        return pb.HeartbeatReply(
            reregister=rereg, free=[pb.Range(offset=o, length=n) for o, n in freed]
        )

    async def RegisterNamespace(self, request: Any, context: Any) -> Any:
        try:
            spec = decode_spec(request.layout_json)
            descriptor = {
                "model": request.model,
                "revision": request.revision,
                "tp_size": request.tp_size or 1,
                "tp_rank": request.tp_rank,
                "cache_salt": request.cache_salt,
                "kv_dtype": request.kv_dtype or spec.dtype,
                "layout": msgspec.to_builtins(spec),
            }
            if not request.model:
                raise LayoutError("model is required")
            ns = self.core.register_namespace(descriptor, spec)
        except LayoutError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info(
            "namespace %s registered: %s",
            ns.fingerprint.hex(),
            json.dumps({k: v for k, v in descriptor.items() if k != "layout"}),
        )
        return pb.RegisterNamespaceReply(fingerprint=ns.fingerprint, namespace_id=ns.ns_id)

    async def Evict(self, request: Any, context: Any) -> Any:
        try:
            evicted, refused = self.core.evict_keys(
                bytes(request.namespace), [bytes(k) for k in request.keys], request.groups
            )
        except Refusal as r:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.message)
        return pb.EvictReply(evicted=evicted, refused=refused)

    async def GetStats(self, request: Any, context: Any) -> Any:
        now = time.monotonic()
        servers = []
        for s in self.core.servers.values():
            servers.append(
                pb.ServerStats(
                    server_id=s.server_id,
                    address=f"{s.addr.host}:{s.addr.port}",
                    alive=s.alive,
                    capacity=s.allocator.capacity,
                    used=s.allocator.used,
                    objects=s.objects,
                    counters=pb.ServerCounters(**s.counters),
                    heartbeat_age_s=now - s.last_seen,
                    shm_path=s.addr.shm_path,
                )
            )
        stats = self.core.stats()
        return pb.GetStatsReply(
            servers=servers,
            counters={k: float(v) for k, v in stats.items()},
            namespaces=len(self.core.namespaces),
        )
