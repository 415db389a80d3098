"""``AsyncGCacheClient``: put, lookup, get and layerwise ``get_layers`` on asyncio.

Failure semantics (see :mod:`gcache.errors`): a store that is down, slow, or
returns bytes that fail their checksum never raises into the engine on a read
path; ``get`` returns ``None`` and a ``LayerStream`` stops with ``ok == False``
(a miss: recompute). ``put`` reports failures in its result. Misuse (tensors that
do not match the layout, buffers that cannot be filled in place, a closed client)
raises.

The facade over the parts, wired here: :mod:`.pool` (connections, shared-memory
mappings, copy threads), :mod:`.metacalls` (calls to the meta, leader retry),
:mod:`.writer` (put), :mod:`.reads` (get, ``fetch_layer``) over :mod:`.plans`
(read plans and checks) and :mod:`.transports` (shared memory, staging file,
TCP), :mod:`.layers` (``LayerStream``), :mod:`.leases` (batched releases).
"""

from __future__ import annotations

import dataclasses
import logging
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
from gcache.errors import ClosedError, GCacheError, LayoutError
from gcache_client.conn import PipelinedConn
from gcache_client.layers import LayerReads, LayerStream
from gcache_client.leases import ReleaseBatcher
from gcache_client.metacalls import MetaCalls
from gcache_client.plans import OFFLOAD_BYTES, layer_rows
from gcache_client.pool import ConnectionPool
from gcache_client.reads import Reader
from gcache_client.router import AsyncRouterClient
from gcache_client.staged import StagingMaps
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
        self.counters: Counter[str] = Counter()
        self.pool = ConnectionPool(self.config)
        self.staging = StagingMaps()  # local servers' staging files (tier-1 reads)
        self.meta = MetaCalls(self.pool, self.config.timeout_s)
        self._releases = ReleaseBatcher(self.meta.call)
        self._writer = Writer(self.meta, self.pool, self.config, self.counters)
        self._reader = Reader(self.config, self.pool, self.staging, self.counters, as_torch)
        self._closed = False
        self._compute: dict[bytes, ModelCompute] = {}  # namespace -> compute model
        # Hit reports to gcache-router after each match (client.router + instance_id).
        self.router: AsyncRouterClient | None = (
            AsyncRouterClient(self.config.router, timeout_s=self.config.timeout_s)
            if self.config.router
            else None
        )

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
        self._closed = self.meta.closed = True
        if self.router is not None:
            await self.router.close()
        await self.pool.close()
        self.staging.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client closed")

    async def _meta_call(self, msg: wire.Msg) -> Any:
        """One hot-path call to the meta (:meth:`MetaCalls.call`)."""
        self._check_open()
        return await self.meta.call(msg)

    async def _server(self, addr: wire.ServerAddr) -> PipelinedConn:
        return await self.pool.server(addr)

    async def _grpc_call(self, method: str, req: Any) -> Any:
        return await self.meta.grpc_call(method, req)

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
        return await self.meta.register(req)

    async def _ns_call(self, ns: Namespace, msg: wire.Msg) -> Any:
        self._check_open()
        return await self.meta.ns_call(ns, msg)

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
        return layer_rows(match, layer)

    async def fetch_layer(
        self,
        match: Match,
        layer: int,
        out: KVPair | None = None,
        *,
        offload: bool = False,
        reads: LayerReads | None = None,
    ) -> LayerKV:
        """One layer of a match, verified (:meth:`gcache_client.reads.Reader.fetch_layer`)."""
        return await self._reader.fetch_layer(match, layer, out, offload=offload, reads=reads)

    async def get(self, match: Match, out: Sequence[KVPair] | None = None) -> list[LayerKV] | None:
        """Every layer of ``match`` (into ``out[l]`` when given), or ``None`` on a miss."""
        self._check_open()
        return await self._reader.get(match, out)

    def get_layers(self, match: Match, out: Sequence[KVPair] | None = None) -> LayerStream:
        """Async iterator over the match's layers in model order, with
        ``config.layers_in_flight`` layer reads ahead of the consumer."""
        self._check_open()
        return self._reader.stream(match, out)

    def _note_miss(self, exc: BaseException) -> None:
        self._reader.note_miss(exc)

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
