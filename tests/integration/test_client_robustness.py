"""Client robustness against real daemons: a cancelled or timed-out call leaves the
shared connection usable (its reply is drained into a scratch sink, never into the
caller's buffers); the meta connection is created once under concurrency; a dead
server's connect does not hold up connects to healthy ones; an ``out`` buffer a
read cannot fill in place is refused; a restarted server's old segment is unmapped
(tmpfs usage back to one segment per server with the client alive)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import ConnectionLost, LayoutError
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import AsyncGCacheClient, GCacheClient
from gcache_client.conn import PipelinedConn
from tests.integration.test_shm_transport import _used, tiny_tmpfs  # noqa: F401
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

# One full layer of 2 MiB per 64 tokens: a READ reply big enough to still be on
# its way when the caller gives up.
BIG = LayoutSpec(
    block_size=16,
    dtype="float16",
    layers=(LayerSpec("full", kv_heads=8, k_head_dim=512, v_head_dim=512),),
)


async def _stored_read(c: AsyncGCacheClient, name: str, ntok: int) -> tuple[Any, wire.Read, int]:
    """Put a prompt, match it, and build one READ of all its bytes."""
    ns = await c.register_namespace(name, BIG)
    toks = tokens(ntok, seed=ntok)
    assert (await c.put(ns, toks, make_kv(ns.layout, ntok, seed=ntok))).ok
    m = await c.match(ns, toks)
    assert m.blocks == ntok // 16
    locs = list(m.objects.values())
    assert len({loc.server for loc in locs}) >= 1
    si = locs[0].server
    mine = [loc for loc in locs if loc.server == si]
    grants = [loc.grant for loc in mine]
    ranges = [(i, g.offset, g.length) for i, g in enumerate(grants)]
    total = sum(g.length for g in grants)
    return m.servers[si], wire.Read(grants, ranges), total


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_cancelled_or_timed_out_read_keeps_the_shared_connection(
    deployment: LocalDeployment, how: str
) -> None:
    async def scenario() -> None:
        async with AsyncGCacheClient(deployment.client_config(transport="tcp")) as c:
            addr, read, total = await _stored_read(c, f"robust-{how}", 16 * 64)
            conn = await c._server(addr)
            dest = bytearray(total)
            if how == "cancel":
                task = asyncio.create_task(conn.call(read, dest=[memoryview(dest)]))
                await asyncio.sleep(0)  # sent; its reply has not been read yet
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(ConnectionLost, match="no reply"):
                    await conn.call(read, dest=[memoryview(dest)], timeout=0)
            # Other requests on the same connection go on: the abandoned reply is
            # drained first (FIFO), into a scratch sink.
            ok = await conn.call(wire.Ping(), timeout=5)
            assert isinstance(ok, wire.Ok)
            assert not conn.closed and await c._server(addr) is conn
            assert conn.abandoned == 1
            assert dest == bytearray(total), "a drained reply never reaches the caller's buffer"
            again = bytearray(total)
            await conn.call(read, dest=[memoryview(again)], timeout=5)
            assert any(again)

    asyncio.run(scenario())


def test_meta_connection_is_opened_once_under_concurrency(
    deployment: LocalDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    real_open = PipelinedConn.open.__func__  # type: ignore[attr-defined]

    async def counting_open(cls: type[PipelinedConn], host: str, port: int, timeout: float) -> Any:
        opened.append(f"{host}:{port}")
        await asyncio.sleep(0.01)  # a connect takes a while: the race window
        return await real_open(cls, host, port, timeout)

    monkeypatch.setattr(PipelinedConn, "open", classmethod(counting_open))

    async def scenario() -> None:
        c = AsyncGCacheClient(deployment.client_config(transport="tcp"))
        try:
            ns = await c.register_namespace("robust-meta", tiny_hybrid())
            toks = tokens(16, seed=1)
            results = await asyncio.gather(*(c.lookup(ns, toks) for _ in range(20)))
            assert results == [0] * 20
        finally:
            await c.close()

    asyncio.run(scenario())
    assert opened == [deployment.meta_addr], opened


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port whose accept queue is full: connects to it hang (a dead server)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    fill = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fill.append(s)
    time.sleep(0.1)
    yield port
    for s in fill:
        s.close()
    lst.close()


def test_connect_to_a_dead_server_does_not_block_healthy_ones(
    deployment: LocalDeployment, black_hole: int
) -> None:
    async def scenario() -> None:
        cfg = deployment.client_config(transport="tcp", timeout_s=3.0)
        async with AsyncGCacheClient(cfg) as c:
            dead = wire.ServerAddr("dead", "127.0.0.1", black_hole, "elsewhere", "")
            healthy = [
                wire.ServerAddr(f"server{i}", "127.0.0.1", s.port, "elsewhere", "")
                for i, s in enumerate(deployment.servers)
            ]
            stuck = asyncio.create_task(c._server(dead))
            await asyncio.sleep(0.05)  # the dead connect is under way
            t0 = time.monotonic()
            conns = await asyncio.gather(*(c._server(a) for a in healthy))
            took = time.monotonic() - t0
            assert took < 1.0, f"healthy connects waited {took:.2f}s behind a dead one"
            assert all(not conn.closed for conn in conns)
            assert not stuck.done()
            with pytest.raises(ConnectionLost):
                await stuck

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_out_buffers_that_cannot_be_filled_in_place_are_refused(
    deployment: LocalDeployment, transport: str
) -> None:
    """A strided numpy ``out`` used to be filled through a hidden copy: the read
    returned ok with the caller's buffer untouched."""
    with GCacheClient(deployment.client_config(transport=transport)) as c:
        ns = c.register_namespace(f"robust-out-{transport}", tiny_hybrid())
        toks = tokens(16, seed=3)
        kv = make_kv(ns.layout, 16, seed=3)
        assert c.put(ns, toks, kv).ok
        m = c.match(ns, toks)

        def outs(strided: bool, readonly: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
            out = []
            for i, spec in enumerate(ns.layout.spec.layers):
                _, n = c.layer_rows(m, i)
                pair = []
                for d in (spec.k_head_dim, spec.v_head_dim):
                    a = np.zeros((2 * n if strided else n, spec.kv_heads, d), np.float16)
                    a = a[::2] if strided else a
                    a.flags.writeable = not readonly
                    pair.append(a)
                out.append((pair[0], pair[1]))
            return out

        with pytest.raises(LayoutError, match="C-contiguous"):
            c.get(m, outs(strided=True))
        with pytest.raises(LayoutError, match="C-contiguous"):
            list(c.get_layers(m, outs(strided=True)))
        with pytest.raises(LayoutError, match="writable"):
            c.get(m, outs(strided=False, readonly=True))
        good = outs(strided=False)
        got = c.get(m, good)
        assert got is not None
        assert_layers_match(got, kv)
        assert all(g.k is o[0] for g, o in zip(got, good, strict=True))
        c.release(m)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_restarted_server_segment_is_unmapped_with_the_client_alive(
    tmp_path: Path,
    tiny_tmpfs: Path,  # noqa: F811
) -> None:
    """kill -9 and restart a server twice on a 64 MiB tmpfs with 24 MiB segments,
    with one shared-memory client alive throughout. Old clients kept each dead
    segment mapped, so tmpfs filled up and the second restart failed with "does
    not fit"; now the client drops a mapping when the incarnation changes."""
    seg = 24 << 20
    d = LocalDeployment(
        tmp_path / "d",
        servers=1,
        capacity="24MiB",
        server_ports=[_free_port()],
        server_args=["--shm-dir", str(tiny_tmpfs)],
    )
    with d, GCacheClient(d.client_config(transport="shm")) as c:
        ns = c.register_namespace("robust-restart", tiny_hybrid())
        for round_ in range(3):
            toks = tokens(32, seed=500 + round_)
            kv = make_kv(ns.layout, 32, seed=500 + round_)
            res = c.put(ns, toks, kv)
            assert res.ok and res.stored > 0, res
            m = c.match(ns, toks)
            assert_layers_match(c.get(m), kv)
            c.release(m)
            assert c.stats()["mapped_segments"] == 1
            assert _used(tiny_tmpfs) < 2 * seg, f"round {round_}: {_used(tiny_tmpfs)} used"
            if round_ < 2:
                d.kill_server(0)
                d.start_server(0)
                d.wait_servers(1)
        assert c.stats()["retired_mappings"] == 2
