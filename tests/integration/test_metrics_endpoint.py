"""The meta's Prometheus endpoint against clients that hold connections: at most
8 connections from one address (an excess one gets a 503 at once), and each
connection has 5 s to send its request and take the whole answer. The old
endpoint admitted any number of connections and waited on ``drain()`` forever
for a client that stopped reading (closing it kept the unsent answer queued)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import pytest

from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.cli.deploy import LocalDeployment
from gcache.meta.metrics import EXCHANGE_TIMEOUT_S, MAX_PER_PEER
from tests import rawwire

OTHER = "127.0.0.2"  # another peer address on the loopback


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    # Registered servers that never beat stay listed: they make the answer large.
    d = LocalDeployment(
        tmp_path_factory.mktemp("metrics"),
        servers=0,
        meta_args=["--heartbeat-timeout-s", "600"],
    )
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def port_of(d: LocalDeployment) -> int:
    assert d.meta is not None
    return int(d.meta.extra["metrics_port"])


def open_from(source: str, port: int, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything until the peer closes (reset included)."""
    s.settimeout(timeout)
    out = bytearray()
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except ConnectionResetError:
        pass
    return bytes(out)


def get(port: int, source: str = "127.0.0.1", path: str = "/metrics") -> tuple[str, bytes]:
    with open_from(source, port) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: meta\r\n\r\n".encode())
        data = read_all(s)
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


def metric(port: int, name: str) -> float:
    status, body = get(port, OTHER)
    assert status.endswith("200 OK"), status
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {name} not exported")


def test_metrics_refuses_past_the_per_peer_cap_and_closes_slowloris(dep: LocalDeployment) -> None:
    port = port_of(dep)
    # Slowloris: connections that send half a request and then nothing.
    slow = [open_from("127.0.0.1", port) for _ in range(MAX_PER_PEER)]
    for s in slow:
        s.sendall(b"GET /metr")
    time.sleep(0.3)
    t0 = time.monotonic()
    status, _ = get(port)
    assert status.endswith("503 Service Unavailable"), f"{status!r}: no per-peer cap"
    assert time.monotonic() - t0 < 2.0
    # Another address is answered while they hang on.
    status, body = get(port, OTHER)
    assert status.endswith("200 OK") and b"gcache_meta_" in body
    # Each of them is closed once its time is up.
    for s in slow:
        assert rawwire.closed_by_peer(s, EXCHANGE_TIMEOUT_S + 3), "slowloris kept open"
        s.close()
    assert get(port)[0].endswith("200 OK")
    assert metric(port, "gcache_meta_metrics_http_refused_total") >= 1
    assert metric(port, "gcache_meta_metrics_http_timeouts_total") >= MAX_PER_PEER


def test_metrics_closes_a_scraper_that_stops_reading(dep: LocalDeployment) -> None:
    port = port_of(dep)
    with grpc.insecure_channel(dep.meta_grpc) as ch:
        stub = pb_grpc.ControlStub(ch)
        for i in range(300):
            stub.RegisterServer(
                pb.RegisterServerRequest(
                    server_id=f"fake-{i:04d}-" + "x" * 8000,
                    host="127.0.0.1",
                    port=1 + i,
                    hostname="fake",
                    capacity=1 << 30,
                    secret=b"s" * 16,
                    incarnation=1 + i,
                ),
                timeout=5,
            )
    status, body = get(port)
    assert status.endswith("200 OK") and len(body) > 10 << 20  # far past socket buffers
    stalled = open_from("127.0.0.1", port, rcvbuf=4096)
    stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: meta\r\n\r\n")  # and never reads
    t0 = time.monotonic()
    status, body2 = get(port, OTHER)  # others are served meanwhile
    assert status.endswith("200 OK") and len(body2) > 10 << 20
    time.sleep(max(0.0, EXCHANGE_TIMEOUT_S + 1.5 - (time.monotonic() - t0)))
    got = read_all(stalled, timeout=5)
    stalled.close()
    assert len(got) < len(body), "the endpoint waited on a scraper that stopped reading"
    assert metric(port, "gcache_meta_metrics_http_timeouts_total") >= MAX_PER_PEER + 1
