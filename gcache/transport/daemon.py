"""The framed-daemon skeleton the meta's hot path, the storage server's data plane
and the router's hot path all run.

:class:`FramedDaemon` accepts through the connection limits
(:func:`~gcache.transport.limits.accept_admitted`: admission, per-peer limits,
idle sweeping) and serves each admitted connection with one loop: read a frame
header and body (the I/O-free parser under :class:`FrameStream`; a daemon's
:data:`BodyCheck` refuses an oversized body before it is decoded), hand the
request to the connection's handler table, answer (replies to pipelined
requests already buffered whole go out together, up to ``reply_batch``), and
log at a bounded rate the lines a peer can provoke (bad frames, refused
connections and requests, send timeouts).

A daemon supplies a :class:`Connection` subclass: its per-connection state and
``handlers``, a table from message type to one function named for it. A handler
returns the reply (or an awaitable of it), or ``None`` when it answered on the
stream itself (the server's WRITE and READ replies, which carry payload).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

from gcache import wire
from gcache.errors import (
    E_BAD_REQUEST,
    E_INTERNAL,
    GCacheError,
    InvalidBody,
    ProtocolError,
    Refusal,
    SendTimeout,
)
from gcache.transport.limits import Conn, ConnectionLimiter, RateLimitedLog, accept_admitted
from gcache.transport.stream import BodyCheck, FrameStream

# What a handler returns: the reply, an awaitable of it, or None (answered itself).
Reply = wire.Msg | Awaitable[wire.Msg | None] | None
Handler = Callable[[Any, wire.FrameHead, Any], Reply]

# Message type -> its name (``T_SEAL`` -> ``SEAL``), for log lines.
TYPE_NAMES: dict[int, str] = {
    v: k[2:] for k, v in vars(wire).items() if k.startswith("T_") and isinstance(v, int)
}


def type_name(msg_type: int) -> str:
    return TYPE_NAMES.get(msg_type, f"type {msg_type}")


class Connection:
    """One admitted connection of a :class:`FramedDaemon`: its stream, its
    admission record (``conn``; None when served without limits) and the
    daemon's handler table. Subclasses add their state and handlers."""

    handlers: ClassVar[Mapping[int, Handler]] = {}

    def __init__(self, daemon: FramedDaemon, stream: FrameStream, conn: Conn | None) -> None:
        self.daemon = daemon
        self.stream = stream
        self.conn = conn
        self.at_head = False  # waiting for the next frame's header
        self.finished = False  # set by a handler that answered and ends the connection

    @property
    def busy(self) -> bool:
        """Replies of this connection still being produced (not idle while it
        waits for the next frame)."""
        return False

    def handle(self, head: wire.FrameHead, msg: Any) -> Reply:
        """The handler for ``head.msg_type`` from the table (``unknown`` when none)."""
        handler = self.handlers.get(head.msg_type)
        if handler is None:
            return self.unknown(head)
        return handler(self, head, msg)

    def unknown(self, head: wire.FrameHead) -> Reply:
        raise Refusal(
            E_BAD_REQUEST,
            f"message type {head.msg_type} not served by the {self.daemon.what or 'server'}",
        )

    def refused(self, head: wire.FrameHead, r: Refusal) -> wire.Msg:
        """The reply to a refused request (counted, logged as the daemon says)."""
        self.daemon.refused_request(self, head, r)
        return wire.Error(r.code, r.message)

    async def closed(self) -> None:
        """The connection ended (any reason); its stream is closed already."""


