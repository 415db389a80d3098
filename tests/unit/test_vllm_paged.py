"""gcache_client.engines.vllm.paged: rows <-> vLLM's CPU paged KV cache, checked against a
row-by-row reference (runs of consecutive blocks, partial edge blocks, vLLM's null
block, blocks in any order)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from gcache_client.engines.vllm.paged import Seg, from_cache, kv_views, segments, to_cache  # noqa: E402

NB, H, BS, D = 12, 2, 4, 3


def _ref_put(cache: Any, ids: list[int], k: Any, v: Any, lo: int) -> None:
    kc, vc = kv_views(cache)
    for r in range(len(k)):
        t = lo + r
        b = ids[t // BS]
        if b:
            kc[b, :, t % BS] = k[r]
            vc[b, :, t % BS] = v[r]


def test_segments_merge_consecutive_blocks_and_split_edges() -> None:
    ids = [5, 6, 7, 2, 3, 9]
    # rows 2..21: partial block 5, whole 6-7 (one run), whole 2-3 (one run), partial 9
    assert segments(ids, BS, 2, 22) == [
        Seg(5, 1, 2, 2, 2),
        Seg(6, 2, 0, 4, 8),
        Seg(2, 2, 0, 12, 8),
        Seg(9, 1, 0, 20, 2),
    ]
    # vLLM's null block (0: dropped outside a sliding window) is left out
    assert segments([0, 0, 4, 5], BS, 0, 16) == [Seg(4, 2, 0, 8, 8)]
    with pytest.raises(IndexError):
        segments([1], BS, 0, 8)


@pytest.mark.parametrize(("lo", "hi"), [(0, 24), (3, 21), (4, 8), (5, 6), (8, 24)])
def test_to_cache_and_from_cache_match_row_by_row(lo: int, hi: int) -> None:
    gen = torch.Generator().manual_seed(lo * 100 + hi)
    ids = [3, 4, 0, 8, 7, 1]  # a run, a null block, out of order, a run
    k = torch.randn(hi - lo, H, D, generator=gen)
    v = torch.randn(hi - lo, H, D, generator=gen)
    want = torch.zeros(NB, H, BS, 2 * D)
    _ref_put(want, ids, k, v, lo)
    got = torch.zeros(NB, H, BS, 2 * D)
    kc, vc = kv_views(got)
    segs = segments(ids, BS, lo, hi)
    live_rows = sum(s.rows for s in segs)
    assert to_cache(kc, vc, segs, k, v, lo) == live_rows * H * D * 4 * 2
    assert torch.equal(got, want)
    # and back: every live row equal, rows in the null block untouched
    k2 = torch.full_like(k, -7.0)
    v2 = torch.full_like(v, -7.0)
    from_cache(kc, vc, segs, k2, v2, lo)
    for r in range(hi - lo):
        t = lo + r
        if ids[t // BS]:
            assert torch.equal(k2[r], k[r]) and torch.equal(v2[r], v[r])
        else:
            assert bool((k2[r] == -7.0).all())


def test_to_cache_converts_dtype() -> None:
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    kc, vc = kv_views(cache)
    k = torch.randn(BS, H, D)
    to_cache(kc, vc, segments([2], BS, 0, BS), k, k, 0)
    assert torch.equal(kc[2].transpose(0, 1), k.to(torch.bfloat16))
