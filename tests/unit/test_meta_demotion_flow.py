"""The demotion pipeline's decisions in the meta: continuous
demotion above ``demote_watermark``, a heartbeat reply that carries the demotions
its own report made room for, and puts that wait for demotions in flight
(``PutWait``) instead of dropping worth-keeping objects. MetaCore is driven
directly with an injected clock; the test plays the server (heartbeats reporting
finished demotions)."""

from __future__ import annotations

import pytest

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.errors import PutWait
from gcache.layout import LayerSpec, LayoutSpec, preset
from gcache.meta.core import MetaCore
from gcache.meta.records import LIVE
from gcache.meta.tiers import Demotion, HeartbeatOut

WALL = 1.7e9
KB = 1 << 10
MB = 1 << 20
OBJ = 8 * KB  # one block of SPEC: two layers of 4 KiB
SLOW = 1e-9  # TFLOP/s: every block of an unknown model is worth a disk write

SPEC = LayoutSpec(
    block_size=4,
    dtype="float16",
    layers=(
        LayerSpec("full", kv_heads=1, k_head_dim=256, v_head_dim=256),
        LayerSpec("full", kv_heads=1, k_head_dim=256, v_head_dim=256),
    ),
)


def make(capacity: int = 64 * OBJ, nvme: int = 16 * MB, **cfg: object) -> tuple[MetaCore, bytes]:
    cfg.setdefault("compute_tflops", SLOW)
    cfg.setdefault("high_watermark", 0.9)
    cfg.setdefault("low_watermark", 0.5)
    core = MetaCore(MetaConfig(**cfg))  # type: ignore[arg-type]
    addr = wire.ServerAddr("s0", "127.0.0.1", 9000, "host", "/dev/shm/s0")
    core.register_server(addr, bytes(16), incarnation=1, capacity=capacity, now=0.0,
                         nvme_capacity=nvme)  # fmt: skip
    fp = core.register_namespace({"model": "m"}, SPEC).fingerprint
    return core, fp


def put(
    core: MetaCore, fp: bytes, prompt: int, now: float, wait: bool = False, blocks: int = 1
) -> wire.PutPlaced:
    """A put of ``blocks`` blocks of a prompt of its own, committed at once."""
    layout = core.namespaces[fp].layout
    ks = keys.block_keys(fp, [prompt * 1000 + j for j in range(4 * blocks)], 4)
    req = wire.PutBegin(fp, ks, layout.groups_to_store(len(ks)))
    placed = core.put_begin(req, now, WALL, wait=wait)
    if placed.placements:
        done = [(i, bytes(8 * len(layout.group_layers[p.group])))
                for i, p in enumerate(placed.placements)]  # fmt: skip
        core.put_commit(wire.PutCommit(placed.put_id, done), now)
    return placed


class Server:
    """The server's side: demotions received in a reply are done by the next beat."""

    def __init__(self) -> None:
        self.next = 0
        self.pending: list[Demotion] = []

    def beat(self, core: MetaCore, now: float) -> HeartbeatOut:
        out = core.tier_heartbeat("s0", 1, {}, now, self.pending)
        self.pending = []
        for obj, _ in out.demote:
            self.pending.append(Demotion(obj.offset, obj.length, self.next, True))
            self.next += obj.length
        return out


def live_objects(core: MetaCore, fp: bytes) -> int:
    ns = core.namespaces[fp]
    return sum(1 for e in ns.entries.values() for o in e.objects if o is not None)


# ---- continuous demotion ---------------------------------------------------------------


def test_objects_demote_above_the_demote_watermark_before_the_high_one() -> None:
    core, fp = make(demote_watermark=0.5)
    srv = core.servers["s0"]
    for p in range(40):  # 40 of 64 objects: past 0.5, below 0.9
        put(core, fp, p, float(p))
    c = core.counters
    # Everything past the demote watermark is on its way to NVMe; nothing dropped.
    assert c["demotions_issued"] == 40 - 32
    assert c["evictions"] == 0 and c["dropped_not_demoted"] == 0
    assert srv.reclaimable_used <= 0.5 * srv.allocator.capacity
    # The oldest go first (the policy's order).
    assert sorted(o.entry.pos for o, _ in srv.demoting.values()) == [0] * 8
    oldest = {o.last_access for o, _ in srv.demoting.values()}
    assert oldest == {float(p) for p in range(8)}


def test_demote_watermark_at_the_high_watermark_is_off() -> None:
    core, fp = make(demote_watermark=0.9)
    for p in range(40):
        put(core, fp, p, float(p))
    assert core.counters["demotions_issued"] == 0


