"""``gcache_client.layers.LayerReads``: a stream's large shared-memory copies take
turns in layer order, whatever order their tasks reach the copy in; a failed or
cancelled layer never leaves the layers after it waiting."""

from __future__ import annotations

import asyncio

from gcache_client.layers import LayerReads


def test_turns_follow_layer_order_not_arrival_order() -> None:
    async def main() -> list[int]:
        reads = LayerReads()
        order: list[int] = []

        async def copy(layer: int, delay: float) -> None:
            await asyncio.sleep(delay)  # layer 5 reaches its copy first
            await reads.turn(layer)
            order.append(layer)
            await asyncio.sleep(0)
            reads.passed(layer)

        await asyncio.gather(
            copy(5, 0.0), copy(3, 0.01), copy(0, 0.02), *(_pass(reads, x) for x in (1, 2, 4))
        )
        return order

    assert asyncio.run(main()) == [0, 3, 5]


async def _pass(reads: LayerReads, layer: int) -> None:
    await asyncio.sleep(0.03)  # small layers pass without a turn, late
    reads.passed(layer)


def test_a_cancelled_waiter_is_forgotten_and_passing_is_idempotent() -> None:
    async def main() -> None:
        reads = LayerReads()
        waiter = asyncio.create_task(reads.turn(2))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert waiter.cancelled()
        assert not reads._waiters  # no future left behind for layer 2
        reads.passed(1)
        reads.passed(0)
        reads.passed(0)
        assert reads.low == 2
        await asyncio.wait_for(reads.turn(2), 1)  # returns at once now

    asyncio.run(main())
