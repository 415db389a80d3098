"""Malformed and hostile input: a clear error or a closed connection, the daemon
keeps serving everyone else, and no committed object changes."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import (
    E_ACCESS_DENIED,
    E_BAD_REQUEST,
    E_OUT_OF_RANGE,
    E_UNKNOWN_NAMESPACE,
    LayoutError,
)
from gcache_client import GCacheClient, Match, Namespace
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

TOKS = tokens(40, seed=77)


@pytest.fixture(scope="module")
def stored(deployment: LocalDeployment) -> Iterator[tuple[GCacheClient, Namespace, list]]:  # type: ignore[type-arg]
    c = GCacheClient(deployment.client_config(transport="tcp"))
    ns = c.register_namespace("bad-input", tiny_hybrid())
    kv = make_kv(ns.layout, len(TOKS), seed=77)
    assert c.put(ns, TOKS, kv).ok
    yield c, ns, kv
    c.close()


def assert_intact(client: GCacheClient, ns: Namespace, kv: list) -> None:  # type: ignore[type-arg]
    m = client.match(ns, TOKS)
    assert m.tokens == 40
    assert_layers_match(client.get(m), kv)
    client.release(m)


def ports(d: LocalDeployment) -> list[int]:
    assert d.meta is not None
    return [d.meta.port, *(s.port for s in d.servers)]


def fresh_match(stored) -> Match:  # type: ignore[no-untyped-def]
    c, ns, _ = stored
    return c.match(ns, TOKS)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 24,  # bad magic
        struct.pack("!HBBHHIIQ", wire.MAGIC, 99, wire.T_PING, 0, 0, 1, 0, 0),  # bad version
        struct.pack("!HBBHHIIQ", wire.MAGIC, 1, 200, 0, 0, 1, 0, 0),  # unknown type
        struct.pack("!HBBHHIIQ", wire.MAGIC, 1, wire.T_PING, 0, 0, 1, 1 << 30, 0),  # huge body
        struct.pack("!HBBHHIIQ", wire.MAGIC, 1, wire.T_LOOKUP, 0, 0, 1, 5, 0)
        + b"\xc1\xc1\xc1\xc1\xc1",
        struct.pack("!HBBHHIIQ", wire.MAGIC, 1, wire.T_PING, 0, 0, 1, 0, 1000),  # payload on PING
        b"GC\x01",  # truncated header, then the client goes away
    ],
    ids=["magic", "version", "type", "body-len", "body-junk", "payload", "truncated"],
)
def test_malformed_frames_close_only_that_connection(deployment, stored, garbage: bytes) -> None:  # type: ignore[no-untyped-def]
    for port in ports(deployment):
        s = rawwire.connect(port)
        s.sendall(garbage)
        if garbage == b"GC\x01":
            s.shutdown(socket.SHUT_WR)
        assert rawwire.closed_by_peer(s), f"port {port} kept a broken connection open"
        s.close()
        # The daemon still answers others.
        head, _, _ = rawwire.call(port, wire.Ping())
        assert head.msg_type == wire.T_OK
    c, ns, kv = stored
    assert_intact(c, ns, kv)
    assert all(p.alive for p in [deployment.meta, *deployment.servers])  # type: ignore[list-item]


def test_meta_refuses_unknown_namespace_and_bad_keys(deployment, stored) -> None:  # type: ignore[no-untyped-def]
    port = ports(deployment)[0]
    head, body, _ = rawwire.call(port, wire.Lookup(b"\x01" * 16, [b"\x02" * 16]))
    assert head.msg_type == wire.T_ERROR and body.code == E_UNKNOWN_NAMESPACE
    _, ns, _ = stored
    head, body, _ = rawwire.call(port, wire.PutBegin(ns.fingerprint, [b"short"], [1]))
    assert head.msg_type == wire.T_ERROR and body.code == E_BAD_REQUEST
    head, body, _ = rawwire.call(port, wire.PutCommit(987654, [(0, b"")]))
    assert head.msg_type == wire.T_ERROR and "unknown" in body.message
    # Errors leave the connection usable: several requests on one socket.
    with rawwire.connect(port) as s:
        s.sendall(
            wire.pack_frame(wire.Lookup(b"\x01" * 16, []), 1) + wire.pack_frame(wire.Ping(), 2)
        )
        h1, _, _ = rawwire.recv_frame(s)
        h2, _, _ = rawwire.recv_frame(s)
        assert (h1.req_id, h1.msg_type, h2.req_id, h2.msg_type) == (1, wire.T_ERROR, 2, wire.T_OK)
    c, ns, kv = stored
    assert_intact(c, ns, kv)


def test_server_refuses_reads_without_a_valid_grant(deployment, stored) -> None:  # type: ignore[no-untyped-def]
    m = fresh_match(stored)
    loc = m.objects[(0, 0)]
    port = m.servers[loc.server].port
    g = loc.grant
    cases = [
        (wire.Read([], [(0, g.offset, 16)]), E_BAD_REQUEST),  # no grant at all
        (
            wire.Read(
                [wire.Grant(g.offset, g.length, g.expiry_ms, b"\x00" * 8)], [(0, g.offset, 16)]
            ),
            E_ACCESS_DENIED,
        ),  # forged tag
        (
            wire.Read(
                [wire.Grant(g.offset, g.length + 4096, g.expiry_ms, g.tag)], [(0, g.offset, 16)]
            ),
            E_ACCESS_DENIED,
        ),  # grant widened by the client
        (wire.Read([g], [(0, g.offset + g.length - 8, 16)]), E_OUT_OF_RANGE),  # past the grant
        (
            wire.Read([wire.Grant(1 << 40, 16, g.expiry_ms, g.tag)], [(0, 1 << 40, 16)]),
            E_OUT_OF_RANGE,
        ),  # past the segment
        (
            wire.Read([wire.Grant(g.offset, g.length, 1, g.tag)], [(0, g.offset, 16)]),
            E_ACCESS_DENIED,
        ),  # expired
    ]
    for msg, code in cases:
        head, body, payload = rawwire.call(port, msg)
        assert head.msg_type == wire.T_ERROR and body.code == code, (msg, body)
        assert payload == b""
    # A read grant is not a write grant: the committed object cannot be overwritten.
    head, body, _ = rawwire.call(port, wire.Write(g), b"\xee" * g.length)
    assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
    # The legitimate read still works.
    head, body, payload = rawwire.call(port, wire.Read([g], [(0, g.offset, 16)]))
    assert head.msg_type == wire.T_READ_DATA and len(payload) == 16
    c, ns, kv = stored
    c.release(m)
    assert_intact(c, ns, kv)


def test_writes_with_bad_lengths_or_grants(deployment, stored) -> None:  # type: ignore[no-untyped-def]
    c, ns, kv = stored
    meta_port = ports(deployment)[0]
    toks = tokens(8, seed=500)
    from gcache import keys

    ks = keys.block_keys(ns.fingerprint, toks, ns.layout.block_size)
    _, placed, _ = rawwire.call(meta_port, wire.PutBegin(ns.fingerprint, ks, [1, 1]))
    p = placed.placements[0]
    port = placed.servers[p.server].port
    g = p.grant
    # Payload shorter than the grant: refused, drained, connection stays usable.
    with rawwire.connect(port) as s:
        s.sendall(
            wire.pack_frame(wire.Write(g), 1, 10) + b"x" * 10 + wire.pack_frame(wire.Ping(), 2)
        )
        h1, b1, _ = rawwire.recv_frame(s)
        h2, _, _ = rawwire.recv_frame(s)
        assert h1.msg_type == wire.T_ERROR and b1.code == E_BAD_REQUEST and h2.msg_type == wire.T_OK
    # A grant moved past the segment end.
    bad = wire.Grant(1 << 40, g.length, g.expiry_ms, g.tag)
    head, body, _ = rawwire.call(port, wire.Write(bad), b"y" * g.length)
    assert head.msg_type == wire.T_ERROR and body.code == E_OUT_OF_RANGE
    # A huge declared payload with a bad grant: error, then the server hangs up
    # rather than reading gigabytes.
    with rawwire.connect(port) as s:
        s.sendall(wire.pack_frame(wire.Write(bad), 1, 3 << 30))
        h, _, _ = rawwire.recv_frame(s)
        assert h.msg_type == wire.T_ERROR
        assert rawwire.closed_by_peer(s)
    # The client disconnects in the middle of a legitimate write.
    s = rawwire.connect(port)
    own = rawwire.obj(ns.fingerprint, ns.layout, ks, p)
    s.sendall(wire.pack_frame(wire.Write(g, own), 1, g.length) + b"z" * (g.length // 2))
    s.close()
    head, _, _ = rawwire.call(port, wire.Ping())
    assert head.msg_type == wire.T_OK
    # Abort the half-written put: nothing of it becomes visible.
    head, _, _ = rawwire.call(meta_port, wire.PutAbort(placed.put_id))
    assert head.msg_type == wire.T_OK
    assert c.lookup(ns, toks) == 0
    assert_intact(c, ns, kv)


def test_put_that_does_not_match_the_layout(deployment, stored) -> None:  # type: ignore[no-untyped-def]
    c, ns, kv = stored
    before = dict(deployment.stats().counters)
    toks = tokens(40, seed=600)
    with pytest.raises(LayoutError, match="layers"):
        c.put(ns, toks, kv[:2])
    wrong_shape = [(k[:, :, :3], v) for k, v in kv]
    with pytest.raises(LayoutError, match="shape"):
        c.put(ns, toks, wrong_shape)
    wrong_dtype = [(k.astype(np.float32), v.astype(np.float32)) for k, v in kv]
    with pytest.raises(LayoutError, match="element size"):
        c.put(ns, toks, wrong_dtype)
    short = [(k[:10], v[:10]) for k, v in kv]
    with pytest.raises(LayoutError):
        c.put(ns, toks, short)
    after = dict(deployment.stats().counters)
    for key in ("objects", "bytes_stored", "puts_begun"):
        assert after.get(key, 0) == before.get(key, 0), key
    assert_intact(c, ns, kv)
