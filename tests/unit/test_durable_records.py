"""Write grants bound to their object, and the server's manifest recording each
written object before its receipt (gcache.capability, gcache.server.core,
gcache.storage.manifest), over a real segment and a real manifest file."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import _native, capability, wire
from gcache.errors import E_ACCESS_DENIED, E_INTERNAL, GCacheError, Refusal
from gcache.server.core import DataPlaneCore, record_of
from gcache.storage.manifest import Manifest
from gcache.storage.record import StoredRecord
from gcache.storage.segment import Segment

CAP = 1 << 20
SECRET = b"s" * 16
NOW = 1_700_000_000_000
LATER = NOW + 10_000
NS = b"n" * 16


def info(key: int, pos: int = 1, group: int = 0, sums: bytes = bytes(16)) -> wire.ObjectInfo:
    return wire.ObjectInfo(NS, bytes([key]) * 16, b"p" * 16, pos, group, sums)


def bound(offset: int, length: int, obj: wire.ObjectInfo, expiry: int = LATER) -> wire.Grant:
    bind = capability.bind_digest(obj.namespace, obj.key, obj.parent, obj.pos, obj.group)
    tag = capability.mint(SECRET, capability.KIND_WRITE, offset, length, expiry, 0, 0, bind)
    return wire.Grant(offset, length, expiry, tag)


@pytest.fixture
def seg(tmp_path: Path) -> Iterator[Segment]:
    s = Segment(str(tmp_path / Segment.file_name("t")), CAP)
    yield s
    s.close()


class Log:
    """A recorder that appends to a real manifest and notes every call."""

    def __init__(self, path: Path) -> None:
        self.manifest = Manifest(str(path), "t@m")
        self.calls: list[list[StoredRecord]] = []
        self.fail = False

    def __call__(self, recs: list[StoredRecord]) -> None:
        if self.fail:
            raise GCacheError("disk full")
        self.manifest.record_writes(recs)
        self.calls.append(recs)


@pytest.fixture
def log(tmp_path: Path) -> Log:
    return Log(tmp_path / "m.manifest")


@pytest.fixture
def core(seg: Segment, log: Log) -> DataPlaneCore:
    return DataPlaneCore(seg, SECRET, recorder=log)


def test_bind_digest_is_canonical() -> None:
    base = (NS, b"k" * 16, b"p" * 16, 3, 1, (100, 200))
    d = capability.bind_digest(*base)
    assert len(d) == capability.BIND_SIZE and d == capability.bind_digest(*base)
    variants = [
        (b"m" * 16, b"k" * 16, b"p" * 16, 3, 1, (100, 200)),
        (NS, b"j" * 16, b"p" * 16, 3, 1, (100, 200)),
        (NS, b"k" * 16, b"q" * 16, 3, 1, (100, 200)),
        (NS, b"k" * 16, b"p" * 16, 4, 1, (100, 200)),
        (NS, b"k" * 16, b"p" * 16, 3, 0, (100, 200)),
        (NS, b"k" * 16, b"p" * 16, 3, 1, (200, 100)),
        (NS, b"k" * 16, b"p" * 16, 3, 1, ()),
        (NS + b"k", b"k" * 15, b"p" * 16, 3, 1, (100, 200)),  # field boundaries count
    ]
    assert len({capability.bind_digest(*v) for v in variants} | {d}) == len(variants) + 1
    assert capability.bind_digest(NS, b"k", b"", -1, 0) == b""  # unencodable: never minted


def test_write_records_before_its_receipt(core: DataPlaneCore, log: Log) -> None:
    obj = info(1)
    g = bound(0, 16, obj)
    msg = wire.Write(g, obj)
    view = core.write_target(msg, 16, NOW)
    view[:] = b"x" * 16
    assert log.calls == []  # nothing recorded before the payload is in
    rc = core.write_done(msg)
    assert rc == core.receipt(g)
    assert [r.key for r in log.calls[0]] == [obj.key]
    want = record_of(g, obj)
    want.seq = 1
    assert log.manifest.records[0] == want
    # Persisted: a fresh replay of the log holds it.
    again = Manifest(log.manifest.path, "t@m")
    again.load()
    assert list(again.records) == [0] and again.records[0].key == obj.key


def test_seal_records_every_grant_in_one_append(core: DataPlaneCore, log: Log) -> None:
    objs = [info(i) for i in range(1, 4)]
    grants = [bound(4096 * i, 64, o) for i, o in enumerate(objs)]
    appends = log.manifest.writes
    receipts = core.seal(wire.Seal(grants, objs), NOW)
    assert receipts == [core.receipt(g) for g in grants]
    assert len(log.calls) == 1 and len(log.calls[0]) == 3
    assert log.manifest.writes == appends + 1
    assert sorted(log.manifest.records) == [0, 4096, 8192]


@pytest.mark.parametrize(
    "forged",
    [
        info(2),  # another key
        wire.ObjectInfo(b"m" * 16, bytes([1]) * 16, b"p" * 16, 1, 0, bytes(16)),  # namespace
        info(1, pos=2),
        info(1, group=1),
        wire.ObjectInfo(NS, bytes([1]) * 16, b"q" * 16, 1, 0, bytes(16)),  # parent
        wire.ObjectInfo(NS, bytes([1]) * 16, b"p" * 16, 1, 0, bytes(16), [8, 8]),  # layers
    ],
)
def test_a_forged_record_is_refused_and_records_nothing(
    core: DataPlaneCore, log: Log, forged: wire.ObjectInfo
) -> None:
    g = bound(0, 16, info(1))
    for attempt in (
        lambda: core.write_target(wire.Write(g, forged), 16, NOW),
        lambda: core.write_target(wire.Write(g), 16, NOW),  # no record at all
        lambda: core.seal(wire.Seal([g], [forged]), NOW),
        lambda: core.seal(wire.Seal([g]), NOW),
    ):
        with pytest.raises(Refusal) as exc:
            attempt()
        assert exc.value.code == E_ACCESS_DENIED
    assert log.calls == [] and len(log.manifest) == 0
    assert core.stats()["used_grants"] == 0  # the refusals consumed nothing
    assert core.seal(wire.Seal([g], [info(1)]), NOW) == [core.receipt(g)]


def test_a_failed_append_gives_no_receipt(core: DataPlaneCore, log: Log) -> None:
    log.fail = True
    obj = info(1)
    msg = wire.Write(bound(0, 16, obj), obj)
    core.write_target(msg, 16, NOW)
    with pytest.raises(Refusal) as exc:
        core.write_done(msg)
    assert exc.value.code == E_INTERNAL
    with pytest.raises(Refusal):
        core.seal(wire.Seal([bound(4096, 16, info(2))], [info(2)]), NOW)
    assert core.stats()["record_failures"] == 2


def test_seal_records_must_match_the_grants(core: DataPlaneCore) -> None:
    g = bound(0, 16, info(1))
    with pytest.raises(Refusal):
        core.seal(wire.Seal([g], [info(1), info(2)]), NOW)
    with pytest.raises(Refusal):  # checksums not 8 bytes per layer
        core.write_target(wire.Write(g, info(1, sums=b"x" * 7)), 16, NOW)


# ---- the manifest: overlaps and stale frees ---------------------------------------------


def rec(offset: int, length: int, key: int = 1) -> StoredRecord:
    return StoredRecord(NS, bytes([key]) * 16, b"", 0, 0, 0, offset, length, bytes(8), 0)


def test_a_write_drops_the_records_its_range_overlaps(tmp_path: Path) -> None:
    m = Manifest(str(tmp_path / "m"), "o")
    m.record_writes([rec(0, 4096), rec(4096, 8192, 2), rec(16384, 4096, 3)])
    m.record_writes([rec(2048, 4096, 4)])  # overlaps the first two, not the third
    assert sorted(m.records) == [2048, 16384]
    assert m.overlaps_dropped == 2
    again = Manifest(m.path, "o")
    again.load()  # the replay reaches the same records
    assert sorted(again.records) == [2048, 16384]
    assert again.records[2048].key == bytes([4]) * 16


def test_a_free_older_than_a_write_spares_it(tmp_path: Path) -> None:
    """The meta freed a range and placed a new object there; the new write reached
    the server before the heartbeat reply carrying the free: the free must not drop
    the new record. A free of a record written before the last answered heartbeat
    was sent drops it."""
    m = Manifest(str(tmp_path / "m"), "o")
    m.record_writes([rec(0, 4096)])
    m.beat_sent()  # heartbeat 1
    m.apply([(0, 4096)], [])  # its reply frees the range: written before beat 1? no
    assert 0 in m.records and m.spared_frees == 1  # written after the last answered beat
    m.beat_answered()
    m.beat_sent()  # heartbeat 2
    m.record_writes([rec(8192, 4096, 2)])  # written after beat 2 was sent
    m.apply([(0, 4096), (8192, 4096)], [])  # reply 2: the first was written before beat 1
    assert sorted(m.records) == [8192]
    m.beat_answered()
    m.beat_sent()
    # Reply 3: its free may be older than the write, made after beat 2 was sent.
    m.apply([(8192, 4096)], [])
    assert sorted(m.records) == [8192]
    m.beat_answered()
    m.beat_sent()
    m.apply([(8192, 4096)], [])  # reply 4: made after beat 3 was sent, after the write
    assert m.records == {}
    # Records the meta was reported at registration are freed by any later free.
    m.record_writes([rec(0, 4096, 3)])
    m.registered()
    m.apply([(0, 4096)], [])
    assert m.records == {}


def test_a_stale_record_is_a_miss_not_wrong_bytes(tmp_path: Path) -> None:
    """A record whose range was rewritten behind its back (a shared-memory writer
    that never sealed) fails its checksums at the restart's verify: dropped."""
    seg = Segment(str(tmp_path / Segment.file_name("v")), CAP)
    try:
        seg.view[0:64] = b"a" * 64
        sums = _native.checksums([seg.view[0:32], seg.view[32:64]], 1)
        m = Manifest(str(tmp_path / "m"), "o")
        good = StoredRecord(NS, b"k" * 16, b"", 0, 0, 0, 0, 64, sums, 0)
        stale = StoredRecord(NS, b"j" * 16, b"", 0, 0, 0, 4096, 64, sums, 0)
        m.record_writes([good, stale])
        seg.view[4096 : 4096 + 64] = b"b" * 64  # rewritten, never recorded
        again = Manifest(m.path, "o")
        again.load()
        assert again.verify(seg.view) == 1 and list(again.records) == [0]
    finally:
        seg.close()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 63), st.integers(1, 8)),
        min_size=1,
        max_size=40,
    )
)
def test_records_never_overlap(tmp_path_factory: pytest.TempPathFactory, writes: list) -> None:  # type: ignore[type-arg]
    """Whatever the writes, the manifest's records are disjoint (a rebuild never
    sees two objects in one byte), live and replayed alike, and the last write of
    each range is kept."""
    path = tmp_path_factory.mktemp("m") / "m"
    m = Manifest(str(path), "o")
    for i, (unit, n) in enumerate(writes):
        m.record_writes([rec(unit * 4096, n * 4096, i % 256)])
    for mm in (m, _replayed(str(path))):
        spans = sorted((r.offset, r.offset + r.length) for r in mm.records.values())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    last_unit, last_n = writes[-1]
    assert m.records[last_unit * 4096].length == last_n * 4096


def _replayed(path: str) -> Manifest:
    m = Manifest(path, "o")
    m.load()
    return m
