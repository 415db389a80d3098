"""Putting reported records into the index, or on the parked books.

The adoption half of the rebuild (``meta/rebuild.py`` drives it from the servers'
reports): :meth:`Adoption.adopt_columns` adopts records whose namespace and
parent block are known in one pass with no per-record helper call (a restarted
meta adopts a million of them); the others are parked (:class:`Parked`, with
their DRAM ranges kept allocated) or dropped when they cannot be right. Adopted
records get ``last_access`` from their sequence number. No I/O.
"""

from __future__ import annotations

from collections import Counter
from itertools import repeat
from typing import Any

import numpy as np

from gcache.config import MetaConfig
from gcache.meta.adoptrun import ADOPTED, AGAIN, DEFERRED, INVALID, AdoptRun
from gcache.meta.index import Index
from gcache.meta.parked import ParkedBooks
from gcache.meta.records import (
    NamespaceRecord,
    Parked,
    ParkedChunk,
    Reported,
    ServerRecord,
    group_layer_bytes,
)
from gcache.storage.columns import Columns


def parked_from(cols: Columns) -> list[Parked]:
    """The records of a decoded columnar chunk (already in block order)."""
    fields = cols.fields()
    out = list(map(Parked, *fields[:10]))  # (positions 0-9 of StoredRecord)
    if cols.layer_bytes is not None:
        for rec, lb in zip(out, cols.layer_bytes, strict=True):
            rec.layer_bytes = lb
    return out


Row = tuple[bytes, bytes, bytes, int, int, int, int, int, bytes, int, tuple[int, ...]]


def parked_row(row: Row, srv: ServerRecord, own: ParkedChunk | None, now: float) -> Parked:
    """One record of a chunk (a row in FIELDS order) as a Parked of ``srv``, or of
    ``own``, the parked chunk it was a row of."""
    rec = Parked(*row[:10], layer_bytes=row[10], server=srv)
    if own is None:
        rec.since = now
    else:
        rec.since, rec.allocated = own.since, own.allocated
    return rec


def recency(now: float, seq: int) -> float:
    """``last_access`` of an adopted object: within the second before ``now``, in
    the order of the server's sequence numbers."""
    return now - 1.0 + min(seq, 10**9) * 1e-9


