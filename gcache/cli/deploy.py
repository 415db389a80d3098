"""A local deployment: one ``gcache-meta`` and N ``gcache-server`` processes on
loopback, started as real subprocesses. ``gcache up`` and the integration tests
both use it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import sync_channel
from gcache.config import ClientConfig
from gcache.errors import GCacheError
from gcache.startup import one_line


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    host: str = "127.0.0.1"
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class LocalDeployment:
    def __init__(
        self,
        data_dir: str | Path,
        servers: int = 2,
        capacity: str = "256MiB",
        host: str = "127.0.0.1",
        meta_port: int = 0,
        grpc_port: int = 0,
        metrics_port: int = 0,
        server_ports: list[int] | None = None,
        meta_args: list[str] | None = None,
        server_args: list[str] | None = None,
        log_level: str = "info",
        tls_ca: str = "",
        nvme_size: str = "0",
        keep_segments: bool = False,
    ) -> None:
        """``nvme_size``: each server's NVMe tier, in ``data_dir/serverN-nvme`` ("0":
        none). ``keep_segments``: leave the servers' segment files (and manifests) in
        the tmpfs at :meth:`stop` for a later start to re-adopt; by default they are
        removed (a server stopped on its own keeps them)."""
        self.data_dir = Path(data_dir)
        self.n_servers = servers
        self.capacity = capacity
        self.host = host
        self.meta_port = meta_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.server_ports = server_ports or [0] * servers
        self.meta_args = meta_args or []
        self.server_args = server_args or []
        self.log_level = log_level
        self.tls_ca = tls_ca  # CA of the meta's gRPC TLS certificate (stats, clients)
        self.nvme_size = nvme_size
        self.keep_segments = keep_segments
        self.meta: Proc | None = None
        self.servers: list[Proc] = []
        self.extra: list[Proc] = []  # engines and a router (gcache/cli/fleet.py)
        self._logs: list[IO[bytes]] = []
        self._started = False  # start() again is a no-op until stop()

    # ---- start/stop ----------------------------------------------------------------

    def _spawn(self, name: str, module: str, args: list[str]) -> Proc:
        log_path = self.data_dir / f"{name}.log"
        try:
            fh = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        except OSError as exc:
            raise GCacheError(f"cannot write the log {log_path}: {exc.strerror}") from exc
        self._logs.append(fh)
        popen = subprocess.Popen(
            [sys.executable, "-m", module, "--log-level", self.log_level, *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return Proc(name, popen, log_path)

    def _wait_ready(self, proc: Proc, ready: Path, deadline: float) -> list[str]:
        while time.monotonic() < deadline:
            if ready.exists():
                return ready.read_text().split()
            if not proc.alive:
                raise GCacheError(
                    f"{proc.name} exited with code {proc.popen.returncode}: "
                    f"{last_error(proc.log_path)} (log: {proc.log_path})"
                )
            time.sleep(0.02)
        raise GCacheError(f"{proc.name} not ready within the timeout; see {proc.log_path}")

    def start(self, timeout: float = 30.0) -> LocalDeployment:
        """Start the meta and the servers; a second call (``with ... as d:
        d.start()``) is a no-op: it used to start a second meta and second servers on
        the same data and NVMe directories, leaking the first deployment."""
        if self._started:
            return self
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise GCacheError(
                f"cannot create the data directory {self.data_dir}: {exc.strerror}"
            ) from exc
        deadline = time.monotonic() + timeout
        try:
            self._start_meta(deadline)
            for i in range(self.n_servers):
                self.start_server(i, deadline)
            self.wait_servers(self.n_servers, deadline - time.monotonic())
        except BaseException:
            self.stop()  # never leave half a deployment running
            raise
        self._started = True
        return self

    def _start_meta(self, deadline: float) -> None:
        ready = self.data_dir / "meta.ready"
        ready.unlink(missing_ok=True)
        self.meta = self._spawn(
            "meta",
            "gcache.meta.daemon",
            [
                "--host",
                self.host,
                "--port",
                str(self.meta_port),
                "--grpc-port",
                str(self.grpc_port),
                "--metrics-port",
                str(self.metrics_port),
                "--ready-file",
                str(ready),
                *self.meta_args,
            ],
        )
        _, port, grpc_port, metrics_port = self._wait_ready(self.meta, ready, deadline)
        self.meta.port = int(port)
        self.meta.extra["grpc_port"] = int(grpc_port)
        self.meta.extra["metrics_port"] = int(metrics_port)

    def restart_meta(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Kill the meta and start a new one on the same ports (servers re-register)."""
        assert self.meta is not None
        self.meta.popen.send_signal(sig)
        self.meta.popen.wait(10)
        self.meta_port = self.meta.port
        self.grpc_port = self.meta.extra["grpc_port"]
        self.metrics_port = self.meta.extra["metrics_port"]
        self._start_meta(time.monotonic() + timeout)

    def start_server(self, i: int, deadline: float | None = None) -> Proc:
        deadline = deadline or time.monotonic() + 30
        ready = self.data_dir / f"server{i}.ready"
        ready.unlink(missing_ok=True)
        port = self.server_ports[i] if i < len(self.server_ports) else 0
        proc = self._spawn(
            f"server{i}",
            "gcache.server.daemon",
            [
                "--host",
                self.host,
                "--port",
                str(port),
                "--meta",
                self.meta_grpc,
                "--capacity",
                self.capacity,
                "--server-id",
                f"server{i}",
                "--heartbeat-interval-s",
                "0.5",
                "--ready-file",
                str(ready),
                *self._nvme_args(i),
                *self.server_args,
            ],
        )
        try:
            _, p = self._wait_ready(proc, ready, deadline)
        except BaseException:  # not listed in self.servers yet: stop() would miss it
            if proc.alive:
                proc.popen.kill()
            proc.popen.wait()
            raise
        proc.port = int(p)
        if i < len(self.servers):
            self.servers[i] = proc
        else:
            self.servers.append(proc)
        return proc

    def _nvme_args(self, i: int) -> list[str]:
        if self.nvme_size in ("", "0"):
            return []
        return ["--nvme-size", self.nvme_size, "--nvme-path", str(self.nvme_dir(i))]

    def nvme_dir(self, i: int) -> Path:
        return self.data_dir / f"server{i}-nvme"

    def segment_files(self, i: int) -> list[Path]:
        """Segment file and manifest of server ``i``'s current process."""
        shm = "/dev/shm"
        args = self.server_args
        if "--shm-dir" in args[:-1]:
            shm = args[args.index("--shm-dir") + 1]
        pid = self.servers[i].popen.pid
        return [Path(shm) / f"gcache-server{i}-{pid}.{ext}" for ext in ("seg", "manifest")]

    def wait_servers(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            alive = sum(1 for s in self.stats().servers if s.alive)
            if alive == n:
                return
            time.sleep(0.05)
        raise GCacheError(f"meta does not list {n} live servers in time")

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.servers[i]
        proc.popen.send_signal(sig)
        proc.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> dict[str, int | None]:
        """SIGTERM everything (engines and router, then servers, then the meta), then
        SIGKILL what is left."""
        codes: dict[str, int | None] = {}
        self._started = False
        procs = [*self.extra, *self.servers, *([self.meta] if self.meta else [])]
        for p in procs:
            if p.alive:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                codes[p.name] = p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[p.name] = p.popen.wait()
        for fh in self._logs:
            fh.close()
        self._logs.clear()
        if not self.keep_segments:
            for i in range(len(self.servers)):
                for path in self.segment_files(i):
                    path.unlink(missing_ok=True)
        return codes

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- addresses -------------------------------------------------------------------

    @property
    def meta_addr(self) -> str:
        assert self.meta is not None
        return f"{self.host}:{self.meta.port}"

    @property
    def meta_grpc(self) -> str:
        assert self.meta is not None
        return f"{self.host}:{self.meta.extra['grpc_port']}"

    @property
    def metrics_url(self) -> str:
        assert self.meta is not None
        return f"http://{self.host}:{self.meta.extra['metrics_port']}/metrics"

    def client_config(self, **kw: Any) -> ClientConfig:
        kw.setdefault("tls_ca", self.tls_ca)
        return ClientConfig(meta=self.meta_addr, meta_grpc=self.meta_grpc, **kw)

    def stats(self) -> Any:
        return fetch_stats(self.meta_grpc, tls_ca=self.tls_ca)


_LOG_PREFIX = re.compile(r"^\S+ \S+ (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def last_error(log_path: Path) -> str:
    """The one line a daemon that failed to start wrote last (its error), without
    the log's time/level prefix."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError as exc:
        return f"its log cannot be read: {exc.strerror}"
    lines = [ln for ln in lines if ln]
    return _LOG_PREFIX.sub("", lines[-1]) if lines else "no output"


def rpc_error_text(exc: grpc.RpcError) -> str:
    """One line for a failed gRPC call: ``UNAVAILABLE: failed to connect ...``."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return one_line(f"{code.name if code else 'error'}: {details}")


def fetch_stats(meta_grpc: str, timeout: float = 5.0, tls_ca: str = "") -> Any:
    with sync_channel(meta_grpc, tls_ca=tls_ca) as channel:
        try:
            return pb_grpc.ControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise GCacheError(f"cannot reach meta at {meta_grpc}: {rpc_error_text(exc)}") from exc
