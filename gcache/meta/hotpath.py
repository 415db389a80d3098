"""The meta's hot path: framed TCP (same wire module as the data plane) driving
:class:`~gcache.meta.core.MetaCore`. One request, one reply, in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from gcache import wire
from gcache.auth import Authenticator
from gcache.errors import (
    E_ACCESS_DENIED,
    E_BAD_REQUEST,
    E_NOT_LEADER,
    InvalidBody,
    PutWait,
    Refusal,
)
from gcache.meta.core import MetaCore
from gcache.meta.session import Session
from gcache.transport.daemon import Connection, FramedDaemon, Reply
from gcache.transport.framing import peek_array_field
from gcache.transport.limits import Conn, ConnectionLimiter
from gcache.transport.stream import BodyCheck, FrameStream

log = logging.getLogger("gcache.meta.hotpath")

# Replies to requests already buffered whole wait for each other (one sendmsg) up
# to these bounds.
REPLY_BATCH = 64
REPLY_BATCH_BYTES = 256 << 10


def hello(auth: Authenticator | None, session: Session, msg: wire.Hello) -> wire.Ok:
    """Authenticate ``session`` by its access token. Without tenant tokens any
    ``Hello`` is accepted and the session stays anonymous (everything allowed)."""
    if auth is None or auth.tenants is None:
        session.authenticated = True
        return wire.Ok(0)
    who = auth.principal(msg.token)
    if who is None:
        raise Refusal(E_ACCESS_DENIED, "unknown access token")
    if session.authenticated and who != session.principal:
        raise Refusal(
            E_ACCESS_DENIED, f"connection already authenticated as {session.principal.name}"
        )
    session.principal = who
    session.authenticated = True
    return wire.Ok(1)


def lookup(core: MetaCore, session: Session, msg: wire.Lookup, now: float, wait: bool) -> wire.Msg:
    for lease_id in msg.release:
        core.release(lease_id, session)
    return core.lookup(msg, now, time.time(), session)


def put_begin(
    core: MetaCore, session: Session, msg: wire.PutBegin, now: float, wait: bool
) -> wire.Msg:
    return core.put_begin(msg, now, time.time(), session, wait)


def put_commit(
    core: MetaCore, session: Session, msg: wire.PutCommit, now: float, wait: bool
) -> wire.Msg:
    return wire.Ok(core.put_commit(msg, now, session))


def put_abort(
    core: MetaCore, session: Session, msg: wire.PutAbort, now: float, wait: bool
) -> wire.Msg:
    return wire.Ok(int(core.put_abort(msg.put_id, session)))


def release(
    core: MetaCore, session: Session, msg: wire.Release, now: float, wait: bool
) -> wire.Msg:
    released = int(core.release(msg.lease_id, session))
    for lease_id in msg.also:
        released += core.release(lease_id, session)
    return wire.Ok(released)


def ping(core: MetaCore, session: Session, msg: wire.Ping, now: float, wait: bool) -> wire.Msg:
    return wire.Ok(0)


# Message type -> the function that serves it (``HELLO`` is served before the
# authentication check, by :func:`hello`).
HANDLERS: dict[int, Callable[[MetaCore, Session, Any, float, bool], wire.Msg]] = {
    wire.T_LOOKUP: lookup,
    wire.T_PUT_BEGIN: put_begin,
    wire.T_PUT_COMMIT: put_commit,
    wire.T_PUT_ABORT: put_abort,
    wire.T_RELEASE: release,
    wire.T_PING: ping,
}


def dispatch(
    core: MetaCore,
    session: Session,
    msg_type: int,
    msg: Any,
    auth: Authenticator | None = None,
    wait: bool = False,
) -> wire.Msg:
    """Run one decoded request of ``session`` against the core; returns the reply body.
    With tenant tokens (``auth.tenants``) only ``PING`` and ``HELLO`` are served
    before the session authenticated. ``wait``: a ``PutBegin`` that finds DRAM full
    while demotions in flight will make room raises ``PutWait``. A meta that may
    not serve (a standby) refuses everything with ``E_NOT_LEADER``."""
    now = time.monotonic()
    if core.not_leader is not None:
        why = core.not_leader(now)
        if why is not None:
            raise Refusal(E_NOT_LEADER, why)
    if msg_type == wire.T_HELLO:
        return hello(auth, session, msg)
    if (
        not session.authenticated
        and auth is not None
        and auth.tenants is not None
        and msg_type != wire.T_PING
    ):
        raise Refusal(E_ACCESS_DENIED, "not authenticated: send HELLO with an access token first")
    handler = HANDLERS.get(msg_type)
    if handler is None:
        raise Refusal(E_BAD_REQUEST, f"message type {msg_type} not served by the meta")
    return handler(core, session, msg, now, wait)


def key_count_check(max_keys: int) -> BodyCheck:
    """Refuse a ``Lookup``/``PutBegin`` by the declared length of its key list
    (field 1), read from the raw body before msgspec decodes a single key."""

    def check(head: wire.FrameHead, body: memoryview) -> None:
        if head.msg_type == wire.T_LOOKUP or head.msg_type == wire.T_PUT_BEGIN:
            # Fast path for the shape every client sends (a fixarray whose field 0
            # is a 16-byte bin namespace): a key list of at most 15 (a fixarray at
            # offset 19) is read off one byte; the generic peek was ~7 % of the
            # meta's CPU per 1 MiB read.
            if len(body) > 19 and 0x90 <= body[0] <= 0x9F and body[1] == 0xC4 and body[2] == 16:
                b = body[19]
                if 0x90 <= b <= 0x9F and b & 0x0F <= max_keys:
                    return
            n = peek_array_field(body, 1)
            if n is not None and n > max_keys:
                raise InvalidBody(f"{n} keys exceed max_keys_per_request ({max_keys})")

    return check


class MetaConnection(Connection):
    """One client's connection to the hot path: its session (authentication,
    puts and leases, ended with the connection)."""

    daemon: HotPathServer

    def __init__(self, daemon: FramedDaemon, stream: FrameStream, conn: Conn | None) -> None:
        super().__init__(daemon, stream, conn)
        self.session = Session(peer=str(stream.peer))

    def handle(self, head: wire.FrameHead, msg: Any) -> Reply:
        d = self.daemon
        try:
            return dispatch(d.core, self.session, head.msg_type, msg, d.auth, d.wait)
        except PutWait:
            return d.put_when_room(self.session, msg)

    async def closed(self) -> None:
        self.daemon.core.end_session(
            self.session, time.monotonic()
        )  # puts aborted, leases released


class HotPathServer(FramedDaemon):
    connection_class = MetaConnection

    def __init__(
        self, core: MetaCore, listener: socket.socket, auth: Authenticator | None = None
    ) -> None:
        cfg = core.cfg
        super().__init__(
            listener,
            what="hot-path",
            log=log,
            limiter=ConnectionLimiter.of(cfg),
            max_body=cfg.max_body_bytes,
            send_timeout=cfg.send_timeout_s,
            check_body=key_count_check(cfg.max_keys_per_request),
            reply_batch=REPLY_BATCH,
            reply_batch_bytes=REPLY_BATCH_BYTES,
        )
        self.core = core
        self.auth = auth
        self.wait = cfg.put_wait_s > 0  # a put may wait for room
        # Set (and replaced) when servers report finished demotions: puts waiting
        # for room (PutWait) try again.
        self._room = asyncio.Event()
        core.on_room = self._room_made

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "replies": self.replies, "reply_batches": self.reply_batches}

    def refused_request(self, c: Connection, head: wire.FrameHead, r: Refusal) -> None:
        self.core.counters["refused"] += 1

    def count_protocol_error(self) -> None:
        self.protocol_errors += 1
        self.core.counters["protocol_errors"] += 1

    def _room_made(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    async def put_when_room(self, session: Session, msg: Any) -> wire.Msg:
        """A ``PutBegin`` told to wait (``PutWait``: DRAM full, demotions in flight
        will free it): place it again each time servers report finished demotions
        (``core.on_room``), for at most ``meta.put_wait_s``; the last try evicts as
        a put always did. The connection's next request waits meanwhile
        (backpressure on that client only)."""
        core = self.core
        core.counters["puts_waited"] += 1
        deadline = time.monotonic() + core.cfg.put_wait_s
        while True:
            left = deadline - time.monotonic()
            if left > 0:
                # No await between the refusal and here: no report is missed.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), left)
            last = time.monotonic() >= deadline
            try:
                return dispatch(core, session, wire.T_PUT_BEGIN, msg, self.auth, not last)
            except PutWait:
                continue
