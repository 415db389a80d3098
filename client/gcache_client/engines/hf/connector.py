"""The transformers connector: :class:`TransformersConnector` binds one model to
one GCache namespace (store, match, load, and a ``prefill`` wiring them)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gcache.config import MetaConfig
from gcache.errors import GCacheError, LayoutError
from gcache.layout import Layout
from gcache_client.engines.hf.cache import GCachePrefixCache, PrefixLoadFailed, WindowCapture
from gcache_client.engines.hf.model import (
    MAX_IDENTITIES,
    kv_from_cache,
    layout_from_model,
    peft_identity,
)
from gcache_client.sync import GCacheClient, SyncLayerStream
from gcache_client.types import KVPair, Match, Namespace, PutResult

log = logging.getLogger("gcache.client.hf")


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
