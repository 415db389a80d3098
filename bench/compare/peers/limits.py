"""Anchors: loopback TCP bandwidth (the real ``iperf3``) and memcpy bandwidth (numpy).

Rows are op "bw". ``iperf3 loopback TCP``: bytes 0 is the plain run (``-P
concurrency``, 3 s); one more 1 s run per size with ``-l SIZE`` (iperf3 caps -l
at 1 MiB for TCP, so larger sizes are skipped and said so in the bytes-0 note).
``memcpy (numpy)``: ``np.copyto`` between two preallocated, pre-faulted uint8
arrays, 1 thread, and ``concurrency`` threads when > 1 (numpy drops the GIL).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from typing import Any

from bench.compare.peers._common import Row, ensure_apt, free_port, row, stop, wait_listening

LAST_ERROR = ""
IPERF_MAX_LEN = 1 << 20  # iperf3: "block size too large (maximum = 1048576 bytes)" for TCP


def available() -> tuple[bool, str]:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False, "numpy not importable"
    try:
        ok, why = ensure_apt(["iperf3"], ["iperf3"])
    except Exception as e:  # available() never raises
        return False, f"iperf3 install check failed: {e!r}"
    return (True, "") if ok else (False, why)


def _iperf(concurrency: int, seconds: int, length: int | None) -> dict[str, Any]:
    """One iperf3 client run against a fresh one-shot server on 127.0.0.1."""
    port = free_port()
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not wait_listening(port, 5.0):
            raise RuntimeError("iperf3 server did not listen within 5 s")
        cmd = ["iperf3", "-c", "127.0.0.1", "-B", "127.0.0.1", "-p", str(port)]
        cmd += ["-t", str(seconds), "-J", "-P", str(max(1, concurrency))]
        if length is not None:
            cmd += ["-l", str(length)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 20)
        try:
            doc: dict[str, Any] = json.loads(r.stdout)
        except json.JSONDecodeError as e:
            raise RuntimeError(f"iperf3 rc {r.returncode}: {(r.stderr or r.stdout)[:200]}") from e
        if doc.get("error"):
            raise RuntimeError(f"iperf3: {doc['error']}")
        return doc
    finally:
        stop(server)


def _iperf_row(doc: dict[str, Any], nbytes: int, concurrency: int, note: str) -> Row:
    end = doc["end"]
    recv = end["sum_received"]
    rtts = [s["sender"]["mean_rtt"] for s in end.get("streams", []) if "mean_rtt" in s["sender"]]
    bits_per_s = float(recv["bits_per_second"])
    seconds = float(recv.get("seconds") or 0.0)
    r = row(
        "iperf3 loopback TCP",
        "bw",
        nbytes,
        1,
        concurrency,
        0.0,
        0.0,
        None,
        note,
        tcp_mean_rtt_us=(sum(rtts) / len(rtts)) if rtts else None,
        bytes_moved=int(recv.get("bytes", 0)),
    )
    r["bw_avg_gbps"], r["wall_s"] = round(bits_per_s / 8e9, 3), round(seconds, 3)
    return r


def _run_iperf(sizes: list[int], concurrency: int, deadline: float) -> list[Row]:
    rows: list[Row] = []
    base = f"iperf3 -c 127.0.0.1 -P {concurrency} -J; end.sum_received.bits_per_second/8"
    skipped = [s for s in sizes if s > IPERF_MAX_LEN]
    secs = max(1, min(3, int(deadline - time.monotonic()) - 1))
    doc = _iperf(concurrency, secs, None)
    note = base + f", -t {secs}, default -l (128 KiB); no per-op latency (tcp_mean_rtt_us = RTT)"
    if skipped:
        note += f"; per-size runs skipped for {skipped}: iperf3 caps -l at {IPERF_MAX_LEN} for TCP"
    rows.append(_iperf_row(doc, 0, concurrency, note))
    late = []
    for size in sizes:
        if size in skipped:
            continue
        if time.monotonic() + 2.0 > deadline:
            late.append(size)
            continue
        doc = _iperf(concurrency, 1, size)
        rows.append(_iperf_row(doc, size, concurrency, base + f", -t 1, -l {size} (buffer length)"))
    if late:
        rows[0]["note"] += f"; per-size runs skipped for {late}: seconds_cap reached"
    return rows


def _copy_loop(dst: Any, src: Any, iters: int, deadline: float, lat: list[float]) -> int:
    import numpy as np

    done = 0
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
        done += 1
        if time.perf_counter() > deadline:
            break
    return done


def _run_memcpy(sizes: list[int], iters: int, concurrency: int, cap: float) -> list[Row]:
    import numpy as np

    rows: list[Row] = []
    rng = np.random.default_rng(0)
    per_size = cap / max(1, len(sizes)) / (2 if concurrency > 1 else 1)
    for size in sizes:
        for threads in sorted({1, max(1, concurrency)}):
            pairs = []
            for _ in range(threads):
                src = rng.integers(0, 256, size, dtype=np.uint8)
                dst = np.zeros(size, dtype=np.uint8)  # zeros() + copyto below faults pages in
                np.copyto(dst, src)
                pairs.append((dst, src))
            lats: list[list[float]] = [[] for _ in range(threads)]
            counts = [0] * threads
            gate = threading.Barrier(threads + 1)
            deadline = time.perf_counter() + per_size + 1.0

            def work(
                i: int,
                lats: list[list[float]] = lats,
                counts: list[int] = counts,
                pairs: list[Any] = pairs,
                gate: threading.Barrier = gate,
                deadline: float = deadline,
            ) -> None:
                gate.wait()
                counts[i] = _copy_loop(pairs[i][0], pairs[i][1], iters, deadline, lats[i])

            ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            gate.wait()  # all threads started: time only the copies
            t0 = time.perf_counter()
            for t in ts:
                t.join()
            wall = time.perf_counter() - t0
            note = (
                f"np.copyto uint8 {size} B, {threads} thread(s) (numpy drops the GIL), each "
                "its own pre-faulted src/dst pair; bw = bytes copied / wall (each byte read "
                "once, written once)"
            )
            rows.append(
                row(
                    "memcpy (numpy)",
                    "bw",
                    size,
                    min(counts),
                    threads,
                    float(size * sum(counts)),
                    wall,
                    [x for v in lats for x in v],
                    note,
                )
            )
    return rows


def run(sizes: list[int], iters: int, concurrency: int, seconds_cap: float = 20.0) -> list[Row]:
    global LAST_ERROR
    LAST_ERROR = ""
    rows: list[Row] = []
    start = time.monotonic()
    errors: list[str] = []
    try:
        rows += _run_memcpy(sizes, iters, concurrency, min(4.0, seconds_cap * 0.25))
    except Exception as e:
        errors.append(f"memcpy: {e!r}")
    try:
        ok, why = available()
        if not ok or shutil.which("iperf3") is None:
            raise RuntimeError(why or "iperf3 not found")
        remaining = seconds_cap - (time.monotonic() - start)
        if remaining < 2.0:
            raise RuntimeError(f"only {remaining:.1f} s of seconds_cap left, iperf3 needs >= 2")
        rows += _run_iperf(sizes, concurrency, time.monotonic() + remaining)
    except Exception as e:
        errors.append(f"iperf3: {e!r}")
    LAST_ERROR = "; ".join(errors)
    return rows


if __name__ == "__main__":
    import sys

    from bench.compare.peers._common import manual

    manual(sys.modules[__name__])
