"""Eviction policies: the compute model, the tree invariants every policy keeps,
and the cost policy's ordering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.layout import Layout, preset
from gcache.meta.core import MetaCore
from gcache.meta.eviction import (
    UNIT_COMPUTE,
    ZERO,
    CostPolicy,
    LRUPolicy,
    ModelCompute,
    compute_for_layout,
    make_policy,
)
from gcache.meta.records import LIVE, NamespaceRecord
from tests.unit.test_meta_core import spec

WALL = 1.7e9
KB = 1 << 10


def make(policy: str = "lru", capacity: int = 256 * KB, **cfg: object) -> tuple[MetaCore, bytes]:
    core = MetaCore(MetaConfig(eviction_policy=policy, **cfg))  # type: ignore[arg-type]
    addr = wire.ServerAddr("s0", "127.0.0.1", 9000, "host", "/dev/shm/s0")
    core.register_server(addr, bytes(16), incarnation=1, capacity=capacity, now=0.0)
    fp = core.register_namespace({"model": "m"}, spec()).fingerprint
    return core, fp


def put(core: MetaCore, fp: bytes, toks: list[int], now: float, ckpt_from: int = -1) -> None:
    layout = core.namespaces[fp].layout
    ks = keys.block_keys(fp, toks, layout.block_size)
    req = wire.PutBegin(fp, ks, layout.groups_to_store(len(ks)), ckpt_from)
    placed = core.put_begin(req, now, WALL)
    done = [
        (i, bytes(8 * len(layout.group_layers[p.group]))) for i, p in enumerate(placed.placements)
    ]
    if placed.placements:
        core.put_commit(wire.PutCommit(placed.put_id, done), now)


def lookup(
    core: MetaCore, fp: bytes, toks: list[int], lease: bool = False, now: float = 0.0
) -> int:
    ks = keys.block_keys(fp, toks, core.namespaces[fp].layout.block_size)
    return core.lookup(wire.Lookup(fp, ks, lease), now, WALL).blocks


def check_tree(ns: NamespaceRecord) -> None:
    """No block lacks its full object while a descendant has one (leaves go first)."""
    fg = ns.full_group
    assert fg is not None
    for e in ns.entries.values():
        if e.objects[fg] is not None:
            p = e.parent
            while p is not None:
                assert p.objects[fg] is not None, "a block with a cached descendant was evicted"
                p = p.parent


# ---- compute model ----------------------------------------------------------------


def test_prefix_flops_match_the_per_token_sum() -> None:
    m = ModelCompute(linear=100.0, full=3.0, windows=((5, 2.0),))
    for t in (0, 1, 4, 5, 6, 17):
        want = sum(100.0 + 3.0 * (p + 1) + 2.0 * min(p + 1, 5) for p in range(t))
        assert m.prefix(t) == pytest.approx(want)
    assert m.span(4, 17) == pytest.approx(m.prefix(17) - m.prefix(4))


def test_mimo_v2_flash_figures() -> None:
    m = compute_for_layout(Layout(preset("mimo-v2-flash", 64)))
    assert m.linear == pytest.approx(2 * 14.18e9, rel=0.01)  # 14.2B active non-embedding
    per_key = 2 * 64 * (192 + 128)
    assert m.full == 9 * per_key
    assert m.windows == ((128, 39 * per_key),)
    # Same model at any block size; an unknown layout costs tokens only.
    assert compute_for_layout(Layout(preset("mimo-v2-flash", 16))) == m
    assert compute_for_layout(Layout(spec())) is UNIT_COMPUTE


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("cost"), CostPolicy)
    with pytest.raises(ValueError):
        make_policy("fifo")


# ---- invariants every policy keeps ---------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "cost"])
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8)), min_size=1, max_size=30))
def test_leaves_first_under_random_load(policy: str, prompts: list[tuple[int, int]]) -> None:
    core, fp = make(policy, capacity=160 * KB, high_watermark=0.7, low_watermark=0.4)
    ns = core.namespaces[fp]
    for step, (branch, nblk) in enumerate(prompts):
        toks = [branch * 7 + t for t in range(4 * nblk)]
        lookup(core, fp, toks, now=float(step))
        put(core, fp, toks, float(step), ckpt_from=0)
        check_tree(ns)
        assert core.live_bytes == sum(
            o.length for e in ns.entries.values() for o in e.objects if o is not None
        )


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_leased_objects_are_never_evicted(policy: str) -> None:
    core, fp = make(policy, capacity=256 * KB, lease_ttl_s=1000.0)
    a = list(range(12))
    put(core, fp, a, 1.0)
    ks = keys.block_keys(fp, a, 4)
    res = core.lookup(wire.Lookup(fp, ks, True), 2.0, WALL)
    assert res.blocks == 3
    for i in range(40):  # far more than fits
        put(core, fp, [10_000 * (i + 1) + t for t in range(12)], 3.0 + i)
    assert core.counters["evictions"] > 0
    ns = core.namespaces[fp]
    for k in ks:
        assert all(o is None or o.state == LIVE for o in ns.entries[k].objects)
    assert lookup(core, fp, a) == 3
    core.release(res.lease_id)
    for i in range(40):
        put(core, fp, [900_000 + 10_000 * i + t for t in range(12)], 50.0 + i)
    assert lookup(core, fp, a) == 0  # unpinned, it may go again


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_tombstoned_interior_window_still_serves_longer_matches(policy: str) -> None:
    core, fp = make(policy, capacity=4 << 20)
    a = list(range(16))  # 4 blocks, window on blocks 2, 3
    b = a + list(range(100, 116))  # 8 blocks, window on 6, 7
    put(core, fp, a, 1.0)
    put(core, fp, b, 2.0)
    assert lookup(core, fp, a) == 4
    ks = keys.block_keys(fp, b, 4)
    assert core.evict_keys(fp, ks[2:4], 0b010) == (2, 0)  # A's window: tombstones
    assert lookup(core, fp, a) == 0
    assert lookup(core, fp, b) == 8
    assert lookup(core, fp, b + [7] * 4) == 8


def test_checkpointed_interior_window_makes_a_shorter_match_valid() -> None:
    core, fp = make("lru", capacity=4 << 20, checkpoint_interval=16)  # every 4 blocks
    long = list(range(40))  # 10 blocks: checkpoints at 4 and 8, end window at 10
    put(core, fp, long, 1.0, ckpt_from=0)
    assert lookup(core, fp, long[:32] + [999] * 4) == 8
    assert lookup(core, fp, long[:16] + [999] * 8) == 4
    assert lookup(core, fp, long[:20] + [999] * 4) == 4  # falls back to the checkpoint
    # Without checkpoints only the end is a valid match point.
    core2, fp2 = make("lru", capacity=4 << 20, checkpoint_interval=16)
    put(core2, fp2, long, 1.0, ckpt_from=-1)
    assert lookup(core2, fp2, long[:32] + [999] * 4) == 0


# ---- the cost policy's order ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_cost_drops_the_cheap_end_window_and_its_dead_tail_first(policy: str) -> None:
    """A prompt of 10 blocks with a checkpoint at 8 and its window at the end (10).
    Freeing the size of the last two blocks: the end window saves only 2 blocks over
    the checkpoint, so cost takes the blocks after the checkpoint, which then end no
    match, and keeps the checkpoint valid. LRU (all objects equally old) takes the
    first-stored pieces, the checkpoint's window."""
    core, fp = make(policy, capacity=4 << 20, checkpoint_interval=32)
    ns = core.namespaces[fp]
    toks = list(range(40))
    put(core, fp, toks, 1.0, ckpt_from=0)
    layout = ns.layout
    full, swa = layout.group_object_bytes
    srv = core.servers["s0"]
    core.evictions.evict(srv, target_used=srv.allocator.used - 2 * (full + swa))
    prefix = toks[:32] + [999] * 4
    if policy == "cost":
        assert lookup(core, fp, prefix) == 8
        assert len(ns.entries) == 8  # blocks 8 and 9 went whole
    else:
        assert lookup(core, fp, prefix) == 0


def test_cost_scores_unanchored_leaves_zero() -> None:
    core, fp = make("cost", capacity=4 << 20)
    ns = core.namespaces[fp]
    toks = list(range(16))
    put(core, fp, toks, 1.0)
    leaf = ns.entries[keys.block_keys(fp, toks, 4)[3]]
    full = leaf.objects[0]
    assert full is not None and full.score > ZERO
    core.evict_keys(fp, [leaf.key], 0b010)  # its window piece: no match ends there
    assert full.score == ZERO


def test_cost_tau_follows_eviction_age() -> None:
    core, fp = make("cost", capacity=128 * KB)
    policy = core.policy
    assert isinstance(policy, CostPolicy)
    for i in range(3000):
        put(core, fp, [1000 * i + t for t in range(8)], float(i))
    # 128 KiB holds ~5 prompts of 24 KiB: at one a second it evicts ~4 s old ones.
    assert policy.rekeys >= 1
    assert 2.0 < policy.tau < 8.0
