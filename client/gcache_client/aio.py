"""``AsyncGCacheClient``: put, lookup, get and layerwise ``get_layers`` on asyncio.

Failure semantics (see :mod:`gcache.errors`): a store that is down, slow, or
returns bytes that fail their checksum never raises into the engine on a read
path; ``get`` returns ``None`` and a ``LayerStream`` stops with ``ok == False``
(a miss: recompute). ``put`` reports failures in its result. Misuse (tensors that
do not match the layout, buffers that cannot be filled in place, a closed client)
raises.

The parts: :mod:`.pool` (connections, shared-memory mappings, copy threads),
:mod:`.writer` (put), :mod:`.plans` (read plans and checks), :mod:`.leases`
(batched releases), :mod:`.layers` (``LayerStream``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from gcache import keys as keymod
from gcache import layout as laymod
from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache.compute import UNIT_COMPUTE, ModelCompute, compute_for_layout
from gcache.config import ClientConfig
from gcache.errors import (
    ClosedError,
    ConnectionLost,
    GCacheError,
    IntegrityError,
    LayoutError,
    NotLeader,
    RemoteError,
    UnknownNamespace,
)
from gcache_client import arrays
from gcache_client.conn import PipelinedConn, gather_or_cancel
from gcache_client.layers import LayerReads, LayerStream
from gcache_client.leases import ReleaseBatcher
from gcache_client.plans import (
    OFFLOAD_BYTES,
    ServerPlan,
    copy_verify,
    halves,
    plan_layer,
    verify,
)
from gcache_client.pool import ConnectionPool
from gcache_client.router import AsyncRouterClient
from gcache_client.staged import STAGED_INLINE_BLOCKS, StagingMaps, read_staged
from gcache_client.tiers import best_cut
from gcache_client.types import KVPair, LayerKV, Match, Namespace, PutResult
from gcache_client.writer import Writer

__all__ = ["OFFLOAD_BYTES", "AsyncGCacheClient", "LayerStream"]

log = logging.getLogger("gcache.client")


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
        self.pool = ConnectionPool(self.config)
        self.staging = StagingMaps()  # local servers' staging files (tier-1 reads)
        self._releases = ReleaseBatcher(self._meta_call)
        self._writer = Writer(self, self.pool)
        self._closed = False
        self._compute: dict[bytes, ModelCompute] = {}  # namespace -> compute model
        # Hit reports to gcache-router after each match (client.router + instance_id).
        self.router: AsyncRouterClient | None = (
            AsyncRouterClient(self.config.router, timeout_s=self.config.timeout_s)
            if self.config.router
            else None
        )
        self.counters: Counter[str] = Counter()

    # ---- lifecycle ---------------------------------------------------------------

    async def connect(self) -> AsyncGCacheClient:
        self._check_open()
        await self.pool.meta()
        return self

    async def __aenter__(self) -> AsyncGCacheClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if not self._closed:
            await self._releases.close(self.config.timeout_s)
        self._closed = True
        if self.router is not None:
            await self.router.close()
        await self.pool.close()
        self.staging.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client closed")

    async def _meta_call(self, msg: wire.Msg) -> Any:
        """One hot-path call. With several metas, a refusal by a standby or a dead
        connection finds the leader and retries once, within ``timeout_s`` in all."""
        self._check_open()
        timeout = self.config.timeout_s
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

    async def _server(self, addr: wire.ServerAddr) -> PipelinedConn:
        return await self.pool.server(addr)

    async def _control(self) -> Any:
        return await self.pool.control_stub()

    async def _grpc_call(self, method: str, req: Any) -> Any:
        """A control call; with several metas a standby's FAILED_PRECONDITION or an
        unreachable meta finds the leader and retries once."""
        try:
            stub = await self._control()
            return await getattr(stub, method)(req, timeout=self.config.timeout_s)
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
                stub = await self._control()
            except ConnectionLost as lost:
                raise GCacheError(f"{method} failed: {lost}") from lost
            return await getattr(stub, method)(req, timeout=self.config.timeout_s)

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
        kv_identity: str = "",
    ) -> Namespace:
        """Register (idempotently) and return the namespace. ``layout`` is a spec or
        a preset name (``mimo-v2-flash``, ``llama-3-8b``). ``kv_identity``: anything
        else that changes the KV of every block (a LoRA adapter and a fingerprint of
        its weights, the pipeline stage), as a canonical string; part of the
        namespace fingerprint."""
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
            kv_identity=kv_identity,
        )
        fp = await self._register(req)
        return Namespace(fp, model, laymod.Layout(spec), req)

    async def _register(self, req: Any) -> bytes:
        try:
            reply = await self._grpc_call("RegisterNamespace", req)
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
        extras: Sequence[bytes] | None = None,
    ) -> tuple[int, int]:
        """Admin: evict the cached objects of ``tokens``' blocks (``blocks`` selects
        which, default all): only their windowed objects, or everything (full objects
        go only from blocks without cached descendants). Returns (evicted, refused).
        ``extras``: as for :meth:`put`."""
        self._check_open()
        block_keys = _keys(ns, tokens, extras)
        if blocks is not None:
            block_keys = [block_keys[i] for i in blocks]
        layout = ns.layout
        mask = 0
        for g, tail in enumerate(layout.group_tail_blocks):
            if tail is not None or not windows_only:
                mask |= 1 << g
        try:
            reply = await self._grpc_call(
                "Evict", pb.EvictRequest(namespace=ns.fingerprint, keys=block_keys, groups=mask)
            )
        except grpc.aio.AioRpcError as exc:
            raise GCacheError(f"Evict failed: {exc.details()}") from exc
        return int(reply.evicted), int(reply.refused)

    # ---- put -------------------------------------------------------------------------

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
        trailing rows. ``extras[i]`` (bytes, one per full block at least) is mixed
        into block i's key: what besides the tokens made that block's KV (multimodal
        content hashes, prompt-embedding hashes), so the same tokens with other
        extras are other blocks. Full groups are stored for every block, windowed groups only
        for the blocks a match ending at this prompt needs (strict O(W)). Store
        failures are reported in the result, never raised."""
        self._check_open()
        return await self._writer.put(ns, tokens, kv, extras=extras)

    # ---- lookup -----------------------------------------------------------------------

    async def lookup(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        *,
        extras: Sequence[bytes] | None = None,
    ) -> int:
        """Tokens of the longest valid cached prefix (no lease; 0 if the store is down).
        ``extras``: as for :meth:`put`."""
        self._check_open()
        block_keys = _keys(ns, tokens, extras)
        try:
            res: wire.LookupResult = await self._ns_call(
                ns, wire.Lookup(ns.fingerprint, block_keys, release=self._take_releases())
            )
        except GCacheError as exc:
            log.warning("lookup failed (miss): %s", exc)
            return 0
        return int(res.tokens)

    async def match(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        *,
        local_tokens: int = 0,
        extras: Sequence[bytes] | None = None,
    ) -> Match:
        """Longest valid prefix with a read lease on its objects, ready for ``get`` or
        ``get_layers``. Release it (or let it expire) when done. ``extras``: what
        besides the tokens made each block's KV (as for :meth:`put`; a match finds
        only blocks put with the same extras).

        With ``client.router`` and ``client.instance_id`` set, the outcome goes to
        the router as a hit report (without waiting): ``local_tokens`` (what the
        engine already holds itself) and the tokens past them the pool holds."""
        self._check_open()
        block_keys = _keys(ns, tokens, extras)
        try:
            res: wire.LookupResult = await self._ns_call(
                ns, wire.Lookup(ns.fingerprint, block_keys, True, self._take_releases())
            )
        except GCacheError as exc:
            log.warning("match failed (miss): %s", exc)
            self.counters["misses"] += 1
            self._report_hits(len(tokens), local_tokens, 0)
            return Match(ns, 0, 0)
        if (
            self.config.load_or_recompute
            and self.config.compute_tflops > 0
            and res.blocks
            and res.objects
        ):
            res = await self._load_or_recompute(ns, block_keys, res)
        self.counters["hits" if res.blocks else "misses"] += 1
        self._report_hits(len(tokens), local_tokens, int(res.tokens))
        return Match(ns, res.blocks, res.tokens, res.lease_id, res.objects, res.servers)

    async def _load_or_recompute(
        self, ns: Namespace, block_keys: list[bytes], res: wire.LookupResult
    ) -> wire.LookupResult:
        """Cut the match where loading the rest would take longer than recomputing
        it (:func:`gcache_client.tiers.best_cut`)."""
        layout = ns.layout
        compute = self._compute.get(ns.fingerprint)
        if compute is None:
            compute = self._compute[ns.fingerprint] = compute_for_layout(layout)
        if compute is UNIT_COMPUTE:
            return res  # a model of unknown cost: always load
        q = best_cut(
            layout, compute, res.blocks, res.objects, res.servers, self.config.compute_tflops
        )
        if q >= res.blocks:
            return res
        self.counters["matches_cut"] += 1
        self.counters["blocks_cut"] += res.blocks - q
        bs = layout.block_size
        if q == 0:
            self._releases.add(res.lease_id)
            return wire.LookupResult(blocks=0, tokens=0)
        if all(t is None for t in layout.group_tail_blocks):
            # No windows: any prefix of the match is valid; keep the lease.
            objs = [o for o in res.objects if o.block < q]
            return wire.LookupResult(q, q * bs, res.lease_id, objs, res.servers)
        # Windowed groups need their window at the new end: ask again for q blocks.
        self._releases.add(res.lease_id)
        try:
            got: wire.LookupResult = await self._ns_call(
                ns, wire.Lookup(ns.fingerprint, block_keys[:q], True, self._take_releases())
            )
        except GCacheError as exc:
            log.warning("match failed (miss): %s", exc)
            return wire.LookupResult(blocks=0, tokens=0)
        return got

    def _report_hits(self, prompt: int, local: int, pool: int) -> None:
        if self.router is not None:
            self.router.report_hits_nowait(
                self.config.instance_id, prompt, local, max(0, pool - local)
            )

    async def release(self, match: Match) -> None:
        """Give the match's lease back. The caller does not wait for it: the lease
        rides on this client's next Lookup, or goes out within ``RELEASE_FLUSH_S``
        batched with others (a lost Release only means the lease runs its term)."""
        if match.lease_id and not self._closed:
            self._releases.add(match.lease_id)
            match.lease_id = 0

    def _take_releases(self) -> list[int]:
        return self._releases.take()

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
        self,
        match: Match,
        layer: int,
        out: KVPair | None = None,
        *,
        offload: bool = False,
        reads: LayerReads | None = None,
    ) -> LayerKV:
        """Read one layer of a match into ``out`` (or fresh arrays) and verify it.
        Raises :class:`GCacheError` subclasses; the stream/``get`` turn them into misses.
        ``offload``: copy and verify a large shared-memory layer on the copy threads,
        for a caller computing while layers arrive (``get_layers``); inline is cheaper
        when nobody else runs meanwhile (``get``). ``reads``: a stream's group plans,
        and its large shared-memory copies one at a time in layer order
        (:class:`~gcache_client.layers.LayerReads`)."""
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
            for user, arr, what in ((k_user, k_arr, "K"), (v_user, v_arr, "V")):
                if not arrays.fills_in_place(user, arr):
                    raise LayoutError(
                        f"layer {layer} {what} out: must be a writable C-contiguous CPU "
                        "array or tensor (a read cannot fill a strided or copied buffer)"
                    )
        off, kb, vb = layout.layer_range(layer)
        li = layout.group_layers[g].index(layer)
        plan_args = (match, g, first_tok // layout.block_size, off, kb, vb, li, k_arr, v_arr)
        layer_bytes = k_arr.nbytes + v_arr.nbytes
        big = offload and layer_bytes >= OFFLOAD_BYTES
        # A layer's plan is O(servers) once its group's is made (O(blocks), once per
        # match and group in a stream); the per-block views a TCP read needs are made
        # on a copy thread for a large layer (materialize, below).
        plans = plan_layer(*plan_args, None if reads is None else reads.groups)
        remote = {}
        for si, sp in plans.items():
            addr = match.servers[si >> 1]  # si: plan_key(server, tier)
            seg = self.pool.mapped(addr) if not si & 1 else None
            if seg is None:
                if si & 1 and await self._read_staged(addr, sp, big, layer):
                    continue  # a local server's NVMe object, through its staging file
                remote[si] = await self.pool.server(addr)
                if si & 1:
                    self.counters["bytes_read_nvme"] += sp.nbytes
                continue
            if big and reads is not None and reads.ordered:  # a stream's, in layer order
                ok = await reads.copy(copy_verify, seg, sp, 0, sp.count)
            elif big:  # copy + verify, half of the blocks on each copy thread
                parts = halves(sp.count, sp.nbytes)
                ok = all(
                    await gather_or_cancel(
                        *(self.pool.offload(copy_verify, seg, sp, a, b) for a, b in parts)
                    )
                )
            else:
                ok = copy_verify(seg, sp, 0, sp.count)
            if not ok:
                raise IntegrityError(f"layer {layer}: checksum mismatch")
            self.counters["bytes_read_shm"] += sp.nbytes
        if remote:
            if big:
                for si in remote:
                    await self.pool.offload(plans[si].materialize)
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
                parts = halves(len(checks), layer_bytes)
                jobs = (self.pool.offload(verify, checks[a:b]) for a, b in parts)
                ok = all(await gather_or_cancel(*jobs))
            else:
                ok = verify(checks)
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
        shared = LayerReads()  # the group plans, made once for all layers
        reads = (
            self.fetch_layer(match, i, None if out is None else out[i], reads=shared)
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

    async def _read_staged(
        self, addr: wire.ServerAddr, sp: ServerPlan, big: bool, layer: int
    ) -> bool:
        """Tier-1 objects of a server on this host (its segment is mapped) through
        its staging file (:mod:`gcache_client.staged`); False: read them over TCP."""
        if self.pool.mapped(addr) is None:
            return False
        if big and sp.count > STAGED_INLINE_BLOCKS:  # else a thread hop costs more
            await self.pool.offload(sp.materialize)
        conn = await self.pool.server(addr)
        offload = self.pool.offload if big else None
        timeout = self.config.timeout_s
        ok = await read_staged(conn, addr.server_id, sp, self.staging, offload, timeout)
        if ok is None:
            return False
        if not ok:
            raise IntegrityError(f"layer {layer}: checksum mismatch")
        self.counters["bytes_read_nvme"] += sp.nbytes
        return True

    def stats(self) -> dict[str, int]:
        out = {**self.counters, **self.pool.stats(), **self.staging.stats()}
        if self.router is not None:
            out.update({f"router_{k}": v for k, v in self.router.stats().items()})
        return out


def _keys(
    ns: Namespace, tokens: Sequence[int] | np.ndarray, extras: Sequence[bytes] | None
) -> list[bytes]:
    """The chained block keys of ``tokens`` in ``ns``, ``extras`` mixed in (one per
    full block; more are ignored, fewer is a LayoutError)."""
    try:
        return keymod.block_keys(ns.fingerprint, tokens, ns.layout.block_size, extras)
    except ValueError as exc:
        raise LayoutError(f"block keys: {exc}") from exc
