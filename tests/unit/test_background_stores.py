"""Background stores of the engine connectors (gcache_client.engines.background):
at most ``limit`` in flight, a caller past that waits for the oldest, flush waits
for all and raises what a store raised."""

from __future__ import annotations

import threading

import pytest

from gcache_client.engines.background import BackgroundStores


def test_past_the_limit_a_store_waits_for_the_oldest_and_says_so() -> None:
    stores: BackgroundStores[int] = BackgroundStores(2, "t")
    gates = [threading.Event() for _ in range(3)]
    try:
        a, waited_a = stores.submit(lambda: gates[0].wait(5) and 1)
        b, waited_b = stores.submit(lambda: gates[1].wait(5) and 2)
        assert not waited_a and not waited_b and stores.in_flight() == 2
        third: list[bool] = []
        t = threading.Thread(target=lambda: third.append(stores.submit(lambda: 3)[1]))
        t.start()
        t.join(0.2)
        assert t.is_alive() and not third  # held: two in flight
        gates[0].set()
        t.join(5)
        assert third == [True] and a.result() == 1
        gates[1].set()
        stores.flush(5)
        assert b.result() == 2 and stores.in_flight() == 0
    finally:
        for g in gates:
            g.set()
        stores.shutdown()


def test_flush_raises_what_a_store_raised() -> None:
    stores: BackgroundStores[None] = BackgroundStores(4, "t")

    def boom() -> None:
        raise RuntimeError("store failed")

    try:
        stores.submit(boom)
        with pytest.raises(RuntimeError, match="store failed"):
            stores.flush(5)
    finally:
        stores.shutdown()
