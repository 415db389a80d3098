"""Columnar ReportObjects chunks (the meta's rebuild): encode/decode round trip,
block order whatever the server sent, and bad input refused whole with a clear
error (nothing of the chunk adopted). A real gcache-meta refusing a bad chunk:
tests/integration/test_report_columns_meta.py."""

from __future__ import annotations

import random

import msgspec
import pytest

from gcache import keys
from gcache._proto import gcache_pb2 as pb
from gcache.config import MetaConfig
from gcache.errors import ProtocolError
from gcache.layout import Layout
from gcache.meta.core import MetaCore
from gcache.storage import columns
from gcache.storage.record import StoredRecord
from tests.kvdata import tiny_hybrid
from tests.unit.test_meta_tiers import KB, addr

NS_A, NS_B = bytes(range(16)), bytes(range(16, 32))


def records(n: int, seed: int = 1) -> list[StoredRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pos = rng.randrange(100)
        nsums = rng.choice((1, 2, 5))
        out.append(
            StoredRecord(
                namespace=NS_A if i % 3 else NS_B,
                key=rng.randbytes(16),
                parent=rng.randbytes(16) if pos else b"",
                pos=pos,
                group=rng.randrange(3),
                tier=rng.randrange(2),
                offset=rng.randrange(1 << 40) * 4096,
                length=rng.randrange(1, 1 << 33),
                sums=rng.randbytes(8 * nsums),
                seq=rng.randrange(1 << 60),
                layer_bytes=tuple(rng.randrange(1, 1 << 20) for _ in range(nsums))
                if i % 4 == 0
                else (),
            )
        )
    return out


def test_round_trip_in_block_order() -> None:
    recs = records(500)
    got = columns.decode(pb.StoredColumns.FromString(columns.encode(recs).SerializeToString()))
    want = sorted(recs, key=lambda r: r.pos)  # stable: ties keep the sent order
    assert len(got) == len(want)
    assert got.pos == [r.pos for r in want]
    assert got.key == [r.key for r in want]
    assert got.parent == [r.parent for r in want]
    assert got.namespace == [r.namespace for r in want]
    assert got.group == [r.group for r in want]
    assert got.tier == [r.tier for r in want]
    assert got.offset == [r.offset for r in want]
    assert got.length == [r.length for r in want]
    assert got.sums == [r.sums for r in want]
    assert got.seq == [r.seq for r in want]
    assert got.layer_bytes == [r.layer_bytes for r in want]


def test_equal_layers_send_no_layer_columns() -> None:
    recs = [r for r in records(50) if not r.layer_bytes]
    cols = columns.encode(recs)
    assert not cols.nlayer_bytes and not cols.layer_bytes
    assert columns.decode(cols).layer_bytes is None
    assert len(columns.decode(columns.encode([]))) == 0


@pytest.mark.parametrize(
    ("column", "cut", "words"),
    [
        ("keys", 5, "not 16 each"),
        ("parents", 16, "parents hold"),
        ("pos", 1, "column pos"),
        ("group", 1, "column group"),
        ("offset", 8, "column offset"),
        ("seq", 3, "column seq"),
        ("nsums", 2, "column nsums"),
        ("sums", 8, "sums hold"),
        ("layer_bytes", 4, "layer_bytes hold"),
        ("nlayer_bytes", 2, "column nlayer_bytes"),
    ],
)
def test_truncated_or_mismatched_columns_are_refused_whole(
    column: str, cut: int, words: str
) -> None:
    cols = columns.encode(records(40))
    setattr(cols, column, getattr(cols, column)[:-cut])
    with pytest.raises(ProtocolError, match=words) as err:
        columns.decode(cols)
    assert "\n" not in str(err.value)  # one line for the operator


def test_namespace_index_out_of_range_is_refused() -> None:
    cols = columns.encode(records(10))
    del cols.namespaces[1:]
    with pytest.raises(ProtocolError, match="namespace index"):
        columns.decode(cols)


def test_a_refused_chunk_adopts_nothing_and_the_next_good_one_still_does() -> None:
    """Against MetaCore: the decode error comes before any adoption."""
    spec = tiny_hybrid()
    layout = Layout(spec)
    core = MetaCore(MetaConfig())
    desc = {"model": "cols", "layout": msgspec.to_builtins(spec)}
    ns = core.register_namespace(desc, spec)
    core.register_server(addr(0), bytes(16), 1, 256 * KB, 0.0, report=True)
    ks = keys.block_keys(ns.fingerprint, list(range(4 * layout.block_size)), layout.block_size)
    size, nsums = layout.group_object_bytes[0], len(layout.group_layers[0])
    recs = [
        StoredRecord(
            ns.fingerprint, k, ks[i - 1] if i else b"", i, 0, 0, i * 4096, size, bytes(8 * nsums), i
        )
        for i, k in enumerate(ks)
    ]
    bad = columns.encode(recs[:2])
    bad.length = bad.length[:-8]
    with pytest.raises(ProtocolError):
        core.report_columns("s0", 1, columns.decode(bad), False, 1.0)
    assert core.stats()["objects"] == 0
    got = core.report_columns("s0", 1, columns.decode(columns.encode(recs)), True, 1.0)
    assert got == (len(recs), 0)
    assert core.stats()["objects"] == len(recs)


@pytest.mark.parametrize("arrays", [False, True])
def test_allocator_from_used_ranges_matches_one_allocation_per_range(arrays: bool) -> None:
    """A rebuilt server's allocator is made from the gaps between its reported
    ranges (SegmentAllocator.with_used, given tuples or two arrays): the same books
    as allocating each range."""
    import numpy as np

    from gcache.storage.allocator import SegmentAllocator

    def given(ranges: list[tuple[int, int]]) -> object:
        if not arrays:
            return ranges
        return (
            np.array([r[0] for r in ranges], np.int64),
            np.array([r[1] for r in ranges], np.int64),
        )

    rng = random.Random(3)
    cap, align = (1 << 24) + 1000, 4096
    used: list[tuple[int, int]] = []
    off = 0
    while True:
        off += rng.choice((0, 0, 4096, 3 * 4096))
        size = rng.randrange(1, 5 * 4096)
        if off + size > cap - 4096 * 4:
            break
        used.append((off, size))
        off += (size + align - 1) // align * align
    fast = SegmentAllocator.with_used(cap, align, given(used))  # type: ignore[arg-type]
    slow = SegmentAllocator(cap, align)
    cursor, gaps = 0, []
    for o, n in used:
        if o > cursor:
            gaps.append(slow.alloc(o - cursor))
        assert slow.alloc(n) == o
        cursor = o + (n + align - 1) // align * align
    for g in gaps:
        assert g is not None
        slow.free(g)
    assert list(fast.free_ranges()) == list(slow.free_ranges())
    assert (fast.used, fast.live, fast.capacity) == (slow.used, slow.live, slow.capacity)
    assert fast.largest_free() == slow.largest_free()
    for o, _ in used[::2]:
        fast.free(o)
        slow.free(o)
    assert list(fast.free_ranges()) == list(slow.free_ranges())
    assert fast.alloc(8192) == slow.alloc(8192)
    for bad in ([(0, 8192), (4096, 4096)], [(100, 10)], [(cap - 10, 4096)]):
        with pytest.raises(ValueError):
            SegmentAllocator.with_used(cap, align, given(bad))  # type: ignore[arg-type]


def _chain(fp: bytes, layout: Layout, n: int) -> list[StoredRecord]:
    ks = keys.block_keys(fp, list(range(n * layout.block_size)), layout.block_size)
    size, nsums = layout.group_object_bytes[0], len(layout.group_layers[0])
    return [
        StoredRecord(fp, k, ks[i - 1] if i else b"", i, 0, 0, i * 4096, size, bytes(8 * nsums), i)
        for i, k in enumerate(ks)
    ]


def test_parentless_records_wait_for_the_next_chunk_of_another_server_unparked() -> None:
    """Server 1 runs ahead (block 1 before server 0's block 0): its record is
    retried after server 0's next chunk and adopted without being parked."""
    spec = tiny_hybrid()
    layout = Layout(spec)
    core = MetaCore(MetaConfig())
    ns = core.register_namespace({"model": "ahead", "layout": msgspec.to_builtins(spec)}, spec)
    for i in range(2):
        core.register_server(addr(i), bytes(16), 1, 256 * KB, 0.0, report=True)
    recs = _chain(ns.fingerprint, layout, 3)
    got = core.report_columns("s1", 1, columns.decode(columns.encode(recs[1:2])), False, 1.0)
    assert got == (0, 0)
    assert core.deferred_of("s1") == 1 and core.stats()["parked_objects"] == 0
    got = core.report_columns("s0", 1, columns.decode(columns.encode(recs[:1])), False, 1.0)
    assert got == (1, 0)
    assert core.deferred_of("s1") == 0, "adopted after server 0's chunk"
    assert core.counters["objects_parked"] == 0
    # Its own next (last) chunk: credited with the record adopted meanwhile.
    got = core.report_columns("s1", 1, columns.decode(columns.encode(recs[2:])), True, 1.0)
    assert got == (2, 0)
    assert core.stats()["objects"] == 3


def test_a_record_still_without_parent_is_parked_before_its_servers_next_chunk() -> None:
    spec = tiny_hybrid()
    layout = Layout(spec)
    core = MetaCore(MetaConfig())
    ns = core.register_namespace({"model": "orphan", "layout": msgspec.to_builtins(spec)}, spec)
    core.register_server(addr(0), bytes(16), 1, 256 * KB, 0.0, report=True)
    recs = _chain(ns.fingerprint, layout, 4)
    core.report_columns("s0", 1, columns.decode(columns.encode(recs[2:3])), False, 1.0)
    assert core.counters["objects_parked"] == 0
    core.report_columns("s0", 1, columns.decode(columns.encode(recs[3:])), False, 1.0)
    assert core.counters["objects_parked"] == 1, "parked once its server moved on"
    got = core.report_columns("s0", 1, columns.decode(columns.encode(recs[:2])), True, 1.0)
    assert got == (4, 0), "the parked chain adopted once its parents came"
    assert core.stats()["parked_objects"] == 0 and core.stats()["objects"] == 4


def test_pacing_decision() -> None:
    from gcache.meta.pacing import MAX_HOLD_S, hold

    assert not hold(0, 0, 4, 0.0), "nothing waits for a parent: go on"
    assert hold(5, 0, 4, 0.0)
    assert hold(5, 2, 4, 0.0)
    assert not hold(5, 3, 4, 0.0), "every other stream waits: someone must go on"
    assert not hold(5, 0, 1, 0.0), "the only stream"
    assert not hold(5, 0, 4, MAX_HOLD_S)


def test_pacer_releases_a_stream_when_its_records_are_adopted_or_all_wait() -> None:
    import asyncio

    from gcache.meta.pacing import ReportPacer

    async def run() -> None:
        pacer = ReportPacer()
        pacer.started()
        pacer.started()
        left = [3]
        task = asyncio.ensure_future(pacer.pace(lambda: left[0]))
        await asyncio.sleep(0.01)
        assert not task.done() and pacer.waiting == 1
        left[0] = 0  # another stream's chunk brought the parents
        pacer.changed()
        assert await asyncio.wait_for(task, 1.0), "its records were adopted"
        # Both streams ahead: the second to wait goes on at once.
        first = asyncio.ensure_future(pacer.pace(lambda: 1))
        await asyncio.sleep(0.01)
        assert await asyncio.wait_for(pacer.pace(lambda: 1), 0.05), "did not wait"
        pacer.ended()  # the other stream ended: the first one goes on too
        assert not await asyncio.wait_for(first, 0.05), "waited in vain"
        assert pacer.waiting == 0 and pacer.holds == 2 and pacer.vain == 1

    asyncio.run(run())


def test_reported_layer_lengths_must_match_the_namespace_layout() -> None:
    """A record carrying layer lengths other than its layout's is dropped; the
    layout's own lengths (or none, for equal layers) are adopted."""
    from gcache.layout import LayerSpec, LayoutSpec
    from gcache.meta.records import group_layer_bytes

    big = LayerSpec("full", kv_heads=2, k_head_dim=8, v_head_dim=4)
    small = LayerSpec("full", kv_heads=1, k_head_dim=8, v_head_dim=4)
    spec = LayoutSpec(block_size=4, dtype="float16", layers=(big, small))
    layout = Layout(spec)
    want = group_layer_bytes(layout, 0)
    assert want == (192, 96)
    core = MetaCore(MetaConfig())
    ns = core.register_namespace({"model": "lb", "layout": msgspec.to_builtins(spec)}, spec)
    core.register_server(addr(0), bytes(16), 1, 256 * KB, 0.0, report=True)
    recs = _chain(ns.fingerprint, layout, 3)
    recs[0].layer_bytes = want
    recs[1].layer_bytes = (96, 192)  # wrong order: not this layout's object
    got = core.report_columns("s0", 1, columns.decode(columns.encode(recs)), True, 1.0)
    assert got is not None and got[0] == 1, got
    assert core.counters["report_invalid"] == 1
