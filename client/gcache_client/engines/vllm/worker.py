"""The worker side of :class:`gcache_client.engines.vllm.connector.GCacheConnector`: layerwise
loads into vLLM's paged KV cache, staging of the rows a step computed, and the
background store once a prompt's stored part is staged."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_events import BlockStored, KVCacheEvent

from gcache import keys as keymod
from gcache import layout as laymod
from gcache_client import arrays
from gcache_client.engines.vllm import cpus
from gcache_client.engines.vllm.async_loader import AsyncLoader, LoadJob
from gcache_client.engines.vllm.core import (
    BridgeConfig,
    KVBridge,
    KVKey,
    match_from_wire,
    wire_namespace,
)
from gcache_client.engines.vllm.meta import MEDIUM, GCacheConnectorMetadata, LayerMap, ReqStep
from gcache_client.engines.vllm.paged import Seg, from_cache, kv_views, segments, to_cache
from gcache_client.sync import SyncLayerStream
from gcache_client.types import KVPair, Match, PutResult

log = logging.getLogger("gcache.client.vllm")


@dataclass
class _Staging:
    """A request's rows on their way to GCache: [rows, heads, dim] per layer."""

    tokens: np.ndarray
    key: KVKey
    kv: list[tuple[np.ndarray, np.ndarray]]
    swa_from: int  # first row every sliding layer holds
    filled: int = 0  # rows [0, filled) of every layer are staged


@dataclass
class _Load:
    req_id: str
    match: Match
    stream: SyncLayerStream
    block_ids: tuple[list[int], ...]
    local: int
    own_lease: bool = False  # this worker's own match (released here), not the scheduler's
    next_layer: int = 0
    failed: bool = False
    segs: dict[tuple[int, int, int], list[Seg]] = field(default_factory=dict)


