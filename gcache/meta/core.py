"""The meta's state machine, without I/O.

:class:`MetaCore` holds membership, namespaces, the SWA-aware prefix index,
placement (it runs each segment's allocator), pending puts, read leases and
eviction. Every method is synchronous and takes ``now`` (monotonic seconds) so
tests drive time directly; the asyncio layers (:mod:`.hotpath`, :mod:`.control`)
decode requests, call in, and send back what it returns. A refusal is a
:class:`~gcache.errors.Refusal`, which never leaves the state half-changed: every
request is validated completely before anything is modified.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from operator import attrgetter, itemgetter
from typing import Any

from gcache import capability, keys, wire
from gcache.config import GRANT_MARGIN_S, MetaConfig
from gcache.errors import (
    E_BAD_REQUEST,
    E_UNKNOWN_NAMESPACE,
    E_UNKNOWN_PUT,
    LayoutError,
    Refusal,
)
from gcache.layout import Layout, LayoutSpec
from gcache.meta.eviction import EvictionPolicy, make_policy
from gcache.meta.reclaim import IndexStore, present_prefix
from gcache.meta.records import (
    EVICTED,
    GONE,
    LIVE,
    BlockEntry,
    Lease,
    NamespaceRecord,
    ObjectRecord,
    PendingPut,
    Placed,
    Plan,
    ServerRecord,
)

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
    "evictions",
    "evicted_bytes",
    "checkpoints_placed",
    "leases_granted",
    "leases_expired",
    "servers_registered",
    "servers_dropped",
    "refused",
    "protocol_errors",
)
MAX_NAMESPACES = 4096
_OBJECTS = attrgetter("objects")


def _wall_ms(now: float, mono_now: float, at: float) -> int:
    """Unix ms of monotonic instant ``at``."""
    return int((now + (at - mono_now)) * 1000)


class MetaCore(IndexStore):
    def __init__(self, cfg: MetaConfig) -> None:
        self.cfg = cfg
        self.namespaces: dict[bytes, NamespaceRecord] = {}
        self.servers: dict[str, ServerRecord] = {}
        self.puts: dict[int, PendingPut] = {}
        self.leases: dict[int, Lease] = {}
        self.policy: EvictionPolicy = make_policy(cfg.eviction_policy)
        self._put_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._put_heap: list[tuple[float, int]] = []
        self._lease_heap: list[tuple[float, int]] = []
        self.counters: Counter[str] = Counter()
        self.entries = 0
        self.live_objects = 0
        self.live_bytes = 0
        self.group_bytes: Counter[str] = Counter()
        self._live: list[ServerRecord] | None = None  # live servers, rebuilt on change

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
        return ns

    def register_server(
        self, addr: wire.ServerAddr, secret: bytes, incarnation: int, capacity: int, now: float
    ) -> ServerRecord:
        old = self.servers.get(addr.server_id)
        if old is not None and old.incarnation == incarnation and old.alive:
            old.last_seen = now
            return old
        if old is not None:
            self.drop_server(old, reason="re-registered with a new incarnation")
        rec = ServerRecord(addr.server_id, addr, secret, incarnation, capacity, now)
        self.servers[addr.server_id] = rec
        self._live = None
        self.counters["servers_registered"] += 1
        return rec

    def heartbeat(
        self, server_id: str, incarnation: int, counters: dict[str, int], now: float
    ) -> tuple[bool, list[tuple[int, int]]]:
        """Returns (must re-register, ranges freed since the last heartbeat)."""
        rec = self.servers.get(server_id)
        if rec is None or not rec.alive or rec.incarnation != incarnation:
            return True, []
        rec.last_seen = now
        rec.counters = counters
        freed, rec.freed = rec.freed, []
        return False, freed

    def drop_server(self, rec: ServerRecord, reason: str) -> None:
        """A server died or restarted: its DRAM is gone, so are its objects."""
        if not rec.alive:
            return
        rec.alive = False
        self._live = None
        self.counters["servers_dropped"] += 1
        for ns in self.namespaces.values():
            for entry in list(ns.entries.values()):
                for g, obj in enumerate(entry.objects):
                    if obj is not None and obj.server is rec:
                        self._unlink(ns, entry, g)
                        obj.state = GONE
                if entry.key in ns.entries:
                    self._prune(ns, entry)
        if self.servers.get(rec.server_id) is rec:
            del self.servers[rec.server_id]
        self.policy.forget_server(rec)

    # ---- hot path: put ---------------------------------------------------------------

    def _namespace(self, fp: bytes) -> NamespaceRecord:
        ns = self.namespaces.get(fp)
        if ns is None:
            raise Refusal(E_UNKNOWN_NAMESPACE, "unknown namespace (register it first)")
        return ns

    def _check_keys(self, key_list: list[bytes]) -> None:
        n = len(key_list)
        if n > self.cfg.max_keys_per_request:
            raise Refusal(E_BAD_REQUEST, f"{n} keys exceed {self.cfg.max_keys_per_request}")
        # Frames from the wire were checked key by key in the decoder; this one
        # C-speed pass catches in-process callers' wrong sizes.
        if len(b"".join(key_list)) != n * keys.KEY_SIZE:
            bad = next((len(k) for k in key_list if len(k) != keys.KEY_SIZE), 0)
            raise Refusal(E_BAD_REQUEST, f"block keys are {keys.KEY_SIZE} bytes, got {bad}")

    def put_begin(self, req: wire.PutBegin, now: float, wall: float) -> wire.PutPlaced:
        ns = self._namespace(req.namespace)
        self._check_keys(req.keys)
        if len(req.groups) != len(req.keys):
            raise Refusal(E_BAD_REQUEST, "groups must have one bitmask per key")
        allowed = (1 << ns.layout.num_groups) - 1
        if any(m & ~allowed for m in req.groups):
            raise Refusal(E_BAD_REQUEST, f"group bitmask outside {allowed:#x}")
        if not -1 <= req.checkpoint_from <= len(req.keys):
            raise Refusal(E_BAD_REQUEST, f"checkpoint_from {req.checkpoint_from} out of range")
        put_id = next(self._put_ids)
        deadline = now + self.cfg.put_timeout_s
        expiry_ms = _wall_ms(wall, now, deadline - GRANT_MARGIN_S)
        plan = self.place(ns, req.keys, req.groups, now, req.checkpoint_from)
        placed = plan.placements
        if not placed:
            return wire.PutPlaced(put_id=0, placements=[], servers=[], no_space=plan.no_space)
        self.puts[put_id] = PendingPut(put_id, ns, list(req.keys), placed, deadline)
        heapq.heappush(self._put_heap, (deadline, put_id))
        index: dict[str, int] = {}
        servers: list[wire.ServerAddr] = []
        placements = []
        for block, g, srv, off, size in placed:
            si = index.get(srv.server_id)
            if si is None:
                si = index[srv.server_id] = len(servers)
                servers.append(srv.addr)
            tag = capability.mint(srv.secret, capability.KIND_WRITE, off, size, expiry_ms)
            placements.append(wire.Placement(block, g, si, wire.Grant(off, size, expiry_ms, tag)))
        return wire.PutPlaced(put_id, placements, servers, plan.no_space, plan.checkpoints)

    def place(
        self,
        ns: NamespaceRecord,
        key_list: list[bytes],
        masks: list[int],
        now: float,
        checkpoint_from: int = -1,
    ) -> Plan:
        """Plan a put of a validated request: skip stored objects (dedup), add the
        checkpoint windows the meta wants (only on blocks from ``checkpoint_from``,
        the first block whose windowed rows the client holds; -1: none), allocate.
        Used by ``put_begin`` and in-process drivers."""
        entries = ns.entries
        fg = ns.full_group
        branch = 0  # how far the prompt follows blocks with their full object cached
        if fg is not None:
            for key in key_list:
                e = entries.get(key)
                if e is None or e.objects[fg] is None:
                    break
                branch += 1
        checkpoints: list[int] = []
        if checkpoint_from >= 0 and fg is not None:
            checkpoints = self._checkpoints(ns, key_list, branch, checkpoint_from)
            if checkpoints:
                masks = ns.layout.add_windows(masks, checkpoints)
        placed: list[Placed] = []
        start = 0
        if branch and fg is not None and masks[:branch].count(1 << fg) == branch:
            # The cached prefix, offered full objects only: all present, no probe.
            start = branch
        evictions = self.counters["evictions"]
        deduped, no_space = self._place_objects(ns, key_list, masks, start, now, placed)
        deduped += start
        if self.counters["evictions"] != evictions:
            # Making room evicted objects this put had counted as stored: place them.
            again, more = self._place_objects(ns, key_list, masks, 0, now, placed)
            deduped = again
            no_space += more
        self.counters["puts_begun"] += 1
        self.counters["objects_no_space"] += no_space
        self.counters["objects_deduped"] += deduped
        self.counters["checkpoints_placed"] += len(checkpoints)
        return Plan(placed, no_space, checkpoints)

    def _place_objects(
        self,
        ns: NamespaceRecord,
        key_list: list[bytes],
        masks: list[int],
        start: int,
        now: float,
        placed: list[Placed],
    ) -> tuple[int, int]:
        """Allocate every object ``masks`` asks for from block ``start`` that is
        neither stored nor in ``placed`` yet. Returns (already stored, no space)."""
        entries = ns.entries
        sizes = ns.layout.group_object_bytes
        have = {(p[0], p[1]) for p in placed} if placed else None
        deduped = no_space = 0
        live = self._live_servers()
        # One server (the replayer, small deployments): allocate there directly.
        only = live[0] if len(live) == 1 else None
        alloc = only.allocator.alloc if only is not None else None
        for i in range(start, len(key_list)):
            mask = masks[i]
            if not mask:
                continue
            entry = entries.get(key_list[i])
            g = 0
            while mask:
                if mask & 1 and (have is None or (i, g) not in have):
                    if entry is not None and entry.objects[g] is not None:
                        deduped += 1
                    else:
                        size = sizes[g]
                        off = alloc(size) if alloc is not None else None
                        if off is not None and only is not None:
                            placed.append((i, g, only, off, size))
                        else:
                            where = self._allocate(size, now)
                            if where is None:
                                no_space += 1
                            else:
                                placed.append((i, g, where[0], where[1], size))
                mask >>= 1
                g += 1
        return deduped, no_space

    def _checkpoints(
        self, ns: NamespaceRecord, key_list: list[bytes], branch: int, first: int
    ) -> list[int]:
        """:meth:`Layout.checkpoint_positions` for this prompt, dense while the store
        is below its low watermark, less the windows that are complete already."""
        layout = ns.layout
        interval = self.cfg.checkpoint_interval // layout.block_size
        if interval <= 0:
            return []
        dense = self._below_low_watermark()
        entries = ns.entries
        out = []
        for c in layout.checkpoint_positions(len(key_list), branch, first, interval, dense):
            for g, t in ns.windowed:
                if any(
                    (e := entries.get(key_list[j])) is None or e.objects[g] is None
                    for j in range(max(0, c - t), c)
                ):
                    out.append(c)
                    break
        return out

    def _below_low_watermark(self) -> bool:
        used = cap = 0
        for srv in self._live_servers():
            used += srv.reclaimable_used
            cap += srv.allocator.capacity
        return used < self.cfg.low_watermark * cap

    def _live_servers(self) -> list[ServerRecord]:
        live = self._live
        if live is None:
            live = self._live = [s for s in self.servers.values() if s.alive]
        return live

    def _allocate(self, size: int, now: float) -> tuple[ServerRecord, int] | None:
        """Place ``size`` bytes on the live server with the most free space,
        evicting there if nothing fits."""
        live = self._live_servers()
        if not live:
            return None
        best = live[0] if len(live) == 1 else max(live, key=lambda s: s.allocator.free_bytes)
        off = best.allocator.alloc(size)
        if off is not None:
            return best, off
        order = sorted(live, key=lambda s: s.allocator.free_bytes, reverse=True)
        for srv in order:
            off = srv.allocator.alloc(size)
            if off is not None:
                return srv, off
        for srv in order:
            self._evict(srv, need_contiguous=size)
            off = srv.allocator.alloc(size)
            if off is not None:
                return srv, off
        return None

    def put_commit(self, req: wire.PutCommit, now: float) -> int:
        put = self.puts.get(req.put_id)
        if put is None:
            raise Refusal(E_UNKNOWN_PUT, f"unknown or expired put {req.put_id}")
        layout = put.ns.layout
        seen: set[int] = set()
        for pi, sums in req.done:
            if not 0 <= pi < len(put.placements) or pi in seen:
                raise Refusal(E_BAD_REQUEST, f"bad or repeated placement index {pi}")
            seen.add(pi)
            group = put.placements[pi][1]
            want = 8 * len(layout.group_layers[group])
            if len(sums) != want:
                raise Refusal(
                    E_BAD_REQUEST, f"placement {pi}: {len(sums)} checksum bytes, want {want}"
                )
        del self.puts[req.put_id]
        return self.commit(put.ns, put.keys, put.placements, dict(req.done), now)

    def commit(
        self,
        ns: NamespaceRecord,
        key_list: list[bytes],
        placements: list[Placed],
        done: dict[int, bytes] | None,
        now: float,
    ) -> int:
        """Make the placements written (``done``: placement index -> checksums; None:
        all of them, without checksums, for in-process drivers) visible; free the
        rest. Returns the objects committed."""
        layout = ns.layout
        entries = ns.entries
        objs: list[ObjectRecord] = []
        touched: set[ServerRecord] = set()
        added = [0] * layout.num_groups
        last = -1
        entry: BlockEntry | None = None
        last_srv: ServerRecord | None = None
        for pi, (block, g, srv, off, size) in enumerate(placements):
            obj_sums = b"" if done is None else done.get(pi)
            if obj_sums is None or not srv.alive:
                self._free_range(srv, off, size)
                continue
            if block != last or entry is None:  # placements come block by block
                got = entries.get(key_list[block])
                entry = got if got is not None else self._ensure_entry(ns, key_list, block)
                last = block
            if entry.objects[g] is not None:  # a concurrent put committed it first
                self._free_range(srv, off, size)
                self.counters["objects_deduped"] += 1
                continue
            obj = ObjectRecord(entry, g, srv, off, size, obj_sums, now)
            entry.objects[g] = obj
            if g == ns.full_group:
                ns.full_holes -= 1
            srv.objects += 1
            added[g] += size
            objs.append(obj)
            if srv is not last_srv:
                touched.add(srv)
                last_srv = srv
        for g, size in enumerate(added):
            if size:
                self.live_bytes += size
                self.group_bytes[layout.group_names[g]] += size
        # Admit once everything is linked, so the policy sees the final tree.
        admit = self.policy.admit
        for obj in objs:
            admit(obj, ns)
        self.live_objects += len(objs)
        self.counters["puts_committed"] += 1
        self.counters["objects_committed"] += len(objs)
        for srv in touched:
            self._check_watermark(srv)
        return len(objs)

    def put_abort(self, put_id: int) -> bool:
        put = self.puts.pop(put_id, None)
        if put is None:
            return False
        for _, _, srv, off, size in put.placements:
            self._free_range(srv, off, size)
        self.counters["puts_aborted"] += 1
        return True

    # ---- hot path: lookup and leases ---------------------------------------------------

    def lookup(self, req: wire.Lookup, now: float, wall: float) -> wire.LookupResult:
        ns = self._namespace(req.namespace)
        self._check_keys(req.keys)
        layout = ns.layout
        p = self.match(ns, req.keys, len(req.keys))
        if p == 0 or not req.lease:
            return wire.LookupResult(blocks=p, tokens=p * layout.block_size)
        chain = list(map(ns.entries.__getitem__, req.keys[:p]))
        picked = self.pick(ns, chain, p, now)
        lease_id = next(self._lease_ids)
        expiry = now + self.cfg.lease_ttl_s
        expiry_ms = _wall_ms(wall, now, expiry - GRANT_MARGIN_S)
        index: dict[str, int] = {}
        servers: list[wire.ServerAddr] = []
        locs: list[wire.ObjectLoc] = []
        for obj in picked:
            obj.pins += 1
            srv = obj.server
            si = index.get(srv.server_id)
            if si is None:
                si = index[srv.server_id] = len(servers)
                servers.append(srv.addr)
            tag = capability.mint(
                srv.secret, capability.KIND_READ, obj.offset, obj.length, expiry_ms
            )
            grant = wire.Grant(obj.offset, obj.length, expiry_ms, tag)
            locs.append(wire.ObjectLoc(obj.entry.pos, obj.group, si, grant, obj.sums))
        self.leases[lease_id] = Lease(lease_id, ns, picked, expiry)
        heapq.heappush(self._lease_heap, (expiry, lease_id))
        self.counters["leases_granted"] += 1
        return wire.LookupResult(p, p * layout.block_size, lease_id, locs, servers)

    def match(self, ns: NamespaceRecord, key_list: list[bytes], limit: int) -> int:
        """Longest valid match (blocks) among the first ``limit`` keys."""
        entries = ns.entries
        keys_ = key_list[:limit] if limit < len(key_list) else key_list
        n = present_prefix(entries, keys_)
        fg = ns.full_group
        if fg is not None and ns.full_holes and n:
            # Some entry lacks its full object: find the first such on this chain.
            fulls = list(map(itemgetter(fg), map(_OBJECTS, map(entries.__getitem__, keys_[:n]))))
            if None in fulls:
                n = fulls.index(None)
        layout = ns.layout
        p = layout.valid_match(n, lambda j, g: entries[keys_[j]].objects[g] is not None)
        c = self.counters
        c["lookups"] += 1
        c["lookup_blocks"] += limit
        c["hit_blocks"] += p
        c["hit_tokens"] += p * layout.block_size
        return p

    def pick(
        self, ns: NamespaceRecord, chain: list[BlockEntry], p: int, now: float
    ) -> list[ObjectRecord]:
        """The objects a match of ``p`` blocks reads, touched (a reuse) for the policy."""
        picked: list[ObjectRecord] = []
        for g, tail in enumerate(ns.layout.group_tail_blocks):
            lo = 0 if tail is None else max(0, p - tail)
            for j in range(lo, p):
                obj = chain[j].objects[g]
                assert obj is not None
                picked.append(obj)
        touch = self.policy.touch
        for obj in picked:
            age = now - obj.last_access
            obj.last_access = now
            touch(obj, ns, age)
        return picked

    def release(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        for obj in lease.objects:
            obj.pins -= 1
            if obj.pins == 0:
                if obj.state == EVICTED:
                    obj.server.deferred_bytes -= obj.length
                    self._free_object(obj)
                elif obj.state == LIVE:
                    self.policy.unpinned(obj, lease.ns)
        return True

    # ---- eviction ------------------------------------------------------------------------

    def evict_keys(self, fp: bytes, key_list: list[bytes], groups: int) -> tuple[int, int]:
        """Admin eviction of named objects. A full object goes only from a leaf (with
        its whole block); windowed objects may go from any block. Returns
        (evicted, refused)."""
        ns = self._namespace(fp)
        self._check_keys(key_list)
        evicted = refused = 0
        for key in key_list:
            entry = ns.entries.get(key)
            if entry is None:
                continue
            for g in range(ns.layout.num_groups):
                if not groups >> g & 1 or entry.objects[g] is None:
                    continue
                if g == ns.full_group:
                    if entry.children:
                        refused += 1
                        continue
                    for g2 in range(len(entry.objects)):
                        if entry.objects[g2] is not None:
                            self._evict_object(ns, entry, g2)
                            evicted += 1
                    break
                self._evict_object(ns, entry, g)
                evicted += 1
            if key in ns.entries:
                self._prune(ns, entry)
        return evicted, refused

    # ---- time ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Expire leases and abandoned puts, drop silent servers, enforce watermarks."""
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            if self.release(lease_id):
                self.counters["leases_expired"] += 1
        while self._put_heap and self._put_heap[0][0] <= now:
            _, put_id = heapq.heappop(self._put_heap)
            if self.put_abort(put_id):
                self.counters["puts_reclaimed"] += 1
        for srv in list(self.servers.values()):
            if now - srv.last_seen > self.cfg.heartbeat_timeout_s:
                self.drop_server(srv, reason="missed heartbeats")
            else:
                self._check_watermark(srv)

    # ---- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        out.update(self.counters)
        out.update(
            namespaces=len(self.namespaces),
            servers=sum(1 for s in self.servers.values() if s.alive),
            index_entries=self.entries,
            objects=self.live_objects,
            bytes_stored=self.live_bytes,
            pending_puts=len(self.puts),
            active_leases=len(self.leases),
            capacity=sum(s.allocator.capacity for s in self.servers.values()),
            used=sum(s.allocator.used for s in self.servers.values()),
        )
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
