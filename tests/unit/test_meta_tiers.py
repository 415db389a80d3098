"""The meta's side of the NVMe tier: demotion decisions, NVMe watermarks, the index
rebuilt from the servers' reports, no placement before a report is complete,
the epoch in grants, and placement's write balance. No processes: MetaCore is
driven directly, the servers' side is played by the test (heartbeats with
finished demotions, reports built from the records the meta sent)."""

from __future__ import annotations

from gcache import capability, keys, wire
from gcache.config import MetaConfig
from gcache.layout import preset
from gcache.meta.core import MetaCore
from gcache.meta.index import LEAVING_DRAM
from gcache.meta.rebuild import Parked
from gcache.meta.records import LIVE, NamespaceRecord, ObjectRecord
from gcache.meta.tiers import Demotion, HeartbeatOut
from tests.unit.test_meta_core import spec

WALL = 1.7e9
KB = 1 << 10
MB = 1 << 20
# The test layout is an unknown model (1 FLOP a token): at 1e-9 TFLOP/s a block
# takes 4 us x 1000 to recompute, far more than reading 8 KiB from NVMe.
SLOW = 1e-9


def make(
    servers: int = 1,
    capacity: int = 256 * KB,
    nvme: int = 4 * MB,
    epoch: int = 0,
    **cfg: object,
) -> tuple[MetaCore, bytes]:
    cfg.setdefault("compute_tflops", SLOW)
    core = MetaCore(MetaConfig(**cfg), epoch=epoch)  # type: ignore[arg-type]
    for i in range(servers):
        core.register_server(
            addr(i), bytes(16), incarnation=1, capacity=capacity, now=0.0, nvme_capacity=nvme
        )
    fp = core.register_namespace({"model": "m"}, spec()).fingerprint
    return core, fp


def addr(i: int) -> wire.ServerAddr:
    return wire.ServerAddr(f"s{i}", "127.0.0.1", 9000 + i, "host", f"/dev/shm/s{i}")


def toks(prompt: int, blocks: int = 4) -> list[int]:
    return [prompt * 1000 + j for j in range(4 * blocks)]


def put(core: MetaCore, fp: bytes, t: list[int], now: float) -> wire.PutPlaced:
    layout = core.namespaces[fp].layout
    ks = keys.block_keys(fp, t, layout.block_size)
    placed = core.put_begin(wire.PutBegin(fp, ks, layout.groups_to_store(len(ks))), now, WALL)
    done = [
        (i, bytes(8 * len(layout.group_layers[p.group]))) for i, p in enumerate(placed.placements)
    ]
    if placed.placements:
        core.put_commit(wire.PutCommit(placed.put_id, done), now)
    return placed


def lookup(core: MetaCore, fp: bytes, t: list[int], lease: bool = False) -> wire.LookupResult:
    ks = keys.block_keys(fp, t, core.namespaces[fp].layout.block_size)
    return core.lookup(wire.Lookup(fp, ks, lease), 0.0, WALL)


def heartbeat(
    core: MetaCore, sid: str, now: float, done: list[Demotion] | None = None
) -> HeartbeatOut:
    return core.tier_heartbeat(sid, 1, {}, now, done)


class FakeTier:
    """The server's NVMe tier, as far as the meta can tell: addresses handed out in
    order; demotions finished on the next heartbeat."""

    def __init__(self) -> None:
        self.next = 0
        self.pending: list[Demotion] = []
        self.records: dict[int, tuple[ObjectRecord, NamespaceRecord]] = {}

    def run(self, core: MetaCore, sid: str, now: float, ok: bool = True) -> HeartbeatOut:
        out = heartbeat(core, sid, now, self.pending)
        self.pending = []
        for obj, _ in out.demote:
            self.pending.append(
                Demotion(obj.offset, obj.length, self.next, ok, "" if ok else "EIO")
            )
            self.next += obj.length
        return out


def tier_objects(core: MetaCore, fp: bytes, tier: int) -> list[ObjectRecord]:
    ns = core.namespaces[fp]
    return [o for e in ns.entries.values() for o in e.objects if o is not None and o.tier == tier]


# ---- demotion ------------------------------------------------------------------------


