"""Lease releases, batched: a released lease rides on the client's next ``Lookup``
or goes out within ``RELEASE_FLUSH_S`` with others, as one ``Release`` message."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from gcache import wire
from gcache.errors import GCacheError

log = logging.getLogger("gcache.client")

# Releases wait for the client's next Lookup (which carries them) or this long, then
# go out as one message; past MAX_PENDING_RELEASES they go out at once.
RELEASE_FLUSH_S: Final = 0.002
MAX_PENDING_RELEASES: Final = 256


class ReleaseBatcher:
    def __init__(self, call: Callable[[wire.Msg], Awaitable[Any]]) -> None:
        self._call = call
        self._ids: list[int] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    def add(self, lease_id: int) -> None:
        if self.closed:
            return
        self._ids.append(lease_id)
        if len(self._ids) >= MAX_PENDING_RELEASES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RELEASE_FLUSH_S, self._due)

    def _due(self) -> None:
        self._timer = None
        self.flush()

    def take(self) -> list[int]:
        """The leases to release, for a ``Lookup`` to carry. The timer stays: it
        finds nothing or what was added since (one timer per ``RELEASE_FLUSH_S``,
        not a timer armed and cancelled for every read)."""
        ids = self._ids
        if not ids:
            return []  # never the list add() appends to
        self._ids = []
        return ids

    def flush(self) -> None:
        ids = self.take()
        if ids and not self.closed:
            task = asyncio.create_task(self._send(ids))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, ids: list[int]) -> None:
        try:
            await self._call(wire.Release(ids[0], ids[1:]))
        except GCacheError as exc:
            log.debug("release failed (the leases expire by themselves): %s", exc)

    async def close(self, timeout: float) -> None:
        """Send what is pending and let releases under way reach the meta."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ids and not self.closed:
            self.flush()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        self.closed = True