class Adoption:
    """The adoption of reported records into the index, and what parking a record
    or dropping it means for its server (the rebuild's other half: ``Rebuild``
    feeds it the servers' reports; the books themselves are :class:`ParkedBooks`)."""

    def __init__(
        self, cfg: MetaConfig, counters: Counter[str], index: Index, books: ParkedBooks
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.books = books

    def adopt_columns(
        self,
        srv: ServerRecord | None,
        cols: Columns,
        now: float,
        origin: list[Parked] | None = None,
        credit: dict[str, int] | None = None,
        owners: list[ParkedChunk] | None = None,
        servers: list[ServerRecord] | None = None,
    ) -> tuple[int, int, list[Parked]]:
        """Adopt records (in block order) whose namespace and parent are known, in
        one pass with no per-record helper calls (1M records: see
        bench/meta_rebuild.py); park those waiting for their namespace (a whole
        chunk of one unknown namespace as a :class:`ParkedChunk`), drop the
        impossible ones. The records are a chunk of ``srv`` or, with ``origin``,
        parked records (off the books, of live servers) being retried, their
        adoptions counted per server in ``credit``, or, with ``owners``, rows of
        parked chunks (off the books) and the chunk of each, or, with ``servers``,
        rows of several servers' chunks merged in block order and the server of
        each (adoptions counted in ``credit``). The adopted objects
        are admitted into the eviction policies in bulk, per namespace run.
        Returns (adopted, dropped, records whose parent is missing)."""
        n = len(cols)
        namespaces = self.index.namespaces
        if (
            origin is None
            and owners is None
            and srv is not None
            and n
            and cols.namespace_at(0) not in namespaces
            and self.park_chunk(srv, cols, now)
        ):
            return 0, 0, []
        counters = self.counters
        deferred: list[Parked] = []
        adopted = dropped = 0
        base = now - 1.0  # recency(now, seq)
        arrays = cols.arrays
        nsa = arrays.ns
        cuts = (np.flatnonzero(nsa[1:] != nsa[:-1]) + 1).tolist() if n > 1 else []
        fields: list[Any] | None = None  # (the lists: made if a run goes row by row)
        cur: ServerRecord | None = None
        held: Reported | None = None
        sparked: dict[int, Parked | ParkedChunk] = {}
        mask = cap = 0
        mine = 0  # objects of cur adopted (credited when cur changes)
        if origin is not None:
            row_srvs: list[Any] = [o.server for o in origin]
        elif owners is not None:
            row_srvs = [c.server for c in owners]
        else:
            row_srvs = servers if servers is not None else [srv] * n
        rows: list[Any] | None = None  # (row, origin, owner, server): made if needed
        mk = parked_row
        run: AdoptRun | None = None
        for i, j in zip([0, *cuts], [*cuts, n], strict=True):
            if i == j:
                continue
            # A run of rows of one namespace: its blocks probed at once, its new
            # blocks and objects added at its end, in bulk.
            ns = namespaces.get(arrays.spaces[int(nsa[i])])
            run = None if ns is None else AdoptRun(self.index, ns, arrays, i, j)
            if run is not None:  # a clean run (nearly all): at once
                fast = run.fast(arrays, cols.layer_bytes, i, j, row_srvs[i:j], base)
                if fast is not None:
                    if mine and credit is not None and cur is not None:
                        credit[cur.server_id] = credit.get(cur.server_id, 0) + mine
                    mine, cur = 0, None
                    for sid, m in fast.items():
                        adopted += m
                        if credit is not None:
                            credit[sid] = credit.get(sid, 0) + m
                    continue
            if rows is None:
                fields = cols.fields()
                rows = list(
                    zip(
                        zip(*fields, strict=True),
                        origin if origin is not None else repeat(None, n),
                        owners if owners is not None else repeat(None, n),
                        servers if servers is not None else repeat(srv, n),
                        strict=True,
                    )
                )
            for row, orig, own, rs in rows[i:j]:
                tier, off, length = row[5], row[6], row[7]
                s: ServerRecord = (
                    orig.server if orig is not None else own.server if own is not None else rs  # type: ignore[assignment]
                )
                if s is not cur:
                    if mine and credit is not None and cur is not None:
                        credit[cur.server_id] = credit.get(cur.server_id, 0) + mine
                    mine = 0
                    cur = s
                    held = s.reported
                    sparked = s.parked
                    mask = s.allocator.align - 1
                    cap = s.allocator.capacity
                if (
                    length <= 0
                    or tier > 1
                    or (
                        tier == 0
                        and (
                            off & mask
                            or off + length > cap
                            or (held is not None and off in held)
                            or off in sparked
                            or (run is not None and (id(s), off) in run.taken)
                        )
                    )
                ):
                    rec = orig or mk(row, s, own, now)
                    counters["report_invalid"] += 1
                    self.release_parked(rec)
                    dropped += 1
                    continue
                if run is None:
                    self.park_for_namespace(orig or mk(row, s, own, now))
                    continue
                got = run.adopt(row, s, base)
                if got == ADOPTED:
                    adopted += 1
                    mine += 1
                elif got == DEFERRED:
                    deferred.append(orig or mk(row, s, own, now))
                elif got == AGAIN:
                    dropped += 1  # reported again (a re-registration): already adopted
                else:
                    counters["report_invalid" if got == INVALID else "report_duplicates"] += 1
                    self.release_parked(orig or mk(row, s, own, now))
                    dropped += 1
            if run is not None:
                run.finish()
        if mine and credit is not None and cur is not None:
            credit[cur.server_id] = credit.get(cur.server_id, 0) + mine
        return adopted, dropped, deferred

    def park_chunk(self, srv: ServerRecord, cols: Columns, now: float) -> bool:
        """Park a chunk of ``srv`` whose records are all of one namespace not
        registered yet, whole, in its columns; False (nothing done) when one of its
        records would be dropped at once (then it goes record by record)."""
        n = len(cols)
        if (
            cols.namespace.count(cols.namespace[0]) != n
            or min(cols.length) <= 0
            or max(cols.tier) > 1
        ):
            return False
        ranges = {
            off: ln for off, ln, t in zip(cols.offset, cols.length, cols.tier, strict=True) if not t
        }
        if len(ranges) != cols.tier.count(0):
            return False  # two records at one offset
        mask = srv.allocator.align - 1
        cap = srv.allocator.capacity
        held = srv.reported
        sparked = srv.parked
        if any(off & mask or off + ln > cap for off, ln in ranges.items()):
            return False
        # (views on both sides: isdisjoint walks the smaller one, not the books)
        if not ranges.keys().isdisjoint(sparked.keys()) or (
            held is not None and any(off in held for off in ranges)
        ):
            return False
        self.books.park_chunk(ParkedChunk(cols, srv, now, ranges))
        self.counters["objects_parked"] += n
        self.bound_parked()
        return True

    def release_chunk(self, chunk: ParkedChunk) -> None:
        """A parked chunk that will not be adopted (off the books): its server drops
        its records (:meth:`_release_parked` for each)."""
        srv = chunk.server
        if not srv.alive:
            return
        cols = chunk.cols
        srv.drop_out += [
            (off, ln) for t, off, ln in zip(cols.tier, cols.offset, cols.length, strict=True) if t
        ]
        if chunk.allocated:
            chunk.allocated = False
            for off, ln in chunk.ranges.items():
                self.index.free_range(srv, off, ln)
        elif srv.reported is not None:
            srv.freed += chunk.ranges.items()

    def bound_parked(self) -> None:
        """At most ``max_parked_objects`` parked: the oldest go (a parked chunk
        whole, before single records)."""
        books = self.books
        limit = self.cfg.max_parked_objects
        while len(books) > limit:
            chunk = books.oldest_chunk()
            if chunk is not None:
                books.unpark_chunk(chunk)
                self.release_chunk(chunk)
                self.counters["parked_dropped"] += len(chunk.cols)
                continue
            old = books.oldest_record()
            assert old is not None
            books.unpark(old)
            self.release_parked(old)
            self.counters["parked_dropped"] += 1

    def adopt_known(self, ns: NamespaceRecord, rec: Parked, now: float) -> tuple[int, int]:
        """Adopt a record of a known namespace (not on the parked books), creating
        its entry under its parent; park it while its parent is unknown. Returns
        (adopted, dropped)."""
        srv = rec.server
        assert srv is not None
        if self.clash(srv, rec):
            self.counters["report_invalid"] += 1
            self.release_parked(rec)
            return 0, 1
        entries = ns.entries
        bid = entries.find(rec.key)
        if bid < 0:
            parent = -1
            if rec.pos:
                parent = entries.find(rec.parent)
                pos = self.index.cx.blocks.cols["pos"]
                if parent < 0 or int(pos[parent]) + 1 != rec.pos:
                    self.park_for_parent(rec)
                    return 0, 0
            bid = self.index.new_block(ns, rec.key, parent, rec.pos)
        if self.adopt(ns, bid, rec, now):
            return 1, 0
        return 0, 1

    @staticmethod
    def clash(srv: ServerRecord, rec: Parked) -> bool:
        """A DRAM record at an offset another reported record holds (one not on the
        parked books: records waiting for a parent are checked again)."""
        if rec.tier != 0:
            return False
        held = srv.reported
        other = srv.parked.get(rec.offset)
        return (held is not None and rec.offset in held) or (other is not None and other is not rec)

    def park_for_namespace(self, rec: Parked) -> None:
        self.books.park_for_namespace(rec)
        self._parked()

    def park_for_parent(self, rec: Parked) -> None:
        self.books.park_for_parent(rec)
        self._parked()

    def _parked(self) -> None:
        self.counters["objects_parked"] += 1
        if len(self.books) > self.cfg.max_parked_objects:
            self.bound_parked()

    def release_parked(self, rec: Parked) -> None:
        """A reported object that will not be adopted: its server drops it (and its
        DRAM range, if already in the allocator, is freed)."""
        srv = rec.server
        if srv is None or not srv.alive:
            return
        if rec.tier == 1:
            srv.drop_out.append((rec.offset, rec.length))
        elif rec.allocated:
            rec.allocated = False
            self.index.free_range(srv, rec.offset, rec.length)
        elif srv.reported is not None:
            # Nothing is placed on a server before its report is complete: the
            # range holds no one else's object, the server may drop the record.
            srv.freed.append((rec.offset, rec.length))

    def adopt(self, ns: NamespaceRecord, bid: int, rec: Parked, now: float) -> bool:
        srv = rec.server
        assert srv is not None
        layout = ns.layout
        index = self.index
        g = rec.group
        if (
            g >= layout.num_groups
            or rec.length != layout.group_object_bytes[g]
            or len(rec.sums) != 8 * len(layout.group_layers[g])
            or (rec.layer_bytes and rec.layer_bytes != group_layer_bytes(layout, g))
        ):
            self.counters["report_invalid"] += 1
            self.release_parked(rec)
            index.prune(ns, bid)
            return False
        have = int(index.cx.blocks.cols["obj"][bid, g])
        if have >= 0:
            o = index.cx.objects.cols
            if (
                index.store.servers[int(o["server"][have])] is srv
                and int(o["tier"][have]) == rec.tier
                and int(o["offset"][have]) == rec.offset
            ):
                return False  # reported again (a re-registration): already adopted
            self.counters["report_duplicates"] += 1
            self.release_parked(rec)
            return False
        seq = rec.seq
        last = now - 1.0 + (seq if seq < 10**9 else 10**9) * 1e-9  # recency(now, seq)
        oids = index.add_objects(
            ns, np.array([bid], dtype=np.int32), g, srv, [rec.offset], rec.length,
            np.frombuffer(rec.sums, dtype=np.uint8).reshape(1, len(rec.sums)),
            np.array([last]), "", rec.tier,
        )  # fmt: skip
        if rec.tier == 0 and srv.reported is not None:
            srv.reported.add(rec.offset, int(oids[0]))
        # (Adopted after the report completed, it was parked: its range is allocated.)
        index.admit(ns, oids)
        return True