def test_continuous_demotion_passes_over_objects_not_worth_a_disk_write() -> None:
    # Llama-3-8B blocks (not worth a disk write at 400 TFLOP/s) are older than the
    # test model's. With the tier short of room (its low watermark, 16 KiB, is
    # below one of them) continuous demotion skips them (they wait for the high
    # watermark, where they are dropped) and demotes the worth-keeping ones.
    core, fp = make(capacity=16 * MB, demote_watermark=0.3, compute_tflops=400.0,
                    nvme_low_watermark=0.001)  # fmt: skip
    llama = core.register_namespace({"model": "llama"}, preset("llama-3-8b", 4)).fingerprint
    for p in range(4):  # 4 x 512 KiB
        put(core, llama, p, float(p))
    for p in range(400):  # 400 x 8 KiB: past 0.3 of 16 MiB
        put(core, fp, p, 10.0 + p)
    c = core.counters
    assert c["demotions_issued"] > 0 and c["evictions"] == 0
    assert all(o.entry.key in core.namespaces[fp].entries
               for o, _ in core.servers["s0"].demoting.values())  # fmt: skip
    assert live_objects(core, llama) == 4  # passed over, not dropped, still evictable
    assert core.policy.stats()["heap_items"] >= 4


def test_demotions_in_flight_are_bounded() -> None:
    core, fp = make(demote_watermark=0.5, max_demotions_in_flight=3)
    srv = core.servers["s0"]
    for p in range(40):
        put(core, fp, p, float(p))
    assert len(srv.demoting) == 3
    assert core.counters["evictions"] == 0  # waiting, not dropped


def test_watermark_pass_stops_at_the_bound_instead_of_dropping() -> None:
    # Past the high watermark with the bound of demotions in flight (2) reached and
    # the tier nearly empty: the pass stops there (demotion is behind) and drops
    # nothing; DRAM stays above its watermark until reports let the next ones go.
    # It used to drop everything past the bound.
    core, fp = make(high_watermark=0.5, low_watermark=0.25, demote_watermark=0.9,
                    max_demotions_in_flight=2)  # fmt: skip
    srv = core.servers["s0"]
    for p in range(40):  # 40 of 64 objects: DRAM never full, puts never wait
        put(core, fp, p, float(p))
    c = core.counters
    assert c["demotions_issued"] == 2 and len(srv.demoting) == 2
    assert c["dropped_not_demoted"] == 0 and c["evictions"] == 0
    assert c["demotion_behind"] > 0
    assert srv.reclaimable_used > 0.5 * srv.allocator.capacity
    server = Server()
    for i in range(40):  # each report lets the next two go
        server.beat(core, 50.0 + i * 0.1)
        if not srv.demoting:
            break
    assert srv.reclaimable_used <= 0.5 * srv.allocator.capacity
    assert c["dropped_not_demoted"] == 0 and c["evictions"] == 0
    assert c["demotions_done"] == c["demotions_issued"] > 2
    assert live_objects(core, fp) == 40


def test_a_report_gets_the_next_batch_in_the_same_reply() -> None:
    core, fp = make(demote_watermark=0.5, max_demotions_in_flight=4)
    server = Server()
    for p in range(40):
        put(core, fp, p, float(p))
    first = server.beat(core, 50.0)
    assert len(first.demote) == 4
    # The report of those 4 frees room under the bound: the reply that answers it
    # carries the next 4 (the server's disk is not idle until the next tick).
    second = server.beat(core, 50.1)
    assert core.counters["demotions_done"] == 4
    assert len(second.demote) == 4
    assert not second.more
    # The DRAM ranges of the finished ones go back in the same reply.
    assert len(second.free) == 4


# ---- puts that wait for demotions in flight --------------------------------------------


def fill_until_full(core: MetaCore, fp: bytes, in_flight: bool = True) -> int:
    """Put one-block prompts until the allocator has no room; past the (demote or
    high) watermark demotions are issued and stay in flight (no heartbeat reports
    them)."""
    srv = core.servers["s0"]
    p = 0
    while srv.allocator.largest_free() >= OBJ:
        put(core, fp, p, float(p))
        p += 1
        assert p < 10_000, "DRAM never filled"
    assert bool(srv.demoting) == in_flight
    return p


