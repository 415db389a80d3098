"""Rebuild speed measures: the cyclic GC paused during reports
and the rebuilt index frozen out of it, index records in no reference cycle once
unlinked, a stalled meta crediting its servers, and records adopted in block order
without a detour through the parked books."""

from __future__ import annotations

import gc

import pytest

from gcache.config import MetaConfig
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
