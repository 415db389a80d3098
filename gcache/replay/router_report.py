"""``gcache replay --router``: its flags, table, JSON and chart."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from gcache.config import parse_size
from gcache.errors import ConfigError, GCacheError, LayoutError
from gcache.replay.router_sim import SimConfig, simulate
from gcache.replay.trace import TraceError, load
from gcache.router.baselines import POLICY_NAMES

_D = SimConfig()


def add_arguments(rp: argparse.ArgumentParser) -> None:
    """The router simulator's own flags (``--trace``, ``--layout``, ``--block-size``,
    ``--policy``, ``--limit``, ``--json``, ``--plot``, ``--quiet`` are shared)."""
    g = rp.add_argument_group("router simulation (--router)")
    g.add_argument(
        "--router",
        action="store_true",
        help=f"simulate a fleet behind each routing policy ({', '.join(POLICY_NAMES)})",
    )
    g.add_argument("--instances", type=int, default=_D.instances, help="engine instances")
    g.add_argument(
        "--speedup", type=float, default=_D.speedup, help="arrival times divided by this"
    )
    g.add_argument(
        "--local-capacity", default="64GiB", help="KV bytes each instance keeps for reuse"
    )
    g.add_argument("--pool-capacity", default="1TiB", help="GCache pool bytes (0: no pool)")
    g.add_argument(
        "--flops", type=float, default=_D.flops, help="effective prefill FLOP/s an instance"
    )
    g.add_argument(
        "--fetch-bandwidth",
        type=float,
        default=_D.fetch_bandwidth,
        help="bytes/s from the pool into an instance",
    )
    g.add_argument(
        "--fetch-latency-s", type=float, default=_D.fetch_latency_s, help="per pool read"
    )
    g.add_argument(
        "--decode-s", type=float, default=_D.decode_s_per_token, help="decode seconds a token"
    )
    g.add_argument("--seed", type=int, default=_D.seed, help="seed of the policies' tie-breaks")


def config_from(args: argparse.Namespace) -> SimConfig:
    cfg = SimConfig(
        instances=args.instances,
        layout=args.layout,
        block_size=args.block_size,
        local_capacity=parse_size(args.local_capacity),
        pool_capacity=parse_size(args.pool_capacity),
        flops=args.flops,
        fetch_bandwidth=args.fetch_bandwidth,
        fetch_latency_s=args.fetch_latency_s,
        decode_s_per_token=args.decode_s,
        speedup=args.speedup,
        checkpoint_interval=args.checkpoint_interval,
        seed=args.seed,
    )
    cfg.check()
    return cfg


COLUMNS = (
    ("policy", lambda r: r["policy"]),
    ("hit", lambda r: f"{r['hit_rate']:.1%}"),
    ("local", lambda r: f"{r['local_hit_rate']:.1%}"),
    ("pool", lambda r: f"{r['pool_hit_rate']:.1%}"),
    ("imbalance", lambda r: f"{r['imbalance']:.2f}"),
    ("TTFT mean", lambda r: f"{r['ttft_mean_s']:.3f} s"),
    ("p50", lambda r: f"{r['ttft_p50_s']:.3f} s"),
    ("p99", lambda r: f"{r['ttft_p99_s']:.3f} s"),
    ("req/s", lambda r: f"{r['throughput_rps']:.2f}"),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, one row per policy."""
    cells = [[name for name, _ in COLUMNS]] + [[fn(r) for _, fn in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(cells):
        pairs = enumerate(zip(row, widths, strict=True))
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs]
        lines.append("| " + " | ".join(parts) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """TTFT mean/p50/p99 bars per policy, and hit rate (local, pool) bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GCacheError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    names = [r["policy"] for r in rows]
    x = list(range(len(rows)))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    for k, (key, label) in enumerate(
        (("ttft_mean_s", "mean"), ("ttft_p50_s", "p50"), ("ttft_p99_s", "p99"))
    ):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("simulated TTFT (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    local = [100 * r["local_hit_rate"] for r in rows]
    bx.bar(x, local, 0.6, label="local")
    bx.bar(x, [100 * r["pool_hit_rate"] for r in rows], 0.6, bottom=local, label="pool")
    bx.set_xticks(x, names, fontsize=8)
    bx.set_ylabel("prompt tokens served from cache (%)")
    bx.legend(fontsize=8)
    bx.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cmd_router(args: argparse.Namespace) -> int:
    """Run every policy on the trace; print the table, write JSON and the chart."""
    try:
        policies = [p.strip() for p in (args.policy or ",".join(POLICY_NAMES)).split(",")]
        policies = [p for p in policies if p]
        bad = [p for p in policies if p not in POLICY_NAMES]
        if bad or not policies:
            name = bad[0] if bad else ""
            raise ConfigError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
        if args.limit < 0:
            raise ConfigError("--limit must be >= 0")
        cfg = config_from(args)
        t0 = time.perf_counter()
        trace = load(args.trace, args.block_size, args.limit)
        if not args.quiet:
            print(
                f"{trace.path}: {trace.requests} requests, {trace.tokens:,} prompt tokens "
                f"(loaded in {time.perf_counter() - t0:.1f}s); {cfg.instances} instances, "
                f"speed-up {cfg.speedup:g}",
                flush=True,
            )

        def done(row: dict[str, Any]) -> None:
            if not args.quiet:
                print(
                    f"  {row['policy']:<11} TTFT mean {row['ttft_mean_s']:.3f} s, "
                    f"p99 {row['ttft_p99_s']:.3f} s ({row['sim_wall_s']:.1f}s)",
                    flush=True,
                )

        rows = simulate(trace, policies, cfg, done)
    except (TraceError, ConfigError, LayoutError) as exc:
        print(f"gcache replay: {exc}", file=sys.stderr)
        return 2
    print()
    print(table(rows))
    try:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=2)
                fh.write("\n")
            print(f"\nJSON: {args.json}")
        if args.plot:
            title = (
                f"{os.path.basename(args.trace)}, {args.layout}, {cfg.instances} instances, "
                f"speed-up {cfg.speedup:g}"
            )
            plot(rows, args.plot, title)
            print(f"chart: {args.plot}")
    except OSError as exc:
        print(f"gcache replay: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    except GCacheError as exc:
        print(f"gcache replay: {exc}", file=sys.stderr)
        return 1
    return 0
