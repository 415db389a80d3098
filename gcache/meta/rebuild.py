# One file (over 450 lines): the path of a report chunk, from its stream through
# adoption and retries to the report's completion, read top to bottom in one place.
"""Rebuilding the index from the servers' reports (after a meta or server restart).

After ``RegisterServer`` a server that holds objects streams its manifest
(``ReportObjects``, DRAM and NVMe records, ``last`` on the final chunk). Each record
goes back into the index at once (lookups answer with what is known while reports
arrive), but nothing new is placed on that server until its report is complete:
only then is its allocator built, with every reported DRAM range marked used, so a
meta that lost its memory never hands out a range that holds live data.

A record is *parked* when its namespace is not registered yet (clients register
theirs again on their first request to a restarted meta) or its parent block has
not been reported (by this server or another). Parked DRAM ranges stay allocated.
Records waiting for a parent are kept per namespace and retried in block order, in
bulk: after every chunk while few wait, else once as many records arrived since the
last retry as wait (so retrying costs about one check per record reported), at the end of
every report, and when their namespace is registered; a record whose parent came
in the next chunk of another server is adopted then, at about the cost of one
adopted at once (the four streams of a restarted cluster interleave; a server that
does not sort its manifest costs one pass more). Records waiting for their namespace
are adopted when it is registered.

Before any of that, the streams are merged by block position
(``meta/streams.py``): rows past the position every other stream in progress has
reached are held, in columns, and adopted with the rows of the other streams'
later chunks in one pass, so a record whose parent is on another server mostly
finds it in the index instead of being deferred and retried.

A meta that restarted (its index nearly empty when a report begins) adopts in a
bulk load: the eviction heaps are not kept while reports arrive (a chain reported
across chunks and servers would push and pull each parent's object about once a
block) and are built by one sort when the last report ends, or as soon as a put
or a watermark pass needs a victim, after which the load goes on with them kept.

Parked records are freed (the server drops them) after ``parked_ttl_s`` or when
more than ``max_parked_objects`` wait. Adopted records get ``last_access`` from
their sequence number, so the eviction order is the recorded one as far as it goes.

A record that cannot be right (out of the segment, misaligned, overlapping another,
a wrong length or checksum count for its group) is dropped and freed, never
adopted. Two copies of one object (DRAM and NVMe after a crash mid-demotion, or on
two servers) keep the first reported; the other is freed. No I/O.
"""

from __future__ import annotations

from collections import Counter
from operator import attrgetter

import numpy as np

from gcache.config import MetaConfig
from gcache.keys import KEY_SIZE
from gcache.meta.adopt import Adoption, parked_from
from gcache.meta.completion import complete_report
from gcache.meta.index import Index
from gcache.meta.membership import Membership
from gcache.meta.parked import ParkedBooks
from gcache.meta.records import (
    BlockEntry,
    Entries,
    NamespaceRecord,
    Parked,
    ParkedChunk,
    Reported,
    ServerRecord,
)
from gcache.meta.streams import PACE_SLACK_ROWS, StreamMerge, in_order, merged
from gcache.storage.columns import Columns, columns_of, concat

# While at most this many records wait for a parent, they are retried after every
# chunk (a few checks); past it only once as many records arrived as wait.
RETRY_EAGER = 256
# A report that begins while the index holds at most this many objects (a meta
# that restarted, its whole cluster reporting) adopts with the eviction heaps not
# kept; they are built by one sort when the last report completes, or as soon as
# anything needs a victim (``Leaves.victim``).
BULK_BELOW = 1 << 16
_POS = attrgetter("pos")

__all__ = ["RETRY_EAGER", "Parked", "Rebuild"]  # Parked: callers import it from here


