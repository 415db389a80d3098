"""The object record: one type for "this server holds this object", and its
encodings.

:class:`StoredRecord` is the record. Every other shape of it is an encoding of
this one type, built from or checked against :data:`FIELDS`
(``tests/unit/test_record_shapes.py``):

* the server's DRAM manifest (``storage/manifest.py``): the record itself, as a
  msgpack array (field order is the on-disk format; ``digest`` stays for old logs);
* the proto ``StoredObject`` (``ReportObjects``, demote and promote commands):
  :func:`to_proto` / :func:`from_proto` here;
* the proto ``StoredColumns`` and the meta's decoded :class:`~gcache.storage.columns.Columns`
  (a chunk of records, one list per field, :meth:`Columns.fields` in FIELDS order);
* the NVMe tier's record header (``storage/nvme.py``, binary, with a CRC);
* the writer-supplied part, ``wire.ObjectInfo`` (:data:`WRITER_FIELDS`: what a
  client sends with its ``WRITE``/``SEAL`` and a grant is bound to), made a record
  by :func:`from_info` with the placement the grant gives;
* the meta's parked record (``meta/records.Parked``): a record plus where it
  waits.

The meta's index node (``meta/records.ObjectRecord``) is not an encoding: it
links an object into the prefix tree and the eviction rings and holds only what
the tree does not already say.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from gcache import wire
from gcache._proto import gcache_pb2 as pb


class StoredRecord(msgspec.Struct, array_like=True):
    """One object a server holds (the owner's record).

    ``namespace``: the namespace fingerprint; ``key``/``parent``: the block's key
    and its parent's (``b""`` for block 0); ``pos``: the block's position;
    ``group``: the layout group; ``tier``: 0 DRAM segment, 1 NVMe; ``offset``:
    segment offset (DRAM) or tier address (NVMe); ``sums``: per-layer xxh3-64, 8
    bytes each (K then V of each layer); ``seq``: the server's record sequence
    number; ``layer_bytes``: each layer's length when the group's layers differ in
    size, else ``()``."""

    namespace: bytes
    key: bytes
    parent: bytes
    pos: int
    group: int
    tier: int
    offset: int
    length: int
    sums: bytes
    seq: int
    digest: int = 0  # unused (manifests of older servers carried xxh3_64 of the bytes)
    layer_bytes: tuple[int, ...] = ()


# The record's fields, in order (``digest`` is a manifest compatibility slot, not
# part of the record any other encoding carries).
FIELDS: Final[tuple[str, ...]] = tuple(f for f in StoredRecord.__struct_fields__ if f != "digest")
# What the writer knows and sends (``wire.ObjectInfo``): the rest is the placement.
WRITER_FIELDS: Final[tuple[str, ...]] = (
    "namespace",
    "key",
    "parent",
    "pos",
    "group",
    "sums",
    "layer_bytes",
)


def to_proto(r: StoredRecord) -> Any:
    """``r`` as a proto ``StoredObject``."""
    return pb.StoredObject(
        namespace=r.namespace,
        key=r.key,
        parent=r.parent,
        pos=r.pos,
        group=r.group,
        tier=r.tier,
        offset=r.offset,
        length=r.length,
        sums=r.sums,
        seq=r.seq,
        layer_bytes=r.layer_bytes,
    )


def from_proto(o: Any) -> StoredRecord:
    """A proto ``StoredObject`` as a record (its bytes fields are ``bytes``
    already: no copy)."""
    return StoredRecord(
        namespace=o.namespace,
        key=o.key,
        parent=o.parent,
        pos=o.pos,
        group=o.group,
        tier=o.tier,
        offset=o.offset,
        length=o.length,
        sums=o.sums,
        seq=o.seq,
        layer_bytes=tuple(o.layer_bytes),
    )


def from_info(
    obj: wire.ObjectInfo, *, tier: int, offset: int, length: int, seq: int = 0
) -> StoredRecord:
    """The record of the object ``obj`` describes, placed at ``offset`` (``length``
    bytes) on ``tier``."""
    return StoredRecord(
        namespace=obj.namespace,
        key=obj.key,
        parent=obj.parent,
        pos=obj.pos,
        group=obj.group,
        tier=tier,
        offset=offset,
        length=length,
        sums=obj.sums,
        seq=seq,
        layer_bytes=tuple(obj.layer_bytes),
    )
