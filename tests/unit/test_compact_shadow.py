"""The compact index against the meta's own index, under the meta's own hypothesis
state machines (tests/unit/test_meta_state_machine.py: puts, commits, aborts,
leases, evictions, server restarts, session ends; test_meta_tiers_state_machine.py:
two tiers, demotions and their failures, promotions, NVMe eviction): after every
step a :class:`~tests.unit.compact_shadow.CompactShadow` applies what the step
changed through the compact index's API and checks that what it derived (children
and hot counts, which objects are evictable, each tier's LRU victim, prefixes,
objects detached while leased) is what the meta holds. The machines' own
invariants run as before. And a rebuild: the compact index's bulk load of the
servers' report chunks against the meta's adoption of the same chunks."""

from __future__ import annotations

import random
from typing import TypeVar

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from gcache import keys
from gcache.config import MetaConfig
from gcache.layout import Layout
from gcache.meta.compact import CompactIndex
from gcache.meta.core import MetaCore
from gcache.meta.eviction import evictable
from gcache.meta.keymap import split_keys
from gcache.storage import columns
from gcache.storage.record import StoredRecord
from tests.kvdata import tiny_hybrid
from tests.unit.compact_shadow import CompactShadow, tick_of
from tests.unit.test_meta_state_machine import MetaMachine
from tests.unit.test_meta_tiers import addr
from tests.unit.test_meta_tiers_state_machine import TierMachine

M = TypeVar("M", MetaMachine, TierMachine)


def shadowed(machine: type[M], steps: int) -> type[M]:
    """``machine`` with a :class:`CompactShadow` following its meta after every step."""

    class Shadowed(machine):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            self.shadow = CompactShadow(self.core)

        @invariant()
        def compact_index_agrees(self) -> None:
            self.shadow.sync()
            self.shadow.check()

    Shadowed.__name__ = Shadowed.__qualname__ = f"Shadowed{machine.__name__}"
    Shadowed.TestCase.settings = settings(
        max_examples=100, stateful_step_count=steps, deadline=None
    )
    return Shadowed


ShadowedMeta = shadowed(MetaMachine, 40)
test_compact_follows_the_meta = ShadowedMeta.TestCase
ShadowedTiers = shadowed(TierMachine, 50)
test_compact_follows_the_meta_tiers = ShadowedTiers.TestCase


# ---- a rebuild: the compact index's bulk load against the meta's adoption -------------


