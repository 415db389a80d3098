"""A chunk of a server's records in columns (proto ``StoredColumns``): an
encoding of :class:`gcache.storage.record.StoredRecord`.

A restarted meta rebuilds its index from the servers' reports (``ReportObjects``):
a million records as a million ``StoredObject`` messages cost the meta about a
microsecond each to parse and convert. In columns a chunk is a dozen ``bytes``
fields: keys and parents as 16 bytes per record, integers as fixed-width
little-endian arrays, the per-layer checksums concatenated. :func:`encode` is the
server's side, :func:`decode` the meta's: it checks every column's length against
the record count before handing anything out, so a truncated or inconsistent chunk
is refused whole (:class:`gcache.errors.ProtocolError`, one line naming the column)
and nothing of it is adopted.

:func:`decode` returns the records ordered by block position (stable), parents
before children, whatever order the server sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from gcache._proto import gcache_pb2 as pb
from gcache.errors import ProtocolError
from gcache.storage.record import StoredRecord

KEY: Final = 16
MAX_RECORDS: Final = 1 << 16  # per chunk (servers send 2048)
_LE = {2: "<u2", 4: "<u4", 8: "<u8", 1: "u1"}


@dataclass(slots=True)
class Columns:
    """Decoded records, one list entry per record, in block-position order."""

    namespace: list[bytes]
    key: list[bytes]
    parent: list[bytes]  # b"" for block 0
    pos: list[int]
    group: list[int]
    tier: list[int]
    offset: list[int]
    length: list[int]
    sums: list[bytes]
    seq: list[int]
    # per-record layer lengths (() = equal layers); None when no record has any
    layer_bytes: list[tuple[int, ...]] | None

    def __len__(self) -> int:
        return len(self.key)

    def fields(self) -> list[Sequence[Any]]:
        """The columns in :data:`gcache.storage.record.FIELDS` order
        (``layer_bytes`` all ``()`` when no record has any)."""
        lbs = self.layer_bytes
        return [
            self.namespace,
            self.key,
            self.parent,
            self.pos,
            self.group,
            self.tier,
            self.offset,
            self.length,
            self.sums,
            self.seq,
            lbs if lbs is not None else [()] * len(self.key),
        ]


# The columns every record has (all but ``layer_bytes``), in FIELDS order.
_LISTS: Final = tuple(f.name for f in dataclasses.fields(Columns))[:-1]


def split(cols: Columns, k: int) -> tuple[Columns, Columns]:
    """The first ``k`` records and the rest (list slices, no record objects)."""
    lbs = cols.layer_bytes
    head = Columns(*(getattr(cols, f)[:k] for f in _LISTS), None)  # type: ignore[arg-type,call-arg]
    tail = Columns(*(getattr(cols, f)[k:] for f in _LISTS), None)  # type: ignore[arg-type,call-arg]
    if lbs is not None:
        head.layer_bytes, tail.layer_bytes = lbs[:k] or None, lbs[k:] or None
    return head, tail


def concat(parts: Sequence[Columns]) -> Columns:
    """Chunks end to end, in the order given (not re-sorted)."""
    out = Columns(*([] for _ in _LISTS), None)  # type: ignore[arg-type,call-arg]
    for c in parts:
        for f in _LISTS:
            getattr(out, f).extend(getattr(c, f))
    if any(c.layer_bytes for c in parts):
        lbs: list[tuple[int, ...]] = []
        for c in parts:
            lbs += c.layer_bytes if c.layer_bytes is not None else [()] * len(c)
        out.layer_bytes = lbs
    return out


def columns_of(records: Sequence[StoredRecord]) -> Columns:
    """Records (already checked and in block order) as :class:`Columns`."""
    lbs = [r.layer_bytes for r in records]
    return Columns(
        namespace=[r.namespace for r in records],
        key=[r.key for r in records],
        parent=[r.parent for r in records],
        pos=[r.pos for r in records],
        group=[r.group for r in records],
        tier=[r.tier for r in records],
        offset=[r.offset for r in records],
        length=[r.length for r in records],
        sums=[r.sums for r in records],
        seq=[r.seq for r in records],
        layer_bytes=lbs if any(lbs) else None,
    )


def encode(records: Sequence[StoredRecord]) -> Any:
    """``records`` as one ``StoredColumns`` message."""
    n = len(records)
    spaces: dict[bytes, int] = {}
    ns_index = np.fromiter(
        (spaces.setdefault(r.namespace, len(spaces)) for r in records), np.uint16, n
    )
    ints = np.array(
        [(r.pos, r.group, r.tier, r.offset, r.length, r.seq, len(r.sums) // 8) for r in records],
        np.uint64,
    ).reshape(n, 7)
    zero = bytes(KEY)
    cols = pb.StoredColumns(
        namespaces=list(spaces),
        ns_index=ns_index.astype("<u2").tobytes(),
        keys=b"".join(r.key for r in records),
        parents=b"".join(r.parent or zero for r in records),
        pos=ints[:, 0].astype("<u4").tobytes(),
        group=ints[:, 1].astype("u1").tobytes(),
        tier=ints[:, 2].astype("u1").tobytes(),
        offset=ints[:, 3].astype("<u8").tobytes(),
        length=ints[:, 4].astype("<u8").tobytes(),
        seq=ints[:, 5].astype("<u8").tobytes(),
        nsums=ints[:, 6].astype("<u2").tobytes(),
        sums=b"".join(r.sums for r in records),
    )
    if any(r.layer_bytes for r in records):
        cols.nlayer_bytes = np.array([len(r.layer_bytes) for r in records], "<u2").tobytes()
        cols.layer_bytes = np.array([b for r in records for b in r.layer_bytes], "<u4").tobytes()
    return cols


def _array(cols: Any, name: str, width: int, n: int) -> np.ndarray[Any, Any]:
    raw = getattr(cols, name)
    if len(raw) != n * width:
        raise ProtocolError(
            f"report chunk refused: column {name} holds {len(raw)} bytes, "
            f"{n} records need {n * width}"
        )
    return np.frombuffer(raw, _LE[width])


def decode(cols: Any) -> Columns:
    """The records of a ``StoredColumns`` message, parents before children. Raises
    :class:`ProtocolError` (nothing decoded) when a column does not match the record
    count, a namespace index is out of range, or the checksums or layer lengths do
    not add up."""
    keys = cols.keys
    n, rest = divmod(len(keys), KEY)
    if rest:
        raise ProtocolError(f"report chunk refused: keys hold {len(keys)} bytes, not 16 each")
    if n > MAX_RECORDS:
        raise ProtocolError(f"report chunk refused: {n} records (at most {MAX_RECORDS})")
    parents = cols.parents
    if len(parents) != n * KEY:
        raise ProtocolError(
            f"report chunk refused: parents hold {len(parents)} bytes, {n} records need {n * KEY}"
        )
    ns_index = _array(cols, "ns_index", 2, n)
    pos = _array(cols, "pos", 4, n)
    group = _array(cols, "group", 1, n)
    tier = _array(cols, "tier", 1, n)
    offset = _array(cols, "offset", 8, n)
    length = _array(cols, "length", 8, n)
    seq = _array(cols, "seq", 8, n)
    nsums = _array(cols, "nsums", 2, n)
    spaces = list(cols.namespaces)
    if n and int(ns_index.max()) >= len(spaces):
        raise ProtocolError(
            f"report chunk refused: namespace index {int(ns_index.max())} of "
            f"{len(spaces)} namespaces"
        )
    sums = cols.sums
    sum_end = np.cumsum(nsums, dtype=np.int64) * 8
    if (int(sum_end[-1]) if n else 0) != len(sums):
        raise ProtocolError(
            f"report chunk refused: sums hold {len(sums)} bytes, the records' counts "
            f"need {int(sum_end[-1]) if n else 0}"
        )
    layer_lists: list[tuple[int, ...]] | None = None
    if cols.nlayer_bytes or cols.layer_bytes:
        nlb = _array(cols, "nlayer_bytes", 2, n)
        lb_end = np.cumsum(nlb, dtype=np.int64)
        total = int(lb_end[-1]) if n else 0
        lb = cols.layer_bytes
        if len(lb) != 4 * total:
            raise ProtocolError(
                f"report chunk refused: layer_bytes hold {len(lb)} bytes, the records' "
                f"counts need {4 * total}"
            )
        flat = np.frombuffer(lb, "<u4").tolist()
        ends = lb_end.tolist()
        starts = [0, *ends[:-1]]
        layer_lists = [tuple(flat[a:b]) for a, b in zip(starts, ends, strict=True)]
    ends8 = sum_end.tolist()
    starts8 = [0, *ends8[:-1]] if n else []
    pos_l = pos.tolist()
    ns_l = ns_index.tolist()
    if n < 2 or bool((pos[1:] >= pos[:-1]).all()):  # as servers send: no reordering
        one = spaces[0] if len(spaces) == 1 else None
        return Columns(
            namespace=[one] * n if one is not None else [spaces[i] for i in ns_l],
            key=[keys[i : i + KEY] for i in range(0, n * KEY, KEY)],
            parent=[parents[KEY * i : KEY * i + KEY] if p else b"" for i, p in enumerate(pos_l)],
            pos=pos_l,
            group=group.tolist(),
            tier=tier.tolist(),
            offset=offset.tolist(),
            length=length.tolist(),
            sums=[sums[a:b] for a, b in zip(starts8, ends8, strict=True)],
            seq=seq.tolist(),
            layer_bytes=layer_lists,
        )
    order = np.argsort(pos, kind="stable")
    idx = order.tolist()
    return Columns(
        namespace=[spaces[ns_l[i]] for i in idx],
        key=[keys[KEY * i : KEY * i + KEY] for i in idx],
        parent=[parents[KEY * i : KEY * i + KEY] if pos_l[i] else b"" for i in idx],
        pos=[pos_l[i] for i in idx],
        group=group[order].tolist(),
        tier=tier[order].tolist(),
        offset=offset[order].tolist(),
        length=length[order].tolist(),
        sums=[sums[starts8[i] : ends8[i]] for i in idx],
        seq=seq[order].tolist(),
        layer_bytes=[layer_lists[i] for i in idx] if layer_lists is not None else None,
    )
