"""``gcache replay --router``: a fleet of engine instances behind each routing policy,
driven by a request trace, in simulated time.

Each instance has
* its own KV memory (``local_capacity`` bytes, LRU over blocks, leaves first): after
  a prefill it holds the full-attention object of every prompt block and the
  windowed objects of the last window; the windowed objects behind the window are
  *spare*, as in a sliding-window engine (vLLM frees those blocks; they keep their
  hash until reused): they serve matches but are evicted before anything else, so
  a later prompt resumes locally only up to its window-safe length
  (:meth:`Layout.valid_match`), which is often shorter than its leading blocks;
* one prefill at a time, first come first served: a request's hits are decided when
  its prefill starts (local window-safe match, then what the GCache pool serves
  beyond it), and its first token comes after the pool fetch (``fetch_latency_s`` +
  bytes / ``fetch_bandwidth``) and the prefill of the rest (the model's FLOPs with
  the cached prefix, :class:`~gcache.meta.eviction.ModelCompute`, at ``flops`` per
  second);
* decode in the background at ``decode_s_per_token`` a token (continuous batching:
  it holds KV blocks, Dynamo's load, but does not delay prefills).

The pool is one GCache store shared by the fleet (``pool_capacity`` bytes, LRU):
every finished prefill puts its blocks with the strict O(W) masks plus the windows
of the checkpoint rule (:meth:`Layout.checkpoint_positions`), as the client does.
The pool serves every policy alike; what differs is where each policy sends the
requests. Requests arrive at the trace's timestamps divided by ``speedup``.

A policy sees the fleet through :class:`SimView` (the same
:class:`~gcache.router.policy.ClusterView` the daemon offers): load as reported
(queued, running, compute tokens in flight, active KV blocks), each instance's
window-safe local match, its plain leading-block match (``prefix_match``, what a
window-unaware KV-event tree sees) and the pool's window-safe match.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gcache.config import MetaConfig
from gcache.errors import ConfigError
from gcache.layout import Layout, preset
from gcache.meta.eviction import ModelCompute, compute_for_layout
from gcache.replay.trace import Trace
from gcache.router.baselines import POLICY_NAMES, make_policy
from gcache.router.policy import InstanceLoad, RouteRequest

GiB = 1 << 30


@dataclass(frozen=True)
class SimConfig:
    """The fleet and its time model. Defaults: an 8-instance MiMo-V2-Flash fleet."""

    instances: int = 8
    layout: str = "mimo-v2-flash"
    block_size: int = 64
    local_capacity: int = 64 * GiB  # KV bytes each instance keeps for reuse
    pool_capacity: int = 1024 * GiB  # the GCache pool (0: no pool)
    flops: float = 4.0e14  # effective prefill FLOP/s of one instance
    fetch_bandwidth: float = 25e9  # bytes/s from the pool into one instance
    fetch_latency_s: float = 0.002  # per request that reads the pool
    decode_s_per_token: float = 0.02
    speedup: float = 1.0  # arrival times are divided by this
    checkpoint_interval: int = MetaConfig.checkpoint_interval  # tokens (0: off)
    seed: int = 0

    def check(self) -> None:
        if self.instances <= 0:
            raise ConfigError(f"--instances must be > 0, got {self.instances}")
        if self.local_capacity < 0 or self.pool_capacity < 0:
            raise ConfigError("capacities must be >= 0")
        for name in ("flops", "fetch_bandwidth", "speedup"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.fetch_latency_s < 0 or self.decode_s_per_token < 0:
            raise ConfigError("--fetch-latency-s and --decode-s must be >= 0")
        if self.checkpoint_interval < 0:
            raise ConfigError("--checkpoint-interval must be >= 0")


class BlockCache:
    """Block objects by key (a bitmask of groups), LRU by bytes. Keys are touched
    leaf first, so a prefix outlives its extensions.

    ``spare`` objects are what an engine freed but still holds (vLLM frees the
    sliding-window blocks behind the window; they keep their hash until reused):
    they serve matches, and they are evicted before anything else."""

    __slots__ = ("capacity", "evicted", "group_bytes", "objects", "spare", "used")

    def __init__(self, capacity: int, group_bytes: Sequence[int]) -> None:
        self.capacity = capacity
        self.group_bytes = list(group_bytes)
        self.objects: OrderedDict[bytes, int] = OrderedDict()  # key -> groups held
        self.spare: OrderedDict[bytes, int] = OrderedDict()  # key -> groups held as spare
        self.used = 0
        self.evicted = 0

    def _size(self, mask: int) -> int:
        return sum(b for g, b in enumerate(self.group_bytes) if mask >> g & 1)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys whose full-attention object (group 0) is held."""
        objs = self.objects
        n = 0
        for k in keys:
            if not objs.get(k, 0) & 1:
                break
            n += 1
        return n

    def valid(self, layout: Layout, keys: Sequence[bytes], limit: int) -> int:
        """Window-safe match of ``keys[:limit]``."""
        objs = self.objects
        full = self.prefix(keys[:limit])
        return layout.valid_match(full, lambda j, g: bool(objs.get(keys[j], 0) >> g & 1))

    def touch(self, keys: Sequence[bytes]) -> None:
        objs, spare = self.objects, self.spare
        for k in reversed(keys):
            if k in objs:
                objs.move_to_end(k)
                if k in spare:
                    spare.move_to_end(k)

    def add(self, keys: Sequence[bytes], masks: Sequence[int], spares: Sequence[int] = ()) -> None:
        """Hold ``masks[i]`` of ``keys[i]``, and ``spares[i]`` as spare objects."""
        objs, spare = self.objects, self.spare
        spares = spares or [0] * len(keys)
        for k, m, sp in zip(reversed(keys), reversed(masks), reversed(spares), strict=True):
            old = objs.get(k, 0)
            new = (m | sp) & ~old
            if k in objs:
                objs.move_to_end(k)
            objs[k] = old | m | sp
            self.used += self._size(new)
            was = spare.pop(k, 0)
            kept = (was | (sp & new)) & ~m  # spare until a put holds it for real
            if kept:
                spare[k] = kept
        while self.used > self.capacity and objs:
            if spare:
                k, sp = spare.popitem(last=False)
                objs[k] &= ~sp
                if not objs[k]:
                    del objs[k]
            else:
                k, sp = objs.popitem(last=False)
            self.used -= self._size(sp)
            self.evicted += 1


