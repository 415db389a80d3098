"""The server's pool of NVMe read buffers (gcache/server/tiered.py ``ReadBuffers``):
a tier-1 READ reads into a page-aligned, pre-faulted buffer reused from READ to
READ (mapping a fresh one per READ made 1 MiB reads 0.57x raw), bounded in bytes,
and the reply gives it back once sent."""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import numpy as np
import pytest

from gcache.errors import GCacheError
from gcache.server.tiered import MIN_BUFFER, ReadBuffers, TieredReadReply
from gcache.storage.nvme import BLOCK, NvmeTier
from gcache.storage.record import StoredRecord

MiB = 1 << 20


def _rec(i: int) -> StoredRecord:
    return StoredRecord(b"n" * 16, i.to_bytes(16, "big"), b"", i, 0, 0, 0, 0, b"", 0)


def _addr(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def test_buffer_is_reused_page_aligned_and_size_classed() -> None:
    pool = ReadBuffers(8 * MiB)
    a = pool.acquire(100)
    assert a.size == MIN_BUFFER and len(a.view) == MIN_BUFFER and _addr(a.view) % BLOCK == 0
    pool.release(a)
    b = pool.acquire(MiB)
    assert b is a  # the same mapping: no mmap, no page faults
    pool.release(b)
    c = pool.acquire(MiB + 1)
    assert c.size == 2 * MiB
    pool.release(c)
    assert (pool.hits, pool.misses) == (1, 2)
    assert pool.lent == 0 and pool.pooled == 3 * MiB
    pool.close()
    assert pool.pooled == 0


def test_pool_is_bounded_and_lends_one_off_buffers_past_its_limit() -> None:
    pool = ReadBuffers(4 * MiB)
    lent = [pool.acquire(MiB) for _ in range(4)]
    extra = pool.acquire(MiB)  # every pooled byte is lent: a one-off buffer
    assert not extra.pooled and pool.one_off == 1 and pool.pooled == 4 * MiB
    pool.release(extra)  # unmapped, not kept
    assert pool.pooled == 4 * MiB and pool.lent == 4 * MiB
    for b in lent:
        pool.release(b)
    # A larger class evicts free buffers of other classes to stay within the limit.
    big = pool.acquire(4 * MiB)
    assert big.pooled and pool.pooled == 4 * MiB and pool.unmapped == 4
    pool.release(big)
    assert pool.lent == 0 and pool.pooled <= pool.limit
    pool.close()


def test_tiered_reply_reads_byte_exact_into_a_pooled_buffer_and_gives_it_back(
    tmp_path: Path,
) -> None:
    tier = NvmeTier(str(tmp_path), 64 * MiB)
    pool = ReadBuffers(16 * MiB)
    seg = memoryview(bytearray(4 * MiB))
    try:
        payloads = [os.urandom(n) for n in (MiB, 3000, MiB + 5)]
        addrs = [tier.append(_rec(i), memoryview(p)) for i, p in enumerate(payloads)]
        tier.sync()
        for _ in range(3):  # the second and third READs reuse the first one's buffer
            lengths = array("Q", [len(p) for p in payloads])
            reply = TieredReadReply(
                seg, tier, array("Q", addrs), lengths, bytearray([1, 1, 1]), sum(lengths)
            )
            reply.load(pool)
            got = b"".join(bytes(v) for v in reply.views())
            assert got == b"".join(payloads)
            assert pool.lent > 0
            reply.release()
            reply.release()  # idempotent
            assert pool.lent == 0
        assert pool.misses == 1 and pool.hits == 2
    finally:
        pool.close()
        tier.close()


def test_read_many_refuses_a_short_or_unaligned_buffer(tmp_path: Path) -> None:
    tier = NvmeTier(str(tmp_path), 16 * MiB)
    pool = ReadBuffers(4 * MiB)
    try:
        addr = tier.append(_rec(1), memoryview(os.urandom(2 * BLOCK)))
        buf = pool.acquire(MiB)
        with pytest.raises(GCacheError, match="page-aligned buffer"):
            tier.read_many([(addr, 2 * BLOCK)], buf.view[:BLOCK])
        with pytest.raises(GCacheError, match="page-aligned buffer"):
            tier.read_many([(addr, 2 * BLOCK)], buf.view[1 : 1 + 4 * BLOCK])
        assert tier.read_span([(addr, 2 * BLOCK)]) == 2 * BLOCK
        pool.release(buf)
    finally:
        pool.close()
        tier.close()