class _Worker:
    def __init__(self, cfg: BridgeConfig, lmap: LayerMap, model_id: str) -> None:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.lmap = lmap
        pp = get_pp_group()
        self.bridge = KVBridge(
            cfg,
            model_id,
            lmap.spec,
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
            stage=f"pp={pp.rank_in_group}/{pp.world_size}" if pp.world_size > 1 else "",
        )
        self.layout = self.bridge.layout
        self.index = {name: i for i, name in enumerate(lmap.names)}
        self.caches: dict[str, torch.Tensor] = {}
        self.views: dict[str, tuple[Any, Any]] = {}  # layer -> paged K, V views
        self.group_block = lmap.group_block
        self.layer_group = [lmap.group_of[n] for n in lmap.names]
        # (request, group, lo, hi) -> segments of this step's stored rows
        self.step_segs: dict[tuple[str, int, int, int], list[Seg]] = {}
        self.staging: dict[str, _Staging] = {}
        self.loads: list[_Load] = []
        self.steps: list[ReqStep] = []
        self.meta: GCacheConnectorMetadata | None = None
        self.load_errors: set[int] = set()
        self.events: list[KVCacheEvent] = []
        self.stats_delta: dict[str, int] = {}
        self._stats_lock = threading.Lock()  # the async loader counts too
        self.to_start: list[ReqStep] = []  # this step's loads, not started yet
        self.loader = AsyncLoader(cfg.max_async_loads) if cfg.load_mode == "async" else None
        self.store = cfg.store
        avail = cpus.available_cpus()
        self.placer = cpus.ThreadPlacer(cpus.client_cpus(cfg.client_cpus, os.environ, avail))
        self.load_before = cfg.load_mode == "before" or (
            cfg.load_mode == "auto" and cpus.shares_omp_cores(self.placer.cpus, os.environ, avail)
        )
        omp = cpus.omp_cpus(os.environ)
        how = "layer by layer during the forward"
        if self.loader is not None:
            how = "async, before the request is scheduled"
        elif self.load_before:
            how = "whole, before the forward"
        log.info(
            "GCache connector: client threads on CPUs %s (vLLM's OpenMP threads on %s); loads %s",
            sorted(self.placer.cpus) if self.placer.cpus is not None else "as started",
            sorted(omp) if omp is not None else "unbound",
            how,
        )

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.caches = dict(kv_caches)
        self.views = {name: kv_views(t) for name, t in self.caches.items()}
        self.placer.place()

    def _blocks_of(self, lo: int, hi: int, block_ids: tuple[list[int], ...]) -> set[int]:
        out: set[int] = set()
        for g, b in enumerate(self.lmap.group_block):
            out.update(x for x in block_ids[g][lo // b : -(-hi // b)] if x)
        return out

    # -- a step --

    def prepare(self, meta: GCacheConnectorMetadata) -> None:
        """Take a step's metadata (once; vLLM calls ``start_load_kv`` before the
        forward only when the step loads, so every hook may be the first)."""
        if meta is self.meta:
            return
        self.meta = meta
        for req_id in meta.finished:
            self.staging.pop(req_id, None)
        # An async load's request computes nothing this step: no staging of rows,
        # no store (its staging buffer is being filled by the load).
        self.steps = [st for st in meta.steps if not st.async_load]
        self.loads = []
        self.to_start = [st for st in meta.steps if st.load is not None]
        for st in meta.steps:
            if (
                self.store
                and st.tokens is not None
                and st.store_len > 0
                and st.req_id not in self.staging
            ):
                self._new_staging(st)

    def start_step(self, meta: GCacheConnectorMetadata) -> None:
        self.prepare(meta)
        todo, self.to_start = self.to_start, []
        self.placer.place()
        for st in todo:
            ld = self._start_load(st)
            if not st.async_load:
                self.loads.append(ld)
            else:
                assert self.loader is not None  # the scheduler has the same load_mode
                self.loader.submit(LoadJob(st.req_id, functools.partial(self._load_all, ld)))
        if self.loads and self.load_before:  # read whole now: nothing reads during the forward
            self.wait_layer(self.lmap.names[-1])

    def _new_staging(self, st: ReqStep) -> None:
        n = st.store_len
        kv = []
        for sp in self.layout.spec.layers:
            k = arrays.empty((n, sp.kv_heads, sp.k_head_dim), self.layout.dtype)
            v = arrays.empty((n, sp.kv_heads, sp.v_head_dim), self.layout.dtype)
            kv.append((k, v))
        toks = np.asarray(st.tokens, dtype=np.int64)
        # After a hit in vLLM's own prefix cache, the sliding groups hold only the
        # blocks inside the window: stage those rows (the full groups hold all).
        swa_from = _first_live_row(st, self.lmap, self.layout) if st.start else 0
        self.staging[st.req_id] = _Staging(toks, st.key, kv, swa_from=swa_from)

    def _start_load(self, st: ReqStep) -> _Load:
        assert st.load is not None
        ns = self.bridge.namespace(st.key)
        m = match_from_wire(ns, st.load)
        own = wire_namespace(st.load) != ns.fingerprint
        if own:
            # The scheduler matched another shard's namespace (tensor-parallel rank,
            # pipeline stage): read only this worker's own shard, matched here.
            m = self._own_match(st, m)
        stg = self.staging.get(st.req_id)
        out: list[KVPair] | None = None
        if stg is not None:
            out = []
            for layer in range(self.layout.num_layers):
                first, n = self.bridge.client.layer_rows(m, layer)
                k, v = stg.kv[layer]
                out.append((k[first : first + n], v[first : first + n]))
            stg.swa_from = max(0, m.blocks - _max_tail(self.layout)) * self.layout.block_size
            stg.filled = m.tokens
        t0 = time.perf_counter()
        stream = self.bridge.client.get_layers(m, out)
        self._stat("load_start_us", int((time.perf_counter() - t0) * 1e6))
        self._stat("loads", 1)
        self._stat("load_tokens", m.tokens - st.local)
        return _Load(st.req_id, m, stream, st.block_ids, st.local, own_lease=own)

    def _own_match(self, st: ReqStep, theirs: Match) -> Match:
        """This worker's own match of the scheduler's matched prefix: its shard's
        objects, never another rank's. Anything short of the scheduler's match is
        an empty match: the load fails and vLLM recomputes."""
        self._stat("own_matches", 1)
        stg = self.staging.get(st.req_id)
        tokens = (
            np.asarray(st.tokens, dtype=np.int64)
            if st.tokens is not None
            else (stg.tokens if stg is not None else None)
        )
        if tokens is None or len(tokens) < theirs.tokens:
            self._stat("own_match_short", 1)
            return Match(theirs.namespace, 0, 0)
        mine = self.bridge.match(tokens[: theirs.tokens], st.key)
        if mine.tokens < theirs.tokens:
            self._stat("own_match_short", 1)
            self.bridge.release(mine)
            return Match(theirs.namespace, 0, 0)
        return mine

    def _load_all(self, ld: _Load) -> str:
        """An async load, on the loader thread: every layer into the paged cache.
        Returns "" when all landed, else why not (the request is then recomputed)."""
        t0 = time.perf_counter()
        try:
            n = 0
            for lkv in ld.stream:
                self._scatter(ld, lkv.layer, lkv.k, lkv.v, lkv.start)
                n += 1
            if n != self.layout.num_layers or not ld.stream.ok:
                return ld.stream.error or f"{n} of {self.layout.num_layers} layers"
            return ""
        finally:
            self._close_load(ld)
            self._stat("load_wait_us", int((time.perf_counter() - t0) * 1e6))

    def wait_layer(self, name: str) -> None:
        i = self.index.get(name)
        if i is None or not self.loads:
            return
        t0 = time.perf_counter()
        for ld in self.loads:
            while not ld.failed and ld.next_layer <= i:
                try:
                    lkv = next(ld.stream)
                except StopIteration:
                    self._load_failed(ld, ld.stream.error or "stream ended")
                    break
                try:
                    self._scatter(ld, lkv.layer, lkv.k, lkv.v, lkv.start)
                except (IndexError, RuntimeError) as exc:  # blocks vLLM did not allocate
                    self._load_failed(ld, f"copy into the paged cache: {exc}")
                    break
                ld.next_layer += 1
        self._stat("load_wait_us", int((time.perf_counter() - t0) * 1e6))

    def _scatter(self, ld: _Load, layer: int, k: Any, v: Any, start: int) -> None:
        hi = start + len(k)
        lo = max(start, ld.local)  # vLLM's own prefix cache already holds [0, local)
        if lo >= hi:
            return
        g = self.layer_group[layer]
        segs = ld.segs.get((g, lo, hi))
        if segs is None:  # once per group and load; null blocks (dropped) left out
            segs = ld.segs[(g, lo, hi)] = segments(ld.block_ids[g], self.group_block[g], lo, hi)
        kc, vc = self.views[self.lmap.names[layer]]
        kt = arrays.as_torch(k, self.layout.dtype)
        vt = arrays.as_torch(v, self.layout.dtype)
        self._stat("load_bytes", to_cache(kc, vc, segs, kt, vt, start))

    def _close_load(self, ld: _Load) -> None:
        ld.stream.close()
        if ld.own_lease:
            self.bridge.release(ld.match)

    def _load_failed(self, ld: _Load, why: str) -> None:
        ld.failed = True
        bad = self._blocks_of(ld.local, ld.match.tokens, ld.block_ids)
        self.load_errors |= bad
        self.staging.pop(ld.req_id, None)  # its staged prefix is incomplete
        self._stat("load_errors", 1)
        log.warning(
            "GCache load of %s failed (%s); vLLM recomputes %d blocks", ld.req_id, why, len(bad)
        )

    def save_layer(self, name: str, kv_layer: torch.Tensor) -> None:
        i = self.index.get(name)
        if i is None:
            return
        for st in self.steps:
            stg = self.staging.get(st.req_id)
            if stg is None:
                continue
            # Rows [filled, end) are new to the staging buffer: computed this step,
            # or (first step after vLLM's own prefix-cache hit) cached by vLLM.
            lo, hi = stg.filled, min(st.end, len(stg.tokens))
            if hi <= lo:
                continue
            g = self.layer_group[i]
            key = (st.req_id, g, lo, hi)
            segs = self.step_segs.get(key)
            if segs is None:  # once per group and step; null blocks (dropped) left out
                segs = self.step_segs[key] = segments(st.block_ids[g], self.group_block[g], lo, hi)
            kc, vc = self.views.get(name) or kv_views(kv_layer)
            k, v = stg.kv[i]
            from_cache(
                kc,
                vc,
                segs,
                arrays.as_torch(k, self.layout.dtype),
                arrays.as_torch(v, self.layout.dtype),
                0,
            )

    def end_step(self) -> None:
        if self.loads:  # layers nobody waited for (a step without attention metadata)
            self.wait_layer(self.lmap.names[-1])
        for ld in self.loads:
            self._close_load(ld)
        self.loads = []
        self.step_segs.clear()
        for st in self.steps:
            stg = self.staging.get(st.req_id)
            if stg is None:
                continue
            stg.filled = max(stg.filled, min(st.end, len(stg.tokens)))
            if stg.filled >= len(stg.tokens):
                del self.staging[st.req_id]
                self._submit(stg)
        self.steps = []
        self.placer.place()  # a store thread started by this step

    def _submit(self, stg: _Staging) -> None:
        kv: list[KVPair] = []
        for i, (k, v) in enumerate(stg.kv):
            if self.layout.group_tail_blocks[self.layout.layer_group[i]] is None:
                kv.append((k, v))
            else:
                kv.append((k[stg.swa_from :], v[stg.swa_from :]))
        nblocks = len(stg.tokens) // self.layout.block_size

        def done(res: PutResult | None) -> None:
            if res is not None and res.ok:
                self._stored_events(stg.tokens, nblocks, stg.key)

        self._stat("stores", 1)
        self.bridge.store_async(stg.tokens, kv, stg.key, done)

    def _stored_events(self, tokens: np.ndarray, nblocks: int, key: KVKey) -> None:
        ns = self.bridge.namespace(key)
        bs = self.layout.block_size
        gkeys = keymod.block_keys(ns.fingerprint, tokens, bs, key.extras_for(nblocks))
        hashes = [int.from_bytes(k[:8], "little") for k in gkeys][:nblocks]
        ekeys = list(key.event_keys) if key.event_keys is not None else None
        tail = _max_tail(self.layout)
        for g in range(len(self.lmap.group_block)):
            first = 0
            names = [n for n in self.lmap.names if self.lmap.group_of[n] == g]
            if names and self.layout.spec.layers[self.index[names[0]]].kind == "swa":
                first = max(0, nblocks - tail)
            self.events.append(
                BlockStored(
                    block_hashes=hashes[first:],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=[int(x) for x in tokens[first * bs : nblocks * bs]],
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=key.lora_name,
                    extra_keys=ekeys[first:nblocks] if ekeys is not None else None,
                    group_idx=g,
                )
            )

    # -- reports --

    def take_finished(self) -> tuple[set[str], set[str]]:
        """Async loads done since the last call: (finished, failed); a failed one
        is in both (vLLM's contract), its staged rows dropped."""
        done = self.loader.take() if self.loader is not None else {}
        failed = {r for r, why in done.items() if why}
        for req_id in failed:
            self.staging.pop(req_id, None)
            self._stat("load_errors", 1)
            log.warning(
                "GCache async load of %s failed (%s); vLLM recomputes it", req_id, done[req_id]
            )
        return set(done), failed

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def take_events(self) -> list[KVCacheEvent]:
        out, self.events = self.events, []
        return out

    def _stat(self, key: str, n: int) -> None:
        with self._stats_lock:
            self.stats_delta[key] = self.stats_delta.get(key, 0) + n

    def take_stats(self) -> dict[str, int]:
        with self._stats_lock:
            out, self.stats_delta = self.stats_delta, {}
        return out

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self.bridge.close()


def _max_tail(layout: laymod.Layout) -> int:
    return max((t for t in layout.group_tail_blocks if t is not None), default=0)


def _first_live_row(st: ReqStep, lmap: LayerMap, layout: laymod.Layout) -> int:
    """First GCache block boundary from which every sliding group's vLLM blocks are
    still allocated (not vLLM's null block 0)."""
    first = 0
    for g, b in enumerate(lmap.group_block):
        ids = st.block_ids[g]
        j = 0
        while j < len(ids) and j * b < st.start and ids[j] == 0:
            j += 1
        first = max(first, j * b)
    bs = layout.block_size
    return -(-first // bs) * bs
