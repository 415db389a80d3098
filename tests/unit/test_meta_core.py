"""MetaCore driven directly: bytes in, decisions out, time passed explicitly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.errors import E_BAD_REQUEST, E_UNKNOWN_NAMESPACE, E_UNKNOWN_PUT, Refusal
from gcache.layout import LayerSpec, Layout, LayoutSpec
from gcache.meta.core import MetaCore
from gcache.meta.records import LIVE

WALL = 1_700_000_000.0
MB = 1 << 20


def spec(block_size: int = 4, window: int = 8) -> LayoutSpec:
    full = LayerSpec("full", kv_heads=1, k_head_dim=256, v_head_dim=256)
    swa = LayerSpec("swa", kv_heads=1, k_head_dim=256, v_head_dim=256, window=window)
    return LayoutSpec(block_size=block_size, dtype="float16", layers=(full, swa, full))


def make_core(servers: int = 2, capacity: int = 4 * MB, **cfg: object) -> MetaCore:
    core = MetaCore(MetaConfig(**cfg))  # type: ignore[arg-type]
    for i in range(servers):
        addr = wire.ServerAddr(f"s{i}", "127.0.0.1", 9000 + i, "host", f"/dev/shm/s{i}")
        core.register_server(addr, bytes(16), incarnation=1, capacity=capacity, now=0.0)
    return core


def register(core: MetaCore, name: str = "m", sp: LayoutSpec | None = None) -> bytes:
    sp = sp or spec()
    return core.register_namespace({"model": name}, sp).fingerprint


def put(core: MetaCore, fp: bytes, toks: list[int], now: float = 1.0) -> tuple[int, int]:
    """A client's put: begin, (pretend to) write, commit. Returns (placed, committed)."""
    layout = core.namespaces[fp].layout
    ks = keys.block_keys(fp, toks, layout.block_size)
    placed = core.put_begin(wire.PutBegin(fp, ks, layout.groups_to_store(len(ks))), now, WALL)
    done = [
        (i, bytes(8 * len(layout.group_layers[p.group]))) for i, p in enumerate(placed.placements)
    ]
    n = core.put_commit(wire.PutCommit(placed.put_id, done), now) if placed.placements else 0
    return len(placed.placements), n


def lookup(
    core: MetaCore, fp: bytes, toks: list[int], lease: bool = False, now: float = 2.0
) -> wire.LookupResult:
    layout = core.namespaces[fp].layout
    ks = keys.block_keys(fp, toks, layout.block_size)
    return core.lookup(wire.Lookup(fp, ks, lease), now, WALL)


def test_put_then_lookup_and_dedup() -> None:
    core = make_core()
    fp = register(core)
    toks = list(range(40))  # 10 blocks of 4; window 8 -> 2 swa blocks (ceil(7/4))
    placed, committed = put(core, fp, toks)
    assert placed == committed == 10 + 2
    assert lookup(core, fp, toks).tokens == 40
    # Same prompt again: everything deduplicated.
    assert put(core, fp, toks) == (0, 0)
    # A longer prompt sharing the prefix stores only the new blocks + its window.
    placed, _ = put(core, fp, toks + list(range(100, 108)))
    assert placed == 2 + 2
    # The old end is still a valid match point (its window was kept).
    assert lookup(core, fp, toks).tokens == 40
    # A prefix ending mid-way has no window: the match falls back to 0, not garbage.
    assert lookup(core, fp, toks[:20]).tokens == 0


def test_unknown_namespace_and_bad_requests_change_nothing() -> None:
    core = make_core()
    fp = register(core)
    before = core.stats()
    with pytest.raises(Refusal) as e:
        core.lookup(wire.Lookup(b"x" * 16, [b"k" * 16]), 1.0, WALL)
    assert e.value.code == E_UNKNOWN_NAMESPACE
    with pytest.raises(Refusal) as e:
        core.put_begin(wire.PutBegin(fp, [b"short"], [1]), 1.0, WALL)
    assert e.value.code == E_BAD_REQUEST
    with pytest.raises(Refusal) as e:
        core.put_begin(wire.PutBegin(fp, [b"k" * 16], [1, 1]), 1.0, WALL)
    assert e.value.code == E_BAD_REQUEST
    with pytest.raises(Refusal) as e:
        core.put_begin(wire.PutBegin(fp, [b"k" * 16], [0b100]), 1.0, WALL)
    assert e.value.code == E_BAD_REQUEST
    with pytest.raises(Refusal) as e:
        core.put_commit(wire.PutCommit(12345, []), 1.0)
    assert e.value.code == E_UNKNOWN_PUT
    after = core.stats()
    assert after["objects"] == before["objects"] == 0
    assert after["used"] == before["used"] == 0


