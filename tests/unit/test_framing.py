"""The I/O-free framing layer: partial frames, body limits, buffer growth and
shrink, msgpack peeking, sendmsg batches and partial sends, without sockets."""

from __future__ import annotations

import random

import msgspec
import pytest

from gcache import wire
from gcache.errors import ProtocolError
from gcache.transport.framing import (
    IOV_BATCH,
    READ_AHEAD,
    FrameParser,
    ReceiveBuffer,
    Scatter,
    after_sent,
    peek_array_field,
    send_some,
)


def frames(n: int) -> tuple[bytes, list[wire.Msg]]:
    msgs: list[wire.Msg] = []
    for i in range(n):
        if i % 3 == 0:
            msgs.append(wire.Ping())
        elif i % 3 == 1:
            msgs.append(wire.Lookup(bytes(16), [bytes([i % 256]) * 16] * (i % 7)))
        else:
            msgs.append(wire.Error(i, "x" * (i * 97)))
    return b"".join(wire.pack_frame(m, i) for i, m in enumerate(msgs)), msgs


def parse_all(p: FrameParser, data: bytes, chunks: list[int]) -> list[tuple[int, object]]:
    """Feed ``data`` in the given chunk sizes; collect (req_id, body) events."""
    out: list[tuple[int, object]] = []
    head: wire.FrameHead | None = None
    pos = 0
    for size in [*chunks, len(data)]:
        p.feed(data[pos : pos + size])
        pos += size
        while True:
            if head is None:
                head = p.next_head()
                if head is None:
                    break
            body = p.next_body(head)
            if body is None:
                break
            with body:
                out.append((head.req_id, wire.decode_body(head.msg_type, body)))
            head = None
        if pos >= len(data):
            break
    return out


@pytest.mark.parametrize("seed", range(5))
def test_partial_frames_parse_at_any_split(seed: int) -> None:
    data, msgs = frames(40)
    rng = random.Random(seed)
    chunks = [rng.choice([1, 2, 7, 23, 24, 25, 100, 5000]) for _ in range(len(data))]
    got = parse_all(FrameParser(), data, chunks)
    assert [r for r, _ in got] == list(range(40))
    assert [b for _, b in got] == msgs


def test_one_byte_at_a_time() -> None:
    data, msgs = frames(10)
    got = parse_all(FrameParser(), data, [1] * len(data))
    assert [b for _, b in got] == msgs


def test_body_over_the_daemon_limit_is_refused_at_header_time() -> None:
    p = FrameParser(max_body=4096)
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.T_LOOKUP, 0, 0, 1, 32 << 20, 0)
    p.feed(head)
    with pytest.raises(ProtocolError, match="exceeds"):
        p.next_head()
    # A body at the limit is fine.
    p2 = FrameParser(max_body=4096)
    p2.feed(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.T_PING, 0, 0, 1, 4096, 0))
    assert p2.next_head() is not None


def test_declared_32mib_body_allocates_only_what_arrives() -> None:
    """The old stream sized its buffer from the declared length: a 24-byte header
    made it allocate 32 MiB."""
    p = FrameParser()  # the wire's 32 MiB limit
    p.feed(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.T_PING, 0, 0, 1, 32 << 20, 0))
    head = p.next_head()
    assert head is not None and head.body_len == 32 << 20
    assert p.next_body(head) is None
    space = p.space()
    assert p.buffer.capacity <= READ_AHEAD and space.nbytes <= READ_AHEAD
    space.release()
    # 100 KiB arrive: the buffer stays within twice what was received.
    received = 0
    while received < 100 << 10:
        v = p.space()
        n = min(v.nbytes, (100 << 10) - received)
        v[:n] = b"\x00" * n
        v.release()
        p.commit(n)
        received += n
    assert p.buffer.capacity <= 2 * received
    assert p.next_body(head) is None


def test_buffer_shrinks_back_after_a_large_frame() -> None:
    p = FrameParser()
    big = wire.pack_frame(wire.Error(1, "y" * (3 << 20)), 5)
    p.feed(big + wire.pack_frame(wire.Ping(), 6)[:10])  # a partial next frame behind it
    head = p.next_head()
    assert head is not None
    body = p.next_body(head)
    assert body is not None and p.buffer.capacity >= 3 << 20
    body.release()
    p.feed(wire.pack_frame(wire.Ping(), 6)[10:])
    head = p.next_head()
    assert head is not None
    body = p.next_body(head)
    assert body is not None
    body.release()
    assert len(p.buffer) == 0
    assert p.buffer.capacity == READ_AHEAD and p.buffer.shrunk >= 1


