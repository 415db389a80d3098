"""Peer measurements for ``python -m bench.compare``.

Each module named in ``PEERS`` exposes ``available() -> (ok, reason)`` and
``run(sizes, iters, concurrency, seconds_cap=20.0) -> list[dict]`` (rows with
``system, op, bytes, iterations, concurrency, bw_avg_gbps, lat_p50_us,
lat_p99_us, note``) plus a module-level ``LAST_ERROR`` string. They install
what they need (apt / pip) on first use, bind only 127.0.0.1, and are
benchmark-only: nothing under tests/ imports them.
"""

PEERS: list[str] = ["limits", "redis_peer", "mooncake_peer"]

__all__ = ["PEERS"]
