# One file (over 450 lines): one gRPC servicer, one method per control-plane call.
"""The meta's control plane: gRPC service driving :class:`MetaCore`."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
import msgspec

from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import Authenticator, bearer
from gcache.errors import LayoutError, ProtocolError, Refusal
from gcache.layout import decode_spec
from gcache.meta.core import MetaCore
from gcache.meta.events import FeedFull
from gcache.meta.pacing import MAX_VAIN, ReportPacer
from gcache.meta.rebuild import Parked
from gcache.meta.records import NamespaceRecord, ObjectRecord, ServerRecord, group_layer_bytes
from gcache.meta.tiers import Demotion, Promotion
from gcache.storage import columns
from gcache.storage.record import StoredRecord, to_proto

log = logging.getLogger("gcache.meta.control")
# The longest kv_identity a namespace takes (LoRA name + weights fingerprint + stage).
MAX_KV_IDENTITY = 1024


def id_conflict(
    old: ServerRecord | None, addr: wire.ServerAddr, incarnation: int, now: float, hold_s: float
) -> str | None:
    """Why a registration of ``addr.server_id`` must be refused, or None.

    An id is held by its live server: a registration with another incarnation from
    another address (host, port or hostname) while the holder was heard from within
    ``hold_s`` is a second server with the same ``--server-id``, not a restart (a
    restart reuses the address, or comes after the old one fell silent)."""
    if old is None or not old.alive or old.incarnation == incarnation:
        return None
    same_place = (old.addr.host, old.addr.port, old.addr.hostname) == (
        addr.host,
        addr.port,
        addr.hostname,
    )
    age = now - old.last_seen
    if same_place or age >= hold_s:
        return None
    return (
        f"server id {addr.server_id!r} is held by a live server at "
        f"{old.addr.host}:{old.addr.port} on {old.addr.hostname or '?'} (heard from "
        f"{age:.1f} s ago); give this server another --server-id, or wait "
        f"{hold_s:.0f} s after the old one stopped"
    )


def stored(obj: ObjectRecord, ns: NamespaceRecord) -> Any:
    """The proto record of an object (what its server persists in its manifest)."""
    entry = obj.entry
    parent = entry.parent
    rec = StoredRecord(
        namespace=ns.fingerprint,
        key=entry.key,
        parent=parent.key if parent is not None else b"",
        pos=entry.pos,
        group=obj.group,
        tier=obj.tier,
        offset=obj.offset,
        length=obj.length,
        sums=obj.sums,
        seq=0,
        layer_bytes=group_layer_bytes(ns.layout, obj.group),
    )
    return to_proto(rec)


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``);
    False where there is none (another libc)."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM is False:
        return False
    _TRIM(0)
    return True


_TRIM: Any = None


class GcPause:
    """The cyclic garbage collector paused while reports are adopted, and what they
    adopted frozen out of it afterwards.

    A rebuild allocates many objects while it runs (decoded report chunks,
    parked records, handles); the collector's generational passes over them took
    half of the rebuild's CPU when the index itself was Python objects
    (bench/meta_rebuild.py: 1.68 s instead of 3.6 s for 206k objects in process),
    and a full pass after a large rebuild stalled the event loop (heartbeats
    unanswered). When the last report in progress ends (also on error)
    everything alive is moved to the permanent generation (``gc.freeze``, as the
    daemon does after start-up) and the collector resumes: it never rescans
    what the rebuild left.
    Only after a real rebuild (at least ``FREEZE_MIN`` objects adopted during the
    pause): a frozen object that later becomes cyclic garbage (a closed
    connection's) is never collected, so small pauses do not freeze. Then the C
    heap's free pages go back to the system (``malloc_trim``: the decoded chunks
    and their temporaries leave holes a restarted meta would otherwise keep in
    its RSS)."""

    FREEZE_MIN = 1 << 16

    def __init__(self, adopted: Callable[[], int] = lambda: 0) -> None:
        self.adopted = adopted  # objects adopted so far (MetaCore counter)
        self.depth = 0
        self.was_enabled = False
        self.paused_s = 0.0
        self.freezes = 0
        self._since = 0.0
        self._adopted_at = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self.depth == 0:
            self.was_enabled = gc.isenabled()
            self._since = time.monotonic()
            self._adopted_at = self.adopted()
            gc.disable()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.paused_s += time.monotonic() - self._since
                if self.adopted() - self._adopted_at >= self.FREEZE_MIN:
                    gc.freeze()
                    self.freezes += 1
                    trim_heap()
                if self.was_enabled:
                    gc.enable()


def parked_records(objects: Any) -> list[Parked]:
    """A chunk's records (proto ``StoredObject``; bytes fields are ``bytes``
    already, no copy)."""
    return [
        Parked(
            o.namespace,
            o.key,
            o.parent,
            o.pos,
            o.group,
            o.tier,
            o.offset,
            o.length,
            o.sums,
            o.seq,
            layer_bytes=tuple(o.layer_bytes),
        )
        for o in objects
    ]


class ControlService(pb_grpc.ControlServicer):  # type: ignore[misc]
    def __init__(
        self,
        core: MetaCore,
        heartbeat_interval_s: float = 1.0,
        auth: Authenticator | None = None,
        hotpath: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.core = core
        self.heartbeat_interval_s = heartbeat_interval_s
        self.auth = auth or Authenticator()
        self.hotpath = hotpath  # HotPathServer.stats: its connection counters
        self.refused_unauthenticated = 0
        self.refused_duplicate_id = 0
        self.refused_not_leader = 0
        # HA: () -> (role, leader addresses) for GetStats; None for a single meta.
        self.ha_role: Callable[[], tuple[str, str]] | None = None
        # While reports are adopted (see GcPause).
        self.gc_pause = GcPause(lambda: core.counters["objects_adopted"])
        self.pacer = ReportPacer()  # report streams by block position (meta/pacing.py)
        # WatchRemovals subscribers wait on this; a removal (recorded by the core,
        # synchronously, on the loop thread) sets it once per loop pass.
        self._removal_wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_due = False
        core.removals.on_record = self._removal_recorded

    def _removal_recorded(self) -> None:
        if self._wake_due or self._removal_wake is None or self._loop is None:
            return
        self._wake_due = True
        self._loop.call_soon_threadsafe(self._wake_removal_watchers)

    def _wake_removal_watchers(self) -> None:
        self._wake_due = False
        ev, self._removal_wake = self._removal_wake, asyncio.Event()
        if ev is not None:
            ev.set()

    def stats(self) -> dict[str, int]:
        """The control service's counters and the hot path's (``hotpath_*``)."""
        hot = self.hotpath() if self.hotpath is not None else {}
        return {
            "refused_unauthenticated": self.refused_unauthenticated,
            "refused_duplicate_id": self.refused_duplicate_id,
            "refused_not_leader": self.refused_not_leader,
            "report_holds": self.pacer.holds,  # report streams held (meta/pacing.py)
            "report_held_ms": int(self.pacer.held_s * 1000),
            **{f"hotpath_{k}": v for k, v in hot.items()},
        }

    async def _require_cluster(self, context: Any, call: str) -> None:
        if not self.auth.is_cluster(bearer(context.invocation_metadata())):
            self.refused_unauthenticated += 1
            log.warning("refused %s from %s: no valid cluster token", call, context.peer())
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "a valid cluster token is required"
            )

    async def _require_leader(self, context: Any) -> None:
        """A standby (or a leader that cannot confirm its lease) answers every call
        FAILED_PRECONDITION naming the leader, never with data."""
        gate = self.core.not_leader
        if gate is not None:
            why = gate(time.monotonic())
            if why is not None:
                self.refused_not_leader += 1
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)

    async def RegisterServer(self, request: Any, context: Any) -> Any:
        await self._require_leader(context)
        await self._require_cluster(context, "RegisterServer")
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
            dram_read_gbps=request.dram_read_gbps,
            nvme_read_gbps=request.nvme_read_gbps,
        )
        now = time.monotonic()
        conflict = id_conflict(
            self.core.servers.get(request.server_id),
            addr,
            request.incarnation,
            now,
            self.core.cfg.heartbeat_timeout_s,
        )
        if conflict is not None:
            self.refused_duplicate_id += 1
            log.warning("refused RegisterServer from %s:%d: %s", addr.host, addr.port, conflict)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, conflict)
        srv = self.core.register_server(
            addr,
            bytes(request.secret),
            request.incarnation,
            request.capacity,
            now,
            nvme_capacity=request.nvme_capacity,
            nvme_read_gbps=request.nvme_read_gbps,
            nvme_write_gbps=request.nvme_write_gbps,
            report=request.objects > 0,
            report_objects=request.objects,
        )
        log.info(
            "server %s registered at %s:%d (%d bytes DRAM, %d bytes NVMe%s)",
            request.server_id,
            request.host,
            request.port,
            request.capacity,
            request.nvme_capacity,
            f", reporting {request.objects} objects" if not srv.ready else "",
        )
        return pb.RegisterServerReply(
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.core.cfg.heartbeat_timeout_s,
            epoch=self.core.epoch,
            report_columns=True,
        )

    async def ReportObjects(self, request_iterator: Any, context: Any) -> Any:
        """A server's manifest, in chunks (``last`` on the final one): adopted into
        the index; the server gets placements only once it is complete."""
        await self._require_leader(context)
        await self._require_cluster(context, "ReportObjects")
        with self.gc_pause():
            self.pacer.started()
            try:
                return await self._report_objects(request_iterator, context)
            finally:
                self.pacer.ended()

    async def _report_objects(self, request_iterator: Any, context: Any) -> Any:
        adopted = dropped = vain = 0
        server_id = ""
        async for chunk in request_iterator:
            await self._require_leader(context)
            if chunk.epoch != self.core.epoch:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"report for meta epoch {chunk.epoch}, this meta's is {self.core.epoch}: "
                    "register again",
                )
            cols = None
            if chunk.HasField("columns"):
                try:
                    cols = columns.decode(chunk.columns)  # all or nothing of the chunk
                except ProtocolError as exc:
                    log.warning("server %s: %s", chunk.server_id, exc)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    return None
            now = time.monotonic()
            got: tuple[int, int] | None = (0, 0)
            if cols is None or chunk.objects:  # a server before columns
                records = parked_records(chunk.objects)
                got = self.core.report_objects(
                    chunk.server_id, chunk.incarnation, records, chunk.last and cols is None, now
                )
            if got is not None and cols is not None:
                more = self.core.report_columns(
                    chunk.server_id, chunk.incarnation, cols, chunk.last, now
                )
                got = None if more is None else (got[0] + more[0], got[1] + more[1])
            if got is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"server {chunk.server_id!r} incarnation {chunk.incarnation} is not "
                    "registered: register again",
                )
                return None
            adopted += got[0]
            dropped += got[1]
            server_id = chunk.server_id
            self.pacer.changed()  # what waited for a parent may be adopted now
            waiting = functools.partial(self.core.deferred_of, server_id)
            if not chunk.last and vain < MAX_VAIN and not await self.pacer.pace(waiting):
                vain += 1  # by block position with the other streams, unless in vain
        parked = self.core.parked_of(server_id) if server_id else 0
        log.info(
            "server %s reported what it holds: %d objects adopted, %d dropped, %d waiting "
            "for their namespace or parent block",
            server_id,
            adopted,
            dropped,
            parked,
        )
        return pb.ReportObjectsReply(adopted=adopted, dropped=dropped, parked=parked)

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        await self._require_leader(context)
        await self._require_cluster(context, "Heartbeat")
        c = request.counters
        counters = {f.name: int(getattr(c, f.name)) for f in c.DESCRIPTOR.fields}
        done = request.demoted
        demoted = [Demotion(d.dram_offset, d.length, d.nvme_offset, d.ok, d.error) for d in done]
        promoted = [
            Promotion(p.nvme_offset, p.length, p.dram_offset, p.ok, p.error)
            for p in request.promoted
        ]
        out = self.core.tier_heartbeat(
            request.server_id,
            request.incarnation,
            counters,
            time.monotonic(),
            demoted,
            request.nvme_used,
            [(r.offset, r.length) for r in request.nvme_lost],
            promoted,
        )
        if out.failed:
            log.warning(
                "server %s: %d demotions failed (%s); demoting there paused",
                request.server_id,
                len(out.failed),
                out.failed[0],
            )
        return pb.HeartbeatReply(
            reregister=out.reregister,
            free=[pb.Range(offset=o, length=n) for o, n in out.free],
            adopt=[stored(obj, ns) for obj, ns in out.adopt],
            demote=[pb.DemoteCommand(object=stored(obj, ns)) for obj, ns in out.demote],
            drop_nvme=[pb.Range(offset=o, length=n) for o, n in out.drop_nvme],
            promote=[
                pb.PromoteCommand(object=stored(obj, ns), dram_offset=off)
                for obj, ns, off in out.promote
            ],
            more=out.more,
            epoch=self.core.epoch,
            next_beat_s=out.next_beat_s,
        )

    async def RegisterNamespace(self, request: Any, context: Any) -> Any:
        await self._require_leader(context)
        why = self.auth.may_register_namespace(
            bearer(context.invocation_metadata()), request.cache_salt
        )
        if why is not None:
            self.refused_unauthenticated += 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
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
            if request.kv_identity:  # absent when empty: older fingerprints unchanged
                if len(request.kv_identity) > MAX_KV_IDENTITY:
                    raise LayoutError(
                        f"kv_identity of {len(request.kv_identity)} characters"
                        f" (at most {MAX_KV_IDENTITY})"
                    )
                descriptor["kv_identity"] = request.kv_identity
            if not request.model:
                raise LayoutError("model is required")
            if len(self.core.parked):
                with self.gc_pause():  # it may adopt what was reported for it
                    ns = self.core.register_namespace(descriptor, spec)
            else:
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
        await self._require_leader(context)
        why = self.auth.may_administer(bearer(context.invocation_metadata()))
        if why is not None:
            self.refused_unauthenticated += 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        try:
            evicted, refused = self.core.evict_keys(
                bytes(request.namespace), [bytes(k) for k in request.keys], request.groups
            )
        except Refusal as r:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.message)
        return pb.EvictReply(evicted=evicted, refused=refused)

    async def WatchRemovals(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """Stream the removals of one namespace while the call lasts
        (``meta/events.py``): a first empty batch once subscribed, then batches of at
        most ``max_batch`` removals, an empty one every ``keepalive_s``; ``gap``
        when removals were lost. The subscriber ends with the call."""
        await self._require_leader(context)
        fp = bytes(request.namespace)
        ns = self.core.namespaces.get(fp)
        if ns is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown namespace (register it first)")
            return
        why = self.auth.may_register_namespace(
            bearer(context.invocation_metadata()), str(ns.descriptor.get("cache_salt", ""))
        )
        if why is not None:
            self.refused_unauthenticated += 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        feed = self.core.removals
        try:
            sub = feed.subscribe(fp, time.monotonic())
        except FeedFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        max_batch = min(request.max_batch or 1024, 1 << 16)
        keepalive = min(max(request.keepalive_s or 10.0, 0.05), 300.0)
        if self._removal_wake is None:
            self._removal_wake = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        try:
            yield pb.RemovalBatch(cursor=sub.cursor)
            while True:
                wake = self._removal_wake
                if not feed.pending(sub):
                    try:
                        await asyncio.wait_for(wake.wait(), keepalive)
                    except TimeoutError:
                        yield pb.RemovalBatch(cursor=sub.cursor)
                        continue
                b = feed.read(sub, max_batch)
                yield pb.RemovalBatch(
                    removed=[pb.Removed(key=k, group=g) for k, g in b.removed],
                    gap=b.gap,
                    cursor=b.cursor,
                )
        finally:
            feed.unsubscribe(sub)

    async def GetStats(self, request: Any, context: Any) -> Any:
        """Answered by a standby too (its role and the leader, no servers): status,
        never cached data."""
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
                    nvme_capacity=s.nvme_capacity,
                    nvme_used=s.nvme_bytes,
                    nvme_objects=s.nvme_count,
                    demotions=s.demoted,
                    demotions_in_flight=len(s.demoting),
                    dropped_not_demoted=s.dropped,
                )
            )
        stats = self.core.stats()
        role, leader = self.ha_role() if self.ha_role is not None else ("", "")
        return pb.GetStatsReply(
            servers=servers,
            counters={k: float(v) for k, v in {**stats, **self.stats()}.items()},
            namespaces=len(self.core.namespaces),
            role=role,
            leader=leader,
            epoch=self.core.epoch,
        )