def test_dram_past_high_watermark_demotes_then_frees_dram_after_the_report() -> None:
    core, fp = make()
    srv = core.servers["s0"]
    tier = FakeTier()
    for p in range(12):
        put(core, fp, toks(p), float(p))
    assert core.counters["demotions_issued"] > 0
    assert srv.demoting, "demotions wait for the server's report"
    used_before = srv.allocator.used
    # The objects being copied are still DRAM objects, readable and pinned.
    # (placement may still evict some in flight when DRAM is full: they stay pinned)
    assert all(o.tier == 0 and o.pins == 1 for o, _ in srv.demoting.values())
    assert any(o.state == LIVE for o, _ in srv.demoting.values())
    tier.run(core, "s0", 20.0)  # sends the commands
    out = tier.run(core, "s0", 21.0)  # reports them done (and may send more)
    c = core.counters
    assert c["demotions_done"] > 0
    settled = c["demotions_done"] + c["demotions_void"] + len(srv.demoting)
    assert settled == c["demotions_issued"]
    assert srv.demoting_bytes == sum(o.length for o, _ in srv.demoting.values())
    nvme = tier_objects(core, fp, 1)
    assert nvme and srv.nvme_bytes == sum(o.length for o in nvme)
    assert srv.allocator.used < used_before
    # Freed DRAM ranges go to the server in the following reply.
    assert heartbeat(core, "s0", 22.0).free or out.free
    # Every prompt still hits in full, some of it from NVMe; grants say the tier.
    res = lookup(core, fp, toks(0), lease=True)
    assert res.blocks == 4
    assert 1 in {loc.grant.tier for loc in res.objects}
    nvme_offsets = {o.offset for o in nvme}
    for loc in res.objects:
        assert loc.grant.tier == 0 or loc.grant.offset in nvme_offsets


def test_interior_dram_blocks_demote_once_their_children_are_on_nvme() -> None:
    # DRAM with room for the demotions in flight (they free DRAM a heartbeat later).
    core, fp = make(capacity=1 * MB)
    tier = FakeTier()
    for p in range(40):
        put(core, fp, toks(p, blocks=6), float(p))
        tier.run(core, "s0", float(p) + 0.5)
    ns = core.namespaces[fp]
    fg = ns.full_group
    assert fg is not None
    # Whole prompts went to NVMe, block 0 included: not only their leaves.
    first = keys.block_keys(fp, toks(0, 6), 4)
    full = [ns.entries[k].objects[fg] for k in first]
    assert all(o is not None and o.tier == 1 for o in full)
    assert lookup(core, fp, toks(0, 6)).blocks == 6
    # hot counts are exact: children whose full object is in DRAM and not leaving
    # it (a demotion in flight: continuous demotion leaves some at the end).
    for e in ns.entries.values():
        want = 0
        for c in ns.entries.values():
            o = c.objects[fg]
            if c.parent is e and o is not None and o.tier == 0 and o.hits != LEAVING_DRAM:
                want += 1
        assert e.hot == want


def test_objects_not_worth_a_disk_write_are_demoted_while_the_tier_has_room() -> None:
    # Llama-3-8B with 4-token blocks: 64 GFLOP (0.16 ms at 400 TFLOP/s) to recompute
    # a block, 512 KiB (0.26 ms at 2 GB/s) to read it back: not worth a disk write.
    # Under the tier's low watermark that does not matter: what leaves DRAM is
    # demoted (the value rule only judges when the tier is short of room). It used
    # to be dropped with the 4 MiB tier empty.
    core = MetaCore(MetaConfig(compute_tflops=400.0))
    srv = core.register_server(addr(0), bytes(16), 1, 8 * MB, 0.0, nvme_capacity=4 * MB)
    fp = core.register_namespace({"model": "llama"}, preset("llama-3-8b", 4)).fingerprint
    tier = FakeTier()
    low = core.cfg.nvme_low_watermark * srv.nvme_capacity
    c = core.counters
    first_drop_at = -1.0
    for p in range(12):
        put(core, fp, toks(p), float(p))
        tier.run(core, "s0", p + 0.5)  # sends the demotions
        tier.run(core, "s0", p + 0.6)  # reports them done
        if c["dropped_not_demoted"] and first_drop_at < 0:
            first_drop_at = srv.nvme_bytes
    room = int(low) // (512 * KB)  # 6 objects
    assert c["demotions_done"] >= room
    # Nothing was dropped before the tier was at its low watermark; from there the
    # value rule judges and drops them (NVMe keeps what it holds).
    assert first_drop_at > low - 512 * KB
    assert c["dropped_not_demoted"] == c["dropped_not_worth"] > 0
    assert srv.nvme_bytes <= core.cfg.nvme_high_watermark * srv.nvme_capacity
    assert srv.dropped == c["dropped_not_demoted"] and srv.demoted == c["demotions_done"]


