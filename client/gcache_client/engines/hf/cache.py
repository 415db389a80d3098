"""The cache objects of a transformers forward on GCache: :class:`GCachePrefixCache`
(a ``DynamicCache`` whose prefix loads layer by layer as the model reaches each
layer) and :class:`WindowCapture` (the sliding layers' rows the windows to store
need, copied out as the forward produces them)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from gcache.errors import GCacheError
from gcache.layout import Layout
from gcache_client import arrays
from gcache_client.sync import SyncLayerStream
from gcache_client.types import KVPair


def set_layer_kv(layer: Any, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
    """A ``DynamicCache`` layer holding the prefix's ``k`` / ``v`` (``[1, heads,
    rows, dim]``, the rows a load brought). A sliding layer keeps what
    transformers keeps of it, the last ``W - 1`` rows (a stored window may be up to
    a block longer: ``Layout.window_rows``), and counts all ``tokens`` of the
    prefix as seen."""
    if not layer.is_initialized:
        layer.lazy_initialization(k, v)
    if getattr(layer, "is_sliding", False):
        keep = layer.sliding_window - 1
        layer.keys, layer.values = k[:, :, -keep:], v[:, :, -keep:]
        layer.cumulative_length = tokens
    else:
        layer.keys, layer.values = k, v


class PrefixLoadFailed(GCacheError):
    """Raised inside a forward pass when a prefix layer could not be loaded; the
    connector catches it and recomputes (a miss)."""


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
            set_layer_kv(self.layers[lkv.layer], k, v, self._gc_prefix)
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
