"""Clients that stop reading their replies: both daemons close such a connection
once it took no reply byte for ``send_timeout_s``, count it in ``stats()`` (server:
heartbeat counters in GetStats and Prometheus; meta: ``gcache_meta_hotpath_*``),
and keep serving everyone else meanwhile. The old daemons waited on the full
socket forever, holding the connection, its task and its buffers."""

from __future__ import annotations

import random
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tokens

SEND_S = 1.0
TOKS = tokens(64, seed=11)
# Objects of 64 KiB a layer and block: a few READs fill every socket buffer.
LAYOUT = LayoutSpec(
    block_size=16,
    dtype="float16",
    layers=(LayerSpec("full", kv_heads=8, k_head_dim=128, v_head_dim=128),) * 2,
)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    timeout = ["--send-timeout-s", str(SEND_S)]
    d = LocalDeployment(
        tmp_path_factory.mktemp("slow"),
        servers=1,
        capacity="64MiB",
        meta_args=timeout,
        server_args=timeout,
    )
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def stalled_socket(port: int) -> socket.socket:
    """A connection with a small receive buffer that the test will not read."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    return s


def drain_until_closed(s: socket.socket, timeout: float) -> tuple[bool, int]:
    """Read everything; (closed by the peer, bytes read) once it closes or goes
    quiet for ``timeout`` seconds."""
    s.settimeout(timeout)
    got = 0
    try:
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                return True, got
            got += len(chunk)
    except (ConnectionResetError, BrokenPipeError):
        return True, got
    except TimeoutError:
        return False, got


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"metric {name} not exported")


def wait_for(pred: object, timeout: float) -> float:
    """Seconds until ``pred()`` holds; fails after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"condition not met within {timeout} s")


def test_server_closes_a_client_that_stops_reading_read_replies(slow: LocalDeployment) -> None:
    client = GCacheClient(slow.client_config(transport="tcp"))
    try:
        ns = client.register_namespace("slow", LAYOUT)
        kv = make_kv(ns.layout, len(TOKS), seed=11)
        assert client.put(ns, TOKS, kv).ok
        m = client.match(ns, TOKS)
        g = max((o.grant for o in m.objects.values()), key=lambda g: g.length)
        # 64 MiB of replies in pipelined READs of the whole granted range, never read.
        n = (64 << 20) // g.length
        read = wire.pack_frame(wire.Read([g], [(0, g.offset, g.length)]), 1)
        total = n * (g.length + len(wire.pack_frame(wire.ReadData(g.length), 1)))
        port = slow.servers[0].port
        s = stalled_socket(port)
        t0 = time.monotonic()
        s.sendall(read * n)
        # Others are served while the stalled connection waits.
        assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK
        m2 = client.match(ns, TOKS)
        assert_layers_match(client.get(m2), kv)
        client.release(m2)

        def timed_out() -> bool:
            srv = slow.stats().servers[0]
            return bool(srv.counters.connections_send_timeouts >= 1)

        wait_for(timed_out, SEND_S + 8)  # the send timeout, then a heartbeat
        assert time.monotonic() - t0 >= SEND_S * 0.9
        closed, got = drain_until_closed(s, 3)
        assert closed, "server kept a connection whose client stopped reading"
        assert got < total, "the whole reply went out: the connection never stalled"
        s.close()
        # Counted in the heartbeat counters: GetStats and Prometheus show it.
        url = slow.metrics_url
        sid = slow.stats().servers[0].server_id
        name = f'gcache_server_ops_total{{server="{sid}",kind="connections_send_timeouts"}}'
        assert metric(url, name) >= 1
        # The server still serves: the data reads back byte-identical.
        assert_layers_match(client.get(m), kv)
        client.release(m)
    finally:
        client.close()


