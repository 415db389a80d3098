"""Frame header, bodies, encode/decode (gcache.wire). Headers for the error cases
are packed here by hand with ``struct`` from the documented layout."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import wire
from gcache.errors import ProtocolError

# magic, version, type, flags, reserved, req_id, body_len, payload_len; network order
HDR = struct.Struct("!HBBHHIIQ")
GC = 0x4743

GRANT = wire.Grant(offset=4096, length=8192, expiry_ms=1_700_000_000_000, tag=b"\x01" * 8)
ADDR = wire.ServerAddr("srv-1", "10.0.0.1", 7800, "node1", "/dev/shm/gcache-srv-1.seg")

# (message, its documented type number)
SAMPLES: list[tuple[wire.Msg, int]] = [
    (wire.Error(code=5, message="range [0, +4) is not inside its grant"), 1),
    (wire.Ok(), 2),
    (wire.Ok(value=2**63 - 1), 2),
    (wire.Ping(), 3),
    (wire.Write(grant=GRANT), 10),
    (wire.Read(grants=[GRANT, GRANT], ranges=[(0, 4096, 10), (1, 5000, 100)]), 11),
    (wire.Read(grants=[], ranges=[]), 11),
    (wire.ReadData(total=110), 12),
    (wire.Seal(grants=[GRANT]), 13),
    (wire.Sealed(receipts=[2**64 - 1, 0]), 14),
    (wire.Hello(token="t0ken"), 27),
    (wire.Route(keys=[b"k" * 16], tokens=64, request_id="r1"), 40),
    (wire.Routed("i0", "http://127.0.0.1:1", 1, 2, 0.5, "affinity"), 41),
    (wire.ReportHits("i0", 128, 64, 64), 42),
    (wire.ReportLoad("i0", 1, 2, 300, 4, "http://127.0.0.1:1"), 43),
    # Server counters and the staging area.
    (wire.ServerStats(), 15),
    (wire.ServerStatsReply({"staging_ranges": 0.0, "nvme_read_pieces": 12.0}), 16),
    (wire.ReadStaged([GRANT], [(0, 0, 4096)], [7]), 17),
    (wire.Staged(3, "/dev/shm/gcache-x-1.seg.stage", [0, 8192], 2**40), 18),
    (wire.Unstage([1, 2]), 19),
    (wire.PutBegin(namespace=b"n" * 16, keys=[b"k" * 16, b"j" * 16], groups=[1, 3]), 20),
    (
        wire.PutPlaced(
            put_id=7,
            placements=[wire.Placement(block=0, group=1, server=0, grant=GRANT)],
            servers=[ADDR],
            no_space=2,
        ),
        21,
    ),
    (wire.PutCommit(put_id=7, done=[(0, b"\xaa" * 16), (3, b"")]), 22),
    (wire.PutCommit(put_id=2**64 - 1, done=[(0, b"\xaa" * 16)], receipts=[2**64 - 1]), 22),
    (wire.PutAbort(put_id=7), 23),
    (wire.Lookup(namespace=b"n" * 16, keys=[b"k" * 16], lease=True), 24),
    (wire.Lookup(namespace=b"n" * 16, keys=[]), 24),
    (
        wire.LookupResult(
            blocks=2,
            tokens=128,
            lease_id=99,
            objects=[wire.ObjectLoc(block=1, group=0, server=0, grant=GRANT, sums=b"s" * 8)],
            servers=[ADDR],
        ),
        25,
    ),
    (wire.LookupResult(blocks=0, tokens=0), 25),
    (wire.Release(lease_id=99), 26),
]


def _lists(x: object) -> object:
    if isinstance(x, list | tuple):
        return [_lists(v) for v in x]
    return x


def test_header_layout_constants() -> None:
    assert wire.HEADER_SIZE == HDR.size == 24
    assert wire.MAX_BODY == 32 * 2**20
    assert wire.MAX_PAYLOAD == 4 * 2**30
    assert set(wire.BODY_TYPES) == {t for _, t in SAMPLES}
    assert frozenset({10, 12}) == wire.PAYLOAD_TYPES


@pytest.mark.parametrize(("msg", "mtype"), SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip_pack_frame(msg: wire.Msg, mtype: int) -> None:
    payload_len = 12345 if mtype in (10, 12) else 0
    frame = wire.pack_frame(msg, req_id=0xDEADBEEF, payload_len=payload_len)
    magic, ver, t, flags, res, req_id, body_len, plen = HDR.unpack_from(frame)
    assert (magic, ver, t, flags, res) == (GC, 1, mtype, 0, 0)
    assert frame[:2] == b"GC"
    assert (req_id, body_len, plen) == (0xDEADBEEF, len(frame) - 24, payload_len)
    head = wire.parse_header(frame[:24])
    assert head == wire.FrameHead(mtype, 0, 0xDEADBEEF, len(frame) - 24, payload_len)
    body = wire.decode_body(head.msg_type, frame[24 : 24 + head.body_len])
    assert type(body) is type(msg)
    assert body == msg
    # the body is plain MessagePack, array-encoded
    raw = msgspec.msgpack.decode(frame[24:])
    assert isinstance(raw, list)
    assert raw == _lists(msgspec.to_builtins(msg, builtin_types=(bytes,)))


@pytest.mark.parametrize(("msg", "mtype"), SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip_encoder_views(msg: wire.Msg, mtype: int) -> None:
    enc = wire.FrameEncoder(initial=8)  # smaller than any frame: must grow
    view = enc.encode(msg, req_id=3)
    frame = bytes(view)
    view.release()
    head = wire.parse_header(memoryview(frame)[:24])
    assert head.msg_type == mtype and head.req_id == 3 and head.payload_len == 0
    assert wire.decode_body(mtype, memoryview(frame)[24:]) == msg
    assert wire.decode_body(mtype, bytearray(frame[24:])) == msg
    assert frame == wire.pack_frame(msg, req_id=3)


def test_reused_encoder_identical_frames() -> None:
    enc = wire.FrameEncoder(initial=64)
    first = [wire.pack_frame(m, req_id=i) for i, (m, _) in enumerate(SAMPLES)]
    for _ in range(3):  # frames of different sizes, back and forth, same buffer
        for i, (m, _) in enumerate(SAMPLES):
            with enc.encode(m, req_id=i) as view:
                assert bytes(view) == first[i]
            assert enc.encode_bytes(m, req_id=i) == first[i]
    # a big frame then a small one: no stale tail bytes from the big one
    big = wire.PutBegin(namespace=b"n" * 16, keys=[b"k" * 16] * 5000, groups=[1] * 5000)
    big_frame = enc.encode_bytes(big)
    assert len(big_frame) > 80_000
    assert wire.decode_body(20, big_frame[24:]) == big
    assert enc.encode_bytes(wire.Ping(), req_id=1) == wire.pack_frame(wire.Ping(), req_id=1)


def test_encode_while_previous_view_alive_is_refused() -> None:
    # Documented contract: release the previous view before encoding again.
    enc = wire.FrameEncoder()
    old = enc.encode(wire.Ping())
    with pytest.raises(BufferError):
        enc.encode(wire.Lookup(namespace=b"n" * 16, keys=[b"k" * 16] * 3))
    old.release()
    new = enc.encode(wire.Lookup(namespace=b"n" * 16, keys=[b"k" * 16] * 3))
    assert wire.decode_body(24, new[24:]).keys == [b"k" * 16] * 3


# ---- header errors ------------------------------------------------------------------


def _hdr(
    magic: int = GC,
    version: int = 1,
    mtype: int = 3,
    flags: int = 0,
    req_id: int = 1,
    body_len: int = 0,
    payload_len: int = 0,
) -> bytes:
    return HDR.pack(magic, version, mtype, flags, 0, req_id, body_len, payload_len)


def test_hand_packed_header_accepted() -> None:
    head = wire.parse_header(_hdr(mtype=10, flags=7, req_id=9, body_len=30, payload_len=4096))
    assert head == wire.FrameHead(10, 7, 9, 30, 4096)
    # a longer buffer is fine: only the first 24 bytes are the header
    assert wire.parse_header(_hdr() + b"junk").msg_type == 3


@pytest.mark.parametrize(
    "raw",
    [
        _hdr(magic=0x4347),  # "CG"
        _hdr(magic=0),
        _hdr(version=0),
        _hdr(version=2),
        _hdr(mtype=0),
        _hdr(mtype=4),
        _hdr(mtype=99),
        _hdr(mtype=255),
        _hdr(body_len=wire.MAX_BODY + 1),
        _hdr(body_len=2**32 - 1),
        _hdr(mtype=3, payload_len=1),  # PING cannot carry a payload
        _hdr(mtype=11, payload_len=8),  # READ request cannot either
        _hdr(mtype=24, payload_len=8),
        _hdr(mtype=1, payload_len=2**40),
        _hdr(mtype=10, payload_len=wire.MAX_PAYLOAD + 1),
        _hdr(mtype=12, payload_len=2**64 - 1),
        b"",
        b"GC",
        _hdr()[:23],
    ],
)
def test_bad_header_raises_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.parse_header(raw)


def test_limits_are_inclusive() -> None:
    assert wire.parse_header(_hdr(body_len=wire.MAX_BODY)).body_len == wire.MAX_BODY
    head = wire.parse_header(_hdr(mtype=10, payload_len=wire.MAX_PAYLOAD))
    assert head.payload_len == wire.MAX_PAYLOAD


# ---- body errors ------------------------------------------------------------------


def _body(msg: wire.Msg) -> bytes:
    return wire.pack_frame(msg)[24:]


@pytest.mark.parametrize(
    ("mtype", "body"),
    [
        (3, b""),  # empty body: not even an array
        (10, b"\xc1"),  # never-used msgpack byte
        (10, b"\x91"),  # truncated array
        (24, b"\xff\xff\xff"),
        (10, _body(wire.Lookup(namespace=b"n" * 16, keys=[b"k" * 16]))),  # wrong shape
        (11, _body(wire.Write(grant=GRANT))),
        (24, _body(wire.PutAbort(put_id=1))),  # too few fields
        (1, _body(wire.Ok(value=3))),
        (25, _body(wire.Error(code=1, message="x"))),
        (2, msgspec.msgpack.encode(["not an int"])),
        (10, msgspec.msgpack.encode([[1, 2, 3, "tag-not-bytes"]])),
        (11, msgspec.msgpack.encode([[], [[0, 1]]])),  # range tuple of 2
        (2, msgspec.msgpack.encode({"value": 1})),  # map, bodies are arrays
        (4, _body(wire.Ping())),  # unknown type
        (0, b"\x90"),
        (-1, b"\x90"),
    ],
)
def test_bad_body_raises_protocol_error(mtype: int, body: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode_body(mtype, body)


def test_trailing_bytes_after_body_rejected() -> None:
    with pytest.raises(ProtocolError):
        wire.decode_body(2, _body(wire.Ok(1)) + b"\x00")


def test_deeply_nested_body_is_protocol_error() -> None:
    body = b"\x92\x00" + b"\x91" * 2000 + b"\xc0"  # [0, [[[...nil...]]]]
    with pytest.raises(ProtocolError):
        wire.decode_body(wire.T_OK, body)


# ---- fuzz: only ProtocolError ever escapes --------------------------------------------


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=40))
def test_fuzz_parse_header_arbitrary_bytes(raw: bytes) -> None:
    try:
        head = wire.parse_header(raw)
    except ProtocolError:
        return
    assert len(raw) >= 24 and raw[:3] == b"GC\x01"
    assert head.msg_type in wire.BODY_TYPES


@settings(max_examples=300, deadline=None)
@given(
    version=st.integers(0, 255),
    mtype=st.integers(0, 255),
    flags=st.integers(0, 2**16 - 1),
    req_id=st.integers(0, 2**32 - 1),
    body_len=st.integers(0, 2**32 - 1),
    payload_len=st.integers(0, 2**64 - 1),
)
def test_fuzz_parse_header_fields(
    version: int, mtype: int, flags: int, req_id: int, body_len: int, payload_len: int
) -> None:
    raw = HDR.pack(GC, version, mtype, flags, 0, req_id, body_len, payload_len)
    valid = (
        version == 1
        and mtype in wire.BODY_TYPES
        and body_len <= wire.MAX_BODY
        and (payload_len == 0 or mtype in (10, 12))
        and payload_len <= wire.MAX_PAYLOAD
    )
    try:
        head = wire.parse_header(raw)
    except ProtocolError:
        assert not valid
        return
    assert valid
    assert head == wire.FrameHead(mtype, flags, req_id, body_len, payload_len)


MSGTYPES = st.one_of(st.sampled_from(sorted(wire.BODY_TYPES)), st.integers(-5, 300))


@settings(max_examples=300, deadline=None)
@given(mtype=MSGTYPES, body=st.binary(max_size=64))
def test_fuzz_decode_body_arbitrary_bytes(mtype: int, body: bytes) -> None:
    try:
        wire.decode_body(mtype, body)
    except ProtocolError:
        pass


# shallow msgpack values: well-formed bodies of the wrong shape
MSGPACK_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.binary(max_size=16),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(mtype=MSGTYPES, value=MSGPACK_VALUES)
def test_fuzz_decode_body_wellformed_msgpack(mtype: int, value: object) -> None:
    body = msgspec.msgpack.encode(value)
    try:
        msg = wire.decode_body(mtype, body)
    except ProtocolError:
        return
    assert type(msg) is wire.BODY_TYPES[mtype]
