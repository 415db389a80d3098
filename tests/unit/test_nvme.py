"""The NVMe tier (gcache/storage/nvme.py): log-structured regions in a few large
preallocated files, records replayed from region headers at start, torn writes and
damaged bytes dropped, regions reclaimed whole."""

from __future__ import annotations

import mmap
import os
import sys
import threading
from pathlib import Path

import pytest

from gcache.errors import GCacheError
from gcache.storage.nvme import BLOCK, NvmeTier, geometry
from gcache.storage.record import StoredRecord

MiB = 1 << 20


def _rec(i: int) -> StoredRecord:
    return StoredRecord(
        namespace=b"n" * 16,
        key=i.to_bytes(16, "big"),
        parent=(i - 1).to_bytes(16, "big") if i else b"",
        pos=i,
        group=i % 3,
        tier=0,
        offset=0,
        length=0,
        sums=i.to_bytes(8, "big") * 3,
        seq=0,
    )


def _payload(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "big") + os.urandom(60)) * (n // 64) + b"x" * (n % 64)


def _read(t: NvmeTier, addr: int, n: int) -> bytes:
    buf = bytearray(n)
    t.read_into(addr, memoryview(buf))
    return bytes(buf)


def test_geometry_few_large_files() -> None:
    assert geometry(256 * MiB) == (1, 8, 32 * MiB)
    files, per_file, region = geometry(1 << 40)
    assert files == 8 and region == 64 * MiB and per_file * files * region <= 1 << 40
    with pytest.raises(GCacheError, match="too small"):
        geometry(MiB)


def test_objects_survive_reopen_byte_exact(tmp_path: Path) -> None:
    t = NvmeTier(str(tmp_path / "b"), 16 * MiB)
    want: dict[int, tuple[int, bytes]] = {}
    for i, n in enumerate([100, 4096, 5000, 300_000, 1 * MiB + 17]):
        p = _payload(i, n)
        want[t.append(_rec(i), memoryview(p))] = (i, p)
    t.sync()
    assert len(t.files) == 1 and (tmp_path / "b" / "tier-0.dat").stat().st_size == 16 * MiB
    t.close()
    t = NvmeTier(str(tmp_path / "b"), 16 * MiB)
    recs = {r.offset: r for r in t.scan()}
    assert sorted(recs) == sorted(want)
    for addr, (i, p) in want.items():
        r = recs[addr]
        assert (r.key, r.pos, r.group, r.tier, r.length) == (_rec(i).key, i, i % 3, 1, len(p))
        assert r.parent == _rec(i).parent and r.sums == _rec(i).sums
        assert _read(t, addr, len(p)) == p
        assert t.covers(addr, len(p)) and not t.covers(addr + 1, 10)
    assert t.used == sum(len(p) for _, p in want.values())
    t.close()


def test_aligned_source_is_written_directly(tmp_path: Path) -> None:
    """A page-aligned source (the DRAM segment) goes out with O_DIRECT as is."""
    seg = mmap.mmap(-1, 4 * MiB)
    view = memoryview(seg)
    view[: 3 * MiB] = os.urandom(3 * MiB)
    t = NvmeTier(str(tmp_path), 64 * MiB)
    addr = t.append(_rec(1), view[MiB : 3 * MiB - 5])
    t.sync()
    assert _read(t, addr, 2 * MiB - 5) == bytes(view[MiB : 3 * MiB - 5])
    assert t.stats()["nvme_direct"] == 1  # this file system takes O_DIRECT
    t.close()
    view.release()
    seg.close()


def _three(tmp_path: Path) -> tuple[list[int], list[bytes]]:
    t = NvmeTier(str(tmp_path), 16 * MiB)
    payloads = [_payload(i, 64 * 1024 + i) for i in range(3)]
    addrs = [t.append(_rec(i), memoryview(p)) for i, p in enumerate(payloads)]
    t.close()
    return addrs, payloads


def test_torn_payload_is_dropped_not_served(tmp_path: Path) -> None:
    addrs, payloads = _three(tmp_path)
    path = tmp_path / "tier-0.dat"
    with open(path, "r+b") as fh:  # the second object's write was cut short
        fh.seek(addrs[1] + 1000)
        fh.write(bytes(50_000))
    t = NvmeTier(str(tmp_path), 16 * MiB)
    assert sorted(r.offset for r in t.scan()) == [addrs[0], addrs[2]]
    assert t.scan_bad_payloads == 1 and not t.covers(addrs[1], 1)
    assert _read(t, addrs[2], len(payloads[2])) == payloads[2]
    t.close()


def test_damaged_record_header_ends_the_region(tmp_path: Path) -> None:
    addrs, _ = _three(tmp_path)
    with open(tmp_path / "tier-0.dat", "r+b") as fh:
        fh.seek(addrs[1] - BLOCK + 40)  # a byte of the second record's header
        b = fh.read(1)
        fh.seek(addrs[1] - BLOCK + 40)
        fh.write(bytes([b[0] ^ 0xFF]))
    t = NvmeTier(str(tmp_path), 16 * MiB)
    assert [r.offset for r in t.scan()] == [addrs[0]]
    t.close()


def test_damaged_region_header_drops_the_region(tmp_path: Path) -> None:
    addrs, _ = _three(tmp_path)
    with open(tmp_path / "tier-0.dat", "r+b") as fh:
        fh.seek(addrs[0] - 2 * BLOCK + 8)  # the region header
        fh.write(b"\xff\xff")
    t = NvmeTier(str(tmp_path), 16 * MiB)
    assert t.scan() == [] and t.used == 0
    t.close()


def test_drop_is_durable_and_region_is_reclaimed_whole(tmp_path: Path) -> None:
    t = NvmeTier(str(tmp_path), 16 * MiB)  # 8 regions of 2 MiB
    size = 700 * 1024
    addrs = [t.append(_rec(i), memoryview(_payload(i, size))) for i in range(4)]
    first_region = addrs[0] // t.region_size
    assert addrs[1] // t.region_size == first_region  # many objects per region
    assert t.drop(addrs[0]) and not t.drop(addrs[0])
    t.close()
    t = NvmeTier(str(tmp_path), 16 * MiB)
    assert sorted(r.offset for r in t.scan()) == addrs[1:]
    for a in addrs[1:]:
        t.drop(a)
    assert t.stats()["nvme_free_regions"] == 8 and t.used == 0
    t.close()
    t = NvmeTier(str(tmp_path), 16 * MiB)
    assert t.scan() == []
    t.close()


def test_full_tier_evicts_the_emptiest_region_and_reports_it(tmp_path: Path) -> None:
    t = NvmeTier(str(tmp_path), 16 * MiB)  # 8 regions of 2 MiB: 2 objects each
    size = 900 * 1024
    addrs = [t.append(_rec(i), memoryview(_payload(i, size))) for i in range(16)]
    assert t.take_lost() == []
    t.drop(addrs[5])  # region 2 now has the fewest live bytes
    extra = t.append(_rec(99), memoryview(_payload(99, size)))
    lost = t.take_lost()
    assert lost == [(addrs[4], size)] and extra == addrs[4]  # region 2 starts over
    assert t.objects[extra].record.key == _rec(99).key
    assert t.stats()["nvme_evicted_regions"] == 1
    t.close()
    t = NvmeTier(str(tmp_path), 16 * MiB)
    recs = {r.offset: r for r in t.scan()}
    assert len(recs) == 15 and recs[extra].key == _rec(99).key
    assert _read(t, extra, size) != b"" and recs[extra].seq > max(
        r.seq for a, r in recs.items() if a != extra
    )
    t.close()


def test_object_larger_than_a_region_is_refused(tmp_path: Path) -> None:
    t = NvmeTier(str(tmp_path), 16 * MiB)
    with pytest.raises(GCacheError, match="does not fit"):
        t.append(_rec(1), memoryview(bytes(2 * MiB)))
    t.close()


def test_directory_is_locked(tmp_path: Path) -> None:
    t = NvmeTier(str(tmp_path), 16 * MiB)
    with pytest.raises(GCacheError, match="in use"):
        NvmeTier(str(tmp_path), 16 * MiB)
    t.close()


def test_records_is_a_snapshot_while_the_writer_appends(tmp_path: Path) -> None:
    """The loop lists the records (a registration's report) while the writer thread
    appends, drops and evicts: the listing is one atomic snapshot. The old generator
    over the live dict raised "dictionary changed size during iteration"."""
    t = NvmeTier(str(tmp_path / "nvme"), 4 << 20, direct=False)
    stop = threading.Event()
    payload = memoryview(_payload(0, 512))

    def writer() -> None:
        i = 0
        while not stop.is_set():
            addr = t.append(_rec(i % 200), payload)
            if i % 3 == 0:
                t.drop(addr)
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    th = threading.Thread(target=writer)
    th.start()
    try:
        for _ in range(3000):
            recs = list(t.records())
            assert all(r.tier == 1 for r in recs)
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
        t.close()
