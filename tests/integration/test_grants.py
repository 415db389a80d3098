"""One-shot write grants and receipts against real daemons: a server consumes a
write grant with its first ``WRITE`` or ``SEAL`` and refuses any replay; every
consumed grant earns a receipt the client hands to the meta in ``PutCommit``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gcache import keys, wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import E_ACCESS_DENIED
from gcache_client import GCacheClient, Namespace
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens


@pytest.fixture(scope="module")
def ns(deployment: LocalDeployment) -> Iterator[Namespace]:
    with GCacheClient(deployment.client_config(transport="tcp")) as c:
        yield c.register_namespace("grants", tiny_hybrid())


# Prompt keys of each put begun here, for the records its grants are bound to.
KEYS: dict[int, tuple[Namespace, list[bytes]]] = {}


def _placed(d: LocalDeployment, ns: Namespace, seed: int) -> wire.PutPlaced:
    assert d.meta is not None
    ks = keys.block_keys(ns.fingerprint, tokens(8, seed=seed), ns.layout.block_size)
    head, placed, _ = rawwire.call(d.meta.port, wire.PutBegin(ns.fingerprint, ks, [1, 1]))
    assert head.msg_type == wire.T_PUT_PLACED, placed
    assert len(placed.placements) == 2
    KEYS[placed.put_id] = (ns, ks)
    return placed  # type: ignore[no-any-return]


def _obj(placed: wire.PutPlaced, p: wire.Placement) -> wire.ObjectInfo:
    ns, ks = KEYS[placed.put_id]
    return rawwire.obj(ns.fingerprint, ns.layout, ks, p)


def _write(placed: wire.PutPlaced, p: wire.Placement) -> wire.Write:
    return wire.Write(p.grant, _obj(placed, p))


def _seal(placed: wire.PutPlaced, ps: list[wire.Placement]) -> wire.Seal:
    return wire.Seal([p.grant for p in ps], [_obj(placed, p) for p in ps])


def _send(s: Any, msg: wire.Msg, req_id: int, payload: bytes = b"") -> tuple[Any, Any]:
    s.sendall(wire.pack_frame(msg, req_id, len(payload)) + payload)
    head, body, _ = rawwire.recv_frame(s)
    assert head.req_id == req_id
    return head, body


def test_replayed_write_grant_is_refused_by_the_server(
    deployment: LocalDeployment, ns: Namespace
) -> None:
    placed = _placed(deployment, ns, seed=1)
    p = placed.placements[0]
    port = placed.servers[p.server].port
    g = p.grant
    with rawwire.connect(port) as s:
        head, body = _send(s, _write(placed, p), 1, b"a" * g.length)
        assert head.msg_type == wire.T_OK
        assert 0 <= body.value < 1 << 64  # the receipt
        # The same grant again, on this connection and on a fresh one: refused,
        # the payload drained, the connection still usable.
        head, body = _send(s, _write(placed, p), 2, b"b" * g.length)
        assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
        assert "already used" in body.message
        head, _ = _send(s, wire.Ping(), 3)
        assert head.msg_type == wire.T_OK
    head, body, _ = rawwire.call(port, _write(placed, p), b"c" * g.length)
    assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
    rawwire.call(deployment.meta.port, wire.PutAbort(placed.put_id))  # type: ignore[union-attr]


def test_seal_then_write_refused(deployment: LocalDeployment, ns: Namespace) -> None:
    placed = _placed(deployment, ns, seed=2)
    by_server: dict[int, list[wire.Placement]] = {}
    for p in placed.placements:
        by_server.setdefault(p.server, []).append(p)
    for si, ps in by_server.items():
        port = placed.servers[si].port
        with rawwire.connect(port) as s:
            head, body = _send(s, _seal(placed, ps), 1)
            assert head.msg_type == wire.T_SEALED, body
            assert len(body.receipts) == len(ps)
            assert len(set(body.receipts)) == len(ps)
            for i, p in enumerate(ps):
                g = p.grant
                head, body = _send(s, _write(placed, p), 10 + i, b"x" * g.length)
                assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
                head, body = _send(s, _seal(placed, [p]), 20 + i)
                assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
    rawwire.call(deployment.meta.port, wire.PutAbort(placed.put_id))  # type: ignore[union-attr]


def test_write_then_seal_refused_and_a_refused_seal_consumes_nothing(
    deployment: LocalDeployment, ns: Namespace
) -> None:
    placed = _placed(deployment, ns, seed=3)
    p0, p1 = placed.placements
    fresh = None if p0.server != p1.server else p1  # both on one server: the interesting case
    port = placed.servers[p0.server].port
    with rawwire.connect(port) as s:
        head, _ = _send(s, _write(placed, p0), 1, b"w" * p0.grant.length)
        assert head.msg_type == wire.T_OK
        head, body = _send(s, _seal(placed, [p0]), 2)
        assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
        if fresh is not None:
            head, body = _send(s, _seal(placed, [fresh, p0]), 3)
            assert head.msg_type == wire.T_ERROR
            head, body = _send(s, _seal(placed, [fresh]), 4)  # not consumed by the refusal
            assert head.msg_type == wire.T_SEALED and len(body.receipts) == 1
    rawwire.call(deployment.meta.port, wire.PutAbort(placed.put_id))  # type: ignore[union-attr]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_put_commits_one_receipt_per_done_entry(
    deployment: LocalDeployment, ns: Namespace, transport: str
) -> None:
    """The client sends ``PutCommit(put_id, done, receipts)`` with one receipt per
    done entry (from ``WRITE`` replies on TCP, from ``SEAL`` on shared memory),
    and the put still round-trips."""
    with GCacheClient(deployment.client_config(transport=transport)) as c:
        sent: list[wire.PutCommit] = []
        real = c.aio.meta.call

        async def spy(msg: wire.Msg) -> Any:
            if isinstance(msg, wire.PutCommit):
                sent.append(msg)
            return await real(msg)

        c.aio.meta.call = spy  # type: ignore[method-assign]
        toks = tokens(40, seed={"tcp": 41, "shm": 42}[transport])
        kv = make_kv(ns.layout, len(toks), seed=5)
        res = c.put(ns, toks, kv)
        assert res.ok and res.stored > 0
        (commit,) = sent
        assert len(commit.receipts) == len(commit.done) == res.stored
        assert len(set(commit.receipts)) == len(commit.receipts)
        assert all(0 <= r < 1 << 64 for r in commit.receipts)
        m = c.match(ns, toks)
        assert_layers_match(c.get(m), kv)
        c.release(m)
        if transport == "shm":
            assert c.stats().get("bytes_read_shm", 0) > 0


def test_shared_memory_writes_count_at_the_server(deployment: LocalDeployment) -> None:
    """``gcache status`` counts shared-memory writes: the SEAL counts them."""

    def writes() -> int:
        return sum(s.counters.writes for s in deployment.stats().servers)

    with GCacheClient(deployment.client_config(transport="shm")) as c:
        ns = c.register_namespace("grants-shm-count", tiny_hybrid())
        time.sleep(1.2)  # two heartbeats: counters settled
        before = writes()
        toks = tokens(40, seed=77)
        res = c.put(ns, toks, make_kv(ns.layout, len(toks), seed=77))
        assert res.ok and res.stored > 0
        deadline = time.monotonic() + 5
        while writes() < before + res.stored and time.monotonic() < deadline:
            time.sleep(0.1)
        assert writes() >= before + res.stored


def _persisted(port: int) -> float:
    head, body, _ = rawwire.call(port, wire.ServerStats())
    assert head.msg_type == wire.T_SERVER_STATS_REPLY, body
    return float(body.values["records_persisted"])


def test_a_write_grant_writes_only_the_object_it_was_minted_for(
    deployment: LocalDeployment, ns: Namespace
) -> None:
    """A grant presented with another object's record (key, parent, position,
    group, namespace), or with none, is refused on WRITE and SEAL: nothing is
    written, consumed or recorded; with its own record it then writes once."""
    placed = _placed(deployment, ns, seed=5)
    p = placed.placements[0]
    port = placed.servers[p.server].port
    own = _obj(placed, p)
    _, ks = KEYS[placed.put_id]
    forged = [
        wire.ObjectInfo(own.namespace, bytes(16), own.parent, own.pos, own.group, own.sums),
        wire.ObjectInfo(own.namespace, ks[1 - p.block], own.parent, own.pos, own.group, own.sums),
        wire.ObjectInfo(own.namespace, own.key, own.parent, own.pos + 1, own.group, own.sums),
        wire.ObjectInfo(own.namespace, own.key, own.parent, own.pos, own.group + 1, own.sums),
        wire.ObjectInfo(bytes(16), own.key, own.parent, own.pos, own.group, own.sums),
        wire.ObjectInfo(own.namespace, own.key, b"\x01" * 16, own.pos, own.group, own.sums),
    ]
    before = _persisted(port)
    g = p.grant
    with rawwire.connect(port) as s:
        for i, bad in enumerate(forged):
            head, body = _send(s, wire.Write(g, bad), 10 + i, b"f" * g.length)
            assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED, body
            head, body = _send(s, wire.Seal([g], [bad]), 30 + i)
            assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED, body
        head, body = _send(s, wire.Write(g), 50, b"f" * g.length)  # no record at all
        assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED, body
        assert _persisted(port) == before
        head, body = _send(s, wire.Write(g, own), 51, b"o" * g.length)
        assert head.msg_type == wire.T_OK, body
    assert _persisted(port) == before + 1
    rawwire.call(deployment.meta.port, wire.PutAbort(placed.put_id))  # type: ignore[union-attr]
