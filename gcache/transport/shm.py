"""Shared-memory data path: a client on the server's host maps the segment file
and copies bytes directly, with no socket and no server CPU.

The same rules as TCP hold: ranges come from the meta's grants (a read lease pins
the objects; a write grant names a freshly allocated range), and the client
verifies every read against its checksums. What the capability tag enforces on
TCP is the client's own discipline here: a process that can map the segment is
trusted like the server's own user.
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Sequence

from gcache.errors import AccessDenied, ConnectionLost


class MappedSegment:
    __slots__ = ("_mm", "path", "size", "view")

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ConnectionLost(f"cannot open segment {path}: {exc}") from exc
        try:
            self.size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise ConnectionLost(f"cannot map segment {path}: {exc}") from exc
        finally:
            os.close(fd)
        self.view = memoryview(self._mm)

    def _range(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise AccessDenied(5, f"range [{offset}, +{length}) outside the segment")
        return self.view[offset : offset + length]

    def read_into(self, ranges: Sequence[tuple[int, int]], dest: Sequence[memoryview]) -> int:
        total = 0
        for (off, length), d in zip(ranges, dest, strict=True):
            d[:] = self._range(off, length)
            total += length
        return total

    def write(self, offset: int, payload: Sequence[memoryview]) -> int:
        pos = offset
        for v in payload:
            n = v.nbytes
            self._range(pos, n)[:] = v
            pos += n
        return pos - offset

    def close(self) -> None:
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass


def is_local(hostname: str, shm_path: str) -> bool:
    """Whether a server's segment can be mapped from here."""
    return bool(shm_path) and hostname == socket.gethostname() and os.path.exists(shm_path)
