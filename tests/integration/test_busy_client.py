"""A client whose connection a real daemon refuses at its connection limits
(``ERROR(E_BUSY)`` with request id 0, then closed): the client's pending calls fail
with :class:`Busy`, a ``RemoteError`` (reads are misses, puts report the error),
and the refusal is logged once. The old client took the frame for a reply out of
order ("reply to request 0, expected 1") and failed the calls as a lost
connection, without the daemon's reason."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import E_BUSY, Busy, RemoteError
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from gcache_client.conn import PipelinedConn
from tests.kvdata import assert_layers_match, make_kv, tokens

LAYOUT = LayoutSpec(
    block_size=16,
    dtype="float16",
    layers=(LayerSpec("full", kv_heads=2, k_head_dim=64, v_head_dim=64),) * 2,
)
TOKS = tokens(64, seed=31)


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    one = ["--max-connections-per-peer", "1"]
    d = LocalDeployment(
        tmp_path_factory.mktemp("busy"),
        servers=1,
        capacity="16MiB",
        meta_args=one,
        server_args=one,
    )
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def test_second_client_at_the_limit_gets_misses_and_busy_errors(
    busy: LocalDeployment, caplog: pytest.LogCaptureFixture
) -> None:
    first = GCacheClient(busy.client_config(transport="tcp"))
    second = GCacheClient(busy.client_config(transport="tcp"))
    try:
        ns = first.register_namespace("busy", LAYOUT)
        kv = make_kv(ns.layout, len(TOKS), seed=31)
        assert first.put(ns, TOKS, kv).ok  # holds the one meta and server connection
        m = first.match(ns, TOKS)
        assert m.tokens == len(TOKS)
        ns2 = second.register_namespace("busy", LAYOUT)  # gRPC: not limited
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gcache_client.conn"):
            # The meta's hot path refuses the second client: misses, a put error.
            assert second.lookup(ns2, TOKS) == 0
            assert second.match(ns2, TOKS).tokens == 0
            res = second.put(ns2, TOKS, kv)
            assert not res.ok and res.stored == 0
            assert res.error is not None and "max_connections_per_peer 1" in res.error, res.error
            # The server refuses it too: reading the first client's lease is a miss,
            # counted as the daemon's refusal (remote_errors), not a lost connection.
            assert second.get(m) is None
            st = second.stats()
            assert st.get("remote_errors", 0) >= 1 and st.get("read_errors", 0) == 0, st
        refusals = [r for r in caplog.records if "refused the connection" in r.getMessage()]
        assert refusals and all("max_connections_per_peer" in r.getMessage() for r in refusals)
        # The first client is served throughout.
        assert_layers_match(first.get(m), kv)
        first.release(m)
    finally:
        second.close()
        first.close()


def test_pending_calls_on_a_refused_connection_fail_busy_logged_once(
    busy: LocalDeployment, caplog: pytest.LogCaptureFixture
) -> None:
    holder = GCacheClient(busy.client_config(transport="tcp"))
    try:
        ns = holder.register_namespace("busy-raw", LAYOUT)
        assert holder.put(ns, TOKS, make_kv(ns.layout, len(TOKS), seed=32)).ok
        port = busy.servers[0].port

        async def refused() -> list[BaseException | object]:
            conn = await PipelinedConn.open("127.0.0.1", port, 5.0)
            try:
                calls = [conn.call(wire.Ping(), timeout=5.0) for _ in range(3)]
                return list(await asyncio.gather(*calls, return_exceptions=True))
            finally:
                conn.close()

        caplog.clear()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="gcache_client.conn"):
            outcomes = asyncio.run(refused())
        # The old client popped a call off its queue, found the reply's id (0) did
        # not match and failed the others: that call hung for its whole timeout.
        assert time.monotonic() - t0 < 2.0
        for out in outcomes:
            assert isinstance(out, Busy), f"{out!r}"
            assert isinstance(out, RemoteError) and out.code == E_BUSY
            assert "max_connections_per_peer" in out.message
        refusals = [r for r in caplog.records if "refused the connection" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]
    finally:
        holder.close()
