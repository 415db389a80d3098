"""NVMe tier bandwidth against the raw device.

For object sizes of 1 MiB and 16 MiB, in the same directory:

* raw: ``dd`` sequential write with ``oflag=direct conv=fdatasync`` and read with
  ``iflag=direct`` of the same number of bytes;
* GCache: the server's demotion path (``NvmeTier.append`` straight from a
  page-aligned DRAM segment, one ``fdatasync`` per batch of 16, as a heartbeat's
  demotions) and its tier-1 READ path (``TieredReadReply.load``: ``O_DIRECT``
  ``preadv`` of each object into a reply buffer from the server's pool of reused,
  pre-faulted buffers, ``ReadBuffers``; the tier's O_DIRECT writes left no page
  cache). ``--fresh-buffers``: a new mapping per READ instead (the old path).

Prints a table with the ratios (target >= 0.7x). Usage::

    python -m bench.nvme_tier --dir /path/on/nvme [--total 512MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import tempfile
import time
from array import array

from gcache.config import parse_size
from gcache.server.tiered import ReadBuffers, TieredReadReply
from gcache.storage.nvme import NvmeTier
from gcache.storage.record import StoredRecord

MiB = 1 << 20


def _dd(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([\d.]+) s", out)
    assert m, out
    return float(m.group(1))


def raw(directory: str, size: int, count: int) -> tuple[float, float]:
    path = os.path.join(directory, "raw.dat")
    bs = f"{size // MiB}M"
    try:
        w = _dd(
            [
                "if=/dev/zero",
                f"of={path}",
                f"bs={bs}",
                f"count={count}",
                "oflag=direct",
                "conv=fdatasync",
            ]
        )
        r = _dd([f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"])
    finally:
        os.unlink(path)
    total = size * count
    return total / w / 1e9, total / r / 1e9


def gcache(
    directory: str, size: int, count: int, tier_size: int, fresh: bool = False
) -> tuple[float, float]:
    path = os.path.join(directory, "tier")
    seg = mmap.mmap(-1, size * 16)
    view = memoryview(seg)
    view[:] = os.urandom(MiB) * (len(view) // MiB)
    tier = NvmeTier(path, tier_size)
    try:
        addrs: list[int] = []
        t0 = time.perf_counter()
        for i in range(count):
            rec = StoredRecord(b"n" * 16, i.to_bytes(16, "big"), b"", i, 0, 0, 0, 0, b"", 0)
            off = (i % 16) * size
            addrs.append(tier.append(rec, view[off : off + size]))
            if i % 16 == 15:
                tier.sync()
        tier.sync()
        pool = ReadBuffers(256 * MiB)  # as the daemon's
        t1 = time.perf_counter()
        for a in addrs:
            reply = TieredReadReply(
                view, tier, array("Q", [a]), array("Q", [size]), bytearray([1]), size
            )
            reply.load(None if fresh else pool)
            reply.release()
        t2 = time.perf_counter()
        pool.close()
    finally:
        tier.close()
        view.release()
        seg.close()
        shutil.rmtree(path, ignore_errors=True)
    total = size * count
    return total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.nvme_tier")
    p.add_argument("--dir", default="", help="directory on the device (default: a temp dir)")
    p.add_argument("--total", default="512MiB", help="bytes written per size")
    p.add_argument("--json", default="")
    p.add_argument("--fresh-buffers", action="store_true", help="map a new read buffer per READ")
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="gcache-nvme-bench-")
    total = parse_size(args.total)
    rows = []
    for size in (MiB, 16 * MiB):
        count = max(total // size, 16)
        tier_size = max(2 * total, 64 * size)
        rw, rr = raw(directory, size, count)
        gw, gr = gcache(directory, size, count, tier_size, args.fresh_buffers)
        rows.append(
            {
                "size": size,
                "count": count,
                "raw_write_gbps": rw,
                "raw_read_gbps": rr,
                "gcache_write_gbps": gw,
                "gcache_read_gbps": gr,
                "write_ratio": gw / rw,
                "read_ratio": gr / rr,
            }
        )
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"directory: {directory}")
    print("| object | raw write | GCache write | ratio | raw read | GCache read | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size'] // MiB} MiB | {r['raw_write_gbps']:.2f} GB/s | "
            f"{r['gcache_write_gbps']:.2f} GB/s | {r['write_ratio']:.2f}x | "
            f"{r['raw_read_gbps']:.2f} GB/s | {r['gcache_read_gbps']:.2f} GB/s | "
            f"{r['read_ratio']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
