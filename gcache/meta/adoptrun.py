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
        parents = [p if p else _ROOT for p in fields[2][a:b]]
        ok = all(len(k) == 16 for k in keys) and all(len(p) == 16 for p in parents)
        if ok:
            self.ex = cx.find_keys(ns.ns_id, keys).tolist()
            pex = cx.find_keys(ns.ns_id, parents)
        else:  # (a malformed key: probed one by one, refused below)
            self.ex = [ns.entries.find(k) for k in keys]
            pex = np.array([ns.entries.find(p) for p in parents], dtype=np.int32)
        self.pex = pex.tolist()
        self.ppos = np.where(
            pex >= 0, cx.blocks.cols["pos"][np.where(pex >= 0, pex, 0)], -1
        ).tolist()
        exb = np.array(self.ex, dtype=np.int32)
        objs = cx.blocks.cols["obj"][np.where(exb >= 0, exb, 0), : layout.num_groups]
        objs[exb < 0] = -1
        self.objs = objs.tolist()
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
            )  # fmt: skip
            oids[at] = got
            if not tier and srv.reported is not None:
                for r, oid in zip(at, got.tolist(), strict=True):
                    srv.reported.add(rows[r][4], oid)  # (adopted after its report completed)
        index.admit(ns, oids)
