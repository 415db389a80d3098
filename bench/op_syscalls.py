"""System calls and context switches per operation, per process.

Starts a local meta + one server, runs ``gcache-bench``'s own TCP read and write
operations (1 MiB by default, ``--qd`` in flight) and counts, with ``perf stat``
tracepoints attached to the client (this process), the server and the meta for the
timed part only: ``sendmsg``, ``recvmsg``, ``recvfrom``, ``epoll_ctl``,
``epoll_pwait``, ``getpid`` (asyncio's running-loop check) and context
switches. Unlike times, these counts barely move with the machine's load, so two
trees can be compared on a busy machine.

    python -m bench.op_syscalls --size 1MiB -n 1000 --json F
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Any

import uvloop

from gcache.benchtool import ops
from gcache.cli.deploy import LocalDeployment
from gcache.config import parse_size
from gcache_client import AsyncGCacheClient

EVENTS = [
    "syscalls:sys_enter_sendmsg",
    "syscalls:sys_enter_recvmsg",
    "syscalls:sys_enter_recvfrom",
    "syscalls:sys_enter_epoll_ctl",
    "syscalls:sys_enter_epoll_pwait",
    "syscalls:sys_enter_getpid",
    "context-switches",
]


class _Quiet:
    def update(self, *_: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _perf(pid: int, path: str) -> subprocess.Popen[bytes]:
    cmd = ["perf", "stat", "-x", ",", "-e", ",".join(EVENTS), "-p", str(pid), "-o", path]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def parse_perf(text: str) -> dict[str, int]:
    """``perf stat -x ,`` output: event name (without ``syscalls:sys_enter_``) -> count."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        p = line.strip().split(",")
        if len(p) > 3 and p[0].replace(".", "").isdigit():
            out[p[2].split(":")[-1].replace("sys_enter_", "")] = int(float(p[0]))
    return out


async def _measure(dep: LocalDeployment, size: int, n: int, qd: int) -> dict[str, Any]:
    c = AsyncGCacheClient(dep.client_config(transport="tcp"))
    await c.connect()
    ns = await ops.prepare_objects(c, size, 64)
    assert dep.meta is not None
    pids = {"client": os.getpid(), "server": dep.servers[0].popen.pid, "meta": dep.meta.popen.pid}
    res: dict[str, Any] = {}
    for op in ("read", "write"):
        with tempfile.TemporaryDirectory() as tmp:
            spies = {k: _perf(p, os.path.join(tmp, k)) for k, p in pids.items()}
            await asyncio.sleep(1.0)  # perf attached before the timed part
            if op == "read":
                await ops.run_read(c, ns, 64, ops.Budget(n, 0), qd, _Quiet())  # type: ignore[arg-type]
            else:
                await ops.run_write(c, size, ops.Budget(n, 0), qd, 1, _Quiet())  # type: ignore[arg-type]
            for s in spies.values():
                s.send_signal(signal.SIGINT)  # perf stat prints its counts on SIGINT
            for s in spies.values():
                s.wait()
            counts = {}
            for k in pids:
                with open(os.path.join(tmp, k)) as fh:
                    counts[k] = {e: round(v / n, 2) for e, v in parse_perf(fh.read()).items()}
            res[op] = counts
    await c.close()
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.op_syscalls", description=__doc__)
    p.add_argument("--size", default="1MiB")
    p.add_argument("-n", "--iters", type=int, default=1000)
    p.add_argument("--qd", type=int, default=4)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("bench.op_syscalls: needs perf (apt-get install linux-perf)")
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="gcache-syscalls-") as tmp:
        dep = LocalDeployment(tmp, servers=1, capacity="2GiB", metrics_port=-1)
        dep.start()
        try:
            res = uvloop.run(_measure(dep, size, args.iters, args.qd))
        finally:
            dep.stop()
    doc = {"size": size, "iters": args.iters, "qd": args.qd, "load_average": os.getloadavg(), **res}
    for op in ("read", "write"):
        for proc, counts in res[op].items():
            print(f"{op:5} {proc:6} " + " ".join(f"{k}={v}" for k, v in counts.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
