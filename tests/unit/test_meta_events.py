"""The meta's removal feed (``gcache/meta/events.py``): what counts as a
removal (evictions, NVMe evictions, a lost server; not a demotion to NVMe), the
bounded ring with explicit gaps, the bound on subscribers, recording only while
watched. MetaCore driven directly, no processes."""

from __future__ import annotations

import pytest

from gcache import keys
from gcache.meta.core import MetaCore
from gcache.meta.events import FeedFull, RemovalFeed, Subscriber
from tests.unit.test_meta_tiers import FakeTier, make, put, tier_objects, toks

KEY = b"k" * 16


def drain(feed: RemovalFeed, sub: Subscriber) -> tuple[list[tuple[bytes, int]], bool]:
    out: list[tuple[bytes, int]] = []
    gap = False
    while feed.pending(sub) or not out:
        b = feed.read(sub, 7)
        gap = gap or b.gap
        out += b.removed
        if not b.removed:
            break
    return out, gap


# ---- the feed alone -------------------------------------------------------------------


def test_feed_records_only_watched_namespaces_and_from_subscription_on() -> None:
    feed = RemovalFeed(ring=8)
    feed.removed(b"a" * 16, KEY, 0)  # nobody watches: not kept
    assert not feed.rings and feed.stats()["removals_recorded"] == 0
    sub = feed.subscribe(b"a" * 16, now=0.0)
    feed.removed(b"b" * 16, KEY, 0)  # another namespace
    feed.removed(b"a" * 16, KEY, 1)
    assert drain(feed, sub) == ([(KEY, 1)], False)
    feed.unsubscribe(sub)
    assert not feed.rings, "the last subscriber gone, the ring is freed"
    feed.unsubscribe(sub)  # twice is harmless


def test_a_subscriber_that_falls_behind_the_ring_reads_a_gap_then_the_rest() -> None:
    feed = RemovalFeed(ring=4)
    fp = b"a" * 16
    slow = feed.subscribe(fp, 0.0)
    fast = feed.subscribe(fp, 0.0)
    ks = [bytes([i]) * 16 for i in range(10)]
    for i, k in enumerate(ks):
        feed.removed(fp, k, 0)
        if i < 3:
            assert feed.read(fast, 100).removed == [(k, 0)]
    assert feed.read(fast, 100).gap  # 3 read, 7 more, 4 kept
    got, gap = drain(feed, slow)
    assert gap and got == [(k, 0) for k in ks[6:]], "the newest ring-full, in order"
    assert feed.counters["subscriber_gaps"] == 2
    assert feed.stats()["removals_dropped_from_ring"] == 6
    # Reading on after the gap: no gap again, wrap-around in order.
    for k in ks[:5]:
        feed.removed(fp, k, 2)
    got, gap = drain(feed, slow)
    assert gap  # 5 > ring of 4
    assert got == [(k, 2) for k in ks[1:5]]
    feed.removed(fp, ks[9], 1)
    assert drain(feed, slow) == ([(ks[9], 1)], False)


def test_subscribers_are_bounded() -> None:
    feed = RemovalFeed(ring=4, max_subscribers=2)
    a = feed.subscribe(b"a" * 16, 0.0)
    feed.subscribe(b"b" * 16, 0.0)
    with pytest.raises(FeedFull):
        feed.subscribe(b"a" * 16, 0.0)
    assert feed.counters["subscribers_refused"] == 1
    feed.unsubscribe(a)
    feed.subscribe(b"c" * 16, 0.0)
    assert feed.stats()["event_subscribers"] == 2


# ---- what the meta reports --------------------------------------------------------------


def watch(core: MetaCore, fp: bytes) -> Subscriber:
    return core.removals.subscribe(fp, 0.0)


def test_evictions_are_removals_with_their_group() -> None:
    core, fp = make(nvme=0)  # no NVMe: the watermark drops
    sub = watch(core, fp)
    for p in range(12):
        put(core, fp, toks(p), float(p))
    assert core.counters["evictions"] > 0
    got, gap = drain(core.removals, sub)
    assert not gap
    assert len(got) == core.counters["evictions"]
    ns = core.namespaces[fp]
    for key, g in got:  # every reported object is gone from the index
        entry = ns.entries.get(key)
        assert entry is None or entry.objects[g] is None
    # evicted prompts are reported in full: each removed block key is a real key
    all_keys = {k for p in range(12) for k in keys.block_keys(fp, toks(p), 4)}
    assert {k for k, _ in got} <= all_keys
    assert core.stats()["removed_evicted"] == len(got)


def test_admin_evict_is_a_removal() -> None:
    core, fp = make(nvme=0)
    sub = watch(core, fp)
    put(core, fp, toks(0), 0.0)
    ks = keys.block_keys(fp, toks(0), 4)
    evicted, _ = core.evict_keys(fp, [ks[-1]], groups=0xFF)
    got, _ = drain(core.removals, sub)
    assert evicted == len(got) > 0 and {k for k, _ in got} == {ks[-1]}


def test_demotion_to_nvme_is_not_a_removal_but_nvme_eviction_is() -> None:
    core, fp = make(nvme=256 * 1024)
    sub = watch(core, fp)
    tier = FakeTier()
    for p in range(6):
        put(core, fp, toks(p), float(p))
        tier.run(core, "s0", float(p) + 0.5)
        tier.run(core, "s0", float(p) + 0.7)
    assert core.counters["demotions_done"] > 0
    removed = {(k, g) for k, g in drain(core.removals, sub)[0]}
    for obj in tier_objects(core, fp, 1):  # demoted objects: in GCache, not removed
        assert (obj.entry.key, obj.group) not in removed
    assert len(removed) == core.counters["evictions"] - core.counters["nvme_evictions"]
    for p in range(6, 60):  # now fill NVMe past its watermark
        put(core, fp, toks(p), float(p))
        tier.run(core, "s0", float(p) + 0.5)
    assert core.counters["nvme_evictions"] > 0
    more, gap = drain(core.removals, sub)
    assert not gap
    assert len(removed) + len(more) == core.counters["evictions"]


def test_a_lost_server_removes_its_objects() -> None:
    core, fp = make(servers=2, nvme=0, capacity=1 << 20)
    sub = watch(core, fp)
    for p in range(4):
        put(core, fp, toks(p), float(p))
    s0 = core.servers["s0"]
    held = s0.objects
    assert held > 0
    core.drop_server(s0, "test")
    got, _ = drain(core.removals, sub)
    assert len(got) >= held  # its objects, and blocks left without their full object
    assert core.stats()["removed_server_lost"] == held
