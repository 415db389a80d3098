"""The compact index (``gcache/meta/compact.py``) alone against ``MetaCore``, in
process, on the same prompts. Since 2026-12-07 ``MetaCore`` runs on the compact
index itself, so the anchor is the meta's own bookkeeping around it (handles,
totals, leases, grants, the allocators) over the bare data structure.

    python -m bench.compact_index [--blocks 1M,10M] [--anchor-blocks 1M] \
        [--python-blocks 1M] [--json FILE]

Both sides get the prompts of ``bench.meta_scale`` (random 16-byte block keys, a
third of the blocks in each of 4k, 32k and 128k-token prompts of 64-token blocks,
MiMo-V2-Flash: a full-attention object on every block with 9 layers of 8-byte
checksums, window objects at each prompt's end as ``Layout.groups_to_store`` says).

* **compact**: ``CompactIndex.add_chain`` + ``add_objects`` per prompt (4 servers
  in turn); a lookup is ``match`` of the full group (a binary search of probes, as
  the meta's); a leased lookup also finds every matched block (``find_keys``:
  one pass over the key list), ``touch``-es their objects and ``pin``-s them, then ``unpin``-s them
  (the release); eviction is ``victim`` + ``remove_object`` until 100,000
  objects (at most half of them) went. With the C kernels (``gcache/_native/
  _index.c``: heap sifts, probes, the lookup's binary search) when built; the
  **compact (Python)** side, at ``--python-blocks``, runs the same without them
  (``native=False``).
* **anchor** (``MetaCore``, at ``--anchor-blocks``): ``put_begin`` + ``put_commit``
  per prompt, a lookup is ``MetaCore.lookup`` unleased, a leased one is
  ``MetaCore.lookup(lease=True)`` + ``release`` (which also builds the reply's
  object locations: more than the compact side does), eviction is
  ``Index.evict_pass`` of 100,000 objects.

Each side runs in its own process (RSS is not shared or reused between them). RSS
per block: VmRSS after the fill minus VmRSS before it (the keys already in memory),
over the blocks indexed. The compact index also prints the bytes its arrays hold.
The two differ in scope: the anchor also holds the allocators' live maps and
builds each lease's reply (grants, checksums), which the bare index does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench.meta_rebuild import descriptor, rss_kib
from bench.meta_scale import BS, make_prompts, parse_sizes, pct, plan, put_in_process

EVICT = 100_000
CHUNK_ROWS = 65_536
SERVERS = 4


def _layout() -> Any:
    from gcache.layout import Layout, preset

    return Layout(preset("mimo-v2-flash", BS))


def latencies(out: dict[str, Any], length: int, lat: list[float], leased: list[float]) -> None:
    size = f"{length * BS // 1024}k"
    out[f"lookup_{size}_p50_us"] = round(pct(lat, 50) * 1e6, 1)
    out[f"lookup_{size}_p99_us"] = round(pct(lat, 99) * 1e6, 1)
    out[f"leased_{size}_p99_us"] = round(pct(leased, 99) * 1e6, 1)


def fill_compact(ix: Any, layout: Any, prompts: dict[int, list[list[bytes]]]) -> int:
    """Every prompt into ``ix`` (namespace 0): its blocks by ``add_chain``, its
    objects by ``add_objects`` per group as ``Layout.groups_to_store`` says, the
    prompts' servers in turn. Returns the next access tick."""
    widths = [8 * len(x) for x in layout.group_layers]
    sizes = layout.group_object_bytes
    tick = offset = p = 0
    for lists in prompts.values():
        masks = layout.groups_to_store(len(lists[0]))
        rows = {g: np.flatnonzero([m >> g & 1 for m in masks]) for g in range(len(widths))}
        for ks in lists:
            ids = ix.add_chain(0, ks)
            for g, at in rows.items():
                n = at.size
                if not n:
                    continue
                ticks = np.arange(tick, tick + n, dtype=np.uint64)
                offs = np.arange(offset, offset + n * sizes[g], sizes[g], dtype=np.uint64)
                ix.add_objects(
                    ids[at], g, p % SERVERS, offs, np.full(n, sizes[g], np.uint32),
                    np.zeros((n, widths[g]), np.uint8), ticks,
                )  # fmt: skip
                tick += n
                offset += n * sizes[g]
            p += 1
    return tick


