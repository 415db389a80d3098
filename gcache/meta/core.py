"""The meta's state machine, without I/O.

:class:`MetaCore` holds membership, namespaces, the SWA-aware prefix index,
placement (it runs each segment's allocator), pending puts, read leases and
eviction. It is composed of layers, each in its own module:

* :mod:`.reclaim` (``IndexStore``): index bookkeeping, eviction mechanics, the
  quarantine of ranges freed from pending puts, access checks;
* :mod:`.placement`: dedup, checkpoints, allocation within a put's budget;
* :mod:`.puts`: begin, commit and abort of puts owned by a session;
* :mod:`.leases`: lookups and read leases owned by a session;
* :mod:`.tiers`: demotion to the servers' NVMe tiers, NVMe watermarks, heartbeat
  outboxes (issue 10);
* :mod:`.rebuild`: the index rebuilt from the servers' reports (issue 10);
* this module: membership, namespaces, session end, time, stats.

Every method is synchronous and takes ``now`` (monotonic seconds) so tests drive
time directly; the asyncio layers (:mod:`.hotpath`, :mod:`.control`) decode
requests, call in with the requesting :class:`~gcache.meta.session.Session`, and
send back what it returns. A refusal is a :class:`~gcache.errors.Refusal`, which
never leaves the state half-changed: every request is validated completely before
anything is modified.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.errors import LayoutError
from gcache.layout import Layout, LayoutSpec
from gcache.meta.events import SERVER_LOST, RemovalFeed
from gcache.meta.eviction import make_policy
from gcache.meta.rebuild import Rebuild
from gcache.meta.records import GONE, NamespaceRecord, ObjectRecord, ServerRecord
from gcache.meta.session import Session
from gcache.meta.tiers import Demotion

# Monotonic counters of MetaCore.stats() (always exported, from 0).
COUNTERS = (
    "lookups",
    "lookup_blocks",
    "hit_blocks",
    "hit_tokens",
    "puts_begun",
    "puts_committed",
    "puts_aborted",
    "puts_reclaimed",
    "objects_committed",
    "objects_deduped",
    "objects_no_space",
    "objects_over_bounds",
    "objects_unreceipted",
    "evictions",
    "evicted_bytes",
    "checkpoints_placed",
    "leases_granted",
    "leases_expired",
    "leased_objects",
    "leased_bytes",
    "servers_registered",
    "servers_dropped",
    "sessions_ended",
    "session_puts_aborted",
    "session_leases_released",
    "foreign_refused",
    "refused",
    "protocol_errors",
    # issue 10: tiers and rebuild
    "demotions_issued",
    "demotions_done",
    "demotions_failed",
    "demotions_unknown",
    "demotions_void",
    "demoted_bytes",
    "dropped_not_demoted",
    "nvme_evictions",
    "nvme_lost",
    "adopt_overflow",
    "adopt_paused",
    "stalls",
    "promotions_issued",
    "promotions_done",
    "promotions_failed",
    "promotions_void",
    "promotions_unknown",
    "promotions_no_room",
    "promoted_bytes",
    "objects_adopted",
    "objects_parked",
    "objects_report_dropped",
    "parked_dropped",
    "parked_expired",
    "report_invalid",
    "report_duplicates",
    "reports_completed",
    # issue 10: the demotion pipeline (A)
    "demotions_ahead",
    "puts_told_to_wait",
    "puts_waited",
    # issue 13: the removal feed (meta/events.py)
    "removals_recorded",
    "removals_delivered",
    "removals_dropped_from_ring",
    "removed_evicted",
    "removed_server_lost",
    "subscribers_refused",
    "subscriber_gaps",
)
MAX_NAMESPACES = 4096


class MetaCore(Rebuild):
    def __init__(self, cfg: MetaConfig, epoch: int = 0) -> None:
        """``epoch``: the meta's epoch (unix ms of its start; the daemon sets it), in
        every grant and in RegisterServerReply; 0 for in-process drivers."""
        self.cfg = cfg
        self.epoch = epoch
        self.now_s = 0.0
        self._compute = {}
        self.parked_ns = {}
        self.parked_parent = {}
        self.parked_all = {}
        self.parked_chunks = {}  # issue 10 (G1): chunks parked whole, see meta/adopt.py
        self.parked_ns_chunks = {}
        self.parked_rows = 0
        self.namespaces = {}
        self._ns_by_id: dict[int, NamespaceRecord] = {}
        self.servers = {}
        self.puts = {}
        self.leases = {}
        self.policy = make_policy(cfg.eviction_policy)
        self.nvme_policy = make_policy(cfg.eviction_policy)
        self._put_heap = []
        self._lease_heap = []
        self.quarantine = []
        self._qseq = itertools.count()
        self.counters = Counter()
        self.entries = 0
        self.live_objects = 0
        self.live_bytes = 0
        self.group_bytes = Counter()
        self.tenant_bytes = Counter()
        self.pending_bytes = 0
        self.pending_by_session = Counter()
        self.pending_by_tenant = Counter()
        self._live = None  # live servers, rebuilt on change
        self.removals = RemovalFeed(cfg.event_ring, cfg.max_event_subscribers)
        # High availability (meta/ha.py): why this meta may not serve at ``now``
        # (a standby's redirect), or None; the election's gauges for stats().
        self.not_leader: Callable[[float], str | None] | None = None
        self.ha_stats: Callable[[], Mapping[str, float]] | None = None

    # ---- control plane -------------------------------------------------------------

    def register_namespace(self, descriptor: dict[str, Any], spec: LayoutSpec) -> NamespaceRecord:
        layout = Layout(spec)  # validates; LayoutError propagates to the caller
        fp = keys.fingerprint(descriptor)
        ns = self.namespaces.get(fp)
        if ns is not None:
            return ns
        if len(self.namespaces) >= MAX_NAMESPACES:
            raise LayoutError(f"too many namespaces (limit {MAX_NAMESPACES})")
        ns = NamespaceRecord(len(self.namespaces) + 1, fp, layout, descriptor)
        self.namespaces[fp] = ns
        self._ns_by_id[ns.ns_id] = ns
        # What servers reported for it before it was registered (a meta restart).
        self.adopt_parked_namespace(ns, self.now_s)
        return ns

    def register_server(
        self,
        addr: wire.ServerAddr,
        secret: bytes,
        incarnation: int,
        capacity: int,
        now: float,
        *,
        nvme_capacity: int = 0,
        nvme_read_gbps: float = 0.0,
        nvme_write_gbps: float = 0.0,
        report: bool = False,
    ) -> ServerRecord:
        """Add (or refresh) a server. ``report``: it holds objects it will report
        (``report_objects``); nothing is placed on it until the report is complete."""
        old = self.servers.get(addr.server_id)
        if old is not None and old.incarnation == incarnation and old.alive:
            old.last_seen = now
            return old
        if old is not None:
            self.drop_server(old, reason="re-registered with a new incarnation")
        rec = ServerRecord(addr.server_id, addr, secret, incarnation, capacity, now)
        rec.nvme_capacity = nvme_capacity
        rec.dram_read_gbps = addr.dram_read_gbps
        rec.nvme_read_gbps = nvme_read_gbps or addr.nvme_read_gbps
        rec.nvme_write_gbps = nvme_write_gbps
        rec.grant_epoch = self.epoch
        self.servers[addr.server_id] = rec
        if report:
            self.begin_report(rec)
        self._live = None
        self.counters["servers_registered"] += 1
        return rec

    def heartbeat(
        self,
        server_id: str,
        incarnation: int,
        counters: dict[str, int],
        now: float,
        demoted: list[Demotion] | None = None,
    ) -> tuple[bool, list[tuple[int, int]]]:
        """Returns (must re-register, ranges freed since the last heartbeat). The
        whole reply (adopt, demote, drop_nvme) is :meth:`tier_heartbeat`'s."""
        out = self.tier_heartbeat(server_id, incarnation, counters, now, demoted)
        return out.reregister, out.free

    def drop_server(self, rec: ServerRecord, reason: str) -> None:
        """A server died or restarted: its DRAM is gone, so are its objects. Walks
        that server's own objects (its rings), never the rest of the index."""
        if not rec.alive:
            return
        rec.alive = False
        self._live = None
        self.counters["servers_dropped"] += 1
        for ns_id, ring in rec.rings.items():
            ns = self._ns_by_id[ns_id]
            while ring.next_on is not ring:
                obj = ring.next_on
                assert isinstance(obj, ObjectRecord)
                entry = obj.entry
                self._unlink(ns, entry, obj.group, SERVER_LOST)  # also off the ring
                obj.state = GONE
                self._prune(ns, entry)
        rec.rings.clear()
        rec.demoting.clear()
        rec.adopt_out.clear()
        rec.demote_out.clear()
        rec.promoting.clear()
        rec.promote_out.clear()
        rec.parked.clear()
        if self.servers.get(rec.server_id) is rec:
            del self.servers[rec.server_id]
        self.policy.forget_server(rec)
        self.nvme_policy.forget_server(rec)

    # ---- sessions ------------------------------------------------------------------

    def end_session(self, session: Session, now: float) -> None:
        """A hot-path connection closed: abort its pending puts (their ranges go to
        quarantine) and release its leases, at once."""
        for put_id in list(session.puts):
            put = self.puts.get(put_id)
            if put is not None and put.owner is session:
                self._drop_put(put)
                self.counters["session_puts_aborted"] += 1
        session.puts.clear()
        for lease_id in list(session.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.owner is session:
                self._end_lease(lease)
                self.counters["session_leases_released"] += 1
        session.leases.clear()
        self.counters["sessions_ended"] += 1

    # ---- time ----------------------------------------------------------------------

    def stalled(self, seconds: float) -> None:
        """The meta itself was not listening for ``seconds`` (its driver saw its
        event loop that late: a long rebuild step, a stalled host): the servers get
        that time as credit, so none is dropped for heartbeats nobody read."""
        for srv in self.servers.values():
            srv.last_seen += seconds
        self.counters["stalls"] += 1

    def tick(self, now: float) -> None:
        """Expire leases and abandoned puts, return quarantined ranges whose grants
        expired, drop silent servers, enforce watermarks (demoting), free parked
        reported objects that waited too long."""
        self.now_s = max(self.now_s, now)
        self.expire_parked(now)
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expiry <= now:
                self._end_lease(lease)
                self.counters["leases_expired"] += 1
        while self._put_heap and self._put_heap[0][0] <= now:
            _, put_id = heapq.heappop(self._put_heap)
            put = self.puts.get(put_id)
            if put is not None and put.deadline <= now:
                self._drop_put(put)
                self.counters["puts_reclaimed"] += 1
        self._release_quarantine(now)
        for srv in list(self.servers.values()):
            if now - srv.last_seen > self.cfg.heartbeat_timeout_s:
                self.drop_server(srv, reason="missed heartbeats")
            else:
                self._check_watermark(srv)

    # ---- stats ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        out.update(self.counters)
        if self.ha_stats is not None:
            out.update(self.ha_stats())
        live = [s for s in self.servers.values() if s.alive]
        out.update(
            namespaces=len(self.namespaces),
            servers=len(live),
            index_entries=self.entries,
            objects=self.live_objects,
            bytes_stored=self.live_bytes,
            pending_puts=len(self.puts),
            pending_bytes=self.pending_bytes,
            quarantined_bytes=sum(s.quarantined_bytes for s in live),
            quarantined_ranges=len(self.quarantine),
            active_leases=len(self.leases),
            tenants=len(self.tenant_bytes),
            capacity=sum(s.allocator.capacity for s in self.servers.values()),
            used=sum(s.allocator.used for s in self.servers.values()),
        )
        out.update(self.tier_stats())
        out["parked_objects"] = len(self.parked_all) + self.parked_rows
        out.update(self.removals.stats())
        for name, val in self.group_bytes.items():
            out[f"bytes_stored_{name}"] = val
        lookups = self.counters["lookup_blocks"]
        out["block_hit_rate"] = self.counters["hit_blocks"] / lookups if lookups else 0.0
        return out

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"MetaCore(servers={s['servers']}, namespaces={s['namespaces']}, "
            f"objects={s['objects']}, bytes={s['bytes_stored']})"
        )


def wall_now() -> float:
    return time.time()
