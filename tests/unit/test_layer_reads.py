"""``gcache_client.layers.LayerReads``: a stream's large shared-memory copies run
on one ordered thread, in the order they were handed over, never two at once; a
cancelled copy is waited for (it may be writing into the caller's buffers)."""

from __future__ import annotations

import asyncio
import threading
import time

from gcache_client.layers import LayerReads


def test_copies_run_one_at_a_time_in_the_order_handed_over() -> None:
    log: list[tuple[str, int]] = []
    busy = threading.Lock()

    def job(i: int) -> int:
        assert busy.acquire(blocking=False), "two copies at once"
        try:
            log.append(("start", i))
            time.sleep(0.002 * (5 - i))  # earlier jobs take longer
            log.append(("end", i))
        finally:
            busy.release()
        return i

    async def main() -> list[int]:
        reads = LayerReads()
        return list(await asyncio.gather(*(reads.copy(job, i) for i in range(5))))

    assert asyncio.run(main()) == list(range(5))
    assert log == [(e, i) for i in range(5) for e in ("start", "end")]


def test_a_cancelled_copy_is_waited_for() -> None:
    done = threading.Event()

    def job() -> None:
        time.sleep(0.05)
        done.set()

    async def main() -> None:
        reads = LayerReads()
        task = asyncio.create_task(reads.copy(job))
        await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert done.is_set()  # the copy had finished before the cancel returned

    asyncio.run(main())
