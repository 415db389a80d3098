"""Meta high availability across hosts (tests/netns.py): etcd on host E, two
metas on hosts M1 and M2 elected through it, a server on host B, real clients on
host B (the server's host) and host D, all given ``etcd://E:2379/PREFIX``. The
leader's host cut off (``ip link set ... down``): the other meta takes over, the
server follows it and reports what it holds, the prompts put before the cut hit
again; no client raises, no operation hangs, zero wrong bytes. With the link
back, the old leader does not take the lead back while the new one holds it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.netns import (
    Fabric,
    FabricError,
    Host,
    JsonProc,
    call,
    child_env,
    fabric_or_skip,
    wait_file,
)

ETCD = "/usr/bin/etcd"
PREFIX = "/gcache-mh"
TIMEOUT_S = 1.0  # the clients' per-operation timeout
HEARTBEAT_INTERVAL_S = 0.25
TAKEOVER_S = 10.0  # bound on the whole takeover as seen by a client (target: 3-5 s)
BOUND_S = 3 * TIMEOUT_S + 1.0  # one prompt: lookup (a redirect and a retry), read, release
PROMPTS: dict[str, Any] = {"model": "ha", "prompts": list(range(1, 25)), "tokens": 8}


@dataclass
class HaCluster:
    fabric: Fabric
    etcd_host: Host
    metas: dict[str, Host]  # meta id -> its host
    b: Host
    d: Host
    etcd_url: str
    logs: Path

    def leader(self) -> dict[str, Any] | None:
        """The leader record in etcd (None when no leader is named)."""
        out = self.etcd_host.run(
            ["etcdctl", f"--endpoints=http://{self.etcd_host.addr}:2379", "get",
             f"{PREFIX}/leader", "--print-value-only"]
        ).strip()  # fmt: skip
        return json.loads(out) if out else None

    def wait_leader(self, timeout: float = 20.0, other_than: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = self.leader()
            if rec is not None and rec["id"] != other_than:
                return rec
            time.sleep(0.1)
        raise AssertionError(f"no leader (other than {other_than!r}) within {timeout} s")

    def client(self, host: Host, name: str) -> JsonProc:
        return JsonProc(
            host,
            [sys.executable, "-m", "tests.netns_client", "--meta", self.etcd_url,
             "--timeout-s", str(TIMEOUT_S)],
            self.logs / f"{name}.log",
        )  # fmt: skip


def start_etcd(host: Host, logs: Path) -> None:
    url = f"http://{host.addr}"
    p = host.popen(
        [ETCD, "--name", "e", "--data-dir", str(logs / "etcd"),
         "--listen-client-urls", f"{url}:2379", "--advertise-client-urls", f"{url}:2379",
         "--listen-peer-urls", f"{url}:2380", "--initial-advertise-peer-urls", f"{url}:2380",
         "--initial-cluster", f"e={url}:2380"],
        log=logs / "etcd.log",
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            host.run(["etcdctl", f"--endpoints={url}:2379", "endpoint", "health"], timeout=5)
            return
        except (FabricError, OSError) as exc:
            if p.poll() is not None or time.monotonic() > deadline:
                raise FabricError(f"etcd on {host.name} did not start: {exc}") from exc
            time.sleep(0.2)


def start_meta(host: Host, meta_id: str, etcd_url: str, logs: Path) -> None:
    ready = logs / f"{meta_id}.ready"
    p = host.python(
        "gcache.meta.daemon",
        ["--host", host.addr, "--port", "0", "--grpc-port", "0", "--metrics-port", "-1",
         "--etcd", etcd_url, "--meta-id", meta_id, "--heartbeat-timeout-s", "2",
         "--ready-file", str(ready)],
        log=logs / f"{meta_id}.log",
    )  # fmt: skip
    wait_file(ready, p, meta_id)


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HaCluster]:
    if not Path(ETCD).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{ETCD} is needed under CI=true (apt-get install etcd-server)")
        pytest.skip(f"{ETCD} not installed")
    child_env()
    logs = tmp_path_factory.mktemp("multihost-ha")
    fabric = fabric_or_skip(5)
    try:
        e, m1, m2, b, d = fabric.hosts
        start_etcd(e, logs)
        etcd_url = f"etcd://{e.addr}:2379{PREFIX}"
        cluster = HaCluster(fabric, e, {"m1": m1, "m2": m2}, b, d, etcd_url, logs)
        start_meta(m1, "m1", etcd_url, logs)
        cluster.wait_leader()
        start_meta(m2, "m2", etcd_url, logs)
        ready = logs / "sB.ready"
        server = b.python(
            "gcache.server.daemon",
            ["--host", b.addr, "--port", "0", "--meta", etcd_url, "--capacity", "64MiB",
             "--server-id", "sB", "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
             "--ready-file", str(ready)],
            log=logs / "sB.log",
        )  # fmt: skip
        wait_file(ready, server, "sB")
        yield cluster
    finally:
        fabric.close()


def test_leader_host_cut_off_a_standby_takes_over(ha: HaCluster) -> None:
    cb, cd = ha.client(ha.b, "clientB"), ha.client(ha.d, "clientD")
    assert call(cb, op="put", **PROMPTS)["stored"] == PROMPTS["prompts"]
    for client in (cb, cd):
        g = call(client, op="get", **PROMPTS)
        assert (g["hits"], g["wrong"]) == (len(PROMPTS["prompts"]), 0), g
    first = ha.wait_leader()
    old = ha.metas[first["id"]]
    old.link_down()
    t_cut = time.monotonic()
    try:
        # Clients keep asking; every answer comes within the bound, no exception,
        # never a wrong byte, until every prompt hits again through the new leader.
        served: dict[str, float] = {}
        while len(served) < 2 and time.monotonic() - t_cut < TAKEOVER_S:
            for name, client in (("B", cb), ("D", cd)):
                if name in served:
                    continue
                g = call(client, op="get", **PROMPTS)
                assert g["wrong"] == 0, g
                assert all(r["ms"] <= BOUND_S * 1000 for r in g["prompts"]), g
                if g["hits"] == len(PROMPTS["prompts"]):
                    served[name] = time.monotonic() - t_cut
            time.sleep(0.1)
        new = ha.wait_leader(timeout=1.0, other_than=first["id"])
        assert new["epoch"] > first["epoch"], (first, new)
        assert set(served) == {"B", "D"}, f"not every prompt hit {TAKEOVER_S} s after the cut"
        # The new leader takes puts too.
        more = {**PROMPTS, "prompts": [101, 102, 103]}
        assert call(cd, op="put", **more)["stored"] == more["prompts"]
    finally:
        old.link_up()
    # The old leader back on the network: still one leader, the same; reads right.
    time.sleep(2.5)
    assert ha.wait_leader(timeout=1.0)["id"] == new["id"]
    for client in (cb, cd):
        g = call(client, op="get", **PROMPTS)
        assert (g["hits"], g["wrong"]) == (len(PROMPTS["prompts"]), 0), g
        g = call(client, op="get", **more)
        assert (g["hits"], g["wrong"]) == (3, 0), g
    print(
        f"\nleader {first['id']} (epoch {first['epoch']}) cut off: {new['id']} leads "
        f"(epoch {new['epoch']}); every prompt hit again after {served['B']:.1f} s "
        f"(client on the server's host) / {served['D']:.1f} s (client on another host)"
    )
