"""The router's decision core: fleet index + event ingestion + policy, no I/O.

The daemon's drivers (framed hot path, HTTP front, ZMQ subscriber, health probes)
call into :class:`RouterCore` with the time passed in; everything here is plain
synchronous code.
"""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gcache import keys as keymod
from gcache import wire
from gcache.config import RouterConfig
from gcache.errors import E_BAD_REQUEST, E_NO_INSTANCE, ConfigError, LayoutError, Refusal
from gcache.layout import PRESETS, Layout, preset, spec_from_dict, validate
from gcache.router.baselines import make_policy
from gcache.router.events import EventIngestor, Outcome
from gcache.router.index import FleetIndex, RouterError, RouteView
from gcache.router.policy import InstanceLoad, Policy, RouteRequest
from gcache.router.scoring import ScoringWeights


@dataclass(frozen=True, slots=True)
class StaticInstance:
    """One ``[ID=]URL[@EVENTS]`` entry of ``router.instances``."""

    name: str
    url: str
    events: str


def parse_instances(text: str) -> list[StaticInstance]:
    """``router.instances``: comma-separated ``[ID=]URL[@EVENTS]``."""
    out: list[StaticInstance] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, rest = item.partition("=")
        if not sep or "://" in name:
            name, rest = "", item
        url, _, events = rest.partition("@")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"router.instances: {item!r}: URL must be http(s)://host:port")
        if events and not events.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"router.instances: {item!r}: events endpoint must be tcp://, ipc:// or inproc://"
            )
        name = name or parsed.netloc
        if any(s.name == name for s in out):
            raise ConfigError(f"router.instances: instance id {name!r} appears twice")
        out.append(StaticInstance(name, url.rstrip("/"), events))
    return out


def load_layout(cfg: RouterConfig) -> Layout:
    try:
        if cfg.layout in PRESETS:
            return Layout(preset(cfg.layout, cfg.block_size))
        data = json.loads(Path(cfg.layout).read_text())
        if "layers" not in data:
            data["block_size"] = cfg.block_size
        spec = spec_from_dict(data)
        validate(spec)
        return Layout(spec)
    except (OSError, ValueError, LayoutError) as exc:
        raise ConfigError(
            f"router.layout: {cfg.layout!r} is neither a preset ({', '.join(PRESETS)}) "
            f"nor a readable layout file: {exc}"
        ) from exc


def parse_weights(text: str) -> dict[str, float]:
    """``router.weights``: ``name=value,...`` overriding :class:`ScoringWeights`."""
    known = {f.name: f for f in fields(ScoringWeights)}
    out: dict[str, float] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(f"router.weights: {item!r} is not name=value")
        try:
            num = float(value)
        except ValueError:
            raise ConfigError(f"router.weights: {name} must be a number, got {value!r}") from None
        f = known.get(name)
        out[name] = int(num) if f is not None and f.type == "int" else num
    return out


def namespace_fp(cfg: RouterConfig) -> bytes:
    if cfg.namespace:
        return bytes.fromhex(cfg.namespace)
    return keymod.fingerprint({"router_model": cfg.model})


def make_router_policy(cfg: RouterConfig) -> Policy:
    weights = parse_weights(cfg.weights) if cfg.policy == "gcache" else {}
    if cfg.weights and cfg.policy != "gcache":
        raise ConfigError("router.weights applies to the gcache policy only")
    return make_policy(cfg.policy, block_size=cfg.block_size, seed=cfg.seed, **weights)


