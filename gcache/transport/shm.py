"""Shared-memory data path: a client on the server's host maps the segment file
and copies bytes directly, with no socket and no server CPU.

The same rules as TCP hold: ranges come from the meta's grants (a read lease pins
the objects; a write grant names a freshly allocated range), and the client
verifies every read against its checksums. What the capability tag enforces on
TCP is the client's own discipline here: a process that can map the segment is
trusted like the server's own user.

A copy must never kill the client's process: a segment whose file is not fully
allocated (a server that did not reserve its tmpfs space) is not mapped at all,
since a copy into a hole on a full tmpfs dies of SIGBUS. A mapping is dropped
(:meth:`MappedSegment.retire`) when its server restarts or goes away; copies
hold it (:meth:`MappedSegment.hold`), and the last one to finish unmaps it.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from gcache import _native as native
from gcache.errors import E_ACCESS_DENIED, E_OUT_OF_RANGE, AccessDenied, ConnectionLost

_BLOCK = 512  # st_blocks unit


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class MappedSegment:
    __slots__ = ("_arr", "_lock", "_mm", "_retired", "_users", "inode", "path", "size", "view")

    def __init__(self, path: str, populate: bool = False) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ConnectionLost(f"cannot open segment {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            self.size, self.inode = st.st_size, (st.st_dev, st.st_ino)
            if st.st_blocks * _BLOCK < st.st_size:
                raise ConnectionLost(
                    f"segment {path} is not fully allocated ({st.st_blocks * _BLOCK} of "
                    f"{st.st_size} bytes): a copy into it could fault on a full tmpfs, "
                    "so it is not mapped"
                )
            # MAP_POPULATE fills the page tables now: a fresh mapping otherwise takes a
            # fault per 4 KiB page on first touch (measured: 0.8 GB/s vs 9.8 warm).
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(fd, self.size, flags=flags)
        except OSError as exc:
            raise ConnectionLost(f"cannot map segment {path}: {exc}") from exc
        finally:
            os.close(fd)
        self.view = memoryview(self._mm)
        self._arr = np.frombuffer(self._mm, np.uint8)
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def mapped(self) -> bool:
        return not self._mm.closed

    def same_file(self) -> bool:
        """Whether the path still names the file this maps (a restarted server's
        start removes its dead predecessor's file)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    @contextmanager
    def hold(self) -> Iterator[np.ndarray]:
        """Keep the mapping while a copy runs (any thread); ConnectionLost once
        the mapping was retired."""
        with self._lock:
            if self._retired:
                raise ConnectionLost(f"segment {self.path} was dropped (its server restarted)")
            self._users += 1
        try:
            yield self._arr
        finally:
            with self._lock:
                self._users -= 1
                last = self._retired and self._users == 0
            if last:
                self._unmap()

    def retire(self) -> None:
        """No new copies; unmap now, or when the last copy in flight ends."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            idle = self._users == 0
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        try:
            del self._arr
        except AttributeError:
            pass
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the pages go with that view

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise AccessDenied(E_OUT_OF_RANGE, f"range [{offset}, +{length}) outside the segment")

    def read_into(self, ranges: Sequence[tuple[int, int]], dest: Sequence[memoryview]) -> int:
        # np.copyto drops the GIL for the copy (memoryview assignment does not): the
        # thread consuming layers keeps running while the next layer is copied.
        total = 0
        with self.hold() as arr:
            for (off, length), d in zip(ranges, dest, strict=True):
                self._check(off, length)
                np.copyto(np.frombuffer(d, np.uint8), arr[off : off + length])
                total += length
        return total

    def read_leased(
        self, ranges: Sequence[tuple[int, int]], dest: Sequence[memoryview], expiry_ms: int
    ) -> int:
        """``read_into`` under a read lease that ends at ``expiry_ms`` (unix ms, the
        earliest of the grants'). What the server checks on TCP, the client checks
        here: no copy starts after the lease ended, and a copy that outlived it is
        refused, because the meta may already have freed and reused those bytes."""
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired")
        n = self.read_into(ranges, dest)
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired during the copy")
        return n

    def read_checksums(
        self,
        ranges: Sequence[tuple[int, int]],
        dest: Sequence[memoryview],
        group: int,
        expiry_ms: int,
    ) -> bytes:
        """``read_leased`` with the checksums of what was copied, in the same pass
        (:func:`gcache._native.copy_checksums`, without the GIL): one 8-byte
        checksum per ``group`` ranges, taken over the bytes that landed in
        ``dest``. The caller compares them with the checksums the meta holds."""
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired")
        with self.hold():
            sums = self._copy(dest, ranges, group, into_segment=False)
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired during the copy")
        return sums

    def read_layer(self, copy: native.LayerCopy, expiry_ms: int) -> int:
        """One layer's blocks (:class:`gcache._native.LayerCopy`) copied out of the
        segment and verified in one native call, under a read lease that ends at
        ``expiry_ms`` with the checks of :meth:`read_leased`. Returns -1 when every
        block matched its checksum, else the first block that did not; a range
        outside the segment is refused before any byte moves."""
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired")
        with self.hold():
            try:
                bad = native.read_layer(self.view, copy)
            except ValueError as exc:
                raise AccessDenied(E_OUT_OF_RANGE, str(exc)) from exc
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired during the copy")
        return bad

    def write_checksums(
        self, offset: int, length: int, expiry_ms: int, payload: Sequence[memoryview], group: int
    ) -> bytes:
        """``write_granted`` that also returns the checksum of every ``group``
        payload pieces (a layer's K then V), computed over the caller's bytes in the
        same pass as the copy."""
        if now_ms() >= expiry_ms:
            raise AccessDenied(E_ACCESS_DENIED, "grant expired")
        n = sum(v.nbytes for v in payload)
        if n != length:
            raise AccessDenied(E_OUT_OF_RANGE, f"payload {n} B for a grant of {length} B")
        self._check(offset, length)
        spans = []
        pos = offset
        for v in payload:
            spans.append((pos, v.nbytes))
            pos += v.nbytes
        with self.hold():
            return self._copy(payload, spans, group, into_segment=True)

    def _copy(
        self,
        views: Sequence[memoryview],
        spans: Sequence[tuple[int, int]],
        group: int,
        into_segment: bool,
    ) -> bytes:
        """Copy between ``views`` and the segment ``spans`` (under :meth:`hold`),
        checksumming the private side. The segment views are released before the
        hold ends, so a retired mapping can be unmapped by its last user."""
        seg = self.view
        parts = []
        try:
            for off, length in spans:
                self._check(off, length)
                parts.append(seg[off : off + length])
            if into_segment:
                return native.copy_checksums(parts, views, group, hash_src=True)
            return native.copy_checksums(views, parts, group)
        finally:
            for part in parts:
                part.release()

    def write_granted(
        self, offset: int, length: int, expiry_ms: int, payload: Sequence[memoryview]
    ) -> int:
        """Write ``payload`` into ``[offset, +length)`` under a write grant that ends
        at ``expiry_ms``, with the checks the server makes on TCP. A write that
        outlives its grant can land on bytes the meta already gave to another put;
        that put's checksums turn them into a miss, never into wrong KV."""
        self.write_checksums(offset, length, expiry_ms, payload, max(1, len(payload)))
        return length

    def close(self) -> None:
        self.retire()


def is_local(hostname: str, shm_path: str) -> bool:
    """Whether a server's segment can be mapped from here."""
    return bool(shm_path) and hostname == socket.gethostname() and os.path.exists(shm_path)
