"""The merge of the servers' report streams by block position (meta/streams.py):
rows past the other streams' positions are held in columns and adopted with
their parents in one pass; holding is only about speed, so whatever the order
and interleaving, every reported object ends in the index and nothing stays
held. No processes: MetaCore is driven directly with chunks in columns."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.config import MetaConfig
from gcache.meta.core import MetaCore
from gcache.meta.rebuild import Parked
from gcache.meta.records import BlockEntry, ObjectRecord, ServerRecord
from gcache.meta.streams import StreamMerge, in_order, merged
from gcache.storage.columns import Columns, columns_of, concat, split
from tests.unit.test_meta_tiers import SLOW, addr, make, put, report_of, toks


def srv(i: int) -> ServerRecord:
    return ServerRecord(f"s{i}", addr(i), bytes(16), 1, 1 << 20, 0.0)


def rows(*pos: int, ns: bytes = b"n" * 16) -> Columns:
    """Columns of records at these block positions (keys name the position)."""

    def key(p: int) -> bytes:
        return bytes([p % 256]) * 16

    return columns_of(
        [
            Parked(ns, key(p), key(p - 1) if p else b"", p, 0, 0, 4096 * i, 4096, b"", i)
            for i, p in enumerate(pos)
        ]
    )


def test_rows_past_another_streams_position_wait_for_it() -> None:
    a, b = srv(0), srv(1)
    m = StreamMerge()
    # a alone so far: its position bounds nothing but itself
    (part,) = m.push(a, rows(0, 1, 2), False, 0.0)
    assert part[0] is a and part[1].pos == [0, 1, 2]
    # b at position 1: a's next rows past 1 wait
    parts = m.push(b, rows(0, 1), False, 0.0)
    assert [(s.server_id, c.pos) for s, c in parts] == [("s1", [0, 1])]
    parts = m.push(a, rows(3, 4, 5), False, 0.0)
    assert [(s.server_id, c.pos) for s, c in parts] == [("s0", [])]
    assert m.rows == 3 and m.held_of("s0") == 3
    # b reaches 4: a's rows up to 4 come out with b's, in one block order
    parts = m.push(b, rows(2, 3, 4), False, 0.0)
    cols, servers = merged(parts)
    assert cols.pos == [2, 3, 3, 4, 4]
    assert [s.server_id for s in servers] == ["s1", "s1", "s0", "s1", "s0"]
    assert m.held_of("s0") == 1
    # b ends: its position bounds nothing any more
    parts = m.push(b, rows(), True, 0.0)
    assert [(s.server_id, c.pos) for s, c in parts] == [("s1", []), ("s0", [5])]
    assert m.rows == 0
    assert m.stats()["report_rows_held_total"] == 3


def test_a_last_chunk_hands_out_all_its_rows_and_a_dead_servers_rows_go() -> None:
    a, b, c = srv(0), srv(1), srv(2)
    m = StreamMerge()
    m.push(c, rows(0), False, 0.0)  # c stays at position 0
    m.push(a, rows(0, 1, 2), False, 0.0)
    m.push(b, rows(0, 1, 2), False, 0.0)
    assert m.held_of("s0") == 2 and m.held_of("s1") == 2
    (part,) = m.push(a, rows(3), True, 0.0)  # a's stream ends: all of it goes
    assert part[1].pos == [1, 2, 3]
    b.alive = False
    parts = m.push(c, rows(1, 2), True, 0.0)  # b's rows are dropped, not handed out
    assert [s.server_id for s, _ in parts] == ["s2"]
    assert m.rows == 0


def test_held_rows_are_bounded_and_a_stalled_stream_is_found() -> None:
    a, b = srv(0), srv(1)
    m = StreamMerge(max_rows=4)
    m.push(b, rows(0), False, 0.0)
    m.push(a, rows(0, 1, 2, 3), False, 0.0)
    assert m.rows == 3
    (part,) = m.push(a, rows(4, 5), False, 1.0)  # 5 would be held: nothing is
    assert part[1].pos == [1, 2, 3, 4, 5] and m.rows == 0
    m.push(a, rows(6), False, 2.0)
    assert m.stalled(3.5, 1.0) == ["s0"] and m.stalled(2.5, 1.0) == []
    got = m.take("s0")
    assert got is not None and got[1].pos == [6] and m.rows == 0


def test_columns_split_concat_and_order_keep_every_column() -> None:
    c = rows(3, 1, 2)
    c.layer_bytes = [(1, 2), (), (3,)]
    head, tail = split(c, 1)
    assert head.pos == [3] and tail.pos == [1, 2] and tail.layer_bytes == [(), (3,)]
    back = concat([head, tail])
    assert back.fields() == c.fields()
    ordered, who = in_order(back, ["x", "y", "z"])
    assert ordered.pos == [1, 2, 3] and who == ["y", "z", "x"]
    assert ordered.layer_bytes == [(), (3,), (1, 2)] and ordered.key[2] == c.key[0]


def restarted(old: MetaCore, fp: bytes, servers: int) -> MetaCore:
    new = MetaCore(MetaConfig(compute_tflops=SLOW))
    new.register_namespace({"model": "m"}, old.namespaces[fp].layout.spec)
    for i in range(servers):
        new.register_server(addr(i), bytes(16), 1, 4 << 20, 0.0, report=True)
    return new


def index_of(core: MetaCore) -> set[tuple[bytes, int, str, int, int]]:
    return {
        (e.key, o.group, o.server.server_id, o.tier, o.offset)
        for ns in core.namespaces.values()
        for e in ns.entries.values()
        for o in e.objects
        if o is not None
    }


def books_match_a_rescan(core: MetaCore) -> None:
    """Every incremental count the adoption keeps, against a rescan of the index."""
    objs = [
        (ns, e, o)
        for ns in core.namespaces.values()
        for e in ns.entries.values()
        for o in e.objects
        if o is not None
    ]
    assert core.index.live_objects == len(objs)
    assert core.index.live_bytes == sum(o.length for _, _, o in objs)
    assert core.index.entries == sum(len(ns.entries) for ns in core.namespaces.values())
    for ns in core.namespaces.values():
        fg = ns.full_group
        assert fg is not None

        def full(e: BlockEntry, fg: int = fg) -> ObjectRecord | None:
            return e.objects[fg]

        assert ns.full_holes == len([e for e in ns.entries.values() if full(e) is None])
        for e in ns.entries.values():
            kids = [c for c in ns.entries.values() if c.parent is e]
            assert e.children == len(kids)
            hot = [c for c in kids if (o := full(c)) is not None and o.tier == 0]
            assert e.hot == len(hot)
    for srv in core.servers.values():
        mine = [o for _, _, o in objs if o.server is srv]
        assert srv.objects == len(mine)
        found = core.index.server_objects(srv).tolist()
        assert sorted(found) == sorted(o.oid for o in mine)
        nvme = [o for o in mine if o.tier]
        assert srv.nvme_bytes == sum(o.length for o in nvme)
        assert srv.nvme_count == len(nvme)


def filled(servers: int, prompts: int) -> tuple[MetaCore, bytes]:
    old, fp = make(servers=servers, capacity=4 << 20)
    for p in range(prompts):
        put(old, fp, toks(p, 2 + p % 7), float(p))
    assert not old.counters["evictions"]  # every block has its objects to report
    return old, fp


def test_children_ahead_of_their_parents_on_another_server_are_not_parked() -> None:
    old, fp = filled(2, 12)
    per = {sid: sorted(report_of(old, sid), key=lambda r: r.pos) for sid in ("s0", "s1")}
    new = restarted(old, fp, 2)
    # s0 sends everything at once, then s1 (the worst interleaving): s0's rows past
    # s1's position wait for s1's chunks instead of being parked.
    new.report_columns("s1", 1, columns_of(per["s1"][:1]), False, 1.0)
    new.report_columns("s0", 1, columns_of(per["s0"]), False, 1.0)
    assert new.counters["objects_parked"] == 0 and new.rebuild.streams.rows > 0
    new.report_columns("s1", 1, columns_of(per["s1"][1:]), True, 1.0)
    new.report_columns("s0", 1, columns_of([]), True, 1.0)
    assert new.counters["objects_parked"] == 0
    assert new.rebuild.streams.rows == 0 and new.parked_of("s0") == new.parked_of("s1") == 0
    assert index_of(new) == index_of(old)
    assert all(s.ready for s in new.servers.values())
    books_match_a_rescan(new)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    servers=st.integers(1, 3),
    chunk=st.integers(1, 9),
    unsorted=st.booleans(),
    nvme=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_any_interleaving_adopts_every_object_and_holds_nothing_at_the_end(
    seed: int, servers: int, chunk: int, unsorted: bool, nvme: float
) -> None:
    old, fp = filled(servers, 10)
    rng = random.Random(seed)
    streams: dict[str, list[Columns]] = {}
    want = set()
    for i in range(servers):
        recs = report_of(old, f"s{i}")
        for j, r in enumerate(recs):
            if rng.random() < nvme:  # on the server's NVMe tier (any address)
                r.tier, r.offset = 1, (1 << 30) + 4096 * j
            want.add((r.key, r.group, f"s{i}", r.tier, r.offset))
        recs.sort(key=lambda r: r.pos)
        if unsorted and i == 0:
            rng.shuffle(recs)  # a server that does not send in block order
        parts = [recs[j : j + chunk] for j in range(0, len(recs), chunk)] or [[]]
        streams[f"s{i}"] = [columns_of(p) for p in parts]
    new = restarted(old, fp, servers)
    # a twin fed the same, whose eviction policy filters its bulk-admitted items
    # at every admission (a rebuild at scale does past 65,536 of them)
    twin = restarted(old, fp, servers)
    twin.index.policy.pending_min = twin.index.policy._pending_check = 0  # type: ignore[attr-defined]
    left = {sid: list(parts) for sid, parts in streams.items()}
    while left:
        sid = rng.choice(sorted(left))
        cols = left[sid].pop(0)
        assert new.report_columns(sid, 1, cols, not left[sid], 1.0) is not None
        twin.report_columns(sid, 1, cols, not left[sid], 1.0)
        if not left[sid]:
            del left[sid]
        if rng.random() < 0.1:
            new.tick(1.0)
            twin.tick(1.0)
    assert new.rebuild.streams.rows == 0
    assert index_of(new) == want
    books_match_a_rescan(new)
    assert sum(new.parked_of(f"s{i}") for i in range(servers)) == 0
    assert all(s.ready for s in new.servers.values())

    # the filtered twin offers the same victims in the same order
    def order(core: MetaCore) -> list[tuple[bytes, int]]:
        return [(o.entry.key, o.group) for o, _ in core.evictions.candidates(0)]

    assert order(twin) == order(new)
