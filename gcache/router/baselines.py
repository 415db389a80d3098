"""The routers people run today, as :class:`~gcache.router.policy.Policy` objects,
and :func:`make_policy`, the one factory the daemon and the simulator use.

* ``round-robin``: the next live instance in turn.
* ``least-load``: fewest queued + running requests, then fewest tokens in flight.
* ``sglang``: SGLang's ``cache_aware`` (sgl-model-gateway ``policies/cache_aware.rs``)
  at its *library* defaults: ``cache_threshold`` 0.5, ``balance_abs_threshold`` 32,
  ``balance_rel_threshold`` 1.1. Its load is the count of requests it has routed and
  that are still running (``queued + running``); when ``max - min > abs`` and
  ``max > min * rel`` it picks the least loaded; otherwise the instance whose
  approximate tree matches the most of the request, if the match rate
  (matched / request length) exceeds ``cache_threshold``, else the instance with the
  smallest tree. The trees are built only from the requests it routed (no feedback
  from engines), here over block keys instead of characters, bounded per instance
  (``max_tree_blocks``, oldest-used leaves first).
* ``dynamo``: NVIDIA Dynamo's KV router (``kv_router/scheduler.rs``): per instance
  ``logit = overlap_score_weight * prefill_blocks + decode_blocks`` with
  ``prefill_blocks = (tokens in flight + request tokens - overlap * block_size) /
  block_size`` and ``decode_blocks = active blocks + request blocks``; weight 1,
  temperature 0 (the minimum, ties at random). Its overlap comes from the engines'
  KV events: the leading blocks an instance holds, with no notion of a sliding
  window (a view may offer ``prefix_match``; without it the local match is used).
* ``gcache``: :class:`gcache.router.scoring.GCachePolicy`.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, Protocol, runtime_checkable

from gcache.errors import ConfigError
from gcache.router.policy import ClusterView, Decision, Policy, RouteRequest
from gcache.router.scoring import GCachePolicy, ScoringWeights, weights_from

POLICY_NAMES = ("round-robin", "least-load", "sglang", "dynamo", "gcache")


@runtime_checkable
class PrefixView(Protocol):
    """A view that can also say how many *leading* blocks an instance holds in its
    full-attention group, windows ignored (what a window-unaware tree sees)."""

    def prefix_match(self, instance: str, keys: Sequence[bytes]) -> int: ...


def _pick_min(
    live: Sequence[str], cost: Callable[[str], float], rng: random.Random
) -> tuple[str, float]:
    best: list[str] = []
    best_cost = math.inf
    for inst in live:
        c = cost(inst)
        if c < best_cost:
            best, best_cost = [inst], c
        elif c == best_cost:
            best.append(inst)
    return (best[0] if len(best) == 1 else rng.choice(best)), best_cost


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, req: RouteRequest, view: ClusterView, now: float) -> Decision:
        live = view.live(now)
        inst = live[self.next % len(live)]
        self.next = (self.next + 1) % (1 << 62)
        return Decision(inst, 0, 0, 0.0, "round-robin")

    def routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        return None


class LeastLoadPolicy:
    name = "least-load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)

    def choose(self, req: RouteRequest, view: ClusterView, now: float) -> Decision:
        def cost(inst: str) -> float:
            load = view.load(inst)
            # requests first, tokens in flight as the tie-break (< 1 request)
            return (load.queued + load.running) + load.tokens_in_flight / 1e12

        inst, c = _pick_min(view.live(now), cost, self.rng)
        return Decision(inst, 0, 0, c, "load")

    def routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        return None


class _ApproxTree:
    """One instance's approximate prefix tree, over chained block keys: a key names
    its whole prefix, so the set of keys is the tree. Bounded; leaves used longest
    ago go first (a key is touched leaf-first, so its prefix outlives it)."""

    __slots__ = ("cap", "keys")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):  # leaf first: the root ends up most recent
            if k in self.keys:
                self.keys.move_to_end(k)
            else:
                self.keys[k] = None
        while len(self.keys) > self.cap:
            self.keys.popitem(last=False)


class SGLangPolicy:
    """SGLang's cache_aware router (see the module text)."""

    name = "sglang"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.1,
        max_tree_blocks: int = 1 << 16,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0 or balance_rel_threshold < 1.0:
            raise ConfigError("sglang: cache_threshold in [0, 1], balance_rel_threshold >= 1")
        if balance_abs_threshold < 0 or max_tree_blocks <= 0:
            raise ConfigError("sglang: balance_abs_threshold >= 0, max_tree_blocks > 0")
        self.cache_threshold = cache_threshold
        self.abs = balance_abs_threshold
        self.rel = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self.rng = rng or random.Random(0)
        self.trees: dict[str, _ApproxTree] = {}

    def _tree(self, inst: str) -> _ApproxTree:
        tree = self.trees.get(inst)
        if tree is None:
            tree = self.trees[inst] = _ApproxTree(self.max_tree_blocks)
        return tree

    def choose(self, req: RouteRequest, view: ClusterView, now: float) -> Decision:
        live = view.live(now)
        for gone in [i for i in self.trees if i not in live]:
            del self.trees[gone]
        loads = {i: view.load(i).queued + view.load(i).running for i in live}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.abs and hi > lo * self.rel:
            inst, c = _pick_min(live, lambda i: float(loads[i]), self.rng)
            return Decision(inst, 0, 0, c, "balance")
        n = len(req.keys)
        matches = {i: self._tree(i).match(req.keys) for i in live}
        best, m = _pick_min(live, lambda i: -float(matches[i]), self.rng)
        rate = -m / n if n else 0.0
        if rate > self.cache_threshold:
            return Decision(best, matches[best], 0, rate, "affinity")
        inst, size = _pick_min(live, lambda i: float(len(self._tree(i).keys)), self.rng)
        return Decision(inst, matches[inst], 0, size, "smallest-tree")

    def routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        self._tree(decision.instance).insert(req.keys)


