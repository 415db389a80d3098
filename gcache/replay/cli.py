"""``gcache replay``: replay request traces through the meta's index, checkpoint
and eviction code for each policy and capacity, and report what each saves."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from gcache.config import MetaConfig, parse_size
from gcache.errors import ConfigError, GCacheError, LayoutError
from gcache.layout import PRESETS
from gcache.replay import report, router_report
from gcache.replay.runner import DEFAULT_POLICIES, POLICIES, Options, sweep
from gcache.replay.trace import TraceError, load


def add_parser(sub: Any) -> None:
    rp = sub.add_parser(
        "replay",
        help="replay a request trace through the index and eviction policies",
        description=__doc__,
    )
    rp.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    rp.add_argument("--layout", default="mimo-v2-flash", choices=PRESETS, help="layout preset")
    rp.add_argument("--block-size", type=int, default=64, help="index block size in tokens")
    rp.add_argument(
        "--capacity", default="300GB", help="store capacity, or a comma-separated list to sweep"
    )
    rp.add_argument(
        "--nvme-capacity",
        default="0",
        help="NVMe tier of the server (0: DRAM only), or a comma-separated list to sweep",
    )
    rp.add_argument(
        "--dram-gbps",
        type=float,
        default=Options.dram_gbps,
        help="read bandwidth from the store's DRAM into the engine (GB/s; 0: free)",
    )
    rp.add_argument(
        "--nvme-gbps",
        type=float,
        default=Options.nvme_gbps,
        help="read bandwidth from the NVMe tier (GB/s): the demotion rule and the fetch time",
    )
    rp.add_argument(
        "--compute-tflops",
        type=float,
        default=Options.compute_tflops,
        help="the engine's prefill TFLOP/s (the load-or-recompute and demotion rules)",
    )
    rp.add_argument(
        "--promotion",
        default=Options.promotion,
        help="the meta's promotion policy: off, or hits:N (NVMe back to DRAM on N hits)",
    )
    rp.add_argument(
        "--no-load-or-recompute",
        dest="load_or_recompute",
        action="store_false",
        help="load every match whole, however slow its fetch",
    )
    rp.add_argument(
        "--policy",
        default="",
        help=f"comma-separated, from: {', '.join(POLICIES)} (default: all); with --router "
        "the routing policies (default: all)",
    )
    rp.add_argument(
        "--checkpoint-interval",
        type=int,
        default=Options.checkpoint_interval,
        help="tokens between checkpoint positions (the meta's setting; 0: off)",
    )
    rp.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    rp.add_argument("--jobs", type=int, default=0, help="parallel replays (default: CPU count)")
    rp.add_argument("--json", default="", help="write the rows as JSON here")
    rp.add_argument("--plot", default="", help="draw FLOPs saved against capacity (PNG)")
    rp.add_argument("--quiet", action="store_true", help="no progress lines")
    router_report.add_arguments(rp)
    rp.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    if args.router:
        return router_report.cmd_router(args)
    try:
        capacities = [parse_size(c.strip()) for c in args.capacity.split(",") if c.strip()]
        nvme = [parse_size(c.strip()) for c in args.nvme_capacity.split(",") if c.strip()]
        policy = args.policy or ",".join(DEFAULT_POLICIES)
        policies = [p.strip() for p in policy.split(",") if p.strip()]
        bad = [p for p in policies if p not in POLICIES]
        if bad or not policies:
            raise ConfigError(f"unknown policy {bad[0] if bad else ''!r}; known: {POLICIES}")
        if not capacities or min(capacities) < 1 << 20:
            raise ConfigError("capacities must be at least 1MiB")
        if not nvme or any(0 < c < 1 << 20 for c in nvme):
            raise ConfigError("NVMe capacities must be 0 (none) or at least 1MiB")
        if args.checkpoint_interval < 0 or args.jobs < 0 or args.limit < 0:
            raise ConfigError("--checkpoint-interval, --jobs and --limit must be >= 0")
        if not (args.dram_gbps >= 0 and args.nvme_gbps > 0 and args.compute_tflops > 0):
            raise ConfigError("need --dram-gbps >= 0, --nvme-gbps > 0 and --compute-tflops > 0")
        opts = Options(
            args.layout,
            args.block_size,
            args.checkpoint_interval,
            dram_gbps=args.dram_gbps,
            nvme_gbps=args.nvme_gbps,
            compute_tflops=args.compute_tflops,
            load_or_recompute=args.load_or_recompute,
            promotion=args.promotion,
        )
        MetaConfig(promotion=args.promotion).check()
        t0 = time.perf_counter()
        trace = load(args.trace, args.block_size, args.limit)
        if not args.quiet:
            print(
                f"{trace.path}: {trace.requests} requests, {trace.tokens:,} prompt tokens, "
                f"{trace.blocks:,} blocks of {args.block_size} "
                f"(loaded in {time.perf_counter() - t0:.1f}s); "
                f"{len(policies) * len(capacities) * len(nvme)} replays on "
                f"{args.jobs or os.cpu_count()} processes",
                flush=True,
            )

        def done(row: dict[str, Any]) -> None:
            if not args.quiet:
                print(
                    f"  {row['policy']:<7} {report.where(row):>16}: "
                    f"FLOPs saved {row['flops_saved']:.1%} "
                    f"(net of fetch {row['flops_saved_net']:.1%}), "
                    f"{row['blocks_per_s']:,.0f} blocks/s",
                    flush=True,
                )

        rows = sweep(trace, policies, capacities, opts, args.jobs, done, nvme)
    except (TraceError, ConfigError, LayoutError) as exc:
        print(f"gcache replay: {exc}", file=sys.stderr)
        return 2
    report.annotate(rows)
    print()
    print(report.table(rows))
    try:
        if args.json:
            report.write_json(rows, args.json)
            print(f"\nJSON: {args.json}")
        if args.plot:
            name = os.path.basename(args.trace)
            report.plot(rows, args.plot, f"{name}, {args.layout}, block {args.block_size}")
            print(f"chart: {args.plot}")
    except (OSError, GCacheError) as exc:
        print(f"gcache replay: {exc}", file=sys.stderr)
        return 1
    return 0
