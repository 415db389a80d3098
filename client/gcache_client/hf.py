"""GCache for ``transformers`` causal LMs (MiMo-V2-Flash and other hybrid models).

Two calls an engine loop needs, plus a ``prefill`` that wires them together:

* :meth:`TransformersConnector.store` after a prefill: the prompt's KV from the
  model's ``DynamicCache`` into GCache (full layers for every block, sliding layers
  only for the trailing window: strict O(W));
* :meth:`TransformersConnector.load` before a prefill: the longest valid cached
  prefix as a cache object the model accepts. The cache fills itself *layer by
  layer*: the model's forward asks the cache for layer i (``update``) just before
  computing attention i, and only then waits for that layer's bytes, while the
  reads of the next ``layers_in_flight`` layers are already in flight on the
  client's I/O thread. So fetching layer i+1 overlaps computing layer i. The mask
  construction at the start of a forward needs layers 0 and the first sliding
  layer, so those two are waited for before any compute.
* :meth:`TransformersConnector.prefill`: look up, load, run the model on the
  remaining tokens in two chunks (up to the last block boundary, then the rest),
  store at the boundary, return the logits. Any store failure during the load is a
  miss: the prefill is recomputed from scratch, never run on wrong KV.

torch and transformers are imported by this module only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from gcache.errors import GCacheError, LayoutError
from gcache.layout import LayerSpec, LayoutSpec, validate
from gcache_client import arrays
from gcache_client.sync import GCacheClient, SyncLayerStream
from gcache_client.types import KVPair, Match, Namespace, PutResult

log = logging.getLogger("gcache.client.hf")


class PrefixLoadFailed(GCacheError):
    """Raised inside a forward pass when a prefix layer could not be loaded; the
    connector catches it and recomputes (a miss)."""


def _decoder(model: Any) -> Any:
    inner = getattr(model, "model", model)
    return getattr(inner, "layers", None) or inner.model.layers


def layout_from_model(model: Any, block_size: int = 64) -> LayoutSpec:
    """Derive the GCache layout from a loaded model: which layers are full or
    sliding (and their window), KV heads, K and V head dims (read off the k/v
    projection shapes, so per-layer head counts like MiMo's doubled SWA heads come
    out right), and the dtype."""
    config = model.config.get_text_config(decoder=True)
    layer_types = (
        getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    )
    layers = []
    for i, block in enumerate(_decoder(model)):
        attn = block.self_attn
        head_dim = int(attn.head_dim)
        kv_heads = attn.k_proj.out_features // head_dim
        v_dim = attn.v_proj.out_features // kv_heads
        if layer_types[i] == "sliding_attention":
            window = int(config.sliding_window)
            # transformers keeps window-1 rows for a sliding layer; strict O(W)
            # stores ceil((W-1)/block_size) blocks, so they must coincide.
            if (window - 1) % block_size:
                raise LayoutError(
                    f"block_size {block_size} must divide sliding_window - 1 = {window - 1} "
                    "(transformers keeps exactly that many rows of a sliding layer)"
                )
            layers.append(LayerSpec("swa", kv_heads, head_dim, v_dim, window=window))
        elif layer_types[i] == "full_attention":
            layers.append(LayerSpec("full", kv_heads, head_dim, v_dim))
        else:
            raise LayoutError(f"layer {i}: unsupported layer type {layer_types[i]!r}")
    dtype = str(model.dtype).removeprefix("torch.")
    spec = LayoutSpec(block_size=block_size, dtype=dtype, layers=tuple(layers))
    validate(spec)
    return spec


def kv_from_cache(cache: Any) -> list[KVPair]:
    """``(K, V)`` per layer as ``[rows, kv_heads, head_dim]`` CPU tensors (batch 1).
    Sliding layers yield only the rows the cache keeps (its window)."""
    out: list[KVPair] = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        if k is None or k.shape[0] != 1:
            raise LayoutError("store() needs a filled cache of batch size 1")
        out.append(
            (k[0].transpose(0, 1).contiguous().cpu(), v[0].transpose(0, 1).contiguous().cpu())
        )
    return out


class GCachePrefixCache(DynamicCache):  # type: ignore[misc]
    """A ``DynamicCache`` whose first ``prefix_tokens`` come from GCache, layer by
    layer, the first time the model touches each layer."""

    def __init__(
        self,
        config: Any,
        stream: SyncLayerStream,
        prefix_tokens: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
        layout_dtype: str,
    ) -> None:
        super().__init__(config=config)
        self._gc_stream = stream
        self._gc_next = 0
        self._gc_prefix = prefix_tokens
        self._gc_num = num_layers
        self._gc_dtype = dtype
        self._gc_device = device
        self._gc_layout_dtype = layout_dtype
        self.gc_wait_s = 0.0  # time the forward pass spent waiting for bytes

    def _gc_ensure(self, layer_idx: int) -> None:
        top = min(layer_idx, self._gc_num - 1)
        while self._gc_next <= top:
            t0 = time.perf_counter()
            try:
                lkv = next(self._gc_stream)
            except StopIteration:
                raise PrefixLoadFailed(self._gc_stream.error or "prefix stream ended") from None
            self.gc_wait_s += time.perf_counter() - t0
            k, v = lkv.k, lkv.v
            if isinstance(k, np.ndarray):
                k, v = (
                    arrays.as_torch(k, self._gc_layout_dtype),
                    arrays.as_torch(v, self._gc_layout_dtype),
                )
            # [rows, heads, dim] -> [1, heads, rows, dim] as a view: the model's own
            # update() concatenates the new tokens onto it, which is the one copy
            # the in-process cache pays too.
            k = k.permute(1, 0, 2).unsqueeze(0).to(self._gc_device, self._gc_dtype)
            v = v.permute(1, 0, 2).unsqueeze(0).to(self._gc_device, self._gc_dtype)
            layer = self.layers[lkv.layer]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            if getattr(layer, "is_sliding", False):
                keep = layer.sliding_window - 1  # what transformers keeps of a window
                layer.keys, layer.values = k[:, :, -keep:], v[:, :, -keep:]
                layer.cumulative_length = self._gc_prefix
            else:
                layer.keys, layer.values = k, v
            self._gc_next += 1

    def loaded_all(self) -> None:
        self._gc_ensure(self._gc_num - 1)

    def update(
        self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        self._gc_ensure(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._gc_ensure(layer_idx)
        return int(super().get_seq_length(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._gc_ensure(layer_idx)
        return super().get_mask_sizes(query_length, layer_idx)  # type: ignore[no-any-return]


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # logits of the last computed chunk, [1, chunk, vocab]
    cache: Any  # the model's cache after the prompt, ready for decoding
    prompt_tokens: int
    reused_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    stored: PutResult | None = None

    @property
    def next_token_logits(self) -> torch.Tensor:
        return self.logits[0, -1]


class TransformersConnector:
    """Binds one model to one GCache namespace."""

    def __init__(
        self,
        client: GCacheClient,
        model: Any,
        model_id: str,
        *,
        block_size: int = 64,
        revision: str = "",
        cache_salt: str = "",
    ) -> None:
        self.client = client
        self.model = model
        self.spec = layout_from_model(model, block_size)
        self.ns: Namespace = client.register_namespace(
            model_id, self.spec, block_size=block_size, revision=revision, cache_salt=cache_salt
        )
        self.block_size = block_size
        self.num_layers = len(self.spec.layers)

    # ---- the two engine calls ------------------------------------------------------

    def store(self, tokens: Any, cache: Any) -> PutResult:
        """After a prefill whose cache holds exactly ``tokens``: store the KV of their
        full blocks. Call it at a block boundary (``prefill`` does) so the sliding
        layers still hold the whole window of the last block."""
        toks = _as_token_array(tokens)
        if cache.get_seq_length() != len(toks):
            raise LayoutError(
                f"cache holds {cache.get_seq_length()} tokens, got {len(toks)} tokens"
            )
        usable = (len(toks) // self.block_size) * self.block_size
        if usable != len(toks):
            raise LayoutError(
                f"store at a block boundary: {len(toks)} tokens is not a multiple of "
                f"{self.block_size} (prefill in two chunks, or use prefill())"
            )
        return self.client.put(self.ns, toks, kv_from_cache(cache))

    def match(self, tokens: Any) -> Match:
        return self.client.match(self.ns, _as_token_array(tokens))

    def load(self, match: Match) -> GCachePrefixCache | None:
        """A cache that fills itself layer by layer from ``match`` as the model runs,
        or ``None`` when nothing matched."""
        if match.tokens == 0:
            return None
        p = next(self.model.parameters())
        return GCachePrefixCache(
            self.model.config,
            self.client.get_layers(match),
            match.tokens,
            self.num_layers,
            p.dtype,
            p.device,
            self.spec.dtype,
        )

    # ---- a whole prefill ---------------------------------------------------------------

    def prefill(self, input_ids: Any, *, store: bool = True, reuse: bool = True) -> PrefillOutput:
        """Prefill a prompt (batch 1), reusing and then storing cached prefixes."""
        with torch.no_grad():
            return self._prefill(input_ids, store, reuse)

    def _prefill(self, input_ids: Any, store: bool, reuse: bool) -> PrefillOutput:
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        toks = ids[0].cpu().numpy()
        n = ids.shape[1]
        t_start = time.perf_counter()
        timings: dict[str, float] = {}
        match: Match | None = None
        reused = 0
        cache: Any = None
        if reuse and n > 1:
            # At least one token must be computed to produce logits.
            match = self.match(toks[: n - 1])
            timings["lookup_s"] = time.perf_counter() - t_start
            cache = self.load(match)
            reused = match.tokens if cache is not None else 0
        try:
            out = self._run(ids, cache, reused, toks, store, timings)
        except PrefixLoadFailed as exc:
            log.warning("prefix load failed (%s); recomputing %d tokens", exc, n)
            reused = 0
            out = self._run(ids, None, 0, toks, store, timings)
        finally:
            if match is not None:
                self.client.release(match)
        logits, final_cache, stored = out
        if isinstance(cache, GCachePrefixCache) and reused:
            timings["wait_s"] = cache.gc_wait_s
        timings["total_s"] = time.perf_counter() - t_start - timings.get("store_s", 0.0)
        return PrefillOutput(logits, final_cache, n, reused, timings, stored)

    def _run(
        self,
        ids: torch.Tensor,
        cache: Any,
        start: int,
        toks: np.ndarray,
        store: bool,
        timings: dict[str, float],
    ) -> tuple[torch.Tensor, Any, PutResult | None]:
        model = self.model
        n = ids.shape[1]
        if cache is None:
            cache = DynamicCache(config=model.config)
        boundary = (n // self.block_size) * self.block_size
        stored = None
        if store and boundary > start and boundary < n:
            model(ids[:, start:boundary], cache=cache, use_cache=True, logits_to_keep=1)
            t0 = time.perf_counter()
            stored = self._safe_store(toks[:boundary], cache)
            timings["store_s"] = time.perf_counter() - t0
            start = boundary
        out = model(ids[:, start:], cache=cache, use_cache=True)
        if store and boundary == n and boundary > 0 and stored is None:
            t0 = time.perf_counter()
            stored = self._safe_store(toks, cache)
            timings["store_s"] = time.perf_counter() - t0
        return out.logits, cache, stored

    def _safe_store(self, toks: np.ndarray, cache: Any) -> PutResult | None:
        try:
            return self.store(toks, cache)
        except GCacheError as exc:  # a store problem must never fail the request
            log.warning("store failed: %s", exc)
            return None


def _as_token_array(tokens: Any) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        arr: np.ndarray = tokens.reshape(-1).cpu().numpy()
        return arr
    return np.asarray(tokens).reshape(-1)
