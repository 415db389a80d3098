"""GCache-medium KV events, without processes: the router keeps blocks
announced with medium GCACHE as pool blocks (every instance may load them), not
as the announcing instance's own memory, and stops counting them once retracted;
the connector's table of announced blocks retracts what the meta removed, the
oldest past its bound, and everything after a gap."""

from __future__ import annotations

from gcache.config import RouterConfig
from gcache.keys import block_keys
from gcache.router.service import RouterCore
from gcache_client.engines.kv_events import ReportedBlocks, gcache_hash
from tests.unit.test_router_events import BS, FP, VAllBlocksCleared, VBlockRemoved, batch, stored
from tests.unit.test_router_events import tokens as toks

GCACHE = "GCACHE"


def core() -> RouterCore:
    cfg = RouterConfig(
        namespace=FP.hex(), layout="llama-3-8b", block_size=BS, instances="a=http://a,b=http://b"
    )
    c = RouterCore(cfg, 0.0)
    for name in ("a", "b"):
        c.index.register(name, 0.0)
    return c


def chain(t: list[int]) -> list[bytes | int]:
    """The hashes the GCache connector announces: its GCache keys' first 8 bytes."""
    return [gcache_hash(k) for k in block_keys(FP, t, BS)]


def test_gcache_blocks_are_pool_hits_for_every_instance_until_retracted() -> None:
    c = core()
    t = toks(4, seed=1)
    keys = c.keys_of(t)
    hs = chain(t)
    out = c.events("a", 0, batch(stored(hs, None, t, medium=GCACHE)), 1.0)
    assert out.applied == 1 and not out.rejected
    d = c.route(keys, len(t), 1.0)
    assert d.pool_blocks == 4 and d.local_blocks == 0, "a pool hit, not a's memory"
    assert c.index.blocks_of("a") == 0 and len(c.pool_index.instances["a"].blocks) == 4
    # vLLM clearing its own cache leaves the pool alone.
    c.events("a", 1, batch(VAllBlocksCleared()), 1.0)
    assert c.route(keys, len(t), 1.0).pool_blocks == 4
    # GCache evicted the last two blocks: the pool serves the first two only.
    c.events("a", 2, batch(VBlockRemoved(hs[2:], GCACHE)), 1.0)
    assert c.route(keys, len(t), 1.0).pool_blocks == 2
    c.events("a", 3, batch(VBlockRemoved(hs[:2], GCACHE)), 1.0)
    assert c.route(keys, len(t), 1.0).pool_blocks == 0
    assert c.stats(1.0)["pool_index"]["removed_blocks"] == 4


def test_gpu_blocks_stay_local_and_a_sequence_gap_resets_the_pool_too() -> None:
    c = core()
    t = toks(3, seed=2)
    keys = c.keys_of(t)
    c.events("b", 0, batch(stored(chain(t), None, t)), 1.0)  # medium GPU
    d = c.route(keys, len(t), 1.0)
    assert d.instance == "b" and d.local_blocks == 3 and d.pool_blocks == 0
    c.events("a", 0, batch(stored(chain(t), None, t, medium=GCACHE)), 1.0)
    assert c.pool_from_events(keys) == 3  # (a route credits the pool beyond b's local 3)
    assert c.index.blocks_of("a") == 0
    c.events("a", 5, batch(), 1.0)  # batches 1..4 lost: removals may be lost
    assert c.pool_from_events(keys) == 0
    assert c.route(keys, len(t), 1.0).local_blocks == 3, "b's own blocks are b's"


def test_each_instance_retracts_its_own_announcements() -> None:
    c = core()
    t = toks(2, seed=3)
    keys = c.keys_of(t)
    for name in ("a", "b"):
        c.events(name, 0, batch(stored(chain(t), None, t, medium=GCACHE)), 1.0)
    c.events("a", 1, batch(VBlockRemoved(chain(t), GCACHE)), 1.0)
    assert c.route(keys, len(t), 1.0).pool_blocks == 2, "b still announces them"
    c.events("b", 1, batch(VBlockRemoved(chain(t), GCACHE)), 1.0)
    assert c.route(keys, len(t), 1.0).pool_blocks == 0


# ---- the connector's table (gcache_client.engines.kv_events.ReportedBlocks) ----------------------


def test_reported_blocks_retract_per_engine_group_of_the_removed_layout_group() -> None:
    # vLLM groups 0 (full) and 1, 2 (two groups of the one sliding window).
    table = ReportedBlocks([0, 1, 1])
    k1, k2 = b"\x01" * 16, b"\x02" * 16
    table.stored([gcache_hash(k1), gcache_hash(k2)], 0)
    table.stored([gcache_hash(k2)], 1)
    table.stored([gcache_hash(k2)], 2)
    table.removed([(k2, 1), (b"\x09" * 16, 0)])  # the window of k2; an unknown block
    assert table.take() == [(1, [gcache_hash(k2)]), (2, [gcache_hash(k2)])]
    table.removed([(k2, 0), (k1, 0)])
    assert table.take() == [(0, [gcache_hash(k2), gcache_hash(k1)])]
    assert len(table) == 0 and table.stats()["removals_ignored"] == 1


def test_reported_blocks_are_bounded_and_a_gap_retracts_everything() -> None:
    table = ReportedBlocks([0], max_blocks=2)
    table.stored([1, 2, 3], 0)
    assert table.take() == [(0, [1])], "past the bound the oldest is retracted at once"
    table.gap()
    assert table.take() == [(0, [2, 3])] and len(table) == 0


def test_a_full_pool_index_rejects_the_event_not_the_batch() -> None:
    cfg = RouterConfig(
        namespace=FP.hex(), layout="llama-3-8b", block_size=BS, instances="a=http://a",
        max_instances=1,
    )  # fmt: skip
    c = RouterCore(cfg, 0.0)
    c.pool_index.register("stale", 0.0)  # the pool index's one slot is taken
    t = toks(1, seed=4)
    out = c.events(
        "a", 0, batch(stored(chain(t), None, t, medium=GCACHE), stored(chain(t), None, t)), 1.0
    )
    assert out.applied == 1 and out.rejected and "at most 1" in out.rejected[0][1]
    assert c.ingestor.stats()["rejected_pool"] == 1 and c.index.blocks_of("a") == 1
