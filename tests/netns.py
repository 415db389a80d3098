"""Many hosts on one machine: a Linux bridge and N "hosts", each its own network
namespace (a veth pair into the bridge, its own address), mount namespace (its own
tmpfs on /dev/shm, so shared memory is per host) and UTS namespace (its own
hostname, which the client compares with a server's to decide on shared memory).

One long-lived holder process per host owns the host's mount and UTS namespaces;
every process of the host is started with ``nsenter --target <holder> --mount
--uts --net``, so the processes of one host share its /dev/shm and hostname and
those of different hosts do not. The file system outside /dev/shm is shared by
all hosts (data directories, logs, ready files), like a shared home directory.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and ``ip``, ``unshare``, ``nsenter``.
:func:`fabric_or_skip` makes a fabric for a test: under ``CI=true`` a fabric that
cannot be made FAILS the test; elsewhere the test is skipped with the reason.

By hand (what :class:`Fabric` does, for an operator reproducing it)::

    ip link add gcbr type bridge && ip link set gcbr up
    ip netns add gch1
    ip link add gcv1 type veth peer name gcp1
    ip link set gcp1 netns gch1 && ip -n gch1 link set gcp1 name eth0
    ip link set gcv1 master gcbr && ip link set gcv1 up
    ip -n gch1 addr add 10.213.0.1/24 dev eth0
    ip -n gch1 link set eth0 up && ip -n gch1 link set lo up
    ip netns exec gch1 unshare --mount --uts --propagation private --fork \\
        sh -c 'mount -t tmpfs -o size=256m tmpfs /dev/shm; hostname h1; exec sleep infinity' &
    nsenter --target <pid of that sleep> --mount --uts --net gcache-server --host 10.213.0.1 ...
    ip link set gcv1 down    # cut host 1 off; "up" restores it
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

TOOLS = ("ip", "unshare", "nsenter", "mount")
ROOT = Path(__file__).resolve().parents[1]


def child_env() -> None:
    """Daemons and clients started on the hosts import this tree's code."""
    paths = [str(ROOT), str(ROOT / "client")]
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])


class FabricError(RuntimeError):
    """The namespaces, bridge or veths could not be made (not root, no tools)."""


