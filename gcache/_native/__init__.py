"""Copy and checksum fused in one pass over the bytes, without the GIL.

The data plane's per-byte work: a shared-memory read copies an object's ranges
out of the mapped segment and verifies each layer's checksum; a put checksums
each layer (and, over shared memory, copies it into the segment); a TCP read
verifies what it received. :func:`copy_checksums` and :func:`checksums` do that
for a whole list of pieces in one call: in C (``_dataplane.c``), releasing the
GIL, hashing each 32 KiB step right after copying it (while it is in cache), and
splitting calls of several MiB across threads.

A *unit* is ``group`` consecutive pieces (a layer's K then V: ``group=2``); each
unit's checksum is 8 bytes, ``xxhash.xxh3_64(b"".join(unit)).digest()``, the one
checksum every writer and reader of GCache uses (``CHECKSUM``). The pure-Python
path (:mod:`gcache._native.fallback`, numpy copies and the ``xxhash`` package)
gives the same bytes; it is used when ``GCACHE_NATIVE=0`` or the extension was not
built, and the tests run both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Final, NamedTuple

from gcache._native import fallback

__all__ = [
    "CHECKSUM",
    "INDEX_KERNELS",
    "NATIVE",
    "LayerCopy",
    "checksums",
    "copy_checksums",
    "read_layer",
    "set_threads",
    "verify",
]

CHECKSUM: Final = "xxh3-64"
Buffer = memoryview | bytes | bytearray

log = logging.getLogger("gcache.native")

try:
    from gcache._native import _dataplane
except ImportError as exc:  # a build without the extension: still correct, slower
    log.warning("native data plane unavailable (%s): using the Python path", exc)
    _dataplane = None  # type: ignore[assignment]

NATIVE: Final = _dataplane is not None and os.environ.get("GCACHE_NATIVE", "1") != "0"

# The compact index's kernels (``_index.c``: heap sifts, key probes, a lookup's
# binary search) over its numpy columns; None: the index's own Python loops, the
# same results (``GCACHE_NATIVE=0`` or no build; the tests run both).
try:
    from gcache._native import _index
except ImportError as exc:
    log.warning("native index kernels unavailable (%s): using the Python path", exc)
    _index = None  # type: ignore[assignment]

INDEX_KERNELS: Final = _index if os.environ.get("GCACHE_NATIVE", "1") != "0" else None


def checksums(src: Sequence[Buffer], group: int) -> bytes:
    """One 8-byte checksum per ``group`` consecutive pieces of ``src``."""
    if NATIVE:
        return _dataplane.checksums(src, group)
    return fallback.checksums(src, group)


def copy_checksums(
    dst: Sequence[Buffer], src: Sequence[Buffer], group: int, *, hash_src: bool = False
) -> bytes:
    """Copy ``src[i]`` into ``dst[i]`` (equal lengths, not overlapping) and return
    the checksum of every ``group`` pieces, computed in the same pass: over the
    bytes written to ``dst`` (a read: what the caller gets is what is verified),
    or over ``src`` with ``hash_src`` (a write: the caller's own bytes)."""
    if NATIVE:
        return _dataplane.copy_checksums(dst, src, group, hash_src)
    return fallback.copy_checksums(dst, src, group, hash_src)


class LayerCopy(NamedTuple):
    """One layer's blocks to copy out of a mapped segment and verify: built once by
    the read plan, unpacked once into the kernel's arguments (the fields are in
    the kernel's order, after the segment).

    Block ``r`` (``offsets``, ``rows``: int64 buffers): K is
    ``seg[offsets[r] + off, +kb)``, V the ``vb`` bytes after it; they land in row
    ``rows[r]`` of ``kdst`` (``kb`` bytes a row) and ``vdst`` (``vb``), and the
    xxh3-64 of what landed must equal ``sums[r * stride + 8 * li, +8)``."""

    kdst: Buffer
    vdst: Buffer
    offsets: Buffer
    rows: Buffer
    sums: Buffer
    stride: int
    li: int
    off: int
    kb: int
    vb: int


def read_layer(seg: Buffer, copy: LayerCopy) -> int:
    """One layer's blocks (:class:`LayerCopy`) out of a mapped segment, copied and
    verified in one call. Returns -1 when every block matched, else the first
    block that did not. A range outside ``seg`` or a row outside the destinations
    raises ``ValueError`` before any byte moves."""
    if NATIVE:
        return _dataplane.read_layer(seg, *copy)
    return fallback.read_layer(seg, *copy)


def verify(src: Sequence[Buffer], group: int, want: bytes) -> bool:
    """Whether every unit of ``src`` hashes to its 8 bytes of ``want``."""
    return checksums(src, group) == want


def set_threads(n: int) -> int:
    """Threads one large call is split across (default: the CPUs, at most 4).
    Returns the previous setting."""
    if NATIVE:
        return _dataplane.set_threads(n)
    return fallback.set_threads(n)
