"""What one READ may cost a real ``gcache-server``: its reply is at most the bytes
its distinct grants cover, and a reply waiting on a client that stopped reading
holds its ranges compactly, its views made a batch at a time as the socket takes
them (gcache/server/core.py ``read_views``, ``ReadReply``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import E_BAD_REQUEST
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import make_kv, tokens

# Objects of 128 KiB (16 tokens x 8 heads x 128 x fp16, K and V, 2 layers).
LAYOUT = LayoutSpec(
    block_size=16,
    dtype="float16",
    layers=(LayerSpec("full", kv_heads=8, k_head_dim=128, v_head_dim=128),) * 2,
)
N_RANGES = 65536
READERS = 16


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    # A send timeout far beyond the test: stalled readers stay stalled while measured.
    d = LocalDeployment(
        tmp_path_factory.mktemp("readbounds"),
        servers=1,
        capacity="64MiB",
        server_args=["--send-timeout-s", "300"],
    )
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


@pytest.fixture(scope="module")
def grants(dep: LocalDeployment) -> Iterator[list[wire.Grant]]:
    """Read grants of 16 MiB of stored objects (128 of 128 KiB), all on server 0."""
    client = GCacheClient(dep.client_config(transport="tcp"))
    try:
        ns = client.register_namespace("bounds", LAYOUT)
        toks = tokens(2048, seed=21)
        assert client.put(ns, toks, make_kv(ns.layout, len(toks), seed=21)).ok
        m = client.match(ns, toks)
        gs = sorted({o.grant.offset: o.grant for o in m.objects.values()}.values(), key=_off)
        assert len(gs) == 128 and all(g.length == 128 << 10 for g in gs)
        yield gs
        client.release(m)
    finally:
        client.close()


def _off(g: wire.Grant) -> int:
    return g.offset


def rss_anon(pid: int) -> int:
    """Private memory of a process (its heap), not the shared segment it touched."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_read_repeating_a_grant_is_refused_not_amplified(
    dep: LocalDeployment, grants: list[wire.Grant]
) -> None:
    """65536 copies of one 128 KiB granted range: a 0.5 MiB request that asked the
    server for an 8 GiB reply. Now refused with E_BAD_REQUEST (the connection stays
    usable); a READ up to its distinct grants' bytes is still served."""
    port = dep.servers[0].port
    g = grants[0]
    with rawwire.connect(port) as s:
        s.sendall(wire.pack_frame(wire.Read([g], [(0, g.offset, g.length)] * N_RANGES), 1))
        head, body, _ = rawwire.recv_frame(s)
        assert head.msg_type == wire.T_ERROR, f"answered {head} for an 8 GiB reply"
        assert body.code == E_BAD_REQUEST and "distinct grants cover" in body.message
        # The same grant listed twice still counts once.
        twice = wire.Read([g, g], [(0, g.offset, g.length), (1, g.offset, 1)])
        s.sendall(wire.pack_frame(twice, 2))
        head, body, _ = rawwire.recv_frame(s)
        assert head.msg_type == wire.T_ERROR and body.code == E_BAD_REQUEST
        # Repeats within the granted bytes are fine: the connection still serves.
        half = g.length // 2
        ok = wire.Read([g], [(0, g.offset, half), (0, g.offset, half)])
        s.sendall(wire.pack_frame(ok, 3))
        head, _, payload = rawwire.recv_frame(s)
        assert head.msg_type == wire.T_READ_DATA and head.req_id == 3
        assert payload == payload[:half] * 2


def test_stalled_readers_of_65536_ranges_hold_little_memory(
    dep: LocalDeployment, grants: list[wire.Grant]
) -> None:
    """16 clients each send a READ of 65536 ranges (256 bytes each, 16 MiB of reply
    over 16 MiB of grants) and read nothing. The server built all 65536 views of
    each reply up front and held them while the send waited: about 14 MiB per
    stalled reader. Now it holds 16 bytes a range and one batch of views."""
    port, pid = dep.servers[0].port, dep.servers[0].popen.pid
    span = 256
    per_grant = N_RANGES // len(grants)
    ranges = [
        (gi, g.offset + j * (g.length // per_grant), span)
        for gi, g in enumerate(grants)
        for j in range(per_grant)
    ]
    frame = wire.pack_frame(wire.Read(grants, ranges), 5)
    total = span * N_RANGES
    # Warm up the server's allocator with the same READ, answered in full.
    with rawwire.connect(port) as s:
        s.sendall(frame)
        head, _, expected = rawwire.recv_frame(s)
        assert head.msg_type == wire.T_READ_DATA and len(expected) == total
    time.sleep(0.3)
    base = rss_anon(pid)
    socks: list[socket.socket] = []
    try:
        for _ in range(READERS):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            s.settimeout(10)
            s.connect(("127.0.0.1", port))
            s.sendall(frame)
            socks.append(s)  # never read: the server's send stalls
        time.sleep(1.5)
        # Everyone else is still served meanwhile.
        assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK
        grown = rss_anon(pid) - base
        assert grown < 64 << 20, (
            f"server heap grew {grown >> 20} MiB for {READERS} stalled 65536-range READs"
        )
        # A stalled reply, once read, is whole and in order.
        s = socks[0]
        s.settimeout(30)
        head, _, payload = rawwire.recv_frame(s)
        assert head.msg_type == wire.T_READ_DATA and head.req_id == 5
        assert payload == expected
    finally:
        for s in socks:
            s.close()
