"""The NVMe tier end to end: fill past DRAM so objects demote, read them back
byte-exact from NVMe with get_layers (over TCP even where shared memory maps the
DRAM segment); Lookup results say which tier each object is on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gcache.cli.deploy import LocalDeployment
from gcache.errors import GCacheError
from gcache.storage.nvme import NvmeTier
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

BLOCKS = 64
NTOK = 4 * BLOCKS


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_fill_past_dram_demotes_and_nvme_reads_are_byte_exact(
    tmp_path: Path, transport: str
) -> None:
    with LocalDeployment(tmp_path, servers=1, capacity="8MiB", nvme_size="64MiB") as d:
        d.start()
        client = GCacheClient(d.client_config(transport=transport))
        ns = client.register_namespace(f"tiers-{transport}", tiny_hybrid())
        n = 60  # ~2x the DRAM segment (66 objects of 4 KiB a prompt)
        for s in range(n):
            assert client.put(ns, tokens(NTOK, seed=s), make_kv(ns.layout, NTOK, seed=s)).ok
            time.sleep(0.05)  # demotions finish a heartbeat later: let them
        time.sleep(2.0)
        stats = d.stats().counters
        assert stats["demotions_done"] > 0, dict(stats)
        tiers_seen: set[int] = set()
        exact = nvme_prompts = 0
        for s in range(n):
            toks = tokens(NTOK, seed=s)
            m = client.match(ns, toks)
            if not m.tokens:
                continue
            tiers = {loc.grant.tier for loc in m.objects.values()}
            tiers_seen |= tiers
            with client.get_layers(m) as stream:
                layers = list(stream)
            assert stream.ok, f"prompt {s}: a read failed"
            assert_layers_match(layers, make_kv(ns.layout, NTOK, seed=s))
            exact += 1
            nvme_prompts += 1 in tiers
            client.release(m)
        assert tiers_seen == {0, 1}, tiers_seen
        assert nvme_prompts > 0 and exact >= nvme_prompts
        if transport == "shm":
            assert client.stats()["bytes_read_nvme"] > 0
        print(
            f"{transport}: {exact}/{n} prompts read byte-exact, {nvme_prompts} of them from "
            f"NVMe; demotions {stats['demotions_done']:.0f} done, "
            f"{stats['dropped_not_demoted']:.0f} dropped"
        )
        client.close()


def test_server_with_fresh_nvme_dir_stays_up_and_holds_its_lock(tmp_path: Path) -> None:
    """A defect this guards against: ``with LocalDeployment(...) as d: d.start()``
    started a second meta and a second ``server0`` on the same NVMe directory; the
    second one exited ~0.4 s after registering with "the NVMe directory ... is in
    use by another gcache-server" (the first deployment leaked). A second start()
    is now a no-op: one meta, one server, alive past several heartbeats, and the
    directory's lock held by that server until it stops."""
    with LocalDeployment(tmp_path, servers=1, capacity="8MiB", nvme_size="64MiB") as d:
        meta_pid = d.meta.popen.pid if d.meta else 0
        d.start()  # what the test above does: must not start anything again
        assert d.meta is not None and d.meta.popen.pid == meta_pid
        assert len(d.servers) == 1
        time.sleep(1.6)  # three heartbeats (0.5 s)
        assert d.servers[0].alive, (tmp_path / "server0.log").read_text()
        assert "in use by another" not in (tmp_path / "server0.log").read_text()
        servers = [s for s in d.stats().servers if s.alive]
        assert len(servers) == 1
        with pytest.raises(GCacheError, match="in use by another gcache-server"):
            NvmeTier(str(d.nvme_dir(0)), 64 << 20)  # the live server holds the lock
        codes = d.stop()
        assert all(c == 0 for c in codes.values()), codes
    NvmeTier(str(d.nvme_dir(0)), 64 << 20).close()  # released at exit
