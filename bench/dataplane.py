"""CPU seconds per GB moved, per process, on the data paths.

Starts a local meta + one server, runs ``gcache-bench``'s own read and write
operations (leased match + copy + verify + release; put = PutBegin + copy +
checksum + PutCommit) at each size, transport and queue depth, and reads the CPU
time (user + system) each process spent during the timed part from
``/proc/PID/stat`` (the client is this process). ``--profile DIR`` attaches
``py-spy record --native`` to the client, server and meta for each case and keeps
the flame graphs' raw folded stacks there.

    python -m bench.dataplane --sizes 1MiB,64MiB --transports tcp,shm --ops read,write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import uvloop

from gcache.benchtool import ops
from gcache.benchtool.stats import Progress, Samples
from gcache.config import ClientConfig, parse_size

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def _case(
    cfg: ClientConfig,
    op: str,
    size: int,
    qd: int,
    iters: int,
    pids: dict[str, int],
    profile: str,
) -> dict[str, Any]:
    from gcache_client import AsyncGCacheClient

    quiet = Progress("", 1, open(os.devnull, "w"))  # noqa: SIM115
    async with AsyncGCacheClient(cfg) as client:
        count = max(1, min(64, (256 << 20) // size))  # gcache-bench's own choice
        ns = await ops.prepare_objects(client, size, count if op == "read" else 1)
        kv = ops.raw_kv(ns.layout.spec)  # generated before the timed part
        if op == "read":
            # warm-up: connections, mapping, the first touch of the read buffers
            await ops.run_read(client, ns, count, ops.Budget(2 * qd, 0), qd, quiet)
        spies = _spy(pids, profile, f"{op}-{cfg.transport}-{size}") if profile else []
        before = {name: cpu_s(pid) for name, pid in pids.items()}
        t0 = time.perf_counter()
        budget = ops.Budget(iters, 0)
        s: Samples
        if op == "read":
            s = await ops.run_read(client, ns, count, budget, qd, quiet)
        else:

            async def put(i: int) -> int:
                res = await client.put(ns, ops.batch_tokens(1000 + i, 1), kv)
                if not res.ok or res.stored != 1:
                    raise RuntimeError(f"write failed: {res}")
                return size

            s = Samples()

            async def worker() -> None:
                while budget.take():
                    t = time.perf_counter()
                    n = await put(budget.issued)
                    s.add(t, time.perf_counter(), n)

            await asyncio.gather(*(worker() for _ in range(qd)))
        wall = time.perf_counter() - t0
        after = {name: cpu_s(pid) for name, pid in pids.items()}
        for p in spies:
            p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for p in spies:
            p.wait()
    moved = sum(s.nbytes)
    cpu = {name: after[name] - before[name] for name in pids}
    lat = sorted(e - b for b, e in zip(s.starts, s.ends, strict=True))
    return {
        "op": op,
        "transport": cfg.transport,
        "size": size,
        "qd": qd,
        "ops": len(lat),
        "gbps": moved / wall / 1e9,
        "p50_us": lat[len(lat) // 2] * 1e6,
        "cpu_us_per_op": {k: v / len(lat) * 1e6 for k, v in cpu.items()},
        "cpu_s_per_gb": {k: v / (moved / 1e9) for k, v in cpu.items()},
        "cpu_s_per_gb_total": sum(cpu.values()) / (moved / 1e9),
    }


def _spy(pids: dict[str, int], folder: str, tag: str) -> list[subprocess.Popen[bytes]]:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = []
    for name, pid in pids.items():
        path = os.path.join(folder, f"{tag}-{name}.txt")
        out.append(
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--native",
                    "--threads",
                    "-r",
                    "250",
                    "-f",
                    "raw",
                    "-o",
                    path,
                    "-p",
                    str(pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(1.0)  # let py-spy attach before the timed part
    return out


def layers_case(
    d: Any, transport: str, prompt: int, iters: int, pids: dict[str, int]
) -> dict[str, Any]:
    """``gcache-bench get_layers`` (the same measurement: transfer-only passes, then
    compute = transfer) with load-or-recompute off, and its anchor: numpy copies
    of the same objects' bytes out of the same mapped segment into a preallocated
    buffer (no checksum)."""
    import numpy as np

    from gcache.benchtool.layers import run_get_layers
    from gcache.transport.shm import MappedSegment
    from gcache_client import GCacheClient

    quiet = Progress("", 1, open(os.devnull, "w"))  # noqa: SIM115
    cfg = d.client_config(transport=transport, timeout_s=30.0, load_or_recompute=False)
    with GCacheClient(cfg) as client:
        ns = client.register_namespace(f"dataplane/layers/{time.time_ns()}", "mimo-v2-flash")
        toks = np.arange(prompt, dtype=np.int64)
        before = {name: cpu_s(pid) for name, pid in pids.items()}
        samples, extra = run_get_layers(client, ns, toks, iters, "sleep", 0.0, quiet)
        after = {name: cpu_s(pid) for name, pid in pids.items()}
        m = client.match(ns, toks)
        spans = [
            (m.servers[o.server].shm_path, o.grant.offset, o.grant.length)
            for o in m.objects.values()
        ]
        client.release(m)
    nbytes = sum(n for _, _, n in spans)
    segs = {path: MappedSegment(path, populate=True) for path in {p for p, _, _ in spans}}
    out = np.ones(nbytes, np.uint8)
    best = float("inf")
    for _ in range(5):
        pos = 0
        t0 = time.perf_counter()
        for path, off, n in spans:
            with segs[path].hold() as arr:
                np.copyto(out[pos : pos + n], arr[off : off + n])
            pos += n
        best = min(best, time.perf_counter() - t0)
    for seg in segs.values():
        seg.close()
    moved = sum(samples.nbytes)
    cpu = {k: after[k] - before[k] for k in pids}
    # run_get_layers moves the prompt 3 times (transfer only) + iters times
    total_gb = moved / 1e9 * (iters + 3) / iters
    return {
        "op": "get_layers",
        "transport": transport,
        "prompt": prompt,
        "bytes": nbytes,
        "transfer_ms": extra["transfer_only_us"] / 1e3,
        "numpy_copy_ms": best * 1e3,
        "ratio": extra["transfer_only_us"] / 1e6 / best,
        "ttfl_ms": extra["ttfl_us"] / 1e3,
        "overlap": extra["overlap"],
        "overlap_best": extra["overlap_best"],
        "cpu_s_per_gb": {k: v / total_gb for k, v in cpu.items()},
        "cpu_s_per_gb_total": sum(cpu.values()) / total_gb,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1MiB,16MiB")
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--ops", default="read,write")
    p.add_argument("--qd", type=int, default=4)
    p.add_argument("--bytes", default="1GiB", help="bytes moved per case (at most 2000 ops)")
    p.add_argument("--capacity", default="1GiB", help="the server's segment")
    p.add_argument("--profile", default="", help="folder for py-spy raw stacks")
    p.add_argument("--layers", default="", help="get_layers over these transports instead")
    p.add_argument("--prompt", type=int, default=32768, help="--layers: prompt tokens")
    p.add_argument("-n", "--iters", type=int, default=3, help="--layers: iterations")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    from gcache.cli.deploy import LocalDeployment

    rows = []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gcache-dp-") as tmp:
        d = LocalDeployment(
            tmp,
            servers=1,
            capacity=args.capacity,
            metrics_port=-1,
            # as gcache-bench; and a whole 32k-token prompt (780 MB) in one put
            meta_args=[
                *("--high-watermark", "0.95", "--low-watermark", "0.9"),
                *("--max-pending-per-client", "0.9", "--max-pending-total", "0.9"),
            ],
        )
        d.start()
        try:
            assert d.meta is not None
            pids = {
                "client": os.getpid(),
                "server": d.servers[0].popen.pid,
                "meta": d.meta.popen.pid,
            }
            for transport in [t for t in args.layers.split(",") if t]:
                row = layers_case(d, transport, args.prompt, args.iters, pids)
                rows.append(row)
                print(
                    f"get_layers {transport:<3} {row['bytes'] / 1e6:.1f} MB: transfer "
                    f"{row['transfer_ms']:.1f} ms, numpy copy {row['numpy_copy_ms']:.1f} ms "
                    f"({row['ratio']:.2f}x), TTFL {row['ttfl_ms']:.1f} ms, overlap "
                    f"{row['overlap']:.3f} (best {row['overlap_best']:.3f}) | CPU s/GB "
                    f"{row['cpu_s_per_gb_total']:.3f}",
                    flush=True,
                )
            for transport in args.transports.split(",") if not args.layers else []:
                for size_s in args.sizes.split(","):
                    size = parse_size(size_s)
                    iters = max(20, min(2000, parse_size(args.bytes) // size))
                    for op in args.ops.split(","):
                        cfg = d.client_config(transport=transport, timeout_s=30.0)
                        row = uvloop.run(_case(cfg, op, size, args.qd, iters, pids, args.profile))
                        rows.append(row)
                        us = row["cpu_us_per_op"]
                        print(
                            f"{op:<5} {transport:<3} {size_s:>6} qd{args.qd} "
                            f"{row['gbps']:6.2f} GB/s p50 {row['p50_us']:8.0f} us | CPU us/op "
                            f"client {us['client']:7.0f} server {us['server']:7.0f} "
                            f"meta {us['meta']:6.0f} | CPU s/GB {row['cpu_s_per_gb_total']:.3f}",
                            flush=True,
                        )
        finally:
            d.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
