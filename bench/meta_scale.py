"""The meta at fleet scale: memory, lookup latency, put rate, rebuild and eviction
per indexed-block count.

    python -m bench.meta_scale --blocks 1M,10M [--servers 4] [--put-qd 2]
                               [--lookups 2000] [--profile] [--json FILE]

For each ``--blocks`` size (suffixes k and M, decimal: 20k = 20,000) the same
prompts are indexed twice, each time in a fresh, real ``gcache-meta`` process
(``LocalDeployment``); the prompts are whole MiMo-V2-Flash prompts (64-token
blocks; strict O(W): one full object per block, the two sliding-window objects
of each prompt's last blocks) of 4k, 32k and 128k tokens, each length an equal
share of the blocks (as ``gcache-bench lookup`` fills), with random 16-byte keys.

(a) **Report path** (a fleet of restarted servers): ``--servers`` servers played
over real gRPC exactly as ``bench/meta_rebuild.py`` plays them (its ``play``:
``RegisterServer``, ``ReportObjects`` in ``StoredColumns`` chunks of 2048 records
in block order, heartbeats), each object on a random server, ``--nvme-fraction``
of them on NVMe. Measured: the rebuild time (first ``RegisterServer`` to the last
``ReportObjectsReply``), the meta's CPU over it, and its RSS per block.

(b) **Put path** (the client hot path): one real ``gcache-server`` (sparse
segment: ``--no-populate --no-reserve``, so nothing is written) and a real
client; every prompt is PUT_BEGIN, SEAL at the server (no bytes move; the
server's receipt) and PUT_COMMIT, ``--put-qd`` prompts in flight (the loop of
``gcache.benchtool.ops.populate_index``). A real server holds a record of every
object too (about 950 B each in its process at 1M): where that would not fit in
memory beside the meta (``--put-server auto``; or ``played``), the server is
played over real gRPC instead (registered, heartbeating, as ``meta_rebuild``
plays them) and the bench computes the receipts the server's SEAL would return
(``capability.receipt`` with the secret it registered): the same frames reach
the meta's hot path, only the SEAL round trip is gone (the table's ``srv``
column says which; puts/s is then the meta's rate without a server's). Measured:
puts (prompts) and blocks per second, the meta's RSS per block; then Lookups of
whole prompts of each length through the meta's hot path (one in flight, no
lease unless ``--lease``), and the eviction cost: the server's capacity is sized
so the fill ends at 85 % of it, below the 90 % high watermark; then 4k-token
prompts are put until the watermark is crossed (12 % more blocks) and the commit
that crossed it evicts down to 80 % in one pass (LRU, no NVMe tier: dropped).
Eviction cost per block, three ways: *burst* = (that commit's time - the phase's
median commit) / the blocks that left the index (the evict path itself, as the
client waits for it); *latency* = (the time of all the phase's commits - their
count x the median) / the blocks that left (with what follows it: the server
applying the frees); *CPU* = (the meta's CPU over the phase - its blocks put x
the fill's CPU per block) / the blocks that left.

RSS: ``/proc/PID/status`` VmRSS after the fill minus VmRSS before it (the meta
started, the namespace registered). ``--profile``: ``py-spy record`` on the meta
during each fill (if ``py-spy`` is in the virtual environment or on PATH); the
top functions by own and by total samples are printed and kept in the JSON.
``--report-only``: the report path alone (a rebuild's figures, without the puts).

Also a breakdown of where the bytes of one block go: an in-process ``MetaCore``
of ``--breakdown-blocks`` blocks (filled as ``bench/index_memory.py`` fills one), each
object reachable from the index sized with ``sys.getsizeof`` rounded up to
pymalloc's 16 bytes, per kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import msgspec
import numpy as np

from bench.meta_rebuild import (
    CHUNK,
    MODEL,
    chunk_body,
    cpu_s,
    descriptor,
    play,
    rss_kib,
    spread,
)
from gcache import capability, keys, wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.benchtool.ops import _seal_and_commit
from gcache.cli.deploy import LocalDeployment, fetch_stats
from gcache.config import ClientConfig
from gcache.layout import Layout
from gcache.storage.record import StoredRecord

BS = 64  # tokens per block
PROMPT_TOKENS = (4096, 32768, 131072)
FILL_TO = 0.85  # of the put path's capacity, below the default 0.9 high watermark


def parse_count(text: str) -> int:
    """``20k`` -> 20000, ``1M`` -> 1000000, ``1.5M``, ``123``."""
    t = text.strip()
    mult = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000, "G": 10**9, "g": 10**9}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad block count {text!r} (e.g. 20k, 1M)") from None


def parse_sizes(text: str) -> list[int]:
    sizes = [parse_count(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 3 * 2048:
        raise argparse.ArgumentTypeError(
            f"--blocks {text!r}: need at least {3 * 2048} blocks (a prompt of each length)"
        )
    return sizes


def plan(n_blocks: int) -> dict[int, int]:
    """Prompts per length in blocks: each of the three lengths an equal share."""
    share = -(-n_blocks // len(PROMPT_TOKENS))
    return {p // BS: max(1, share // (p // BS)) for p in PROMPT_TOKENS}


def make_prompts(counts: dict[int, int], seed: int) -> dict[int, list[list[bytes]]]:
    """Random 16-byte block keys (the meta never recomputes a chain), per length."""
    out: dict[int, list[list[bytes]]] = {}
    rng = random.Random(seed)
    for blocks, n in counts.items():
        raw = rng.randbytes(16 * blocks * n)
        out[blocks] = [
            [raw[16 * (i * blocks + j) : 16 * (i * blocks + j + 1)] for j in range(blocks)]
            for i in range(n)
        ]
    return out


def fill_bytes(layout: Layout, prompts: dict[int, list[list[bytes]]]) -> tuple[int, int, int]:
    """(objects, DRAM bytes, blocks) of storing every prompt (sizes are page multiples)."""
    sizes = layout.group_object_bytes
    objects = nbytes = blocks = 0
    for length, lists in prompts.items():
        per_obj = per_bytes = 0
        for mask in layout.groups_to_store(length):
            for g in range(layout.num_groups):
                if mask >> g & 1:
                    per_obj += 1
                    per_bytes += sizes[g]
        objects += per_obj * len(lists)
        nbytes += per_bytes * len(lists)
        blocks += length * len(lists)
    return objects, nbytes, blocks


# ---- (a) the report path -------------------------------------------------------------------


def report_records(
    fp: bytes,
    layout: Layout,
    prompts: dict[int, list[list[bytes]]],
    servers: int,
    nvme_fraction: float,
    seed: int,
) -> tuple[list[list[StoredRecord]], list[int]]:
    """Each server's manifest of ``prompts`` in block order (what ``gcache-server``
    streams), each object on a random server, and each server's DRAM capacity
    (below the watermarks); as ``bench.meta_rebuild.manifests`` for given prompts."""
    rng = random.Random(seed)
    lists = [ks for group in prompts.values() for ks in group]
    per, dram_off = spread(fp, layout, lists, servers, nvme_fraction, rng)
    for recs in per:
        recs.sort(key=lambda o: o.pos)
    return per, [max(4 * d, 1 << 30) for d in dram_off]


def report_chunks(
    fp: bytes,
    layout: Layout,
    prompts: dict[int, list[list[bytes]]],
    servers: int,
    nvme_fraction: float,
    seed: int,
) -> tuple[list[list[bytes]], list[int], int]:
    """:func:`report_records` as serialised ``ReportObjectsRequest`` bodies in
    ``StoredColumns`` chunks (without the header fields, added per chunk), the
    capacities and the object count."""
    per, caps = report_records(fp, layout, prompts, servers, nvme_fraction, seed)
    out: list[list[bytes]] = []
    total = 0
    for i, recs in enumerate(per):
        total += len(recs)
        out.append(
            [
                chunk_body(recs[j : j + CHUNK], "columns").SerializeToString()
                for j in range(0, len(recs), CHUNK)
            ]
        )
        per[i] = []
    return out, caps, total


def run_report(
    prompts: dict[int, list[list[bytes]]], args: argparse.Namespace, prof: str
) -> dict[str, Any]:
    desc, spec = descriptor(BS)
    fp = keys.fingerprint(desc)
    layout = Layout(spec)
    t = time.perf_counter()
    chunks, caps, total = report_chunks(
        fp, layout, prompts, args.servers, args.nvme_fraction, args.seed
    )
    build_s = time.perf_counter() - t
    ns_req = pb.RegisterNamespaceRequest(
        model=MODEL, layout_json=msgspec.json.encode(spec).decode(), kv_dtype=spec.dtype
    )
    blocks = sum(len(ks) for lists in prompts.values() for ks in lists)
    with tempfile.TemporaryDirectory(prefix="gcache-scale-") as tmp:
        dep = LocalDeployment(tmp, servers=0, metrics_port=-1, log_level="warning")
        dep.start()
        try:
            assert dep.meta is not None
            pid = dep.meta.popen.pid
            with grpc.insecure_channel(dep.meta_grpc) as ch:
                got = pb_grpc.ControlStub(ch).RegisterNamespace(ns_req, timeout=30)
                assert got.fingerprint == fp, "namespace fingerprint differs"
            time.sleep(0.3)
            before = rss_kib(pid)
            spy = Profiler(pid, prof) if prof else None
            dt, cpu, _settle, st, res = asyncio.run(
                play(dep.meta_grpc, pid, chunks, caps, ns_req, False)
            )
            top = spy.stop() if spy else {}
            after = rss_kib(pid)
        finally:
            dep.stop()
    del chunks
    c = st.counters
    adopted = int(c.get("objects", 0))
    if adopted != total:
        raise RuntimeError(f"report path: {adopted} of {total} objects in the index")
    grown = (after["VmRSS"] - before["VmRSS"]) * 1024
    return {
        "objects": total,
        "servers": args.servers,
        "nvme_fraction": args.nvme_fraction,
        "rebuild_s": round(dt, 3),
        "us_per_block": round(dt / blocks * 1e6, 2),
        "meta_cpu_s": round(cpu, 3),
        "dropped": sum(d for _, d in res),
        "index_entries": int(c.get("index_entries", 0)),
        # how the streams met: rows held by the merge, records parked on the way
        "rows_held": int(c.get("report_rows_held_total", 0)),
        "objects_parked": int(c.get("objects_parked", 0)),
        "rss_before_mib": round(before["VmRSS"] / 1024, 1),
        "rss_after_mib": round(after["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(after["VmHWM"] / 1024, 1),
        "rss_bytes_per_block": round(grown / blocks, 1),
        "rss_bytes_per_object": round(grown / total, 1),
        "build_manifests_s": round(build_s, 2),
        "profile": top,
    }


# ---- (b) the put path ----------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


Commit = Any  # async (client, layout, placed, fp, keys) -> None


async def commit_played(
    secret: bytes, client: Any, layout: Layout, placed: Any, fp: bytes, ks: list[bytes]
) -> None:
    """PutCommit of every placement with the receipts a server holding ``secret``
    would have returned for its SEAL (``capability.receipt``): the meta's work is
    the same as with a real server, no server process holds the records."""
    done = [
        (i, bytes(8 * len(layout.group_layers[pl.group]))) for i, pl in enumerate(placed.placements)
    ]
    receipts = [
        capability.receipt(secret, pl.grant.offset, pl.grant.length, pl.grant.expiry_ms)
        for pl in placed.placements
    ]
    await client._meta_call(wire.PutCommit(placed.put_id, done, receipts))


async def put_prompt(
    client: Any, ns: Any, ks: list[bytes], commit: Commit, stall_s: float = 30.0
) -> float:
    """One prompt through the hot path as ``ops.populate_index`` puts it (PutBegin,
    SEAL at the server for its receipt, PutCommit; again while anything found no
    space). Returns the seconds of the last seal + commit (where a commit that
    crosses the high watermark evicts)."""
    layout = ns.layout
    masks = layout.groups_to_store(len(ks))
    deadline = time.monotonic() + stall_s
    commit_s = 0.0
    while True:
        placed = await client._meta_call(wire.PutBegin(ns.fingerprint, ks, masks))
        if placed.placements:
            t0 = time.perf_counter()
            await commit(client, layout, placed, ns.fingerprint, ks)
            commit_s = time.perf_counter() - t0
            deadline = time.monotonic() + stall_s
        if not placed.no_space:
            return commit_s
        if time.monotonic() > deadline:
            raise RuntimeError(f"put stalled: {placed.no_space} objects found no space")
        await asyncio.sleep(0.01)


async def put_all(
    client: Any, ns: Any, lists: list[list[bytes]], qd: int, commit: Commit
) -> list[float]:
    it = iter(lists)
    times: list[float] = []

    async def worker() -> None:
        for ks in it:
            times.append(await put_prompt(client, ns, ks, commit))

    await asyncio.gather(*(worker() for _ in range(qd)))
    return times


async def played_server(target: str, capacity: int, stop: asyncio.Event) -> tuple[bytes, Any]:
    """Register one server over real gRPC as ``gcache-server`` does (no objects to
    report) and heartbeat it until ``stop``; returns its secret and the task."""
    secret = os.urandom(16)
    ch = grpc.aio.insecure_channel(target)
    stub = pb_grpc.ControlStub(ch)
    reg = pb.RegisterServerRequest(
        server_id="played0", host="127.0.0.1", port=40000, hostname="bench", shm_path="",
        capacity=capacity, secret=secret, incarnation=7, objects=0,
    )  # fmt: skip
    epoch = (await stub.RegisterServer(reg, timeout=60)).epoch

    async def beats() -> None:
        try:
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
                beat = pb.HeartbeatRequest(server_id="played0", incarnation=7, epoch=epoch)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Heartbeat(beat, timeout=120)
        finally:
            await ch.close()

    return secret, asyncio.create_task(beats())


def choose_put_server(choice: str, blocks: int) -> str:
    """``auto``: a real server unless the real server's records (about 950 B an
    object in its process, measured at 1M) with the meta's and this process's
    would not fit in 3/4 of the memory available now."""
    if choice != "auto":
        return choice
    avail = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    need = blocks * (950 + 800 + 200)
    return "real" if need < 0.75 * avail else "played"


async def lookups(
    client: Any, fp: bytes, lists: list[list[bytes]], n: int, lease: bool, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    lat: list[float] = []
    for i in range(n + 20):
        ks = lists[rng.randrange(len(lists))]
        t0 = time.perf_counter()
        res = await client._meta_call(wire.Lookup(fp, ks, lease))
        dt = time.perf_counter() - t0
        if res.blocks != len(ks):
            raise RuntimeError(f"lookup matched {res.blocks} of {len(ks)} blocks")
        if lease and res.lease_id:
            await client._meta_call(wire.Release(res.lease_id))
        if i >= 20:  # the first ones warm the connection
            lat.append(dt * 1e6)
    return {
        "p50_us": round(pct(lat, 50), 1),
        "p99_us": round(pct(lat, 99), 1),
        "p999_us": round(pct(lat, 99.9), 1),
        "per_s": round(len(lat) / (sum(lat) / 1e6), 1),
    }


def run_puts(
    prompts: dict[int, list[list[bytes]]], args: argparse.Namespace, prof: str
) -> dict[str, Any]:
    from gcache.layout import preset
    from gcache_client import AsyncGCacheClient

    layout = Layout(preset("mimo-v2-flash", BS))
    objects, nbytes, blocks = fill_bytes(layout, prompts)
    capacity = -(-int(nbytes / FILL_TO) // 4096) * 4096
    extra_blocks = max(2 * 64, int(0.12 * blocks)) // 64 * 64  # crosses 0.9 from 0.85
    extra = make_prompts({64: extra_blocks // 64}, args.seed + 1)[64]
    # Every prompt, the lengths interleaved (shuffled) so the LRU order, hence what
    # the eviction phase takes, is not by length.
    order = [ks for lists in prompts.values() for ks in lists]
    random.Random(args.seed).shuffle(order)
    server = choose_put_server(args.put_server, blocks)
    with tempfile.TemporaryDirectory(prefix="gcache-scale-") as tmp:
        dep = LocalDeployment(
            tmp,
            servers=1 if server == "real" else 0,
            capacity=str(capacity),
            metrics_port=-1,
            log_level="warning",
            # one client is the whole workload: its puts may reserve most of the store
            meta_args=["--max-pending-per-client", "0.9", "--max-pending-total", "0.9"],
            server_args=["--no-populate", "--no-reserve"],
        )
        dep.start()
        try:
            assert dep.meta is not None
            pid = dep.meta.popen.pid
            cfg = ClientConfig(
                meta=dep.meta_addr, meta_grpc=dep.meta_grpc, transport="tcp", timeout_s=120.0
            )

            async def body() -> dict[str, Any]:
                stop = asyncio.Event()
                commit: Commit = _seal_and_commit
                beating = None
                if server == "played":
                    secret, beating = await played_server(dep.meta_grpc, capacity, stop)
                    commit = functools.partial(commit_played, secret)
                try:
                    return await measure(commit)
                finally:
                    stop.set()
                    if beating is not None:
                        await beating

            async def measure(commit: Commit) -> dict[str, Any]:
                async with AsyncGCacheClient(cfg) as client:
                    ns = await client.register_namespace(
                        "bench-scale", "mimo-v2-flash", block_size=BS
                    )
                    await asyncio.sleep(0.3)
                    before = rss_kib(pid)
                    spy = Profiler(pid, prof) if prof else None
                    cpu0 = cpu_s(pid)
                    t0 = time.perf_counter()
                    await put_all(client, ns, order, args.put_qd, commit)
                    fill_s = time.perf_counter() - t0
                    fill_cpu = cpu_s(pid) - cpu0
                    top = spy.stop() if spy else {}
                    after = rss_kib(pid)
                    server_rss = rss_kib(dep.servers[0].popen.pid)["VmRSS"] if dep.servers else 0
                    st = fetch_stats(dep.meta_grpc, timeout=120).counters
                    look = {
                        p: await lookups(
                            client, ns.fingerprint, prompts[p // BS], args.lookups, args.lease, 7
                        )
                        for p in PROMPT_TOKENS
                    }
                    # The eviction phase.
                    st1 = fetch_stats(dep.meta_grpc, timeout=120).counters
                    ev0 = int(st1.get("evictions", 0))
                    en0 = int(st1.get("index_entries", 0))
                    cpu1 = cpu_s(pid)
                    times = await put_all(client, ns, extra, 1, commit)
                    ev_cpu = cpu_s(pid) - cpu1
                    st2 = fetch_stats(dep.meta_grpc, timeout=120).counters
                    return {
                        "before": before,
                        "after": after,
                        "fill_s": fill_s,
                        "fill_cpu": fill_cpu,
                        "stats": st,
                        "lookups": look,
                        "ev_objects": int(st2.get("evictions", 0)) - ev0,
                        "ev_blocks": en0 + extra_blocks - int(st2.get("index_entries", 0)),
                        "ev_times": times,
                        "ev_cpu": ev_cpu,
                        "profile": top,
                        "server_rss": server_rss,
                    }

            r = asyncio.run(body())
        finally:
            dep.stop()
    st = r["stats"]
    if int(st.get("index_entries", 0)) != blocks:
        raise RuntimeError(f"put path: {st.get('index_entries')} of {blocks} blocks indexed")
    if int(st.get("evictions", 0)):
        raise RuntimeError("put path: the fill evicted (capacity sized too small)")
    grown = (r["after"]["VmRSS"] - r["before"]["VmRSS"]) * 1024
    n_puts = len(order)
    times = r["ev_times"]
    med = pct(times, 50)
    excess = sum(times) - len(times) * med
    evb = r["ev_blocks"]
    cpu_per_block = r["fill_cpu"] / blocks
    return {
        "objects": int(st.get("objects", 0)),
        "server": server,
        "capacity_bytes": capacity,
        "puts": n_puts,
        "put_qd": args.put_qd,
        "fill_s": round(r["fill_s"], 3),
        "puts_per_s": round(n_puts / r["fill_s"], 1),
        "blocks_per_s": round(blocks / r["fill_s"], 1),
        "meta_cpu_s": round(r["fill_cpu"], 3),
        "meta_cpu_us_per_block": round(cpu_per_block * 1e6, 2),
        "rss_before_mib": round(r["before"]["VmRSS"] / 1024, 1),
        "rss_after_mib": round(r["after"]["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(r["after"]["VmHWM"] / 1024, 1),
        "rss_bytes_per_block": round(grown / blocks, 1),
        "rss_bytes_per_object": round(grown / objects, 1),
        "server_rss_mib": round(r["server_rss"] / 1024, 1),
        "lookup": {str(p): v for p, v in r["lookups"].items()},
        "lookup_lease": args.lease,
        "eviction": {
            "blocks_put": extra_blocks,
            "objects_evicted": r["ev_objects"],
            "blocks_evicted": evb,
            "commits": len(times),
            "commit_median_ms": round(med * 1e3, 3),
            "commit_max_ms": round(max(times, default=0.0) * 1e3, 1),
            # the watermark pass is one commit (90 % -> 80 %): the slowest one
            "us_per_block_burst": (
                round((max(times) - med) / evb * 1e6, 2) if evb > 0 and times else None
            ),
            "us_per_block_latency": round(excess / evb * 1e6, 2) if evb > 0 else None,
            "us_per_block_cpu": (
                round((r["ev_cpu"] - extra_blocks * cpu_per_block) / evb * 1e6, 2)
                if evb > 0
                else None
            ),
        },
        "profile": r["profile"],
    }


# ---- py-spy --------------------------------------------------------------------------------


def py_spy() -> str:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy") or ""


class Profiler:
    """``py-spy record`` of process ``pid`` (raw collapsed stacks into ``path``)
    until :meth:`stop`, which returns the top functions."""

    def __init__(self, pid: int, path: str, rate: int = 100) -> None:
        self.path = path
        exe = py_spy()
        self.proc: subprocess.Popen[bytes] | None = None
        if not exe:
            print("--profile: py-spy not found (pip install py-spy)", file=sys.stderr)
            return
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--format", "raw", "--output", path,
             "--rate", str(rate), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(0.5)  # attached before the fill starts

    def stop(self, n: int = 15) -> dict[str, Any]:
        if self.proc is None:
            return {}
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not Path(self.path).exists():
            return {"error": err.decode(errors="replace")[-500:]}
        return top_functions(Path(self.path).read_text(), n) | {"raw": self.path}


OUTER = frozenset({"<module>", "main", "run_main", "main.<locals>.body"})


def top_functions(collapsed: str, n: int = 15) -> dict[str, Any]:
    """Top ``n`` functions of py-spy's raw (collapsed) stacks: by own samples (the
    innermost frame), and by total samples (a function counted once per stack;
    only ``gcache`` code below the daemon's start-up frames)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        samples += k
        frames = []
        for f in stack.split(";"):
            name, _, where = f.partition(" (")
            frames.append((name, where.rsplit(":", 1)[0]))
        name, where = frames[-1]
        own[f"{name} ({where})"] += k
        for name, where in set(frames):
            if where.startswith("gcache/") and name not in OUTER:
                total[f"{name} ({where})"] += k
    pc = 100.0 / max(samples, 1)
    return {
        "samples": samples,
        "own": [[f, round(c * pc, 1)] for f, c in own.most_common(n)],
        "total": [[f, round(c * pc, 1)] for f, c in total.most_common(n)],
    }


# ---- where a block's bytes go --------------------------------------------------------------


def _alloc(o: object) -> int:
    """Bytes pymalloc gives ``o`` (16-byte size classes up to 512 B)."""
    s = sys.getsizeof(o)
    return -(-s // 16) * 16 if s <= 512 else s


def walk(core: Any) -> dict[str, Any]:
    """Bytes per indexed block of ``core`` by part: the compact index's arrays
    (rows in use), the servers' allocators' live maps, and what else the meta
    keeps per object (pymalloc-rounded ``sys.getsizeof`` of Python objects)."""
    by: Counter[str] = Counter()
    cx = core.index.cx
    n = core.entries
    n_obj = core.live_objects
    by["blocks table (key, namespace, parent, pos, counts, object ids, generation)"] += (
        cx.blocks.nbytes()
    )
    by["objects table (block, group, tier, server, offset, length, keys, pins, ...)"] += (
        cx.objects.nbytes()
    )
    by["checksum slabs (8 B a layer)"] += cx.sums_slabs.nbytes()
    by["key map (open addressing, int32 block ids)"] += cx.keys.nbytes()
    by["eviction heaps (int32 per evictable object)"] += cx.leaves.nbytes()
    for srv in core.servers.values():
        by["allocator live map (DRAM offset -> size)"] += srv.allocator.live_nbytes()
        if srv.reported:
            by["report in progress (DRAM offset -> object)"] += _alloc(srv.reported)
    total = sum(by.values())
    return {
        "blocks": n,
        "objects": n_obj,
        "objects_per_block": round(n_obj / n, 3),
        "bytes_per_block": round(total / n, 1),
        "rows": [[k, round(v / n, 1)] for k, v in sorted(by.items(), key=lambda kv: -kv[1])],
    }


def put_in_process(core: Any, ns: Any, prompts: dict[int, list[list[bytes]]]) -> None:
    """Every prompt through ``core.put_begin``/``put_commit`` (8-byte checksums a
    layer), in process."""
    layout = ns.layout
    for lists in prompts.values():
        for ks in lists:
            placed = core.put_begin(
                wire.PutBegin(ns.fingerprint, ks, layout.groups_to_store(len(ks))), 1.0, 1.7e9
            )
            done = [
                (j, bytes(8 * len(layout.group_layers[pl.group])))
                for j, pl in enumerate(placed.placements)
            ]
            core.put_commit(wire.PutCommit(placed.put_id, done), 1.0)


def breakdown(n_blocks: int, seed: int) -> dict[str, Any]:
    """:func:`walk` of an in-process ``MetaCore`` given the bench's prompts through
    put_begin/put_commit (as ``bench/index_memory.py`` fills one)."""
    from gcache.config import MetaConfig
    from gcache.meta.core import MetaCore

    desc, spec = descriptor(BS)
    prompts = make_prompts(plan(n_blocks), seed)
    # No server heartbeats this core: its commits' outbox (what a heartbeat would
    # take) must hold them all, or placement pauses (as gcache-bench lookup does).
    core = MetaCore(MetaConfig(adopt_outbox=max(1 << 16, 4 * n_blocks)))
    core.register_server(wire.ServerAddr("s0", "127.0.0.1", 1, "h", ""), bytes(16), 1, 1 << 60, 0.0)
    put_in_process(core, core.register_namespace(desc, spec), prompts)
    for srv in core.servers.values():
        srv.adopt_out.clear()  # what a server's next heartbeat takes (in-process only)
    gc.collect()
    return walk(core)


def report_heap(n_blocks: int, servers: int, nvme_fraction: float, seed: int) -> dict[str, Any]:
    """The report path in process, traced: a ``MetaCore`` adopts the same kind of
    manifests (columns encoded and decoded as on the wire, chunk by chunk, as
    ``meta/control.py`` hands them on). Returns the traced heap per block that
    stays, and its peak on the way (what RSS keeps when the allocator cannot give
    freed arenas back)."""
    import tracemalloc

    from gcache.config import MetaConfig
    from gcache.meta.core import MetaCore
    from gcache.storage import columns

    desc, spec = descriptor(BS)
    prompts = make_prompts(plan(n_blocks), seed)
    blocks = sum(len(ks) for lists in prompts.values() for ks in lists)
    core = MetaCore(MetaConfig())
    fp = core.register_namespace(desc, spec).fingerprint
    per, caps = report_records(fp, Layout(spec), prompts, servers, nvme_fraction, seed)
    bodies = [
        [
            columns.encode(recs[j : j + CHUNK]).SerializeToString()
            for j in range(0, len(recs), CHUNK)
        ]
        for recs in per
    ]
    del per
    for i in range(servers):
        addr = wire.ServerAddr(f"s{i}", "127.0.0.1", 1 + i, "h", "")
        core.register_server(addr, bytes(16), 1, caps[i], 0.0, nvme_capacity=1 << 44, report=True)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i, chunks in enumerate(bodies):
        for j, body in enumerate(chunks):
            cols = columns.decode(pb.StoredColumns.FromString(body))
            core.report_columns(f"s{i}", 1, cols, j == len(chunks) - 1, 1.0)
            del cols
    gc.collect()
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if core.entries != blocks:
        raise RuntimeError(f"in-process report: {core.entries} of {blocks} blocks")
    return walk(core) | {
        "heap_bytes_per_block": round((now - base) / blocks, 1),
        "heap_peak_bytes_per_block": round((peak - base) / blocks, 1),
    }


# ---- main ----------------------------------------------------------------------------------


def run_size(n: int, args: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    counts = plan(n)
    prompts = make_prompts(counts, args.seed)
    blocks = sum(b * c for b, c in counts.items())
    print(f"# {blocks} blocks: prompts {counts} (blocks: count)", file=sys.stderr, flush=True)
    prof = os.path.join(out_dir, f"meta-scale-{n}-%s.txt") if args.profile else ""
    report = run_report(prompts, args, prof % "report" if prof else "")
    print(f"#   report path: {report['rebuild_s']:.1f} s", file=sys.stderr, flush=True)
    puts = None if args.report_only else run_puts(prompts, args, prof % "puts" if prof else "")
    return {
        "blocks": blocks,
        "prompts": {str(b * BS): c for b, c in counts.items()},
        "report": report,
        "puts": puts,
    }


def table(rows: list[dict[str, Any]]) -> str:
    cols = [f"{p // 1024}k p50/p99 [us]" for p in PROMPT_TOKENS]
    head = f"{'blocks':>10} {'srv':>6} {'RSS/block put':>13} {'RSS/block rep':>13} " + " ".join(
        f"{c:>19}" for c in cols
    )
    head += f" {'puts/s':>7} {'blocks/s':>9} {'rebuild [s]':>11} {'evict/block [us]':>16}"
    lines = [head]
    for r in rows:
        p, rep = r["puts"], r["report"]
        if p is None:  # --report-only
            lines.append(
                f"{r['blocks']:>10} {'-':>6} {'-':>13} {rep['rss_bytes_per_block']:>11.0f} B "
                f"{'-':>{20 * len(PROMPT_TOKENS) + 18}} {rep['rebuild_s']:>11.2f}"
            )
            continue
        ev = p["eviction"]
        looks = []
        for t in PROMPT_TOKENS:
            lk = p["lookup"][str(t)]
            cell = f"{lk['p50_us']:.0f} / {lk['p99_us']:.0f}"
            looks.append(f"{cell:>19}")
        evs = f"{ev['us_per_block_burst']} / {ev['us_per_block_cpu']}"
        lines.append(
            f"{r['blocks']:>10} {p['server']:>6} {p['rss_bytes_per_block']:>11.0f} B "
            f"{rep['rss_bytes_per_block']:>11.0f} B {' '.join(looks)} "
            f"{p['puts_per_s']:>7.0f} {p['blocks_per_s']:>9.0f} {rep['rebuild_s']:>11.2f} "
            f"{evs:>16}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=parse_sizes, default=parse_sizes("1M"))
    ap.add_argument("--servers", type=int, default=4, help="report path: servers played")
    ap.add_argument("--nvme-fraction", type=float, default=0.5, help="report path: on NVMe")
    ap.add_argument("--put-qd", type=int, default=2, help="put path: prompts in flight")
    ap.add_argument(
        "--put-server",
        choices=("auto", "real", "played"),
        default="auto",
        help="put path: a real gcache-server (SEAL gives the receipts), or one played over "
        "gRPC (registered, heartbeating; the bench computes the receipts); auto: real "
        "unless its memory would not fit",
    )
    ap.add_argument("--lookups", type=int, default=2000, help="lookups per prompt length")
    ap.add_argument("--lease", action="store_true", help="leased lookups (+ release)")
    ap.add_argument("--breakdown-blocks", type=parse_count, default=100_000)
    ap.add_argument("--profile", action="store_true", help="py-spy on the meta during fills")
    ap.add_argument("--report-only", action="store_true", help="the report path (rebuild) only")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else tempfile.gettempdir()
    rows: list[dict[str, Any]] = []
    bd: dict[str, Any] = {}

    def save() -> None:
        if args.json:
            result = {
                "command": "python -m bench.meta_scale "
                + " ".join(sys.argv[1:] if argv is None else argv),
                "python": sys.version.split()[0],
                "load_avg_1m": os.getloadavg()[0],
                "rows": rows,
                "breakdown": bd,
            }
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    for n in args.blocks:
        rows.append(run_size(n, args, out_dir))
        print(table(rows[-1:]), file=sys.stderr, flush=True)
        save()  # each size as it ends: a later one may not fit
    if args.breakdown_blocks > 0:
        bd = breakdown(args.breakdown_blocks, args.seed)
        bd["report_path"] = report_heap(
            args.breakdown_blocks, args.servers, args.nvme_fraction, args.seed
        )
    print()
    print("# RSS/block: put path (all DRAM) and report path; lookups one in flight through")
    print("# the meta's hot path; evict/block: the commit that crossed the high watermark")
    print("# (its time over the median commit) / from the meta's CPU over the phase")
    print(table(rows))
    for r in rows:
        for path in ("report", "puts"):
            if r[path] is None:
                continue
            top = r[path]["profile"]
            if top.get("own"):
                print(f"\n# py-spy, {r['blocks']} blocks, {path} fill: "
                      f"{top['samples']} samples, % own / % total")  # fmt: skip
                for (f, a), (g, b) in zip(top["own"], top["total"], strict=False):
                    print(f"  {a:5.1f}  {f[:64]:<64}  {b:5.1f}  {g[:64]}")
    if bd:
        rp = bd["report_path"]
        print(
            f"\n# where a block's bytes go: in-process MetaCore of {bd['blocks']} blocks "
            f"({bd['objects_per_block']} objects a block), filled by puts / by reports"
        )
        both = dict(bd["rows"])
        rep = dict(rp["rows"])
        for k in [*both, *(k for k in rep if k not in both)]:
            print(f"  {both.get(k, 0.0):7.1f} B {rep.get(k, 0.0):7.1f} B  {k}")
        print(f"  {bd['bytes_per_block']:7.1f} B {rp['bytes_per_block']:7.1f} B  total")
        print(
            f"# report path traced heap: {rp['heap_bytes_per_block']:.0f} B a block stay, "
            f"{rp['heap_peak_bytes_per_block']:.0f} B a block at the peak"
        )
    save()


if __name__ == "__main__":
    main()