def test_objects_not_worth_a_disk_write_are_dropped_when_the_tier_is_short() -> None:
    # The same blocks with a tier whose low watermark is below one object: never
    # room, so only the value rule judges, and it drops every one.
    core = MetaCore(MetaConfig(compute_tflops=400.0, nvme_low_watermark=0.001))
    core.register_server(addr(0), bytes(16), 1, 8 * MB, 0.0, nvme_capacity=64 * MB)
    fp = core.register_namespace({"model": "llama"}, preset("llama-3-8b", 4)).fingerprint
    for p in range(12):
        put(core, fp, toks(p), float(p))
    assert core.counters["demotions_issued"] == 0
    assert core.counters["dropped_not_demoted"] == core.counters["dropped_not_worth"] > 0
    assert core.counters["evictions"] > 0


def test_no_nvme_tier_or_demote_off_drops() -> None:
    for kw in ({"nvme": 0}, {"demote": False}):
        core, fp = make(**kw)  # type: ignore[arg-type]
        for p in range(12):
            put(core, fp, toks(p), float(p))
        assert core.counters["demotions_issued"] == 0
        assert core.counters["evictions"] > 0


def test_nvme_watermark_evicts_by_deleting() -> None:
    core, fp = make(nvme=256 * KB)
    srv = core.servers["s0"]
    tier = FakeTier()
    dropped: list[tuple[int, int]] = []
    for p in range(60):
        put(core, fp, toks(p), float(p))
        dropped += tier.run(core, "s0", float(p) + 0.5).drop_nvme
    assert core.counters["nvme_evictions"] > 0
    assert dropped, "NVMe evictions are sent as drop_nvme"
    assert srv.nvme_bytes <= core.cfg.nvme_high_watermark * srv.nvme_capacity
    live = {(o.offset, o.length) for o in tier_objects(core, fp, 1)}
    assert not live & set(dropped), "a live NVMe object was deleted"


def test_failed_demotion_keeps_the_object_and_pauses_demoting() -> None:
    core, fp = make()
    srv = core.servers["s0"]
    tier = FakeTier()
    for p in range(12):
        put(core, fp, toks(p), float(p))
    tier.run(core, "s0", 20.0, ok=False)
    out = tier.run(core, "s0", 21.0)
    assert core.counters["demotions_failed"] > 0 and out.failed
    assert not tier_objects(core, fp, 1)
    assert srv.demote_paused_until > 21.0
    assert all(o.pins == 0 for o in tier_objects(core, fp, 0))


def test_evicted_while_demoting_deletes_the_copy() -> None:
    core, fp = make()
    srv = core.servers["s0"]
    tier = FakeTier()
    for p in range(12):
        put(core, fp, toks(p), float(p))
    tier.run(core, "s0", 20.0)
    obj = next(o for o, _ in srv.demoting.values() if o.entry.children == 0)
    copy = next(d for d in tier.pending if d.dram_offset == obj.offset)
    # The operator evicts it while it is being copied: its range stays held.
    core.evict_keys(fp, [obj.entry.key], 0b111)
    assert obj.state != LIVE and srv.deferred_bytes >= obj.length
    out = tier.run(core, "s0", 21.0)
    assert (copy.nvme_offset, copy.length) in out.drop_nvme + heartbeat(core, "s0", 22).drop_nvme
    assert srv.deferred_bytes == 0
    assert (obj.offset, obj.length) in heartbeat(core, "s0", 23).free + out.free