def test_put_finding_dram_full_waits_for_demotions_instead_of_dropping() -> None:
    core, fp = make(demote_watermark=0.9)
    srv = core.servers["s0"]
    n = fill_until_full(core, fp)
    used, objects = srv.allocator.used, live_objects(core, fp)
    gen = core.room_gen
    woken: list[int] = []
    core.on_room = lambda: woken.append(core.room_gen)  # the hot path's wake-up
    with pytest.raises(PutWait):
        put(core, fp, n, 100.0, wait=True)
    # Nothing changed: no eviction, no range kept, no pending put.
    assert core.counters["evictions"] == 0
    assert srv.allocator.used == used and live_objects(core, fp) == objects
    assert not core.puts and srv.pending_bytes == 0
    assert core.counters["puts_told_to_wait"] == 1
    # The server reports the demotions: room, and the put goes through.
    server = Server()
    server.beat(core, 100.1)
    server.beat(core, 100.2)
    assert core.room_gen > gen and woken and woken[-1] == core.room_gen
    placed = put(core, fp, n, 100.3, wait=True)
    assert len(placed.placements) == 1 and placed.no_space == 0
    assert core.counters["evictions"] == 0
    # Every object is still cached, in DRAM or on NVMe.
    assert live_objects(core, fp) == n + 1


def test_put_that_may_not_wait_evicts_as_before() -> None:
    core, fp = make(demote_watermark=0.9)
    n = fill_until_full(core, fp)
    placed = put(core, fp, n, 100.0, wait=False)
    assert len(placed.placements) == 1
    assert core.counters["evictions"] > 0  # dropped (worth-keeping) to make room


def test_put_drops_objects_not_worth_a_disk_write_at_once() -> None:
    # DRAM full of worth-keeping objects being demoted, and older llama blocks not
    # worth a disk write while the tier is short of room (its low watermark, 16 KiB,
    # is below one of them): the put drops those at once and does not wait.
    core, fp = make(capacity=8 * MB, demote_watermark=0.3, high_watermark=1.0,
                    compute_tflops=400.0, nvme_low_watermark=0.001)  # fmt: skip
    llama = core.register_namespace({"model": "llama"}, preset("llama-3-8b", 4)).fingerprint
    for p in range(2):
        put(core, llama, p, float(p))
    fill_until_full(core, fp)
    before = live_objects(core, fp)
    placed = put(core, fp, 10_000, 100.0, wait=True)  # no PutWait
    assert len(placed.placements) == 1
    c = core.counters
    assert c["dropped_not_demoted"] >= 1 and c["puts_told_to_wait"] == 0
    assert c["dropped_not_worth"] == c["dropped_not_demoted"]
    assert live_objects(core, llama) < 2
    assert live_objects(core, fp) == before + 1  # no worth-keeping object dropped


def test_put_with_tier_room_waits_rather_than_drop_objects_not_worth_a_disk_write() -> None:
    # The same llama blocks with the tier nearly empty: the value rule does not
    # judge, they are demoted like the rest and the put waits for the room.
    core, fp = make(capacity=8 * MB, demote_watermark=0.3, high_watermark=1.0,
                    compute_tflops=400.0)  # fmt: skip
    llama = core.register_namespace({"model": "llama"}, preset("llama-3-8b", 4)).fingerprint
    for p in range(2):
        put(core, llama, p, float(p))
    fill_until_full(core, fp)
    with pytest.raises(PutWait):
        put(core, fp, 10_000, 100.0, wait=True)
    c = core.counters
    assert c["dropped_not_demoted"] == 0 and c["evictions"] == 0
    assert live_objects(core, llama) == 2
    srv = core.servers["s0"]
    assert core.namespaces[llama] in {n for _, n in srv.demoting.values()}


def test_put_without_an_nvme_tier_evicts_without_waiting() -> None:
    core, fp = make(nvme=0, high_watermark=1.0)
    p = fill_until_full(core, fp, in_flight=False)
    placed = put(core, fp, p, 100.0, wait=True)
    assert len(placed.placements) == 1
    assert core.counters["evictions"] > 0 and core.counters["puts_told_to_wait"] == 0


def big_namespace(core: MetaCore) -> bytes:
    """A model whose one-block object (32 KiB) is 4 of the test model's."""
    return core.register_namespace({"model": "big"}, LayoutSpec(
        block_size=4, dtype="float16",
        layers=(LayerSpec("full", kv_heads=4, k_head_dim=256, v_head_dim=256),),
    )).fingerprint  # fmt: skip


def test_put_waits_only_for_room_the_demotions_in_flight_make() -> None:
    # In flight: 8 KiB objects. A 2-block put needs one object at a time, so it
    # waits; an object bigger than everything in flight cannot be helped by them,
    # and with no demotion possible (a failed one paused the tier) nothing else
    # will come: evict.
    core, fp = make(demote_watermark=0.5, high_watermark=1.0, max_demotions_in_flight=4)
    srv = core.servers["s0"]
    n = fill_until_full(core, fp)
    assert srv.demoting_bytes == 4 * OBJ
    with pytest.raises(PutWait):
        put(core, fp, n, 100.0, wait=True, blocks=2)
    assert core.counters["demotion_behind_waits"] == 0  # the room is in flight
    srv.demote_paused_until = 1e9  # no more demotions on this server
    core.tiers.now_s = 101.0
    big = big_namespace(core)
    placed = put(core, big, 0, 101.0, wait=True)  # 32 KiB: more than is in flight
    assert len(placed.placements) == 1
    assert core.counters["evictions"] > 0
    assert core.counters["dropped_no_tier"] > 0


