"""The bulk half of adoption (``meta/adopt.py``): the rows of one namespace in a
report chunk, checked one by one in block order against what the index held
when the run began and what the run itself added, then added to the compact
index in bulk (its new blocks by one ``add_blocks``, its objects by one
``add_objects`` per group, server and tier). No I/O."""

from __future__ import annotations

from typing import Any

import numpy as np

from gcache.meta.index import Index
from gcache.meta.keymap import split_keys
from gcache.meta.records import NamespaceRecord, ServerRecord, group_layer_bytes

ADOPTED, DEFERRED, AGAIN, INVALID, DUPLICATE = range(5)
_ROOT = bytes(16)


class AdoptRun:
    """The rows of one namespace in a chunk being adopted (in block order): their
    keys and parents probed in the index at once, the blocks they need and the
    objects they bring kept in lists, added to the index in bulk by
    :meth:`finish`. A new block is numbered ``-1 - i`` until then."""

    def __init__(self, index: Index, ns: NamespaceRecord, fields: list[Any], a: int, b: int):
        self.index = index
        self.ns = ns
        layout = ns.layout
        self.sizes = layout.group_object_bytes
        self.nsums = [8 * len(x) for x in layout.group_layers]
        self.layout = layout
        cx = index.cx
        keys = list(fields[1][a:b])
        parents = [p or _ROOT for p in fields[2][a:b]]
        n = len(keys)
        ok = {*map(len, keys), *map(len, parents)} <= {16}
        if ok:
            exb = cx.find_keys(ns.ns_id, keys)
            pex = cx.find_keys(ns.ns_id, parents)
        else:  # (a malformed key: probed one by one, refused below)
            exb = np.array([ns.entries.find(k) for k in keys], dtype=np.int32)
            pex = np.array([ns.entries.find(p) for p in parents], dtype=np.int32)
        self.exb = exb
        self.ex = exb.tolist()
        self.pex = pex.tolist()
        self.ppos = np.where(
            pex >= 0, cx.blocks.cols["pos"][np.where(pex >= 0, pex, 0)], -1
        ).tolist()
        self._objs: list[list[int]] | None = None
        self.n = n
        self.k = 0  # the row being adopted, in the run
        # new blocks: key -> number; their key, parent key, position, children
        self.made: dict[bytes, int] = {}
        self.new_keys: list[bytes] = []
        self.new_parent: list[bytes] = []
        self.new_pos: list[int] = []
        # parent: a block id (>= 0), a new block (-1 - its number), None for a root
        self.new_up: list[int | None] = []
        self.new_kids: list[int] = []
        self.new_objs: list[int] = []
        self.dead: set[int] = set()
        # objects: (block or new block, group) -> (server, tier, offset), in row order
        self.pending: dict[tuple[int, int], tuple[ServerRecord, int, int]] = {}
        self.rows: list[tuple[int, int, ServerRecord, int, int, bytes, float]] = []
        self.taken: set[tuple[int, int]] = set()  # (server, DRAM offset) adopted here

    def fast(
        self, fields: list[Any], a: int, b: int, srvs: list[ServerRecord], base: float
    ) -> dict[str, int] | None:
        """The whole run at once when it is clean: every row valid (range, group,
        length, checksums), no two rows for one object or one DRAM range, no
        object there already, every new block's parent in the index or earlier in
        the run at the position before. Returns the objects adopted per server,
        or None (nothing done: the caller goes row by row, which says what is
        wrong with which row)."""
        n = b - a
        if not n or self.k:
            return None
        keys, parents = fields[1][a:b], fields[2][a:b]
        pos, grp, tier = fields[3][a:b], fields[4][a:b], fields[5][a:b]
        off, length, sums, seq, lbs = (f[a:b] for f in fields[6:11])
        sizes, nsums, layout = self.sizes, self.nsums, self.layout
        ng = len(sizes)
        # the rows, as the row-by-row path checks them (vectorised)
        g_a = np.array(grp, dtype=np.int64)
        t_a = np.array(tier, dtype=np.int64)
        if int(g_a.max()) >= ng or int(t_a.max()) > 1:
            return None
        if (np.array(length, dtype=np.int64) != np.array(sizes)[g_a]).any():
            return None
        if (np.fromiter(map(len, sums), np.int64, n) != np.array(nsums)[g_a]).any():
            return None
        if any(lbs) and any(
            lb and lb != group_layer_bytes(layout, g) for lb, g in zip(lbs, grp, strict=True)
        ):
            return None
        # DRAM ranges: in the segment, aligned, nobody else's (per server)
        o_a = np.array(off, dtype=np.int64)
        l_a = np.array(length, dtype=np.int64)
        sid = np.array([id(s) for s in srvs], dtype=np.int64)
        dram = t_a == 0
        for s in {id(x): x for x in srvs}.values():
            mine = dram & (sid == id(s))
            if not mine.any():
                continue
            al = s.allocator
            om = o_a[mine]
            if (om & (al.align - 1)).any() or (om + l_a[mine] > al.capacity).any():
                return None
            if np.unique(om).size != om.size:
                return None
            offs = om.tolist()
            if s.parked and any(o in s.parked for o in offs):
                return None
            held = s.reported
            if held is not None and max(held.get_many(offs), default=-1) >= 0:
                return None
        if len(set(zip(keys, grp, strict=True))) != n:
            return None  # one object named twice
        exb = self.exb
        old = exb >= 0
        if old.any() and (self.index.cx.blocks.cols["obj"][exb[old], g_a[old]] >= 0).any():
            return None  # there already (or another copy): row by row
        index, ns = self.index, self.ns
        bids = exb.copy()
        new = np.flatnonzero(~old)
        if new.size:
            nk_rows = new.tolist()
            nkeys = [keys[k] for k in nk_rows]
            npos = [pos[k] for k in nk_rows]
            newpos = dict(zip(nkeys, npos, strict=True))  # (the last row of each key)
            if len(set(zip(nkeys, npos, strict=True))) != len(newpos):
                return None  # one block at two positions
            # each new block's parent: in the index, or a new block, one position up
            p_a = np.array(npos, dtype=np.int64)
            got_pos = np.array([newpos.get(parents[k], -1) for k in nk_rows], dtype=np.int64)
            ppos = np.array(self.ppos, dtype=np.int64)[new]
            up = np.where(np.array(self.pex, dtype=np.int64)[new] >= 0, ppos, got_pos)
            if ((p_a > 0) & (up + 1 != p_a)).any():
                return None  # its parent comes later, or never
            first = dict(zip(reversed(nkeys), reversed(nk_rows), strict=True))
            order = sorted(first.values())
            nk = [keys[k] for k in order]
            k0, k1 = split_keys(nk)
            pk0, pk1 = split_keys([parents[k] if pos[k] else _ROOT for k in order])
            got = index.add_blocks(
                ns, k0, k1, pk0, pk1, np.array([pos[k] for k in order], np.int32)
            )
            if (got < 0).any():
                raise RuntimeError("adoption: a new block lost its parent")
            made = dict(zip(nk, got.tolist(), strict=True))
            bids[new] = [made[key] for key in nkeys]
        store = index.store
        slot_a = np.array([store.slot_of(s) for s in srvs], dtype=np.int64)
        code = (g_a * 65536 + slot_a) * 2 + t_a
        uniq, inv = np.unique(code, return_inverse=True)
        times_all = base + np.minimum(np.array(seq, dtype=np.float64), 1e9) * 1e-9
        oids = np.empty(n, dtype=np.int32)
        credit: dict[str, int] = {}
        for u, c in enumerate(uniq.tolist()):
            g, slot, t = c // 131072, (c // 2) % 65536, c % 2
            at_a = np.flatnonzero(inv == u)
            at = at_a.tolist()
            srv = store.servers[slot]
            assert srv is not None
            width = nsums[g]
            blob = np.frombuffer(b"".join([sums[k] for k in at]), dtype=np.uint8)
            got = index.add_objects(
                ns, bids[at_a], g, srv, o_a[at_a].astype(np.uint64), sizes[g],
                blob.reshape(len(at), width), times_all[at_a], "", t, refresh=False,
            )  # fmt: skip
            oids[at_a] = got
            credit[srv.server_id] = credit.get(srv.server_id, 0) + len(at)
            if not t and srv.reported is not None:
                srv.reported.add_many(o_a[at_a].tolist(), got.tolist())
        index.settle(oids)  # one refresh of the eviction order for the whole run
        index.admit(ns, oids, ordered=False)
        return credit

    @property
    def objs(self) -> list[list[int]]:
        """Per row, the object rows its block held when the run began (-1: none)."""
        if self._objs is None:
            exb = self.exb
            o = self.index.cx.blocks.cols["obj"][np.where(exb >= 0, exb, 0), : len(self.sizes)]
            o[exb < 0] = -1
            self._objs = o.tolist()
        return self._objs

    def adopt(self, row: tuple[Any, ...], s: ServerRecord, base: float) -> int:
        """One row (its range checked): what became of it."""
        _, key, pkey, pos, g, tier, off, length, sums, seq, lb = row
        k = self.k
        self.k += 1
        ref = self.ex[k]
        if ref < 0:
            made = self.made.get(key)
            if made is not None:
                ref = -1 - made
            else:
                up: int | None = None  # a root
                if pos:
                    pm = self.made.get(pkey)
                    if pm is not None and self.new_pos[pm] + 1 == pos:
                        up = -1 - pm
                    elif self.pex[k] >= 0 and self.ppos[k] + 1 == pos:
                        up = self.pex[k]
                    else:
                        return DEFERRED
                m = len(self.new_keys)
                self.made[key] = m
                self.new_keys.append(key)
                self.new_parent.append(pkey if pos else b"")
                self.new_pos.append(pos)
                self.new_up.append(up)
                self.new_kids.append(0)
                self.new_objs.append(0)
                if up is not None and up < 0:
                    self.new_kids[-1 - up] += 1
                ref = -1 - m
        layout = self.layout
        if (
            g >= len(self.sizes)
            or length != self.sizes[g]
            or len(sums) != self.nsums[g]
            or (lb and lb != group_layer_bytes(layout, g))
        ):
            if ref < 0:
                self._prune(-1 - ref)
            return INVALID
        have = self.pending.get((ref, g))
        if have is None and ref >= 0:
            oid = self.objs[k][g] if self.ex[k] == ref else -1
            if oid >= 0:
                o = self.index.cx.objects.cols
                srv = self.index.store.servers[int(o["server"][oid])]
                have = (srv, int(o["tier"][oid]), int(o["offset"][oid]))  # type: ignore[assignment]
        if have is not None:
            if have[0] is s and have[1] == tier and have[2] == off:
                return AGAIN
            return DUPLICATE
        self.pending[(ref, g)] = (s, tier, off)
        if ref < 0:
            self.new_objs[-1 - ref] += 1
        if not tier:
            self.taken.add((id(s), off))
        last = base + (seq if seq < 10**9 else 10**9) * 1e-9
        self.rows.append((ref, g, s, tier, off, sums, last))
        return ADOPTED

    def _prune(self, m: int) -> None:
        """A new block left with no object and no child is not made (nor, so on
        up, a new parent left so)."""
        while m >= 0 and m not in self.dead and not self.new_objs[m] and not self.new_kids[m]:
            self.dead.add(m)
            del self.made[self.new_keys[m]]
            up = self.new_up[m]
            m = -1
            if up is not None and up < 0:
                m = -1 - up
                self.new_kids[m] -= 1

    def finish(self) -> None:
        """Add the run's new blocks, then its objects, then tell the policies."""
        index, ns = self.index, self.ns
        ids = np.full(len(self.new_keys), -1, dtype=np.int32)
        live = [m for m in range(len(self.new_keys)) if m not in self.dead]
        if live:
            k0, k1 = split_keys([self.new_keys[m] for m in live])
            pk0, pk1 = split_keys([self.new_parent[m] or _ROOT for m in live])
            pos = np.array([self.new_pos[m] for m in live], dtype=np.int32)
            got = index.add_blocks(ns, k0, k1, pk0, pk1, pos)
            if (got < 0).any():
                raise RuntimeError("adoption: a new block lost its parent")
            ids[live] = got
        if not self.rows:
            return
        batches: dict[tuple[int, int, int], list[int]] = {}
        for r, (_, g, s, tier, _, _, _) in enumerate(self.rows):
            batches.setdefault((g, index.store.slot_of(s), tier), []).append(r)
        oids = np.empty(len(self.rows), dtype=np.int32)
        rows = self.rows
        for (g, slot, tier), at in batches.items():
            srv = index.store.servers[slot]
            assert srv is not None
            bids = np.fromiter(
                (rows[r][0] if rows[r][0] >= 0 else ids[-1 - rows[r][0]] for r in at),
                np.int32,
                len(at),
            )
            width = self.nsums[g]
            sums = np.frombuffer(b"".join(rows[r][5] for r in at), dtype=np.uint8)
            got = index.add_objects(
                ns, bids, g, srv, [rows[r][4] for r in at], self.sizes[g],
                sums.reshape(len(at), width), np.array([rows[r][6] for r in at]), "", tier,
                refresh=False,
            )  # fmt: skip
            oids[at] = got
            if not tier and srv.reported is not None:
                for r, oid in zip(at, got.tolist(), strict=True):
                    srv.reported.add(rows[r][4], oid)  # (adopted after its report completed)
        index.settle(oids)  # one refresh of the eviction order for the whole run
        index.admit(ns, oids, ordered=False)
