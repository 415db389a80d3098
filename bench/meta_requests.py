"""What one small request costs the meta's core, in process (no sockets): a leased
lookup and its release of 1 and 4 objects, and a put (begin + commit) of one
object by a client session (grants minted, receipts checked, as the hot path
serves it). The per-request floor under every small operation of the data plane.

    python -m bench.meta_requests [--rounds 7] [--n 4000] [--only lookup|put] [--json FILE]

To compare two source trees, run this file against each (the core is imported
from ``PYTHONPATH``; start it outside both trees, or ``python -m`` finds the
working directory's first):

    cd /tmp && PYTHONPATH=TREE:TREE/client python /path/to/bench/meta_requests.py

Each figure is the minimum over ``--rounds`` rounds of ``--n`` requests (the
least disturbed round on a shared machine); the keys and receipts the bench
makes per request are timed apart and not counted."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gcache import capability, keys, wire
from gcache.benchtool import ops
from gcache.config import MetaConfig
from gcache.meta.core import MetaCore
from gcache.meta.session import LOCAL, Session

SECRET = bytes(16)
WALL = 1.7e9


def make_core() -> MetaCore:
    core = MetaCore(MetaConfig())
    addr = wire.ServerAddr("s0", "127.0.0.1", 9000, "host", "/dev/shm/s0")
    core.register_server(addr, SECRET, incarnation=1, capacity=1 << 34, now=0.0)
    return core


def best(rounds: int, n: int, step: Callable[[int], None]) -> float:
    """Microseconds per call of ``step(i)``: the minimum over the rounds."""
    out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(r * n, (r + 1) * n):
            step(i)
        out.append((time.perf_counter() - t0) / n * 1e6)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=4000, help="requests per round")
    ap.add_argument("--only", choices=("lookup", "put"), help="one kind of request (a profile)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    core = make_core()
    spec = ops.raw_layout(65536)
    fp = core.register_namespace({"model": "bench"}, spec).fingerprint
    layout = core.namespaces[fp].layout
    client = Session("bench-client")

    def put(tokens: np.ndarray) -> int:
        ks = keys.block_keys(fp, tokens, layout.block_size)
        placed = core.put_begin(
            wire.PutBegin(fp, ks, layout.groups_to_store(len(ks))), 1.0, WALL, client
        )
        done, rc = [], []
        for j, pl in enumerate(placed.placements):
            done.append((j, bytes(8 * len(layout.group_layers[pl.group]))))
            g = pl.grant
            rc.append(capability.receipt(SECRET, g.offset, g.length, g.expiry_ms))
        return int(core.put_commit(wire.PutCommit(placed.put_id, done, rc), 1.0, client))

    out: dict[str, float] = {}
    for batch in () if args.only == "put" else (1, 4):
        prompts = []
        for i in range(32):
            toks = ops.batch_tokens((batch << 20) + i, batch)
            if put(toks) != batch:
                raise SystemExit("the prompts to look up could not be stored")
            prompts.append(keys.block_keys(fp, toks, layout.block_size))

        def lookup(i: int, prompts: list[list[bytes]] = prompts) -> None:
            res = core.lookup(wire.Lookup(fp, prompts[i % 32], True), 2.0, WALL)
            core.release(res.lease_id, LOCAL)

        out[f"lookup_release_{batch}_us"] = best(args.rounds, args.n, lookup)

    def put1(i: int) -> None:
        if put(ops.batch_tokens((8 << 20) + i, 1)) != 1:
            raise SystemExit("a put stored nothing")

    def own(i: int) -> None:  # the bench's own share of put1: keys and a receipt
        keys.block_keys(fp, ops.batch_tokens((9 << 20) + i, 1), layout.block_size)
        capability.receipt(SECRET, 0, 65536, 1)

    if args.only != "lookup":
        put1(-1)
        out["put_1_us"] = best(args.rounds, args.n, put1) - best(args.rounds, args.n, own)
    print("| request | us (min of rounds) |\n|---|---|")
    for name, us in out.items():
        print(f"| {name.removesuffix('_us')} | {us:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
