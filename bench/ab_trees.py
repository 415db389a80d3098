"""Two source trees against each other on the data plane: ``gcache-bench OP
--local`` of ``--before`` and ``--after``, alternated ABBA (before, after, after,
before, ...) ``--rounds`` times per configuration (op x size x transport), so
both see the same machine load and its drift. Prints the median over rounds of
p50/p99 latency and throughput with the after/before ratios, and writes every run
to ``--json``. For a refactor that must change no speed:

    python bench/ab_trees.py --before /work/wt/base --after . --json out.json
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


def run_one(tree: Path, op: str, size: str, transport: str, qd: int, seconds: float) -> Any:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{tree}:{tree / 'client'}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable, "-m", "gcache.benchtool.main", op, "-s", size,
            "-D", str(seconds), "--qd", str(qd), "--transport", transport, "--local",
            "--capacity", "1GiB", "--json", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tree)
        return json.loads(out.read_text())[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="source tree of the anchor")
    ap.add_argument("--after", type=Path, required=True, help="source tree measured against it")
    ap.add_argument("--ops", default="read,write")
    ap.add_argument("--sizes", default="64KiB,1MiB")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--qd", type=int, default=4, help="operations in flight")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    ap.add_argument("--json", type=Path, default=Path("ab_trees.json"))
    args = ap.parse_args()
    trees = [("before", args.before.resolve()), ("after", args.after.resolve())]
    runs: list[dict[str, Any]] = []
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            for transport in args.transports.split(","):
                for r in range(args.rounds):
                    for name, tree in trees if r % 2 == 0 else trees[::-1]:
                        row = run_one(tree, op, size, transport, args.qd, args.duration)
                        row.update(tree=name, op=op, size=size, transport=transport, round=r)
                        runs.append(row)
                        print(
                            f"{op:>5} {size:>6} {transport:>3} round {r} {name:>6}: p50 "
                            f"{row['lat_p50_us']:8.1f} us  p99 {row['lat_p99_us']:8.1f} us  "
                            f"{row['bw_avg_gbps']:.3f} GB/s",
                            flush=True,
                        )
    print()
    print(
        "| op | size | transport | p50 before [us] | p50 after [us] | ratio | "
        "p99 before [us] | p99 after [us] | ratio | GB/s before | GB/s after | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            for transport in args.transports.split(","):

                def med(tree: str, key: str, op: str = op, size: str = size,
                        transport: str = transport) -> float:  # fmt: skip
                    return float(
                        statistics.median(
                            r[key]
                            for r in runs
                            if (r["tree"], r["op"], r["size"], r["transport"])
                            == (tree, op, size, transport)
                        )
                    )

                cells = [op, size, transport]
                line: dict[str, Any] = {"op": op, "size": size, "transport": transport}
                for key in ("lat_p50_us", "lat_p99_us", "bw_avg_gbps"):
                    b, a = med("before", key), med("after", key)
                    line[key] = {"before": b, "after": a, "ratio": a / b if b else None}
                    fmt = ".3f" if key == "bw_avg_gbps" else ".1f"
                    cells += [format(b, fmt), format(a, fmt), f"{a / b:.2f}" if b else "-"]
                summary.append(line)
                print("| " + " | ".join(cells) + " |")
    args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
