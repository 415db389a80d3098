"""Receive-buffer memory, body limits, key-count refusal, idle timeout, connection
caps and rate-limited bad-frame logging, against real daemons with small limits."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import E_BAD_REQUEST, E_BUSY, Busy, remote_error
from tests import rawwire

PER_PEER = 4
IDLE_S = 1.0
MAX_KEYS = 64


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (/proc/<pid>/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def header(msg_type: int, body_len: int, payload_len: int = 0, req_id: int = 1) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, msg_type, 0, 0, req_id, body_len, payload_len)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    limits = [
        "--max-connections-per-peer",
        str(PER_PEER),
        "--idle-timeout-s",
        str(IDLE_S),
    ]
    d = LocalDeployment(
        tmp_path_factory.mktemp("limits"),
        servers=1,
        capacity="64MiB",
        meta_args=[*limits, "--max-keys-per-request", str(MAX_KEYS)],
        server_args=limits,
    )
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def procs(d: LocalDeployment) -> list[tuple[int, int]]:
    """(port, pid) of the meta's hot path and the server's data plane."""
    assert d.meta is not None
    return [(d.meta.port, d.meta.popen.pid), (d.servers[0].port, d.servers[0].popen.pid)]


def wait_closed_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    time.sleep(0.2)  # the daemons notice the EOFs and release the slots


def test_declared_32mib_body_costs_no_32mib(limited: LocalDeployment) -> None:
    """The old stream sized its receive buffer from the declared body length: each
    of these headers made the daemon allocate (and zero) 32 MiB at once."""
    meta_port, meta_pid = procs(limited)[0]
    srv_port, srv_pid = procs(limited)[1]
    # The meta's body limit (4 MiB by default) refuses the header outright.
    before = rss(meta_pid)
    socks = []
    for _ in range(PER_PEER):
        s = rawwire.connect(meta_port)
        s.sendall(header(wire.T_LOOKUP, 32 << 20))
        socks.append(s)
    for s in socks:
        assert rawwire.closed_by_peer(s, 3), "meta kept a connection declaring a 32 MiB body"
    assert rss(meta_pid) - before < 16 << 20
    wait_closed_all(socks)
    # The server accepts bodies up to 32 MiB: its buffer grows with what arrives
    # (256 KiB each here), not with what the header declared.
    before = rss(srv_pid)
    socks = []
    for _ in range(PER_PEER):
        s = rawwire.connect(srv_port)
        s.sendall(header(wire.T_READ, 32 << 20) + b"\x00" * (256 << 10))
        socks.append(s)
    time.sleep(0.3)
    grown = rss(srv_pid) - before
    assert grown < 24 << 20, f"server RSS grew {grown >> 20} MiB for {PER_PEER} headers"
    wait_closed_all(socks)
    for port, _ in procs(limited):
        assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK


def test_key_count_refused_before_decoding(limited: LocalDeployment) -> None:
    """A body that declares 2**32-1 keys is refused from its array header with an
    error answer; the old meta handed it to the decoder, which failed on the
    truncated list and closed the connection."""
    port = procs(limited)[0][0]
    forged = b"\x94\xc4\x10" + b"\x01" * 16 + b"\xdd\xff\xff\xff\xff" + b"\xc4\x10" + b"\x02" * 16
    too_many = msgspec.msgpack.encode(wire.Lookup(b"\x01" * 16, [b"\x02" * 16] * (MAX_KEYS + 1)))
    with rawwire.connect(port) as s:
        for req, body in ((1, forged), (2, too_many)):
            s.sendall(header(wire.T_LOOKUP, len(body), req_id=req) + body)
            head, err, _ = rawwire.recv_frame(s)
            assert (head.req_id, head.msg_type, err.code) == (req, wire.T_ERROR, E_BAD_REQUEST)
            assert "max_keys_per_request" in err.message
        s.sendall(wire.pack_frame(wire.Ping(), 3))  # the connection is still usable
        head, _, _ = rawwire.recv_frame(s)
        assert (head.req_id, head.msg_type) == (3, wire.T_OK)


def test_idle_connection_is_closed(limited: LocalDeployment) -> None:
    for port, _ in procs(limited):
        silent = rawwire.connect(port)
        partial = rawwire.connect(port)
        partial.sendall(header(wire.T_PING, 0)[:10])  # half a header, then nothing
        chatty = rawwire.connect(port)
        t0 = time.monotonic()
        # A connection that keeps sending frames stays open past the timeout.
        while time.monotonic() - t0 < IDLE_S * 2:
            chatty.sendall(wire.pack_frame(wire.Ping(), 9))
            assert rawwire.recv_frame(chatty)[0].msg_type == wire.T_OK
            time.sleep(0.2)
        assert rawwire.closed_by_peer(silent, IDLE_S * 3), f"port {port}: idle kept open"
        assert rawwire.closed_by_peer(partial, IDLE_S * 3), f"port {port}: slow header kept"
        assert time.monotonic() - t0 >= IDLE_S * 0.9
        chatty.sendall(wire.pack_frame(wire.Ping(), 10))
        assert rawwire.recv_frame(chatty)[0].msg_type == wire.T_OK
        wait_closed_all([silent, partial, chatty])


def test_connections_per_peer_capped(limited: LocalDeployment) -> None:
    for port, _ in procs(limited):
        socks = [rawwire.connect(port) for _ in range(PER_PEER)]
        for s in socks:  # all admitted and served
            s.sendall(wire.pack_frame(wire.Ping(), 1))
            assert rawwire.recv_frame(s)[0].msg_type == wire.T_OK
        extra = rawwire.connect(port)
        head, err, _ = rawwire.recv_frame(extra)  # one ERROR(E_BUSY) frame, then closed
        assert head.msg_type == wire.T_ERROR and "max_connections_per_peer" in err.message
        assert (head.req_id, err.code) == (0, E_BUSY)  # was E_BAD_REQUEST
        assert isinstance(remote_error(err.code, err.message), Busy)
        assert rawwire.closed_by_peer(extra, 3)
        extra.close()
        for s in socks:  # the N admitted ones stay usable
            s.sendall(wire.pack_frame(wire.Ping(), 2))
            assert rawwire.recv_frame(s)[0].msg_type == wire.T_OK
        wait_closed_all(socks)
        # Slots are given back: a new connection is admitted again.
        assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK


def test_bad_frame_burst_logs_a_bounded_number_of_warnings(limited: LocalDeployment) -> None:
    assert limited.meta is not None
    logs = [limited.meta.log_path, limited.servers[0].log_path]
    before = [p.read_text().count(" WARNING ") for p in logs]
    t0 = time.monotonic()
    for port, _ in procs(limited):
        for i in range(1000):
            with rawwire.connect(port) as s:
                s.sendall(b"\x00" * 24 if i % 2 else header(99, 0))
                assert rawwire.closed_by_peer(s, 3)
    time.sleep(1.1)  # a token is back: the next bad frame is logged with the count left out
    for port, _ in procs(limited):
        with rawwire.connect(port) as s:
            s.sendall(b"\x00" * 24)
            assert rawwire.closed_by_peer(s, 3)
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    after = [p.read_text().count(" WARNING ") for p in logs]
    for path, b, a in zip(logs, before, after, strict=True):
        # burst of 10, then 1 a second (both daemons' windows overlap the whole run)
        assert a - b <= 10 + elapsed + 2, f"{path.name}: {a - b} WARNING lines for 1000 bad frames"
        assert a - b >= 1
        assert "similar lines suppressed" in path.read_text()
    for port, _ in procs(limited):
        assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK


def test_refused_requests_log_a_bounded_number_of_lines(limited: LocalDeployment) -> None:
    """Requests a client can send at will that the server refuses (forged grants)
    and connections that end badly were logged one INFO line each: 2000 forged
    READs wrote 2000 lines. Now they share a rate limit like bad frames do."""
    log_path = limited.servers[0].log_path
    before = log_path.read_text().count(" INFO ")
    port = limited.servers[0].port
    forged = wire.Grant(0, 4096, int(time.time() * 1000) + 60_000, b"\x00" * 8)
    read = wire.pack_frame(wire.Read([forged], [(0, 0, 4096)]), 5)
    t0 = time.monotonic()
    with rawwire.connect(port) as s:
        for _ in range(2000):
            s.sendall(read)
            head, err, _ = rawwire.recv_frame(s)
            assert head.msg_type == wire.T_ERROR, err  # refused, connection kept
    for _ in range(200):  # connections that end mid-frame
        with rawwire.connect(port) as s:
            s.sendall(read[:-3])
    elapsed = time.monotonic() - t0
    time.sleep(0.3)
    lines = log_path.read_text().count(" INFO ") - before
    assert lines <= 2 * (10 + elapsed + 2), f"{lines} INFO lines for 2200 refusals"
    assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK
