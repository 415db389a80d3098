"""Coalesced frames, without daemons: the parser tells a
whole buffered frame from a partial one, queued frames go out ahead of the next
send in one ``sendmsg`` and in order (also after a partial send), and lease ids
come from a batched CSPRNG draw; the meta's key-count check keeps refusing every
over-long key list on its fast path."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgspec
import pytest

from gcache import wire
from gcache.errors import InvalidBody
from gcache.meta.hotpath import key_count_check
from gcache.meta.ids import IdSource
from gcache.transport.framing import FrameParser
from gcache.transport.stream import FrameStream


def test_frame_ready_only_for_a_whole_frame_without_payload() -> None:
    p = FrameParser()
    ping = wire.pack_frame(wire.Ping(), 7)
    assert not p.frame_ready()
    p.feed(ping[:10])
    assert not p.frame_ready()  # part of a header
    p.feed(ping[10:])
    assert p.frame_ready()
    head = p.next_head()
    assert head is not None and p.next_body(head) is not None
    assert not p.frame_ready()
    ok = wire.pack_frame(wire.Ok(123456), 8)
    p.feed(ok[:-1])
    assert not p.frame_ready()  # the body is not all here
    p.feed(ok[-1:])
    assert p.frame_ready()
    p2 = FrameParser()
    p2.feed(wire.pack_frame(wire.Write(wire.Grant(0, 4, 0, b"t" * 8)), 9, payload_len=4))
    assert not p2.frame_ready()  # a payload follows: not a frame the meta answers alone


def _frames(data: bytes) -> list[tuple[int, int, int]]:
    p = FrameParser()
    p.feed(data)
    out = []
    while (head := p.next_head()) is not None:
        body = p.next_body(head)
        assert body is not None
        out.append((head.msg_type, head.req_id, head.payload_len))
        if head.payload_len:
            with p.buffer.take(head.payload_len):
                pass
    return out


def test_queued_frames_go_out_first_in_one_send_and_in_order() -> None:
    async def run() -> tuple[bytes, int]:
        a, b = socket.socketpair()
        stream = FrameStream(a)
        try:
            for i in range(1, 4):
                stream.queue_msg(wire.Ping(), i)
            assert stream.queued == 3 * len(wire.pack_frame(wire.Ping(), 1))
            write = wire.Write(wire.Grant(0, 3, 0, b"t" * 8))
            await stream.send_msg(write, 4, [b"xyz"])  # queued ones first
            assert stream.queued == 0
            stream.queue_msg(wire.Ping(), 5)
            assert stream.try_flush() and stream.queued == 0
            await stream.flush()  # nothing left: no send
            b.setblocking(False)
            data = b.recv(1 << 16)
            return data, len(data)
        finally:
            stream.close()
            b.close()

    data, _ = asyncio.run(run())
    assert _frames(data) == [
        (wire.T_PING, 1, 0),
        (wire.T_PING, 2, 0),
        (wire.T_PING, 3, 0),
        (wire.T_WRITE, 4, 3),
        (wire.T_PING, 5, 0),
    ]


def test_a_partial_flush_keeps_the_rest_first_in_line() -> None:
    async def run() -> bytes:
        a, b = socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stream = FrameStream(a)
        # FrameStream asks for large buffers on TCP only; a socketpair keeps these.
        got = bytearray()
        try:
            n = 0
            while stream.try_flush():  # fill the socket until a flush is partial
                n += 1
                stream.queue_msg(wire.Error(1, "x" * 1000), n)
                assert n < 10000
            left = stream.queued
            assert left > 0
            stream.queue_msg(wire.Ping(), n + 1)  # behind what is left
            assert stream.queued > left
            b.setblocking(False)

            async def drain() -> None:
                loop = asyncio.get_running_loop()
                while True:
                    chunk = await loop.sock_recv(b, 1 << 16)
                    if not chunk:
                        return
                    got.extend(chunk)

            reader = asyncio.create_task(drain())
            await stream.flush()
            assert stream.queued == 0
            stream.close()
            await asyncio.wait_for(reader, 5.0)
            return bytes(got)
        finally:
            stream.close()
            b.close()

    frames = _frames(asyncio.run(run()))
    ids = [rid for _, rid, _ in frames]
    assert ids == list(range(1, len(ids) + 1)) and frames[-1][0] == wire.T_PING


def test_lease_ids_are_random_nonzero_and_skip_taken_ones() -> None:
    src = IdSource()
    seen = {src.next(()) for _ in range(2000)}  # four draws of the kernel's CSPRNG
    assert len(seen) == 2000 and 0 not in seen and max(seen) >= 1 << 60
    taken = set(seen)
    assert src.next(taken) not in taken


def test_key_count_fast_path_still_refuses_every_over_long_list() -> None:
    """The meta's key-count check reads a short key list off one byte of the shape
    clients send; lists over the bound, forged headers and other shapes still go
    through the generic peek and are refused."""
    ns, key = b"\x01" * 16, b"\x02" * 16

    def run(max_keys: int, msg: wire.Msg, body: bytes | None = None) -> None:
        raw = msgspec.msgpack.encode(msg) if body is None else body
        head = wire.parse_header(wire.pack_frame(msg)[: wire.HEADER_SIZE])
        key_count_check(max_keys)(head, memoryview(raw))

    run(4, wire.Lookup(ns, [key] * 4, True))
    run(4, wire.PutBegin(ns, [key] * 4, [1] * 4))
    body = msgspec.msgpack.encode(wire.Lookup(ns, [key]))
    assert body[19] == 0x91  # the key list where the fast path looks for it
    for max_keys, n in ((4, 5), (14, 15), (15, 16), (64, 65)):
        with pytest.raises(InvalidBody, match="max_keys_per_request"):
            run(max_keys, wire.Lookup(ns, [key] * n, True))
    forged = b"\x94\xc4\x10" + ns + b"\xdd\xff\xff\xff\xff" + b"\xc4\x10" + key
    with pytest.raises(InvalidBody, match="max_keys_per_request"):
        run(64, wire.Lookup(ns, [key]), forged)


class _CountingWaits(FrameStream):
    waits = 0

    async def _wait_writable(self, registered: list[int]) -> None:
        self.waits += 1
        await super()._wait_writable(registered)


def test_a_large_send_registers_for_writing_once_however_often_it_waits() -> None:
    """A send larger than the socket buffers waits for room many times; the socket
    stays registered across those waits (one add_writer / remove_writer pair per
    send, not one per wait) and is unregistered when the send is done."""
    big = 8 << 20

    async def main() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        calls = {"add": 0, "remove": 0}
        add, remove = loop.add_writer, loop.remove_writer

        def counting_add(fd: Any, cb: Any, *args: Any) -> None:
            calls["add"] += 1
            add(fd, cb, *args)

        def counting_remove(fd: Any) -> bool:
            calls["remove"] += 1
            return remove(fd)

        loop.add_writer = counting_add  # type: ignore[method-assign,assignment]
        loop.remove_writer = counting_remove  # type: ignore[method-assign]
        a, b = socket.socketpair()
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        b.setblocking(False)
        stream = _CountingWaits(a)
        got = 0

        async def drain() -> None:
            nonlocal got
            while got < big:
                chunk = await loop.sock_recv(b, 256 << 10)
                got += len(chunk)

        reader = asyncio.create_task(drain())
        try:
            await stream.send_views([memoryview(bytearray(big))])
            await asyncio.wait_for(reader, 10.0)
        finally:
            stream.close()
            b.close()
        return stream.waits, calls["add"], calls["remove"]

    waits, adds, removes = asyncio.run(main())
    assert waits > 2, waits  # the send did wait for room several times
    assert (adds, removes) == (1, 1)
