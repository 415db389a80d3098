"""An engine instance's own prefix cache: bounded, LRU, window-safe, no I/O.

What an engine keeps in its own (GPU or host) memory, per block and layout group,
the way vLLM's hybrid allocator does: the full-attention group's KV for every block
of a cached prompt, each sliding-window group's KV only for the last
``ceil((W-1)/block_size)`` blocks before where a match may end (strict O(W), the
same rule as the GCache pool: :meth:`gcache.layout.Layout.groups_to_store`).

* :meth:`LocalPrefixCache.match` is the window-safe match
  (:meth:`~gcache.layout.Layout.valid_match`) over what is held, the same rule the
  router applies to the KV events it receives, so both agree on what is usable.
* :meth:`LocalPrefixCache.insert` adds a prompt's missing entries and evicts the
  least recently used ones past ``capacity`` bytes. It returns what changed, so the
  engine can publish it as KV events (``BlockStored``/``BlockRemoved``).
* Recency: a use touches a prompt's blocks from the last to the first, so the first
  blocks (shared by the most prompts) are evicted last and a chain loses its tail
  before its head.

Entries are opaque payloads (the engine stores per-layer tensors) with their size
given by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gcache.errors import ConfigError
from gcache.layout import Layout


def engine_hash(key: bytes) -> int:
    """The 64-bit block hash the engine publishes for a GCache block key (vLLM sends
    integer hashes by default); a block has the same hash in every group."""
    return int.from_bytes(key[:8], "little")


@dataclass(slots=True)
class Entry:
    payload: Any
    nbytes: int


@dataclass(frozen=True, slots=True)
class Change:
    """Entries stored by an insert (``block`` indices into the prompt's keys, by
    group) and entries evicted (by engine hash, by group)."""

    stored: dict[int, list[int]]  # group -> block indices, ascending
    removed: dict[int, list[int]]  # group -> engine hashes


class LocalPrefixCache:
    def __init__(self, layout: Layout, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"local cache capacity must be > 0 bytes, got {capacity_bytes}")
        if 0 not in layout.group_windows:
            raise ConfigError("local cache: the layout has no full-attention group")
        self.layout = layout
        self.capacity = capacity_bytes
        self.full_group = layout.group_windows.index(0)
        self._entries: OrderedDict[tuple[bytes, int], Entry] = OrderedDict()
        self.used = 0
        self.hits = 0  # matches that found at least one block
        self.misses = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def has(self, key: bytes, group: int) -> bool:
        return (key, group) in self._entries

    def match(self, keys: Sequence[bytes]) -> int:
        """Window-safe blocks of ``keys`` held here (no recency change)."""
        entries = self._entries
        full = 0
        fg = self.full_group
        for k in keys:
            if (k, fg) not in entries:
                break
            full += 1
        return self.layout.valid_match(full, lambda j, g: (keys[j], g) in entries)

    def needed(self, blocks: int) -> list[tuple[int, int]]:
        """``(block, group)`` entries a match of ``blocks`` blocks reads, in model
        order of groups (full group: every block; windowed: the tail)."""
        lay = self.layout
        return [(j, g) for g in range(lay.num_groups) for j in lay.window_blocks(g, blocks)]

    def use(self, keys: Sequence[bytes], blocks: int) -> dict[tuple[int, int], Any]:
        """The payloads a match of ``blocks`` reads, touched (most recent last block
        first, so the head of the chain ends up the most recent)."""
        if blocks:
            self.hits += 1
        else:
            self.misses += 1
        out: dict[tuple[int, int], Any] = {}
        for j, g in sorted(self.needed(blocks), reverse=True):
            key = (keys[j], g)
            self._entries.move_to_end(key)
            out[(j, g)] = self._entries[key].payload
        return out

    def insert(
        self,
        keys: Sequence[bytes],
        blocks: int,
        make: Callable[[int, int], tuple[Any, int]],
    ) -> Change:
        """Hold a prompt's first ``blocks`` blocks (strict O(W) entries): the missing
        ones are made by ``make(block, group) -> (payload, nbytes)``; present ones are
        touched. Then evict past capacity, least recently used first."""
        stored: dict[int, list[int]] = {}
        masks = self.layout.groups_to_store(blocks)
        for j in range(blocks - 1, -1, -1):
            for g in range(self.layout.num_groups):
                if not masks[j] >> g & 1:
                    continue
                key = (keys[j], g)
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    continue
                payload, nbytes = make(j, g)
                self._entries[key] = Entry(payload, nbytes)
                self.used += nbytes
                stored.setdefault(g, []).append(j)
        for g in stored:
            stored[g].reverse()
        return Change(stored, self._evict())

    def _evict(self) -> dict[int, list[int]]:
        removed: dict[int, list[int]] = {}
        while self.used > self.capacity and self._entries:
            (key, g), entry = self._entries.popitem(last=False)
            self.used -= entry.nbytes
            self.evicted += 1
            removed.setdefault(g, []).append(engine_hash(key))
        return removed

    def clear(self) -> int:
        n = len(self._entries)
        self._entries.clear()
        self.used = 0
        return n

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "used_bytes": self.used,
            "capacity_bytes": self.capacity,
            "hits": self.hits,
            "misses": self.misses,
            "evicted": self.evicted,
        }
