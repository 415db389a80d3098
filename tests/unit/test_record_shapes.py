"""Every shape of the object record agrees with the one type,
:class:`gcache.storage.record.StoredRecord`: the proto ``StoredObject`` and
``StoredColumns``, the meta's decoded ``Columns`` and parked records, the manifest
frame, the writer's ``wire.ObjectInfo``, and the NVMe record header."""

from __future__ import annotations

import inspect

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache.meta.adopt import parked_from
from gcache.meta.records import Parked
from gcache.storage import columns, manifest, nvme
from gcache.storage.record import (
    FIELDS,
    WRITER_FIELDS,
    StoredRecord,
    from_info,
    from_proto,
    to_proto,
)

records = st.builds(
    StoredRecord,
    namespace=st.binary(min_size=16, max_size=16),
    key=st.binary(min_size=16, max_size=16),
    parent=st.one_of(st.just(b""), st.binary(min_size=16, max_size=16)),
    pos=st.one_of(st.just(0), st.integers(1, 2**31)),
    group=st.integers(0, 7),
    tier=st.integers(0, 1),
    offset=st.integers(0, 2**40),
    length=st.integers(1, 2**30),
    sums=st.binary(min_size=8, max_size=8).map(lambda b: b * 4),
    seq=st.integers(0, 2**62),
    layer_bytes=st.one_of(st.just(()), st.tuples(*[st.integers(1, 2**20)] * 4)),
).filter(lambda r: (r.parent == b"") == (r.pos == 0))  # block 0 alone has no parent


def fields_of(r: StoredRecord) -> tuple[object, ...]:
    return tuple(getattr(r, f) for f in FIELDS)


def test_every_encoding_names_the_record_fields() -> None:
    assert FIELDS == (
        "namespace", "key", "parent", "pos", "group", "tier", "offset", "length",
        "sums", "seq", "layer_bytes",
    )  # fmt: skip
    assert tuple(pb.StoredObject.DESCRIPTOR.fields_by_name) == FIELDS
    # (Columns is built from one list per field, in this order; its lists too)
    assert tuple(inspect.signature(columns.Columns).parameters) == FIELDS
    assert (*columns.LIST_NAMES, "layer_bytes") == FIELDS
    assert set(WRITER_FIELDS) <= set(FIELDS)
    assert tuple(wire.ObjectInfo.__struct_fields__) == WRITER_FIELDS
    # The parked record is a record with its waiting state after it.
    assert Parked.__struct_fields__[: len(StoredRecord.__struct_fields__)] == (
        StoredRecord.__struct_fields__
    )
    # StoredColumns carries every field (keys/parents/namespaces by their plurals).
    col_names = set(pb.StoredColumns.DESCRIPTOR.fields_by_name)
    plural = {"namespace": "namespaces", "key": "keys", "parent": "parents"}
    for f in FIELDS:
        assert plural.get(f, f) in col_names, f


@given(records)
def test_proto_round_trip(r: StoredRecord) -> None:
    assert fields_of(from_proto(to_proto(r))) == fields_of(r)
    assert from_proto(pb.StoredObject.FromString(to_proto(r).SerializeToString())) == r


@given(st.lists(records, min_size=1, max_size=20))
def test_columns_round_trip_in_block_order(recs: list[StoredRecord]) -> None:
    cols = columns.decode(columns.encode(recs))
    want = sorted(recs, key=lambda r: r.pos)  # stable, as decode orders them
    got = list(zip(*cols.fields(), strict=True))
    assert got == [fields_of(r) for r in want]
    assert [fields_of(p) for p in parked_from(cols)] == [fields_of(r) for r in want]


@given(records)
def test_manifest_frame_round_trip(r: StoredRecord) -> None:
    frame = manifest.frame(manifest._Entry(manifest.KIND_ADD, r))
    entries, size, bad = manifest.replay(frame)
    assert size == len(frame)
    assert bad == 0 and len(entries) == 1
    assert entries[0].rec == r


def test_manifest_frames_of_older_servers_still_decode() -> None:
    # An older log's record: no layer_bytes, an xxh3 digest in the slot after seq.
    raw = msgspec.msgpack.encode(
        [manifest.KIND_ADD, [b"n" * 16, b"k" * 16, b"", 0, 0, 0, 4096, 64, b"s" * 8, 3, 99]]
    )
    import struct
    import zlib

    frame = struct.pack("<II", len(raw), zlib.crc32(raw)) + raw
    (entry,), _, bad = manifest.replay(frame)
    assert bad == 0 and entry.rec is not None
    assert entry.rec.seq == 3 and entry.rec.layer_bytes == ()


def test_writer_info_becomes_the_record_of_its_grant() -> None:
    info = wire.ObjectInfo(b"n" * 16, b"k" * 16, b"p" * 16, 5, 1, b"s" * 16, [3, 5])
    rec = from_info(info, tier=0, offset=8192, length=8)
    for f in WRITER_FIELDS:
        want = getattr(info, f)
        assert getattr(rec, f) == (tuple(want) if isinstance(want, list) else want), f
    assert (rec.tier, rec.offset, rec.length, rec.seq) == (0, 8192, 8, 0)


@given(records, st.booleans())
def test_nvme_header_round_trip(r: StoredRecord, uneven: bool) -> None:
    # On NVMe: tier 1, the address is where the header lies (not in it), and
    # layer lengths, when given, are one per checksum adding up to the length.
    lb = (r.length, 1, 2, 3) if uneven else ()
    r = StoredRecord(
        **{
            **{f: getattr(r, f) for f in FIELDS},
            **{"tier": 1, "offset": 0, "length": sum(lb) or r.length, "layer_bytes": lb},
        }
    )
    got = nvme.unpack_record(memoryview(nvme.pack_record(r, 7, 42)), 7)
    assert got is not None
    assert fields_of(got[0]) == fields_of(r) and got[1:] == (nvme.LIVE, 42)
