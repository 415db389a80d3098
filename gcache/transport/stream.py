"""The thin I/O layer under :mod:`gcache.wire`: frames over a non-blocking socket.

Payload bytes go straight between the socket and caller-owned memory
(``sock_recv_into`` into memoryviews of the segment or of the caller's arrays,
``sendmsg`` with lists of views); only headers and bodies pass through reused
buffers. OS errors are translated to :class:`ConnectionLost` (the peer broke it) or
:class:`ClosedError` (we closed it). The byte bookkeeping (frame parsing, the
receive buffer, send batches, scatter lists) is I/O-free, in
:mod:`gcache.transport.framing`; this module only drives it with syscalls.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gcache import wire
from gcache.errors import ClosedError, ConnectionLost, ProtocolError, SendTimeout
from gcache.transport.framing import (
    IOV_BATCH,
    READ_AHEAD,
    Buffer,
    FrameParser,
    Scatter,
    as_bytes_views,
    send_some,
)

__all__ = ["IOV_BATCH", "SOCKET_BUFFER", "BodyCheck", "Buffer", "FrameStream"]

_DRAIN_CHUNK = 1 << 20
SOCKET_BUFFER = 4 << 20

# Called with a frame's header and raw body before it is decoded (raise to refuse).
BodyCheck = Callable[[wire.FrameHead, memoryview], None]


def _recvmsg_into(sock: socket.socket) -> Callable[[list[memoryview]], int]:
    return lambda views: sock.recvmsg_into(views)[0]


class FrameStream:
    """One framed connection. Not safe for concurrent senders or receivers; the
    owner serializes each direction (a send lock, a single reader task).

    Receiving reads ahead into a small buffer, so a header and a small body usually
    arrive in one ``recv``; payload bytes beyond what the read-ahead caught go
    straight into the caller's views. The socket stays registered with the event
    loop while someone waits on it, and is dropped from it the first time it turns
    readable with nobody waiting: a request/reply loop costs no ``epoll_ctl`` per
    message (``loop.sock_recv_into`` costs two, and under uvloop one loop pass more).
    """

    __slots__ = (
        "_closed",
        "_encoder",
        "_loop",
        "_out",
        "_out_bytes",
        "_parser",
        "_reading",
        "_waiter",
        "_wwaiter",
        "peer",
        "send_timeout",
        "sock",
    )

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop | None = None,
        max_body: int = wire.MAX_BODY,
        read_ahead: int = READ_AHEAD,
        send_timeout: float | None = None,
    ) -> None:
        """``send_timeout``: seconds a send may wait for the peer to take any byte
        (the socket buffer stays full) before it fails with :class:`SendTimeout`;
        the clock restarts whenever bytes go out. ``None``: wait forever."""
        if send_timeout is not None and not send_timeout > 0:
            raise ValueError("send_timeout must be positive")
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Large buffers: a MiB-sized payload moves in a few big copies instead of
            # dozens of wakeups (the kernel caps these at net.core.*mem_max).
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
                except OSError:
                    pass
        self.sock = sock
        self._loop = loop or asyncio.get_running_loop()
        self._parser = FrameParser(max_body, read_ahead)
        self._reading = False
        self._waiter: asyncio.Future[None] | None = None
        self._wwaiter: asyncio.Future[None] | None = None
        self._encoder = wire.FrameEncoder()
        # Frames queued by queue_msg, sent ahead of the next send (one sendmsg for
        # all of them); after a partial try_flush, the views still to send.
        self._out: list[Buffer] = []
        self._out_bytes = 0
        self._closed = False
        self.send_timeout = send_timeout
        try:
            self.peer: Any = sock.getpeername()
        except OSError:
            self.peer = None

    @classmethod
    async def connect(cls, host: str, port: int, timeout: float = 5.0) -> FrameStream:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise ConnectionLost(f"cannot connect to {host}:{port}: {exc}") from exc
        return cls(sock, loop)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._parser.buffer)

    @property
    def frame_ready(self) -> bool:
        """A whole frame without payload (header and body) is already buffered: the
        next ``recv_frame`` needs no syscall (a daemon answers it before flushing)."""
        return self._parser.frame_ready()

    @property
    def queued(self) -> int:
        """Bytes of queued frames not sent yet (see :meth:`queue_msg`)."""
        return self._out_bytes

    @property
    def buffer_capacity(self) -> int:
        """Bytes the receive buffer holds allocated right now."""
        return self._parser.buffer.capacity

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop_reading()
            for w in (self._waiter, self._wwaiter):
                if w is not None and not w.done():
                    w.set_exception(ClosedError("stream closed"))
            self.sock.close()

    # ---- readiness -------------------------------------------------------------------

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            try:
                self._loop.remove_reader(self.sock.fileno())
            except (OSError, ValueError, RuntimeError):
                pass  # the loop is closing or the fd is already gone

    def _on_readable(self) -> None:
        w = self._waiter
        if w is None:
            self._stop_reading()  # level-triggered: do not spin while nobody reads
        elif not w.done():
            w.set_result(None)

    async def _wait_readable(self) -> None:
        if self._closed:
            raise ClosedError("stream closed")
        fut = self._loop.create_future()
        self._waiter = fut
        if not self._reading:
            self._loop.add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True
        try:
            await fut
        finally:
            self._waiter = None

    async def _wait_writable(self, registered: list[int]) -> None:
        """Slow path of sending: the socket buffer is full. With a send timeout,
        fails with :class:`SendTimeout` when the peer takes nothing for that long.
        The socket stays registered for writing across the waits of one send
        (``registered`` holds its fd; the sender unregisters it when done): a
        16 MiB reply through an 8 MiB buffer costs one ``epoll_ctl`` pair, not one
        per wait."""
        if self._closed:
            raise ClosedError("stream closed")
        fut = self._loop.create_future()
        self._wwaiter = fut
        timeout = self.send_timeout

        def expired() -> None:
            if not fut.done():
                fut.set_exception(
                    SendTimeout(f"peer {self.peer} took no reply bytes for {timeout:g} s")
                )

        timer = None if timeout is None else self._loop.call_later(timeout, expired)
        if not registered:
            fd = self.sock.fileno()
            self._loop.add_writer(fd, self._on_writable)
            registered.append(fd)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._wwaiter = None

    def _on_writable(self) -> None:
        w = self._wwaiter
        if w is not None and not w.done():
            w.set_result(None)

    def _unregister_writer(self, registered: list[int]) -> None:
        if registered:
            try:
                self._loop.remove_writer(registered[0])
            except (OSError, ValueError, RuntimeError):
                pass

    # ---- receiving ---------------------------------------------------------------

    async def _recv(self, recv: Callable[[Any], int], into: Any) -> int:
        """One receive syscall, waiting while the socket has nothing; 0 means EOF."""
        while True:
            try:
                return recv(into)
            except (BlockingIOError, InterruptedError):
                await self._wait_readable()
            except OSError as exc:
                raise self._recv_error(exc) from exc

    async def _recv_more(self) -> bool:
        """One receive into the parser's buffer (it grows only with what arrives).
        False on EOF."""
        if self._closed:
            raise ClosedError("stream closed")
        parser = self._parser
        n = await self._recv(self.sock.recv_into, parser.space())
        if n == 0:
            return False
        parser.commit(n)
        return True

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely from the socket."""
        if self._closed:
            raise ClosedError("stream closed")
        view = view.cast("B") if view.format != "B" else view
        view = view[self._parser.buffer.drain_into(view) :]
        sock = self.sock
        while view:
            n = await self._recv(sock.recv_into, view)
            if n == 0:
                raise ConnectionLost("peer closed the connection")
            view = view[n:]

    async def recv_into_many(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order with as few syscalls as the socket allows
        (``recvmsg_into`` scatters one read across up to ``IOV_BATCH`` views)."""
        if self._closed:
            raise ClosedError("stream closed")
        scatter = Scatter(views)
        scatter.fill_from(self._parser.buffer)
        recv = _recvmsg_into(self.sock)
        while not scatter.done:
            n = await self._recv(recv, scatter.batch())
            if n == 0:
                raise ConnectionLost("peer closed the connection")
            scatter.advance(n)

    async def recv_head(self) -> wire.FrameHead | None:
        """Next frame header, or ``None`` on a clean EOF between frames. A body
        longer than this stream's ``max_body`` is a :class:`ProtocolError` here,
        before any byte of it is buffered."""
        parser = self._parser
        head = parser.next_head()
        while head is None:
            if not await self._recv_more():
                if not self.buffered:
                    return None
                raise ProtocolError(
                    f"truncated header ({self.buffered} bytes): peer closed the connection"
                )
            head = parser.next_head()
        return head

    async def recv_body(self, head: wire.FrameHead, check: BodyCheck | None = None) -> Any:
        """Receive and decode the body of ``head``; ``check`` sees the raw bytes
        first (a whole frame was read, so a refusal there leaves the stream in step)."""
        parser = self._parser
        body = parser.next_body(head)
        while body is None:
            if not await self._recv_more():
                raise ConnectionLost("peer closed the connection before the body")
            body = parser.next_body(head)
        with body:
            if check is not None:
                check(head, body)
            return wire.decode_body(head.msg_type, body)

    async def recv_frame(self) -> tuple[wire.FrameHead, Any] | None:
        head = await self.recv_head()
        if head is None:
            return None
        return head, await self.recv_body(head)

    async def discard(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (a refused payload) to keep the stream in sync."""
        scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK) or 1))
        while nbytes > 0:
            step = min(nbytes, len(scratch))
            await self.recv_into(scratch[:step])
            nbytes -= step

    # ---- sending -------------------------------------------------------------------

    async def send_msg(
        self, msg: wire.Msg, req_id: int = 0, payload: Sequence[Buffer] = (), payload_len: int = -1
    ) -> None:
        """Send one frame; ``payload`` views are written after the body, uncopied."""
        if payload_len < 0:
            payload_len = sum(len(p) for p in payload)
        head = self._encoder.encode(msg, req_id, payload_len)
        try:
            await self.send_views([*self._take_out(), head, *payload])
        finally:
            head.release()

    def queue_msg(self, msg: wire.Msg, req_id: int = 0) -> None:
        """Queue one frame without payload (an owned copy of its header and body,
        tens of bytes): it goes out with the next :meth:`flush`, :meth:`try_flush`
        or ``send_*`` call, ahead of that call's own frame, in one ``sendmsg``.
        The caller bounds what it queues (:attr:`queued`)."""
        if self._closed:
            raise ClosedError("stream closed")
        frame = self._encoder.encode_bytes(msg, req_id)
        self._out.append(frame)
        self._out_bytes += len(frame)

    def _take_out(self) -> list[Buffer]:
        out = self._out
        if out:
            self._out = []
            self._out_bytes = 0
        return out

    def try_flush(self) -> bool:
        """Send the queued frames without waiting; True when all went out. What the
        socket did not take stays queued, first in line (a frame is never cut
        short by a later one). Raises like :meth:`send_views`."""
        if not self._out:
            return True
        if self._closed:
            raise ClosedError("stream closed")
        views = self._take_out()
        try:
            rest = send_some(self.sock.sendmsg, as_bytes_views(views))
        except OSError as exc:
            raise self._send_error(exc) from exc
        if rest:
            self._out = list(rest)
            self._out_bytes = sum(v.nbytes for v in rest)
            return False
        return True

    async def flush(self) -> None:
        """Send every queued frame (waiting for room as :meth:`send_views` does)."""
        if self._out:
            await self.send_views(self._take_out())

    async def send_msg_batches(
        self,
        msg: wire.Msg,
        req_id: int,
        batches: Iterable[Sequence[Buffer]],
        payload_len: int,
    ) -> None:
        """Send one frame of ``payload_len`` payload bytes whose views come in
        batches, each taken from ``batches`` only once the previous one went out:
        a reply waiting on a slow reader holds one batch of views, not all of them.
        The header goes out with the first batch."""
        it = iter(batches)
        head = self._encoder.encode(msg, req_id, payload_len)
        try:
            await self.send_views([*self._take_out(), head, *next(it, ())])
        finally:
            head.release()
        for batch in it:
            await self.send_views(batch)

    async def send_views(self, views: Sequence[Buffer]) -> None:
        """Send every view, ``IOV_BATCH`` per ``sendmsg``; when the socket is full,
        wait for room and resume where it stopped, still without copying."""
        if self._closed:
            raise ClosedError("stream closed")
        sendmsg = self.sock.sendmsg
        registered: list[int] = []  # the fd, once registered for writing
        try:
            rest = send_some(sendmsg, as_bytes_views(views))
            while rest:
                await self._wait_writable(registered)
                rest = send_some(sendmsg, rest)
        except OSError as exc:
            raise self._send_error(exc) from exc
        finally:
            self._unregister_writer(registered)

    def _recv_error(self, exc: OSError) -> Exception:
        if self._closed:
            return ClosedError("stream closed")
        return ConnectionLost(f"receive failed: {exc}")

    def _send_error(self, exc: OSError) -> Exception:
        if self._closed:
            return ClosedError("stream closed")
        return ConnectionLost(f"send failed: {exc}")