def test_nvme_objects_the_server_lost_are_forgotten_not_deleted() -> None:
    core, fp = make()
    tier = FakeTier()
    for p in range(12):
        put(core, fp, toks(p), float(p))
    tier.run(core, "s0", 20.0)
    tier.run(core, "s0", 21.0)
    lost = [(o.offset, o.length) for o in tier_objects(core, fp, 1)]
    assert lost
    out = core.tier_heartbeat("s0", 1, {}, 22.0, None, 0, lost)
    assert core.counters["nvme_lost"] == len(lost)
    assert not tier_objects(core, fp, 1)
    assert core.servers["s0"].nvme_bytes == sum(
        o.length for o, _ in core.servers["s0"].demoting.values()
    )
    assert not set(lost) & set(out.drop_nvme + heartbeat(core, "s0", 23.0).drop_nvme)


# ---- rebuild from reports ---------------------------------------------------------------


def report_of(core: MetaCore, sid: str) -> list[Parked]:
    """What a server holds after applying every heartbeat reply: its manifest."""
    out: list[Parked] = []
    for ns in core.namespaces.values():
        for e in ns.entries.values():
            for o in e.objects:
                if o is not None and o.server.server_id == sid:
                    parent = e.parent.key if e.parent is not None else b""
                    out.append(
                        Parked(
                            ns.fingerprint, e.key, parent, e.pos, o.group, o.tier,
                            o.offset, o.length, o.sums, seq=int(o.last_access * 1000),
                        )
                    )  # fmt: skip
    return out


def test_rebuild_from_reports_restores_hits_and_blocks_placement_until_complete() -> None:
    old, fp = make(servers=2)
    tier = FakeTier()
    prompts = [toks(p) for p in range(10)]
    for i, t in enumerate(prompts):
        put(old, fp, t, float(i))
        tier.run(old, "s0", float(i) + 0.5)
        heartbeat(old, "s1", float(i) + 0.5)
    hits_before = [lookup(old, fp, t).blocks for t in prompts]
    assert sum(hits_before) > 0
    reports = {sid: report_of(old, sid) for sid in ("s0", "s1")}

    # A new meta (epoch later); the servers register and report, clients come back.
    new = MetaCore(MetaConfig(compute_tflops=SLOW), epoch=2)
    for i in range(2):
        new.register_server(addr(i), bytes(16), 1, 256 * KB, 0.0, nvme_capacity=4 * MB, report=True)
    assert not any(s.ready for s in new.servers.values())
    # Chunks arrive before the namespace is registered: parked, ranges held.
    half = len(reports["s0"]) // 2
    assert new.report_objects("s0", 1, reports["s0"][:half], False, 1.0) == (0, 0)
    assert new.stats()["parked_objects"] == half
    fp2 = new.register_namespace({"model": "m"}, spec()).fingerprint
    assert fp2 == fp
    # The namespace is back: no placement while any report is incomplete.
    placed = put(new, fp, toks(99), 2.0)
    assert not placed.placements and placed.no_space
    new.report_objects("s0", 1, reports["s0"][half:], True, 2.0)
    new.report_objects("s1", 1, reports["s1"], True, 2.0)
    assert all(s.ready for s in new.servers.values())
    assert [lookup(new, fp, t).blocks for t in prompts] == hits_before
    # Reported DRAM ranges are used: new placements never overlap them.
    held = {(o.server.server_id, o.offset) for o in tier_objects(new, fp, 0)}
    placed = put(new, fp, toks(100), 3.0)
    assert placed.placements
    for p in placed.placements:
        sid = placed.servers[p.server].server_id
        assert (sid, p.grant.offset) not in held
    assert new.counters["reports_completed"] == 2


def test_children_reported_before_their_parents_wait_for_them() -> None:
    old, fp = make(servers=2)
    for p in range(4):
        put(old, fp, toks(p, 8), float(p))
    reps = [("s0", r) for r in report_of(old, "s0")] + [("s1", r) for r in report_of(old, "s1")]
    new = MetaCore(MetaConfig(compute_tflops=SLOW))
    new.register_namespace({"model": "m"}, spec())
    new.register_server(addr(0), bytes(16), 1, 256 * KB, 0.0, report=True)
    new.register_server(addr(1), bytes(16), 1, 256 * KB, 0.0, report=True)
    # Deepest blocks first, one record per chunk: every one must wait.
    for sid, rec in sorted(reps, key=lambda r: -r[1].pos):
        new.report_objects(sid, 1, [rec], False, 1.0)
    ns = new.namespaces[fp]
    for e in ns.entries.values():
        assert e.parent is None or ns.entries.get(e.parent.key) is e.parent
    assert new.stats()["parked_objects"] == 0
    assert [lookup(new, fp, toks(p, 8)).blocks for p in range(4)] == [
        lookup(old, fp, toks(p, 8)).blocks for p in range(4)
    ]


