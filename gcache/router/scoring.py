"""The ``gcache`` routing policy: route to the instance where the request's first
token comes soonest, counting what its own memory and the GCache pool save.

Per live instance ``i``, in *token-equivalents* (one token of prefill compute)::

    local_i   = window-safe blocks of the prompt that i holds itself
    pool_i    = window-safe blocks the pool holds beyond local_i
    compute_i = prompt tokens - (local_i + pool_i) * block_size
    cost_i    = compute_i + pool_token_cost * pool_i * block_size
                + load_weight * tokens_in_flight_i
                + request_tokens * (queued_i + running_i)

Lowest cost wins; costs equal to within ``tie_tolerance`` are broken at random with
the injected ``random.Random``. The window-safe match (:meth:`Layout.valid_match`)
is what the engine can really resume from on a sliding-window model: a prefix whose
last window was freed is worth nothing past the last point whose window is held, so
an instance that merely holds the full-attention blocks of a long prefix does not
attract the request.

Guard (no instance flooded or starved): an instance whose load exceeds
``flood_rel`` x the least-loaded live instance's load + ``flood_abs_tokens``, or
with ``max_queued`` or more queued requests, is not eligible while any other
instance is; affinity therefore never piles work onto one instance while another
idles, and an idle instance is never passed over for one that is flooded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields

from gcache.errors import ConfigError
from gcache.router.policy import ClusterView, Decision, InstanceLoad, RouteRequest


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """Weights of the ``gcache`` policy. The defaults are the documented ones
    (docs/router.md, "Policies"); the router's config and the simulator take them
    from here."""

    # Cost of a token served by the pool, as a fraction of computing it. MiMo-V2-Flash
    # fetches ~23 KB of KV a token (full-attention layers; the windowed layers only for
    # the last window) against ~28 GFLOP to compute it: at 25 GB/s and 400 TFLOP/s
    # effective that is 0.9 us against 71 us, ~1.3%; 0.05 leaves room for slower
    # fabrics and the fetch latency.
    pool_token_cost: float = 0.05
    # Weight of one token still in flight on the instance (prefill work queued ahead
    # of the request, in the same compute tokens as the request's own prefill).
    load_weight: float = 1.0
    # Fixed cost of each queued or running request (scheduling, decode steps that
    # share the GPU with the prefill): token-equivalents.
    request_tokens: float = 64.0
    # The guard: not eligible above flood_rel x min load + flood_abs_tokens ...
    flood_rel: float = 2.0
    flood_abs_tokens: float = 32768.0
    # ... or with this many queued requests (0: no limit).
    max_queued: int = 64
    # Costs closer than this (relative) are ties, broken at random.
    tie_tolerance: float = 1e-9

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first weight out of range."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"router weight {f.name} must be finite, got {v}")
        if not 0.0 <= self.pool_token_cost <= 1.0:
            raise ConfigError(f"pool_token_cost must be in [0, 1], got {self.pool_token_cost}")
        if self.load_weight <= 0.0:
            raise ConfigError(f"load_weight must be > 0, got {self.load_weight}")
        if self.request_tokens < 0.0 or self.flood_abs_tokens < 0.0:
            raise ConfigError("request_tokens and flood_abs_tokens must be >= 0")
        if self.flood_rel < 1.0:
            raise ConfigError(f"flood_rel must be >= 1, got {self.flood_rel}")
        if self.max_queued < 0:
            raise ConfigError(f"max_queued must be >= 0, got {self.max_queued}")
        if not 0.0 <= self.tie_tolerance < 1.0:
            raise ConfigError(f"tie_tolerance must be in [0, 1), got {self.tie_tolerance}")


def load_tokens(load: InstanceLoad, w: ScoringWeights) -> float:
    """An instance's load in token-equivalents (the cost's load term)."""
    return w.load_weight * load.tokens_in_flight + w.request_tokens * (load.queued + load.running)


class GCachePolicy:
    """Lowest estimated prefill work + pool fetch + queue; see the module text."""

    name = "gcache"

    def __init__(
        self,
        block_size: int,
        weights: ScoringWeights | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.weights = weights or ScoringWeights()
        self.weights.check()
        self.rng = rng or random.Random(0)
        self.decisions = 0
        self.guarded = 0  # decisions where the guard passed over a cheaper instance
        self.ties = 0

    def choose(self, req: RouteRequest, view: ClusterView, now: float) -> Decision:
        live = view.live(now)
        if not live:
            raise ValueError("no live instance")  # the caller checks; a bug otherwise
        w = self.weights
        bs = self.block_size
        n = len(req.keys)
        pool_all = min(view.pool_match(req.keys), n) if n else 0
        loads = [load_tokens(view.load(i), w) for i in live]
        floor = min(loads)
        limit = w.flood_rel * floor + w.flood_abs_tokens
        cheapest = math.inf  # over every instance, eligible or not
        scored: list[tuple[int, int, float]] = []
        for idx, inst in enumerate(live):
            local = min(view.local_match(inst, req.keys), n) if n else 0
            pool = max(0, pool_all - local)
            compute = max(0, req.tokens - (local + pool) * bs)
            cost = compute + w.pool_token_cost * pool * bs + loads[idx]
            scored.append((local, pool, cost))
            cheapest = min(cheapest, cost)
        eligible = [
            idx
            for idx, inst in enumerate(live)
            if loads[idx] <= limit and (w.max_queued == 0 or view.load(inst).queued < w.max_queued)
        ]
        if not eligible:  # everyone flooded: the least loaded still takes it
            eligible = [min(range(len(live)), key=loads.__getitem__)]
        best_cost = min(scored[idx][2] for idx in eligible)
        slack = w.tie_tolerance * max(1.0, abs(best_cost))
        best = [idx for idx in eligible if scored[idx][2] <= best_cost + slack]
        pick = best[0] if len(best) == 1 else self.rng.choice(best)
        self.decisions += 1
        if len(best) > 1:
            self.ties += 1
        local, pool, cost = scored[pick]
        if cost > cheapest:
            self.guarded += 1
            reason = "guard"
        elif local:
            reason = "affinity"
        elif pool:
            reason = "pool"
        else:
            reason = "load"
        return Decision(live[pick], local, pool, cost, reason)

    def routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {"decisions": self.decisions, "guarded": self.guarded, "ties": self.ties}


def weights_from(cfg: dict[str, object]) -> ScoringWeights:
    """:class:`ScoringWeights` from ``cfg``'s matching keys (others ignored)."""
    kw: dict[str, float | int] = {}
    for f in fields(ScoringWeights):
        if f.name not in cfg:
            continue
        v = cfg[f.name]
        want = int if f.type in ("int", int) else float
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ConfigError(f"router weight {f.name}: not a number: {v!r}")
        try:
            kw[f.name] = want(v)
        except ValueError as exc:
            raise ConfigError(f"router weight {f.name}: not a number: {v!r}") from exc
    weights = ScoringWeights(**kw)  # type: ignore[arg-type]
    weights.check()
    return weights


__all__: Sequence[str] = ("GCachePolicy", "ScoringWeights", "load_tokens", "weights_from")
