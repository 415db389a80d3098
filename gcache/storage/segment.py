"""The DRAM segment of a storage daemon: one file in shared memory, mapped once.

The file lives in ``shm_dir`` (tmpfs, ``/dev/shm`` by default) so that a client on
the same host can map the very same pages (the SHM transport). Its whole size is
reserved at start (``posix_fallocate``): a sparse file on a tmpfs that fills up
later would kill the server and every client copying into it with SIGBUS, so a
segment that does not fit fails start-up with one line instead. It is optionally
pre-faulted (``MAP_POPULATE``) so the first writes do not pay page faults. Which
ranges hold objects is the meta's business (it runs the allocator); the segment only
bounds-checks and hands out views.
"""

from __future__ import annotations

import errno
import mmap
import os
import re

from gcache.errors import GCacheError

PAGE = mmap.PAGESIZE


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


class Segment:
    __slots__ = ("_fd", "_mm", "capacity", "path", "view")

    def __init__(
        self, path: str, capacity: int, populate: bool = False, reserve: bool = True
    ) -> None:
        """``reserve=False`` leaves the file sparse: only for segments nothing writes
        (index-only benchmarks); a write into it on a full tmpfs faults (SIGBUS)."""
        self.path = path
        self.capacity = capacity
        where = os.path.dirname(path) or "."
        free = _free_bytes(where)
        if (reserve or populate) and free is not None and capacity > free:
            raise GCacheError(_no_room(capacity, where, free))
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise GCacheError(f"cannot create segment file {path}: {exc}") from exc
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
    def remove_stale(shm_dir: str, server_id: str) -> list[str]:
        """Unlink segment files this server id left behind when its process died
        without cleaning up (SIGKILL, OOM). Files of live processes are kept."""
        removed: list[str] = []
        prefix = f"gcache-{_safe(server_id)}-"
        try:
            names = os.listdir(shm_dir)
        except OSError:
            return removed
        for name in names:
            if not (name.startswith(prefix) and name.endswith(".seg")):
                continue
            pid = name[len(prefix) : -len(".seg")]
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
        return removed

    def in_bounds(self, offset: int, length: int) -> bool:
        return offset >= 0 and length >= 0 and offset + length <= self.capacity

    def close(self) -> None:
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes with the process
        try:
            os.close(self._fd)
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
