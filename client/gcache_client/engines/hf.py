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
  remaining tokens in one forward, and store. The windows to store (the one
  ending at the last full block, and the checkpoint windows: the last interval
  multiple and the last block boundary before the end) are copied out of the
  sliding layers as the forward computes their rows (:class:`WindowCapture`), so
  any window and block size works (a window is stored rounded up to whole blocks,
  rows transformers itself drops), and the prefill is not split. Any load failure
  during the forward is a miss: the prefill is recomputed from scratch, never run
  on wrong KV; a store failure is logged and ignored.

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

from gcache.config import MetaConfig
from gcache.errors import GCacheError, LayoutError
from gcache.layout import LayerSpec, Layout, LayoutSpec, validate
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
            # Any window: the layout stores ceil((W-1)/block_size) blocks, which may
            # be more rows than the W-1 transformers keeps (WindowCapture keeps them).
            window = int(config.sliding_window)
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


class WindowCapture:
    """Copies of the sliding layers' rows that the windows ending at ``positions``
    (block positions) are stored with, taken as a forward computes (or a load
    brings) them. transformers keeps only ``W - 1`` rows of a sliding layer and
    drops the rest during the forward, while a stored window is
    ``Layout.window_rows`` rows (whole blocks) and may end anywhere inside the
    chunk; so the rows are copied out on the way in, once each, and nothing else
    is kept (O(W) per position)."""

    def __init__(self, layout: Layout, positions: list[int]) -> None:
        self.layout = layout
        self.positions = sorted(set(positions))
        bs = layout.block_size
        # layer -> [(position, first row, end row)] for the sliding layers
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}
        for layer in range(layout.num_layers):
            g = layout.layer_group[layer]
            if layout.group_tail_blocks[g] is None:
                continue
            spans = []
            for c in self.positions:
                blocks = layout.window_blocks(g, c)
                spans.append((c, blocks.start * bs, blocks.stop * bs))
            self.ranges[layer] = spans
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._filled: dict[tuple[int, int], int] = {}

    def wants(self, layer: int) -> bool:
        return layer in self.ranges

    def offer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``[start, start + len(k))`` of ``layer``, token-major
        (``[rows, kv_heads, head_dim]``, any strides)."""
        n = k.shape[0]
        for c, a, b in self.ranges.get(layer, ()):
            lo, hi = max(a, start), min(b, start + n)
            if lo >= hi:
                continue
            key = (c, layer)
            bufs = self._rows.get(key)
            if bufs is None:
                bufs = self._rows[key] = (
                    torch.empty((b - a, *k.shape[1:]), dtype=k.dtype),
                    torch.empty((b - a, *v.shape[1:]), dtype=v.dtype),
                )
            bufs[0][lo - a : hi - a].copy_(k[lo - start : hi - start])
            bufs[1][lo - a : hi - a].copy_(v[lo - start : hi - start])
            self._filled[key] = self._filled.get(key, 0) + hi - lo

    def complete(self, c: int) -> bool:
        return all(
            self._filled.get((c, layer), 0) == b - a
            for layer, spans in self.ranges.items()
            for c2, a, b in spans
            if c2 == c
        )

    def window(self, c: int, layer: int) -> KVPair:
        """The captured rows of the window ending at block ``c`` for ``layer``."""
        return self._rows[(c, layer)]

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._rows.values())


class GCachePrefixCache(DynamicCache):  # type: ignore[misc]
    """A ``DynamicCache`` whose first ``prefix_tokens`` come from GCache, layer by
    layer, the first time the model touches each layer (none without a
    ``stream``). With a :class:`WindowCapture`, the sliding layers' rows that
    windows to store need are copied out as they arrive (loaded or computed)."""

    def __init__(
        self,
        config: Any,
        stream: SyncLayerStream | None,
        prefix_tokens: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
        layout_dtype: str,
        capture: WindowCapture | None = None,
    ) -> None:
        super().__init__(config=config)
        self._gc_stream = stream
        self._gc_next = 0 if stream is not None else num_layers
        self._gc_prefix = prefix_tokens
        self._gc_num = num_layers
        self._gc_dtype = dtype
        self._gc_device = device
        self._gc_layout_dtype = layout_dtype
        self.gc_capture = capture
        self.gc_wait_s = 0.0  # time the forward pass spent waiting for bytes

    def _gc_ensure(self, layer_idx: int) -> None:
        top = min(layer_idx, self._gc_num - 1)
        while self._gc_next <= top:
            assert self._gc_stream is not None
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
            cap = self.gc_capture
            if cap is not None and cap.wants(lkv.layer):
                cap.offer(lkv.layer, lkv.start, k, v)
            # [rows, heads, dim] -> [1, heads, rows, dim] as a view: the model's own
            # update() concatenates the new tokens onto it, which is the one copy
            # the in-process cache pays too.
            k = k.permute(1, 0, 2).unsqueeze(0).to(self._gc_device, self._gc_dtype)
            v = v.permute(1, 0, 2).unsqueeze(0).to(self._gc_device, self._gc_dtype)
            layer = self.layers[lkv.layer]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            if getattr(layer, "is_sliding", False):
                # The stored window may be up to a block longer than the W - 1
                # rows transformers keeps of it.
                keep = layer.sliding_window - 1
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
        cap = self.gc_capture
        if cap is not None and cap.wants(layer_idx):
            layer = self.layers[layer_idx]
            start = int(getattr(layer, "cumulative_length", 0)) if layer.is_initialized else 0
            cap.offer(
                layer_idx, start, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._gc_ensure(layer_idx)
        return int(super().get_seq_length(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._gc_ensure(layer_idx)
        return super().get_mask_sizes(query_length, layer_idx)  # type: ignore[no-any-return]


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # logits of the prompt's last token, [1, 1, vocab]
    cache: Any  # the model's cache after the prompt, ready for decoding
    prompt_tokens: int
    reused_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    stored: PutResult | None = None  # the put of the prompt's full blocks
    checkpoints: list[int] = field(default_factory=list)  # windows saved inside it

    @property
    def next_token_logits(self) -> torch.Tensor:
        return self.logits[0, -1]


MAX_IDENTITIES = 64  # adapter namespaces a connector keeps registered


def peft_identity(model: Any, cache: dict[tuple[Any, ...], str] | None = None) -> str:
    """The KV identity of a (PEFT) model: ``""`` for a plain model; for a model
    with LoRA adapters, the active adapters' names with a fingerprint (xxh3-128)
    of each one's weights, e.g. ``"lora=math@<hex>"``. ``cache`` keeps fingerprints
    per (adapter, parameter versions), so weights changed in place are hashed anew."""
    import xxhash

    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return ""
    active = getattr(model, "active_adapters", None)
    names = list(active() if callable(active) else active or [])
    disabled = getattr(model, "_adapters_disabled", False) is True or any(
        getattr(m, "_disable_adapters", False) is True for m in model.modules()
    )
    if disabled or not names:  # PeftModel.disable_adapter(): the base model's KV
        return ""
    parts = []
    for name in sorted(names):
        params = sorted(
            (k, p)
            for k, p in model.named_parameters()
            if f".{name}." in k or k.endswith(f".{name}")
        )
        key = (name, tuple((k, p.data_ptr(), p._version) for k, p in params))
        fp = cache.get(key) if cache is not None else None
        if fp is None:
            h = xxhash.xxh3_128()
            h.update(repr(sorted(peft_config[name].to_dict().items(), key=str)).encode())
            for k, p in params:
                h.update(k.encode())
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            fp = h.hexdigest()
            if cache is not None:
                if len(cache) >= MAX_IDENTITIES:  # bounded: oldest out
                    cache.pop(next(iter(cache)))
                cache[key] = fp
        parts.append(f"lora={name}@{fp}")
    return ",".join(parts)


class TransformersConnector:
    """Binds one model to one GCache namespace.

    ``checkpoint_interval`` (tokens; the meta's ``checkpoint_interval`` by
    default, 0: off) and ``checkpoint_last`` choose the extra windows a prefill
    saves besides the one at its last full block (:meth:`Layout.checkpoint_positions`
    with the match as the branch point): the last interval multiple before the
    end, and the last block boundary before the end (so the same block-aligned
    prompt sent again resumes one block before its end)."""

    def __init__(
        self,
        client: GCacheClient,
        model: Any,
        model_id: str,
        *,
        block_size: int = 64,
        revision: str = "",
        cache_salt: str = "",
        kv_identity: str | None = None,
        checkpoint_interval: int = MetaConfig.checkpoint_interval,
        checkpoint_last: bool = True,
    ) -> None:
        if checkpoint_interval < 0:
            raise LayoutError(f"checkpoint_interval must be >= 0, got {checkpoint_interval}")
        self.client = client
        self.model = model
        self.spec = layout_from_model(model, block_size)
        self.model_id, self.revision, self.cache_salt = model_id, revision, cache_salt
        # What besides the tokens changes the KV: given, or (None) read off the model
        # at every call: a PEFT model's active LoRA adapters and their weights.
        self.fixed_identity = kv_identity
        self._fingerprints: dict[tuple[Any, ...], str] = {}
        self._namespaces: dict[str, Namespace] = {}
        self.layout: Layout = self.ns.layout
        self.block_size = block_size
        self.num_layers = len(self.spec.layers)
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_last = checkpoint_last
        self.counters: dict[str, int] = {
            "prefills": 0,
            "prompt_tokens": 0,
            "reused_tokens": 0,
            "load_failures": 0,
            "puts": 0,
            "put_failures": 0,
            "checkpoint_windows": 0,
            "captured_bytes": 0,
        }

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    @property
    def kv_identity(self) -> str:
        """The identity the next put or match is keyed by (:func:`peft_identity`)."""
        if self.fixed_identity is not None:
            return self.fixed_identity
        return peft_identity(self.model, self._fingerprints)

    @property
    def ns(self) -> Namespace:
        """The namespace of the model's current identity (registered once each)."""
        ident = self.kv_identity
        ns = self._namespaces.get(ident)
        if ns is None:
            if len(self._namespaces) >= MAX_IDENTITIES:
                self._namespaces.pop(next(iter(self._namespaces)))
            ns = self._namespaces[ident] = self.client.register_namespace(
                self.model_id,
                self.spec,
                block_size=self.spec.block_size,
                revision=self.revision,
                cache_salt=self.cache_salt,
                kv_identity=ident,
            )
        return ns

    # ---- the two engine calls ------------------------------------------------------

    def store(self, tokens: Any, cache: Any) -> PutResult:
        """After a prefill whose cache holds exactly ``tokens``: store the KV of their
        full blocks. Call it at a block boundary. A plain ``DynamicCache`` holds
        only ``W - 1`` rows of a sliding layer, so this works when the stored window
        (``Layout.window_rows``) is no longer; :meth:`prefill` has no such limit."""
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

    def load(self, match: Match, capture: WindowCapture | None = None) -> GCachePrefixCache | None:
        """A cache that fills itself layer by layer from ``match`` as the model runs,
        or ``None`` when nothing matched (with a ``capture``: an empty cache that
        copies the windows out)."""
        if match.tokens == 0:
            return None if capture is None else self._cache(None, 0, capture)
        return self._cache(self.client.get_layers(match), match.tokens, capture)

    def _cache(
        self, stream: SyncLayerStream | None, prefix: int, capture: WindowCapture | None
    ) -> GCachePrefixCache:
        p = next(self.model.parameters())
        return GCachePrefixCache(
            self.model.config,
            stream,
            prefix,
            self.num_layers,
            p.dtype,
            p.device,
            self.spec.dtype,
            capture,
        )

    def windows_to_save(self, nblocks: int, matched: int) -> list[int]:
        """Block positions whose windows a prefill of a prompt with ``nblocks`` full
        blocks saves, given ``matched`` blocks came from GCache (its window is
        there already): the end, and the checkpoints inside the computed part."""
        layout = self.layout
        if nblocks <= matched:
            return []
        interval = self.checkpoint_interval // self.block_size
        first = max(0, matched - layout.max_tail)  # sliding rows held: loaded or computed
        ckpts = layout.checkpoint_positions(
            nblocks, matched, first, interval, False, last=self.checkpoint_last
        )
        return sorted({nblocks, *(c for c in ckpts if matched < c < nblocks)})

    # ---- a whole prefill ---------------------------------------------------------------

    def prefill(self, input_ids: Any, *, store: bool = True, reuse: bool = True) -> PrefillOutput:
        """Prefill a prompt (batch 1), reusing and then storing cached prefixes."""
        with torch.no_grad():
            return self._prefill(input_ids, store, reuse)

    def _prefill(self, input_ids: Any, store: bool, reuse: bool) -> PrefillOutput:
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        toks = ids[0].cpu().numpy()
        n = ids.shape[1]
        nblocks = n // self.block_size
        t_start = time.perf_counter()
        timings: dict[str, float] = {}
        match: Match | None = None
        reused = 0
        if reuse and n > 1:
            # At least one token must be computed to produce logits.
            match = self.match(toks[: n - 1])
            timings["lookup_s"] = time.perf_counter() - t_start
            reused = match.tokens
        try:
            positions = self.windows_to_save(nblocks, reused // self.block_size) if store else []
            capture = WindowCapture(self.layout, positions) if positions else None
            stream = self.client.get_layers(match) if match is not None and reused else None
            cache = self._cache(stream, reused, capture)
            try:
                logits = self._forward(ids[:, reused:], cache)
            except PrefixLoadFailed as exc:
                log.warning("prefix load failed (%s); recomputing %d tokens", exc, n)
                self.counters["load_failures"] += 1
                reused = 0
                positions = self.windows_to_save(nblocks, 0) if store else []
                capture = WindowCapture(self.layout, positions) if positions else None
                cache = self._cache(None, 0, capture)
                logits = self._forward(ids, cache)
        finally:
            if match is not None:
                self.client.release(match)
        cache.gc_capture = None  # decoding goes on without copying anything out
        if reused:
            timings["wait_s"] = cache.gc_wait_s
        timings["total_s"] = time.perf_counter() - t_start
        self.counters["prefills"] += 1
        self.counters["prompt_tokens"] += n
        self.counters["reused_tokens"] += reused
        stored: PutResult | None = None
        saved: list[int] = []
        if capture is not None:
            t0 = time.perf_counter()
            stored, saved = self.save_windows(toks, cache, capture)
            timings["store_s"] = time.perf_counter() - t0
        return PrefillOutput(logits, cache, n, reused, timings, stored, saved)

    def _forward(self, ids: torch.Tensor, cache: GCachePrefixCache) -> torch.Tensor:
        out = self.model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache.loaded_all()  # a model that skipped a layer's cache still gets it
        logits: torch.Tensor = out.logits
        return logits

    def save_windows(
        self, toks: np.ndarray, cache: GCachePrefixCache, capture: WindowCapture
    ) -> tuple[PutResult | None, list[int]]:
        """Put the prompt's full blocks with the window at its end, then each
        checkpoint window (a put of the prefix ending there: its full objects are
        stored already, so only the window's objects are written)."""
        bs = self.block_size
        layout = self.layout
        end = capture.positions[-1]
        full: dict[int, KVPair] = {}
        for layer in range(self.num_layers):
            if not capture.wants(layer):
                lay = cache.layers[layer]
                full[layer] = (
                    lay.keys[0, :, : end * bs].transpose(0, 1).contiguous().cpu(),
                    lay.values[0, :, : end * bs].transpose(0, 1).contiguous().cpu(),
                )
        self.counters["captured_bytes"] += capture.nbytes()
        main: PutResult | None = None
        saved: list[int] = []
        # The end first: it stores the full objects the checkpoints share.
        for c in [end, *capture.positions[:-1]]:
            if not capture.complete(c):
                log.warning("window at block %d not fully computed; not stored", c)
                continue
            kv: list[KVPair] = []
            for layer in range(layout.num_layers):
                if capture.wants(layer):
                    kv.append(capture.window(c, layer))
                else:
                    k, v = full[layer]
                    kv.append((k[: c * bs], v[: c * bs]))
            res = self._safe_put(toks[: c * bs], kv)
            if c == end:
                main = res
            elif res is not None and res.ok:
                saved.append(c)
                self.counters["checkpoint_windows"] += 1
        return main, saved

    def _safe_put(self, toks: np.ndarray, kv: list[KVPair]) -> PutResult | None:
        self.counters["puts"] += 1
        try:
            res = self.client.put(self.ns, toks, kv)
        except GCacheError as exc:  # a store problem must never fail the request
            log.warning("store failed: %s", exc)
            self.counters["put_failures"] += 1
            return None
        if not res.ok:
            self.counters["put_failures"] += 1
        return res

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
