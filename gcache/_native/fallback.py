"""The pure-Python data plane kernels: the same results as ``_dataplane.c``
(numpy copies, which release the GIL, and the ``xxhash`` package), for builds
without the extension and as the reference the tests hold the native one to."""

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


def set_threads(n: int) -> int:
    global _threads
    if not 1 <= n <= 16:
        raise ValueError("threads must be 1..16")
    old, _threads = _threads, n
    return old
