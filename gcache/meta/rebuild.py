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
are adopted when it is registered. Parked records are freed (the server drops
them) after ``parked_ttl_s`` or when more than ``max_parked_objects`` wait.
Adopted records get ``last_access`` from their sequence number, so the eviction
order is the recorded one as far as it goes.

A record that cannot be right (out of the segment, misaligned, overlapping another,
a wrong length or checksum count for its group) is dropped and freed, never
adopted. Two copies of one object (DRAM and NVMe after a crash mid-demotion, or on
two servers) keep the first reported; the other is freed. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from gcache.keys import KEY_SIZE
from gcache.meta.records import (
    GONE,
    LIVE,
    BlockEntry,
    NamespaceRecord,
    ObjectRecord,
    ServerRecord,
    group_layer_bytes,
)
from gcache.meta.tiers import Tiers
from gcache.storage.allocator import SegmentAllocator
from gcache.storage.columns import Columns, columns_of


@dataclass(slots=True)
class Parked:
    """One reported object (proto ``StoredObject``) of a server."""

    namespace: bytes
    key: bytes
    parent: bytes
    pos: int
    group: int
    tier: int
    offset: int
    length: int
    sums: bytes
    seq: int
    server: ServerRecord | None = None
    since: float = 0.0
    allocated: bool = False  # its DRAM range is in the allocator (report complete)
    layer_bytes: tuple[int, ...] = ()  # per-layer lengths when unequal (else ())


_POS = attrgetter("pos")


def parked_from(cols: Columns) -> list[Parked]:
    """The records of a decoded columnar chunk (already in block order)."""
    out = list(
        map(
            Parked,
            cols.namespace,
            cols.key,
            cols.parent,
            cols.pos,
            cols.group,
            cols.tier,
            cols.offset,
            cols.length,
            cols.sums,
            cols.seq,
        )
    )
    if cols.layer_bytes is not None:
        for rec, lb in zip(out, cols.layer_bytes, strict=True):
            rec.layer_bytes = lb
    return out


# While at most this many records wait for a parent, they are retried after every
# chunk (a few checks); past it only once as many records arrived as wait.
RETRY_EAGER = 256


def recency(now: float, seq: int) -> float:
    """``last_access`` of an adopted object: within the second before ``now``, in
    the order of the server's sequence numbers."""
    return now - 1.0 + min(seq, 10**9) * 1e-9