class DynamoPolicy:
    """NVIDIA Dynamo's KV router at weight 1, temperature 0 (see the module text)."""

    name = "dynamo"

    def __init__(
        self,
        block_size: int,
        overlap_score_weight: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        if block_size <= 0 or overlap_score_weight < 0:
            raise ConfigError("dynamo: block_size > 0, overlap_score_weight >= 0")
        self.block_size = block_size
        self.weight = overlap_score_weight
        self.rng = rng or random.Random(0)

    def choose(self, req: RouteRequest, view: ClusterView, now: float) -> Decision:
        bs = self.block_size
        n = len(req.keys)
        req_blocks = -(-req.tokens // bs)
        overlap: dict[str, int] = {}
        match = view.prefix_match if isinstance(view, PrefixView) else view.local_match

        def logit(inst: str) -> float:
            o = overlap[inst] = min(match(inst, req.keys), n) if n else 0
            load = view.load(inst)
            prefill = max(0, load.tokens_in_flight + req.tokens - o * bs) / bs
            decode = load.active_blocks + req_blocks
            return self.weight * prefill + decode

        inst, c = _pick_min(view.live(now), logit, self.rng)
        return Decision(inst, overlap[inst], 0, c, "kv-overlap")

    def routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        return None


def make_policy(name: str, **cfg: Any) -> Policy:
    """A policy by name (:data:`POLICY_NAMES`). ``cfg``: ``block_size`` (tokens a
    key covers; default 64), ``seed`` or ``rng`` (ties), and the policy's own
    settings: :class:`~gcache.router.scoring.ScoringWeights` fields for ``gcache``,
    ``cache_threshold``/``balance_abs_threshold``/``balance_rel_threshold``/
    ``max_tree_blocks`` for ``sglang``, ``overlap_score_weight`` for ``dynamo``.
    Unknown names and settings raise :class:`ConfigError`."""
    cfg = dict(cfg)
    block_size = int(cfg.pop("block_size", 64))
    rng = cfg.pop("rng", None)
    seed = cfg.pop("seed", 0)
    if rng is None:
        rng = random.Random(seed)
    if not isinstance(rng, random.Random):
        raise ConfigError("rng must be a random.Random")
    own: dict[str, tuple[str, ...]] = {
        "round-robin": (),
        "least-load": (),
        "sglang": (
            "cache_threshold",
            "balance_abs_threshold",
            "balance_rel_threshold",
            "max_tree_blocks",
        ),
        "dynamo": ("overlap_score_weight",),
        "gcache": tuple(f.name for f in fields(ScoringWeights)),
    }
    if name not in own:
        raise ConfigError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    extra = sorted(set(cfg) - set(own[name]))
    if extra:
        raise ConfigError(f"policy {name}: unknown setting {extra[0]!r}")
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-load":
        return LeastLoadPolicy(rng)
    if name == "sglang":
        return SGLangPolicy(rng=rng, **cfg)
    if name == "dynamo":
        return DynamoPolicy(block_size, rng=rng, **cfg)
    return GCachePolicy(block_size, weights_from(cfg), rng)
