"""Page geometry and the copies between SGLang's host pool and GCache.

The host pool describes where a page lies with ``get_page_buffer_meta`` (SGLang's
zero-copy v1 interface): a fixed list of regions per page. Each region is one layer
of the page's GCache layout (its first half as "K", its second as "V"); the copies
are numpy views straight over the pool's memory (no staging)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gcache import layout as laymod
from gcache.errors import ConfigError, GCacheError
from gcache_client.arrays import NUMPY_DTYPES
from gcache_client.types import KVPair

__all__ = [
    "SUPPORTED_LAYOUTS",
    "PageGeometry",
    "flat_kv",
    "layout_for_regions",
    "page_bytes",
    "page_kv",
    "page_views",
]

# Host layouts whose pages get_page_buffer_meta describes (SGLang's v1 interface).
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_MAX_DIM = 65536  # gcache.layout: kv_heads and head dims are at most this


def _split(n: int) -> tuple[int, int]:
    """``n`` elements as ``heads * dim`` with both at most 65536 (the fewest heads)."""
    for heads in range(max(1, -(-n // _MAX_DIM)), _MAX_DIM + 1):
        if n % heads == 0:
            return heads, n // heads
    raise ConfigError(f"gcache sglang backend: a page region of {n} elements cannot be laid out")


def layout_for_regions(sizes: Sequence[int], dtype: str) -> laymod.LayoutSpec:
    """The GCache layout of one page made of regions of ``sizes`` bytes: one layer
    per region, its first half as K and its second as V, block size 1 (a page)."""
    gdtype = dtype if dtype in laymod.DTYPE_SIZES else "uint8"
    esize = laymod.DTYPE_SIZES[gdtype]
    layers = []
    for i, size in enumerate(sizes):
        if size <= 0 or size % (2 * esize):
            raise ConfigError(
                f"gcache sglang backend: page region {i} has {size} bytes, not two equal "
                f"halves of {gdtype}"
            )
        heads, dim = _split(size // esize // 2)
        layers.append(laymod.LayerSpec("full", kv_heads=heads, k_head_dim=dim, v_head_dim=dim))
    return laymod.LayoutSpec(block_size=1, dtype=gdtype, layers=tuple(layers))


def page_bytes(spec: laymod.LayoutSpec | None) -> int:
    """Bytes of one page laid out as ``spec`` (0 without one)."""
    return 0 if spec is None else laymod.Layout(spec).group_object_bytes[0]


def page_size_of(host: Any) -> int:
    """Tokens per page of a host pool."""
    return int(getattr(host, "page_size", 1) or 1)


def is_anchor(host: Any) -> bool:
    """A logical anchor pool: no page memory of its own."""
    return getattr(host, "kv_buffer", True) is None


@dataclass(frozen=True)
class PageGeometry:
    """How one host pool lays out a page: its regions and their GCache layouts
    (``spec`` for zero-copy pages, ``flat_spec`` for SGLang's flat data pages)."""

    layout: str
    dtype: str
    page_size: int
    sizes: tuple[int, ...]  # bytes of each region of a page
    spec: laymod.LayoutSpec
    flat_spec: laymod.LayoutSpec

    @classmethod
    def of(cls, name: str, host: Any) -> PageGeometry:
        """The geometry of pool ``name`` (a :class:`ConfigError` where the backend
        cannot describe its pages)."""
        page_size = page_size_of(host)
        layout = str(getattr(host, "layout", ""))
        if layout not in SUPPORTED_LAYOUTS:
            raise ConfigError(
                f"gcache sglang backend: host layout {layout!r} of pool {name} is not "
                f"supported (supported: {', '.join(SUPPORTED_LAYOUTS)})"
            )
        meta = getattr(host, "get_page_buffer_meta", None)
        if meta is None:
            raise ConfigError(
                f"gcache sglang backend: pool {name} ({type(host).__name__}) has no "
                "get_page_buffer_meta"
            )
        _, raw_sizes = meta(torch.arange(page_size, dtype=torch.int64))
        sizes = tuple(int(s) for s in raw_sizes)
        dtype = str(getattr(host, "dtype", "uint8")).removeprefix("torch.")
        spec = layout_for_regions(sizes, dtype)
        flat = host.get_dummy_flat_data_page()
        flat_bytes = int(flat.numel()) * int(flat.element_size())
        flat_spec = layout_for_regions([flat_bytes], dtype)
        return cls(layout, dtype, page_size, sizes, spec, flat_spec)


def _byte_array(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 view of ``size`` bytes of host memory at ``ptr``."""
    raw = (ctypes.c_ubyte * size).from_address(ptr)
    return np.ctypeslib.as_array(raw)


def page_kv(spec: laymod.LayoutSpec, ptrs: Sequence[int], sizes: Sequence[int]) -> list[KVPair]:
    """Per layer (region) of ``spec`` the (K, V) numpy views of one page's memory."""
    npdt = NUMPY_DTYPES[spec.dtype]
    out: list[KVPair] = []
    for layer, ptr, size in zip(spec.layers, ptrs, sizes, strict=True):
        arr = _byte_array(ptr, size)
        half = size // 2
        shape = (1, layer.kv_heads, layer.k_head_dim)
        out.append((arr[:half].view(npdt).reshape(shape), arr[half:].view(npdt).reshape(shape)))
    return out


def page_views(
    name: str,
    host: Any,
    spec: laymod.LayoutSpec,
    page_size: int,
    host_indices: torch.Tensor,
    npages: int,
) -> list[list[KVPair]]:
    """Per page the (K, V) views of the host pages at ``host_indices`` of pool
    ``name``, checked against its layout ``spec``."""
    idx = host_indices.detach().to("cpu", torch.int64)[: npages * page_size]
    ptrs, sizes = host.get_page_buffer_meta(idx)
    r = len(spec.layers)
    if len(ptrs) != npages * r:
        raise GCacheError(f"pool {name}: {len(ptrs)} page regions for {npages} pages")
    want = [layer.kv_heads * layer.k_head_dim for layer in spec.layers]
    esize = laymod.DTYPE_SIZES[spec.dtype]
    for i, s in enumerate(sizes):
        if int(s) != 2 * esize * want[i % r]:
            raise GCacheError(f"pool {name}: page region of {s} bytes, layout differs")
    return [
        page_kv(spec, ptrs[i * r : (i + 1) * r], sizes[i * r : (i + 1) * r]) for i in range(npages)
    ]


def flat_kv(spec: laymod.LayoutSpec, page: torch.Tensor) -> list[KVPair]:
    """The (K, V) views of one flat data page (a contiguous CPU tensor)."""
    t = page.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        raise GCacheError("flat page must be a contiguous CPU tensor")
    nbytes = int(t.numel()) * int(t.element_size())
    return page_kv(spec, [int(t.data_ptr())], [nbytes])