def _reports(
    fp: bytes, layout: Layout, prompts: list[list[int]], rng: random.Random, nvme: bool
) -> dict[int, list[StoredRecord]]:
    """Each server's records of ``prompts`` (shared prefixes share blocks): the full
    object on every block, windows where ``Layout.groups_to_store`` puts them, each
    object on one server, DRAM or (``nvme``) NVMe."""
    bs = layout.block_size
    out: dict[int, list[StoredRecord]] = {0: [], 1: []}
    seen: set[tuple[bytes, int]] = set()
    nxt = {(s, t): 0 for s in out for t in (0, 1)}
    for p in prompts:
        ks = keys.block_keys(fp, [t for x in p for t in [x] * bs], bs)
        for i, (k, mask) in enumerate(zip(ks, layout.groups_to_store(len(ks)), strict=True)):
            for g in range(layout.num_groups):
                if not mask >> g & 1 or (k, g) in seen:
                    continue
                seen.add((k, g))
                srv, tier = rng.randrange(2), rng.randrange(2) if nvme else 0
                off = nxt[(srv, tier)]
                nxt[(srv, tier)] += 4096
                sums = rng.randbytes(8 * len(layout.group_layers[g]))
                out[srv].append(
                    StoredRecord(fp, k, ks[i - 1] if i else b"", i, g, tier, off,
                                 layout.group_object_bytes[g], sums, rng.randrange(1 << 20))
                )  # fmt: skip
    return out


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=6),
    chunk=st.integers(1, 6),
    seed=st.integers(0, 1 << 16),
    nvme=st.booleans(),
)
def test_compact_bulk_load_builds_what_the_meta_adopts(
    prompts: list[list[int]], chunk: int, seed: int, nvme: bool
) -> None:
    """Two servers report a forest of prompts in shuffled chunks, interleaved; the
    meta adopts them (merging by position, parking what waits for a parent), and
    the compact index loads the same decoded chunks in bulk (``add_blocks`` with
    orphans retried with the next chunk, ``add_objects``, the heaps built once by
    ``end_bulk``). Both hold the same blocks, parents, objects and evictable sets."""
    rng = random.Random(seed)
    spec = tiny_hybrid()
    layout = Layout(spec)
    core = MetaCore(MetaConfig())
    ns = core.register_namespace({"model": "rb", "layout": msgspec.to_builtins(spec)}, spec)
    for i in range(2):
        core.register_server(addr(i), bytes(16), 1, 1 << 30, 0.0, report=True,
                             nvme_capacity=1 << 30 if nvme else 0)  # fmt: skip
    reports = _reports(ns.fingerprint, layout, prompts, rng, nvme)
    chunks: list[tuple[int, list[StoredRecord], bool]] = []
    for s, recs in reports.items():
        rng.shuffle(recs)
        parts = [recs[i : i + chunk] for i in range(0, len(recs), chunk)] or [[]]
        chunks += [(s, part, j == len(parts) - 1) for j, part in enumerate(parts)]
    rng.shuffle(chunks)
    chunks.sort(key=lambda c: c[2])  # each server's last chunk after its others
    decoded = [(s, columns.decode(columns.encode(part)), last) for s, part, last in chunks]
    for s, cols, last in decoded:
        got = core.report_columns(f"s{s}", 1, cols, last, 1.0)
        assert got is not None and got[1] == 0, "the generator made an invalid record"
    assert core.stats()["parked_objects"] == 0
    # The compact side, fed the same chunks.
    ix = CompactIndex(groups=layout.num_groups)
    ix.namespace(ns.ns_id, ns.full_group)
    ix.begin_bulk()
    waiting: list[tuple[int, int]] = []  # (chunk, row) of orphans, retried
    for c, (_s, cols, _) in enumerate(decoded):
        rows = waiting + [(c, r) for r in range(len(cols))]
        blocks: dict[bytes, tuple[bytes, int]] = {}
        for cc, r in rows:
            col = decoded[cc][1]
            blocks.setdefault(col.key[r], (col.parent[r], col.pos[r]))
        ks = list(blocks)
        k0, k1 = split_keys(ks)
        pk0, pk1 = split_keys([blocks[k][0] or bytes(16) for k in ks])
        ids = ix.add_blocks(ns.ns_id, k0, k1, pk0, pk1,
                            np.array([blocks[k][1] for k in ks], np.int32))  # fmt: skip
        bid = dict(zip(ks, ids.tolist(), strict=True))
        waiting = []
        for cc, r in rows:
            sc, col = decoded[cc][0], decoded[cc][1]
            b = bid[col.key[r]]
            if b < 0:
                waiting.append((cc, r))
                continue
            rec = ns.entries[col.key[r]].objects[col.group[r]]
            assert rec is not None
            ix.add_objects(
                np.array([b], np.int32), col.group[r], sc, np.array([col.offset[r]], np.uint64),
                np.array([col.length[r]], np.uint32),
                np.frombuffer(col.sums[r], np.uint8).reshape(1, -1),
                np.array([tick_of(rec.last_access)], np.uint64), col.tier[r],
            )  # fmt: skip
    ix.end_bulk()
    assert not waiting
    assert ix.stats()["blocks"] == len(ns.entries)
    o = ix.objects.cols
    n_objs = 0
    for key, e in ns.entries.items():
        k0, k1 = split_keys([key])
        b = int(ix.find(ns.ns_id, k0, k1)[0])
        assert b >= 0
        parent = int(ix.blocks.cols["parent"][b])
        if e.parent is None:
            assert parent == -1
        else:
            pk0, pk1 = split_keys([e.parent.key])
            assert parent == int(ix.find(ns.ns_id, pk0, pk1)[0])
        assert int(ix.blocks.cols["children"][b]) == e.children
        assert int(ix.blocks.cols["hot"][b]) == e.hot
        for g, rec in enumerate(e.objects):
            oid = int(ix.blocks.cols["obj"][b, g])
            assert (oid >= 0) == (rec is not None)
            if rec is None:
                continue
            n_objs += 1
            assert (int(o["tier"][oid]), int(o["offset"][oid])) == (rec.tier, rec.offset)
            assert ix.sums(oid) == rec.sums
            assert (int(o["hpos"][oid]) >= 0) == evictable(rec, ns)
    assert ix.stats()["objects"] == n_objs
