"""An unpaced write burst into a server with an NVMe tier keeps what is worth keeping
a real meta and server, puts of 3x the DRAM segment back to
back with no pause. Continuous demotion keeps the server's disk busy, the server
reports each finished batch at once, and a put that finds DRAM full while
demotions are in flight waits for them in the meta instead of dropping cached
objects. Every prompt then hits in full and reads back byte-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

NTOK = 4 * 64  # 64 blocks: 66 objects of 4 KiB a prompt (about 264 KiB)
MIB = 1 << 20


def test_unpaced_burst_of_3x_dram_demotes_instead_of_dropping(tmp_path: Path) -> None:
    with LocalDeployment(
        tmp_path,
        servers=1,
        capacity="8MiB",
        nvme_size="64MiB",
        # A put may wait up to 20 s for room (the client's timeout is above it): a
        # loaded CI machine delays demotions, it must not turn them into drops.
        meta_args=["--put-wait-s", "20"],
    ) as d:
        d.start()
        client = GCacheClient(d.client_config(timeout_s=30.0))
        ns = client.register_namespace("demotion-burst", tiny_hybrid())
        n = 90  # ~3x the DRAM segment
        kvs = [make_kv(ns.layout, NTOK, seed=s) for s in range(n)]
        for s in range(n):  # no pause between puts
            res = client.put(ns, tokens(NTOK, seed=s), kvs[s])
            assert res.ok and res.no_space == 0, (s, res)
        stats = d.stats().counters
        # Nothing worth keeping was dropped to make room.
        assert stats["evictions"] == 0, dict(stats)
        assert stats["dropped_not_demoted"] == 0, dict(stats)
        nvme_prompts = 0
        for s in range(n):
            m = client.match(ns, tokens(NTOK, seed=s))
            assert m.tokens == NTOK, f"prompt {s}: {m.tokens} of {NTOK} tokens cached"
            nvme_prompts += any(loc.grant.tier == 1 for loc in m.objects.values())
            with client.get_layers(m) as stream:
                layers = list(stream)
            assert stream.ok, f"prompt {s}: a read failed"
            assert_layers_match(layers, kvs[s])
            port = m.servers[0].port
            client.release(m)
        assert nvme_prompts > n // 2, nvme_prompts  # most of it went to the disk
        # The server reported finished batches at once (an early heartbeat each),
        # not only at its 1 s tick.
        _, body, _ = rawwire.call(port, wire.ServerStats())
        assert isinstance(body, wire.ServerStatsReply), body
        assert body.values["early_reports"] > 0, body.values
        after = d.stats().counters
        assert after["evictions"] == 0, dict(after)
        print(
            f"{n} prompts (3x DRAM) put unpaced, all read back byte-exact, "
            f"{nvme_prompts} partly from NVMe; demotions {after['demotions_done']:.0f} "
            f"done, puts that waited for them {after['puts_waited']:.0f}, "
            f"evictions {after['evictions']:.0f}"
        )
        client.close()


def test_bench_nvme_write_row_is_unpaced_and_drops_nothing(tmp_path: Path) -> None:
    """``gcache-bench write --tier nvme`` puts back to back (4 in flight, no pacing):
    4x its DRAM segment goes to NVMe, every put stored, nothing evicted."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "gcache.benchtool.main", "write", "-s", "1MiB", "--tier",
           "nvme", "-n", "64", "--qd", "4", "--capacity", "16MiB", "--nvme-dir",
           str(tmp_path), "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["op"] == "write" and row["tier"] == "nvme"
    assert row["evictions"] == 0, row
    # Everything above the demote watermark (0.1 of DRAM) went to the disk.
    assert row["demoted_bytes"] >= 64 * MIB - 2 * MIB, row
    assert row["bw_avg_gbps"] > 0
