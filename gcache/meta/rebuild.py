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
Parked records are adopted when the namespace or parent arrives, and freed (the
server drops them) after ``parked_ttl_s`` or when more than
``max_parked_objects`` wait. Adopted records get ``last_access`` from their
sequence number, so the eviction order is the recorded one as far as it goes.

A record that cannot be right (out of the segment, misaligned, overlapping another,
a wrong length or checksum count for its group) is dropped and freed, never
adopted. Two copies of one object (DRAM and NVMe after a crash mid-demotion, or on
two servers) keep the first reported; the other is freed. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from gcache.keys import KEY_SIZE
from gcache.meta.records import (
    GONE,
    LIVE,
    BlockEntry,
    NamespaceRecord,
    ObjectRecord,
    ServerRecord,
)
from gcache.meta.tiers import Tiers
from gcache.storage.allocator import SegmentAllocator


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


_BLOCK_ORDER = attrgetter("namespace", "pos")


def recency(now: float, seq: int) -> float:
    """``last_access`` of an adopted object: within the second before ``now``, in
    the order of the server's sequence numbers."""
    return now - 1.0 + min(seq, 10**9) * 1e-9


class Rebuild(Tiers):
    # namespace fingerprint -> parked records waiting for it
    parked_ns: dict[bytes, list[Parked]]
    # (namespace, parent key) -> parked records waiting for that parent block
    parked_parent: dict[tuple[bytes, bytes], list[Parked]]
    # every parked record in arrival order (id -> record): bound and expiry
    parked_all: dict[int, Parked]

    def begin_report(self, srv: ServerRecord) -> None:
        """``srv`` will report what it holds: no placement on it until it is done."""
        if srv.reported is None and not srv.objects:
            srv.reported = {}
            self._live = None

    def report_objects(
        self,
        server_id: str,
        incarnation: int,
        records: list[Parked],
        last: bool,
        now: float,
    ) -> tuple[int, int] | None:
        """One chunk of a server's report. Returns (adopted, dropped), or None when
        the server is not registered with this incarnation (it must re-register)."""
        srv = self.servers.get(server_id)
        if srv is None or not srv.alive or srv.incarnation != incarnation:
            return None
        srv.last_seen = now
        adopted = dropped = 0
        if srv.reported is None:
            # Reported again after its report completed (a retried stream): only
            # what is already adopted is accepted; the rest is ignored, not freed
            # (its range may have been placed again since).
            for rec in records:
                known = self.namespaces.get(rec.namespace)
                entry = known.entries.get(rec.key) if known is not None else None
                ok = entry is not None and rec.group < len(entry.objects)
                have = entry.objects[rec.group] if entry is not None and ok else None
                if have is None or have.server is not srv or have.offset != rec.offset:
                    dropped += 1
            return 0, dropped
        # Parents before children: a chunk is adopted in block order. The common
        # case (namespace known, parent known, nothing waiting) takes no detour
        # through the parked books (1M records: see bench/meta_rebuild.py).
        records.sort(key=_BLOCK_ORDER)
        namespaces = self.namespaces
        ns: NamespaceRecord | None = None
        fp = b""
        for rec in records:
            rec.server = srv
            rec.since = now
            why = self._invalid(srv, rec)
            if why:
                self.counters["report_invalid"] += 1
                self._release_parked(rec)
                dropped += 1
                continue
            if rec.namespace != fp or ns is None:
                fp = rec.namespace
                ns = namespaces.get(fp)
            if ns is None:
                self._park(rec, self.parked_ns.setdefault(fp, []))
                continue
            got, lost = self._adopt_known(ns, rec, now)
            adopted += got
            dropped += lost
        if last and srv.reported is not None:
            self._complete(srv)
        self.counters["objects_adopted"] += adopted
        self.counters["objects_report_dropped"] += dropped
        return adopted, dropped

    def _adopt_known(self, ns: NamespaceRecord, rec: Parked, now: float) -> tuple[int, int]:
        """Adopt a valid record of a known namespace, creating its entry under its
        parent, then whatever waited for that entry; park it while its parent is
        unknown. Returns (adopted, dropped)."""
        entries = ns.entries
        entry = entries.get(rec.key)
        created = entry is None
        if entry is None:
            parent = None
            if rec.pos:
                parent = entries.get(rec.parent)
                if parent is None or parent.pos + 1 != rec.pos:
                    key = (rec.namespace, rec.parent)
                    self._park(rec, self.parked_parent.setdefault(key, []))
                    return 0, 0
            groups = len(ns.layout.group_windows)  # num_groups, without the property call
            entry = entries[rec.key] = BlockEntry(rec.key, parent, rec.pos, groups)
            self.entries += 1
            if ns.full_group is not None:
                ns.full_holes += 1
            if parent is not None:
                parent.children += 1
        adopted = dropped = 0
        if self._adopt(ns, entry, rec, now):
            adopted = 1
        else:
            dropped = 1
        if created and self.parked_parent:
            waiting = self.parked_parent.pop((rec.namespace, rec.key), None)
            if waiting:
                adopted += self._adopt_waiting(ns, waiting, now)
        return adopted, dropped

    def _invalid(self, srv: ServerRecord, rec: Parked) -> str:
        if len(rec.key) != KEY_SIZE or (rec.parent and len(rec.parent) != KEY_SIZE):
            return "bad key"
        if (rec.pos == 0) != (not rec.parent):
            return "block 0 has no parent, every other block has one"
        if rec.length <= 0 or rec.tier not in (0, 1):
            return "bad length or tier"
        if rec.tier == 0:
            align = srv.allocator.align
            if rec.offset % align or rec.offset + rec.length > srv.allocator.capacity:
                return "outside the segment"
            held = srv.reported if srv.reported is not None else {}
            if rec.offset in held or rec.offset in srv.parked:
                return "a second object at one offset"
        return ""

    def _is_parked(self, rec: Parked) -> bool:
        return id(rec) in self.parked_all

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

    def _adopt_waiting(self, ns: NamespaceRecord, waiting: list[Parked], now: float) -> int:
        """Adopt parked records whose parent block was just created (and what waited
        for those). Stale entries (already expired or adopted) are skipped."""
        n = 0
        for rec in waiting:
            if self._is_parked(rec):
                n += self._adopt_chain(ns, rec, now)
        return n

    def _adopt_chain(self, ns: NamespaceRecord, first: Parked, now: float) -> int:
        """Adopt ``first`` and every parked record that was waiting for it (and for
        those, and so on). Returns the objects adopted."""
        n = 0
        stack = [first]
        parked = self.parked_all
        while stack:
            rec = stack.pop()
            if parked.pop(id(rec), None) is None and rec is not first:
                continue  # a stale entry of a consumed list
            srv = rec.server  # (off the parked books, as _unpark does)
            if srv is None or not srv.alive:
                continue
            if rec.tier == 0 and srv.parked.get(rec.offset) is rec:
                del srv.parked[rec.offset]
            entry, created = self._entry_for(ns, rec)
            if entry is None:
                self._park(rec, self.parked_parent.setdefault((rec.namespace, rec.parent), []))
                continue
            if self._adopt(ns, entry, rec, now):
                n += 1
            if created:
                stack.extend(self.parked_parent.pop((rec.namespace, rec.key), ()))
        return n

    def _entry_for(self, ns: NamespaceRecord, rec: Parked) -> tuple[BlockEntry | None, bool]:
        """The entry of ``rec``'s block, created under its parent if missing; None
        while the parent is unknown (entries stay prefix-closed)."""
        entries = ns.entries
        entry = entries.get(rec.key)
        if entry is not None:
            return entry, False
        parent = None
        if rec.parent:
            parent = entries.get(rec.parent)
            if parent is None or parent.pos + 1 != rec.pos:
                return None, False
        entry = entries[rec.key] = BlockEntry(rec.key, parent, rec.pos, ns.layout.num_groups)
        self.entries += 1
        if ns.full_group is not None:
            ns.full_holes += 1
        if parent is not None:
            parent.children += 1
        return entry, True

    def _adopt(self, ns: NamespaceRecord, entry: BlockEntry, rec: Parked, now: float) -> bool:
        srv = rec.server
        assert srv is not None
        layout = ns.layout
        g = rec.group
        if (
            g >= len(entry.objects)  # num_groups
            or rec.length != layout.group_object_bytes[g]
            or len(rec.sums) != 8 * len(layout.group_layers[g])
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
        reported DRAM range (adopted or parked) used, then open it for placement."""
        reported = srv.reported
        assert reported is not None
        ranges: list[tuple[int, int, ObjectRecord | Parked]] = [
            (off, o.length, o) for off, o in reported.items()
        ]
        ranges += [(off, p.length, p) for off, p in srv.parked.items()]
        ranges.sort(key=lambda r: r[0])
        cap = srv.allocator.capacity
        alloc = SegmentAllocator(cap, srv.allocator.align)
        mask = alloc.align - 1
        gaps: list[int] = []
        cursor = 0
        overlapping: list[ObjectRecord | Parked] = []
        for off, length, what in ranges:
            if off < cursor:
                overlapping.append(what)
                continue
            if off > cursor:
                gap = alloc.alloc(off - cursor)
                assert gap == cursor
                gaps.append(gap)
            got = alloc.alloc(length)
            assert got == off
            cursor = off + ((length + mask) & ~mask)
        for gap in gaps:
            alloc.free(gap)
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
        waiting.sort(key=_BLOCK_ORDER)
        n = 0
        parked = self.parked_all
        for rec in waiting:
            if id(rec) not in parked:
                continue  # expired or dropped meanwhile
            self._unpark(rec)
            srv = rec.server
            if srv is None or not srv.alive:
                continue
            n += self._adopt_known(ns, rec, now)[0]
        self.counters["objects_adopted"] += n
        return n

    def parked_of(self, server_id: str) -> int:
        """Records of ``server_id`` still parked (waiting for a namespace or parent)."""
        srv = self.servers.get(server_id)
        return sum(1 for r in self.parked_all.values() if r.server is srv) if srv else 0

    def expire_parked(self, now: float) -> None:
        """Free parked records older than ``parked_ttl_s``."""
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
