"""Promotion: an NVMe object read ``promotion_hits`` times is copied back into its
server's DRAM (``meta.promotion = "hits:N"``). The object stays on NVMe, readable
and pinned, until the server reports the copy; then the index switches to the DRAM
copy. No I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from gcache.config import MetaConfig
from gcache.meta.evictions import Evictions
from gcache.meta.index import Index
from gcache.meta.records import LIVE, NamespaceRecord, ObjectRecord, ServerRecord
from gcache.meta.tiers import MAX_PROMOTIONS_IN_FLIGHT, PROMOTING, Promotion, held


class Promoter:
    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        index: Index,
        evictions: Evictions,
        demote_or_drop: Callable[[ServerRecord, int], int],
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.evictions = evictions
        # Makes DRAM room as a put's watermark does (``Tiers.demote_or_drop``).
        self.demote_or_drop = demote_or_drop

    def on_pick(self, ns: NamespaceRecord, picked: npt.NDArray[np.int32] | list[int]) -> None:
        """A lookup read the object rows ``picked`` (a few: a list): count the hits
        of NVMe objects for promotion (``Leases``' pick hook)."""
        need = self.cfg.promotion_hits
        if need <= 0:
            return
        if isinstance(picked, list):
            tier = self.index.cx.objects.mv("tier")
            nvme = [oid for oid in picked if tier[oid]]
        else:
            o = self.index.cx.objects.cols
            nvme = picked[o["tier"][picked] != 0].tolist()
        for oid in nvme:
            obj = self.index.obj(oid)
            if obj.tier and obj.hits != PROMOTING:
                obj.hits += 1
                if obj.hits >= need:
                    self._promote(obj, ns)

    def _promote(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        """Allocate a DRAM range on ``obj``'s server and ask the server to copy the
        NVMe object there (a write by the server itself, no client grant). The
        server's DRAM stays below its high watermark: room is made as for a put (the
        coldest DRAM objects demote or go, never pinned ones), else the promotion
        waits for the next hit. The object stays on NVMe, readable and pinned, until
        the server reports the copy."""
        srv = obj.server
        cfg = self.cfg
        c = self.counters
        if (
            obj.state != LIVE
            or not srv.alive
            or not srv.ready
            or len(srv.promoting) >= MAX_PROMOTIONS_IN_FLIGHT
        ):
            return False
        length = obj.length
        need = held(srv, length)
        # Promotions in flight count against the watermark (they will land in DRAM).
        high = int(cfg.high_watermark * srv.allocator.capacity) - srv.promoting_bytes
        if srv.reclaimable_used + need > high:
            # Make room as a put does: the coldest DRAM objects (in the policy's
            # order, never pinned ones) demote or go; the hit object is the hottest.
            if cfg.demote:
                self.demote_or_drop(srv, high - need)
            else:
                self.evictions.evict(srv, target_used=high - need, max_bytes=4 * need)
            if srv.reclaimable_used + need > high:
                c["promotions_no_room"] += 1
                return False
        off = srv.allocator.alloc(length)
        if off is None:
            c["promotions_no_room"] += 1
            return False
        self.index.pin([obj])
        obj.hits = PROMOTING
        srv.promoting[off] = (obj, ns)
        srv.promoting_bytes += held(srv, length)
        srv.promote_out.append((obj, ns, off))
        c["promotions_issued"] += 1
        return True

    def promoted(self, srv: ServerRecord, done: Promotion) -> None:
        """A server finished (or failed) a promotion: switch the index to the DRAM
        copy and delete the NVMe one (once its last read lease ends), or give the
        DRAM range back."""
        c = self.counters
        got = srv.promoting.pop(done.dram_offset, None)
        if got is None or got[0].length != done.length or got[0].offset != done.nvme_offset:
            c["promotions_unknown"] += 1
            if got is not None:
                srv.promoting[done.dram_offset] = got
            return
        obj, ns = got
        length = obj.length
        srv.promoting_bytes -= held(srv, length)
        obj.hits = 0
        if not done.ok or obj.state != LIVE:
            # Failed, or evicted meanwhile: the DRAM range goes back (the server
            # drops whatever record it made there).
            self.index.free_range(srv, done.dram_offset, length)
            c["promotions_failed" if not done.ok else "promotions_void"] += 1
            self.index.unpin([obj], ns)
            return
        self.index.unpin([obj], ns)
        nvme_offset = obj.offset
        # Leases still reading the NVMe copy keep it: deleted when the last ends.
        if not self.index.move_tier(ns, obj, done.dram_offset, 0):
            self.index.free_copy(srv, 1, nvme_offset, length)  # drop_nvme in the next reply
        c["promotions_done"] += 1
        c["promoted_bytes"] += length
