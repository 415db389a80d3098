"""Promotion back to DRAM on repeated hits (meta.promotion = "hits:N"): the
meta allocates the DRAM range, the server copies and reports, the index switches
to the DRAM copy and the NVMe copy is deleted (after its last read lease). MetaCore
is driven directly; the server's side is played by the test."""

from __future__ import annotations

import pytest

from gcache import keys
from gcache.config import MetaConfig
from gcache.errors import ConfigError
from gcache.meta.core import MetaCore
from gcache.meta.records import LIVE
from gcache.meta.tiers import Promotion
from tests.unit.test_meta_tiers import FakeTier, lookup, make, put, toks


def on_nvme(promotion: str) -> tuple[MetaCore, bytes, list[int]]:
    """A store whose first prompt went to NVMe whole, DRAM below its low watermark."""
    core, fp = make(capacity=1 * (1 << 20), promotion=promotion)
    tier = FakeTier()
    for p in range(40):
        put(core, fp, toks(p, blocks=6), float(p))
        tier.run(core, "s0", float(p) + 0.5)
    for t in (50.0, 51.0, 52.0):
        tier.run(core, "s0", t)
    first = toks(0, 6)
    res = lookup(core, fp, first)
    assert res.blocks == 6
    assert not core.servers["s0"].demoting
    return core, fp, first


def hit(core: MetaCore, fp: bytes, t: list[int]) -> list[tuple[int, int, int]]:
    """A leased lookup, released at once; returns (tier, offset, length) of each grant."""
    res = lookup(core, fp, t, lease=True)
    core.release(res.lease_id)
    return [(o.grant.tier, o.grant.offset, o.grant.length) for o in res.objects]


def hit_free(core: MetaCore, fp: bytes, t: list[int]) -> list[tuple[int, int, int]]:
    """Grants of a lease-free lookup (does not count as a hit): via the index."""
    ns = core.namespaces[fp]
    ks = keys.block_keys(fp, t, ns.layout.block_size)
    out = []
    for k in ks:
        for o in ns.entries[k].objects:
            if o is not None:
                out.append((o.tier, o.offset, o.length))
    return out


def test_promotion_after_n_hits_switches_to_dram_and_deletes_the_nvme_copy() -> None:
    core, fp, first = on_nvme("hits:2")
    srv = core.servers["s0"]
    before = [g for g in hit_free(core, fp, first) if g[0] == 1]
    assert before, "the first prompt is on NVMe"
    hit(core, fp, first)
    assert core.counters["promotions_issued"] == 0  # one hit: not yet
    used = srv.allocator.used
    hit(core, fp, first)
    issued = core.counters["promotions_issued"]
    assert issued == len(before)
    # The meta allocated the DRAM ranges itself; the objects stay on NVMe, pinned.
    assert srv.allocator.used == used + sum(n for _, _, n in before)
    assert all(g[0] == 1 for g in hit_free(core, fp, first) if g in before)
    out = core.tier_heartbeat("s0", 1, {}, 60.0)
    assert len(out.promote) == issued
    cmds = {(obj.offset, obj.length): off for obj, _, off in out.promote}
    assert set(cmds) == {(o, n) for _, o, n in before}
    assert all(obj.tier == 1 and obj.pins == 1 for obj, _, _ in out.promote)
    held = {(o, n) for _, o, n in before}
    dram_ranges = {(off, n) for (_, n), off in cmds.items()}
    # Still readable from NVMe while the copies are made.
    assert {(o, n) for t, o, n in hit_free(core, fp, first) if t == 1} == held
    done = [Promotion(o, n, off, True) for (o, n), off in cmds.items()]
    out = core.tier_heartbeat("s0", 1, {}, 61.0, promoted=done)
    assert core.counters["promotions_done"] == issued
    # The index now reads those blocks from DRAM at the ranges the meta allocated...
    now = {(t, o, n) for t, o, n in hit_free(core, fp, first)}
    assert {(o, n) for t, o, n in now if t == 0} >= dram_ranges
    assert not {(o, n) for t, o, n in now if t == 1} & held
    # ...and the NVMe copies are deleted.
    assert held <= set(out.drop_nvme)
    assert srv.promoting_bytes == 0 and not srv.promoting
    assert lookup(core, fp, first).blocks == 6


def test_promotion_off_never_promotes() -> None:
    core, fp, first = on_nvme("off")
    for _ in range(5):
        hit(core, fp, first)
    assert core.counters["promotions_issued"] == 0
    assert not core.tier_heartbeat("s0", 1, {}, 60.0).promote


