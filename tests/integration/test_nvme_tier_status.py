"""The NVMe tier as an operator sees it: ``gcache up`` says each server's tier (size,
where) and shows the tier table in its banner; after puts of about 3x DRAM,
``gcache status`` shows per server and in total what the tier holds, the
demotions and the drops, the same numbers as ``gcache status --json``, and
nothing was dropped while the tiers had room."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from gcache.cli.deploy import fetch_stats
from gcache.config import ClientConfig
from gcache_client import GCacheClient
from tests.integration.test_up_supervisor import SMALL, Up
from tests.kvdata import make_kv, tiny_hybrid, tokens

NTOK = 4 * 64  # 66 objects of 4 KiB a prompt (about 264 KiB)
MiB = 1 << 20


def status(grpc_addr: str, *extra: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gcache.cli.main", "status", "--meta-grpc", grpc_addr, *extra],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_up_banner_and_status_show_the_nvme_tier(tmp_path: Path) -> None:
    up = Up(tmp_path, "--servers", "1", "--capacity", "8MiB", "--nvme-size", "64MiB", env=SMALL)
    try:
        addr = up.wait_for(r"clients: GCacheClient\(meta='(\S+)', meta_grpc='(\S+)'\)")
        meta, grpc_addr = addr.group(1), addr.group(2)
        up.wait_for("serving; Ctrl-C to stop")
        banner = up.text
        nvme_dir = (tmp_path / "server0-nvme").resolve()
        assert f"(8MiB DRAM segment, 64MiB NVMe tier in {nvme_dir})" in banner, banner
        assert re.search(r"^  NVMe tier +size +used +used% +objects +demotions", banner, re.M)
        assert re.search(r"^  server0 +64\.0 MiB +0 B +0\.0% +0 +0 +0 +0$", banner, re.M), banner
        assert re.search(r"^  total +64\.0 MiB +0 B +0\.0% +0 +0 +0 +0$", banner, re.M), banner

        client = GCacheClient(ClientConfig(meta=meta, meta_grpc=grpc_addr, timeout_s=30.0))
        ns = client.register_namespace("tier-status", tiny_hybrid())
        n = 90  # about 3x the DRAM segment, a quarter of the tier's low watermark
        for s in range(n):
            assert client.put(ns, tokens(NTOK, seed=s), make_kv(ns.layout, NTOK, seed=s)).ok
        deadline = time.monotonic() + 30
        while fetch_stats(grpc_addr).counters["demotions_in_flight"]:
            assert time.monotonic() < deadline, "demotions never finished"
            time.sleep(0.1)
        missed = [s for s in range(n) if client.lookup(ns, tokens(NTOK, seed=s)) != NTOK]
        if missed:  # say why: which drop counters moved
            c = fetch_stats(grpc_addr).counters
            moved = {k: v for k, v in c.items() if k.startswith(("dropped", "demotion")) and v}
            raise AssertionError(f"prompts {missed} missed after the puts; counters {moved}")
        client.close()
        # The meta asked the server for heartbeats at the pressure interval while
        # the puts pressed on DRAM (demotions queued by a waiting put start at once).
        assert fetch_stats(grpc_addr).counters["pressure_beats"] > 0

        raw = json.loads(status(grpc_addr, "--json"))
        (srv,) = raw["servers"]
        c = raw["counters"]
        assert int(srv["nvmeCapacity"]) == 64 * MiB
        used, objects, done = int(srv["nvmeUsed"]), int(srv["nvmeObjects"]), int(srv["demotions"])
        # (the meta counts an object's bytes, not the 4 KiB pages its record takes)
        assert used > MiB and objects > 0 and done == c["demotions_done"] > 0
        # Nothing was dropped: the tier had room all along.
        assert "droppedNotDemoted" not in srv and c["dropped_not_demoted"] == 0
        text = status(grpc_addr)
        row = re.search(r"^server0 +64\.0 MiB +([\d.]+) MiB +([\d.]+)% +(\d+) +(\d+) +0 +0$",
                        text, re.M)  # fmt: skip
        assert row is not None, text
        assert float(row.group(1)) == round(used / MiB, 1)
        assert float(row.group(2)) == round(100 * used / (64 * MiB), 1)
        assert (int(row.group(3)), int(row.group(4))) == (objects, done)
        total = re.search(
            r"^total +64\.0 MiB +[\d.]+ MiB +[\d.]+% +(\d+) +(\d+) +0 +0$", text, re.M
        )
        assert total is not None and (int(total.group(1)), int(total.group(2))) == (objects, done)
        assert "dropped: 0 left DRAM with no NVMe copy" in text, text
    finally:
        up.close()
