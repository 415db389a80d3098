"""Result rows of ``gcache-bench``, perftest style, and the terminal progress bar.

A run yields, per operation, its start and end time (``perf_counter`` seconds) and
its bytes. From those: iterations, BW average (all bytes over the wall time from
the first start to the last end), BW peak (the best of ten equal time windows, at
least 20 ms each), message rate and latency percentiles. GB/s means 1e9 bytes/s.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

HEADER = (
    f"{'#bytes':>10} {'#iterations':>12} {'BW peak[GB/s]':>14} {'BW average[GB/s]':>17} "
    f"{'MsgRate[Mops]':>14} {'lat p50[us]':>12} {'p99[us]':>10} {'p99.9[us]':>10}"
)


@dataclass
class Samples:
    """Per-operation timings from one client (or merged from several)."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)

    def add(self, start: float, end: float, n: int) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.nbytes.append(n)

    def extend(self, other: Samples) -> None:
        self.starts += other.starts
        self.ends += other.ends
        self.nbytes += other.nbytes

    def to_json(self) -> dict[str, list[Any]]:
        return {"starts": self.starts, "ends": self.ends, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict[str, list[Any]]) -> Samples:
        return cls(list(d["starts"]), list(d["ends"]), list(d["nbytes"]))


def summarize(op: str, transport: str, size: int, s: Samples, **extra: Any) -> dict[str, Any]:
    if not s.ends:
        return {
            "op": op,
            "transport": transport,
            "bytes": size,
            "iterations": 0,
            "bw_peak_gbps": 0.0,
            "bw_avg_gbps": 0.0,
            "mops": 0.0,
            "lat_p50_us": None,
            "lat_p99_us": None,
            "lat_p999_us": None,
            **extra,
        }
    starts = np.asarray(s.starts)
    ends = np.asarray(s.ends)
    nb = np.asarray(s.nbytes, dtype=np.float64)
    t0, t1 = float(starts.min()), float(ends.max())
    wall = max(t1 - t0, 1e-9)
    lat = (ends - starts) * 1e6
    bins = max(1, min(10, int(wall / 0.02)))
    edges = np.linspace(t0, t1, bins + 1)
    per_bin = np.histogram(ends, bins=edges, weights=nb)[0]
    peak = float(per_bin.max() / (wall / bins)) if bins > 1 else float(nb.sum() / wall)
    return {
        "op": op,
        "transport": transport,
        "bytes": size,
        "iterations": len(ends),
        "bw_peak_gbps": peak / 1e9,
        "bw_avg_gbps": float(nb.sum()) / wall / 1e9,
        "mops": len(ends) / wall / 1e6,
        "lat_p50_us": float(np.percentile(lat, 50)),
        "lat_p99_us": float(np.percentile(lat, 99)),
        "lat_p999_us": float(np.percentile(lat, 99.9)),
        "wall_s": wall,
        **extra,
    }


def format_row(r: dict[str, Any]) -> str:
    def us(x: Any) -> str:
        return f"{x:.1f}" if isinstance(x, float) else "-"

    return (
        f"{r['bytes']:>10} {r['iterations']:>12} {r['bw_peak_gbps']:>14.3f} "
        f"{r['bw_avg_gbps']:>17.3f} {r['mops']:>14.4f} {us(r['lat_p50_us']):>12} "
        f"{us(r['lat_p99_us']):>10} {us(r.get('lat_p999_us')):>10}"
    )


class Progress:
    """A one-line progress bar on stderr, only when it is a terminal."""

    def __init__(self, label: str, total: float, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self.total = max(total, 1e-9)
        self._last = 0.0

    def update(self, done: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label:<24} [{bar:<30}] {frac:6.1%}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 70 + "\r")
            self.stream.flush()
