"""Tier-1 (NVMe) READs served in pieces, pipelined with the send and with the
connection's next READs (gcache/server/nvme_reads.py).

Real meta + server with an NVMe tier; objects are put, pushed out of a small DRAM
segment by filler puts until the meta lists them on tier 1, then read back
byte-exact at sizes that cross the server's 1 MiB read pieces. The server's own
counters come from its ``SERVER_STATS`` frame."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gcache import wire
from gcache.benchtool.tiers import WATERMARKS
from gcache.cli.deploy import LocalDeployment
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import AsyncGCacheClient, GCacheClient, Namespace
from tests import rawwire

MiB = 1 << 20
PIECE = MiB  # gcache.server.nvme_reads.PIECE (staging)
SEND_PIECE = 4 * MiB  # gcache.server.nvme_reads.SEND_PIECE (TCP replies)
# (KV heads, K head dim, V head dim) of a one-layer uint8 object: K 1 MiB + 1 byte
# (1 byte past a piece) and V 17 bytes; K 1 MiB + 1 and V 1 MiB + 18; 16 MiB + 1298
# in all. K and V are read as separate spans, V from an unaligned offset.
SIZES = [(17, 61681, 1), (17, 61681, 61682), (129, 65025, 65041)]
BIG = SIZES[2]
TTL = 2.0  # the servers' staging_ttl_s here


def layout(h: int, k: int, v: int) -> LayoutSpec:
    return LayoutSpec(block_size=1, dtype="uint8", layers=(LayerSpec("full", h, k, v),))


def kv(h: int, k: int, v: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(0, 256, (1, h, k), dtype=np.uint8),
            rng.integers(0, 256, (1, h, v), dtype=np.uint8),
        )
    ]


def toks(seed: int) -> list[int]:
    return [seed * 7 + 1]


@pytest.fixture()
def deployment(tmp_path: Path) -> Iterator[LocalDeployment]:
    with LocalDeployment(
        tmp_path,
        servers=1,
        capacity="96MiB",
        meta_args=[*WATERMARKS, "--max-pending-per-client", "0.9", "--max-pending-total", "0.9"],
        server_args=["--heartbeat-interval-s", "0.1", "--staging-ttl-s", str(TTL)],
        nvme_size="768MiB",
    ) as d:
        d.start()
        yield d


def server_stats(port: int) -> dict[str, float]:
    _, body, _ = rawwire.call(port, wire.ServerStats())
    assert isinstance(body, wire.ServerStatsReply), body
    return body.values


def on_tier1(client: GCacheClient, ns: Namespace, seed: int) -> bool:
    m = client.match(ns, toks(seed))
    try:
        return bool(m.tokens) and all(o.grant.tier == 1 for o in m.objects.values())
    finally:
        client.release(m)


def demote(client: GCacheClient, d: LocalDeployment, objs: list[tuple[Namespace, int]]) -> None:
    """Put filler objects (pacing DRAM under 70 %) until every object in ``objs``
    lies on tier 1: rounds of twice the DRAM segment, checked between rounds only
    (a lookup counts as a use and keeps an object in DRAM)."""
    filler = client.register_namespace("nvme-reads-filler", layout(64, 32768, 32768))
    fkv = kv(64, 32768, 32768, 99)
    deadline = time.monotonic() + 120
    i = 0
    cap = d.stats().counters["capacity"]
    while True:
        for _ in range(int(2 * cap) // (4 * MiB)):
            while d.stats().counters["used"] > 0.7 * cap:
                assert time.monotonic() < deadline, "DRAM never drained"
                time.sleep(0.02)
            put(client, filler, 10_000 + i, fkv)
            i += 1
        while d.stats().counters["demotions_in_flight"]:
            time.sleep(0.05)
        if all(on_tier1(client, ns, s) for ns, s in objs):
            return
        assert time.monotonic() < deadline, "objects never reached the NVMe tier"


def put(client: GCacheClient, ns: Namespace, seed: int, data: Any) -> None:
    """Put one object, retrying while DRAM has no room (demotions make it)."""
    deadline = time.monotonic() + 60
    while True:
        res = client.put(ns, toks(seed), data)
        if res.ok and res.stored + res.deduped == 1:
            return
        assert time.monotonic() < deadline, res
        time.sleep(0.05)


def put_objects(client: GCacheClient, d: LocalDeployment) -> list[tuple[Namespace, int, Any]]:
    out = []
    for n, (h, k, v) in enumerate(SIZES):
        ns = client.register_namespace(f"nvme-reads-{h}-{k}-{v}", layout(h, k, v))
        for s in range(2):
            data = kv(h, k, v, 100 * n + s)
            put(client, ns, s, data)
            out.append((ns, s, data))
            while d.stats().counters["used"] > 0.7 * d.stats().counters["capacity"]:
                time.sleep(0.02)
    demote(client, d, [(ns, s) for ns, s, _ in out])
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_tier1_reads_byte_exact_across_pieces_and_pipelined(
    deployment: LocalDeployment, transport: str
) -> None:
    d = deployment
    client = GCacheClient(d.client_config(transport=transport))
    objs = put_objects(client, d)
    port = 0
    for ns, s, data in objs:  # one at a time
        m = client.match(ns, toks(s))
        assert all(o.grant.tier == 1 for o in m.objects.values())
        port = m.servers[0].port
        got = client.get(m)
        client.release(m)
        assert got is not None, f"{ns.model} {s}: miss"
        assert np.array_equal(np.asarray(got[0].k), data[0][0])
        assert np.array_equal(np.asarray(got[0].v), data[0][1])
    before = server_stats(port)

    async def together() -> list[bool]:  # all in flight on one connection
        async with AsyncGCacheClient(d.client_config(transport=transport)) as c:
            spaces = {
                ns.model: await c.register_namespace(ns.model, ns.layout.spec) for ns, _, _ in objs
            }

            async def one(ns: Namespace, s: int, data: Any) -> bool:
                m = await c.match(spaces[ns.model], toks(s))
                got = await c.get(m)
                await c.release(m)
                return (
                    got is not None
                    and np.array_equal(np.asarray(got[0].k), data[0][0])
                    and np.array_equal(np.asarray(got[0].v), data[0][1])
                )

            return list(await asyncio.gather(*(one(*o) for o in objs * 3)))

    assert all(asyncio.run(together()))
    after = server_stats(port)
    # New behaviour: pieces of at most 1 MiB; over TCP, READs started while another
    # is sent; on the same host (shm), every tier-1 read through the staging file.
    pieces = after["nvme_read_pieces"] - before["nvme_read_pieces"]
    # pieces of at most 1.5 SEND_PIECE: a 16 MiB object is read by 3 or more
    need = 3 * 2 * sum(h * (k + v) * 2 // (3 * SEND_PIECE) + 1 for h, k, v in SIZES)
    if transport == "tcp":
        assert pieces >= need
        assert after["nvme_replies_ahead"] > before["nvme_replies_ahead"]
        assert after["staged_reads"] == 0
    else:
        # 18 reads of up to 16 MiB at once on one connection: past the connection's
        # share of the staging area a read is refused and goes over TCP instead.
        staged = after["staged_reads"] - before["staged_reads"]
        refused = after["staging_refused"] - before["staging_refused"]
        assert staged > 0 and staged + refused == 3 * len(objs), (staged, refused)
        assert before["staged_reads"] == len(objs)  # one at a time: all staged
        assert client.stats()["staged_reads"] == len(objs)
        assert client.stats()["bytes_read_staged"] == sum(
            a.nbytes + b.nbytes for _, _, ((a, b),) in objs
        )
    client.close()  # its last staged range, if not given back yet, goes with it
    deadline = time.monotonic() + 5
    while (after := server_stats(port))["staging_ranges"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after["staging_used_bytes"] == 0
    assert after["nvme_replies_queued"] == 0
    assert after["nvme_read_buffers_lent_bytes"] == 0


def _tier_files(d: LocalDeployment) -> list[Path]:
    return [p for p in d.nvme_dir(0).rglob("*") if p.is_file() and p.stat().st_size > MiB]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_corrupted_nvme_byte_past_the_first_piece_is_a_miss(
    deployment: LocalDeployment, transport: str
) -> None:
    d = deployment
    client = GCacheClient(d.client_config(transport=transport))
    ns = client.register_namespace("nvme-reads-corrupt", layout(*BIG))
    data = kv(*BIG, 5)
    put(client, ns, 0, data)
    demote(client, d, [(ns, 0)])
    # The byte 3 MiB + 5 into K: read by the fourth piece, after the reply began.
    needle = data[0][0].tobytes()[3 * MiB + 5 - 64 : 3 * MiB + 5 + 64]
    hits = 0
    for path in _tier_files(d):
        blob = path.read_bytes()
        at = blob.find(needle)
        if at >= 0:
            fd = os.open(path, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([blob[at + 64] ^ 0xFF]), at + 64)
                os.fsync(fd)
            finally:
                os.close(fd)
            hits += 1
    assert hits == 1, hits
    m = client.match(ns, toks(0))
    assert m.tokens == 1 and all(o.grant.tier == 1 for o in m.objects.values())
    assert client.get(m) is None  # checksum mismatch: a miss, never wrong bytes
    client.release(m)
    assert client.stats()["integrity_errors"] >= 1
    if transport == "shm":
        assert client.stats()["staged_reads"] == 1  # through the staging file
    client.close()


def _raw_read(m: Any) -> bytes:
    loc = next(iter(m.objects.values()))
    g = loc.grant
    half = g.length // 2
    return wire.pack_frame(wire.Read([g], [(0, g.offset, half), (0, g.offset + half, half)]), 1)


def test_disconnect_mid_tier1_reads_gives_back_buffers_and_budget(
    deployment: LocalDeployment,
) -> None:
    """A client that asks for several 16 MiB tier-1 READs on one connection, takes a
    few bytes of the first reply and goes away: the server's pooled buffers, its
    read-ahead budget and its queued replies are all given back."""
    d = deployment
    client = GCacheClient(d.client_config(transport="tcp"))
    ns = client.register_namespace("nvme-reads-disconnect", layout(*BIG))
    for s in range(2):
        put(client, ns, s, kv(*BIG, s))
    demote(client, d, [(ns, 0), (ns, 1)])
    m = client.match(ns, toks(0))
    port = m.servers[0].port
    before = server_stats(port)
    for _ in range(3):
        sock = rawwire.connect(port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(_raw_read(m) * 6)  # six READs pipelined: some queued behind
        assert len(rawwire.recv_exact(sock, 4096)) == 4096
        time.sleep(0.3)  # the server is blocked sending, its next READs read ahead
        during = server_stats(port)
        assert during["nvme_replies_queued"] >= 2, during
        assert during["nvme_read_buffers_lent_bytes"] > 0, during
        sock.close()
        deadline = time.monotonic() + 10
        while True:
            after = server_stats(port)
            if after["nvme_read_buffers_lent_bytes"] == 0 and after["nvme_replies_queued"] == 0:
                break
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
    assert after["nvme_replies_ahead"] > before["nvme_replies_ahead"]
    got = client.get(m)  # the server still serves tier-1 reads
    client.release(m)
    assert got is not None and np.array_equal(np.asarray(got[0].k), kv(*BIG, 0)[0][0])
    client.close()


def _staged(sock: socket.socket, m: Any, release: tuple[int, ...] = ()) -> wire.Staged:
    loc = next(iter(m.objects.values()))
    g = loc.grant
    half = g.length // 2
    msg = wire.ReadStaged([g], [(0, g.offset, half), (0, g.offset + half, half)], list(release))
    sock.sendall(wire.pack_frame(msg, 1))
    _, body, _ = rawwire.recv_frame(sock)
    assert isinstance(body, wire.Staged), body
    return body


def _staged_object(d: LocalDeployment, client: GCacheClient) -> tuple[Any, int]:
    ns = client.register_namespace("nvme-reads-staging", layout(*SIZES[1]))
    put(client, ns, 0, kv(*SIZES[1], 0))
    demote(client, d, [(ns, 0)])
    m = client.match(ns, toks(0))
    return m, m.servers[0].port


def test_staging_range_never_released_expires(deployment: LocalDeployment) -> None:
    """A client that takes a staged read and never sends UNSTAGE (its connection
    stays open) holds its range only for staging_ttl_s."""
    d = deployment
    client = GCacheClient(d.client_config(transport="tcp"))
    m, port = _staged_object(d, client)
    sock = rawwire.connect(port)
    staged = _staged(sock, m)
    with open(staged.path, "rb") as fh:  # the bytes are there, in the staging file
        fh.seek(staged.offsets[0])
        want = kv(*SIZES[1], 0)[0][0].tobytes()
        assert fh.read(4096) == want[:4096]
    held = server_stats(port)
    assert held["staging_ranges"] == 1 and held["staging_used_bytes"] > 0, held
    time.sleep(TTL + 0.5)
    after = server_stats(port)
    assert after["staging_ranges"] == 0 and after["staging_used_bytes"] == 0, after
    assert after["staging_expired"] == held["staging_expired"] + 1
    sock.sendall(wire.pack_frame(wire.Unstage([staged.stage_id]), 2))
    _, body, _ = rawwire.recv_frame(sock)
    assert body == wire.Ok(0)  # nothing left to give back
    sock.close()
    client.release(m)
    client.close()


def test_staging_ranges_of_a_closed_connection_are_freed(deployment: LocalDeployment) -> None:
    d = deployment
    client = GCacheClient(d.client_config(transport="tcp"))
    m, port = _staged_object(d, client)
    sock = rawwire.connect(port)
    ids = [_staged(sock, m).stage_id for _ in range(3)]
    held = server_stats(port)
    assert held["staging_ranges"] == 3, held
    other = rawwire.connect(port)  # another connection cannot give them back
    other.sendall(wire.pack_frame(wire.Unstage(ids), 1))
    assert rawwire.recv_frame(other)[1] == wire.Ok(0)
    other.close()
    # A read gives back ranges its connection is done with (no UNSTAGE needed).
    _staged(sock, m, release=tuple(ids[:2]))
    assert server_stats(port)["staging_ranges"] == 2
    sock.close()
    deadline = time.monotonic() + 5
    while (after := server_stats(port))["staging_ranges"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after["staging_used_bytes"] == 0
    assert after["staging_freed_on_close"] == held["staging_freed_on_close"] + 2
    client.release(m)
    client.close()


def test_staged_reads_in_flight_on_one_connection_come_back_in_order(
    deployment: LocalDeployment,
) -> None:
    """Several READ_STAGED of one connection sent back to back are read into the
    staging file at once (the server counts the ones started behind an earlier
    one), answered in request order, each byte-exact; a PING behind them is
    answered after them; given back, the staging area is empty again."""
    d = deployment
    client = GCacheClient(d.client_config(transport="tcp"))
    ns = client.register_namespace("nvme-reads-staged-ahead", layout(*SIZES[1]))
    data = [kv(*SIZES[1], 10 + s) for s in range(2)]
    for s in range(2):
        put(client, ns, s, data[s])
    demote(client, d, [(ns, 0), (ns, 1)])
    ms = [client.match(ns, toks(s)) for s in range(2)]
    port = ms[0].servers[0].port
    before = server_stats(port)
    sock = rawwire.connect(port)
    n = 8
    frames = []
    for i in range(n):
        g = next(iter(ms[i % 2].objects.values())).grant
        half = g.length // 2
        ranges = [(0, g.offset, half), (0, g.offset + half, g.length - half)]
        frames.append(wire.pack_frame(wire.ReadStaged([g], ranges, []), i + 1))
    frames.append(wire.pack_frame(wire.Ping(), n + 1))
    sock.sendall(b"".join(frames))
    ids = []
    for i in range(n):
        head, body, _ = rawwire.recv_frame(sock)
        assert head.req_id == i + 1, (head.req_id, i + 1)
        assert isinstance(body, wire.Staged), body
        k, v = data[i % 2][0]
        want = k.tobytes() + v.tobytes()
        half = len(want) // 2
        with open(body.path, "rb") as fh:
            fh.seek(body.offsets[0])
            got = fh.read(half)
            fh.seek(body.offsets[1])
            got += fh.read(len(want) - half)
        assert got == want, f"reply {i + 1}: staged bytes differ"
        ids.append(body.stage_id)
    head, body, _ = rawwire.recv_frame(sock)
    assert head.req_id == n + 1 and body == wire.Ok(0)
    held = server_stats(port)
    assert held["staging_ranges"] == n, held
    assert held["staged_replies_ahead"] > before["staged_replies_ahead"], held
    sock.sendall(wire.pack_frame(wire.Unstage(ids), n + 2))
    assert rawwire.recv_frame(sock)[1] == wire.Ok(n)
    after = server_stats(port)
    assert after["staging_ranges"] == 0 and after["staging_used_bytes"] == 0, after
    sock.close()
    for m in ms:
        client.release(m)
    client.close()