def test_put_waits_when_demotion_is_behind() -> None:
    # The bound of demotions in flight (1) is reached with the tier nearly empty:
    # an object bigger than what is in flight waits for demotion to catch up
    # (each finished one lets the next go) instead of dropping objects the tier
    # has room for. It used to evict.
    core, fp = make(demote_watermark=0.5, high_watermark=1.0, max_demotions_in_flight=1)
    srv = core.servers["s0"]
    fill_until_full(core, fp)
    assert srv.demoting_bytes == OBJ
    big = big_namespace(core)
    with pytest.raises(PutWait):
        put(core, big, 0, 101.0, wait=True)  # 32 KiB: more than is in flight
    c = core.counters
    assert c["demotion_behind_waits"] == 1 and c["puts_told_to_wait"] == 1
    assert c["evictions"] == 0 and c["dropped_not_demoted"] == 0
    # Demotion catches up one report at a time; the put goes through without a drop.
    server = Server()
    for i in range(40):
        server.beat(core, 102.0 + i * 0.1)
        try:
            placed = put(core, big, 0, 102.05 + i * 0.1, wait=True)
        except PutWait:
            continue
        break
    else:
        raise AssertionError("the put never got its room")
    assert len(placed.placements) == 1
    assert c["evictions"] == 0 and c["dropped_not_demoted"] == 0
    # A put that may not wait any longer evicts, and says so.
    fill_until_full(core, fp)
    put(core, big, 1, 200.0, wait=False)
    assert c["dropped_put_could_not_wait"] > 0
    assert c["dropped_not_demoted"] == c["dropped_put_could_not_wait"]


def test_waiting_put_keeps_pinned_and_leased_objects() -> None:
    core, fp = make(demote_watermark=0.9)
    n = fill_until_full(core, fp)
    with pytest.raises(PutWait):
        put(core, fp, n, 100.0, wait=True)
    srv = core.servers["s0"]
    assert all(o.state == LIVE and o.pins == 1 for o, _ in srv.demoting.values())


def test_heartbeat_reply_asks_for_the_next_beat_soon_under_dram_pressure() -> None:
    """A reply asks for the next heartbeat within ``pressure_heartbeat_s`` while the
    rate puts were placed on the server since its last beat would take DRAM past
    ``demote_watermark`` within a second (a put then finding DRAM full queues
    demotions the server fetches at once), and leaves the server's interval alone
    on an idle or slowly written server."""
    core, fp = make(capacity=64 * OBJ, demote_watermark=0.8)
    srv = Server()
    assert srv.beat(core, 0.0).next_beat_s == 0.0  # empty and idle
    put(core, fp, 0, now=0.5, blocks=4)  # 4 of 64 objects in a second: slow
    assert srv.beat(core, 1.0).next_beat_s == 0.0
    assert core.counters["pressure_beats"] == 0
    # A fast writer: 32 objects within half a second (64 a second): projected a
    # second ahead, DRAM passes 80 % long before the next regular beat.
    for p in range(1, 9):
        put(core, fp, p, now=1.0 + p * 0.05, blocks=4)
    out = srv.beat(core, 1.5)
    assert out.next_beat_s == core.cfg.pressure_heartbeat_s > 0
    assert core.counters["pressure_beats"] == 1
    # Writes stop: below the watermark, the next reply leaves the interval alone.
    assert core.servers["s0"].allocator.used < 0.8 * 64 * OBJ
    assert srv.beat(core, 2.5).next_beat_s == 0.0
    # Past the watermark the server beats soon whatever the rate.
    s0 = core.servers["s0"]
    for p in range(9, 100):
        put(core, fp, p, now=3.0)
        if s0.allocator.used >= 0.8 * 64 * OBJ:  # (some of it demoting)
            break
    assert srv.beat(core, 13.0).next_beat_s == core.cfg.pressure_heartbeat_s


def test_pressure_beats_off_without_a_tier_or_when_configured_off() -> None:
    core, fp = make(nvme=0)
    for p in range(12):
        put(core, fp, p, now=p * 0.01, blocks=4)
    assert Server().beat(core, 0.2).next_beat_s == 0.0
    core, fp = make(pressure_heartbeat_s=0.0)
    for p in range(12):
        put(core, fp, p, now=p * 0.01, blocks=4)
    assert Server().beat(core, 0.2).next_beat_s == 0.0
