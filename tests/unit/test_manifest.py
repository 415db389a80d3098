"""The server's DRAM manifest (gcache/storage/manifest.py): an append log of CRC
frames replayed at start; torn or damaged frames and changed bytes are dropped."""

from __future__ import annotations

import os
from pathlib import Path

from gcache import _native
from gcache.storage.manifest import Manifest
from gcache.storage.record import StoredRecord

SEG: memoryview | None = None  # the segment _rec takes its checksums from


def _sums(seg: memoryview, offset: int, length: int, layers: int = 2) -> bytes:
    step = length // layers
    parts = [seg[offset + j * step : offset + (j + 1) * step] for j in range(layers)]
    return _native.checksums(parts, 1)


def _rec(i: int, offset: int, length: int = 4096, seg: memoryview | None = None) -> StoredRecord:
    seg = seg if seg is not None else SEG
    assert seg is not None
    return StoredRecord(
        namespace=b"n" * 16,
        key=i.to_bytes(16, "big"),
        parent=(i - 1).to_bytes(16, "big") if i else b"",
        pos=i,
        group=0,
        tier=0,
        offset=offset,
        length=length,
        sums=_sums(seg, offset, length),  # two layers, as the putter computed them
        seq=0,
    )


def _segment(n: int = 16) -> memoryview:
    global SEG
    SEG = memoryview(bytearray(os.urandom(n * 4096)))
    return SEG


def _reopen(path: Path, seg: memoryview | None) -> Manifest:
    m = Manifest(str(path))
    m.load()
    m.verify(seg)
    return m


def test_records_survive_a_restart(tmp_path: Path) -> None:
    seg = _segment()
    m = Manifest(str(tmp_path / "m"))
    m.load()
    m.verify(seg)
    assert m.apply([], [_rec(i, i * 4096) for i in range(8)], seg) == 8
    m.apply([(3 * 4096, 4096)], [], seg)
    m.close()  # no clean shutdown step exists: a kill -9 leaves the same file
    m2 = _reopen(tmp_path / "m", seg)
    assert sorted(r.offset // 4096 for r in m2) == [0, 1, 2, 4, 5, 6, 7]
    r = m2.records[4096]
    assert r.key == (1).to_bytes(16, "big") and r.parent == bytes(16)
    assert r.sums == _sums(seg, 4096, 4096)
    assert len({r.seq for r in m2}) == 7


def test_torn_tail_is_dropped(tmp_path: Path) -> None:
    seg = _segment()
    m = Manifest(str(tmp_path / "m"))
    m.load()
    m.verify(seg)
    for i in range(6):
        m.apply([], [_rec(i, i * 4096)], seg)
    m.close()
    path = tmp_path / "m"
    size = path.stat().st_size
    os.truncate(path, size - 5)  # the last append was cut short
    m2 = _reopen(path, seg)
    assert sorted(r.offset // 4096 for r in m2) == [0, 1, 2, 3, 4]
    assert m2.bad_frames == 1


def test_corrupted_frame_ends_the_replay(tmp_path: Path) -> None:
    seg = _segment()
    m = Manifest(str(tmp_path / "m"))
    m.load()
    m.verify(seg)
    for i in range(6):
        m.apply([], [_rec(i, i * 4096)], seg)
    m.close()
    path = tmp_path / "m"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damage one byte in the middle of the log
    path.write_bytes(bytes(data))
    m2 = _reopen(path, seg)
    kept = sorted(r.offset // 4096 for r in m2)
    assert m2.bad_frames == 1 and kept == list(range(len(kept))) and len(kept) < 6


def test_changed_bytes_are_not_readopted(tmp_path: Path) -> None:
    seg = _segment()
    m = Manifest(str(tmp_path / "m"))
    m.load()
    m.verify(seg)
    m.apply([], [_rec(i, i * 4096) for i in range(4)], seg)
    m.close()
    seg[2 * 4096 + 100] ^= 0x01  # one bit of object 2 changed while the server was down
    m2 = _reopen(tmp_path / "m", seg)
    assert sorted(r.offset // 4096 for r in m2) == [0, 1, 3] and m2.dropped == 1
    m2.close()
    assert len(_reopen(tmp_path / "m", None)) == 0, "no segment to re-adopt: nothing kept"


def test_log_is_compacted(tmp_path: Path) -> None:
    seg = _segment(4)
    m = Manifest(str(tmp_path / "m"))
    m.load()
    m.verify(seg)
    for _ in range(20000):
        m.apply([(0, 4096)], [_rec(1, 0)], seg)
    assert m.stats()["log_bytes"] < (1 << 20) * 3
    assert (tmp_path / "m").stat().st_size < (1 << 20) * 3
    m.close()
    m2 = _reopen(tmp_path / "m", seg)
    assert [r.offset for r in m2] == [0]


def test_adopt_reads_no_byte_and_restart_checks_each_layer(tmp_path: Path) -> None:
    """Recording an object takes the checksums it carries (a segment whose bytes
    differ from them is not even looked at); the restart checks every layer (in
    batches smaller than one object here) and drops what no longer matches: a
    changed byte in a second layer, checksums that never matched, a length that
    does not split into its layers, a record without checksums."""
    seg = _segment(64)
    m = Manifest(str(tmp_path / "m"))
    m.load()
    m.verify(seg)
    recs = [_rec(i, i * 8192, 8192) for i in range(6)]
    recs[3].sums = bytes(16)  # never matched
    recs[4].length, recs[4].sums = 8191, _sums(seg, 4 * 8192, 8190)  # odd split
    recs[5].sums = b""
    assert m.apply([], recs, seg) == 6
    assert all(r.digest == 0 for r in m)
    m.close()
    seg[1 * 8192 + 4096 + 7] ^= 0x10  # object 1, second layer
    m2 = Manifest(str(tmp_path / "m"))
    m2.load()
    assert m2.verify(seg, batch=4096) == 2
    assert sorted(r.offset for r in m2) == [0, 2 * 8192] and m2.dropped == 4
    assert m2.verified_bytes == 2 * 8192
