"""The toy inference engine behind ``gcache-engine``: a ``transformers`` model with
its own bounded prefix cache (the instance's memory) and GCache as the shared pool.

Per request (:meth:`Engine.generate`):

1. the prompt's block keys; the window-safe match in the local cache (``L``
   blocks) and in the pool (``P`` blocks, leased; the client reports both to the
   router when configured with one);
2. the prefix comes from the local cache when ``L >= P`` (no copy over the
   network), else from the pool, layer by layer as the model runs
   (:class:`gcache_client.engines.hf.GCachePrefixCache`); a pool read that fails is a
   miss and the prompt is recomputed;
3. the rest of the prompt is computed in two chunks (to the last block boundary,
   then the remainder); at the boundary the prompt's blocks go to the pool (put)
   and to the local cache, whose changes are published as vLLM KV events;
4. greedy decoding, restricted to the tokens the text codec can round-trip.

Synchronous and single-threaded (one request at a time); the HTTP server runs it
on a worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from gcache import keys as keymod
from gcache import textcodec
from gcache.errors import GCacheError
from gcache_client.engines.hf import (
    GCachePrefixCache,
    PrefixLoadFailed,
    TransformersConnector,
    kv_from_cache,
    set_layer_kv,
)
from gcache_client.engines.kv_events import ZmqPublisher, change_events
from gcache_client.engines.local_cache import Change, LocalPrefixCache
from gcache_client.sync import GCacheClient

log = logging.getLogger("gcache.engine")


@dataclass
class Generation:
    prompt_tokens: int
    local_tokens: int  # prefix tokens taken from the instance's own cache
    pool_tokens: int  # prefix tokens fetched from the GCache pool
    output: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    timings: dict[str, float] = field(default_factory=dict)


class Engine:
    def __init__(
        self,
        client: GCacheClient,
        model: Any,
        model_id: str,
        *,
        block_size: int = 64,
        local_capacity: int = 256 << 20,
        publisher: ZmqPublisher | None = None,
    ) -> None:
        self.conn = TransformersConnector(client, model, model_id, block_size=block_size)
        self.client = client
        self.model = model
        self.ns = self.conn.ns
        self.layout = self.ns.layout
        self.block_size = block_size
        self.local = LocalPrefixCache(self.layout, local_capacity)
        self.publisher = publisher
        self.allowed = torch.tensor(list(textcodec.GENERATED))
        self.stats_counters: dict[str, int] = {
            "requests": 0,
            "prompt_tokens": 0,
            "local_tokens": 0,
            "pool_tokens": 0,
            "generated_tokens": 0,
            "pool_load_failures": 0,
        }

    # ---- prefill ----------------------------------------------------------------------

    def _local_cache(self, keys: Sequence[bytes], blocks: int) -> Any:
        """A model cache holding the first ``blocks`` blocks from the local cache."""
        payloads = self.local.use(keys, blocks)
        cache = DynamicCache(config=self.model.config)
        layout = self.layout
        for layer in range(layout.num_layers):
            g = layout.layer_group[layer]
            li = layout.group_layers[g].index(layer)
            window = layout.window_blocks(g, blocks)
            ks = [payloads[(j, g)][li][0] for j in window]
            vs = [payloads[(j, g)][li][1] for j in window]
            k = torch.cat(ks).permute(1, 0, 2).unsqueeze(0)
            v = torch.cat(vs).permute(1, 0, 2).unsqueeze(0)
            set_layer_kv(cache.layers[layer], k, v, blocks * self.block_size)
        return cache

    def _store(self, ids: np.ndarray, keys: Sequence[bytes], cache: Any, put: bool = True) -> None:
        """At a block boundary: the prompt's blocks to the pool (``put``) and the
        local cache."""
        t0 = time.perf_counter()
        if put:
            self.conn._safe_store(ids, cache)
        kv = kv_from_cache(cache)
        n = len(ids)
        layout = self.layout

        def make(j: int, g: int) -> tuple[Any, int]:
            parts = []
            nbytes = 0
            for layer in layout.group_layers[g]:
                k, v = kv[layer]
                first_row = n - k.shape[0]  # sliding layers keep only their window
                lo = j * self.block_size - first_row
                kb = k[lo : lo + self.block_size].clone()
                vb = v[lo : lo + self.block_size].clone()
                parts.append((kb, vb))
                nbytes += kb.nbytes + vb.nbytes
            return parts, nbytes

        change = self.local.insert(keys, n // self.block_size, make)
        self._publish(ids, keys, change)
        log.debug("stored %d tokens in %.1f ms", n, (time.perf_counter() - t0) * 1e3)

    def _publish(self, ids: np.ndarray, keys: Sequence[bytes], change: Change) -> None:
        if self.publisher is not None:
            self.publisher.publish(change_events(self.layout, ids, keys, change))

    def prefill(self, ids: np.ndarray) -> tuple[torch.Tensor, Any, Generation]:
        n = len(ids)
        gen = Generation(n, 0, 0)
        t0 = time.perf_counter()
        bs = self.block_size
        keys = keymod.block_keys(self.ns.fingerprint, ids, bs)
        # At least one token is computed, to produce the next token's logits.
        local = self.local.match(keys[: (n - 1) // bs])
        match = self.client.match(self.ns, ids[: n - 1], local_tokens=local * bs)
        try:
            cache: Any = None
            start = 0
            if match.blocks > local:
                cache = self.conn.load(match)
                start = match.tokens
                gen.pool_tokens = start
            elif local:
                cache = self._local_cache(keys, local)
                start = local * bs
                gen.local_tokens = start
            else:
                self.local.misses += 1
            gen.timings["lookup_s"] = time.perf_counter() - t0
            try:
                logits, cache = self._run(ids, keys, cache, start)
            except PrefixLoadFailed as exc:
                log.warning("pool prefix load failed (%s); recomputing %d tokens", exc, n)
                self.stats_counters["pool_load_failures"] += 1
                gen.pool_tokens = 0
                logits, cache = self._run(ids, keys, None, 0)
        finally:
            self.client.release(match)
        gen.timings["prefill_s"] = time.perf_counter() - t0
        return logits, cache, gen

    def _run(
        self, ids: np.ndarray, keys: Sequence[bytes], cache: Any, start: int
    ) -> tuple[torch.Tensor, Any]:
        model = self.model
        t = torch.as_tensor(ids).reshape(1, -1)
        n = len(ids)
        if cache is None:
            cache = DynamicCache(config=model.config)
        boundary = (n // self.block_size) * self.block_size
        stored = False
        if boundary == start and boundary > 0 and isinstance(cache, GCachePrefixCache):
            # The whole prefix came from the pool: keep it locally too.
            cache.loaded_all()
            self._store(ids[:boundary], keys, cache, put=False)
        if boundary > start and boundary < n:
            model(t[:, start:boundary], cache=cache, use_cache=True, logits_to_keep=1)
            if isinstance(cache, GCachePrefixCache):
                cache.loaded_all()
            self._store(ids[:boundary], keys, cache)
            stored = True
            start = boundary
        logits = model(t[:, start:], cache=cache, use_cache=True, logits_to_keep=1).logits
        if boundary == n and boundary > start and not stored:
            self._store(ids, keys, cache)
        return logits[0, -1], cache

    # ---- generate ------------------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        on_token: Callable[[int], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Generation:
        """Prefill ``prompt`` and decode up to ``max_tokens`` tokens greedily."""
        ids = np.asarray(prompt, dtype=np.int64)
        if len(ids) < 1:
            raise GCacheError("empty prompt")
        with torch.no_grad():
            logits, cache, gen = self.prefill(ids)
            t0 = time.perf_counter()
            for i in range(max_tokens):
                if cancelled is not None and cancelled():
                    gen.finish_reason = "abort"
                    break
                tok = int(self.allowed[int(logits[self.allowed].argmax())])
                gen.output.append(tok)
                if on_token is not None:
                    on_token(tok)
                if i + 1 < max_tokens:
                    out = self.model(torch.tensor([[tok]]), cache=cache, use_cache=True)
                    logits = out.logits[0, -1]
            gen.timings["decode_s"] = time.perf_counter() - t0
        c = self.stats_counters
        c["requests"] += 1
        c["prompt_tokens"] += gen.prompt_tokens
        c["local_tokens"] += gen.local_tokens
        c["pool_tokens"] += gen.pool_tokens
        c["generated_tokens"] += len(gen.output)
        return gen

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.stats_counters, "local_cache": self.local.stats()}
        if self.publisher is not None:
            out["kv_events"] = self.publisher.stats()
        return out
