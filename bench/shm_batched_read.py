"""``bench.compare``'s batched shared-memory read shape in one process: one
operation of 4 objects of SIZE bytes at a time (``match`` + ``get`` into
preallocated buffers + ``release``), GB/s and CPU microseconds per operation of the
client, the meta and the server (from /proc; 10 ms clock ticks).

    python -m bench.shm_batched_read [SIZE [ITERS]]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import uvloop

from gcache.benchtool.ops import batch_tokens, prepare_objects
from gcache.cli.deploy import LocalDeployment
from gcache_client import AsyncGCacheClient

BATCH = 4
COUNT = 32


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


async def run(d: LocalDeployment, size: int, iters: int) -> tuple[float, dict[str, float]]:
    assert d.meta is not None
    cfg = d.client_config(transport="shm", timeout_s=30.0, load_or_recompute=False)
    async with AsyncGCacheClient(cfg) as c:
        ns = await prepare_objects(c, size, COUNT, BATCH)
        spec = ns.layout.spec.layers[0]
        buf: Any = [
            (
                np.empty((BATCH, spec.kv_heads, spec.k_head_dim), np.uint8),
                np.empty((BATCH, spec.kv_heads, spec.v_head_dim), np.uint8),
            )
        ]

        async def op(i: int) -> None:
            m = await c.match(ns, batch_tokens(i % COUNT, BATCH))
            got = await c.get(m, buf)
            await c.release(m)
            if got is None:
                raise RuntimeError("read missed")

        for i in range(50):  # warm-up: connections, the mapping
            await op(i)
        pids = {"client": os.getpid(), "meta": d.meta.popen.pid, "server": d.servers[0].popen.pid}
        before = {k: cpu_s(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        for i in range(iters):
            await op(i)
        wall = time.perf_counter() - t0
        after = {k: cpu_s(p) for k, p in pids.items()}
        return wall, {k: (after[k] - before[k]) / iters * 1e6 for k in pids}


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    with tempfile.TemporaryDirectory() as tmp:
        d = LocalDeployment(
            tmp, servers=1, capacity="2GiB", metrics_port=-1,
            meta_args=["--high-watermark", "0.95", "--low-watermark", "0.9"],
        )  # fmt: skip
        d.start()
        try:
            wall, cpu = uvloop.run(run(d, size, iters))
        finally:
            d.stop()
    print(json.dumps({
        "size": size,
        "gbps": round(iters * BATCH * size / wall / 1e9, 3),
        "us_per_op": round(wall / iters * 1e6, 1),
        "cpu_us_per_op": {k: round(v, 1) for k, v in cpu.items()},
        "load": os.getloadavg()[0],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
