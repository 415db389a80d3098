"""SGLang HiCache storage backend on GCache (sglang 0.5.x, tested with 0.5.23).

Loaded by SGLang's dynamic backend factory, with no change to SGLang::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "gcache",
        "module_path": "gcache_client.sglang", "class_name": "GCacheHiCacheStorage",
        "interface_v1": 1, "meta": "10.0.0.5:7700", "meta_grpc": "10.0.0.5:7701"}'

Keys. SGLang hands one hash string per page, already chained over the prefix
(``get_hash_str``), so a page hash names the whole prefix up to that page. Each
page is one GCache block of its own, keyed with the public client API: a
one-token "prompt" (token 0, ``block_size`` 1) whose per-block extra is the page
hash, i.e. ``xxh3_128(namespace fingerprint || int32 0 || hash)``
(:func:`gcache.keys.block_keys`). The namespace fingerprint carries the model,
the TP rank and size, the host pool's layout and dtype, the pool (KV, SWA,
Mamba, ...), the pipeline stage and the page geometry, so two models, ranks or
layouts never share a key. The pages are independent roots of the meta's index
(not a chain): SGLang calls with any run of a sequence's pages (a batch of 128,
a radix node's pages), never necessarily from its first page, and a GCache chain
would fix each page's position at its first put. Prefix semantics stay SGLang's:
``batch_exists`` counts the leading pages present.

Bytes. The host pool describes where a page lies with ``get_page_buffer_meta``
(SGLang's zero-copy v1 interface): a fixed list of regions per page (K and V of
every layer for ``layer_first``, one K and one V region for ``page_first``,
``page_first_direct`` and ``page_head``, one region per page or layer for MLA).
Each region is one layer of the GCache layout (its first half as "K", its second
as "V", a byte container: the client checksums each layer with xxh3-64 on put
and verifies it on every read). Puts copy straight out of the host pages and
reads land straight in them (numpy views over the pool's memory, no staging).
The non-zero-copy ``get``/``set``/``batch_get``/``batch_set`` (SGLang's flat
data pages) use a namespace of their own ("flat" format), so the two formats
never mix.

Parallelism. Every TP rank reads and writes its own shard's namespace. With MLA
(``is_mla_model``, KV replicated across ranks) the KV namespace is shared by
every rank; only the storage writer (rank 0) stores, the others' sets are
skipped (reported done), all read the one copy. Mamba state stays per rank.

Sliding window (v2, ``PoolHitPolicy.TRAILING_PAGES``): a hybrid model's SWA or
Mamba pool stores only the trailing pages SGLang hands it, capped per pool by
``max_trailing_pages`` (GCache's strict O(W): the window a match ending there
needs), and ``batch_exists_v2`` reports the prefix lengths whose trailing
window is complete on every pool.

Failures are misses: a store that is down, slow or returns bytes failing their
checksum makes pages missing (``False``/``None``/0), never an exception into
SGLang; misuse (a layout the backend cannot describe, an unknown setting) is a
:class:`~gcache.errors.ConfigError` when the backend is built or the pool is
registered.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
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

from gcache import layout as laymod
from gcache.config import ClientConfig
from gcache.errors import ConfigError, GCacheError
from gcache.transport.limits import RateLimitedLog
from gcache_client.aio import AsyncGCacheClient
from gcache_client.arrays import NUMPY_DTYPES
from gcache_client.loopthread import LoopThread
from gcache_client.types import KVPair, Namespace

__all__ = ["GCacheHiCacheStorage", "HiCacheGCacheConfig"]

log = logging.getLogger("gcache.client.sglang")
fail_log = RateLimitedLog(log)
T = TypeVar("T")

# Keys SGLang itself reads from the extra config (or leaves in it): accepted, not ours.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
# Host layouts whose pages get_page_buffer_meta describes (SGLang's v1 interface).
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_CLIENT_FIELDS = {f.name: f for f in dataclasses.fields(ClientConfig)}
_PAGE_TOKENS = np.zeros(1, dtype=np.int32)  # a page is a one-token, one-block "prompt"
_MAX_DIM = 65536  # gcache.layout: kv_heads and head dims are at most this


@dataclass(frozen=True)
class HiCacheGCacheConfig:
    """The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``
    (every ``ClientConfig`` field may be given too: ``meta``, ``meta_grpc``,
    ``transport``, ``timeout_s``, ``token_file``, ...). SGLang's own keys
    (:data:`SGLANG_KEYS`) are accepted and ignored; anything else is an error."""

    model_id: str = ""  # namespace model id; default: SGLang's model name
    revision: str = ""  # namespace revision (weights version)
    cache_salt: str = ""  # isolates tenants sharing one GCache
    max_batch_pages: int = 1024  # pages one call handles; past it they are misses
    max_pages_in_flight: int = 64  # page operations in flight at once (per backend)
    batch_timeout_s: float = 30.0  # a whole batch call; past it its pages are misses
    # TRAILING_PAGES pools: at most this many trailing pages stored per set, by pool
    # name ({"swa": 2}); pools not named store every page SGLang hands over.
    max_trailing_pages: tuple[tuple[str, int], ...] = ()
    max_tracked_pages: int = 1 << 20  # pages remembered for clear() (oldest forgotten)
    max_metric_samples: int = 1024  # get_stats() samples kept between two calls
    client: ClientConfig = field(default_factory=ClientConfig)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> HiCacheGCacheConfig:
        own = {f.name for f in dataclasses.fields(cls)} - {"client"}
        mine: dict[str, Any] = {}
        client: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if key in SGLANG_KEYS:
                continue
            if key in own:
                mine[key] = value
            elif key in _CLIENT_FIELDS:
                client[key] = value
            else:
                known = sorted(own | set(_CLIENT_FIELDS))
                raise ConfigError(
                    f"gcache sglang backend: unknown setting {key!r} (known: {', '.join(known)})"
                )
        trailing = mine.pop("max_trailing_pages", {})
        if not isinstance(trailing, Mapping) or not all(
            isinstance(k, str) and type(v) is int for k, v in trailing.items()
        ):
            raise ConfigError(
                "gcache sglang backend: max_trailing_pages must map pool names to page counts"
            )
        for name, value in mine.items():
            want = type(getattr(cls(), name))
            if want is float and type(value) is int:
                mine[name] = value = float(value)
            if type(value) is not want:
                raise ConfigError(
                    f"gcache sglang backend: {name} must be {want.__name__}, "
                    f"got {type(value).__name__}"
                )
        for name, value in client.items():
            want_c = type(_CLIENT_FIELDS[name].default)
            if want_c is float and type(value) is int:
                client[name] = float(value)
            elif type(value) is not want_c:
                raise ConfigError(
                    f"gcache sglang backend: {name} must be {want_c.__name__}, "
                    f"got {type(value).__name__}"
                )
        cfg = cls(
            **mine,
            max_trailing_pages=tuple(sorted(trailing.items())),
            client=dataclasses.replace(ClientConfig(), **client),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        for name in ("max_batch_pages", "max_pages_in_flight", "max_tracked_pages"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"gcache sglang backend: {name} must be >= 1, got {getattr(self, name)}"
                )
        if self.max_metric_samples < 0:
            raise ConfigError("gcache sglang backend: max_metric_samples must be >= 0")
        if not self.batch_timeout_s > 0:
            raise ConfigError(
                f"gcache sglang backend: batch_timeout_s must be > 0, got {self.batch_timeout_s}"
            )
        for name, pages in self.max_trailing_pages:
            if pages < 1:
                raise ConfigError(
                    f"gcache sglang backend: max_trailing_pages[{name!r}] must be >= 1"
                )
        self.client.check()

    def trailing_cap(self, pool: str) -> int | None:
        return dict(self.max_trailing_pages).get(pool)


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


def _byte_array(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 view of ``size`` bytes of host memory at ``ptr``."""
    raw = (ctypes.c_ubyte * size).from_address(ptr)
    return np.ctypeslib.as_array(raw)


