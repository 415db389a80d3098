# One file (over 450 lines): the log format, its regions and its recovery share one layout.
"""The NVMe tier of ``gcache-server``: a log-structured store in a few large
preallocated files (``--nvme-path DIR --nvme-size SIZE``).

Layout (CacheLib Navy / Mooncake bucket style). The tier is cut into *regions* of
``region_size`` bytes (a few per file); objects are appended to the open region
one after another, each as a 4 KiB record header followed by its payload padded
to 4 KiB, so every write is sequential and ``O_DIRECT``-aligned (the payload is
written straight from the page-aligned DRAM segment; a file system that refuses
``O_DIRECT`` falls back to buffered writes). A region is reclaimed whole: when its
last live object is dropped, or, when no region is free, by evicting the region
with the fewest live bytes (its objects are reported as lost).

The index of the tier is the region headers, replayed at start (no other
database): a region begins with a 4 KiB header (magic, region size and index,
generation, CRC-32), and each record header carries the object's namespace
fingerprint, key, parent key, block position, group, length, per-layer checksums,
``xxh3_64`` of the payload, the record's sequence number and the region's
generation, under its own CRC-32; when the object's layers differ in size (a
version 2 record) their byte lengths follow the checksums. At start every region
is scanned: a record whose header fails its CRC or names another generation ends
the region's log, one whose payload no longer hashes to the recorded value (a
torn write, damage) is dropped; neither is ever served. Dropping an object
rewrites its header as a tombstone (same CRC rule); reusing a region writes a
new region header with a new generation, which invalidates every record left from
its previous life.

Addresses: an object's address is the global byte offset of its payload
(``region index * region_size + offset in region``); ``Grant.offset`` of a tier-1
read grant is that address.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import time
import zlib
from typing import Final

import numpy as np

from gcache import _native
from gcache.errors import GCacheError
from gcache.storage.record import StoredRecord

BLOCK: Final = 4096
_REGION_MAGIC: Final = b"GCNR"
_RECORD_MAGIC: Final = b"GCNO"
_VERSION: Final = 1
# magic, version, region size, region index, generation; CRC-32 follows.
_REGION: Final = struct.Struct("<4sHQIQ")
# magic, version, flags, nsums, generation, seq, namespace, key, parent,
# has parent, pos, group, length, payload xxh3_64; sums, then CRC-32 follow.
_RECORD: Final = struct.Struct("<4sBBHQQ16s16s16sBIIQQ")
_CRC: Final = struct.Struct("<I")
MAX_SUMS: Final = (BLOCK - _RECORD.size - _CRC.size) // 8
# Version 2 of a record header: the object's layers differ in size, their
# byte lengths (u32 each, one per checksum) follow the checksums. Equal layers are
# still written as version 1, and version 1 records stay readable.
_RECORD_V2: Final = 2
MAX_SUMS_V2: Final = (BLOCK - _RECORD.size - _CRC.size) // 12
LIVE: Final = 1
DEAD: Final = 2
MAX_FILES: Final = 8
FILE_STEP: Final = 64 << 30  # one more file per 64 GiB of tier
MAX_REGION: Final = 64 << 20
MIN_REGION: Final = 1 << 20


def _align(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _addr(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


def geometry(size: int) -> tuple[int, int, int]:
    """(files, regions per file, region size) for a tier of ``size`` bytes: a file
    per 64 GiB (at most 8), regions of 64 MiB, smaller for small tiers so that
    each file holds at least 8 (never under 1 MiB)."""
    files = max(1, min(MAX_FILES, size // FILE_STEP))
    per_file = size // files
    region = max(MIN_REGION, min(MAX_REGION, per_file // 8) // MIN_REGION * MIN_REGION)
    regions = per_file // region
    if regions < 2:
        raise GCacheError(
            f"an NVMe tier of {size} bytes is too small: it needs at least "
            f"{2 * MIN_REGION} bytes (two 1 MiB regions)"
        )
    return files, regions, region


def payload_hash(payload: memoryview) -> int:
    """xxh3-64 of a whole payload (the record's ``phash``), hashed by the native
    kernel without the GIL: the disk thread's hash no longer stalls the server's
    event loop (it was 15 % of the demotion thread's time, holding the GIL)."""
    return int.from_bytes(_native.checksums([payload], 1), "big")


class NvmeObject:
    __slots__ = ("header", "record", "region")

    def __init__(self, region: int, header: int, record: StoredRecord) -> None:
        self.region = region  # region index
        self.header = header  # offset of the record header inside the region
        self.record = record  # tier 1, offset = the object's address


class Region:
    __slots__ = ("gen", "index", "live", "live_bytes", "objects", "write_pos")

    def __init__(self, index: int) -> None:
        self.index = index
        self.gen = 0  # 0: never written (or its header failed its check)
        self.write_pos = 0  # next record header offset; 0 = not open
        self.live = 0
        self.live_bytes = 0
        self.objects: set[int] = set()  # addresses of live objects


def _pack_region(region_size: int, index: int, gen: int) -> bytes:
    body = _REGION.pack(_REGION_MAGIC, _VERSION, region_size, index, gen)
    return body + _CRC.pack(zlib.crc32(body))


def _unpack_region(buf: memoryview, region_size: int, index: int) -> int:
    """The generation of a valid region header, else 0."""
    n = _REGION.size
    magic, version, size, idx, gen = _REGION.unpack_from(buf)
    if magic != _REGION_MAGIC or version != _VERSION or size != region_size or idx != index:
        return 0
    if _CRC.unpack_from(buf, n)[0] != zlib.crc32(buf[:n]):
        return 0
    return int(gen)


def pack_record(rec: StoredRecord, gen: int, payload_hash: int, flags: int = LIVE) -> bytes:
    nsums = len(rec.sums) // 8
    uneven = rec.layer_bytes
    most = MAX_SUMS_V2 if uneven else MAX_SUMS
    if len(rec.sums) % 8 or nsums > most:
        raise GCacheError(f"an object record holds at most {most} 8-byte layer checksums")
    if uneven and (len(uneven) != nsums or sum(uneven) != rec.length):
        raise GCacheError("layer lengths must be one per checksum and add up to the length")
    if len(rec.namespace) != 16 or len(rec.key) != 16 or len(rec.parent) not in (0, 16):
        raise GCacheError("namespace, key and parent must be 16-byte fingerprints")
    body = _RECORD.pack(
        _RECORD_MAGIC,
        _RECORD_V2 if uneven else _VERSION,
        flags,
        nsums,
        gen,
        rec.seq,
        rec.namespace,
        rec.key,
        rec.parent or bytes(16),
        1 if rec.parent else 0,
        rec.pos,
        rec.group,
        rec.length,
        payload_hash,
    )
    body += rec.sums
    if uneven:
        body += struct.pack(f"<{nsums}I", *uneven)
    return body + _CRC.pack(zlib.crc32(body))


def unpack_record(buf: memoryview, gen: int) -> tuple[StoredRecord, int, int] | None:
    """(record, flags, payload hash) of a valid record header of generation
    ``gen``, else None (end of the region's log)."""
    fixed = _RECORD.unpack_from(buf)
    magic, version, flags, nsums, rgen, seq, ns, key, parent, has_parent = fixed[:10]
    pos, group, length, phash = fixed[10:]
    uneven = version == _RECORD_V2
    if (
        magic != _RECORD_MAGIC
        or version not in (_VERSION, _RECORD_V2)
        or rgen != gen
        or nsums > (MAX_SUMS_V2 if uneven else MAX_SUMS)
    ):
        return None
    sums_end = _RECORD.size + 8 * nsums
    end = sums_end + (4 * nsums if uneven else 0)
    if flags not in (LIVE, DEAD) or _CRC.unpack_from(buf, end)[0] != zlib.crc32(buf[:end]):
        return None
    lengths = struct.unpack_from(f"<{nsums}I", buf, sums_end) if uneven else ()
    rec = StoredRecord(
        namespace=bytes(ns),
        key=bytes(key),
        parent=bytes(parent) if has_parent else b"",
        pos=pos,
        group=group,
        tier=1,
        offset=0,
        length=length,
        sums=bytes(buf[_RECORD.size : sums_end]),
        seq=seq,
        layer_bytes=tuple(lengths),
    )
    return rec, flags, phash


class _File:
    __slots__ = ("direct", "fd", "path", "rfd")

    def __init__(self, path: str, size: int, direct: bool) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise GCacheError(f"cannot open the NVMe tier file {path}: {exc.strerror}") from exc
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise GCacheError(
                    f"the NVMe tier file {path} ({size} bytes) does not fit on its file "
                    "system: lower --nvme-size or move --nvme-path"
                ) from exc
            raise GCacheError(f"cannot allocate the NVMe tier file {path}: {exc}") from exc
        self.rfd = fd  # buffered: reads, and writes when O_DIRECT is refused
        self.fd = fd
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = fd  # e.g. a file system without O_DIRECT: buffered writes

    def close(self) -> None:
        for fd in {self.fd, self.rfd}:
            try:
                os.close(fd)
            except OSError:
                pass


def _pwritev(fd: int, views: list[memoryview], offset: int) -> None:
    """Write every view at ``offset``, resuming after a short write."""
    total = sum(len(v) for v in views)
    done = 0
    while True:
        n = os.pwritev(fd, views, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at {offset + done}")
        done += n
        if done >= total:
            return
        rest: list[memoryview] = []
        for v in views:
            if n >= len(v):
                n -= len(v)
                continue
            rest.append(v[n:])
            n = 0
        views = rest


def preadv_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at {offset + done}")
        done += n


class NvmeTier:
    """The tier's files, regions and in-memory index (address -> object).

    Synchronous: the daemon runs :meth:`append`, :meth:`read_into` and
    :meth:`sync` on a worker thread (one at a time for writes) and the rest on its
    loop."""

    def __init__(self, path: str, size: int, direct: bool = True, verify: bool = True) -> None:
        self.path = path
        self.nfiles, self.per_file, self.region_size = geometry(size)
        self.capacity = self.nfiles * self.per_file * self.region_size
        self.verify = verify
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise GCacheError(f"cannot create the NVMe directory {path}: {exc.strerror}") from exc
        self._lock_fd = os.open(os.path.join(path, "tier.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise GCacheError(
                f"the NVMe directory {path} is in use by another gcache-server"
            ) from exc
        file_size = self.per_file * self.region_size
        self.files = [
            _File(os.path.join(path, f"tier-{i}.dat"), file_size, direct)
            for i in range(self.nfiles)
        ]
        self.regions = [Region(i) for i in range(self.nfiles * self.per_file)]
        self.objects: dict[int, NvmeObject] = {}
        self.open: Region | None = None
        self.gen = 0
        self.seq = 0
        self.used = 0  # bytes of live objects (payloads)
        self.lost: list[tuple[int, int]] = []  # (address, length) evicted by the tier
        self.dirty: set[int] = set()  # files written since the last sync
        # Page-aligned scratch: a record header, a payload tail, an unaligned payload.
        self._head = mmap.mmap(-1, BLOCK)
        self._tail = mmap.mmap(-1, BLOCK)
        self._bounce = mmap.mmap(-1, 4 << 20)
        self.appended = self.appended_bytes = self.dropped = self.evicted_regions = 0
        self.reads = self.read_bytes = 0
        self.scan_bad_headers = self.scan_bad_payloads = self.scan_regions = 0
        self.scan_s = 0.0

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self.files)

    # ---- addresses ----------------------------------------------------------------

    def _locate(self, region: int, offset: int) -> tuple[_File, int]:
        f, r = divmod(region, self.per_file)
        return self.files[f], r * self.region_size + offset

    def address(self, region: int, header: int) -> int:
        return region * self.region_size + header + BLOCK

    def covers(self, offset: int, length: int) -> bool:
        """A tier-1 grant must name a live object (its address, at most its length)."""
        obj = self.objects.get(offset)
        return obj is not None and 0 < length <= obj.record.length

    # ---- start -------------------------------------------------------------------

    def scan(self) -> list[StoredRecord]:
        """Replay every region header and record; returns the live records. A bad
        header ends its region's log; a payload that fails its hash is dropped."""
        t0 = time.monotonic()
        head = memoryview(self._head)
        buf = bytearray(self.region_size)
        out: list[StoredRecord] = []
        for region in self.regions:
            f, base = self._locate(region.index, 0)
            preadv_exact(f.rfd, head, base)
            gen = _unpack_region(head, self.region_size, region.index)
            region.gen = gen
            if not gen:
                continue
            self.scan_regions += 1
            self.gen = max(self.gen, gen)
            pos = BLOCK
            while pos + BLOCK <= self.region_size:
                preadv_exact(f.rfd, head, base + pos)
                parsed = unpack_record(head, gen)
                if parsed is None:
                    break
                rec, flags, phash = parsed
                span = BLOCK + _align(rec.length)
                if pos + span > self.region_size:
                    self.scan_bad_headers += 1
                    break
                self.seq = max(self.seq, rec.seq)
                if flags == LIVE:
                    ok = True
                    if self.verify:
                        view = memoryview(buf)[: rec.length]
                        preadv_exact(f.rfd, view, base + pos + BLOCK)
                        ok = payload_hash(view) == phash
                    if ok:
                        rec.offset = self.address(region.index, pos)
                        self._index(region, pos, rec)
                        out.append(rec)
                    else:
                        self.scan_bad_payloads += 1
                pos += span
            # Not appended to again: the next write opens a fresh region.
        self.scan_s = time.monotonic() - t0
        return out

    def _index(self, region: Region, header: int, rec: StoredRecord) -> None:
        self.objects[rec.offset] = NvmeObject(region.index, header, rec)
        region.objects.add(rec.offset)
        region.live += 1
        region.live_bytes += rec.length
        self.used += rec.length

    # ---- writes ------------------------------------------------------------------

    def _open_region(self) -> Region:
        """A fresh region to append to: a free one (oldest generation first), else
        the one with the fewest live bytes, evicted whole (its objects -> lost)."""
        candidates = [r for r in self.regions if r is not self.open]
        free = [r for r in candidates if r.live == 0]
        if free:
            region = min(free, key=lambda r: r.gen)
        else:
            region = min(candidates, key=lambda r: r.live_bytes)
            for addr in sorted(region.objects):
                obj = self.objects.pop(addr)
                self.lost.append((addr, obj.record.length))
                self.used -= obj.record.length
            region.objects.clear()
            region.live = region.live_bytes = 0
            self.evicted_regions += 1
        self.gen += 1
        region.gen = self.gen
        head = memoryview(self._head)
        head[:] = bytes(BLOCK)
        hdr = _pack_region(self.region_size, region.index, region.gen)
        head[: len(hdr)] = hdr
        f, base = self._locate(region.index, 0)
        _pwritev(f.fd, [head], base)
        self.dirty.add(self.files.index(f))
        region.write_pos = BLOCK
        self.open = region
        return region

    def append(self, rec: StoredRecord, payload: memoryview) -> int:
        """Write one object (header + payload) at the end of the open region and
        index it; returns its address. Durable after :meth:`sync`."""
        length = len(payload)
        span = BLOCK + _align(length)
        if span > self.region_size - BLOCK:
            raise GCacheError(
                f"an object of {length} bytes does not fit a {self.region_size}-byte "
                "NVMe region (raise --nvme-size)"
            )
        region = self.open
        if region is None or region.write_pos + span > self.region_size:
            region = self._open_region()
        pos = region.write_pos
        self.seq += 1
        rec.seq = self.seq
        rec.tier = 1
        rec.length = length
        phash = payload_hash(payload)
        hdr = pack_record(rec, region.gen, phash)
        head = memoryview(self._head)
        head[:] = bytes(BLOCK)
        head[: len(hdr)] = hdr
        f, foff = self._locate(region.index, pos)
        whole = length // BLOCK * BLOCK
        rest = length - whole
        tail = memoryview(self._tail)
        if rest:
            tail[:rest] = payload[whole:]
            tail[rest:] = bytes(BLOCK - rest)
        if not f.direct or _addr(payload) % BLOCK == 0:
            views = [head, payload[:whole]] if whole else [head]
            if rest:
                views.append(tail)
            _pwritev(f.fd, views, foff)
        else:  # an unaligned source (not the segment): through the bounce buffer
            _pwritev(f.fd, [head], foff)
            bounce = memoryview(self._bounce)
            done = 0
            while done < whole:
                n = min(len(bounce), whole - done)
                bounce[:n] = payload[done : done + n]
                _pwritev(f.fd, [bounce[:n]], foff + BLOCK + done)
                done += n
            if rest:
                _pwritev(f.fd, [tail], foff + BLOCK + whole)
        self.dirty.add(self.files.index(f))
        region.write_pos = pos + span
        rec.offset = self.address(region.index, pos)
        self._index(region, pos, rec)
        self.appended += 1
        self.appended_bytes += length
        return rec.offset

    def sync(self) -> None:
        """Make the writes so far durable (one ``fdatasync`` per file written)."""
        for i in sorted(self.dirty):
            os.fdatasync(self.files[i].fd)
        self.dirty.clear()

    def drop(self, address: int, length: int = 0) -> bool:
        """Delete an object: tombstone its header; a region whose last live object
        goes is free for reuse."""
        obj = self.objects.get(address)
        if obj is None or (length and length != obj.record.length):
            return False
        del self.objects[address]
        region = self.regions[obj.region]
        region.objects.discard(address)
        region.live -= 1
        region.live_bytes -= obj.record.length
        self.used -= obj.record.length
        self.dropped += 1
        hdr = pack_record(obj.record, region.gen, 0, DEAD)
        head = memoryview(self._head)
        head[:] = bytes(BLOCK)
        head[: len(hdr)] = hdr
        f, foff = self._locate(region.index, obj.header)
        _pwritev(f.fd, [head], foff)
        self.dirty.add(self.files.index(f))
        return True

    def take_lost(self) -> list[tuple[int, int]]:
        lost, self.lost = self.lost, []
        return lost

    # ---- reads -------------------------------------------------------------------

    def read_into(self, address: int, view: memoryview) -> None:
        """Read ``len(view)`` bytes at ``address`` (inside one object)."""
        region, off = divmod(address, self.region_size)
        f, foff = self._locate(region, off)
        preadv_exact(f.rfd, view, foff)
        self.reads += 1
        self.read_bytes += len(view)

    def read_span(self, ranges: list[tuple[int, int]]) -> int:
        """Bytes of page-aligned buffer :meth:`read_many` needs for ``ranges``."""
        return max(sum(_align(span) for _, _, span, _ in self._spans(ranges)), BLOCK)

    def _spans(self, ranges: list[tuple[int, int]]) -> list[tuple[_File, int, int, int]]:
        """(file, file offset, span, skip) of each range: with ``O_DIRECT``, the whole
        4 KiB blocks around it (inside the object's padded record)."""
        spans: list[tuple[_File, int, int, int]] = []
        for address, n in ranges:
            region, off = divmod(address, self.region_size)
            f, foff = self._locate(region, off)
            if f.direct:
                a0 = foff // BLOCK * BLOCK
                spans.append((f, a0, _align(foff + n) - a0, foff - a0))
            else:
                spans.append((f, foff, n, 0))
        return spans

    def read_many(
        self, ranges: list[tuple[int, int]], buf: memoryview | None = None
    ) -> list[memoryview]:
        """Read ``(address, length)`` ranges into one page-aligned buffer, each with
        ``O_DIRECT`` where the file takes it, so a read neither goes through nor
        fills the page cache; returns one view of exactly each range. ``buf``: a
        page-aligned buffer of at least :meth:`read_span` bytes to read into (the
        daemon's pool, reused from READ to READ); else a fresh mapping."""
        spans = self._spans(ranges)
        total = max(sum(_align(span) for _, _, span, _ in spans), BLOCK)
        if buf is None:
            buf = memoryview(
                mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
            )
        elif len(buf) < total or _addr(buf) % BLOCK:
            raise GCacheError(f"an NVMe read needs a page-aligned buffer of {total} bytes")
        out: list[memoryview] = []
        pos = 0
        for (f, start, span, skip), (_, n) in zip(spans, ranges, strict=True):
            preadv_exact(f.fd if f.direct else f.rfd, buf[pos : pos + span], start)
            out.append(buf[pos + skip : pos + skip + n])
            pos += _align(span)
            self.reads += 1
            self.read_bytes += n
        return out

    def records(self) -> list[StoredRecord]:
        """A snapshot (one call, atomic under the GIL): the loop lists the records
        while the writer thread appends and drops."""
        return [o.record for o in list(self.objects.values())]

    # ---- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        try:
            self.sync()
        except OSError:
            pass
        for f in self.files:
            f.close()
        os.close(self._lock_fd)
        for m in (self._head, self._tail, self._bounce):
            m.close()

    def stats(self) -> dict[str, int | float]:
        return {
            "nvme_capacity": self.capacity,
            "nvme_used": self.used,
            "nvme_objects": len(self.objects),
            "nvme_regions": len(self.regions),
            "nvme_region_size": self.region_size,
            "nvme_free_regions": sum(1 for r in self.regions if r.live == 0),
            "nvme_direct": int(self.direct),
            "nvme_appended": self.appended,
            "nvme_appended_bytes": self.appended_bytes,
            "nvme_dropped": self.dropped,
            "nvme_evicted_regions": self.evicted_regions,
            "nvme_reads": self.reads,
            "nvme_read_bytes": self.read_bytes,
            "nvme_scan_bad_headers": self.scan_bad_headers,
            "nvme_scan_bad_payloads": self.scan_bad_payloads,
            "nvme_scan_s": self.scan_s,
        }


def measure(path: str, nbytes: int = 32 << 20) -> tuple[float, float]:
    """(write, read) GB/s of ``O_DIRECT`` sequential I/O on a scratch file in
    ``path`` (the tier's own files are never touched); buffered where the file
    system refuses ``O_DIRECT``."""
    scratch = os.path.join(path, "bandwidth.tmp")
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    view[:] = os.urandom(1024) * (nbytes // 1024)
    try:
        try:
            fd = os.open(scratch, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            fd = os.open(scratch, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            t0 = time.perf_counter()
            _pwritev(fd, [view], 0)
            os.fdatasync(fd)
            t1 = time.perf_counter()
            preadv_exact(fd, view, 0)
            t2 = time.perf_counter()
        finally:
            os.close(fd)
    finally:
        view.release()
        buf.close()
        try:
            os.unlink(scratch)
        except OSError:
            pass
    return nbytes / max(t1 - t0, 1e-9) / 1e9, nbytes / max(t2 - t1, 1e-9) / 1e9
