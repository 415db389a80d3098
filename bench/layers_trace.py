"""Where a shared-memory ``get_layers`` spends its time: each large copy's start
and end on the copy thread, and when the caller got each full layer.
Diagnostic, not a benchmark: it wraps the client's ``copy_verify``.

    python -m bench.layers_trace [--prompt 32768]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import gcache_client.transports as aio
from gcache.benchtool.layers import zero_kv
from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from gcache_client.plans import copy_verify as _copy_verify

EVENTS: list[tuple[float, float, int]] = []


def _traced(seg: Any, sp: Any, a: int, b: int) -> bool:
    t0 = time.perf_counter()
    ok = _copy_verify(seg, sp, a, b)
    EVENTS.append((t0, time.perf_counter(), sp.nbytes))
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt", type=int, default=32768)
    args = p.parse_args()
    setattr(aio, "copy_verify", _traced)  # noqa: B010 (wraps every copy the client makes)
    with tempfile.TemporaryDirectory() as tmp:
        d = LocalDeployment(
            tmp, servers=1, capacity="2GiB", metrics_port=-1,
            meta_args=["--high-watermark", "0.95", "--low-watermark", "0.9",
                       "--max-pending-per-client", "0.9", "--max-pending-total", "0.9"],
        )  # fmt: skip
        d.start()
        try:
            cfg = d.client_config(transport="shm", timeout_s=30.0, load_or_recompute=False)
            with GCacheClient(cfg) as c:
                ns = c.register_namespace(f"trace/{time.time_ns()}", "mimo-v2-flash")
                toks = np.arange(args.prompt, dtype=np.int64)
                kv = zero_kv(ns.layout, len(toks))
                assert c.put(ns, toks, kv).ok
                out = [(np.full_like(k, 1), np.full_like(v, 1)) for k, v in kv]
                del kv

                def fetch(compute: float) -> tuple[float, float, list[tuple[float, float]]]:
                    EVENTS.clear()
                    m = c.match(ns, toks)
                    t0 = time.perf_counter()
                    got = []
                    for _ in c.get_layers(m, out):
                        ta = time.perf_counter()
                        if compute:
                            time.sleep(compute)
                        got.append((ta - t0, time.perf_counter() - t0))
                    total = time.perf_counter() - t0
                    c.release(m)
                    return t0, total, got

                transfer = statistics.median(fetch(0)[1] for _ in range(3))
                per = transfer / ns.layout.num_layers
                t0, total, got = fetch(per)
                print(f"transfer {transfer * 1e3:.1f} ms; with compute {total * 1e3:.1f} ms")
                for s, e, n in EVENTS:
                    if n > 1 << 20:
                        print(
                            f"  copy {n / 1e6:6.1f} MB "
                            f"{(s - t0) * 1e3:7.1f} -> {(e - t0) * 1e3:7.1f}"
                        )
                for i, (a, b) in enumerate(got):
                    if ns.layout.layer_group[i] == 0:
                        print(f"  layer {i:2} got {a * 1e3:7.1f} ms, done {b * 1e3:7.1f} ms")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
