"""vLLM's KV events, decoded and applied to the router's index. No I/O.

What vLLM sends (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): ZMQ
multipart messages ``(topic, seq as 8 bytes big-endian, payload)`` where payload is
one MessagePack ``KVEventBatch``: ``ts``, ``events``, ``data_parallel_rank``; each
event a tagged struct ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids`` of the new blocks, ``block_size``, ``lora_id``, ``medium``,
``lora_name``, ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``), ``BlockRemoved`` (``block_hashes``, ``medium``,
``group_idx``) or ``AllBlocksCleared``. Current vLLM encodes structs as maps with
the tag in ``"type"``; older releases (and SGLang's outer batch) as arrays with
the tag first. Both are accepted, batch and event each by their first byte.

Engines name blocks by their own hashes (SHA-256 of their own chain, or 64-bit
ints), which mean nothing to GCache. A ``BlockStored`` carries the token ids, so
the router re-keys each block to the GCache chained key
(:func:`gcache.keys.block_keys`): from the namespace fingerprint for a block
without parent, else from the key it gave the parent (the parent's engine hash
must be known). Extra keys and LoRA names are mixed in per block as
:func:`block_extra` bytes; a client routing such prompts keys them the same way.

Medium ``GCACHE`` (a GCache connector's events): the blocks are in the
GCache pool, which every instance can load from, not in the sending instance's
memory. With a pool index (``EventIngestor(pool=...)``) they go there, under the
sending instance (each engine retracts what it announced); any other medium is the
instance's own memory. ``AllBlocksCleared`` (vLLM clearing its own cache) leaves
the pool index alone; a sequence gap or restart resets both.

Every event is checked before it changes anything; a bad one is rejected with a
reason (:class:`Outcome`) and the rest of its batch still applies. A batch that
does not decode, from an unknown instance, or numbered before the last one applied
is rejected whole.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec

from gcache import keys as keymod
from gcache.router.index import FleetIndex, Instance, RouterError

EngineHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)] | int
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]

MEDIUM_GCACHE: Final = "GCACHE"

# Kinds of vLLM KV-cache groups (KVCacheSpecKind) served by full attention.
FULL_KINDS: Final = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "cross_attention"}
)
SLIDING_KINDS: Final = frozenset({"sliding_window", "sliding_window_mla"})


# ---- schema (map form: current vLLM; *A classes: array form) ----------------------


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[TokenId] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class BlockStoredA(BlockStored, array_like=True, tag="BlockStored"):
    pass


class BlockRemovedA(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class AllBlocksClearedA(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class KVEventBatchA(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStoredA | BlockRemovedA | AllBlocksClearedA]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _RawBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawBatchA(_RawBatch, array_like=True):
    pass


_EVENT_MAP: Final = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_EVENT_ARR: Final = msgspec.msgpack.Decoder(BlockStoredA | BlockRemovedA | AllBlocksClearedA)
_BATCH_MAP: Final = msgspec.msgpack.Decoder(KVEventBatch)
_BATCH_ARR: Final = msgspec.msgpack.Decoder(KVEventBatchA)
_RAW_MAP: Final = msgspec.msgpack.Decoder(_RawBatch)
_RAW_ARR: Final = msgspec.msgpack.Decoder(_RawBatchA)


class BadBatch(ValueError):
    """A payload that is not a KV event batch."""


def _is_array(first: int) -> bool:
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def decode_batch(payload: bytes | memoryview) -> tuple[float, list[Event]]:
    """``(ts, events)`` of one KV event batch, map or array form. Raises
    :class:`BadBatch` naming what is wrong; nothing is half-decoded."""
    if not payload:
        raise BadBatch("empty payload")
    arr = _is_array(payload[0])
    try:
        batch = (_BATCH_ARR if arr else _BATCH_MAP).decode(payload)
        return batch.ts, list(batch.events)
    except msgspec.DecodeError:
        pass  # maybe mixed forms (an array batch of map events): decode per event
    try:
        raw = (_RAW_ARR if arr else _RAW_MAP).decode(payload)
        events: list[Event] = []
        for r in raw.events:
            buf = memoryview(r)
            if not buf:
                raise BadBatch("empty event")
            events.append((_EVENT_ARR if _is_array(buf[0]) else _EVENT_MAP).decode(buf))
        return raw.ts, events
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise BadBatch(f"not a KV event batch: {exc}") from exc


def block_extra(lora_name: str | None, extra: list[Any] | tuple[Any, ...] | None) -> bytes:
    """The bytes mixed into a block's GCache key for a block with a LoRA adapter or
    extra keys (multimodal hashes, salts): MessagePack of ``[lora_name, extra]``;
    empty (nothing mixed in) for a plain block."""
    if lora_name is None and extra is None:
        return b""
    return msgspec.msgpack.encode([lora_name, list(extra) if extra is not None else None])


@dataclass(slots=True)
class Outcome:
    """What one batch did: events applied, (kind, reason) of each rejected one, and
    why the instance's index was reset first, if it was."""

    applied: int = 0
    blocks: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    reset: str = ""


