"""The NVMe tier as an operator sees it: ``gcache up --capacity 256MiB --nvme-size
1GiB`` and a working set of about 3x DRAM.

A real :class:`LocalDeployment` (a ``gcache-meta`` and ``--servers`` ``gcache-server``
processes, each with ``--capacity`` DRAM and an ``--nvme-size`` NVMe tier under a
temporary directory, as ``gcache up`` starts them) and the demo's store workload:
prompts on the full-size MiMo-V2-Flash KV layout (48 layers, 64-token blocks,
``gcache.cli.demo``), each distinct, stored one after the other until
``--working-set`` x the deployment's DRAM was written, then every prompt looked up
again in the order stored and read back, byte-verified. A prompt is a hit when it
matches in full and every byte read is right.

Prints per tree: prompts stored, hit afterwards (%), ``dropped_not_demoted``,
demotions (done), the NVMe tier used, and the puts that waited for demotions
(``--show-status``: also what ``gcache status`` printed at the end). With
``--before TREE`` the same scenario runs on that source tree first (its own
``gcache`` on ``PYTHONPATH``, in a subprocess), so one command gives the table of
a change::

    python bench/nvme_tier_ops.py --before /work/main --json nvme_tier_ops.json

(``--after`` defaults to the tree this file is in.) Uses only what both trees
have: ``LocalDeployment``, ``GCacheClient`` and the meta's counters.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
MiB = 1 << 20

COLUMNS = (
    ("tree", "tree", "{}"),
    ("prompts", "prompts stored", "{}"),
    ("hit_pct", "hit afterwards", "{:.1f} %"),
    ("dropped_not_demoted", "dropped_not_demoted", "{:.0f}"),
    ("demotions_done", "demotions", "{:.0f}"),
    ("nvme_used_pct", "NVMe used", "{:.1f} %"),
    ("puts_waited", "puts waited", "{:.0f}"),
    ("demotion_behind_waits", "behind waits", "{:.0f}"),
    ("store_s", "store s", "{:.1f}"),
)


def scenario(args: argparse.Namespace) -> dict[str, Any]:
    """The operator's scenario on the ``gcache`` this interpreter imports."""
    import numpy as np

    from gcache.cli.demo import synthetic_kv
    from gcache.cli.deploy import LocalDeployment
    from gcache.cli.main import print_status
    from gcache.config import parse_size
    from gcache_client import GCacheClient

    block = 64
    dram = parse_size(args.capacity) * args.servers
    rng = np.random.default_rng(args.seed)
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        LocalDeployment(
            tmp,
            servers=args.servers,
            capacity=args.capacity,
            metrics_port=-1,
            nvme_size=args.nvme_size,
        ) as d,
    ):
        d.start()
        with GCacheClient(d.client_config(timeout_s=30.0)) as client:
            ns = client.register_namespace("demo/mimo-v2-flash", "mimo-v2-flash", block_size=block)
            system = rng.integers(0, 150_000, 2 * block)  # a shared system prompt
            prompts: list[Any] = []
            written = 0
            failed = 0
            t0 = time.perf_counter()
            while written < args.working_set * dram:
                p = np.concatenate([system, rng.integers(0, 150_000, args.prompt_tokens)])
                p = p[: (len(p) // block) * block]
                res = client.put(ns, p, synthetic_kv(ns.layout, ns.fingerprint, p))
                failed += 0 if res.ok and not res.no_space else 1
                written += res.bytes_written
                prompts.append(p)
            store_s = time.perf_counter() - t0
            deadline = time.monotonic() + 30
            while d.stats().counters["demotions_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.1)  # what the operator sees a moment later
            hits = hit_tokens = mismatches = 0
            for p in prompts:
                m = client.match(ns, p)
                ok = m.tokens == len(p)
                if m.tokens:
                    expect = synthetic_kv(ns.layout, ns.fingerprint, p[: m.tokens])
                    stream = client.get_layers(m)
                    for lay in stream:
                        ek, ev = expect[lay.layer]
                        off = lay.start - (m.tokens - len(ek))
                        same = np.array_equal(lay.k, ek[off:]) and np.array_equal(lay.v, ev[off:])
                        mismatches += 0 if same else 1
                        ok = ok and same
                    ok = ok and stream.ok
                    hit_tokens += m.tokens if stream.ok else 0
                    client.release(m)
                hits += ok
        reply = d.stats()
        c = dict(reply.counters)
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            print_status(reply)  # what `gcache status` prints (this tree's)
    ncap = c.get("nvme_capacity", 0) or 1
    return {
        "status": shown.getvalue(),
        "prompts": len(prompts),
        "prompt_tokens": int(sum(len(p) for p in prompts)),
        "hits": hits,
        "hit_pct": 100.0 * hits / max(1, len(prompts)),
        "hit_tokens": hit_tokens,
        "mismatches": mismatches,
        "puts_not_stored_whole": failed,
        "written_mib": written / MiB,
        "dram_mib": dram / MiB,
        "store_s": store_s,
        "nvme_used_mib": c.get("nvme_used", 0) / MiB,
        "nvme_used_pct": 100.0 * c.get("nvme_used", 0) / ncap,
        **{
            k: c.get(k, 0.0)
            for k in (
                "dropped_not_demoted",
                "demotions_done",
                "demotions_issued",
                "demoted_bytes",
                "evictions",
                "nvme_evictions",
                "puts_waited",
                "puts_told_to_wait",
                "demotion_behind",
                "demotion_behind_waits",
                "dropped_no_tier",
                "dropped_not_worth",
                "dropped_tier_full",
                "dropped_put_could_not_wait",
            )
        },
    }


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The scenario in a subprocess importing ``tree``'s gcache."""
    env = dict(os.environ, PYTHONPATH=f"{tree}:{tree / 'client'}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(out)]
        cmd += ["--servers", str(args.servers), "--capacity", args.capacity]
        cmd += ["--nvme-size", args.nvme_size, "--working-set", str(args.working_set)]
        cmd += ["--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.seed)]
        if args.dir:
            cmd += ["--dir", args.dir]
        subprocess.run(cmd, env=env, check=True, cwd=tree)
        row: dict[str, Any] = json.loads(out.read_text())
    return row


def table(rows: list[dict[str, Any]]) -> list[str]:
    widths = [max(len(h), *(len(f.format(r.get(k, 0))) for r in rows)) for k, h, f in COLUMNS]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths, strict=True))]
    for r in rows:
        cells = [f.format(r.get(k, 0)) for k, _, f in COLUMNS]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/nvme_tier_ops.py", description=__doc__)
    ap.add_argument("--before", type=Path, help="also run on this source tree, first")
    ap.add_argument("--after", type=Path, default=HERE, help="source tree (default: this one)")
    ap.add_argument("--servers", type=int, default=2, help="as gcache up (default 2)")
    ap.add_argument("--capacity", default="256MiB", help="DRAM per server")
    ap.add_argument("--nvme-size", default="1GiB", help="NVMe tier per server")
    ap.add_argument("--working-set", type=float, default=3.0, help="x the deployment's DRAM")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="after the 128 shared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="where the NVMe tiers go (default: the temp directory)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--show-status", action="store_true", help="print gcache status at the end")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # child: the scenario only
    args = ap.parse_args()
    if args.one:
        args.one.write_text(json.dumps(scenario(args)))
        return
    rows = []
    for name, tree in (("before", args.before), ("after", args.after)):
        if tree is None:
            continue
        row = {"tree": name, "path": str(tree.resolve()), **run_tree(tree.resolve(), args)}
        rows.append(row)
    print(
        f"{args.servers} servers x {args.capacity} DRAM + {args.nvme_size} NVMe, "
        f"working set {args.working_set}x DRAM, MiMo-V2-Flash prompts of "
        f"{128 + args.prompt_tokens} tokens, stored then all looked up again:"
    )
    for line in table(rows):
        print("  " + line)
    for r in rows:  # the tiers stay below their low watermark: nothing may be dropped
        met = r["hit_pct"] >= 95.0 and r["dropped_not_demoted"] == 0
        print(f"  {r['tree']}: >= 95 % hit and nothing dropped: {'met' if met else 'NOT met'}")
    if args.show_status:
        for r in rows:
            print(f"\ngcache status at the end ({r['tree']}):\n{r['status']}", end="")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
