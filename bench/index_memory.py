"""Bytes of meta memory per indexed block, and index operation rates.

    python -m bench.index_memory [--blocks 200000] [--json FILE]

Drives the real ``MetaCore`` in process (no sockets): puts prompts of 64 blocks
with the MiMo-V2-Flash layout (strict O(W): one full object per block, windows at
each prompt's end), then measures traced Python heap per indexed block, and the
rate of PutBegin+PutCommit and of Lookup per block. The anchor is a plain
``dict[bytes16, None]`` of the same keys built in the same run: the ratio shows
what the entries cost beyond the hash map itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.layout import preset
from gcache.meta.core import MetaCore

WALL = 1.7e9


def build(n_blocks: int, prompt_blocks: int) -> tuple[MetaCore, bytes, list[list[bytes]], float]:
    core = MetaCore(MetaConfig(high_watermark=0.99, low_watermark=0.98))
    for i in range(2):
        core.register_server(
            wire.ServerAddr(f"s{i}", "127.0.0.1", 1 + i, "h", ""), bytes(16), 1, 1 << 50, 0.0
        )
    spec = preset("mimo-v2-flash", 64)
    fp = core.register_namespace({"model": "bench"}, spec).fingerprint
    layout = core.namespaces[fp].layout
    prompts = []
    t0 = time.perf_counter()
    for p in range(n_blocks // prompt_blocks):
        toks = list(range(p * 10_000, p * 10_000 + 64 * prompt_blocks))
        ks = keys.block_keys(fp, toks, 64)
        prompts.append(ks)
        placed = core.put_begin(wire.PutBegin(fp, ks, layout.groups_to_store(len(ks))), 1.0, WALL)
        done = [
            (j, bytes(8 * len(layout.group_layers[pl.group])))
            for j, pl in enumerate(placed.placements)
        ]
        core.put_commit(wire.PutCommit(placed.put_id, done), 1.0)
    return core, fp, prompts, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    # Timed build untraced (tracemalloc slows allocation several-fold), then a
    # traced build of the same size for the memory figure.
    core, fp, prompts, put_s = build(args.blocks, args.prompt_blocks)
    del core
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    core, fp, prompts, _ = build(args.blocks, args.prompt_blocks)
    gc.collect()
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = core.entries

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    anchor = {k: None for ks in prompts for k in ks}
    anchor_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    t0 = time.perf_counter()
    looked = 0
    for ks in prompts:
        core.lookup(wire.Lookup(fp, ks, lease=True), 2.0, WALL)
        looked += len(ks)
    lookup_s = time.perf_counter() - t0

    rows = [
        {"metric": "indexed blocks", "value": n},
        {"metric": "bytes per block (meta index)", "value": round(index_bytes / n, 1)},
        {
            "metric": "bytes per key (anchor: dict of keys)",
            "value": round(anchor_bytes / len(anchor), 1),
        },
        {"metric": "index / anchor", "value": round(index_bytes / max(anchor_bytes, 1), 2)},
        {"metric": "put blocks/s (PutBegin+PutCommit)", "value": round(n / put_s)},
        {"metric": "leased lookup blocks/s", "value": round(looked / lookup_s)},
    ]
    width = max(len(str(r["metric"])) for r in rows)
    for r in rows:
        print(f"{r['metric']:<{width}}  {r['value']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
