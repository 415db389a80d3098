"""Pending puts: begin (bounded placement, write grants), commit (only what was
written, proven by the servers' receipts) and abort. Every range freed from a
pending put is quarantined until its write grants have expired. No I/O."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from gcache import capability, wire
from gcache.config import GRANT_MARGIN_S, MetaConfig
from gcache.errors import E_BAD_REQUEST, E_UNKNOWN_PUT, Refusal
from gcache.meta.fewrows import SMALL
from gcache.meta.ids import new_id, wall_ms
from gcache.meta.index import Index
from gcache.meta.membership import Membership
from gcache.meta.placement import UNBOUNDED, Budget, Placement
from gcache.meta.records import NamespaceRecord, PendingPut, Placed, ServerRecord
from gcache.meta.session import LOCAL, Session


class Puts:
    def __init__(
        self,
        cfg: MetaConfig,
        counters: Counter[str],
        index: Index,
        members: Membership,
        placement: Placement,
        check_watermark: Callable[[ServerRecord], None],
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.index = index
        self.members = members
        self.placement = placement
        self.check_watermark = check_watermark  # after a commit, per server touched
        self.puts: dict[int, PendingPut] = {}
        self._put_heap: list[tuple[float, int]] = []
        self.pending_bytes = 0
        self.pending_by_session: Counter[int] = Counter()  # session id -> bytes held
        self.pending_by_tenant: Counter[str] = Counter()

    def put_budget(self, session: Session) -> Budget:
        """What a new put of ``session`` may reserve and evict (MetaConfig bounds)."""
        cfg = self.cfg
        cap = self.members.live_capacity()
        alloc = min(
            int(cfg.max_pending_per_client * cap) - self.pending_by_session[session.sid],
            int(cfg.max_pending_total * cap) - self.pending_bytes,
        )
        quota = session.principal.quota_bytes
        if quota:
            name = session.principal.name
            alloc = min(alloc, quota - self.index.tenant_bytes[name] - self.pending_by_tenant[name])
        return Budget(max(0, alloc), int(cfg.max_evict_per_put * cap))

    def put_begin(
        self,
        req: wire.PutBegin,
        now: float,
        wall: float,
        session: Session = LOCAL,
        wait: bool = False,
    ) -> wire.PutPlaced:
        """``wait``: rather than evict worth-keeping objects when DRAM is full while
        demotions in flight will make the room, raise ``PutWait`` (nothing placed;
        the hot path places the put again once they are reported)."""
        ns = self.index.namespace(req.namespace, session.principal)
        self.index.check_keys(req.keys)
        if len(req.groups) != len(req.keys):
            raise Refusal(E_BAD_REQUEST, "groups must have one bitmask per key")
        allowed = (1 << ns.layout.num_groups) - 1
        if any(m & ~allowed for m in req.groups):
            raise Refusal(E_BAD_REQUEST, f"group bitmask outside {allowed:#x}")
        if not -1 <= req.checkpoint_from <= len(req.keys):
            raise Refusal(E_BAD_REQUEST, f"checkpoint_from {req.checkpoint_from} out of range")
        self.index.quarantine.release(now)
        budget = self.put_budget(session)
        budget.wait = wait
        want = budget.alloc
        plan = self.placement.place(ns, req.keys, req.groups, now, req.checkpoint_from, budget)
        if plan.no_space and budget.alloc < want and budget.alloc < UNBOUNDED:
            self.counters["objects_over_bounds"] += plan.no_space
        placed = plan.placements
        if not placed:
            return wire.PutPlaced(put_id=0, placements=[], servers=[], no_space=plan.no_space)
        put_id = new_id(self.puts)
        deadline = now + self.cfg.put_timeout_s
        expiry_ms = wall_ms(wall, now, deadline - GRANT_MARGIN_S)
        put = PendingPut(put_id, ns, list(req.keys), placed, deadline, session, expiry_ms)
        self.puts[put_id] = put
        session.puts.add(put_id)
        self._reserve(put, +1)
        heapq.heappush(self._put_heap, (deadline, put_id))
        index: dict[str, int] = {}
        servers: list[wire.ServerAddr] = []
        placements = []
        keys = req.keys
        fp = ns.fingerprint
        layer_bytes = ns.layout.group_layer_bytes
        bind_digest = capability.bind_digest
        for block, g, srv, off, size in placed:
            si = index.get(srv.server_id)
            if si is None:
                si = index[srv.server_id] = len(servers)
                servers.append(srv.addr)
            # Write grants carry this meta's epoch: a server refuses those of an
            # older meta than the one it registered with (no amnesiac overwrites).
            ep = srv.grant_epoch
            # Bound to the one object it may write: the server checks the record
            # the writer sends against it and persists that record before the
            # receipt (durable before this meta acknowledges the commit).
            parent = keys[block - 1] if block else b""
            bind = bind_digest(fp, keys[block], parent, block, g, layer_bytes[g])
            tag = capability.mint(
                srv.secret, capability.KIND_WRITE, off, size, expiry_ms, 0, ep, bind
            )
            grant = wire.Grant(off, size, expiry_ms, tag, 0, ep)
            placements.append(wire.Placement(block, g, si, grant))
        return wire.PutPlaced(put_id, placements, servers, plan.no_space, plan.checkpoints)

    def _reserve(self, put: PendingPut, sign: int) -> None:
        """Count (``sign`` +1) or stop counting (-1) what ``put`` holds."""
        n = sign * put.nbytes
        self.pending_bytes += n
        sid = put.owner.sid
        tenant = put.owner.principal.name
        self.pending_by_session[sid] += n
        if not self.pending_by_session[sid]:
            del self.pending_by_session[sid]
        self.pending_by_tenant[tenant] += n
        if not self.pending_by_tenant[tenant]:
            del self.pending_by_tenant[tenant]
        for _, _, srv, _, size in put.placements:
            srv.pending_bytes += sign * size

    def _settle(self, put: PendingPut) -> None:
        """``put`` is no longer pending (committed, aborted or reclaimed)."""
        del self.puts[put.put_id]
        put.owner.puts.discard(put.put_id)
        self._reserve(put, -1)

    def _owned_put(self, put_id: int, session: Session) -> PendingPut | None:
        """The pending put ``put_id`` if ``session`` began it. Another session's put
        is reported as unknown: its existence is not revealed."""
        put = self.puts.get(put_id)
        if put is None:
            return None
        if put.owner is not session:
            self.counters["foreign_refused"] += 1
            return None
        return put

    def put_commit(self, req: wire.PutCommit, now: float, session: Session = LOCAL) -> int:
        put = self._owned_put(req.put_id, session)
        if put is None:
            raise Refusal(E_UNKNOWN_PUT, f"unknown or expired put {req.put_id}")
        layout = put.ns.layout
        seen: set[int] = set()
        for pi, sums in req.done:
            if not 0 <= pi < len(put.placements) or pi in seen:
                raise Refusal(E_BAD_REQUEST, f"bad or repeated placement index {pi}")
            seen.add(pi)
            group = put.placements[pi][1]
            want = 8 * len(layout.group_layers[group])
            if len(sums) != want:
                raise Refusal(
                    E_BAD_REQUEST, f"placement {pi}: {len(sums)} checksum bytes, want {want}"
                )
        done = dict(req.done)
        if session is not LOCAL:
            self._check_receipts(put, req, done)
        self._settle(put)
        return self.commit(
            put.ns,
            put.keys,
            put.placements,
            done,
            now,
            owner=put.owner.principal.name,
            hold_until=put.deadline,
            record=session is LOCAL,
        )

    def _check_receipts(self, put: PendingPut, req: wire.PutCommit, done: dict[int, bytes]) -> None:
        """Keep in ``done`` only placements whose write grant the server consumed:
        ``req.receipts[i]`` must be the receipt of ``req.done[i]``'s grant. The rest
        are treated as unwritten (quarantined), so no grant of a committed put can
        still write: every committed object's grant was used up. In-process drivers
        (:data:`LOCAL`, never a connection) mint no grants and send no receipts."""
        receipts = req.receipts
        for n, (pi, _) in enumerate(req.done):
            _, _, srv, off, size = put.placements[pi]
            want = capability.receipt(srv.secret, off, size, put.expiry_ms)
            if n >= len(receipts) or receipts[n] != want:
                del done[pi]
                self.counters["objects_unreceipted"] += 1

    def commit(
        self,
        ns: NamespaceRecord,
        key_list: list[bytes],
        placements: list[Placed],
        done: dict[int, bytes] | None,
        now: float,
        owner: str = "",
        hold_until: float | None = None,
        record: bool = True,
    ) -> int:
        """Make the placements written (``done``: placement index -> checksums; None:
        all of them, without checksums, for in-process drivers) visible, their bytes
        counted against tenant ``owner``; the rest are quarantined until
        ``hold_until`` (their grants' end; None: no grant was minted, free at once).
        ``record``: queue each object for its server's manifest (the heartbeat
        reply's ``adopt``); False for a client's put, whose server recorded every
        object when its bound write grant was consumed, before the receipt.
        Returns the objects committed."""
        layout = ns.layout
        index = self.index
        touched: dict[str, ServerRecord] = {}
        keep: list[tuple[int, int, ServerRecord, int, int, bytes]] = []
        last = -1
        for pi, (block, g, srv, off, size) in enumerate(placements):
            obj_sums = b"" if done is None else done.get(pi)
            if obj_sums is None or not srv.alive:
                self._put_back(srv, off, size, hold_until)
                continue
            keep.append((block, g, srv, off, size, obj_sums))
            last = max(last, block)
        if not keep:
            self.counters["puts_committed"] += 1
            return 0
        bids = index.ensure_chain(ns, key_list[: last + 1])
        if len(keep) <= SMALL:  # (a few: one by one, no array calls)
            return self._commit_few(ns, keep, bids, now, owner, hold_until, record, touched)
        obj = index.cx.blocks.cols["obj"]
        # Batches per (group, server); each object keeps its place in the put
        # (block by block: the order the policy admits them in).
        batches: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        servers: dict[str, ServerRecord] = {}
        n = 0
        for block, g, srv, off, size, _ in keep:
            bid = int(bids[block])
            if obj[bid, g] >= 0:  # a concurrent put committed it first
                self._put_back(srv, off, size, hold_until)
                self.counters["objects_deduped"] += 1
                continue
            batches.setdefault((g, srv.server_id), []).append((bid, off, n))
            n += 1
            servers[srv.server_id] = srv
            touched[srv.server_id] = srv
        oids = np.empty(n, dtype=np.int32)
        sums_of = {(int(bids[b]), g): sm for b, g, _, _, _, sm in keep}
        for (g, sid), items in batches.items():
            srv = servers[sid]
            width = len(sums_of[(items[0][0], g)])
            rows = np.frombuffer(
                b"".join(sums_of[(bid, g)] for bid, _, _ in items), dtype=np.uint8
            ).reshape(len(items), width)
            got = index.add_objects(
                ns,
                np.fromiter((bid for bid, _, _ in items), np.int32, len(items)),
                g,
                srv,
                [off for _, off, _ in items],
                layout.group_object_bytes[g],
                rows,
                np.full(len(items), now),
                owner,
            )
            oids[[i for _, _, i in items]] = got
        if record:
            for oid in oids.tolist():
                index.record(ns, index.obj(oid))
        # Admit once everything is added, so the policy sees the final tree.
        index.admit(ns, oids)
        self.counters["puts_committed"] += 1
        self.counters["objects_committed"] += len(oids)
        for srv in touched.values():
            self.check_watermark(srv)
        return len(oids)

    def _commit_few(
        self,
        ns: NamespaceRecord,
        keep: list[tuple[int, int, ServerRecord, int, int, bytes]],
        bids: npt.NDArray[np.int32] | list[int],
        now: float,
        owner: str,
        hold_until: float | None,
        record: bool,
        touched: dict[str, ServerRecord],
    ) -> int:
        """:meth:`commit` of a few objects, one by one (in placement order)."""
        index = self.index
        obj, width = index.cx.blocks.mv("obj"), index.cx.groups
        sizes = ns.layout.group_object_bytes
        ids = bids if isinstance(bids, list) else bids.tolist()
        oids: list[int] = []
        for block, g, srv, off, size, obj_sums in keep:
            bid = ids[block]
            if obj[bid * width + g] >= 0:  # a concurrent put committed it first
                self._put_back(srv, off, size, hold_until)
                self.counters["objects_deduped"] += 1
                continue
            oids.append(index.add_object(ns, bid, g, srv, off, sizes[g], obj_sums, now, owner))
            touched[srv.server_id] = srv
        if record:
            for oid in oids:
                index.record(ns, index.obj(oid))
        index.admit(ns, oids)
        self.counters["puts_committed"] += 1
        self.counters["objects_committed"] += len(oids)
        for srv in touched.values():
            self.check_watermark(srv)
        return len(oids)

    def _put_back(self, srv: ServerRecord, off: int, size: int, hold_until: float | None) -> None:
        if hold_until is None:
            self.index.free_range(srv, off, size)
        else:
            self.index.quarantine.hold(srv, off, size, hold_until)

    def put_abort(self, put_id: int, session: Session = LOCAL) -> bool:
        put = self._owned_put(put_id, session)
        if put is None:
            return False
        self._drop_put(put)
        self.counters["puts_aborted"] += 1
        return True

    def _drop_put(self, put: PendingPut) -> None:
        """Forget ``put``; its ranges wait in quarantine for its grants to expire."""
        self._settle(put)
        for _, _, srv, off, size in put.placements:
            self.index.quarantine.hold(srv, off, size, put.deadline)

    def end_session(self, session: Session) -> None:
        """Abort the pending puts of a closed session (their ranges go to quarantine)."""
        for put_id in list(session.puts):
            put = self.puts.get(put_id)
            if put is not None and put.owner is session:
                self._drop_put(put)
                self.counters["session_puts_aborted"] += 1
        session.puts.clear()

    def expire(self, now: float) -> None:
        """Reclaim puts past their deadline, then return quarantined ranges whose
        grants expired."""
        while self._put_heap and self._put_heap[0][0] <= now:
            _, put_id = heapq.heappop(self._put_heap)
            put = self.puts.get(put_id)
            if put is not None and put.deadline <= now:
                self._drop_put(put)
                self.counters["puts_reclaimed"] += 1
        self.index.quarantine.release(now)
