"""A pipelined request/response connection over :class:`FrameStream`.

Requests are sent back to back under a send lock; one reader task matches replies
to requests in FIFO order (servers answer each connection in order) and receives
``READ`` payloads straight into the caller's destination views. A timeout or any
transport failure closes the connection and fails every pending request, so a late
reply can never scribble into a buffer its caller has already given up on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from gcache import wire
from gcache.errors import ClosedError, ConnectionLost, GCacheError, ProtocolError, remote_error
from gcache.transport.stream import Buffer, FrameStream

T = TypeVar("T")


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """Like ``asyncio.gather`` but on the first failure (or cancellation) cancels and
    awaits the rest, so no read keeps writing into buffers after we return."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class PipelinedConn:
    __slots__ = ("_closed", "_ids", "_pending", "_reader", "_send_lock", "name", "stream")

    def __init__(self, stream: FrameStream, name: str) -> None:
        self.stream = stream
        self.name = name
        self._send_lock = asyncio.Lock()
        self._pending: deque[tuple[int, asyncio.Future[Any], Sequence[memoryview] | None]] = deque()
        self._ids = itertools.count(1)
        self._closed: BaseException | None = None
        self._reader = asyncio.create_task(self._read_loop())

    @classmethod
    async def open(cls, host: str, port: int, timeout: float) -> PipelinedConn:
        return cls(await FrameStream.connect(host, port, timeout), f"{host}:{port}")

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def call(
        self,
        msg: wire.Msg,
        payload: Sequence[Buffer] = (),
        dest: Sequence[memoryview] | None = None,
        timeout: float = 5.0,
    ) -> Any:
        """Send ``msg`` (+ payload views) and await the reply body. A ``READ`` reply's
        payload lands in ``dest`` views, in order."""
        if self._closed is not None:
            raise ConnectionLost(f"connection to {self.name} is down: {self._closed}")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                async with self._send_lock:
                    req_id = next(self._ids) & 0xFFFFFFFF
                    self._pending.append((req_id, fut, dest))
                    await self.stream.send_msg(msg, req_id, payload)
                return await fut
        except TimeoutError as exc:
            self.close(ConnectionLost(f"{self.name}: no reply within {timeout}s"))
            raise ConnectionLost(f"{self.name}: no reply within {timeout}s") from exc
        except asyncio.CancelledError:
            # The reply may still be on its way into ``dest``; the caller is gone, so
            # drop the connection rather than let it write into reclaimed buffers.
            if not fut.done() or fut.cancelled():
                self.close(ConnectionLost(f"{self.name}: request cancelled"))
            raise
        except (ConnectionLost, ClosedError) as exc:
            self.close(exc)
            raise ConnectionLost(f"{self.name}: {exc}") from exc

    async def _read_loop(self) -> None:
        stream = self.stream
        try:
            while True:
                frame = await stream.recv_frame()
                if frame is None:
                    raise ConnectionLost("peer closed the connection")
                head, body = frame
                if not self._pending:
                    raise ProtocolError(f"unsolicited reply (request id {head.req_id})")
                req_id, fut, dest = self._pending.popleft()
                if head.req_id != req_id:
                    raise ProtocolError(f"reply to request {head.req_id}, expected {req_id}")
                if head.msg_type == wire.T_READ_DATA:
                    if dest is None or sum(v.nbytes for v in dest) != head.payload_len:
                        raise ProtocolError("READ reply size does not match the request")
                    await stream.recv_into_many(dest)
                elif head.payload_len:
                    await stream.discard(head.payload_len)
                if fut.done():
                    continue
                if head.msg_type == wire.T_ERROR:
                    fut.set_exception(remote_error(body.code, body.message))
                else:
                    fut.set_result(body)
        except asyncio.CancelledError:
            self._fail(ClosedError("connection closed"))
            raise
        except GCacheError as exc:
            self._fail(exc)
        except Exception as exc:  # never leave callers waiting on a dead reader
            self._fail(ConnectionLost(f"reader failed: {exc!r}"))
        finally:
            stream.close()

    def _fail(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        while self._pending:
            _, fut, _ = self._pending.popleft()
            if not fut.done():
                fut.set_exception(ConnectionLost(f"{self.name}: {exc}"))
                fut.exception()  # mark retrieved: the caller may have timed out

    def close(self, reason: BaseException | None = None) -> None:
        self._fail(reason or ClosedError("connection closed"))
        self.stream.close()
        self._reader.cancel()
