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
from collections.abc import Sequence
from typing import Any

from gcache import wire
from gcache.errors import ClosedError, ConnectionLost, ProtocolError

# Linux IOV_MAX is 1024; keep sendmsg batches well under it.
_IOV_BATCH = 512
_DRAIN_CHUNK = 1 << 20
SOCKET_BUFFER = 4 << 20

Buffer = memoryview | bytes | bytearray


class FrameStream:
    """One framed connection. Not safe for concurrent senders or receivers; the
    owner serializes each direction (a send lock, a single reader task)."""

    __slots__ = ("_body", "_closed", "_encoder", "_head", "_loop", "peer", "sock")

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
        self._head = bytearray(wire.HEADER_SIZE)
        self._body = bytearray(64 << 10)
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
            self.sock.close()

    # ---- receiving ---------------------------------------------------------------

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely from the socket."""
        if self._closed:
            raise ClosedError("stream closed")
        loop, sock = self._loop, self.sock
        while view:
            try:
                n = await loop.sock_recv_into(sock, view)
            except OSError as exc:
                raise self._recv_error(exc) from exc
            if n == 0:
                raise ConnectionLost("peer closed the connection")
            view = view[n:]

    async def recv_into_many(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order with as few syscalls as the socket allows
        (``recvmsg_into`` scatters one read across up to 512 views)."""
        if self._closed:
            raise ClosedError("stream closed")
        pending = [v.cast("B") if v.format != "B" else v for v in views if v.nbytes]
        sock = self.sock
        i = 0
        while i < len(pending):
            try:
                n = sock.recvmsg_into(pending[i : i + _IOV_BATCH])[0]
            except BlockingIOError:
                await self._readable()
                continue
            except OSError as exc:
                raise self._recv_error(exc) from exc
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

    async def _readable(self) -> None:
        loop = self._loop
        fut: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        fd = self.sock.fileno()
        loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            loop.remove_reader(fd)

    async def recv_head(self) -> wire.FrameHead | None:
        """Next frame header, or ``None`` on a clean EOF between frames."""
        head = memoryview(self._head)
        if self._closed:
            raise ClosedError("stream closed")
        try:
            n = await self._loop.sock_recv_into(self.sock, head)
        except OSError as exc:
            raise self._recv_error(exc) from exc
        if n == 0:
            return None
        if n < wire.HEADER_SIZE:
            try:
                await self.recv_into(head[n:])
            except ConnectionLost as exc:
                raise ProtocolError(f"truncated header ({n} bytes): {exc}") from exc
        return wire.parse_header(self._head)

    async def recv_body(self, head: wire.FrameHead) -> Any:
        size = head.body_len
        if size > len(self._body):
            self._body = bytearray(max(size, 2 * len(self._body)))
        view = memoryview(self._body)[:size]
        await self.recv_into(view)
        return wire.decode_body(head.msg_type, view)

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
