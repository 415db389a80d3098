"""The metas' election decisions (gcache/meta/election.py), fed directly with a
model of etcd (leases that expire on the same clock, a transaction on the leader
and epoch keys, outages after which etcd renews every lease, as it does): never
two metas serving at once, epochs strictly increasing, and a meta stopped longer
than its lease serves nothing until etcd confirms it."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gcache.errors import ConfigError
from gcache.leader import LeaderRecord, MetaFinder, parse_etcd, parse_redirect, redirect_text
from gcache.meta.election import Election, Role, next_epoch

TTL = 2.0


def rec(meta_id: str, epoch: int) -> LeaderRecord:
    return LeaderRecord(meta_id, f"{meta_id}:1", f"{meta_id}:2", f"{meta_id}:3", epoch)


class FakeEtcd:
    def __init__(self) -> None:
        self.up = True
        self.leader: LeaderRecord | None = None
        self.lease_expiry = 0.0
        self.epoch = 0
        self.down_at = 0.0

    def expire(self, now: float) -> None:
        if self.leader is not None and now >= self.lease_expiry:
            self.leader = None


class ElectionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.wall_ms = 1_000
        self.etcd = FakeEtcd()
        self.metas = [Election("a", TTL), Election("b", TTL)]
        self.epochs_won: list[int] = []

    def step(self, el: Election, delay: float) -> None:
        """One round of the driver (meta/ha.py) for ``el``; the answer takes ``delay``."""
        etcd = self.etcd
        if not etcd.up:
            el.unreachable(self.now)
            return
        etcd.expire(self.now)
        if el.role is Role.STANDBY:
            el.observe(etcd.leader, etcd.epoch, self.now)
            if el.should_campaign(self.now):
                sent = self.now
                epoch = el.campaign_epoch(self.wall_ms)
                if etcd.leader is None and epoch > etcd.epoch:
                    etcd.leader, etcd.epoch = rec(el.meta_id, epoch), epoch
                    etcd.lease_expiry = self.now + TTL
                    self.now += delay
                    el.won(epoch, rec(el.meta_id, epoch), sent, TTL)
                    self.epochs_won.append(epoch)
        elif el.role is Role.LEADER:
            sent = self.now
            alive = etcd.leader is not None and etcd.leader.id == el.meta_id
            if alive:
                etcd.lease_expiry = self.now + TTL  # processed as it arrives
            self.now += delay
            el.refreshed(sent, TTL if alive else 0.0, self.now)
            etcd.expire(self.now)
            if el.role is Role.LEADER:
                el.observe(etcd.leader, etcd.epoch, self.now)

    @rule(i=st.integers(0, 1), delay=st.floats(0, 0.3))
    def tick(self, i: int, delay: float) -> None:
        self.step(self.metas[i], delay)

    @rule(dt=st.floats(0.01, 5.0))
    def time_passes(self, dt: float) -> None:
        """Nobody runs for ``dt`` (the metas may be stopped, SIGSTOP)."""
        self.now += dt
        self.wall_ms += int(dt * 1000)

    @rule(i=st.integers(0, 1), dt=st.floats(0.5, 12.0))
    def one_meta_stalls(self, i: int, dt: float) -> None:
        """Meta ``i`` stops for ``dt`` while the other keeps its rounds."""
        end = self.now + dt
        other = self.metas[1 - i]
        while self.now < end:
            self.now = min(end, self.now + TTL / 6)
            self.step(other, 0.01)
            self.check_one_serves()
        self.metas[i].stalled(self.now, dt)

    @rule()
    def etcd_down(self) -> None:
        if self.etcd.up:
            self.etcd.up = False
            self.etcd.down_at = self.now

    @rule()
    def etcd_back(self) -> None:
        if not self.etcd.up:
            self.etcd.up = True
            # What expired before it went down is gone; etcd's new raft leader
            # gives every other lease a fresh TTL (its lessor's promotion).
            self.etcd.expire(self.etcd.down_at)
            self.etcd.lease_expiry = self.now + TTL

    @rule()
    def wall_clock_steps_back(self) -> None:
        self.wall_ms = max(0, self.wall_ms - 5_000)

    @invariant()
    def check_one_serves(self) -> None:
        serving = [m for m in self.metas if m.may_serve(self.now)]
        assert len(serving) <= 1, [(m.meta_id, m.epoch) for m in serving]

    @invariant()
    def epochs_increase(self) -> None:
        assert self.epochs_won == sorted(set(self.epochs_won))

    @precondition(lambda self: True)
    @invariant()
    def leader_matches_etcd(self) -> None:
        for m in self.metas:
            if m.may_serve(self.now) and not m.degraded:
                # A leader serving on its lease is the one etcd names, same epoch.
                self.etcd.expire(self.now)
                assert self.etcd.leader is not None
                assert (self.etcd.leader.id, self.etcd.leader.epoch) == (m.meta_id, m.epoch)


TestElection = ElectionMachine.TestCase
TestElection.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_stall_longer_than_ttl_stops_serving_until_confirmed() -> None:
    el = Election("a", TTL)
    el.observe(None, 0, 0.0)
    el.won(next_epoch(0, 5), rec("a", 5), 0.0, TTL)
    assert el.may_serve(1.0)
    # Resumed after 10 s: before the ticker or a keep-alive ran, it serves nothing.
    assert not el.may_serve(10.0)
    el.stalled(10.0, 10.0)
    el.unreachable(10.0)  # etcd unreachable after the stall: still not serving
    assert not el.may_serve(10.1)
    el.refreshed(10.1, 0.0, 10.2)  # etcd: the lease is gone
    assert el.role is Role.STEPPING_DOWN and not el.may_serve(10.2)


def test_degraded_serves_while_trying() -> None:
    el = Election("a", TTL)
    el.observe(None, 0, 0.0)
    el.won(7, rec("a", 7), 0.0, TTL)
    for t in (0.5, 1.5, 2.5, 3.5):  # a try every ttl/6 or so, each failing
        el.unreachable(t)
        assert el.degraded and el.may_serve(t + 0.3)
    assert el.may_serve(4.9)
    assert not el.may_serve(9.0)  # no try for longer than the TTL: a stall
    el.unreachable(9.0)
    assert not el.may_serve(9.0)


def test_next_epoch_and_standby_ready() -> None:
    assert next_epoch(10, 5) == 11 and next_epoch(10, 50) == 50
    el = Election("b", TTL)
    assert not el.ready(0.0)
    el.observe(rec("a", 3), 3, 0.0)
    assert el.ready(1.0) and not el.should_campaign(1.0) and not el.may_serve(1.0)
    assert not el.ready(5.0)  # etcd not heard from within a TTL


def test_addresses() -> None:
    t = parse_etcd("meta.etcd", "etcd://h1:2379,h2:2380/gcache/prod")
    assert t.endpoints == (("h1", 2379), ("h2", 2380)) and t.leader_key == b"/gcache/prod/leader"
    for bad in ("etcd://h:1", "http://h:1/x", "etcd:///x", "etcd://h:99999/x", "etcd://h/x"):
        with pytest.raises(ConfigError, match=r"meta\.etcd"):
            parse_etcd("meta.etcd", bad)
    r = rec("a", 1)
    assert LeaderRecord.decode(r.encode()) == r and LeaderRecord.decode(b"{") is None
    assert parse_redirect(redirect_text(r)) == ("a:1", "a:2")
    assert parse_redirect(redirect_text(None)) is None
    f = MetaFinder("h:1,h:2", "h:3,h:4")
    assert f.several and f.candidates == [("h:1", "h:3"), ("h:2", "h:4")]
    f.failed()
    assert f.candidates[f.index % 2] == ("h:2", "h:4")
    f.failed(redirect_text(rec("x", 2)))
    assert f.hint == ("x:1", "x:2")
    assert not MetaFinder("h:1").several
