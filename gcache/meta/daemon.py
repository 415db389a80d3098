"""``gcache-meta``: the metadata service (hot path on framed TCP, control on gRPC)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import time

import grpc

from gcache import config as cfgmod
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import Authenticator, add_port, server_credentials
from gcache.config import MetaConfig
from gcache.errors import BindError
from gcache.leader import LeaderRecord, parse_etcd, redirect_text
from gcache.meta.control import ControlService
from gcache.meta.core import MetaCore
from gcache.meta.election import Election
from gcache.meta.ha import EtcdElection
from gcache.meta.hotpath import HotPathServer
from gcache.meta.metrics import MetricsServer
from gcache.startup import (
    OneLineParser,
    install_uvloop,
    listen_tcp,
    probe_port,
    run_main,
    setup_logging,
)

log = logging.getLogger("gcache.meta")
TICK_S = 0.1
STALL_S = 1.0  # a tick this late: the loop was blocked, servers get the time back


class Restart(Exception):
    """This meta lost its leadership: the process replaces itself (``main``)."""

    def __init__(self, ports: tuple[int, int, int]) -> None:
        super().__init__("stepping down")
        self.ports = ports


def setup_ha(
    cfg: MetaConfig,
    core: MetaCore,
    control: ControlService,
    addrs: tuple[int, int, int],
    stopping: asyncio.Event,
    stepped_down: list[str],
) -> EtcdElection:
    """Join the election in ``cfg.etcd``: the core serves only while this meta
    is the leader with a valid lease (``core.not_leader``); it takes its epoch
    when it wins. It starts empty and rebuilds from the servers' reports, which
    come once they find it the leader (docs/architecture.md)."""
    port, grpc_port, metrics_port = addrs
    host = cfg.advertise_host or cfg.host
    meta_id = cfg.meta_id or f"{socket.gethostname()}:{port}"
    election = Election(meta_id, cfg.etcd_lease_ttl_s)
    core.epoch = 0

    def record(epoch: int) -> LeaderRecord:
        return LeaderRecord(
            meta_id, f"{host}:{port}", f"{host}:{grpc_port}", f"{host}:{metrics_port}", epoch
        )

    def not_leader(now: float) -> str | None:
        if election.may_serve(now):
            return None
        other = election.leader
        return redirect_text(other if other is not None and other.id != meta_id else None)

    def on_leader(epoch: int) -> None:
        core.epoch = epoch  # before the first request it serves: grants carry it

    def on_step_down(why: str) -> None:
        stepped_down.append(why)
        stopping.set()

    def role() -> tuple[str, str]:
        lead = election.leader
        where = f"hot={lead.hot} grpc={lead.grpc}" if lead is not None else ""
        return election.role.value, where

    driver = EtcdElection(
        election, parse_etcd("meta.etcd", cfg.etcd), record, on_leader, on_step_down
    )
    core.not_leader = not_leader
    core.ha_stats = driver.stats
    control.ha_role = role
    return driver


async def run(cfg: MetaConfig) -> None:
    # The epoch: unix ms of this start. Every grant carries it and servers refuse
    # writes of an older one, so a restarted meta's predecessor cannot overwrite.
    # With --etcd the election gives it (a standby has none).
    core = MetaCore(cfg, epoch=int(time.time() * 1000))
    auth = Authenticator.from_files(cfg.cluster_token_file, cfg.tenants_file)
    tls = server_credentials(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
    listener = listen_tcp(cfg.host, cfg.port, "meta.port, --port", 1024)
    port = listener.getsockname()[1]
    hot = HotPathServer(core, listener, auth)

    grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    control = ControlService(core, auth=auth, hotpath=hot.stats)
    pb_grpc.add_ControlServicer_to_server(control, grpc_server)
    grpc_setting = "meta.grpc_port, --grpc-port"
    try:
        probe_port(cfg.host, cfg.grpc_port, grpc_setting)
        grpc_port = add_port(grpc_server, f"{cfg.host}:{cfg.grpc_port}", tls)
    except (BindError, RuntimeError) as exc:
        listener.close()
        if isinstance(exc, BindError):
            raise
        raise BindError(
            f"cannot listen on {cfg.host}:{cfg.grpc_port} ({grpc_setting}): {exc}"
        ) from exc
    if grpc_port == 0:
        listener.close()
        raise BindError(f"cannot listen on {cfg.host}:{cfg.grpc_port} ({grpc_setting})")
    await grpc_server.start()

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            try:
                now = time.monotonic()
                late = now - last - TICK_S
                last = now
                if late > STALL_S:
                    log.warning("the meta's event loop stalled for %.1f s", late)
                    core.stalled(late)
                    if driver is not None:
                        driver.election.stalled(now, late)
                core.tick(now)
            except Exception:
                log.exception("tick failed")

    driver: EtcdElection | None = None
    stepped_down: list[str] = []
    metrics = MetricsServer(core, hot.stats)
    metrics_port = -1
    if cfg.metrics_port >= 0:
        try:
            metrics_port = await metrics.start(cfg.host, cfg.metrics_port)
        except BindError:
            listener.close()
            await grpc_server.stop(grace=None)
            raise
    tasks = [asyncio.create_task(hot.accept_loop()), asyncio.create_task(ticker())]
    if cfg.etcd:
        driver = setup_ha(
            cfg, core, control, (port, grpc_port, metrics_port), stopping, stepped_down
        )
        election = driver.election
        metrics.ready = lambda: election.ready(time.monotonic())
        tasks.append(asyncio.create_task(driver.run()))
        log.info("gcache-meta joins the election in %s as %s", cfg.etcd, election.meta_id)
    log.info(
        "gcache-meta: hot path on %s:%d, gRPC on %s:%d, metrics on %s",
        cfg.host,
        port,
        cfg.host,
        grpc_port,
        f"http://{cfg.host}:{metrics_port}/metrics" if metrics_port >= 0 else "(disabled)",
    )
    if auth.enabled or tls is not None:
        log.info("gcache-meta auth: %s, gRPC TLS: %s", auth.describe(), "on" if tls else "off")
    else:
        log.warning("gcache-meta runs without authentication (no cluster or tenant tokens)")
    # Everything allocated at start-up (modules, gRPC, the config) is permanent:
    # keep it out of every later collection of the cyclic collector.
    gc.freeze()
    if cfg.ready_file:
        with open(cfg.ready_file + ".tmp", "w") as fh:
            fh.write(f"{cfg.host} {port} {grpc_port} {metrics_port}\n")
        os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
    try:
        await stopping.wait()
    finally:
        log.info("gcache-meta stopping: %r", core)
        for t in tasks:
            t.cancel()
        if driver is not None and not stepped_down:
            await driver.close()  # a clean stop hands the lease over at once
        await hot.close()
        await metrics.close()
        await grpc_server.stop(grace=0.5)
    if stepped_down:
        raise Restart((port, grpc_port, metrics_port))


def reexec(argv: list[str], ports: tuple[int, int, int]) -> None:
    """Replace this process with a fresh meta on the same ports (and pid): a
    leader that lost its lease keeps nothing of its term (index, leases, puts
    in flight) and comes back as a standby. Sockets are not inherited (PEP 446)."""
    port, grpc_port, metrics_port = ports
    args = [*argv, "--port", str(port), "--grpc-port", str(grpc_port)]
    if metrics_port >= 0:
        args += ["--metrics-port", str(metrics_port)]
    log.warning("gcache-meta restarts as a standby (same ports, fresh state)")
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, "-m", "gcache.meta.daemon", *args])


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="gcache-meta",
        description="GCache metadata service: server membership, namespaces, the SWA-aware "
        "prefix index, placement, leases and eviction. Hot path on framed TCP, control "
        "plane on gRPC.",
    )
    cfgmod.add_arguments(parser, MetaConfig)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)

    def body() -> None:
        cfg = cfgmod.from_args(MetaConfig, args)
        install_uvloop()
        try:
            asyncio.run(run(cfg))
        except Restart as r:
            reexec(list(sys.argv[1:] if argv is None else argv), r.ports)

    run_main("gcache-meta", log, body)


if __name__ == "__main__":
    main()