@dataclass
class _Req:
    idx: int
    arrival: float
    tokens: int
    output: int
    keys: list[bytes]
    est_compute: int = 0  # compute tokens estimated when queued (the load it adds)
    start: float = 0.0
    end: float = 0.0


@dataclass
class _Instance:
    name: str
    cache: BlockCache
    queue: deque[_Req] = field(default_factory=deque)
    current: _Req | None = None
    decoding: int = 0
    active_blocks: int = 0
    queued_compute: int = 0
    busy_s: float = 0.0


class SimView:
    """The fleet as a :class:`~gcache.router.policy.ClusterView` at ``now``."""

    def __init__(self, sim: RouterSim) -> None:
        self.sim = sim
        self.names = [i.name for i in sim.instances]
        self.now = 0.0

    def live(self, now: float) -> Sequence[str]:
        return self.names

    def load(self, instance: str) -> InstanceLoad:
        inst = self.sim.by_name[instance]
        cur = inst.current
        in_flight = inst.queued_compute
        if cur is not None and cur.end > cur.start:
            in_flight += round(
                cur.est_compute * max(0.0, cur.end - self.now) / (cur.end - cur.start)
            )
        running = (1 if cur is not None else 0) + inst.decoding
        return InstanceLoad(len(inst.queue), running, in_flight, inst.active_blocks)

    def local_match(self, instance: str, keys: Sequence[bytes]) -> int:
        return self.sim.by_name[instance].cache.valid(self.sim.layout, keys, len(keys))

    def prefix_match(self, instance: str, keys: Sequence[bytes]) -> int:
        return self.sim.by_name[instance].cache.prefix(keys)

    def pool_match(self, keys: Sequence[bytes]) -> int:
        return self.sim.pool.valid(self.sim.layout, keys, len(keys))


