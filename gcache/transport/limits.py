"""Connection limits and rate-limited logging for the daemons' listeners.

The decisions are plain synchronous code with an injected clock
(:class:`ConnectionLimiter`, :class:`RateLimitedLog`); :func:`idle_sweeper` and
:func:`refuse` are the thin asyncio/socket drivers the daemons' accept loops use.

* at most ``max_connections`` open connections per daemon and
  ``max_connections_per_peer`` per peer address; an excess connection is accepted,
  answered with one ``ERROR`` frame and closed at once;
* a connection that waits for a frame longer than ``idle_timeout_s`` (nothing of it
  in flight: no request being handled or answered) is closed; one whose peer takes
  no byte of a reply for ``send_timeout_s`` is closed by its stream
  (:class:`~gcache.errors.SendTimeout`) and counted here;
* lines a peer can provoke (bad frames, refused connections) are logged at a
  bounded rate, with a count of the lines left out.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from gcache import wire
from gcache.errors import E_BUSY


def peer_host(addr: Any) -> str:
    """The address part of a socket peer (connections are counted per host)."""
    if isinstance(addr, tuple) and addr:
        return str(addr[0])
    return str(addr)


class Conn:
    """One admitted connection: its peer, whether it waits for a frame (and
    since when), and how to close it."""

    __slots__ = ("close", "idle_since", "peer")

    def __init__(self, peer: str, close: Callable[[], None], now: float) -> None:
        self.peer = peer
        self.close = close
        # Monotonic time since which the connection waits for a frame with nothing
        # in flight; None while a request of it is being handled or answered.
        self.idle_since: float | None = now


class ConnectionSettings(Protocol):
    """The connection limits every daemon's config carries (same names in each)."""

    @property
    def max_connections(self) -> int: ...
    @property
    def max_connections_per_peer(self) -> int: ...
    @property
    def idle_timeout_s(self) -> float: ...


class ConnectionLimiter:
    """Admission and idle bookkeeping for one daemon's connections. Bounded: it
    holds at most ``max_connections`` entries and one counter per peer with an
    open connection."""

    @classmethod
    def of(cls, cfg: ConnectionSettings) -> ConnectionLimiter:
        """The limiter a daemon's config asks for."""
        return cls(cfg.max_connections, cfg.max_connections_per_peer, cfg.idle_timeout_s)

    def __init__(self, max_connections: int, max_per_peer: int, idle_timeout_s: float) -> None:
        if not 1 <= max_per_peer <= max_connections:
            raise ValueError("need 1 <= max_per_peer <= max_connections")
        if idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be positive")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.idle_timeout_s = idle_timeout_s
        self._open: set[Conn] = set()
        self._per_peer: dict[str, int] = {}
        self.accepted = 0
        self.refused_total = 0  # refused: the daemon was at max_connections
        self.refused_peer = 0  # refused: that peer was at max_connections_per_peer
        self.idle_closed = 0
        self.send_timeouts = 0  # closed: the peer took no reply byte for send_timeout_s

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, peer: str, close: Callable[[], None], now: float) -> Conn | str:
        """A :class:`Conn` for an admitted connection, or why it is refused."""
        if len(self._open) >= self.max_connections:
            self.refused_total += 1
            return f"{len(self._open)} connections open (max_connections {self.max_connections})"
        n = self._per_peer.get(peer, 0)
        if n >= self.max_per_peer:
            self.refused_peer += 1
            return f"{n} connections from {peer} (max_connections_per_peer {self.max_per_peer})"
        self._per_peer[peer] = n + 1
        conn = Conn(peer, close, now)
        self._open.add(conn)
        self.accepted += 1
        return conn

    def release(self, conn: Conn) -> None:
        """The connection ended (any reason); idempotent."""
        if conn in self._open:
            self._open.discard(conn)
            n = self._per_peer[conn.peer] - 1
            if n:
                self._per_peer[conn.peer] = n
            else:
                del self._per_peer[conn.peer]

    def expired(self, now: float) -> list[Conn]:
        """Connections idle for longer than the timeout; they count as closed for
        being idle and leave the table (the caller closes them)."""
        limit = now - self.idle_timeout_s
        out = [c for c in self._open if c.idle_since is not None and c.idle_since <= limit]
        for c in out:
            self.release(c)
        self.idle_closed += len(out)
        return out

    def stats(self) -> dict[str, int]:
        return {
            "connections_open": len(self._open),
            "connections_accepted": self.accepted,
            "connections_refused": self.refused_total + self.refused_peer,
            "connections_refused_per_peer": self.refused_peer,
            "connections_idle_closed": self.idle_closed,
            "connections_send_timeouts": self.send_timeouts,
            "peers_connected": len(self._per_peer),
        }


