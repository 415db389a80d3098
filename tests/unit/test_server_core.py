"""The storage daemon's sync core (gcache.server.core) over a real shared-memory
segment (gcache.storage.segment) with capabilities (gcache.capability)."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import capability, wire
from gcache.errors import (
    E_ACCESS_DENIED,
    E_BAD_REQUEST,
    E_NO_SPACE,
    E_OUT_OF_RANGE,
    GCacheError,
    Refusal,
)
from gcache.server.core import MAX_READ_RANGES, READ_BATCH, DataPlaneCore
from gcache.storage.segment import Segment

CAP = 1 << 20
SECRET = b"s" * 16
NOW = 1_700_000_000_000
LATER = NOW + 10_000


def grant(
    kind: bytes, offset: int, length: int, expiry: int = LATER, secret: bytes = SECRET
) -> wire.Grant:
    return wire.Grant(offset, length, expiry, capability.mint(secret, kind, offset, length, expiry))


def wgrant(offset: int, length: int, expiry: int = LATER) -> wire.Grant:
    return grant(capability.KIND_WRITE, offset, length, expiry)


def rgrant(offset: int, length: int, expiry: int = LATER) -> wire.Grant:
    return grant(capability.KIND_READ, offset, length, expiry)


@pytest.fixture
def seg(tmp_path: Path) -> Iterator[Segment]:
    path = tmp_path / Segment.file_name("t")
    s = Segment(str(path), CAP)
    assert path.exists() and path.stat().st_size == CAP
    yield s
    s.close()
    assert not path.exists()  # close unlinks the file


@pytest.fixture
def core(seg: Segment) -> DataPlaneCore:
    return DataPlaneCore(seg, SECRET)


def refused(exc: pytest.ExceptionInfo[Refusal], code: int) -> None:
    assert exc.value.code == code, exc.value.message


def write(core: DataPlaneCore, g: wire.Grant, data: bytes, now: int = NOW) -> None:
    with core.write_target(wire.Write(g), len(data), now) as view:
        view[:] = data


def read(core: DataPlaneCore, msg: wire.Read, now: int = NOW) -> bytes:
    reply = core.read_views(msg, now)
    views = reply.views()
    out = b"".join(bytes(v) for v in views)
    for v in views:
        v.release()
    assert reply.total == len(out) and len(reply) == len(msg.ranges)
    return out


# ---- capability --------------------------------------------------------------------


def test_mint_is_keyed_blake2b_of_packed_fields() -> None:
    expected = hashlib.blake2b(
        b"W" + struct.pack("!QQQBQ", 4096, 100, LATER, 0, 0), key=SECRET, digest_size=8
    ).digest()
    assert capability.mint(SECRET, b"W", 4096, 100, LATER) == expected
    assert capability.check(SECRET, b"W", 4096, 100, LATER, expected)
    assert not capability.check(SECRET, b"R", 4096, 100, LATER, expected)
    assert not capability.check(SECRET, b"W", 4096, 101, LATER, expected)
    assert not capability.check(SECRET, b"W", 4097, 100, LATER, expected)
    assert not capability.check(SECRET, b"W", 4096, 100, LATER + 1, expected)
    assert not capability.check(b"t" * 16, b"W", 4096, 100, LATER, expected)
    assert not capability.check(SECRET, b"W", 4096, 100, LATER, expected[:7])


# ---- segment -----------------------------------------------------------------------


def test_segment_basics(seg: Segment) -> None:
    assert seg.capacity == CAP and len(seg.view) == CAP
    assert seg.in_bounds(0, CAP)
    assert seg.in_bounds(CAP, 0)
    assert not seg.in_bounds(0, CAP + 1)
    assert not seg.in_bounds(1, CAP)
    assert not seg.in_bounds(-1, 1)
    assert not seg.in_bounds(0, -1)
    with pytest.raises(GCacheError):  # O_EXCL: never reuse someone else's file
        Segment(seg.path, CAP)
    name = Segment.file_name("host:7800/a b")
    assert "/" not in name and ":" not in name and " " not in name
    assert name.startswith("gcache-host_7800_a_b-") and name.endswith(".seg")


def test_remove_stale_segments(tmp_path: Path) -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no live process
    dead, alive = child.pid, os.getpid()
    names = [
        f"gcache-srv-{dead}.seg",  # stale: removed
        f"gcache-srv-{alive}.seg",  # live process: kept
        "gcache-srv-notapid.seg",  # not ours to judge: kept
        f"gcache-other-{dead}.seg",  # another server id: kept
        f"gcache-srv-{dead}.tmp",  # not a segment: kept
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert Segment.remove_stale(str(tmp_path), "srv") == [f"gcache-srv-{dead}.seg"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    assert Segment.remove_stale(str(tmp_path / "absent"), "srv") == []


# ---- WRITE -------------------------------------------------------------------------


def test_valid_write_targets_the_granted_range(core: DataPlaneCore, seg: Segment) -> None:
    g = wgrant(4096, 1000)
    view = core.write_target(wire.Write(g), 1000, NOW)
    assert len(view) == 1000
    view[:] = bytes(range(250)) * 4
    view.release()
    # the bytes landed at the granted offset of the shared file itself
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        assert os.pread(fd, 1000, 4096) == bytes(range(250)) * 4
        assert os.pread(fd, 1, 4095) == b"\0"
        assert os.pread(fd, 1, 5096) == b"\0"
    finally:
        os.close(fd)
    assert core.stats()["writes"] == 1 and core.stats()["write_bytes"] == 1000


def test_write_edges_of_segment(core: DataPlaneCore) -> None:
    write(core, wgrant(0, 8), b"A" * 8)
    write(core, wgrant(CAP - 8, 8), b"Z" * 8)
    assert read(core, wire.Read([rgrant(0, CAP)], [(0, 0, 8), (0, CAP - 8, 8)])) == (
        b"A" * 8 + b"Z" * 8
    )


def test_write_payload_length_mismatch(core: DataPlaneCore) -> None:
    g = wgrant(0, 100)
    for n in (99, 101, 0):
        with pytest.raises(Refusal) as exc:
            core.write_target(wire.Write(g), n, NOW)
        refused(exc, E_BAD_REQUEST)


@pytest.mark.parametrize("expiry", [NOW, NOW - 1, 0])
def test_write_expired_grant(core: DataPlaneCore, expiry: int) -> None:
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(wgrant(0, 10, expiry)), 10, NOW)
    refused(exc, E_ACCESS_DENIED)


def test_write_forged_grants(core: DataPlaneCore) -> None:
    good = wgrant(4096, 64)
    forgeries = [
        wire.Grant(4096, 64, LATER, b"\0" * 8),
        wire.Grant(4096, 64, LATER, bytes([good.tag[0] ^ 1]) + good.tag[1:]),
        wire.Grant(4096, 64, LATER, b""),
        wire.Grant(0, 64, LATER, good.tag),  # moved range
        wire.Grant(4096, 64, LATER + 1, good.tag),  # extended expiry
        grant(capability.KIND_WRITE, 4096, 64, secret=b"x" * 16),  # other server's key
        rgrant(4096, 64),  # a READ grant
    ]
    for forged in forgeries:
        with pytest.raises(Refusal) as exc:
            core.write_target(wire.Write(forged), forged.length, NOW)
        refused(exc, E_ACCESS_DENIED)
    assert core.stats()["refused"] == len(forgeries)
    assert core.stats()["writes"] == 0


@pytest.mark.parametrize(
    ("offset", "length"), [(CAP - 10, 20), (CAP, 1), (CAP + 4096, 8), (0, CAP + 1)]
)
def test_write_outside_segment(core: DataPlaneCore, offset: int, length: int) -> None:
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(wgrant(offset, length)), length, NOW)
    refused(exc, E_OUT_OF_RANGE)


def test_write_negative_offset(core: DataPlaneCore) -> None:
    g = wire.Grant(-8, 16, LATER, b"\0" * 8)  # cannot even be minted
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(g), 16, NOW)
    refused(exc, E_OUT_OF_RANGE)


# ---- READ --------------------------------------------------------------------------


def test_reads_return_written_bytes(core: DataPlaneCore) -> None:
    a, b = os.urandom(3000), os.urandom(500)
    write(core, wgrant(8192, 3000), a)
    write(core, wgrant(65536, 500), b)
    ga, gb = rgrant(8192, 3000), rgrant(65536, 500)
    msg = wire.Read([ga, gb], [(0, 8192, 3000), (1, 65536 + 100, 50), (0, 8192 + 7, 1)])
    assert read(core, msg) == a + b[100:150] + a[7:8]
    # the same grants again (verified once, cached), other ranges
    assert read(core, wire.Read([ga, gb], [(1, 65536, 500), (0, 8192 + 2999, 1)])) == (b + a[2999:])
    s = core.stats()
    assert s["reads"] == 2 and s["read_bytes"] == 3051 + 501
    assert s["writes"] == 2 and s["write_bytes"] == 3500 and s["refused"] == 0
    assert s["capacity"] == CAP


def test_read_empty_ranges(core: DataPlaneCore) -> None:
    reply = core.read_views(wire.Read([rgrant(0, 10)], []), NOW)
    assert reply.views() == [] and reply.total == 0


@pytest.mark.parametrize(
    "rng",
    [
        (0, 4095, 10),  # starts before the grant
        (0, 4096, 1025),  # ends after it
        (0, 4096 + 1024, 1),  # starts at its end
        (0, 4096, 0),  # empty range
        (0, 4096, -5),
        (0, 0, 4096),  # elsewhere in the segment
    ],
)
def test_read_range_outside_its_grant(core: DataPlaneCore, rng: tuple[int, int, int]) -> None:
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([rgrant(4096, 1024)], [(0, 4096, 8), rng]), NOW)
    refused(exc, E_OUT_OF_RANGE)
    assert core.stats()["refused"] == 1 and core.stats()["reads"] == 0


def test_read_range_inside_other_grant_only(core: DataPlaneCore) -> None:
    """A range must lie inside the grant it names, not just inside some grant."""
    msg = wire.Read([rgrant(0, 100), rgrant(1000, 100)], [(0, 1000, 10)])
    with pytest.raises(Refusal) as exc:
        core.read_views(msg, NOW)
    refused(exc, E_OUT_OF_RANGE)


@pytest.mark.parametrize("gi", [1, 2, -1, 2**31])
def test_read_grant_index_out_of_range(core: DataPlaneCore, gi: int) -> None:
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([rgrant(0, 100)], [(gi, 0, 10)]), NOW)
    refused(exc, E_BAD_REQUEST)


def test_read_with_no_grants(core: DataPlaneCore) -> None:
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([], [(0, 0, 1)]), NOW)
    refused(exc, E_BAD_REQUEST)


def test_read_with_write_grant(core: DataPlaneCore) -> None:
    g = wgrant(0, 64)
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([g], [(0, 0, 64)]), NOW)
    refused(exc, E_ACCESS_DENIED)
    # still refused after the tag was verified (and cached) for a WRITE
    write(core, g, b"w" * 64)
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([g], [(0, 0, 64)]), NOW)
    refused(exc, E_ACCESS_DENIED)
    # and a READ grant, once verified, does not open WRITE access
    r = rgrant(0, 64)
    assert read(core, wire.Read([r], [(0, 0, 64)])) == b"w" * 64
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(r), 64, NOW)
    refused(exc, E_ACCESS_DENIED)


def test_cached_tag_does_not_cover_altered_grant(core: DataPlaneCore) -> None:
    g = rgrant(0, 64)
    read(core, wire.Read([g], [(0, 0, 64)]))  # verified and cached
    for altered in (
        wire.Grant(0, 128, g.expiry_ms, g.tag),
        wire.Grant(64, 64, g.expiry_ms, g.tag),
        wire.Grant(0, 64, g.expiry_ms + 1000, g.tag),
    ):
        with pytest.raises(Refusal) as exc:
            core.read_views(wire.Read([altered], [(0, altered.offset, 1)]), NOW)
        refused(exc, E_ACCESS_DENIED)
    # a cached grant still expires
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([g], [(0, 0, 64)]), g.expiry_ms)
    refused(exc, E_ACCESS_DENIED)


def test_read_any_bad_grant_refuses_whole_read(core: DataPlaneCore) -> None:
    bad = wire.Grant(100, 10, LATER, b"\0" * 8)
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([rgrant(0, 10), bad], [(0, 0, 10)]), NOW)
    refused(exc, E_ACCESS_DENIED)
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([rgrant(CAP - 4, 8)], []), NOW)
    refused(exc, E_OUT_OF_RANGE)
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([rgrant(0, 10, NOW - 1)], [(0, 0, 10)]), NOW)
    refused(exc, E_ACCESS_DENIED)


def test_too_many_ranges(core: DataPlaneCore) -> None:
    g = rgrant(0, MAX_READ_RANGES)
    ok = wire.Read([g], [(0, i, 1) for i in range(MAX_READ_RANGES)])
    reply = core.read_views(ok, NOW)
    assert reply.total == MAX_READ_RANGES
    batches = list(reply.batches())
    assert len(batches) == MAX_READ_RANGES // READ_BATCH
    assert all(len(b) == READ_BATCH for b in batches)
    for b in batches:
        for v in b:
            v.release()
    with pytest.raises(Refusal) as exc:
        core.read_views(wire.Read([g], [(0, 0, 1)] * (MAX_READ_RANGES + 1)), NOW)
    refused(exc, E_BAD_REQUEST)


def test_read_reply_at_most_its_distinct_grants(core: DataPlaneCore) -> None:
    """Ranges may repeat granted bytes, but the reply is at most what the READ's
    distinct grants cover: 65536 copies of one grant made a tiny request ask for
    65536 times its grant."""
    g, h = rgrant(0, 64), rgrant(4096, 32)
    write(core, wgrant(0, 64), b"a" * 64)
    assert read(core, wire.Read([g, h], [(0, 0, 64), (0, 0, 32)])) == b"a" * 96  # <= 96
    for msg in (
        wire.Read([g], [(0, 0, 64), (0, 0, 1)]),
        wire.Read([g, g, g], [(0, 0, 64), (1, 0, 64)]),  # a repeated grant counts once
        wire.Read([g], [(0, 0, 64)] * MAX_READ_RANGES),
    ):
        with pytest.raises(Refusal) as exc:
            core.read_views(msg, NOW)
        refused(exc, E_BAD_REQUEST)
        assert "distinct grants cover" in exc.value.message
    assert core.stats()["refused"] == 3 and core.stats()["reads"] == 1


def test_refusal_counters(core: DataPlaneCore) -> None:
    write(core, wgrant(0, 10), b"0123456789")
    attempts = [
        lambda: core.write_target(wire.Write(wgrant(0, 10)), 9, NOW),
        lambda: core.write_target(wire.Write(wgrant(0, 10, NOW)), 10, NOW),
        lambda: core.write_target(wire.Write(wgrant(CAP, 10)), 10, NOW),
        lambda: core.read_views(wire.Read([rgrant(0, 10)], [(0, 5, 10)]), NOW),
        lambda: core.read_views(wire.Read([rgrant(0, 10)], [(3, 0, 1)]), NOW),
    ]
    for i, attempt in enumerate(attempts, 1):
        with pytest.raises(Refusal):
            attempt()
        assert core.stats()["refused"] == i
    assert read(core, wire.Read([rgrant(0, 10)], [(0, 2, 3)])) == b"234"
    assert core.stats() == {
        "capacity": CAP,
        "reads": 1,
        "writes": 1,
        "read_bytes": 3,
        "write_bytes": 10,
        "refused": 5,
        "freed_bytes": 0,
        "seals": 0,
        "sealed_bytes": 0,
        "replays_refused": 0,
        "old_epoch_refused": 0,
        "epoch": 0,
        "used_grants": 1,
        "records_persisted": 0,
        "record_failures": 0,
    }


def test_free_counts_in_bounds_only(core: DataPlaneCore) -> None:
    core.free(0, 4096)
    core.free(CAP - 10, 20)
    core.free(-1, 5)
    assert core.stats()["freed_bytes"] == 4096


# ---- property: the range rule ----------------------------------------------------------

_ids = itertools.count()


@settings(max_examples=60, deadline=None)
@given(
    goff=st.integers(0, CAP - 1),
    glen=st.integers(1, 4096),
    ranges=st.lists(
        st.tuples(st.integers(-1, 1), st.integers(-10, 8200), st.integers(-2, 5000)),
        min_size=1,
        max_size=4,
    ),
)
def test_range_rule(
    tmp_path_factory: pytest.TempPathFactory,
    goff: int,
    glen: int,
    ranges: list[tuple[int, int, int]],
) -> None:
    glen = min(glen, CAP - goff)
    seg = Segment(str(tmp_path_factory.getbasetemp() / f"prop-{next(_ids)}.seg"), CAP)
    try:
        core = DataPlaneCore(seg, SECRET)
        data = os.urandom(glen)
        write(core, wgrant(goff, glen), data)
        # absolute offsets near the grant
        abs_ranges = [(gi, goff + off - 5, n) for gi, off, n in ranges]
        g = rgrant(goff, glen)
        expected = b""
        code = None
        for gi, off, n in abs_ranges:
            if gi != 0:
                code = E_BAD_REQUEST
                break
            if n <= 0 or off < goff or off + n > goff + glen:
                code = E_OUT_OF_RANGE
                break
            expected += data[off - goff : off - goff + n]
        if code is None and len(expected) > glen:
            code = E_BAD_REQUEST  # more bytes than the grant covers
        if code is None:
            assert read(core, wire.Read([g], abs_ranges)) == expected
        else:
            with pytest.raises(Refusal) as exc:
                core.read_views(wire.Read([g], abs_ranges), NOW)
            refused(exc, code)
    finally:
        seg.close()


# ---- one-shot write grants, receipts, SEAL ------------------------------------------


def test_replayed_write_grant_is_refused(core: DataPlaneCore) -> None:
    g = wgrant(4096, 16)
    write(core, g, b"a" * 16)
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(g), 16, NOW + 1)
    refused(exc, E_ACCESS_DENIED)
    assert "already used" in exc.value.message
    assert read(core, wire.Read([rgrant(4096, 16)], [(0, 4096, 16)])) == b"a" * 16
    assert core.stats()["writes"] == 1 and core.stats()["replays_refused"] == 1


def test_write_receipt_verifies_with_the_secret(core: DataPlaneCore) -> None:
    g = wgrant(8192, 32)
    write(core, g, b"r" * 32)
    r = core.receipt(g)
    assert r == capability.receipt(SECRET, 8192, 32, LATER)
    assert 0 <= r < 1 << 64
    assert r != capability.receipt(SECRET, 8192, 32, LATER + 1)
    assert r != capability.receipt(b"t" * 16, 8192, 32, LATER)


def test_seal_consumes_grants_and_returns_receipts(core: DataPlaneCore) -> None:
    a, b = wgrant(0, 100), wgrant(4096, 200)
    receipts = core.seal(wire.Seal([a, b]), NOW)
    assert receipts == [
        capability.receipt(SECRET, 0, 100, LATER),
        capability.receipt(SECRET, 4096, 200, LATER),
    ]
    st = core.stats()
    assert st["writes"] == 2 and st["write_bytes"] == 300 and st["sealed_bytes"] == 300
    assert st["seals"] == 1
    # SEAL then WRITE with the same grant: refused; SEAL again: refused.
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(a), 100, NOW)
    refused(exc, E_ACCESS_DENIED)
    with pytest.raises(Refusal) as exc:
        core.seal(wire.Seal([b]), NOW)
    refused(exc, E_ACCESS_DENIED)


def test_write_then_seal_refused(core: DataPlaneCore) -> None:
    g = wgrant(0, 8)
    write(core, g, b"x" * 8)
    with pytest.raises(Refusal) as exc:
        core.seal(wire.Seal([g]), NOW)
    refused(exc, E_ACCESS_DENIED)


def test_seal_is_all_or_nothing(core: DataPlaneCore) -> None:
    good, used = wgrant(0, 8), wgrant(4096, 8)
    write(core, used, b"u" * 8)
    for bad in (
        [good, used],  # one already used
        [good, good],  # the same grant twice
        [good, rgrant(8192, 8)],  # a read grant
        [good, wgrant(8192, 8, NOW)],  # expired
        [good, wire.Grant(8192, 8, LATER, b"\0" * 8)],  # forged
    ):
        with pytest.raises(Refusal):
            core.seal(wire.Seal(bad), NOW)
    # none of the refused SEALs consumed ``good``
    assert core.seal(wire.Seal([good]), NOW) == [core.receipt(good)]


def test_used_grant_table_is_bounded_and_refuses_when_full(seg: Segment) -> None:
    core = DataPlaneCore(seg, SECRET, max_used_grants=3)
    for i in range(3):
        write(core, wgrant(i * 4096, 8, LATER + i), b"z" * 8)
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(wgrant(5 * 4096, 8)), 8, NOW)
    refused(exc, E_NO_SPACE)
    with pytest.raises(Refusal) as exc:
        core.seal(wire.Seal([wgrant(6 * 4096, 8)]), NOW)
    refused(exc, E_NO_SPACE)
    # The used grants are still remembered (a replay is refused, not forgotten).
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(wgrant(0, 8, LATER)), 8, NOW)
    refused(exc, E_ACCESS_DENIED)
    # Once the first grant has expired it is forgotten, which frees a slot; it
    # cannot be replayed since an expired grant fails the expiry check.
    write(core, wgrant(7 * 4096, 8, LATER + 10), b"n" * 8, now=LATER)
    assert core.stats()["used_grants"] == 3
    with pytest.raises(Refusal) as exc:
        core.write_target(wire.Write(wgrant(0, 8, LATER)), 8, LATER)
    refused(exc, E_ACCESS_DENIED)
    # A SEAL that would overflow the table is refused whole.
    with pytest.raises(Refusal) as exc:
        core.seal(
            wire.Seal([wgrant(8 * 4096, 8, LATER + 10), wgrant(9 * 4096, 8, LATER + 10)]), LATER + 1
        )
    refused(exc, E_NO_SPACE)
