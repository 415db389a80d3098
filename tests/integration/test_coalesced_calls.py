"""Calls issued in one event-loop pass go out in one ``sendmsg``:
the client queues frames without payload and flushes them at the end of the
pass; the meta answers every request already buffered whole and sends the replies
together. Each request is still answered on its own, in order, against a real meta:
a bad one among them gets its own ``ERROR`` and the others their results; leases
taken by coalesced Lookups are released when the connection drops."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from gcache import wire
from gcache.cli.deploy import LocalDeployment, fetch_stats
from gcache.errors import E_BAD_REQUEST, E_NO_SPACE, RemoteError
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from gcache_client.conn import PipelinedConn
from tests.kvdata import make_kv, tokens

LAYOUT = LayoutSpec(
    block_size=16,
    dtype="float16",
    layers=(LayerSpec("full", kv_heads=2, k_head_dim=64, v_head_dim=64),) * 2,
)
TOKS = tokens(64, seed=41)


def meta_counters(dep: LocalDeployment) -> dict[str, int]:
    return {k: int(v) for k, v in fetch_stats(dep.meta_grpc).counters.items()}


def test_one_pass_of_calls_is_one_send_each_answered_on_its_own(
    deployment: LocalDeployment,
) -> None:
    from gcache import keys as keymod

    c = GCacheClient(deployment.client_config(transport="tcp"))
    try:
        ns = c.register_namespace("coalesced", LAYOUT)
        assert c.put(ns, TOKS, make_kv(ns.layout, len(TOKS), seed=41)).ok
    finally:
        c.close()
    keys = keymod.block_keys(ns.fingerprint, TOKS, LAYOUT.block_size)
    assert deployment.meta is not None
    port = deployment.meta.port
    before = meta_counters(deployment)

    async def burst() -> tuple[list[Any], int, list[Any]]:
        conn = await PipelinedConn.open("127.0.0.1", port, 5.0)
        try:
            calls = [
                conn.call(wire.Lookup(ns.fingerprint, keys, True)),
                conn.call(wire.Lookup(ns.fingerprint, [b"short key"], True)),  # not 16 bytes
                conn.call(wire.Lookup(ns.fingerprint, keys, True)),
                conn.call(wire.Ping()),
            ]
            got = list(await asyncio.gather(*calls, return_exceptions=True))
            flushes = conn.flushes
            # The next pass: one more send, and the connection is still in step.
            again = list(await asyncio.gather(conn.call(wire.Ping()), conn.call(wire.Ping())))
            return got, flushes, [*again, conn.flushes]
        finally:
            conn.close()  # the leases of the two good Lookups end with the connection

    got, flushes, (p1, p2, flushes_after) = asyncio.run(burst())
    assert flushes == 1, "four calls of one loop pass were not sent together"
    assert flushes_after == 2 and isinstance(p1, wire.Ok) and isinstance(p2, wire.Ok)
    good1, bad, good2, ping = got
    for res in (good1, good2):
        assert isinstance(res, wire.LookupResult), res
        assert res.blocks == 4 and res.lease_id and len(res.objects) == 4
    assert good1.lease_id != good2.lease_id
    assert isinstance(bad, RemoteError) and bad.code == E_BAD_REQUEST, bad
    assert isinstance(ping, wire.Ok)
    # The meta answered the burst in fewer sends than replies, and released both
    # leases when the connection closed.
    deadline = time.monotonic() + 5.0
    while True:
        after = meta_counters(deployment)
        released = after["session_leases_released"] - before["session_leases_released"]
        if released >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert released == 2, (before, after)
    replies = after["hotpath_replies"] - before["hotpath_replies"]
    batches = after["hotpath_reply_batches"] - before["hotpath_reply_batches"]
    assert replies >= 6 and batches < replies, (replies, batches)


def test_coalesced_lookups_past_the_lease_bound_are_refused_each_not_hung(
    tmp_path: Path,
) -> None:
    """Four leased Lookups in one send against a meta that lets a connection hold two
    leases: two get their leases, the other two an ``ERROR(E_NO_SPACE)`` of their
    own, at once (no hang, the connection stays usable); once the two are released
    (riding on the next Lookup), a lease is granted again."""
    from gcache import keys as keymod

    dep = LocalDeployment(
        tmp_path, servers=1, capacity="16MiB", meta_args=["--max-leases-per-client", "2"]
    )
    dep.start()
    try:
        c = GCacheClient(dep.client_config(transport="tcp"))
        try:
            ns = c.register_namespace("lease-bound", LAYOUT)
            assert c.put(ns, TOKS, make_kv(ns.layout, len(TOKS), seed=42)).ok
        finally:
            c.close()
        keys = keymod.block_keys(ns.fingerprint, TOKS, LAYOUT.block_size)
        assert dep.meta is not None
        port = dep.meta.port

        async def burst() -> tuple[list[Any], int, Any]:
            conn = await PipelinedConn.open("127.0.0.1", port, 5.0)
            try:
                lookups = [conn.call(wire.Lookup(ns.fingerprint, keys, True)) for _ in range(4)]
                got = list(await asyncio.gather(*lookups, return_exceptions=True))
                flushes = conn.flushes
                leases = [r.lease_id for r in got if isinstance(r, wire.LookupResult)]
                again = await conn.call(wire.Lookup(ns.fingerprint, keys, True, leases))
                return got, flushes, again
            finally:
                conn.close()

        # A hung item would fail as ConnectionLost ("no reply within") at its
        # timeout, not as the meta's E_NO_SPACE.
        got, flushes, again = asyncio.run(burst())
        assert flushes == 1
        ok = [r for r in got if isinstance(r, wire.LookupResult)]
        refused = [r for r in got if isinstance(r, RemoteError)]
        assert len(ok) == 2 and all(r.lease_id for r in ok), got
        assert len(refused) == 2 and all(r.code == E_NO_SPACE for r in refused), got
        assert isinstance(again, wire.LookupResult) and again.lease_id
    finally:
        codes = dep.stop()
    assert all(code == 0 for code in codes.values()), codes
