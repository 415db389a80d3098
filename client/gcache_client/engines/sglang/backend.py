"""SGLang's ``HiCacheStorage`` on GCache: the pools SGLang registers, prefix
presence, zero-copy and flat page transfers, and administration, composed of the
settings (:mod:`.config`), the pools and their namespaces (:mod:`.namespaces`), the
page views (:mod:`.pages`), the page operations on the client's loop (:mod:`.ops`)
and the counters (:mod:`.metrics`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from gcache.errors import ConfigError
from gcache_client.engines.sglang.config import HiCacheGCacheConfig
from gcache_client.engines.sglang.metrics import Metrics
from gcache_client.engines.sglang.namespaces import NamespaceRegistry, Pool
from gcache_client.engines.sglang.ops import PageOps, fail_log, log
from gcache_client.engines.sglang.pages import flat_kv, page_bytes, page_views
from gcache_client.types import KVPair

__all__ = ["GCacheHiCacheStorage"]


class GCacheHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` on GCache: ``StorageBackendFactory`` builds it
    as ``GCacheHiCacheStorage(storage_config, kwargs)`` and registers the host pools
    right after (``register_mem_pool_host``, ``register_mem_host_pool_v2``)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.cfg = HiCacheGCacheConfig.from_extra(storage_config.extra_config)
        sc = storage_config
        if getattr(sc, "dcp_size", 1) > 1:
            raise ConfigError("gcache sglang backend: decode context parallel is not supported")
        if getattr(sc, "should_split_heads", False):
            raise ConfigError(
                "gcache sglang backend: heterogeneous TP (tp_lcm_size) is not supported"
            )
        self.model = self.cfg.model_id or sc.model_name or ""
        if not self.model:
            raise ConfigError("gcache sglang backend: no model name (set model_id)")
        self.interface_v1 = bool((sc.extra_config or {}).get("interface_v1", 0))
        self.is_writer = bool(sc.is_storage_writer)
        self.pools: dict[str, Pool] = {}
        self.registered_pools: dict[str, Any] = {}
        self.mem_pool_host: Any = None
        self.metrics = Metrics(self.cfg.max_metric_samples)
        self.ops = PageOps(self.cfg, self.metrics)
        self.aio = self.ops.aio
        self.namespaces = NamespaceRegistry(self.aio, self.model, self.cfg, sc)
        log.info(
            "GCache HiCache backend: model %s, tp %d/%d, pp %d/%d, %s, meta %s",
            self.model,
            sc.tp_rank,
            sc.tp_size,
            sc.pp_rank,
            sc.pp_size,
            "interface_v1 (zero copy)" if self.interface_v1 else "flat pages",
            self.cfg.client.meta,
        )

    # ---- pools --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor pool (SGLang's KV pool, or a hybrid model's logical anchor)."""
        self.mem_pool_host = mem_pool_host
        self._add_pool(str(PoolName.KV), mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = str(host_pool_name)
        self.registered_pools[name] = host_pool
        anchor = self.pools.get(name)
        if name == str(PoolName.KV) and anchor is not None and anchor.spec is not None:
            return  # the anchor already describes the KV pages
        self._add_pool(name, host_pool)

    def _add_pool(self, name: str, host: Any) -> None:
        pool = Pool.of(name, host, self.storage_config)
        self.pools[name] = pool
        if pool.spec is None:
            return  # logical anchor: no page memory
        log.info(
            "GCache HiCache backend: pool %s: %d regions per page (%d bytes), %s",
            name,
            len(pool.regions),
            sum(pool.regions),
            "shared by every TP rank"
            if pool.shared
            else f"TP rank {self.storage_config.tp_rank}'s own",
        )

    def _pool(self, name: Any) -> Pool | None:
        pool = self.pools.get(str(name))
        if pool is None:
            self.metrics.count("unknown_pool")
            fail_log.log(time.monotonic(), "gcache sglang backend: unregistered pool %s", name)
        return pool

    def _fmt(self) -> str:
        return "pages" if self.interface_v1 else "flat"

    def _kv_pool(self) -> Pool | None:
        return self.pools.get(str(PoolName.KV))

    # ---- presence ------------------------------------------------------------------------

    async def _presence(self, pool: Pool, keys: Sequence[str], fmt: str) -> list[bool]:
        ns = await self.namespaces.get(pool, fmt)
        return await self.ops.gather([self.ops.present(ns, k.encode()) for k in keys])

    def _presence_job(self, pool: Pool, keys: Sequence[str]) -> Callable[[], Awaitable[list[bool]]]:
        return lambda: self._presence(pool, keys, "pages")

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys`` are stored, counted from the first (a prefix)."""
        keys = keys[: self.cfg.max_batch_pages]
        pool = self._kv_pool()
        if not keys or pool is None:
            return 0
        if pool.spec is None:
            return len(keys)  # logical anchor: the v2 pools decide
        fmt = self._fmt()

        def query() -> Awaitable[list[bool]]:
            return self._presence(pool, keys, fmt)

        got: list[bool] = self.ops.run(query, [], "exists")
        hits = got.index(False) if False in got else len(got)
        self.metrics.count("exists_pages", len(keys))
        self.metrics.count("exists_hits", hits)
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable KV prefix given every other pool's hit policy: ALL_PAGES pools
        need every page of it, TRAILING_PAGES pools (SWA, Mamba) only the trailing
        ``len(transfer.keys)`` pages before its end, BLOCK_GROUPS pools report their
        leading whole groups without gating it. ``restorable_prefix_pages``: every
        prefix length all pools can serve (a trailing pool leaves holes)."""
        keys = keys[: self.cfg.max_batch_pages]
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            pool = self._pool(transfer.name)
            present: list[bool] = []
            if pool is not None and pool.spec is not None:
                present = self.ops.run(self._presence_job(pool, keys[:kv_pages]), [], "exists")
            present += [False] * (kv_pages - len(present))
            policy = transfer.hit_policy
            if policy == PoolHitPolicy.TRAILING_PAGES:
                n = max(1, len(transfer.keys) if transfer.keys else 1)
                ok = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - n) : p])}
                boundary = max(ok, default=0)
            elif policy == PoolHitPolicy.BLOCK_GROUPS:
                g = max(1, transfer.group_pages or 1)
                groups = 0
                while (groups + 1) * g <= kv_pages and all(present[groups * g : (groups + 1) * g]):
                    groups += 1
                if groups:
                    hit_count[transfer.name] = groups * g
                continue  # never gates the KV hit
            else:  # ALL_PAGES
                boundary = present.index(False) if False in present else kv_pages
                ok = set(range(1, boundary + 1))
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [p for p in restorable if p in ok]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hit_count, restorable)

    # ---- zero copy (v1 and v2) --------------------------------------------------------------

    def _check_io(self, pool: Pool | None, keys: Sequence[str], host_indices: Any) -> int:
        """Pages a zero-copy call may move (0: none)."""
        if pool is None or not keys or host_indices is None:
            return 0
        n = min(len(keys), self.cfg.max_batch_pages)
        if int(host_indices.numel()) < n * pool.page_size:
            self.metrics.count("bad_indices")
            fail_log.log(
                time.monotonic(),
                "gcache sglang backend: %d host indices for %d pages of %d",
                int(host_indices.numel()),
                n,
                pool.page_size,
            )
            return 0
        return n

    def _io(
        self, pool: Pool | None, keys: list[str], host_indices: Any, is_set: bool
    ) -> list[bool]:
        n = self._check_io(pool, keys, host_indices)
        out = [False] * len(keys)
        if n == 0 or pool is None:
            return out
        spec = pool.spec
        if spec is None:  # a logical anchor: nothing to move
            return [True] * len(keys)
        if is_set and pool.shared and not self.is_writer:
            self.metrics.count("sets_skipped_not_writer", n)
            return [True] * n + [False] * (len(keys) - n)
        t0 = time.perf_counter()

        async def run() -> list[bool]:
            ns = await self.namespaces.get(pool, "pages")
            views = page_views(pool.name, pool.host, spec, pool.page_size, host_indices, n)
            pairs = zip(keys[:n], views, strict=True)
            if is_set:
                jobs = [self.ops.put(pool.name, "pages", ns, k.encode(), v) for k, v in pairs]
            else:
                jobs = [self.ops.get(ns, k.encode(), v) for k, v in pairs]
            return await self.ops.gather(jobs)

        got = self.ops.run(run, [False] * n, "set" if is_set else "get")
        out[:n] = got
        self.metrics.sample(is_set, sum(got), page_bytes(spec), time.perf_counter() - t0)
        return out

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool's pages at ``host_indices``."""
        return self._io(self._kv_pool(), keys, host_indices, is_set=False)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` (copied straight out)."""
        return self._io(self._kv_pool(), keys, host_indices, is_set=True)

    def _io_v2(self, transfers: list[PoolTransfer], is_set: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for t in transfers:
            pool = self._pool(t.name)
            keys = list(t.keys or [])
            indices = t.host_indices
            skip = 0
            cap = self.cfg.trailing_cap(str(t.name))
            if is_set and t.hit_policy == PoolHitPolicy.TRAILING_PAGES and cap is not None:
                skip = max(0, len(keys) - cap)  # strict O(W): only the trailing window
            if skip and pool is not None and indices is not None:
                self.metrics.count("pages_outside_window", skip)
                tail = self._io(pool, keys[skip:], indices[skip * pool.page_size :], is_set)
                results[t.name] = [True] * skip + tail
            else:
                results[t.name] = self._io(pool, keys, indices, is_set)
        return results

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._io_v2(transfers, is_set=False)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Per pool: TRAILING_PAGES pools store at most their ``max_trailing_pages``
        last pages (the pages before them are reported done: they are not needed)."""
        return self._io_v2(transfers, is_set=True)

    # ---- flat data pages (SGLang's non-zero-copy path) -------------------------------------

    def _flat_kv(self, pool: Pool, page: torch.Tensor) -> list[KVPair]:
        spec = pool.flat_spec
        assert spec is not None
        return flat_kv(spec, page)

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Read flat data pages into ``target_locations`` (SGLang's dummy pages)."""
        pool = self._kv_pool()
        if pool is None or pool.flat_spec is None or target_locations is None:
            return [None] * len(keys)
        n = min(len(keys), len(target_locations), self.cfg.max_batch_pages)

        async def run() -> list[bool]:
            ns = await self.namespaces.get(pool, "flat")
            jobs = [
                self.ops.get(ns, k.encode(), self._flat_kv(pool, t))
                for k, t in zip(keys[:n], target_locations[:n], strict=True)
            ]
            return await self.ops.gather(jobs)

        got = self.ops.run(run, [False] * n, "get")
        return [target_locations[i] if i < n and got[i] else None for i in range(len(keys))]

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        pool = self._kv_pool()
        if target_location is None and pool is not None and pool.flat_spec is not None:
            target_location = pool.host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat data pages (``values``); True only if every page went in."""
        pool = self._kv_pool()
        if pool is None or pool.flat_spec is None or values is None:
            return False
        if len(keys) > self.cfg.max_batch_pages or len(values) < len(keys):
            return False
        if pool.shared and not self.is_writer:
            self.metrics.count("sets_skipped_not_writer", len(keys))
            return True

        async def run() -> list[bool]:
            ns = await self.namespaces.get(pool, "flat")
            jobs = [
                self.ops.put(pool.name, "flat", ns, k.encode(), self._flat_kv(pool, v.contiguous()))
                for k, v in zip(keys, values[: len(keys)], strict=True)
            ]
            return await self.ops.gather(jobs)

        return all(self.ops.run(run, [False], "set"))

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    # ---- administration ----------------------------------------------------------------------

    def clear(self) -> bool:
        """Evict every page this backend stored (at most ``max_tracked_pages`` of the
        latest; other engines' pages and older ones stay until GCache evicts them)."""
        entries = self.ops.tracked.take()

        async def run() -> bool:
            async def one(pool_name: str, fmt: str, key: bytes) -> bool:
                pool = self.pools.get(pool_name)
                if pool is None:
                    return False
                ns = await self.namespaces.get(pool, fmt)
                await self.ops.evict(ns, key)
                return True

            return all(await self.ops.gather([one(*e) for e in entries]))

        ok = self.ops.run(run, False, "clear") if entries else True
        self.metrics.count("pages_cleared", len(entries))
        return ok

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch and backup call
        since the last call); None where SGLang's metrics module cannot load."""
        return self.metrics.storage_metrics()

    def stats(self) -> dict[str, int]:
        """The backend's counters and its client's (hits, bytes read, errors, ...)."""
        out = self.metrics.snapshot()
        out["tracked_pages"] = len(self.ops.tracked)
        out["tracked_pages_forgotten"] = self.ops.tracked.forgotten
        out.update({f"client_{k}": v for k, v in self.aio.stats().items()})
        return out

    def close(self) -> None:
        self.ops.close()
