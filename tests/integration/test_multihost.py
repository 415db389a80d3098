"""GCache across hosts: each host a Linux network namespace with its own address,
hostname and /dev/shm (tests/netns.py). The meta on host A, servers on hosts B and
C bound to their hosts' addresses, clients on host B (the server's host) and on
host D (no server), each a long-lived real client (tests/netns_client.py).

- A client on another host reads over TCP, one on a server's host over shared
  memory (shown by the clients' own counters).
- A server's host cut off (``ip link set ... down``): its blocks become misses
  within the client timeout, never an error or a hang; the other server's blocks
  still hit. With the link back, the server heartbeats again and its blocks hit
  again.
- Zero wrong bytes throughout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Fabric, Host, JsonProc, call, child_env, fabric_or_skip, wait_file

TIMEOUT_S = 1.0  # the clients' per-operation timeout
HEARTBEAT_TIMEOUT_S = 2.0  # the meta drops a server silent this long
HEARTBEAT_INTERVAL_S = 0.25
TOKENS = 8  # two blocks of 4 tokens per prompt
PROMPTS = list(range(1, 25))


@dataclass
class Cluster:
    fabric: Fabric
    a: Host  # meta
    b: Host  # server sB and a client
    c: Host  # server sC
    d: Host  # a client only
    meta_hot: str
    meta_grpc: str
    logs: Path
    servers: dict[str, Any]

    def client(self, host: Host, name: str) -> JsonProc:
        return JsonProc(
            host,
            [sys.executable, "-m", "tests.netns_client", "--meta", self.meta_hot,
             "--meta-grpc", self.meta_grpc, "--timeout-s", str(TIMEOUT_S)],
            self.logs / f"{name}.log",
        )  # fmt: skip


def start_server(host: Host, sid: str, meta_grpc: str, logs: Path) -> Any:
    ready = logs / f"{sid}.ready"
    ready.unlink(missing_ok=True)
    p = host.python(
        "gcache.server.daemon",
        ["--host", host.addr, "--port", "0", "--meta", meta_grpc, "--capacity", "64MiB",
         "--server-id", sid, "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
         "--ready-file", str(ready)],
        log=logs / f"{sid}.log",
    )  # fmt: skip
    wait_file(ready, p, sid)
    return p


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    child_env()
    logs = tmp_path_factory.mktemp("multihost")
    fabric = fabric_or_skip(4)
    try:
        a, b, c, d = fabric.hosts
        ready = logs / "meta.ready"
        meta = a.python(
            "gcache.meta.daemon",
            ["--host", a.addr, "--port", "0", "--grpc-port", "0", "--metrics-port", "-1",
             "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--ready-file", str(ready)],
            log=logs / "meta.log",
        )  # fmt: skip
        _, port, grpc_port, _ = wait_file(ready, meta, "meta")
        meta_grpc = f"{a.addr}:{grpc_port}"
        servers = {
            "sB": start_server(b, "sB", meta_grpc, logs),
            "sC": start_server(c, "sC", meta_grpc, logs),
        }
        yield Cluster(fabric, a, b, c, d, f"{a.addr}:{port}", meta_grpc, logs, servers)
    finally:
        fabric.close()


@pytest.fixture(scope="module")
def clients(cluster: Cluster) -> Iterator[tuple[JsonProc, JsonProc]]:
    """A client on host B (a server's host) and one on host D (no server), kept
    alive across the link changes (stopped with the fabric)."""
    yield cluster.client(cluster.b, "clientB"), cluster.client(cluster.d, "clientD")


def sb_prefix(blocks: list[list[str]]) -> int:
    """Leading blocks whose every object is on sB (what stays readable without sC)."""
    n = 0
    for holders in blocks:
        if holders != ["sB"]:
            break
        n += 1
    return n


def test_remote_client_reads_tcp_local_client_reads_shared_memory(
    cluster: Cluster, clients: tuple[JsonProc, JsonProc]
) -> None:
    cb, cd = clients
    prompts = {"model": "transport", "prompts": PROMPTS, "tokens": TOKENS}
    assert call(cb, op="put", **prompts)["stored"] == PROMPTS
    before_b = call(cb, op="stats")["stats"]
    before_d = call(cd, op="stats")["stats"]

    got_d = call(cd, op="get", **prompts)
    got_b = call(cb, op="get", **prompts)
    for got in (got_d, got_b):
        assert (got["hits"], got["wrong"]) == (len(PROMPTS), 0), got
    # The meta hands out the addresses the servers bound on their own hosts, and
    # the hostnames that decide shared memory.
    for sid, host in (("sB", cluster.b), ("sC", cluster.c)):
        assert got_d["servers"][sid]["host"] == host.addr
        assert got_d["servers"][sid]["hostname"] == host.name
    on = {s for r in got_d["prompts"] for b in r["blocks"] for s in b}
    assert on == {"sB", "sC"}, f"every object on one server ({on}): nothing shows both paths"

    d = delta(call(cd, op="stats")["stats"], before_d)
    b = delta(call(cb, op="stats")["stats"], before_b)
    # Host D has no server: every byte over TCP, nothing mapped.
    assert d["bytes_read"] > 0 and d.get("bytes_read_shm", 0) == 0
    assert call(cd, op="stats")["stats"]["mapped_segments"] == 0
    # Host B maps its own server's segment (sB) and reads sC over TCP.
    assert call(cb, op="stats")["stats"]["mapped_segments"] == 1
    assert 0 < b["bytes_read_shm"] < b["bytes_read"]
    print(
        f"\nremote client D: {d['bytes_read']} B over TCP; client B: "
        f"{b['bytes_read_shm']} B over shared memory, "
        f"{b['bytes_read'] - b['bytes_read_shm']} B over TCP"
    )


def delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items()}


# A flat layout (one object per block): the meta spreads a prompt's blocks over the
# servers, so one-block prompts lie wholly on sB or wholly on sC and three-block
# prompts mostly on both (their readable prefix without sC: 0, 1 or 2 blocks).
SETS: tuple[dict[str, Any], ...] = (
    {"model": "flat-cut", "prompts": PROMPTS, "tokens": 4},
    {"model": "flat-cut", "prompts": list(range(201, 213)), "tokens": 12},
)
BOUND_S = 3 * TIMEOUT_S + 0.5  # one prompt: a lookup, a read, a release, and slack


def get_all(client: JsonProc) -> list[dict[str, Any]]:
    """Every prompt of SETS read back, with its number of tokens; no wrong bytes."""
    out = []
    for s in SETS:
        g = call(client, op="get", **s)
        assert g["wrong"] == 0, g
        assert g["elapsed_s"] <= BOUND_S * len(s["prompts"]), g
        out += [{**r, "full": s["tokens"]} for r in g["prompts"]]
    return out


def test_cut_off_server_host_is_a_bounded_miss_and_serves_again(
    cluster: Cluster, clients: tuple[JsonProc, JsonProc]
) -> None:
    cb, cd = clients
    for s in SETS:
        assert call(cd, op="put", **s)["stored"] == s["prompts"]
    g0 = get_all(cd)
    assert all(r["state"] == "hit" for r in g0), g0
    keep = {r["seed"]: sb_prefix(r["blocks"]) * 4 for r in g0}  # tokens readable without sC
    only_b = {r["seed"] for r in g0 if keep[r["seed"]] == r["full"]}
    with_c = {r["seed"] for r in g0 if keep[r["seed"]] < r["full"]}
    assert only_b and with_c, f"placement put no prompt wholly on sB or none on sC: {keep}"
    # No wait before the cut: a server records each object in its manifest before
    # it acknowledges the write, so it reports even the newest ones when it is back.

    cluster.c.link_down()
    t_cut = time.monotonic()
    try:
        # At once (the meta still lists sC): reads of sC's objects fail within the
        # client timeout, as misses; prompts wholly on sB still hit; no exception.
        t0 = time.monotonic()
        timed_out = []
        for client in (cd, cb):
            for r in get_all(client):
                if r["state"] == "miss" and r["tokens"]:  # matched, then sC's read timed out
                    timed_out.append(r["ms"])
                assert r["ms"] <= BOUND_S * 1000, r
                if r["seed"] in only_b:
                    assert r["state"] == "hit", r
                else:
                    # a get is whole or a miss: a match still naming sC is a miss
                    ok = r["state"] == "miss" or (
                        r["state"] == "partial" and r["tokens"] <= keep[r["seed"]]
                    )
                    assert ok, r
        first_s = time.monotonic() - t0
        # The first read of sC's objects came before the meta dropped sC: it waited
        # for the client timeout (not longer) and became a miss.
        assert timed_out and min(timed_out) >= 0.9 * TIMEOUT_S * 1000, timed_out
        # A put while sC is cut off returns (stored or not) within the bound.
        extra = {"model": "flat-cut", "prompts": [101, 102, 103, 104], "tokens": 12}
        p1 = call(cb, op="put", **extra)
        assert p1["elapsed_s"] <= BOUND_S * 4, p1

        # Once the meta dropped sC (heartbeat timeout), a lookup gives exactly the
        # prefix held on sB, at once (no read waits on sC any more).
        time.sleep(max(0.0, t_cut + HEARTBEAT_TIMEOUT_S - time.monotonic()))
        deadline = t_cut + HEARTBEAT_TIMEOUT_S + 5.0
        while True:
            g2 = get_all(cd)
            if all(r["tokens"] == keep[r["seed"]] for r in g2):
                break
            assert time.monotonic() < deadline, f"sC's objects still listed: {g2}"
            time.sleep(0.25)
        assert all(r["ms"] < TIMEOUT_S * 1000 for r in g2), g2
        cut_s = time.monotonic() - t_cut
    finally:
        cluster.c.link_up()
    t_up = time.monotonic()

    # Link back: sC heartbeats again, the meta takes it back with the objects it
    # reports, and its blocks hit again without being put again.
    deadline = t_up + 10 * HEARTBEAT_TIMEOUT_S
    while True:
        g3 = get_all(cd)
        if all(r["state"] == "hit" for r in g3) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    back_s = time.monotonic() - t_up
    missing = [r["seed"] for r in g3 if r["state"] != "hit"]
    assert not missing, f"not served {back_s:.1f} s after the link returned: {missing}"
    assert any("sC" in b for r in g3 for b in r["blocks"])
    stored = p1["stored"]
    if stored:  # what was stored during the cut reads back right from both hosts
        for client in (cd, cb):
            g4 = call(client, op="get", **{**extra, "prompts": stored})
            assert (g4["hits"], g4["wrong"]) == (len(stored), 0), g4
    print(
        f"\ncut: first pass over {len(keep)} prompts x 2 clients {first_s:.2f} s "
        f"({len(timed_out)} reads timed out, {max(timed_out):.0f} ms at most); "
        f"exact sB prefixes {cut_s:.1f} s after the cut; {len(stored)}/4 puts stored "
        f"during the cut; all hit again {back_s:.1f} s after the link returned"
    )
