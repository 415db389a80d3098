"""GCache as a vLLM v1 KV connector, hybrid-aware (``SupportsHMA``) and layerwise.

Loaded by vLLM with no change to vLLM::

    KVTransferConfig(kv_connector="GCacheConnector",
                     kv_connector_module_path="gcache_client.vllm", kv_role="kv_both",
                     kv_connector_extra_config={"meta": "HOST:PORT", "meta_grpc": "HOST:PORT"})

Scheduler side (:class:`_Scheduler`): ``get_num_new_matched_tokens`` asks the meta for
the longest window-safe match of the prompt (minus its last token) and keeps the
lease, so the hit cannot be evicted before the worker reads it;
``update_state_after_alloc`` / ``build_connector_meta`` hand the worker the match
and every KV cache group's block ids; ``request_finished_all_groups`` releases
what is left. The worker copies what it stores while it computes, so vLLM's blocks
are never held for a store.

Worker side (:class:`_Worker`): ``start_load_kv`` starts ``get_layers`` for every
loading request (reads run ahead on the client's I/O thread, straight into a
host staging buffer); ``wait_for_layer_load(layer)`` waits for that layer only
and copies it into the paged KV cache blocks vLLM allocated (one strided copy per
run of consecutive blocks, :mod:`gcache_client.engines.vllm.paged`), so the load
overlaps the forward. With ``load_mode="async"`` the load runs on a background
thread before the request is scheduled and is reported by
``get_transfer_results`` (a failure as ``failed_recving``: vLLM recomputes the
request, with any number of KV cache groups). ``save_kv_layer`` copies the rows
this step computed into
the staging buffer; once a prompt's last stored row is staged, ``wait_for_save``
hands the put to a background thread (full groups every block, sliding-window
groups only their window, plus the checkpoint windows the meta asks for). A load
that fails reports its blocks through ``get_block_ids_with_load_errors`` and vLLM
recomputes them.

The GCache-facing part lives in :mod:`gcache_client.engines.vllm.core` (engine-agnostic).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from gcache_client.engines.vllm.events import SchedulerEvents
from gcache_client.engines.vllm.meta import (
    MEDIUM,
    GCacheConnectorMetadata,
    ReqStep,
    bridge_config,
    layer_map,
    model_id,
)
from gcache_client.engines.vllm.scheduler import _Scheduler
from gcache_client.engines.vllm.worker import _Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["MEDIUM", "GCacheConnector", "GCacheConnectorMetadata", "ReqStep"]

log = logging.getLogger("gcache.client.vllm")


# ---- the connector ------------------------------------------------------------------


class GCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's entry point; the work is done by :class:`_Scheduler` or :class:`_Worker`."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = bridge_config(vllm_config)
        lmap = layer_map(kv_cache_config, vllm_config.model_config.dtype)
        self._events: SchedulerEvents | None = None
        if role == KVConnectorRole.SCHEDULER:
            par = vllm_config.parallel_config
            self._sched: _Scheduler | None = _Scheduler(
                cfg,
                lmap,
                model_id(vllm_config),
                tp_size=int(par.tensor_parallel_size),
                pp_size=int(par.pipeline_parallel_size),
            )
            self._work: _Worker | None = None
            kve = vllm_config.kv_events_config
            publishing = kve is not None and bool(kve.enable_kv_cache_events)
            self._events = SchedulerEvents(cfg, lmap, self._sched.bridge, watch=publishing)
        else:
            self._sched = None
            self._work = _Worker(cfg, lmap, model_id(vllm_config))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    # -- scheduler side --
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        n = self._sched.matched(request, num_computed_tokens)
        return n, n > 0 and self._sched.async_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, num_external_tokens, blocks.get_block_ids())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None and connector_output.failed_recving:
            self._sched.load_failed(set(connector_output.failed_recving))
        kv_events = connector_output.kv_cache_events
        if self._events is not None and kv_events is not None:
            self._events.worker_events(kv_events.get_all_events())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        self._sched.finished(request.request_id)
        return False, None  # the worker copied what it stores: free the blocks now

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' GCACHE ``BlockStored`` and GCache's removals (vllm_events)."""
        return self._events.take() if self._events is not None else ()

    # -- worker side --
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._work is not None
        self._work.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._work is not None
        self._work.start_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._work is not None
        self._work.prepare(self._meta())
        self._work.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._work is not None
        self._work.prepare(self._meta())
        self._work.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._work is not None
        if self.has_connector_metadata():
            self._work.prepare(self._meta())
            self._work.end_step()

    def _meta(self) -> GCacheConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, GCacheConnectorMetadata)
        return meta

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Async loads done (a failed one is also finished) and failed: vLLM
        recomputes a failed request from its first token, whatever its groups."""
        if self._work is None:
            return KVConnectorTransferResults()
        done, failed = self._work.take_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._work is not None
        return self._work.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._sched is not None:  # keys: unkeyable, LoRA, multimodal, embeddings
            data = self._sched.take_stats()
            return GCacheConnectorStats(data=data) if data else None
        if self._work is None:
            return None
        return GCacheConnectorStats(data=self._work.take_stats())

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return GCacheConnectorStats(data=dict(data or {}))

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        if self._work is None:
            return None
        events = self._work.take_events()
        return GCacheKVEvents(events) if events else None

    def shutdown(self) -> None:
        for part in (self._events, self._sched, self._work):
            if part is not None:
                part.close()


class GCacheConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last report: hits, bytes, load and store times."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class GCacheKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    def __init__(self, events: list[KVCacheEvent]) -> None:
        self._events = list(events)
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVConnectorKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
