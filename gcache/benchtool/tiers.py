"""``gcache-bench write|read --tier nvme``: the NVMe tier through a running server.

* ``write``: objects of SIZE are put through the client, back to back with no
  pacing, into a small DRAM segment. Above its demote watermark (0.1 in a
  ``--local`` run) the meta demotes them continuously and the server copies them
  to its NVMe tier (``O_DIRECT`` appends, one ``fdatasync`` per batch, each batch
  reported at once); a put that finds DRAM full waits in the meta for the
  demotions in flight (``meta.put_wait_s``). The bandwidth is the meta's
  ``demoted_bytes`` counter over the time it grew: from the last sample before
  the first demotion was reported to the first sample with the final value
  (sampled every 20 ms, so the interval is never shorter than the real one). The
  row also says how many puts waited and whether anything was evicted.
* ``read``: the same fill (untimed), then every object the meta lists on tier 1 is
  read back through the client (``match`` with a lease, the read, the checksum
  check, ``release``), ``--qd`` in flight. ``--transport tcp``: the server reads the
  object in ``O_DIRECT`` pieces and sends each as it lands; ``--transport shm``:
  the server reads it into its staging file, which the client maps and copies out
  of (gcache/server/staging.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from gcache.benchtool.ops import Budget, _pump, batch_tokens, raw_kv, raw_layout
from gcache.benchtool.stats import Progress, Samples
from gcache_client import AsyncGCacheClient, Namespace

Stats = Callable[[], dict[str, float]]  # the meta's counters (GetStats)
# Meta settings of the local run: demote continuously above 10 % of DRAM, so most
# of the segment holds demotions in flight and room for the puts arriving.
WATERMARKS = ["--high-watermark", "0.9", "--low-watermark", "0.5", "--demote-watermark", "0.1"]


def default_count(size: int) -> int:
    """Objects per run: 1 GiB of them, 32 .. 4096."""
    return max(32, min(4096, (1 << 30) // size))


async def fill(
    client: AsyncGCacheClient,
    size: int,
    count: int,
    stats: Stats,
    timeout: float = 300.0,
    qd: int = 1,
) -> tuple[Namespace, list[tuple[float, float]]]:
    """Put ``count`` objects back to back, ``qd`` puts in flight (a put that found no
    room at all is retried; none should be), then wait for the demotions to finish;
    returns the namespace and the ``(time, demoted_bytes)`` samples taken
    meanwhile."""
    spec = raw_layout(size)
    ns = await client.register_namespace(f"gcache-bench/nvme/{uuid.uuid4()}", spec)
    kv = raw_kv(spec, 1)
    samples: list[tuple[float, float]] = []
    done = asyncio.Event()

    async def sampler() -> None:
        while True:
            c = await asyncio.to_thread(stats)
            samples.append((time.perf_counter(), c.get("demoted_bytes", 0.0)))
            if done.is_set() and c.get("demotions_in_flight", 0.0) == 0:
                return
            await asyncio.sleep(0.02)

    task = asyncio.create_task(sampler())
    deadline = time.monotonic() + timeout
    progress = Progress(f"fill {size}", count)
    todo = iter(range(count))
    stored = 0

    async def putter() -> None:
        nonlocal stored
        for i in todo:
            while True:
                res = await client.put(ns, batch_tokens(i, 1), kv)
                if res.ok and res.stored + res.deduped == 1:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not store object {i} in {timeout:.0f} s: {res}")
                await asyncio.sleep(0.01)
            stored += 1
            progress.update(stored)

    try:
        await asyncio.gather(*(putter() for _ in range(max(1, qd))))
        progress.close()
        await asyncio.sleep(0.3)  # the last puts' demotions get issued
        done.set()
        await asyncio.wait_for(task, timeout)
    finally:
        task.cancel()
    return ns, samples


def demotion_rate(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(bytes, seconds, GB/s) of the demotions seen in ``samples``."""
    if len(samples) < 2:
        return 0.0, 0.0, 0.0
    first_val = samples[0][1]
    final = samples[-1][1]
    t_start = next(
        (samples[i - 1][0] for i in range(1, len(samples)) if samples[i][1] > first_val),
        samples[0][0],
    )
    t_end = next(t for t, v in samples if v >= final)
    nbytes = final - first_val
    secs = max(t_end - t_start, 1e-9)
    return nbytes, secs, nbytes / secs / 1e9 if nbytes else 0.0


async def tier1_objects(client: AsyncGCacheClient, ns: Namespace, count: int) -> list[int]:
    """Indices of the objects the meta lists on NVMe."""
    out = []
    for i in range(count):
        m = await client.match(ns, batch_tokens(i, 1))
        if m.tokens and all(o.grant.tier == 1 for o in m.objects.values()):
            out.append(i)
        await client.release(m)
    return out


async def run_read_nvme(
    client: AsyncGCacheClient,
    ns: Namespace,
    which: list[int],
    budget: Budget,
    qd: int,
    progress: Progress,
) -> Samples:
    spec = ns.layout.spec.layers[0]
    bufs = [
        [
            (
                np.empty((1, spec.kv_heads, spec.k_head_dim), np.uint8),
                np.empty((1, spec.kv_heads, spec.v_head_dim), np.uint8),
            )
        ]
        for _ in range(qd)
    ]
    free = list(range(qd))
    size = ns.layout.group_object_bytes[0]

    async def op(i: int) -> int:
        slot = free.pop()
        try:
            m = await client.match(ns, batch_tokens(which[(i - 1) % len(which)], 1))
            got = await client.get(m, bufs[slot])
            await client.release(m)
            if got is None:
                raise RuntimeError("NVMe read missed")
        finally:
            free.append(slot)
        return size

    return await _pump(qd, budget, op, progress)


async def run_nvme(args: dict[str, Any], stats: Stats) -> tuple[Samples | None, dict[str, Any]]:
    """One ``--tier nvme`` run: (read samples or None for write, extra row fields)."""
    cfg = args["client"]
    size, count = args["size"], args["count"]
    async with AsyncGCacheClient(cfg) as client:
        # write: ``--qd`` puts in flight feed the demotions; read: one (untimed)
        ns, samples = await fill(
            client, size, count, stats, qd=args["qd"] if args["op"] == "write" else 1
        )
        nbytes, secs, gbps = demotion_rate(samples)
        c = await asyncio.to_thread(stats)
        extra: dict[str, Any] = {
            "tier": "nvme",
            "objects": count,
            "demoted_bytes": int(nbytes),
            "demotion_s": round(secs, 4),
            "demotion_gbps": gbps,
            # puts that waited for demotions in flight; anything dropped instead
            "puts_waited": int(c.get("puts_waited", 0)),
            "evictions": int(c.get("evictions", 0)),
        }
        if args["op"] == "write":
            return None, extra
        which = await tier1_objects(client, ns, count)
        if not which:
            raise RuntimeError("no object reached the NVMe tier (is the server's tier on?)")
        extra["objects_on_nvme"] = len(which)
        iters = args["iters"] or len(which)
        budget = Budget(iters, args["seconds"])
        s = await run_read_nvme(
            client, ns, which, budget, args["qd"], Progress(f"read nvme {size}", iters)
        )
        return s, extra
