"""The router's fleet-wide index of what each engine instance holds in its own memory.

Plain synchronous code, no I/O; the clock is passed in (``now``).

Two views of the same facts, kept in step:

* per instance (:class:`Instance`): its blocks in store order (an ``OrderedDict``
  GCache key -> ``(engine hash, group bitmask)``, oldest first, bounded by
  ``max_blocks``: a store past the bound evicts the oldest entries) and the map
  from the engine's own block hashes to GCache keys (KV events name blocks by the
  engine's hashes);
* fleet-wide, per layout group: GCache key -> bitmask of the instance *slots*
  holding that group's object of the block. A route walks the prompt's keys once,
  ANDing masks, so the full-attention prefix of every instance comes out of one
  pass (one dict probe per block, whatever the number of instances); the
  window-safe end (:meth:`Layout.valid_match`) is then checked per instance that
  matched at all, on the last ``tail`` blocks only.

Sequence numbers: each instance's event batches are numbered (vLLM's ZMQ
publisher counts from 0). :meth:`FleetIndex.check_seq` classifies a batch's
number: the next one is applied; a gap (batches lost, so removals may be lost)
or a restart (numbering back at 0) resets that instance's index before the batch
is applied; an older number (a replay, or a stale publisher) is rejected and
changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from gcache.errors import GCacheError
from gcache.layout import Layout
from gcache.router.policy import InstanceLoad

EngineHash = bytes | int
SeqVerdict = Literal["next", "first", "gap", "restart", "backwards"]

MAX_SLOTS: Final = 1024


class RouterError(GCacheError):
    """A request the router refuses (no live instance, fleet full, bad instance id)."""


@dataclass(slots=True)
class Instance:
    """One engine instance as the router knows it."""

    name: str
    slot: int
    url: str = ""
    load: InstanceLoad = field(default_factory=InstanceLoad)
    last_seen: float = float("-inf")
    seq: int = -1  # number of the last event batch applied (-1: none yet)
    blocks: OrderedDict[bytes, tuple[EngineHash, int]] = field(default_factory=OrderedDict)
    by_engine: dict[EngineHash, bytes] = field(default_factory=dict)
    engine_groups: dict[int, int] = field(default_factory=dict)  # engine group idx -> bitmask
    resets: int = 0
    evicted: int = 0
    reported_prompt_tokens: int = 0
    reported_local_tokens: int = 0
    reported_pool_tokens: int = 0
    # Listed in router.instances: kept while silent (never forgotten), and not live
    # until it has answered a health probe, reported load or sent KV events.
    static: bool = False


class FleetIndex:
    """Instances, their liveness and load, and the blocks each holds (see module)."""

    def __init__(
        self,
        layout: Layout,
        *,
        max_instances: int = 64,
        max_blocks: int = 262144,
        ttl_s: float = 10.0,
        forget_s: float = 600.0,
    ) -> None:
        if not 1 <= max_instances <= MAX_SLOTS:
            raise ValueError(f"max_instances must be in 1..{MAX_SLOTS}")
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.layout = layout
        self.max_instances = max_instances
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self.forget_s = forget_s
        self.all_groups = (1 << layout.num_groups) - 1
        self.full_group = layout.group_windows.index(0) if 0 in layout.group_windows else -1
        # group -> key -> bitmask of instance slots holding that group's object
        self.holders: list[dict[bytes, int]] = [{} for _ in range(layout.num_groups)]
        self._window_blocks = layout.window_blocks  # the window rule (gcache/layout.py)
        self._windowed = [g for g, t in enumerate(layout.group_tail_blocks) if t is not None]
        self.instances: dict[str, Instance] = {}
        self.by_slot: list[Instance | None] = [None] * max_instances
        self.counters: dict[str, int] = {
            "stored_blocks": 0,
            "removed_blocks": 0,
            "evicted_blocks": 0,
            "resets": 0,
            "forgotten": 0,
            "matches": 0,
        }

    # ---- instances ------------------------------------------------------------

    def get(self, name: str) -> Instance | None:
        return self.instances.get(name)

    def register(
        self, name: str, now: float, url: str = "", *, seen: bool = True, static: bool = False
    ) -> Instance:
        """The instance ``name`` (created on first sight); marks it seen at ``now``
        unless ``seen`` is False (a listed instance not heard from yet)."""
        inst = self.instances.get(name)
        if inst is None:
            if not name or len(name) > 256:
                raise RouterError(f"instance id must be 1..256 characters, got {name!r}")
            self.forget_expired(now)
            slot = next((i for i, s in enumerate(self.by_slot) if s is None), -1)
            if slot < 0:
                raise RouterError(
                    f"cannot add instance {name!r}: the router tracks at most "
                    f"{self.max_instances} (router.max_instances)"
                )
            inst = Instance(name=name, slot=slot)
            self.instances[name] = inst
            self.by_slot[slot] = inst
        if url:
            inst.url = url
        inst.static = inst.static or static
        if seen:
            inst.last_seen = max(inst.last_seen, now)
        return inst

    def report_load(self, name: str, load: InstanceLoad, now: float, url: str = "") -> Instance:
        inst = self.register(name, now, url)
        inst.load = load
        return inst

    def report_hits(self, name: str, prompt: int, local: int, pool: int, now: float) -> None:
        inst = self.instances.get(name)
        if inst is None:
            raise RouterError(f"unknown instance {name!r}")
        inst.last_seen = max(inst.last_seen, now)
        inst.reported_prompt_tokens += prompt
        inst.reported_local_tokens += local
        inst.reported_pool_tokens += pool

    def is_live(self, inst: Instance, now: float) -> bool:
        return now - inst.last_seen <= self.ttl_s

    def live(self, now: float) -> list[str]:
        """Instances heard from within ``ttl_s``, in slot order (stable)."""
        return [s.name for s in self.by_slot if s is not None and now - s.last_seen <= self.ttl_s]

    def forget_expired(self, now: float) -> int:
        """Drop instances silent for ``forget_s`` (their index and slot); listed
        (static) instances stay known."""
        gone = [
            i for i in self.instances.values() if not i.static and now - i.last_seen > self.forget_s
        ]
        for inst in gone:
            self.clear(inst)
            del self.instances[inst.name]
            self.by_slot[inst.slot] = None
            self.counters["forgotten"] += 1
        return len(gone)

    # ---- sequence numbers -----------------------------------------------------------

    @staticmethod
    def check_seq(inst: Instance, seq: int) -> SeqVerdict:
        """Classify batch number ``seq`` of ``inst`` (see module text)."""
        if inst.seq < 0:
            return "first"
        if seq == inst.seq + 1:
            return "next"
        if seq == 0:
            return "restart"
        if seq > inst.seq + 1:
            return "gap"
        return "backwards"

    def reset(self, inst: Instance) -> None:
        """Forget everything ``inst`` held (gap, restart, ``AllBlocksCleared``)."""
        self.clear(inst)
        inst.engine_groups.clear()
        inst.resets += 1
        self.counters["resets"] += 1

    # ---- blocks ----------------------------------------------------------------------

    def clear(self, inst: Instance) -> None:
        bit = 1 << inst.slot
        for key, (_, mask) in inst.blocks.items():
            self._drop_bits(key, mask, bit)
        inst.blocks.clear()
        inst.by_engine.clear()

    def _drop_bits(self, key: bytes, mask: int, bit: int) -> None:
        holders = self.holders
        g = 0
        while mask:
            if mask & 1:
                d = holders[g]
                m = d.get(key, 0) & ~bit
                if m:
                    d[key] = m
                else:
                    d.pop(key, None)
            mask >>= 1
            g += 1

    def store(
        self, inst: Instance, hashes: Sequence[EngineHash], keys: Sequence[bytes], mask: int
    ) -> None:
        """``inst`` now holds groups ``mask`` of blocks ``keys`` (engine hashes
        ``hashes``, same order). Refreshes their age; evicts the oldest past
        ``max_blocks``."""
        bit = 1 << inst.slot
        blocks, by_engine, holders = inst.blocks, inst.by_engine, self.holders
        for h, key in zip(hashes, keys, strict=True):
            old = blocks.get(key)
            if old is not None:
                old_hash, old_mask = old
                if old_hash != h:
                    by_engine.pop(old_hash, None)
                new_mask = old_mask | mask
                blocks[key] = (h, new_mask)
                blocks.move_to_end(key)
            else:
                new_mask = mask
                blocks[key] = (h, mask)
            by_engine[h] = key
            m, g = new_mask, 0
            while m:
                if m & 1:
                    d = holders[g]
                    d[key] = d.get(key, 0) | bit
                m >>= 1
                g += 1
        self.counters["stored_blocks"] += len(keys)
        over = len(blocks) - self.max_blocks
        if over > 0:
            for _ in range(over):
                key, (h, m) = blocks.popitem(last=False)
                if by_engine.get(h) == key:
                    del by_engine[h]
                self._drop_bits(key, m, bit)
            inst.evicted += over
            self.counters["evicted_blocks"] += over

    def remove(self, inst: Instance, hashes: Sequence[EngineHash], mask: int) -> int:
        """``inst`` dropped groups ``mask`` of the blocks named by engine ``hashes``;
        hashes it never stored are ignored. Returns blocks affected."""
        bit = 1 << inst.slot
        blocks, by_engine = inst.blocks, inst.by_engine
        done = 0
        for h in hashes:
            key = by_engine.get(h)
            if key is None:
                continue
            _, old = blocks[key]
            left = old & ~mask
            self._drop_bits(key, old & mask, bit)
            if left:
                blocks[key] = (h, left)
            else:
                del blocks[key]
                del by_engine[h]
            done += 1
        self.counters["removed_blocks"] += done
        return done

    # ---- matching --------------------------------------------------------------------

    def match(self, keys: Sequence[bytes], prefix: dict[str, int] | None = None) -> dict[str, int]:
        """Window-safe local match (blocks) of ``keys`` for every instance holding
        at least its first block; instances absent from the result match 0.
        ``prefix``, if given, receives the full-attention prefix of each, windows
        ignored (what a window-unaware router would see)."""
        self.counters["matches"] += 1
        if not keys or self.full_group < 0:
            return {}
        full = self.holders[self.full_group]
        first = full.get(keys[0], 0)
        if not first:
            return {}
        ends: dict[int, int] = {}
        cur = first
        n = len(keys)
        get = full.get
        i = 1
        while i < n:
            m = get(keys[i], 0) & cur
            if m != cur:
                dropped = cur & ~m
                while dropped:
                    low = dropped & -dropped
                    ends[low.bit_length() - 1] = i
                    dropped ^= low
                cur = m
                if not cur:
                    break
            i += 1
        while cur:
            low = cur & -cur
            ends[low.bit_length() - 1] = n
            cur ^= low
        by_slot = self.by_slot
        out: dict[str, int] = {}
        if prefix is not None:
            for slot, end in ends.items():
                inst = by_slot[slot]
                if inst is not None:
                    prefix[inst.name] = end
        if not self._windowed:
            for slot, end in ends.items():
                inst = by_slot[slot]
                if inst is not None:
                    out[inst.name] = end
            return out
        # Window-safe ends, all instances at once: ok[p] = slots holding every
        # windowed group on the last `tail` blocks before p; each instance's end is
        # the largest p <= its full prefix with its bit in ok[p].
        top = max(ends.values())
        ok = self._window_ok(keys, top)
        at: dict[int, int] = {}
        for slot, end in ends.items():
            at[end] = at.get(end, 0) | (1 << slot)
        active = 0
        for p in range(top, 0, -1):
            active |= at.get(p, 0)
            got = ok[p] & active
            if got:
                active ^= got
                while got:
                    low = got & -got
                    inst = by_slot[low.bit_length() - 1]
                    if inst is not None:
                        out[inst.name] = p
                    got ^= low
        return out

    def _window_ok(self, keys: Sequence[bytes], top: int) -> list[int]:
        """``ok[p]`` for p in 0..top: bitmask of slots holding, for every windowed
        group, the objects of the blocks a match ending at p needs
        (``Layout.window_blocks``)."""
        ok = [-1] * (top + 1)
        ok[0] = 0
        window_blocks = self._window_blocks
        for g in self._windowed:
            get = self.holders[g].get
            held = [get(keys[j], 0) for j in range(top)]
            for p in range(1, top + 1):
                m = ok[p]
                for j in window_blocks(g, p):
                    m &= held[j]
                ok[p] = m
        return ok

    def blocks_of(self, name: str) -> int:
        inst = self.instances.get(name)
        return 0 if inst is None else len(inst.blocks)

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "instances": len(self.instances),
            "indexed_blocks": sum(len(i.blocks) for i in self.instances.values()),
            "distinct_keys": len(self.holders[self.full_group]) if self.full_group >= 0 else 0,
        }


class RouteView:
    """The :class:`~gcache.router.policy.ClusterView` of one route: local matches of
    every instance computed in one pass (:meth:`FleetIndex.match`), the pool's match
    looked up beforehand (the meta's hot-path ``Lookup``)."""

    __slots__ = ("index", "matches", "pool", "prefixes")

    def __init__(self, index: FleetIndex, keys: Sequence[bytes], pool_blocks: int = 0) -> None:
        self.index = index
        self.prefixes: dict[str, int] = {}
        self.matches = index.match(keys, self.prefixes)
        self.pool = pool_blocks

    def live(self, now: float) -> list[str]:
        return self.index.live(now)

    def load(self, instance: str) -> InstanceLoad:
        inst = self.index.instances.get(instance)
        return InstanceLoad() if inst is None else inst.load

    def local_match(self, instance: str, keys: Sequence[bytes]) -> int:
        return self.matches.get(instance, 0)

    def pool_match(self, keys: Sequence[bytes]) -> int:
        return self.pool

    def prefix_match(self, instance: str, keys: Sequence[bytes]) -> int:
        """Full-attention prefix held, windows ignored (for window-unaware baselines)."""
        return self.prefixes.get(instance, 0)
