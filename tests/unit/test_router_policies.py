"""Routing policies (gcache.router.scoring, gcache.router.baselines) on a plain
in-memory cluster view: the decisions each policy must make."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gcache.errors import ConfigError
from gcache.router.baselines import POLICY_NAMES, make_policy
from gcache.router.policy import InstanceLoad, Policy, RouteRequest
from gcache.router.scoring import GCachePolicy, ScoringWeights

BS = 64


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [((tag << 32) | i).to_bytes(16, "little") for i in range(n)]


@dataclass
class View:
    """Local matches given per instance: window-safe (``safe``) and naive
    (``prefix``, what a window-unaware tree sees)."""

    instances: list[str]
    loads: dict[str, InstanceLoad] = field(default_factory=dict)
    safe: dict[str, int] = field(default_factory=dict)
    prefix: dict[str, int] = field(default_factory=dict)
    pool: int = 0

    def live(self, now: float) -> Sequence[str]:
        return self.instances

    def load(self, instance: str) -> InstanceLoad:
        return self.loads.get(instance, InstanceLoad())

    def local_match(self, instance: str, keys: Sequence[bytes]) -> int:
        return self.safe.get(instance, 0)

    def prefix_match(self, instance: str, keys: Sequence[bytes]) -> int:
        return self.prefix.get(instance, self.safe.get(instance, 0))

    def pool_match(self, keys: Sequence[bytes]) -> int:
        return self.pool


def req(nblocks: int) -> RouteRequest:
    return RouteRequest(keys(nblocks), nblocks * BS + 10)


def test_gcache_prefers_the_local_window_safe_match() -> None:
    view = View(["a", "b", "c"], safe={"b": 40}, prefix={"a": 100, "b": 40})
    d = make_policy("gcache").choose(req(100), view, 0.0)
    assert (d.instance, d.local_blocks, d.reason) == ("b", 40, "affinity")
    # Dynamo counts a's 100 leading full-attention blocks, which it cannot resume from
    assert make_policy("dynamo").choose(req(100), view, 0.0).instance == "a"


def test_gcache_credits_the_pool_but_prefers_local() -> None:
    # pool serves 80 blocks anywhere; b holds 60 itself: b saves 60 fetches
    view = View(["a", "b"], safe={"b": 60}, pool=80)
    d = make_policy("gcache").choose(req(100), view, 0.0)
    assert (d.instance, d.local_blocks, d.pool_blocks) == ("b", 60, 20)
    # a pool hit is cheaper than compute: a short queue on b loses to a's pool fetch
    w = ScoringWeights()
    queue = int(60 * BS * (1 - w.pool_token_cost)) + 500
    view.loads["b"] = InstanceLoad(tokens_in_flight=queue)
    d = make_policy("gcache").choose(req(100), view, 0.0)
    assert (d.instance, d.pool_blocks, d.reason) == ("a", 80, "pool")


def test_gcache_load_outweighs_a_small_hit() -> None:
    view = View(["a", "b"], safe={"a": 10}, loads={"a": InstanceLoad(1, 1, 20_000, 300)})
    d = make_policy("gcache").choose(req(100), view, 0.0)
    assert d.instance == "b" and d.reason == "load"


def test_gcache_guard_passes_over_a_flooded_full_hit() -> None:
    # a holds the whole prompt, but its queue is past the guard: flood_rel x 0 + abs
    w = ScoringWeights(flood_abs_tokens=1000.0, load_weight=0.001)
    view = View(["a", "b"], safe={"a": 100}, loads={"a": InstanceLoad(3, 1, 2_000_000, 10)})
    pol = GCachePolicy(BS, w, random.Random(1))
    d = pol.choose(req(100), view, 0.0)
    assert d.instance == "b" and d.reason == "guard" and pol.stats()["guarded"] == 1
    # without the guard the cheap load weight would have flooded a
    loose = GCachePolicy(BS, ScoringWeights(flood_abs_tokens=1e12, load_weight=0.001))
    assert loose.choose(req(100), view, 0.0).instance == "a"


def test_gcache_guard_max_queued() -> None:
    w = ScoringWeights(max_queued=4)
    view = View(["a", "b"], safe={"a": 100}, loads={"a": InstanceLoad(queued=4)})
    assert GCachePolicy(BS, w).choose(req(100), view, 0.0).instance == "b"
    # everyone flooded: the least loaded takes it
    view.loads["b"] = InstanceLoad(queued=9)
    assert GCachePolicy(BS, w).choose(req(100), view, 0.0).instance == "a"


def test_gcache_ties_are_random_and_seeded() -> None:
    view = View(["a", "b", "c", "d"])
    pol = make_policy("gcache", seed=7)
    seq = [pol.choose(req(10), view, 0.0).instance for _ in range(400)]
    again = make_policy("gcache", seed=7)
    assert seq == [again.choose(req(10), view, 0.0).instance for _ in range(400)]
    picks = Counter(seq)
    assert set(picks) == {"a", "b", "c", "d"} and min(picks.values()) > 60


def test_weights_are_checked() -> None:
    with pytest.raises(ConfigError, match="pool_token_cost"):
        make_policy("gcache", pool_token_cost=2.0)
    with pytest.raises(ConfigError, match="load_weight"):
        make_policy("gcache", load_weight=0)
    with pytest.raises(ConfigError, match="not a number"):
        make_policy("gcache", flood_rel="many")
    with pytest.raises(ConfigError, match="unknown setting"):
        make_policy("gcache", cache_threshold=0.5)
    with pytest.raises(ConfigError, match="unknown routing policy"):
        make_policy("random")
    assert make_policy("gcache", flood_rel="3").weights.flood_rel == 3.0  # type: ignore[attr-defined]


def test_every_name_builds_and_routes() -> None:
    view = View(["a", "b"])
    for name in POLICY_NAMES:
        pol: Policy = make_policy(name, block_size=BS, seed=1)
        assert pol.name == name
        d = pol.choose(req(4), view, 0.0)
        assert d.instance in ("a", "b")
        pol.routed(req(4), d, 0.0)


def test_round_robin_cycles() -> None:
    pol = make_policy("round-robin")
    view = View(["a", "b", "c"])
    assert [pol.choose(req(1), view, 0.0).instance for _ in range(6)] == list("abcabc")


def test_least_load_requests_then_tokens() -> None:
    view = View(
        ["a", "b", "c"],
        loads={"a": InstanceLoad(1, 1), "b": InstanceLoad(0, 1, 900), "c": InstanceLoad(0, 1, 10)},
    )
    assert make_policy("least-load").choose(req(1), view, 0.0).instance == "c"


def test_sglang_tree_from_routed_requests_only() -> None:
    pol = make_policy("sglang", seed=3)
    view = View(["a", "b"], safe={"b": 100})  # the engines' real caches: ignored
    r = req(100)
    first = pol.choose(r, view, 0.0)
    assert first.reason == "smallest-tree"
    pol.routed(r, first, 0.0)
    again = pol.choose(r, view, 0.0)
    assert (again.instance, again.reason) == (first.instance, "affinity")
    # a request sharing less than cache_threshold (0.5) goes to the smallest tree
    half = RouteRequest([*r.keys[:40], *keys(60, tag=9)], 100 * BS)
    other = pol.choose(half, view, 0.0)
    assert other.instance != first.instance and other.reason == "smallest-tree"


def test_sglang_balance_thresholds_are_the_library_defaults() -> None:
    pol = make_policy("sglang")
    r = req(10)
    d = pol.choose(r, View(["a", "b"]), 0.0)
    pol.routed(r, d, 0.0)
    owner, other = d.instance, ("b" if d.instance == "a" else "a")
    # 33 - 0 > 32 and 33 > 0 * 1.1: imbalanced, least loaded despite the match
    loads = {owner: InstanceLoad(queued=33)}
    assert pol.choose(r, View(["a", "b"], loads=loads), 0.0).reason == "balance"
    # 32 - 0 is not > 32: balanced, the tree match wins
    loads = {owner: InstanceLoad(queued=32)}
    assert pol.choose(r, View(["a", "b"], loads=loads), 0.0).instance == owner
    # 40 vs 37: abs 3 <= 32, balanced; 100 vs 60: 40 > 32 and 100 > 66: imbalanced
    loads = {owner: InstanceLoad(queued=100), other: InstanceLoad(queued=60)}
    assert pol.choose(r, View(["a", "b"], loads=loads), 0.0).instance == other


def test_dynamo_cost_is_prefill_plus_decode_blocks() -> None:
    pol = make_policy("dynamo", block_size=BS)
    # a: 50 blocks overlap but 60 active decode blocks; b: none, idle
    view = View(["a", "b"], prefix={"a": 50}, loads={"a": InstanceLoad(active_blocks=60)})
    d = pol.choose(req(100), view, 0.0)
    # a: (100*64+10-50*64)/64 + 60 + 101 = 211.16; b: 100.16 + 101 = 201.16
    assert d.instance == "b" and d.cost == pytest.approx((100 * BS + 10) / BS + 101)
    view.loads["a"] = InstanceLoad(active_blocks=40)
    assert pol.choose(req(100), view, 0.0).instance == "a"


def test_sglang_trees_are_bounded_and_forget_gone_instances() -> None:
    pol = make_policy("sglang", max_tree_blocks=50)
    view = View(["a", "b"])
    for tag in range(10):
        r = RouteRequest(keys(30, tag=tag), 30 * BS)
        pol.routed(r, pol.choose(r, view, 0.0), 0.0)
    trees = pol.trees  # type: ignore[attr-defined]
    assert all(len(t.keys) <= 50 for t in trees.values())
    pol.choose(req(3), View(["b"]), 0.0)
    assert set(trees) <= {"b"}
