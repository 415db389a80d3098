"""Child processes of the Mooncake peer: ``python -m <this module> ROLE JSON``.

driver: starts ``mooncake_master`` (RPC + metrics on 127.0.0.1), a storage and a
client process, hands them their loops and prints one JSON line (rows, errors,
listeners). storage / client: ``MooncakeDistributedStore.setup`` (2 GiB / no
global segment), print "ready", then run the timed loop once per stdin line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.compare.peers import _common as c
from bench.compare.peers._common import Row

SEGMENT = 2 << 30


def _setup(master: str, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped,import-not-found]

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def _bench(store: Any, a: dict[str, Any], system: str, local: bool, note: str) -> list[Row]:
    """Timed batch_put_from / batch_get_into loops, ``conc`` keys of each size per batch."""
    import numpy as np
    from mooncake.store import ReplicateConfig  # type: ignore[import-untyped,import-not-found]

    sizes, iters, conc = a["sizes"], a["iters"], a["conc"]
    slice_s = a["budget"] / max(1, 2 * len(sizes))
    cfg = ReplicateConfig()
    if local:
        cfg.preferred_segment = store.get_hostname()
    buf = np.random.default_rng(1).integers(0, 256, 2 * conc * max(sizes), dtype=np.uint8)
    base, tag = buf.ctypes.data, "L" if local else "R"
    if store.register_buffer(base, buf.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    rows: list[Row] = []
    for size in sizes:
        src = [base + j * size for j in range(conc)]
        dst = [base + (conc + j) * size for j in range(conc)]
        lens = [size] * conc
        for op in ("write", "read"):
            rkeys = [f"{tag}-r{size}-{j}" for j in range(conc)]
            if op == "read":
                rc = store.batch_put_from(rkeys, src, lens, cfg)
                if any(rc):
                    raise RuntimeError(f"batch_put_from (read setup) {size}: {rc}")
            lat: list[float] = []
            excluded = 0.0
            t_start = time.perf_counter()
            deadline = t_start + slice_s
            for it in range(iters):
                keys = [f"{tag}-w{size}-{it}-{j}" for j in range(conc)]
                t0 = time.perf_counter_ns()
                if op == "write":
                    res = store.batch_put_from(keys, src, lens, cfg)
                    bad = [r for r in res if r != 0]
                else:
                    res = store.batch_get_into(rkeys, dst, lens)
                    bad = [r for r in res if r != size]
                lat.append((time.perf_counter_ns() - t0) / 1e3)
                if bad:
                    raise RuntimeError(f"{op} {size}: result codes {res}")
                if op == "write":  # untimed: keep the segment from filling up
                    t_rm = time.perf_counter()
                    store.batch_remove(keys, True)
                    excluded += time.perf_counter() - t_rm
                if time.perf_counter() > deadline:
                    break
            wall = time.perf_counter() - t_start - excluded
            if op == "read":
                if not np.array_equal(buf[: conc * size], buf[conc * size : 2 * conc * size]):
                    raise RuntimeError(f"read {size}: data mismatch")
                store.batch_remove(rkeys, True)
            rows.append(
                c.row(
                    system,
                    op,
                    size,
                    len(lat),
                    conc,
                    float(len(lat) * conc * size),
                    wall,
                    lat,
                    f"{note}; {conc} keys x {size} B per batch, latency per batch",
                )
            )
    store.unregister_buffer(base)
    return rows


NOTES = {
    "storage": (
        "mooncake (local memcpy)",
        "the process owning the only (2 GiB) segment reads and "
        "writes it itself, preferred_segment = own hostname: transfer engine local path "
        "(MC_STORE_MEMCPY auto-enabled for TCP-only)",
    ),
    "client": (
        "mooncake (TCP)",
        "client process (global_segment_size=0) -> storage process "
        "(2 GiB segment) over the TCP transport on loopback, P2PHANDSHAKE metadata",
    ),
}


def _role_store(role: str, a: dict[str, Any]) -> None:
    """Storage or client: set up, say "ready", run the loop once per stdin command."""
    store = _setup(a["master"], SEGMENT if role == "storage" else 0)
    print("ready", flush=True)
    system, note = NOTES[role]
    for line in sys.stdin:
        try:
            out: dict[str, Any] = {
                "rows": _bench(store, json.loads(line), system, role == "storage", note)
            }
        except Exception as e:
            out = {"rows": [], "error": f"{role}: {e!r}"}
        print(json.dumps(out), flush=True)
    store.close()


def _popen_logged(cmd: list[str], log: str, **kw: Any) -> subprocess.Popen[Any]:
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stderr=f, **kw)


def _child(role: str, arg: dict[str, Any], log: str) -> subprocess.Popen[str]:
    """Start storage or client; return once it printed "ready" (else raise with its log)."""
    cmd = [sys.executable, "-m", "bench.compare.peers._mooncake_roles", role, json.dumps(arg)]
    p = _popen_logged(
        cmd, log, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=c.child_env()
    )
    if p.stdout is None or p.stdout.readline().strip() != "ready":
        c.stop(p)
        tail = [ln for ln in Path(log).read_text().splitlines() if ln[:1] in "EF"][-2:]
        raise RuntimeError(f"{role} failed to start (rc {p.poll()}): {tail}")
    return p


def _role_driver(a: dict[str, Any]) -> None:
    """Runs master, storage and client; prints one JSON line with rows and listeners."""
    tmp = tempfile.mkdtemp(prefix="peer-mooncake-")
    procs: list[subprocess.Popen[Any]] = []
    result: dict[str, Any] = {"rows": [], "errors": [], "listeners": []}
    try:
        port, mport = c.free_port(), c.free_port()
        mlog = os.path.join(tmp, "master.log")
        procs.append(
            _popen_logged(
                [
                    a["master_bin"],
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={mport}",
                    "--enable_http_metadata_server=false",
                    "--http_metadata_server_host=127.0.0.1",
                    "--logtostderr",
                ],
                mlog,
                stdout=subprocess.DEVNULL,
            )
        )
        if not c.wait_listening(port, 10.0):
            raise RuntimeError(f"mooncake_master did not listen on {port} (rc {procs[0].poll()})")
        a["master"] = f"127.0.0.1:{port}"
        for role in ("storage", "client"):
            procs.append(_child(role, a, os.path.join(tmp, f"{role}.log")))
        result["listeners"] = c.listeners()
        for p, share in ((procs[2], 0.6), (procs[1], 1.0)):  # client (TCP), then local
            assert p.stdout is not None and p.stdin is not None
            left = max(0.5, a["cap"] - (time.monotonic() - a["t0"]))
            p.stdin.write(json.dumps({**a, "budget": left * share}) + "\n")
            p.stdin.flush()
            out = json.loads(p.stdout.readline() or '{"rows": [], "error": "child died"}')
            result["rows"] += out["rows"]
            if out.get("error"):
                result["errors"].append(out["error"])
            p.stdin.close()
    except Exception as e:
        result["errors"].append(repr(e))
    finally:
        for p in reversed(procs):
            c.stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "driver":
        _role_driver(json.loads(sys.argv[2]))
    else:
        _role_store(sys.argv[1], json.loads(sys.argv[2]))
