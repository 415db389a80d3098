"""NVMe rows of ``python -m bench.compare``: the directory's raw
sequential bandwidth with ``dd`` (``oflag=direct conv=fdatasync`` / ``iflag=direct``,
the object size as block size) against GCache's NVMe tier on the same directory
through a local meta + server (``gcache-bench write|read --tier nvme``: the demotion
bandwidth fed by unpaced puts over shared memory, and tier-1 reads through the
client over TCP)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

RAW = "raw disk (dd direct)"
GCACHE = "gcache (NVMe)"
GCACHE_STAGED = "gcache (NVMe, shm staging)"  # same-host reads via the staging file
DEFAULT_SIZES = "1MiB,16MiB"
# Puts in flight feeding the demotion rows: unpaced, more than the disk takes, so
# the figure is the demotion pipeline's (a put that finds DRAM full waits in the
# meta for the demotions in flight).
WRITE_QD = 4
_COPIED = re.compile(r"(\d+) bytes .*copied, ([0-9.]+) s")


def parse_dd(stderr: str) -> tuple[int, float]:
    """(bytes, seconds) from dd's summary line."""
    m = _COPIED.search(stderr)
    if m is None:
        raise RuntimeError(f"dd printed no summary: {stderr.strip()[-200:]}")
    return int(m.group(1)), float(m.group(2))


def _row(system: str, op: str, size: int, n: int, gbps: float, note: str) -> dict[str, Any]:
    return {
        "system": system,
        "op": op,
        "bytes": size,
        "iterations": n,
        "concurrency": 1,
        "bw_avg_gbps": round(gbps, 3),
        "bw_peak_gbps": round(gbps, 3),
        "lat_p50_us": None,
        "lat_p99_us": None,
        "note": note,
    }


def raw_rows(directory: str, size: int, total: int) -> list[dict[str, Any]]:
    """dd write then read of ``total`` bytes in blocks of ``size``, O_DIRECT."""
    count = max(1, total // size)
    path = os.path.join(directory, f"compare-dd-{size}.tmp")
    rows: list[dict[str, Any]] = []
    try:
        for op, cmd in (
            ("write", ["dd", "if=/dev/zero", f"of={path}", f"bs={size}", f"count={count}",
                       "oflag=direct", "conv=fdatasync"]),
            ("read", ["dd", f"if={path}", "of=/dev/null", f"bs={size}", "iflag=direct"]),
        ):  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()[-200:]}")
            nbytes, secs = parse_dd(r.stderr)
            rows.append(_row(RAW, op, size, count, nbytes / max(secs, 1e-9) / 1e9, " ".join(cmd)))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return rows


def gcache_row(
    directory: str, op: str, size: int, count: int, qd: int, transport: str = "tcp"
) -> dict[str, Any]:
    """One ``gcache-bench OP --tier nvme`` run (its own local meta + server); a read
    over ``transport`` (shm: through the server's staging file)."""
    with tempfile.TemporaryDirectory(prefix="compare-nvme-") as tmp:
        out = os.path.join(tmp, "row.json")
        args = [op, "-s", str(size), "--tier", "nvme", "-n", str(count),
                "--nvme-dir", directory, "--json", out]  # fmt: skip
        if op == "read":
            args += ["--qd", str(qd), "--transport", transport]
        else:  # unpaced puts, WRITE_QD in flight, feed the demotions (shared memory)
            args += ["--qd", str(WRITE_QD), "--transport", "auto"]
        cmd = [sys.executable, "-m", "gcache.benchtool.main", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(
                f"gcache-bench {' '.join(args)}: " + (r.stderr.strip().splitlines() or ["?"])[-1]
            )
        with open(out) as fh:
            g = json.load(fh)[0]
    what = (
        f"demotion: the meta's demoted_bytes over the time it grew ({g.get('puts_waited', 0)} "
        f"puts waited for room, {g.get('evictions', 0)} evictions)"
        if op == "write"
        else (
            f"tier-1 reads through the client over {transport.upper()}"
            + (" (the server's staging file)" if transport == "shm" else "")
            + f", {qd} in flight, checksums verified"
        )
    )
    system = GCACHE_STAGED if op == "read" and transport == "shm" else GCACHE
    return _row(system, op, size, int(g["iterations"]), g["bw_avg_gbps"],
                f"gcache-bench {' '.join(args[:-2])}: {what}")  # fmt: skip


def run(directory: str, sizes: list[int], total: int, qd: int) -> tuple[list[dict[str, Any]], str]:
    """Raw and GCache rows for every size; (rows so far, error) on a failure."""
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            t0 = time.monotonic()
            rows += raw_rows(directory, size, total)
            count = max(8, total // size)
            rqd = qd if size <= 4 << 20 else 2
            rows.append(gcache_row(directory, "write", size, count, rqd))
            for transport in ("tcp", "shm"):
                rows.append(gcache_row(directory, "read", size, count, rqd, transport))
            print(f"# nvme {size}: {time.monotonic() - t0:.1f} s", flush=True)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return rows, str(exc)
    return rows, ""
