"""The router simulator (gcache.replay.router_sim) and ``gcache replay --router``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gcache.errors import ConfigError
from gcache.layout import Layout, preset
from gcache.meta.eviction import compute_for_layout
from gcache.replay.router_sim import BlockCache, RouterSim, SimConfig, percentile, simulate
from gcache.replay.trace import load
from gcache.router.baselines import POLICY_NAMES, make_policy
from gcache.router.policy import RouteRequest

LAYOUT = Layout(preset("mimo-v2-flash", 64))
COMPUTE = compute_for_layout(LAYOUT)
TRACES = Path("/work/shared/data/traces")


def write_trace(path: Path, records: Sequence[tuple[float, int, int, Sequence[int]]]) -> str:
    with open(path, "w") as fh:
        for ts, n_in, n_out, ids in records:
            fh.write(
                json.dumps(
                    {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
                )
                + "\n"
            )
    return str(path)


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [((tag << 32) | i).to_bytes(16, "little") for i in range(n)]


def test_block_cache_window_safe_match_is_not_the_leading_blocks() -> None:
    cache = BlockCache(1 << 40, LAYOUT.group_object_bytes)
    ks = keys(40)
    cache.add(ks, LAYOUT.groups_to_store(40))
    assert cache.prefix(ks) == 40 and cache.valid(LAYOUT, ks, 40) == 40
    # a prompt sharing 30 blocks: all 30 full objects are there, the window is not
    other = ks[:30] + keys(10, tag=1)
    assert cache.prefix(other) == 30
    assert cache.valid(LAYOUT, other, 40) == 0
    # the engine must compute a token: a limit below the end finds no window either
    assert cache.valid(LAYOUT, ks, 39) == 0


def test_block_cache_lru_evicts_leaves_first() -> None:
    full = LAYOUT.group_object_bytes[0]
    cache = BlockCache(10 * full, [full, 0])
    a, b = keys(8, tag=1), keys(4, tag=2)
    cache.add(a, [1] * 8)
    cache.add(b, [1] * 4)  # 12 objects, room for 10: a's two last blocks go
    assert cache.prefix(a) == 6 and cache.prefix(b) == 4 and cache.evicted == 2
    cache.touch(a[:6])
    cache.add(keys(3, tag=3), [1] * 3)  # b is now the oldest: its leaves go first
    assert cache.prefix(a) == 6 and cache.prefix(b) == 1


def test_one_request_ttft_is_its_prefill_time(tmp_path: Path) -> None:
    tr = load(write_trace(tmp_path / "t.jsonl", [(0, 5000, 10, list(range(10)))]), 64)
    cfg = SimConfig(instances=2, flops=1e14)
    row = RouterSim(tr, "gcache", cfg).run()
    assert row["ttft_mean_s"] == pytest.approx(COMPUTE.prefix(5000) / 1e14)
    assert row["hit_rate"] == 0.0 and row["requests"] == 1
    # decode: the request ends output x decode_s after its first token
    assert row["throughput_rps"] == pytest.approx(1 / (row["ttft_mean_s"] + 10 * 0.02))


def test_queueing_and_pool_fetch(tmp_path: Path) -> None:
    # the same 4096-token prompt three times at t=0 on one instance, no pool: FIFO
    rec = [(0, 4096, 0, list(range(8)))] * 3
    tr = load(write_trace(tmp_path / "q.jsonl", rec), 64)
    one = SimConfig(instances=1, pool_capacity=0, flops=1e14)
    row = RouterSim(tr, "round-robin", one).run()
    first = COMPUTE.prefix(4096) / 1e14
    rest = COMPUTE.span(4095 // 64 * 64, 4096) / 1e14  # all but the last block is local
    assert row["ttft_p50_s"] == pytest.approx(first + rest)
    assert row["ttft_mean_s"] == pytest.approx((3 * first + 3 * rest) / 3)
    # two instances, round-robin, a pool: the follow-up (100 more tokens) on the other
    # instance fetches the first prompt's 64 blocks and their last window from the pool
    two = SimConfig(instances=2, flops=1e14, fetch_bandwidth=1e10, fetch_latency_s=0.001)
    rec2 = [(0, 4096, 0, list(range(8))), (10_000, 4196, 0, [*range(8), 99])]
    tr2 = load(write_trace(tmp_path / "p.jsonl", rec2), 64)
    row = RouterSim(tr2, "round-robin", two).run()
    nbytes = 64 * LAYOUT.group_object_bytes[0] + sum(
        t * LAYOUT.group_object_bytes[g]
        for g, t in enumerate(LAYOUT.group_tail_blocks)
        if t is not None
    )
    fetch = 0.001 + nbytes / 1e10
    second = fetch + COMPUTE.span(4096, 4196) / 1e14
    assert row["pool_hit_rate"] == pytest.approx(4096 / (4096 + 4196))
    assert row["local_hit_rate"] == 0.0
    assert row["ttft_mean_s"] == pytest.approx((first + second) / 2)
    # the same prompt again exactly: the engine computes its last block, whose window
    # the pool lacks (strict O(W) keeps the window at the end): no pool hit
    rec3 = [(0, 4096, 0, list(range(8))), (10_000, 4096, 0, list(range(8)))]
    tr3 = load(write_trace(tmp_path / "p3.jsonl", rec3), 64)
    assert RouterSim(tr3, "round-robin", two).run()["pool_hit_rate"] == 0.0


def test_gcache_follows_the_window_not_the_leading_blocks(tmp_path: Path) -> None:
    """An instance served a 24-trace-block prompt and, short of memory, dropped the
    spare windows behind its last one. A request sharing the first 20 trace blocks
    (160 index blocks) finds all their full-attention blocks there but no window:
    Dynamo, blind to windows, still sends it there although that instance is busy;
    gcache knows it can resume nothing there and takes the idle one."""
    long = list(range(24))
    tr = load(write_trace(tmp_path / "w.jsonl", [(0, 24 * 512, 1, long)]), 64)
    full = LAYOUT.group_object_bytes[0]
    tails = sum(
        t * LAYOUT.group_object_bytes[g]
        for g, t in enumerate(LAYOUT.group_tail_blocks)
        if t is not None
    )
    cfg = SimConfig(instances=2, pool_capacity=0, local_capacity=192 * full + tails)
    sim = RouterSim(tr, "gcache", cfg)
    sim.run()
    held = [i for i in sim.instances if i.cache.objects]
    assert len(held) == 1 and not held[0].cache.spare
    x, y = held[0].name, next(i.name for i in sim.instances if i.name != held[0].name)
    follow = RouteRequest(tr.keys[0][:160] + keys(32, tag=7), 24 * 512)
    view = sim.view
    assert view.prefix_match(x, follow.keys) == 160 and view.local_match(x, follow.keys) == 0
    held[0].queued_compute = 5000  # x is busy
    assert make_policy("dynamo", block_size=64).choose(follow, view, 0.0).instance == x
    d = make_policy("gcache").choose(follow, view, 0.0)
    assert (d.instance, d.local_blocks) == (y, 0)


def test_spare_windows_serve_a_repeat_until_evicted(tmp_path: Path) -> None:
    long = list(range(24))
    rec = [(0, 24 * 512, 1, long), (9000, 24 * 512 + 100, 1, [*long, 50])]
    tr = load(write_trace(tmp_path / "w2.jsonl", rec), 64)
    sim = RouterSim(tr, "gcache", SimConfig(instances=2, pool_capacity=0))
    row = sim.run()
    # the follow-up extends the prompt: all 192 blocks are local, windows included
    assert sim.local_tokens == 192 * 64
    assert row["local_hit_rate"] == pytest.approx(192 * 64 / (24 * 512 * 2 + 100))


def test_gcache_spreads_when_affinity_would_queue(tmp_path: Path) -> None:
    # 16 copies of one prompt at once on 4 instances: affinity alone would queue
    # them all on one instance; the load term spreads them
    rec = [(0, 16 * 512, 1, list(range(16)))] + [(1, 16 * 512, 1, list(range(16)))] * 15
    tr = load(write_trace(tmp_path / "s.jsonl", rec), 64)
    row = RouterSim(tr, "gcache", SimConfig(instances=4, pool_capacity=0)).run()
    assert row["imbalance"] < 1.6


def test_config_and_policy_errors(tmp_path: Path) -> None:
    tr = load(write_trace(tmp_path / "e.jsonl", [(0, 600, 1, [0, 1])]), 64)
    with pytest.raises(ConfigError, match="instances"):
        simulate(tr, ["gcache"], SimConfig(instances=0))
    with pytest.raises(ConfigError, match="speedup"):
        simulate(tr, ["gcache"], SimConfig(speedup=0))
    with pytest.raises(ConfigError, match="unknown routing policy 'random'"):
        simulate(tr, ["random"], SimConfig())


def test_percentile() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0 and percentile([], 0.5) == 0.0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gcache.cli.main", "replay", "--router", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(not (TRACES / "synthetic_trace.jsonl").exists(), reason="no shipped traces")
def test_cli_table_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = run_cli(
        "--trace",
        str(TRACES / "synthetic_trace.jsonl"),
        "--limit",
        "300",
        "--speedup",
        "2",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert p.returncode == 0, p.stderr
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == list(POLICY_NAMES)
    want = {"policy", "hit_rate", "imbalance", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s"}
    assert all(want | {"throughput_rps"} <= set(r) for r in rows)
    assert "| gcache" in p.stdout and png.stat().st_size > 1000
    assert all(r["requests"] == 300 for r in rows)


def test_cli_refusals_are_one_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "c.jsonl", [(0, 600, 1, [0, 1])])
    p = run_cli("--trace", trace, "--policy", "gcache,random")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "'random'" in p.stderr
    p = run_cli("--trace", trace, "--instances", "0")
    assert p.returncode == 2 and "--instances" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("--trace", trace, "--local-capacity", "lots")
    assert p.returncode == 2 and "not a size" in p.stderr and "Traceback" not in p.stderr