class FramedDaemon:
    """Accept loop and serve loop of one framed listener (see the module doc).

    ``reply_batch``/``reply_batch_bytes``: replies to requests already buffered
    whole wait for each other (one ``sendmsg``) up to these bounds, never across
    a receive; 1 sends each reply at once. ``internal_error_reply``: a handler's
    unexpected exception is answered with ``E_INTERNAL`` and the connection goes
    on (otherwise the connection ends; either way it is logged)."""

    connection_class: type[Connection] = Connection

    def __init__(
        self,
        listener: socket.socket | None,
        *,
        what: str,
        log: logging.Logger,
        limiter: ConnectionLimiter,
        max_body: int,
        send_timeout: float | None,
        check_body: BodyCheck | None = None,
        reply_batch: int = 1,
        reply_batch_bytes: int = 0,
        internal_error_reply: bool = True,
        request_log: RateLimitedLog | None = None,
    ) -> None:
        self.listener = listener
        self.what = what
        self.label = what or "data-plane"  # in log lines
        self.log = log
        self.limiter = limiter
        self.max_body = max_body
        self.send_timeout = send_timeout
        self.check_body = check_body
        self.reply_batch = reply_batch
        self.reply_batch_bytes = reply_batch_bytes
        self.internal_error_reply = internal_error_reply
        self.connections: set[asyncio.Task[None]] = set()
        self.total_connections = 0
        self.protocol_errors = 0
        self.replies = 0
        self.reply_batches = 0  # sendmsg calls that carried replies (stats)
        # Lines a remote peer can provoke at will: bounded rate.
        self.bad_frame_log = RateLimitedLog(log)
        self.refused_log = RateLimitedLog(log)
        # Refused requests and connections that end badly (when set; else debug).
        self.request_log = request_log

    def stats(self) -> dict[str, int]:
        out = {
            **self.limiter.stats(),
            "protocol_errors": self.protocol_errors,
            **self.bad_frame_log.stats("bad_frames"),
            **self.refused_log.stats("refused_connections"),
        }
        if self.request_log is not None:
            out.update(self.request_log.stats("refused_requests"))
        return out

    # ---- hooks ---------------------------------------------------------------------

    def connection(self, stream: FrameStream, conn: Conn | None) -> Connection:
        return self.connection_class(self, stream, conn)

    def refused_request(self, c: Connection, head: wire.FrameHead, r: Refusal) -> None:
        """Count (and, with a request log, log) one refused request."""
        if self.request_log is not None:
            self.request_log.log(
                time.monotonic(),
                "refused %s from %s: %s",
                type_name(head.msg_type),
                c.stream.peer,
                r.message,
            )

    def count_protocol_error(self) -> None:
        self.protocol_errors += 1

    # ---- serving -------------------------------------------------------------------

    async def serve_connection(self, sock: socket.socket, conn: Conn | None = None) -> None:
        stream = FrameStream(sock, max_body=self.max_body, send_timeout=self.send_timeout)
        if conn is not None:
            conn.close = stream.close  # the idle sweeper closes the stream
        c = self.connection(stream, conn)
        check_body = self.check_body
        batch, batch_bytes = self.reply_batch, self.reply_batch_bytes
        waiting = 0  # replies queued, not sent yet
        reply: wire.Msg | None
        try:
            while True:
                if conn is not None:
                    conn.idle_since = None if c.busy else time.monotonic()
                c.at_head = True
                head = await stream.recv_head()
                c.at_head = False
                if head is None:
                    return
                try:
                    msg = await stream.recv_body(head, check_body)
                except InvalidBody as exc:  # the frame was read whole: answer, go on
                    reply = c.refused(head, Refusal(E_BAD_REQUEST, str(exc)))
                else:
                    if conn is not None and not head.payload_len:
                        conn.idle_since = None  # a whole frame: in flight until answered
                    try:
                        out = c.handle(head, msg)
                        # Drop the request (up to 131072 decoded keys) now, not when
                        # the next one arrives: an idle connection holds none of it.
                        del msg
                        if out is None or isinstance(out, wire.Msg):
                            reply = out
                        else:
                            reply = await out
                    except Refusal as r:
                        reply = c.refused(head, r)
                    except Exception as exc:  # a bug must not take the daemon down
                        if not self.internal_error_reply:
                            raise
                        self.log.exception("internal error handling message type %d", head.msg_type)
                        reply = wire.Error(E_INTERNAL, f"internal error: {exc!r}")
                if reply is None:  # the handler answered on the stream itself
                    if c.finished:
                        return
                    continue
                self.replies += 1
                if batch == 1:
                    self.reply_batches += 1
                    await stream.send_msg(reply, head.req_id)
                    continue
                # Requests a client pipelined arrive together: answer every one
                # already buffered whole, then send the replies in one sendmsg (one
                # wakeup of the client, not one per reply).
                stream.queue_msg(reply, head.req_id)
                del reply
                waiting += 1
                if waiting >= batch or stream.queued >= batch_bytes or not stream.frame_ready:
                    waiting = 0
                    self.reply_batches += 1
                    await stream.flush()
        except ProtocolError as exc:
            self.count_protocol_error()
            self.bad_frame_log.log(
                time.monotonic(),
                "closing %s connection from %s: %s",
                self.label,
                stream.peer,
                exc,
            )
        except SendTimeout as exc:  # a client that stopped reading its replies
            self.limiter.send_timeouts += 1
            self.refused_log.log(time.monotonic(), "closing %s connection: %s", self.label, exc)
        except GCacheError as exc:
            if self.request_log is not None:
                self.request_log.log(
                    time.monotonic(), "connection from %s ended: %s", stream.peer, exc
                )
            else:
                self.log.debug("%s connection from %s ended: %s", self.label, stream.peer, exc)
        except Exception:  # a bug must cost one connection, never the daemon
            self.log.exception("internal error on %s connection from %s", self.label, stream.peer)
        finally:
            stream.close()
            await c.closed()
            if conn is not None:
                self.limiter.release(conn)

    async def _serve_admitted(self, sock: socket.socket, conn: Conn) -> None:
        self.total_connections += 1
        await self.serve_connection(sock, conn)

    def _listener_closed(self) -> bool:
        return self.listener is None or self.listener.fileno() < 0

    async def accept_loop(self, stopping: Callable[[], bool] | None = None) -> None:
        """Accept, admit through the connection limits, serve (``accept_admitted``);
        returns when an accept fails and ``stopping()`` (default: the listener was
        closed) says so."""
        assert self.listener is not None
        await accept_admitted(
            self.listener,
            self.limiter,
            self.refused_log,
            self.what,
            self._serve_admitted,
            self.connections,
            stopping or self._listener_closed,
        )

    async def close(self) -> None:
        """Close the listener and end every connection."""
        if self.listener is not None:
            self.listener.close()
        for t in self.connections:
            t.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
