"""Meta rebuild time and memory for N indexed blocks reported by the servers.

    python -m bench.meta_rebuild [--blocks 1000000] [--servers 4] [--order random]
                                 [--namespace first|last] [--format columns|objects]
                                 [--json FILE]

Starts a real ``gcache-meta`` process (``LocalDeployment`` with no servers) and
plays ``--servers`` restarted storage servers over real gRPC: each registers
(``RegisterServer`` with its object count) and streams its manifest with
``ReportObjects`` in chunks of 2048 records, all servers at once, exactly as
``gcache-server`` does after a meta restart (``server/tiers.py``): in columns
(``StoredColumns``, ``--format columns``) or, as servers before them did, as
``StoredObject`` messages (``--format objects``). The records are
those of prompts of ``--prompt-blocks`` blocks with the MiMo-V2-Flash layout
(block size 64; one full object per block, the sliding-window objects of each
prompt's last blocks, strict O(W)); each object sits on a random server, a
``--nvme-fraction`` of them on its NVMe tier. ``--order``: the order of a server's
manifest: ``random`` (worst case: most records arrive before their parent) or
``block`` (sorted by block position, as servers stream).

Measured: wall time from the first ``RegisterServer`` to the last
``ReportObjectsReply`` (``--namespace first``: the namespace was registered again
before, as a client that came back first does) or to the ``RegisterNamespace``
that adopts what was parked for it (``--namespace last``); then ``GetStats``
checks every object is in the index and nothing is left parked (the servers
heartbeat meanwhile, as real ones do). CPU: the meta process's user + system
time over the same span (``/proc/PID/stat``), the figure that does not depend on
what else runs on the host. Memory: the meta's RSS (``/proc/PID/status`` VmRSS)
before and after, and its peak (VmHWM). The
records are built and serialised before the clock starts (the servers have their
manifest in memory), so the time is the meta's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import msgspec

from gcache import keys
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.cli.deploy import LocalDeployment
from gcache.layout import Layout, preset
from gcache.storage import columns
from gcache.storage.record import StoredRecord

CHUNK = 2048  # records per ReportObjects message (gcache/server/tiers.py REPORT_CHUNK)
ALIGN = 4096
MODEL = "bench-rebuild"


def descriptor(block_size: int) -> tuple[dict[str, Any], Any]:
    spec = preset("mimo-v2-flash", block_size)
    return (
        {
            "model": MODEL,
            "revision": "",
            "tp_size": 1,
            "tp_rank": 0,
            "cache_salt": "",
            "kv_dtype": spec.dtype,
            "layout": msgspec.to_builtins(spec),
        },
        spec,
    )


def spread(
    fp: bytes,
    layout: Layout,
    prompts: list[list[bytes]],
    servers: int,
    nvme_fraction: float,
    rng: random.Random,
) -> tuple[list[list[StoredRecord]], list[int]]:
    """The records of ``prompts`` (each a list of block keys) as the restarted
    servers would hold them: every stored object on a random server, on NVMe with
    probability ``nvme_fraction``, in the order written. Returns each server's
    records and the DRAM bytes each uses."""
    sizes = layout.group_object_bytes
    sums = [bytes(8 * len(layout.group_layers[g])) for g in range(layout.num_groups)]
    per: list[list[StoredRecord]] = [[] for _ in range(servers)]
    dram_off = [0] * servers
    nvme_off = [0] * servers
    seq = 0
    masks_of: dict[int, list[int]] = {}
    for ks in prompts:
        masks = masks_of.get(len(ks))
        if masks is None:
            masks = masks_of[len(ks)] = layout.groups_to_store(len(ks))
        parent = b""
        for pos, key in enumerate(ks):
            mask, g = masks[pos], 0
            while mask:
                if mask & 1:
                    s = rng.randrange(servers)
                    seq += 1
                    length = sizes[g]
                    if rng.random() < nvme_fraction:
                        tier, off = 1, nvme_off[s]
                        nvme_off[s] += length
                    else:
                        tier, off = 0, dram_off[s]
                        dram_off[s] += (length + ALIGN - 1) // ALIGN * ALIGN
                    per[s].append(
                        StoredRecord(
                            namespace=fp, key=key, parent=parent, pos=pos, group=g,
                            tier=tier, offset=off, length=length, sums=sums[g], seq=seq,
                        )
                    )  # fmt: skip
                mask >>= 1
                g += 1
            parent = key
    return per, dram_off


def manifests(
    fp: bytes,
    layout: Layout,
    n_blocks: int,
    prompt_blocks: int,
    servers: int,
    nvme_fraction: float,
    order: str,
    fmt: str = "columns",
    seed: int = 1,
) -> tuple[list[list[bytes]], list[int], int]:
    """Each server's report as serialised ``ReportObjectsRequest`` bodies (without
    the header fields, added per chunk), each server's DRAM capacity needed, and the
    object count."""
    rng = random.Random(seed)
    n_prompts = max(1, n_blocks // prompt_blocks)
    raw = os.urandom(16 * n_prompts * prompt_blocks)
    prompts = [
        [raw[16 * k : 16 * k + 16] for k in range(i * prompt_blocks, (i + 1) * prompt_blocks)]
        for i in range(n_prompts)
    ]
    per, dram_off = spread(fp, layout, prompts, servers, nvme_fraction, rng)
    out: list[list[bytes]] = []
    total = 0
    for recs in per:
        total += len(recs)
        if order == "random":
            rng.shuffle(recs)
        else:
            recs.sort(key=lambda o: o.pos)
        out.append(
            [
                chunk_body(recs[i : i + CHUNK], fmt).SerializeToString()
                for i in range(0, len(recs), CHUNK)
            ]
        )
    caps = [max(4 * d, 1 << 30) for d in dram_off]  # below the watermarks
    return out, caps, total


def records_in(parts: list[bytes]) -> int:
    """The records of a server's report chunks (each full but the last)."""
    if not parts:
        return 0
    last = pb.ReportObjectsRequest.FromString(parts[-1])
    tail = len(last.columns.keys) // 16 if last.HasField("columns") else len(last.objects)
    return (len(parts) - 1) * CHUNK + tail