class Rebuild:
    """The servers' reports, chunk by chunk, into :class:`Adoption`; what waits is
    on the :class:`ParkedBooks`, retried here; a server's allocator built when its
    report is complete."""

    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        index: Index,
        members: Membership,
        adoption: Adoption,
        books: ParkedBooks,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.members = members
        self.adoption = adoption
        self.books = books
        # records reported since the last retry of parked_parent
        self._since_retry = 0
        # objects of a server adopted while another server's report was adopted (a
        # parent arrived): added to its own ReportObjectsReply.adopted
        self._credit: dict[str, int] | None = None
        # server id -> its last chunk's records whose parent was missing: retried
        # after the other servers' chunks, parked before its own next chunk
        # (meta/pacing.py holds that stream meanwhile)
        self._deferred: dict[str, list[Parked]] | None = None
        # the report streams merged by block position (rows held in columns)
        self.streams = StreamMerge()
        # objects the index will hold once the reports in progress are adopted (as
        # the servers said): the tables' room, made at once
        self._expect = 0

    def begin_report(self, srv: ServerRecord, objects: int = 0) -> None:
        """``srv`` will report what it holds (``objects``, as it said: room is
        made for them at once): no placement on it until it is done."""
        if srv.reported is None and not srv.objects:
            srv.reported = Reported(srv.allocator.align)
            self.members.invalidate()
            cx = self.index.cx
            if not cx.bulk and self.index.live_objects <= BULK_BELOW:
                cx.begin_bulk()
                self.counters["rebuild_bulk_loads"] += 1
            if not any(
                s.reported is not None for s in self.members.servers.values() if s is not srv
            ):
                self._expect = self.index.live_objects  # (the first report of a wave)
            self._expect += max(objects, 0)
            cx.reserve(self._expect)
        if self._credit:
            self._credit.pop(srv.server_id, None)
        # A server that registers again reports everything again: forget what was
        # held of its earlier stream (not released: its records are reported anew).
        self.streams.take(srv.server_id)

    def _reporting(self, server_id: str, incarnation: int, now: float) -> ServerRecord | None:
        srv = self.members.servers.get(server_id)
        if srv is None or not srv.alive or srv.incarnation != incarnation:
            return None
        srv.last_seen = now
        return srv

    def report_columns(
        self, server_id: str, incarnation: int, cols: Columns, last: bool, now: float
    ) -> tuple[int, int] | None:
        """One chunk of a server's report, decoded from columns (in block order).
        Returns (adopted, dropped): adopted counts this server's objects adopted
        during the call, including those that waited for a parent; None when the
        server is not registered with this incarnation (it must re-register)."""
        srv = self._reporting(server_id, incarnation, now)
        if srv is None:
            return None
        if srv.reported is None:
            return 0, self._reported_again(srv, parked_from(cols))
        if (len(cols) and cols.namespace_at(0) in self.index.namespaces) or (
            last and self.streams.holds(srv.server_id)
        ):
            return self._merged(srv, cols, last, now)
        adopted, dropped, deferred = self.adoption.adopt_columns(srv, cols, now)
        return self._after_chunk(srv, adopted, dropped, deferred, last, now)

    def _merged(self, srv: ServerRecord, cols: Columns, last: bool, now: float) -> tuple[int, int]:
        """A chunk through the merge of the report streams: what it no longer holds,
        of every stream, adopted in block order in one pass. ``dropped`` counts the
        rows dropped in that pass (nearly always all of them this chunk's)."""
        cols, servers = merged(self.streams.push(srv, cols, last, now))
        credit = self._credit if self._credit is not None else {}
        self._credit = credit
        adopted, dropped, deferred = self.adoption.adopt_columns(
            None, cols, now, servers=servers, credit=credit
        )
        mine = credit.pop(srv.server_id, 0)
        self.counters["objects_adopted"] += adopted - mine  # other servers' (credited)
        return self._after_chunk(srv, mine, dropped, deferred, last, now)

    def flush_held(self, server_id: str, now: float) -> None:
        """Adopt (or defer and park) every row held of ``server_id``'s stream."""
        got = self.streams.take(server_id)
        if got is None:
            return
        srv, cols = got
        if not srv.alive or srv.reported is None:
            return
        credit = self._credit if self._credit is not None else {}
        self._credit = credit
        adopted, dropped, deferred = self.adoption.adopt_columns(
            None, cols, now, servers=[srv] * len(cols), credit=credit
        )
        self.counters["objects_adopted"] += adopted
        self.counters["objects_report_dropped"] += dropped
        if deferred:
            self._retry_deferred(deferred, now, park=True)

    def report_objects(
        self,
        server_id: str,
        incarnation: int,
        records: list[Parked],
        last: bool,
        now: float,
    ) -> tuple[int, int] | None:
        """:meth:`report_columns` for records one by one (``StoredObject``, what
        servers before columns send, and in-process drivers)."""
        srv = self._reporting(server_id, incarnation, now)
        if srv is None:
            return None
        if srv.reported is None:
            return 0, self._reported_again(srv, records)
        good: list[Parked] = []
        dropped = 0
        for rec in records:
            k, p = rec.key, rec.parent
            if len(k) != KEY_SIZE or (p and len(p) != KEY_SIZE) or (rec.pos == 0) != (not p):
                rec.server, rec.since = srv, now
                self.counters["report_invalid"] += 1
                self.adoption.release_parked(rec)
                dropped += 1
            else:
                good.append(rec)
        good.sort(key=_POS)
        cols = columns_of(good)
        adopted, lost, deferred = self.adoption.adopt_columns(srv, cols, now)
        return self._after_chunk(srv, adopted, dropped + lost, deferred, last, now)

    def _reported_again(self, srv: ServerRecord, records: list[Parked]) -> int:
        """Reported again after its report completed (a retried stream): only what
        is already adopted is accepted; the rest is ignored, not freed (its range
        may have been placed again since). Returns the records not accepted."""
        dropped = 0
        for rec in records:
            known = self.index.namespaces.get(rec.namespace)
            entry = known.entries.get(rec.key) if known is not None else None
            ok = entry is not None and rec.group < len(entry.objects)
            have = entry.objects[rec.group] if entry is not None and ok else None
            if have is None or have.server is not srv or have.offset != rec.offset:
                dropped += 1
        return dropped

    def _after_chunk(
        self,
        srv: ServerRecord,
        adopted: int,
        dropped: int,
        deferred: list[Parked],
        last: bool,
        now: float,
    ) -> tuple[int, int]:
        """After a chunk's own records: retry the previous chunk's records that
        waited for a parent (parking those still waiting), retry the parked ones
        when due, complete the report on ``last``."""
        self.counters["objects_adopted"] += adopted
        self._since_retry += adopted + len(deferred)
        dmap = self._deferred
        if dmap is None:
            dmap = self._deferred = {}
        own = dmap.pop(srv.server_id, None)
        if own:
            self._retry_deferred(own, now, park=True)
        for sid, recs in list(dmap.items()):  # this chunk may hold their parents
            left = self._retry_deferred(recs, now, park=False)
            if left:
                dmap[sid] = left
            else:
                del dmap[sid]
        if deferred:
            if last:
                self._retry_deferred(deferred, now, park=True)
            else:
                dmap[srv.server_id] = deferred
        if self.books.waiting_for_parent():
            waiting = self.books.waiting_for_parent()
            if last or waiting <= RETRY_EAGER or self._since_retry >= waiting:
                self._retry_parents(now)
        if self._credit:
            adopted += self._credit.pop(srv.server_id, 0)
        if last and srv.reported is not None:
            self._complete(srv)
        self.counters["objects_report_dropped"] += dropped
        return adopted, dropped

    def _retry_deferred(self, recs: list[Parked], now: float, park: bool) -> list[Parked]:
        """Records of one chunk (block order) that missed their parent: adopt those
        whose parent came since (or comes among them) in one pass; park the others
        (``park``) or return them."""
        credit = self._credit if self._credit is not None else {}
        ready: list[Parked] = []
        rest: list[Parked] = []
        coming: set[bytes] = set()
        fp = b""
        ns: NamespaceRecord | None = None
        entries: Entries | dict[bytes, BlockEntry] = {}
        for rec in recs:
            srv = rec.server
            if rec.namespace != fp:
                fp = rec.namespace
                ns = self.index.namespaces.get(fp)
                entries = ns.entries if ns is not None else {}
            if srv is None or not srv.alive or ns is None:
                continue
            parent = entries.get(rec.parent)
            if (parent is not None and parent.pos + 1 == rec.pos) or rec.parent in coming:
                ready.append(rec)
                coming.add(rec.key)
            else:
                rest.append(rec)
        n = 0
        if ready:
            n, _, missed = self.adoption.adopt_columns(None, columns_of(ready), now, ready, credit)
            if missed:
                rest += missed
                rest.sort(key=_POS)
        self._credit = credit
        self.counters["objects_adopted"] += n
        if not park:
            return rest
        for rec in rest:
            srv = rec.server
            assert srv is not None
            if self.adoption.clash(srv, rec):
                self.counters["report_invalid"] += 1
                self.adoption.release_parked(rec)
            else:
                self.adoption.park_for_parent(rec)
        return []

    def deferred_of(self, server_id: str) -> int:
        """Records of ``server_id``'s stream that wait for the others (what
        ``meta/pacing.py`` holds the stream on): those of its last chunk still
        missing a parent, and its rows held by the merge past a slack of
        :data:`~gcache.meta.streams.PACE_SLACK_ROWS` (a stream that far ahead
        waits, so the merge's bound is not reached and nothing is parked)."""
        recs = self._deferred.get(server_id) if self._deferred else None
        ahead = self.streams.held_of(server_id) - PACE_SLACK_ROWS
        return (len(recs) if recs else 0) + max(ahead, 0)

    def _retry_parents(self, now: float) -> int:
        """Adopt, in block order, the parked records whose parent block is now in
        the index or among them (a chain of them in one pass, through the one-pass
        adoption); the rest wait on. Returns the objects adopted (credited to their
        servers, see ``_credit``)."""
        self._since_retry = 0
        books = self.books
        pools = books.take_parent_pools()
        credit = self._credit if self._credit is not None else {}
        n = 0
        for fp, pool in pools.items():
            ns = self.index.namespaces.get(fp)
            if ns is None:
                continue
            entries = ns.entries
            pool.sort(key=_POS)  # runs of sorted chunks: merged, not re-sorted
            keep: list[Parked] = []
            ready: list[Parked] = []
            coming: set[bytes] = set()
            for rec in pool:
                if not books.is_parked(rec):
                    continue  # expired, dropped or adopted meanwhile
                parent = entries.get(rec.parent)
                if (parent is not None and parent.pos + 1 == rec.pos) or rec.parent in coming:
                    ready.append(rec)
                    coming.add(rec.key)
                else:
                    keep.append(rec)
            n += self._adopt_parked(ns, ready, now, credit)
            if keep:
                books.requeue_for_parent(fp, keep)
        self._credit = credit
        self.counters["objects_adopted"] += n
        return n

    def _adopt_parked(
        self, ns: NamespaceRecord, recs: list[Parked], now: float, credit: dict[str, int] | None
    ) -> int:
        """Take parked records of ``ns`` (block order) off the books and adopt them
        in one pass; those still missing their parent are parked again."""
        live: list[Parked] = []
        for rec in recs:
            self.books.unpark(rec)
            srv = rec.server
            if srv is not None and srv.alive:
                live.append(rec)
        if not live:
            return 0
        got, _, deferred = self.adoption.adopt_columns(None, columns_of(live), now, live, credit)
        for rec in deferred:
            self.adoption.park_for_parent(rec)
        return got

    def _complete(self, srv: ServerRecord) -> None:
        """The report of ``srv`` is complete: build its allocator with every
        reported DRAM range (adopted or parked) used, from the gaps between them
        (no allocation per range), then open it for placement."""
        complete_report(srv, self.books, self.index, self.counters)
        self.members.invalidate()
        self.end_bulk()

    def end_bulk(self) -> None:
        """No report in progress (each complete, or its server gone): build the
        eviction heaps of a bulk load, if one is on."""
        cx = self.index.cx
        if cx.bulk and not any(
            s.alive and s.reported is not None for s in self.members.servers.values()
        ):
            cx.end_bulk()

    def adopt_parked_namespace(self, ns: NamespaceRecord, now: float) -> int:
        """``ns`` was registered: adopt what was reported for it (its parked chunks
        merged in block order, in one pass)."""
        chunks, waiting = self.books.take_namespace(ns.fingerprint)
        n = self._adopt_chunks(ns, chunks, now)
        if waiting:
            waiting.sort(key=_POS)
            n += self._adopt_parked(ns, waiting, now, None)
        self.counters["objects_adopted"] += n
        if self.books.waiting_for_parent(ns.fingerprint):
            n += self._retry_parents(now)
        return n

    def _adopt_chunks(self, ns: NamespaceRecord, chunks: list[ParkedChunk], now: float) -> int:
        """Adopt the rows of parked chunks of ``ns`` (taken off the books), merged
        in block order, in one pass; rows still missing their parent are parked one
        by one."""
        live = [c for c in chunks if c.server.alive]
        if not live:
            return 0
        if len(live) == 1 and not live[0].skip:
            cols = live[0].cols
            owners = [live[0]] * len(cols)
        else:
            parts: list[Columns] = []
            owners = []
            for c in live:
                cols = c.cols
                if c.skip:  # rows whose range turned out to be another's
                    keep = [
                        i
                        for i, (t, off) in enumerate(zip(cols.tier, cols.offset, strict=True))
                        if t or off not in c.skip
                    ]
                    cols = cols.take(np.array(keep, dtype=np.int64))
                parts.append(cols)
                owners += [c] * len(cols)
            cols, ordered = in_order(concat(parts), owners)
            owners = ordered if ordered is not None else owners
            if not any(cols.layer_bytes or ()):
                cols.layer_bytes = None
        got, _, deferred = self.adoption.adopt_columns(None, cols, now, owners=owners)
        for rec in deferred:
            self.adoption.park_for_parent(rec)
        return got

    def parked_of(self, server_id: str) -> int:
        """Records of ``server_id`` still parked (waiting for a namespace or parent)."""
        srv = self.members.servers.get(server_id)
        return 0 if srv is None else self.books.of_server(srv)

    def expire_parked(self, now: float) -> None:
        """Free parked records older than ``parked_ttl_s``; park the records that
        waited a second for a next chunk that did not come."""
        for sid in self.streams.stalled(now, 1.0):  # stop holding a stalled stream's rows
            self.flush_held(sid, now)
        if self._deferred:
            for sid, due in list(self._deferred.items()):
                if due[0].since < now - 1.0:
                    del self._deferred[sid]
                    self._retry_deferred(due, now, park=True)
        cutoff = now - self.cfg.parked_ttl_s
        books = self.books
        while (chunk := books.oldest_chunk()) is not None and chunk.since <= cutoff:
            books.unpark_chunk(chunk)
            self.adoption.release_chunk(chunk)
            self.counters["parked_expired"] += len(chunk.cols)
        while (rec := books.oldest_record()) is not None and rec.since <= cutoff:
            books.unpark(rec)
            self.adoption.release_parked(rec)
            self.counters["parked_expired"] += 1
        books.drop_stale()
