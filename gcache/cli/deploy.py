"""A local deployment: one ``gcache-meta`` and N ``gcache-server`` processes on
loopback, started as real subprocesses. ``gcache up`` and the integration tests
both use it.
One file: the whole life of a local deployment (ports, start order, readiness,
restarts, teardown), which ``gcache up`` and the tests drive as one object."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

import grpc

from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import sync_channel
from gcache.cli.ha import HA_METAS, Etcd
from gcache.config import ClientConfig, ServerConfig, load
from gcache.errors import ConfigError, GCacheError
from gcache.startup import one_line
from gcache.storage.segment import _safe as safe_id

# Files a server process creates in its shm dir: gcache-<server id>-<pid>.<ext>.
SHM_EXTS = ("seg", "manifest", "stage")


class DeploymentInterrupted(GCacheError):
    """SIGINT/SIGTERM arrived while the deployment was starting (or restarting a
    process); everything it started is stopped by :meth:`LocalDeployment.stop`."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum} while starting")
        self.signum = signum


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


@dataclass
class Respawn:
    """How to start one named process again with the same identity (``gcache up``'s
    supervisor, :mod:`gcache.cli.supervise`): ``spawn`` starts it and returns at
    once (the new :class:`Proc` replaces the old one in the deployment); ``ready``
    says whether that process is up yet (and records its ports)."""

    spawn: Callable[[], Proc]
    ready: Callable[[Proc], bool]


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
        ha: bool = False,
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
        # Every process ever spawned (restarts too), for stop() and its file cleanup.
        self.spawned: list[Proc] = []
        # name -> how to restart it with the same identity (meta, serverN, ...).
        self.respawn: dict[str, Respawn] = {}
        # Set (to the signal number) by a SIGINT/SIGTERM handler: start-up's waits
        # raise DeploymentInterrupted at their next check instead of going on.
        self.interrupted = 0
        # ha: an etcd (gcache/cli/ha.py) and two metas, "meta" and "meta1", elected
        # through it; servers and clients are given its etcd:// address.
        self.ha = ha
        self.etcd: Etcd | None = None
        self.metas: dict[str, Proc] = {}

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
        proc = Proc(name, popen, log_path)
        self.spawned.append(proc)
        return proc

    def _wait_ready(self, proc: Proc, ready: Path, deadline: float) -> list[str]:
        while time.monotonic() < deadline:
            if self.interrupted:
                raise DeploymentInterrupted(self.interrupted)
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
            if self.ha:
                self.etcd = Etcd.start(self.data_dir / "etcd", self.host)
                self._track_etcd()
                self.respawn["etcd"] = Respawn(self._respawn_etcd, self._etcd_ready)
                for name in HA_METAS:
                    self._start_meta(deadline, name)
            else:
                self._start_meta(deadline)
            for i in range(self.n_servers):
                self.start_server(i, deadline)
            self.wait_servers(self.n_servers, deadline - time.monotonic())
        except BaseException:
            self.stop()  # never leave half a deployment running
            raise
        self._started = True
        return self

    def _track_etcd(self) -> Proc:
        assert self.etcd is not None and self.etcd.popen is not None
        proc = Proc("etcd", self.etcd.popen, self.etcd.log_path, self.host, self.etcd.client_port)
        self.spawned.append(proc)
        return proc

    def _respawn_etcd(self) -> Proc:
        """``gcache up --ha``'s supervisor restarts etcd on the same ports and data."""
        assert self.etcd is not None
        self.etcd.spawn()
        return self._track_etcd()

    def _etcd_ready(self, proc: Proc) -> bool:
        return self.etcd is not None and self.etcd.healthy()

    def _start_meta(self, deadline: float, name: str = "meta") -> None:
        proc = self._spawn_meta(name)
        self._meta_ready(proc, self._wait_ready(proc, proc.extra["ready_file"], deadline))

    def _spawn_meta(self, name: str = "meta") -> Proc:
        """Start the meta (on the ports of the one before, once it had some) and
        return at once; :meth:`_meta_ready` records its ports. With ``ha``, ``name``
        is one of the elected metas (``meta``, ``meta1``)."""
        ports = (self.meta_port, self.grpc_port, self.metrics_port)
        prev = self.metas.get(name)
        if name != "meta":
            ports = (0, 0, 0) if prev is None else (prev.port, *prev.extra["ports"][1:])
        ready = self.data_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        ha = ["--etcd", self.etcd.url, "--meta-id", name] if self.etcd is not None else []
        proc = self._spawn(
            name,
            "gcache.meta.daemon",
            [
                "--host",
                self.host,
                "--port",
                str(ports[0]),
                "--grpc-port",
                str(ports[1]),
                "--metrics-port",
                str(ports[2]),
                "--ready-file",
                str(ready),
                *ha,
                *self.meta_args,
            ],
        )
        proc.extra["ready_file"] = ready
        self.metas[name] = proc
        if name == "meta":
            self.meta = proc
        self.respawn.setdefault(
            name, Respawn(partial(self._spawn_meta, name), self._poll(self._meta_ready))
        )
        return proc

    def _meta_ready(self, proc: Proc, fields: list[str]) -> None:
        _, port, grpc_port, metrics_port = fields
        proc.port = int(port)
        proc.extra["grpc_port"] = int(grpc_port)
        proc.extra["metrics_port"] = int(metrics_port)
        proc.extra["ports"] = (int(port), int(grpc_port), int(metrics_port))
        if proc is self.meta:  # a restart binds the same ports (servers, clients know them)
            self.meta_port, self.grpc_port = proc.port, int(grpc_port)
            self.metrics_port = int(metrics_port)

    def _poll(self, on_ready: Callable[[Proc, list[str]], None]) -> Callable[[Proc], bool]:
        """A ``Respawn.ready`` for a process that writes a ready file."""

        def ready(proc: Proc) -> bool:
            path: Path = proc.extra["ready_file"]
            if not path.exists():
                return False
            on_ready(proc, path.read_text().split())
            return True

        return ready

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
        proc = self._spawn_server(i)
        try:
            fields = self._wait_ready(proc, proc.extra["ready_file"], deadline)
        except BaseException:  # never leave it running (stop() kills it too)
            if proc.alive:
                proc.popen.kill()
            proc.popen.wait()
            raise
        self._server_ready(i, proc, fields)
        return proc

    def _spawn_server(self, i: int) -> Proc:
        """Start server ``i`` (same id, port and NVMe directory as the one before)
        and return at once; it is the deployment's server ``i`` from now on."""
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
        proc.extra["ready_file"] = ready
        proc.extra["shm_prefix"] = f"gcache-{safe_id(f'server{i}')}-"
        if i < len(self.servers):
            self.servers[i] = proc
        else:
            self.servers.append(proc)
        self.respawn.setdefault(
            f"server{i}",
            Respawn(partial(self._spawn_server, i), self._poll(partial(self._server_ready, i))),
        )
        return proc

    def _server_ready(self, i: int, proc: Proc, fields: list[str]) -> None:
        proc.port = int(fields[1])
        while len(self.server_ports) <= i:
            self.server_ports.append(0)
        self.server_ports[i] = proc.port  # a restart listens on the same port

    def _nvme_args(self, i: int) -> list[str]:
        if self.nvme_size in ("", "0"):
            # Said, so an inherited GCACHE_SERVER_NVME_PATH cannot ask for a tier.
            return ["--nvme-size", "0"]
        return ["--nvme-size", self.nvme_size, "--nvme-path", str(self.nvme_dir(i))]

    def nvme_dir(self, i: int) -> Path:
        return self.data_dir / f"server{i}-nvme"

    def shm_dir(self) -> Path:
        """Where the servers put their segments: ``--shm-dir`` in ``server_args``,
        else what they read from the environment (``GCACHE_SERVER_SHM_DIR``)."""
        args = self.server_args
        if "--shm-dir" in args[:-1]:
            return Path(args[args.index("--shm-dir") + 1])
        try:
            return Path(load(ServerConfig).shm_dir)
        except ConfigError:  # the servers refuse it too, and create nothing
            return Path(ServerConfig().shm_dir)

    def segment_files(self, i: int) -> list[Path]:
        """Segment file and manifest of server ``i``'s current process."""
        pid = self.servers[i].popen.pid
        return [self.shm_dir() / f"gcache-server{i}-{pid}.{ext}" for ext in ("seg", "manifest")]

    def processes(self) -> dict[str, Proc]:
        """The deployment's processes by name: the latest spawned of each name."""
        return {p.name: p for p in self.spawned}

    def created_files(self) -> list[Path]:
        """What the processes spawned so far may have left behind: their ready files
        in the data dir, and each server process's segment, manifest and staging
        file in the shm dir (by pid, so other deployments' files are never named)."""
        out: list[Path] = []
        shm = self.shm_dir()
        for p in self.spawned:
            ready = p.extra.get("ready_file")
            if isinstance(ready, Path):
                out += [ready, ready.with_name(ready.name + ".tmp")]
            prefix = p.extra.get("shm_prefix")
            if prefix:
                out += [shm / f"{prefix}{p.popen.pid}.{ext}" for ext in SHM_EXTS]
        return out

    def wait_servers(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            if self.interrupted:
                raise DeploymentInterrupted(self.interrupted)
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
        """SIGTERM every process group (engines and router, then servers, then the
        meta, then anything else spawned: restarts in flight), SIGKILL what is left
        after ``timeout``, then remove the files they created (:meth:`cleanup`)."""
        codes: dict[str, int | None] = {}
        self._started = False
        procs = [*self.extra, *self.servers, *([self.meta] if self.meta else [])]
        # etcd last (below): the metas give their leases back as they stop.
        procs += [p for p in self.spawned if p not in procs and p.name != "etcd"]
        for p in procs:
            if p.alive:
                signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                code = p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(p, signal.SIGKILL)
                code = p.popen.wait()
            codes.setdefault(p.name, code)  # the current process of each name comes first
        for p in procs:  # whatever a daemon forked into its group dies with it
            signal_group(p, signal.SIGKILL)
        if self.etcd is not None:  # last: the metas gave their leases back
            self.etcd.stop()
        for fh in self._logs:
            fh.close()
        self._logs.clear()
        self.cleanup()
        return codes

    def cleanup(self) -> list[Path]:
        """Remove what the (stopped) processes left: ready files always; segments,
        manifests and staging files unless ``keep_segments`` (then staging files
        only). Logs and NVMe directories stay. Returns what was removed."""
        removed = []
        for path in self.created_files():
            if self.keep_segments and path.suffix in (".seg", ".manifest"):
                continue
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError:
                pass
        return removed

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- addresses -------------------------------------------------------------------

    @property
    def meta_addr(self) -> str:
        """The meta's hot path (with ``ha``: the etcd:// address)."""
        if self.etcd is not None:
            return self.etcd.url
        assert self.meta is not None
        return f"{self.host}:{self.meta.port}"

    @property
    def meta_grpc(self) -> str:
        """The meta's gRPC address (with ``ha``: the etcd:// address)."""
        if self.etcd is not None:
            return self.etcd.url
        assert self.meta is not None
        return f"{self.host}:{self.meta.extra['grpc_port']}"

    @property
    def metrics_url(self) -> str:
        meta = self.leader() if self.etcd is not None else self.meta
        assert meta is not None
        return f"http://{self.host}:{meta.extra['metrics_port']}/metrics"

    def client_config(self, **kw: Any) -> ClientConfig:
        kw.setdefault("tls_ca", self.tls_ca)
        return ClientConfig(meta=self.meta_addr, meta_grpc=self.meta_grpc, **kw)

    def stats(self) -> Any:
        if self.etcd is not None:
            return fetch_stats(self.grpc_of(self.leader()), tls_ca=self.tls_ca)
        return fetch_stats(self.meta_grpc, tls_ca=self.tls_ca)

    # ---- ha: the elected metas -------------------------------------------------------

    def grpc_of(self, meta: Proc) -> str:
        return f"{self.host}:{meta.extra['grpc_port']}"

    def hot_of(self, meta: Proc) -> str:
        return f"{self.host}:{meta.port}"

    def role_of(self, meta: Proc, timeout: float = 0.5) -> str:
        """``leader``, ``standby``, ``stepping-down`` ("" a single meta; "down")."""
        if not meta.alive or not meta.port:
            return "down"
        try:
            return str(fetch_stats(self.grpc_of(meta), timeout, self.tls_ca).role)
        except GCacheError:
            return "down"

    def leader(self, timeout: float = 10.0, exclude: Proc | None = None) -> Proc:
        """The meta that says it leads (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            for p in self.metas.values():
                if p is not exclude and self.role_of(p) == "leader":
                    return p
            if time.monotonic() > deadline:
                raise GCacheError(f"no meta leads within {timeout} s")
            time.sleep(0.05)

    def signal_leader(self, sig: int) -> Proc:
        """Send ``sig`` (SIGKILL, SIGSTOP, ...) to the leader; returns it."""
        lead = self.leader()
        signal_group(lead, sig)
        if sig == signal.SIGKILL:
            lead.popen.wait(10)
        return lead


def signal_group(p: Proc, sig: int) -> None:
    """Signal the process group a daemon leads (started with its own session)."""
    try:
        os.killpg(p.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        if p.alive:
            p.popen.send_signal(sig)


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
