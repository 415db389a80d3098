# One file (over 450 lines): the policies share one interface and one compute model.
"""Eviction policies behind one small interface, and the compute model they use.

What may be evicted: any windowed (``swa``) object on its own (an interior one
becomes a tombstone that still serves longer matches), and a ``full`` object only
on a *leaf* block (no cached descendants), since every longer match needs it. An
object under a live read lease is never a candidate: it is being read, and
dropping it would free nothing until the lease ends. The meta asks a policy for
candidates in the order it prefers, across every server (the meta stops once the
server it needs room on has it); the policy keeps its own bookkeeping current
through the hooks below.

Policies: ``lru`` (the baseline) and ``cost`` (value = expected reuse x recompute
FLOPs / bytes; see ``docs/eviction.md`` for the rule and its measured effect).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from gcache.compute import (  # re-exported: the compute model lives in the shared core
    PRESET_COMPUTE,
    UNIT_COMPUTE,
    ModelCompute,
    compute_for_layout,
)
from gcache.layout import Layout
from gcache.meta.compact import CompactIndex
from gcache.meta.handles import LIVE, BlockEntry, Ghost, ObjectRecord, kids

if TYPE_CHECKING:
    from gcache.meta.records import NamespaceRecord

F64 = npt.NDArray[np.float64]


def evictable(obj: ObjectRecord, ns: NamespaceRecord) -> bool:
    """Live, unleased, and a full object only at a leaf of its tier (see
    :func:`~gcache.meta.handles.kids`: a DRAM block whose children are all on NVMe
    may leave DRAM, by demotion or eviction)."""
    if obj.state != LIVE or obj.pins:
        return False
    if obj.group != ns.full_group:
        return True
    return kids(obj) == 0


class Index(Protocol):
    """What a policy asks of the index that ranks by it (``meta/index.py``)."""

    cx: CompactIndex

    def obj(self, oid: int) -> ObjectRecord: ...

    def rekey(self, oids: npt.NDArray[np.int32]) -> None: ...

    def rekey_all(self) -> None: ...


class EvictionPolicy(Protocol):
    """How a tier ranks its evictable objects. The index keeps the order (a heap
    per tier of the compact index, ``meta/leaves.py``) and which objects are in
    it; a policy says what an object's key is (the smallest goes first) from its
    last access and its score, and, with ``events``, hears what may change a
    score."""

    name: str
    events: bool  # wants the per-object hooks below
    by_access: bool  # the key is the last access alone (a touch sets it without arrays)

    def bind(self, ix: Index, tier: int) -> None:
        """The index (and tier) whose objects it ranks."""

    def keys(self, atime: F64, score: npt.NDArray[Any]) -> F64:
        """Eviction keys of objects last accessed at ``atime`` with ``score``."""
        ...

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """A newly added object (called once every object of the put is added)."""

    def accessed(self, oids: npt.NDArray[np.int32], ns: NamespaceRecord, now: float) -> None:
        """A lookup read these objects at ``now`` (their keys are updated already)."""

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        """``entry`` lost its last child (in a tier): its full object may be a leaf."""

    def evicted(self, obj: Ghost, ns: NamespaceRecord) -> None:
        """An object just left the index (its block is still there)."""

    def stale(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        """A candidate whose key is out of date: re-scored here, True to re-rank
        it instead of evicting it now."""
        ...

    def stats(self) -> dict[str, int]: ...


class LRUPolicy:
    """Least recently used among the evictable objects of the whole store: the key
    is the last access. One order for every server together, so an old prompt
    split across servers ranks by its age, not by where its blocks happen to sit
    (per-server orders would evict a fresh prompt on one server while the old
    one's leaf, elsewhere, kept its interior blocks unevictable)."""

    name = "lru"
    events = False
    by_access = True

    def __init__(self) -> None:
        self.ix: Index | None = None
        self.tier = 0

    def bind(self, ix: Index, tier: int) -> None:
        self.ix, self.tier = ix, tier

    def keys(self, atime: F64, score: npt.NDArray[Any]) -> F64:
        return atime

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        pass

    def accessed(self, oids: npt.NDArray[np.int32], ns: NamespaceRecord, now: float) -> None:
        pass

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        pass

    def evicted(self, obj: Ghost, ns: NamespaceRecord) -> None:
        pass

    def stale(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        heap = self.ix.cx.leaves.heaps[self.tier].size if self.ix is not None else 0
        return {"heap_items": heap}


# ---- the cost policy -------------------------------------------------------------------

# Log value of an object that serves no match as things stand: a window piece whose
# partner is gone, or a leaf block without a window at its end (no match can end
# there, so its full object saves nothing until a later put re-anchors it).
ZERO = -1.0e4
# A window's value is the recompute between it and the previous window on its path;
# the walk back to that window stops after this many blocks.
MAX_WALK = 1024
# Time constant of the reuse decay until the first estimate, and its floor.
TAU_START_S = 60.0
TAU_MIN_S = 0.1
TAU_SAMPLES = 4096  # evictions per estimate of tau
TAU_DRIFT = 1.25  # re-key the heaps when the estimate moves by more than this factor


class _NsCost:
    __slots__ = ("bs", "compute", "fg", "full_bytes", "ref", "window_bytes", "windowed")

    def __init__(self, ns: NamespaceRecord, compute: ModelCompute) -> None:
        layout = ns.layout
        self.bs = layout.block_size
        self.compute = compute
        self.fg = ns.full_group
        self.windowed = ns.windowed
        self.full_bytes = layout.group_object_bytes[self.fg] if self.fg is not None else 0
        self.window_bytes = sum(t * layout.group_object_bytes[g] for g, t in ns.windowed)
        # Scores are relative to a full object at position 0, so they stay near 0.
        first = compute.span(0, self.bs)
        self.ref = math.log(first / (self.full_bytes or self.window_bytes))


class CostPolicy:
    """Evict the object of least value = P(reuse) x recompute FLOPs / bytes.

    * Recompute FLOPs (:class:`ModelCompute`): a leaf's full object saves its block,
      whose attention grows with position; a window saves the tokens between the
      previous window on its path and itself (a match that cannot end there falls
      back to that one), so an end window just after a checkpoint is worth little
      and a checkpoint far from the last one a lot.
    * P(reuse) decays exponentially with the time since the last access
      (AsymCache's decaying reuse probability; Marconi's recency + FLOP
      efficiency), with time constant ``tau`` = the store's characteristic time,
      measured online: the mean time since the last access of the objects it
      evicts (those worth something). It is the time scale on which this store
      can keep anything at all, so a factor e in value buys one such period.

    So log value = score - (now - last_access) / tau with score = log(FLOPs/bytes),
    and ranking by value is ranking by key = last_access + tau x score, which is
    static between accesses: one lazy-deletion heap per server, as for LRU. When the
    ``tau`` estimate drifts by more than 25% every heap is re-keyed (rare, O(n)).
    Objects that serve no match (:data:`ZERO`) go first.
    """

    name = "cost"
    events = True
    by_access = False

    def __init__(
        self,
        compute: Callable[[Layout], ModelCompute] = compute_for_layout,
        tau_s: float | None = None,
    ) -> None:
        """``tau_s`` fixes ``tau`` (tests, experiments) instead of measuring it."""
        self.ix: Index | None = None
        self.tier = 0
        self._now = 0.0  # the latest access seen: the clock, for eviction ages
        self._compute = compute
        self._ns: dict[int, _NsCost] = {}
        self.fixed_tau = tau_s is not None
        self.tau = tau_s if tau_s is not None else TAU_START_S
        self._age_sum = 0.0
        self._age_n = 0
        self.pushes = 0
        self.rekeys = 0

    # -- scoring -------------------------------------------------------------------

    def _cost(self, ns: NamespaceRecord) -> _NsCost:
        nc = self._ns.get(ns.ns_id)
        if nc is None:
            nc = self._ns[ns.ns_id] = _NsCost(ns, self._compute(ns.layout))
        return nc

    @staticmethod
    def _window_ends_at(e: BlockEntry, nc: _NsCost) -> bool:
        """A match may end right after block ``e``: every windowed group is present
        on the ``tail`` blocks up to ``e`` (fewer near the start)."""
        for g, t in nc.windowed:
            x: BlockEntry | None = e
            for _ in range(t):
                if x is None:
                    break
                if x.objects[g] is None:
                    return False
                x = x.parent
        return True

    def _prev_window(self, x: BlockEntry | None, end: int, nc: _NsCost) -> int:
        """Position of the nearest window end at or above block ``x`` (0 at the root):
        where a match falls back to without the window at ``end``."""
        g0 = nc.windowed[0][0]
        for _ in range(MAX_WALK):
            if x is None:
                return 0
            if x.objects[g0] is not None and self._window_ends_at(x, nc):
                return x.pos + 1
            x = x.parent
        return max(0, end - MAX_WALK)

    def _density(self, prev: int, end: int, nbytes: int, nc: _NsCost) -> float:
        value = nc.compute.span(prev * nc.bs, end * nc.bs) / nbytes
        return math.log(max(value, 1e-300)) - nc.ref

    def _segment(self, e: BlockEntry, nc: _NsCost) -> float:
        """Score of the leaf segment ending at leaf ``e`` (anchored): evicting the
        leaf breaks its window, and every block back to the previous window
        follows it (nothing can end a match there), so the segment goes as a
        unit: its recompute over its bytes (full objects and the window)."""
        end = e.pos + 1
        prev = self._prev_window(e.parent, end, nc)
        nbytes = (end - prev) * nc.full_bytes + nc.window_bytes
        return self._density(prev, end, nbytes, nc)

    def _score_full(self, e: BlockEntry, nc: _NsCost) -> float:
        if e.children == 0 and nc.windowed:
            if e.objects[nc.windowed[0][0]] is None or not self._window_ends_at(e, nc):
                return ZERO
            return self._segment(e, nc)
        a = e.pos * nc.bs
        return math.log(nc.compute.span(a, a + nc.bs) / nc.full_bytes) - nc.ref

    def _score_window(self, obj: ObjectRecord, nc: _NsCost) -> float:
        e = obj.entry
        if self._window_ends_at(e, nc):  # the window's last block
            if e.children == 0 and nc.fg is not None:
                return self._segment(e, nc)
            end = e.pos + 1
            bonus = 0.0
        else:  # an earlier block of a window ending below (the entry has no child links)
            end = e.pos + next(t for g, t in nc.windowed if g == obj.group)
            # It goes after the window's last block, so a window is dropped whole.
            bonus = 1e-3
        # An interior window alone: without it a match falls back to the previous one.
        prev = self._prev_window(e.parent, end, nc)
        return self._density(prev, end, nc.window_bytes, nc) + bonus

    # -- keys ------------------------------------------------------------------------

    def bind(self, ix: Index, tier: int) -> None:
        self.ix, self.tier = ix, tier

    def keys(self, atime: F64, score: npt.NDArray[Any]) -> F64:
        return atime + self.tau * score.astype(np.float64)

    def _push(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        """``obj``'s score changed: re-rank it."""
        assert self.ix is not None
        self.ix.rekey(np.array([obj.oid], dtype=np.int32))
        self.pushes += 1

    def _rescore_full(self, e: BlockEntry, ns: NamespaceRecord, nc: _NsCost) -> None:
        if nc.fg is None or not e.alive:
            return
        full = e.objects[nc.fg]
        if full is None or full.state != LIVE or full.pins or kids(full):
            return
        if nc.windowed and e.objects[nc.windowed[0][0]] is None:
            full.score = ZERO  # the common case while a dead branch collapses
        else:
            full.score = self._score_full(e, nc)
        self._push(full, ns)

    # -- hooks -------------------------------------------------------------------------

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        nc = self._cost(ns)
        if obj.last_access > self._now:
            self._now = obj.last_access
        if obj.group == nc.fg:
            if evictable(obj, ns):
                obj.score = self._score_full(obj.entry, nc)
                self._push(obj, ns)
            return
        obj.score = self._score_window(obj, nc)
        self._push(obj, ns)
        if obj.entry.children == 0:  # a window at a leaf anchors its full object
            self._rescore_full(obj.entry, ns, nc)

    def accessed(self, oids: npt.NDArray[np.int32], ns: NamespaceRecord, now: float) -> None:
        if now > self._now:
            self._now = now

    def _update_tau(self) -> None:
        est = max(TAU_MIN_S, self._age_sum / self._age_n)
        self._age_sum = 0.0
        self._age_n = 0
        if not 1 / TAU_DRIFT <= est / self.tau <= TAU_DRIFT:
            self.tau = est
            self.rekeys += 1
            if self.ix is not None:
                self.ix.rekey_all()

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        self._rescore_full(entry, ns, self._ns.get(ns.ns_id) or self._cost(ns))

    def evicted(self, obj: Ghost, ns: NamespaceRecord) -> None:
        nc = self._ns.get(ns.ns_id) or self._cost(ns)
        if not self.fixed_tau and obj.score > ZERO / 2:
            self._age_sum += self._now - obj.last_access
            self._age_n += 1
            if self._age_n >= TAU_SAMPLES:
                self._update_tau()
        if obj.group == nc.fg:
            return  # the whole block goes; the parent hears of it via became_leaf
        e = obj.entry
        if not e.alive:
            return
        if e.children == 0:
            self._rescore_full(e, ns, nc)  # its end window is broken
        parent = e.parent
        if parent is not None and parent.children <= 1:
            piece = parent.objects[obj.group]
            if piece is not None and evictable(piece, ns) and not self._window_ends_at(parent, nc):
                piece.score = ZERO  # half of a window nobody can use
                self._push(piece, ns)

    def stale(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        heap = self.ix.cx.leaves.heaps[self.tier].size if self.ix is not None else 0
        return {
            "heap_items": heap,
            "pushes": self.pushes,
            "rekeys": self.rekeys,
            "tau_ms": int(self.tau * 1000),
        }


__all__ = [
    "PRESET_COMPUTE",
    "UNIT_COMPUTE",
    "CostPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "ModelCompute",
    "compute_for_layout",
    "make_policy",
]

POLICIES = ("lru", "cost")


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "cost":
        return CostPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
