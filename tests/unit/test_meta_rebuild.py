"""Rebuild speed measures: the cyclic GC paused during reports
and the rebuilt index frozen out of it, index records in no reference cycle once
unlinked, a stalled meta crediting its servers, records adopted in block order
without a detour through the parked books, and the eviction heaps of a restarted
meta built once, by a sort, when its reports end (or when a put needs a victim
first)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from gcache.config import MetaConfig
from gcache.meta import rebuild
from gcache.meta.compact import CompactIndex
from gcache.meta.control import GcPause
from gcache.meta.core import MetaCore
from tests.unit.test_meta_tiers import KB, SLOW, addr, make, put, report_of, toks


def test_gc_pause_nests_restores_and_freezes_only_after_a_rebuild() -> None:
    adopted = [0]
    pause = GcPause(lambda: adopted[0])
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with pause():
            assert not gc.isenabled()
        assert gc.isenabled()
        assert pause.freezes == 0, "nothing adopted: nothing frozen"
        with pause():
            assert not gc.isenabled()
            with pause():
                assert not gc.isenabled()
            assert not gc.isenabled(), "the outer report is still in progress"
            keep = [[i] for i in range(1000)]  # what a rebuild allocates
            adopted[0] += GcPause.FREEZE_MIN
        assert gc.isenabled()
        assert pause.freezes == 1
        assert gc.get_freeze_count() >= frozen + len(keep)
        with pytest.raises(RuntimeError), pause():
            raise RuntimeError("a report stream failed")
        assert gc.isenabled(), "re-enabled on error too"
    finally:
        gc.unfreeze()


def test_a_stalled_meta_credits_its_servers_instead_of_dropping_them() -> None:
    core, _ = make(servers=2)
    timeout = core.cfg.heartbeat_timeout_s
    core.stalled(timeout + 5.0)  # the loop was blocked that long
    core.tick(timeout + 4.0)
    assert len([s for s in core.servers.values() if s.alive]) == 2
    assert core.counters["stalls"] == 1
    core.tick(2 * timeout + 10.0)  # silent for real afterwards: dropped
    assert not core.servers


def test_reports_in_block_order_are_adopted_without_parking() -> None:
    old, fp = make(servers=2)
    for p in range(6):
        put(old, fp, toks(p, 8), float(p))
    # Both servers' records, parents first (as servers stream them).
    reps = sorted(
        [("s0", r) for r in report_of(old, "s0")] + [("s1", r) for r in report_of(old, "s1")],
        key=lambda sr: sr[1].pos,
    )
    new = MetaCore(MetaConfig(compute_tflops=SLOW))
    new.register_namespace({"model": "m"}, old.namespaces[fp].layout.spec)
    for i in range(2):
        new.register_server(addr(i), bytes(16), 1, 256 * KB, 0.0, report=True)
    for sid, rec in reps:
        new.report_objects(sid, 1, [rec], False, 1.0)
    for sid in ("s0", "s1"):
        new.report_objects(sid, 1, [], True, 1.0)
    assert new.counters["objects_parked"] == 0
    assert new.stats()["objects"] == old.stats()["objects"]


def assert_heaps_hold_the_evictable(cx: CompactIndex) -> None:
    """Each tier's eviction heap holds its evictable live objects, and perhaps
    pinned ones that would be evictable unpinned (pins are lazy), each where its
    ``hpos`` says (in a bulk load: nothing)."""
    o = cx.objects.cols
    hpos = o["hpos"][: cx.objects.rows]
    if cx.bulk:
        assert not cx.leaves.size() and (hpos < 0).all()
        return
    live = np.flatnonzero(o["block"][: cx.objects.rows] >= 0).astype(np.int32)
    ok = live[cx.leaves.evictable(live)]
    may = set(live[cx.leaves.evictable(live, pins=False)].tolist())
    held_all = 0
    for t, h in enumerate(cx.leaves.heaps):
        held = h.heap[: h.size]
        held_all += h.size
        assert (hpos[held] == np.arange(h.size)).all()
        mine = set(held.tolist())
        assert set(ok[o["tier"][ok] == t].tolist()) <= mine <= may
        assert (o["tier"][held] == t).all()
        key = o["tick"][held].astype(object) * (1 << 64) + o["hseq"][held].astype(object)
        for i in range(1, h.size):
            assert key[(i - 1) // 2] <= key[i], "heap order"
    assert (hpos >= 0).sum() == held_all
    assert cx.stats()["evictable"] == ok.size


def _restarted(
    servers: int = 2, bulk: bool = True, prompts: int = 8
) -> tuple[MetaCore, MetaCore, list]:  # type: ignore[type-arg]
    old, fp = make(servers=servers)
    for p in range(prompts):
        put(old, fp, toks(p, 8 + p), float(p))
    reps = sorted(
        [(f"s{i}", r) for i in range(servers) for r in report_of(old, f"s{i}")],
        key=lambda sr: sr[1].pos,
    )
    new = MetaCore(MetaConfig(compute_tflops=SLOW))
    new.register_namespace({"model": "m"}, old.namespaces[fp].layout.spec)
    for i in range(servers):
        new.register_server(addr(i), bytes(16), 1, 256 * KB, 0.0, report=True)
    assert new.index.cx.bulk is bulk
    return old, new, reps


def _victims(core: MetaCore) -> list[tuple[int, float]]:
    """Every evictable DRAM object in eviction order: (tick, last access)."""
    cx = core.index.cx
    out = []
    while (oid := cx.victim(0)) >= 0:
        cx.leaves.take_out(oid)
        out.append((int(cx.objects.cols["tick"][oid]), float(cx.objects.cols["atime"][oid])))
    return out


def test_a_restarted_meta_builds_its_eviction_heaps_once_when_the_reports_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, new, reps = _restarted()
    for sid, rec in reps:
        new.report_objects(sid, 1, [rec], False, 1.0)
        assert new.index.cx.bulk, "no heap kept while the reports arrive"
    new.report_objects("s0", 1, [], True, 1.0)
    assert new.index.cx.bulk, "s1 still reports"
    new.report_objects("s1", 1, [], True, 1.0)
    assert not new.index.cx.bulk
    assert new.counters["rebuild_bulk_loads"] == 1
    assert_heaps_hold_the_evictable(new.index.cx)
    bulk_order = _victims(new)
    # The same reports with the heaps kept all along: the same eviction order.
    monkeypatch.setattr(rebuild, "BULK_BELOW", -1)
    _, eager, reps = _restarted(bulk=False)
    for sid, rec in reps:
        eager.report_objects(sid, 1, [rec], False, 1.0)
        assert_heaps_hold_the_evictable(eager.index.cx)
    for sid in ("s0", "s1"):
        eager.report_objects(sid, 1, [], True, 1.0)
    assert eager.counters["rebuild_bulk_loads"] == 0
    assert bulk_order and _victims(eager) == bulk_order


def test_a_victim_needed_during_the_reports_builds_the_heaps_there() -> None:
    _, new, reps = _restarted()
    half = len(reps) // 2
    for sid, rec in reps[:half]:
        new.report_objects(sid, 1, [rec], False, 1.0)
    cx = new.index.cx
    assert cx.bulk
    first = cx.victim(0)  # (an eviction for a put on a server whose report is done)
    assert not cx.bulk and first >= 0
    assert_heaps_hold_the_evictable(cx)
    for sid, rec in reps[half:]:  # the rest adopted with the heaps kept
        new.report_objects(sid, 1, [rec], False, 1.0)
        assert_heaps_hold_the_evictable(cx)
    for sid in ("s0", "s1"):
        new.report_objects(sid, 1, [], True, 1.0)
    assert not cx.bulk and new.counters["rebuild_bulk_loads"] == 1
    assert_heaps_hold_the_evictable(cx)


def test_a_server_lost_mid_report_ends_the_bulk_load_at_the_next_tick() -> None:
    _, new, reps = _restarted(prompts=2)  # (s0 under its watermark: no drain)
    for sid, rec in reps:
        if sid == "s0":
            new.report_objects(sid, 1, [rec], False, 1.0)
    new.report_objects("s0", 1, [], True, 1.0)
    assert new.index.cx.bulk, "s1 registered to report and has not finished"
    new.tick(1.0)
    assert new.index.cx.bulk
    later = 1.0 + new.cfg.heartbeat_timeout_s + 1.0
    new.servers["s0"].last_seen = later  # (s0 beats; s1 is silent: dropped)
    new.tick(later)
    assert "s1" not in new.servers and "s0" in new.servers
    assert not new.index.cx.bulk
    assert_heaps_hold_the_evictable(new.index.cx)
