"""Hypothesis stateful test over :class:`MetaCore` with NVMe tiers: puts (that may
wait for room, or may not), heartbeats that report demotions done or failed,
leased lookups, releases, admin evictions and time, on two servers whose tiers
differ in size, with a model whose blocks are always worth a disk write and one
whose blocks never are. An injected clock; the test plays the servers.

The invariant: no DRAM object leaves DRAM without an NVMe copy while its server's
tier takes demotions and has room for it (below the NVMe low watermark with it),
unless a put that could not wait (any more) evicted it. Every drop goes through
``Index.drop``; the test watches it and judges each by the state at that moment,
from its own reading of the rule (not the code's). Also: the drop counters add up,
the tiers stay below their high watermark, demotions in flight stay within their
bound."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.errors import PutWait
from gcache.layout import preset
from gcache.meta.core import MetaCore
from gcache.meta.records import NamespaceRecord, ObjectRecord, ServerRecord
from gcache.meta.tiers import DROP_REASONS, Demotion
from tests.unit.test_meta_core import spec
from tests.unit.test_meta_rebuild import assert_heaps_hold_the_evictable

WALL = 1_700_000_000.0
KB = 1 << 10
CAP = 1024 * KB  # DRAM per server
NVME = {"s0": 384 * KB, "s1": 4096 * KB}  # s0's tier is soon short of room
MAX_IN_FLIGHT = 3


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = MetaConfig(
            compute_tflops=400.0,  # llama-3-8b blocks of one token: not worth a disk write
            heartbeat_timeout_s=1000.0,
            put_timeout_s=5.0,
            lease_ttl_s=4.0,
            max_demotions_in_flight=MAX_IN_FLIGHT,
            high_watermark=0.9,
            low_watermark=0.6,
            demote_watermark=0.75,
            max_evict_per_put=0.5,
        )
        self.core = MetaCore(self.cfg)
        self.now = 0.0
        for i, (sid, nvme) in enumerate(NVME.items()):
            addr = wire.ServerAddr(sid, "127.0.0.1", 9000 + i, "h", "")
            self.core.register_server(addr, bytes(16), 1, CAP, 0.0, nvme_capacity=nvme)
        self.fps = [
            self.core.register_namespace({"model": "m"}, spec()).fingerprint,  # worth it
            self.core.register_namespace({"model": "l"}, preset("llama-3-8b", 1)).fingerprint,
        ]
        # The servers' side: demotions received, reported by the next heartbeat.
        self.pending: dict[str, list[Demotion]] = {sid: [] for sid in NVME}
        self.next_addr = dict.fromkeys(NVME, 0)
        self.leases: list[int] = []
        self.may_drop = False  # a put that may not wait is being placed
        self.violations: list[str] = []
        self.drops = 0
        inner = self.core.evictions.drop

        def watched(obj: ObjectRecord, ns: NamespaceRecord) -> int:
            if obj.tier == 0:
                self.drops += 1
                if not self.may_drop and self._tier_open(obj.server) and self._room(obj):
                    self.violations.append(
                        f"{obj.server.server_id}: a {obj.length}-byte object dropped with "
                        f"{obj.server.nvme_bytes} of {obj.server.nvme_capacity} NVMe bytes used"
                    )
            return inner(obj, ns)

        self.core.evictions.drop = watched  # type: ignore[method-assign]

    # ---- the rule, as the test reads it --------------------------------------------

    def _tier_open(self, srv: ServerRecord) -> bool:
        return bool(
            srv.nvme_capacity and srv.alive and srv.ready and self.now >= srv.demote_paused_until
        )

    def _room(self, obj: ObjectRecord) -> bool:
        srv = obj.server
        return srv.nvme_bytes + obj.length <= self.cfg.nvme_low_watermark * srv.nvme_capacity

    # ---- rules -----------------------------------------------------------------

    @rule(
        model=st.integers(0, 1),
        prompt=st.integers(0, 40),
        nblk=st.integers(1, 6),
        wait=st.booleans(),
    )
    def put(self, model: int, prompt: int, nblk: int, wait: bool) -> None:
        fp = self.fps[model]
        layout = self.core.namespaces[fp].layout
        bs = layout.block_size
        ks = keys.block_keys(fp, [prompt * 1009 + t for t in range(bs * nblk)], bs)
        req = wire.PutBegin(fp, ks, layout.groups_to_store(nblk))
        self.may_drop = not wait
        try:
            placed = self.core.put_begin(req, self.now, WALL + self.now, wait=wait)
        except PutWait:
            return  # the hot path would try again after the next report
        finally:
            self.may_drop = False
        if placed.placements:
            done = [
                (i, bytes(8 * len(layout.group_layers[p.group])))
                for i, p in enumerate(placed.placements)
            ]
            self.core.put_commit(wire.PutCommit(placed.put_id, done), self.now)

    @rule(sid=st.sampled_from(sorted(NVME)), ok=st.sampled_from([True, True, True, False]))
    def heartbeat(self, sid: str, ok: bool) -> None:
        """The server reports the demotions it was sent (written, or failed with an
        I/O error) and takes the next ones."""
        self.now += 0.1
        done = self.pending[sid]
        if not ok:
            done = [Demotion(d.dram_offset, d.length, 0, False, "EIO") for d in done]
        out = self.core.tier_heartbeat(sid, 1, {}, self.now, done)
        self.pending[sid] = []
        for obj, _ in out.demote:
            self.pending[sid].append(Demotion(obj.offset, obj.length, self.next_addr[sid], True))
            self.next_addr[sid] += obj.length

    @rule(model=st.integers(0, 1), prompt=st.integers(0, 40), nblk=st.integers(1, 6))
    def lookup(self, model: int, prompt: int, nblk: int) -> None:
        fp = self.fps[model]
        bs = self.core.namespaces[fp].layout.block_size
        ks = keys.block_keys(fp, [prompt * 1009 + t for t in range(bs * nblk)], bs)
        res = self.core.lookup(wire.Lookup(fp, ks, True), self.now, WALL + self.now)
        if res.lease_id:
            self.leases.append(res.lease_id)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(self.leases))
        self.core.release(lease_id)
        self.leases.remove(lease_id)

    @rule(model=st.integers(0, 1), prompt=st.integers(0, 40), nblk=st.integers(1, 6))
    def evict(self, model: int, prompt: int, nblk: int) -> None:
        fp = self.fps[model]
        bs = self.core.namespaces[fp].layout.block_size
        ks = keys.block_keys(fp, [prompt * 1009 + t for t in range(bs * nblk)], bs)
        self.core.evict_keys(fp, ks[::-1], 0b11)

    @rule(dt=st.sampled_from([0.25, 1.0, 6.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.core.tick(self.now)
        self.leases = [i for i in self.leases if i in self.core.leases]

    # ---- invariants ----------------------------------------------------------------

    @invariant()
    def eviction_heaps_hold_exactly_the_evictable(self) -> None:
        assert_heaps_hold_the_evictable(self.core.index.cx)

    @invariant()
    def nothing_demotable_dropped_while_the_tier_has_room(self) -> None:
        assert not self.violations, self.violations[0]

    @invariant()
    def drop_counters_add_up(self) -> None:
        c = self.core.counters
        assert c["dropped_not_demoted"] == sum(c[r] for r in DROP_REASONS)
        assert c["dropped_not_demoted"] == sum(s.dropped for s in self.core.servers.values())
        assert c["demotions_done"] == sum(s.demoted for s in self.core.servers.values())
        # Every DRAM object that went for room was counted (admin evictions do not
        # go through Index.drop).
        assert self.drops == c["dropped_not_demoted"]

    @invariant()
    def tiers_and_demotions_stay_within_bounds(self) -> None:
        for srv in self.core.servers.values():
            assert srv.nvme_bytes <= self.cfg.nvme_high_watermark * srv.nvme_capacity
            assert len(srv.demoting) <= MAX_IN_FLIGHT
            assert srv.demoting_bytes == sum(o.length for o, _ in srv.demoting.values())


TierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_tier_state_machine = TierMachine.TestCase
