"""The HTTP side of ``gcache-engine`` (:mod:`.server`): admission, the worker thread,
load accounting and the OpenAI-compatible handlers, around an engine
(:class:`gcache_client.engines.demo.engine.Engine`)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from gcache import layout as laymod
from gcache import textcodec
from gcache.config import EngineConfig
from gcache.errors import GCacheError
from gcache_client.router import AsyncRouterClient

log = logging.getLogger("gcache.engine")


class Busy(GCacheError):
    """The engine's queue is full."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


class EngineService:
    """Admission, the worker thread, load accounting and the HTTP handlers."""

    def __init__(
        self,
        cfg: EngineConfig,
        engine: Any,
        instance_id: str,
        url: str,
        router: AsyncRouterClient | None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.instance_id = instance_id
        self.url = url
        self.router = router
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gcache-engine")
        self._lock = threading.Lock()
        self.queued = 0
        self.running = 0
        self.tokens_in_flight = 0
        self.refused = 0
        self.started = time.time()

    # ---- load --------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        with self._lock:
            return {
                "queued": self.queued,
                "running": self.running,
                "tokens_in_flight": self.tokens_in_flight,
                "active_blocks": self.tokens_in_flight // self.cfg.block_size,
            }

    def report_load(self) -> None:
        if self.router is not None:
            self.router.report_load_nowait(self.instance_id, url=self.url, **self.load())

    async def load_loop(self) -> None:
        while True:
            if self.router is not None:
                try:
                    await self.router.report_load(self.instance_id, url=self.url, **self.load())
                except GCacheError as exc:
                    log.debug("load report failed: %s", exc)
            await asyncio.sleep(self.cfg.load_interval_s)

    # ---- running a request ------------------------------------------------------------------

    async def run(
        self,
        ids: list[int],
        max_tokens: int,
        on_token: Callable[[int], None] | None,
        cancelled: threading.Event,
    ) -> Any:
        cost = len(ids) + max_tokens
        with self._lock:
            if self.queued + self.running >= self.cfg.max_queue:
                self.refused += 1
                raise Busy(f"engine busy: {self.cfg.max_queue} requests waiting or running")
            self.queued += 1
            self.tokens_in_flight += cost
        self.report_load()

        def job() -> Any:
            with self._lock:
                self.queued -= 1
                self.running += 1
            try:
                return self.engine.generate(ids, max_tokens, on_token, cancelled.is_set)
            finally:
                with self._lock:
                    self.running -= 1
                    self.tokens_in_flight -= cost

        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, job)
        finally:
            self.report_load()

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ---- HTTP -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats_handler)
        app.router.add_get("/v1/gcache/namespace", self.namespace)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "instance": self.instance_id, **self.load()})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.model_id,
                        "object": "model",
                        "created": int(self.started),
                        "owned_by": "gcache",
                    }
                ],
            }
        )

    async def namespace(self, request: web.Request) -> web.Response:
        ns = self.engine.ns
        return web.json_response(
            {
                "fingerprint": ns.fingerprint.hex(),
                "model": ns.model,
                "block_size": ns.layout.block_size,
                "layout": json.loads(laymod.encode_spec(ns.layout.spec)),
            }
        )

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "instance": self.instance_id,
            "url": self.url,
            "refused": self.refused,
            **self.load(),
            **self.engine.stats(),
        }
        out["client"] = self.engine.client.stats()
        if self.router is not None:
            out["router_client"] = self.router.stats()
        return out

    async def stats_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise textcodec.PromptError(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise textcodec.PromptError("request body must be a JSON object")
        return body

    def _max_tokens(self, body: dict[str, Any]) -> int:
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw is None:
            return self.cfg.default_max_tokens
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            raise textcodec.PromptError(f"max_tokens must be a positive integer, got {raw!r}")
        if raw > self.cfg.max_tokens:
            raise textcodec.PromptError(
                f"max_tokens {raw} is over this engine's {self.cfg.max_tokens}"
            )
        return raw

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            if chat:
                ids = textcodec.encode(textcodec.render_chat(body.get("messages") or []))
            else:
                if "prompt" not in body:
                    raise textcodec.PromptError("prompt is required")
                ids = textcodec.prompt_ids(body["prompt"])
            if not ids:
                raise textcodec.PromptError("the prompt is empty")
            if len(ids) > self.cfg.max_prompt_tokens:
                raise textcodec.PromptError(
                    f"prompt of {len(ids)} tokens is over this engine's "
                    f"{self.cfg.max_prompt_tokens}"
                )
            vocab = self.engine.model.config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise textcodec.PromptError(f"token ids must be in 0..{vocab - 1}")
            max_tokens = self._max_tokens(body)
        except textcodec.PromptError as exc:
            return _error(400, str(exc))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": str(body.get("model") or self.cfg.model_id),
        }
        if body.get("stream"):
            return await self._stream(request, ids, max_tokens, chat, meta, body)
        cancelled = threading.Event()
        try:
            gen = await self.run(ids, max_tokens, None, cancelled)
        except Busy as exc:
            return _error(503, str(exc), "server_busy")
        except GCacheError as exc:
            return _error(500, str(exc), "server_error")
        except asyncio.CancelledError:
            cancelled.set()
            raise
        text = textcodec.decode(gen.output)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": gen.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": gen.finish_reason}
        out = {**meta, "choices": [choice], "usage": self._usage(gen), "gcache": self._info(gen)}
        return web.json_response(out, headers={"x-gcache-instance": self.instance_id})

    def _usage(self, gen: Any) -> dict[str, Any]:
        return {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": len(gen.output),
            "total_tokens": gen.prompt_tokens + len(gen.output),
            "prompt_tokens_details": {"cached_tokens": gen.local_tokens + gen.pool_tokens},
        }

    def _info(self, gen: Any) -> dict[str, Any]:
        return {
            "instance": self.instance_id,
            "prompt_tokens": gen.prompt_tokens,
            "local_tokens": gen.local_tokens,
            "pool_tokens": gen.pool_tokens,
        }

    async def _stream(
        self,
        request: web.Request,
        ids: list[int],
        max_tokens: int,
        chat: bool,
        meta: dict[str, Any],
        body: dict[str, Any],
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int] = asyncio.Queue()
        cancelled = threading.Event()
        chunk_meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}

        def on_token(tok: int) -> None:
            loop.call_soon_threadsafe(tokens.put_nowait, tok)

        task = asyncio.ensure_future(self.run(ids, max_tokens, on_token, cancelled))
        # Admission is decided at once: a refusal is a plain error, not a stream.
        await asyncio.sleep(0)
        if task.done() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, Busy):
                return _error(503, str(exc), "server_busy")
            return _error(500, str(exc), "server_error")
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "cache-control": "no-cache",
                "x-gcache-instance": self.instance_id,
            }
        )
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                d: dict[str, Any] = {}
                if first:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                c: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish}
            return {**chunk_meta, "choices": [c]}

        try:
            if chat:
                await send(chunk(None, None, first=True))
            while True:
                getter = asyncio.ensure_future(tokens.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    await send(chunk(textcodec.decode([getter.result()]), None))
                    continue
                getter.cancel()
                while not tokens.empty():
                    await send(chunk(textcodec.decode([tokens.get_nowait()]), None))
                break
            try:
                gen = task.result()
            except GCacheError as exc:
                await send({"error": {"message": str(exc), "type": "server_error"}})
                await resp.write(b"data: [DONE]\n\n")
                return resp
            last = chunk(None, gen.finish_reason)
            last["gcache"] = self._info(gen)
            await send(last)
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({**chunk_meta, "choices": [], "usage": self._usage(gen)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            cancelled.set()  # the client went away: stop generating
            raise
        return resp
