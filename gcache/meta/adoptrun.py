"""The bulk half of adoption (``meta/adopt.py``): the rows of one namespace in a
report chunk, checked one by one in block order against what the index held
when the run began and what the run itself added, then added to the compact
index in bulk (its new blocks by one ``add_blocks``, its objects by one
``add_objects`` per group, server and tier). No I/O."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from gcache.meta.index import Index
from gcache.meta.keymap import split_keys
from gcache.meta.records import NamespaceRecord, ServerRecord, group_layer_bytes
from gcache.storage.columns import ColArrays

ADOPTED, DEFERRED, AGAIN, INVALID, DUPLICATE = range(5)
_ROOT = bytes(16)


class AdoptRun:
    """The rows of one namespace in a chunk being adopted (in block order): their
    keys and parents probed in the index at once, the blocks they need and the
    objects they bring kept in lists, added to the index in bulk by
    :meth:`finish`. A new block is numbered ``-1 - i`` until then."""

    def __init__(self, index: Index, ns: NamespaceRecord, cols: ColArrays, a: int, b: int):
        self.index = index
        self.ns = ns
        layout = ns.layout
        self.sizes = layout.group_object_bytes
        self.nsums = [8 * len(x) for x in layout.group_layers]
        self.layout = layout
        cx = index.cx
        kv = cols.keys[a:b].view("<u8")  # (rows, 2): the keys' two halves
        pv = cols.parents[a:b].view("<u8")
        self.k0, self.k1, self.pk0, self.pk1 = kv[:, 0], kv[:, 1], pv[:, 0], pv[:, 1]
        n = b - a
        exb = cx.keys.find(ns.ns_id, self.k0, self.k1)
        pex = cx.keys.find(ns.ns_id, self.pk0, self.pk1)
        self.exb = exb
        self.pex_a = pex
        self.ppos_a = np.where(pex >= 0, cx.blocks.cols["pos"][np.where(pex >= 0, pex, 0)], -1)
        # (as lists, for the row-by-row path: made at its first row)
        self.ex: list[int] = []
        self.pex: list[int] = []
        self.ppos: list[int] = []
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
        self,
        cols: ColArrays,
        lbs: list[tuple[int, ...]] | None,
        a: int,
        b: int,
        srvs: list[ServerRecord],
        base: float,
    ) -> dict[str, int] | None:
        """The whole run at once when it is clean: every row valid (range, group,
        length, checksums), no two rows for one object or one DRAM range, no
        object there already, every new block's parent in the index or earlier in
        the run at the position before. Returns the objects adopted per server,
        or None (nothing done: the caller goes row by row, which says what is
        wrong with which row). Reads the chunk's arrays only (``lbs``: its rows'
        layer lengths, or None)."""
        n = b - a
        if not n or self.k:
            return None
        pos, g_a, t_a = cols.pos[a:b], cols.group[a:b], cols.tier[a:b]
        o_a, l_a, seq = cols.offset[a:b], cols.length[a:b], cols.seq[a:b]
        sizes, nsums, layout = self.sizes, self.nsums, self.layout
        ng = len(sizes)
        # the rows, as the row-by-row path checks them (vectorised)
        if int(g_a.min()) < 0 or int(g_a.max()) >= ng or int(t_a.min()) < 0 or int(t_a.max()) > 1:
            return None
        if (l_a != np.array(sizes)[g_a]).any() or (o_a < 0).any():
            return None
        width_a = cols.sum_len[a:b]
        if (width_a != np.array(nsums)[g_a]).any():
            return None
        if lbs is not None and any(
            lb and lb != group_layer_bytes(layout, int(g))
            for lb, g in zip(lbs[a:b], g_a.tolist(), strict=True)
        ):
            return None
        # DRAM ranges: in the segment, aligned, nobody else's (per server)
        first = srvs[0]
        ids = np.fromiter(map(id, srvs), np.int64, n)
        one = bool((ids == ids[0]).all())
        sid = None if one else ids
        by_id = {id(first): first} if one else dict(zip(map(id, srvs), srvs, strict=True))
        dram = t_a == 0
        for s in by_id.values():
            mine = dram if sid is None else dram & (sid == id(s))
            if not mine.any():
                continue
            al = s.allocator
            om = o_a[mine]
            if (om & (al.align - 1)).any() or (om + l_a[mine] > al.capacity).any():
                return None
            so = np.sort(om)
            if (so[1:] == so[:-1]).any():
                return None
            if s.parked and any(o in s.parked for o in om.tolist()):
                return None
            held = s.reported
            if held is not None and held.any_of(om):
                return None
        k0, k1 = self.k0, self.k1
        by_key = np.lexsort((g_a, k1, k0))  # one object named twice: row by row
        sk0, sk1, sg = k0[by_key], k1[by_key], g_a[by_key]
        if ((sk0[1:] == sk0[:-1]) & (sk1[1:] == sk1[:-1]) & (sg[1:] == sg[:-1])).any():
            return None
        exb = self.exb
        old = exb >= 0
        if old.any() and (self.index.cx.blocks.cols["obj"][exb[old], g_a[old]] >= 0).any():
            return None  # there already (or another copy): row by row
        index, ns = self.index, self.ns
        bids = exb.copy()
        new = np.flatnonzero(~old)
        if new.size and self._new_blocks(new, pos, bids) is None:
            return None
        store = index.store
        if one:
            slot_a: Any = store.slot_of(first)
        else:
            uids, inv_s = np.unique(ids, return_inverse=True)
            slots = [store.slot_of(by_id[u]) for u in uids.tolist()]
            slot_a = np.array(slots, dtype=np.int64)[inv_s]
        code = (g_a * 65536 + slot_a) * 2 + t_a
        if one and not t_a.any() and not g_a.any():  # (one batch)
            uniq, inv = [int(code[0])], np.zeros(n, dtype=np.int64)
        else:
            uniq_a, inv = np.unique(code, return_inverse=True)
            uniq = uniq_a.tolist()
        sq = np.where(seq < 0, 10**9, np.minimum(seq, 10**9)).astype(np.float64)
        times_all = base + sq * 1e-9
        at_all = cols.sum_at[a:b]
        oids = np.empty(n, dtype=np.int32)
        credit: dict[str, int] = {}
        for u, c in enumerate(uniq):
            g, slot, t = c // 131072, (c // 2) % 65536, c % 2
            at_a = np.flatnonzero(inv == u)
            srv = store.servers[slot]
            assert srv is not None
            width = nsums[g]
            blob = cols.sums
            if width:  # (each row's checksums: one strided gather)
                win = np.lib.stride_tricks.as_strided(
                    blob, shape=(max(blob.size - width + 1, 0), width), strides=(1, 1)
                )
                sums = win[at_all[at_a]]
            else:
                sums = np.zeros((at_a.size, 0), dtype=np.uint8)
            got = index.add_objects(
                ns, bids[at_a], g, srv, o_a[at_a].astype(np.uint64), sizes[g],
                sums, times_all[at_a], "", t, refresh=False,
            )  # fmt: skip
            oids[at_a] = got
            credit[srv.server_id] = credit.get(srv.server_id, 0) + int(at_a.size)
            if not t and srv.reported is not None:
                srv.reported.add_many(o_a[at_a].tolist(), got.tolist())
        index.settle(oids)  # one refresh of the eviction order for the whole run
        index.admit(ns, oids, ordered=False)
        return credit

    def _new_blocks(self, new: npt.NDArray[np.intp], pos: Any, bids: Any) -> bool | None:
        """Add the run's new blocks (rows ``new``: keys not in the index), each at
        its first row, and put their ids in ``bids``; None (nothing added) when a
        key comes at two positions, a parent is neither in the index nor a new
        block one position up, or two new keys share their first half (a 2^-64
        chance: the row-by-row path handles it)."""
        k0, k1, pk0, pk1 = self.k0, self.k1, self.pk0, self.pk1
        nk0, nk1, npos = k0[new], k1[new], pos[new]
        order = np.lexsort((np.arange(new.size), nk1, nk0))  # by key, then row
        sk0, sk1, sp = nk0[order], nk1[order], npos[order]
        same = (sk0[1:] == sk0[:-1]) & (sk1[1:] == sk1[:-1])
        if (same & (sp[1:] != sp[:-1])).any():
            return None  # one block at two positions
        head = np.concatenate([[True], ~same])  # each key's first row
        uk0, uk1, upos = sk0[head], sk1[head], sp[head]
        if (uk0[1:] == uk0[:-1]).any():
            return None
        # each new block's parent: in the index, or a new block, one position up
        p0, p1 = pk0[new], pk1[new]
        at = np.minimum(np.searchsorted(uk0, p0), uk0.size - 1)
        found = (uk0[at] == p0) & (uk1[at] == p1)
        got_pos = np.where(found, upos[at], -1)
        pex, ppos = self.pex_a[new], self.ppos_a[new]
        up = np.where(pex >= 0, ppos, got_pos)
        if ((npos > 0) & (up + 1 != npos)).any():
            return None  # its parent comes later, or never
        rows = np.sort(new[order][head])  # first rows, in run order
        rk0, rp0 = k0[rows], pos[rows]
        root = rp0 == 0
        got = self.index.add_blocks(
            self.ns, rk0, k1[rows], np.where(root, 0, pk0[rows]), np.where(root, 0, pk1[rows]),
            rp0.astype(np.int32),
        )  # fmt: skip
        if (got < 0).any():
            raise RuntimeError("adoption: a new block lost its parent")
        ids = np.empty(uk0.size, dtype=np.int32)
        ids[np.searchsorted(uk0, rk0)] = got
        bids[new] = ids[np.searchsorted(uk0, nk0)]
        return True

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
        if not k:
            self.ex, self.pex = self.exb.tolist(), self.pex_a.tolist()
            self.ppos = self.ppos_a.tolist()
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
