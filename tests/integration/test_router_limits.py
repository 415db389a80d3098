"""Bounded memory and connections for gcache-router:
its framed hot path under the meta's limits (body limit, key count refused from the
array header, idle timeout, connections per peer answered E_BUSY, rate-limited
bad-frame logs) and its HTTP front (body limit, connections per peer answered 503,
idle and half-sent requests closed), against a real router process with small
limits."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from gcache import wire
from gcache.errors import E_BAD_REQUEST, E_BUSY
from tests import rawwire
from tests.integration.test_limits import header, rss, wait_closed_all
from tests.integration.test_router import Router

PER_PEER = 4
IDLE_S = 1.0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = Router(
        tmp_path_factory.mktemp("router-limits"),
        "--max-connections-per-peer", str(PER_PEER), "--idle-timeout-s", str(IDLE_S),
        "--max-body", "64KiB", "--http-max-connections-per-peer", str(PER_PEER),
        "--max-http-body", "8KiB",
    )  # fmt: skip
    r.load("e1", url="http://127.0.0.1:9")
    yield r
    assert r.stop() == 0, r.log.read_text()[-2000:]


def conns(r: Router, front: str, what: str) -> float:
    return r.metric("gcache_router_connections_total", front=front, what=what)


def test_hot_path_body_limit_and_key_count(router: Router) -> None:
    before = rss(router.proc.pid)
    socks = []
    for _ in range(PER_PEER):  # declared 32 MiB bodies: refused from the header
        s = rawwire.connect(router.port)
        s.sendall(header(wire.T_ROUTE, 32 << 20))
        socks.append(s)
    for s in socks:
        assert rawwire.closed_by_peer(s, 3), "router kept a connection declaring 32 MiB"
    assert rss(router.proc.pid) - before < 16 << 20
    wait_closed_all(socks)
    # 2**32-1 keys declared in 40 bytes: refused from the array header, connection kept
    forged = b"\x93\xdd\xff\xff\xff\xff" + b"\xc4\x10" + b"\x02" * 16
    with rawwire.connect(router.port) as s:
        s.sendall(header(wire.T_ROUTE, len(forged), req_id=7) + forged)
        head, err, _ = rawwire.recv_frame(s)
        assert (head.req_id, head.msg_type, err.code) == (7, wire.T_ERROR, E_BAD_REQUEST)
        assert "exceed the router's limit" in err.message
        s.sendall(wire.pack_frame(wire.Ping(), 8))
        assert rawwire.recv_frame(s)[0].msg_type == wire.T_OK


def test_hot_path_idle_connection_is_closed(router: Router) -> None:
    silent = rawwire.connect(router.port)
    partial = rawwire.connect(router.port)
    partial.sendall(header(wire.T_PING, 0)[:10])
    chatty = rawwire.connect(router.port)
    t0 = time.monotonic()
    while time.monotonic() - t0 < IDLE_S * 2:
        chatty.sendall(wire.pack_frame(wire.Ping(), 9))
        assert rawwire.recv_frame(chatty)[0].msg_type == wire.T_OK
        time.sleep(0.2)
    assert rawwire.closed_by_peer(silent, IDLE_S * 3)
    assert rawwire.closed_by_peer(partial, IDLE_S * 3)
    chatty.sendall(wire.pack_frame(wire.Ping(), 10))
    assert rawwire.recv_frame(chatty)[0].msg_type == wire.T_OK
    wait_closed_all([silent, partial, chatty])
    assert conns(router, "hotpath", "connections_idle_closed") >= 2


def test_hot_path_connections_per_peer_capped(router: Router) -> None:
    socks = [rawwire.connect(router.port) for _ in range(PER_PEER)]
    for s in socks:
        s.sendall(wire.pack_frame(wire.Ping(), 1))
        assert rawwire.recv_frame(s)[0].msg_type == wire.T_OK
    extra = rawwire.connect(router.port)
    head, err, _ = rawwire.recv_frame(extra)
    assert (head.req_id, head.msg_type, err.code) == (0, wire.T_ERROR, E_BUSY)
    assert "max_connections_per_peer" in err.message
    assert rawwire.closed_by_peer(extra, 3)
    extra.close()
    wait_closed_all(socks)
    assert rawwire.call(router.port, wire.Ping())[0].msg_type == wire.T_OK
    assert conns(router, "hotpath", "connections_refused_per_peer") >= 1


def test_hot_path_bad_frames_log_a_bounded_number_of_warnings(router: Router) -> None:
    before = router.log.read_text().count(" WARNING ")
    t0 = time.monotonic()
    for i in range(1000):
        with rawwire.connect(router.port) as s:
            s.sendall(b"\x00" * 24 if i % 2 else header(99, 0))
            assert rawwire.closed_by_peer(s, 3)
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    text = router.log.read_text()
    lines = text.count(" WARNING ") - before
    assert 1 <= lines <= 10 + elapsed + 2, f"{lines} WARNING lines for 1000 bad frames"
    assert conns(router, "hotpath", "protocol_errors") >= 1000
    assert rawwire.call(router.port, wire.Ping())[0].msg_type == wire.T_OK


def _http(router: Router) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.http), timeout=5)


def _request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _answer(s: socket.socket) -> bytes:
    s.settimeout(5)
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    return out


def test_http_body_limit(router: Router) -> None:
    big = json.dumps({"prompt": "x" * (16 << 10)}).encode()
    with _http(router) as s:
        s.sendall(_request("/route", big))
        assert _answer(s).startswith(b"HTTP/1.1 413")
    router.load("e1", url="http://127.0.0.1:9")
    small = json.dumps({"prompt": [1, 2, 3]}).encode()
    with _http(router) as s:
        s.sendall(_request("/route", small))
        assert _answer(s).startswith(b"HTTP/1.1 200")


def test_http_connections_per_peer_capped(router: Router) -> None:
    """One connection past http_max_connections_per_peer is answered 503 with the
    reason and closed; the admitted ones keep working; slots come back."""
    socks = [_http(router) for _ in range(PER_PEER)]
    for s in socks:  # keep-alive requests: all admitted and served
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(s).startswith(b"HTTP/1.1 200")
    with _http(router) as extra:
        data = _answer(extra) + (extra.recv(65536) or b"")
        assert data.startswith(b"HTTP/1.1 503"), data
        assert b"max_connections_per_peer" in data
        assert rawwire.closed_by_peer(extra, 3)
    for s in socks:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(s).startswith(b"HTTP/1.1 200")
    wait_closed_all(socks)
    with urllib.request.urlopen(f"http://127.0.0.1:{router.http}/healthz", timeout=5) as r:
        assert r.status == 200
    assert conns(router, "http", "connections_refused_per_peer") >= 1
    assert "router HTTP: refused a connection" in router.log.read_text()


def test_http_idle_and_half_sent_requests_are_closed(router: Router) -> None:
    silent = _http(router)
    partial = _http(router)
    partial.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    served = _http(router)
    served.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(served).startswith(b"HTTP/1.1 200")  # then idle on keep-alive
    for s in (silent, partial, served):
        assert rawwire.closed_by_peer(s, IDLE_S * 4), "idle HTTP connection kept open"
    wait_closed_all([silent, partial, served])
    assert conns(router, "http", "connections_idle_closed") >= 3
