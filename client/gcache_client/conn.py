"""A pipelined request/response connection over :class:`FrameStream`.

Requests are sent back to back under a send lock; one reader task matches replies
to requests in FIFO order (servers answer each connection in order) and receives
``READ`` payloads straight into the caller's destination views.

A call that is cancelled or times out does not close the connection others share:
its request is *abandoned*, and its reply, when it comes, is read and dropped (a
payload goes into a scratch sink, never into the caller's buffers, which the
caller has taken back). Only when the reply is already streaming into the
caller's buffers, or the request frame may be half sent, is the connection
closed instead. A transport failure fails every pending request.

A daemon at a connection limit answers a new connection with one ``ERROR(E_BUSY)``
frame with request id 0 and closes it: every pending call then fails with
:class:`~gcache.errors.Busy` (a :class:`~gcache.errors.RemoteError`, so reads
become misses), and the refusal is logged once for the connection (at a bounded
rate across connections).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from gcache import wire
from gcache.errors import (
    E_BUSY,
    Busy,
    ClosedError,
    ConnectionLost,
    GCacheError,
    ProtocolError,
    remote_error,
)
from gcache.transport.limits import RateLimitedLog
from gcache.transport.stream import Buffer, FrameStream

log = logging.getLogger("gcache_client.conn")
# Connections a daemon refused at its limits: one line each, at a bounded rate (a
# client retrying against a full daemon must not flood its engine's log).
_busy_log = RateLimitedLog(log)

T = TypeVar("T")


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """Like ``asyncio.gather`` but on the first failure (or cancellation) cancels and
    awaits the rest, so no read keeps writing into buffers after we return. One
    awaitable is awaited in place: no task, no loop pass (a 1 MiB read is one layer
    from one server), and a cancellation reaches it where it waits, as it would."""
    if len(aws) == 1:
        return [await aws[0]]
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# Abandoned requests whose replies are still due; past this the connection is
# closed instead (a server that answers nothing in time is likely gone).
MAX_ABANDONED = 256
# After a failed send, how long a call waits for the reader to deliver what the
# peer sent before it went (an E_BUSY refusal) instead of a bare ConnectionLost.
_SEND_FAILED_GRACE_S = 0.5


def _expire(fut: asyncio.Future[Any]) -> None:
    """A call's deadline: its reply is late (the caller abandons the request)."""
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Pending:
    __slots__ = ("abandoned", "answered", "dest", "fut", "receiving", "req_id")

    def __init__(
        self, req_id: int, fut: asyncio.Future[Any], dest: Sequence[memoryview] | None
    ) -> None:
        self.req_id = req_id
        self.fut = fut
        self.dest = dest
        self.abandoned = False
        self.receiving = False  # the reply's payload is streaming into ``dest``
        self.answered = False  # the reader is done with this request