class Rebuild(Tiers):
    # namespace fingerprint -> parked records waiting for it
    parked_ns: dict[bytes, list[Parked]]
    # namespace fingerprint -> parked records waiting for their parent block, retried
    # in bulk (_retry_parents); entries no longer in parked_all are stale
    parked_parent: dict[bytes, list[Parked]]
    # every parked record in arrival order (id -> record): bound and expiry
    parked_all: dict[int, Parked]
    # records reported since the last retry of parked_parent
    _since_retry: int = 0
    # objects of a server adopted while another server's report was adopted (a
    # parent arrived): added to its own ReportObjectsReply.adopted
    _credit: dict[str, int] | None = None
    # server id -> its last chunk's records whose parent was missing: retried after
    # the other servers' chunks, parked before its own next chunk (meta/pacing.py
    # holds that stream meanwhile)
    _deferred: dict[str, list[Parked]] | None = None

    def begin_report(self, srv: ServerRecord) -> None:
        """``srv`` will report what it holds: no placement on it until it is done."""
        if srv.reported is None and not srv.objects:
            srv.reported = {}
            self._live = None
        if self._credit:
            self._credit.pop(srv.server_id, None)

    def _reporting(self, server_id: str, incarnation: int, now: float) -> ServerRecord | None:
        srv = self.servers.get(server_id)
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
        adopted, dropped, deferred = self._adopt_columns(srv, cols, now)
        return self._after_chunk(srv, adopted, dropped, deferred, last, now)

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
                self._release_parked(rec)
                dropped += 1
            else:
                good.append(rec)
        good.sort(key=_POS)
        cols = columns_of(good)
        adopted, lost, deferred = self._adopt_columns(srv, cols, now)
        return self._after_chunk(srv, adopted, dropped + lost, deferred, last, now)

    def _reported_again(self, srv: ServerRecord, records: list[Parked]) -> int:
        """Reported again after its report completed (a retried stream): only what
        is already adopted is accepted; the rest is ignored, not freed (its range
        may have been placed again since). Returns the records not accepted."""
        dropped = 0
        for rec in records:
            known = self.namespaces.get(rec.namespace)
            entry = known.entries.get(rec.key) if known is not None else None
            ok = entry is not None and rec.group < len(entry.objects)
            have = entry.objects[rec.group] if entry is not None and ok else None
            if have is None or have.server is not srv or have.offset != rec.offset:
                dropped += 1
        return dropped

    def _adopt_columns(
        self,
        srv: ServerRecord | None,
        cols: Columns,
        now: float,
        origin: list[Parked] | None = None,
        credit: dict[str, int] | None = None,
    ) -> tuple[int, int, list[Parked]]:
        """Adopt records (in block order) whose namespace and parent are known, in
        one pass with no per-record helper calls (1M records: see
        bench/meta_rebuild.py); park those waiting for their namespace, drop the
        impossible ones. The records are a chunk of ``srv`` or, with ``origin``,
        parked records (off the books, of live servers) being retried, their
        adoptions counted per server in ``credit``. Returns (adopted, dropped,
        records whose parent is missing)."""
        n = len(cols)
        namespaces = self.namespaces
        counters = self.counters
        lbs = cols.layer_bytes
        deferred: list[Parked] = []
        adopted = dropped = created = nbytes = 0
        base = now - 1.0  # recency(now, seq)
        fp = b""
        ns: NamespaceRecord | None = None
        entries: dict[bytes, BlockEntry] = {}
        layout = None
        sizes: list[int] = []
        nsums: list[int] = []
        gbytes: list[int] = []
        groups = 0
        full: int | None = None
        link = self._link_object
        policy, nvme_policy = self.policy, self.nvme_policy
        cur: ServerRecord | None = None
        held: dict[int, ObjectRecord] | None = None
        sparked: dict[int, Parked] = {}
        mask = cap = 0
        rows = zip(
            cols.namespace,
            cols.key,
            cols.parent,
            cols.pos,
            cols.group,
            cols.tier,
            cols.offset,
            cols.length,
            cols.sums,
            cols.seq,
            lbs if lbs is not None else repeat((), n),
            origin if origin is not None else repeat(None, n),
            strict=True,
        )
        for nsf, key, pkey, pos, g, tier, off, length, sums, seq, lb, orig in rows:
            s: ServerRecord = orig.server if orig is not None else srv  # type: ignore[assignment]
            if s is not cur:
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
                    )
                )
            ):
                rec = orig or Parked(nsf, key, pkey, pos, g, tier, off, length, sums, seq, s, now)
                counters["report_invalid"] += 1
                self._release_parked(rec)
                dropped += 1
                continue
            if nsf != fp or ns is None:
                if ns is not None:
                    self._add_group_bytes(ns, gbytes)
                fp = nsf
                ns = namespaces.get(fp)
                if ns is not None:
                    entries = ns.entries
                    layout = ns.layout
                    sizes = layout.group_object_bytes
                    nsums = [8 * len(x) for x in layout.group_layers]
                    groups = len(nsums)
                    gbytes = [0] * groups
                    full = ns.full_group
            if ns is None:
                rec = orig or Parked(nsf, key, pkey, pos, g, tier, off, length, sums, seq, s, now)
                rec.layer_bytes = lb
                self._park(rec, self.parked_ns.setdefault(fp, []))
                continue
            entry = entries.get(key)
            if entry is None:
                parent = None
                if pos:
                    parent = entries.get(pkey)
                    if parent is None or parent.pos + 1 != pos:
                        rec = orig or Parked(
                            nsf, key, pkey, pos, g, tier, off, length, sums, seq, s, now
                        )
                        rec.layer_bytes = lb
                        deferred.append(rec)
                        continue
                entry = entries[key] = BlockEntry(key, parent, pos, groups)
                created += 1
                if full is not None:
                    ns.full_holes += 1
                if parent is not None:
                    parent.children += 1
            if (
                g >= groups
                or length != sizes[g]
                or len(sums) != nsums[g]
                or (lb and lb != group_layer_bytes(layout, g))
            ):
                rec = orig or Parked(nsf, key, pkey, pos, g, tier, off, length, sums, seq, s, now)
                counters["report_invalid"] += 1
                self._release_parked(rec)
                self._prune(ns, entry)
                dropped += 1
                continue
            have = entry.objects[g]
            if have is not None:
                dropped += 1
                if have.server is s and have.tier == tier and have.offset == off:
                    continue  # reported again (a re-registration): already adopted
                counters["report_duplicates"] += 1
                self._release_parked(
                    orig or Parked(nsf, key, pkey, pos, g, tier, off, length, sums, seq, s, now)
                )
                continue
            last = base + (seq if seq < 10**9 else 10**9) * 1e-9
            obj = ObjectRecord(entry, g, s, off, length, sums, last, "", tier)
            link(ns, entry, obj)
            nbytes += length
            gbytes[g] += length
            if tier == 0 and held is not None:
                held[off] = obj  # (adopted after its report completed: allocated)
            (nvme_policy if tier else policy).admit(obj, ns)
            adopted += 1
            if credit is not None:
                credit[s.server_id] = credit.get(s.server_id, 0) + 1
        if ns is not None:
            self._add_group_bytes(ns, gbytes)
        self.entries += created
        self.live_objects += adopted  # _count_in, less the tenant (a reported object has none)
        self.live_bytes += nbytes
        return adopted, dropped, deferred

    def _add_group_bytes(self, ns: NamespaceRecord, gbytes: list[int]) -> None:
        names = ns.layout.group_names
        for g, n in enumerate(gbytes):
            if n:
                self.group_bytes[names[g]] += n
                gbytes[g] = 0

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
        if self.parked_parent:
            waiting = self._waiting_parents()
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
        whose parent came since; park the others (``park``) or return them."""
        credit = self._credit if self._credit is not None else {}
        n = 0
        left: list[Parked] = []
        fp = b""
        ns: NamespaceRecord | None = None
        for rec in recs:
            srv = rec.server
            if rec.namespace != fp:
                fp = rec.namespace
                ns = self.namespaces.get(fp)
            if srv is None or not srv.alive or ns is None:
                continue
            if not park:
                parent = ns.entries.get(rec.parent)
                if parent is None or parent.pos + 1 != rec.pos:
                    left.append(rec)
                    continue
            got = self._adopt_known(ns, rec, now)[0]
            if got:
                n += got
                credit[srv.server_id] = credit.get(srv.server_id, 0) + got
        self._credit = credit
        self.counters["objects_adopted"] += n
        return left

    def deferred_of(self, server_id: str) -> int:
        """Records of ``server_id``'s last chunk still waiting for a parent."""
        recs = self._deferred.get(server_id) if self._deferred else None
        return len(recs) if recs else 0

    def _waiting_parents(self) -> int:
        return sum(len(v) for v in self.parked_parent.values())

    def _retry_parents(self, now: float) -> int:
        """Adopt, in block order, the parked records whose parent block is now in
        the index or among them (a chain of them in one pass, through the one-pass
        adoption); the rest wait on. Returns the objects adopted (credited to their
        servers, see ``_credit``)."""
        self._since_retry = 0
        pools, self.parked_parent = self.parked_parent, {}
        parked = self.parked_all
        credit = self._credit if self._credit is not None else {}
        n = 0
        for fp, pool in pools.items():
            ns = self.namespaces.get(fp)
            if ns is None:
                continue
            entries = ns.entries
            pool.sort(key=_POS)  # runs of sorted chunks: merged, not re-sorted
            keep: list[Parked] = []
            ready: list[Parked] = []
            coming: set[bytes] = set()
            for rec in pool:
                if id(rec) not in parked:
                    continue  # expired, dropped or adopted meanwhile
                parent = entries.get(rec.parent)
                if (parent is not None and parent.pos + 1 == rec.pos) or rec.parent in coming:
                    ready.append(rec)
                    coming.add(rec.key)
                else:
                    keep.append(rec)
            n += self._adopt_parked(ns, ready, now, credit)
            if keep:
                waiting = self.parked_parent.setdefault(fp, [])
                waiting[:0] = keep
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
            self._unpark(rec)
            srv = rec.server
            if srv is not None and srv.alive:
                live.append(rec)
        if not live:
            return 0
        got, _, deferred = self._adopt_columns(None, columns_of(live), now, live, credit)
        if deferred:
            where = self.parked_parent.setdefault(ns.fingerprint, [])
            for rec in deferred:
                self._park(rec, where)
        return got

    def _adopt_known(self, ns: NamespaceRecord, rec: Parked, now: float) -> tuple[int, int]:
        """Adopt a record of a known namespace (not on the parked books), creating
        its entry under its parent; park it while its parent is unknown. Returns
        (adopted, dropped)."""
        srv = rec.server
        assert srv is not None
        if self._clash(srv, rec):
            self.counters["report_invalid"] += 1
            self._release_parked(rec)
            return 0, 1
        entries = ns.entries
        entry = entries.get(rec.key)
        if entry is None:
            parent = None
            if rec.pos:
                parent = entries.get(rec.parent)
                if parent is None or parent.pos + 1 != rec.pos:
                    self._park(rec, self.parked_parent.setdefault(rec.namespace, []))
                    return 0, 0
            groups = len(ns.layout.group_windows)  # num_groups, without the property call
            entry = entries[rec.key] = BlockEntry(rec.key, parent, rec.pos, groups)
            self.entries += 1
            if ns.full_group is not None:
                ns.full_holes += 1
            if parent is not None:
                parent.children += 1
        if self._adopt(ns, entry, rec, now):
            return 1, 0
        return 0, 1

    @staticmethod
    def _clash(srv: ServerRecord, rec: Parked) -> bool:
        """A DRAM record at an offset another reported record holds (one not on the
        parked books: records waiting for a parent are checked again)."""
        if rec.tier != 0:
            return False
        held = srv.reported if srv.reported is not None else {}
        other = srv.parked.get(rec.offset)
        return rec.offset in held or (other is not None and other is not rec)

    def _park(self, rec: Parked, where: list[Parked]) -> None:
        where.append(rec)
        self.parked_all[id(rec)] = rec
        srv = rec.server
        assert srv is not None
        if rec.tier == 0:
            srv.parked[rec.offset] = rec
        self.counters["objects_parked"] += 1
        while len(self.parked_all) > self.cfg.max_parked_objects:
            old = self.parked_all.pop(next(iter(self.parked_all)))
            self._unpark(old)
            self._release_parked(old)
            self.counters["parked_dropped"] += 1

    def _unpark(self, rec: Parked) -> None:
        """Take ``rec`` off the parked books (not its lists: they are consumed whole,
        and a stale entry there is skipped)."""
        self.parked_all.pop(id(rec), None)
        srv = rec.server
        if srv is not None and rec.tier == 0 and srv.parked.get(rec.offset) is rec:
            del srv.parked[rec.offset]

    def _release_parked(self, rec: Parked) -> None:
        """A reported object that will not be adopted: its server drops it (and its
        DRAM range, if already in the allocator, is freed)."""
        srv = rec.server
        if srv is None or not srv.alive:
            return
        if rec.tier == 1:
            srv.drop_out.append((rec.offset, rec.length))
        elif rec.allocated:
            rec.allocated = False
            self._free_range(srv, rec.offset, rec.length)
        elif srv.reported is not None:
            # Nothing is placed on a server before its report is complete: the
            # range holds no one else's object, the server may drop the record.
            srv.freed.append((rec.offset, rec.length))

    def _adopt(self, ns: NamespaceRecord, entry: BlockEntry, rec: Parked, now: float) -> bool:
        srv = rec.server
        assert srv is not None
        layout = ns.layout
        g = rec.group
        if (
            g >= len(entry.objects)  # num_groups
            or rec.length != layout.group_object_bytes[g]
            or len(rec.sums) != 8 * len(layout.group_layers[g])
            or (rec.layer_bytes and rec.layer_bytes != group_layer_bytes(layout, g))
        ):
            self.counters["report_invalid"] += 1
            self._release_parked(rec)
            self._prune(ns, entry)
            return False
        have = entry.objects[g]
        if have is not None:
            if have.server is srv and have.tier == rec.tier and have.offset == rec.offset:
                return False  # reported again (a re-registration): already adopted
            self.counters["report_duplicates"] += 1
            self._release_parked(rec)
            return False
        seq = rec.seq
        last = now - 1.0 + (seq if seq < 10**9 else 10**9) * 1e-9  # recency(now, seq)
        obj = ObjectRecord(entry, g, srv, rec.offset, rec.length, rec.sums, last, "", rec.tier)
        self._link_object(ns, entry, obj)
        self.live_objects += 1  # _count_in, less the tenant (a reported object has none)
        self.live_bytes += rec.length
        self.group_bytes[layout.group_names[g]] += rec.length
        if rec.tier == 0 and srv.reported is not None:
            srv.reported[rec.offset] = obj
        # (Adopted after the report completed, it was parked: its range is allocated.)
        self._pol(obj).admit(obj, ns)
        return True

    def _complete(self, srv: ServerRecord) -> None:
        """The report of ``srv`` is complete: build its allocator with every
        reported DRAM range (adopted or parked) used, from the gaps between them
        (no allocation per range), then open it for placement."""
        reported = srv.reported
        assert reported is not None
        ranges = [(off, o.length) for off, o in reported.items()]
        ranges += [(off, p.length) for off, p in srv.parked.items()]
        ranges.sort()
        mask = srv.allocator.align - 1
        used: list[tuple[int, int]] = []
        cursor = 0
        overlapping: list[ObjectRecord | Parked] = []
        for off, length in ranges:
            if off < cursor:
                mine = reported.get(off)
                overlapping.append(mine if mine is not None else srv.parked[off])
                continue
            used.append((off, length))
            cursor = off + ((length + mask) & ~mask)
        alloc = SegmentAllocator.with_used(srv.allocator.capacity, srv.allocator.align, used)
        for p in srv.parked.values():
            p.allocated = True
        srv.allocator = alloc
        srv.reported = None
        self._live = None
        self.counters["reports_completed"] += 1
        for what in overlapping:
            self.counters["report_invalid"] += 1
            # Its range is another's: forget it without freeing anything (the
            # server's record at that offset belongs to the first one).
            if isinstance(what, Parked):
                what.allocated = False
                self._unpark(what)
            elif what.state == LIVE:
                entry = what.entry
                ns = next(n for n in self.namespaces.values() if n.entries.get(entry.key) is entry)
                self._unlink(ns, entry, what.group)
                what.state = GONE
                self._prune(ns, entry)

    def adopt_parked_namespace(self, ns: NamespaceRecord, now: float) -> int:
        """``ns`` was registered: adopt what was reported for it."""
        waiting = self.parked_ns.pop(ns.fingerprint, None)
        if not waiting:
            return 0
        waiting.sort(key=_POS)
        parked = self.parked_all
        n = self._adopt_parked(ns, [r for r in waiting if id(r) in parked], now, None)
        self.counters["objects_adopted"] += n
        if self.parked_parent.get(ns.fingerprint):
            n += self._retry_parents(now)
        return n

    def parked_of(self, server_id: str) -> int:
        """Records of ``server_id`` still parked (waiting for a namespace or parent)."""
        srv = self.servers.get(server_id)
        return sum(1 for r in self.parked_all.values() if r.server is srv) if srv else 0

    def expire_parked(self, now: float) -> None:
        """Free parked records older than ``parked_ttl_s``; park the records that
        waited a second for a next chunk that did not come."""
        if self._deferred:
            for sid, due in list(self._deferred.items()):
                if due[0].since < now - 1.0:
                    del self._deferred[sid]
                    self._retry_deferred(due, now, park=True)
        cutoff = now - self.cfg.parked_ttl_s
        parked = self.parked_all
        while parked:
            rec = next(iter(parked.values()))
            if rec.since > cutoff:
                break
            self._unpark(rec)
            self._release_parked(rec)
            self.counters["parked_expired"] += 1
        if not parked:
            # Consumed lists may hold stale records: drop them with the last one.
            self.parked_ns.clear()
            self.parked_parent.clear()