def test_invalid_and_overlapping_reports_are_dropped() -> None:
    new = MetaCore(MetaConfig())
    fp = new.register_namespace({"model": "m"}, spec()).fingerprint
    new.register_server(addr(0), bytes(16), 1, 256 * KB, 0.0, report=True)
    k = keys.block_keys(fp, toks(1), 4)
    sums = bytes(16)
    recs = [
        Parked(fp, k[0], b"", 0, 0, 0, 4096 + 1, 8 * KB, sums, 1),  # misaligned
        Parked(fp, k[0], b"", 0, 0, 0, 512 * KB, 8 * KB, sums, 2),  # outside
        Parked(fp, k[0], b"", 0, 0, 0, 0, 4 * KB, sums, 3),  # wrong length for group 0
        Parked(fp, k[1], k[0], 1, 0, 0, 64 * KB, 8 * KB, sums, 4),  # parent never valid
    ]
    got = new.report_objects("s0", 1, recs, True, 1.0)
    assert got is not None and got[0] == 0
    assert new.counters["report_invalid"] == 3
    assert new.stats()["objects"] == 0
    # A report for an unknown incarnation is refused.
    assert new.report_objects("s0", 7, [], True, 1.0) is None


def test_parked_objects_expire_and_are_freed() -> None:
    new = MetaCore(MetaConfig(parked_ttl_s=5.0, heartbeat_timeout_s=100.0))
    new.register_server(addr(0), bytes(16), 1, 256 * KB, 0.0, report=True)
    fp = keys.fingerprint({"model": "never"})
    k = keys.block_keys(fp, toks(1), 4)
    new.report_objects(
        "s0", 1, [Parked(fp, k[0], b"", 0, 0, 0, 0, 8 * KB, bytes(16), 1)], True, 1.0
    )
    srv = new.servers["s0"]
    assert srv.allocator.used == 8 * KB  # held while parked
    new.tick(3.0)
    assert srv.allocator.used == 8 * KB
    new.tick(7.0)
    assert srv.allocator.used == 0
    assert new.counters["parked_expired"] == 1
    assert (0, 8 * KB) in heartbeat(new, "s0", 7.5).free


# ---- epoch and tiers in grants --------------------------------------------------------


def test_grants_carry_the_epoch_and_the_tier() -> None:
    core, fp = make(epoch=1_700_000_000_123)
    placed = put(core, fp, toks(1), 0.0)
    g = placed.placements[0].grant
    assert g.epoch == 1_700_000_000_123 and g.tier == 0
    p = placed.placements[0]
    k = keys.block_keys(fp, toks(1), 4)
    parent = k[p.block - 1] if p.block else b""
    lb = core.namespaces[fp].layout.group_layer_bytes[p.group]
    bind = capability.bind_digest(fp, k[p.block], parent, p.block, p.group, lb)
    assert capability.check(
        bytes(16), capability.KIND_WRITE, g.offset, g.length, g.expiry_ms, g.tag, 0, g.epoch, bind
    )
    assert not capability.check(
        bytes(16), capability.KIND_WRITE, g.offset, g.length, g.expiry_ms, g.tag, 0, 0, bind
    )
    # Bound to its object: without the record, or with another one, it fails.
    assert not capability.check(
        bytes(16), capability.KIND_WRITE, g.offset, g.length, g.expiry_ms, g.tag, 0, g.epoch
    )
    other = capability.bind_digest(fp, k[p.block], parent, p.block, p.group + 1, lb)
    assert not capability.check(
        bytes(16), capability.KIND_WRITE, g.offset, g.length, g.expiry_ms, g.tag, 0, g.epoch, other
    )
    res = lookup(core, fp, toks(1), lease=True)
    r = res.objects[0].grant
    assert r.epoch == g.epoch
    assert capability.check(
        bytes(16), capability.KIND_READ, r.offset, r.length, r.expiry_ms, r.tag, r.tier, r.epoch
    )


# ---- placement balance ------------------------------------------------------------------