def test_commit_with_wrong_checksums_is_refused_whole() -> None:
    core = make_core()
    fp = register(core)
    ks = keys.block_keys(fp, list(range(8)), 4)
    placed = core.put_begin(wire.PutBegin(fp, ks, [1, 1]), 1.0, WALL)
    used = core.stats()["used"]
    with pytest.raises(Refusal):
        core.put_commit(wire.PutCommit(placed.put_id, [(0, bytes(16)), (1, bytes(3))]), 1.0)
    assert core.stats()["objects"] == 0 and core.stats()["used"] == used
    # The put is still pending and can be committed correctly.
    assert (
        core.put_commit(wire.PutCommit(placed.put_id, [(0, bytes(16)), (1, bytes(16))]), 1.0) == 2
    )


def test_abandoned_put_is_reclaimed() -> None:
    core = make_core(put_timeout_s=5.0)
    fp = register(core)
    ks = keys.block_keys(fp, list(range(16)), 4)
    placed = core.put_begin(wire.PutBegin(fp, ks, [1] * 4), 1.0, WALL)
    assert core.stats()["used"] > 0
    core.tick(3.0)
    assert core.stats()["pending_puts"] == 1
    core.tick(6.5)
    assert core.stats()["pending_puts"] == 0 and core.stats()["used"] == 0
    assert core.counters["puts_reclaimed"] == 1
    with pytest.raises(Refusal):
        core.put_commit(wire.PutCommit(placed.put_id, []), 7.0)


def test_lease_pins_evicted_object_until_release() -> None:
    core = make_core(servers=1, capacity=1 * MB, lease_ttl_s=100.0)
    fp = register(core)
    layout = core.namespaces[fp].layout
    a = list(range(8))
    put(core, fp, a)
    res = lookup(core, fp, a, lease=True)
    assert res.tokens == 8 and res.lease_id
    leased = {(o.block, o.group) for o in res.objects}
    # Fill the server with other prompts: a leased object is never an eviction
    # candidate, so A survives them.
    for i in range(40):
        put(core, fp, [1000 * (i + 1) + t for t in range(8)], now=3.0 + i)
        assert lookup(core, fp, a).tokens == 8
    assert core.counters["evictions"] > 0
    # An admin eviction drops it from the index; its memory waits for the lease.
    core.evict_keys(fp, keys.block_keys(fp, a, layout.block_size)[::-1], 0b11)
    assert lookup(core, fp, a).tokens == 0
    srv = core.servers["s0"]
    assert srv.deferred_bytes == sum(layout.group_object_bytes[g] for _, g in leased)
    used = srv.allocator.used
    assert core.release(res.lease_id)
    assert srv.deferred_bytes == 0 and srv.allocator.used < used
    assert not core.release(res.lease_id)  # idempotent


def test_lease_expiry_unpins() -> None:
    core = make_core(lease_ttl_s=2.0)
    fp = register(core)
    put(core, fp, list(range(8)))
    res = lookup(core, fp, list(range(8)), lease=True, now=1.0)
    assert core.stats()["active_leases"] == 1
    core.tick(2.5)
    assert core.stats()["active_leases"] == 1
    core.tick(3.5)
    assert core.stats()["active_leases"] == 0
    assert not core.release(res.lease_id)


def test_dead_server_objects_leave_the_index() -> None:
    core = make_core(heartbeat_timeout_s=5.0)
    fp = register(core)
    toks = list(range(40))
    put(core, fp, toks)
    assert lookup(core, fp, toks).tokens == 40
    core.heartbeat("s0", 1, {}, now=4.0)
    core.tick(8.0)  # s1 silent since 0.0, s0 heard at 4.0
    assert "s1" not in core.servers and "s0" in core.servers
    got = lookup(core, fp, toks).tokens
    assert got < 40
    # Whatever still matches lies entirely on the surviving server.
    res = lookup(core, fp, toks, lease=True, now=8.5)
    assert all(res.servers[o.server].server_id == "s0" for o in res.objects)
    assert core.heartbeat("s1", 1, {}, now=9.0) == (True, [])


