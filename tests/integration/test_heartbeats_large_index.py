"""Dropping a server must cost the meta time in proportion to that server's
objects, not to the whole index. The old ``drop_server`` walked every entry of every
namespace on the event loop (0.74 s at 500k blocks, seconds at 10M): while it ran no
heartbeat was answered, long enough at a large index to drop healthy servers too.

A real meta, server A with a large sparse segment and an index of :data:`BLOCKS`
blocks on it (the ``gcache-bench lookup`` populate path: PutBegin, SEAL for the
receipts, PutCommit; no bytes move), server B with a few real objects; both beat
every :data:`BEAT_S`. B is killed with SIGKILL; until well after the meta dropped it,
the meta must answer at once, list A as alive with a heartbeat never older than
:data:`LATE_S`, count exactly one drop, and A's data must still hit. With the old
walk this index stalled the meta ~1.1 s (A's heartbeat 1.17 s old).

The heartbeat timeout is :data:`TIMEOUT_S`, not shorter: building the index makes the
meta pause too (its cyclic garbage collector's full collections walk the whole index;
on two busy cores such a pause reached 1.5 s and dropped A at a 0.6 s timeout)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import numpy as np

from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import sync_channel
from gcache.benchtool import ops
from gcache.benchtool.stats import Progress
from gcache.cli.deploy import LocalDeployment
from gcache.errors import GCacheError
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import AsyncGCacheClient, GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tokens

TIMEOUT_S = 2.0  # meta heartbeat_timeout_s
BEAT_S = 0.1  # both servers' heartbeat_interval_s
LATE_S = 0.5  # the oldest A's heartbeat (and the slowest GetStats) may get
BLOCKS = 300_000  # indexed on A: the old walk took ~1.1 s (on 2 busy cores)
PROMPT_BLOCKS = 4096  # blocks per populate put (one SEAL of 4096 grants)
WATCH_S = 2.5  # how long the meta is watched after B is due to be dropped
# Tiny objects (16 tokens x 16 bytes) keep A's segment and manifest small while
# every index entry costs the meta what a real one does.
LAYOUT = LayoutSpec(
    block_size=16,
    dtype="uint8",
    layers=(LayerSpec("full", kv_heads=1, k_head_dim=8, v_head_dim=8),),
)
# The large index's model: one full-attention group and 31 sliding windows (of 2..32
# tokens: one or two tail blocks each, so a prompt stores ~1.01 objects per block).
# Each entry has 32 object slots, which the old walk visited one by one: BLOCKS
# entries cost it what millions of a two-group model's would, at the price of
# indexing BLOCKS.
BIG_LAYOUT = LayoutSpec(
    block_size=16,
    dtype="uint8",
    layers=(
        LayerSpec("full", kv_heads=1, k_head_dim=8, v_head_dim=8),
        *(LayerSpec("swa", kv_heads=1, k_head_dim=8, v_head_dim=8, window=w) for w in range(2, 65)),
    ),
)


async def _populate(d: LocalDeployment, prompts: int) -> None:
    async with AsyncGCacheClient(d.client_config(timeout_s=30.0)) as client:
        ns = await client.register_namespace("hb-large-index", BIG_LAYOUT)
        await ops.populate_index(client, ns, prompts, PROMPT_BLOCKS, Progress("index", prompts))


def _populated_prompt(p: int) -> np.ndarray:
    """The tokens of populated prompt ``p`` (:func:`ops.populate_index`'s)."""
    return np.arange(p * 10**7, p * 10**7 + PROMPT_BLOCKS * BIG_LAYOUT.block_size, dtype=np.int64)


def _server(stats: pb.GetStatsReply, server_id: str) -> pb.ServerStats | None:
    return next((s for s in stats.servers if s.server_id == server_id), None)


def test_dropping_a_small_server_keeps_heartbeats_of_a_large_one_flowing(
    tmp_path: Path,
) -> None:
    d = LocalDeployment(
        tmp_path,
        servers=1,
        capacity="64GiB",  # sparse: the populated objects are never written
        metrics_port=-1,
        meta_args=[
            "--heartbeat-timeout-s",
            str(TIMEOUT_S),
            "--checkpoint-interval",
            "0",
        ],
        server_args=["--no-populate", "--no-reserve", "--heartbeat-interval-s", str(BEAT_S)],
    )
    d.start()
    try:
        t0 = time.monotonic()
        prompts = -(-BLOCKS // PROMPT_BLOCKS)
        try:
            asyncio.run(_populate(d, prompts))
        except GCacheError as exc:
            raise AssertionError(f"indexing failed: {exc}; meta: {d.stats()}") from exc
        populate_s = time.monotonic() - t0

        client = GCacheClient(d.client_config(timeout_s=5.0))
        try:
            ns = client.register_namespace("hb-real-data", LAYOUT)
            on_a = tokens(16 * 8, seed=1)
            kv_a = make_kv(ns.layout, len(on_a), seed=1)
            assert client.put(ns, on_a, kv_a).ok  # only A is up: A holds it

            # Server B: small, ordinary, same fast heartbeats.
            d.capacity = "64MiB"
            d.server_args = ["--heartbeat-interval-s", str(BEAT_S)]
            d.start_server(1)
            d.wait_servers(2)
            # B has written nothing recently: new puts go there first.
            for s in range(4):
                toks = tokens(16 * 4, seed=100 + s)
                assert client.put(ns, toks, make_kv(ns.layout, len(toks), seed=s)).ok
            before = d.stats()
            b = _server(before, "server1")
            assert b is not None and b.alive and 0 < b.objects < 100, b
            a = _server(before, "server0")
            assert a is not None and a.objects >= BLOCKS, a
            assert before.counters["servers_dropped"] == 0
            entries = before.counters["index_entries"]

            d.kill_server(1, signal.SIGKILL)
            # Watch the meta over one persistent channel: each GetStats's latency is
            # how long the meta's event loop kept everyone (heartbeats too) waiting.
            worst_rpc = worst_age = 0.0
            dropped_seen = False
            with sync_channel(d.meta_grpc) as channel:
                stub = pb_grpc.ControlStub(channel)
                end = time.monotonic() + TIMEOUT_S + WATCH_S
                while time.monotonic() < end:
                    t = time.monotonic()
                    st = stub.GetStats(pb.GetStatsRequest(), timeout=30.0)
                    rpc = time.monotonic() - t
                    a = _server(st, "server0")
                    assert a is not None and a.alive, f"server A dropped: {st}"
                    worst_rpc = max(worst_rpc, rpc)
                    worst_age = max(worst_age, a.heartbeat_age_s)
                    dropped = st.counters["servers_dropped"]
                    assert dropped <= 1, f"more than B dropped: {st.counters}"
                    dropped_seen = dropped_seen or dropped == 1
                    time.sleep(0.05)
            assert dropped_seen, "B was never dropped"
            after = d.stats()
            assert after.counters["servers_dropped"] == 1
            gone = _server(after, "server1")
            assert gone is None or not gone.alive, gone
            detail = (
                f"{BLOCKS} blocks indexed in {populate_s:.1f} s; after the kill: A's "
                f"heartbeat at most {worst_age:.2f} s old, GetStats at most {worst_rpc:.2f} s"
            )
            print(detail)
            # A's heartbeats (every 0.1 s) kept being answered; the meta never stalled.
            assert worst_age < LATE_S, detail
            assert worst_rpc < LATE_S, detail
            # A's index and data are intact: B's few entries went, nothing else.
            assert entries - 100 < after.counters["index_entries"] <= entries
            m = client.match(ns, on_a)
            assert m.tokens == len(on_a)
            got = client.get(m)
            client.release(m)
            assert_layers_match(got, kv_a)
            big = client.register_namespace("hb-large-index", BIG_LAYOUT)
            for p in (0, prompts - 1):
                toks = _populated_prompt(p)
                assert client.lookup(big, toks) == len(toks)
        finally:
            client.close()
    finally:
        d.stop()
