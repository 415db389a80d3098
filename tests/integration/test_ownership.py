"""Puts and leases belong to the hot-path connection that made them,
against a real meta and server: another connection cannot commit, abort or
release them, a closed connection's puts and leases end at once, and a write
grant of an aborted put can never change an object committed after it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gcache import keys, wire
from gcache.cli.deploy import LocalDeployment
from gcache.errors import E_ACCESS_DENIED, E_UNKNOWN_PUT
from gcache_client import GCacheClient, Namespace
from tests import rawwire
from tests.kvdata import tiny_hybrid, tokens


@pytest.fixture(scope="module")
def one_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """One server: a freed range is re-used by the next put of the same size, which
    is where a stale grant used to land."""
    d = LocalDeployment(tmp_path_factory.mktemp("own"), servers=1, capacity="16MiB")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def ns(one_server: LocalDeployment) -> Iterator[Namespace]:
    c = GCacheClient(one_server.client_config())
    yield c.register_namespace("ownership", tiny_hybrid())
    c.close()


class Conn:
    """A raw hot-path connection (one meta session)."""

    def __init__(self, port: int) -> None:
        self.sock = rawwire.connect(port)
        self.req = 0

    def call(self, msg: wire.Msg, payload: bytes = b"") -> tuple[int, Any]:
        self.req += 1
        self.sock.sendall(wire.pack_frame(msg, self.req, len(payload)) + payload)
        head, body, _ = rawwire.recv_frame(self.sock)
        assert head.req_id == self.req
        return head.msg_type, body

    def close(self) -> None:
        self.sock.close()


def meta_port(d: LocalDeployment) -> int:
    assert d.meta is not None and d.meta.port is not None
    return d.meta.port


def stat(d: LocalDeployment, name: str) -> float:
    return float(dict(d.stats().counters).get(name, 0.0))


def begin(conn: Conn, ns: Namespace, seed: int, nblk: int = 2) -> wire.PutPlaced:
    toks = [int(t) for t in tokens(4 * nblk, seed=seed)]
    ks = keys.block_keys(ns.fingerprint, toks, ns.layout.block_size)
    t, placed = conn.call(wire.PutBegin(ns.fingerprint, ks, ns.layout.groups_to_store(nblk)))
    assert t == wire.T_PUT_PLACED and placed.placements, placed
    assert isinstance(placed, wire.PutPlaced)
    KEYS[placed.put_id] = (ns, ks)
    return placed


# Prompt keys of each put begun here, for the records its grants are bound to.
KEYS: dict[int, tuple[Namespace, list[bytes]]] = {}


def bound_write(placed: wire.PutPlaced, p: wire.Placement) -> wire.Write:
    """A WRITE of placement ``p`` with the record its grant is bound to."""
    ns, ks = KEYS[placed.put_id]
    return wire.Write(p.grant, rawwire.obj(ns.fingerprint, ns.layout, ks, p))


def write_all(placed: wire.PutPlaced, fill: bytes) -> list[int]:
    """WRITE every placement with ``fill`` bytes; returns the receipts."""
    receipts = []
    for p in placed.placements:
        head, body, _ = rawwire.call(
            placed.servers[p.server].port, bound_write(placed, p), fill * p.grant.length
        )
        assert head.msg_type == wire.T_OK, body
        receipts.append(body.value)
    return receipts


def commit_msg(ns: Namespace, placed: wire.PutPlaced, receipts: list[int]) -> wire.PutCommit:
    done = [
        (i, bytes(8 * len(ns.layout.group_layers[p.group])))
        for i, p in enumerate(placed.placements)
    ]
    return wire.PutCommit(placed.put_id, done, receipts)


def test_another_connection_cannot_commit_abort_or_release(
    one_server: LocalDeployment, ns: Namespace
) -> None:
    a, b = Conn(meta_port(one_server)), Conn(meta_port(one_server))
    try:
        placed = begin(a, ns, seed=1)
        assert placed.put_id > 1 << 32  # a random 64-bit id, not 1, 2, 3...
        receipts = write_all(placed, b"\x11")
        # b knows the id (it guessed it, or a restarted meta re-used it): refused.
        assert b.call(wire.PutAbort(placed.put_id)) == (wire.T_OK, wire.Ok(0))
        t, err = b.call(commit_msg(ns, placed, receipts))
        assert t == wire.T_ERROR and err.code == E_UNKNOWN_PUT
        # The owner commits everything it wrote.
        t, ok = a.call(commit_msg(ns, placed, receipts))
        assert t == wire.T_OK and ok.value == len(placed.placements)
        toks = [int(x) for x in tokens(8, seed=1)]
        ks = keys.block_keys(ns.fingerprint, toks, ns.layout.block_size)
        t, res = a.call(wire.Lookup(ns.fingerprint, ks, lease=True))
        assert t == wire.T_LOOKUP_RESULT and res.blocks == 2 and res.lease_id
        assert b.call(wire.Release(res.lease_id)) == (wire.T_OK, wire.Ok(0))
        assert a.call(wire.Release(res.lease_id)) == (wire.T_OK, wire.Ok(1))
    finally:
        a.close()
        b.close()


def test_closed_connection_ends_its_puts_and_leases_at_once(
    one_server: LocalDeployment, ns: Namespace
) -> None:
    a = Conn(meta_port(one_server))
    placed = begin(a, ns, seed=2)
    receipts = write_all(placed, b"\x22")
    assert a.call(commit_msg(ns, placed, receipts))[0] == wire.T_OK
    begin(a, ns, seed=3)  # left pending
    toks = [int(x) for x in tokens(8, seed=2)]
    ks = keys.block_keys(ns.fingerprint, toks, ns.layout.block_size)
    assert a.call(wire.Lookup(ns.fingerprint, ks, lease=True))[1].lease_id
    assert stat(one_server, "pending_puts") == 1 and stat(one_server, "active_leases") == 1
    a.close()
    # put_timeout_s is 30 s and lease_ttl_s 10 s: only the closed connection ends them.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if stat(one_server, "pending_puts") == 0 and stat(one_server, "active_leases") == 0:
            break
        time.sleep(0.05)
    assert stat(one_server, "pending_puts") == 0 and stat(one_server, "active_leases") == 0
    assert stat(one_server, "session_puts_aborted") >= 1


def test_stale_write_grant_cannot_change_a_committed_object(
    one_server: LocalDeployment, ns: Namespace
) -> None:
    """A begins a put and aborts it, keeping its write grants; B then commits the
    same blocks. Old code handed B the very ranges A's grants cover (the allocator
    re-uses a freed range first), so A's stale WRITE overwrote B's committed object.
    Now A's ranges are quarantined until its grants expire: B gets other ranges,
    A's write lands in the quarantine, and B's object reads back byte-identical."""
    a, b = Conn(meta_port(one_server)), Conn(meta_port(one_server))
    try:
        pa = begin(a, ns, seed=4)
        assert a.call(wire.PutAbort(pa.put_id)) == (wire.T_OK, wire.Ok(1))
        pb = begin(b, ns, seed=4)
        a_ranges = [(p.grant.offset, p.grant.length) for p in pa.placements]
        for p in pb.placements:
            for off, n in a_ranges:
                assert p.grant.offset + p.grant.length <= off or off + n <= p.grant.offset
        receipts = write_all(pb, b"\xbb")
        assert b.call(commit_msg(ns, pb, receipts))[1].value == len(pb.placements)
        # A's stale grants: the server still takes them (unused, unexpired), but
        # they only cover quarantined ranges.
        for p in pa.placements:
            head, _, _ = rawwire.call(
                pa.servers[p.server].port, bound_write(pa, p), b"\xaa" * p.grant.length
            )
            assert head.msg_type == wire.T_OK
        # B's own grants were consumed by its writes: a replay is refused.
        p = pb.placements[0]
        head, body, _ = rawwire.call(
            pb.servers[p.server].port, bound_write(pb, p), b"\xcc" * p.grant.length
        )
        assert head.msg_type == wire.T_ERROR and body.code == E_ACCESS_DENIED
        # B's committed object reads back byte-identical.
        toks = [int(x) for x in tokens(8, seed=4)]
        ks = keys.block_keys(ns.fingerprint, toks, ns.layout.block_size)
        t, res = b.call(wire.Lookup(ns.fingerprint, ks, lease=True))
        assert t == wire.T_LOOKUP_RESULT and res.blocks == 2
        for loc in res.objects:
            g = loc.grant
            head, _, payload = rawwire.call(
                res.servers[loc.server].port, wire.Read([g], [(0, g.offset, g.length)])
            )
            assert head.msg_type == wire.T_READ_DATA
            assert payload == b"\xbb" * g.length
        b.call(wire.Release(res.lease_id))
    finally:
        a.close()
        b.close()
