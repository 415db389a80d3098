"""Read plans: which bytes of which server land in which view of the caller's
arrays, and the checks that make a read trustworthy (per block: xxh3-64 of K then V
against the checksum the meta holds). Plain synchronous code; the copy threads run
:func:`copy_verify` and :func:`verify`."""

from __future__ import annotations

from typing import Final

import numpy as np

from gcache import _native as native
from gcache import wire
from gcache.errors import IntegrityError
from gcache.transport.shm import MappedSegment
from gcache_client import arrays
from gcache_client.types import Match

# In get_layers, shared-memory copies and checksums of at least this many bytes per
# layer run on the copy threads (numpy's copy runs without the GIL).
OFFLOAD_BYTES: Final = 1 << 20
SPLIT_BYTES: Final = 8 << 20  # and at least this many are split across the threads
COPY_THREADS: Final = 2


def halves(n: int, nbytes: int) -> list[tuple[int, int]]:
    """Index ranges splitting ``n`` pieces across the copy threads when the layer is
    large enough for that to pay (a full MiMo layer at 32k tokens is ~84 MB)."""
    if native.NATIVE or nbytes < SPLIT_BYTES or n < COPY_THREADS:
        return [(0, n)]  # the native kernel splits a large call across threads itself
    step = -(-n // COPY_THREADS)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def verify(checks: list[tuple[memoryview, memoryview, bytes]]) -> bool:
    """Every block's K then V against its checksum, in one native call (no GIL)."""
    pieces: list[memoryview] = []
    for kd, vd, _ in checks:
        pieces += (kd, vd)
    return native.checksums(pieces, 2) == b"".join(c[2] for c in checks)


class ServerPlan:
    """One server's share of a layer read: the grants, the ``(grant index, offset,
    length)`` ranges (K then V of each block), the destination views in the caller's
    arrays, and per block the views and checksum to verify."""

    __slots__ = ("checks", "dest", "expiry", "grants", "nbytes", "ranges")

    def __init__(self) -> None:
        self.grants: list[wire.Grant] = []
        self.ranges: list[tuple[int, int, int]] = []
        self.dest: list[memoryview] = []
        self.checks: list[tuple[memoryview, memoryview, bytes]] = []
        self.expiry = 0  # the earliest grant expiry (unix ms)
        self.nbytes = 0


def plan_key(server: int, tier: int) -> int:
    """Plans are per server and tier: NVMe (tier 1) objects are always read over TCP
    (the server reads its disk), DRAM ones over shared memory where it is mapped."""
    return server << 1 | (tier & 1)


def plan_layer(
    match: Match,
    g: int,
    first_blk: int,
    off: int,
    kb: int,
    vb: int,
    li: int,
    k_arr: np.ndarray,
    v_arr: np.ndarray,
) -> dict[int, ServerPlan]:
    """One layer's reads, per :func:`plan_key` (server index and tier)."""
    plans: dict[int, ServerPlan] = {}
    kbytes, vbytes = arrays.byte_view(k_arr), arrays.byte_view(v_arr)
    objects = match.objects
    for blk in range(first_blk, match.blocks):
        loc = objects.get((blk, g))
        if loc is None:
            raise IntegrityError(f"match lacks object ({blk}, {g})")
        key = plan_key(loc.server, loc.grant.tier)
        sp = plans.get(key)
        if sp is None:
            sp = plans[key] = ServerPlan()
        gi = len(sp.grants)
        sp.grants.append(loc.grant)
        base = loc.grant.offset + off
        sp.ranges += ((gi, base, kb), (gi, base + kb, vb))
        r = blk - first_blk
        kd, vd = kbytes[r * kb : (r + 1) * kb], vbytes[r * vb : (r + 1) * vb]
        sp.dest += (kd, vd)
        sp.checks.append((kd, vd, loc.sums[li * 8 : li * 8 + 8]))
    for sp in plans.values():
        sp.expiry = min(gr.expiry_ms for gr in sp.grants)
        sp.nbytes = len(sp.checks) * (kb + vb)
    return plans


def copy_verify(seg: MappedSegment, sp: ServerPlan, a: int, b: int) -> bool:
    """Copy blocks ``[a, b)`` of a local server's share under its lease and verify
    them, checksumming each block's bytes as they land (one pass, no GIL)."""
    spans = [(o, n) for _, o, n in sp.ranges[2 * a : 2 * b]]
    sums = seg.read_checksums(spans, sp.dest[2 * a : 2 * b], 2, sp.expiry)
    return sums == b"".join(c[2] for c in sp.checks[a:b])
