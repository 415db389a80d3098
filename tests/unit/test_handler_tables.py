"""Every message type a framed daemon serves is handled by one function named for
it (``T_PUT_BEGIN`` -> ``put_begin``), looked up in the daemon's handler table."""

from __future__ import annotations

from gcache import wire
from gcache.meta import hotpath as meta_hotpath
from gcache.router.hotpath import RouterConnection
from gcache.server.dataplane import ServerConnection
from gcache.transport.daemon import TYPE_NAMES, type_name


def _check(table: dict[int, object], expected: set[int]) -> None:
    assert set(table) == expected
    for msg_type, fn in table.items():
        assert getattr(fn, "__name__", "") == TYPE_NAMES[msg_type].lower(), msg_type


def test_meta_table() -> None:
    _check(
        dict(meta_hotpath.HANDLERS),
        {
            wire.T_LOOKUP,
            wire.T_PUT_BEGIN,
            wire.T_PUT_COMMIT,
            wire.T_PUT_ABORT,
            wire.T_RELEASE,
            wire.T_PING,
        },
    )
    assert meta_hotpath.hello.__name__ == "hello"  # served before authentication


def test_server_table() -> None:
    _check(
        dict(ServerConnection.handlers),
        {
            wire.T_WRITE,
            wire.T_READ,
            wire.T_SEAL,
            wire.T_PING,
            wire.T_READ_STAGED,
            wire.T_UNSTAGE,
            wire.T_SERVER_STATS,
        },
    )


def test_router_table() -> None:
    _check(
        dict(RouterConnection.handlers),
        {wire.T_ROUTE, wire.T_REPORT_HITS, wire.T_REPORT_LOAD, wire.T_PING},
    )


def test_type_names() -> None:
    assert type_name(wire.T_SEAL) == "SEAL"
    assert type_name(wire.T_READ_STAGED) == "READ_STAGED"
    assert type_name(999) == "type 999"