def chunk_body(recs: list[StoredRecord], fmt: str) -> Any:
    """A ``ReportObjectsRequest`` carrying ``recs``: in columns (``StoredColumns``,
    what ``gcache-server`` sends a meta that takes them) or as ``StoredObject``
    messages (servers before columns)."""
    if fmt == "columns":
        return pb.ReportObjectsRequest(columns=columns.encode(recs))
    fields = ("namespace", "key", "parent", "pos", "group", "tier", "offset", "length")
    objects = [
        pb.StoredObject(sums=r.sums, seq=r.seq, **{f: getattr(r, f) for f in fields}) for r in recs
    ]
    return pb.ReportObjectsRequest(objects=objects)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, val = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(val.split()[0])
    return out


async def play(
    target: str, pid: int, chunks: list[list[bytes]], caps: list[int], ns_req: Any, ns_last: bool
) -> tuple[float, float, float, Any, list[tuple[int, int]]]:
    """Register every server, stream its report, heartbeat; returns (seconds, meta
    CPU seconds, seconds until GetStats answered, the stats, per-server (adopted,
    dropped))."""
    cpu0 = cpu_s(pid)
    channels = [grpc.aio.insecure_channel(target) for _ in chunks]
    stubs = [pb_grpc.ControlStub(c) for c in channels]
    raw_report = [
        c.stream_unary(
            "/gcache.v1.Control/ReportObjects",
            request_serializer=lambda b: b,
            response_deserializer=pb.ReportObjectsReply.FromString,
        )
        for c in channels
    ]
    for c in channels:
        await c.channel_ready()

    async def one(i: int, epochs: dict[int, int]) -> tuple[int, int]:
        sid = f"bench{i}"
        reg = pb.RegisterServerRequest(
            server_id=sid, host="127.0.0.1", port=40000 + i, hostname="bench",
            shm_path="", capacity=caps[i], secret=bytes(range(16)), incarnation=7,
            nvme_capacity=1 << 44, nvme_read_gbps=2.0, nvme_write_gbps=1.0,
            objects=records_in(chunks[i]),  # as a server says: what it will report
        )  # fmt: skip
        reply = await stubs[i].RegisterServer(reg, timeout=60)
        epoch = epochs[i] = reply.epoch
        parts = chunks[i]

        def frames() -> Any:
            for j, body in enumerate(parts):
                head = pb.ReportObjectsRequest(
                    server_id=sid, incarnation=7, epoch=epoch, last=j == len(parts) - 1
                ).SerializeToString()
                yield head + body  # proto fields concatenate

        got = await raw_report[i](frames(), timeout=600)
        return got.adopted, got.dropped

    epochs: dict[int, int] = {}

    async def beats() -> None:
        # Heartbeats as a server sends them (else the meta drops the servers).
        while True:
            await asyncio.sleep(0.5)
            for i, ep in list(epochs.items()):
                beat = pb.HeartbeatRequest(server_id=f"bench{i}", incarnation=7, epoch=ep)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stubs[i].Heartbeat(beat, timeout=60)

    beating = asyncio.create_task(beats())
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(i, epochs) for i in range(len(chunks))))
    if ns_last:
        await stubs[0].RegisterNamespace(ns_req, timeout=600)
    dt = time.perf_counter() - t0
    cpu = cpu_s(pid) - cpu0
    t = time.perf_counter()
    stats = await stubs[0].GetStats(pb.GetStatsRequest(), timeout=600)
    settle = time.perf_counter() - t
    beating.cancel()
    for c in channels:
        await c.close()
    return dt, cpu, settle, stats, list(res)


