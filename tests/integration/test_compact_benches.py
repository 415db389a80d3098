"""bench/compact_index.py at a small size: it runs, and its JSON has every field
the docs' tables are made of, so it does not rot between the runs at fleet scale."""

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
