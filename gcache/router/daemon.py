"""``gcache-router``: the KV-affinity router sidecar (docs/router.md).

asyncio drives the synchronous core (:mod:`.service`): the framed hot path
(:mod:`.hotpath`), the HTTP front (:mod:`.http`), ZMQ KV-event ingestion
(:mod:`.ingest`), health probes of the instances' URLs, and a ticker that forgets
instances silent for ``instance_forget_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import aiohttp

from gcache import config as cfgmod
from gcache.auth import load_client_token
from gcache.config import RouterConfig
from gcache.errors import BindError
from gcache.router.hotpath import PoolMatcher, RouterHotPath
from gcache.router.ingest import EventSubscriber
from gcache.router.service import RouterCore
from gcache.startup import (
    OneLineParser,
    install_uvloop,
    listen_tcp,
    run_main,
    setup_logging,
)

log = logging.getLogger("gcache.router")
TICK_S = 1.0


async def health_prober(core: RouterCore) -> None:
    """GET each instance URL's ``health_path`` every ``health_interval_s``; a 2xx
    answer keeps the instance live (engines that send no load reports)."""
    cfg = core.cfg
    interval = cfg.health_interval_s
    timeout = aiohttp.ClientTimeout(total=max(0.2, min(2.0, interval)))
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def probe(name: str, url: str) -> None:
            try:
                async with session.get(url + cfg.health_path) as resp:
                    if 200 <= resp.status < 300:
                        core.seen(name, time.monotonic())
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass

        while True:
            targets = [(i.name, i.url) for i in core.index.instances.values() if i.url]
            await asyncio.gather(*(probe(n, u) for n, u in targets))
            await asyncio.sleep(interval)


async def run(cfg: RouterConfig) -> None:
    core = RouterCore(cfg, time.monotonic())
    token = load_client_token(cfg.token, cfg.token_file)  # one line if unreadable
    subscriber = EventSubscriber(core)
    subscriber.open()
    try:
        listener = listen_tcp(cfg.host, cfg.port, "router.port, --port", 1024)
    except BindError:
        subscriber.close()
        raise
    port = listener.getsockname()[1]
    pool = PoolMatcher(cfg.meta, core.fp, cfg.pool_timeout_s, token) if core.pool_enabled else None
    hot = RouterHotPath(core, listener, pool)
    front = None
    http_port = -1
    if cfg.http_port >= 0:
        from gcache.router.http import HttpFront

        try:
            http_listener = listen_tcp(
                cfg.host, cfg.http_port, "router.http_port, --http-port", 1024
            )
        except BindError:
            listener.close()
            subscriber.close()
            raise
        front = HttpFront(core, pool, hot.stats)
        http_port = await front.start(http_listener)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(TICK_S)
            core.tick(time.monotonic())

    tasks = [asyncio.create_task(hot.accept_loop()), asyncio.create_task(ticker())]
    tasks += subscriber.tasks()
    if cfg.health_interval_s > 0:
        tasks.append(asyncio.create_task(health_prober(core)))
    log.info(
        "gcache-router: hot path on %s:%d, HTTP on %s, policy %s, layout %s, %d instance(s) "
        "configured, events: %d subscription(s)%s, pool match: %s",
        cfg.host,
        port,
        f"http://{cfg.host}:{http_port}" if http_port >= 0 else "(disabled)",
        cfg.policy,
        cfg.layout,
        len(core.static),
        len(subscriber.sockets),
        f", bound {subscriber.bound}" if subscriber.bound else "",
        cfg.meta if pool is not None else "off (set router.meta and router.namespace)",
    )
    if cfg.ready_file:
        with open(cfg.ready_file + ".tmp", "w") as fh:
            fh.write(f"{cfg.host} {port} {http_port} {subscriber.bound}\n")
        os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
    try:
        await stopping.wait()
    finally:
        log.info("gcache-router stopping: %s", core.counters)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await hot.close()
        if front is not None:
            await front.close()
        if pool is not None:
            pool.close()
        subscriber.close()


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="gcache-router",
        description="GCache KV-affinity router: routes each request to the engine instance "
        "where its first token comes soonest (window-safe local prefix, the GCache pool, "
        "load). Framed hot path for gcache_client, OpenAI-compatible HTTP proxy, vLLM KV "
        "events over ZMQ.",
    )
    cfgmod.add_arguments(parser, RouterConfig)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)

    def body() -> None:
        cfg = cfgmod.from_args(RouterConfig, args)
        install_uvloop()
        asyncio.run(run(cfg))

    run_main("gcache-router", log, body)


if __name__ == "__main__":
    main()