class PipelinedConn:
    __slots__ = (
        "_closed",
        "_flush_due",
        "_flusher",
        "_ids",
        "_loop",
        "_owed",
        "_pending",
        "_reader",
        "_send_lock",
        "abandoned",
        "flushes",
        "name",
        "stream",
    )

    def __init__(self, stream: FrameStream, name: str) -> None:
        self.stream = stream
        self.name = name
        self._send_lock = asyncio.Lock()
        self._pending: deque[_Pending] = deque()
        self._owed = 0  # abandoned requests whose replies are still due
        self.abandoned = 0  # requests abandoned so far (stats)
        self._ids = itertools.count(1)
        self._closed: BaseException | None = None
        self._loop = asyncio.get_running_loop()  # the reader runs on it, so do calls
        self._flush_due = False  # a _flush is scheduled for this loop pass
        self._flusher: asyncio.Task[None] | None = None
        self.flushes = 0  # sendmsg batches of coalesced frames (stats)
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
            if isinstance(self._closed, Busy):  # the daemon refused this connection
                raise Busy(self._closed.code, self._closed.message)
            raise ConnectionLost(f"connection to {self.name} is down: {self._closed}")
        loop = self._loop
        fut: asyncio.Future[Any] = loop.create_future()
        p: _Pending | None = None
        sent = False
        try:
            if payload:
                async with asyncio.timeout(timeout):
                    async with self._send_lock:
                        # 1 .. 2**32 - 1: request id 0 is the daemon's, for refusals.
                        p = _Pending(next(self._ids) % 0xFFFFFFFF + 1, fut, dest)
                        self._pending.append(p)
                        await self.stream.send_msg(msg, p.req_id, payload)
                        sent = True
                    return await fut
            # Coalesced: frames without payload queued in this loop pass go out
            # together in one sendmsg at its end (_flush). A queued frame is the
            # stream's: it goes out whole, or the connection fails, so the caller
            # may give up on it like on a sent one. The only wait is for the reply:
            # its deadline fails the future itself (no asyncio.timeout, whose
            # running-loop lookups cost a getpid syscall each).
            p = _Pending(next(self._ids) % 0xFFFFFFFF + 1, fut, dest)
            self._pending.append(p)
            self.stream.queue_msg(msg, p.req_id)
            sent = True
            if not self._flush_due:
                self._flush_due = True
                loop.call_soon(self._flush)
            timer = loop.call_later(timeout, _expire, fut)
            try:
                return await fut
            finally:
                timer.cancel()
        except TimeoutError as exc:
            self._abandon(p, sent, f"no reply within {timeout}s")
            raise ConnectionLost(f"{self.name}: no reply within {timeout}s") from exc
        except asyncio.CancelledError:
            self._abandon(p, sent, "request cancelled")
            raise
        except (ConnectionLost, ClosedError) as exc:
            if isinstance(exc, ConnectionLost) and not fut.done():
                # The send failed: the peer is gone, but what it said before going
                # (a refusal at its connection limits) may still wait in the socket
                # for the reader, which ends at once and fails ``fut`` with it.
                await asyncio.wait([fut], timeout=_SEND_FAILED_GRACE_S)
                said = fut.exception() if fut.done() and not fut.cancelled() else None
                if isinstance(said, Busy):
                    raise said from exc
            self.close(exc)
            raise ConnectionLost(f"{self.name}: {exc}") from exc

    def _flush(self) -> None:
        """End of the loop pass that queued frames: send them in one ``sendmsg``;
        a full socket, or a payload send under way, leaves it to a task."""
        self._flush_due = False
        if self._closed is not None:
            return
        if not self._send_lock.locked():
            try:
                if self.stream.try_flush():
                    self.flushes += 1
                    return
            except (ConnectionLost, ClosedError) as exc:
                self._send_failed(exc)
                return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_slow())

    async def _flush_slow(self) -> None:
        stream = self.stream
        try:
            async with self._send_lock:
                while stream.queued:  # frames queued while this one waited for room
                    await stream.flush()
                    self.flushes += 1
        except (ConnectionLost, ClosedError) as exc:
            self._send_failed(exc)

    def _send_failed(self, exc: BaseException) -> None:
        """Queued frames could not go out: the peer is gone. What it said before
        going (a refusal at its connection limits) may still wait in the socket for
        the reader, which then fails every call with it; else the calls fail as
        a lost connection after a short grace."""
        if self._closed is None:
            reason = ConnectionLost(f"{self.name}: {exc}")
            self._loop.call_later(_SEND_FAILED_GRACE_S, self.close, reason)

    def _abandon(self, p: _Pending | None, sent: bool, why: str) -> None:
        """The caller gave up on ``p``: have its reply drained, not delivered. The
        connection is closed only if it cannot stay in step or in bounds."""
        if p is None or self._closed is not None:
            return  # never queued, or the connection is already down
        if p.answered and not p.receiving:
            return  # the reply was read whole: nothing is owed
        if not sent or p.receiving or self._owed >= MAX_ABANDONED:
            # A half-sent frame, or a payload already landing in the caller's
            # buffers: only closing the connection stops it.
            self.close(ConnectionLost(f"{self.name}: {why}"))
            return
        p.abandoned = True
        p.dest = None
        self._owed += 1
        self.abandoned += 1
        if not p.fut.done():
            p.fut.cancel()

    async def _read_loop(self) -> None:
        stream = self.stream
        try:
            while True:
                frame = await stream.recv_frame()
                if frame is None:
                    raise ConnectionLost("peer closed the connection")
                head, body = frame
                if head.req_id == 0 and head.msg_type == wire.T_ERROR and body.code == E_BUSY:
                    # Refused at the daemon's connection limits; it closes the socket.
                    raise remote_error(body.code, body.message)
                if not self._pending:
                    raise ProtocolError(f"unsolicited reply (request id {head.req_id})")
                p = self._pending[0]
                if head.req_id != p.req_id:  # ``p`` stays queued: _fail fails it too
                    raise ProtocolError(f"reply to request {head.req_id}, expected {p.req_id}")
                self._pending.popleft()
                p.answered = True
                if p.abandoned:
                    self._owed -= 1
                    if head.payload_len:  # into a scratch sink, never the caller's buffers
                        await stream.discard(head.payload_len)
                    continue
                dest = p.dest
                if head.msg_type == wire.T_READ_DATA:
                    if dest is None or sum(v.nbytes for v in dest) != head.payload_len:
                        raise ProtocolError("READ reply size does not match the request")
                    p.receiving = True
                    await stream.recv_into_many(dest)
                    p.receiving = False
                elif head.payload_len:
                    await stream.discard(head.payload_len)
                fut = p.fut
                if fut.done():
                    continue
                if head.msg_type == wire.T_ERROR:
                    fut.set_exception(remote_error(body.code, body.message))
                else:
                    fut.set_result(body)
        except asyncio.CancelledError:
            self._fail(ClosedError("connection closed"))
            raise
        except Busy as exc:
            _busy_log.log(time.monotonic(), "%s refused the connection: %s", self.name, exc.message)
            self._fail(exc)
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
            fut = self._pending.popleft().fut
            if not fut.done():
                if isinstance(exc, Busy):
                    fut.set_exception(Busy(exc.code, f"{self.name}: {exc.message}"))
                else:
                    fut.set_exception(ConnectionLost(f"{self.name}: {exc}"))
                fut.exception()  # mark retrieved: the caller may have timed out

    def close(self, reason: BaseException | None = None) -> None:
        self._fail(reason or ClosedError("connection closed"))
        self.stream.close()
        self._reader.cancel()
