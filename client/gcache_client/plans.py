"""Read plans: which bytes of which server land in which view of the caller's
arrays, and the checks that make a read trustworthy (per block: xxh3-64 of K then V
against the checksum the meta holds). Plain synchronous code; the copy threads run
:func:`copy_verify` and :func:`verify`."""

from __future__ import annotations

from typing import Final, NamedTuple

import numpy as np

from gcache import _native as native
from gcache import wire
from gcache.errors import E_OUT_OF_RANGE, AccessDenied, IntegrityError
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


class GroupServer:
    """One server's (and tier's) blocks of one layout group in a match: what every
    layer of the group shares. Built once per match and group (a get_layers
    stream keeps them), so a layer's plan costs O(servers), not O(blocks).

    ``offsets`` (the grants' segment offsets) and ``rows`` (each block's row in
    the caller's arrays) are int64 arrays for the native read; ``sums`` is every
    block's per-layer checksums back to back, ``stride`` bytes a block."""

    __slots__ = ("expiry", "grant_bytes", "grants", "offsets", "rows", "stride", "sums")

    def __init__(self, locs: list[tuple[int, wire.ObjectLoc]], stride: int) -> None:
        self.grants = [loc.grant for _, loc in locs]
        self.offsets = np.fromiter((gr.offset for gr in self.grants), np.int64, len(locs))
        self.rows = np.fromiter((r for r, _ in locs), np.int64, len(locs))
        self.stride = stride
        for _, loc in locs:
            if len(loc.sums) != stride:
                raise IntegrityError(f"object ({loc.block}, {loc.group}) has no checksum per layer")
        self.sums = b"".join(loc.sums for _, loc in locs)
        self.expiry = min(gr.expiry_ms for gr in self.grants)  # unix ms
        self.grant_bytes = min(gr.length for gr in self.grants)


class PlanKey(NamedTuple):
    """Plans are per server and tier: a server's DRAM objects are read over
    shared memory where its segment is mapped, its NVMe (tier 1) ones through its
    staging file or over TCP (the server reads its disk)."""

    server: int  # index into ``Match.servers``
    nvme: bool  # tier 1


def plan_key(server: int, tier: int) -> PlanKey:
    return PlanKey(server, bool(tier & 1))


def plan_group(match: Match, g: int, first_blk: int) -> dict[PlanKey, GroupServer]:
    """Group ``g``'s blocks ``[first_blk, match.blocks)`` per :class:`PlanKey`."""
    stride = 8 * len(match.namespace.layout.group_layers[g])
    by_key: dict[PlanKey, list[tuple[int, wire.ObjectLoc]]] = {}
    objects = match.objects
    for blk in range(first_blk, match.blocks):
        loc = objects.get((blk, g))
        if loc is None:
            raise IntegrityError(f"match lacks object ({blk}, {g})")
        key = PlanKey(loc.server, bool(loc.grant.tier & 1))
        got = by_key.get(key)
        if got is None:
            got = by_key[key] = []
        got.append((blk - first_blk, loc))
    return {key: GroupServer(locs, stride) for key, locs in by_key.items()}


def layer_rows(match: Match, layer: int) -> tuple[int, int]:
    """(first token, token count) of the rows a read of ``layer`` returns: every
    matched token for full layers, the stored window for sliding ones."""
    layout = match.namespace.layout
    rows = layout.window_blocks(layout.layer_group[layer], match.blocks)
    bs = layout.block_size
    return rows.start * bs, len(rows) * bs


class LayerTarget:
    """One layer of a match to read: its rows, its place in each object of its
    group, and the caller's K and V arrays it lands in. Built once per layer read;
    every server's plan of the layer shares it."""

    __slots__ = (
        *("first_blk", "first_tok", "group", "k_arr", "kb", "kbytes", "layer", "li"),
        *("match", "nbytes", "off", "v_arr", "vb", "vbytes"),
    )

    def __init__(
        self, match: Match, layer: int, first_tok: int, k_arr: np.ndarray, v_arr: np.ndarray
    ) -> None:
        layout = match.namespace.layout
        self.match, self.layer, self.first_tok = match, layer, first_tok
        self.group = g = layout.layer_group[layer]
        self.first_blk = first_tok // layout.block_size
        self.off, self.kb, self.vb = layout.layer_range(layer)
        self.li = layout.group_layers[g].index(layer)
        self.k_arr, self.v_arr = k_arr, v_arr
        self.kbytes, self.vbytes = arrays.byte_view(k_arr), arrays.byte_view(v_arr)
        self.nbytes = k_arr.nbytes + v_arr.nbytes


