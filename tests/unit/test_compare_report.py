"""bench.compare: sizes parsing and the ratio table (pure functions, no peers run)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.compare.__main__ import _sizes, parse_args
from bench.compare.report import MEMCPY_TARGET, chart, human, ratios


def row(system: str, op: str, nbytes: int, gbps: float, conc: int = 4) -> dict[str, Any]:
    return {
        "system": system,
        "op": op,
        "bytes": nbytes,
        "iterations": 10,
        "concurrency": conc,
        "bw_avg_gbps": gbps,
        "lat_p50_us": 1.0,
        "lat_p99_us": 2.0,
    }


MIB = 1 << 20


def test_sizes_and_defaults() -> None:
    assert _sizes("64KiB,1MiB,4MiB") == [64 << 10, MIB, 4 * MIB]
    a = parse_args([])
    assert (a.iters, a.concurrency) == (1000, 4) and a.json.endswith(".json")
    with pytest.raises(SystemExit, match="bad --sizes"):
        _sizes("lots")
    with pytest.raises(SystemExit, match="at least one positive size"):
        _sizes(",")


def test_ratios_use_like_for_like_shapes_and_best_anchor() -> None:
    rows = [
        row("gcache (TCP)", "read", MIB, 1.0),
        row("gcache (TCP, batched)", "read", MIB, 1.5),
        row("iperf3 loopback TCP", "bw", 0, 2.0),  # plain run
        row("iperf3 loopback TCP", "bw", MIB, 2.5),  # per-size run: the better anchor
        row("mooncake (TCP)", "read", MIB, 1.2),
        row("redis (redis-py)", "read", MIB, 0.4),
        row("gcache (TCP)", "read", 4 * MIB, 1.6),
    ]
    got = {(r["peer"], r["bytes"]): r for r in ratios(rows, [MIB, 4 * MIB])}
    iperf = got[("iperf3 loopback TCP", MIB)]
    assert iperf["peer_gbps"] == 2.5 and iperf["ratio"] == 0.4 and iperf["met"] is False
    # iperf3 caps -l at 1 MiB: larger sizes compare against its best run of any block
    # size (plain or per-size), untargeted at 4 MiB.
    big = got[("iperf3 loopback TCP", 4 * MIB)]
    assert big["peer_gbps"] == 2.5 and big["target"] is None
    moon = got[("mooncake (TCP)", MIB)]
    assert moon["gcache"] == "gcache (TCP, batched)" and moon["ratio"] == 1.25 and moon["met"]
    assert got[("redis (redis-py)", MIB)]["met"] is True  # 1.0 / 0.4 = 2.5 >= 2.0
    assert got[("redis (redis-py)", MIB)]["ratio"] == 2.5


def test_tcp_16mib_targets_09x_iperf3_and_runs_only_in_flight() -> None:
    """TCP targets: 1 MiB >= 0.8x and 16 MiB >= 0.9x iperf3, read and write; the 16 MiB
    anchor is iperf3's best block size (it refuses -l 16 MiB); 16 MiB GCache runs only
    over TCP with operations in flight, at most TCP_EXTRA_BYTES per op."""
    from bench.compare.__main__ import TCP_EXTRA_BYTES, _runs

    rows = [
        row("iperf3 loopback TCP", "bw", 0, 2.0),
        row("iperf3 loopback TCP", "bw", MIB, 3.0),
        row("gcache (TCP)", "read", MIB, 2.5),
        row("gcache (TCP)", "write", MIB, 2.0),
        row("gcache (TCP)", "read", 16 * MIB, 2.8),
        row("gcache (TCP)", "write", 16 * MIB, 2.6),
        row("redis (redis-py)", "read", MIB, 1.0),
    ]
    got = {(r["peer"], r["op"], r["bytes"]): r for r in ratios(rows, [MIB, 16 * MIB])}
    ip = "iperf3 loopback TCP"
    assert got[(ip, "read", MIB)]["target"] == 0.8 and got[(ip, "read", MIB)]["met"] is True
    assert got[(ip, "write", MIB)]["met"] is False  # 2.0 / 3.0
    r16, w16 = got[(ip, "read", 16 * MIB)], got[(ip, "write", 16 * MIB)]
    assert r16["peer_gbps"] == 3.0 and r16["target"] == 0.9 and r16["met"] is True
    assert w16["target"] == 0.9 and w16["met"] is False  # 2.6 / 3.0 = 0.87
    assert ("redis (redis-py)", "read", 16 * MIB) not in got  # no redis row at 16 MiB
    runs = _runs([MIB], [16 * MIB], 1000, 4)
    big = [r for r in runs if r[2] == 16 * MIB]
    assert {(t, op) for t, op, *_ in big} == {("tcp", "write"), ("tcp", "read")}
    assert all(q == 4 and batch == 1 and n * 16 * MIB <= TCP_EXTRA_BYTES for *_, q, batch, n in big)
    assert len(runs) == 2 * 2 * 2 + 2  # 1 MiB: 2 transports x 2 ops x 2 shapes
    assert parse_args([]).tcp_sizes == "16MiB"


def test_memcpy_target_applies_only_without_mooncake() -> None:
    rows = [row("gcache (SHM)", "read", MIB, 3.0), row("memcpy (numpy)", "bw", MIB, 4.0)]
    (r,) = ratios(rows, [MIB])
    assert r["target"] == MEMCPY_TARGET and r["met"] is True
    rows.append(row("mooncake (local memcpy)", "read", MIB, 8.0))
    with_mc = {r["peer"]: r for r in ratios(rows, [MIB])}
    assert with_mc["memcpy (numpy)"]["target"] is None


def test_chart_and_human(tmp_path: Any) -> None:
    assert human(MIB) == "1MiB" and human(64 << 10) == "64KiB" and human(1000) == "1000"
    out = tmp_path / "c.png"
    assert chart([row("gcache (TCP)", "read", MIB, 1.0), row("x", "bw", 0, 1.0)], str(out)) == ""
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_nvme_rows_ratio_against_raw_dd_at_every_size() -> None:
    """NVMe targets: GCache's NVMe write/read against dd direct on the same directory,
    target 0.7x at 1 MiB and 16 MiB alike; dd's summary line is parsed."""
    from bench.compare.nvme import GCACHE, RAW, parse_dd

    assert parse_dd(
        "512+0 records in\n512+0 records out\n"
        "536870912 bytes (537 MB, 512 MiB) copied, 0.402 s, 1.3 GB/s\n"
    ) == (536870912, 0.402)
    with pytest.raises(RuntimeError, match="no summary"):
        parse_dd("dd: failed to open")
    rows = [
        row(RAW, "write", MIB, 1.0, 1),
        row(RAW, "read", MIB, 2.0, 1),
        row(GCACHE, "write", MIB, 0.8, 1),
        row(GCACHE, "read", MIB, 0.4, 1),
        row(RAW, "read", 16 * MIB, 2.0, 1),
        row(GCACHE, "read", 16 * MIB, 1.5, 1),
    ]
    got = {(r["op"], r["bytes"]): r for r in ratios(rows, [MIB, 16 * MIB])}
    assert got[("write", MIB)]["met"] is True and got[("write", MIB)]["ratio"] == 0.8
    assert got[("read", MIB)]["met"] is False and got[("read", MIB)]["target"] == 0.7
    assert got[("read", 16 * MIB)]["target"] == 0.7 and got[("read", 16 * MIB)]["met"] is True
    assert parse_args(["--skip", "nvme"]).nvme_sizes == "1MiB,16MiB"


def test_shm_batched_read_target_is_one_times_mooncake_memcpy() -> None:
    """Shared-memory target: read 1 MiB, 4 in flight (the batched shape) >= 1.0x Mooncake's
    same-host memcpy path."""
    rows = [
        row("gcache (SHM, batched)", "read", MIB, 6.0),
        row("mooncake (local memcpy)", "read", MIB, 7.0),
    ]
    got = {r["peer"]: r for r in ratios(rows, [MIB])}["mooncake (local memcpy)"]
    assert got["target"] == 1.0 and got["met"] is False  # 0.86x was "met" at 0.8
