"""Merging the servers' report streams by block position (meta rebuild).

After a meta restart every server streams its manifest at once, each in block
position order, and a block's parent is usually on another server. Adopted chunk
by chunk as they arrive, the rows of a chunk past the position the other streams
have reached find no parent yet: they are deferred and retried, at about twice the
cost of a row adopted at once (1M blocks of mixed 4k-128k-token prompts on 4
servers: about half of the rows). :class:`StreamMerge` holds those rows instead,
in columns, and hands them out with the rows of the other streams' later chunks
once every stream in progress has passed their position; :func:`in_order` puts
rows of several streams in block position order for one adoption pass.

A stream's position is the position of the last row it sent: it has sent every
row before it. Holding is only about speed: the adoption still checks every
row's parent, so a server that does not send in order, or one that never
reports, costs retries, never a wrong index. Held rows are bounded
(``max_rows``, all streams together); the caller takes a stream's rows whole at
its end and when it stalls. Plain bookkeeping, no I/O, no clock of its own.
"""

from __future__ import annotations

from typing import Final, TypeVar

import numpy as np

from gcache.meta.records import ServerRecord
from gcache.storage.columns import Columns, concat, split

# Rows held, all streams together; past it a chunk is handed out whole.
MAX_HELD_ROWS: Final = 1 << 17
NO_LIMIT: Final = 1 << 62
# Rows a stream may have held before the report pacer holds the stream itself
# (``Rebuild.deferred_of``): two chunks of 2048.
PACE_SLACK_ROWS: Final = 4096

Part = tuple[ServerRecord, Columns]
T = TypeVar("T")


class StreamMerge:
    """The rows held of each report stream, and each stream's position."""

    def __init__(self, max_rows: int = MAX_HELD_ROWS) -> None:
        self.max_rows = max_rows
        # server id -> (server, its held rows in block order, when it last sent)
        self._held: dict[str, tuple[ServerRecord, Columns, float]] = {}
        self._front: dict[str, int] = {}  # server id -> position of its last row
        self.rows = 0  # held, all streams
        self.chunks = 0  # chunks merged
        self.held_total = 0  # rows ever held

    def push(self, srv: ServerRecord, cols: Columns, last: bool, now: float) -> list[Part]:
        """A chunk of ``srv``'s stream (``last``: its final one): hold its rows
        past every stream's position and return what is no longer held, of every
        stream (this one's first unless empty), each part in block order."""
        sid = srv.server_id
        held, front = self._held, self._front
        self.chunks += 1
        prev = held.pop(sid, None)
        if prev is not None:
            self.rows -= len(prev[1])
            cols = in_order(concat([prev[1], cols]))[0]
        if last:
            front.pop(sid, None)
        elif len(cols):
            front[sid] = max(int(cols.arrays.pos[-1]), front.get(sid, 0))
        limit = min(front.values(), default=NO_LIMIT)
        if self.rows + len(cols) > self.max_rows:
            limit = NO_LIMIT  # hold nothing more
        k = len(cols) if last else _upto(cols, limit)
        head, rest = split(cols, k)
        parts: list[Part] = [(srv, head)]
        if len(rest):
            held[sid] = (srv, rest, now)
            self.rows += len(rest)
            self.held_total += len(rest)
        for osid, (osrv, ocols, osince) in list(held.items()):
            if osid == sid:
                continue
            k = _upto(ocols, limit) if osrv.alive else len(ocols)
            if not k:
                continue
            del held[osid]
            self.rows -= len(ocols)
            head, rest = split(ocols, k)
            if osrv.alive:
                parts.append((osrv, head))
            if len(rest):
                held[osid] = (osrv, rest, osince)
                self.rows += len(rest)
        return parts

    def take(self, server_id: str) -> Part | None:
        """Every row held of ``server_id``'s stream, which ends (or stalled)."""
        self._front.pop(server_id, None)
        got = self._held.pop(server_id, None)
        if got is None:
            return None
        self.rows -= len(got[1])
        return got[0], got[1]

    def held_of(self, server_id: str) -> int:
        got = self._held.get(server_id)
        return len(got[1]) if got is not None else 0

    def stalled(self, now: float, after_s: float) -> list[str]:
        """Streams with rows held that sent nothing for ``after_s``."""
        return [sid for sid, (_, _, t) in self._held.items() if t < now - after_s]

    def holds(self, server_id: str) -> bool:
        return server_id in self._held

    def stats(self) -> dict[str, int]:
        return {
            "report_rows_held": self.rows,
            "report_rows_held_total": self.held_total,
            "report_chunks_merged": self.chunks,
        }


def _upto(cols: Columns, limit: int) -> int:
    """How many leading rows of ``cols`` are at positions up to ``limit``."""
    return int(np.searchsorted(cols.arrays.pos, limit, side="right"))


def in_order(cols: Columns, servers: list[T] | None = None) -> tuple[Columns, list[T] | None]:
    """``cols`` (and ``servers``, something per row: its server, its chunk) in
    block position order, stable; as they are when already so."""
    pos = cols.arrays.pos
    if pos.size < 2 or bool((pos[1:] >= pos[:-1]).all()):
        return cols, servers
    order = np.argsort(pos, kind="stable")
    out = cols.take(order)
    return out, (None if servers is None else [servers[i] for i in order.tolist()])


def merged(parts: list[Part]) -> tuple[Columns, list[ServerRecord]]:
    """Parts of several streams as one run in block order, and each row's server."""
    if len(parts) == 1:
        srv, cols = parts[0]
        return cols, [srv] * len(cols)
    cols = concat([c for _, c in parts])
    servers = [s for s, c in parts for _ in range(len(c))]
    out, srvs = in_order(cols, servers)
    assert srvs is not None
    return out, srvs
