"""bench/meta_scale.py end to end at a small size (a real gcache-meta, a real server,
a real client): it runs, and its JSON has every field the docs' table is made of,
so the benchmark cannot rot between the runs at fleet scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.meta_scale import parse_count, plan, top_functions

ROOT = Path(__file__).resolve().parents[2]


def test_counts_and_plan() -> None:
    assert [parse_count(x) for x in ("20k", "1M", "1.5M", "10M", "123")] == [
        20_000, 1_000_000, 1_500_000, 10_000_000, 123,
    ]  # fmt: skip
    # each prompt length (64, 512, 2048 blocks) an equal share of the blocks
    assert plan(60_000) == {64: 312, 512: 39, 2048: 9}


def test_top_functions_of_collapsed_stacks() -> None:
    raw = (
        "main (gcache/meta/daemon.py:239);dispatch (gcache/meta/hotpath.py:136);"
        "Puts.commit (gcache/meta/puts.py:246) 3\n"
        "main (gcache/meta/daemon.py:239);dispatch (gcache/meta/hotpath.py:136) 1\n"
    )
    top = top_functions(raw)
    assert top["samples"] == 4
    assert top["own"][0] == ["Puts.commit (gcache/meta/puts.py)", 75.0]
    assert top["total"][0] == ["dispatch (gcache/meta/hotpath.py)", 100.0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("server", ["real", "played"])
def test_meta_scale_20k_end_to_end(tmp_path: Path, server: str) -> None:
    out = tmp_path / "scale.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'client'}")
    cmd = [sys.executable, "-m", "bench.meta_scale", "--blocks", "20k", "--lookups", "50",
           "--breakdown-blocks", "5k", "--put-server", server, "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RSS/block" in r.stdout and "where a block's bytes go" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["blocks"] >= 18_000
    rep, puts = row["report"], row["puts"]
    for key in ("rebuild_s", "meta_cpu_s", "rss_bytes_per_block", "objects"):
        assert rep[key] > 0, key
    assert rep["index_entries"] == row["blocks"] and rep["dropped"] == 0
    assert puts["server"] == server
    for key in ("puts_per_s", "blocks_per_s", "rss_bytes_per_block", "meta_cpu_us_per_block"):
        assert puts[key] > 0, key
    assert set(puts["lookup"]) == {"4096", "32768", "131072"}
    for lk in puts["lookup"].values():
        assert 0 < lk["p50_us"] <= lk["p99_us"] and lk["per_s"] > 0
    ev = puts["eviction"]
    assert ev["blocks_evicted"] > 0 and ev["objects_evicted"] >= ev["blocks_evicted"]
    for key in ("us_per_block_burst", "us_per_block_latency", "us_per_block_cpu"):
        assert ev[key] is not None, key
    bd = res["breakdown"]
    assert bd["bytes_per_block"] > 0 and bd["rows"] and bd["blocks"] > 4_000
    rp = bd["report_path"]
    assert rp["bytes_per_block"] > 0 and rp["heap_peak_bytes_per_block"] > 0
