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


def test_a_forked_child_gets_its_own_copy_thread() -> None:
    """The ordered copy thread does not survive fork(): a child that inherited the
    parent's executor would queue its copies to a thread that does not exist."""
    import os

    async def one() -> int:
        return await LayerReads().copy(lambda: 7)

    assert asyncio.run(one()) == 7  # the parent's thread exists now
    pid = os.fork()
    if pid == 0:  # child: must not hang; exit code says whether it worked
        try:
            os._exit(0 if asyncio.run(asyncio.wait_for(one(), 5)) == 7 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
