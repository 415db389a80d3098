from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """A real meta and two real servers on loopback, shared by a test module."""
    d = LocalDeployment(tmp_path_factory.mktemp("deploy"), servers=2, capacity="192MiB")
    d.start()
    yield d
    pids = [str(s.popen.pid) for s in d.servers]
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"
    leftover = [p.name for p in Path("/dev/shm").glob("gcache-*") if p.stem.split("-")[-1] in pids]
    assert not leftover, f"segment files left behind: {leftover}"


@pytest.fixture(params=["tcp", "shm"])
def client(deployment: LocalDeployment, request: pytest.FixtureRequest) -> Iterator[GCacheClient]:
    """A client on each data path: every test using it runs over TCP and over
    shared memory (the transport conformance suite)."""
    c = GCacheClient(deployment.client_config(transport=request.param))
    yield c
    c.close()
