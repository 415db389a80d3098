"""Client per-operation paths: releases batched without a
timer armed and cancelled per read, and one awaitable awaited in place (no task)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gcache import wire
from gcache_client.conn import gather_or_cancel
from gcache_client.leases import RELEASE_FLUSH_S, ReleaseBatcher


def test_releases_ride_lookups_or_go_out_within_the_flush_window() -> None:
    sent: list[list[int]] = []

    async def call(msg: wire.Msg) -> Any:
        assert isinstance(msg, wire.Release)
        sent.append([msg.lease_id, *msg.also])
        return wire.Ok(1 + len(msg.also))

    async def run() -> None:
        b = ReleaseBatcher(call)
        b.add(1)
        b.add(2)
        timer = b._timer
        assert timer is not None
        carried = b.take()  # a Lookup carries them
        assert carried == [1, 2] and b._timer is timer  # the timer stays armed
        empty = b.take()
        empty.append(99)  # what take() hands out is never the batcher's own list
        b.add(3)  # no new timer: the armed one sends it
        assert b._timer is timer
        await asyncio.sleep(RELEASE_FLUSH_S * 5)
        assert sent == [[3]] and b._timer is None
        b.add(4)
        assert b._timer is not None  # armed again on the next add
        await b.close(1.0)
        assert sent == [[3], [4]] and b._timer is None

    asyncio.run(run())


def test_one_awaitable_runs_in_place_and_is_cancelled_where_it_waits() -> None:
    async def run() -> None:
        async def one() -> int:
            return len(asyncio.all_tasks())

        # Only the test's own task: gather_or_cancel made none for the one read.
        assert await gather_or_cancel(one()) == [1]
        started = asyncio.Event()
        cancelled = []

        async def slow() -> None:
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        outer = asyncio.ensure_future(gather_or_cancel(slow()))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert cancelled == [True]
        # Several: as before, tasks that all finish or are all cancelled.
        assert await gather_or_cancel(asyncio.sleep(0, 1), asyncio.sleep(0, 2)) == [1, 2]

    asyncio.run(run())
