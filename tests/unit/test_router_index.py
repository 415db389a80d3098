"""The router's fleet index (gcache/router/index.py): window-safe local matches,
bounded memory, resets, sequence verdicts, liveness."""

from __future__ import annotations

import random

import pytest

from gcache.keys import block_keys
from gcache.layout import Layout, preset
from gcache.router.index import FleetIndex, RouterError, RouteView
from gcache.router.policy import InstanceLoad

FP = b"\x01" * 16
MIMO = Layout(preset("mimo-v2-flash"))  # groups: full, swa128 (tail 2 blocks of 64)
LLAMA = Layout(preset("llama-3-8b"))  # one full group
FULL, SWA = 1, 2


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return block_keys(FP, [rng.randrange(50000) for _ in range(n * 64)], 64)


def hashes(ks: list[bytes]) -> list[bytes]:
    return [b"h" + k for k in ks]


def test_match_is_the_longest_held_prefix_per_instance() -> None:
    idx = FleetIndex(LLAMA)
    ks = keys(10)
    a, b, c = (idx.register(n, 0.0) for n in "abc")
    idx.store(a, hashes(ks[:10]), ks[:10], FULL)
    idx.store(b, hashes(ks[:4]), ks[:4], FULL)
    idx.store(c, hashes(ks[5:]), ks[5:], FULL)  # no block 0: matches nothing
    assert idx.match(ks) == {"a": 10, "b": 4}
    assert idx.match(ks[:3]) == {"a": 3, "b": 3}
    assert idx.match(keys(3, seed=9)) == {}


def test_a_hole_ends_the_match_there() -> None:
    idx = FleetIndex(LLAMA)
    ks = keys(8)
    a = idx.register("a", 0.0)
    idx.store(a, hashes(ks), ks, FULL)
    idx.remove(a, [hashes(ks)[5]], FULL)
    assert idx.match(ks) == {"a": 5}


def test_window_safe_match_needs_the_last_window() -> None:
    """Full-attention blocks of 10 blocks held, but the sliding window only for
    blocks 4..5: the match usable by the engine ends at 6, not 10."""
    idx = FleetIndex(MIMO)
    ks = keys(10)
    a = idx.register("a", 0.0)
    idx.store(a, hashes(ks), ks, FULL)
    idx.store(a, hashes(ks[4:6]), ks[4:6], SWA)
    assert idx.match(ks) == {"a": 6}
    # a window at the very end makes the whole prefix usable
    idx.store(a, hashes(ks[8:10]), ks[8:10], SWA)
    assert idx.match(ks) == {"a": 10}
    # and without any window, nothing past the start is usable
    b = idx.register("b", 0.0)
    idx.store(b, hashes(ks), ks, FULL)
    assert "b" not in idx.match(ks)


def test_window_blocks_alone_match_nothing() -> None:
    idx = FleetIndex(MIMO)
    ks = keys(4)
    a = idx.register("a", 0.0)
    idx.store(a, hashes(ks), ks, SWA)
    assert idx.match(ks) == {}


def test_bounded_per_instance_evicts_oldest_and_cleans_the_fleet_maps() -> None:
    idx = FleetIndex(LLAMA, max_blocks=10)
    ks = keys(15)
    a = idx.register("a", 0.0)
    b = idx.register("b", 0.0)
    idx.store(b, hashes(ks), ks, FULL)  # b is bounded too
    idx.store(a, hashes(ks[:8]), ks[:8], FULL)
    idx.store(a, hashes(ks[:2]), ks[:2], FULL)  # refreshed: now the youngest
    idx.store(a, hashes(ks[8:12]), ks[8:12], FULL)
    assert len(a.blocks) == 10
    assert set(a.blocks) == set(ks[:2]) | set(ks[4:12])  # blocks 2, 3 were oldest
    assert a.evicted == 2 and idx.counters["evicted_blocks"] == 2 + 5
    assert hashes(ks)[2] not in a.by_engine
    assert idx.match(ks) == {"a": 2}  # block 2 gone: a's prefix ends there
    full = idx.holders[0]
    assert ks[2] not in full and ks[0] in full and ks[14] in full
    assert len(full) <= 15


