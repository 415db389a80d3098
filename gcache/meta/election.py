"""Leader election of the metas, as decisions without I/O (``gcache/meta/ha.py``
drives it with etcd; the clock is passed in).

States: ``standby`` (answers every request with a redirect), ``leader`` (serves
while its lease is known valid), ``stepping-down`` (terminal: it lost the lease;
the daemon replaces itself with a fresh process, see ``ha.py``).

Safety rests on three rules:

* A lease is valid until the time the keep-alive that confirmed it was *sent*
  plus the TTL the answer granted, minus a margin: etcd counts from when it got
  the request, later, so the meta stops before etcd could expire the lease and
  let a standby win. The check reads the clock on every request
  (:meth:`Election.may_serve`), so a meta stopped for longer than the TTL
  (SIGSTOP, a VM pause) serves nothing after it resumes until a keep-alive sent
  after the pause is answered, whatever ran first on its event loop.
* Epochs strictly increase: a winner takes ``max(stored + 1, unix ms)``
  (:func:`next_epoch`) and the campaign's transaction requires the stored epoch
  it read, so two winners never share an epoch.
* While etcd cannot be reached at all the leader keeps serving ("degraded"),
  because no other meta can win without etcd either, but only if the failure was
  noticed while its lease was still valid, and only for one TTL after each failed
  try (the driver tries every TTL/3): a meta that paused or stopped trying needs
  etcd's confirmation again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gcache.leader import LeaderRecord

STANDBY = "standby"
LEADER = "leader"
STEPPING_DOWN = "stepping-down"


class Role(enum.Enum):
    STANDBY = STANDBY
    LEADER = LEADER
    STEPPING_DOWN = STEPPING_DOWN


def next_epoch(stored: int, wall_ms: int) -> int:
    """A new leader's epoch: above every earlier one, and unix ms when the clock
    allows (so the epochs of single metas, unix ms of their start, keep meaning)."""
    return max(stored + 1, wall_ms)


@dataclass
class Election:
    meta_id: str
    ttl_s: float
    margin_s: float = -1.0  # default: a quarter of the TTL

    def __post_init__(self) -> None:
        if self.margin_s < 0:
            self.margin_s = self.ttl_s / 4
        self.role = Role.STANDBY
        self.epoch = 0  # the epoch this meta leads with (0: never led)
        self.highest_epoch = 0  # highest epoch seen in etcd
        self.valid_until = float("-inf")  # lease known valid before this (monotonic)
        self.degraded = False  # leader, etcd unreachable: serving on (see above)
        self.degraded_until = float("-inf")  # one TTL after the last failed try
        self.connected_until = float("-inf")  # heard from etcd within a TTL before this
        self.leader: LeaderRecord | None = None  # the leader etcd named last
        self.terms = 0  # times this meta became leader
        self.why = ""  # why it steps down

    # ---- questions -------------------------------------------------------------------

    def may_serve(self, now: float) -> bool:
        return self.role is Role.LEADER and (
            now < self.valid_until or (self.degraded and now < self.degraded_until)
        )

    def stepping_down(self) -> bool:
        return self.role is Role.STEPPING_DOWN

    def connected(self, now: float) -> bool:
        return now < self.connected_until

    def ready(self, now: float) -> bool:
        """``/ready``: a serving leader, or a standby in touch with etcd."""
        if self.role is Role.LEADER:
            return self.may_serve(now)
        return self.role is Role.STANDBY and self.connected(now)

    def should_campaign(self, now: float) -> bool:
        return self.role is Role.STANDBY and self.connected(now) and self.leader is None

    def campaign_epoch(self, wall_ms: int) -> int:
        return next_epoch(self.highest_epoch, wall_ms)

    def keepalive_every(self) -> float:
        return self.ttl_s / 3

    # ---- what etcd said --------------------------------------------------------------

    def observe(self, leader: LeaderRecord | None, stored_epoch: int, now: float) -> None:
        """A read of ``PREFIX/leader`` and ``PREFIX/epoch`` succeeded."""
        self.connected_until = now + self.ttl_s
        self.leader = leader
        self.highest_epoch = max(self.highest_epoch, stored_epoch)
        if leader is not None:
            self.highest_epoch = max(self.highest_epoch, leader.epoch)
        if self.role is Role.LEADER and (
            leader is None or leader.id != self.meta_id or leader.epoch != self.epoch
        ):
            self._step_down(f"etcd names another leader ({leader})")

    def won(self, epoch: int, record: LeaderRecord, sent_at: float, ttl_s: float) -> None:
        """The campaign's transaction succeeded; ``sent_at``: when the lease it
        used was granted (the request sent)."""
        if self.role is not Role.STANDBY or epoch <= self.highest_epoch:
            raise AssertionError(f"won epoch {epoch} as {self.role} (seen {self.highest_epoch})")
        self.role = Role.LEADER
        self.epoch = self.highest_epoch = epoch
        self.leader = record
        self.terms += 1
        self.degraded = False
        self.valid_until = sent_at + min(ttl_s, self.ttl_s) - self.margin_s
        self.connected_until = sent_at + self.ttl_s

    def refreshed(self, sent_at: float, ttl_left: float, now: float) -> None:
        """A keep-alive sent at ``sent_at`` was answered with ``ttl_left`` (<= 0:
        the lease is gone)."""
        self.connected_until = now + self.ttl_s
        if self.role is not Role.LEADER:
            return
        if ttl_left <= 0:
            self._step_down("the lease expired in etcd")
            return
        self.degraded = False
        self.valid_until = max(
            self.valid_until, sent_at + min(ttl_left, self.ttl_s) - self.margin_s
        )

    def unreachable(self, now: float) -> None:
        """An etcd call failed (no answer). Noticed while the lease was valid, or
        within a TTL of the previous failed try: serve on for one more TTL. A
        leader that made no try for longer than a TTL (it was stopped) stops."""
        if self.role is not Role.LEADER:
            return
        if now < self.valid_until or (self.degraded and now < self.degraded_until):
            self.degraded = True
            self.degraded_until = now + self.ttl_s
        else:
            self.degraded = False

    def stalled(self, now: float, late_s: float) -> None:
        """The event loop did not run for ``late_s``: a leader that may have lost
        its lease meanwhile needs etcd's word again before it serves."""
        if late_s + self.margin_s >= self.ttl_s:
            self.degraded = False

    def lost(self, why: str) -> None:
        if self.role is Role.LEADER:
            self._step_down(why)

    def _step_down(self, why: str) -> None:
        self.role = Role.STEPPING_DOWN
        self.degraded = False
        self.valid_until = float("-inf")
        self.why = why

    def stats(self, now: float) -> dict[str, float]:
        return {
            "ha_leader": float(self.role is Role.LEADER),
            "ha_serving": float(self.may_serve(now)),
            "ha_epoch": float(self.epoch),
            "ha_terms": float(self.terms),
            "ha_degraded": float(self.degraded),
            "ha_etcd_connected": float(self.connected(now)),
        }
