# One file (over 450 lines): TierState owns a server's segment, manifest and NVMe tier.
"""What a ``gcache-server`` keeps across restarts, and its NVMe tier's control side.

* At start (:meth:`TierState.start`): re-adopt the segment file a dead process of
  the same server id left for the same meta (renamed to this process's name), replay
  its manifest and keep the records whose layers still match the checksums their
  putter computed (else DRAM starts empty), open and scan the NVMe tier (records
  failing their CRC or payload hash are dropped), and measure the DRAM and NVMe
  bandwidths the meta uses; all of it on a worker thread (:meth:`TierState.open`),
  never on the event loop.
* Each write under a bound grant (``WRITE``, ``SEAL``): its object's record, sent
  with it, is appended to the manifest before the receipt is answered
  (:meth:`TierState.record_writes`), so a commit the meta acknowledged is in the
  manifest, and in every later report, whichever process is killed after it.
* Each heartbeat reply's ``adopt`` (in-process drivers' commits only): recorded
  with the checksums the meta sends (``StoredObject.sums``); no byte of the object
  is read (the restart checks them).
* On registration: the registration carries the tier's size and bandwidths and the
  count of objects held; :meth:`report` then streams every record
  (``ReportObjects``, chunks of :data:`REPORT_CHUNK`, ``last`` on the final one).
* Each heartbeat reply: ``free`` then ``adopt`` go to the manifest; ``drop_nvme``
  and ``demote`` run, in that order, on one worker thread (disk I/O never blocks
  the data plane); a demotion batch ends with one ``fdatasync`` and its results are
  reported in the next heartbeat (``demoted``; the meta frees the DRAM range only
  then). Objects the tier evicted by itself go out as ``nvme_lost``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc

from gcache._proto import gcache_pb2 as pb
from gcache.config import ServerConfig
from gcache.errors import GCacheError
from gcache.server.tier_records import (
    dram_gbps,
    left_under_own_name,
    remove_left_under_own_name,
    split_batch,
)
from gcache.storage import columns as columnsmod
from gcache.storage import nvme as nvmemod
from gcache.storage.manifest import Manifest, read_owner
from gcache.storage.nvme import NvmeTier
from gcache.storage.record import StoredRecord, from_proto, to_proto
from gcache.storage.segment import Segment, manifest_path

log = logging.getLogger("gcache.server")

REPORT_CHUNK: Final = 2048
MAX_PENDING_REPORTS: Final = 1 << 16  # demotion results / lost objects not yet sent


class TierState:
    def __init__(self, segment: Segment, manifest: Manifest, nvme: NvmeTier | None) -> None:
        self.segment = segment
        self.manifest = manifest
        self.nvme = nvme
        self.readopted = 0  # DRAM objects kept at start
        self.dram_gbps = 0.0
        self.nvme_read_gbps = self.nvme_write_gbps = 0.0
        self.epoch = 0
        self.demoted: list[pb.Demoted] = []
        self.promoted: list[pb.Promoted] = []  # promotions done, for the next beat
        self.promotions = self.promote_failures = 0
        self.demotions = self.demote_failures = self.adopted = 0
        self.reports = self.report_failures = 0
        self.reports_dropped = 0  # results past MAX_PENDING_REPORTS (meta times them out)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "nvme-write")
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called (on the loop) when a demotion batch's results wait to be reported:
        # the control loop heartbeats at once instead of at its next tick (A).
        self.on_report: Callable[[], None] | None = None
        self.early_reports = 0  # batches that asked for an early heartbeat
        self.demote_jobs = 0  # worker jobs the replies' demotions were written in

    # ---- start -------------------------------------------------------------------

    @classmethod
    async def open(cls, cfg: ServerConfig, server_id: str, path: str) -> TierState:
        """:meth:`start` on a worker thread: re-adopting reads every recorded byte
        of the segment and scans the NVMe tier, which must not stall the loop."""
        return await asyncio.to_thread(cls.start, cfg, server_id, path)

    @classmethod
    def start(cls, cfg: ServerConfig, server_id: str, path: str) -> TierState:
        owner = f"{server_id}@{cfg.meta}"
        old = left_under_own_name(path, owner) if cfg.reuse_segment else None
        if old is None and os.path.exists(path):
            remove_left_under_own_name(path)
        if cfg.reuse_segment and old is None:
            old = Segment.adoptable(cfg.shm_dir, server_id, owner, read_owner)
            if old is not None:
                try:
                    os.replace(old, path)
                    os.replace(manifest_path(old), manifest_path(path))
                except OSError as exc:
                    log.warning("cannot re-adopt segment file %s: %s", old, exc)
                    old = None
        for name in Segment.remove_stale(cfg.shm_dir, server_id, owner, read_owner):
            log.warning("removed stale segment file %s of a dead process", name)
        segment = Segment(
            path,
            cfg.capacity_bytes,
            populate=cfg.populate,
            reserve=cfg.reserve,
            reuse=old is not None,
        )
        manifest = Manifest(manifest_path(path), owner)
        nvme: NvmeTier | None = None
        try:
            manifest.load()
            t0 = time.monotonic()
            readopted = manifest.verify(segment.view if segment.reused else None)
            if segment.reused:
                log.info(
                    "re-adopted segment %s: %d objects (%d bytes) intact, %d dropped "
                    "(%d bad log frames), checked in %.2f s",
                    path,
                    readopted,
                    manifest.verified_bytes,
                    manifest.dropped,
                    manifest.bad_frames,
                    time.monotonic() - t0,
                )
            size = cfg.nvme_size_bytes
            if size:
                nvme = NvmeTier(cfg.nvme_path, size, direct=cfg.nvme_direct)
                recs = nvme.scan()
                log.info(
                    "NVMe tier %s: %d bytes in %d regions of %d bytes, %d objects "
                    "(%d bad records dropped) scanned in %.2f s%s",
                    cfg.nvme_path,
                    nvme.capacity,
                    len(nvme.regions),
                    nvme.region_size,
                    len(recs),
                    nvme.scan_bad_payloads + nvme.scan_bad_headers,
                    nvme.scan_s,
                    "" if nvme.direct else " (buffered: O_DIRECT refused)",
                )
            elif cfg.nvme_path:
                log.info("NVMe tier off (nvme_size 0): %s is not used", cfg.nvme_path)
        except BaseException:
            if nvme is not None:
                nvme.close()
            manifest.close()
            segment.close(keep=True)
            raise
        state = cls(segment, manifest, nvme)
        state.readopted = readopted
        state.dram_gbps = dram_gbps(segment.view)
        if nvme is not None:
            try:
                state.nvme_write_gbps, state.nvme_read_gbps = nvmemod.measure(cfg.nvme_path)
            except OSError as exc:
                log.warning("cannot measure the NVMe bandwidth in %s: %s", cfg.nvme_path, exc)
        return state

    # ---- registration --------------------------------------------------------------

    def records(self) -> list[StoredRecord]:
        """DRAM and NVMe records, parents before children (by block position): the
        meta adopts a record whose parent it knows at once and parks the others."""
        out = list(self.manifest)
        if self.nvme is not None:
            out.extend(list(self.nvme.records()))
        out.sort(key=lambda r: r.pos)  # report in block order (the meta's rebuild)
        return out

    def fill_registration(self, req: pb.RegisterServerRequest) -> None:
        req.nvme_capacity = self.nvme.capacity if self.nvme is not None else 0
        req.dram_read_gbps = self.dram_gbps
        req.nvme_read_gbps = self.nvme_read_gbps
        req.nvme_write_gbps = self.nvme_write_gbps
        req.objects = len(self.records())

    async def report(
        self, stub: Any, server_id: str, incarnation: int, epoch: int, columns: bool = False
    ) -> None:
        """Stream the manifest (DRAM and NVMe) to the meta after a registration: in
        columns (``StoredColumns``) to a meta that takes them
        (``RegisterServerReply.report_columns``), else as ``StoredObject`` messages."""
        self.epoch = epoch
        recs = self.records()

        async def chunks() -> AsyncIterator[pb.ReportObjectsRequest]:
            for i in range(0, max(len(recs), 1), REPORT_CHUNK):
                part = recs[i : i + REPORT_CHUNK]
                req = pb.ReportObjectsRequest(
                    server_id=server_id,
                    incarnation=incarnation,
                    epoch=epoch,
                    last=i + REPORT_CHUNK >= len(recs),
                )
                if columns:
                    req.columns.CopyFrom(columnsmod.encode(part))
                else:
                    req.objects.extend(to_proto(r) for r in part)
                yield req

        try:
            reply = await stub.ReportObjects(chunks(), timeout=60.0)
        except grpc.aio.AioRpcError as exc:
            self.report_failures += 1
            log.warning("reporting %d objects to the meta failed: %s", len(recs), exc.details())
            return
        self.reports += 1
        log.info(
            "reported %d objects to the meta (epoch %d): %d adopted, %d dropped, "
            "%d waiting for their parent",
            len(recs),
            epoch,
            reply.adopted,
            reply.dropped,
            reply.parked,
        )

    # ---- writes ----------------------------------------------------------------------

    def record_writes(self, recs: list[StoredRecord]) -> None:
        """The records of objects written under bound grants, persisted before their
        receipts (:class:`gcache.server.core.DataPlaneCore`'s recorder); raises
        :class:`GCacheError` when the append fails."""
        self.manifest.record_writes(recs)

    def beat_sent(self) -> None:
        self.manifest.beat_sent()

    def beat_answered(self) -> None:
        self.manifest.beat_answered()

    def registered(self) -> None:
        self.manifest.registered()

    # ---- heartbeats ----------------------------------------------------------------

    def fill_heartbeat(self, beat: pb.HeartbeatRequest) -> None:
        beat.epoch = self.epoch
        done_p, self.promoted = self.promoted, []
        beat.promoted.extend(done_p)
        if self.nvme is None:
            return
        beat.nvme_used = self.nvme.used
        done, self.demoted = self.demoted, []
        beat.demoted.extend(done)
        beat.nvme_lost.extend(pb.Range(offset=a, length=n) for a, n in self.nvme.take_lost())

    def unsent(self, beat: pb.HeartbeatRequest) -> None:
        """A heartbeat that failed: its reports go out with the next one."""
        self.promoted[:0] = list(beat.promoted)
        if self.nvme is None:
            return
        self.demoted[:0] = list(beat.demoted)
        self.nvme.lost[:0] = [(r.offset, r.length) for r in beat.nvme_lost]

    def apply(self, reply: pb.HeartbeatReply) -> None:
        frees = [(r.offset, r.length) for r in reply.free]
        adopt = [from_proto(o) for o in reply.adopt]
        if frees or adopt:
            try:
                self.adopted += self.manifest.apply(frees, adopt, self.segment.view)
            except GCacheError as exc:
                log.warning("%s", exc)
        if reply.promote:
            self._promote(list(reply.promote))
        if self.nvme is None:
            for cmd in reply.demote:
                o = cmd.object
                self._done(
                    [pb.Demoted(dram_offset=o.offset, length=o.length, ok=False, error="no NVMe")]
                )
            return
        drops = [(r.offset, r.length) for r in reply.drop_nvme]
        cmds = [from_proto(c.object) for c in reply.demote]
        if drops or cmds:
            self._loop = asyncio.get_running_loop()
            # A reply holding most of DRAM in two jobs (H2): the first half's report
            # frees its room, and the puts that take it are demoted, while the
            # second half is on the disk.
            jobs = split_batch(cmds, self.segment.capacity)
            for i, part in enumerate(jobs):
                fut = self._writer.submit(self._tier_work, drops if i == 0 else [], part)
                fut.add_done_callback(self._finished)
            self.demote_jobs += len(jobs)

    def _finished(self, fut: concurrent.futures.Future[list[pb.Demoted]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            done = fut.result()
        except BaseException as exc:  # a bug in the worker: report, never hang
            log.error("NVMe worker failed: %s", exc)
            return
        loop.call_soon_threadsafe(self._done, done)

    def _done(self, done: list[pb.Demoted]) -> None:
        room = MAX_PENDING_REPORTS - len(self.demoted)
        self.demoted.extend(done[: max(room, 0)])
        self.reports_dropped += max(len(done) - max(room, 0), 0)
        if done and self.on_report is not None:
            # Report now: the meta frees the DRAM ranges only on the report, and its
            # reply carries the next batch (the disk does not wait for a tick).
            self.early_reports += 1
            self.on_report()

    def _tier_work(
        self, drops: list[tuple[int, int]], cmds: list[StoredRecord]
    ) -> list[pb.Demoted]:
        """Worker thread: delete, then copy each DRAM object to NVMe; one sync."""
        nvme = self.nvme
        assert nvme is not None
        for addr, length in drops:
            try:
                nvme.drop(addr, length)
            except OSError as exc:
                log.warning("NVMe drop of %d failed: %s", addr, exc)
        out: list[pb.Demoted] = []
        seg = self.segment
        for rec in cmds:
            dram, length = rec.offset, rec.length
            res = pb.Demoted(dram_offset=dram, length=length)
            if not seg.in_bounds(dram, length) or length <= 0:
                res.error = "range outside the segment"
            else:
                try:
                    res.nvme_offset = nvme.append(rec, seg.view[dram : dram + length])
                    res.ok = True
                except (GCacheError, OSError) as exc:
                    res.error = str(exc)
            out.append(res)
        try:
            nvme.sync()
        except OSError as exc:
            for r in out:
                r.ok, r.error = False, f"fdatasync failed: {exc}"
        self.demotions += sum(1 for r in out if r.ok)
        self.demote_failures += sum(1 for r in out if not r.ok)
        return out

    # ---- promotion: NVMe -> DRAM at a range the meta allocated --------------------

    def _promote(self, cmds: list[pb.PromoteCommand]) -> None:
        """Copy NVMe objects into the DRAM ranges the meta allocated, on the worker
        thread (after the demotions and drops already queued); then record them in
        the manifest and report them in the next heartbeat (``promoted``)."""
        if self.nvme is None:
            for c in cmds:
                o = c.object
                self.promoted.append(
                    pb.Promoted(
                        nvme_offset=o.offset,
                        length=o.length,
                        dram_offset=c.dram_offset,
                        error="no NVMe",
                    )
                )
            return
        self._loop = asyncio.get_running_loop()
        fut = self._writer.submit(self._promote_work, cmds, self.epoch)
        loop = self._loop

        def finished(f: concurrent.futures.Future[list[tuple[pb.Promoted, StoredRecord]]]) -> None:
            if loop.is_closed():
                return
            try:
                res = f.result()
            except BaseException as exc:  # a bug in the worker: report, never hang
                log.error("NVMe promotion worker failed: %s", exc)
                return
            loop.call_soon_threadsafe(self._promoted_done, res)

        fut.add_done_callback(finished)

    def _promote_work(
        self, cmds: list[pb.PromoteCommand], epoch: int
    ) -> list[tuple[pb.Promoted, StoredRecord]]:
        """Worker thread. A command of an older meta (the server registered again
        since: a new meta may have placed data in that range) copies nothing."""
        nvme = self.nvme
        assert nvme is not None
        seg = self.segment
        out: list[tuple[pb.Promoted, StoredRecord]] = []
        for cmd in cmds:
            rec = from_proto(cmd.object)
            dram, length = cmd.dram_offset, rec.length
            res = pb.Promoted(nvme_offset=rec.offset, length=length, dram_offset=dram)
            inside = length > 0 and seg.in_bounds(dram, length)
            if self.epoch != epoch:
                res.error = "the meta changed (epoch): not copied"
            elif not inside or not nvme.covers(rec.offset, length):
                res.error = "range outside the segment or the tier"
            else:
                try:
                    nvme.read_into(rec.offset, seg.view[dram : dram + length])
                    res.ok = True
                except (GCacheError, OSError) as exc:
                    res.error = str(exc)
            rec.tier, rec.offset = 0, dram
            out.append((res, rec))
        return out

    def _promoted_done(self, done: list[tuple[pb.Promoted, StoredRecord]]) -> None:
        """Loop thread: record the DRAM copies (digest from the segment), then report."""
        recs = [rec for res, rec in done if res.ok]
        if recs:
            try:
                self.manifest.apply([], recs, self.segment.view)
            except GCacheError as exc:
                log.warning("%s", exc)
                for res, _ in done:
                    res.ok, res.error = False, str(exc)
        self.promotions += sum(1 for res, _ in done if res.ok)
        self.promote_failures += sum(1 for res, _ in done if not res.ok)
        room = max(MAX_PENDING_REPORTS - len(self.promoted), 0)
        self.promoted.extend(res for res, _ in done[:room])
        self.reports_dropped += max(len(done) - room, 0)

    # ---- end -----------------------------------------------------------------------

    def close(self, keep: bool = True) -> None:
        self._writer.shutdown(wait=True)
        if self.nvme is not None:
            self.nvme.close()
        self.manifest.close()
        self.segment.close(keep=keep)

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "readopted_objects": self.readopted,
            "manifest_records": len(self.manifest),
            "manifest_bad_frames": self.manifest.bad_frames,
            "manifest_dropped": self.manifest.dropped,
            "manifest_overlaps_dropped": self.manifest.overlaps_dropped,
            "manifest_spared_frees": self.manifest.spared_frees,
            "adopted": self.adopted,
            "epoch": self.epoch,
            "demotions": self.demotions,
            "demote_failures": self.demote_failures,
            "demote_jobs": self.demote_jobs,
            "early_reports": self.early_reports,
            "promotions": self.promotions,
            "promote_failures": self.promote_failures,
            "reports": self.reports,
            "report_failures": self.report_failures,
            "dram_read_gbps": self.dram_gbps,
            "nvme_read_gbps": self.nvme_read_gbps,
            "nvme_write_gbps": self.nvme_write_gbps,
        }
        if self.nvme is not None:
            out.update(self.nvme.stats())
        return out
