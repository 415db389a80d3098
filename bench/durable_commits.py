"""Put latency and throughput before and after durable commits: ``gcache-bench
write --local`` of two source trees (``--before``: e.g. the main branch; ``--after``:
this tree), run back to back and alternated ``--rounds`` times per configuration
(object size x transport) so both see the same machine load. Prints a table of the
median over rounds of p50/p99 latency and throughput, with the after/before ratios,
and writes every run to ``--json``.

    python bench/durable_commits.py --before /work/main --after . --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_one(tree: Path, size: str, transport: str, duration: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{tree}:{tree / 'client'}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            "-m",
            "gcache.benchtool.main",
            "write",
            "-s",
            size,
            "-D",
            str(duration),
            "--transport",
            transport,
            "--local",
            "--capacity",
            "1GiB",
            "--json",
            str(out),
        ]
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tree)
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="source tree of the anchor")
    ap.add_argument("--after", type=Path, required=True, help="source tree measured against it")
    ap.add_argument("--sizes", default="64KiB,1MiB")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    ap.add_argument("--json", type=Path, default=Path("durable_commits.json"))
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        for transport in args.transports.split(","):
            for r in range(args.rounds):
                for name, tree in trees.items():
                    row = run_one(tree, size, transport, args.duration)
                    row.update(tree=name, size=size, round=r)
                    runs.append(row)
                    print(
                        f"{size:>6} {transport:>3} round {r} {name:>6}: p50 "
                        f"{row['lat_p50_us']:8.1f} us  p99 {row['lat_p99_us']:8.1f} us  "
                        f"{row['bw_avg_gbps']:.3f} GB/s",
                        flush=True,
                    )
    print()
    head = (
        f"{'size':>6} {'transport':>9} | {'p50 before':>10} {'p50 after':>9} {'ratio':>5} | "
        f"{'p99 before':>10} {'p99 after':>9} {'ratio':>5} | "
        f"{'GB/s before':>11} {'GB/s after':>10} {'ratio':>5}"
    )
    print(head)
    table = []
    for size in args.sizes.split(","):
        for transport in args.transports.split(","):

            def med(tree: str, field: str, s: str = size, t: str = transport) -> float:
                return statistics.median(
                    float(x[field])
                    for x in runs
                    if x["tree"] == tree and x["size"] == s and x["transport"] == t
                )

            row = {"size": size, "transport": transport}
            for field in ("lat_p50_us", "lat_p99_us", "bw_avg_gbps"):
                b, a = med("before", field), med("after", field)
                row[field] = {"before": b, "after": a, "ratio": a / b if b else 0.0}
            table.append(row)
            p50, p99, bw = row["lat_p50_us"], row["lat_p99_us"], row["bw_avg_gbps"]
            print(
                f"{size:>6} {transport:>9} | {p50['before']:10.1f} {p50['after']:9.1f} "
                f"{p50['ratio']:5.2f} | {p99['before']:10.1f} {p99['after']:9.1f} "
                f"{p99['ratio']:5.2f} | {bw['before']:11.3f} {bw['after']:10.3f} "
                f"{bw['ratio']:5.2f}"
            )
    args.json.write_text(json.dumps({"table": table, "runs": runs}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
