"""Load or recompute: how much of a match is worth fetching.

A match's objects lie in DRAM or on NVMe (``ObjectLoc.grant.tier``), on servers
that measured their read bandwidths at start (``ServerAddr.dram_read_gbps``,
``nvme_read_gbps``). Loading blocks ``[0, q)`` and recomputing ``[q, P)`` takes

    fetch(q) + FLOPs(q*bs, P*bs) / (compute_tflops * 1e12)

where ``fetch(q)`` is the bytes of the objects a match of ``q`` blocks reads, each
over its tier's bandwidth, and the FLOPs come from the compute model of
docs/eviction.md (:mod:`gcache.compute`). :func:`best_cut` returns the ``q`` with
the least total (the longest on a tie). A server that reported no bandwidth
counts as free to read from, so without figures nothing changes. Pure functions,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from gcache import wire
from gcache.compute import ModelCompute
from gcache.layout import Layout


def fetch_seconds(loc: wire.ObjectLoc, servers: Sequence[wire.ServerAddr]) -> float:
    addr = servers[loc.server]
    gbps = addr.nvme_read_gbps if loc.grant.tier else addr.dram_read_gbps
    return loc.grant.length / (gbps * 1e9) if gbps > 0 else 0.0


def best_cut(
    layout: Layout,
    compute: ModelCompute,
    blocks: int,
    objects: Sequence[wire.ObjectLoc],
    servers: Sequence[wire.ServerAddr],
    tflops: float,
) -> int:
    """The number of blocks worth loading of a ``blocks``-block match."""
    if blocks <= 0:
        return 0
    full = layout.group_tail_blocks.index(None) if None in layout.group_tail_blocks else None
    per_block = [0.0] * blocks
    windows = 0.0  # a cut anywhere reads about one window's worth: counted for every q > 0
    for loc in objects:
        t = fetch_seconds(loc, servers)
        if loc.group == full and loc.block < blocks:
            per_block[loc.block] += t
        else:
            windows += t
    bs = layout.block_size
    rate = tflops * 1e12
    end = blocks * bs
    best_q, best_t = blocks, float("inf")
    fetched = 0.0
    for q in range(blocks + 1):
        total = (fetched + windows if q else 0.0) + compute.span(q * bs, end) / rate
        if total <= best_t:
            best_q, best_t = q, total
        if q < blocks:
            fetched += per_block[q]
    return best_q
