"""``gcache-engine`` / ``python -m gcache_client.engines.demo.server``: an OpenAI-compatible
engine instance around the toy MiMo-V2-Flash model (:mod:`gcache_client.engines.demo.engine`).

HTTP (aiohttp):

* ``POST /v1/completions`` (``prompt``: text or token ids) and
  ``POST /v1/chat/completions`` (``messages``, rendered by
  :func:`gcache_client.textcodec.render_chat`), ``stream: true`` answered as
  server-sent events ending in ``data: [DONE]``; every answer carries ``gcache``
  (instance, prompt tokens, tokens from the local cache and from the pool) and
  ``usage.prompt_tokens_details.cached_tokens``, and the header ``x-gcache-instance``;
* ``GET /health``, ``GET /v1/models``, ``GET /stats``, ``GET /v1/gcache/namespace``
  (the namespace fingerprint a router needs to key prompts the way this engine does).

One request runs at a time on a worker thread; at most ``max_queue`` wait, past that
the answer is 503. With ``router`` set, the instance reports its load every
``load_interval_s`` (and at each admission and completion) and its client reports
hits after each lookup; with ``kv_events_endpoint`` set it publishes its local
cache's changes as vLLM KV events.

This module assembles the process (the engine, the HTTP service of :mod:`.service`,
the load reports); the handlers are in :mod:`.service`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from aiohttp import web

from gcache import config as cfgmod
from gcache.config import ClientConfig, EngineConfig, parse_size
from gcache.startup import OneLineParser, listen_tcp, run_main
from gcache_client.engines.demo.service import EngineService
from gcache_client.router import AsyncRouterClient

log = logging.getLogger("gcache.engine")


def _build(cfg: EngineConfig, instance_id: str, url: str) -> Any:
    """The model, the GCache client and the engine (slow: imports torch)."""
    import transformers

    from gcache_client.engines.demo.engine import Engine
    from gcache_client.engines.kv_events import ZmqPublisher
    from gcache_client.models import tiny_mimo_v2_flash
    from gcache_client.sync import GCacheClient

    transformers.logging.set_verbosity_error()
    model = tiny_mimo_v2_flash(num_layers=cfg.layers, hidden_size=cfg.hidden, seed=cfg.seed)
    client_cfg = ClientConfig(
        meta=cfg.meta,
        meta_grpc=cfg.meta_grpc,
        transport=cfg.transport,
        router=cfg.router,
        instance_id=instance_id if cfg.router else "",
    )
    publisher = None
    if cfg.kv_events_endpoint:
        publisher = ZmqPublisher(cfg.kv_events_endpoint, cfg.kv_events_topic or instance_id)
    client = GCacheClient(client_cfg)
    try:
        return Engine(
            client,
            model,
            cfg.model_id,
            block_size=cfg.block_size,
            local_capacity=parse_size(cfg.local_capacity),
            publisher=publisher,
        )
    except BaseException:
        client.close()
        if publisher is not None:
            publisher.close()
        raise


async def serve(cfg: EngineConfig) -> None:
    sock = listen_tcp(cfg.host, cfg.port, "engine.port", 128)
    port = sock.getsockname()[1]
    url = cfg.url or f"http://{cfg.host}:{port}"
    instance_id = cfg.instance_id or url.split("://", 1)[1].rstrip("/")
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        engine = await loop.run_in_executor(None, _build, cfg, instance_id, url)
    except BaseException:
        sock.close()
        raise
    router = AsyncRouterClient(cfg.router, timeout_s=2.0) if cfg.router else None
    service = EngineService(cfg, engine, instance_id, url, router)
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    loader = asyncio.create_task(service.load_loop())
    ns = engine.ns
    events = engine.publisher.bound_endpoint if engine.publisher else "off"
    log.info(
        "gcache-engine %s: serving on %s, namespace %s (block %d), pool %s, router %s, "
        "kv events %s",
        instance_id,
        url,
        ns.fingerprint.hex(),
        ns.layout.block_size,
        cfg.meta,
        cfg.router or "off",
        events,
    )
    if cfg.ready_file:
        with open(cfg.ready_file + ".tmp", "w") as fh:
            fh.write(f"{cfg.host} {port} {ns.fingerprint.hex()} {events}\n")
        import os

        os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
    try:
        await stopping.wait()
    finally:
        log.info("gcache-engine %s stopping", instance_id)
        loader.cancel()
        await runner.cleanup()
        service.close()
        if router is not None:
            await router.close()
        if engine.publisher is not None:
            engine.publisher.close()
        await loop.run_in_executor(None, engine.client.close)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="gcache-engine",
        description="An OpenAI-compatible engine instance (a tiny random-weight "
        "MiMo-V2-Flash model) with its own prefix cache, GCache as the shared pool, "
        "vLLM-format KV events and load reports to gcache-router.",
    )
    cfgmod.add_arguments(parser, EngineConfig)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def body() -> None:
        cfg = cfgmod.from_args(EngineConfig, args)
        asyncio.run(serve(cfg))

    run_main("gcache-engine", log, body)


if __name__ == "__main__":
    main()
