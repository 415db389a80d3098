"""The meta's removal feed: which blocks left GCache, per namespace, for clients
that publish KV events (a vLLM connector's ``BlockRemoved`` with medium ``GCACHE``).

Plain synchronous code, no I/O; the clock is passed in (``now``). The gRPC
``WatchRemovals`` call (``meta/control.py``) only drives it.

What is a removal: an object that left the index while its block may still be
asked for, i.e. evicted (watermarks, a put making room, an admin ``Evict``, NVMe
evictions), dropped (a server's report overlapping another, lost NVMe objects) or
lost with its server. A finished demotion or promotion moves an object between
tiers of the same server: not a removal (the block is still in GCache).

Bounds:

* a namespace's events are recorded only while it has a subscriber (no cost on the
  eviction path otherwise beyond one dict probe), in one ring of at most
  ``ring`` events shared by its subscribers;
* a subscriber is a cursor into that ring (O(1) memory whatever it lags); one that
  falls more than ``ring`` events behind gets a *gap*: the events it missed are
  gone and it is told so (``Batch.gap``), then resumes at the oldest kept event.
  A subscriber that reads a gap must treat every block it reported as possibly
  removed (the connector reports them removed, see ``gcache_client.engines.kv_events``);
* at most ``max_subscribers`` subscribers in all; one more is refused
  (``FeedFull``). A subscriber belongs to the call (connection) that made it and
  ends with it (:meth:`RemovalFeed.unsubscribe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gcache.errors import GCacheError

# Why an object left (counted per reason, exported as a metric): evicted (any
# policy or admin eviction, NVMe evictions and losses, a report's overlapping
# record) or lost with its server.
EVICTED = "evicted"
SERVER_LOST = "server_lost"


class FeedFull(GCacheError):
    """No room for another subscriber (``meta.max_event_subscribers``)."""


@dataclass(slots=True)
class Batch:
    """What one read returned: ``(key, group)`` removals in order, the cursor to
    read from next, and whether events were lost before them."""

    removed: list[tuple[bytes, int]]
    cursor: int
    gap: bool = False


class _Ring:
    """The last ``cap`` removals of a namespace: removal number ``s`` sits at
    ``buf[s % cap]`` (a list that grows to ``cap``, then is overwritten in turn)."""

    __slots__ = ("buf", "cap", "end", "subscribers")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf: list[tuple[bytes, int]] = []
        self.end = 0  # number of the next removal
        self.subscribers = 0

    @property
    def first(self) -> int:
        return max(0, self.end - self.cap)


@dataclass(slots=True)
class Subscriber:
    sub_id: int
    fp: bytes
    cursor: int
    since: float
    gaps: int = 0
    delivered: int = 0


class RemovalFeed:
    def __init__(self, ring: int = 65536, max_subscribers: int = 256) -> None:
        if ring < 1 or max_subscribers < 0:
            raise ValueError("ring must be >= 1 and max_subscribers >= 0")
        self.ring = ring
        self.max_subscribers = max_subscribers
        self.rings: dict[bytes, _Ring] = {}
        self.subscribers: dict[int, Subscriber] = {}
        self._next_id = 1
        # Called after a removal is recorded (the daemon wakes its subscribers).
        self.on_record: Callable[[], None] | None = None
        # Hot counters as attributes (the eviction path bumps them), the rest here.
        self.recorded = 0
        self.overwritten = 0
        self.server_lost = 0
        self.counters: dict[str, int] = {
            "removals_delivered": 0,
            "subscribers_refused": 0,
            "subscriber_gaps": 0,
        }

    # ---- the meta's side ---------------------------------------------------------------

    def watched(self, fp: bytes) -> bool:
        return fp in self.rings

    def removed(self, fp: bytes, key: bytes, group: int, reason: str = EVICTED) -> None:
        """Object ``group`` of block ``key`` of namespace ``fp`` left GCache."""
        ring = self.rings.get(fp)
        if ring is None:
            return
        buf = ring.buf
        slot = ring.end % ring.cap
        ring.end += 1
        if slot == len(buf):
            buf.append((key, group))
        else:  # the ring is full: the oldest goes
            buf[slot] = (key, group)
            self.overwritten += 1
        self.recorded += 1
        if reason == SERVER_LOST:
            self.server_lost += 1
        if self.on_record is not None:
            self.on_record()

    # ---- subscribers ---------------------------------------------------------------------

    def subscribe(self, fp: bytes, now: float) -> Subscriber:
        """A new subscriber of ``fp``, reading from the next removal on."""
        if len(self.subscribers) >= self.max_subscribers:
            self.counters["subscribers_refused"] += 1
            raise FeedFull(
                f"the meta serves at most {self.max_subscribers} removal subscribers "
                "(meta.max_event_subscribers)"
            )
        ring = self.rings.get(fp)
        if ring is None:
            ring = self.rings[fp] = _Ring(self.ring)
        ring.subscribers += 1
        sub = Subscriber(self._next_id, fp, ring.end, now)
        self._next_id += 1
        self.subscribers[sub.sub_id] = sub
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if self.subscribers.pop(sub.sub_id, None) is None:
            return
        ring = self.rings.get(sub.fp)
        if ring is not None:
            ring.subscribers -= 1
            if ring.subscribers <= 0:
                del self.rings[sub.fp]  # nobody watches: stop recording, free the ring

    def pending(self, sub: Subscriber) -> bool:
        ring = self.rings.get(sub.fp)
        return ring is not None and sub.cursor < ring.end

    def read(self, sub: Subscriber, max_events: int) -> Batch:
        """Up to ``max_events`` removals after ``sub``'s cursor (advancing it); a
        cursor the ring moved past reads as a gap first."""
        ring = self.rings.get(sub.fp)
        if ring is None:
            return Batch([], sub.cursor)
        gap = sub.cursor < ring.first
        if gap:
            sub.cursor = ring.first
            sub.gaps += 1
            self.counters["subscriber_gaps"] += 1
        n = min(max_events, ring.end - sub.cursor)
        buf, at = ring.buf, sub.cursor % ring.cap
        out = buf[at : at + n]
        if len(out) < n:  # wrapped around
            out += buf[: n - len(out)]
        sub.cursor += n
        sub.delivered += n
        self.counters["removals_delivered"] += n
        return Batch(out, sub.cursor, gap)

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "removals_recorded": self.recorded,
            "removals_dropped_from_ring": self.overwritten,
            f"removed_{EVICTED}": self.recorded - self.server_lost,
            f"removed_{SERVER_LOST}": self.server_lost,
            "event_subscribers": len(self.subscribers),
            "event_rings": len(self.rings),
            "event_ring_events": sum(len(r.buf) for r in self.rings.values()),
        }
