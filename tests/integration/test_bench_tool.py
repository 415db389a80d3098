"""gcache-bench end to end: each mode against a deployment it starts (--local),
rows with the documented keys, and a clean exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = {"op", "transport", "bytes", "iterations", "bw_peak_gbps", "bw_avg_gbps", "mops"}
LAT = {"lat_p50_us", "lat_p99_us"}


def bench(tmp_path: Path, *argv: str) -> list[dict[str, object]]:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "gcache.benchtool.main", *argv, "--local", "--json", str(out)]
    if argv[0] != "lookup":
        cmd += ["--capacity", "256MiB"]  # the default (4 GiB, pre-faulted) is for real runs
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows: list[dict[str, object]] = json.loads(out.read_text())
    assert rows and all(row.keys() >= COMMON for row in rows)
    return rows


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_write_and_read_rows(tmp_path: Path, transport: str) -> None:
    for op in ("write", "read"):
        (row,) = bench(tmp_path, op, "-s", "64KiB", "-n", "40", "--qd", "2", "--batch", "2",
                       "--transport", transport)  # fmt: skip
        assert row["op"] == op and row["transport"] == transport
        assert row["bytes"] == 65536 and row["iterations"] == 40
        assert row.keys() >= LAT and float(row["bw_avg_gbps"]) > 0  # type: ignore[arg-type]


def test_get_layers_row(tmp_path: Path) -> None:
    (row,) = bench(tmp_path, "get_layers", "--prompt", "1024", "-n", "2", "--transport", "shm")
    assert {"ttfl_us", "total_us", "overlap", "prompt_tokens"} <= row.keys()
    assert row["prompt_tokens"] == 1024 and 0 < float(row["overlap"]) <= 1.5  # type: ignore[arg-type]


def test_lookup_rows_hot_path_and_in_process(tmp_path: Path) -> None:
    rows = bench(tmp_path, "lookup", "--prompt", "1024,4096", "--index-blocks", "3000", "-n", "50")
    assert [(r["transport"], r["prompt_tokens"]) for r in rows] == [
        ("meta hot path", 1024),
        ("meta hot path", 4096),
        ("in-process index", 1024),
        ("in-process index", 4096),
    ]
    assert all(float(r["lookups_per_s"]) > 0 and r["indexed_blocks"] >= 3000 for r in rows)  # type: ignore[arg-type, operator]