def _run(*args: str) -> str:
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FabricError(f"{' '.join(args)}: {exc}") from exc
    if res.returncode != 0:
        raise FabricError(f"{' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res.stdout


@dataclass
class Host:
    """One host: ``name`` (its hostname), ``addr`` (its address on the bridge)."""

    fabric: Fabric
    index: int
    name: str
    netns: str
    veth: str  # the bridge side of its link (cut it with link_down)
    addr: str
    holder: subprocess.Popen[bytes] | None = None
    holder_pid: int = 0  # the process whose mount and UTS namespaces are the host's
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, args: Sequence[str]) -> list[str]:
        return ["nsenter", f"--target={self.holder_pid}", "--mount", "--uts", "--net", "--", *args]

    def popen(
        self,
        args: Sequence[str],
        log: Path | None = None,
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` on this host (its own session; stopped at cleanup)."""
        fh: Any = None
        if log is not None:
            fh = open(log, "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            p = subprocess.Popen(
                self.argv(args),
                stdin=stdin,
                stdout=stdout if stdout is not None else fh,
                stderr=fh,
                start_new_session=True,
            )
        finally:
            if fh is not None:
                fh.close()
        self.procs.append(p)
        return p

    def python(
        self, module: str, args: Sequence[str], log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        return self.popen([sys.executable, "-m", module, *args], log=log)

    def run(self, args: Sequence[str], timeout: float = 20) -> str:
        res = subprocess.run(
            self.argv(args), capture_output=True, text=True, timeout=timeout, check=False
        )
        if res.returncode != 0:
            raise FabricError(f"on {self.name}: {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def link_down(self) -> None:
        """Cut this host off the bridge (its processes keep running)."""
        _run("ip", "link", "set", self.veth, "down")

    def link_up(self) -> None:
        _run("ip", "link", "set", self.veth, "up")


class Fabric:
    """A bridge and ``n`` hosts named per process (``gc<pid>...``), so parallel runs
    do not collide; :meth:`close` removes everything it made and kills everything
    it started, whatever state the test left."""

    def __init__(self, n: int, tmpfs_size: str = "256m") -> None:
        self.pid = os.getpid()
        self.tag = f"gc{self.pid}"
        self.subnet = f"10.213.{self.pid % 250}"
        self.bridge = f"{self.tag}b"
        self.tmpfs_size = tmpfs_size
        self.hosts: list[Host] = []
        self._bridge_made = False
        self._n = n

    def start(self) -> Fabric:
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise FabricError(f"missing tools: {', '.join(missing)}")
        if os.geteuid() != 0:
            raise FabricError("network namespaces need root")
        sweep_dead_runs()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(1, self._n + 1):
                self._add_host(i)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, i: int) -> None:
        netns, veth, peer = f"{self.tag}h{i}", f"{self.tag}v{i}", f"{self.tag}p{i}"
        h = Host(self, i, f"host{i}-{self.pid}", netns, veth, f"{self.subnet}.{i}")
        _run("ip", "netns", "add", netns)
        self.hosts.append(h)  # from here on close() removes it
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", netns)
        _run("ip", "-n", netns, "link", "set", peer, "name", "eth0")
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "-n", netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        script = (
            f"mount -t tmpfs -o size={self.tmpfs_size} tmpfs /dev/shm && "
            f"hostname {h.name} && echo $$ && exec sleep infinity"
        )
        h.holder = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts",
             "--propagation", "private", "--fork", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        assert h.holder.stdout is not None
        line = h.holder.stdout.readline().strip()
        if not line:
            err = h.holder.stderr.read().decode(errors="replace") if h.holder.stderr else ""
            raise FabricError(f"host {h.name}: namespace holder failed: {err.strip()}")
        h.holder_pid = int(line)
        got = h.run(["hostname"]).strip()
        if got != h.name:
            raise FabricError(f"host {h.name}: nsenter gives hostname {got!r}")

    def close(self) -> None:
        """Kill every process started on a host (SIGTERM, then SIGKILL), the
        holders, then delete the namespaces, veths and bridge."""
        procs = [p for h in self.hosts for p in h.procs]
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for h in self.hosts:
            if h.holder_pid:
                try:
                    os.kill(h.holder_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if h.holder is not None:
                if h.holder.poll() is None:
                    _signal_group(h.holder, signal.SIGKILL)
                h.holder.wait()
                for s in (h.holder.stdout, h.holder.stderr):
                    if s is not None:
                        s.close()
            subprocess.run(["ip", "link", "del", h.veth], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, check=False)
        self.hosts.clear()
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            self._bridge_made = False

    def __enter__(self) -> Fabric:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_NAME = re.compile(r"^gc(\d+)[hbvp]\d*(?:@\S+)?$")


def sweep_dead_runs() -> None:
    """Remove the namespaces, veths and bridges of runs whose process is gone (a
    run killed before its cleanup); those of live runs are left alone."""
    names = [ln.split()[0] for ln in _run("ip", "netns", "list").splitlines() if ln.strip()]
    links = [ln.split(":")[1].strip() for ln in _run("ip", "-o", "link").splitlines()]
    for name in names + links:
        m = _NAME.match(name)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        kind = ["netns", "del"] if name in names else ["link", "del"]
        subprocess.run(["ip", *kind, name.split("@")[0]], capture_output=True, check=False)


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # started with start_new_session: its own group
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def fabric_or_skip(n: int) -> Fabric:
    """A started fabric of ``n`` hosts; skip the test when namespaces cannot be
    made, except under ``CI=true``, where that is a failure (CI runs as root)."""
    try:
        return Fabric(n).start()
    except FabricError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"network namespaces are needed under CI=true: {exc}")
        pytest.skip(f"network namespaces unavailable: {exc}")


def wait_file(
    path: Path, proc: subprocess.Popen[bytes], what: str, timeout: float = 30
) -> list[str]:
    """The words of a daemon's ready file once written; fails when it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        if proc.poll() is not None:
            raise FabricError(f"{what} exited with code {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise FabricError(f"{what} not ready within {timeout} s")


class JsonProc:
    """A process on a host that answers one JSON line per JSON command
    (tests/netns_client.py); :meth:`call` bounds the wait for the answer."""

    def __init__(
        self, host: Host, args: Sequence[str], log: Path, ready_timeout: float = 30
    ) -> None:
        self.host = host
        self.proc = host.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, log=log)
        self.log = log
        self._lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                self._lines.put(raw.decode(errors="replace"))
            self._lines.put("")

        threading.Thread(target=pump, daemon=True).start()
        first = self._next(ready_timeout)
        if '"ready"' not in first:
            raise FabricError(f"client on {host.name} did not start: {first!r}")

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise FabricError(
                f"no answer from the client on {self.host.name} in {timeout} s"
            ) from None
        if not line:
            raise FabricError(f"the client on {self.host.name} exited ({self.proc.poll()})")
        return line

    def call(self, cmd: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            line = self._next(timeout)
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out


def call(client: JsonProc, **cmd: Any) -> dict[str, Any]:
    """One command; the test fails when the client raised."""
    out = client.call(cmd)
    assert "error" not in out, f"the client on {client.host.name} raised: {out['error']}"
    return out
