"""Background loads for ``load_mode="async"`` (see :mod:`gcache_client.engines.vllm.scheduler`):
one thread per vLLM worker runs queued loads one after another and keeps their
outcomes until the worker reports them to vLLM (``get_transfer_results``)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("gcache.client.vllm")


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    run: Callable[[], str]  # loads; returns "" when every layer landed, else why not


class AsyncLoader:
    """A bounded queue of loads (``submit`` waits while ``max_pending`` are queued)
    and the set of finished ones; thread-safe."""

    def __init__(self, max_pending: int) -> None:
        self._q: queue.Queue[LoadJob | None] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._done: dict[str, str] = {}  # req_id -> "" (loaded) or why it failed
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="gcache-async-load", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob) -> None:
        self._q.put(job)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                why = job.run()
            except Exception as exc:  # any failure is a failed load, never a dead thread
                why = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._done[job.req_id] = why

    def take(self) -> dict[str, str]:
        """Loads finished since the last call: req_id -> "" or the failure."""
        with self._lock:
            out, self._done = self._done, {}
        return out

    def pending(self) -> int:
        return self._q.qsize()

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            log.warning("async loader: %d loads still queued at shutdown", self._q.qsize())
            return
        self._thread.join(timeout)