class RouterCore:
    """Decisions and bookkeeping of one router (see module text)."""

    def __init__(self, cfg: RouterConfig, now: float, policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.layout = load_layout(cfg)
        self.fp = namespace_fp(cfg)
        self.pool_enabled = bool(cfg.meta and cfg.namespace)
        self.index = FleetIndex(
            self.layout,
            max_instances=cfg.max_instances,
            max_blocks=cfg.max_blocks_per_instance,
            ttl_s=cfg.instance_ttl_s,
            forget_s=cfg.instance_forget_s,
        )
        # Blocks engines announced in the GCache pool (KV events with medium
        # GCACHE): the pool match when no meta is configured for it.
        self.pool_index = FleetIndex(
            self.layout,
            max_instances=cfg.max_instances,
            max_blocks=cfg.max_blocks_per_instance,
            ttl_s=cfg.instance_forget_s,
            forget_s=cfg.instance_forget_s,
        )
        self.ingestor = EventIngestor(self.index, self.fp, pool=self.pool_index)
        self.policy = policy if policy is not None else make_router_policy(cfg)
        self.static = parse_instances(cfg.instances)
        for s in self.static:
            self.index.register(s.name, now, s.url, seen=False, static=True)
        self.counters: Counter[str] = Counter()
        self.by_reason: Counter[str] = Counter()
        self.routed_to: Counter[str] = Counter()

    # ---- keys ---------------------------------------------------------------------

    def keys_of(self, tokens: Sequence[int]) -> list[bytes]:
        return keymod.block_keys(self.fp, tokens, self.layout.block_size)

    # ---- requests --------------------------------------------------------------------

    def route(
        self, keys: Sequence[bytes], tokens: int, now: float, pool_blocks: int = 0, rid: str = ""
    ) -> wire.Routed:
        """Choose an instance; raises :class:`Refusal` (``E_NO_INSTANCE``) when none
        is live."""
        self.counters["routes"] += 1
        if tokens < 0 or tokens < len(keys) * self.layout.block_size:
            self.counters["refused"] += 1
            raise Refusal(
                E_BAD_REQUEST,
                f"tokens ({tokens}) must cover the {len(keys)} full blocks of the keys",
            )
        if not self.pool_enabled:
            pool_blocks = self.pool_from_events(keys)
        view = RouteView(self.index, keys, pool_blocks)
        if not view.live(now):
            self.counters["no_instance"] += 1
            raise Refusal(
                E_NO_INSTANCE,
                f"no live engine instance: none of the {len(self.index.instances)} known "
                f"has answered a health probe, reported load or sent KV events within "
                f"router.instance_ttl_s ({self.cfg.instance_ttl_s} s)",
            )
        req = RouteRequest(keys=keys, tokens=tokens, request_id=rid)
        d = self.policy.choose(req, view, now)
        self.policy.routed(req, d, now)
        self.by_reason[d.reason] += 1
        self.routed_to[d.instance] += 1
        inst = self.index.instances[d.instance]
        return wire.Routed(
            instance=d.instance,
            url=inst.url,
            local_blocks=d.local_blocks,
            pool_blocks=d.pool_blocks,
            cost=float(d.cost),
            reason=d.reason,
        )

    def pool_from_events(self, keys: Sequence[bytes]) -> int:
        """Window-safe blocks of ``keys`` some engine announced in the GCache pool
        (GCACHE-medium KV events) and has not retracted."""
        if not self.pool_index.instances:
            return 0
        return max(self.pool_index.match(keys).values(), default=0)

    def report_load(self, msg: wire.ReportLoad, now: float) -> wire.Ok:
        if min(msg.queued, msg.running, msg.tokens_in_flight, msg.active_blocks) < 0:
            raise Refusal(E_BAD_REQUEST, "load figures must be >= 0")
        if msg.url and not msg.url.startswith(("http://", "https://")):
            raise Refusal(E_BAD_REQUEST, f"instance url must be http(s)://..., got {msg.url!r}")
        load = InstanceLoad(msg.queued, msg.running, msg.tokens_in_flight, msg.active_blocks)
        try:
            self.index.report_load(msg.instance, load, now, msg.url.rstrip("/"))
        except RouterError as exc:
            raise Refusal(E_BAD_REQUEST, str(exc)) from exc
        self.counters["load_reports"] += 1
        return wire.Ok(0)

    def report_hits(self, msg: wire.ReportHits, now: float) -> wire.Ok:
        if min(msg.prompt_tokens, msg.local_tokens, msg.pool_tokens) < 0 or (
            msg.local_tokens + msg.pool_tokens > msg.prompt_tokens
        ):
            raise Refusal(E_BAD_REQUEST, "hit figures must be >= 0 and within prompt_tokens")
        try:
            self.index.report_hits(
                msg.instance, msg.prompt_tokens, msg.local_tokens, msg.pool_tokens, now
            )
        except RouterError as exc:
            raise Refusal(E_BAD_REQUEST, str(exc)) from exc
        self.counters["hit_reports"] += 1
        return wire.Ok(0)

    def events(self, instance: str, seq: int, payload: bytes, now: float) -> Outcome:
        return self.ingestor.ingest(instance, seq, payload, now)

    def seen(self, instance: str, now: float) -> None:
        """A health probe of ``instance`` succeeded."""
        inst = self.index.get(instance)
        if inst is not None:
            inst.last_seen = max(inst.last_seen, now)

    def tick(self, now: float) -> None:
        self.index.forget_expired(now)
        self.pool_index.forget_expired(now)

    def stats(self, now: float) -> dict[str, Any]:
        live = set(self.index.live(now))
        return {
            **{k: v for k, v in self.counters.items()},
            "by_reason": dict(self.by_reason),
            "index": self.index.stats(),
            "pool_index": self.pool_index.stats(),
            "events": self.ingestor.stats(),
            "instances": {
                i.name: {
                    "url": i.url,
                    "live": i.name in live,
                    "blocks": len(i.blocks),
                    "seq": i.seq,
                    "resets": i.resets,
                    "evicted": i.evicted,
                    "queued": i.load.queued,
                    "running": i.load.running,
                    "tokens_in_flight": i.load.tokens_in_flight,
                    "routed": self.routed_to.get(i.name, 0),
                    "reported_prompt_tokens": i.reported_prompt_tokens,
                    "reported_local_tokens": i.reported_local_tokens,
                    "reported_pool_tokens": i.reported_pool_tokens,
                }
                for i in self.index.instances.values()
            },
        }
