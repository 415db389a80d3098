"""What a leased lookup's reply costs to read out of the index, three ways, for
choosing how the meta moves onto the compact index (docs/performance.md, "The
compact index with the meta's semantics").

    python -m bench.lease_reply [--blocks 100k] [--json FILE]

The same prompts (``bench.meta_scale``'s, MiMo-V2-Flash) fill a ``MetaCore``
through ``put_begin``/``put_commit`` and a ``CompactIndex`` the way
``bench.compact_index`` does (``fill_compact``); then, for a 32k-token (and a 128k-token) prompt's
lease, each way reads every leased object's reply fields (block position, group,
server, offset, length, tier, checksums), as ``Leases.lookup`` does before it
mints the grants:

* **records** (the anchor): today's ``ObjectRecord`` attributes.
* **handles**: one small object per leased object whose fields are properties
  reading the compact columns (records as views over the columns).
* **ids**: the lease as an array of object ids; each field one fancy index and
  ``tolist``, the checksums one ``tobytes`` per object.
* **ids, checksums as one blob**: the same, the checksums of a width as one byte
  string (what a reply carrying them per lease instead of per object would take).

Median microseconds a lease over ``--reps`` repetitions, and the ratio to the
records way in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.compact_index import _layout, fill_compact
from bench.meta_rebuild import descriptor
from bench.meta_scale import BS, make_prompts, parse_sizes, plan, put_in_process

Row = tuple[Any, ...]


def build(n_blocks: int, seed: int) -> tuple[Any, Any, Any, dict[int, list[list[bytes]]]]:
    from gcache import wire
    from gcache.config import MetaConfig
    from gcache.meta.compact import CompactIndex
    from gcache.meta.core import MetaCore

    desc, spec = descriptor(BS)
    prompts = make_prompts(plan(n_blocks), seed)
    core = MetaCore(MetaConfig(adopt_outbox=max(1 << 16, 4 * n_blocks)))
    core.register_server(wire.ServerAddr("s0", "127.0.0.1", 1, "h", ""), bytes(16), 1, 1 << 60, 0.0)
    ns = core.register_namespace(desc, spec)
    put_in_process(core, ns, prompts)
    layout = _layout()
    ix = CompactIndex(groups=layout.num_groups)
    ix.namespace(0, ns.full_group)
    fill_compact(ix, layout, prompts)
    return core, ns, ix, prompts


class Handle:
    """An object as a view over the compact columns (a property per field)."""

    __slots__ = ("ix", "oid")

    def __init__(self, ix: Any, oid: int) -> None:
        self.ix, self.oid = ix, oid

    @property
    def pos(self) -> int:
        return int(self.ix.blocks.cols["pos"][self.ix.objects.cols["block"][self.oid]])

    @property
    def group(self) -> int:
        return int(self.ix.objects.cols["group"][self.oid])

    @property
    def server(self) -> int:
        return int(self.ix.objects.cols["server"][self.oid])

    @property
    def offset(self) -> int:
        return int(self.ix.objects.cols["offset"][self.oid])

    @property
    def length(self) -> int:
        return int(self.ix.objects.cols["length"][self.oid])

    @property
    def tier(self) -> int:
        return int(self.ix.objects.cols["tier"][self.oid])

    @property
    def sums(self) -> bytes:
        return bytes(self.ix.sums(self.oid))


def ways(core: Any, ns: Any, ix: Any, ks: list[bytes]) -> dict[str, Callable[[], object]]:
    picked = core.leasing.pick(ns, [ns.entries[k] for k in ks], len(ks), 5.0)
    bids = ix.find_keys(0, ks)
    objcol = ix.blocks.cols["obj"]
    parts = [objcol[bids, g] for g in range(objcol.shape[1])]
    oids = np.concatenate([p[p >= 0] for p in parts])
    assert len(oids) == len(picked), (len(oids), len(picked))
    o = ix.objects.cols

    def records() -> list[Row]:
        return [
            (r.entry.pos, r.group, r.server.server_id, r.offset, r.length, r.tier, r.sums)
            for r in picked
        ]

    def handles() -> list[Row]:
        return [
            (h.pos, h.group, h.server, h.offset, h.length, h.tier, h.sums)
            for h in (Handle(ix, i) for i in oids.tolist())
        ]

    def fields() -> list[Row]:
        pos = ix.blocks.cols["pos"][o["block"][oids]].tolist()
        cols = [o[c][oids].tolist() for c in ("group", "server", "offset", "length", "tier")]
        return list(zip(pos, *cols, strict=True))

    def ids() -> list[Row]:
        sl, ln = o["sums_slot"][oids], o["sums_len"][oids]
        sums = [b""] * len(oids)
        for w in np.unique(ln).tolist():
            at = np.flatnonzero(ln == w)
            for i, r in zip(at.tolist(), ix.sums_slabs.slabs[w].cols["s"][sl[at]], strict=True):
                sums[i] = r.tobytes()
        return [(*row, s) for row, s in zip(fields(), sums, strict=True)]

    def blob() -> tuple[list[Row], dict[int, bytes]]:
        sl, ln = o["sums_slot"][oids], o["sums_len"][oids]
        blobs = {
            w: ix.sums_slabs.slabs[w].cols["s"][sl[ln == w]].tobytes()
            for w in np.unique(ln).tolist()
        }
        return fields(), blobs

    return {
        "records": records,
        "handles": handles,
        "ids": ids,
        "ids, checksums as one blob": blob,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.lease_reply", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--blocks", type=parse_sizes, default=parse_sizes("100k"))
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    core, ns, ix, prompts = build(args.blocks[0], args.seed)
    rows = []
    for length in sorted(prompts):
        if length * BS // 1024 not in (32, 128):
            continue
        fns = ways(core, ns, ix, prompts[length][0])
        row: dict[str, Any] = {"prompt": f"{length * BS // 1024}k", "blocks": length}
        for name, fn in fns.items():
            lat = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn()
                lat.append(time.perf_counter() - t)
            row[name] = round(statistics.median(lat) * 1e6, 1)
        rows.append(row)
    names = list(fns)
    print("| prompt | objects read | " + " | ".join(f"{n} us" for n in names) + " |")
    print("|" + "---|" * (2 + len(names)))
    for r in rows:
        cells = [f"{r[n]} ({r[n] / r['records']:.1f}x)" for n in names]
        print(f"| {r['prompt']} | {r['blocks']} blocks | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "argv": sys.argv[1:]}, fh, indent=2)


if __name__ == "__main__":
    main()
