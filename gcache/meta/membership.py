"""The servers the meta knows: registration, drop (a dead or restarted server takes
its objects with it), the set placement may use, and the heartbeat credit of a
stalled meta. No I/O; ``now`` comes from the caller."""

from __future__ import annotations

from collections import Counter

from gcache import wire
from gcache.config import MetaConfig
from gcache.meta.events import SERVER_LOST
from gcache.meta.evictions import Evictions
from gcache.meta.index import Index
from gcache.meta.records import ServerRecord


class Membership:
    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        index: Index,
        evictions: Evictions,
        epoch: int,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.evictions = evictions
        self.epoch = epoch  # carried by every grant of a server registered here
        self.servers: dict[str, ServerRecord] = {}
        self._live: list[ServerRecord] | None = None  # live servers, rebuilt on change

    def invalidate(self) -> None:
        """A server's eligibility for placement may have changed."""
        self._live = None

    def live_servers(self) -> list[ServerRecord]:
        """Servers new data may go to: alive, their report complete (a server still
        reporting what it holds may hold live data in any range), and their manifest
        outbox below ``adopt_outbox`` (backpressure: a server whose commits are not
        recorded yet takes no new placements until a heartbeat drains it, so every
        commit reaches its manifest)."""
        live = self._live
        if live is None:
            bound = self.cfg.adopt_outbox
            live = self._live = [
                s for s in self.servers.values() if s.alive and s.ready and len(s.adopt_out) < bound
            ]
        return live

    def ready_servers(self) -> list[ServerRecord]:
        """Alive servers with their report complete (placement paused or not)."""
        return [s for s in self.servers.values() if s.alive and s.ready]

    def live_capacity(self) -> int:
        return sum(s.allocator.capacity for s in self.ready_servers())

    def register_server(
        self,
        addr: wire.ServerAddr,
        secret: bytes,
        incarnation: int,
        capacity: int,
        now: float,
        nvme_capacity: int,
        nvme_read_gbps: float,
        nvme_write_gbps: float,
    ) -> tuple[ServerRecord, bool]:
        """Add (or refresh) a server; returns it and whether it is a new record."""
        old = self.servers.get(addr.server_id)
        if old is not None and old.incarnation == incarnation and old.alive:
            old.last_seen = now
            return old, False
        if old is not None:
            self.drop_server(old, reason="re-registered with a new incarnation")
        rec = ServerRecord(addr.server_id, addr, secret, incarnation, capacity, now)
        rec.nvme_capacity = nvme_capacity
        rec.dram_read_gbps = addr.dram_read_gbps
        rec.nvme_read_gbps = nvme_read_gbps or addr.nvme_read_gbps
        rec.nvme_write_gbps = nvme_write_gbps
        rec.grant_epoch = self.epoch
        self.servers[addr.server_id] = rec
        return rec, True

    def drop_server(self, rec: ServerRecord, reason: str) -> None:
        """A server died or restarted: its DRAM is gone, so are its objects (found by
        one vectorised scan of the index's server column)."""
        if not rec.alive:
            return
        rec.alive = False
        self._live = None
        self.counters["servers_dropped"] += 1
        index = self.index
        self.evictions.drop_server_objects(rec, SERVER_LOST)
        if rec.slot >= 0:
            index.store.rows_named(rec.slot, 0)  # its slot goes once no row names it
        rec.demoting.clear()
        rec.adopt_out.clear()
        rec.demote_out.clear()
        rec.promoting.clear()
        rec.promote_out.clear()
        rec.parked.clear()
        if self.servers.get(rec.server_id) is rec:
            del self.servers[rec.server_id]

    def stalled(self, seconds: float) -> None:
        """The meta itself was not listening for ``seconds``: the servers get that
        time as credit, so none is dropped for heartbeats nobody read."""
        for srv in self.servers.values():
            srv.last_seen += seconds
        self.counters["stalls"] += 1
