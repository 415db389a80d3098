"""An allocator's live map: the start of every live range (in alignment units) to
its size (in units), for :class:`~gcache.storage.allocator.SegmentAllocator`.

The meta keeps one allocator per server and a live range per DRAM object, tens
of millions of them in a fleet: a dict of Python ints costs about 75 B a range.
This map is two ``uint32`` arrays in open addressing (11-22 B a range: a slot
is 8 B, the table 4/3-8/3 of the ranges: at most 3/4 full), probed in C
(``gcache._native.INDEX_KERNELS``); without the native kernels
(``GCACHE_NATIVE=0``) it is a dict with the same behaviour. No I/O."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from gcache._native import INDEX_KERNELS

_MIN = 64
_EMPTY = 0
_TOMB = 0xFFFFFFFF
MAX_KEY = 0xFFFFFFFD  # keys are stored + 1; two values are markers


class LiveMap:
    """``unit -> size`` with ``get``, ``put``, ``pop``; bounded only by what is
    put (the table stays at most 3/4 full, removed slots counted)."""

    def __init__(self, native: bool = True) -> None:
        self.k = INDEX_KERNELS if native else None
        self._dict: dict[int, int] | None = None if self.k is not None else {}
        self.keys = np.zeros(_MIN, dtype=np.uint32)
        self.vals = np.zeros(_MIN, dtype=np.uint32)
        self.n = 0
        self.tombs = 0

    def __len__(self) -> int:
        return self.n if self._dict is None else len(self._dict)

    def get(self, unit: int) -> int:
        """The size of the range at ``unit``, or -1."""
        if self._dict is not None:
            return self._dict.get(unit, -1)
        assert self.k is not None
        return int(self.k.live_get(self.keys, self.vals, unit))

    def put(self, unit: int, size: int) -> None:
        if not 0 <= unit <= MAX_KEY:
            raise ValueError(f"live map: unit {unit} out of range")
        if self._dict is not None:
            self._dict[unit] = size
            return
        assert self.k is not None
        if 4 * (self.n + self.tombs + 1) > 3 * self.keys.size:
            self._rehash(max(_MIN, (4 * (self.n + 1)) // 3 + 1))
        got = self.k.live_put(self.keys, self.vals, unit, size)
        if got < 0:  # (the table is never full at this load)
            raise RuntimeError("live map: no free slot")
        if got == 1:
            self.n += 1
            # (an added key may have taken a removed slot: counted once rehashed)

    def pop(self, unit: int) -> int:
        """Remove ``unit``, answering its size, or -1 (not there)."""
        if self._dict is not None:
            return self._dict.pop(unit, -1)
        assert self.k is not None
        got = int(self.k.live_pop(self.keys, self.vals, unit))
        if got >= 0:
            self.n -= 1
            self.tombs += 1
        return got

    def items(self) -> Iterator[tuple[int, int]]:
        """``(unit, size)`` of every range, in no order (tests, rebuilds)."""
        if self._dict is not None:
            return iter(list(self._dict.items()))
        used = (self.keys != _EMPTY) & (self.keys != _TOMB)
        return zip(
            (self.keys[used].astype(np.int64) - 1).tolist(), self.vals[used].tolist(), strict=True
        )

    def arrays(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Every (unit, value) as two arrays, in no order (no tuple per entry)."""
        if self._dict is not None:
            d = self._dict
            return (
                np.fromiter(d.keys(), np.int64, len(d)),
                np.fromiter(d.values(), np.int64, len(d)),
            )
        used = (self.keys != _EMPTY) & (self.keys != _TOMB)
        return self.keys[used].astype(np.int64) - 1, self.vals[used].astype(np.int64)

    def put_many(self, units: np.ndarray, sizes: np.ndarray) -> None:
        """:meth:`put` of many (a rebuilt allocator's ranges)."""
        if self._dict is not None:
            self._dict.update(zip(units.tolist(), sizes.tolist(), strict=True))
            return
        if len(units) and (int(units.min()) < 0 or int(units.max()) > MAX_KEY):
            raise ValueError("live map: unit out of range")
        if 4 * (self.n + self.tombs + len(units)) > 3 * self.keys.size:
            self._rehash(max(_MIN, (4 * (self.n + len(units))) // 3 + 1))
        assert self.k is not None
        self.n += self.k.live_put_many(
            self.keys,
            self.vals,
            np.ascontiguousarray(units, dtype=np.int64),
            np.ascontiguousarray(sizes, dtype=np.int64),
        )

    def get_many(self, units: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """:meth:`get` of each (-1: not there), one C call when built."""
        u = np.ascontiguousarray(units, dtype=np.int64)
        if self._dict is not None:
            d = self._dict
            return np.fromiter((d.get(x, -1) for x in u.tolist()), np.int64, u.size)
        assert self.k is not None
        out = np.empty(u.size, dtype=np.int64)
        self.k.live_get_many(self.keys, self.vals, u, out)
        return out

    def any_of(self, units: npt.ArrayLike) -> bool:
        """Whether any of ``units`` is in the map."""
        return bool((self.get_many(units) >= 0).any())

    def _rehash(self, size: int) -> None:
        """Into a table of at least ``size`` slots (a power of two), without the
        removed slots."""
        slots = _MIN
        while slots < size:
            slots *= 2
        old_k, old_v = self.keys, self.vals
        used = (old_k != _EMPTY) & (old_k != _TOMB)
        self.keys = np.zeros(slots, dtype=np.uint32)
        self.vals = np.zeros(slots, dtype=np.uint32)
        self.tombs = 0
        assert self.k is not None
        self.k.live_put_many(
            self.keys, self.vals, old_k[used].astype(np.int64) - 1, old_v[used].astype(np.int64)
        )

    def nbytes(self) -> int:
        if self._dict is not None:
            return 0  # (a dict: not the fleet's configuration)
        return int(self.keys.nbytes + self.vals.nbytes)
