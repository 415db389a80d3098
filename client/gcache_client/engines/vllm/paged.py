"""Copies between GCache's token-major rows (``[tokens, kv_heads, head_dim]`` per
layer, K and V apart) and vLLM's paged KV cache (CPU backend:
``[blocks, kv_heads, block_size, 2 * head_dim]``, read as K = rows
``[0, block_size)`` and V = rows ``[block_size, 2 * block_size)`` of the
``[blocks, kv_heads, 2 * block_size, head_dim]`` view).

A request's rows ``[lo, hi)`` in one KV cache group are cut once per step into
:class:`Seg` s (:func:`segments`): runs of whole blocks with consecutive block ids,
and partial blocks at the edges; every layer of the group reuses them. A run is
one strided ``copy_`` per layer for K and one for V (tokens x heads transposed
on the fly): measured on the 2-core CPU, 7,680 rows of 2 heads x 64 floats per
layer take 0.6 ms as one run, 1.0 ms block by block, 10-30 ms through
``index_copy_``/advanced indexing (torch's scatter of a strided source).

The GCache layout cannot be filled in place here: a read writes C-contiguous
token-major rows and vLLM's blocks are head-major, so one transposing copy is the
least there is (the rows read also serve as the source of the request's store).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # vLLM's placeholder for blocks it dropped (outside a sliding window)


@dataclass(frozen=True)
class Seg:
    """Rows ``[row, row + rows)`` of a request live in blocks ``block ..
    block + count - 1`` from offset ``off`` (``count > 1`` only for whole blocks)."""

    block: int
    count: int
    off: int
    row: int
    rows: int


def segments(block_ids: Sequence[int], block_size: int, lo: int, hi: int) -> list[Seg]:
    """The rows ``[lo, hi)`` of a request whose group's blocks are ``block_ids``,
    as runs of consecutive block ids; rows in vLLM's null block are left out.
    Raises ``IndexError`` when the rows run past the allocated blocks."""
    b = block_size
    out: list[Seg] = []
    pos = lo
    while pos < hi:
        j = pos // b
        off = pos - j * b
        end = min(hi, (j + 1) * b)
        bid = int(block_ids[j])
        if bid != NULL_BLOCK:
            n = end - pos
            last = out[-1] if out else None
            if (
                last is not None
                and off == 0
                and n == b
                and last.off == 0
                and last.rows == last.count * b
                and last.block + last.count == bid
                and last.row + last.rows == pos
            ):
                out[-1] = Seg(last.block, last.count + 1, 0, last.row, last.rows + b)
            else:
                out.append(Seg(bid, 1, off, pos, n))
        pos = end
    return out


def kv_views(cache: Any) -> tuple[Any, Any]:
    """K and V views ``[blocks, kv_heads, block_size, head_dim]`` of one layer's
    paged cache."""
    nb, heads, bsz, two_d = cache.shape
    v = cache.view(nb, heads, 2 * bsz, two_d // 2)
    return v[:, :, :bsz], v[:, :, bsz:]


def to_cache(kc: Any, vc: Any, segs: Sequence[Seg], k: Any, v: Any, base: int) -> int:
    """Copy rows (``k``/``v`` tensors ``[rows, heads, dim]`` whose row 0 is token
    ``base``) into the paged cache at ``segs``; returns the bytes copied."""
    nbytes = 0
    b = kc.shape[2]
    for s in segs:
        r = s.row - base
        ks, vs = k[r : r + s.rows], v[r : r + s.rows]
        if s.off == 0 and s.rows == s.count * b:
            shape = (s.count, b, ks.shape[1], ks.shape[2])
            kc[s.block : s.block + s.count].copy_(ks.view(shape).transpose(1, 2))
            vc[s.block : s.block + s.count].copy_(vs.view(shape).transpose(1, 2))
        else:
            kc[s.block, :, s.off : s.off + s.rows].copy_(ks.transpose(0, 1))
            vc[s.block, :, s.off : s.off + s.rows].copy_(vs.transpose(0, 1))
        nbytes += ks.nbytes + vs.nbytes
    return nbytes


def from_cache(kc: Any, vc: Any, segs: Sequence[Seg], k: Any, v: Any, base: int) -> None:
    """Copy the paged cache's rows at ``segs`` into ``k``/``v`` (contiguous tensors
    ``[rows, heads, dim]`` whose row 0 is token ``base``)."""
    b = kc.shape[2]
    for s in segs:
        r = s.row - base
        ks, vs = k[r : r + s.rows], v[r : r + s.rows]
        if s.off == 0 and s.rows == s.count * b:
            shape = (s.count, b, ks.shape[1], ks.shape[2])
            ks.view(shape).copy_(kc[s.block : s.block + s.count].transpose(1, 2))
            vs.view(shape).copy_(vc[s.block : s.block + s.count].transpose(1, 2))
        else:
            ks.copy_(kc[s.block, :, s.off : s.off + s.rows].transpose(0, 1))
            vs.copy_(vc[s.block, :, s.off : s.off + s.rows].transpose(0, 1))
