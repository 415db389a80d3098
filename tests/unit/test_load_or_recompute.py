"""The client's load-or-recompute rule (client/gcache_client/tiers.py): a match stops
where fetching the rest, at the servers' measured tier bandwidths, would take longer
than recomputing it with the model's FLOPs."""

from __future__ import annotations

from gcache import wire
from gcache.compute import compute_for_layout
from gcache.layout import Layout, preset
from gcache_client.tiers import best_cut

LAYOUT = Layout(preset("mimo-v2-flash", 64))
COMPUTE = compute_for_layout(LAYOUT)
FULL = LAYOUT.group_tail_blocks.index(None)


def locs(tiers: list[int]) -> list[wire.ObjectLoc]:
    size = LAYOUT.group_object_bytes[FULL]
    return [
        wire.ObjectLoc(b, FULL, 0, wire.Grant(b * size, size, 0, bytes(8), tier=t), bytes(8))
        for b, t in enumerate(tiers)
    ]


def server(dram: float, nvme: float) -> list[wire.ServerAddr]:
    return [wire.ServerAddr("s", "h", 1, "h", "", 1, dram_read_gbps=dram, nvme_read_gbps=nvme)]


def test_fast_tiers_load_everything() -> None:
    assert best_cut(LAYOUT, COMPUTE, 8, locs([0] * 4 + [1] * 4), server(20.0, 5.0), 400.0) == 8


def test_without_measured_bandwidth_nothing_changes() -> None:
    assert best_cut(LAYOUT, COMPUTE, 8, locs([1] * 8), server(0.0, 0.0), 1e9) == 8


def test_a_slow_nvme_tail_is_recomputed_not_loaded() -> None:
    # DRAM at 20 GB/s, NVMe at 1 MB/s: the NVMe half costs far more than recomputing.
    assert best_cut(LAYOUT, COMPUTE, 8, locs([0] * 4 + [1] * 4), server(20.0, 0.001), 400.0) == 4


def test_everything_slow_is_a_miss() -> None:
    assert best_cut(LAYOUT, COMPUTE, 8, locs([1] * 8), server(0.001, 0.001), 400.0) == 0
