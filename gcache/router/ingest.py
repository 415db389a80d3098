"""ZMQ SUB ingestion of vLLM KV events (``zmq.asyncio``), feeding :class:`RouterCore`.

Two ways in, both vLLM's own (``--kv-events-config``):

* the engine binds its PUB (``endpoint: tcp://*:5557``) and the router connects one
  SUB socket per instance listed with ``@EVENTS`` in ``router.instances``: the
  instance is known by the socket, the topic is ignored;
* the engine connects its PUB to the router (``endpoint: tcp://ROUTER:PORT``), and
  the router binds one SUB on ``router.events_bind``: the topic names the instance.

A message is ``(topic, seq as 8 bytes big-endian, payload)``. Anything else is
rejected (counted, logged at a bounded rate) and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from gcache.config import parse_size
from gcache.errors import BindError
from gcache.router.service import RouterCore
from gcache.transport.limits import RateLimitedLog

log = logging.getLogger("gcache.router.events")


class EventSubscriber:
    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.ctx = zmq.asyncio.Context()
        self.sockets: list[tuple[zmq.asyncio.Socket, str]] = []  # (socket, instance or "")
        self.max_bytes = parse_size(core.cfg.events_max_bytes)
        self.reject_log = RateLimitedLog(log)
        self.reset_log = RateLimitedLog(log)
        self.malformed_messages = 0
        self.bound = ""

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    def open(self) -> None:
        """Connect to every listed instance's publisher; bind ``events_bind``."""
        for s in self.core.static:
            if s.events:
                sock = self._socket()
                try:
                    sock.connect(s.events)
                except zmq.ZMQError as exc:
                    sock.close()
                    raise BindError(
                        f"cannot subscribe to {s.events} (router.instances, {s.name}): {exc}"
                    ) from exc
                self.sockets.append((sock, s.name))
        if self.core.cfg.events_bind:
            sock = self._socket()
            try:
                sock.bind(self.core.cfg.events_bind)
            except zmq.ZMQError as exc:
                sock.close()
                raise BindError(
                    f"cannot listen on {self.core.cfg.events_bind} (router.events_bind, "
                    f"--events-bind): {exc}"
                ) from exc
            self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.sockets.append((sock, ""))

    def handle(self, frames: list[bytes], instance: str, now: float) -> None:
        """One received message (plain code: tests drive it without sockets)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed_messages += 1
            self.core.ingestor.rejected["malformed_message"] += 1
            self.reject_log.log(
                now,
                "KV events: rejected a message of %d frames (want topic, 8-byte seq, payload)",
                len(frames),
            )
            return
        topic, seq_raw, payload = frames
        name = instance
        if not name:
            try:
                name = topic.decode("utf-8")
            except UnicodeDecodeError:
                name = repr(topic)
        seq = int.from_bytes(seq_raw, "big")
        out = self.core.events(name, seq, payload, now)
        if out.reset:
            self.reset_log.log(now, "KV events from %s: index reset: %s", name, out.reset)
        for what, reason in out.rejected:
            self.reject_log.log(now, "KV events from %s: rejected %s: %s", name, what, reason)

    async def _pump(self, sock: zmq.asyncio.Socket, instance: str) -> None:
        while True:
            frames = await sock.recv_multipart(copy=True)
            try:
                self.handle(list(frames), instance, time.monotonic())
            except Exception:  # a bug must cost one message, never the router
                log.exception("internal error applying KV events from %s", instance or "?")

    def tasks(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._pump(s, i)) for s, i in self.sockets]

    def stats(self) -> dict[str, int]:
        return {"malformed_messages": self.malformed_messages, "sockets": len(self.sockets)}

    def close(self) -> None:
        for sock, _ in self.sockets:
            sock.close(linger=0)
        self.ctx.term()
