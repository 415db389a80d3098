"""``gcache-meta``: the metadata service (hot path on framed TCP, control on gRPC)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time

import grpc

from gcache import config as cfgmod
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import Authenticator, add_port, server_credentials
from gcache.config import MetaConfig
from gcache.errors import BindError
from gcache.meta.control import ControlService
from gcache.meta.core import MetaCore
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


async def run(cfg: MetaConfig) -> None:
    # The epoch: unix ms of this start. Every grant carries it and servers refuse
    # writes of an older one, so a restarted meta's predecessor cannot overwrite.
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
                core.tick(now)
            except Exception:
                log.exception("tick failed")

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
        await hot.close()
        await metrics.close()
        await grpc_server.stop(grace=0.5)


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
        asyncio.run(run(cfg))

    run_main("gcache-meta", log, body)


if __name__ == "__main__":
    main()
