"""The thin I/O layer under :mod:`gcache.wire`: frames over a non-blocking socket.

Payload bytes go straight between the socket and caller-owned memory
(``sock_recv_into`` into memoryviews of the segment or of the caller's arrays,
``sendmsg`` with lists of views); only headers and bodies pass through reused
buffers. OS errors are translated to :class:`ConnectionLost` (the peer broke it) or
:class:`ClosedError` (we closed it).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any

from gcache import wire
from gcache.errors import ClosedError, ConnectionLost, ProtocolError

# Linux IOV_MAX is 1024; keep sendmsg batches well under it.
_IOV_BATCH = 512
_DRAIN_CHUNK = 1 << 20
# Read-ahead: one recv usually holds a header and a small body. Kept small because
# payload bytes it catches are copied once more on their way to the caller's views.
_READ_AHEAD = 16 << 10
SOCKET_BUFFER = 4 << 20

Buffer = memoryview | bytes | bytearray


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
        "_rbuf",
        "_reading",
        "_rend",
        "_rstart",
        "_waiter",
        "peer",
        "sock",
    )

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop | None = None) -> None:
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
        self._rbuf = bytearray(_READ_AHEAD)
        self._rstart = 0
        self._rend = 0
        self._reading = False
        self._waiter: asyncio.Future[None] | None = None
        self._encoder = wire.FrameEncoder()
        self._closed = False
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

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop_reading()
            w = self._waiter
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

    def _buffered(self) -> int:
        return self._rend - self._rstart

    async def _fill(self, need: int) -> bool:
        """Read ahead until ``need`` bytes are buffered. False on EOF before any
        byte of them arrived; ConnectionLost on EOF part-way."""
        if self._closed:
            raise ClosedError("stream closed")
        if len(self._rbuf) - self._rstart < need:
            rest = self._rbuf[self._rstart : self._rend]
            if len(self._rbuf) < need:
                self._rbuf = bytearray(max(need, 2 * len(self._rbuf)))
            self._rbuf[: len(rest)] = rest
            self._rstart, self._rend = 0, len(rest)
        sock, view = self.sock, memoryview(self._rbuf)
        while self._rend - self._rstart < need:
            n = await self._recv(sock.recv_into, view[self._rend :])
            if n == 0:
                if self._rend == self._rstart:
                    return False
                raise ConnectionLost("peer closed the connection mid-frame")
            self._rend += n
        return True

    def _take(self, n: int) -> memoryview:
        """``n`` buffered bytes (valid until the next receive)."""
        v = memoryview(self._rbuf)[self._rstart : self._rstart + n]
        self._rstart += n
        if self._rstart == self._rend:
            self._rstart = self._rend = 0
        return v

    def _drain_into(self, view: memoryview) -> int:
        """Copy what the read-ahead already holds into ``view``; returns bytes copied."""
        n = min(self._buffered(), view.nbytes)
        if n:
            with self._take(n) as src:
                view[:n] = src
        return n

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely from the socket."""
        if self._closed:
            raise ClosedError("stream closed")
        view = view.cast("B") if view.format != "B" else view
        view = view[self._drain_into(view) :]
        sock = self.sock
        while view:
            n = await self._recv(sock.recv_into, view)
            if n == 0:
                raise ConnectionLost("peer closed the connection")
            view = view[n:]

    async def recv_into_many(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order with as few syscalls as the socket allows
        (``recvmsg_into`` scatters one read across up to 512 views)."""
        if self._closed:
            raise ClosedError("stream closed")
        pending = [v.cast("B") if v.format != "B" else v for v in views if v.nbytes]
        i = 0
        while i < len(pending) and self._buffered():
            n = self._drain_into(pending[i])
            if n == pending[i].nbytes:
                i += 1
            else:
                pending[i] = pending[i][n:]
        sock = self.sock
        while i < len(pending):
            n = await self._recv(_recvmsg_into(sock), pending[i : i + _IOV_BATCH])
            if n == 0:
                raise ConnectionLost("peer closed the connection")
            while n:
                size = pending[i].nbytes
                if n >= size:
                    n -= size
                    i += 1
                else:
                    pending[i] = pending[i][n:]
                    n = 0

    async def recv_head(self) -> wire.FrameHead | None:
        """Next frame header, or ``None`` on a clean EOF between frames."""
        try:
            if not await self._fill(wire.HEADER_SIZE):
                return None
        except ConnectionLost as exc:
            raise ProtocolError(f"truncated header ({self._buffered()} bytes): {exc}") from exc
        with self._take(wire.HEADER_SIZE) as head:
            return wire.parse_header(head)

    async def recv_body(self, head: wire.FrameHead) -> Any:
        size = head.body_len
        if not await self._fill(size):
            raise ConnectionLost("peer closed the connection before the body")
        with self._take(size) as body:
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
            await self.send_views([head, *payload])
        finally:
            head.release()

    async def send_views(self, views: Sequence[Buffer]) -> None:
        if self._closed:
            raise ClosedError("stream closed")
        sock = self.sock
        for start in range(0, len(views), _IOV_BATCH):
            batch = [memoryview(v).cast("B") for v in views[start : start + _IOV_BATCH]]
            total = sum(v.nbytes for v in batch)
            try:
                sent = sock.sendmsg(batch)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self._send_error(exc) from exc
            if sent == total:
                continue
            # Slow path: the socket buffer is full. Wait for room and continue
            # from where sendmsg stopped, still without copying the payload.
            for v in batch:
                if sent >= v.nbytes:
                    sent -= v.nbytes
                    continue
                rest = v[sent:]
                sent = 0
                try:
                    await self._loop.sock_sendall(sock, rest)
                except OSError as exc:
                    raise self._send_error(exc) from exc

    def _recv_error(self, exc: OSError) -> Exception:
        if self._closed:
            return ClosedError("stream closed")
        return ConnectionLost(f"receive failed: {exc}")

    def _send_error(self, exc: OSError) -> Exception:
        if self._closed:
            return ClosedError("stream closed")
        return ConnectionLost(f"send failed: {exc}")
