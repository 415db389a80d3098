"""Belady's rule for the replayer: evict the evictable object whose next use is
farthest in the future. It reads the trace ahead, so it is a reference that shows
the headroom, never a policy for live use.

"Next use" comes from one pass over the trace with an unbounded cache: request
``r`` shares a prefix of ``b_r`` index blocks with earlier requests, so it uses the
full objects of its first ``b_r`` blocks and the windowed objects of the ``tail``
blocks before ``b_r`` (where its match would end). Same rules as every policy: a
full object goes only from a leaf, a leased object never.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from gcache.meta.records import BlockEntry, NamespaceRecord, ObjectRecord
from gcache.replay.trace import Trace

if TYPE_CHECKING:
    from gcache.meta.eviction import Index
    from gcache.meta.handles import Ghost

NEVER = float(1 << 60)


class Oracle:
    """Per block key, the requests that use its full object and its window piece."""

    def __init__(self, trace: Trace, tail: int) -> None:
        self.full: dict[bytes, array[int]] = {}
        self.window: dict[bytes, array[int]] = {}
        self.shared: list[int] = []  # b_r per request
        seen: set[bytes] = set()
        bs = trace.block_size
        for r, (keys, length) in enumerate(zip(trace.keys, trace.lengths, strict=True)):
            limit = min(len(keys), (length - 1) // bs)
            b = 0
            while b < limit and keys[b] in seen:
                b += 1
            self.shared.append(b)
            for k in keys[:b]:
                self.full.setdefault(k, array("i")).append(r)
            for k in keys[max(0, b - tail) : b] if tail else ():
                self.window.setdefault(k, array("i")).append(r)
            seen.update(keys)

    def next_use(self, key: bytes, window: bool, after: int) -> float:
        uses = (self.window if window else self.full).get(key)
        if uses is None:
            return NEVER
        i = bisect_right(uses, after)
        return float(uses[i]) if i < len(uses) else NEVER


class BeladyPolicy:
    """Keys by next use, farthest first (the key is minus the next use; the score
    holds the next use). A key whose predicted use passed without a touch is
    re-keyed when the object comes up as a candidate."""

    name = "belady"
    events = True
    by_access = False

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.clock = -1  # the request being replayed; the runner sets it
        self.ix: Index | None = None
        self.tier = 0
        self.pushes = 0

    def bind(self, ix: Index, tier: int) -> None:
        self.ix, self.tier = ix, tier

    def keys(self, atime: npt.NDArray[np.float64], score: npt.NDArray[Any]) -> Any:
        return -score.astype(np.float64)

    def _push(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        nxt = self.oracle.next_use(obj.entry.key, obj.group != ns.full_group, self.clock)
        obj.score = nxt
        assert self.ix is not None
        self.ix.rekey(np.array([obj.oid], dtype=np.int32))
        self.pushes += 1

    def refresh(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        """Re-key the objects of ``entry`` (a predicted use passed without a touch)."""
        for obj in entry.objects:
            if obj is not None:
                self._push(obj, ns)

    def admit(self, obj: ObjectRecord, ns: NamespaceRecord) -> None:
        self._push(obj, ns)

    def accessed(self, oids: npt.NDArray[np.int32], ns: NamespaceRecord, now: float) -> None:
        assert self.ix is not None
        for oid in oids.tolist():
            self._push(self.ix.obj(oid), ns)

    def became_leaf(self, entry: BlockEntry, ns: NamespaceRecord) -> None:
        self.refresh(entry, ns)

    def evicted(self, obj: Ghost, ns: NamespaceRecord) -> None:
        pass

    def stale(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        if obj.score <= self.clock:  # its predicted use passed unused: re-key
            obj.score = self.oracle.next_use(obj.entry.key, obj.group != ns.full_group, self.clock)
            return True
        return False

    def stats(self) -> dict[str, int]:
        return {"pushes": self.pushes}
