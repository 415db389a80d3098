"""GCache as a vLLM encoder-cache (EC) connector: multimodal encoder outputs
shared between instances, keyed by the media's content hash (vLLM's ``mm_hash``),
so an instance serving an image another one already encoded skips its vision
encoder. Loaded by vLLM with no change to vLLM::

    ECTransferConfig(ec_connector="GCacheECConnector",
                     ec_connector_module_path="gcache_client.vllm_ec", ec_role="ec_both",
                     ec_connector_extra_config={"meta": "HOST:PORT", "meta_grpc": "HOST:PORT"})

Storage is :class:`gcache_client.engines.vllm.ec.store.ECStore` (ordinary GCache data:
a namespace per model, output dtype and width, and cache salt; the object keyed
by the hash; checksums on every read; a small header checked against the
expected dtype, shape and length).

Where the bytes move (why the scheduler side reads):

* **Scheduler side.** vLLM asks ``ensure_cache_available(request)`` before it
  schedules a request with media; for each item not yet computed the connector
  starts a fetch on a background thread (``match`` + ``get`` + header check; at
  most ``max_loads_in_flight``, past that the item is a miss) and answers
  ``False`` (the request waits a step) until its fetches are done. Then
  ``has_cache_item`` is ``True`` only for an item whose verified output is in
  hand: vLLM skips its encoder for it. A fetch that fails, times out or reads a
  wrong header is a miss: vLLM runs the encoder. ``update_state_after_alloc``
  moves a fetched output into the next step's metadata (bounded by
  ``max_staged_bytes``).
* **Worker side.** ``start_load_caches`` puts the outputs of the step's metadata
  into vLLM's encoder cache (it cannot fail: the bytes are already there and
  verified); ``save_caches`` stores what the encoder computed in the background
  (``max_pending_stores`` in flight, then a store waits). A store failure is
  logged and counted; the request never sees it.

Fetching on the worker instead would leave vLLM 0.32 no way back once the
scheduler said "cached": a worker that cannot produce the output stops the
engine (``Encoder cache miss``), and a step with nothing scheduled never calls
the worker's EC connector, so the scheduler could not wait for a worker fetch.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from gcache.errors import GCacheError
from gcache_client.engines.vllm.ec.store import DTYPES, ECConfig, ECStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["ECConfig", "GCacheECConnector", "GCacheECMetadata"]

log = logging.getLogger("gcache.client.vllm_ec")


@dataclass
class GCacheECMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, per step: fetched outputs to put into the encoder
    cache, and the cache salt of each item the encoder computes this step."""

    loads: dict[str, torch.Tensor] = field(default_factory=dict)
    salts: dict[str, str] = field(default_factory=dict)


@dataclass
class _Item:
    """A fetch the scheduler side started: running (``future``), then its output
    (``None``: a miss)."""

    future: Future[torch.Tensor | None] | None
    out: torch.Tensor | None = None
    done: bool = False
    claimed: bool = False  # has_cache_item said yes: kept until allocated
    owners: set[str] = field(default_factory=set)  # requests that wait for it

    @property
    def nbytes(self) -> int:
        return 0 if self.out is None else int(self.out.numel() * self.out.element_size())


