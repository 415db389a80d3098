"""``gcache replay``: replay request traces through the meta's index, checkpoint
and eviction code for each policy and capacity, and report what each saves."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from gcache.config import parse_size
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
        policy = args.policy or ",".join(DEFAULT_POLICIES)
        policies = [p.strip() for p in policy.split(",") if p.strip()]
        bad = [p for p in policies if p not in POLICIES]
        if bad or not policies:
            raise ConfigError(f"unknown policy {bad[0] if bad else ''!r}; known: {POLICIES}")
        if not capacities or min(capacities) < 1 << 20:
            raise ConfigError("capacities must be at least 1MiB")
        if args.checkpoint_interval < 0 or args.jobs < 0 or args.limit < 0:
            raise ConfigError("--checkpoint-interval, --jobs and --limit must be >= 0")
        opts = Options(args.layout, args.block_size, args.checkpoint_interval)
        t0 = time.perf_counter()
        trace = load(args.trace, args.block_size, args.limit)
        if not args.quiet:
            print(
                f"{trace.path}: {trace.requests} requests, {trace.tokens:,} prompt tokens, "
                f"{trace.blocks:,} blocks of {args.block_size} "
                f"(loaded in {time.perf_counter() - t0:.1f}s); "
                f"{len(policies) * len(capacities)} replays on "
                f"{args.jobs or os.cpu_count()} processes",
                flush=True,
            )

        def done(row: dict[str, Any]) -> None:
            if not args.quiet:
                print(
                    f"  {row['policy']:<7} {report.fmt_bytes(row['capacity_bytes']):>8}: "
                    f"FLOPs saved {row['flops_saved']:.1%}, "
                    f"{row['blocks_per_s']:,.0f} blocks/s",
                    flush=True,
                )

        rows = sweep(trace, policies, capacities, opts, args.jobs, done)
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
