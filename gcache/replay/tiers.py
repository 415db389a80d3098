"""Tiers in the replay: the meta's own demotion code, a server that completes every
demotion at once, and the client's load-or-recompute rule on every match.

**Server side.** The replay registers its one virtual server with an NVMe tier
(``nvme_capacity``, ``nvme_read_gbps``). The meta then does what it does live: at
each commit that takes DRAM past its high watermark, :mod:`gcache.meta.tiers`
demotes the objects worth a disk write (recompute time against the NVMe read time
at the server's bandwidth) and drops the rest, and evicting from NVMe deletes.
:class:`ServerSim` plays the server through the real heartbeat
(``MetaCore.tier_heartbeat``): it takes the reply's ``demote`` list, reports each
object demoted (an NVMe address from a log cursor, as the server's log-structured
tier would) in the next heartbeat, and repeats until nothing is left in flight, so
every demotion completes before the next request (a disk that keeps up; the
replay reports the write bandwidth that takes as ``demote_gbps``). The adopt,
free and drop outboxes are emptied by the same heartbeats, and promotions (NVMe
back to DRAM on repeated hits, ``meta.promotion = "hits:N"``) complete the same way.

**Client side.** :func:`load_plan` applies ``gcache_client.tiers.best_cut`` to the
objects a match reads, at the tiers' read bandwidths and the engine's prefill
FLOP/s, exactly as ``AsyncGCacheClient.match`` does: where fetching the rest of a
match takes longer than recomputing it, the match is cut (with windowed groups
the client looks up the shorter prefix again, whose window must exist).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gcache import wire
from gcache.compute import ModelCompute
from gcache.meta.core import MetaCore
from gcache.meta.records import NamespaceRecord, ObjectRecord, ServerRecord
from gcache.meta.tiers import Demotion, Promotion
from gcache_client.tiers import best_cut

# Heartbeats per drain, at most: each moves up to the meta's per-reply limits
# (4096 demotions, 4096 adopts), so this bounds one drain to ~4M objects.
MAX_HEARTBEATS = 1024


class ServerSim:
    """The replay's server: answers the meta's heartbeat replies at once."""

    def __init__(self, core: MetaCore, srv: ServerRecord) -> None:
        self.core = core
        self.srv = srv
        self.cursor = 0  # next NVMe address (a log that never wraps)
        self.demotions = 0
        self.promotions = 0
        self.heartbeats = 0

    def drain(self, now: float) -> None:
        """Heartbeat until no demotion is in flight and every outbox is empty."""
        srv = self.srv
        core = self.core
        done: list[Demotion] = []
        up: list[Promotion] = []
        for _ in range(MAX_HEARTBEATS):
            out = core.tier_heartbeat(
                srv.server_id, srv.incarnation, {}, now, demoted=done, promoted=up
            )
            self.heartbeats += 1
            done = []
            for obj, _ns in out.demote:
                done.append(Demotion(obj.offset, obj.length, self.cursor, True))
                self.cursor += obj.length
            up = [Promotion(obj.offset, obj.length, off, True) for obj, _ns, off in out.promote]
            self.demotions += len(done)
            self.promotions += len(up)
            busy = done or up or srv.demote_out or srv.adopt_out or srv.drop_out
            if not (busy or srv.demoting or srv.promoting or srv.promote_out):
                return
        if done or up:  # past the bound: report what this round did, the rest waits
            core.tier_heartbeat(srv.server_id, srv.incarnation, {}, now, demoted=done, promoted=up)


@dataclass
class Loaded:
    """What a client loads of a match of ``matched`` blocks."""

    matched: int
    blocks: int  # loaded (``matched`` unless the rule cut it)
    fetch_s: tuple[float, float]  # seconds reading from DRAM, from NVMe
    nvme_flops: float  # prefill FLOPs of the loaded blocks read (partly) from NVMe
    objects: list[ObjectRecord]


def _locs(picked: list[ObjectRecord]) -> list[wire.ObjectLoc]:
    return [
        wire.ObjectLoc(o.entry.pos, o.group, 0, wire.Grant(o.offset, o.length, 0, b"", o.tier), b"")
        for o in picked
    ]


def fetch_seconds(picked: list[ObjectRecord], dram_gbps: float, nvme_gbps: float) -> list[float]:
    """Seconds reading ``picked`` from [DRAM, NVMe] at those bandwidths (0: free)."""
    t = [0.0, 0.0]
    rates = (dram_gbps * 1e9, nvme_gbps * 1e9)
    for o in picked:
        tier = 1 if o.tier else 0
        if rates[tier] > 0:
            t[tier] += o.length / rates[tier]
    return t


def load_plan(
    core: MetaCore,
    ns: NamespaceRecord,
    keys: list[bytes],
    matched: int,
    picked: list[ObjectRecord],
    compute: ModelCompute,
    servers: list[wire.ServerAddr],
    tflops: float,
    now: float,
    cut: bool = True,
) -> Loaded:
    """The client's side of a match of ``matched`` blocks whose reads are ``picked``
    (already touched by the lookup): the rule's cut (a second lookup of the shorter
    prefix where windows are involved, as the client does), then what the loaded
    part costs to fetch and which of its FLOPs came from NVMe."""
    layout = ns.layout
    blocks = matched
    if cut and matched:
        q = best_cut(layout, compute, matched, _locs(picked), servers, tflops)
        if q < matched:
            if q == 0:
                blocks, picked = 0, []
            elif not ns.windowed:
                blocks = q
                picked = [o for o in picked if o.entry.pos < q]
            else:
                blocks = core.match(ns, keys, q)
                picked = core.pick(ns, keys, blocks, now)
    addr = servers[0]
    fetch = fetch_seconds(picked, addr.dram_read_gbps, addr.nvme_read_gbps)
    nvme_flops = 0.0
    if blocks:
        bs = layout.block_size
        span: Callable[[int, int], float] = compute.span
        for j in nvme_positions(picked):
            nvme_flops += span(j * bs, (j + 1) * bs)
    return Loaded(matched, blocks, (fetch[0], fetch[1]), nvme_flops, picked)


def nvme_positions(picked: list[ObjectRecord]) -> set[int]:
    """Blocks of a match that read at least one of their objects (the full object,
    or a window's object near the end) from NVMe."""
    return {o.entry.pos for o in picked if o.tier}
