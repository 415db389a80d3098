"""gcache-router: routing decision latency and KV-event ingestion rate.

    python -m bench.router_bench [--instances 32] [--blocks 1000000] [--json FILE]

* decision: a :class:`FleetIndex` (MiMo-V2-Flash layout, block size 64) holding
  ``--blocks`` blocks over ``--instances`` instances: prompts of 256 blocks sharing
  a 32-block system prompt, each held by one to three instances (full-attention
  objects of every block, the sliding window of the last two). Each request is a
  held prompt (or a fresh one) plus 16 new blocks; one decision = the local match
  of every instance in one pass (:class:`RouteView`) + the ``gcache`` policy's
  choice, timed one by one (``perf_counter_ns``), the same code the daemon runs.
* ingestion: vLLM ``KVEventBatch`` payloads (map-encoded msgpack, 16 blocks per
  ``BlockStored``, 16 events per batch, each event continuing its parent), decoded,
  re-keyed from their token ids to GCache chained keys and applied
  (:class:`EventIngestor`, in process); then the same batches over real ZMQ
  (PUB -> a ``gcache-router`` process's bound SUB), counted by the router's
  ``/metrics`` until all have arrived.

Prints a table; ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from gcache import wire
from gcache.keys import block_keys
from gcache.layout import Layout, preset
from gcache.router.baselines import make_policy
from gcache.router.events import BlockStored, EventIngestor, KVEventBatch
from gcache.router.index import FleetIndex, RouteView
from gcache.router.policy import InstanceLoad, RouteRequest

FP = bytes(range(16))
BS = 64
PROMPT = 256
SYSTEM = 32


def build(instances: int, blocks: int, seed: int) -> tuple[FleetIndex, list[list[bytes]], float]:
    layout = Layout(preset("mimo-v2-flash", BS))
    idx = FleetIndex(layout, max_instances=max(instances, 1), max_blocks=blocks)
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 150000, SYSTEM * BS, dtype=np.int32)
    insts = [idx.register(f"i{i}", 0.0, f"http://i{i}") for i in range(instances)]
    for i, inst in enumerate(insts):
        inst.load = InstanceLoad(queued=i % 3, running=2, tokens_in_flight=(i * 997) % 8192)
    prompts: list[list[bytes]] = []
    t0 = time.perf_counter()
    pick = random.Random(seed)
    while sum(len(i.blocks) for i in insts) < blocks:
        toks = np.concatenate([system, rng.integers(0, 150000, (PROMPT - SYSTEM) * BS, np.int32)])
        keys = block_keys(FP, toks, BS)
        prompts.append(keys)
        for inst in pick.sample(insts, pick.choice((1, 1, 2, 3))):
            idx.store(inst, keys, keys, 1)
            idx.store(inst, keys[-2:], keys[-2:], 2)
    return idx, prompts, time.perf_counter() - t0


def bench_decisions(
    idx: FleetIndex, prompts: list[list[bytes]], n: int, seed: int
) -> dict[str, float]:
    policy = make_policy("gcache", block_size=BS, seed=seed)
    rng = random.Random(seed)
    fresh = block_keys(FP, np.arange(PROMPT * BS, dtype=np.int32), BS)
    times = []
    hits = 0
    gc.collect()
    gc.freeze()
    for i in range(n):
        base = fresh if i % 10 == 9 else rng.choice(prompts)
        keys = base + block_keys(base[-1], np.full(16 * BS, i, dtype=np.int32), BS)
        t0 = time.perf_counter_ns()
        view = RouteView(idx, keys, pool_blocks=0)
        req = RouteRequest(keys, len(keys) * BS)
        d = policy.choose(req, view, 1.0)
        times.append(time.perf_counter_ns() - t0)
        hits += d.local_blocks > 0
    gc.unfreeze()
    arr = np.array(times) / 1e3
    return {
        "decisions": n,
        "keys_per_request": PROMPT + 16,
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "max_us": float(arr.max()),
        "local_hit_fraction": hits / n,
    }


def make_batches(n_blocks: int, seed: int) -> tuple[list[bytes], int]:
    """Map-encoded vLLM batches: 16 events of 16 blocks each, chained."""
    rng = np.random.default_rng(seed)
    enc = msgspec.msgpack.Encoder()
    payloads = []
    made = 0
    h = 0
    while made < n_blocks:
        events = []
        parent: int | None = None
        for e in range(16):
            toks = rng.integers(0, 150000, 16 * BS, dtype=np.int32).tolist()
            hashes = list(range(h, h + 16))
            h += 16
            events.append(
                BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=parent if e else None,
                    token_ids=toks,
                    block_size=BS,
                    medium="GPU",
                )
            )
            parent = hashes[-1]
            made += 16
        payloads.append(enc.encode(KVEventBatch(ts=time.time(), events=list(events))))
    return payloads, made


def bench_ingest(payloads: list[bytes], blocks: int) -> dict[str, float]:
    layout = Layout(preset("mimo-v2-flash", BS))
    idx = FleetIndex(layout, max_blocks=blocks + 1)
    idx.register("e1", 0.0)
    ing = EventIngestor(idx, FP)
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads):
        ing.ingest("e1", seq, p, 1.0)
    dt = time.perf_counter() - t0
    assert ing.blocks == blocks and not ing.rejected, ing.stats()
    return {"blocks": blocks, "seconds": dt, "blocks_per_s": blocks / dt}


def _metric(http: int, what: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'gcache_router_events_total{{what="{what}"}} '):
                return float(line.split()[-1])
    return 0.0


def bench_zmq(payloads: list[bytes], blocks: int) -> dict[str, float]:
    import zmq

    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "gcache.router.daemon", "--port", "0", "--http-port", "0",
                "--events-bind", "tcp://127.0.0.1:*", "--health-interval-s", "0",
                "--namespace", FP.hex(), "--max-blocks-per-instance", str(blocks + 1),
                "--ready-file", str(ready), "--log-level", "warning",
            ],
        )  # fmt: skip
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise SystemExit("router did not start")
                time.sleep(0.05)
            _, port, http, endpoint = ready.read_text().split()
            from tests.rawwire import call  # the framed ReportLoad that makes e1 known

            call(int(port), wire.ReportLoad("e1", 0, 0, 0, 0, "http://127.0.0.1:9"))
            pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            pub.connect(endpoint)
            time.sleep(0.5)
            t0 = time.perf_counter()
            for seq, p in enumerate(payloads):
                pub.send_multipart([b"e1", seq.to_bytes(8, "big"), p])
            deadline = time.monotonic() + 120
            while _metric(int(http), "blocks") < blocks:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {_metric(int(http), 'blocks')} blocks arrived")
                time.sleep(0.01)
            dt = time.perf_counter() - t0
            rejected = _metric(int(http), "rejected_backwards") + _metric(int(http), "malformed")
            pub.close(linger=0)
        finally:
            proc.terminate()
            proc.wait(10)
    return {"blocks": blocks, "seconds": dt, "blocks_per_s": blocks / dt, "rejected": rejected}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="router_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed in all")
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--ingest-blocks", type=int, default=262144)
    ap.add_argument("--no-zmq", action="store_true", help="skip the end-to-end ZMQ run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    tracemalloc.start()
    idx, prompts, build_s = build(args.instances, args.blocks, args.seed)
    heap = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    st = idx.stats()
    dec = bench_decisions(idx, prompts, args.decisions, args.seed)
    payloads, nb = make_batches(args.ingest_blocks, args.seed)
    ing = bench_ingest(payloads, nb)
    zq = None if args.no_zmq else bench_zmq(payloads, nb)
    res: dict[str, Any] = {
        "instances": args.instances,
        "indexed_blocks": st["indexed_blocks"],
        "distinct_keys": st["distinct_keys"],
        "index_bytes_per_block": heap / max(1, st["indexed_blocks"]),
        "build_s": build_s,
        "decision": dec,
        "ingest_in_process": ing,
        "ingest_zmq": zq,
    }
    rows = [
        ("instances", f"{args.instances}"),
        ("indexed blocks (distinct keys)", f"{st['indexed_blocks']} ({st['distinct_keys']})"),
        ("index heap per indexed block", f"{res['index_bytes_per_block']:.0f} B"),
        ("decision p50 / p99 / max", f"{dec['p50_us']:.0f} / {dec['p99_us']:.0f} / "
         f"{dec['max_us']:.0f} us ({dec['keys_per_request']} keys a request)"),
        ("decisions with a local hit", f"{dec['local_hit_fraction']:.0%}"),
        ("ingestion, in process", f"{ing['blocks_per_s']:,.0f} blocks/s"),
    ]  # fmt: skip
    if zq is not None:
        rows.append(("ingestion, ZMQ to a router process", f"{zq['blocks_per_s']:,.0f} blocks/s"))
    width = max(len(r[0]) for r in rows)
    print(f"| {'measure':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
