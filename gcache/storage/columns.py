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
before children, whatever order the server sent, as arrays (:class:`ColArrays`:
no Python object per record); the lists of the row-by-row paths are made only
when one asks for them.
"""

from __future__ import annotations

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
class ColArrays:
    """Records as arrays, one row each (what :func:`decode` makes: no Python
    object per record). ``sums`` is a byte blob several chunks' rows may share
    after slicing: each row's checksums are ``sums[sum_at[i]:sum_at[i] +
    sum_len[i]]``."""

    spaces: list[bytes]  # the distinct namespaces
    ns: np.ndarray[Any, Any]  # per row: its namespace in spaces
    keys: np.ndarray[Any, Any]  # (n, 16) uint8
    parents: np.ndarray[Any, Any]  # (n, 16) uint8 (a root's: zeros)
    pos: np.ndarray[Any, Any]  # int64 (as the rest)
    group: np.ndarray[Any, Any]
    tier: np.ndarray[Any, Any]
    offset: np.ndarray[Any, Any]
    length: np.ndarray[Any, Any]
    seq: np.ndarray[Any, Any]
    sums: np.ndarray[Any, Any]  # uint8 blob
    sum_at: np.ndarray[Any, Any]
    sum_len: np.ndarray[Any, Any]

    def __len__(self) -> int:
        return int(self.pos.size)

    def take(self, idx: Any) -> ColArrays:
        """The rows ``idx`` (a slice or an index array); the blob is shared."""
        return ColArrays(
            self.spaces, self.ns[idx], self.keys[idx], self.parents[idx], self.pos[idx],
            self.group[idx], self.tier[idx], self.offset[idx], self.length[idx],
            self.seq[idx], self.sums, self.sum_at[idx], self.sum_len[idx],
        )  # fmt: skip


def _blob_part(a: ColArrays) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The bytes of ``a``'s rows' checksums and each row's place in them: one
    slice of the blob when they lie in it end to end (as decoded and split),
    else gathered."""
    n = len(a)
    if not n:
        return a.sums[:0], a.sum_at[:0]
    at, ln = a.sum_at, a.sum_len
    lo = int(at[0])
    if n == 1 or (at[1:] == at[:-1] + ln[:-1]).all():
        return a.sums[lo : int(at[-1] + ln[-1])], at - lo
    mv = memoryview(a.sums.data)
    blob = b"".join([mv[x : x + y] for x, y in zip(at.tolist(), ln.tolist(), strict=True)])
    ends = np.cumsum(ln)
    return np.frombuffer(blob, np.uint8), ends - ln


def concat_arrays(parts: Sequence[ColArrays]) -> ColArrays:
    """Parts end to end (namespaces re-indexed, checksums copied once)."""
    spaces: dict[bytes, int] = {}
    ns, blobs, ats = [], [], []
    base = 0
    for a in parts:
        remap = np.array([spaces.setdefault(x, len(spaces)) for x in a.spaces] or [0], np.uint16)
        ns.append(remap[a.ns])
        blob, at = _blob_part(a)
        blobs.append(blob)
        ats.append(at + base)
        base += blob.size
    cat = np.concatenate
    return ColArrays(
        list(spaces), cat(ns), cat([a.keys for a in parts]), cat([a.parents for a in parts]),
        cat([a.pos for a in parts]), cat([a.group for a in parts]), cat([a.tier for a in parts]),
        cat([a.offset for a in parts]), cat([a.length for a in parts]),
        cat([a.seq for a in parts]), cat(blobs), cat(ats), cat([a.sum_len for a in parts]),
    )  # fmt: skip


def _lists_of(a: ColArrays) -> list[list[Any]]:
    """The rows of ``a`` as lists in FIELDS order (without layer lengths)."""
    n = len(a)
    sp = a.spaces
    kb, pb_ = a.keys.tobytes(), a.parents.tobytes()
    pos = a.pos.tolist()
    mv = memoryview(a.sums.data)
    return [
        [sp[0]] * n if len(sp) == 1 else [sp[i] for i in a.ns.tolist()],
        [kb[i : i + KEY] for i in range(0, n * KEY, KEY)],
        [pb_[KEY * i : KEY * i + KEY] if p else b"" for i, p in enumerate(pos)],
        pos,
        a.group.tolist(),
        a.tier.tolist(),
        a.offset.tolist(),
        a.length.tolist(),
        [bytes(mv[x : x + y]) for x, y in zip(a.sum_at.tolist(), a.sum_len.tolist(), strict=True)],
        a.seq.tolist(),
    ]


def _arrays_of(lists: list[list[Any]]) -> ColArrays:
    """:class:`ColArrays` of rows given as lists (records built one by one)."""
    nsl, key, parent, pos, group, tier, offset, length, sums, seq = lists
    n = len(key)
    spaces: dict[bytes, int] = {}
    ns = np.fromiter((spaces.setdefault(x, len(spaces)) for x in nsl), np.uint16, n)
    zero = bytes(KEY)
    ln = np.fromiter(map(len, sums), np.int64, n)
    i64 = np.int64

    def arr(x: list[int]) -> np.ndarray[Any, Any]:
        return np.array(x, dtype=np.uint64).astype(i64) if n else np.zeros(0, i64)

    return ColArrays(
        list(spaces), ns,
        np.frombuffer(b"".join(key), np.uint8).reshape(n, KEY),
        np.frombuffer(b"".join([p or zero for p in parent]), np.uint8).reshape(n, KEY),
        arr(pos), arr(group), arr(tier), arr(offset), arr(length), arr(seq),
        np.frombuffer(b"".join(sums), np.uint8), np.cumsum(ln) - ln, ln,
    )  # fmt: skip


