"""Unguessable ids for puts and leases, and the wall time of a monotonic instant
(grants carry wall ms)."""

from __future__ import annotations

import os
from collections.abc import Container


def wall_ms(now: float, mono_now: float, at: float) -> int:
    """Unix ms of monotonic instant ``at``."""
    return int((now + (at - mono_now)) * 1000)


class IdSource:
    """Random non-zero 64-bit ids, unguessable (the kernel's CSPRNG), drawn
    ``batch`` at a time: one ``getrandom`` per 512 ids instead of one per id
    (``secrets.randbits``), which the meta's profile showed on every leased Lookup and put."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: list[int] = []

    def next(self, taken: Container[int], batch: int = 512) -> int:
        ids = self._ids
        while True:
            if not ids:
                raw = os.urandom(8 * batch)
                ids += (int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8))
            i = ids.pop()
            if i and i not in taken:
                return i


_PUT_IDS = IdSource()


def new_id(taken: Container[int]) -> int:
    """A random, non-zero 64-bit put id not in ``taken``: unguessable by other
    clients, and an id from before a meta restart names nothing after it."""
    return _PUT_IDS.next(taken)