def test_receive_buffer_compacts_and_keeps_bytes_in_order() -> None:
    b = ReceiveBuffer(64)
    rng = random.Random(1)
    stream = bytes(rng.randrange(256) for _ in range(10_000))
    out = bytearray()
    pos = 0
    while pos < len(stream) or len(b):
        if pos < len(stream):
            v = b.space(len(b) + rng.randrange(1, 200))
            n = min(v.nbytes, rng.randrange(1, 150), len(stream) - pos)
            v[:n] = stream[pos : pos + n]
            v.release()
            b.commit(n)
            pos += n
        k = rng.randrange(0, len(b) + 1)
        with b.take(k) as t:
            out += t
    assert bytes(out) == stream
    with pytest.raises(ValueError):
        b.take(1)


def test_peek_keys_count_without_decoding() -> None:
    for n in (0, 3, 15, 16, 70000):
        body = msgspec.msgpack.encode(wire.Lookup(b"\x01" * 16, [b"\x02" * 16] * n, True, [1]))
        assert peek_array_field(memoryview(body), 1) == n
        body = msgspec.msgpack.encode(wire.PutBegin(b"\x01" * 300, [b"\x02" * 16] * n, [1] * n))
        assert peek_array_field(memoryview(body), 1) == n
    # A header claiming 2**32-1 keys in a tiny body is read as such (and refused by
    # the caller) without decoding anything.
    forged = b"\x94\xc4\x10" + b"\x01" * 16 + b"\xdd\xff\xff\xff\xff"
    assert peek_array_field(memoryview(forged), 1) == 0xFFFFFFFF
    for bad in (b"", b"\x01", b"\x91\xc4\x01a", b"\x92\xc4\x05ab", b"\x92\xc1\x90"):
        assert peek_array_field(memoryview(bad), 1) is None


def test_after_sent() -> None:
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defg")]
    assert b"".join(after_sent(views, 0)) == b"abcdefg"
    assert b"".join(after_sent(views, 2)) == b"cdefg"
    assert b"".join(after_sent(views, 3)) == b"defg"
    assert b"".join(after_sent(views, 6)) == b"g"
    assert after_sent(views, 7) == []


class FakeSocket:
    """A sendmsg that takes at most ``cap`` bytes per call and is full every
    ``full_every``-th call; records the largest batch it was handed."""

    def __init__(self, cap: int, full_every: int = 0) -> None:
        self.cap = cap
        self.full_every = full_every
        self.calls = 0
        self.max_batch = 0
        self.data = bytearray()

    def sendmsg(self, views: list[memoryview]) -> int:
        self.calls += 1
        self.max_batch = max(self.max_batch, len(views))
        assert len(views) <= IOV_BATCH
        if self.full_every and self.calls % self.full_every == 0:
            raise BlockingIOError
        room = self.cap
        for v in views:
            n = min(room, v.nbytes)
            self.data += v[:n]
            room -= n
            if not room:
                break
        return self.cap - room


@pytest.mark.parametrize("cap,full_every", [(1 << 30, 0), (1000, 0), (7, 3), (4096, 2)])
def test_send_some_batches_and_resumes_after_partial_sends(cap: int, full_every: int) -> None:
    rng = random.Random(cap)
    chunks = [bytes([i % 251]) * rng.randrange(0, 40) for i in range(1300)]  # > 2 batches
    views = [memoryview(c) for c in chunks]
    sock = FakeSocket(cap, full_every)
    rest = send_some(sock.sendmsg, views)
    rounds = 0
    while rest:  # the stream waits for writability between these
        rest = send_some(sock.sendmsg, rest)
        rounds += 1
        assert rounds < 100_000
    assert bytes(sock.data) == b"".join(chunks)
    assert sock.max_batch == IOV_BATCH
    if cap >= 1 << 20 and not full_every:
        assert sock.calls == 3  # 1300 views: 512 + 512 + 276


def test_scatter_more_than_one_batch_and_from_read_ahead() -> None:
    dst = [bytearray(3) for _ in range(1200)]
    sc = Scatter([memoryview(d) for d in dst] + [memoryview(bytearray(0))])
    src = bytes(i % 256 for i in range(3600))
    buf = ReceiveBuffer(64)
    buf.feed(src[:50])
    sc.fill_from(buf)
    assert len(buf) == 0
    pos, rng = 50, random.Random(3)
    while not sc.done:
        batch = sc.batch()
        assert 0 < len(batch) <= IOV_BATCH
        room = sum(v.nbytes for v in batch)
        n = min(room, rng.randrange(1, 2000))
        data = memoryview(src[pos : pos + n])
        for v in batch:  # what recvmsg_into does
            k = min(v.nbytes, data.nbytes)
            v[:k] = data[:k]
            data = data[k:]
            if not data:
                break
        sc.advance(n)
        pos += n
    assert b"".join(dst) == src
