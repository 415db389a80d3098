"""KV events in vLLM's own format, published over ZMQ, so ``gcache-router`` (or any
consumer of vLLM's ``--kv-events-config``) learns what an engine holds locally.

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

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from gcache.errors import ConfigError
from gcache.layout import Layout
from gcache_client.local_cache import Change, engine_hash

MEDIUM_GPU = "GPU"


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
