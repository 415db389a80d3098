"""Pipelined tier-1 READ replies (one file: the TCP and staged reply pipelines
share their in-order sender, :class:`_InOrder`).

A tier-1 READ used to read its whole object from NVMe, then send it, then take the
next READ of the connection: disk and network in series, and one READ at a time
on the disk threads. Here each reply's disk bytes are read in pieces
(:data:`SEND_PIECE`, page aligned, ``O_DIRECT``) on the ``nvme-read`` threads, at most
:data:`DEPTH` of one reply on them at once, and each payload chunk goes out as
soon as its piece has landed while the next pieces are read (``max(disk, net)``
rather than their sum). The connection's reader goes on to the next request
meanwhile: up to :data:`AHEAD` tier-1 READs of one connection are started (their
pieces read) while an earlier one is still being sent, so several READs in flight
keep the disk threads busy. Replies still leave in request order: one sender task
per connection sends them, and any other reply of the connection waits until the
queued ones are out (:meth:`NvmeReplies.drain`).

Bounds: every queued reply holds its bytes of the server's read-ahead budget
(:class:`gcache.server.tiered.ReadBudget`) and one pooled buffer
(:class:`gcache.server.tiered.ReadBuffers`); at most :data:`AHEAD` replies per
connection. A connection that closes (or a send that fails) releases them all,
after the pieces already on a disk thread have finished (a thread never writes
into a buffer lent again). A disk error before the reply's first byte went out is
answered with an ``ERROR`` frame; after it, the connection is closed (the frame
cannot be finished), which the client sees as a miss."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final

from gcache import wire
from gcache.errors import E_BAD_REQUEST, E_BUSY, E_INTERNAL, ConnectionLost
from gcache.server.staging import StagingArea
from gcache.server.tiered import (
    READ_BATCH,
    Chunk,
    Piece,
    ReadBudget,
    ReadBuffer,
    ReadBuffers,
    TieredReadReply,
)
from gcache.storage.nvme import preadv_exact
from gcache.transport.stream import FrameStream

PIECE: Final = 1 << 20  # bytes per disk read into the staging file (all in parallel)
# bytes per disk read of a TCP reply: 1 MiB pieces cost more server CPU than they
# saved on the 2-core VM (16 MiB: 0.42-0.64 ms/MiB against 0.33-0.50 unpipelined)
SEND_PIECE: Final = 4 << 20
DEPTH: Final = 4  # pieces of one reply on the disk threads at once
AHEAD: Final = 4  # tier-1 replies of one connection started before they are sent
STAGED_AHEAD: Final = 4  # READ_STAGED of one connection being read at once


def _read_piece(reads: Piece) -> None:
    for fd, offset, view in reads:
        preadv_exact(fd, view, offset)


class _Job:
    """One tier-1 reply being read and sent."""

    __slots__ = (
        "buf",
        "chunks",
        "closed",
        "finished",
        "futures",
        "next",
        "pieces",
        "reply",
        "req_id",
        "running",
    )

    def __init__(self, reply: TieredReadReply, req_id: int) -> None:
        self.reply = reply
        self.req_id = req_id
        self.buf: ReadBuffer | None = None
        self.pieces: list[Piece] = []
        self.chunks: list[Chunk] = []
        self.futures: list[concurrent.futures.Future[None]] = []
        self.next = 0  # pieces submitted
        self.running = 0  # submitted, not finished
        self.closed = False
        self.finished = False


class _InOrder:
    """What both reply queues share: a queue of replies sent in request order by
    one sender task, a change event the reader waits on, and the sender's error."""

    _queue: deque[Any]

    def __init__(self) -> None:
        self.error: BaseException | None = None  # why the sender stopped
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    async def drain(self) -> None:
        """Wait until every queued reply went out (another reply may go next)."""
        while self._queue:
            self._raise_if_failed()
            await self._wait_change()
        self._raise_if_failed()

    async def _stop_sender(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except BaseException:  # cancelled, or its own failure (kept in .error)
                pass

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise ConnectionLost(f"reply failed: {self.error}")

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()


class NvmeReplies(_InOrder):
    """The tier-1 READ replies of one connection, started ahead and sent in order
    (see the module docstring). Runs on the event loop; the disk reads run on
    ``executor``."""

    def __init__(
        self,
        stream: FrameStream,
        executor: concurrent.futures.Executor,
        buffers: ReadBuffers,
        budget: ReadBudget,
        counters: dict[str, int],
        on_error: Callable[[str], None],
        on_idle: Callable[[], None] = lambda: None,
        piece: int = SEND_PIECE,
        depth: int = DEPTH,
        ahead: int = AHEAD,
    ) -> None:
        self.stream = stream
        self.executor = executor
        self.buffers = buffers
        self.budget = budget
        self.counters = counters  # shared by the server's connections (stats())
        self.on_error = on_error
        self.on_idle = on_idle
        self.piece, self.depth, self.ahead = piece, depth, ahead
        super().__init__()
        self._queue: deque[_Job] = deque()
        self._loop = asyncio.get_running_loop()

    # ---- the reader's side -------------------------------------------------------

    async def submit(self, reply: TieredReadReply, req_id: int) -> None:
        """Start reading ``reply`` and queue it behind the connection's earlier
        replies; waits (backpressure) while :data:`AHEAD` are queued and for room
        in the read-ahead budget."""
        while len(self._queue) >= self.ahead:
            self._raise_if_failed()
            await self._wait_change()
        self._raise_if_failed()
        job = _Job(reply, req_id)
        await self.budget.acquire(reply.nvme_bytes)
        self.counters["nvme_replies_queued"] += 1
        try:
            span = reply.span()
            buf = self.buffers.try_acquire(span)
            if buf is None:  # maps and faults in a buffer: not on the loop
                buf = await self._loop.run_in_executor(self.executor, self.buffers.acquire, span)
            job.buf = buf
            job.pieces, job.chunks = reply.plan_pieces(buf.view, self.piece)
        except BaseException:
            await self._finish(job)
            raise
        if self._queue:
            self.counters["nvme_replies_ahead"] += 1
        self._queue.append(job)
        self._fill(job)
        if self._task is None:
            self._task = asyncio.create_task(self._send_loop())
        self._changed.set()

    async def close(self) -> BaseException | None:
        """Stop sending and release every queued reply (waits for pieces already on
        a disk thread). Returns why the sender stopped, if it failed."""
        await self._stop_sender()
        while self._queue:
            await self._finish(self._queue.popleft())
        return self.error

    # ---- disk pieces ---------------------------------------------------------------

    def _fill(self, job: _Job) -> None:
        """Submit pieces until :data:`DEPTH` of the job are on the disk threads."""
        while not job.closed and job.running < self.depth and job.next < len(job.pieces):
            fut = self.executor.submit(_read_piece, job.pieces[job.next])
            job.futures.append(fut)
            job.next += 1
            job.running += 1
            self.counters["nvme_read_pieces"] += 1
            fut.add_done_callback(self._landed(job))

    def _landed(self, job: _Job) -> Callable[[concurrent.futures.Future[None]], None]:
        def cb(_fut: concurrent.futures.Future[None]) -> None:  # on a disk thread
            if job.next >= len(job.pieces):
                # every piece is on a disk thread already: nothing for _fill to do,
                # so no wake-up of the loop (the sender waits on the future itself).
                # ``next`` only grows on the loop: a stale read wakes it needlessly.
                return
            try:
                self._loop.call_soon_threadsafe(self._done, job)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

        return cb

    def _done(self, job: _Job) -> None:
        job.running -= 1
        self._fill(job)

    def landed(self, job: _Job, idx: int) -> bool:
        return idx < len(job.futures) and job.futures[idx].done()

    async def _piece(self, job: _Job, idx: int) -> None:
        """Wait for piece ``idx``; raises its ``OSError``."""
        while idx >= len(job.futures):  # not submitted yet: an earlier one must land
            if job.closed:
                raise ConnectionLost("reply closed")
            try:
                await asyncio.wrap_future(job.futures[max(0, idx - self.depth)])
            except OSError:
                pass  # that piece's own wait reports it
        fut = job.futures[idx]
        if fut.done() and not fut.cancelled():  # landed: no asyncio future chained (a wake-up)
            fut.result()
            return
        await asyncio.wrap_future(fut)

    async def _finish(self, job: _Job) -> None:
        """Release a job's buffer and budget once no disk thread writes into it.
        Idempotent (a cancelled call is completed by :meth:`close`)."""
        job.closed = True
        for fut in job.futures:
            if not fut.cancel() and not fut.done():  # on a disk thread: wait for it
                try:
                    await asyncio.wrap_future(fut)
                except Exception:
                    pass
        if job.finished:
            return
        job.finished = True
        job.futures.clear()
        job.pieces, job.chunks = [], []
        job.reply.release()
        if job.buf is not None:
            buf, job.buf = job.buf, None
            self.buffers.release(buf)
        self.counters["nvme_replies_queued"] -= 1
        await self.budget.release(job.reply.nvme_bytes)

    # ---- the sender ----------------------------------------------------------------

    async def _send_loop(self) -> None:
        try:
            while True:
                while not self._queue:
                    self.on_idle()
                    await self._wait_change()
                job = self._queue[0]
                try:
                    await self._send(job)
                finally:
                    await self._finish(job)  # then off the queue: close() sees it till then
                    if self._queue and self._queue[0] is job:
                        self._queue.popleft()
                    self._changed.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the peer went away, a send timed out, a disk error
            if isinstance(exc, OSError):
                self.on_error(f"NVMe read failed mid-reply, closing the connection: {exc}")
            self.error = exc
            self.stream.close()
            self._changed.set()

    async def _send(self, job: _Job) -> None:
        stream = self.stream
        chunks = job.chunks
        first = next((p for _, p in chunks if p >= 0), -1)
        try:
            if first >= 0:
                await self._piece(job, first)
        except OSError as exc:  # nothing sent yet: an ERROR frame, the connection stays
            self.on_error(f"NVMe read failed: {exc}")
            await stream.send_msg(wire.Error(E_INTERNAL, f"NVMe read failed: {exc}"), job.req_id)
            return
        total = job.reply.total
        batch: list[memoryview] = []
        head_sent = False
        waited = first
        for view, p in chunks:
            if p > waited:
                if not self.landed(job, p) and batch:  # what landed goes out meanwhile
                    await self._flush(job, batch, head_sent, total)
                    head_sent, batch = True, []
                await self._piece(job, p)  # OSError now: the frame cannot end, close
                waited = p
            batch.append(view)
            if len(batch) >= READ_BATCH:
                await self._flush(job, batch, head_sent, total)
                head_sent, batch = True, []
        if batch or not head_sent:
            await self._flush(job, batch, head_sent, total)

    async def _flush(self, job: _Job, batch: list[memoryview], head_sent: bool, total: int) -> None:
        if head_sent:
            await self.stream.send_views(batch)
        else:
            await self.stream.send_msg(wire.ReadData(total), job.req_id, batch, total)


class StagedReplies(_InOrder):
    """The ``READ_STAGED`` replies of one connection: up to ``ahead`` are read into
    the staging file at once (the connection's reader goes on to the next request
    while earlier ones are on the disk threads), and a sender task sends their
    replies in request order (the client matches replies to requests in FIFO
    order). Any other reply of the connection waits until these went out
    (:meth:`drain`). Bounds: ``ahead`` per connection (the reader waits), and the
    staging area's share per connection (a read past it is answered ``E_BUSY`` and
    goes over TCP). A closed connection waits for the reads on the disk threads
    before its ranges are freed (:meth:`close`), so no thread writes into a range
    lent again."""

    def __init__(
        self,
        stream: FrameStream,
        counters: dict[str, int],
        on_idle: Callable[[], None] = lambda: None,
        ahead: int = STAGED_AHEAD,
    ) -> None:
        self.stream = stream
        self.counters = counters  # shared by the server's connections (stats())
        self.on_idle = on_idle
        self.ahead = ahead
        super().__init__()
        self._queue: deque[tuple[asyncio.Future[wire.Msg], int]] = deque()

    async def room(self) -> None:
        """Wait (backpressure) while ``ahead`` replies are queued; raises when the
        sender failed."""
        while len(self._queue) >= self.ahead:
            self._raise_if_failed()
            await self._wait_change()
        self._raise_if_failed()

    def put(self, reply: Awaitable[wire.Msg] | wire.Msg, req_id: int) -> None:
        """Queue the reply to ``req_id`` (an awaitable: started now; a message:
        sent in its turn). Never raises: whatever was started is awaited by
        :meth:`close` (it holds references the read gives back)."""
        fut: asyncio.Future[wire.Msg]
        if isinstance(reply, wire.Msg):
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(reply)
        else:
            fut = asyncio.ensure_future(reply)
        if self._queue:  # started while an earlier one of the connection is queued
            self.counters["staged_replies_ahead"] += 1
        self._queue.append((fut, req_id))
        if self._task is None and self.error is None:
            self._task = asyncio.create_task(self._send_loop())
        self._changed.set()

    async def close(self) -> BaseException | None:
        """Stop sending; wait for the reads still on the disk threads (their
        replies are dropped). Returns why the sender stopped, if it failed."""
        await self._stop_sender()
        while self._queue:
            fut, _ = self._queue.popleft()
            try:
                await fut  # a read is never cancelled mid-way: its pieces finish first
            except Exception:
                pass
        return self.error

    async def _send_loop(self) -> None:
        try:
            while True:
                while not self._queue:
                    self.on_idle()
                    await self._wait_change()
                fut, req_id = self._queue[0]
                out = await asyncio.shield(fut)  # close() waits for it, never cancels it
                await self.stream.send_msg(out, req_id)
                self._queue.popleft()
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the peer went away, a send timed out
            self.error = exc
            self.stream.close()
            self._changed.set()


async def read_staged(
    reply: TieredReadReply,
    staging: StagingArea,
    executor: concurrent.futures.Executor,
    owner: int,
    piece: int = PIECE,
) -> wire.Msg:
    """Serve a ``READ_STAGED``: read the reply's tier-1 ranges from NVMe into a
    range of the staging file owned by ``owner`` (pieces in parallel on the disk
    threads) and answer where each landed (``STAGED``), or an ``ERROR`` (no room:
    the client reads over TCP instead; a disk error)."""
    if not reply.all_tier1:
        return wire.Error(E_BAD_REQUEST, "READ_STAGED is for tier-1 ranges only")
    span = reply.span()
    got = staging.stage(owner, span, time.monotonic())
    if got is None:
        return wire.Error(E_BUSY, "the staging area is full: read over TCP")
    rid, base = got
    expiry_ms = int((time.time() + staging.ttl_s) * 1000)
    pieces, _ = reply.plan_pieces(staging.view[base : base + span], piece)
    loop = asyncio.get_running_loop()
    futs = [loop.run_in_executor(executor, _read_piece, p) for p in pieces]
    try:
        await asyncio.gather(*futs)
    except OSError as exc:
        staging.release(owner, rid)
        return wire.Error(E_INTERNAL, f"NVMe read failed: {exc}")
    except BaseException:
        # the range stays owned until its pieces finished: freed when the
        # connection closes (release_owner) after they ran, or when it expires
        for f in futs:
            f.cancel()
        raise
    finally:
        reply.release()
    offsets = [base + o for o in reply.buffer_offsets()]
    return wire.Staged(rid, staging.path, offsets, expiry_ms)


def new_counters() -> dict[str, int]:
    """The counters :class:`NvmeReplies` keeps (one dict for all connections)."""
    return {
        "nvme_read_pieces": 0,
        "nvme_replies_queued": 0,
        "nvme_replies_ahead": 0,
        "staged_replies_ahead": 0,
    }
