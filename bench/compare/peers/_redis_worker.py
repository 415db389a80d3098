"""One redis-py client process of the Redis peer: ``python -m`` this ``PORT IDX``.

Connects, prints "ready", then per JSON line on stdin ({size, op, iters, budget,
start_at}) waits for ``start_at`` (CLOCK_MONOTONIC, shared by all processes), runs
SET or GET ``iters`` times (bounded by ``budget`` seconds) and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import redis


def main(port: int, idx: int) -> None:
    cli = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60.0)
    cli.ping()  # connect before any timing
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        size, op = int(cmd["size"]), cmd["op"]
        key, val = f"bench:{size}:{idx}", os.urandom(size)
        lat: list[float] = []
        err = ""
        while time.perf_counter() < cmd["start_at"]:
            time.sleep(0.0005)
        t_start = time.perf_counter()
        deadline = t_start + cmd["budget"]
        try:
            for _ in range(cmd["iters"]):
                t0 = time.perf_counter_ns()
                if op == "write":
                    cli.set(key, val)
                else:
                    got = cli.get(key)
                    if not isinstance(got, bytes) or len(got) != size:
                        raise RuntimeError(f"GET {key}: {got if got is None else len(got)}")
                lat.append((time.perf_counter_ns() - t0) / 1e3)
                if time.perf_counter() > deadline:
                    break
        except Exception as e:
            err = repr(e)
        out = {"lat": lat, "t0": t_start, "t1": time.perf_counter(), "err": err}
        print(json.dumps(out), flush=True)
    cli.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
