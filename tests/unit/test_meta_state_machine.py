"""Hypothesis stateful test over :class:`MetaCore`: puts, commits, aborts, leased
lookups, releases, evictions, server drops, session ends and time, from two client
sessions, with an injected clock. After every step the index invariants hold, no
two objects share bytes, and no write grant that is still valid covers a byte of a
committed object or of another put's placement (so no committed object can change
bytes through a grant)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gcache import capability, keys, wire
from gcache.config import MetaConfig
from gcache.errors import E_UNKNOWN_PUT, Refusal
from gcache.meta.core import MetaCore
from gcache.meta.records import EVICTED, GONE, LIVE, ObjectRecord
from gcache.meta.session import Session
from tests.unit.test_meta_core import spec
from tests.unit.test_meta_rebuild import assert_heaps_hold_the_evictable

WALL = 1_700_000_000.0
CAP = 192 << 10  # per server: a few prompts, so eviction and no_space happen


@dataclass
class GrantRec:
    """A write grant the meta handed out, as a client holds it."""

    server: str
    incarnation: int
    offset: int
    length: int
    expiry_ms: int
    put_id: int
    placement: int
    consumed: bool = False  # committed with its receipt: the server will not take it again


@dataclass
class PutRec:
    put_id: int
    session: int
    prompt: tuple[int, int]
    placements: list[wire.Placement]
    servers: list[wire.ServerAddr]


def prompt_tokens(branch: int, nblk: int) -> list[int]:
    return [branch * 1009 + t for t in range(4 * nblk)]


class MetaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = MetaCore(
            MetaConfig(
                put_timeout_s=5.0,
                lease_ttl_s=4.0,
                heartbeat_timeout_s=1000.0,
                high_watermark=0.8,
                low_watermark=0.5,
                max_evict_per_put=0.5,
            )
        )
        self.now = 0.0
        self.incarnation = {"s0": 1, "s1": 1}
        for sid in self.incarnation:
            self._register(sid)
        self.fp = self.core.register_namespace({"model": "sm"}, spec()).fingerprint
        self.ns = self.core.namespaces[self.fp]
        self.sessions = [Session("c0"), Session("c1")]
        self.pending: list[PutRec] = []
        self.grants: list[GrantRec] = []
        self.leases: list[tuple[int, int]] = []  # (lease id, session index)

    def _register(self, sid: str) -> None:
        addr = wire.ServerAddr(sid, "127.0.0.1", 9000, "h", "")
        self.core.register_server(addr, sid.encode() * 8, self.incarnation[sid], CAP, self.now)

    def _keys(self, branch: int, nblk: int) -> list[bytes]:
        return keys.block_keys(self.fp, prompt_tokens(branch, nblk), 4)

    # ---- rules -----------------------------------------------------------------

    @rule(s=st.integers(0, 1), branch=st.integers(0, 3), nblk=st.integers(1, 12))
    def put_begin(self, s: int, branch: int, nblk: int) -> None:
        ks = self._keys(branch, nblk)
        req = wire.PutBegin(self.fp, ks, self.ns.layout.groups_to_store(nblk), nblk // 2)
        placed = self.core.put_begin(req, self.now, WALL + self.now, self.sessions[s])
        if not placed.placements:
            assert placed.put_id == 0
            return
        self.pending.append(
            PutRec(placed.put_id, s, (branch, nblk), placed.placements, placed.servers)
        )
        for i, p in enumerate(placed.placements):
            sid = placed.servers[p.server].server_id
            self.grants.append(
                GrantRec(
                    sid,
                    self.incarnation[sid],
                    p.grant.offset,
                    p.grant.length,
                    p.grant.expiry_ms,
                    placed.put_id,
                    i,
                )
            )

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), wrong=st.booleans())
    def put_commit(self, data: st.DataObject, wrong: bool) -> None:
        put = data.draw(st.sampled_from(self.pending))
        n = len(put.placements)
        done_idx = sorted(data.draw(st.sets(st.integers(0, n - 1))))
        forged_idx: set[int] = set()
        layout = self.ns.layout
        done = [(i, bytes(8 * len(layout.group_layers[put.placements[i].group]))) for i in done_idx]
        receipts = []
        for i in done_idx:
            pl = put.placements[i]
            sid = put.servers[pl.server].server_id
            gr = pl.grant
            # The server's receipt; a forged one for a placement never written.
            forged = data.draw(st.booleans()) if i % 3 == 0 else False
            r = capability.receipt(sid.encode() * 8, gr.offset, gr.length, gr.expiry_ms)
            receipts.append(r ^ 1 if forged else r)
            if forged:
                forged_idx.add(i)
        req = wire.PutCommit(put.put_id, done, receipts)
        if wrong:  # another session knows the id: refused, nothing changes
            with pytest.raises(Refusal) as e:
                self.core.put_commit(req, self.now, self.sessions[1 - put.session])
            assert e.value.code == E_UNKNOWN_PUT
            return
        self.core.put_commit(req, self.now, self.sessions[put.session])
        self.pending.remove(put)
        for rec in self.grants:
            if rec.put_id == put.put_id and rec.placement in done_idx:
                # The server returned a receipt: it takes the grant no more. A forged
                # receipt stands for a grant never used: it stays valid (and its
                # range must not be committed or re-used until it expires).
                rec.consumed = rec.placement not in forged_idx

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), wrong=st.booleans())
    def put_abort(self, data: st.DataObject, wrong: bool) -> None:
        put = data.draw(st.sampled_from(self.pending))
        s = 1 - put.session if wrong else put.session
        assert self.core.put_abort(put.put_id, self.sessions[s]) is not wrong
        if not wrong:
            self.pending.remove(put)

    @rule(s=st.integers(0, 1), branch=st.integers(0, 3), nblk=st.integers(1, 12))
    def lookup(self, s: int, branch: int, nblk: int) -> None:
        req = wire.Lookup(self.fp, self._keys(branch, nblk), True)
        res = self.core.lookup(req, self.now, WALL + self.now, self.sessions[s])
        if res.lease_id:
            self.leases.append((res.lease_id, s))

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), wrong=st.booleans())
    def release(self, data: st.DataObject, wrong: bool) -> None:
        lease_id, s = data.draw(st.sampled_from(self.leases))
        held = lease_id in self.core.leases
        ok = self.core.release(lease_id, self.sessions[1 - s if wrong else s])
        assert ok == (held and not wrong)
        if not wrong:
            self.leases.remove((lease_id, s))

    @rule(branch=st.integers(0, 3), nblk=st.integers(1, 12), groups=st.integers(1, 3))
    def evict(self, branch: int, nblk: int, groups: int) -> None:
        self.core.evict_keys(self.fp, self._keys(branch, nblk)[::-1], groups)

    @rule(sid=st.sampled_from(["s0", "s1"]))
    def restart_server(self, sid: str) -> None:
        self.incarnation[sid] += 1
        self._register(sid)  # the old incarnation is dropped with its objects

    @rule(s=st.integers(0, 1))
    def end_session(self, s: int) -> None:
        self.core.end_session(self.sessions[s], self.now)
        self.pending = [p for p in self.pending if p.session != s]
        self.leases = [(i, o) for i, o in self.leases if o != s]
        self.sessions[s] = Session(f"c{s}'")

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0, 6.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.core.tick(self.now)
        self.pending = [p for p in self.pending if p.put_id in self.core.puts]
        self.leases = [(i, s) for i, s in self.leases if i in self.core.leases]

    # ---- invariants ----------------------------------------------------------------

    def _objects(self) -> list[ObjectRecord]:
        return [o for e in self.ns.entries.values() for o in e.objects if o is not None]

    @invariant()
    def eviction_heaps_hold_exactly_the_evictable(self) -> None:
        assert_heaps_hold_the_evictable(self.core.index.cx)

    @invariant()
    def index_counters_match_a_rescan(self) -> None:
        core, ns = self.core, self.ns
        objs = self._objects()
        assert all(o.state == LIVE and o.server.alive for o in objs)
        assert core.live_objects == len(objs)
        assert core.live_bytes == sum(o.length for o in objs)
        assert core.entries == len(ns.entries)
        assert ns.full_holes == sum(1 for e in ns.entries.values() if e.objects[0] is None)
        for e in ns.entries.values():
            assert not (e.children == 0 and e.empty())
        for srv in core.servers.values():
            mine = [o for o in objs if o.server is srv]
            assert srv.objects == len(mine)
            # the scan that finds a dead server's objects finds exactly these
            found = core.index.server_objects(srv).tolist()
            assert sorted(found) == sorted(o.oid for o in mine)

    @invariant()
    def no_two_holders_share_bytes_and_allocators_agree(self) -> None:
        core = self.core
        leased = {id(o): o for lease in core.leases.values() for o in lease.objects}
        for srv in core.servers.values():
            spans: list[tuple[int, int, str]] = []
            for o in self._objects():
                if o.server is srv:
                    spans.append((o.offset, o.length, "object"))
            deferred = 0
            for o in leased.values():
                if o.server is srv and o.state == EVICTED:
                    spans.append((o.offset, o.length, "evicted, leased"))
                    deferred += o.length
                assert o.state != GONE or not o.server.alive or o.server is not srv
            pending = 0
            for put in core.puts.values():
                for _, _, s, off, size in put.placements:
                    if s is srv:
                        spans.append((off, size, "pending"))
                        pending += size
            quarantined = 0
            for _, _, s, off, size in core.quarantine:
                if s is srv:
                    spans.append((off, size, "quarantined"))
                    quarantined += size
            spans.sort()
            for (a, n, what), (b, _, other) in pairwise(spans):
                assert a + n <= b, f"{what} at {a}+{n} overlaps {other} at {b} on {srv.server_id}"
            assert srv.deferred_bytes == deferred
            assert srv.pending_bytes == pending
            assert srv.quarantined_bytes == quarantined
            assert srv.allocator.used == sum(n for _, n, _ in spans)

    @invariant()
    def no_valid_write_grant_covers_committed_or_foreign_bytes(self) -> None:
        core = self.core
        now_ms = (WALL + self.now) * 1000
        self.grants = [g for g in self.grants if g.expiry_ms >= now_ms]  # expired: refused
        for g in self.grants:
            if g.consumed:
                continue
            srv = core.servers.get(g.server)
            if srv is None or srv.incarnation != g.incarnation:
                continue  # a grant of a dead incarnation: its server refuses it
            lo, hi = g.offset, g.offset + g.length
            for o in self._objects():
                if o.server is srv:
                    assert o.offset + o.length <= lo or hi <= o.offset, (
                        f"live write grant of put {g.put_id} covers a committed object"
                    )
            for put in core.puts.values():
                if put.put_id == g.put_id:
                    continue
                for _, _, s, off, size in put.placements:
                    if s is srv:
                        assert off + size <= lo or hi <= off, "grant covers another put's range"


MetaMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_meta_state_machine = MetaMachine.TestCase
