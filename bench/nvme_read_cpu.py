"""CPU per MiB of tier-1 (NVMe) reads, client and server.

On a machine whose cores are shared, wall-clock bandwidth mostly says how much
CPU the processes got; the CPU they spend per MiB read does not. A local meta and
server (128 MiB DRAM, watermarks 0.5 / 0.2, 4 GiB NVMe tier under ``--dir``):
``count`` objects of ``--size-mib`` MiB are put and pushed to NVMe by more puts,
then every object on tier 1 is read 3 times (``match`` + ``get`` + ``release``),
``--qd`` in flight; client CPU from ``getrusage``, server CPU from
``/proc/<pid>/stat``::

    python -m bench.nvme_read_cpu --size-mib 16 --count 16 --qd 2 --transport shm --dir /work/nB
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time

import numpy as np

from gcache.cli.deploy import LocalDeployment
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import AsyncGCacheClient

META_ARGS = ["--high-watermark", "0.5", "--low-watermark", "0.2"]
META_ARGS += ["--max-pending-per-client", "0.9", "--max-pending-total", "0.9"]


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def measure(d: LocalDeployment, size_mib: int, count: int, qd: int, transport: str) -> str:
    spec = LayoutSpec(
        block_size=1, dtype="uint8", layers=(LayerSpec("full", size_mib * 8, 65536, 65536),)
    )
    async with AsyncGCacheClient(d.client_config(transport=transport, timeout_s=60.0)) as c:
        ns = await c.register_namespace("nvme-read-cpu", spec)
        k = np.random.default_rng(1).integers(0, 256, (1, size_mib * 8, 65536), dtype=np.uint8)
        kv = [(k, k.copy())]
        cap = d.stats().counters["capacity"]
        for i in range(count + int(cap * 1.2) // (size_mib << 20)):
            while d.stats().counters["used"] > 0.7 * cap:
                await asyncio.sleep(0.01)
            while True:
                r = await c.put(ns, [i], kv)
                if r.ok and r.stored + r.deduped == 1:
                    break
                await asyncio.sleep(0.02)
        while d.stats().counters["demotions_in_flight"]:
            await asyncio.sleep(0.05)
        tier1 = []
        for i in range(count):
            m = await c.match(ns, [i])
            if m.tokens and all(o.grant.tier == 1 for o in m.objects.values()):
                tier1.append(i)
            await c.release(m)
        if not tier1:
            raise SystemExit("no object reached the NVMe tier")
        todo = tier1 * 3

        async def worker() -> None:
            while todo:
                m = await c.match(ns, [todo.pop()])
                got = await c.get(m)
                await c.release(m)
                if got is None:
                    raise RuntimeError("NVMe read missed")

        pid = d.servers[0].popen.pid
        r0, s0, w0 = resource.getrusage(resource.RUSAGE_SELF), proc_cpu(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(qd)))
        wall = time.perf_counter() - w0
        r1, s1 = resource.getrusage(resource.RUSAGE_SELF), proc_cpu(pid)
        client = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        mib = len(tier1) * 3 * size_mib
        staged = c.stats().get("staged_reads", 0)
    return (
        f"size={size_mib}MiB transport={transport} qd={qd} reads={len(tier1) * 3} "
        f"staged={staged} gbps={mib * (1 << 20) / wall / 1e9:.3f} "
        f"client_cpu_ms_per_MiB={client * 1e3 / mib:.3f} "
        f"server_cpu_ms_per_MiB={(s1 - s0) * 1e3 / mib:.3f} "
        f"load={os.getloadavg()}"
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.nvme_read_cpu")
    p.add_argument("--size-mib", type=int, default=16)
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--qd", type=int, default=2)
    p.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    p.add_argument("--dir", default=None, help="directory on the disk under test")
    a = p.parse_args()
    with (
        tempfile.TemporaryDirectory(dir=a.dir) as tmp,
        LocalDeployment(
            tmp,
            servers=1,
            capacity="128MiB",
            metrics_port=-1,
            meta_args=META_ARGS,
            server_args=["--heartbeat-interval-s", "0.1"],
            nvme_size=str(4 << 30),
        ) as d,
    ):
        d.start()
        print(asyncio.run(measure(d, a.size_mib, a.count, a.qd, a.transport)), flush=True)


if __name__ == "__main__":
    main()