class RateLimitedLog:
    """A token bucket in front of a logger: at most ``burst`` lines at once and
    ``per_s`` lines a second after that; the next line that gets through says how
    many were left out. For lines a remote peer can provoke at will."""

    def __init__(
        self,
        logger: logging.Logger,
        per_s: float = 1.0,
        burst: int = 10,
        level: int = logging.WARNING,
    ) -> None:
        if per_s <= 0 or burst < 1:
            raise ValueError("need per_s > 0 and burst >= 1")
        self.logger = logger
        self.per_s = per_s
        self.burst = burst
        self.level = level
        self._tokens = float(burst)
        self._last: float | None = None
        self._pending_suppressed = 0
        self.logged = 0
        self.suppressed = 0

    def allow(self, now: float) -> bool:
        """Take a token if one is left (pure decision; no logging)."""
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def log(self, now: float, msg: str, *args: object) -> bool:
        """Log ``msg % args`` if the rate allows; True if it was written."""
        if not self.allow(now):
            self.suppressed += 1
            self._pending_suppressed += 1
            return False
        if self._pending_suppressed:
            msg += " (%d similar lines suppressed)"
            args = (*args, self._pending_suppressed)
            self._pending_suppressed = 0
        self.logged += 1
        self.logger.log(self.level, msg, *args)
        return True

    def stats(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_logged": self.logged, f"{prefix}_suppressed": self.suppressed}


def refuse(sock: socket.socket, reason: str) -> None:
    """Answer an excess connection with one ``ERROR(E_BUSY)`` frame (request id 0;
    best effort, never blocking) and close it."""
    frame = wire.pack_frame(wire.Error(E_BUSY, f"connection refused: {reason}"))
    try:
        sock.setblocking(False)
        sock.send(frame)
    except OSError:
        pass
    finally:
        sock.close()


async def idle_sweeper(
    limiter: ConnectionLimiter, clock: Callable[[], float] = time.monotonic
) -> None:
    """Close connections idle past the limiter's timeout, checking a few times
    per timeout period (at least once a second)."""
    period = min(1.0, limiter.idle_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        for conn in limiter.expired(clock()):
            conn.close()


async def accept_admitted(
    listener: socket.socket,
    limiter: ConnectionLimiter,
    refused_log: RateLimitedLog,
    what: str,
    serve: Callable[[socket.socket, Conn], Any],
    tasks: set[asyncio.Task[None]],
    stopping: Callable[[], bool],
) -> None:
    """The accept loop every framed daemon runs: accept, admit through ``limiter``
    (an excess connection gets one ``ERROR(E_BUSY)`` frame and is closed, logged at
    ``refused_log``'s rate), serve each admitted one as a task kept in ``tasks``,
    and close idle connections meanwhile. Returns when ``stopping()`` says an
    accept failed because the listener was closed."""
    loop = asyncio.get_running_loop()
    prefix = f"{what}: " if what else ""
    sweeper = asyncio.create_task(idle_sweeper(limiter))
    try:
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:
                if stopping():
                    return
                refused_log.log(time.monotonic(), "%saccept failed: %s", prefix, exc)
                await asyncio.sleep(0.05)
                continue
            now = time.monotonic()
            conn = limiter.admit(peer_host(addr), sock.close, now)
            if isinstance(conn, str):
                refused_log.log(now, "%srefused a connection from %s: %s", prefix, addr, conn)
                refuse(sock, conn)
                continue
            task = asyncio.create_task(serve(sock, conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        sweeper.cancel()
