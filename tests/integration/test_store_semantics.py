"""Prefix sharing, dedup, strict O(W) storage, leases through eviction, dead
servers and corrupted bytes, against real daemons."""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gcache.cli.deploy import LocalDeployment
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, shared_kv, tokens


def counters(d: LocalDeployment) -> dict[str, float]:
    return dict(d.stats().counters)


def test_prefix_sharing_dedup_and_strict_window(
    deployment: LocalDeployment, client: GCacheClient
) -> None:
    ns = client.register_namespace(
        f"sem-prefix-{client.config.transport}", "mimo-v2-flash", block_size=16
    )
    layout = ns.layout
    tail = layout.group_tail_blocks[1]
    assert tail == 8  # ceil(127 / 16)
    full_b, swa_b = layout.group_object_bytes
    before = counters(deployment)
    a_toks = tokens(16 * 12, seed=1)
    a_kv = make_kv(layout, len(a_toks), seed=1)
    r1 = client.put(ns, a_toks, a_kv)
    assert r1.ok and r1.stored == 12 + tail and r1.deduped == 0
    # Exactly strict O(W): full objects for all 12 blocks, swa for the last 8 only.
    after = counters(deployment)
    assert after["bytes_stored_full"] - before.get("bytes_stored_full", 0) == 12 * full_b
    assert after["bytes_stored_swa128"] - before.get("bytes_stored_swa128", 0) == tail * swa_b
    assert r1.bytes_written == layout.stored_bytes(12) == 12 * full_b + tail * swa_b

    # B extends A by 4 blocks: A's 12 full objects are shared, not rewritten.
    b_toks = np.concatenate([a_toks, tokens(64, seed=2)])
    b_kv = shared_kv(a_kv, make_kv(layout, len(b_toks), seed=2), len(a_toks))
    r2 = client.put(ns, b_toks, b_kv)
    assert r2.ok and r2.stored == 4 + 4  # 4 new full + the window's 4 new swa blocks
    assert r2.deduped == 12 + 4  # 12 shared full + 4 swa of A's tail that B's window reuses
    assert client.lookup(ns, b_toks) == 16 * 16
    assert client.lookup(ns, a_toks) == 16 * 12  # A's own end still has its window
    # A prompt that branches off inside A (after block 6): no window saved there, so
    # the valid match ends at 0 even though 6 full blocks are shared. Never garbage.
    c_toks = np.concatenate([a_toks[: 16 * 6], tokens(32, seed=3)])
    assert client.lookup(ns, c_toks) == 0

    m = client.match(ns, b_toks)
    assert_layers_match(client.get(m), b_kv)
    client.release(m)


def test_namespaces_never_mix(client: GCacheClient) -> None:
    ns1 = client.register_namespace(
        f"sem-ns-{client.config.transport}", "llama-3-8b", block_size=16
    )
    ns2 = client.register_namespace(
        f"sem-ns-{client.config.transport}", "llama-3-8b", block_size=16, cache_salt="tenant-b"
    )
    assert ns1.fingerprint != ns2.fingerprint
    toks = tokens(64, seed=4)
    assert client.put(ns1, toks, make_kv(ns1.layout, 64, seed=4)).ok
    assert client.lookup(ns1, toks) == 64
    assert client.lookup(ns2, toks) == 0


SMALL = LayoutSpec(
    block_size=16,
    dtype="float16",
    layers=(
        LayerSpec("full", 1, 512, 512),
        LayerSpec("swa", 1, 512, 512, window=32),
        LayerSpec("full", 1, 512, 512),
    ),
)  # full object 64 KiB, swa object 32 KiB per block


@pytest.fixture
def small_deployment(tmp_path: Path) -> Iterator[LocalDeployment]:
    d = LocalDeployment(
        tmp_path,
        servers=1,
        capacity="2MiB",
        meta_args=["--lease-ttl-s", "30", "--high-watermark", "0.8", "--low-watermark", "0.6"],
    )
    d.start()
    yield d
    d.stop()


def test_lease_keeps_object_readable_through_eviction(small_deployment: LocalDeployment) -> None:
    with GCacheClient(small_deployment.client_config()) as c:
        ns = c.register_namespace("sem-lease", SMALL)
        a = tokens(16 * 4, seed=10)
        a_kv = make_kv(ns.layout, len(a), seed=10)
        assert c.put(ns, a, a_kv).ok
        m = c.match(ns, a)
        assert m.tokens == 64
        # Other prompts (2 MiB server, ~320 KiB a prompt) force evictions, but a
        # leased object is never an eviction candidate: A stays.
        for i in range(20):
            t = tokens(16 * 4, seed=100 + i)
            c.put(ns, t, make_kv(ns.layout, len(t), seed=100 + i))
        assert counters(small_deployment)["evictions"] > 0
        assert c.lookup(ns, a) == 64
        # An admin eviction (leaf first) drops A from the index while it is leased.
        c.evict(ns, a, blocks=range(3, -1, -1), windows_only=False)
        assert c.lookup(ns, a) == 0, "A should have been evicted"
        # The lease still pins A's bytes: reading through the old match is exact.
        assert_layers_match(c.get(m), a_kv)
        c.release(m)


