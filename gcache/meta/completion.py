"""A server's report complete: every DRAM range it reported (adopted or parked)
marked used in a new allocator built from the gaps between them, and what
overlaps an earlier range forgotten. Plain code over the meta's records, no I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from gcache.meta.index import Index
from gcache.meta.parked import ParkedBooks
from gcache.meta.records import LIVE, ObjectRecord, Parked, ParkedChunk, ServerRecord
from gcache.storage.allocator import SegmentAllocator

Held = ObjectRecord | Parked | ParkedChunk
Ranges = tuple["np.ndarray[Any, Any]", "np.ndarray[Any, Any]"]  # (offsets, lengths)


def reported_ranges(
    srv: ServerRecord, books: ParkedBooks, index: Index
) -> tuple[list[tuple[int, int]] | Ranges, list[tuple[int, Held]]]:
    """Every DRAM range of a server whose report completes (adopted, parked one by
    one or in chunks), by offset, and apart those overlapping an earlier one (with
    what holds each). In the usual case, nothing overlapping, as two arrays
    (offsets, lengths) checked at once, without a tuple per range."""
    reported = srv.reported
    assert reported is not None
    offs, oids = reported.arrays()
    lens = index.cx.objects.cols["length"][oids].astype(np.int64)
    more = [(off, p.length) for off, p in srv.parked.items() if type(p) is Parked]
    for chunk in books.chunks_of(srv):
        more += chunk.ranges.items()
    if more:
        offs = np.concatenate([offs, np.fromiter((r[0] for r in more), np.int64, len(more))])
        lens = np.concatenate([lens, np.fromiter((r[1] for r in more), np.int64, len(more))])
    order = np.argsort(offs, kind="stable")
    offs, lens = offs[order], lens[order]
    mask = srv.allocator.align - 1
    ends = offs + ((lens + mask) & ~mask)
    if bool((offs[1:] >= ends[:-1]).all()):
        return (offs, lens), []
    used: list[tuple[int, int]] = []
    cursor = 0
    overlapping: list[tuple[int, Held]] = []
    for off, length in zip(offs.tolist(), lens.tolist(), strict=True):
        if off < cursor:
            mine = reported.get(off)
            overlapping.append((off, index.obj(mine) if mine >= 0 else srv.parked[off]))
            continue
        used.append((off, length))
        cursor = off + ((length + mask) & ~mask)
    return used, overlapping


def complete_report(
    srv: ServerRecord, books: ParkedBooks, index: Index, counters: Counter[str]
) -> None:
    """Build ``srv``'s allocator with every reported DRAM range used (no
    allocation per range) and mark its report complete (placement may use it once
    the caller invalidated the live set); records whose range is another's are
    forgotten."""
    used, overlapping = reported_ranges(srv, books, index)
    alloc = SegmentAllocator.with_used(srv.allocator.capacity, srv.allocator.align, used)
    assert srv.reported is not None
    for p in srv.parked.values():
        p.allocated = True
    srv.allocator = alloc
    srv.reported = None
    counters["reports_completed"] += 1
    forget_overlapping(srv, overlapping, index, books, counters)


def forget_overlapping(
    srv: ServerRecord,
    overlapping: list[tuple[int, Held]],
    index: Index,
    books: ParkedBooks,
    counters: Counter[str],
) -> None:
    """Records of ``srv`` whose DRAM range turned out to be another's (its report
    complete, :func:`reported_ranges`): forgotten without freeing anything (the
    server's record at that offset belongs to the first one)."""
    for off, what in overlapping:
        counters["report_invalid"] += 1
        if isinstance(what, ParkedChunk):
            del what.ranges[off]
            del srv.parked[off]
            what.skip.add(off)
        elif isinstance(what, Parked):
            what.allocated = False
            books.unpark(what)
        elif what.state == LIVE:
            entry = what.entry
            ns = index.ns_of(entry)
            index.forget(index.unlink(ns, entry, what.group))
            index.prune(ns, entry)
