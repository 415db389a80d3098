"""Background stores of an engine connector: one worker thread, at most ``limit``
stores in flight, and a caller past that waits for the oldest (backpressure the
caller counts). Shared by the vLLM KV connector and the encoder-cache store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BackgroundStores(Generic[T]):
    """Bounded background work on one thread, in submission order."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._pending: list[Future[T]] = []

    def submit(self, fn: Callable[..., T], *args: Any) -> tuple[Future[T], bool]:
        """Run ``fn(*args)`` in the background, after waiting for the oldest store
        when ``limit`` are in flight. Returns its future and whether it waited."""
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            oldest = self._pending[0] if len(self._pending) >= self.limit else None
        if oldest is not None:
            oldest.result()
        fut = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.append(fut)
        return fut, oldest is not None

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every store submitted so far (raises what one raised)."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            f.result(timeout)

    def in_flight(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._pending)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
