"""The read path: a layer of a match into the caller's arrays (or fresh ones),
verified. :meth:`Reader.fetch_layer` composes the parts: the destination
buffers, the layer's plan per server and tier (:mod:`.plans`), the transport
each share goes through (:mod:`.transports`), and the result. ``get`` reads
every layer at once; a :class:`~gcache_client.layers.LayerStream` reads them in
order, ahead of the consumer."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from gcache.config import ClientConfig
from gcache.errors import GCacheError, IntegrityError, LayoutError, RemoteError
from gcache_client import arrays
from gcache_client.conn import gather_or_cancel
from gcache_client.layers import LayerReads, LayerStream
from gcache_client.plans import OFFLOAD_BYTES, LayerTarget, layer_rows, plan_layer
from gcache_client.pool import ConnectionPool
from gcache_client.staged import StagingMaps
from gcache_client.transports import LayerJob, Share, Transports
from gcache_client.types import KVPair, LayerKV, Match

log = logging.getLogger("gcache.client")


class Reader:
    def __init__(
        self,
        config: ClientConfig,
        pool: ConnectionPool,
        staging: StagingMaps,
        counters: Counter[str],
        as_torch: bool = False,
    ) -> None:
        self.config = config
        self.counters = counters
        self.as_torch = as_torch
        self.transports = Transports(pool, staging, counters, config.timeout_s)

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
        ``offload``: copy and verify a large layer on the copy threads, for a caller
        computing while layers arrive (``get_layers``); inline is cheaper when
        nobody else runs meanwhile (``get``). ``reads``: a stream's group plans,
        and its large shared-memory copies one at a time in layer order
        (:class:`~gcache_client.layers.LayerReads`)."""
        target, k_user, v_user = self._target(match, layer, out)
        # A layer's plan is O(servers) once its group's is made (O(blocks), once per
        # match and group in a stream); the per-block views a TCP read needs are made
        # on a copy thread for a large layer.
        plans = plan_layer(target, None if reads is None else reads.groups)
        big = offload and target.nbytes >= OFFLOAD_BYTES
        job = LayerJob(layer, target.nbytes, big, reads)
        routes = self.transports.route(match.servers, plans)
        left: list[Share] = []
        for transport in self.transports.order:
            shares = routes.get(transport)
            if shares is not None:
                left = await transport.read_layer(job, shares + left if left else shares)
            elif left:
                left = await transport.read_layer(job, left)
        if self.as_torch and out is None:
            dtype = match.namespace.layout.dtype
            k_user, v_user = (
                arrays.as_torch(target.k_arr, dtype),
                arrays.as_torch(target.v_arr, dtype),
            )
        self.counters["bytes_read"] += target.nbytes
        return LayerKV(layer, target.first_tok, k_user, v_user)

    def _target(self, match: Match, layer: int, out: KVPair | None) -> tuple[LayerTarget, Any, Any]:
        """The layer's :class:`LayerTarget` over ``out`` (checked: it must be filled
        in place) or fresh arrays, and what the caller gets back for K and V."""
        layout = match.namespace.layout
        spec = layout.spec.layers[layer]
        first_tok, n = layer_rows(match, layer)
        k_shape = (n, spec.kv_heads, spec.k_head_dim)
        v_shape = (n, spec.kv_heads, spec.v_head_dim)
        k_arr: np.ndarray
        v_arr: np.ndarray
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
        return LayerTarget(match, layer, first_tok, k_arr, v_arr), k_user, v_user

    async def get(self, match: Match, out: Sequence[KVPair] | None = None) -> list[LayerKV] | None:
        """Every layer of ``match`` (into ``out[l]`` when given), or ``None`` on a miss."""
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
            self.note_miss(exc)
            return None

    def stream(self, match: Match, out: Sequence[KVPair] | None = None) -> LayerStream:
        return LayerStream(self, match, out)

    def note_miss(self, exc: BaseException) -> None:
        kind = "integrity_errors" if isinstance(exc, IntegrityError) else "read_errors"
        if isinstance(exc, RemoteError):
            kind = "remote_errors"
        self.counters[kind] += 1
        log.warning("read failed, treating as a miss: %s", exc)