class RouterSim:
    """One policy over one trace. :meth:`run` returns the policy's result row."""

    def __init__(self, trace: Trace, policy: str, cfg: SimConfig) -> None:
        cfg.check()
        if trace.block_size != cfg.block_size:
            raise ConfigError("the trace was loaded with another block size")
        self.cfg = cfg
        self.trace = trace
        self.layout = Layout(preset(cfg.layout, cfg.block_size))
        self.compute: ModelCompute = compute_for_layout(self.layout)
        gb = self.layout.group_object_bytes
        self.instances = [
            _Instance(f"i{n}", BlockCache(cfg.local_capacity, gb)) for n in range(cfg.instances)
        ]
        self.by_name = {i.name: i for i in self.instances}
        self.pool = BlockCache(cfg.pool_capacity, gb)
        self.policy = make_policy(policy, block_size=cfg.block_size, seed=cfg.seed)
        self.view = SimView(self)
        self.tail = max((t for t in self.layout.group_tail_blocks if t is not None), default=0)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.ttft: list[float] = []
        self.local_tokens = 0
        self.pool_tokens = 0
        self.last_finish = 0.0
        self.decide_s = 0.0

    # ---- the events -----------------------------------------------------------------

    def _push(self, t: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, data))

    def run(self) -> dict[str, Any]:
        tr, speed = self.trace, self.cfg.speedup
        # kinds: completions (0, 1) before arrivals (2) at the same instant
        for i in range(tr.requests):
            r = _Req(i, tr.times[i] / speed, tr.lengths[i], tr.outputs[i], tr.keys[i])
            self._push(r.arrival, 2, r)
        wall = time.perf_counter()
        while self.events:
            now, kind, _, data = heapq.heappop(self.events)
            if kind == 2:
                self._arrive(now, data)
            elif kind == 0:
                self._prefilled(now, data)
            else:
                inst, r = data
                inst.decoding -= 1
                inst.active_blocks -= self._blocks(r)
                self.last_finish = max(self.last_finish, now)
        return self._row(time.perf_counter() - wall)

    def _blocks(self, r: _Req) -> int:
        return -(-(r.tokens + r.output) // self.cfg.block_size)

    def _usable(self, r: _Req) -> int:
        """Blocks an engine may take from a cache: it computes at least one token."""
        return min(len(r.keys), (r.tokens - 1) // self.cfg.block_size)

    def _hits(self, inst: _Instance, r: _Req) -> tuple[int, int]:
        lim = self._usable(r)
        local = inst.cache.valid(self.layout, r.keys, lim)
        pooled = self.pool.valid(self.layout, r.keys, lim) if self.cfg.pool_capacity else 0
        return local, max(0, pooled - local)

    def _arrive(self, now: float, r: _Req) -> None:
        self.view.now = now
        req = RouteRequest(r.keys, r.tokens, str(r.idx))
        t0 = time.perf_counter()
        d = self.policy.choose(req, self.view, now)
        self.decide_s += time.perf_counter() - t0
        self.policy.routed(req, d, now)
        inst = self.by_name[d.instance]
        local, pooled = self._hits(inst, r)
        r.est_compute = max(1, r.tokens - (local + pooled) * self.cfg.block_size)
        inst.queue.append(r)
        inst.queued_compute += r.est_compute
        if inst.current is None:
            self._start(now, inst)

    def _start(self, now: float, inst: _Instance) -> None:
        r = inst.queue.popleft()
        inst.queued_compute -= r.est_compute
        bs = self.cfg.block_size
        local, pooled = self._hits(inst, r)
        done = local + pooled
        service = self.compute.span(done * bs, r.tokens) / self.cfg.flops
        if pooled:
            nbytes = pooled * self.layout.group_object_bytes[0]
            for g, tail in enumerate(self.layout.group_tail_blocks):
                if tail is not None:
                    window = self.layout.window_blocks(g, pooled)
                    nbytes += len(window) * self.layout.group_object_bytes[g]
            service += self.cfg.fetch_latency_s + nbytes / self.cfg.fetch_bandwidth
            self.pool.touch(r.keys[local:done])
        inst.cache.touch(r.keys[:local])
        self.local_tokens += local * bs
        self.pool_tokens += pooled * bs
        r.est_compute = max(1, r.tokens - done * bs)
        r.start, r.end = now, now + service
        inst.current = r
        inst.busy_s += service
        inst.active_blocks += self._blocks(r)
        self._push(r.end, 0, (inst, r, done))

    def _prefilled(self, now: float, data: tuple[_Instance, _Req, int]) -> None:
        inst, r, done = data
        self.ttft.append(now - r.arrival)
        n = len(r.keys)
        masks = self.layout.groups_to_store(n)
        every = (1 << self.layout.num_groups) - 1
        inst.cache.add(r.keys, masks, [every & ~m for m in masks])
        if self.cfg.pool_capacity:
            interval = self.cfg.checkpoint_interval // self.cfg.block_size
            first = max(0, done - self.tail)
            pos = self.layout.checkpoint_positions(n, done, first, interval, False)
            self.pool.add(r.keys, self.layout.add_windows(masks, pos) if pos else masks)
        inst.current = None
        inst.decoding += 1
        self._push(now + r.output * self.cfg.decode_s_per_token, 1, (inst, r))
        if inst.queue:
            self._start(now, inst)

    # ---- the result -----------------------------------------------------------------

    def _row(self, wall_s: float) -> dict[str, Any]:
        tr = self.trace
        tt = sorted(self.ttft)
        total = max(1, tr.tokens)
        busy = [i.busy_s for i in self.instances]
        mean_busy = sum(busy) / len(busy)
        span = self.last_finish - tr.times[0] / self.cfg.speedup
        return {
            "policy": self.policy.name,
            "instances": self.cfg.instances,
            "requests": len(tt),
            "speedup": self.cfg.speedup,
            "hit_rate": (self.local_tokens + self.pool_tokens) / total,
            "local_hit_rate": self.local_tokens / total,
            "pool_hit_rate": self.pool_tokens / total,
            "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
            "ttft_mean_s": sum(tt) / len(tt),
            "ttft_p50_s": percentile(tt, 0.50),
            "ttft_p99_s": percentile(tt, 0.99),
            "throughput_rps": len(tt) / span if span > 0 else 0.0,
            "decision_us": 1e6 * self.decide_s / max(1, len(tt)),
            "sim_wall_s": wall_s,
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def simulate(
    trace: Trace,
    policies: Sequence[str],
    cfg: SimConfig,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per policy, all on the same trace and fleet."""
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad or not policies:
        raise ConfigError(
            f"unknown routing policy {bad[0] if bad else ''!r}; known: {POLICY_NAMES}"
        )
    cfg.check()
    rows = []
    for name in policies:
        row = RouterSim(trace, name, cfg).run()
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows
