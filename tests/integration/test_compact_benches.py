"""bench/compact_index.py and bench/meta_requests.py at a small size: they run,
and their JSON has every field the docs' tables are made of, so they do not rot
between the runs that fill those tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'client'}")


def run(tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", *args, "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "|---" in r.stdout, r.stdout
    res: dict[str, object] = json.loads(out.read_text())
    return res


@pytest.mark.timeout(180)
def test_compact_index_bench_small(tmp_path: Path) -> None:
    res = run(tmp_path, "bench.compact_index", "--blocks", "10k", "--anchor-blocks", "10k",
              "--python-blocks", "10k", "--lookups", "20")  # fmt: skip
    rows = res["rows"]
    assert isinstance(rows, list)
    assert [r["side"] for r in rows] == ["anchor (MetaCore index)", "compact", "compact (Python)"]
    for r in rows:
        assert r["blocks"] >= 6_000 and r["rss_per_block"] is not None
        for key in ("lookup_32k_p99_us", "leased_128k_p99_us", "evict_us_per_object"):
            assert r[key] > 0, (r["side"], key)
    assert rows[1]["rebuild_s"] >= 0 and rows[1]["array_bytes_per_block"] > 0


@pytest.mark.timeout(180)
def test_meta_requests_bench_small(tmp_path: Path) -> None:
    res = run(tmp_path, "bench.meta_requests", "--rounds", "1", "--n", "200")
    assert set(res) == {"lookup_release_1_us", "lookup_release_4_us", "put_1_us"}
    assert all(isinstance(v, float) and v > 0 for v in res.values()), res
