"""``AsyncGCacheClient``: put, lookup, get and layerwise ``get_layers`` on asyncio.

Failure semantics (see :mod:`gcache.errors`): a store that is down, slow, or
returns bytes that fail their checksum never raises into the engine on a read
path; ``get`` returns ``None`` and a ``LayerStream`` stops with ``ok == False``
(a miss: recompute). ``put`` reports failures in its result. Misuse (tensors that
do not match the layout, a closed client) raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np
import xxhash

from gcache import keys as keymod
from gcache import layout as laymod
from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.config import ClientConfig
from gcache.errors import (
    ClosedError,
    GCacheError,
    IntegrityError,
    LayoutError,
    RemoteError,
    UnknownNamespace,
)
from gcache.transport import shm
from gcache.transport.shm import MappedSegment
from gcache_client import arrays
from gcache_client.conn import PipelinedConn, gather_or_cancel
from gcache_client.types import KVPair, LayerKV, Match, Namespace, PutResult

log = logging.getLogger("gcache.client")


# Releases wait for the client's next Lookup (which carries them) or this long, then
# go out as one message; past MAX_PENDING_RELEASES they go out at once.
RELEASE_FLUSH_S = 0.002
MAX_PENDING_RELEASES = 256
# In get_layers, shared-memory copies and checksums of at least this many bytes per
# layer run on COPY_THREADS threads (numpy's copy runs without the GIL).
OFFLOAD_BYTES = 1 << 20
COPY_THREADS = 2
SPLIT_BYTES = 8 << 20  # and at least this many are split across the threads
T = TypeVar("T")


def _halves(n: int, nbytes: int) -> list[tuple[int, int]]:
    """Index ranges splitting ``n`` pieces across the copy threads when the layer is
    large enough for that to pay (a full MiMo layer at 32k tokens is ~84 MB)."""
    if nbytes < SPLIT_BYTES or n < COPY_THREADS:
        return [(0, n)]
    step = -(-n // COPY_THREADS)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _verify(checks: list[tuple[memoryview, memoryview, bytes]]) -> bool:
    for kd, vd, want in checks:
        h = xxhash.xxh3_64(kd)
        h.update(vd)
        if h.digest() != want:
            return False
    return True


class _ServerPlan:
    """One server's share of a layer read: the grants, the ``(grant index, offset,
    length)`` ranges (K then V of each block), the destination views in the caller's
    arrays, and per block the views and checksum to verify."""

    __slots__ = ("checks", "dest", "expiry", "grants", "nbytes", "ranges")

    def __init__(self) -> None:
        self.grants: list[wire.Grant] = []
        self.ranges: list[tuple[int, int, int]] = []
        self.dest: list[memoryview] = []
        self.checks: list[tuple[memoryview, memoryview, bytes]] = []
        self.expiry = 0  # the earliest grant expiry (unix ms)
        self.nbytes = 0


def _plan_layer(
    match: Match,
    g: int,
    first_blk: int,
    off: int,
    kb: int,
    vb: int,
    li: int,
    k_arr: np.ndarray,
    v_arr: np.ndarray,
) -> dict[int, _ServerPlan]:
    plans: dict[int, _ServerPlan] = {}
    kbytes, vbytes = arrays.byte_view(k_arr), arrays.byte_view(v_arr)
    objects = match.objects
    for blk in range(first_blk, match.blocks):
        loc = objects.get((blk, g))
        if loc is None:
            raise IntegrityError(f"match lacks object ({blk}, {g})")
        sp = plans.get(loc.server)
        if sp is None:
            sp = plans[loc.server] = _ServerPlan()
        gi = len(sp.grants)
        sp.grants.append(loc.grant)
        base = loc.grant.offset + off
        sp.ranges += ((gi, base, kb), (gi, base + kb, vb))
        r = blk - first_blk
        kd, vd = kbytes[r * kb : (r + 1) * kb], vbytes[r * vb : (r + 1) * vb]
        sp.dest += (kd, vd)
        sp.checks.append((kd, vd, loc.sums[li * 8 : li * 8 + 8]))
    for sp in plans.values():
        sp.expiry = min(gr.expiry_ms for gr in sp.grants)
        sp.nbytes = len(sp.checks) * (kb + vb)
    return plans


def _copy_verify(seg: MappedSegment, sp: _ServerPlan, a: int, b: int) -> bool:
    """Copy blocks ``[a, b)`` of a local server's share under its lease, then verify them."""
    spans = [(o, n) for _, o, n in sp.ranges[2 * a : 2 * b]]
    seg.read_leased(spans, sp.dest[2 * a : 2 * b], sp.expiry)
    return _verify(sp.checks[a:b])


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


