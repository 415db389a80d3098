"""The compact index's key map: 16-byte block keys (two ``uint64`` columns of the
blocks' :class:`~gcache.meta.rowtable.RowTable`, with their namespace id) to block
ids, in an open-addressing table of ``int32`` ids with linear probing. The hash is
the key's first 8 bytes mixed with the namespace (block keys are chained hashes
already). The table stays at most half full, tombstones counted (a rehash makes
it 25-50 % full); a removal leaves a tombstone, and once they pass a quarter of
the table it is rehashed. Probes for
many keys run as one numpy loop (a prompt, a report chunk); ``find1`` probes one
key (a lookup's binary search), in C when the native kernels are built
(``gcache._native.INDEX_KERNELS``), else with scalar reads. No I/O."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from gcache._native import INDEX_KERNELS
from gcache.errors import CompactIndexError
from gcache.meta.rowtable import MIN_ROWS, RowTable

I32 = npt.NDArray[np.int32]
U64 = npt.NDArray[np.uint64]

EMPTY: Final = -1  # a slot never used
TOMB: Final = -2  # a slot whose block was removed
_MIX: Final = 0x9E3779B97F4A7C15


def ns_mix(ns: int) -> int:
    """The namespace's share of a key's hash (equal keys of two namespaces land
    apart)."""
    return (ns * _MIX) & 0xFFFF_FFFF_FFFF_FFFF


def split_keys(keys: list[bytes]) -> tuple[U64, U64]:
    """16-byte keys as two little-endian ``uint64`` columns (one copy, no per-key
    objects)."""
    joined = b"".join(keys)
    if len(joined) != 16 * len(keys) or (keys and set(map(len, keys)) != {16}):
        raise CompactIndexError("block keys must be 16 bytes each")
    pairs = np.frombuffer(joined, dtype="<u8").reshape(-1, 2)
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


class KeyMap:
    def __init__(self, blocks: RowTable, native: bool = True) -> None:
        self.blocks = blocks  # has "k0", "k1" (uint64) and "ns" (uint16) columns
        self.table = np.full(4 * MIN_ROWS, EMPTY, dtype=np.int32)
        self.tombs = 0
        self.kernels = INDEX_KERNELS if native else None

    def find(self, ns: int, k0: U64, k1: U64) -> I32:
        """Block ids of keys (-1: not indexed), one probe loop for all of them (in C
        when built)."""
        if self.kernels is not None:
            found = np.empty(len(k0), dtype=np.int32)
            b = self.blocks.cols
            self.kernels.key_find_cols(
                self.table, b["k0"], b["k1"], b["ns"],
                np.ascontiguousarray(k0, dtype=np.uint64),
                np.ascontiguousarray(k1, dtype=np.uint64), ns, found,
            )  # fmt: skip
            return found
        out = np.full(len(k0), -1, dtype=np.int32)
        b = self.blocks.cols
        bk0, bk1, bns = b["k0"], b["k1"], b["ns"]
        mask = np.uint64(self.table.size - 1)
        h = (k0 ^ np.uint64(ns_mix(ns))) & mask
        active = np.arange(len(k0))
        while active.size:
            t = self.table[h.astype(np.int64)]
            safe = np.where(t >= 0, t, 0)
            hit = (t >= 0) & (bk0[safe] == k0[active]) & (bk1[safe] == k1[active])
            hit &= bns[safe] == ns
            out[active[hit]] = t[hit]
            go_on = ~hit & (t != EMPTY)
            active, h = active[go_on], (h[go_on] + np.uint64(1)) & mask
        return out

    def find_keys(self, ns: int, keys: list[bytes]) -> I32:
        """Block ids of a list of 16-byte keys (-1: not indexed): in C when built
        (no joined copy of the keys), else :meth:`find` of their columns."""
        if self.kernels is None:
            return self.find(ns, *split_keys(keys))
        out = np.empty(len(keys), dtype=np.int32)
        b = self.blocks.cols
        try:
            self.kernels.key_find_list(
                self.table, b["k0"], b["k1"], b["ns"], keys if type(keys) is list else list(keys),
                ns, out,
            )  # fmt: skip
        except ValueError as exc:
            raise CompactIndexError(str(exc)) from exc
        return out

    def find1(self, ns: int, key: bytes) -> int:
        """The block id of one key (-1: not indexed): scalar probes, no arrays."""
        if len(key) != 16:
            raise CompactIndexError(f"block keys are 16 bytes, got {len(key)}")
        if self.kernels is not None:
            b = self.blocks.cols
            return int(self.kernels.key_find1(self.table, b["k0"], b["k1"], b["ns"], key, ns))
        k0 = int.from_bytes(key[:8], "little")
        k1 = int.from_bytes(key[8:16], "little")
        mask = self.table.size - 1
        h = (k0 ^ ns_mix(ns)) & mask
        table, b = self.table, self.blocks.cols
        bk0, bk1, bns = b["k0"], b["k1"], b["ns"]
        while True:
            t = int(table[h])
            if t == EMPTY:
                return -1
            if t >= 0 and int(bk0[t]) == k0 and int(bk1[t]) == k1 and int(bns[t]) == ns:
                return t
            h = (h + 1) & mask

    def leading(self, ns: int, keys: list[bytes], full: int) -> list[int]:
        """The block ids of the leading ``keys`` that are indexed and (``full`` >=
        0) hold an object of group ``full``: a small lookup's match, one C call
        with no array made for it."""
        b = self.blocks.cols
        obj = b["obj"]
        if self.kernels is not None:
            try:
                return self.kernels.key_prefix(  # type: ignore[no-any-return]
                    self.table, b["k0"], b["k1"], b["ns"], obj, obj.shape[1], ns,
                    keys if type(keys) is list else list(keys), full,
                )  # fmt: skip
            except ValueError as exc:
                raise CompactIndexError(str(exc)) from exc
        out = []
        for key in keys:
            bid = self.find1(ns, key)
            if bid < 0 or (full >= 0 and obj[bid, full] < 0):
                break
            out.append(bid)
        return out

    def match(self, ns: int, keys: list[bytes], group: int) -> int:
        """How many leading keys have an object of ``group``, for a group whose
        objects are prefix-closed (the full-attention group: only leaves are
        evicted): a binary search of :meth:`find1` probes. :meth:`prefix` is the
        general (vectorised) form."""
        k = self.kernels
        b = self.blocks.cols  # the blocks' "obj" column: an object id per group
        if k is not None:
            try:
                return int(k.match(
                    self.table, b["k0"], b["k1"], b["ns"], b["obj"], b["obj"].shape[1], ns,
                    keys if type(keys) is list else list(keys), group,
                ))  # fmt: skip
            except ValueError as exc:
                raise CompactIndexError(str(exc)) from exc
        obj = b["obj"]

        def has(i: int) -> bool:
            bid = self.find1(ns, keys[i])
            return bid >= 0 and int(obj[bid, group]) >= 0

        lo, hi = 0, len(keys)
        if hi and has(hi - 1):
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if has(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def prefix(self, ns: int, keys: list[bytes], group: int) -> int:
        """How many leading keys have an object of ``group`` (a lookup's match)."""
        ids = self.find_keys(ns, keys)
        have = ids >= 0
        objs = np.where(have, self.blocks.cols["obj"][np.where(have, ids, 0), group], -1)
        gaps = np.flatnonzero(objs < 0)
        return int(gaps[0]) if gaps.size else len(keys)

    def place(self, ids: I32) -> None:
        """Put block ``ids`` (their keys not in the table) into the table (in C
        when built)."""
        b = self.blocks.cols
        if self.kernels is not None:
            ids = np.ascontiguousarray(ids, dtype=np.int32)
            self.tombs -= self.kernels.key_place(self.table, b["k0"], b["ns"], ids)
            return
        mask = np.uint64(self.table.size - 1)
        ids = ids.copy()
        h = (b["k0"][ids] ^ (b["ns"][ids].astype(np.uint64) * np.uint64(_MIX))) & mask
        while ids.size:
            slot = h.astype(np.int64)
            t = self.table[slot]
            # Several keys may probe the same open slot: the first of each takes it.
            cand = np.flatnonzero(t < 0)
            _, first = np.unique(slot[cand], return_index=True)
            won = cand[first]
            self.tombs -= int(np.count_nonzero(t[won] == TOMB))
            self.table[slot[won]] = ids[won]
            left = np.ones(ids.size, dtype=bool)
            left[won] = False
            ids, h = ids[left], (h[left] + np.uint64(1)) & mask

    def place1(self, bid: int) -> None:
        """:meth:`place` of one block, without arrays."""
        k0v, nsv = self.blocks.views("k0", "ns")
        k0, ns = k0v[bid], nsv[bid]
        table = self.table
        mask = table.size - 1
        h = (k0 ^ ns_mix(ns)) & mask
        while table[h] >= 0:
            h = (h + 1) & mask
        if table[h] == TOMB:
            self.tombs -= 1
        table[h] = bid

    def remove(self, bid: int) -> None:
        """Take block ``bid``'s key out (a tombstone in its slot)."""
        b = self.blocks.cols
        if self.kernels is not None:
            slot = self.kernels.key_slot(self.table, b["k0"], b["ns"], bid)
            if slot < 0:
                raise CompactIndexError(f"block {bid} is not in the key map")
        else:
            mask = self.table.size - 1
            slot = (int(b["k0"][bid]) ^ ns_mix(int(b["ns"][bid]))) & mask
            while self.table[slot] != bid:
                slot = (slot + 1) & mask
        self.table[slot] = TOMB
        self.tombs += 1

    def fit(self, live: int) -> None:
        """Make room for ``live`` keys: keep the table at most half full
        (tombstones counted) and its tombstones under a quarter of it, rehashing
        into a table of at least 2x ``live`` (so 25-50 % full: 8-16 B a key)
        when either would be passed."""
        size = self.table.size
        if 2 * (live + self.tombs) <= size and 4 * self.tombs <= size:
            return
        while size < 2 * live + 2:
            size *= 2
        ids = self.table[self.table >= 0]
        self.table = np.full(size, EMPTY, dtype=np.int32)
        self.tombs = 0
        self.place(ids.astype(np.int32))

    def nbytes(self) -> int:
        return int(self.table.nbytes)