def run_compact(n_blocks: int, lookups: int, seed: int, native: bool = True) -> dict[str, Any]:
    from gcache.meta.compact import CompactIndex

    layout = _layout()
    widths = [8 * len(x) for x in layout.group_layers]
    sizes = layout.group_object_bytes
    prompts = make_prompts(plan(n_blocks), seed)
    gc.collect()
    before = rss_kib(os.getpid())
    ix = CompactIndex(groups=layout.num_groups, native=native)
    tails = layout.group_tail_blocks
    ix.namespace(0, tails.index(None) if None in tails else None)
    t0 = time.perf_counter()
    tick = fill_compact(ix, layout, prompts)
    fill_s = time.perf_counter() - t0
    gc.collect()
    after = rss_kib(os.getpid())
    blocks = ix.stats()["blocks"]
    out: dict[str, Any] = {
        "side": "compact" if native else "compact (Python)",
        "blocks": blocks,
        "objects": ix.stats()["objects"],
        "fill_s": round(fill_s, 2),
        "fill_blocks_per_s": round(blocks / fill_s),
        "rss_per_block": round((after["VmRSS"] - before["VmRSS"]) * 1024 / blocks, 1),
        "array_bytes_per_block": round(ix.nbytes() / blocks, 1),
    }
    rng = np.random.default_rng(seed)
    for length, lists in prompts.items():
        lat, leased = [], []
        for i in rng.integers(0, len(lists), lookups):
            ks = lists[int(i)]
            t = time.perf_counter()
            n = ix.match(0, ks, 0)
            lat.append(time.perf_counter() - t)
            assert n == length
            # Leased: every matched object's id (one vectorised probe) and touched.
            t = time.perf_counter()
            n = ix.match(0, ks, 0)
            tick += 1
            oids = ix.blocks.cols["obj"][ix.find_keys(0, ks[:n]), 0]
            ix.touch(oids, tick)
            ix.pin(oids)
            ix.unpin(oids)
            leased.append(time.perf_counter() - t)
        latencies(out, length, lat, leased)
    t = time.perf_counter()
    went = min(EVICT, ix.stats()["objects"] // 2)
    for _ in range(went):
        ix.remove_object(ix.victim())
    out["evict_us_per_object"] = round((time.perf_counter() - t) / went * 1e6, 2)
    del ix
    gc.collect()
    out.update(rebuild_compact(prompts, layout, widths, sizes, native))
    return out


def rebuild_compact(
    prompts: dict[int, list[list[bytes]]],
    layout: Any,
    widths: list[int],
    sizes: list[int],
    native: bool,
) -> dict[str, Any]:
    """The same blocks as the servers report them: rows (key, parent key, position,
    groups) merged by position across prompts (as ``meta/streams.py`` hands them
    to adoption) in chunks of ``CHUNK_ROWS``, loaded in bulk (the eviction heap
    built once at the end). Only the index's side of a rebuild: no gRPC, no
    decoding, no allocator books."""
    from gcache.meta.compact import CompactIndex

    k0s, k1s, poss, masks = [], [], [], []
    for length, lists in prompts.items():
        pk = np.frombuffer(b"".join(k for ks in lists for k in ks), "<u8").reshape(-1, 2)
        k0s.append(pk[:, 0])
        k1s.append(pk[:, 1])
        poss.append(np.tile(np.arange(length, dtype=np.int32), len(lists)))
        masks.append(np.tile(np.array(layout.groups_to_store(length), np.uint8), len(lists)))
    k0, k1 = np.concatenate(k0s), np.concatenate(k1s)
    pos, mask = np.concatenate(poss), np.concatenate(masks)
    pk0, pk1 = np.roll(k0, 1), np.roll(k1, 1)
    pk0[pos == 0] = 0
    pk1[pos == 0] = 0
    order = np.argsort(pos, kind="stable")
    ix = CompactIndex(groups=layout.num_groups, native=native)
    tails = layout.group_tail_blocks
    ix.namespace(0, tails.index(None) if None in tails else None)
    t0 = time.perf_counter()
    ix.begin_bulk()
    off = 0
    for c in range(0, len(order), CHUNK_ROWS):
        r = order[c : c + CHUNK_ROWS]
        ids = ix.add_blocks(0, k0[r], k1[r], pk0[r], pk1[r], pos[r])
        for g, width in enumerate(widths):
            at = np.flatnonzero(mask[r] >> g & 1)
            n = at.size
            offs = np.arange(off, off + n * sizes[g], sizes[g], dtype=np.uint64)
            off += n * sizes[g]
            ix.add_objects(
                ids[at], g, c % SERVERS, offs, np.full(n, sizes[g], np.uint32),
                np.zeros((n, width), np.uint8), np.arange(c, c + n, dtype=np.uint64),
            )  # fmt: skip
    ix.end_bulk()
    took = time.perf_counter() - t0
    assert ix.stats()["blocks"] == len(order)
    return {"rebuild_s": round(took, 2), "rebuild_us_per_block": round(took / len(order) * 1e6, 2)}


def run_anchor(n_blocks: int, lookups: int, seed: int) -> dict[str, Any]:
    from gcache import wire
    from gcache.config import MetaConfig
    from gcache.meta.core import MetaCore

    desc, spec = descriptor(BS)
    prompts = make_prompts(plan(n_blocks), seed)
    gc.collect()
    before = rss_kib(os.getpid())
    core = MetaCore(MetaConfig(adopt_outbox=max(1 << 16, 4 * n_blocks)))
    for s in range(SERVERS):
        addr = wire.ServerAddr(f"s{s}", "127.0.0.1", 1 + s, "h", "")
        core.register_server(addr, bytes(16), 1, 1 << 60, 0.0)
    ns = core.register_namespace(desc, spec)
    t0 = time.perf_counter()
    put_in_process(core, ns, prompts)
    fill_s = time.perf_counter() - t0
    for srv in core.servers.values():
        srv.adopt_out.clear()  # what the servers' heartbeats would take
    gc.collect()
    after = rss_kib(os.getpid())
    blocks = core.entries
    out: dict[str, Any] = {
        "side": "anchor (MetaCore index)",
        "blocks": blocks,
        "objects": sum(s.objects for s in core.servers.values()),
        "fill_s": round(fill_s, 2),
        "fill_blocks_per_s": round(blocks / fill_s),
        "rss_per_block": round((after["VmRSS"] - before["VmRSS"]) * 1024 / blocks, 1),
        "array_bytes_per_block": None,
    }
    rng = np.random.default_rng(seed)
    now = 2.0
    for length, lists in prompts.items():
        lat, leased = [], []
        for i in rng.integers(0, len(lists), lookups):
            ks = lists[int(i)]
            now += 1e-6
            t = time.perf_counter()
            r = core.lookup(wire.Lookup(ns.fingerprint, ks), now, 1.7e9)
            lat.append(time.perf_counter() - t)
            assert r.blocks == length, r.blocks
            t = time.perf_counter()
            r = core.lookup(wire.Lookup(ns.fingerprint, ks, lease=True), now, 1.7e9)
            core.release(r.lease_id)
            leased.append(time.perf_counter() - t)
        latencies(out, length, lat, leased)
    t = time.perf_counter()
    left = min(EVICT, out["objects"] // 2)
    went_to = left
    for srv in list(core.servers.values()):
        left -= core.evictions.evict_pass(srv, max_objects=left // SERVERS + 1)[1]
    went = went_to - left
    out["evict_us_per_object"] = round((time.perf_counter() - t) / max(1, went) * 1e6, 2)
    return out


COLS = (
    ("side", "side"),
    ("blocks", "blocks"),
    ("rss_per_block", "RSS B/block"),
    ("array_bytes_per_block", "arrays B/block"),
    ("fill_blocks_per_s", "fill blocks/s"),
    ("lookup_4k_p50_us", "4k p50 us"),
    ("lookup_4k_p99_us", "4k p99"),
    ("lookup_32k_p50_us", "32k p50"),
    ("lookup_32k_p99_us", "32k p99"),
    ("lookup_128k_p50_us", "128k p50"),
    ("lookup_128k_p99_us", "128k p99"),
    ("leased_4k_p99_us", "leased 4k p99"),
    ("leased_32k_p99_us", "leased 32k p99"),
    ("leased_128k_p99_us", "leased 128k p99"),
    ("evict_us_per_object", "evict us/obj"),
    ("rebuild_s", "rebuild s (index only)"),
)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for _, h in COLS) + " |"
    sep = "|" + "---|" * len(COLS)
    body = [
        "| " + " | ".join("-" if r.get(k) is None else f"{r[k]:,}" if isinstance(r[k], int)
                          else str(r[k]) for k, _ in COLS) + " |"
        for r in rows
    ]  # fmt: skip
    return "\n".join([head, sep, *body])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.compact_index", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--blocks", type=parse_sizes, default=parse_sizes("1M"))
    ap.add_argument("--anchor-blocks", type=parse_sizes, default=parse_sizes("1M"),
                    help="MetaCore's index at these sizes (the anchor)")  # fmt: skip
    ap.add_argument("--python-blocks", type=parse_sizes, default=[],
                    help="the compact index without its C kernels at these sizes")  # fmt: skip
    ap.add_argument("--lookups", type=int, default=1000, help="lookups per prompt length")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--side", choices=["compact", "python", "anchor"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:  # one side in this process (the parent runs each in its own)
        if args.side == "anchor":
            row = run_anchor(args.blocks[0], args.lookups, args.seed)
        else:
            row = run_compact(args.blocks[0], args.lookups, args.seed, args.side == "compact")
        print(json.dumps(row))
        return
    rows = []
    jobs = [("anchor", n) for n in args.anchor_blocks] + [("compact", n) for n in args.blocks]
    jobs += [("python", n) for n in args.python_blocks]
    for side, n in jobs:
        cmd = [sys.executable, "-m", "bench.compact_index", "--side", side, "--blocks", str(n),
               "--lookups", str(args.lookups), "--seed", str(args.seed)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{side} at {n} blocks failed: {r.stderr.strip().splitlines()[-1:]}")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"# {side} {n:,} blocks done", file=sys.stderr, flush=True)
    print(table(rows))
    base = [r for r in rows if r["side"].startswith("anchor")]
    for r in rows:
        if r["side"].startswith("compact") and base:
            b = base[0]
            print(f"{r['side']} at {r['blocks']:,} blocks / anchor at {b['blocks']:,}: RSS per "
                  f"block {r['rss_per_block'] / b['rss_per_block']:.2f}x, 32k lookup p99 "
                  f"{r['lookup_32k_p99_us'] / b['lookup_32k_p99_us']:.2f}x, fill rate "
                  f"{r['fill_blocks_per_s'] / b['fill_blocks_per_s']:.2f}x, eviction "
                  f"{r['evict_us_per_object'] / b['evict_us_per_object']:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "argv": sys.argv[1:]}, fh, indent=2)


if __name__ == "__main__":
    main()