def run(args: argparse.Namespace) -> dict[str, Any]:
    desc, spec = descriptor(64)
    fp = keys.fingerprint(desc)
    layout = Layout(spec)
    t = time.perf_counter()
    chunks, caps, total = manifests(
        fp,
        layout,
        args.blocks,
        args.prompt_blocks,
        args.servers,
        args.nvme_fraction,
        args.order,
        args.format,
    )
    build_s = time.perf_counter() - t
    ns_req = pb.RegisterNamespaceRequest(
        model=MODEL, layout_json=msgspec.json.encode(spec).decode(), kv_dtype=spec.dtype
    )
    with tempfile.TemporaryDirectory(prefix="gcache-rebuild-") as tmp:
        dep = LocalDeployment(tmp, servers=0, metrics_port=-1, log_level="warning")
        dep.start()
        try:
            assert dep.meta is not None
            pid = dep.meta.popen.pid
            target = dep.meta_grpc
            if not args.namespace_last:
                with grpc.insecure_channel(target) as ch:
                    got = pb_grpc.ControlStub(ch).RegisterNamespace(ns_req, timeout=30)
                    assert got.fingerprint == fp, "namespace fingerprint differs"
            before = rss_kib(pid)
            dt, cpu, settle, st, res = asyncio.run(
                play(target, pid, chunks, caps, ns_req, args.namespace_last)
            )
            after = rss_kib(pid)
            if int(st.counters.get("objects", 0)) != total:
                log = (Path(tmp) / "meta.log").read_text().splitlines()
                print("meta log (last lines):", *log[-15:], sep="\n  ", file=sys.stderr)
        finally:
            dep.stop()
    c = st.counters
    return {
        "blocks": args.blocks,
        "objects": total,
        "servers": args.servers,
        "order": args.order,
        "format": args.format,
        "namespace": "last" if args.namespace_last else "first",
        "nvme_fraction": args.nvme_fraction,
        "rebuild_s": round(dt, 3),
        "us_per_object": round(dt / total * 1e6, 2),
        "meta_cpu_s": round(cpu, 3),
        "load_avg_1m": os.getloadavg()[0],
        "first_stats_after_s": round(settle, 3),
        "adopted": int(c.get("objects", 0)),
        "dropped": sum(d for _, d in res),
        "parked_left": int(c.get("parked_objects", 0)),
        "parked_total": int(c.get("objects_parked", 0)),
        "index_entries": int(c.get("index_entries", 0)),
        "reports_completed": int(c.get("reports_completed", 0)),
        "report_holds": int(c.get("report_holds", 0)),  # streams held (meta/pacing.py)
        "report_held_s": round(c.get("report_held_ms", 0) / 1000, 2),
        "rss_before_mib": round(before["VmRSS"] / 1024, 1),
        "rss_after_mib": round(after["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(after["VmHWM"] / 1024, 1),
        "bytes_per_object": round((after["VmRSS"] - before["VmRSS"]) * 1024 / total, 1),
        "build_manifests_s": round(build_s, 2),
        "python": sys.version.split()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--nvme-fraction", type=float, default=0.5)
    ap.add_argument("--order", choices=("random", "block"), default="block")
    ap.add_argument("--namespace", choices=("first", "last"), default="first")
    ap.add_argument(
        "--format",
        choices=("columns", "objects"),
        default="columns",
        help="ReportObjects chunks in columns (StoredColumns) or as StoredObject messages",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    args.namespace_last = args.namespace == "last"
    r = run(args)
    rows = [
        ("blocks / objects", f"{r['blocks']} / {r['objects']}"),
        ("servers, manifest order, namespace", f"{r['servers']}, {r['order']}, {r['namespace']}"),
        ("rebuild (first RegisterServer -> all adopted)", f"{r['rebuild_s']:.2f} s"),
        ("per object", f"{r['us_per_object']:.1f} us"),
        ("meta CPU during it", f"{r['meta_cpu_s']:.2f} s (load average {r['load_avg_1m']:.1f})"),
        ("then GetStats answered after", f"{r['first_stats_after_s']:.2f} s"),
        (
            "in the index / parked left / dropped",
            f"{r['adopted']} / {r['parked_left']} / {r['dropped']}",
        ),
        ("parked on the way", str(r["parked_total"])),
        ("streams held (pacing), total", f"{r['report_holds']}, {r['report_held_s']} s"),
        (
            "meta RSS before -> after (peak)",
            f"{r['rss_before_mib']} -> {r['rss_after_mib']} MiB ({r['rss_peak_mib']})",
        ),
        ("RSS per object", f"{r['bytes_per_object']:.0f} B"),
    ]
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{w}}  {b}")
    print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
