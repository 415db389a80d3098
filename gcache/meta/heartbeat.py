"""Heartbeats: a server's heartbeat applies what it reports (finished demotions and
promotions, NVMe objects it lost) and is answered with the outboxes of its record
(ranges freed, commits to record, demotions, NVMe deletes, promotions), each bounded
per reply. Finished demotions free DRAM: puts told to wait for room try again
(``room_gen``, ``on_room``). No I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from gcache.config import MetaConfig
from gcache.meta.membership import Membership
from gcache.meta.promotion import Promoter
from gcache.meta.records import LIVE, ServerRecord
from gcache.meta.tiers import (
    MAX_ADOPT_PER_REPLY,
    MAX_DEMOTE_PER_REPLY,
    MAX_DROP_PER_REPLY,
    MAX_PROMOTE_PER_REPLY,
    Demotion,
    HeartbeatOut,
    Promotion,
    Tiers,
)

T = TypeVar("T")

# How far ahead a server's recent write rate is projected against its demote
# watermark (about one regular heartbeat interval): see Heartbeats.next_beat.
PRESSURE_HORIZON_S = 1.0


def _take(items: list[T], n: int) -> list[T]:
    """The first ``n`` of ``items``, removed from it."""
    out = items[:n]
    del items[:n]
    return out


class Heartbeats:
    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        members: Membership,
        tiers: Tiers,
        promoter: Promoter,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.members = members
        self.tiers = tiers
        self.promoter = promoter
        # Bumped whenever servers report finished demotions (DRAM freed), and
        # ``on_room`` called: a put told to wait for room (``PutWait``) tries again.
        self.room_gen = 0
        self.on_room: Callable[[], None] | None = None

    def tier_heartbeat(
        self,
        server_id: str,
        incarnation: int,
        counters: dict[str, int],
        now: float,
        demoted: list[Demotion] | None = None,
        nvme_used: int = 0,
        nvme_lost: list[tuple[int, int]] | None = None,
        promoted: list[Promotion] | None = None,
    ) -> HeartbeatOut:
        """A server's heartbeat: apply its finished demotions, then answer with
        what it must do (bounded per reply; the rest waits for the next one)."""
        self.tiers.now_s = max(self.tiers.now_s, now)
        srv = self.members.servers.get(server_id)
        if srv is None or not srv.alive or srv.incarnation != incarnation:
            return HeartbeatOut(reregister=True)
        since, srv.last_seen = now - srv.last_seen, now
        srv.counters = counters
        srv.nvme_used_reported = nvme_used
        out = HeartbeatOut()
        if nvme_lost:
            self.tiers.nvme_lost(srv, nvme_lost)
        for d in demoted or ():
            err = self.tiers.demoted(srv, d, now)
            if err is not None:
                out.failed.append(err)
        if demoted:
            self.room_gen += 1  # puts waiting for room try again (meta/hotpath.py)
            if self.on_room is not None:
                self.on_room()
        for pr in promoted or ():
            self.promoter.promoted(srv, pr)
        # The watermark first, so this reply carries the demotions it queues (the
        # server's disk gets its next batch now, not a heartbeat later); the
        # per-reply bounds below cut only what this reply cannot hold.
        self.tiers.check_watermark(srv)
        # Order matters to the server: free, then adopt, then demote.
        out.free, srv.freed = srv.freed, []
        paused = len(srv.adopt_out) >= self.cfg.adopt_outbox
        out.adopt = [
            (o, ns)
            for o, ns in _take(srv.adopt_out, MAX_ADOPT_PER_REPLY)
            if o.state == LIVE and o.tier == 0
        ]
        if paused and len(srv.adopt_out) < self.cfg.adopt_outbox:
            self.members.invalidate()  # drained below the bound: placement resumes
        out.demote = _take(srv.demote_out, MAX_DEMOTE_PER_REPLY)
        out.drop_nvme = _take(srv.drop_out, MAX_DROP_PER_REPLY)
        out.promote = _take(srv.promote_out, MAX_PROMOTE_PER_REPLY)
        # Cut by a per-reply bound: the server asks again at once, so an outbox
        # drains at round-trip speed.
        out.more = bool(srv.adopt_out or srv.demote_out or srv.drop_out or srv.promote_out)
        out.next_beat_s = self.next_beat(srv, since)
        return out

    def next_beat(self, srv: ServerRecord, since: float) -> float:
        """How soon ``srv`` should heartbeat again (``since``: seconds since its last
        one): ``pressure_heartbeat_s`` while its DRAM (allocated, demotions in
        flight included) is past ``demote_watermark`` or would pass it within
        ``PRESSURE_HORIZON_S`` at the rate puts were placed on it since the last
        beat; else 0 (the server's own interval). A put that
        finds DRAM full queues demotions in the server's outbox, and the server
        learns of them at its next heartbeat: at the regular interval that alone
        could outlast the put's wait (``put_wait_s``) and make it drop objects."""
        placed, srv.placed_since_beat = srv.placed_since_beat, 0
        cfg = self.cfg
        if not (cfg.demote and srv.nvme_capacity and cfg.pressure_heartbeat_s > 0):
            return 0.0
        rate = placed / max(since, cfg.pressure_heartbeat_s)  # bytes/s
        watermark = cfg.demote_watermark * srv.allocator.capacity
        if srv.allocator.used + rate * PRESSURE_HORIZON_S >= watermark:
            self.counters["pressure_beats"] += 1
            return cfg.pressure_heartbeat_s
        return 0.0

    def tier_stats(self) -> dict[str, float]:
        live = [s for s in self.members.servers.values() if s.alive]
        return {
            "epoch": self.members.epoch,
            "nvme_capacity": sum(s.nvme_capacity for s in live),
            "nvme_used": sum(s.nvme_bytes for s in live),
            "demotions_in_flight": sum(len(s.demoting) for s in live),
            "promotions_in_flight": sum(len(s.promoting) for s in live),
            "servers_reporting": sum(1 for s in live if not s.ready),
        }
