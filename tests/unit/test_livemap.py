"""The allocator's live map (gcache/storage/livemap.py) against a dict, with the C
probes and with the dict fallback, through growth and removed slots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache._native import INDEX_KERNELS
from gcache.storage.livemap import MAX_KEY, LiveMap

OPS = st.lists(
    st.tuples(st.sampled_from("ppgd"), st.integers(0, 300), st.integers(0, 1 << 32 - 1)),
    max_size=400,
)


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_live_map_acts_as_a_dict(native: bool, ops: list[tuple[str, int, int]]) -> None:
    if native and INDEX_KERNELS is None:
        pytest.skip("native kernels off (GCACHE_NATIVE=0); CI builds them")
    m, model = LiveMap(native=native), {}
    for op, k, v in ops:
        if op == "p":
            m.put(k, v)
            model[k] = v
        elif op == "g":
            assert m.get(k) == model.get(k, -1)
        else:
            assert m.pop(k) == model.pop(k, -1)
        assert len(m) == len(model)
    assert dict(m.items()) == model
    units, values = m.arrays()
    assert dict(zip(units.tolist(), values.tolist(), strict=True)) == model
    probe = np.array([k for _, k, _ in ops[:20]] + [301, -5], dtype=np.int64)
    assert m.any_of(probe) == any(int(u) in model for u in probe)
    assert m.get_many(probe).tolist() == [model.get(int(u), -1) for u in probe]
    if native:  # at most 3/4 full, removed slots counted
        assert 4 * (m.n + m.tombs) <= 3 * m.keys.size


def test_live_map_bulk_and_bounds() -> None:
    m = LiveMap()
    units = np.arange(0, 100_000, 3, dtype=np.int64)
    m.put_many(units, units % 7 + 1)
    assert len(m) == len(units)
    assert m.get(99) == 99 % 7 + 1 and m.get(100) == -1
    with pytest.raises(ValueError):
        m.put(MAX_KEY + 1, 1)
    with pytest.raises(ValueError):
        m.put(-1, 1)
    if INDEX_KERNELS is not None:
        assert m.nbytes() <= 8 * 3 * len(units)  # two uint32 a slot, at most 8/3 a range
