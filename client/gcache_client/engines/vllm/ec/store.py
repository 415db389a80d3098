"""Encoder outputs (a multimodal item's embeddings) stored in GCache, keyed by the
item's content hash: the engine-agnostic part of :mod:`gcache_client.engines.vllm.ec.connector`
(numpy, torch and the client; no vLLM import).

An encoder output (any tensor, ``[..., width]``) is ordinary GCache data:

* **Namespace** per (model id + revision, the output's dtype and width, cache
  salt): ``register_namespace(f"{model}#encoder/{dtype}/{width}", layout,
  revision=..., cache_salt=...)`` with a one-layer ``uint8`` layout whose rows are
  ``row_bytes`` wide (``width * element size``, rounded up to even: K and V each
  hold half a row) and ``block_rows`` rows per block. Eviction, quotas,
  tenants and NVMe demotion apply as to any namespace.
* **Object**: a 64-byte header (magic, version, dtype, shape, payload length, the
  first 16 bytes of the item's key digest) followed by the tensor's bytes, padded
  to whole blocks: ``rows(n, row_bytes, block_rows)`` rows. The K half of the
  layer holds the first half of those bytes and the V half the second, so one
  contiguous buffer is both the put's source and the get's destination.
* **Key tokens** (:func:`key_tokens`): block 0 starts with the SHA-256 of the
  item's identifier (vLLM's ``mm_hash``, computed from the media's content) as 8
  int32, then the number of rows of the tensor and its width; the rest are 0.
  GCache chains block keys, so every block of the object is keyed by the hash.

A read is a leased ``match`` that must cover every block, a ``get`` into one
buffer (the client checks every block's xxh3 checksums), then the header is
checked against what the reader expects (dtype, width, row count, digest): any
failure is a miss (``None``), never an exception and never wrong bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gcache import layout as laymod
from gcache.config import ClientConfig
from gcache.errors import ConfigError, GCacheError
from gcache_client.engines.background import BackgroundStores
from gcache_client.engines.vllm.core import settings_from_extra
from gcache_client.sync import GCacheClient
from gcache_client.types import Namespace

log = logging.getLogger("gcache.client.vllm_ec")

HEADER_BYTES = 64
MAGIC = b"GCEC"
VERSION = 1
MAX_DIMS = 4
# magic, version, dtype code, ndim, 4 dims, payload bytes, digest[:16]
_HEADER = struct.Struct("<4sHBB4QQ16s")
assert _HEADER.size <= HEADER_BYTES

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}
_DTYPE_NAME = {t: name for name, t in DTYPES.items()}


@dataclass(frozen=True)
class ECConfig:
    """Settings of the encoder-cache connector (``ec_connector_extra_config``);
    every ``ClientConfig`` field may be given too (``meta``, ``meta_grpc``,
    ``transport``, ``timeout_s``, ...)."""

    model_id: str = ""  # namespace model id; default: vLLM's served model name
    revision: str = ""
    cache_salt: str = ""  # default salt of requests that carry none
    block_rows: int = 16  # rows (of row_bytes) per GCache block; >= 16
    max_namespaces: int = 16  # (dtype, width, salt) namespaces kept registered
    max_pending_stores: int = 4  # background stores in flight; past it a store waits
    max_loads_in_flight: int = 8  # background fetches; past it an item is a miss
    load_threads: int = 2  # threads fetching encoder outputs
    max_staged_bytes: int = 256 << 20  # fetched outputs not yet handed to the worker
    max_tracked: int = 4096  # items whose state (loading, ready, miss) is kept
    blocking_loads: bool = False  # True: fetch inline (no deferred step)
    # Async fetches: wait up to this long for them before deferring the request a
    # step (a fetch usually takes well under this; a deferred request costs a step).
    load_wait_ms: int = 20
    store: bool = True  # False: only load (also for ec_role ec_consumer)
    client: ClientConfig = dataclasses.field(
        default_factory=lambda: ClientConfig(load_or_recompute=False)
    )

    def check(self) -> None:
        for name in (
            "max_namespaces",
            "max_pending_stores",
            "max_loads_in_flight",
            "load_threads",
            "max_staged_bytes",
            "max_tracked",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.load_wait_ms < 0:
            raise ConfigError(f"load_wait_ms must be >= 0, got {self.load_wait_ms}")
        if not 16 <= self.block_rows <= laymod.MAX_BLOCK_SIZE:
            raise ConfigError(
                f"block_rows must be in 16..{laymod.MAX_BLOCK_SIZE}, got {self.block_rows}"
            )
        self.client.check()

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ECConfig:
        cfg: ECConfig = settings_from_extra(
            cls, extra, "GCache EC connector", {"load_or_recompute": False}
        )
        return cfg


def digest(identifier: str) -> bytes:
    return hashlib.sha256(identifier.encode()).digest()


def row_bytes(width: int, dtype: str) -> int:
    """Bytes per GCache row for outputs of ``width`` elements of ``dtype``."""
    n = width * int(DTYPES[dtype].itemsize)
    return n + (n & 1)


def rows(n_rows: int, width: int, dtype: str, block_rows: int) -> int:
    """GCache rows (a whole number of blocks) of an output with ``n_rows`` rows."""
    total = HEADER_BYTES + n_rows * width * int(DTYPES[dtype].itemsize)
    r = -(-total // row_bytes(width, dtype))
    return -(-r // block_rows) * block_rows


def key_tokens(identifier: str, n_rows: int, width: int, total_rows: int) -> np.ndarray:
    """The token ids whose chained block keys name the object."""
    t = np.zeros(total_rows, dtype=np.int32)
    t[:8] = np.frombuffer(digest(identifier), dtype="<i4")
    t[8], t[9] = n_rows, width
    return t


def encode_header(identifier: str, t: torch.Tensor) -> bytes:
    dtype = _DTYPE_NAME[t.dtype]
    dims = [*t.shape] + [0] * (MAX_DIMS - t.dim())
    nbytes = t.numel() * t.element_size()
    hdr = _HEADER.pack(
        MAGIC, VERSION, _DTYPE_CODE[dtype], t.dim(), *dims, nbytes, digest(identifier)[:16]
    )
    return hdr.ljust(HEADER_BYTES, b"\0")


def decode(
    buf: np.ndarray, identifier: str, dtype: str, width: int, n_rows: int
) -> torch.Tensor | None:
    """The tensor in ``buf`` (a view, no copy), or ``None`` (with a logged reason)
    when the header does not describe what the reader expects."""
    try:
        magic, ver, code, ndim, d0, d1, d2, d3, nbytes, dig = _HEADER.unpack_from(
            buf[:HEADER_BYTES].tobytes()
        )
    except struct.error:
        return None
    shape = tuple(d for d in (d0, d1, d2, d3)[:ndim])
    want_bytes = n_rows * width * int(DTYPES[dtype].itemsize)
    problems = []
    if magic != MAGIC or ver != VERSION:
        problems.append("magic/version")
    if code != _DTYPE_CODE[dtype]:
        problems.append("dtype")
    if not 1 <= ndim <= MAX_DIMS or shape[-1] != width or int(np.prod(shape)) != n_rows * width:
        problems.append(f"shape {shape}")
    if nbytes != want_bytes or HEADER_BYTES + nbytes > buf.nbytes:
        problems.append(f"length {nbytes}")
    if dig != digest(identifier)[:16]:
        problems.append("identifier")
    if problems:
        log.warning(
            "GCache encoder output %s refused (%s): a miss", identifier, ", ".join(problems)
        )
        return None
    raw = torch.from_numpy(buf[HEADER_BYTES : HEADER_BYTES + nbytes])
    return raw.view(DTYPES[dtype]).reshape(shape)


class ECStore:
    """Encoder outputs in GCache for one engine process (thread-safe)."""

    def __init__(self, config: ECConfig, model_id: str) -> None:
        config.check()
        self.config = config
        self.model_id = config.model_id or model_id
        self.client = GCacheClient(config.client)
        self._ns: OrderedDict[tuple[str, int, str], Namespace] = OrderedDict()
        self._lock = threading.Lock()
        self._stores: BackgroundStores[bool] = BackgroundStores(
            self.config.max_pending_stores, "gcache-ec-store"
        )
        self.counters: Counter[str] = Counter()

    def _count(self, **kw: int) -> None:
        with self._lock:
            self.counters.update(kw)

    def namespace(self, dtype: str, width: int, salt: str) -> Namespace:
        key = (dtype, width, salt)
        with self._lock:
            ns = self._ns.get(key)
            if ns is not None:
                self._ns.move_to_end(key)
                return ns
        half = row_bytes(width, dtype) // 2
        spec = laymod.LayoutSpec(
            block_size=self.config.block_rows,
            dtype="uint8",
            layers=(laymod.LayerSpec("full", kv_heads=1, k_head_dim=half, v_head_dim=half),),
        )
        ns = self.client.register_namespace(
            f"{self.model_id}#encoder/{dtype}/{width}",
            spec,
            block_size=self.config.block_rows,
            revision=self.config.revision,
            cache_salt=salt,
        )
        with self._lock:
            self._ns[key] = ns
            while len(self._ns) > self.config.max_namespaces:
                self._ns.popitem(last=False)
        return ns

    @staticmethod
    def _halves(buf: np.ndarray, total_rows: int, half: int) -> tuple[np.ndarray, np.ndarray]:
        k = buf[: total_rows * half].reshape(total_rows, 1, half)
        v = buf[total_rows * half :].reshape(total_rows, 1, half)
        return k, v

    # ---- read ----------------------------------------------------------------------

    def fetch(
        self, identifier: str, dtype: str, width: int, n_rows: int, salt: str = ""
    ) -> torch.Tensor | None:
        """The encoder output stored for ``identifier`` (``n_rows`` rows of
        ``width`` ``dtype`` elements), or ``None``: not stored, evicted, a store
        problem, a checksum or header mismatch (all misses)."""
        t0 = time.monotonic()
        try:
            out = self._fetch(identifier, dtype, width, n_rows, salt)
        except (GCacheError, OSError, ValueError, KeyError) as exc:
            log.warning("GCache encoder output %s: fetch failed (a miss): %s", identifier, exc)
            self._count(load_errors=1, misses=1)
            return None
        us = int((time.monotonic() - t0) * 1e6)
        if out is None:
            self._count(misses=1, load_us=us)
        else:
            self._count(hits=1, load_us=us, bytes_loaded=out.numel() * out.element_size())
        return out

    def _fetch(
        self, identifier: str, dtype: str, width: int, n_rows: int, salt: str
    ) -> torch.Tensor | None:
        if dtype not in DTYPES or width < 1 or n_rows < 1:
            return None
        ns = self.namespace(dtype, width, salt)
        total = rows(n_rows, width, dtype, self.config.block_rows)
        self._count(lookups=1)
        m = self.client.match(ns, key_tokens(identifier, n_rows, width, total))
        try:
            if m.tokens != total:
                return None  # never stored, or part of it evicted
            half = row_bytes(width, dtype) // 2
            buf = np.empty(total * 2 * half, dtype=np.uint8)
            if self.client.get(m, [self._halves(buf, total, half)]) is None:
                self._count(load_errors=1)
                return None
        finally:
            if m.lease_id:
                self.client.release(m)
        out = decode(buf, identifier, dtype, width, n_rows)
        if out is None:
            self._count(load_errors=1)
        return out

    # ---- write ---------------------------------------------------------------------

    def encode(self, identifier: str, t: torch.Tensor) -> tuple[np.ndarray, int, int] | None:
        """(buffer, GCache rows, width) holding ``t`` with its header, or ``None``
        for a tensor this store does not keep (dtype, no dims, too many dims)."""
        if t.dtype not in _DTYPE_NAME or not 1 <= t.dim() <= MAX_DIMS or t.numel() == 0:
            return None
        dtype, width = _DTYPE_NAME[t.dtype], int(t.shape[-1])
        n_rows = t.numel() // width
        total = rows(n_rows, width, dtype, self.config.block_rows)
        buf = np.zeros(total * row_bytes(width, dtype), dtype=np.uint8)
        buf[:HEADER_BYTES] = np.frombuffer(encode_header(identifier, t), dtype=np.uint8)
        nbytes = t.numel() * t.element_size()
        src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        torch.from_numpy(buf[HEADER_BYTES : HEADER_BYTES + nbytes]).copy_(src)
        return buf, total, width

    def store(self, identifier: str, t: torch.Tensor, salt: str = "") -> bool:
        """Store ``t`` now (blocking); ``False`` on any failure (logged, counted)."""
        t0 = time.monotonic()
        enc = self.encode(identifier, t)
        if enc is None:
            self._count(store_skipped=1)
            return False
        buf, total, width = enc
        dtype = _DTYPE_NAME[t.dtype]
        try:
            ns = self.namespace(dtype, width, salt)
            half = row_bytes(width, dtype) // 2
            res = self.client.put(
                ns,
                key_tokens(identifier, t.numel() // width, width, total),
                [self._halves(buf, total, half)],
            )
        except GCacheError as exc:
            log.warning("GCache encoder output %s: store failed: %s", identifier, exc)
            self._count(store_errors=1)
            return False
        ok = res.ok and res.no_space == 0
        self._count(
            stores=1,
            store_us=int((time.monotonic() - t0) * 1e6),
            bytes_stored=res.bytes_written,
            objects_stored=res.stored,
            objects_deduped=res.deduped,
            objects_no_space=res.no_space,
            store_errors=0 if ok else 1,
        )
        return ok

    def store_async(self, identifier: str, t: torch.Tensor, salt: str = "") -> None:
        """Store in the background; at most ``max_pending_stores`` at once (past it,
        this call waits for the oldest: backpressure, counted as ``store_waits``).
        The tensor is copied (with its header) before this returns only when it
        runs; vLLM never writes into an encoder output it cached."""
        _, waited = self._stores.submit(self.store, identifier, t, salt)
        if waited:
            self._count(store_waits=1)

    def flush(self, timeout: float | None = None) -> None:
        self._stores.flush(timeout)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
        out["pending_stores"] = self._stores.in_flight()
        return out

    def close(self) -> None:
        try:
            self.flush(self.config.client.timeout_s * 4)
        except Exception as exc:  # a store stuck past its timeouts: logged, not raised
            log.warning("GCache EC store flush at close: %s", exc)
        finally:
            self._stores.shutdown()
            self.client.close()
