"""KV events in vLLM's own format, published over ZMQ, so ``gcache-router`` (or any
consumer of vLLM's ``--kv-events-config``) learns what an engine holds locally.

Blocks removed from GCache: :class:`RemovalWatcher` follows the meta's
``WatchRemovals`` stream of a namespace on a thread, and :class:`ReportedBlocks`
turns its removals into ``BlockRemoved(medium="GCACHE")`` for the blocks this
engine reported stored in GCache (only those: each engine retracts what it
announced, so a router hears of a removal once per engine that claimed the block).
A lost stretch of removals (the meta's gap, a broken stream, a restarted meta)
retracts every block reported so far: a router then stops counting them as pool
hits, which is never wrong, only pessimistic.

The structs mirror ``vllm/distributed/kv_events.py`` field for field (msgspec,
``omit_defaults``, events tagged by class name). A message is vLLM's
``ZmqEventPublisher`` multipart: ``(topic, sequence number as 8 bytes big-endian,
msgpack KVEventBatch)``, numbered from 0 at each start of the publisher (a consumer
sees a restart as the numbering going back to 0).

Socket: vLLM's rule, an endpoint with ``*`` (``tcp://*:5557``) is bound, any other
(``tcp://router:5557``) is connected to. A PUB socket never blocks: past its
high-water mark ZMQ drops messages; the publisher counts batches sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from gcache.errors import ConfigError
from gcache.layout import Layout
from gcache_client.engines.local_cache import Change, engine_hash

MEDIUM_GPU = "GPU"
MEDIUM_GCACHE = "GCACHE"

log = logging.getLogger("gcache.client.kv_events")


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def spec_kind(window: int) -> str:
    """vLLM's ``kv_cache_spec_kind`` of a layout group."""
    return "full_attention" if window == 0 else "sliding_window"


Event = BlockStored | BlockRemoved | AllBlocksCleared


def change_events(
    layout: Layout, ids: Sequence[int] | np.ndarray, keys: Sequence[bytes], change: Change
) -> list[Event]:
    """The KV events of a local-cache change, as vLLM's scheduler emits them: one
    ``BlockStored`` per run of consecutive new blocks of a group (its parent's hash,
    the blocks' token ids, the group's index, kind and window), full-attention
    group first so every parent is announced before its children; then one
    ``BlockRemoved`` per group of evicted blocks."""
    bs = layout.block_size
    events: list[Event] = []
    for g in sorted(change.stored):
        window = layout.group_windows[g]
        blocks = change.stored[g]
        run_start = 0
        for i in range(1, len(blocks) + 1):
            if i < len(blocks) and blocks[i] == blocks[i - 1] + 1:
                continue
            a, b = blocks[run_start], blocks[i - 1]
            events.append(
                BlockStored(
                    block_hashes=[engine_hash(keys[j]) for j in range(a, b + 1)],
                    parent_block_hash=engine_hash(keys[a - 1]) if a > 0 else None,
                    token_ids=[int(t) for t in ids[a * bs : (b + 1) * bs]],
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    group_idx=g,
                    kv_cache_spec_kind=spec_kind(window),
                    kv_cache_spec_sliding_window=window or None,
                )
            )
            run_start = i
    for g in sorted(change.removed):
        hashes: list[int | bytes] = list(change.removed[g])
        events.append(BlockRemoved(hashes, MEDIUM_GPU, group_idx=g))
    return events


