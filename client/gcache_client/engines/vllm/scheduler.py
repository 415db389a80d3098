"""The scheduler side of :class:`gcache_client.engines.vllm.connector.GCacheConnector`: leased
matches, block ids per KV cache group, and the per-step metadata for the workers.

With ``load_mode="async"`` a hit is loaded before the request is scheduled: the
step's metadata carries the load with the blocks vLLM allocated for it
(:meth:`_Scheduler.after_alloc`), the workers report it through
``get_transfer_results``, and a request whose load failed is not matched again
(vLLM recomputes it from its first token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gcache_client.engines.vllm.core import (
    BridgeConfig,
    KVBridge,
    KVKey,
    match_to_wire,
    store_tokens,
)
from gcache_client.engines.vllm.keys import RequestKeys, Unkeyable
from gcache_client.engines.vllm.meta import GCacheConnectorMetadata, LayerMap, ReqStep
from gcache_client.types import Match

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _SchedReq:
    tokens: list[int]  # as keyed (vllm_keys): empty = nothing to store
    key: KVKey | None  # None: its KV cannot be keyed safely, never loaded nor stored
    match: Match | None = None
    local: int = 0
    load_pending: bool = False
    blocks: list[list[int]] = field(default_factory=list)
    sent_tokens: bool = False
    async_pending: bool = False  # an async load to hand the workers next step
    no_load: bool = False  # its async load failed: recompute, never match again


class _Scheduler:
    def __init__(
        self, cfg: BridgeConfig, lmap: LayerMap, model_id: str, tp_size: int = 1, pp_size: int = 1
    ) -> None:
        self.lmap = lmap
        # Matches are made in rank 0's (and stage 0's) namespace; a worker of
        # another rank or stage matches its own shard again (the worker).
        self.bridge = KVBridge(
            cfg,
            model_id,
            lmap.spec,
            tp_size=tp_size,
            tp_rank=0,
            stage=f"pp=0/{pp_size}" if pp_size > 1 else "",
        )
        self.reqs: dict[str, _SchedReq] = {}
        self.async_loads = cfg.load_mode == "async"
        self.keys = RequestKeys(self.bridge.block_size, cfg.lora_keys)
        self.counters = {"async_loads": 0, "async_load_failures": 0}
        self._reported: dict[str, int] = {}

    def _new(self, request: Request) -> _SchedReq:
        try:
            key: KVKey | None = self.keys.key(request)
            tokens = self.keys.tokens(request)
        except Unkeyable:
            key, tokens = None, []
        return _SchedReq(tokens, key)

    def matched(self, request: Request, num_computed: int) -> int:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = self._new(request)
        if st.match is not None:  # asked again: drop the previous lease
            self.bridge.release(st.match)
            st.match = None
        if st.no_load or st.key is None:
            return 0
        tokens = st.tokens
        if len(tokens) <= self.bridge.block_size:
            return 0
        m = self.bridge.match(tokens[: len(tokens) - 1], st.key)
        if m.tokens <= num_computed:
            self.bridge.release(m)
            return 0
        st.match, st.local = m, num_computed
        return int(m.tokens - num_computed)

    def after_alloc(
        self, request: Request, num_external: int, block_ids: tuple[list[int], ...]
    ) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or st.match is None:
            return
        if num_external <= 0:
            self.bridge.release(st.match)
            st.match = None
            return
        st.load_pending = True
        if self.async_loads:  # not scheduled before the load is done: send it now
            st.blocks = [list(b) for b in block_ids]
            st.async_pending = True

    def load_failed(self, req_ids: set[str]) -> None:
        """Async loads the workers reported failed: vLLM recomputes those requests
        from their first token (and asks for a match again: answer none)."""
        for req_id in req_ids:
            st = self.reqs.get(req_id)
            if st is None:
                continue
            self.counters["async_load_failures"] += 1
            st.no_load = True
            st.sent_tokens = False  # the worker dropped its staged rows: stage again
            if st.match is not None:
                self.bridge.release(st.match)
                st.match = None

    def build(self, so: SchedulerOutput) -> GCacheConnectorMetadata:
        meta = GCacheConnectorMetadata()
        for req_id, pend in self.reqs.items():
            if pend.async_pending and pend.match is not None and pend.key is not None:
                pend.async_pending = pend.load_pending = False
                self.counters["async_loads"] += 1
                store_len = store_tokens(len(pend.tokens), self.bridge.block_size)
                meta.steps.append(
                    ReqStep(
                        req_id,
                        tuple(pend.blocks),
                        pend.local,
                        pend.local,
                        store_len,
                        None if pend.sent_tokens else pend.tokens[:store_len],
                        pend.key,
                        match_to_wire(pend.match),
                        pend.local,
                        async_load=True,
                    )
                )
                pend.sent_tokens = True
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:  # not seen by get_num_new_matched_tokens: its key is
                # unknown here (no adapter, media or embeddings at hand), store nothing
                st = _SchedReq([], None)
                self.reqs[new.req_id] = st
                self.keys.counters["unkeyed_new_requests"] += 1
            st.blocks = [list(b) for b in new.block_ids]
            self._step(meta, new.req_id, st, new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: its staged rows are gone; store nothing more.
                st.blocks = [list(b) for b in nb] if nb is not None else st.blocks
                st.tokens = []
                meta.finished.append(req_id)
                continue
            if nb is not None:
                for g, b in enumerate(nb):
                    st.blocks[g].extend(b)
            self._step(meta, req_id, st, cached.num_computed_tokens[i], so)
        for req_id in so.finished_req_ids:
            meta.finished.append(req_id)
        return meta

    def _step(
        self,
        meta: GCacheConnectorMetadata,
        req_id: str,
        st: _SchedReq,
        computed: int,
        so: SchedulerOutput,
    ) -> None:
        if st.key is None:
            return  # never loaded, never stored
        n = len(st.tokens)
        store_len = store_tokens(n, self.bridge.block_size)
        load = None
        if st.load_pending and st.match is not None:
            load = match_to_wire(st.match)
            st.load_pending = False
        end = computed + int(so.num_scheduled_tokens.get(req_id, 0))
        if computed >= store_len and load is None:
            return  # past the stored part of the prompt (decoding)
        step = ReqStep(
            req_id,
            tuple(st.blocks),
            computed,
            end,
            store_len,
            None if st.sent_tokens else st.tokens[:store_len],
            st.key,
            load,
            st.local,
        )
        st.sent_tokens = True
        meta.steps.append(step)

    def take_stats(self) -> dict[str, int]:
        """Counters since the last call (requests by key kind, unkeyable requests,
        async loads), for vLLM's connector stats."""
        now = {**self.keys.stats(), **self.counters}
        out = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return {k: v for k, v in out.items() if v}

    def finished(self, req_id: str) -> None:
        st = self.reqs.pop(req_id, None)
        if st is not None and st.match is not None:
            self.bridge.release(st.match)

    def close(self) -> None:
        for st in self.reqs.values():
            if st.match is not None:
                self.bridge.release(st.match)
        self.reqs.clear()
        self.bridge.close()
