"""The client's put logs a failed SEAL at a bounded rate: while a
server is down every put's seal on it fails, and one WARNING per put flooded the
log. Real meta, server and client; the server is killed with SIGKILL."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from gcache_client.writer import seal_log
from tests.kvdata import make_kv, tiny_hybrid, tokens

PUTS = 40


def test_failed_seals_are_logged_at_a_bounded_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with LocalDeployment(tmp_path, servers=1, capacity="64MiB") as d:
        client = GCacheClient(d.client_config(timeout_s=1.0))
        try:
            ns = client.register_namespace("seal-log", tiny_hybrid())
            assert client.put(ns, tokens(16, seed=0), make_kv(ns.layout, 16, seed=0)).ok
            d.kill_server(0, signal.SIGKILL)
            before = seal_log.suppressed
            with caplog.at_level(logging.WARNING, logger="gcache.client"):
                for s in range(1, PUTS + 1):
                    r = client.put(ns, tokens(16, seed=s), make_kv(ns.layout, 16, seed=s))
                    assert not r.ok or r.no_space or r.stored == 0
        finally:
            client.close()
    lines = [r for r in caplog.records if "seal on server0 failed" in r.getMessage()]
    assert lines, "no seal failure logged at all"
    assert len(lines) <= seal_log.burst + 1, f"{len(lines)} lines for {PUTS} failed puts"
    assert seal_log.suppressed - before >= PUTS - len(lines) - 1