def test_reset_forgets_one_instance_only() -> None:
    idx = FleetIndex(MIMO)
    ks = keys(6)
    a, b = idx.register("a", 0.0), idx.register("b", 0.0)
    for inst in (a, b):
        idx.store(inst, hashes(ks), ks, FULL | SWA)
    idx.reset(a)
    assert idx.match(ks) == {"b": 6}
    assert not a.blocks and not a.by_engine and a.resets == 1
    idx.reset(b)
    assert all(not d for d in idx.holders)  # nothing stale left in the fleet maps


def test_sequence_verdicts() -> None:
    idx = FleetIndex(LLAMA)
    a = idx.register("a", 0.0)
    assert idx.check_seq(a, 7) == "first"
    a.seq = 7
    assert idx.check_seq(a, 8) == "next"
    assert idx.check_seq(a, 10) == "gap"
    assert idx.check_seq(a, 0) == "restart"
    assert idx.check_seq(a, 7) == "backwards"
    assert idx.check_seq(a, 3) == "backwards"


def test_live_expires_and_forget_frees_the_slot() -> None:
    idx = FleetIndex(LLAMA, max_instances=2, ttl_s=10.0, forget_s=100.0)
    ks = keys(3)
    a = idx.register("a", 0.0)
    idx.store(a, hashes(ks), ks, FULL)
    idx.report_load("b", InstanceLoad(queued=1), 5.0, url="http://b")
    assert idx.live(5.0) == ["a", "b"]
    assert idx.live(12.0) == ["b"]
    assert idx.live(16.0) == []
    with pytest.raises(RouterError, match="at most 2"):
        idx.register("c", 50.0)
    c = idx.register("c", 101.0)  # a silent > forget_s: forgotten, slot reused
    assert idx.get("a") is None and c.slot == a.slot
    assert idx.match(ks) == {}  # a's blocks did not pass to c


def test_route_view_serves_the_policy_interface() -> None:
    idx = FleetIndex(LLAMA)
    ks = keys(5)
    a = idx.report_load("a", InstanceLoad(running=2), 0.0)
    idx.register("b", 0.0)
    idx.store(a, hashes(ks), ks, FULL)
    view = RouteView(idx, ks, pool_blocks=3)
    assert view.live(1.0) == ["a", "b"]
    assert view.local_match("a", ks) == 5 and view.local_match("b", ks) == 0
    assert view.pool_match(ks) == 3
    assert view.load("a").running == 2


def test_many_instances_one_pass() -> None:
    """32 instances, each holding a different prefix length of one prompt."""
    idx = FleetIndex(MIMO)
    ks = keys(64)
    for i in range(32):
        inst = idx.register(f"i{i}", 0.0)
        n = 2 * i + 2
        idx.store(inst, hashes(ks[:n]), ks[:n], FULL)
        idx.store(inst, hashes(ks[n - 2 : n]), ks[n - 2 : n], SWA)
    got = idx.match(ks)
    assert got == {f"i{i}": 2 * i + 2 for i in range(32)}


def test_prefix_ignores_windows_for_window_unaware_policies() -> None:
    idx = FleetIndex(MIMO)
    ks = keys(8)
    a = idx.register("a", 0.0)
    idx.store(a, hashes(ks), ks, FULL)
    idx.store(a, hashes(ks[2:4]), ks[2:4], SWA)
    view = RouteView(idx, ks)
    assert view.local_match("a", ks) == 4
    assert view.prefix_match("a", ks) == 8


def test_fleet_match_equals_the_layout_rule_per_instance() -> None:
    """Random holdings of 8 instances: the one-pass fleet match equals
    Layout.valid_match run per instance on its own holdings (the reference)."""
    rng = random.Random(3)
    for layout in (MIMO, Layout(preset("mimo-v2-flash", 16))):
        for trial in range(40):
            idx = FleetIndex(layout)
            ks = keys(24, seed=trial)
            held: dict[str, tuple[int, set[int]]] = {}
            for i in range(8):
                inst = idx.register(f"i{i}", 0.0)
                full = rng.randrange(0, 25)
                wins = {j for j in range(full) if rng.random() < 0.4}
                idx.store(inst, hashes(ks[:full]), ks[:full], FULL)
                w = sorted(wins)
                idx.store(inst, hashes([ks[j] for j in w]), [ks[j] for j in w], SWA)
                held[inst.name] = (full, wins)
            want = {}
            for name, (full, wins) in held.items():
                end = layout.valid_match(full, lambda j, g, wins=wins: j in wins)
                if end:
                    want[name] = end
            assert idx.match(ks) == want