def test_killed_server_turns_blocks_into_misses(tmp_path: Path) -> None:
    with (
        LocalDeployment(
            tmp_path, servers=2, capacity="64MiB", meta_args=["--heartbeat-timeout-s", "1.5"]
        ) as d,
        GCacheClient(d.client_config(transport="tcp"), timeout_s=2.0) as c,
    ):
        ns = c.register_namespace("sem-kill", SMALL)
        toks = tokens(16 * 20, seed=20)
        kv = make_kv(ns.layout, len(toks), seed=20)
        assert c.put(ns, toks, kv).ok
        m = c.match(ns, toks)
        assert m.tokens == 320
        on = {m.servers[o.server].server_id for o in m.objects.values()}
        assert on == {"server0", "server1"}  # placement spread the prompt
        shm_client = GCacheClient(d.client_config(transport="shm"), timeout_s=2.0)
        m_shm = shm_client.match(ns, toks)
        d.kill_server(1)
        # Reading through the old match over TCP: a miss, not an exception.
        assert c.get(m) is None
        # Over shared memory the dead server's pages are still mapped: the read
        # either verifies (the bytes are the right KV) or is a miss, never garbage.
        got_shm = shm_client.get(m_shm)
        assert got_shm is None or all(
            np.array_equal(layer.k, kv[layer.layer][0][layer.start : layer.start + len(layer.k)])
            for layer in got_shm
        )
        shm_client.close()
        stream = c.get_layers(m)
        assert list(stream) == [] or not stream.ok
        assert not stream.ok
        # Once the meta notices, the dead server's blocks leave the index.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.lookup(ns, toks) == 320:
            time.sleep(0.2)
        left = c.lookup(ns, toks)
        assert left < 320
        if left:
            m2 = c.match(ns, toks)
            got = c.get(m2)
            assert got is not None and all(
                np.array_equal(
                    layer.k, kv[layer.layer][0][layer.start : layer.start + len(layer.k)]
                )
                for layer in got
            )
        # Still a working store: new puts land on the surviving server.
        t2 = tokens(64, seed=21)
        assert c.put(ns, t2, make_kv(ns.layout, 64, seed=21)).ok
        assert c.lookup(ns, t2) == 64


def test_corrupted_bytes_are_a_miss(deployment: LocalDeployment, client: GCacheClient) -> None:
    ns = client.register_namespace(f"sem-corrupt-{client.config.transport}", SMALL)
    toks = tokens(64, seed=30)
    kv = make_kv(ns.layout, 64, seed=30)
    assert client.put(ns, toks, kv).ok
    m = client.match(ns, toks)
    loc = m.objects[(0, 0)]
    shm = {s.server_id: s.shm_path for s in deployment.stats().servers}[
        m.servers[loc.server].server_id
    ]
    with open(shm, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        mm[loc.grant.offset + 100] ^= 0xFF
        before = client.stats().get("integrity_errors", 0)
        assert client.get(m) is None
        assert client.stats()["integrity_errors"] == before + 1
        stream = client.get_layers(m)
        assert [layer.layer for layer in stream] == []  # layer 0 is the damaged one
        assert not stream.ok
        mm[loc.grant.offset + 100] ^= 0xFF
    assert client.get(m) is not None
    client.release(m)


def test_prometheus_metrics_endpoint(deployment: LocalDeployment, client: GCacheClient) -> None:
    import urllib.error
    import urllib.request

    ns = client.register_namespace(f"sem-metrics-{client.config.transport}", SMALL)
    toks = tokens(32, seed=40)
    client.put(ns, toks, make_kv(ns.layout, 32, seed=40))
    client.lookup(ns, toks)
    with urllib.request.urlopen(deployment.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["gcache_meta_lookups_total"] >= 1
    assert values["gcache_meta_hit_blocks_total"] >= 2
    assert values['gcache_server_used_bytes{server="server0"}'] > 0
    assert "# TYPE gcache_meta_evictions_total counter" in text
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(deployment.metrics_url.replace("/metrics", "/nope"), timeout=5)


def test_meta_restart_servers_reregister_and_service_resumes(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=2, capacity="16MiB") as d:
        with GCacheClient(d.client_config(), timeout_s=2.0) as c:
            ns = c.register_namespace("sem-restart", SMALL)
            toks = tokens(64, seed=50)
            assert c.put(ns, toks, make_kv(ns.layout, 64, seed=50)).ok
            m = c.match(ns, toks)
            d.restart_meta()
            # The acknowledged put is in its servers' manifests: the restarted meta
            # rebuilds it from their reports (before that, a miss, never an error).
            d.wait_servers(2, timeout=10)
            deadline = time.monotonic() + 10
            while c.lookup(ns, toks) != 64 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.lookup(ns, toks) == 64
            # Old grants either still verify (bytes not reused yet) or read as a miss.
            got = c.get(m)
            assert got is None or len(got) == 3
            # The client re-registers the namespace (same fingerprint) by itself.
            assert c.put(ns, toks, make_kv(ns.layout, 64, seed=50)).ok
            assert c.lookup(ns, toks) == 64
