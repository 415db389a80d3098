"""The pure-Python data plane kernels: the same results as ``_dataplane.c``
(numpy copies, which release the GIL, and the ``xxhash`` package), for builds
without the extension and as the reference the tests hold the native one to.
Their signatures are the C kernels' (the tests call both the same way); the
public wrappers in :mod:`gcache._native` take the plan objects."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

Buffer = memoryview | bytes | bytearray

_threads = 1


def _units(n: int, group: int) -> int:
    if group <= 0:
        raise ValueError("group must be positive")
    if n % group:
        raise ValueError(f"{n} pieces are not whole groups of {group}")
    return n // group


def checksums(src: Sequence[Buffer], group: int) -> bytes:
    out = bytearray()
    for u in range(_units(len(src), group)):
        h = xxhash.xxh3_64()
        for piece in src[u * group : (u + 1) * group]:
            h.update(piece)
        out += h.digest()
    return bytes(out)


def copy_checksums(
    dst: Sequence[Buffer], src: Sequence[Buffer], group: int, hash_src: bool = False
) -> bytes:
    _units(len(src), group)
    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} destinations for {len(src)} sources")
    for i, (d, s) in enumerate(zip(dst, src, strict=True)):
        dv = np.frombuffer(d, np.uint8)
        sv = np.frombuffer(s, np.uint8)
        if dv.nbytes != sv.nbytes:
            raise ValueError(f"piece {i}: {sv.nbytes} bytes into a {dv.nbytes}-byte destination")
        np.copyto(dv, sv)
    return checksums(src if hash_src else dst, group)


def read_layer(
    seg: Buffer,
    kdst: Buffer,
    vdst: Buffer,
    offsets: Buffer,
    rows: Buffer,
    sums: Buffer,
    stride: int,
    li: int,
    off: int,
    kb: int,
    vb: int,
) -> int:
    o = np.frombuffer(offsets, np.int64)
    rw = np.frombuffer(rows, np.int64)
    if len(o) != len(rw):
        raise ValueError("offsets and rows must be int64 buffers of equal length")
    sv = memoryview(sums).cast("B")
    if min(kb, vb, off, li) < 0 or stride < 8 * (li + 1) or len(sv) < len(o) * stride:
        raise ValueError("bad layer geometry or checksum table")
    src = np.frombuffer(seg, np.uint8)
    kd = np.frombuffer(kdst, np.uint8)
    vd = np.frombuffer(vdst, np.uint8)
    krows = kd.nbytes // kb if kb else 0
    vrows = vd.nbytes // vb if vb else 0
    for r, (a, row) in enumerate(zip(o.tolist(), rw.tolist(), strict=True)):
        if a < 0 or a + off + kb + vb > src.nbytes:
            raise ValueError(f"block {r}: range [{a + off}, +{kb + vb}) outside the segment")
        if row < 0 or (kb and row >= krows) or (vb and row >= vrows):
            raise ValueError(f"block {r}: row {row} outside the destination")
    bad = -1
    for r, (a, row) in enumerate(zip(o.tolist(), rw.tolist(), strict=True)):
        k = kd[row * kb : (row + 1) * kb]
        v = vd[row * vb : (row + 1) * vb]
        np.copyto(k, src[a + off : a + off + kb])
        np.copyto(v, src[a + off + kb : a + off + kb + vb])
        h = xxhash.xxh3_64(k.data)
        h.update(v.data)
        if bad < 0 and h.digest() != sv[r * stride + 8 * li : r * stride + 8 * li + 8]:
            bad = r
    return bad


def set_threads(n: int) -> int:
    global _threads
    if not 1 <= n <= 16:
        raise ValueError("threads must be 1..16")
    old, _threads = _threads, n
    return old