class ZmqPublisher:
    """PUB socket + sequence numbers + the msgpack encoder (call from one thread)."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 100_000) -> None:
        import zmq

        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"kv events endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}"
            )
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._ctx: Any = zmq.Context.instance()
        self._sock: Any = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise ConfigError(f"kv events endpoint {endpoint}: {exc}") from exc
        self._encoder = msgspec.msgpack.Encoder()
        self.seq = 0
        self.batches = 0
        self.events = 0
        self.dropped = 0

    @property
    def bound_endpoint(self) -> str:
        """The endpoint actually bound (resolves a ``:0`` port)."""
        import zmq

        last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else self.endpoint

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        import zmq

        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)
        payload = self._encoder.encode(batch)
        try:
            self._sock.send_multipart(
                (self.topic, self.seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.dropped += 1
        self.seq += 1
        self.batches += 1
        self.events += len(events)

    def close(self) -> None:
        self._sock.close(0)

    def stats(self) -> dict[str, int]:
        return {
            "batches": self.batches,
            "events": self.events,
            "dropped": self.dropped,
            "seq": self.seq,
        }


# ---- removals from GCache ----------------------------------------------------------------


def gcache_hash(key: bytes) -> int:
    """The block hash GCache-medium events carry: the first 8 bytes of the block's
    GCache key, little-endian (what the vLLM connector's ``BlockStored`` says)."""
    return int.from_bytes(key[:8], "little")


class ReportedBlocks:
    """Blocks this engine reported stored in GCache (hash -> bitmask of its event
    groups), bounded by ``max_blocks``: past it the oldest is retracted at once
    (``BlockRemoved``), so the table never claims more than it can later retract.
    Thread-safe: the watcher threads report removals, the engine takes events.

    ``layout_group_of[g]``: the GCache layout group of the engine's event group
    ``g`` (vLLM may split one window's layers into several KV cache groups)."""

    def __init__(self, layout_group_of: Sequence[int], max_blocks: int = 1 << 20) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.layout_group_of = list(layout_group_of)
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._out: dict[int, list[int]] = {}  # event group -> hashes to retract
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {
            "stored": 0,
            "removed": 0,
            "removals_ignored": 0,
            "retracted_over_bound": 0,
            "gaps": 0,
        }

    def _retract(self, h: int, mask: int) -> None:
        g = 0
        while mask:
            if mask & 1:
                self._out.setdefault(g, []).append(h)
            mask >>= 1
            g += 1

    def stored(self, hashes: Sequence[int], group: int) -> None:
        with self._lock:
            blocks = self._blocks
            bit = 1 << group
            for h in hashes:
                blocks[h] = blocks.get(h, 0) | bit
                blocks.move_to_end(h)
            self.counters["stored"] += len(hashes)
            while len(blocks) > self.max_blocks:
                h, mask = blocks.popitem(last=False)
                self._retract(h, mask)
                self.counters["retracted_over_bound"] += 1

    def removed(self, removed: Sequence[tuple[bytes, int]]) -> None:
        """The meta removed object ``layout group`` of each block ``key``."""
        with self._lock:
            blocks = self._blocks
            for key, lg in removed:
                h = gcache_hash(key)
                mask = blocks.get(h)
                if mask is None:
                    self.counters["removals_ignored"] += 1
                    continue
                drop = 0
                for g, lgroup in enumerate(self.layout_group_of):
                    if lgroup == lg and mask >> g & 1:
                        drop |= 1 << g
                if not drop:
                    self.counters["removals_ignored"] += 1
                    continue
                self._retract(h, drop)
                left = mask & ~drop
                if left:
                    blocks[h] = left
                else:
                    del blocks[h]
                self.counters["removed"] += 1

    def gap(self) -> None:
        """Removals were lost: retract everything reported."""
        with self._lock:
            for h, mask in self._blocks.items():
                self._retract(h, mask)
            self._blocks.clear()
            self.counters["gaps"] += 1

    def take(self) -> list[tuple[int, list[int]]]:
        """``(event group, hashes)`` to report removed, since the last call."""
        with self._lock:
            out, self._out = self._out, {}
        return sorted(out.items())

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "reported_blocks": len(self._blocks)}


def removal_events(taken: Sequence[tuple[int, Sequence[int]]]) -> list[Event]:
    """:meth:`ReportedBlocks.take` as this module's ``BlockRemoved`` events."""
    return [BlockRemoved(list(hs), MEDIUM_GCACHE, group_idx=g) for g, hs in taken]


Sink = Callable[[bytes, list[tuple[bytes, int]], bool], None]