def test_a_restarted_empty_server_is_not_flooded() -> None:
    core, fp = make(servers=3, capacity=4 * MB, nvme=0, high_watermark=0.99, low_watermark=0.98)
    for p in range(200):
        put(core, fp, toks(p), p * 0.01)
    # s2 restarts empty (a new incarnation).
    core.register_server(addr(2), bytes(16), incarnation=2, capacity=4 * MB, now=2.0)
    counts = {"s0": 0, "s1": 0, "s2": 0}
    for p in range(200, 400):
        placed = put(core, fp, toks(p), 2.0 + p * 0.01)
        for pl in placed.placements:
            counts[placed.servers[pl.server].server_id] += 1
    total = sum(counts.values())
    assert counts["s2"] < 0.6 * total, counts  # it used to take every new write
    assert counts["s2"] > counts["s0"], counts  # but it does take more


# ---- adopt outbox: lossless, bounded by backpressure ------------------------------------


def test_full_adopt_outbox_pauses_placement_and_loses_no_commit() -> None:
    """Commits past ``adopt_outbox`` were counted and left out of the server's
    manifest (lost on a restart). Now a server whose outbox is full takes no new
    placements until a heartbeat drains it, and every commit reaches the manifest."""
    core, fp = make(servers=2, capacity=4 * MB, nvme=0, adopt_outbox=8)
    s0, s1 = core.servers["s0"], core.servers["s1"]
    committed: set[tuple[str, int]] = set()
    adopted: set[tuple[str, int]] = set()
    paused_seen = False
    for p in range(30):
        placed = put(core, fp, toks(p), float(p))
        for pl in placed.placements:
            committed.add((placed.servers[pl.server].server_id, pl.grant.offset))
        for srv in (s0, s1):
            # Never more than the bound plus what one put placed before the pause.
            assert len(srv.adopt_out) <= 8 + 6
            if len(srv.adopt_out) >= 8:
                paused_seen = True
                assert srv not in core.membership.live_servers()
        if p % 5 == 4:  # a heartbeat now and then drains both outboxes
            for sid in ("s0", "s1"):
                out = heartbeat(core, sid, float(p) + 0.5)
                adopted |= {(sid, o.offset) for o, _ in out.adopt}
    assert paused_seen and core.counters["adopt_paused"] > 0
    for sid in ("s0", "s1"):
        for _ in range(10):
            adopted |= {(sid, o.offset) for o, _ in heartbeat(core, sid, 99.0).adopt}
    live = {(o.server.server_id, o.offset) for o in tier_objects(core, fp, 0)}
    assert live <= committed
    assert live <= adopted, "a committed object never reached its server's manifest"
    # Drained: both servers take placements again.
    assert s0 in core.membership.live_servers() and s1 in core.membership.live_servers()


def test_single_server_with_a_full_outbox_answers_no_space_until_drained() -> None:
    core, fp = make(servers=1, capacity=4 * MB, nvme=0, adopt_outbox=4)
    first = put(core, fp, toks(0), 0.0)
    assert len(first.placements) >= 4
    blocked = put(core, fp, toks(1), 1.0)
    assert not blocked.placements and blocked.no_space
    heartbeat(core, "s0", 2.0)  # drains the outbox
    assert put(core, fp, toks(1), 3.0).placements


def test_reply_says_more_while_the_outbox_holds_more_than_one_reply() -> None:
    """The outbox drained one bounded reply per heartbeat interval (~4096 commits/s a
    server; placement paused for tens of seconds after a burst). A reply cut by its
    bound now says ``more`` so the server heartbeats again at once."""
    from gcache.meta.tiers import MAX_ADOPT_PER_REPLY

    core, fp = make(servers=1, capacity=64 * MB, nvme=0)
    n = 0
    p = 0
    while n <= MAX_ADOPT_PER_REPLY + 10:
        n += len(put(core, fp, toks(p), 0.0).placements)
        p += 1
    srv = core.servers["s0"]
    assert len(srv.adopt_out) == n
    first = heartbeat(core, "s0", 1.0)
    assert len(first.adopt) == MAX_ADOPT_PER_REPLY and first.more
    second = heartbeat(core, "s0", 1.001)
    assert len(second.adopt) == n - MAX_ADOPT_PER_REPLY and not second.more
    assert not heartbeat(core, "s0", 2.0).more
