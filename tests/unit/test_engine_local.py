"""The engine instance's parts that need no model: the text codec, the bounded local
prefix cache (window-safe match, LRU order) and its KV events, checked against the
router's own decoder and index (gcache/router/events.py, index.py)."""

from __future__ import annotations

import random

import msgspec
import pytest

from gcache import textcodec
from gcache.errors import ConfigError
from gcache.keys import block_keys
from gcache.layout import LayerSpec, Layout, LayoutSpec
from gcache.router.events import EventIngestor, decode_batch
from gcache.router.index import FleetIndex
from gcache_client.engines.kv_events import BlockRemoved, BlockStored, KVEventBatch, change_events
from gcache_client.engines.local_cache import LocalPrefixCache, engine_hash

FP = bytes(range(16))
BS = 64
# The toy engine's layout: full attention every third layer, window 129 (2 tail blocks).
LAYOUT = Layout(
    LayoutSpec(
        block_size=BS,
        dtype="float32",
        layers=tuple(
            LayerSpec("full", 1, 192, 128)
            if i % 3 == 0
            else LayerSpec("swa", 2, 192, 128, window=129)
            for i in range(6)
        ),
    )
)
ENTRY = 1000  # bytes each entry is said to take


def _make(j: int, g: int) -> tuple[object, int]:
    return (j, g), ENTRY


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# ---- text codec ------------------------------------------------------------------------


def test_chat_follow_up_prompt_starts_with_the_previous_prompt_and_reply() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    first = textcodec.encode(textcodec.render_chat(msgs))
    reply_ids = [ord(c) for c in "hi there!"]  # the engine generates printable ASCII only
    reply = textcodec.decode(reply_ids)
    follow = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    second = textcodec.encode(textcodec.render_chat(follow))
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + len(reply_ids)] == reply_ids


@pytest.mark.parametrize(
    "bad",
    [[], [{"role": "wizard", "content": "x"}], ["text"], [{"role": "user", "content": 3}]],
)
def test_chat_refuses_malformed_messages(bad: list[object]) -> None:
    with pytest.raises(textcodec.PromptError):
        textcodec.render_chat(bad)  # type: ignore[arg-type]


def test_prompt_ids_text_or_token_ids_only() -> None:
    assert textcodec.prompt_ids("ab") == [97, 98]
    assert textcodec.prompt_ids([5, 6]) == [5, 6]
    assert textcodec.prompt_ids(["ab"]) == [97, 98]
    for bad in ([1.5], [True], {"a": 1}, ["a", "b"]):
        with pytest.raises(textcodec.PromptError):
            textcodec.prompt_ids(bad)


# ---- local cache ------------------------------------------------------------------------


def test_local_match_is_window_safe() -> None:
    cache = LocalPrefixCache(LAYOUT, 1 << 30)
    keys = block_keys(FP, _ids(5 * BS, 1), BS)
    change = cache.insert(keys, 5, _make)
    # Strict O(W): the full group for every block, the window group for the last 2.
    assert change.stored == {0: [0, 1, 2, 3, 4], 1: [3, 4]}
    assert cache.match(keys) == 5
    # A prompt ending at block 4 would need the window of blocks 2 and 3: not held.
    assert cache.match(keys[:4]) == 0
    longer = block_keys(FP, _ids(5 * BS, 1) + _ids(BS, 2), BS)
    assert longer[:5] == keys
    assert cache.match(longer) == 5  # the held end point is still usable


def test_local_cache_is_bounded_and_evicts_the_tail_of_the_oldest_prompt_first() -> None:
    cache = LocalPrefixCache(LAYOUT, 10 * ENTRY)
    a = block_keys(FP, _ids(4 * BS, 1), BS)
    b = block_keys(FP, _ids(4 * BS, 2), BS)
    assert not cache.insert(a, 4, _make).removed  # 6 entries
    change = cache.insert(b, 4, _make)  # 6 more: 2 of a's must go
    assert cache.used <= 10 * ENTRY and len(cache) == 10
    # a's deepest entries went first (block 3: its window and full objects).
    assert sorted(change.removed.items()) == [(0, [engine_hash(a[3])]), (1, [engine_hash(a[3])])]
    assert cache.match(b) == 4
    assert cache.match(a) == 0  # ...which makes a unusable but keeps its head
    assert cache.has(a[0], 0)


def test_local_cache_refuses_a_zero_capacity() -> None:
    with pytest.raises(ConfigError):
        LocalPrefixCache(LAYOUT, 0)


# ---- KV events: what the engine publishes is what the router indexes --------------------


def _router() -> tuple[FleetIndex, EventIngestor]:
    index = FleetIndex(LAYOUT, max_instances=4, max_blocks=1 << 16, ttl_s=10, forget_s=60)
    index.register("e1", 0.0)
    return index, EventIngestor(index, FP)


def test_engine_events_decode_with_the_router_and_give_the_same_local_match() -> None:
    """Prompts inserted into a small local cache (so it evicts), each change
    published as a vLLM batch; the router's index, fed only those bytes, agrees
    with the engine's own window-safe match on every prompt."""
    index, ingest = _router()
    cache = LocalPrefixCache(LAYOUT, 40 * ENTRY)
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(7)
    prompts: list[list[int]] = []
    for seq in range(30):
        if prompts and rng.random() < 0.6:  # a follow-up turn: a known prompt plus more
            ids = rng.choice(prompts) + _ids(rng.randrange(1, 3) * BS, rng.randrange(10**6))
        else:
            ids = _ids(rng.randrange(1, 6) * BS, rng.randrange(10**6))
        prompts.append(ids)
        keys = block_keys(FP, ids, BS)
        change = cache.insert(keys, len(keys), _make)
        events = change_events(LAYOUT, ids, keys, change)
        payload = enc.encode(KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))
        _, decoded = decode_batch(payload)
        assert len(decoded) == len(events)
        out = ingest.ingest("e1", seq, payload, 1.0)
        assert not out.rejected and not out.reset, out
        for p in prompts:
            k = block_keys(FP, p, BS)
            assert index.match(k).get("e1", 0) == cache.match(k)


def test_engine_event_fields_are_vllms() -> None:
    ids = _ids(3 * BS, 3)
    keys = block_keys(FP, ids, BS)
    cache = LocalPrefixCache(LAYOUT, 1 << 30)
    events = change_events(LAYOUT, ids, keys, cache.insert(keys, 3, _make))
    full, window = events
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored)
    assert full.block_hashes == [engine_hash(k) for k in keys]
    assert full.parent_block_hash is None and full.token_ids == ids
    assert (full.group_idx, full.kv_cache_spec_kind) == (0, "full_attention")
    assert window.block_hashes == [engine_hash(k) for k in keys[1:]]
    assert window.parent_block_hash == engine_hash(keys[0])
    assert window.token_ids == ids[BS:]
    assert (window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == (
        "sliding_window",
        129,
    )
    # Map-encoded with the class name in "type", as current vLLM sends it.
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(1.0, [full], 0)))
    assert raw["events"][0]["type"] == "BlockStored"
    removed = BlockRemoved([1], "GPU", group_idx=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(removed))["type"] == "BlockRemoved"
