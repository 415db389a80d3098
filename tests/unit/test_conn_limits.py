"""Connection limits, idle expiry and the rate-limited log as plain code with an
injected clock; the connection settings' range checks."""

from __future__ import annotations

import logging

import pytest

from gcache import config as cfgmod
from gcache.config import MetaConfig, ServerConfig
from gcache.errors import ConfigError
from gcache.transport.limits import Conn, ConnectionLimiter, RateLimitedLog, peer_host


def test_limits_per_peer_and_total() -> None:
    lim = ConnectionLimiter(max_connections=5, max_per_peer=3, idle_timeout_s=10)
    a = [lim.admit("10.0.0.1", lambda: None, 0.0) for _ in range(3)]
    assert all(isinstance(c, Conn) for c in a)
    refused = lim.admit("10.0.0.1", lambda: None, 0.0)
    assert isinstance(refused, str) and "max_connections_per_peer" in refused
    b = [lim.admit("10.0.0.2", lambda: None, 0.0) for _ in range(2)]
    assert all(isinstance(c, Conn) for c in b)
    full = lim.admit("10.0.0.3", lambda: None, 0.0)
    assert isinstance(full, str) and "max_connections" in full
    first = a[0]
    assert isinstance(first, Conn)
    lim.release(first)
    lim.release(first)  # idempotent
    assert isinstance(lim.admit("10.0.0.1", lambda: None, 0.0), Conn)
    s = lim.stats()
    assert s["connections_open"] == 5 and s["connections_refused"] == 2
    assert s["connections_refused_per_peer"] == 1 and s["peers_connected"] == 2
    for c in [*a[1:], *b]:
        assert isinstance(c, Conn)
        lim.release(c)
    assert lim.stats()["peers_connected"] == 1  # only the re-admitted one is left


def test_idle_expiry_skips_connections_in_flight() -> None:
    lim = ConnectionLimiter(10, 10, idle_timeout_s=5)
    idle = lim.admit("p", lambda: None, 0.0)
    busy = lim.admit("p", lambda: None, 0.0)
    fresh = lim.admit("p", lambda: None, 4.0)
    assert isinstance(idle, Conn) and isinstance(busy, Conn) and isinstance(fresh, Conn)
    busy.idle_since = None  # a request of it is being handled
    assert lim.expired(4.9) == []
    assert lim.expired(5.0) == [idle]
    assert lim.expired(100.0) == [fresh]
    assert lim.stats()["connections_idle_closed"] == 2 and len(lim) == 1


def test_rate_limited_log_bounds_lines_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RateLimitedLog(logging.getLogger("t.rl"), per_s=2.0, burst=5)
    with caplog.at_level(logging.WARNING, "t.rl"):
        written = sum(log.log(0.0, "bad frame %d", i) for i in range(1000))
        assert written == 5
        assert log.log(0.5, "bad frame %d", 1000)  # one token refilled after 0.5 s
    assert len(caplog.records) == 6
    assert "995 similar lines suppressed" in caplog.records[-1].getMessage()
    assert log.stats("bad_frames") == {"bad_frames_logged": 6, "bad_frames_suppressed": 995}


def test_peer_host() -> None:
    assert peer_host(("127.0.0.1", 5555)) == "127.0.0.1"
    assert peer_host(("::1", 1, 0, 0)) == "::1"


@pytest.mark.parametrize("cls", [MetaConfig, ServerConfig])
def test_connection_settings_are_range_checked(cls: type) -> None:
    prefix = "GCACHE_META_" if cls is MetaConfig else "GCACHE_SERVER_"
    ok = cfgmod.load(
        cls,
        env={
            prefix + "MAX_BODY": "64KiB",
            prefix + "IDLE_TIMEOUT_S": "0.5",
            prefix + "MAX_CONNECTIONS": "8",
            prefix + "MAX_CONNECTIONS_PER_PEER": "2",
        },
    )
    assert ok.max_body_bytes == 64 << 10 and ok.max_connections_per_peer == 2
    for key, bad in [
        ("MAX_BODY", "1KiB"),
        ("MAX_BODY", "33MiB"),
        ("MAX_BODY", "lots"),
        ("IDLE_TIMEOUT_S", "0"),
        ("MAX_CONNECTIONS", "0"),
        ("MAX_CONNECTIONS_PER_PEER", "0"),
        ("MAX_CONNECTIONS_PER_PEER", "5000"),  # above max_connections (4096)
    ]:
        with pytest.raises(ConfigError):
            cfgmod.load(cls, env={prefix + key: bad})
    assert MetaConfig().max_body_bytes == 4 << 20  # the hot path needs far less than 32 MiB