def test_meta_closes_a_client_that_pipelines_without_reading(slow: LocalDeployment) -> None:
    assert slow.meta is not None
    port = slow.meta.port
    name = "gcache_meta_hotpath_connections_send_timeouts_total"
    before = metric(slow.metrics_url, name)
    s = stalled_socket(port)
    s.setblocking(False)
    pings = memoryview(wire.pack_frame(wire.Ping(), 1) * 4096)
    sent, blocked_since = 0, None
    t0 = time.monotonic()
    # Pipeline pings until both directions are full: the meta is stuck sending.
    while time.monotonic() - t0 < 20:
        try:
            sent += s.send(pings[sent % len(pings) :])  # whole frames, in order
            blocked_since = None
        except BlockingIOError:
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 0.3:
                break
            time.sleep(0.02)
        except (ConnectionResetError, BrokenPipeError):
            break
    assert sent > 0
    # The meta keeps serving others meanwhile.
    assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK
    wait_for(lambda: metric(slow.metrics_url, name) >= before + 1, SEND_S + 8)
    s.setblocking(True)
    closed, _ = drain_until_closed(s, 3)
    assert closed, "meta kept a connection whose client stopped reading"
    s.close()
    assert metric(slow.metrics_url, "gcache_meta_hotpath_connections_open") >= 0
    assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_read_of_65536_ranges_holds_no_memory_once_answered(slow: LocalDeployment) -> None:
    """A READ of 65536 one-byte ranges is a 1 MiB request for a 64 KiB reply, but
    cost the server about 32 MiB (a view and a wrapped view per range, a tuple per
    decoded range) that stayed held on the connection until its next request:
    16 idle connections held about 500 MiB. Now the ranges are dropped before the
    reply is sent and the views once it is."""
    client = GCacheClient(slow.client_config(transport="tcp"))
    try:
        ns = client.register_namespace("ranges", LAYOUT)
        kv = make_kv(ns.layout, len(TOKS), seed=12)
        assert client.put(ns, TOKS, kv).ok
        m = client.match(ns, TOKS)
        g = next(iter(m.objects.values())).grant
        n = 65536
        read = wire.pack_frame(wire.Read([g], [(0, g.offset + i % g.length, 1) for i in range(n)]))
        port, pid = slow.servers[0].port, slow.servers[0].popen.pid
        base = rss(pid)
        socks = []
        for _ in range(16):
            s = rawwire.connect(port)
            s.sendall(read)
            head, _, payload = rawwire.recv_frame(s)
            assert head.msg_type == wire.T_READ_DATA and len(payload) == n
            socks.append(s)  # answered, now idle
        time.sleep(0.3)
        grown = rss(pid) - base
        assert grown < 128 << 20, f"server RSS grew {grown >> 20} MiB for 16 answered READs"
        for s in socks:
            s.close()
        client.release(m)
    finally:
        client.close()


def test_meta_idle_connection_holds_nothing_of_its_last_request(slow: LocalDeployment) -> None:
    """The meta kept each connection's last decoded request (and reply) until the
    next one arrived: 16 idle connections after one 131072-key Lookup each held
    about 150 MiB. Now they are dropped once the reply is sent."""
    assert slow.meta is not None
    client = GCacheClient(slow.client_config(transport="tcp"))
    try:
        ns = client.register_namespace("idle-keys", LAYOUT)
        rng = random.Random(7)
        keys = [rng.randbytes(16) for _ in range(1 << 17)]
        frame = wire.pack_frame(wire.Lookup(ns.fingerprint, keys), 3)
        pid = slow.meta.popen.pid
        base = rss(pid)
        socks = []
        for _ in range(16):
            s = rawwire.connect(slow.meta.port)
            s.sendall(frame)
            head, result, _ = rawwire.recv_frame(s)
            assert head.msg_type == wire.T_LOOKUP_RESULT and result.blocks == 0
            socks.append(s)  # answered, now idle
        time.sleep(0.3)
        grown = rss(pid) - base
        assert grown < 64 << 20, f"meta RSS grew {grown >> 20} MiB for 16 idle connections"
        for s in socks:
            s.close()
    finally:
        client.close()
