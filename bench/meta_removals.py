"""Cost of the meta's removal feed on its eviction path.

    python -m bench.meta_removals [--puts 4000] [--subscribers 0|1|...] [--repeat 5]

Drives :class:`MetaCore` in process (no I/O, as its unit tests do): one server of
4 MiB DRAM and no NVMe, a namespace of one full-attention layer (16 KiB blocks of
16 tokens), prompts of 4 blocks put and committed one after another, so past the
first ~60 prompts every put evicts (watermarks) about as many objects as it
stores. Measured: CPU time (``time.process_time``) per put and per evicted
object, best of ``--repeat``; with ``--subscribers N`` that many subscribers
watch the namespace and one of them reads the feed after every put (what the
gRPC stream does), so the figure includes recording and reading. A tree without
the feed (a tree without it) runs the same script: ``subscribers`` is then ignored.
"""

from __future__ import annotations

import argparse
import json
import time

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.layout import LayerSpec, LayoutSpec
from gcache.meta.core import MetaCore

SPEC = LayoutSpec(block_size=16, dtype="float16", layers=(LayerSpec("full", 1, 256, 256),))
WALL = 1.7e9


def run(puts: int, subscribers: int) -> dict[str, float]:
    core = MetaCore(MetaConfig(demote=False))
    addr = wire.ServerAddr("s0", "127.0.0.1", 9000, "host", "/dev/shm/x")
    core.register_server(addr, bytes(16), 1, 4 << 20, 0.0)
    fp = core.register_namespace({"model": "bench"}, SPEC).fingerprint
    feed = getattr(core, "removals", None)
    subs = [feed.subscribe(fp, 0.0) for _ in range(subscribers)] if feed is not None else []
    prompts = [keys.block_keys(fp, [p * 1000 + j for j in range(64)], 16) for p in range(puts)]
    layout = core.namespaces[fp].layout
    read = 0
    t0 = time.process_time()
    for p, ks in enumerate(prompts):
        now = float(p) * 0.001
        placed = core.put_begin(wire.PutBegin(fp, ks, layout.groups_to_store(len(ks))), now, WALL)
        done = [(i, bytes(8)) for i in range(len(placed.placements))]
        core.put_commit(wire.PutCommit(placed.put_id, done), now)
        if subs and feed is not None:
            read += len(feed.read(subs[0], 1 << 16).removed)
    cpu = time.process_time() - t0
    evicted = core.counters["evictions"]
    return {
        "puts": puts,
        "evicted": evicted,
        "read": read,
        "us_per_put": cpu / puts * 1e6,
        "us_per_evicted": cpu / max(1, evicted) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--puts", type=int, default=4000)
    ap.add_argument("--subscribers", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    runs = [run(args.puts, args.subscribers) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["us_per_put"])
    print(json.dumps({"subscribers": args.subscribers, **best}))


if __name__ == "__main__":
    main()