def _page_kv(spec: laymod.LayoutSpec, ptrs: Sequence[int], sizes: Sequence[int]) -> list[KVPair]:
    """Per layer (region) of ``spec`` the (K, V) numpy views of one page's memory."""
    npdt = NUMPY_DTYPES[spec.dtype]
    out: list[KVPair] = []
    for layer, ptr, size in zip(spec.layers, ptrs, sizes, strict=True):
        arr = _byte_array(ptr, size)
        half = size // 2
        shape = (1, layer.kv_heads, layer.k_head_dim)
        out.append((arr[:half].view(npdt).reshape(shape), arr[half:].view(npdt).reshape(shape)))
    return out


@dataclass
class _Pool:
    """One registered host pool: its geometry and its GCache namespaces."""

    name: str
    host: Any
    page_size: int
    spec: laymod.LayoutSpec | None  # None: a logical anchor without page memory
    flat_spec: laymod.LayoutSpec | None
    descriptor: str
    shared: bool  # one copy for every TP rank (MLA KV)
    namespaces: dict[str, Namespace] = field(default_factory=dict)  # format -> namespace


class _Tracked:
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
        self.pools: dict[str, _Pool] = {}
        self.registered_pools: dict[str, Any] = {}
        self.mem_pool_host: Any = None
        self.counters: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        n = self.cfg.max_metric_samples
        self._prefetch_pages: deque[int] = deque(maxlen=n)
        self._backup_pages: deque[int] = deque(maxlen=n)
        self._prefetch_gbps: deque[float] = deque(maxlen=n)
        self._backup_gbps: deque[float] = deque(maxlen=n)
        self._tracked = _Tracked(self.cfg.max_tracked_pages)
        self._ns_lock = threading.Lock()
        self._ns_retry_at = 0.0
        self._closed = False
        self._lt = LoopThread("gcache-sglang")
        self.aio = AsyncGCacheClient(self.cfg.client)
        self._sem = asyncio.Semaphore(self.cfg.max_pages_in_flight)
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
        sc = self.storage_config
        page_size = int(getattr(host, "page_size", 1) or 1)
        layout = str(getattr(host, "layout", ""))
        if getattr(host, "kv_buffer", True) is None:  # logical anchor: no page memory
            self.pools[name] = _Pool(name, host, page_size, None, None, "", False)
            return
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
        _, sizes = meta(torch.arange(page_size, dtype=torch.int64))
        dtype = str(getattr(host, "dtype", "uint8")).removeprefix("torch.")
        spec = layout_for_regions([int(s) for s in sizes], dtype)
        flat = host.get_dummy_flat_data_page()
        flat_bytes = int(flat.numel()) * int(flat.element_size())
        flat_spec = layout_for_regions([flat_bytes], dtype)
        shared = bool(sc.is_mla_model) and name != str(PoolName.MAMBA)
        parts = [
            "sglang-hicache",
            f"pool={name}",
            f"class={type(host).__name__}",
            f"layout={layout}",
            f"dtype={dtype}",
            f"page={page_size}",
            f"regions={','.join(str(int(s)) for s in sizes)}",
            f"pp={sc.pp_rank}/{sc.pp_size}",
        ]
        if getattr(sc, "attn_cp_size", 1) > 1:
            parts.append(f"cp={sc.attn_cp_rank}/{sc.attn_cp_size}")
        descriptor = ";".join(parts)
        self.pools[name] = _Pool(name, host, page_size, spec, flat_spec, descriptor, shared)
        log.info(
            "GCache HiCache backend: pool %s: %d regions per page (%d bytes), %s",
            name,
            len(sizes),
            sum(int(s) for s in sizes),
            "shared by every TP rank" if shared else f"TP rank {sc.tp_rank}'s own",
        )

    # ---- the loop and namespaces -----------------------------------------------------

    def _run(self, make: Callable[[], Awaitable[T]], default: T, what: str) -> T:
        """Run ``make()`` on the client's loop, bounded by ``batch_timeout_s``; any
        failure is logged (rate-limited) and gives ``default`` (a miss)."""
        if self._closed:
            return default

        async def bounded() -> T:
            return await asyncio.wait_for(make(), self.cfg.batch_timeout_s)

        try:
            return self._lt.run(bounded())
        except Exception as exc:  # a store failure is a miss, never SGLang's problem
            self._count(f"{what}_errors")
            fail_log.log(time.monotonic(), "gcache sglang backend: %s failed (miss): %r", what, exc)
            return default

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.counters[name] += n

    async def _namespace(self, pool: _Pool, fmt: str) -> Namespace:
        ns = pool.namespaces.get(fmt)
        if ns is not None:
            return ns
        if time.monotonic() < self._ns_retry_at:
            raise GCacheError("namespace registration failed recently; retrying shortly")
        spec = pool.spec if fmt == "pages" else pool.flat_spec
        assert spec is not None
        sc = self.storage_config
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
            self._ns_retry_at = time.monotonic() + 1.0
            raise
        pool.namespaces[fmt] = ns
        return ns

    def _pool(self, name: Any) -> _Pool | None:
        pool = self.pools.get(str(name))
        if pool is None:
            self._count("unknown_pool")
            fail_log.log(time.monotonic(), "gcache sglang backend: unregistered pool %s", name)
        return pool

    # ---- per page, on the loop ---------------------------------------------------------

    async def _present(self, ns: Namespace, key: bytes) -> bool:
        async with self._sem:
            return await self.aio.lookup(ns, _PAGE_TOKENS, extras=[key]) > 0

    async def _put(
        self, pool: _Pool, fmt: str, ns: Namespace, key: bytes, kv: list[KVPair]
    ) -> bool:
        async with self._sem:
            res = await self.aio.put(ns, _PAGE_TOKENS, kv, extras=[key])
        ok = not res.error and not res.failed and not res.no_space
        if ok:
            self._tracked.add(pool.name, fmt, key)
            self._count("pages_stored" if res.stored else "pages_deduped")
            self._count("bytes_stored", res.bytes_written)
        else:
            self._count("pages_not_stored")
        return ok

    async def _get(self, ns: Namespace, key: bytes, kv: list[KVPair]) -> bool:
        async with self._sem:
            m = await self.aio.match(ns, _PAGE_TOKENS, extras=[key])
            if m.blocks < 1:
                return False
            try:
                got = await self.aio.get(m, kv)
            finally:
                await self.aio.release(m)
        if got is None:
            self._count("pages_failed_read")
            return False
        self._count("pages_read")
        return True

    async def _gather(self, jobs: Sequence[Awaitable[bool]]) -> list[bool]:
        done = await asyncio.gather(*jobs, return_exceptions=True)
        out = []
        for r in done:
            if isinstance(r, BaseException):
                self._count("page_errors")
                fail_log.log(time.monotonic(), "gcache sglang backend: page failed (miss): %r", r)
            out.append(r is True)
        return out

    # ---- presence ------------------------------------------------------------------------

    async def _presence(self, pool: _Pool, keys: Sequence[str], fmt: str) -> list[bool]:
        ns = await self._namespace(pool, fmt)
        return await self._gather([self._present(ns, k.encode()) for k in keys])

    def _presence_job(
        self, pool: _Pool, keys: Sequence[str]
    ) -> Callable[[], Awaitable[list[bool]]]:
        return lambda: self._presence(pool, keys, "pages")

    def _fmt(self) -> str:
        return "pages" if self.interface_v1 else "flat"

    def _kv_pool(self) -> _Pool | None:
        return self.pools.get(str(PoolName.KV))

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

        got: list[bool] = self._run(query, [], "exists")
        hits = got.index(False) if False in got else len(got)
        self._count("exists_pages", len(keys))
        self._count("exists_hits", hits)
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
                present = self._run(self._presence_job(pool, keys[:kv_pages]), [], "exists")
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

    def _page_views(
        self, pool: _Pool, host_indices: torch.Tensor, npages: int
    ) -> list[list[KVPair]]:
        spec = pool.spec
        assert spec is not None
        idx = host_indices.detach().to("cpu", torch.int64)[: npages * pool.page_size]
        ptrs, sizes = pool.host.get_page_buffer_meta(idx)
        r = len(spec.layers)
        if len(ptrs) != npages * r:
            raise GCacheError(f"pool {pool.name}: {len(ptrs)} page regions for {npages} pages")
        want = [layer.kv_heads * layer.k_head_dim for layer in spec.layers]
        esize = laymod.DTYPE_SIZES[spec.dtype]
        for i, s in enumerate(sizes):
            if int(s) != 2 * esize * want[i % r]:
                raise GCacheError(f"pool {pool.name}: page region of {s} bytes, layout differs")
        return [
            _page_kv(spec, ptrs[i * r : (i + 1) * r], sizes[i * r : (i + 1) * r])
            for i in range(npages)
        ]

    def _check_io(self, pool: _Pool | None, keys: Sequence[str], host_indices: Any) -> int:
        """Pages a zero-copy call may move (0: none)."""
        if pool is None or not keys or host_indices is None:
            return 0
        n = min(len(keys), self.cfg.max_batch_pages)
        if int(host_indices.numel()) < n * pool.page_size:
            self._count("bad_indices")
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
        self, pool: _Pool | None, keys: list[str], host_indices: Any, is_set: bool
    ) -> list[bool]:
        n = self._check_io(pool, keys, host_indices)
        out = [False] * len(keys)
        if n == 0 or pool is None:
            return out
        if pool.spec is None:  # a logical anchor: nothing to move
            return [True] * len(keys)
        if is_set and pool.shared and not self.is_writer:
            self._count("sets_skipped_not_writer", n)
            return [True] * n + [False] * (len(keys) - n)
        t0 = time.perf_counter()

        async def run() -> list[bool]:
            ns = await self._namespace(pool, "pages")
            views = self._page_views(pool, host_indices, n)
            pairs = zip(keys[:n], views, strict=True)
            if is_set:
                jobs = [self._put(pool, "pages", ns, k.encode(), v) for k, v in pairs]
            else:
                jobs = [self._get(ns, k.encode(), v) for k, v in pairs]
            return await self._gather(jobs)

        got = self._run(run, [False] * n, "set" if is_set else "get")
        out[:n] = got
        self._sample(pool, is_set, sum(got), time.perf_counter() - t0)
        return out

    def _sample(self, pool: _Pool, is_set: bool, pages: int, secs: float) -> None:
        spec = pool.spec or pool.flat_spec
        page_bytes = 0 if spec is None else laymod.Layout(spec).group_object_bytes[0]
        gbps = pages * page_bytes / secs / (1 << 30) if secs > 0 else 0.0
        with self._stats_lock:
            (self._backup_pages if is_set else self._prefetch_pages).append(pages)
            (self._backup_gbps if is_set else self._prefetch_gbps).append(gbps)
            self.counters["set_calls" if is_set else "get_calls"] += 1

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
                self._count("pages_outside_window", skip)
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

    def _flat_kv(self, pool: _Pool, page: torch.Tensor) -> list[KVPair]:
        spec = pool.flat_spec
        assert spec is not None
        t = page.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise GCacheError("flat page must be a contiguous CPU tensor")
        nbytes = int(t.numel()) * int(t.element_size())
        return _page_kv(spec, [int(t.data_ptr())], [nbytes])

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
            ns = await self._namespace(pool, "flat")
            jobs = [
                self._get(ns, k.encode(), self._flat_kv(pool, t))
                for k, t in zip(keys[:n], target_locations[:n], strict=True)
            ]
            return await self._gather(jobs)

        got = self._run(run, [False] * n, "get")
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
            self._count("sets_skipped_not_writer", len(keys))
            return True

        async def run() -> list[bool]:
            ns = await self._namespace(pool, "flat")
            jobs = [
                self._put(pool, "flat", ns, k.encode(), self._flat_kv(pool, v.contiguous()))
                for k, v in zip(keys, values[: len(keys)], strict=True)
            ]
            return await self._gather(jobs)

        return all(self._run(run, [False], "set"))

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
        entries = self._tracked.take()

        async def run() -> bool:
            async def one(pool_name: str, fmt: str, key: bytes) -> bool:
                pool = self.pools.get(pool_name)
                if pool is None:
                    return False
                ns = await self._namespace(pool, fmt)
                async with self._sem:
                    await self.aio.evict(ns, _PAGE_TOKENS, windows_only=False, extras=[key])
                return True

            return all(await self._gather([one(*e) for e in entries]))

        ok = self._run(run, False, "clear") if entries else True
        self._count("pages_cleared", len(entries))
        return ok

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch and backup call
        since the last call); None where SGLang's metrics module cannot load."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        m = StorageMetrics()
        with self._stats_lock:
            m.prefetch_pgs.extend(self._prefetch_pages)
            m.backup_pgs.extend(self._backup_pages)
            m.prefetch_bandwidth.extend(self._prefetch_gbps)
            m.backup_bandwidth.extend(self._backup_gbps)
            for q in (self._prefetch_pages, self._backup_pages):
                q.clear()
            self._prefetch_gbps.clear()
            self._backup_gbps.clear()
        return m

    def stats(self) -> dict[str, int]:
        """The backend's counters and its client's (hits, bytes read, errors, ...)."""
        with self._stats_lock:
            out = dict(self.counters)
        out["tracked_pages"] = len(self._tracked)
        out["tracked_pages_forgotten"] = self._tracked.forgotten
        out.update({f"client_{k}": v for k, v in self.aio.stats().items()})
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._lt.close(self.aio.close, 5)
        except Exception as exc:  # closing must not fail SGLang's shutdown
            log.warning("gcache sglang backend: close: %r", exc)
