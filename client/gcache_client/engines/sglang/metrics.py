"""The backend's counters and its per-call samples for SGLang's ``StorageMetrics``."""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any

__all__ = ["Metrics"]


class Metrics:
    """Named counters, and the pages and GB/s of each prefetch (get) and backup
    (set) call, at most ``max_samples`` of each kept between two drains."""

    def __init__(self, max_samples: int) -> None:
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        n = max_samples
        self._prefetch_pages: deque[int] = deque(maxlen=n)
        self._backup_pages: deque[int] = deque(maxlen=n)
        self._prefetch_gbps: deque[float] = deque(maxlen=n)
        self._backup_gbps: deque[float] = deque(maxlen=n)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def sample(self, is_set: bool, pages: int, page_bytes: int, secs: float) -> None:
        """One zero-copy call that moved ``pages`` pages in ``secs`` seconds."""
        gbps = pages * page_bytes / secs / (1 << 30) if secs > 0 else 0.0
        with self._lock:
            (self._backup_pages if is_set else self._prefetch_pages).append(pages)
            (self._backup_gbps if is_set else self._prefetch_gbps).append(gbps)
            self.counters["set_calls" if is_set else "get_calls"] += 1

    def storage_metrics(self) -> Any:
        """SGLang's ``StorageMetrics`` holding the samples since the last call (which
        it drains); None where SGLang's metrics module cannot load."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        m = StorageMetrics()
        with self._lock:
            m.prefetch_pgs.extend(self._prefetch_pages)
            m.backup_pgs.extend(self._backup_pages)
            m.prefetch_bandwidth.extend(self._prefetch_gbps)
            m.backup_bandwidth.extend(self._backup_gbps)
            for q in (self._prefetch_pages, self._backup_pages):
                q.clear()
            self._prefetch_gbps.clear()
            self._backup_gbps.clear()
        return m

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)
