"""``gcache-bench``: bandwidth and latency of GCache by message size, perftest style.
One file: the command line and the driver of each operation (its parser, the run
of each op on a local or given deployment, the table); the operations themselves
are in ``ops.py``, ``layers.py`` and ``tiers.py``.

gcache-bench write -a --local               # sweep 4 KiB .. 64 MiB on a local deployment
gcache-bench read -s 1MiB -D 5 --qd 8 --meta 127.0.0.1:7700
gcache-bench get_layers --prompt 32768 --local
gcache-bench lookup --local --index-blocks 1000000
gcache-bench write -s 1MiB --tier nvme --nvme-dir /mnt/nvme   # demotion to NVMe
gcache-bench read -s 16MiB --tier nvme --nvme-dir /mnt/nvme   # reads from NVMe
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from gcache import wire
from gcache.benchtool import ops
from gcache.benchtool.layers import run_get_layers
from gcache.benchtool.stats import HEADER, Progress, Samples, format_row, summarize
from gcache.config import ClientConfig, parse_size
from gcache.errors import GCacheError
from gcache.startup import OneLineParser, run_command

SWEEP = [4096 << i for i in range(15)]  # 4 KiB .. 64 MiB


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="gcache-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("op", choices=["write", "read", "get_layers", "lookup"])
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "-s",
        "--size",
        help="message size: bytes, or K/M/G binary (1M = 1MiB = 1048576), KB/MB decimal",
    )
    size.add_argument("-a", "--all", action="store_true", help="sweep 4 KiB .. 64 MiB")
    dur = p.add_mutually_exclusive_group()
    dur.add_argument("-n", "--iters", type=int, help="iterations per size (default 1000)")
    dur.add_argument("-D", "--duration", type=float, help="seconds per size")
    p.add_argument("--qd", type=int, default=1, help="operations in flight per client")
    p.add_argument(
        "--batch", type=int, default=1, help="write/read: objects per operation (one put/match)"
    )
    p.add_argument("--clients", type=int, default=1, help="client processes")
    p.add_argument("--transport", choices=["auto", "tcp", "shm"], default="tcp")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--meta", help="meta hot path HOST:PORT of a running deployment")
    where.add_argument(
        "--local",
        action="store_true",
        help="start a meta + server for the run (default when --meta is absent)",
    )
    p.add_argument("--meta-grpc", help="meta gRPC HOST:PORT (default: hot-path port + 1)")
    p.add_argument("--capacity", default="", help="--local: server capacity (default by op)")
    p.add_argument("--preset", default="mimo-v2-flash", help="get_layers/lookup layout preset")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--prompt",
        default=None,
        help="get_layers: prompt tokens (default 32768); lookup: comma-separated list "
        "(default 4096,32768,131072)",
    )
    p.add_argument(
        "--compute",
        choices=["sleep", "matmul"],
        default="sleep",
        help="get_layers: what the caller does per layer",
    )
    p.add_argument(
        "--compute-us",
        type=float,
        default=0.0,
        help="get_layers: compute per layer (default: the measured per-layer transfer)",
    )
    p.add_argument(
        "--index-blocks",
        type=int,
        default=1_000_000,
        help="lookup: blocks indexed before measuring",
    )
    p.add_argument("--lease", action="store_true", help="lookup: leased lookups (+ release)")
    p.add_argument(
        "--tier",
        choices=["dram", "nvme"],
        default="dram",
        help="write/read: the DRAM segment, or the server's NVMe tier (write: demotion "
        "bandwidth; read: reads of demoted objects; -n: objects, default 1 GiB of them)",
    )
    p.add_argument("--nvme-dir", default="", help="--local --tier nvme: directory of the NVMe tier")
    p.add_argument("--json", help="write the rows as JSON to this file")
    return p


def _check_addr(flag: str, value: str | None) -> None:
    host, sep, port = (value or "h:1").rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise SystemExit(f"gcache-bench: {flag} must be HOST:PORT, got {value!r}")


def check_args(args: argparse.Namespace) -> list[int]:
    """Validate; returns the sizes to run. Raises SystemExit with a message."""
    if args.json:  # before a long run, not after it
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise SystemExit(f"gcache-bench: cannot write --json {args.json}: no such folder")
    _check_addr("--meta", args.meta)
    _check_addr("--meta-grpc", args.meta_grpc)
    if args.meta and not args.meta_grpc and int(args.meta.rpartition(":")[2]) >= 65535:
        raise SystemExit("gcache-bench: give --meta-grpc (the hot-path port + 1 is no port)")
    if args.qd < 1 or args.clients < 1 or args.batch < 1:
        raise SystemExit("gcache-bench: --qd, --clients and --batch must be >= 1")
    if args.iters is not None and args.iters < 1:
        raise SystemExit("gcache-bench: -n must be >= 1")
    if args.duration is not None and args.duration <= 0:
        raise SystemExit("gcache-bench: -D must be > 0")
    if args.tier == "nvme" and args.op not in ("write", "read"):
        raise SystemExit("gcache-bench: --tier nvme measures write or read")
    if args.tier == "nvme" and (args.clients != 1 or args.batch != 1):
        raise SystemExit("gcache-bench: --tier nvme runs one client, --batch 1")
    if args.nvme_dir and not os.path.isdir(args.nvme_dir):
        raise SystemExit(f"gcache-bench: --nvme-dir {args.nvme_dir}: no such directory")
    if args.op in ("get_layers", "lookup"):
        if args.size or args.all:
            raise SystemExit(f"gcache-bench: {args.op} takes --prompt, not -s/-a")
        if args.prompt is None:
            args.prompt = "32768" if args.op == "get_layers" else "4096,32768,131072"
        try:
            prompts = [int(x) for x in str(args.prompt).split(",")]
        except ValueError:
            raise SystemExit(f"gcache-bench: bad --prompt {args.prompt!r}") from None
        if any(p < args.block_size for p in prompts):
            raise SystemExit("gcache-bench: --prompt must be at least one block")
        return prompts
    if args.all:
        return SWEEP
    try:
        size = parse_size(args.size or "65536")
        ops.raw_layout(size)
    except (GCacheError, ValueError) as exc:
        raise SystemExit(f"gcache-bench: {exc}") from None
    return [size]


def client_config(args: argparse.Namespace, meta: str, meta_grpc: str) -> ClientConfig:
    return ClientConfig(meta=meta, meta_grpc=meta_grpc, transport=args.transport, timeout_s=30.0)


# ---- write / read in one or several processes --------------------------------------------


async def _data_op(args: dict[str, Any], client_id: int) -> Samples:
    from gcache_client import AsyncGCacheClient

    cfg = ClientConfig(**args["client"])
    budget = ops.Budget(args["iters"], args["seconds"])
    total = args["iters"] if args["iters"] < 1 << 60 else args["seconds"]
    label = f"{args['op']} {args['size']}"
    progress = Progress(label, total) if client_id == 0 else Progress(label, total, io.StringIO())
    async with AsyncGCacheClient(cfg) as client:
        if args["op"] == "write":
            return await ops.run_write(
                client, args["size"], budget, args["qd"], client_id, progress, args["batch"]
            )
        batch = args["batch"]
        count = max(1, min(64, (256 << 20) // (args["size"] * batch)))
        ns = await ops.prepare_objects(client, args["size"], count, batch)
        return await ops.run_read(client, ns, count, budget, args["qd"], progress, batch)


def _run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def _child(args: dict[str, Any], client_id: int, out: Any) -> None:
    try:
        out.put((client_id, _run(_data_op(args, client_id)).to_json(), ""))
    except Exception as exc:  # reported by the parent
        out.put((client_id, None, f"{type(exc).__name__}: {exc}"))


def run_tier(args: argparse.Namespace, size: int, cfg: ClientConfig) -> dict[str, Any]:
    """``--tier nvme`` (gcache/benchtool/tiers.py)."""
    from gcache.benchtool.tiers import default_count, run_nvme
    from gcache.cli.deploy import fetch_stats

    job = {
        "op": args.op,
        "size": size,
        "qd": args.qd,
        "client": cfg,
        "count": args.iters or default_count(size),
        "iters": args.iters if args.op == "read" else 0,
        "seconds": args.duration or 0.0,
    }

    def stats() -> dict[str, float]:
        return dict(fetch_stats(cfg.meta_grpc).counters)

    samples, extra = _run(run_nvme(job, stats))
    if samples is None:  # write: the demotion bandwidth
        gbps = extra["demotion_gbps"]
        return {
            "op": "write",
            "transport": "nvme",
            "bytes": size,
            "iterations": int(extra["demoted_bytes"] // size),
            "bw_peak_gbps": gbps,
            "bw_avg_gbps": gbps,
            "mops": gbps * 1e9 / size / 1e6,
            "lat_p50_us": None,
            "lat_p99_us": None,
            "lat_p999_us": None,
            "wall_s": extra["demotion_s"],
            **extra,
        }
    return summarize("read", "nvme", size, samples, qd=args.qd, **extra)


def run_data(args: argparse.Namespace, size: int, cfg: ClientConfig) -> dict[str, Any]:
    job = {
        "op": args.op,
        "size": size,
        "qd": args.qd,
        "batch": args.batch,
        "client": cfg.__dict__,
        "iters": args.iters if args.iters else (1 << 62 if args.duration else 1000),
        "seconds": args.duration or 0.0,
    }
    if args.clients == 1:
        samples = _run(_data_op(job, 0))
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(job, i, q)) for i in range(args.clients)]
        for pr in procs:
            pr.start()
        samples = Samples()
        errors = []
        for _ in procs:
            _, data, err = q.get()
            if err:
                errors.append(err)
            else:
                samples.extend(Samples.from_json(data))
        for pr in procs:
            pr.join()
        if errors:
            raise RuntimeError("; ".join(errors))
    return summarize(
        args.op, args.transport, size, samples, qd=args.qd, clients=args.clients, batch=args.batch
    )


# ---- get_layers and lookup ----------------------------------------------------------------


def run_layers(args: argparse.Namespace, prompt: int, cfg: ClientConfig) -> dict[str, Any]:
    from gcache_client import GCacheClient

    iters = args.iters or 5
    with GCacheClient(cfg) as client:
        ns = client.register_namespace(
            f"gcache-bench/layers/{time.time_ns()}", args.preset, block_size=args.block_size
        )
        toks = np.arange(prompt, dtype=np.int64)
        samples, extra = run_get_layers(
            client,
            ns,
            toks,
            iters,
            args.compute,
            args.compute_us,
            Progress(f"get_layers {prompt}", iters),
        )
    row = summarize("get_layers", args.transport, int(np.mean(samples.nbytes)), samples, **extra)
    return row


def run_lookups(
    args: argparse.Namespace, prompts: list[int], cfg: ClientConfig
) -> list[dict[str, Any]]:
    from gcache.meta.core import MetaCore
    from gcache_client import AsyncGCacheClient

    bs = args.block_size
    # Each prompt length gets its own whole prompts (a lookup of a prefix would stop
    # at the last saved SWA window), together at least --index-blocks blocks.
    share = -(-args.index_blocks // len(prompts))
    counts = {p: max(1, -(-share // (p // bs))) for p in prompts}
    total_blocks = sum(n * (p // bs) for p, n in counts.items())
    rows = []

    async def remote() -> tuple[Any, dict[int, list[list[bytes]]]]:
        async with AsyncGCacheClient(cfg) as client:
            ns = await client.register_namespace("gcache-bench/lookup", args.preset, block_size=bs)
            key_lists: dict[int, list[list[bytes]]] = {}
            progress = Progress("indexing", sum(counts.values()))
            for p, n in counts.items():
                key_lists[p] = await ops.populate_index(
                    client, ns, n, p // bs, progress, first=sum(map(len, key_lists.values()))
                )
            progress.close()
            for p in prompts:
                budget = ops.Budget(
                    args.iters or (1 << 62 if args.duration else 2000), args.duration or 0.0
                )
                s = await ops.run_lookup(
                    client,
                    ns,
                    key_lists[p],
                    p // bs,
                    budget,
                    args.qd,
                    args.lease,
                    Progress(f"lookup {p}", budget.iters),
                )
                r = summarize(
                    "lookup",
                    "meta hot path",
                    0,
                    s,
                    prompt_tokens=p,
                    indexed_blocks=total_blocks,
                    lease=args.lease,
                )
                r["lookups_per_s"] = r["mops"] * 1e6
                rows.append(r)
            return ns, key_lists

    _ns, key_lists = _run(remote())
    # The same index in this process, no sockets: where the meta's time goes.
    from gcache.config import MetaConfig

    # No server heartbeats this core: the records of its commits (the outbox a
    # server's next heartbeat would take) must fit whole, or placement pauses.
    core = MetaCore(MetaConfig(adopt_outbox=max(1 << 16, 4 * total_blocks)))
    core.register_server(
        wire.ServerAddr("inproc", "127.0.0.1", 1, "h", ""), bytes(16), 1, 1 << 50, 0.0
    )
    from gcache.layout import preset

    fp = core.register_namespace({"model": "inproc"}, preset(args.preset, bs)).fingerprint
    layout = core.namespaces[fp].layout
    for ks_orig in (ks for lists in key_lists.values() for ks in lists):
        placed = core.put_begin(
            wire.PutBegin(fp, ks_orig, layout.groups_to_store(len(ks_orig))), 0.0, 0.0
        )
        core.put_commit(
            wire.PutCommit(
                placed.put_id,
                [
                    (i, bytes(8 * len(layout.group_layers[pl.group])))
                    for i, pl in enumerate(placed.placements)
                ],
            ),
            0.0,
        )
    rng = np.random.default_rng(3)
    for p in prompts:
        s = Samples()
        for _ in range(min(args.iters or 2000, 2000)):
            ks = key_lists[p][int(rng.integers(len(key_lists[p])))]
            t0 = time.perf_counter()
            core.lookup(wire.Lookup(fp, ks, args.lease), 1.0, 0.0)
            s.add(t0, time.perf_counter(), 0)
        r = summarize(
            "lookup",
            "in-process index",
            0,
            s,
            prompt_tokens=p,
            indexed_blocks=core.entries,
            lease=args.lease,
        )
        r["lookups_per_s"] = r["mops"] * 1e6
        rows.append(r)
    return rows


# ---- main ---------------------------------------------------------------------------------


def print_rows(op: str, rows: list[dict[str, Any]]) -> None:
    if op == "get_layers":
        print(
            f"{'#tokens':>8} {'#iterations':>12} {'bytes/iter':>12} {'BW avg[GB/s]':>13} "
            f"{'TTFL[us]':>10} {'total[us]':>11} {'transfer[us]':>13} {'compute[us]':>12} "
            f"{'overlap':>8} {'best':>6}"
        )
        for r in rows:
            print(
                f"{r['prompt_tokens']:>8} {r['iterations']:>12} {r['bytes']:>12} "
                f"{r['bw_avg_gbps']:>13.3f} {r['ttfl_us']:>10.0f} {r['total_us']:>11.0f} "
                f"{r['transfer_only_us']:>13.0f} {r['compute_only_us']:>12.0f} "
                f"{r['overlap']:>8.3f} {r['overlap_best']:>6.3f}"
            )
    elif op == "lookup":
        print(
            f"{'where':<18} {'#tokens':>8} {'#iterations':>12} {'lookups/s':>10} "
            f"{'lat p50[us]':>12} {'p99[us]':>10} {'p99.9[us]':>10}"
        )
        for r in rows:
            print(
                f"{r['transport']:<18} {r['prompt_tokens']:>8} {r['iterations']:>12} "
                f"{r['lookups_per_s']:>10.0f} {r['lat_p50_us']:>12.1f} {r['lat_p99_us']:>10.1f} "
                f"{r['lat_p999_us']:>10.1f}"
            )
    else:
        print(HEADER)
        for r in rows:
            print(format_row(r))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sizes = check_args(args)
    raise SystemExit(run_command("gcache-bench", lambda a: bench(a, sizes), args))


def bench(args: argparse.Namespace, sizes: list[int]) -> int:
    deployment = None
    tmp = None
    if args.meta:
        meta = args.meta
        host, _, port = meta.rpartition(":")
        meta_grpc = args.meta_grpc or f"{host}:{int(port) + 1}"
    else:
        from gcache.cli.deploy import LocalDeployment

        nvme = args.tier == "nvme"
        tmp = tempfile.TemporaryDirectory(prefix="gcache-bench-", dir=args.nvme_dir or None)
        capacity = args.capacity or {"lookup": "2TiB", "get_layers": "2GiB"}.get(args.op, "4GiB")
        server_args = ["--no-populate", "--no-reserve"] if args.op == "lookup" else []
        nvme_size = "0"
        # One client is the whole workload here: let its puts reserve most of the
        # store (the default bounds keep one tenant of many from flushing it).
        meta_args = ["--high-watermark", "0.95", "--low-watermark", "0.9"]
        meta_args += ["--max-pending-per-client", "0.9", "--max-pending-total", "0.9"]
        if nvme:  # a small DRAM segment: most of what is written goes on to NVMe
            from gcache.benchtool.tiers import WATERMARKS, default_count

            meta_args = WATERMARKS

            big = max(sizes)
            capacity = args.capacity or str(max(128 << 20, 8 * big))
            nvme_size = str(2 * big * (args.iters or default_count(big)) + (512 << 20))
            server_args = ["--heartbeat-interval-s", "0.1"]
        deployment = LocalDeployment(
            tmp.name,
            servers=1,
            capacity=capacity,
            metrics_port=-1,
            meta_args=meta_args,
            # lookup indexes blocks without writing them: a sparse segment suffices
            server_args=server_args,
            nvme_size=nvme_size,
        )
        deployment.start()
        meta, meta_grpc = deployment.meta_addr, deployment.meta_grpc
    cfg = client_config(args, meta, meta_grpc)
    rows: list[dict[str, Any]] = []
    print(
        f"# gcache-bench {args.op}  tier {args.tier}  transport {args.transport}  qd {args.qd}  "
        f"clients {args.clients}  meta {meta}",
        flush=True,
    )
    try:
        if args.op in ("write", "read"):
            print(HEADER, flush=True)
            for size in sizes:
                row = (run_tier if args.tier == "nvme" else run_data)(args, size, cfg)
                rows.append(row)
                print(format_row(row), flush=True)
        elif args.op == "get_layers":
            for p in sizes:
                rows.append(run_layers(args, p, cfg))
            print_rows(args.op, rows)
        else:
            rows = run_lookups(args, sizes, cfg)
            print_rows(args.op, rows)
    except (GCacheError, RuntimeError) as exc:
        print(f"gcache-bench: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    finally:
        if deployment is not None:
            deployment.stop()
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    main()
