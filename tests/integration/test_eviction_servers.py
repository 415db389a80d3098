"""Eviction across servers, against real daemons: with two servers, an old
long prompt whose blocks sit on both (its leaf on one, interior blocks on the
other) used to make the meta evict every fresh prompt right after its commit,
since each server's eviction order saw only its own objects and the old prompt's
interior blocks are not evictable while its leaf lives elsewhere. The order now
follows recency (or the cost policy's value) across servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests.kvdata import make_kv, tiny_hybrid, tokens


@pytest.fixture(scope="module", params=["lru", "cost"])
def two_small_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalDeployment]:
    d = LocalDeployment(
        tmp_path_factory.mktemp(f"evict-{request.param}"),
        servers=2,
        capacity="1MiB",  # 256 objects of 4 KiB per server
        meta_args=["--eviction-policy", request.param],
    )
    d.start()
    yield d
    d.stop()


def test_fresh_prompts_survive_an_old_prompt_split_across_servers(
    two_small_servers: LocalDeployment,
) -> None:
    d = two_small_servers
    with GCacheClient(d.client_config()) as c:
        ns = c.register_namespace("evict-servers", tiny_hybrid())
        layout = ns.layout
        old = tokens(4 * 100, seed=1)  # ~20% of the store, spread over both servers
        r = c.put(ns, old, make_kv(layout, len(old), seed=1))
        assert r.ok and r.stored > 100
        servers = {s.server_id: s.objects for s in d.stats().servers}
        assert len(servers) == 2 and all(n > 40 for n in servers.values()), servers
        kept = []
        for i in range(40):  # ~560 objects through a store of 512: eviction throughout
            toks = tokens(4 * 12, seed=100 + i)
            assert c.put(ns, toks, make_kv(layout, len(toks), seed=100 + i)).ok
            kept.append(c.lookup(ns, toks) == len(toks))
        counters = dict(d.stats().counters)
        assert counters["evictions"] > 0
        assert all(kept), f"fresh prompts evicted right after commit: {kept.count(False)} of 40"
        if "lru" in d.meta_args:  # the old prompt, least recently used, is what went
            assert c.lookup(ns, old) < len(old)
        # (cost keeps the old prompt, the most recompute per byte, and evicts the
        # older fresh prompts instead.)