class RemovalWatcher:
    """Follows the meta's ``WatchRemovals`` stream of each watched namespace, one
    daemon thread per namespace (at most ``max_namespaces``), and hands every batch
    to ``sink(fingerprint, removed, gap)``. A stream that breaks or cannot be opened
    is retried every ``retry_s``; whatever went on meanwhile is unknown, so the
    next stream's first batch comes with ``gap`` set (also the first one after a
    namespace the meta no longer knows, e.g. after its restart). A refused
    namespace (access denied) is logged once and not retried."""

    def __init__(
        self,
        meta_grpc: str,
        sink: Sink,
        *,
        token: str | None = None,
        tls_ca: str = "",
        retry_s: float = 1.0,
        keepalive_s: float = 10.0,
        max_namespaces: int = 64,
    ) -> None:
        from gcache._proto import gcache_pb2_grpc as pb_grpc
        from gcache.auth import call_metadata, sync_channel

        self.sink = sink
        self.retry_s = retry_s
        self.keepalive_s = keepalive_s
        self.max_namespaces = max_namespaces
        self._channel: Any = sync_channel(meta_grpc, tls_ca=tls_ca)
        self._stub: Any = pb_grpc.ControlStub(self._channel)
        self._md = call_metadata(token)
        self._lock = threading.Lock()
        self._calls: dict[bytes, Any] = {}
        self._threads: dict[bytes, threading.Thread] = {}
        self._closed = threading.Event()
        self.connected: set[bytes] = set()  # namespaces with a live stream
        self.counters: dict[str, int] = {
            "batches": 0,
            "removed": 0,
            "gaps": 0,
            "stream_errors": 0,
            "refused": 0,
        }

    def watch(self, fp: bytes) -> bool:
        """Follow ``fp`` (idempotent). False when ``max_namespaces`` are watched."""
        with self._lock:
            if fp in self._threads or self._closed.is_set():
                return True
            if len(self._threads) >= self.max_namespaces:
                return False
            t = threading.Thread(target=self._run, args=(fp,), name="gcache-removals", daemon=True)
            self._threads[fp] = t
        t.start()
        return True

    def _run(self, fp: bytes) -> None:
        import grpc

        from gcache._proto import gcache_pb2 as pb

        req = pb.WatchRemovalsRequest(namespace=fp, keepalive_s=self.keepalive_s)
        lost = False  # removals may have been missed before the next stream
        warned = False  # one line per outage, not one per retry
        while not self._closed.is_set():
            call = self._stub.WatchRemovals(req, metadata=self._md)
            with self._lock:
                self._calls[fp] = call
            try:
                first = True
                for batch in call:
                    removed = [(bytes(r.key), int(r.group)) for r in batch.removed]
                    gap = bool(batch.gap) or (first and lost)
                    if first:
                        self.connected.add(fp)
                        first = False
                        lost = False
                        if warned:
                            log.info("GCache removal stream of namespace %s is back", fp.hex())
                            warned = False
                    self.counters["batches"] += 1
                    self.counters["removed"] += len(removed)
                    if gap:
                        self.counters["gaps"] += 1
                    if removed or gap:
                        self.sink(fp, removed, gap)
                lost = True  # the meta ended the stream (it stopped)
            except grpc.RpcError as exc:
                lost = True
                if self._closed.is_set():
                    break
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.PERMISSION_DENIED:
                    self.counters["refused"] += 1
                    log.warning(
                        "GCache removals of namespace %s refused: %s (no BlockRemoved "
                        "events for it)",
                        fp.hex(),
                        exc.details() if hasattr(exc, "details") else exc,
                    )
                    break
                self.counters["stream_errors"] += 1
                if not warned:
                    warned = True
                    log.warning(
                        "GCache removal stream of namespace %s lost (%s); every block "
                        "announced so far is reported removed; retrying every %.1f s",
                        fp.hex(),
                        exc.details() if hasattr(exc, "details") else exc,
                        self.retry_s,
                    )
            finally:
                self.connected.discard(fp)
                with self._lock:
                    self._calls.pop(fp, None)
            if lost:
                # What went on while no stream was open is unknown: retract now, so
                # a router never keeps a pool hit that is gone.
                self.sink(fp, [], True)
            self._closed.wait(self.retry_s)

    def wait_connected(self, fp: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while fp not in self.connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stats(self) -> dict[str, int]:
        return {**self.counters, "namespaces": len(self._threads)}

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for c in calls:
            c.cancel()
        self._channel.close()
