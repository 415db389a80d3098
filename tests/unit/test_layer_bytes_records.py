"""Per-layer byte lengths in a server's records: objects whose layers
differ in size are checked layer by layer at restart (DRAM manifest) and keep their
lengths on the NVMe tier (version 2 record headers); records without lengths (equal
layers, and everything older servers wrote) read as before."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from gcache import _native
from gcache.storage import manifest as mf
from gcache.storage.manifest import Manifest
from gcache.storage.nvme import NvmeTier
from gcache.storage.record import StoredRecord

MiB = 1 << 20
SIZES = (4096, 1024, 3072)  # three layers of one object, unequal


def _rec(i: int, offset: int, sums: bytes, layer_bytes: tuple[int, ...]) -> StoredRecord:
    return StoredRecord(
        namespace=b"n" * 16,
        key=i.to_bytes(16, "big"),
        parent=b"",
        pos=0,
        group=0,
        tier=0,
        offset=offset,
        length=sum(SIZES),
        sums=sums,
        seq=0,
        layer_bytes=layer_bytes,
    )


def _sums(data: bytes, sizes: tuple[int, ...]) -> bytes:
    view, parts, off = memoryview(data), [], 0
    for n in sizes:
        parts.append(view[off : off + n])
        off += n
    return _native.checksums(parts, 1)


def test_manifest_checks_unequal_layers_by_their_lengths(tmp_path: Path) -> None:
    seg = bytearray(os.urandom(64 * 1024))
    obj = bytes(seg[8192 : 8192 + sum(SIZES)])
    good = _rec(1, 8192, _sums(obj, SIZES), SIZES)
    old_style = _rec(2, 8192, good.sums, ())  # no lengths: equal thirds, impossible
    parts = mf.layers(old_style, memoryview(seg))
    assert parts is None or _native.checksums(parts, 1) != good.sums
    m = Manifest(str(tmp_path / "m.log"), "s@meta")
    m.load()
    m.apply([], [good], memoryview(seg))
    m.close()
    again = Manifest(str(tmp_path / "m.log"), "s@meta")
    again.load()
    assert [r.layer_bytes for r in again] == [SIZES], "the lengths are in the log"
    assert again.verify(memoryview(seg)) == 1 and again.dropped == 0
    again.close()
    bad = _rec(3, 8192, good.sums, (4096, 1024, 3071))  # do not add up: dropped
    assert mf.layers(bad, memoryview(seg)) is None


def test_manifest_logs_of_older_servers_still_replay(tmp_path: Path) -> None:
    """An ADD entry written before StoredRecord had layer_bytes (11 fields)."""
    seg = bytearray(os.urandom(64 * 1024))
    sizes = (4096, 4096)
    obj = bytes(seg[:8192])
    old = [b"n" * 16, (5).to_bytes(16, "big"), b"", 0, 0, 0, 0, 8192, _sums(obj, sizes), 1, 0]
    path = tmp_path / "m.log"
    owner = mf.frame(mf._Entry(mf.KIND_OWNER, owner="s@meta"))
    body = msgspec.msgpack.encode([mf.KIND_ADD, old])
    import struct
    import zlib

    path.write_bytes(owner + struct.pack("<II", len(body), zlib.crc32(body)) + body)
    m = Manifest(str(path), "s@meta")
    m.load()
    assert [r.layer_bytes for r in m] == [()]
    assert m.verify(memoryview(seg)) == 1
    m.close()


def test_nvme_records_keep_layer_lengths_and_old_records_read(tmp_path: Path) -> None:
    t = NvmeTier(str(tmp_path / "t"), 16 * MiB)
    payload = os.urandom(sum(SIZES))
    uneven = _rec(1, 0, _sums(payload, SIZES), SIZES)
    even = _rec(2, 0, b"\0" * 24, ())  # version 1 header, as older servers wrote
    a = t.append(uneven, memoryview(payload))
    b = t.append(even, memoryview(payload))
    c = t.append(_rec(3, 0, uneven.sums, SIZES), memoryview(payload))
    t.drop(c, len(payload))  # a version 2 tombstone
    t.sync()
    t.close()
    t = NvmeTier(str(tmp_path / "t"), 16 * MiB)
    recs = {r.offset: r for r in t.scan()}
    assert sorted(recs) == sorted([a, b])
    assert recs[a].layer_bytes == SIZES and recs[a].sums == uneven.sums
    assert recs[b].layer_bytes == ()
    t.close()
