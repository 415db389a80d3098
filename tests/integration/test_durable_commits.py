"""A put that returned OK survives ``kill -9`` of the meta or of its server at any
instant after: the server recorded each object in its manifest (on the tmpfs, next
to the segment) when the write grant was consumed, before the receipt the meta's
commit needed. So a restarted meta rebuilds every acknowledged object from the
server's report, and a restarted server (same id) re-adopts them from its manifest.

Real processes (``LocalDeployment``): a burst of puts, then SIGKILL 0 to 50 ms
after the last OK, a restart, and EVERY acknowledged prompt must hit with equal
bytes, over TCP writes and shared-memory writes (``SEAL``)."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

PROMPTS = 60
NTOK = 4 * 8 + 1  # 8 blocks of 4 tokens
REBUILD_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _burst(client: GCacheClient, ns: object) -> tuple[list[np.ndarray], float]:
    """PROMPTS puts, each acknowledged in full; the instant of the last OK."""
    prompts = [tokens(NTOK, seed=s) for s in range(PROMPTS)]
    last_ok = 0.0
    for s, toks in enumerate(prompts):
        res = client.put(ns, toks, make_kv(ns.layout, NTOK, seed=s))  # type: ignore[attr-defined]
        last_ok = time.monotonic()
        assert res.ok and res.stored > 0 and not res.no_space, res
    return prompts, last_ok


def _all_hit(client: GCacheClient, ns: object, prompts: list[np.ndarray]) -> list[int]:
    """Prompts that do not hit in full with byte-equal KV (empty: all do)."""
    bad = []
    for s, toks in enumerate(prompts):
        m = client.match(ns, toks)  # type: ignore[arg-type]
        if m.tokens != 4 * (NTOK // 4):
            bad.append(s)
            client.release(m)
            continue
        got = client.get(m)
        client.release(m)
        try:
            assert_layers_match(got, make_kv(ns.layout, NTOK, seed=s))  # type: ignore[attr-defined]
        except AssertionError:
            bad.append(s)
    return bad


def _wait_all_hit(client: GCacheClient, ns: object, prompts: list[np.ndarray], what: str) -> float:
    t0 = time.monotonic()
    bad = list(range(len(prompts)))
    while time.monotonic() - t0 < REBUILD_S:
        bad = _all_hit(client, ns, prompts)
        if not bad:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(
        f"after {what}: {len(bad)} of {len(prompts)} acknowledged prompts do not hit "
        f"byte-equal {REBUILD_S} s later: {bad[:10]}"
    )


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("delay_ms", [0, 10, 25, 50])
def test_acknowledged_puts_survive_kill9_of_the_meta(
    tmp_path: Path, transport: str, delay_ms: int
) -> None:
    with LocalDeployment(tmp_path, servers=1, capacity="64MiB") as d:
        d.start()
        client = GCacheClient(d.client_config(transport=transport, timeout_s=1.0))
        try:
            ns = client.register_namespace("durable", tiny_hybrid())
            prompts, last_ok = _burst(client, ns)
            time.sleep(max(0.0, last_ok + delay_ms / 1000 - time.monotonic()))
            d.restart_meta(signal.SIGKILL)
            # The writes took the transport under test (shm: SEALs, TCP: none).
            head, st, _ = rawwire.call(d.servers[0].port, wire.ServerStats())
            assert head.msg_type == wire.T_SERVER_STATS_REPLY, st
            assert (st.values["sealed_bytes"] > 0) == (transport == "shm"), st.values
            assert st.values["records_persisted"] >= PROMPTS, st.values
            took = _wait_all_hit(client, ns, prompts, f"kill -9 of the meta {delay_ms} ms after")
            counters = dict(d.stats().counters)
            print(f"{transport} +{delay_ms} ms: all {PROMPTS} hit {took:.2f} s after restart")
            assert counters.get("objects_adopted", 0) > 0, counters
        finally:
            client.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("delay_ms", [0, 25])
def test_acknowledged_puts_survive_kill9_of_their_server(
    tmp_path: Path, transport: str, delay_ms: int
) -> None:
    with LocalDeployment(tmp_path, servers=1, capacity="64MiB", server_ports=[_free_port()]) as d:
        d.start()
        client = GCacheClient(d.client_config(transport=transport, timeout_s=1.0))
        try:
            ns = client.register_namespace("durable", tiny_hybrid())
            prompts, last_ok = _burst(client, ns)
            time.sleep(max(0.0, last_ok + delay_ms / 1000 - time.monotonic()))
            d.kill_server(0, signal.SIGKILL)
            d.start_server(0)  # same id and port: re-adopts its segment from the manifest
            d.wait_servers(1, 15)
            took = _wait_all_hit(client, ns, prompts, f"kill -9 of the server {delay_ms} ms after")
            print(f"{transport} +{delay_ms} ms: all {PROMPTS} hit {took:.2f} s after restart")
        finally:
            client.close()