LIST_NAMES: Final = ("namespace", "key", "parent", "pos", "group", "tier", "offset", "length",
                 "sums", "seq")  # fmt: skip


class Columns:
    """Records in block-position order: as arrays (:class:`ColArrays`, what
    :func:`decode` gives and the bulk adoption reads) and as one list per field
    (made on first use, for the row-by-row paths). Built from lists (records
    one by one) it makes its arrays on first use."""

    __slots__ = ("_a", "_l", "layer_bytes")

    def __init__(
        self,
        namespace: list[bytes],
        key: list[bytes],
        parent: list[bytes],
        pos: list[int],
        group: list[int],
        tier: list[int],
        offset: list[int],
        length: list[int],
        sums: list[bytes],
        seq: list[int],
        # per-record layer lengths (() = equal layers); None when no record has any
        layer_bytes: list[tuple[int, ...]] | None,
    ) -> None:
        self._l: list[list[Any]] | None = [
            namespace, key, parent, pos, group, tier, offset, length, sums, seq,
        ]  # fmt: skip
        self._a: ColArrays | None = None
        self.layer_bytes = layer_bytes

    @classmethod
    def of(cls, a: ColArrays, layer_bytes: list[tuple[int, ...]] | None = None) -> Columns:
        out = cls.__new__(cls)
        out._a, out._l, out.layer_bytes = a, None, layer_bytes
        return out

    @property
    def arrays(self) -> ColArrays:
        if self._a is None:
            assert self._l is not None
            self._a = _arrays_of(self._l)
        return self._a

    def _lists(self) -> list[list[Any]]:
        if self._l is None:
            assert self._a is not None
            self._l = _lists_of(self._a)
        return self._l

    # (the lists, made on first use; ``arrays`` reads without making them)
    namespace = property(lambda self: self._lists()[0])
    key = property(lambda self: self._lists()[1])
    parent = property(lambda self: self._lists()[2])
    group = property(lambda self: self._lists()[4])
    tier = property(lambda self: self._lists()[5])
    offset = property(lambda self: self._lists()[6])
    length = property(lambda self: self._lists()[7])
    sums = property(lambda self: self._lists()[8])
    seq = property(lambda self: self._lists()[9])

    pos = property(lambda self: self._lists()[3])

    def namespace_at(self, i: int) -> bytes:
        """Row ``i``'s namespace (no lists made)."""
        if self._a is not None:
            return self._a.spaces[int(self._a.ns[i])]
        return self._lists()[0][i]  # type: ignore[no-any-return]

    def __len__(self) -> int:
        if self._a is not None:
            return len(self._a)
        assert self._l is not None
        return len(self._l[1])

    def fields(self) -> list[Sequence[Any]]:
        """The columns in :data:`gcache.storage.record.FIELDS` order
        (``layer_bytes`` all ``()`` when no record has any)."""
        lbs = self.layer_bytes
        return [*self._lists(), lbs if lbs is not None else [()] * len(self)]

    def take(self, idx: Any) -> Columns:
        """The rows ``idx`` (a slice or an index array), in that order."""
        lbs = self.layer_bytes
        if lbs is not None:
            pick = range(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx).tolist()
            lbs = [lbs[i] for i in pick] if any(lbs[i] for i in pick) else None
        return Columns.of(self.arrays.take(idx), lbs)


def split(cols: Columns, k: int) -> tuple[Columns, Columns]:
    """The first ``k`` records and the rest (array slices, no record objects)."""
    return cols.take(slice(0, k)), cols.take(slice(k, len(cols)))


def concat(parts: Sequence[Columns]) -> Columns:
    """Chunks end to end, in the order given (not re-sorted)."""
    out = Columns.of(concat_arrays([c.arrays for c in parts]))
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
    i64 = np.int64
    kv = np.frombuffer(keys, np.uint8).reshape(n, KEY)
    pv = np.frombuffer(parents, np.uint8).reshape(n, KEY)
    if n and (pos == 0).any():  # (a root's parent field is ignored: zeros)
        pv = pv.copy()
        pv[pos == 0] = 0
    sum_len = nsums.astype(i64) * 8
    a = ColArrays(
        spaces, ns_index, kv, pv, pos.astype(i64), group.astype(i64), tier.astype(i64),
        offset.astype(i64), length.astype(i64), seq.astype(i64),
        np.frombuffer(sums, np.uint8), sum_end - sum_len, sum_len,
    )  # fmt: skip
    if n < 2 or bool((pos[1:] >= pos[:-1]).all()):  # as servers send: no reordering
        return Columns.of(a, layer_lists)
    order = np.argsort(pos, kind="stable")
    lbs = [layer_lists[i] for i in order.tolist()] if layer_lists is not None else None
    return Columns.of(a.take(order), lbs)
