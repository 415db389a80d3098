"""The put path: check the caller's KV against the layout, ask the meta for
placements, write each object (a ``WRITE`` over TCP, or a copy into a local
server's mapped segment followed by one ``SEAL`` per server), and commit the
objects written with their checksums and the servers' receipts. Each write carries
its object's record (:class:`gcache.wire.ObjectInfo`: the one its write grant is
bound to, with the checksums), which the server persists before the receipt."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from gcache import _native as native
from gcache import keys as keymod
from gcache import layout as laymod
from gcache import wire
from gcache.config import ClientConfig
from gcache.errors import GCacheError, LayoutError
from gcache.transport.limits import RateLimitedLog
from gcache_client import arrays
from gcache_client.metacalls import MetaCalls
from gcache_client.pool import ConnectionPool
from gcache_client.types import KVPair, Namespace, PutResult

log = logging.getLogger("gcache.client")
# One line per failed seal flooded the log while a server was down (every put):
# a bounded rate; the next line that gets through counts the ones left out.
seal_log = RateLimitedLog(log)


def check_kv(
    ns: Namespace, ntokens: int, nblocks: int, kv: Sequence[KVPair]
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
        first = layout.window_blocks(layout.layer_group[i], nblocks).start
        if start > first * bs:
            raise LayoutError(
                f"layer {i} holds tokens from {start}, but blocks from {first} must be stored"
            )
        out.append((ka, va, start))
    return out


def object_payload(
    layout: laymod.Layout,
    views: list[tuple[np.ndarray, np.ndarray, int]],
    block: int,
    group: int,
) -> list[memoryview]:
    """The object's bytes as a list of views into the caller's arrays: K then V of
    each layer of the group (each layer's pair is one checksummed unit)."""
    bs = layout.block_size
    payload: list[memoryview] = []
    for layer in layout.group_layers[group]:
        k, v, start = views[layer]
        lo = block * bs - start
        payload += (arrays.byte_view(k[lo : lo + bs]), arrays.byte_view(v[lo : lo + bs]))
    return payload


def object_views(
    layout: laymod.Layout,
    views: list[tuple[np.ndarray, np.ndarray, int]],
    block: int,
    group: int,
) -> tuple[list[memoryview], bytes]:
    """:func:`object_payload` and its per-layer checksums (xxh3-64 of K then V)."""
    payload = object_payload(layout, views, block, group)
    return payload, native.checksums(payload, 2)


def object_info(
    layout: laymod.Layout, fp: bytes, block_keys: list[bytes], block: int, group: int, sums: bytes
) -> wire.ObjectInfo:
    """The record of the object at ``block``/``group`` that its write grant is bound
    to (``capability.bind_digest``), with its per-layer checksums."""
    return wire.ObjectInfo(
        fp,
        block_keys[block],
        block_keys[block - 1] if block else b"",
        block,
        group,
        sums,
        list(layout.group_layer_bytes[group]),
    )


class Writer:
    """Puts: the meta's placements (through ``meta``), the objects' bytes to the
    servers (through ``pool``), the commit; counted in ``counters``."""

    def __init__(
        self, meta: MetaCalls, pool: ConnectionPool, config: ClientConfig, counters: Counter[str]
    ) -> None:
        self._meta = meta
        self._pool = pool
        self._config = config
        self._counters = counters

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
        layout = ns.layout
        ntokens = len(tokens)
        nblocks = ntokens // layout.block_size
        result = PutResult(blocks=nblocks)
        if nblocks == 0:
            return result
        views = check_kv(ns, ntokens, nblocks, kv)
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
            placed: wire.PutPlaced = await self._meta.ns_call(
                ns, wire.PutBegin(ns.fingerprint, block_keys, masks, ckpt_from)
            )
        except GCacheError as exc:
            log.warning("put: PutBegin failed: %s", exc)
            result.error = str(exc)
            self._counters["put_errors"] += 1
            return result
        if placed.checkpoints:
            masks = layout.add_windows(masks, placed.checkpoints)
            self._counters["checkpoints_saved"] += len(placed.checkpoints)
        wanted = sum(bin(m).count("1") for m in masks)
        result.no_space = placed.no_space
        result.deduped = wanted - len(placed.placements) - placed.no_space
        if not placed.placements:
            return result
        per_server = self._config.max_inflight_writes
        sem = asyncio.Semaphore(per_server * max(1, len(placed.servers)))

        async def write_one(pi: int, p: wire.Placement) -> tuple[int, bytes, int | None] | None:
            """Write one object; ``(placement, sums, receipt)``, where the receipt of
            a shared-memory copy is ``None`` until its server seals the grant."""
            if not 0 <= p.block < nblocks or any(
                p.block * bs < views[layer][2] for layer in layout.group_layers[p.group]
            ):
                log.warning("put: placement for block %d outside the rows we hold", p.block)
                return None
            payload = object_payload(layout, views, p.block, p.group)
            async with sem:
                try:
                    addr = placed.servers[p.server]
                    seg = self._pool.mapped(addr)
                    if seg is not None:
                        g = p.grant  # copy + per-layer checksums in one pass
                        sums = seg.write_checksums(g.offset, g.length, g.expiry_ms, payload, 2)
                        return pi, sums, None
                    sums = native.checksums(payload, 2)
                    obj = object_info(layout, ns.fingerprint, block_keys, p.block, p.group, sums)
                    conn = await self._pool.server(addr)
                    reply: wire.Ok = await conn.call(
                        wire.Write(p.grant, obj), payload, timeout=self._config.timeout_s
                    )
                except GCacheError as exc:
                    log.warning(
                        "put: write to %s failed: %s", placed.servers[p.server].server_id, exc
                    )
                    return None
            return pi, sums, reply.value

        if len(placed.placements) == 1:  # no task and loop pass for one object
            done = [await write_one(0, placed.placements[0])]
        else:
            done = await asyncio.gather(*(write_one(i, p) for i, p in enumerate(placed.placements)))
        written = [d for d in done if d is not None]
        shm: list[tuple[int, wire.ObjectInfo]] = []
        for pi, sums, rc in written:
            if rc is None:  # copied into a mapped segment: sealed with its record
                pl = placed.placements[pi]
                obj = object_info(layout, ns.fingerprint, block_keys, pl.block, pl.group, sums)
                shm.append((pi, obj))
        sealed = await self._seal(placed, shm)
        ok: list[tuple[int, bytes]] = []
        receipts: list[int] = []
        for pi, sums, rc in written:
            rc = sealed.get(pi) if rc is None else rc
            if rc is not None:
                ok.append((pi, sums))
                receipts.append(rc)
        try:
            await self._meta.call(wire.PutCommit(placed.put_id, ok, receipts))
        except GCacheError as exc:
            log.warning("put: PutCommit failed: %s", exc)
            result.error = str(exc)
            self._counters["put_errors"] += 1
            return result
        result.stored = len(ok)
        result.failed = len(done) - len(ok)
        result.bytes_written = sum(placed.placements[pi].grant.length for pi, _ in ok)
        self._counters["objects_put"] += result.stored
        self._counters["bytes_put"] += result.bytes_written
        return result

    async def _seal(
        self, placed: wire.PutPlaced, shm_done: list[tuple[int, wire.ObjectInfo]]
    ) -> dict[int, int]:
        """One ``SEAL`` per server for the objects this client copied into its
        segment itself (placement index, record): the server consumes their grants
        (as a ``WRITE`` would), persists their records and returns receipts.
        Placement index -> receipt; a refused or failed seal leaves its objects out
        (the put stores fewer, the meta reclaims them)."""
        if not shm_done:  # every object went over TCP (WRITE answered its receipt)
            return {}
        by_server: dict[int, list[tuple[int, wire.ObjectInfo]]] = {}
        for pi, obj in shm_done:
            by_server.setdefault(placed.placements[pi].server, []).append((pi, obj))

        async def seal_one(si: int, part: list[tuple[int, wire.ObjectInfo]]) -> dict[int, int]:
            addr = placed.servers[si]
            pis = [pi for pi, _ in part]
            try:
                conn = await self._pool.server(addr)
                reply: wire.Sealed = await conn.call(
                    wire.Seal([placed.placements[pi].grant for pi in pis], [o for _, o in part]),
                    timeout=self._config.timeout_s,
                )
            except GCacheError as exc:
                seal_log.log(time.monotonic(), "put: seal on %s failed: %s", addr.server_id, exc)
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
