"""Test data: random KV for a layout, as numpy arrays (bf16 as uint16)."""

from __future__ import annotations

import numpy as np

from gcache.layout import LayerSpec, Layout, LayoutSpec
from gcache_client.arrays import NUMPY_DTYPES

KV = list[tuple[np.ndarray, np.ndarray]]


def make_kv(layout: Layout, ntokens: int, seed: int = 0) -> KV:
    rng = np.random.default_rng(seed)
    dt = NUMPY_DTYPES[layout.dtype]
    out = []
    for spec in layout.spec.layers:
        k = rng.integers(0, 255, (ntokens, spec.kv_heads, spec.k_head_dim), dtype=np.uint8)
        v = rng.integers(0, 255, (ntokens, spec.kv_heads, spec.v_head_dim), dtype=np.uint8)
        out.append((k.astype(dt), v.astype(dt)))
    return out


def shared_kv(base: KV, ext: KV, prefix_tokens: int) -> KV:
    """KV of a prompt that shares ``prefix_tokens`` with ``base``: the shared rows
    are identical, as a deterministic model would produce."""
    out = []
    for (bk, bv), (ek, ev) in zip(base, ext, strict=True):
        k, v = ek.copy(), ev.copy()
        k[:prefix_tokens] = bk[:prefix_tokens]
        v[:prefix_tokens] = bv[:prefix_tokens]
        out.append((k, v))
    return out


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 1000).integers(0, 150_000, n, dtype=np.int64)


def tiny_hybrid(block_size: int = 4, window: int = 8) -> LayoutSpec:
    """A 4-layer hybrid layout (full, swa, swa, full) with small heads: fast tests."""
    full = LayerSpec("full", kv_heads=2, k_head_dim=8, v_head_dim=4)
    swa = LayerSpec("swa", kv_heads=1, k_head_dim=8, v_head_dim=4, window=window)
    return LayoutSpec(block_size=block_size, dtype="float16", layers=(full, swa, swa, full))


def assert_layers_match(got: object, kv: KV) -> None:
    """Every returned layer equals the rows of ``kv`` it claims to hold."""
    assert got is not None, "expected a hit, got a miss"
    for layer in got:  # type: ignore[attr-defined]
        k, v = kv[layer.layer]
        n = len(layer.k)
        assert np.array_equal(np.asarray(layer.k), k[layer.start : layer.start + n])
        assert np.array_equal(np.asarray(layer.v), v[layer.start : layer.start + n])
