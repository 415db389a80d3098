"""The DRAM segment of a storage daemon: one file in shared memory, mapped once.

The file lives in ``shm_dir`` (tmpfs, ``/dev/shm`` by default) so that a client on
the same host can map the very same pages (the SHM transport). It is sized with
``ftruncate`` and optionally pre-faulted (``MAP_POPULATE``) so the first writes do
not pay page faults. Which ranges hold objects is the meta's business (it runs the
allocator); the segment only bounds-checks and hands out views.
"""

from __future__ import annotations

import mmap
import os
import re

from gcache.errors import GCacheError

PAGE = mmap.PAGESIZE


class Segment:
    __slots__ = ("_fd", "_mm", "capacity", "path", "view")

    def __init__(self, path: str, capacity: int, populate: bool = False) -> None:
        self.path = path
        self.capacity = capacity
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise GCacheError(f"cannot create segment file {path}: {exc}") from exc
        try:
            os.ftruncate(self._fd, capacity)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(self._fd, capacity, flags=flags)
        except OSError as exc:
            os.close(self._fd)
            os.unlink(path)
            raise GCacheError(f"cannot map a {capacity}-byte segment at {path}: {exc}") from exc
        self.view = memoryview(self._mm)

    @staticmethod
    def file_name(server_id: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", server_id)
        return f"gcache-{safe}-{os.getpid()}.seg"

    def in_bounds(self, offset: int, length: int) -> bool:
        return 0 <= offset and 0 <= length and offset + length <= self.capacity

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
