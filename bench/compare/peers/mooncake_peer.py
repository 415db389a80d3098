"""Mooncake Store over TCP (PyPI ``mooncake-transfer-engine-non-cuda``, CPU only).

``mooncake_master`` (RPC + metrics on 127.0.0.1, HTTP metadata server off), a
*storage* process (``setup(... global_segment_size=2 GiB, "P2PHANDSHAKE", "tcp")``)
and a *client* process (``global_segment_size=0``) timing ``batch_put_from`` /
``batch_get_into`` from one registered buffer, ``concurrency`` keys per batch; then
the storage process runs the loop on its own segment: "mooncake (local memcpy)".
The engine's handshake and TCP data listeners bind 0.0.0.0 / [::] whatever we pass
(0.3.13), so when root can ``unshare -n``, everything runs in a private network
namespace with only ``lo``. The child processes live in ``_mooncake_roles``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from bench.compare.peers import _common as c
from bench.compare.peers._common import Row

LAST_ERROR = ""
LAST_LISTENERS: list[str] = []  # TCP listeners seen while the client ran (inside the namespace)
PIP_NAME = "mooncake-transfer-engine-non-cuda"
ROLES = "bench.compare.peers._mooncake_roles"


def _import_check() -> str:
    """'' when ``import mooncake.store`` works in a fresh interpreter, else its error."""
    r = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=120
    )
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def _master_bin() -> str | None:
    cands = [
        os.path.join(os.path.dirname(sys.executable), "mooncake_master"),
        shutil.which("mooncake_master") or "",
    ]
    return next((x for x in cands if x and os.access(x, os.X_OK)), None)


def available() -> tuple[bool, str]:
    try:
        ok, why = c.ensure_pip("mooncake", PIP_NAME)
        if not ok:
            return False, why
        err = _import_check()
        if "libibverbs" in err:  # the wheel links libibverbs.so.1 even without RDMA
            apt_err = c.apt_install(["libibverbs1"])
            err = f"{err} ({apt_err})" if apt_err else _import_check()
        if err:
            return False, f"import mooncake.store fails: {err}"
        if _master_bin() is None:
            return False, "mooncake_master console script not found"
        return True, ""
    except Exception as e:  # available() never raises
        return False, f"mooncake check failed: {e!r}"


def _netns_ok() -> bool:
    """Can we run the whole thing in a private network namespace with only ``lo``?"""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    probe = ["unshare", "-n", "--", "ip", "link", "set", "lo", "up"]
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


def run(sizes: list[int], iters: int, concurrency: int, seconds_cap: float = 20.0) -> list[Row]:
    global LAST_ERROR, LAST_LISTENERS
    LAST_ERROR, LAST_LISTENERS = "", []
    if not sizes:
        return []
    ok, why = available()
    master = _master_bin()
    if not ok or master is None:
        LAST_ERROR = why or "mooncake_master not found"
        return []
    arg = {
        "sizes": sizes,
        "iters": iters,
        "conc": max(1, concurrency),
        "cap": seconds_cap,
        "t0": time.monotonic(),
        "master_bin": master,
    }
    cmd = [sys.executable, "-m", ROLES, "driver", json.dumps(arg)]
    netns = _netns_ok() and not os.environ.get("PEER_MOONCAKE_HOST_NETNS")
    if netns:
        cmd = ["unshare", "-n", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=c.child_env(),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=seconds_cap + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: driver, master, storage, client
        proc.communicate()
        LAST_ERROR = f"mooncake run exceeded {seconds_cap + 60:.0f} s and was killed"
        return []
    try:
        res = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        LAST_ERROR = f"driver rc {proc.returncode}: {err.strip()[-300:]}"
        return []
    LAST_LISTENERS = res["listeners"]
    where = (
        "private network namespace (unshare -n, lo only)"
        if netns
        else "host network namespace: engine listeners on 0.0.0.0/[::] are reachable"
    )
    for r in res["rows"]:
        r["note"] += f"; run in a {where}"
    LAST_ERROR = "; ".join(res["errors"])
    return list(res["rows"])


if __name__ == "__main__":
    c.manual(sys.modules[__name__])
