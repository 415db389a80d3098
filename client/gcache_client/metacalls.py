"""The client's calls to the meta: hot-path messages and gRPC control calls, each
finding the leader and retrying once when several metas run, and namespace
calls that register a namespace again when a restarted meta forgot it. The
writer, the lease batcher and the facade all call the meta through this."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from gcache import wire
from gcache.errors import (
    ClosedError,
    ConnectionLost,
    GCacheError,
    LayoutError,
    NotLeader,
    UnknownNamespace,
)
from gcache_client.pool import ConnectionPool
from gcache_client.types import Namespace

log = logging.getLogger("gcache.client")


class MetaCalls:
    def __init__(self, pool: ConnectionPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.closed = False  # set by the client's close: no new calls

    async def call(self, msg: wire.Msg) -> Any:
        """One hot-path call. With several metas, a refusal by a standby or a dead
        connection finds the leader and retries once, within ``timeout_s`` in all."""
        if self.closed:
            raise ClosedError("client closed")
        timeout = self.timeout_s
        if not self.pool.finder.several:
            conn = await self.pool.meta()
            return await conn.call(msg, timeout=timeout)
        deadline = time.monotonic() + timeout
        try:
            conn = await self.pool.meta()
            return await conn.call(msg, timeout=timeout)
        except (NotLeader, ConnectionLost) as exc:
            left = deadline - time.monotonic()
            await self.pool.meta_failed(exc.message if isinstance(exc, NotLeader) else "")
            if left <= 0.05:
                raise
            log.info("meta did not serve (%s); trying the leader", exc)
            try:
                conn = await asyncio.wait_for(self.pool.meta(), left)
            except TimeoutError as late:
                raise ConnectionLost(f"no meta leader answered within {timeout}s") from late
            return await conn.call(msg, timeout=max(deadline - time.monotonic(), 0.05))

    async def ns_call(self, ns: Namespace, msg: wire.Msg) -> Any:
        """A hot-path call naming ``ns``; if the meta restarted and forgot the
        namespace, register it again (same fingerprint) and retry once."""
        try:
            return await self.call(msg)
        except UnknownNamespace:
            if ns.request is None:
                raise
            log.info("meta forgot namespace %s; registering it again", ns)
            if await self.register(ns.request) != ns.fingerprint:
                raise
            return await self.call(msg)

    async def grpc_call(self, method: str, req: Any) -> Any:
        """A control call; with several metas a standby's FAILED_PRECONDITION or an
        unreachable meta finds the leader and retries once."""
        try:
            stub = await self.pool.control_stub()
            return await getattr(stub, method)(req, timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, ConnectionLost) as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            if not self.pool.finder.several or code not in (
                None,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                raise
            refusal = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else ""
            await self.pool.meta_failed(refusal or "")
            try:
                stub = await self.pool.control_stub()
            except ConnectionLost as lost:
                raise GCacheError(f"{method} failed: {lost}") from lost
            return await getattr(stub, method)(req, timeout=self.timeout_s)

    async def register(self, req: Any) -> bytes:
        """RegisterNamespace; the namespace's fingerprint."""
        try:
            reply = await self.grpc_call("RegisterNamespace", req)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise LayoutError(exc.details() or "invalid namespace") from exc
            raise GCacheError(f"RegisterNamespace failed: {exc.details()}") from exc
        return bytes(reply.fingerprint)
