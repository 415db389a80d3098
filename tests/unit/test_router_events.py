"""vLLM KV events (gcache/router/events.py): decoding both encodings, re-keying to
GCache chained keys, and every way a batch is refused without changing anything.

The batches are built with the schema vLLM declares (vllm/distributed/kv_events.py:
msgspec structs, tagged, map-encoded in current vLLM, array-encoded in older
releases), written out here independently of the router's own decoder."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from gcache.keys import block_keys
from gcache.layout import Layout, preset
from gcache.router.events import EventIngestor, block_extra, decode_batch
from gcache.router.index import FleetIndex

FP = bytes(range(16))
BS = 64


# ---- vLLM's schema (current: map-encoded) -------------------------------------------


class VEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


# ---- older vLLM (array-encoded) ------------------------------------------------------


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> VBlockStored:
    return VBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=kw.pop("block_size", BS),
        lora_id=kw.pop("lora_id", None),
        medium=kw.pop("medium", "GPU"),
        lora_name=kw.pop("lora_name", None),
        **kw,
    )


def batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode(VEventBatch(ts=1.0, events=list(events)))


def tokens(n_blocks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150000) for _ in range(n_blocks * BS)]


def setup(layout: str = "llama-3-8b") -> tuple[FleetIndex, EventIngestor]:
    idx = FleetIndex(Layout(preset(layout, BS)))
    idx.register("e1", 0.0)
    return idx, EventIngestor(idx, FP)


def snapshot(idx: FleetIndex) -> tuple[Any, ...]:
    inst = idx.get("e1")
    assert inst is not None
    return (dict(inst.blocks), dict(inst.by_engine), inst.seq, [dict(d) for d in idx.holders])


def test_stored_blocks_are_rekeyed_to_gcache_chained_keys() -> None:
    """Two events, the second continuing the first by its parent hash: the router's
    keys are exactly what a GCache client computes for the whole prompt."""
    idx, ing = setup()
    toks = tokens(5)
    out = ing.ingest("e1", 0, batch(stored([b"A" * 32, b"B" * 32], None, toks[: 2 * BS])), 1.0)
    assert out.applied == 1 and out.blocks == 2 and not out.rejected
    out = ing.ingest("e1", 1, batch(stored([11, 12, 13], b"B" * 32, toks[2 * BS :])), 1.0)
    assert out.applied == 1 and not out.rejected
    want = block_keys(FP, toks, BS)
    assert idx.match(want) == {"e1": 5}
    inst = idx.get("e1")
    assert inst is not None and inst.by_engine[12] == want[3]


def test_removed_blocks_leave_the_index() -> None:
    idx, ing = setup()
    toks = tokens(4)
    ing.ingest("e1", 0, batch(stored([1, 2, 3, 4], None, toks)), 1.0)
    ing.ingest("e1", 1, batch(VBlockRemoved(block_hashes=[3, 4, 99], medium="GPU")), 1.0)
    assert idx.match(block_keys(FP, toks, BS)) == {"e1": 2}


def test_old_array_encoding_is_accepted() -> None:
    idx, ing = setup()
    toks = tokens(2)
    payload = msgspec.msgpack.encode(
        OldBatch(ts=1.0, events=[OldBlockStored([5, 6], None, toks, BS, None)])
    )
    out = ing.ingest("e1", 0, payload, 1.0)
    assert out.applied == 1, out.rejected
    assert idx.match(block_keys(FP, toks, BS)) == {"e1": 2}


def test_hybrid_groups_window_safe() -> None:
    """A hybrid engine stores full-attention blocks (group 0) and the sliding window
    (group 1); removing the window of the last blocks ends the usable match."""
    idx, ing = setup("mimo-v2-flash")
    toks = tokens(6)
    hs = list(range(100, 106))
    full = stored(hs, None, toks, group_idx=0, kv_cache_spec_kind="full_attention")
    swa = stored(
        hs,
        None,
        toks,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
    )
    out = ing.ingest("e1", 0, batch(full, swa), 1.0)
    assert out.applied == 2 and not out.rejected
    keys = block_keys(FP, toks, BS)
    assert idx.match(keys) == {"e1": 6}
    # the engine frees the window outside blocks 2..3 (group 1 only)
    gone = VBlockRemoved(block_hashes=[100, 101, 104, 105], medium="GPU", group_idx=1)
    ing.ingest("e1", 1, batch(gone), 1.0)
    assert idx.match(keys) == {"e1": 4}
    bad = stored([1], None, toks[:BS], group_idx=2, kv_cache_spec_kind="sliding_window",
                 kv_cache_spec_sliding_window=4096)  # fmt: skip
    out = ing.ingest("e1", 2, batch(bad), 1.0)
    assert out.rejected and "window 4096" in out.rejected[0][1]


def test_extra_keys_and_lora_are_mixed_in() -> None:
    idx, ing = setup()
    toks = tokens(2)
    extra = [("mm-hash-1",), None]
    ev = stored([1, 2], None, toks, lora_name="adapter", extra_keys=extra)
    ing.ingest("e1", 0, batch(ev), 1.0)
    extras = [block_extra("adapter", ["mm-hash-1"]), block_extra("adapter", None)]
    assert idx.match(block_keys(FP, toks, BS, extras)) == {"e1": 2}
    assert idx.match(block_keys(FP, toks, BS)) == {}


@pytest.mark.parametrize(
    ("event", "kind", "reason"),
    [
        (stored([1], 77, tokens(1)), "unknown_parent", "unknown parent"),
        (stored([1, 2], None, tokens(1)), "tokens", "64 token ids for 2 blocks"),
        (stored([1], None, tokens(1)[:16], block_size=16), "block_size", "block_size 16"),
        (stored([1], None, tokens(1), group_idx=1, kv_cache_spec_kind="mamba"), "group", "mamba"),
        (stored([1, 2], None, tokens(2), extra_keys=[None]), "extra_keys", "1 extra keys"),
    ],
)
def test_bad_event_is_rejected_and_changes_nothing(event: Any, kind: str, reason: str) -> None:
    idx, ing = setup()
    ing.ingest("e1", 0, batch(stored([50], None, tokens(1, seed=5))), 1.0)
    before = snapshot(idx)
    out = ing.ingest("e1", 1, batch(event), 1.0)
    assert out.applied == 0 and len(out.rejected) == 1
    assert reason in out.rejected[0][1]
    assert ing.rejected[kind] == 1
    after = snapshot(idx)
    assert after[:2] == before[:2] and after[3] == before[3]  # only the seq moved on


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        b"",
        msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockStored"}]}),
        msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "Nope", "block_hashes": [1]}]}),
        msgspec.msgpack.encode(  # a block hash that is neither bytes nor int
            {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [1.5]}]}
        ),
        msgspec.msgpack.encode(  # a negative token id
            {
                "ts": 1.0,
                "events": [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "token_ids": [-1] * BS,
                        "block_size": BS,
                    }
                ],
            }
        ),
    ],
)
def test_malformed_batch_is_rejected_whole(payload: bytes) -> None:
    idx, ing = setup()
    ing.ingest("e1", 0, batch(stored([50], None, tokens(1))), 1.0)
    before = snapshot(idx)
    out = ing.ingest("e1", 1, payload, 1.0)
    assert out.rejected and out.rejected[0][0] == "batch"
    assert ing.rejected["malformed"] == 1
    assert snapshot(idx) == before  # sequence number unchanged too


def test_unknown_instance_is_rejected() -> None:
    idx, ing = setup()
    out = ing.ingest("nobody", 0, batch(stored([1], None, tokens(1))), 1.0)
    assert out.rejected == [("batch", "unknown instance 'nobody'")]
    assert idx.get("nobody") is None


def test_sequence_backwards_is_rejected_gap_and_restart_reset() -> None:
    idx, ing = setup()
    t1, t2 = tokens(1, seed=1), tokens(1, seed=2)
    k1, k2 = block_keys(FP, t1, BS), block_keys(FP, t2, BS)
    ing.ingest("e1", 5, batch(stored([1], None, t1)), 1.0)
    ing.ingest("e1", 6, batch(stored([2], None, t2)), 1.0)
    before = snapshot(idx)
    out = ing.ingest("e1", 6, batch(VBlockRemoved(block_hashes=[1], medium=None)), 1.0)
    assert "not after 6" in out.rejected[0][1] and snapshot(idx) == before
    # a gap: removals may have been lost, so the index restarts from this batch
    out = ing.ingest("e1", 9, batch(stored([3], None, tokens(1, seed=3))), 1.0)
    assert out.reset.startswith("sequence gap") and idx.match(k1) == {} and idx.match(k2) == {}
    assert idx.blocks_of("e1") == 1
    # the publisher restarted (its numbering is back at 0)
    out = ing.ingest("e1", 0, batch(stored([1], None, t1)), 1.0)
    assert out.reset.startswith("publisher restarted") and idx.match(k1) == {"e1": 1}
    assert idx.blocks_of("e1") == 1


def test_all_blocks_cleared_resets() -> None:
    idx, ing = setup()
    toks = tokens(3)
    ing.ingest("e1", 0, batch(stored([1, 2, 3], None, toks)), 1.0)
    ing.ingest("e1", 1, batch(VAllBlocksCleared()), 1.0)
    assert idx.blocks_of("e1") == 0 and idx.match(block_keys(FP, toks, BS)) == {}


def test_decode_batch_reads_mixed_forms() -> None:
    """An array batch holding map events (SGLang's newer publisher)."""
    ev = msgspec.msgpack.decode(
        msgspec.msgpack.encode(VBlockRemoved(block_hashes=[3], medium=None))
    )
    ts, events = decode_batch(msgspec.msgpack.encode([2.5, [ev], None]))
    assert ts == 2.5 and len(events) == 1 and list(events[0].block_hashes) == [3]  # type: ignore[union-attr]
