"""The meta's state machine, without I/O.

:class:`MetaCore` owns the meta's components and wires them together in
:meth:`MetaCore.__init__` (the one place that does); each component is in its own
module, holds its own state, and is handed the others it needs:

* :mod:`.index` (``Index``): the prefix index and its totals, eviction mechanics,
  the quarantine of ranges freed from pending puts, access checks;
* :mod:`.membership`: the servers, registration and drop, who placement may use;
* :mod:`.placement`: dedup, checkpoints, allocation within a put's budget (how
  room is made is a strategy it is given: the tiers' demotion);
* :mod:`.puts`: begin, commit and abort of puts owned by a session;
* :mod:`.leases`: lookups and read leases owned by a session;
* :mod:`.tiers`: demotion to the servers' NVMe tiers and both tiers' watermarks;
  :mod:`.promotion`: NVMe objects back to DRAM on repeated hits;
  :mod:`.heartbeat`: what a heartbeat reports and what its reply carries;
* :mod:`.rebuild` and :mod:`.adopt`: the index rebuilt from the servers' reports;
* :mod:`.eviction` (the policies) and :mod:`.events` (the removal feed);
* this module: the wiring, namespaces, sessions, time, stats, and the public
  methods the daemon's layers call (thin delegations).

Every method is synchronous and takes ``now`` (monotonic seconds) so tests drive
time directly; the asyncio layers (:mod:`.hotpath`, :mod:`.control`) decode
requests, call in with the requesting :class:`~gcache.meta.session.Session`, and
send back what it returns. A refusal is a :class:`~gcache.errors.Refusal`, which
never leaves the state half-changed: every request is validated completely before
anything is modified.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.errors import LayoutError
from gcache.layout import Layout, LayoutSpec
from gcache.meta.adopt import Adoption
from gcache.meta.events import RemovalFeed
from gcache.meta.eviction import EvictionPolicy, make_policy
from gcache.meta.evictions import Evictions
from gcache.meta.heartbeat import Heartbeats
from gcache.meta.index import Index
from gcache.meta.leases import Leases
from gcache.meta.membership import Membership
from gcache.meta.parked import ParkedBooks
from gcache.meta.placement import Placement
from gcache.meta.promotion import Promoter
from gcache.meta.puts import Puts
from gcache.meta.quarantine import Quarantine
from gcache.meta.rebuild import Rebuild
from gcache.meta.records import (
    Lease,
    NamespaceRecord,
    PendingPut,
    ServerRecord,
)
from gcache.meta.session import Session
from gcache.meta.tiers import Demotion, Tiers

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
    # tiers and rebuild
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
    "rebuild_bulk_loads",
    # the demotion pipeline
    "demotions_ahead",
    "puts_told_to_wait",
    "puts_waited",
    "pressure_beats",
    "demotion_behind",
    "demotion_behind_waits",
    "watermark_passes_cut",
    "dropped_no_tier",
    "dropped_not_worth",
    "dropped_tier_full",
    "dropped_put_could_not_wait",
    # the removal feed (meta/events.py)
    "removals_recorded",
    "removals_delivered",
    "removals_dropped_from_ring",
    "removed_evicted",
    "removed_server_lost",
    "subscribers_refused",
    "subscriber_gaps",
)
MAX_NAMESPACES = 4096


class MetaCore:
    def __init__(self, cfg: MetaConfig, epoch: int = 0) -> None:
        """``epoch``: the meta's epoch (unix ms of its start; the daemon sets it), in
        every grant and in RegisterServerReply; 0 for in-process drivers."""
        self.cfg = cfg
        self.counters: Counter[str] = Counter()
        c = self.counters
        # The wiring: each component gets the others it calls, nothing more.
        self.removals = RemovalFeed(cfg.event_ring, cfg.max_event_subscribers)
        policy, nvme_policy = make_policy(cfg.eviction_policy), make_policy(cfg.eviction_policy)
        self.index = Index(cfg, c, policy, nvme_policy, self.removals)
        self.evictions = Evictions(self.index)
        self.membership = Membership(cfg, c, self.index, self.evictions, epoch)
        self.index.outbox_full = self.membership.invalidate
        self.tiers = Tiers(cfg, c, self.index, self.evictions)
        self.placement = Placement(cfg, c, self.membership, self.tiers.make_room)
        self.pending = Puts(
            cfg, c, self.index, self.membership, self.placement, self.tiers.check_watermark
        )
        self.promoter = Promoter(cfg, c, self.index, self.evictions, self.tiers.demote_or_drop)
        self.leasing = Leases(cfg, c, self.index, self.promoter.on_pick)
        self.heartbeats = Heartbeats(cfg, c, self.membership, self.tiers, self.promoter)
        self.parked = ParkedBooks()
        self.adoption = Adoption(cfg, c, self.index, self.parked)
        self.rebuild = Rebuild(cfg, c, self.index, self.membership, self.adoption, self.parked)
        # High availability (meta/ha.py): why this meta may not serve at ``now``
        # (a standby's redirect), or None; the election's gauges for stats().
        self.not_leader: Callable[[float], str | None] | None = None
        self.ha_stats: Callable[[], Mapping[str, float]] | None = None

        # ---- the public methods of the components (thin delegations) ----
        self.lookup = self.leasing.lookup
        self.match = self.leasing.match
        self.pick = self.leasing.pick_keys
        self.release = self.leasing.release
        self.put_budget = self.pending.put_budget
        self.put_begin = self.pending.put_begin
        self.put_commit = self.pending.put_commit
        self.put_abort = self.pending.put_abort
        self.commit = self.pending.commit
        self.place = self.placement.place
        self.live_capacity = self.membership.live_capacity
        self.stalled = self.membership.stalled
        self.evict_keys = self.evictions.evict_keys
        self.tier_heartbeat = self.heartbeats.tier_heartbeat
        self.tier_stats = self.heartbeats.tier_stats
        self.demoted = self.tiers.demoted
        self.nvme_lost = self.tiers.nvme_lost
        self.recompute_s = self.tiers.recompute_s
        self.promoted = self.promoter.promoted
        self.begin_report = self.rebuild.begin_report
        self.report_columns = self.rebuild.report_columns
        self.report_objects = self.rebuild.report_objects
        self.deferred_of = self.rebuild.deferred_of
        self.parked_of = self.rebuild.parked_of
        self.expire_parked = self.rebuild.expire_parked
        self.adopt_parked_namespace = self.rebuild.adopt_parked_namespace

    # ---- read-only views of the components' state (drivers, stats, tests) ----------

    @property
    def epoch(self) -> int:
        """The meta's epoch, carried by every grant (membership owns it)."""
        return self.membership.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        """Set by the daemon (and on election) before it serves: grants carry it."""
        self.membership.epoch = epoch

    @property
    def servers(self) -> dict[str, ServerRecord]:
        return self.membership.servers

    @property
    def namespaces(self) -> dict[bytes, NamespaceRecord]:
        return self.index.namespaces

    @property
    def policy(self) -> EvictionPolicy:
        return self.index.policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        """Replace the DRAM policy before anything is stored (the replayer's oracle)."""
        self.index.policy = policy

    @property
    def nvme_policy(self) -> EvictionPolicy:
        return self.index.nvme_policy

    @property
    def entries(self) -> int:
        return self.index.entries

    @property
    def live_objects(self) -> int:
        return self.index.live_objects

    @property
    def live_bytes(self) -> int:
        return self.index.live_bytes

    @property
    def group_bytes(self) -> Counter[str]:
        return self.index.group_bytes

    @property
    def tenant_bytes(self) -> Counter[str]:
        return self.index.tenant_bytes

    @property
    def quarantine(self) -> Quarantine:
        return self.index.quarantine

    @property
    def puts(self) -> dict[int, PendingPut]:
        return self.pending.puts

    @property
    def pending_bytes(self) -> int:
        return self.pending.pending_bytes

    @property
    def pending_by_session(self) -> Counter[int]:
        return self.pending.pending_by_session

    @property
    def pending_by_tenant(self) -> Counter[str]:
        return self.pending.pending_by_tenant

    @property
    def leases(self) -> dict[int, Lease]:
        return self.leasing.leases

    @property
    def now_s(self) -> float:
        """The latest ``now`` seen (tick, heartbeat)."""
        return self.tiers.now_s

    @property
    def room_gen(self) -> int:
        """Bumped whenever servers report finished demotions (puts waiting for room
        try again)."""
        return self.heartbeats.room_gen

    @property
    def on_room(self) -> Callable[[], None] | None:
        return self.heartbeats.on_room

    @on_room.setter
    def on_room(self, fn: Callable[[], None] | None) -> None:
        self.heartbeats.on_room = fn

    # ---- control plane -------------------------------------------------------------

    def register_namespace(self, descriptor: dict[str, Any], spec: LayoutSpec) -> NamespaceRecord:
        layout = Layout(spec)  # validates; LayoutError propagates to the caller
        fp = keys.fingerprint(descriptor)
        namespaces = self.index.namespaces
        ns = namespaces.get(fp)
        if ns is not None:
            return ns
        if len(namespaces) >= MAX_NAMESPACES:
            raise LayoutError(f"too many namespaces (limit {MAX_NAMESPACES})")
        ns = self.index.new_namespace(fp, layout, descriptor)
        # What servers reported for it before it was registered (a meta restart).
        self.rebuild.adopt_parked_namespace(ns, self.now_s)
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
        report_objects: int = 0,
    ) -> ServerRecord:
        """Add (or refresh) a server. ``report``: it holds objects it will report
        (``report_objects``, this many as it says); nothing is placed on it until
        the report is complete."""
        rec, new = self.membership.register_server(
            addr, secret, incarnation, capacity, now,
            nvme_capacity, nvme_read_gbps, nvme_write_gbps,
        )  # fmt: skip
        if not new:
            return rec
        if report:
            self.rebuild.begin_report(rec, report_objects)
        self.membership.invalidate()
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
        out = self.heartbeats.tier_heartbeat(server_id, incarnation, counters, now, demoted)
        return out.reregister, out.free

    def drop_server(self, rec: ServerRecord, reason: str) -> None:
        self.membership.drop_server(rec, reason)

    # ---- sessions ------------------------------------------------------------------

    def end_session(self, session: Session, now: float) -> None:
        """A hot-path connection closed: abort its pending puts (their ranges go to
        quarantine) and release its leases, at once."""
        self.pending.end_session(session)
        self.leasing.end_session(session)
        self.counters["sessions_ended"] += 1

    # ---- time ----------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Expire leases and abandoned puts, return quarantined ranges whose grants
        expired, drop silent servers, enforce watermarks (demoting), free parked
        reported objects that waited too long."""
        self.tiers.now_s = max(self.tiers.now_s, now)
        self.rebuild.expire_parked(now)
        self.leasing.expire(now)
        self.pending.expire(now)  # and the quarantine
        for srv in list(self.membership.servers.values()):
            if now - srv.last_seen > self.cfg.heartbeat_timeout_s:
                self.membership.drop_server(srv, reason="missed heartbeats")
            else:
                self.tiers.check_watermark(srv)
        self.rebuild.end_bulk()  # (a report that will not end: its server dropped)

    # ---- stats ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        out.update(self.counters)
        if self.ha_stats is not None:
            out.update(self.ha_stats())
        servers = self.membership.servers
        live = [s for s in servers.values() if s.alive]
        index = self.index
        out.update(
            namespaces=len(index.namespaces),
            servers=len(live),
            index_entries=index.entries,
            objects=index.live_objects,
            bytes_stored=index.live_bytes,
            pending_puts=len(self.pending.puts),
            pending_bytes=self.pending.pending_bytes,
            quarantined_bytes=sum(s.quarantined_bytes for s in live),
            quarantined_ranges=len(index.quarantine),
            active_leases=len(self.leasing.leases),
            tenants=len(index.tenant_bytes),
            capacity=sum(s.allocator.capacity for s in servers.values()),
            used=sum(s.allocator.used for s in servers.values()),
        )
        out.update(self.heartbeats.tier_stats())
        out.update(self.parked.stats())
        out.update(self.rebuild.streams.stats())
        out.update(self.removals.stats())
        for name, val in index.group_bytes.items():
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
