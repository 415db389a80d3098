"""How SGLang's page keys and a pool, rank and layout become GCache namespaces
and keys.

SGLang hands one hash string per page, already chained over the prefix, so a page
hash names the whole prefix up to that page. Each page is one GCache block of its
own: a one-token "prompt" (:data:`PAGE_TOKENS`, ``block_size`` 1) whose per-block
extra is the page hash. The namespace fingerprint carries the model, the TP rank
and size (none for a pool shared by every rank), the host pool's layout and dtype,
the pool, the pipeline stage and the page geometry (:func:`pool_descriptor`), so
two models, ranks or layouts never share a key. Zero-copy pages ("pages") and
SGLang's flat data pages ("flat") have namespaces of their own."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName

from gcache import layout as laymod
from gcache.errors import GCacheError
from gcache_client.aio import AsyncGCacheClient
from gcache_client.engines.sglang.config import HiCacheGCacheConfig
from gcache_client.engines.sglang.pages import PageGeometry, is_anchor, page_size_of
from gcache_client.types import Namespace

__all__ = ["PAGE_TOKENS", "NamespaceRegistry", "Pool", "Tracked", "pool_descriptor"]

PAGE_TOKENS = np.zeros(1, dtype=np.int32)  # a page is a one-token, one-block "prompt"


def pool_descriptor(name: str, host: Any, geometry: PageGeometry, sc: HiCacheStorageConfig) -> str:
    """The part of pool ``name``'s namespace revision that names its pages: the
    pool, its class, layout, dtype and page geometry and the pipeline (and context
    parallel) stage."""
    parts = [
        "sglang-hicache",
        f"pool={name}",
        f"class={type(host).__name__}",
        f"layout={geometry.layout}",
        f"dtype={geometry.dtype}",
        f"page={geometry.page_size}",
        f"regions={','.join(str(s) for s in geometry.sizes)}",
        f"pp={sc.pp_rank}/{sc.pp_size}",
    ]
    if getattr(sc, "attn_cp_size", 1) > 1:
        parts.append(f"cp={sc.attn_cp_rank}/{sc.attn_cp_size}")
    return ";".join(parts)


@dataclass
class Pool:
    """One registered host pool: its geometry and its GCache namespaces."""

    name: str
    host: Any
    page_size: int
    spec: laymod.LayoutSpec | None  # None: a logical anchor without page memory
    flat_spec: laymod.LayoutSpec | None
    descriptor: str
    shared: bool  # one copy for every TP rank (MLA KV)
    namespaces: dict[str, Namespace] = field(default_factory=dict)  # format -> namespace
    regions: tuple[int, ...] = ()  # bytes of each region of a page

    @classmethod
    def of(cls, name: str, host: Any, sc: HiCacheStorageConfig) -> Pool:
        """Pool ``name`` of ``host`` (a :class:`~gcache.errors.ConfigError` where its
        pages cannot be described). With MLA (KV replicated across ranks) every pool
        but Mamba's is shared by every TP rank."""
        if is_anchor(host):
            return cls(name, host, page_size_of(host), None, None, "", False)
        geo = PageGeometry.of(name, host)
        shared = bool(sc.is_mla_model) and name != str(PoolName.MAMBA)
        descriptor = pool_descriptor(name, host, geo, sc)
        return cls(
            name, host, geo.page_size, geo.spec, geo.flat_spec, descriptor, shared, {}, geo.sizes
        )


class NamespaceRegistry:
    """Registers each pool's namespace per format on first use (and remembers it);
    after a failed registration, fails fast for a second before trying again."""

    def __init__(
        self,
        aio: AsyncGCacheClient,
        model: str,
        cfg: HiCacheGCacheConfig,
        sc: HiCacheStorageConfig,
    ) -> None:
        self.aio = aio
        self.model = model
        self.cfg = cfg
        self.sc = sc
        self._retry_at = 0.0

    async def get(self, pool: Pool, fmt: str) -> Namespace:
        ns = pool.namespaces.get(fmt)
        if ns is not None:
            return ns
        if time.monotonic() < self._retry_at:
            raise GCacheError("namespace registration failed recently; retrying shortly")
        spec = pool.spec if fmt == "pages" else pool.flat_spec
        assert spec is not None
        sc = self.sc
        try:
            ns = await self.aio.register_namespace(
                self.model,
                spec,
                block_size=1,
                revision=f"{self.cfg.revision};{pool.descriptor};format={fmt}",
                tp_size=1 if pool.shared else sc.tp_size,
                tp_rank=0 if pool.shared else sc.tp_rank,
                cache_salt=self.cfg.cache_salt,
            )
        except GCacheError:
            self._retry_at = time.monotonic() + 1.0
            raise
        pool.namespaces[fmt] = ns
        return ns


class Tracked:
    """Page keys this backend stored, per (pool, format): what clear() evicts.
    Bounded: past ``limit`` the oldest is forgotten (it is left to eviction)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[tuple[str, str, bytes], None] = OrderedDict()
        self._lock = threading.Lock()
        self.forgotten = 0

    def add(self, pool: str, fmt: str, key: bytes) -> None:
        with self._lock:
            self._keys[(pool, fmt, key)] = None
            self._keys.move_to_end((pool, fmt, key))
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)
                self.forgotten += 1

    def take(self) -> list[tuple[str, str, bytes]]:
        with self._lock:
            out = list(self._keys)
            self._keys.clear()
            return out

    def __len__(self) -> int:
        return len(self._keys)
