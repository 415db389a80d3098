"""A heartbeat reply's demotions are written and reported in two jobs.

With one job per reply, a reply that held all of DRAM (16 MiB objects in a
128 MiB segment) was reported only when the last object was on the disk; the
puts waiting for room were placed then, and their demotions waited a whole
heartbeat interval for the next tick while the disk stood idle. Now a reply
holding more than half of DRAM goes in two jobs: the first half (by bytes) is
synced and reported on its own while the second half is written, so the room it
frees is refilled and demoted meanwhile. A real DRAM segment, manifest and NVMe
tier; the server's ``nvme-write`` worker thread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gcache._proto import gcache_pb2 as pb
from gcache.server.tiers import TierState, split_batch
from gcache.storage.manifest import Manifest
from gcache.storage.nvme import NvmeTier
from gcache.storage.record import StoredRecord
from gcache.storage.segment import Segment, manifest_path

KIB = 1 << 10
MIB = 1 << 20


def _rec(i: int, offset: int, length: int) -> StoredRecord:
    return StoredRecord(
        namespace=bytes(16), key=i.to_bytes(16, "little"), parent=b"", pos=i, group=0,
        tier=0, offset=offset, length=length, sums=b"", seq=0,
    )  # fmt: skip


def test_split_batch_halves_by_bytes_only_a_reply_holding_most_of_dram() -> None:
    dram = 128 * MIB
    one = [_rec(0, 0, 16 * MIB)]
    assert split_batch(one, dram) == [one]
    assert split_batch([], dram) == [[]]
    recs = [_rec(i, i * 16 * MIB, 16 * MIB) for i in range(7)]  # 112 of 128 MiB
    first, second = split_batch(recs, dram)
    assert first == recs[:4] and second == recs[4:]
    # Half of DRAM or less: one job (1 MiB objects lose by more syncs and reports).
    assert split_batch(recs[:4], dram) == [recs[:4]]
    small = [_rec(i, i * MIB, MIB) for i in range(56)]
    assert split_batch(small, dram) == [small]
    # By bytes, not by count: one large object is a half on its own.
    mixed = [_rec(0, 0, 60 * MIB)] + [_rec(i, i * MIB, 4 * MIB) for i in range(1, 5)]
    assert [len(p) for p in split_batch(mixed, dram)] == [1, 4]


def test_reply_demotions_are_reported_in_two_jobs(tmp_path: Path) -> None:
    seg_path = str(tmp_path / "segment")
    seg = Segment(seg_path, 4 * MIB)
    state = TierState(
        seg, Manifest(manifest_path(seg_path)), NvmeTier(str(tmp_path / "nvme"), 64 * MIB)
    )
    size, n = 512 * KIB, 6  # 3 MiB of a 4 MiB segment: most of DRAM
    for i in range(n):
        seg.view[i * size : (i + 1) * size] = bytes([i + 1]) * size
    reply = pb.HeartbeatReply()
    for i in range(n):
        reply.demote.add().object.CopyFrom(
            pb.StoredObject(
                namespace=bytes(16), key=i.to_bytes(16, "little"), pos=i, group=0, tier=0,
                offset=i * size, length=size,
            )
        )  # fmt: skip
    reports: list[list[tuple[int, bool]]] = []

    async def run() -> None:
        done = asyncio.Event()

        def on_report() -> None:  # the control loop's early heartbeat
            beat = pb.HeartbeatRequest()
            state.fill_heartbeat(beat)
            reports.append([(d.dram_offset, d.ok) for d in beat.demoted])
            if sum(len(r) for r in reports) == n:
                done.set()

        state.on_report = on_report
        state.apply(reply)
        await asyncio.wait_for(done.wait(), 30)

    try:
        asyncio.run(run())
        # Two reports, the first half's before the second half's, each synced.
        assert reports == [
            [(i * size, True) for i in range(3)],
            [(i * size, True) for i in range(3, 6)],
        ], reports
        assert state.stats()["demote_jobs"] == 2
        assert state.stats()["early_reports"] == 2
        nvme = state.nvme
        assert nvme is not None and nvme.appended == n
    finally:
        state.close(keep=False)
