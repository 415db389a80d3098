"""Redis peer: a private ``redis-server`` on 127.0.0.1, measured two ways.

``redis (redis-py)``: ``concurrency`` client processes (``_redis_worker``; with
threads, large GETs serialize on the GIL in redis-py's parser), one connection
each, SET (write) then GET (read) of a random value of each size, every op timed.
``redis-benchmark``: the C tool, ``-t set,get -d SIZE -c concurrency``, N capped
from the redis-py rate so it fits the time budget.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.compare.peers import _common as c
from bench.compare.peers._common import Row, row, stop

LAST_ERROR = ""
BENCH_MAX_D = 1 << 30  # redis-benchmark silently clamps -d to 1 GiB
BULK_MAX = 512 << 20  # server default proto-max-bulk-len


def available() -> tuple[bool, str]:
    try:
        ok, why = c.ensure_apt(["redis-server", "redis-benchmark"], ["redis-server", "redis-tools"])
        if not ok:
            return False, why
        return c.ensure_pip("redis", "redis")
    except Exception as e:  # available() never raises
        return False, f"redis setup check failed: {e!r}"


def _start_server(tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    import redis

    port = c.free_port()
    args = f"--port {port} --bind 127.0.0.1 --appendonly no --protected-mode no --dir {tmp}"
    cmd = ["redis-server", *args.split(), "--save", "", "--logfile", os.path.join(tmp, "log")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0) as cli:
                if cli.ping():
                    return proc, port
        except redis.exceptions.RedisError:
            time.sleep(0.05)
    stop(proc)
    raise RuntimeError("redis-server did not answer PING within 10 s")


def _start_workers(port: int, conc: int, procs: list[subprocess.Popen[str]]) -> None:
    """Start ``conc`` client processes into ``procs`` (so the caller can always stop them)."""
    for i in range(conc):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.compare.peers._redis_worker", str(port), str(i)],
                env=c.child_env(),
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        )
    for p in procs:
        if p.stdout is None or p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"redis-py worker failed to start (rc {p.poll()})")


def _py_phase(
    procs: list[subprocess.Popen[str]], size: int, op: str, iters: int, budget: float
) -> Row:
    start_at = time.perf_counter() + 0.2  # CLOCK_MONOTONIC: comparable across processes
    cmd = json.dumps(
        {"size": size, "op": op, "iters": iters, "budget": budget, "start_at": start_at}
    )
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
    res = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"redis-py worker died (rc {p.poll()})")
        res.append(json.loads(line))
    errors = [r["err"] for r in res if r["err"]]
    if errors:
        raise RuntimeError(f"redis-py {op} {size}: {errors[0]}")
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    counts = [len(r["lat"]) for r in res]
    conc = len(procs)
    parser = "hiredis" if _has_hiredis() else "pure-Python RESP parser"
    note = (
        f"redis-py {_redis_version()} ({parser}), {conc} client processes (threads would "
        "serialize on the GIL in the reply parser), 1 connection each, "
        f"{'SET' if op == 'write' else 'GET'} of a {size} B random value per op, each op "
        "timed; bw = bytes / (last end - first start)"
    )
    return row(
        "redis (redis-py)",
        op,
        size,
        min(counts),
        conc,
        float(size * sum(counts)),
        wall,
        [x for r in res for x in r["lat"]],
        note,
        total_ops=sum(counts),
    )


def _has_hiredis() -> bool:
    return importlib.util.find_spec("hiredis") is not None


def _redis_version() -> str:
    import redis

    return str(getattr(redis, "__version__", "?"))


def _benchmark(port: int, size: int, n: int, conc: int, timeout: float) -> list[Row]:
    cmd = [
        "redis-benchmark",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-t",
        "set,get",
        "-d",
        str(size),
        "-n",
        str(n),
        "-c",
        str(conc),
        "--csv",
        "--precision",
        "3",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(2.0, timeout))
    if r.returncode != 0:
        raise RuntimeError(f"redis-benchmark rc {r.returncode}: {r.stderr.strip()[:200]}")
    rows: list[Row] = []
    for rec in csv.DictReader(io.StringIO(r.stdout)):
        test = rec.get("test", "")
        if test not in ("SET", "GET"):
            continue
        rps = float(rec["rps"]) or 1e-9
        note = (
            f"redis-benchmark -t set,get -d {size} -n {n} -c {conc} --csv; bw = rps x d; "
            "p50/p99 are the tool's: from first request byte sent to first reply byte read "
            "(so a large GET's latency excludes most of the value transfer)"
        )
        rw = row(
            "redis-benchmark",
            "write" if test == "SET" else "read",
            size,
            n // conc,
            conc,
            0.0,
            0.0,
            None,
            note,
            total_ops=n,
        )
        rw["bw_avg_gbps"], rw["wall_s"] = round(rps * size / 1e9, 3), round(n / rps, 4)
        rw["lat_p50_us"] = round(float(rec["p50_latency_ms"]) * 1e3, 1)
        rw["lat_p99_us"] = round(float(rec["p99_latency_ms"]) * 1e3, 1)
        rows.append(rw)
    return rows


def run(sizes: list[int], iters: int, concurrency: int, seconds_cap: float = 20.0) -> list[Row]:
    global LAST_ERROR
    LAST_ERROR = ""
    if not sizes:
        return []
    ok, why = available()
    if not ok:
        LAST_ERROR = why
        return []
    conc = max(1, concurrency)
    start = time.monotonic()
    rows: list[Row] = []
    errors: list[str] = []
    proc: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[str]] = []
    tmp = tempfile.mkdtemp(prefix="peer-redis-")
    try:
        proc, port = _start_server(tmp)
        _start_workers(port, conc, workers)
        py_slice = 0.6 * seconds_cap / max(1, 2 * len(sizes))
        rates: dict[int, float] = {}
        for size in sizes:
            if size > BULK_MAX:
                errors.append(f"size {size} > proto-max-bulk-len {BULK_MAX}: skipped")
                continue
            w = _py_phase(workers, size, "write", iters, py_slice)
            rd = _py_phase(workers, size, "read", iters, py_slice)
            rows += [w, rd]
            rates[size] = (w["total_ops"] + rd["total_ops"]) / max(1e-6, w["wall_s"] + rd["wall_s"])
        if shutil.which("redis-benchmark") is None:
            errors.append("redis-benchmark not found: its rows skipped")
        else:
            for idx, size in enumerate(sizes):
                left = seconds_cap - (time.monotonic() - start)
                if size > BENCH_MAX_D or size not in rates:
                    errors.append(f"redis-benchmark: size {size} skipped (over -d / bulk limit)")
                    continue
                if left < 1.0:
                    errors.append(f"redis-benchmark: size {size} skipped, seconds_cap reached")
                    continue
                budget = left / (len(sizes) - idx)
                n = min(iters * conc, max(conc, int(rates[size] * budget * 0.5)))
                n -= n % conc
                rows += _benchmark(port, size, max(n, conc), conc, left)
    except Exception as e:
        errors.append(repr(e))
    finally:
        for w_proc in workers:
            if w_proc.stdin is not None:
                w_proc.stdin.close()  # EOF ends the worker loop
        for w_proc in workers:
            stop(w_proc)
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    LAST_ERROR = "; ".join(errors)
    return rows


if __name__ == "__main__":
    from bench.compare.peers._common import manual

    manual(sys.modules[__name__])
