"""The operations ``gcache-bench`` measures, each as a user of the client sees it.

* ``write``: ``--batch`` objects of SIZE bytes per operation (default 1), a complete
  ``put`` (PutBegin, the data writes, PutCommit; checksums computed), to new keys.
* ``read``: a complete leased read of ``--batch`` objects: ``match`` (Lookup with
  lease), the data read into a preallocated buffer with checksum verification,
  ``release``. A batch is one prompt of ``--batch`` blocks, so one Lookup and one
  Read cover it (what Mooncake's ``batch_get_into`` of that many keys does).
* ``get_layers``: a whole MiMo-V2-Flash prompt layer by layer (see ``run_get_layers``).
* ``lookup``: the meta's hot-path Lookup of a prompt's precomputed block keys.

``--qd`` operations are kept in flight per client process.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from gcache import keys as keymod
from gcache import wire
from gcache.benchtool.stats import Progress, Samples
from gcache.layout import LayerSpec, Layout, LayoutSpec
from gcache_client import AsyncGCacheClient, Namespace
from gcache_client.writer import object_info


@dataclass
class Budget:
    iters: int
    seconds: float

    def __post_init__(self) -> None:
        self.deadline = time.perf_counter() + self.seconds if self.seconds > 0 else float("inf")
        self.issued = 0

    def take(self) -> bool:
        if self.issued >= self.iters or time.perf_counter() >= self.deadline:
            return False
        self.issued += 1
        return True


def raw_layout(size: int) -> LayoutSpec:
    """One full layer whose one-token block is exactly ``size`` bytes (uint8)."""
    if size < 2:
        raise ValueError(f"size {size} must be at least 2 bytes")
    if size % 1024 == 0 and size // 1024 <= 65536:
        layer = LayerSpec("full", kv_heads=size // 1024, k_head_dim=512, v_head_dim=512)
    elif size <= 131072 and size >= 2:
        layer = LayerSpec("full", kv_heads=1, k_head_dim=size // 2, v_head_dim=size - size // 2)
    else:
        raise ValueError(
            f"size {size} must be a multiple of 1 KiB up to 64 MiB, or at most 128 KiB"
        )
    return LayoutSpec(block_size=1, dtype="uint8", layers=(layer,))


def raw_kv(spec: LayoutSpec, blocks: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    layer = spec.layers[0]
    rng = np.random.default_rng(1)
    k = rng.integers(0, 256, (blocks, layer.kv_heads, layer.k_head_dim), dtype=np.uint8)
    v = rng.integers(0, 256, (blocks, layer.kv_heads, layer.v_head_dim), dtype=np.uint8)
    return [(k, v)]


def batch_tokens(first: int, batch: int) -> np.ndarray:
    """A prompt of ``batch`` one-token blocks: one operation covers ``batch`` objects."""
    return np.arange(first * batch, (first + 1) * batch, dtype=np.int64)


async def _pump(qd: int, budget: Budget, op: Any, progress: Progress) -> Samples:
    samples = Samples()

    async def worker() -> None:
        while budget.take():
            t0 = time.perf_counter()
            n = await op(budget.issued)
            samples.add(t0, time.perf_counter(), n)
            progress.update(
                len(samples.ends) if budget.iters < 1 << 60 else time.perf_counter() - start
            )

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(qd)))
    progress.close()
    return samples


async def run_write(
    client: AsyncGCacheClient,
    size: int,
    budget: Budget,
    qd: int,
    client_id: int,
    progress: Progress,
    batch: int = 1,
) -> Samples:
    spec = raw_layout(size)
    ns = await client.register_namespace(f"gcache-bench/raw/{uuid.uuid4()}", spec)
    kv = raw_kv(spec, batch)
    base = client_id << 24

    async def op(i: int) -> int:
        res = await client.put(ns, batch_tokens(base + i, batch), kv)
        if not res.ok or res.stored != batch:
            raise RuntimeError(f"write failed: {res}")
        return size * batch

    # Untimed warm-up: connections opened, a local segment mapped (perftest does the same).
    await client.put(ns, batch_tokens(base + (1 << 23), batch), kv)
    return await _pump(qd, budget, op, progress)


async def prepare_objects(
    client: AsyncGCacheClient, size: int, count: int, batch: int = 1
) -> Namespace:
    """``count`` stored prompts of ``batch`` objects each, to read back."""
    spec = raw_layout(size)
    ns = await client.register_namespace(f"gcache-bench/raw/{uuid.uuid4()}", spec)
    kv = raw_kv(spec, batch)
    for i in range(count):
        res = await client.put(ns, batch_tokens(i, batch), kv)
        if not res.ok:
            raise RuntimeError(f"could not store the objects to read: {res}")
    return ns


async def run_read(
    client: AsyncGCacheClient,
    ns: Namespace,
    count: int,
    budget: Budget,
    qd: int,
    progress: Progress,
    batch: int = 1,
) -> Samples:
    spec = ns.layout.spec.layers[0]
    bufs = [
        [
            (
                np.empty((batch, spec.kv_heads, spec.k_head_dim), np.uint8),
                np.empty((batch, spec.kv_heads, spec.v_head_dim), np.uint8),
            )
        ]
        for _ in range(qd)
    ]
    free = list(range(qd))
    size = ns.layout.group_object_bytes[0] * batch

    async def op(i: int) -> int:
        slot = free.pop()
        try:
            m = await client.match(ns, batch_tokens(i % count, batch))
            got = await client.get(m, bufs[slot])
            await client.release(m)
            if got is None:
                raise RuntimeError("read missed")
        finally:
            free.append(slot)
        return size

    return await _pump(qd, budget, op, progress)


async def populate_index(
    client: AsyncGCacheClient,
    ns: Namespace,
    prompts: int,
    prompt_blocks: int,
    progress: Progress,
    first: int = 0,
    stall_s: float = 30.0,
) -> list[list[bytes]]:
    """Index ``prompts`` x ``prompt_blocks`` blocks through the hot path without
    writing data (PutBegin + PutCommit with zero checksums): the meta's index, not
    the data plane, is what lookup measures. A put the meta placed only in part
    (``no_space``: e.g. a server's manifest outbox is full until its next heartbeat)
    is committed and begun again (the stored blocks deduplicated) until the prompt is
    whole; ``RuntimeError`` if it makes no progress for ``stall_s``."""
    layout = ns.layout
    key_lists = []
    for p in range(first, first + prompts):
        toks = np.arange(p * 10**7, p * 10**7 + prompt_blocks * layout.block_size, dtype=np.int64)
        ks = keymod.block_keys(ns.fingerprint, toks, layout.block_size)
        key_lists.append(ks)
        masks = layout.groups_to_store(len(ks))
        deadline = time.monotonic() + stall_s
        while True:
            placed = await client._meta_call(wire.PutBegin(ns.fingerprint, ks, masks))
            if placed.placements:
                await _seal_and_commit(client, layout, placed, ns.fingerprint, ks)
                deadline = time.monotonic() + stall_s
            if not placed.no_space:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"indexing stalled: {placed.no_space} objects found no space for {stall_s}s"
                )
            await asyncio.sleep(0.01)
        progress.update(p + 1)
    return key_lists


async def _seal_and_commit(
    client: AsyncGCacheClient,
    layout: Layout,
    placed: wire.PutPlaced,
    fp: bytes,
    keys: list[bytes],
) -> None:
    """Commit every placement of ``placed`` without writing its bytes. The meta
    commits only placements whose grants a server consumed: SEAL them (no bytes
    move; each with the record its grant is bound to, zero checksums: a read of
    one is a miss) for their receipts."""
    by_server: dict[int, list[int]] = {}
    for i, pl in enumerate(placed.placements):
        by_server.setdefault(pl.server, []).append(i)
    receipt: dict[int, int] = {}
    for si, pis in by_server.items():
        conn = await client._server(placed.servers[si])
        grants = [placed.placements[i].grant for i in pis]
        objs = []
        for i in pis:
            pl = placed.placements[i]
            zero = bytes(8 * len(layout.group_layers[pl.group]))
            objs.append(object_info(layout, fp, keys, pl.block, pl.group, zero))
        sealed = await conn.call(wire.Seal(grants, objs), timeout=client.config.timeout_s)
        receipt.update(zip(pis, sealed.receipts, strict=True))
    done = [
        (i, bytes(8 * len(layout.group_layers[pl.group]))) for i, pl in enumerate(placed.placements)
    ]
    receipts = [receipt[i] for i, _ in done]
    await client._meta_call(wire.PutCommit(placed.put_id, done, receipts))


async def run_lookup(
    client: AsyncGCacheClient,
    ns: Namespace,
    key_lists: list[list[bytes]],
    nblocks: int,
    budget: Budget,
    qd: int,
    lease: bool,
    progress: Progress,
) -> Samples:
    rng = np.random.default_rng(7)

    async def op(i: int) -> int:
        ks = key_lists[int(rng.integers(len(key_lists)))]
        res = await client._meta_call(wire.Lookup(ns.fingerprint, ks, lease))
        if res.blocks != nblocks:
            raise RuntimeError(f"lookup matched {res.blocks} of {nblocks} blocks")
        if lease and res.lease_id:
            await client._meta_call(wire.Release(res.lease_id))
        return 0

    return await _pump(qd, budget, op, progress)
