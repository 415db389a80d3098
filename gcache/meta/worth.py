"""The value side of the demotion rule (``meta/tiers.py``): whether a DRAM object
is worth a disk write, judged only when its server's NVMe tier is short of room.
It is when recomputing its block takes at least ``demote_min_gain`` times as long
as reading it back from NVMe at the server's measured bandwidth (recompute FLOPs
from the compute model of docs/eviction.md at ``compute_tflops``; a model of
unknown cost always is), or when cached descendants need it (a full object with
children). Under the cost policy an object that serves no match (score ``ZERO``)
never is. No I/O."""

from __future__ import annotations

from gcache.config import MetaConfig
from gcache.meta.eviction import (
    UNIT_COMPUTE,
    ZERO,
    CostPolicy,
    ModelCompute,
    compute_for_layout,
)
from gcache.meta.index import Index
from gcache.meta.records import NamespaceRecord, ObjectRecord

# Assumed NVMe read bandwidth of a server that reported none (GB/s).
DEFAULT_NVME_READ_GBPS = 2.0


class Worth:
    def __init__(self, cfg: MetaConfig, index: Index) -> None:
        self.cfg = cfg
        self.index = index
        self._compute: dict[int, ModelCompute] = {}

    def compute_of(self, ns: NamespaceRecord) -> ModelCompute:
        c = self._compute.get(ns.ns_id)
        if c is None:
            c = self._compute[ns.ns_id] = compute_for_layout(ns.layout)
        return c

    def recompute_s(self, ns: NamespaceRecord, pos: int) -> float:
        """Seconds to recompute block ``pos`` of a prompt at ``compute_tflops``."""
        bs = ns.layout.block_size
        flops = self.compute_of(ns).span(pos * bs, (pos + 1) * bs)
        return flops / (self.cfg.compute_tflops * 1e12)

    def a_disk_write(self, obj: ObjectRecord, ns: NamespaceRecord) -> bool:
        """Recomputing ``obj``'s block takes at least ``demote_min_gain`` times as
        long as reading it back from NVMe, or its cached descendants need it."""
        if obj.group == ns.full_group and obj.entry.children:
            return True
        # Not a block whose cached descendants need it: judge it by value.
        if isinstance(self.index.policy, CostPolicy) and obj.score <= ZERO / 2:
            return False  # it serves no match as things stand
        gbps = obj.server.nvme_read_gbps or DEFAULT_NVME_READ_GBPS
        read_s = obj.length / (gbps * 1e9)
        if self.compute_of(ns) is UNIT_COMPUTE:
            return True  # unknown cost: keep what fits
        return self.recompute_s(ns, obj.entry.pos) >= self.cfg.demote_min_gain * read_s