def _model_id(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    return str(name[0] if isinstance(name, list | tuple) else name)


class _Scheduler:
    def __init__(self, config: ECConfig, store: ECStore, vllm_config: VllmConfig) -> None:
        self.config, self.store = config, store
        mc = vllm_config.model_config
        self.dtype = next((n for n, t in DTYPES.items() if t == mc.dtype), "")
        ec = vllm_config.ec_transfer_config
        self.widths: dict[str, int] = dict(getattr(ec, "mm_encoder_output_widths", None) or {})
        self.default_width = int(mc.get_inputs_embeds_size())
        self._items: OrderedDict[tuple[str, str], _Item] = OrderedDict()
        self._handled: dict[str, set[str]] = {}  # request -> identifiers decided
        self._loads: dict[str, torch.Tensor] = {}
        self._salts: dict[str, str] = {}
        self._salt = config.cache_salt  # of the request vLLM is scheduling now
        self._pool = ThreadPoolExecutor(config.load_threads, thread_name_prefix="gcache-ec-load")
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def salt(self, request: Request) -> str:
        return getattr(request, "cache_salt", None) or self.config.cache_salt

    def _staged_bytes(self) -> int:
        return sum(i.nbytes for i in self._items.values()) + sum(
            int(t.numel() * t.element_size()) for t in self._loads.values()
        )

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        """Start fetches for the request's items still to encode; ``True`` once
        none of them is in flight."""
        salt = self._salt = self.salt(request)
        handled = self._handled.setdefault(request.request_id, set())
        pending: list[_Item] = []
        for index, f in enumerate(request.mm_features):
            ident = f.identifier
            pos = f.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # its embeddings are behind us (computed or prefix-cached)
            key = (salt, ident)
            item = self._items.get(key)
            if ident not in handled:
                handled.add(ident)
                if item is None:
                    item = self._start(request, index, key)
                if item is not None:
                    item.owners.add(request.request_id)
            if item is not None and not self._poll(item):
                pending.append(item)
        if pending and self.config.load_wait_ms:
            futs = [i.future for i in pending if i.future is not None]
            wait(futs, timeout=self.config.load_wait_ms / 1000)
            pending = [i for i in pending if not self._poll(i)]
        if pending:
            self._count("deferred_steps")
        return not pending

    def _start(self, request: Request, index: int, key: tuple[str, str]) -> _Item | None:
        width = self.widths.get(request.mm_features[index].modality, self.default_width)
        n_rows = request.get_num_encoder_embeds(index)
        running = sum(1 for i in self._items.values() if not i.done)
        if (
            not self.dtype
            or running >= self.config.max_loads_in_flight
            or self._staged_bytes() >= self.config.max_staged_bytes
        ):
            self._count("loads_refused")  # the encoder runs: a miss, never a wait
            return None
        salt, ident = key
        self._count("loads_started")
        if self.config.blocking_loads:
            out = self.store.fetch(ident, self.dtype, width, n_rows, salt)
            item = _Item(None, out, done=True)
        else:
            fut = self._pool.submit(self.store.fetch, ident, self.dtype, width, n_rows, salt)
            item = _Item(fut)
        self._items[key] = item
        self._trim()
        return item

    def _poll(self, item: _Item) -> bool:
        if not item.done and item.future is not None and item.future.done():
            try:
                item.out = item.future.result()
            except Exception as exc:  # fetch() catches store errors; anything else: a miss
                log.warning("GCache encoder output fetch raised (a miss): %s", exc)
                item.out = None
            item.done, item.future = True, None
            if item.out is not None and self._staged_bytes() > self.config.max_staged_bytes:
                item.out = None  # no room to keep it: a miss
                self._count("loads_dropped")
        return item.done

    def _trim(self) -> None:
        """Forget the oldest decided items past ``max_tracked`` (never a claimed
        output or a fetch in flight)."""
        excess = len(self._items) - self.config.max_tracked
        for key in list(self._items):
            if excess <= 0:
                break
            it = self._items[key]
            if it.done and not it.claimed:
                del self._items[key]
                excess -= 1

    def has(self, identifier: str) -> bool:
        item = self._items.get((self._salt, identifier))
        if item is None or not self._poll(item) or item.out is None:
            return False
        item.claimed = True
        return True

    def after_alloc(self, request: Request, index: int) -> None:
        ident = request.mm_features[index].identifier
        salt = self.salt(request)
        item = self._items.get((salt, ident))
        if item is not None and item.claimed and item.out is not None:
            self._loads[ident] = item.out  # this step's metadata carries it
            del self._items[(salt, ident)]
            self._count("hits")
            self._count("bytes_hit", item.nbytes)
        else:
            self._salts[ident] = salt  # the encoder computes it: store under this salt
            self._count("misses")
            if item is not None and item.done:
                del self._items[(salt, ident)]

    def build(self) -> GCacheECMetadata:
        meta = GCacheECMetadata(loads=self._loads, salts=self._salts)
        self._loads, self._salts = {}, {}
        return meta

    def finished(self, request: Request) -> None:
        rid = request.request_id
        self._handled.pop(rid, None)
        for key in list(self._items):
            it = self._items[key]
            it.owners.discard(rid)
            if not it.owners and it.done:
                del self._items[key]  # fetched for nobody left (or a miss)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Worker:
    def __init__(self, config: ECConfig, store: ECStore, producer: bool, device: str) -> None:
        self.store = store
        self.device = torch.device(device or "cpu")
        self.saving = producer and config.store
        self._salts: OrderedDict[str, str] = OrderedDict()
        self._max = config.max_tracked
        self.default_salt = config.cache_salt
        self.counters: dict[str, int] = {}

    def load(self, meta: GCacheECMetadata, encoder_cache: dict[str, torch.Tensor]) -> None:
        for ident, salt in meta.salts.items():
            self._salts[ident] = salt
            self._salts.move_to_end(ident)
        while len(self._salts) > self._max:
            self._salts.popitem(last=False)
        for ident, t in meta.loads.items():
            if t.device != self.device:  # fetched into host memory
                t = t.to(self.device, non_blocking=True)
            encoder_cache.setdefault(ident, t)
            self.counters["installed"] = self.counters.get("installed", 0) + 1

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not self.saving or mm_hash not in encoder_cache:
            return
        salt = self._salts.pop(mm_hash, self.default_salt)
        self.store.store_async(mm_hash, encoder_cache[mm_hash], salt)


class GCacheECConnector(ECConnectorBase):  # type: ignore[misc]
    """vLLM's entry point (``ec_connector="GCacheECConnector"``,
    ``ec_connector_module_path="gcache_client.vllm_ec"``)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        self.config = ECConfig.from_extra(dict(ec.ec_connector_extra_config or {}))
        self._store = ECStore(self.config, _model_id(vllm_config))
        self._sched: _Scheduler | None = None
        self._work: _Worker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self.config, self._store, vllm_config)
        else:
            dc = getattr(vllm_config, "device_config", None)
            device = str(getattr(dc, "device_type", "") or "cpu")
            self._work = _Worker(self.config, self._store, self.is_producer, device)

    # -- scheduler side --
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._sched is None or not self.is_consumer:
            return True
        try:
            return self._sched.ensure(request, num_computed_tokens)
        except GCacheError as exc:  # never fail the engine: the encoder runs
            log.warning("GCache EC connector: %s", exc)
            return True

    def has_cache_item(self, identifier: str) -> bool:
        if self._sched is None or not self.is_consumer:
            return False
        return self._sched.has(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._sched is not None:
            self._sched.after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._sched is not None
        return self._sched.build()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is not None:
            self._sched.finished(request)
        return False, None

    # -- worker side --
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._work is not None and isinstance(meta, GCacheECMetadata):
            self._work.load(meta, encoder_cache)

    def start_save_caches(self, **kwargs: Any) -> None:
        # A producer-only instance never calls start_load_caches: take the salts here.
        meta = self._connector_metadata
        if self._work is not None and isinstance(meta, GCacheECMetadata) and not self.is_consumer:
            self._work.load(GCacheECMetadata(salts=meta.salts), {})

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        if self._work is None:
            return
        try:
            self._work.save(encoder_cache, mm_hash)
        except GCacheError as exc:  # a store never fails a request
            log.warning("GCache EC store of %s: %s", mm_hash, exc)

    # -- both --
    def stats(self) -> dict[str, int]:
        """Counters of this side: the store's (lookups, hits, misses, load_errors,
        bytes_loaded, load_us, stores, bytes_stored, store_errors, store_waits,
        pending_stores, ...) and the scheduler's (loads_started, loads_refused,
        deferred_steps, hits, misses, bytes_hit) or the worker's (installed)."""
        out = dict(self._store.stats())
        part = self._sched or self._work
        if part is not None:
            side = "sched" if self._sched is not None else "worker"
            out.update({f"{side}_{k}": v for k, v in part.counters.items()})
        return out

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.close()
        self._store.close()
