"""Pacing the servers' report streams by block position (meta rebuild).

After a meta restart every server streams its manifest at once, each sorted by
block position; a block's parent is usually on another server. A stream that runs
ahead of the others sends records whose parents have not arrived yet, and each of
those is parked and adopted later at about twice the cost of one adopted at once
(1M blocks on 4 servers: about half of them, with unpaced streams). So a stream
whose last chunk left records waiting for a parent is not read further until
those records were adopted (another stream's chunk brought their parents), or
every other stream in progress is waiting too (someone must go on), or
:data:`MAX_HOLD_S` passed. gRPC's flow control holds the server's next chunks
meanwhile. A stream whose waits were :data:`MAX_VAIN` times in vain (a server that
does not send in block order: holding it only idles the meta) is not held again.
The decision is :func:`hold`, plain code; :class:`ReportPacer` only drives it on
the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final

MAX_HOLD_S: Final = 0.25  # longest a stream waits after one chunk
MAX_VAIN: Final = 2  # a stream whose waits were in vain this often is not held again


def hold(waiting_records: int, streams_waiting: int, streams_active: int, held_s: float) -> bool:
    """Whether a stream whose last chunk left ``waiting_records`` records waiting
    for a parent should wait before its next chunk (``streams_waiting`` other
    streams wait already, ``streams_active`` are in progress, this one included)."""
    return waiting_records > 0 and streams_waiting < streams_active - 1 and held_s < MAX_HOLD_S


class ReportPacer:
    """Counts the report streams in progress and wakes the waiting ones whenever a
    chunk was adopted or a stream started, ended or began to wait."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.active = 0
        self.waiting = 0
        self.holds = 0  # chunks after which a stream waited
        self.vain = 0  # waits that ended with records still waiting
        self.held_s = 0.0
        self._changed = asyncio.Event()

    def started(self) -> None:
        self.active += 1
        self.changed()

    def ended(self) -> None:
        self.active -= 1
        self.changed()

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def pace(self, waiting_records: Callable[[], int]) -> bool:
        """Wait while :func:`hold` says so. False when it waited in vain (records
        still wait for a parent: a stream that does not come in block order, whose
        caller stops pacing it, see :data:`MAX_VAIN`)."""
        t0 = self.clock()
        if not hold(waiting_records(), self.waiting, self.active, 0.0):
            return True
        self.holds += 1
        self.waiting += 1
        self.changed()
        try:
            while True:
                held = self.clock() - t0
                left = waiting_records()
                if not hold(left, self.waiting - 1, self.active, held):
                    if left:
                        self.vain += 1
                    return left == 0
                try:
                    await asyncio.wait_for(self._changed.wait(), MAX_HOLD_S - held)
                except TimeoutError:
                    pass
        finally:
            self.waiting -= 1
            self.held_s += self.clock() - t0
            self.changed()