def test_failed_promotion_gives_the_dram_range_back_and_keeps_the_nvme_copy() -> None:
    core, fp, first = on_nvme("hits:1")
    srv = core.servers["s0"]
    used = srv.allocator.used
    hit(core, fp, first)
    out = core.tier_heartbeat("s0", 1, {}, 60.0)
    assert out.promote
    assert srv.allocator.used > used
    done = [Promotion(obj.offset, obj.length, off, False, "EIO") for obj, _, off in out.promote]
    out2 = core.tier_heartbeat("s0", 1, {}, 61.0, promoted=done)
    assert core.counters["promotions_failed"] == len(done)
    assert srv.allocator.used == used
    assert {(d.dram_offset, d.length) for d in done} <= set(out2.free)
    for obj, _, _ in out.promote:
        assert obj.state == LIVE and obj.tier == 1 and obj.pins == 0 and obj.hits == 0
    assert not out2.drop_nvme


def test_a_leased_nvme_copy_is_deleted_only_after_its_lease_ends() -> None:
    core, fp, first = on_nvme("hits:1")
    res = lookup(core, fp, first, lease=True)  # this hit promotes; the lease stays
    out = core.tier_heartbeat("s0", 1, {}, 60.0)
    done = [Promotion(obj.offset, obj.length, off, True) for obj, _, off in out.promote]
    assert done
    out2 = core.tier_heartbeat("s0", 1, {}, 61.0, promoted=done)
    nvme = {(d.nvme_offset, d.length) for d in done}
    assert not nvme & set(out2.drop_nvme), "deleted under a read lease"
    core.release(res.lease_id)
    out3 = core.tier_heartbeat("s0", 1, {}, 62.0)
    assert nvme <= set(out3.drop_nvme)


def fill_to_high(core: MetaCore) -> int:
    """Allocate raw ranges (nobody's objects: never freed) until DRAM sits just
    below its high watermark; returns the high watermark in bytes."""
    srv = core.servers["s0"]
    high = int(core.cfg.high_watermark * srv.allocator.capacity)
    while srv.reclaimable_used + 4096 < high:
        assert srv.allocator.alloc(4096) is not None
    return high


def test_promotion_makes_room_like_a_put_and_stays_below_the_high_watermark() -> None:
    core, fp, first = on_nvme("hits:1")
    srv = core.servers["s0"]
    high = fill_to_high(core)
    c = core.counters
    left = c["demotions_issued"] + c["dropped_not_demoted"] + c["evictions"]
    hit(core, fp, first)
    assert c["promotions_issued"] > 0
    assert c["demotions_issued"] + c["dropped_not_demoted"] + c["evictions"] > left
    assert srv.reclaimable_used + srv.promoting_bytes <= high


def test_promotion_waits_when_nothing_in_dram_may_leave() -> None:
    core, fp, first = on_nvme("hits:2")
    # Every cached prompt read once and kept leased: nothing in DRAM may leave.
    for p in range(40):
        if lookup(core, fp, toks(p, blocks=6)).blocks:
            lookup(core, fp, toks(p, blocks=6), lease=True)
    fill_to_high(core)
    issued = core.counters["promotions_issued"]
    lookup(core, fp, first, lease=True)  # the second hit of the first prompt
    assert core.counters["promotions_issued"] == issued
    assert core.counters["promotions_no_room"] > 0


def test_evicted_while_promoting_frees_the_dram_range() -> None:
    core, fp, first = on_nvme("hits:1")
    srv = core.servers["s0"]
    used = srv.allocator.used
    hit(core, fp, first)
    out = core.tier_heartbeat("s0", 1, {}, 60.0)
    leaf = next(obj for obj, _, _ in out.promote if obj.entry.children == 0)
    core.evict_keys(fp, [leaf.entry.key], 0b111)
    done = [Promotion(obj.offset, obj.length, off, True) for obj, _, off in out.promote]
    core.tier_heartbeat("s0", 1, {}, 61.0, promoted=done)
    assert core.counters["promotions_void"] >= 1
    assert srv.allocator.used < used + sum(d.length for d in done)


@pytest.mark.parametrize("bad", ["hits:0", "hits:", "hits:x", "always", "hit:2"])
def test_promotion_setting_is_checked(bad: str) -> None:
    with pytest.raises(ConfigError, match="promotion"):
        MetaConfig(promotion=bad).check()
    assert MetaConfig(promotion="hits:3").promotion_hits == 3
