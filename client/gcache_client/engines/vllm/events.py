"""KV events of :class:`~gcache_client.engines.vllm.connector.GCacheConnector`, scheduler side.

vLLM publishes what ``take_events`` returns on the scheduler each step (its
``--kv-events-config`` publisher, the same ZMQ stream as its own GPU events).
Two sources, both medium ``GCACHE``:

* ``BlockStored``: a worker's store finished (``_Worker._stored_events``); it comes
  to the scheduler in the step's ``KVConnectorOutput.kv_cache_events`` and is
  passed on with its group's ``kv_cache_spec_kind`` and window filled in (a
  router needs them to tell a sliding-window group from a full one);
* ``BlockRemoved``: the meta's ``WatchRemovals`` stream of every namespace this
  scheduler uses (:class:`~gcache_client.engines.kv_events.RemovalWatcher`), turned into
  removals of the blocks this engine reported stored
  (:class:`~gcache_client.engines.kv_events.ReportedBlocks`), per vLLM KV cache group.

Each engine retracts only what it announced (a block stored by another engine is
that engine's to retract), so a router that keeps GCACHE blocks per engine sees
each claim withdrawn by its owner. Removals the watcher may have missed (the
meta's gap, a broken stream, a restarted meta) retract everything announced so
far. Events go out with vLLM's next step: an idle engine publishes nothing.
With tensor parallelism vLLM publishes only events every worker reported; the
workers' GCache keys differ per rank, so stores are announced with TP = 1 only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from gcache.auth import load_client_token
from gcache.errors import GCacheError
from gcache_client.engines.kv_events import RemovalWatcher, ReportedBlocks, spec_kind
from gcache_client.engines.vllm.core import BridgeConfig, KVBridge
from gcache_client.engines.vllm.meta import MEDIUM, LayerMap

log = logging.getLogger("gcache.client.vllm")


def group_maps(lmap: LayerMap) -> tuple[list[int], list[int]]:
    """Per vLLM KV cache group: its GCache layout group and its window (0: full)."""
    from gcache.layout import Layout

    layout = Layout(lmap.spec)
    n = len(lmap.group_block)
    lgroup = [0] * n
    window = [0] * n
    for i, name in enumerate(lmap.names):
        g = lmap.group_of[name]
        lgroup[g] = layout.layer_group[i]
        window[g] = lmap.spec.layers[i].window
    return lgroup, window


class SchedulerEvents:
    """Collects the workers' ``BlockStored`` events and the meta's removals; hands
    them to vLLM in :meth:`take`."""

    def __init__(
        self, cfg: BridgeConfig, lmap: LayerMap, bridge: KVBridge, *, watch: bool = True
    ) -> None:
        """``watch``: vLLM publishes KV events (``--kv-events-config``)."""
        self.bridge = bridge
        self.enabled = watch  # vLLM publishes KV events: else nothing is kept
        self.lgroup, self.window = group_maps(lmap)
        self.table = ReportedBlocks(self.lgroup, cfg.max_reported_blocks)
        self._lock = threading.Lock()
        self._out: list[KVCacheEvent] = []
        self.watcher: RemovalWatcher | None = None
        if watch and cfg.report_removals:
            c = cfg.client
            self.watcher = RemovalWatcher(
                c.meta_grpc,
                self._removed,
                token=load_client_token(c.token, c.token_file),
                tls_ca=c.tls_ca,
                max_namespaces=cfg.max_namespaces,
            )
        self._watched: set[bytes] = set()

    def _removed(self, fp: bytes, removed: list[tuple[bytes, int]], gap: bool) -> None:
        if gap:
            self.table.gap()
        if removed:
            self.table.removed(removed)

    def worker_events(self, events: Iterable[Any]) -> None:
        """The events a step's ``KVConnectorOutput`` carried."""
        if not self.enabled:
            return
        out: list[KVCacheEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored) and ev.medium == MEDIUM and ev.group_idx is not None:
                g = ev.group_idx
                if 0 <= g < len(self.window):
                    ev.kv_cache_spec_kind = spec_kind(self.window[g])
                    ev.kv_cache_spec_sliding_window = self.window[g] or None
                    self.table.stored([int(h) for h in ev.block_hashes], g)
            out.append(ev)
        with self._lock:
            self._out += out

    def _watch_namespaces(self) -> None:
        if self.watcher is None:
            return
        for ns in self.bridge.namespaces():
            fp = ns.fingerprint
            if fp not in self._watched:
                self._watched.add(fp)
                self.watcher.watch(fp)

    def take(self) -> list[KVCacheEvent]:
        try:
            self._watch_namespaces()
        except GCacheError as exc:  # never fail a scheduler step for events
            log.warning("GCache removal events: %s", exc)
        with self._lock:
            out, self._out = self._out, []
        for g, hashes in self.table.take():
            out.append(BlockRemoved(block_hashes=list(hashes), medium=MEDIUM, group_idx=g))
        return out

    def stats(self) -> dict[str, int]:
        out = {f"events_{k}": v for k, v in self.table.stats().items()}
        if self.watcher is not None:
            out.update({f"removal_watch_{k}": v for k, v in self.watcher.stats().items()})
        return out

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
