"""A real ``gcache-server`` restarted the way Kubernetes restarts a container:
each run in a new pid namespace with the server as its first process, so every
run has pid 1 and the segment file the last run left has exactly the name this
run creates (deploy/k8s/server.yaml; docs/operations.md "Kubernetes"). The
committed object must be re-adopted and read back byte for byte.

Needs root (a pid namespace): under CI=true that is a failure, not a skip."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gcache import wire
from tests.integration.test_server_restart import OBJ, Harness, _data, _obj

UNSHARE = ("unshare", "--pid", "--kill-child")  # --kill-child implies --fork


def _pidns_or_skip() -> None:
    why = ""
    if shutil.which("unshare") is None:
        why = "no unshare(1)"
    else:
        r = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            why = f"cannot make a pid namespace: {r.stderr.strip()}"
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    _pidns_or_skip()
    harness = Harness(tmp_path)
    harness.prefix = UNSHARE
    try:
        harness.start()
        yield harness
    finally:
        harness.close()


def _wait_unlocked(path: Path, timeout: float = 10.0) -> None:
    """Until no process holds the segment (the killed server's exit completed), as
    the kubelet starts a container's next run only after the last one ended."""
    deadline = time.monotonic() + timeout
    fd = os.open(path, os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed server still holds its segment"
                time.sleep(0.02)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_restart_with_the_same_pid_readopts_the_segment(h: Harness, how: str) -> None:
    o = _obj(1, 3 * OBJ, _data(1))
    assert isinstance(h.write(o.offset, _data(1)), wire.Ok)
    h.meta.wait_beats(h.meta.send(lambda r: r.adopt.append(o)))
    [seg] = list(h.shm.glob("*.seg"))
    assert seg.name.endswith("-1.seg"), f"the server is not pid 1 in its namespace: {seg.name}"
    if how == "kill9":
        h.kill()  # SIGKILL to unshare; --kill-child kills the server with it
    else:
        assert h.proc is not None  # unshare; SIGTERM the server itself, its child
        pid = h.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGTERM)
        h.proc.wait(20)
    _wait_unlocked(seg)
    h.start()  # pid 1 again: the same file name
    assert [p.name for p in h.shm.glob("*.seg")] == [seg.name]
    assert [x.offset for x in h.report] == [o.offset]
    assert h.read(o.offset, OBJ) == _data(1)
