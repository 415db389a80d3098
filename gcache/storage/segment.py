"""The DRAM segment of a storage daemon: one file in shared memory, mapped once.

The file lives in ``shm_dir`` (tmpfs, ``/dev/shm`` by default) so that a client on
the same host can map the very same pages (the SHM transport). Its whole size is
reserved at start (``posix_fallocate``): a sparse file on a tmpfs that fills up
later would kill the server and every client copying into it with SIGBUS, so a
segment that does not fit fails start-up with one line instead. It is optionally
pre-faulted (``MAP_POPULATE``) so the first writes do not pay page faults. Which
ranges hold objects is the meta's business (it runs the allocator); the segment only
bounds-checks and hands out views.

The file outlives its process: a server stopped or killed leaves it in
the tmpfs with its manifest (:mod:`gcache.storage.manifest`), and the next start of
the same server id (for the same meta) re-adopts it (:meth:`Segment.adoptable`):
the file is renamed to the new process's name and mapped again, and the manifest's
records with their digests decide what is kept. Files no start will re-adopt (no
manifest, or another owner's left for over :data:`FOREIGN_STALE_S`) are removed.
A live server holds an exclusive ``flock`` on its file, so no two processes share
one.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import time
from collections.abc import Callable

from gcache.errors import GCacheError

PAGE = mmap.PAGESIZE
# A dead process's segment file that names another owner (same server id, another
# meta) is left for its own server to re-adopt for this long, then removed.
FOREIGN_STALE_S = 3600.0


def _safe(server_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", server_id)


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _no_room(capacity: int, where: str, free: int | None) -> str:
    have = "" if free is None else f" ({free} bytes free)"
    return (
        f"a {capacity}-byte segment does not fit in {where}{have}: lower --capacity, "
        "enlarge the tmpfs, or move --shm-dir (its space is reserved at start, so "
        "nothing can fault later)"
    )


def _reserve(fd: int, size: int) -> None:
    """Allocate every page of the file now (tmpfs counts them against its size), so
    no write into the mapping can hit a full tmpfs (SIGBUS) later."""
    while True:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except InterruptedError:
            continue


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_files(shm_dir: str, prefix: str, suffix: str) -> list[str]:
    """Paths of the files ``<prefix><pid><suffix>`` in ``shm_dir`` whose process
    is gone (a server's segments, its staging files), newest first."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    out: list[tuple[float, str]] = []
    for name in names:
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        pid = name[len(prefix) : len(name) - len(suffix)]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            out.append((os.stat(path).st_mtime, path))
        except OSError:
            continue
    return [p for _, p in sorted(out, reverse=True)]


def manifest_path(segment_path: str) -> str:
    """The manifest next to a segment file (``...-PID.seg`` -> ``...-PID.manifest``)."""
    return segment_path[: -len(".seg")] + ".manifest"


class Segment:
    __slots__ = ("_fd", "_mm", "capacity", "path", "reused", "view")

    def __init__(
        self,
        path: str,
        capacity: int,
        populate: bool = False,
        reserve: bool = True,
        reuse: bool = False,
    ) -> None:
        """``reserve=False`` leaves the file sparse: only for segments nothing writes
        (index-only benchmarks); a write into it on a full tmpfs faults (SIGBUS).
        ``reuse``: map the file already at ``path`` (re-adopted) when it has the
        same size; ``reused`` says whether that happened."""
        self.path = path
        self.capacity = capacity
        self.reused = False
        if reuse:
            try:
                if os.stat(path).st_size == capacity:
                    self.reused = True
                else:
                    os.unlink(path)  # another capacity: start empty
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise GCacheError(f"cannot re-adopt segment file {path}: {exc}") from exc
        where = os.path.dirname(path) or "."
        free = _free_bytes(where)
        if not self.reused and (reserve or populate) and free is not None and capacity > free:
            raise GCacheError(_no_room(capacity, where, free))
        try:
            flags = os.O_RDWR if self.reused else os.O_RDWR | os.O_CREAT | os.O_EXCL
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise GCacheError(f"cannot create segment file {path}: {exc}") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            raise GCacheError(f"segment file {path} is in use by another process") from exc
        try:
            os.ftruncate(self._fd, capacity)
            if reserve:
                _reserve(self._fd, capacity)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(self._fd, capacity, flags=flags)
        except OSError as exc:
            os.close(self._fd)
            os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise GCacheError(_no_room(capacity, where, _free_bytes(where))) from exc
            raise GCacheError(f"cannot map a {capacity}-byte segment at {path}: {exc}") from exc
        self.view = memoryview(self._mm)

    @staticmethod
    def file_name(server_id: str) -> str:
        return f"gcache-{_safe(server_id)}-{os.getpid()}.seg"

    @staticmethod
    def _dead_files(shm_dir: str, server_id: str) -> list[str]:
        """Segment files of this server id whose process is gone, newest first."""
        return dead_files(shm_dir, f"gcache-{_safe(server_id)}-", ".seg")

    @staticmethod
    def adoptable(
        shm_dir: str, server_id: str, owner: str, owner_of: Callable[[str], str | None]
    ) -> str | None:
        """The segment file a dead process of this server id left for ``owner``
        (``server_id@meta``, read from its manifest by ``owner_of``), newest first."""
        for path in Segment._dead_files(shm_dir, server_id):
            if owner_of(manifest_path(path)) == owner:
                return path
        return None

    @staticmethod
    def remove_stale(
        shm_dir: str,
        server_id: str,
        owner: str = "",
        owner_of: Callable[[str], str | None] | None = None,
        now: float | None = None,
    ) -> list[str]:
        """Unlink segment files (and manifests) this server id left behind when its
        process died (SIGKILL, OOM) that no start will re-adopt: ours (``owner``:
        the caller adopted the one it wanted first), those without a manifest, and
        other owners' older than :data:`FOREIGN_STALE_S`. Files of live processes
        are kept."""
        removed: list[str] = []
        now = time.time() if now is None else now
        for path in Segment._dead_files(shm_dir, server_id):
            who = owner_of(manifest_path(path)) if owner_of is not None else None
            if who is not None and who != owner:
                try:
                    if now - os.stat(path).st_mtime < FOREIGN_STALE_S:
                        continue
                except OSError:
                    continue
            for p in (path, manifest_path(path)):
                try:
                    os.unlink(p)
                    if p == path:
                        removed.append(os.path.basename(path))
                except OSError:
                    pass
        return removed

    def in_bounds(self, offset: int, length: int) -> bool:
        return offset >= 0 and length >= 0 and offset + length <= self.capacity

    def close(self, keep: bool = False) -> None:
        """Unmap; ``keep`` leaves the file for the next start to re-adopt."""
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes with the process
        try:
            os.close(self._fd)
        except OSError:
            pass
        if keep:
            return
        for p in (self.path, manifest_path(self.path)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