class EventIngestor:
    """Applies decoded KV event batches of named instances to a :class:`FleetIndex`."""

    def __init__(
        self,
        index: FleetIndex,
        namespace_fp: bytes,
        max_rejects: int = 8,
        pool: FleetIndex | None = None,
    ) -> None:
        if len(namespace_fp) != keymod.KEY_SIZE:
            raise ValueError(f"namespace fingerprint must be {keymod.KEY_SIZE} bytes")
        self.index = index
        self.pool = pool  # GCACHE-medium blocks, per announcing instance (module text)
        self.fp = namespace_fp
        self.max_rejects = max_rejects
        self.batches = 0
        self.events = 0
        self.blocks = 0
        self.rejected: Counter[str] = Counter()  # by reason kind

    def stats(self) -> dict[str, int]:
        return {
            "batches": self.batches,
            "events": self.events,
            "blocks": self.blocks,
            **{f"rejected_{k}": v for k, v in sorted(self.rejected.items())},
        }

    def _reject(self, out: Outcome, kind: str, what: str, reason: str) -> None:
        self.rejected[kind] += 1
        if len(out.rejected) < self.max_rejects:
            out.rejected.append((what, reason))

    def ingest(self, instance: str, seq: int, payload: bytes | memoryview, now: float) -> Outcome:
        """Decode and apply batch ``seq`` of ``instance`` (see module text)."""
        out = Outcome()
        inst = self.index.get(instance)
        if inst is None:
            self._reject(out, "unknown_instance", "batch", f"unknown instance {instance!r}")
            return out
        try:
            _, events = decode_batch(payload)
        except BadBatch as exc:
            self._reject(out, "malformed", "batch", str(exc))
            return out
        verdict = FleetIndex.check_seq(inst, seq)
        if verdict == "backwards":
            self._reject(
                out, "backwards", "batch", f"sequence {seq} is not after {inst.seq} (replayed?)"
            )
            return out
        if verdict in ("gap", "restart"):
            out.reset = (
                f"sequence gap: {inst.seq} then {seq}"
                if verdict == "gap"
                else f"publisher restarted (sequence {inst.seq} then 0)"
            )
            self.index.reset(inst)
            pinst = self.pool.get(instance) if self.pool is not None else None
            if pinst is not None and self.pool is not None:
                self.pool.reset(pinst)
        inst.seq = seq
        inst.last_seen = max(inst.last_seen, now)
        self.batches += 1
        for ev in events:
            self.events += 1
            index, target = self.index, inst
            if (
                not isinstance(ev, AllBlocksCleared)
                and ev.medium == MEDIUM_GCACHE
                and self.pool is not None
            ):
                try:
                    index, target = self.pool, self.pool.register(instance, now)
                except RouterError as exc:  # the pool index is full of instances
                    self._reject(out, "pool", type(ev).__name__, str(exc))
                    continue
            if isinstance(ev, BlockStored):
                self._stored(target, ev, out, index)
            elif isinstance(ev, BlockRemoved):
                mask = self._remove_mask(target, ev.group_idx, index)
                if isinstance(mask, str):
                    self._reject(out, "group", "BlockRemoved", mask)
                    continue
                index.remove(target, ev.block_hashes, mask)
                out.applied += 1
            else:
                self.index.reset(inst)
                out.applied += 1
        return out

    # ---- per event -----------------------------------------------------------------

    def _store_mask(self, inst: Instance, ev: BlockStored) -> int | str:
        layout = self.index.layout  # the pool index has the same layout
        kind = ev.kv_cache_spec_kind
        if kind is None:
            if ev.group_idx is None:
                return self.index.all_groups  # a plain engine: every layer
            known = inst.engine_groups.get(ev.group_idx)
            if known is not None:
                return known
            if layout.num_groups == 1:
                mask = 1
            else:
                return (
                    f"group {ev.group_idx} has no kv_cache_spec_kind: cannot tell which "
                    "layers it holds"
                )
        else:
            if kind in SLIDING_KINDS:
                window = ev.kv_cache_spec_sliding_window or 0
                if window <= 0:
                    return f"{kind} group without kv_cache_spec_sliding_window"
            elif kind in FULL_KINDS:
                window = 0
            else:
                return f"KV kind {kind!r} is not attention the layout describes"
            if window not in layout.group_windows:
                return f"window {window} is not one of the layout's {layout.group_windows}"
            mask = 1 << layout.group_windows.index(window)
        if ev.group_idx is not None:
            inst.engine_groups[ev.group_idx] = mask
        return mask

    def _remove_mask(self, inst: Instance, group_idx: int | None, index: FleetIndex) -> int | str:
        if group_idx is None:
            return index.all_groups
        known = inst.engine_groups.get(group_idx)
        if known is not None:
            return known
        if index.layout.num_groups == 1:
            return 1
        return f"group {group_idx} was never stored"

    def _stored(self, inst: Instance, ev: BlockStored, out: Outcome, index: FleetIndex) -> None:
        bs = index.layout.block_size
        n = len(ev.block_hashes)
        if ev.block_size != bs:
            reason = f"block_size {ev.block_size}, the layout's is {bs}"
            self._reject(out, "block_size", "BlockStored", reason)
            return
        if len(ev.token_ids) != n * bs:
            self._reject(
                out,
                "tokens",
                "BlockStored",
                f"{len(ev.token_ids)} token ids for {n} blocks of {bs}",
            )
            return
        if ev.extra_keys is not None and len(ev.extra_keys) != n:
            self._reject(
                out, "extra_keys", "BlockStored", f"{len(ev.extra_keys)} extra keys for {n} blocks"
            )
            return
        mask = self._store_mask(inst, ev)
        if isinstance(mask, str):
            self._reject(out, "group", "BlockStored", mask)
            return
        if ev.parent_block_hash is None:
            prev = self.fp
        else:
            parent = inst.by_engine.get(ev.parent_block_hash)
            if parent is None:
                self._reject(out, "unknown_parent", "BlockStored", "unknown parent block hash")
                return
            prev = parent
        if n == 0:
            out.applied += 1
            return
        lora = (
            ev.lora_name
            if ev.lora_name is not None
            else (str(ev.lora_id) if ev.lora_id is not None else None)
        )
        extras: list[bytes] | None = None
        if lora is not None or ev.extra_keys is not None:
            extra_keys = ev.extra_keys or [None] * n
            extras = [block_extra(lora, e) for e in extra_keys]
        gkeys = keymod.block_keys(prev, ev.token_ids, bs, extras)
        index.store(inst, ev.block_hashes, gkeys, mask)
        out.applied += 1
        out.blocks += n
        self.blocks += n