class ServerPlan:
    """One server's share of a layer read: its :class:`GroupServer` and the
    layer's :class:`LayerTarget`. For TCP it also gives the grants, the ``(grant
    index, offset, length)`` ranges (K then V of each block), the destination views
    in the caller's arrays and per block the views and checksum to verify, made on
    first use (:meth:`materialize`): a shared-memory read never needs them."""

    __slots__ = (
        *("_checks", "_dest", "_ranges", "count", "gs", "kb", "kbytes", "li", "nbytes"),
        *("off", "vb", "vbytes"),
    )

    def __init__(self, gs: GroupServer, t: LayerTarget) -> None:
        self.gs = gs
        self.off, self.kb, self.vb, self.li = t.off, t.kb, t.vb, t.li
        self.kbytes, self.vbytes = t.kbytes, t.vbytes
        self.count = len(gs.grants)
        self.nbytes = self.count * (t.kb + t.vb)
        self._ranges: list[tuple[int, int, int]] | None = None
        self._dest: list[memoryview] = []
        self._checks: list[tuple[memoryview, memoryview, bytes]] = []

    @property
    def grants(self) -> list[wire.Grant]:
        return self.gs.grants

    @property
    def expiry(self) -> int:
        return self.gs.expiry

    def layer_copy(self, a: int, b: int) -> native.LayerCopy:
        """Blocks ``[a, b)`` of this share as one native copy-and-verify
        (:class:`gcache._native.LayerCopy`); out of range of the grants is refused."""
        gs = self.gs
        if self.off + self.kb + self.vb > gs.grant_bytes:
            raise AccessDenied(E_OUT_OF_RANGE, "layer range outside its grant")
        st = gs.stride
        if a == 0 and b == self.count:
            offsets, rows, sums = gs.offsets.data, gs.rows.data, memoryview(gs.sums)
        else:
            offsets, rows = gs.offsets[a:b].data, gs.rows[a:b].data
            sums = memoryview(gs.sums)[a * st : b * st]
        return native.LayerCopy(
            self.kbytes, self.vbytes, offsets, rows, sums, st, self.li, self.off, self.kb, self.vb
        )

    def materialize(self) -> None:
        """The per-block ranges, views and checks a TCP read needs (~1 ms for a full
        MiMo layer of 512 blocks: the stream runs it on a copy thread)."""
        if self._ranges is not None:
            return
        kb, vb, off, li, stride = self.kb, self.vb, self.off, self.li, self.gs.stride
        ranges: list[tuple[int, int, int]] = []
        dest: list[memoryview] = []
        checks: list[tuple[memoryview, memoryview, bytes]] = []
        kbytes, vbytes, sums = self.kbytes, self.vbytes, self.gs.sums
        for gi, (base, r) in enumerate(
            zip(self.gs.offsets.tolist(), self.gs.rows.tolist(), strict=True)
        ):
            base += off
            ranges += ((gi, base, kb), (gi, base + kb, vb))
            kd, vd = kbytes[r * kb : (r + 1) * kb], vbytes[r * vb : (r + 1) * vb]
            dest += (kd, vd)
            c = gi * stride + 8 * li
            checks.append((kd, vd, sums[c : c + 8]))
        self._dest, self._checks, self._ranges = dest, checks, ranges

    @property
    def ranges(self) -> list[tuple[int, int, int]]:
        self.materialize()
        assert self._ranges is not None
        return self._ranges

    @property
    def dest(self) -> list[memoryview]:
        self.materialize()
        return self._dest

    @property
    def checks(self) -> list[tuple[memoryview, memoryview, bytes]]:
        self.materialize()
        return self._checks


GroupPlans = dict[int, dict[PlanKey, GroupServer]]  # group -> its plans, one match


def plan_layer(t: LayerTarget, groups: GroupPlans | None = None) -> dict[PlanKey, ServerPlan]:
    """One layer's reads, per :class:`PlanKey` (server index and tier). ``groups``:
    the group plans of this match made so far (filled in here), shared by a
    stream's layers."""
    gp = None if groups is None else groups.get(t.group)
    if gp is None:
        gp = plan_group(t.match, t.group, t.first_blk)
        if groups is not None:
            groups[t.group] = gp
    return {key: ServerPlan(gs, t) for key, gs in gp.items()}


def copy_verify(seg: MappedSegment, sp: ServerPlan, a: int, b: int) -> bool:
    """Copy blocks ``[a, b)`` of a local server's share under its lease and verify
    them, checksumming each block's bytes as they land: one native call (no GIL)
    plans the ranges, copies and compares with the meta's checksums."""
    return seg.read_layer(sp.layer_copy(a, b), sp.gs.expiry) < 0
