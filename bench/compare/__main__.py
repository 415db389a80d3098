"""``python -m bench.compare``: GCache against the stores a user would pick instead.

In one run on one machine, at the same value sizes and concurrency:

* the limits: loopback TCP with ``iperf3``, memcpy with numpy;
* Redis: a ``redis-server`` started here on loopback, driven with redis-py
  (one process per concurrent client) and with ``redis-benchmark``;
* Mooncake Store over TCP (master, storage process, client process) and its
  same-process memcpy path, skipped with a printed reason when it cannot run;
* GCache over TCP and over shared memory: a local meta + server started here,
  measured with ``gcache-bench`` (the real console tool, one process, ``--qd``
  operations in flight);
* the NVMe tier (``bench/compare/nvme.py``): raw ``dd`` direct I/O of ``--nvme-dir``
  against ``gcache-bench write|read --tier nvme`` on the same directory.

Prints every figure and the ratios GCache / peer, writes JSON and a PNG chart.
The peers are installed on first use (apt / pip); nothing here is a test dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import import_module
from typing import Any

from bench.compare import nvme
from bench.compare.peers import PEERS
from bench.compare.report import chart, print_ratios, print_table, ratios

DEFAULT_SIZES = "64KiB,1MiB,4MiB"
# The second TCP target size: GCache over TCP (single-object operations in
# flight) against iperf3 only, fewer iterations (the bytes, not the count, matter).
DEFAULT_TCP_SIZES = "16MiB"
TCP_EXTRA_BYTES = 4 << 30  # per op and size: 256 operations of 16 MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="value sizes (comma-separated)")
    p.add_argument(
        "--tcp-sizes",
        default=DEFAULT_TCP_SIZES,
        help="extra sizes for GCache over TCP (operations in flight) against iperf3 only; "
        "'' for none",
    )
    p.add_argument("--iters", type=int, default=1000, help="operations per size and op")
    p.add_argument("--concurrency", type=int, default=4, help="operations in flight")
    p.add_argument("--seconds-cap", type=float, default=20.0, help="time cap per peer")
    p.add_argument(
        "--skip",
        default="",
        help="peers to leave out: limits,redis_peer,mooncake_peer,gcache,nvme",
    )
    p.add_argument(
        "--nvme-dir",
        default="",
        help="directory on the disk under test for the NVMe rows (default: the temp dir)",
    )
    p.add_argument("--nvme-sizes", default=nvme.DEFAULT_SIZES, help="NVMe object sizes")
    p.add_argument(
        "--nvme-total", default="512MiB", help="bytes per NVMe size (dd and gcache-bench)"
    )
    p.add_argument("--json", default="bench/results/compare.json")
    p.add_argument("--plot", default="bench/results/compare.png")
    return p.parse_args(argv)


def _sizes(text: str) -> list[int]:
    from gcache.config import parse_size
    from gcache.errors import ConfigError

    try:
        sizes = [parse_size(x.strip()) for x in text.split(",") if x.strip()]
    except ConfigError as exc:
        raise SystemExit(f"bench.compare: bad --sizes: {exc}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise SystemExit("bench.compare: --sizes needs at least one positive size")
    return sizes


def _runs(
    sizes: list[int], tcp_sizes: list[int], iters: int, qd: int
) -> list[tuple[str, str, int, int, int, int]]:
    """(transport, op, size, qd, batch, iterations) of every gcache-bench run.

    Two shapes of the same concurrency: qd operations of one object in flight (as
    redis-py's client processes), and one operation of qd objects at a time (as
    Mooncake's batch_put_from / batch_get_into of qd keys). The extra TCP sizes run
    in the first shape only (their peer is iperf3), capped at TCP_EXTRA_BYTES."""
    out = []
    for transport in ("tcp", "shm"):
        for op in ("write", "read"):
            for size in sizes:
                for q, batch in ((qd, 1), (1, qd)):
                    out.append((transport, op, size, q, batch, max(1, iters // batch)))
            if transport == "tcp":
                for size in tcp_sizes:
                    if size not in sizes:
                        n = max(qd, min(iters, TCP_EXTRA_BYTES // size))
                        out.append((transport, op, size, qd, 1, n))
    return out


def run_gcache(
    sizes: list[int], iters: int, qd: int, tcp_sizes: list[int] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """gcache-bench write/read over tcp and shm against one local deployment."""
    from gcache.cli.deploy import LocalDeployment

    rows: list[dict[str, Any]] = []
    tcp_sizes = tcp_sizes or []
    with tempfile.TemporaryDirectory(prefix="gcache-compare-") as tmp:
        # Writes outrun this; the meta evicts at its watermarks as in production.
        capacity = max(2 << 30, 64 * max([*sizes, *tcp_sizes]))
        dep = LocalDeployment(
            tmp,
            servers=1,
            capacity=str(capacity),
            metrics_port=-1,
            meta_args=["--high-watermark", "0.95", "--low-watermark", "0.9"],
        )
        dep.start()
        try:
            for transport, op, size, q, batch, n in _runs(sizes, tcp_sizes, iters, qd):
                out = os.path.join(tmp, f"{transport}-{op}-{size}-{batch}.json")
                cmd = [
                    sys.executable, "-m", "gcache.benchtool.main", op,
                    "-s", str(size), "-n", str(n),
                    "--qd", str(q), "--batch", str(batch),
                    "--transport", transport, "--meta", dep.meta_addr,
                    "--meta-grpc", dep.meta_grpc, "--json", out,
                ]  # fmt: skip
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    return rows, f"gcache-bench {op} {transport} {size}: " + (
                        r.stderr.strip().splitlines() or ["?"]
                    )[-1]
                with open(out) as fh:
                    for g in json.load(fh):
                        rows.append(_gcache_row(g, q, batch, " ".join(cmd[3:14])))
        finally:
            dep.stop()
    return rows, ""


def _gcache_row(g: dict[str, Any], qd: int, batch: int, cmd: str) -> dict[str, Any]:
    shape = (
        f"one client process, {qd} operations in flight"
        if batch == 1
        else f"one client process, one operation of {batch} objects at a time"
    )
    return {
        "system": f"gcache ({g['transport'].upper()}{', batched' if batch > 1 else ''})",
        "op": g["op"],
        "bytes": g["bytes"],
        "iterations": g["iterations"],
        "concurrency": qd * batch,
        "bw_avg_gbps": round(g["bw_avg_gbps"], 3),
        "bw_peak_gbps": round(g["bw_peak_gbps"], 3),
        "lat_p50_us": round(g["lat_p50_us"], 1),
        "lat_p99_us": round(g["lat_p99_us"], 1),
        "note": f"gcache-bench {cmd}: {shape}; latency per operation; every read "
        "verifies the xxh3 checksums",
        "wall_s": round(g.get("wall_s", 0.0), 4),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = _sizes(args.sizes)
    tcp_sizes = _sizes(args.tcp_sizes) if args.tcp_sizes.strip() else []
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    t_start = time.monotonic()
    for name in PEERS:
        if name in skip:
            skipped[name] = "--skip"
            continue
        mod = import_module(f"bench.compare.peers.{name}")
        print(f"# {name}: checking / installing ...", flush=True)
        ok, why = mod.available()
        if not ok:
            skipped[name] = why
            print(f"# {name}: skipped: {why}", flush=True)
            continue
        t0 = time.monotonic()
        got = mod.run(sizes, args.iters, args.concurrency, args.seconds_cap)
        rows += got
        if mod.LAST_ERROR:
            skipped[name] = mod.LAST_ERROR
            print(f"# {name}: {mod.LAST_ERROR}", flush=True)
        print(f"# {name}: {len(got)} rows in {time.monotonic() - t0:.1f} s", flush=True)
    if "gcache" not in skip:
        print("# gcache: local meta + server, gcache-bench over tcp and shm ...", flush=True)
        t0 = time.monotonic()
        got, err = run_gcache(sizes, args.iters, args.concurrency, tcp_sizes)
        rows += got
        if err:
            skipped["gcache"] = err
            print(f"# gcache: {err}", flush=True)
        print(f"# gcache: {len(got)} rows in {time.monotonic() - t0:.1f} s", flush=True)
    nvme_sizes: list[int] = []
    if "nvme" not in skip:
        from gcache.config import parse_size

        nvme_sizes = _sizes(args.nvme_sizes)
        where = args.nvme_dir or tempfile.gettempdir()
        print(f"# nvme: dd direct vs gcache-bench --tier nvme in {where} ...", flush=True)
        t0 = time.monotonic()
        got, err = nvme.run(where, nvme_sizes, parse_size(args.nvme_total), args.concurrency)
        rows += got
        if err:
            skipped["nvme"] = err
            print(f"# nvme: {err}", flush=True)
        print(f"# nvme: {len(got)} rows in {time.monotonic() - t0:.1f} s", flush=True)
    print()
    print_table(rows)
    rat = ratios(rows, sorted({*sizes, *tcp_sizes, *nvme_sizes}))
    print()
    print_ratios(rat)
    for name, why in skipped.items():
        print(f"# skipped/partial {name}: {why}")
    doc = {
        "command": " ".join(["python -m bench.compare", *(argv or sys.argv[1:])]),
        "sizes": sizes,
        "tcp_sizes": tcp_sizes,
        "iters": args.iters,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "seconds": round(time.monotonic() - t_start, 1),
        "rows": rows,
        "ratios": rat,
        "skipped": skipped,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
        print(f"# wrote {args.json}")
    if args.plot:
        err = chart(rows, args.plot)
        print(f"# chart: {err}" if err else f"# wrote {args.plot}")


if __name__ == "__main__":
    main()
