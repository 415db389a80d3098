"""A local etcd for ``LocalDeployment(ha=True)`` and ``gcache up --ha``: one
``/usr/bin/etcd`` member on free loopback ports, its data under the deployment's
data dir; kill, stop/continue and restart it on the same ports and data (tests)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gcache.errors import GCacheError

ETCD_BIN = os.environ.get("GCACHE_ETCD", "/usr/bin/etcd")
PREFIX = "/gcache"
HA_METAS = ("meta", "meta1")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Etcd:
    data_dir: Path
    host: str
    client_port: int
    peer_port: int
    popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, data_dir: Path, host: str, timeout: float = 15.0) -> Etcd:
        if not os.access(ETCD_BIN, os.X_OK):
            raise GCacheError(
                f"{ETCD_BIN} not found: install etcd (apt-get install -y etcd-server) "
                "or set GCACHE_ETCD"
            )
        e = cls(data_dir, host, free_port(host), free_port(host))
        e.launch(timeout)
        return e

    @property
    def url(self) -> str:
        """The ``etcd://`` address metas, servers and clients are given."""
        return f"etcd://{self.host}:{self.client_port}{PREFIX}"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_name("etcd.log")

    def launch(self, timeout: float = 15.0) -> None:
        """Start the member (again: same ports, same data) and wait until it is
        healthy."""
        self.spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise GCacheError(f"etcd exited at start; see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise GCacheError(f"etcd not healthy within {timeout} s")

    def healthy(self) -> bool:
        """etcd's ``/health`` says true."""
        try:
            url = f"http://{self.host}:{self.client_port}/health"
            with urllib.request.urlopen(url, timeout=0.5) as r:
                return b'"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the member (same ports, same data) and return at once."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        log = open(self.log_path, "ab")  # noqa: SIM115 - child keeps it
        try:
            self.popen = subprocess.Popen(
                [
                    ETCD_BIN,
                    "--name",
                    "gcache",
                    "--data-dir",
                    str(self.data_dir),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"gcache={peer}",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        return self.popen

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.alive:
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        if self.popen is not None:
            self.signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, remove: bool = True) -> None:
        """Stop the member; ``remove``: its data too (a local deployment's etcd
        holds only the election, nothing to keep)."""
        if self.popen is not None and self.alive:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if remove:
            shutil.rmtree(self.data_dir, ignore_errors=True)
