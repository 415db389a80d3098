from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from gcache.storage.allocator import SegmentAllocator

KIB = 1024
MIB = 1024 * KIB


def test_basic_alloc_free() -> None:
    a = SegmentAllocator(1 * MIB)
    assert a.capacity == MIB and a.used == 0 and a.free_bytes == MIB and a.live == 0
    x = a.alloc(10 * KIB)
    y = a.alloc(4 * KIB)
    assert x is not None and y is not None and x != y
    assert a.size_of(x) == 12 * KIB
    assert a.size_of(y) == 4 * KIB
    assert a.used == 16 * KIB and a.live == 2
    assert a.used + a.free_bytes == a.capacity
    a.free(x)
    assert a.live == 1 and a.used == 4 * KIB
    a.free(y)
    assert a.used == 0 and a.live == 0
    assert list(a.free_ranges()) == [(0, MIB)]
    assert "SegmentAllocator(" in repr(a) and "fragmentation=" in repr(a)


def test_alignment() -> None:
    a = SegmentAllocator(1 * MIB)
    for size in (1, 4095, 4096, 4097, 12345, 65536):
        off = a.alloc(size)
        assert off is not None and off % 4096 == 0
        assert a.size_of(off) == -(-size // 4096) * 4096
    b = SegmentAllocator(10_000, align=512)
    assert b.capacity == 9728  # rounded down to align
    off = b.alloc(1)
    assert off is not None and off % 512 == 0 and b.size_of(off) == 512
    with pytest.raises(ValueError):
        SegmentAllocator(MIB, align=3000)
    with pytest.raises(ValueError):
        a.alloc(0)


def test_none_when_full() -> None:
    a = SegmentAllocator(64 * KIB)
    maybe = [a.alloc(16 * KIB) for _ in range(4)]
    offs = [o for o in maybe if o is not None]
    assert len(offs) == 4
    assert a.alloc(1) is None
    assert a.free_bytes == 0 and a.largest_free() == 0
    assert a.stats()["fragmentation"] == 0
    a.free(offs[0])
    a.free(offs[2])
    # 32 KiB free but in two non-adjacent 16 KiB holes
    assert a.alloc(32 * KIB) is None
    assert a.stats()["fragmentation"] == pytest.approx(0.5)
    assert a.alloc(16 * KIB) is not None
    assert SegmentAllocator(0).alloc(1) is None


def test_coalesce_to_single_block_random_order() -> None:
    rng = random.Random(1234)
    cap = 64 * MIB
    a = SegmentAllocator(cap)
    offs: list[int] = []
    while True:
        off = a.alloc(rng.choice((16 * KIB, 48 * KIB, 2 * MIB, rng.randint(1, 300_000))))
        if off is None:
            break
        offs.append(off)
    assert a.live == len(offs) > 10
    rng.shuffle(offs)
    for i, off in enumerate(offs):
        a.free(off)
        if i % 7 == 0:  # churn while partially free
            again = a.alloc(32 * KIB)
            if again is not None:
                a.free(again)
    assert a.used == 0 and a.live == 0
    assert list(a.free_ranges()) == [(0, cap)]
    assert a.largest_free() == cap
    assert a.stats()["free_blocks"] == 1


def test_fit_found_beyond_bounded_scan() -> None:
    # 20 free 16-page blocks share a bin with one 17-page block and no larger
    # bin exists: the fitting block must still be found past the bounded scan.
    p = 4096
    a = SegmentAllocator(20 * 17 * p + 17 * p)
    holes = []
    for _ in range(20):
        off = a.alloc(16 * p)
        assert off is not None and a.alloc(p) is not None
        holes.append(off)
    big = a.alloc(17 * p)
    assert big is not None and a.free_bytes == 0
    for off in [*holes, big]:
        a.free(off)
    assert a.largest_free() == 17 * p
    assert a.alloc(17 * p) == big


def test_double_free_and_foreign_offset() -> None:
    a = SegmentAllocator(MIB)
    x = a.alloc(8 * KIB)
    assert x is not None
    a.free(x)
    with pytest.raises(ValueError, match="not a live allocation"):
        a.free(x)
    y = a.alloc(8 * KIB)
    assert y is not None
    with pytest.raises(ValueError, match="not a live allocation"):
        a.free(y + 4096)  # inside an allocation, not its start
    with pytest.raises(ValueError):
        a.free(10 * MIB)
    with pytest.raises(ValueError):
        a.size_of(y + 4096)
    assert a.live == 1 and a.used == 8 * KIB


ALIGN = 4096
CAP = 211 * ALIGN  # not a power of two, exercises odd remainders
# Mostly a few "layout" sizes, like real KV objects, plus arbitrary ones.
SIZES = st.one_of(
    st.sampled_from([ALIGN, 3 * ALIGN, 3 * ALIGN - 100, 17 * ALIGN]),
    st.integers(1, 60 * ALIGN),
)


class AllocatorMachine(RuleBasedStateMachine):
    allocs = Bundle("allocs")

    def __init__(self) -> None:
        super().__init__()
        self.a = SegmentAllocator(CAP, align=ALIGN)
        self.model: dict[int, int] = {}  # offset -> requested size

    def _record(self, size: int, off: int | None) -> int | None:
        if off is not None:
            assert off not in self.model
            self.model[off] = size
            assert self.a.size_of(off) == -(-size // ALIGN) * ALIGN
        return off

    @rule(target=allocs, size=SIZES)
    def alloc(self, size: int) -> int | None:
        rounded = -(-size // ALIGN) * ALIGN
        largest = self.a.largest_free()
        off = self.a.alloc(size)
        assert (off is not None) == (rounded <= largest)
        return self._record(size, off)

    @precondition(lambda self: self.a.largest_free() > 0)
    @rule(target=allocs, data=st.data())
    def alloc_fitting(self, data: st.DataObject) -> int | None:
        size = data.draw(st.integers(1, self.a.largest_free()))
        off = self.a.alloc(size)
        assert off is not None, "size <= largest_free() must succeed"
        return self._record(size, off)

    @rule(off=consumes(allocs))
    def free(self, off: int | None) -> None:
        if off is None or off not in self.model:
            return
        self.a.free(off)
        del self.model[off]
        with pytest.raises(ValueError):
            self.a.free(off)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def free_everything(self, data: st.DataObject) -> None:
        offs = data.draw(st.permutations(sorted(self.model)))
        for off in offs:
            self.a.free(off)
        self.model.clear()
        assert list(self.a.free_ranges()) == [(0, CAP)]
        assert self.a.stats()["free_blocks"] == 1

    @invariant()
    def accounting(self) -> None:
        a = self.a
        assert a.used + a.free_bytes == a.capacity == CAP
        assert a.live == len(self.model)
        assert a.used == sum(a.size_of(o) for o in self.model)

    @invariant()
    def tiling(self) -> None:
        # live allocations and free blocks exactly tile [0, CAP), no overlap,
        # and no two free blocks are adjacent (coalescing is immediate)
        spans = [(o, self.a.size_of(o), True) for o in self.model]
        spans += [(o, s, False) for o, s in self.a.free_ranges()]
        spans.sort()
        pos = 0
        prev_free = False
        for off, size, is_live in spans:
            assert off == pos and size > 0 and off % ALIGN == 0
            assert is_live or not prev_free
            prev_free = not is_live
            pos = off + size
        assert pos == CAP
        free_sizes = [s for _, s, live in spans if not live]
        assert self.a.largest_free() == max(free_sizes, default=0)

    def teardown(self) -> None:
        for off in list(self.model):
            self.a.free(off)
        assert list(self.a.free_ranges()) == [(0, CAP)]
        assert self.a.used == 0 and self.a.largest_free() == CAP


AllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_allocator_state_machine = AllocatorMachine.TestCase
