"""Chunks reported for a namespace not registered yet are parked whole, in their
columns: adopted in one merged pass when the namespace registers,
their DRAM ranges held meanwhile and freed when they expire; bulk admission keeps
the LRU order."""

from __future__ import annotations

from gcache.config import MetaConfig
from gcache.meta.core import MetaCore
from gcache.meta.rebuild import Parked
from gcache.storage.columns import columns_of
from tests.unit.test_meta_tiers import KB, SLOW, addr, heartbeat, make, put, report_of, toks


def _pos(r: Parked) -> int:
    return r.pos


def _restarted(servers: int, **cfg: object) -> MetaCore:
    new = MetaCore(MetaConfig(compute_tflops=SLOW, heartbeat_timeout_s=1000.0, **cfg))  # type: ignore[arg-type]
    for i in range(servers):
        new.register_server(addr(i), bytes(16), 1, 256 * KB, 0.0, report=True)
    return new


def _report_chunks(new: MetaCore, reports: dict[str, list[Parked]], now: float) -> int:
    """Each server's manifest in two chunks (block order within each), the
    namespace not registered: returns the records reported."""
    n = 0
    for sid, recs in reports.items():
        recs = sorted(recs, key=_pos)
        half = len(recs) // 2
        for i, part in enumerate((recs[:half], recs[half:])):
            got = new.report_columns(sid, 1, columns_of(part), i == 1, now)
            assert got == (0, 0)
            n += len(part)
    return n


def test_a_chunk_parked_whole_is_adopted_when_its_namespace_registers_late() -> None:
    old, fp = make(servers=2)
    prompts = [toks(p, 6) for p in range(8)]
    for i, t in enumerate(prompts):
        put(old, fp, t, float(i))
    reports = {sid: report_of(old, sid) for sid in ("s0", "s1")}
    new = _restarted(2)
    n = _report_chunks(new, reports, 1.0)
    assert n == old.stats()["objects"] > 0
    # Parked in columns: no object per record, every DRAM range held.
    assert new.parked.records == 0
    assert new.parked.chunk_rows == n and new.parked.chunks == 4
    assert new.stats()["parked_objects"] == n
    assert new.parked_of("s0") == len(reports["s0"])
    for sid in ("s0", "s1"):
        srv = new.servers[sid]
        assert srv.ready
        assert srv.allocator.used == old.servers[sid].allocator.used
    # Late namespace: every record adopted in one merged pass (parents on the other
    # server's chunks come first), none parked again one by one.
    new.register_namespace({"model": "m"}, old.namespaces[fp].layout.spec)
    assert new.stats()["objects"] == n
    assert new.stats()["parked_objects"] == 0 and new.parked.chunks == 0
    assert new.counters["objects_parked"] == n  # only the chunks themselves
    assert new.counters["objects_adopted"] == n
    assert all(not s.parked for s in new.servers.values())
    for sid in ("s0", "s1"):
        assert new.servers[sid].allocator.used == old.servers[sid].allocator.used
    ns = new.namespaces[fp]
    assert len(ns.entries) == len(old.namespaces[fp].entries)
    # Adopted objects are eviction candidates, the oldest (lowest seq) first.
    first = next(iter(new.evictions.candidates(0)))[0]
    assert first.entry.key in {k for k in old.namespaces[fp].entries}


def test_parked_chunks_expire_and_their_ranges_are_freed() -> None:
    old, fp = make(servers=2)
    for i in range(6):
        put(old, fp, toks(i, 5), float(i))
    reports = {sid: report_of(old, sid) for sid in ("s0", "s1")}
    new = _restarted(2, parked_ttl_s=5.0)
    n = _report_chunks(new, reports, 1.0)
    used = {sid: new.servers[sid].allocator.used for sid in ("s0", "s1")}
    assert all(used.values())
    new.expire_parked(3.0)
    assert new.parked.chunk_rows == n  # not yet
    new.expire_parked(7.0)
    assert new.counters["parked_expired"] == n
    assert new.parked.chunk_rows == 0 and new.parked.chunks == 0
    assert new.parked.waiting_for_namespace() == 0
    for sid in ("s0", "s1"):
        srv = new.servers[sid]
        assert srv.allocator.used == 0, "ranges not leaked"
        assert not srv.parked
        freed = heartbeat(new, sid, 7.5).free
        for r in reports[sid]:
            assert (r.offset, r.length) in freed
    # Registered after the expiry: nothing left to adopt, nothing adopted twice.
    new.register_namespace({"model": "m"}, old.namespaces[fp].layout.spec)
    assert new.stats()["objects"] == 0


def test_a_chunk_parked_before_its_report_completes_frees_to_the_server() -> None:
    old, fp = make(servers=1)
    for i in range(3):
        put(old, fp, toks(i, 4), float(i))
    recs = sorted(report_of(old, "s0"), key=_pos)
    new = _restarted(1, parked_ttl_s=5.0)
    assert new.report_columns("s0", 1, columns_of(recs), False, 1.0) == (0, 0)
    srv = new.servers["s0"]
    assert not srv.ready and len(srv.parked) == len(recs)
    new.expire_parked(7.0)  # report still in progress: nothing in the allocator yet
    assert not srv.parked and new.parked.chunk_rows == 0
    assert sorted(srv.freed) == sorted((r.offset, r.length) for r in recs)
    assert new.report_columns("s0", 1, columns_of([]), True, 8.0) == (0, 0)
    assert srv.ready and srv.allocator.used == 0


def test_the_parked_bound_drops_the_oldest_chunk_whole() -> None:
    old, fp = make(servers=1)
    for i in range(4):
        put(old, fp, toks(i, 4), float(i))
    recs = sorted(report_of(old, "s0"), key=_pos)
    half = len(recs) // 2
    new = _restarted(1, max_parked_objects=len(recs) - 1)
    new.report_columns("s0", 1, columns_of(recs[:half]), False, 1.0)
    new.report_columns("s0", 1, columns_of(recs[half:]), True, 1.0)
    assert new.parked.chunk_rows == len(recs) - half
    assert new.counters["parked_dropped"] == half
    srv = new.servers["s0"]
    assert srv.allocator.used == sum(r.length for r in recs[half:])
