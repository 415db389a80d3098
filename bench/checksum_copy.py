"""Copy + checksum kernels on this machine: the two-pass Python path
(numpy copy, then the ``xxhash`` package), the fused native kernel with xxh3-64 and
with CRC32C (SSE4.2 ``crc32`` instruction), on one and two threads, against a
plain numpy copy of the same bytes.

Each case copies ``size`` bytes as one unit of two pieces (K and V of a layer),
from a source that is either the same buffer every time (``hot``: in cache) or
rotates through ``--pool`` bytes (``pool``: as a segment's objects are).

    python -m bench.checksum_copy --sizes 1MiB,64MiB
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import xxhash

from gcache._native import _dataplane as dp
from gcache._native import fallback
from gcache.config import parse_size


def _best_gbps(fn: Callable[[int], object], size: int, reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    times.sort()
    return size / times[len(times) // 2] / 1e9  # median


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1MiB,64MiB")
    p.add_argument("--pool", default="512MiB")
    p.add_argument("--reps", type=int, default=0, help="default: ~1 GiB per case")
    args = p.parse_args(argv)
    pool_bytes = parse_size(args.pool)
    print(f"{'size':>6} {'source':>6} {'kernel':<34} {'GB/s':>7}")
    for size_s in args.sizes.split(","):
        size = parse_size(size_s)
        reps = args.reps or max(5, min(2000, (1 << 30) // size))
        nsrc = max(1, pool_bytes // size)
        pool = np.random.default_rng(0).integers(0, 256, nsrc * size, dtype=np.uint8)
        srcs = [pool[i * size : (i + 1) * size] for i in range(nsrc)]
        dst = np.empty(size, np.uint8)
        dst.fill(1)

        for source in ("hot", "pool"):
            for name, fn in _cases(srcs, dst, source):
                fn(0)
                print(f"{size_s:>6} {source:>6} {name:<34} {_best_gbps(fn, size, reps):7.2f}")


def _cases(
    srcs: list[np.ndarray], dst: np.ndarray, source: str
) -> list[tuple[str, Callable[[int], object]]]:
    half = dst.nbytes // 2
    dv = [dst.data[:half], dst.data[half:]]

    def src_of(i: int) -> np.ndarray:
        return srcs[0] if source == "hot" else srcs[i % len(srcs)]

    def sv(i: int) -> list[memoryview]:
        s = src_of(i).data
        return [s[:half], s[half:]]

    crc = dp.ALGO_CRC32C
    return [
        ("numpy copy (no checksum)", lambda i: np.copyto(dst, src_of(i))),
        ("xxh3-64 only (xxhash package)", lambda i: xxhash.xxh3_64_digest(src_of(i).data)),
        ("xxh3-64 only (native, 1 thread)", lambda i: dp.checksums(sv(i), 2, threads=1)),
        ("crc32c only (native, 1 thread)", lambda i: dp.checksums(sv(i), 2, crc, 1)),
        ("two passes: numpy + xxhash", lambda i: fallback.copy_checksums(dv, sv(i), 2)),
        ("fused xxh3-64, 1 thread", lambda i: dp.copy_checksums(dv, sv(i), 2, threads=1)),
        ("fused xxh3-64, 2 threads", lambda i: dp.copy_checksums(dv, sv(i), 2, threads=2)),
        ("fused crc32c, 1 thread", lambda i: dp.copy_checksums(dv, sv(i), 2, False, crc, 1)),
        ("fused crc32c, 2 threads", lambda i: dp.copy_checksums(dv, sv(i), 2, False, crc, 2)),
    ]


if __name__ == "__main__":
    main()