class AsyncGCacheClient:
    def __init__(
        self, config: ClientConfig | None = None, *, as_torch: bool = False, **overrides: Any
    ) -> None:
        """``overrides`` replace fields of ``config``; ``as_torch`` makes reads that
        allocate their own buffers return torch tensors instead of numpy arrays."""
        cfg = config or ClientConfig()
        self.config = dataclasses.replace(cfg, **overrides) if overrides else cfg
        self.config.check()
        self.as_torch = as_torch
        self._meta: PipelinedConn | None = None
        self._channel: Any = None
        self._data: dict[tuple[str, str, int], PipelinedConn] = {}
        self._shm: dict[tuple[str, str], MappedSegment | None] = {}
        self._data_lock = asyncio.Lock()
        self._closed = False
        self._to_release: list[int] = []
        self._release_timer: asyncio.TimerHandle | None = None
        self._releases: set[asyncio.Task[None]] = set()
        self._copier: ThreadPoolExecutor | None = None
        self.counters: Counter[str] = Counter()

    # ---- lifecycle ---------------------------------------------------------------

    async def connect(self) -> AsyncGCacheClient:
        await self._meta_conn()
        return self

    async def __aenter__(self) -> AsyncGCacheClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._to_release and not self._closed:
            self._flush_releases()
        if self._releases:  # let releases already under way reach the meta
            await asyncio.wait(list(self._releases), timeout=self.config.timeout_s)
        self._closed = True
        if self._meta is not None:
            self._meta.close()
        for conn in self._data.values():
            conn.close()
        self._data.clear()
        for seg in self._shm.values():
            if seg is not None:
                seg.close()
        self._shm.clear()
        if self._channel is not None:
            await self._channel.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client closed")

    async def _meta_conn(self) -> PipelinedConn:
        self._check_open()
        if self._meta is None or self._meta.closed:
            host, port = _host_port(self.config.meta)
            self._meta = await PipelinedConn.open(host, port, self.config.timeout_s)
        return self._meta

    async def _meta_call(self, msg: wire.Msg) -> Any:
        conn = await self._meta_conn()
        return await conn.call(msg, timeout=self.config.timeout_s)

    def _mapped(self, addr: wire.ServerAddr) -> MappedSegment | None:
        """The server's segment mapped into this process, when the data path is
        shared memory (``transport`` shm, or auto and the server is local)."""
        mode = self.config.transport
        if mode == "tcp":
            return None
        key = (addr.server_id, addr.shm_path)
        if key not in self._shm:
            seg = None
            if mode == "shm" or shm.is_local(addr.hostname, addr.shm_path):
                # ConnectionLost if it cannot be mapped
                seg = MappedSegment(addr.shm_path, self.config.shm_populate)
            self._shm[key] = seg
        return self._shm[key]

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the client's copy threads, so a large copy or checksum does
        not hold up the event loop (and layers already fetched reach the caller).
        Cancellation waits for ``fn`` to finish: it may be writing into the
        caller's buffers, which must be left alone once we return."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="gcache-copy")
        fut = asyncio.get_running_loop().run_in_executor(self._copier, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait([fut])
                except asyncio.CancelledError:
                    continue
            raise

    def _control(self) -> Any:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.config.meta_grpc)
        return pb_grpc.ControlStub(self._channel)

    async def _server(self, addr: wire.ServerAddr) -> PipelinedConn:
        key = (addr.server_id, addr.host, addr.port)
        conn = self._data.get(key)
        if conn is not None and not conn.closed:
            return conn
        async with self._data_lock:
            conn = self._data.get(key)
            if conn is None or conn.closed:
                conn = await PipelinedConn.open(addr.host, addr.port, self.config.timeout_s)
                self._data[key] = conn
        return conn

    # ---- namespaces ----------------------------------------------------------------

    async def register_namespace(
        self,
        model: str,
        layout: laymod.LayoutSpec | str,
        *,
        block_size: int = 64,
        revision: str = "",
        tp_size: int = 1,
        tp_rank: int = 0,
        cache_salt: str = "",
    ) -> Namespace:
        """Register (idempotently) and return the namespace. ``layout`` is a spec or
        a preset name (``mimo-v2-flash``, ``llama-3-8b``)."""
        self._check_open()
        spec = laymod.preset(layout, block_size) if isinstance(layout, str) else layout
        laymod.validate(spec)
        req = pb.RegisterNamespaceRequest(
            model=model,
            revision=revision,
            layout_json=laymod.encode_spec(spec).decode(),
            tp_size=tp_size,
            tp_rank=tp_rank,
            cache_salt=cache_salt,
            kv_dtype=spec.dtype,
        )
        fp = await self._register(req)
        return Namespace(fp, model, laymod.Layout(spec), req)

    async def _register(self, req: Any) -> bytes:
        stub = self._control()
        try:
            reply = await stub.RegisterNamespace(req, timeout=self.config.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise LayoutError(exc.details() or "invalid namespace") from exc
            raise GCacheError(f"RegisterNamespace failed: {exc.details()}") from exc
        return bytes(reply.fingerprint)

    async def _ns_call(self, ns: Namespace, msg: wire.Msg) -> Any:
        """A hot-path call naming ``ns``; if the meta restarted and forgot the
        namespace, register it again (same fingerprint) and retry once."""
        try:
            return await self._meta_call(msg)
        except UnknownNamespace:
            if ns.request is None:
                raise
            log.info("meta forgot namespace %s; registering it again", ns)
            if await self._register(ns.request) != ns.fingerprint:
                raise
            return await self._meta_call(msg)

    async def evict(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        *,
        blocks: range | None = None,
        windows_only: bool = True,
    ) -> tuple[int, int]:
        """Admin: evict the cached objects of ``tokens``' blocks (``blocks`` selects
        which, default all): only their windowed objects, or everything (full objects
        go only from blocks without cached descendants). Returns (evicted, refused)."""
        self._check_open()
        block_keys = keymod.block_keys(ns.fingerprint, tokens, ns.layout.block_size)
        if blocks is not None:
            block_keys = [block_keys[i] for i in blocks]
        layout = ns.layout
        mask = 0
        for g, tail in enumerate(layout.group_tail_blocks):
            if tail is not None or not windows_only:
                mask |= 1 << g
        stub = self._control()
        try:
            reply = await stub.Evict(
                pb.EvictRequest(namespace=ns.fingerprint, keys=block_keys, groups=mask),
                timeout=self.config.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise GCacheError(f"Evict failed: {exc.details()}") from exc
        return int(reply.evicted), int(reply.refused)

    # ---- put -------------------------------------------------------------------------

    def _check_kv(
        self, ns: Namespace, ntokens: int, nblocks: int, kv: Sequence[KVPair]
    ) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """numpy views of each layer's K and V with the token index of their row 0."""
        layout = ns.layout
        if len(kv) != layout.num_layers:
            raise LayoutError(f"got KV for {len(kv)} layers, layout has {layout.num_layers}")
        bs = layout.block_size
        out = []
        for i, (k, v) in enumerate(kv):
            spec = layout.spec.layers[i]
            ka = arrays.to_numpy(k, layout.dtype, f"layer {i} K")
            va = arrays.to_numpy(v, layout.dtype, f"layer {i} V")
            want_k = (spec.kv_heads, spec.k_head_dim)
            want_v = (spec.kv_heads, spec.v_head_dim)
            if ka.ndim != 3 or ka.shape[1:] != want_k:
                raise LayoutError(
                    f"layer {i} K: shape {ka.shape}, want [tokens, {want_k[0]}, {want_k[1]}]"
                )
            if va.ndim != 3 or va.shape[1:] != want_v or va.shape[0] != ka.shape[0]:
                raise LayoutError(
                    f"layer {i} V: shape {va.shape}, want [{ka.shape[0]}, {want_v[0]}, {want_v[1]}]"
                )
            if ka.shape[0] > ntokens:
                raise LayoutError(f"layer {i}: {ka.shape[0]} rows for a {ntokens}-token prompt")
            # Rows are the *last* ka.shape[0] tokens (a sliding layer may hold the window only).
            start = ntokens - ka.shape[0]
            g = layout.layer_group[i]
            tail = layout.group_tail_blocks[g]
            first = 0 if tail is None else max(0, nblocks - tail)
            if start > first * bs:
                raise LayoutError(
                    f"layer {i} holds tokens from {start}, but blocks from {first} must be stored"
                )
            out.append((ka, va, start))
        return out

    async def put(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: Sequence[KVPair],
        *,
        extras: Sequence[bytes] | None = None,
    ) -> PutResult:
        """Store the KV of a prompt's full blocks. ``kv[l]`` is ``(K, V)`` of layer l,
        shaped ``[tokens, kv_heads, head_dim]``; sliding layers may pass only their
        trailing rows. Full groups are stored for every block, windowed groups only
        for the blocks a match ending at this prompt needs (strict O(W))."""
        self._check_open()
        layout = ns.layout
        ntokens = len(tokens)
        nblocks = ntokens // layout.block_size
        result = PutResult(blocks=nblocks)
        if nblocks == 0:
            return result
        views = self._check_kv(ns, ntokens, nblocks, kv)
        block_keys = keymod.block_keys(ns.fingerprint, tokens, layout.block_size, extras)
        masks = layout.groups_to_store(nblocks)
        # The meta may ask for checkpoint windows (an SWA window inside the prompt,
        # where a later prompt can resume) on blocks whose windowed rows we hold.
        ckpt_from = -1
        bs = layout.block_size
        for i, (_, _, start) in enumerate(views):
            if layout.group_tail_blocks[layout.layer_group[i]] is not None:
                ckpt_from = max(ckpt_from, -(-start // bs))
        try:
            placed: wire.PutPlaced = await self._ns_call(
                ns, wire.PutBegin(ns.fingerprint, block_keys, masks, ckpt_from)
            )
        except GCacheError as exc:
            log.warning("put: PutBegin failed: %s", exc)
            result.error = str(exc)
            self.counters["put_errors"] += 1
            return result
        if placed.checkpoints:
            masks = layout.add_windows(masks, placed.checkpoints)
            self.counters["checkpoints_saved"] += len(placed.checkpoints)
        wanted = sum(bin(m).count("1") for m in masks)
        result.no_space = placed.no_space
        result.deduped = wanted - len(placed.placements) - placed.no_space
        if not placed.placements:
            return result
        sem = asyncio.Semaphore(self.config.max_inflight_writes * max(1, len(placed.servers)))

        async def write_one(pi: int, p: wire.Placement) -> tuple[int, bytes, int | None] | None:
            """Write one object; ``(placement, sums, receipt)``, where the receipt of
            a shared-memory copy is ``None`` until its server seals the grant."""
            if not 0 <= p.block < nblocks or any(
                p.block * bs < views[layer][2] for layer in layout.group_layers[p.group]
            ):
                log.warning("put: placement for block %d outside the rows we hold", p.block)
                return None
            payload, sums = self._object_views(layout, views, p.block, p.group)
            async with sem:
                try:
                    addr = placed.servers[p.server]
                    seg = self._mapped(addr)
                    if seg is not None:
                        g = p.grant
                        seg.write_granted(g.offset, g.length, g.expiry_ms, payload)
                        return pi, sums, None
                    conn = await self._server(addr)
                    reply: wire.Ok = await conn.call(
                        wire.Write(p.grant), payload, timeout=self.config.timeout_s
                    )
                except GCacheError as exc:
                    log.warning(
                        "put: write to %s failed: %s", placed.servers[p.server].server_id, exc
                    )
                    return None
            return pi, sums, reply.value

        done = await asyncio.gather(*(write_one(i, p) for i, p in enumerate(placed.placements)))
        written = [d for d in done if d is not None]
        sealed = await self._seal(placed, [d[0] for d in written if d[2] is None])
        ok: list[tuple[int, bytes]] = []
        receipts: list[int] = []
        for pi, sums, rc in written:
            rc = sealed.get(pi) if rc is None else rc
            if rc is not None:
                ok.append((pi, sums))
                receipts.append(rc)
        try:
            await self._meta_call(wire.PutCommit(placed.put_id, ok, receipts))
        except GCacheError as exc:
            log.warning("put: PutCommit failed: %s", exc)
            result.error = str(exc)
            self.counters["put_errors"] += 1
            return result
        result.stored = len(ok)
        result.failed = len(done) - len(ok)
        result.bytes_written = sum(placed.placements[pi].grant.length for pi, _ in ok)
        self.counters["objects_put"] += result.stored
        self.counters["bytes_put"] += result.bytes_written
        return result

    async def _seal(self, placed: wire.PutPlaced, shm_done: list[int]) -> dict[int, int]:
        """One ``SEAL`` per server for the objects this client copied into its
        segment itself: the server consumes their grants (as a ``WRITE`` would) and
        returns receipts. Placement index -> receipt; a refused or failed seal
        leaves its objects out (the put stores fewer, the meta reclaims them)."""
        by_server: dict[int, list[int]] = {}
        for pi in shm_done:
            by_server.setdefault(placed.placements[pi].server, []).append(pi)

        async def seal_one(si: int, pis: list[int]) -> dict[int, int]:
            addr = placed.servers[si]
            try:
                conn = await self._server(addr)
                reply: wire.Sealed = await conn.call(
                    wire.Seal([placed.placements[pi].grant for pi in pis]),
                    timeout=self.config.timeout_s,
                )
            except GCacheError as exc:
                log.warning("put: seal on %s failed: %s", addr.server_id, exc)
                return {}
            if len(reply.receipts) != len(pis):
                log.warning(
                    "put: seal on %s: %d receipts for %d grants",
                    addr.server_id,
                    len(reply.receipts),
                    len(pis),
                )
                return {}
            return dict(zip(pis, reply.receipts, strict=True))

        out: dict[int, int] = {}
        for part in await asyncio.gather(*(seal_one(si, p) for si, p in by_server.items())):
            out.update(part)
        return out

    @staticmethod
    def _object_views(
        layout: laymod.Layout,
        views: list[tuple[np.ndarray, np.ndarray, int]],
        block: int,
        group: int,
    ) -> tuple[list[memoryview], bytes]:
        """The object's bytes as a list of views into the caller's arrays (K then V
        of each layer of the group), and its per-layer checksums."""
        bs = layout.block_size
        payload: list[memoryview] = []
        sums = bytearray()
        for layer in layout.group_layers[group]:
            k, v, start = views[layer]
            lo = block * bs - start
            kv_ = arrays.byte_view(k[lo : lo + bs])
            vv = arrays.byte_view(v[lo : lo + bs])
            payload += (kv_, vv)
            h = xxhash.xxh3_64(kv_)
            h.update(vv)
            sums += h.digest()
        return payload, bytes(sums)

    # ---- lookup -----------------------------------------------------------------------

    async def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """Tokens of the longest valid cached prefix (no lease; 0 if the store is down)."""
        self._check_open()
        block_keys = keymod.block_keys(ns.fingerprint, tokens, ns.layout.block_size)
        try:
            res: wire.LookupResult = await self._ns_call(
                ns, wire.Lookup(ns.fingerprint, block_keys, release=self._take_releases())
            )
        except GCacheError as exc:
            log.warning("lookup failed (miss): %s", exc)
            return 0
        return int(res.tokens)

    async def match(self, ns: Namespace, tokens: Sequence[int] | np.ndarray) -> Match:
        """Longest valid prefix with a read lease on its objects, ready for ``get`` or
        ``get_layers``. Release it (or let it expire) when done."""
        self._check_open()
        block_keys = keymod.block_keys(ns.fingerprint, tokens, ns.layout.block_size)
        try:
            res: wire.LookupResult = await self._ns_call(
                ns, wire.Lookup(ns.fingerprint, block_keys, True, self._take_releases())
            )
        except GCacheError as exc:
            log.warning("match failed (miss): %s", exc)
            self.counters["misses"] += 1
            return Match(ns, 0, 0)
        self.counters["hits" if res.blocks else "misses"] += 1
        return Match(ns, res.blocks, res.tokens, res.lease_id, res.objects, res.servers)

    async def release(self, match: Match) -> None:
        """Give the match's lease back. The caller does not wait for it: the lease
        rides on this client's next Lookup, or goes out within ``RELEASE_FLUSH_S``
        batched with others (a lost Release only means the lease runs its term)."""
        if match.lease_id and not self._closed:
            self._to_release.append(match.lease_id)
            match.lease_id = 0
            if len(self._to_release) >= MAX_PENDING_RELEASES:
                self._flush_releases()
            elif self._release_timer is None:
                loop = asyncio.get_running_loop()
                self._release_timer = loop.call_later(RELEASE_FLUSH_S, self._flush_releases)

    def _take_releases(self) -> list[int]:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        ids, self._to_release = self._to_release, []
        return ids

    def _flush_releases(self) -> None:
        ids = self._take_releases()
        if ids and not self._closed:
            task = asyncio.create_task(self._send_releases(ids))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _send_releases(self, ids: list[int]) -> None:
        try:
            await self._meta_call(wire.Release(ids[0], ids[1:]))
        except GCacheError as exc:
            log.debug("release failed (the leases expire by themselves): %s", exc)

    # ---- get -----------------------------------------------------------------------------

    def layer_rows(self, match: Match, layer: int) -> tuple[int, int]:
        """(first token, token count) of the rows ``get_layers`` returns for a layer:
        every matched token for full layers, the stored window for sliding ones."""
        layout = match.namespace.layout
        tail = layout.group_tail_blocks[layout.layer_group[layer]]
        first = 0 if tail is None else max(0, match.blocks - tail)
        bs = layout.block_size
        return first * bs, (match.blocks - first) * bs

    async def fetch_layer(
        self, match: Match, layer: int, out: KVPair | None = None, *, offload: bool = False
    ) -> LayerKV:
        """Read one layer of a match into ``out`` (or fresh arrays) and verify it.
        Raises :class:`GCacheError` subclasses; the stream/``get`` turn them into misses.
        ``offload``: copy and verify a large shared-memory layer on the copy threads,
        for a caller computing while layers arrive (``get_layers``); inline is cheaper
        when nobody else runs meanwhile (``get``)."""
        ns = match.namespace
        layout = ns.layout
        spec = layout.spec.layers[layer]
        g = layout.layer_group[layer]
        first_tok, n = self.layer_rows(match, layer)
        k_shape = (n, spec.kv_heads, spec.k_head_dim)
        v_shape = (n, spec.kv_heads, spec.v_head_dim)
        if out is None:
            k_arr, v_arr = arrays.empty(k_shape, layout.dtype), arrays.empty(v_shape, layout.dtype)
            k_user: Any = k_arr
            v_user: Any = v_arr
        else:
            k_user, v_user = out
            k_arr = arrays.to_numpy(k_user, layout.dtype, f"layer {layer} K out")
            v_arr = arrays.to_numpy(v_user, layout.dtype, f"layer {layer} V out")
            if k_arr.shape != k_shape or v_arr.shape != v_shape:
                raise LayoutError(f"layer {layer} out: want K {k_shape} and V {v_shape}")
            if arrays.is_torch(k_user) and k_arr.ctypes.data != k_user.data_ptr():
                raise LayoutError(f"layer {layer} out: tensors must be contiguous CPU tensors")
        off, kb, vb = layout.layer_range(layer)
        li = layout.group_layers[g].index(layer)
        plan_args = (match, g, first_tok // layout.block_size, off, kb, vb, li, k_arr, v_arr)
        layer_bytes = k_arr.nbytes + v_arr.nbytes
        big = offload and layer_bytes >= OFFLOAD_BYTES
        # A full layer is ~500 blocks: building its plan in Python takes ~1.5 ms, which
        # on the event loop would hold up layers already fetched. Off the loop it goes.
        plans = await self._offload(_plan_layer, *plan_args) if big else _plan_layer(*plan_args)
        remote = {}
        for si, sp in plans.items():
            seg = self._mapped(match.servers[si])
            if seg is None:
                remote[si] = await self._server(match.servers[si])
                continue
            if big:  # copy + verify, half of the blocks on each copy thread
                parts = _halves(len(sp.checks), sp.nbytes)
                ok = all(
                    await gather_or_cancel(
                        *(self._offload(_copy_verify, seg, sp, a, b) for a, b in parts)
                    )
                )
            else:
                ok = _copy_verify(seg, sp, 0, len(sp.checks))
            if not ok:
                raise IntegrityError(f"layer {layer}: checksum mismatch")
            self.counters["bytes_read_shm"] += sp.nbytes
        if remote:
            await gather_or_cancel(
                *(
                    remote[si].call(
                        wire.Read(plans[si].grants, plans[si].ranges),
                        dest=plans[si].dest,
                        timeout=self.config.timeout_s,
                    )
                    for si in remote
                )
            )
            checks = [c for si in remote for c in plans[si].checks]
            if big:
                parts = _halves(len(checks), layer_bytes)
                jobs = (self._offload(_verify, checks[a:b]) for a, b in parts)
                ok = all(await gather_or_cancel(*jobs))
            else:
                ok = _verify(checks)
            if not ok:
                raise IntegrityError(f"layer {layer}: checksum mismatch")
        if self.as_torch and out is None:
            k_user, v_user = (
                arrays.as_torch(k_arr, layout.dtype),
                arrays.as_torch(v_arr, layout.dtype),
            )
        self.counters["bytes_read"] += k_arr.nbytes + v_arr.nbytes
        return LayerKV(layer, first_tok, k_user, v_user)

    async def get(self, match: Match, out: Sequence[KVPair] | None = None) -> list[LayerKV] | None:
        """Every layer of ``match`` (into ``out[l]`` when given), or ``None`` on a miss."""
        self._check_open()
        if match.blocks == 0:
            return None
        reads = (
            self.fetch_layer(match, i, None if out is None else out[i])
            for i in range(match.namespace.layout.num_layers)
        )
        try:
            return await gather_or_cancel(*reads)
        except LayoutError:
            raise
        except (GCacheError, TimeoutError) as exc:
            self._note_miss(exc)
            return None

    def get_layers(self, match: Match, out: Sequence[KVPair] | None = None) -> LayerStream:
        """Async iterator over the match's layers in model order, with
        ``config.layers_in_flight`` layer reads ahead of the consumer."""
        self._check_open()
        return LayerStream(self, match, out)

    def _note_miss(self, exc: BaseException) -> None:
        kind = "integrity_errors" if isinstance(exc, IntegrityError) else "read_errors"
        if isinstance(exc, RemoteError):
            kind = "remote_errors"
        self.counters[kind] += 1
        log.warning("read failed, treating as a miss: %s", exc)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)


class LayerStream:
    """Yields :class:`LayerKV` in layer order. On any store failure it stops early
    and sets ``ok = False``: the engine must recompute (never wrong KV)."""

    def __init__(
        self, client: AsyncGCacheClient, match: Match, out: Sequence[KVPair] | None
    ) -> None:
        self.client = client
        self.match = match
        self.out = out
        self.ok = match.blocks > 0
        self.error: str = "" if self.ok else "no match"
        self._next = 0
        self._tasks: dict[int, asyncio.Task[LayerKV]] = {}
        self._num = match.namespace.layout.num_layers if match.blocks else 0

    def _schedule(self) -> None:
        ahead = self.client.config.layers_in_flight
        top = min(self._num, self._next + ahead)
        for layer in range(self._next, top):
            if layer not in self._tasks:
                out = None if self.out is None else self.out[layer]
                self._tasks[layer] = asyncio.create_task(
                    self.client.fetch_layer(self.match, layer, out, offload=True)
                )

    def __aiter__(self) -> LayerStream:
        return self

    async def __anext__(self) -> LayerKV:
        if not self.ok or self._next >= self._num:
            raise StopAsyncIteration
        self._schedule()
        task = self._tasks.pop(self._next)
        try:
            layer = await task
        except LayoutError:
            await self.aclose()
            raise
        except (GCacheError, TimeoutError) as exc:
            self.client._note_miss(exc)
            self.ok = False
            self.error = str(exc)
            await self.aclose()
            raise StopAsyncIteration from None
        self._next += 1
        self._schedule()
        return layer

    async def aclose(self) -> None:
        """Stop the reads still in flight and wait until they can no longer write
        into any buffer."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._next = self._num
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
