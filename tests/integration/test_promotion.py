"""Promotion back to DRAM on repeated hits, end to end: a real
meta with ``--promotion hits:2`` and a real server with an NVMe tier. Objects
demoted to NVMe and read twice are copied back into DRAM by their server (at a
range the meta allocated), the index switches to the DRAM copy, the NVMe copy is
deleted, and reads are byte-exact from DRAM."""

from __future__ import annotations

import time
from pathlib import Path

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

NTOK = 4 * 64


def test_nvme_objects_hit_twice_are_promoted_to_dram_and_read_byte_exact(
    tmp_path: Path,
) -> None:
    with LocalDeployment(
        tmp_path,
        servers=1,
        capacity="8MiB",
        nvme_size="64MiB",
        # Continuous demotion off (at the high watermark): the NVMe bytes then go
        # down by the promoted copies, not swapped for other demoted objects.
        meta_args=["--promotion", "hits:2", "--demote-watermark", "0.9"],
    ) as d:
        d.start()
        client = GCacheClient(d.client_config(transport="tcp"))
        ns = client.register_namespace("promotion", tiny_hybrid())
        n = 60  # ~2x the DRAM segment: the older prompts demote to NVMe
        for s in range(n):
            assert client.put(ns, tokens(NTOK, seed=s), make_kv(ns.layout, NTOK, seed=s)).ok
            time.sleep(0.05)
        time.sleep(2.0)
        before = d.stats().counters
        assert before["demotions_done"] > 0, dict(before)
        assert before["promotions_issued"] == 0

        def tiers_of(s: int) -> list[int]:
            m = client.match(ns, tokens(NTOK, seed=s))
            out = [loc.grant.tier for loc in m.objects.values()]
            with client.get_layers(m) as stream:
                layers = list(stream)
            assert stream.ok, f"prompt {s}: a read failed"
            assert_layers_match(layers, make_kv(ns.layout, NTOK, seed=s))
            client.release(m)
            return out

        # The oldest prompt still cached with objects on NVMe: read it twice.
        target = next(s for s in range(n) if 1 in tiers_of(s))  # hit 1 (of some)
        first = tiers_of(target)  # hit 2 (every object of it): promotion
        on_nvme = first.count(1)
        assert on_nvme > 0
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            after = d.stats().counters
            if after["promotions_done"] >= on_nvme:
                break
            time.sleep(0.2)
        keys_ = ("promotions_issued", "promotions_no_room", "used", "capacity", "demotions_issued")
        assert after["promotions_issued"] >= on_nvme, str({k: after[k] for k in keys_})
        assert after["promotions_done"] >= on_nvme, dict(after)
        assert after["promotions_failed"] == 0
        # The same prompt now reads from DRAM, byte-exact (tiers_of checks the bytes).
        now = tiers_of(target)
        assert now.count(1) < on_nvme, (first, now)
        # The NVMe copies were deleted: the meta's NVMe bytes went down by them.
        assert after["nvme_used"] < before["nvme_used"]
        print(
            f"prompt {target}: {on_nvme} objects on NVMe promoted after 2 hits "
            f"({after['promotions_done']:.0f} promotions done); NVMe bytes "
            f"{before['nvme_used']:.0f} -> {after['nvme_used']:.0f}"
        )
        client.close()