def test_restarted_server_loses_its_objects() -> None:
    core = make_core(servers=1)
    fp = register(core)
    put(core, fp, list(range(8)))
    addr = core.servers["s0"].addr
    core.register_server(addr, bytes(16), incarnation=2, capacity=4 * MB, now=5.0)
    assert lookup(core, fp, list(range(8))).tokens == 0
    assert core.stats()["objects"] == 0


def test_watermark_eviction_keeps_usage_bounded_and_evicts_leaves_first() -> None:
    core = make_core(servers=1, capacity=256 << 10, high_watermark=0.8, low_watermark=0.5)
    fp = register(core)
    base = list(range(8))
    for i in range(30):
        put(core, fp, base + [10_000 + 100 * i + t for t in range(8)], now=1.0 + i)
        srv = core.servers["s0"]
        assert srv.allocator.used <= 0.8 * srv.allocator.capacity
        # Invariant: no live entry lacks its full object while a descendant has one.
        ns = core.namespaces[fp]
        for e in ns.entries.values():
            full = e.objects[ns.full_group]  # type: ignore[index]
            if full is None or full.state != LIVE:
                assert not any(
                    c.parent is e and c.objects[ns.full_group] is not None  # type: ignore[index]
                    for c in ns.entries.values()
                )
    assert core.counters["evictions"] > 0


def brute_force_match(core: MetaCore, fp: bytes, toks: list[int]) -> int:
    """Longest P with every full object in [0, P) and the window before P present."""
    ns = core.namespaces[fp]
    ks = keys.block_keys(fp, toks, 4)
    tail = ns.layout.group_tail_blocks[1]
    assert tail is not None

    def has(j: int, g: int) -> bool:
        e = ns.entries.get(ks[j])
        return e is not None and e.objects[g] is not None

    for p in range(len(ks), 0, -1):
        if all(has(j, 0) for j in range(p)) and all(has(j, 1) for j in range(max(0, p - tail), p)):
            return p
    return 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 8), st.integers(0, 5)),
        min_size=1,
        max_size=25,
    )
)
def test_random_puts_keep_index_consistent(prompts: list[tuple[int, int, int, int]]) -> None:
    core = make_core(servers=2, capacity=128 << 10, high_watermark=0.7, low_watermark=0.4)
    fp = register(core)
    ns = core.namespaces[fp]
    incarnation = 1
    for step, (branch, nblk, event, cut) in enumerate(prompts):
        if event == 0:  # s1 restarts: its objects leave the index, holes mid-chain
            incarnation += 1
            addr = core.servers["s1"].addr
            core.register_server(addr, bytes(16), incarnation, 128 << 10, float(step))
        toks = [branch * 7 + t for t in range(4 * nblk)]
        before = lookup(core, fp, toks, now=float(step)).blocks
        assert before == brute_force_match(core, fp, toks)
        put(core, fp, toks, now=float(step))
        for probe in (toks, toks[: max(0, len(toks) - 4 * cut)]):
            got = lookup(core, fp, probe, now=float(step)).blocks
            assert got == brute_force_match(core, fp, probe)
        # The hole counter that lets lookups skip the per-block scan matches a rescan.
        assert ns.full_holes == sum(1 for e in ns.entries.values() if e.objects[0] is None)
        # Counters match a rescan.
        objs = [o for e in ns.entries.values() for o in e.objects if o is not None]
        assert core.live_objects == len(objs)
        assert core.live_bytes == sum(o.length for o in objs)
        assert core.entries == len(ns.entries)
        for e in ns.entries.values():
            assert e.children == sum(1 for c in ns.entries.values() if c.parent is e)
            assert not (e.children == 0 and e.empty())
        for s in core.servers.values():
            assert s.allocator.used == sum(o.length for o in objs if o.server is s)


def test_layout_with_only_windowed_layers() -> None:
    swa_only = LayoutSpec(4, "float16", (LayerSpec("swa", 1, 64, 64, window=8),))
    core = make_core()
    fp = register(core, "swa-only", swa_only)
    assert Layout(swa_only).group_tail_blocks == [2]
    toks = list(range(24))
    put(core, fp, toks)
    assert lookup(core, fp, toks).tokens == 24
    assert lookup(core, fp, toks[:12]).tokens == 0
