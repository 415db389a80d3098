"""The meta's hot-path connection counters reach operators over gRPC too: GetStats
carries them as ``hotpath_*`` counters and ``gcache status`` prints them (before,
only Prometheus had them, so a meta refusing clients at its limits looked healthy
in ``gcache status``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment, fetch_stats
from gcache.errors import E_BUSY
from tests import rawwire


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    d = LocalDeployment(
        tmp_path_factory.mktemp("status"),
        servers=1,
        capacity="16MiB",
        meta_args=["--max-connections-per-peer", "2"],
    )
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def test_getstats_and_status_show_hotpath_connections(dep: LocalDeployment) -> None:
    assert dep.meta is not None
    port = dep.meta.port
    held = [rawwire.connect(port) for _ in range(2)]
    try:
        for s in held:
            s.sendall(wire.pack_frame(wire.Ping(), 1))
            assert rawwire.recv_frame(s)[0].msg_type == wire.T_OK
        with rawwire.connect(port) as extra:  # the third from this address: refused
            head, err, _ = rawwire.recv_frame(extra)
            assert head.msg_type == wire.T_ERROR and err.code == E_BUSY
        time.sleep(0.1)
        c = dict(fetch_stats(dep.meta_grpc).counters)
        hot = {k: v for k, v in c.items() if k.startswith("hotpath_")}
        assert hot, f"GetStats carries no hot-path counters: {sorted(c)}"
        assert c["hotpath_connections_open"] == 2
        assert c["hotpath_peers_connected"] == 1
        assert c["hotpath_connections_accepted"] >= 2
        assert c["hotpath_connections_refused"] >= 1
        assert "hotpath_connections_send_timeouts" in c and "hotpath_protocol_errors" in c
        out = subprocess.run(
            [sys.executable, "-m", "gcache.cli.main", "status", "--meta-grpc", dep.meta_grpc],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        line = re.search(
            r"hot path: (\d+) connections open \((\d+) peers\), (\d+) accepted, "
            r"(\d+) refused \(busy\)",
            out.stdout,
        )
        assert line is not None, out.stdout
        assert int(line.group(1)) == 2 and int(line.group(4)) >= 1, out.stdout
    finally:
        for s in held:
            s.close()
