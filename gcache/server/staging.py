"""The staging area: tier-1 reads for clients on the server's host.

A client that maps the server's segment (shared-memory transport) would still get
NVMe objects over loopback TCP: the server's ``sendmsg`` copies every byte, the
client's ``recv`` copies it again, then it checksums them. Instead it asks with
``READ_STAGED``: the server reads the object from NVMe (``O_DIRECT``, in pieces on
its disk threads) straight into a range of its *staging file*, a tmpfs file next
to the segment that the client maps too, and answers ``STAGED`` with where each
range landed; the client copies and verifies out of it in one pass
(``gcache._native.copy_checksums``) and gives the range back with ``UNSTAGE``.

:class:`StagingArea` is the bookkeeping, I/O-free but for the file: ranges are
page aligned (``O_DIRECT`` reads into them), owned by the connection that asked,
bounded (the file's size; at most ``per_owner`` bytes per connection), and
time-limited: a range not given back within ``ttl_s`` is freed the next time the
area is used or its stats are read, so a client that never releases cannot pin it.
A connection's ranges are freed when it closes. A range freed early can be reused
while a slow client still copies out of it: the client verifies every byte against
the meta's checksums, so that is a miss, never wrong data, and it copies nothing
after the range's expiry."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from gcache.errors import GCacheError
from gcache.storage.allocator import SegmentAllocator
from gcache.storage.segment import dead_files

ALIGN = 4096


@dataclass(slots=True)
class StagedRange:
    owner: int
    offset: int
    size: int
    deadline: float  # monotonic seconds


class StagingArea:
    def __init__(self, path: str, size: int, ttl_s: float, per_owner: int) -> None:
        if size <= 0 or size % ALIGN:
            raise GCacheError(f"staging area size {size} must be a positive multiple of {ALIGN}")
        self.path = path
        self.size = size
        self.ttl_s = ttl_s
        self.per_owner = per_owner
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise GCacheError(f"cannot create the staging file {path}: {exc.strerror}") from exc
        try:
            os.posix_fallocate(fd, 0, size)  # no SIGBUS on a full tmpfs later
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        except OSError as exc:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise GCacheError(
                f"cannot reserve the staging file {path} ({size} bytes): {exc.strerror}"
            ) from exc
        os.close(fd)
        self.view = memoryview(self._map)
        self._alloc = SegmentAllocator(size, ALIGN)
        self._ranges: dict[int, StagedRange] = {}
        self._by_owner: dict[int, int] = {}  # owner -> bytes held
        self._next = 1
        self.staged = self.released = self.expired = self.refused = self.owner_freed = 0

    def stage(self, owner: int, nbytes: int, now: float) -> tuple[int, int] | None:
        """A range of ``nbytes`` (rounded up to pages) for ``owner``: ``(id,
        offset)``, or None when the area (or the owner's share) has no room."""
        self.expire(now)
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if self._by_owner.get(owner, 0) + size > self.per_owner:
            self.refused += 1
            return None
        offset = self._alloc.alloc(size)
        if offset is None:
            self.refused += 1
            return None
        rid = self._next
        self._next += 1
        self._ranges[rid] = StagedRange(owner, offset, size, now + self.ttl_s)
        self._by_owner[owner] = self._by_owner.get(owner, 0) + size
        self.staged += 1
        return rid, offset

    def _free(self, rid: int) -> None:
        r = self._ranges.pop(rid)
        self._alloc.free(r.offset)
        left = self._by_owner[r.owner] - r.size
        if left:
            self._by_owner[r.owner] = left
        else:
            del self._by_owner[r.owner]

    def release(self, owner: int, rid: int) -> bool:
        """Give a range back (only its owner can); False when it is not held."""
        r = self._ranges.get(rid)
        if r is None or r.owner != owner:
            return False
        self._free(rid)
        self.released += 1
        return True

    def release_owner(self, owner: int) -> int:
        """Free every range of a closed connection; returns how many."""
        rids = [rid for rid, r in self._ranges.items() if r.owner == owner]
        for rid in rids:
            self._free(rid)
        self.owner_freed += len(rids)
        return len(rids)

    def expire(self, now: float) -> int:
        rids = [rid for rid, r in self._ranges.items() if r.deadline <= now]
        for rid in rids:
            self._free(rid)
        self.expired += len(rids)
        return len(rids)

    def stats(self, now: float) -> dict[str, int]:
        self.expire(now)
        return {
            "staging_size": self.size,
            "staging_used_bytes": self._alloc.used,
            "staging_ranges": len(self._ranges),
            "staged_reads": self.staged,
            "staging_released": self.released,
            "staging_expired": self.expired,
            "staging_refused": self.refused,
            "staging_freed_on_close": self.owner_freed,
        }

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


def staging_path(segment_path: str) -> str:
    """``gcache-<id>-<pid>.seg`` -> ``gcache-<id>-<pid>.stage`` (never matched as a
    segment file by tools that look for ``*.seg``)."""
    stem = segment_path[:-4] if segment_path.endswith(".seg") else segment_path
    return stem + ".stage"


def remove_dead_staging_files(shm_dir: str, segment_path: str) -> list[str]:
    """Staging files a killed predecessor of this server left in ``shm_dir`` (same
    name as this server's segment but for the process id, which is gone)."""
    stem, sep, _pid = os.path.basename(segment_path).rpartition("-")
    removed: list[str] = []
    if not sep:
        return removed
    for path in dead_files(shm_dir, stem + "-", ".stage"):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed
