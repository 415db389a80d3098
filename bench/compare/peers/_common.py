"""Helpers shared by the peer modules: installs, free ports, rows, percentiles."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

Row = dict[str, Any]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def child_env() -> dict[str, str]:
    """Environment for ``sys.executable -m bench.compare.peers...`` children."""
    path = [REPO, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listeners() -> list[str]:
    """Every listening TCP socket of this network namespace as "addr:port" (from /proc)."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            p = ln.split()
            if len(p) < 4 or p[3] != "0A":
                continue
            ip, port = p[1].rsplit(":", 1)
            if len(ip) == 8:
                addr = ".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                addr = "[::]" if set(ip) == {"0"} else f"[{ip}]"
            out.append(f"{addr}:{int(port, 16)}")
    return sorted(out)


def is_listening(port: int) -> bool:
    """True when something listens on TCP ``port`` (read from /proc, no connection made)."""
    return any(x.rsplit(":", 1)[1] == str(port) for x in listeners())


def wait_listening(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_listening(port):
            return True
        time.sleep(0.02)
    return False


def wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def apt_install(packages: Sequence[str]) -> str:
    """``apt-get install -y`` (refreshing the lists once on failure); '' or the error."""
    if shutil.which("apt-get") is None:
        return "no apt-get"
    if os.geteuid() != 0:
        return f"installing {' '.join(packages)} needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", *packages]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if r.returncode != 0:  # stale or empty package lists: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        return f"apt-get install {' '.join(packages)} failed: {e}"
    tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
    return "" if r.returncode == 0 else f"apt-get install {' '.join(packages)}: {tail[0]}"


def ensure_apt(binaries: Sequence[str], packages: Sequence[str]) -> tuple[bool, str]:
    """Install Debian ``packages`` unless every binary in ``binaries`` is on PATH."""
    if all(shutil.which(b) for b in binaries):
        return True, ""
    err = apt_install(packages)
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        return False, f"{missing} missing" + (f" ({err})" if err else "")
    return True, ""


def ensure_pip(module: str, requirement: str) -> tuple[bool, str]:
    """Find ``module`` (without importing it), else pip-install ``requirement`` here."""
    if importlib.util.find_spec(module) is not None:
        return True, ""
    cmd = [sys.executable, "-m", "pip", "install", "-q", requirement]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"pip install {requirement} failed: {e}"
    importlib.invalidate_caches()
    if importlib.util.find_spec(module) is not None:
        return True, ""
    err = [ln for ln in r.stderr.splitlines() if "ERROR" in ln][-1:] or [r.stderr.strip()[-200:]]
    return False, f"pip install {requirement} (rc {r.returncode}): {err[0]}"


def pct(values_us: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..100) of ``values_us``; None when empty."""
    if not values_us:
        return None
    s = sorted(values_us)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return round(float(s[k]), 1)


def row(
    system: str,
    op: str,
    nbytes: int,
    iterations: int,
    concurrency: int,
    total_bytes: float,
    wall_s: float,
    lat_us: Sequence[float] | None,
    note: str,
    **extra: Any,
) -> Row:
    """One result row; bandwidth is ``total_bytes / wall_s`` in GB/s (1e9 bytes/s)."""
    bw = total_bytes / wall_s / 1e9 if wall_s > 0 and total_bytes > 0 else 0.0
    return {
        "system": system,
        "op": op,
        "bytes": int(nbytes),
        "iterations": int(iterations),
        "concurrency": int(concurrency),
        "bw_avg_gbps": round(bw, 3),
        "lat_p50_us": pct(lat_us, 50) if lat_us else None,
        "lat_p99_us": pct(lat_us, 99) if lat_us else None,
        "note": note,
        "wall_s": round(wall_s, 4),
        **extra,
    }


def stop(proc: subprocess.Popen[Any] | None, timeout: float = 5.0) -> None:
    """Terminate a child we started, then kill it if it does not exit."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def manual(mod: ModuleType, sizes: Sequence[int] = (65536, 1048576, 4194304)) -> None:
    """``python -m bench.compare.peers.X``: available(), one run, rows as JSON lines."""
    print("available:", mod.available(), file=sys.stderr)
    t0 = time.monotonic()
    for r in mod.run(list(sizes), 200, 4):
        print(json.dumps(r))
    print(f"LAST_ERROR={mod.LAST_ERROR!r} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
