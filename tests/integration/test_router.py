"""A real ``gcache-router`` process driven with vLLM-format KV events over real ZMQ
sockets and with framed route/report calls: routing to the holder, window-safe
matches, expiry, sequence gaps, restarts, bad events, the load guard, the HTTP
front (proxy with streaming passed through, /route, /healthz, /metrics)."""

from __future__ import annotations

import http.server
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from gcache import wire
from gcache.errors import E_NO_INSTANCE
from gcache.keys import block_keys
from tests.rawwire import call
from tests.unit.test_router_events import VAllBlocksCleared, VBlockRemoved, VEventBatch, stored

FP = bytes(range(16))
BS = 64
TTL = 1.5


class Router:
    """A ``gcache-router`` process; ``instances`` (``router.instances``) may name
    ``{pub}``, the endpoint of a PUB socket bound here for it to subscribe to."""

    def __init__(
        self,
        tmp: Path,
        *args: str,
        fp: bytes = FP,
        layout: str = "mimo-v2-flash",
        block_size: int = BS,
        instances: str = "static=http://127.0.0.1:9@{pub}",
        health_interval_s: float = 0,
        env: dict[str, str] | None = None,
        name: str = "router",
    ) -> None:
        ready = tmp / f"{name}.ready"
        self.log = tmp / f"{name}.log"
        self.pub: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
        self.pub_port: int = self.pub.bind_to_random_port("tcp://127.0.0.1")
        listed = instances.format(pub=f"tcp://127.0.0.1:{self.pub_port}")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "gcache.router.daemon", "--port", "0", "--http-port", "0",
                "--events-bind", "tcp://127.0.0.1:*", "--namespace", fp.hex(),
                "--layout", layout, "--block-size", str(block_size),
                "--instance-ttl-s", str(TTL), "--health-interval-s", str(health_interval_s),
                "--instances", listed, "--ready-file", str(ready), *args,
            ],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.05)
        _, port, http_port, events = ready.read_text().split()
        self.port, self.http = int(port), int(http_port)
        self.events: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)  # engines
        self.events.connect(events)
        self.seq: dict[str, int] = {}
        time.sleep(0.5)  # ZMQ subscriptions propagate

    def call(self, msg: wire.Msg) -> Any:
        return call(self.port, msg)[1]

    def load(self, inst: str, tokens: int = 0, queued: int = 0, url: str = "") -> None:
        url = url or f"http://127.0.0.1:9/{inst}"
        assert self.call(wire.ReportLoad(inst, queued, 0, tokens, 0, url)) == wire.Ok(0)

    def send(self, inst: str, *events: Any, seq: int | None = None, raw: bytes = b"") -> None:
        """One vLLM batch on topic ``inst`` (engine connected to events_bind)."""
        if seq is None:
            seq = self.seq.get(inst, -1) + 1
        self.seq[inst] = seq
        payload = raw or msgspec.msgpack.encode(VEventBatch(ts=time.time(), events=list(events)))
        self.events.send_multipart([inst.encode(), seq.to_bytes(8, "big"), payload])

    def metric(self, name: str, **labels: str) -> float:
        text = self.get("/metrics")[1].decode()
        want = name
        if labels:
            want += "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_metric(self, cond: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, self.get("/metrics")[1].decode()[-3000:]
            time.sleep(0.02)

    def batches(self) -> float:
        return self.metric("gcache_router_events_total", what="batches")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}{path}", data=json.dumps(body).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(10)
        self.events.close(linger=0)
        self.pub.close(linger=0)
        return code


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    r = Router(tmp_path)
    yield r
    assert r.stop() == 0, r.log.read_text()[-2000:]


def prompt(n_blocks: int, seed: int) -> tuple[list[int], list[bytes]]:
    rng = random.Random(seed)
    toks = [rng.randrange(256) for _ in range(n_blocks * BS)]
    return toks, block_keys(FP, toks, BS)


def held(toks: list[int], hashes: list[int], window: bool = True) -> list[Any]:
    """Events of an engine holding all blocks (full group) and, with ``window``,
    the sliding window of the last two (128 tokens)."""
    evs = [stored(hashes, None, toks, group_idx=0, kv_cache_spec_kind="full_attention")]
    if window:
        evs.append(
            stored(hashes[-2:], hashes[-3] if len(hashes) > 2 else None, toks[-2 * BS :],
                   group_idx=1, kv_cache_spec_kind="sliding_window",
                   kv_cache_spec_sliding_window=128)
        )  # fmt: skip
    return evs


def route(r: Router, keys: list[bytes], tokens: int) -> Any:
    return r.call(wire.Route(keys, tokens))


def test_listed_instance_is_not_live_until_heard_from(router: Router) -> None:
    """The listed instance (http://127.0.0.1:9, nothing listens there) has neither
    answered a health probe nor reported load: right after start no request is
    routed to it (it counted as live for instance_ttl_s from start). Clear errors:
    E_NO_INSTANCE on the hot path, 503 with the one-line reason on HTTP."""
    _, keys = prompt(2, 0)
    reply = route(router, keys, 2 * BS)
    assert isinstance(reply, wire.Error) and reply.code == E_NO_INSTANCE, reply
    assert "no live engine instance" in reply.message and "\n" not in reply.message
    status, body = router.get("/healthz")
    assert status == 503 and b"no live instance" in body
    for path in ("/v1/completions", "/route"):
        status, _, body = router.post(path, {"prompt": "hello", "max_tokens": 2})
        message = json.loads(body)["error"]["message"]
        assert status == 503 and message.startswith("no live engine instance"), body
        assert "\n" not in message
    assert router.metric("gcache_router_instance_live", instance="static") == 0
    # A load report makes it live.
    router.load("static", url="http://127.0.0.1:9")
    reply = route(router, keys, 2 * BS)
    assert isinstance(reply, wire.Routed) and reply.instance == "static"


def _health_endpoint() -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = _Engine(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_listed_instance_becomes_live_by_health_probe(tmp_path: Path) -> None:
    """Two listed instances, one answering /health, one unreachable: only the one
    that answered a probe is ever routed to."""
    up = _health_endpoint()
    r = Router(
        tmp_path,
        instances=f"up=http://127.0.0.1:{up.server_address[1]},down=http://127.0.0.1:9",
        health_interval_s=0.2,
    )
    try:
        _, keys = prompt(2, 9)
        r.wait_metric(lambda: r.metric("gcache_router_instance_live", instance="up") == 1)
        got = {route(r, keys, 2 * BS).instance for _ in range(20)}
        assert got == {"up"}
        assert json.loads(r.get("/healthz")[1])["live"] == ["up"]
        assert r.metric("gcache_router_instance_live", instance="down") == 0
    finally:
        up.shutdown()
        assert r.stop() == 0, r.log.read_text()[-2000:]


def test_events_over_zmq_route_to_the_holder_window_safe(router: Router) -> None:
    """e1 holds the prompt with its last window, e2 only its full-attention blocks
    (window freed): e2's usable match is 0, the request goes to e1."""
    toks, keys = prompt(8, 1)
    for inst in ("e1", "e2"):
        router.load(inst)
    router.send("e1", *held(toks, list(range(100, 108))))
    router.send("e2", *held(toks, list(range(200, 208)), window=False))
    router.wait_metric(lambda: router.batches() >= 2)
    for _ in range(5):
        reply = route(router, keys, 8 * BS + 10)
        assert isinstance(reply, wire.Routed), reply
        assert reply.instance == "e1" and reply.local_blocks == 8
    assert router.metric("gcache_router_instance_blocks", instance="e1") == 8


def test_instance_that_stops_reporting_expires(router: Router) -> None:
    toks, keys = prompt(4, 2)
    router.load("e1")
    router.load("e2")
    router.send("e1", *held(toks, [1, 2, 3, 4]))
    router.wait_metric(lambda: router.batches() >= 1)
    assert route(router, keys, 4 * BS).instance == "e1"
    deadline = time.monotonic() + TTL + 0.5
    while time.monotonic() < deadline:  # e2 keeps reporting, e1 falls silent
        router.load("e2")
        time.sleep(0.2)
    reply = route(router, keys, 4 * BS)
    assert reply.instance == "e2" and reply.local_blocks == 0
    assert router.metric("gcache_router_instance_live", instance="e1") == 0


def test_sequence_gap_and_restart_reset_backwards_rejected(router: Router) -> None:
    toks, keys = prompt(4, 3)
    router.load("e1")
    router.load("e2")
    router.send("e1", *held(toks, [1, 2, 3, 4]), seq=0)
    router.wait_metric(lambda: router.batches() >= 1)
    assert route(router, keys, 4 * BS).local_blocks == 4
    router.send("e1", VBlockRemoved(block_hashes=[99], medium="GPU"), seq=1)
    # a replayed (older) batch removing the blocks: rejected, nothing changes
    router.send("e1", VBlockRemoved(block_hashes=[1, 2, 3, 4], medium="GPU"), seq=1)
    router.wait_metric(
        lambda: router.metric("gcache_router_events_total", what="rejected_backwards") >= 1
    )
    assert route(router, keys, 4 * BS).local_blocks == 4
    # a gap (batches 1..4 lost): e1's index is reset, then batch 5 applies
    other, okeys = prompt(2, 4)
    router.send("e1", *held(other, [7, 8]), seq=5)
    router.wait_metric(lambda: router.metric("gcache_router_index_total", what="resets") >= 1)
    assert route(router, okeys, 2 * BS).local_blocks == 2
    reply = route(router, keys, 4 * BS)
    assert reply.local_blocks == 0
    # the engine restarted: its numbering is back at 0; its old blocks are gone
    router.send("e1", *held(toks, [1, 2, 3, 4]), seq=0)
    router.wait_metric(lambda: router.metric("gcache_router_index_total", what="resets") >= 2)
    assert route(router, okeys, 2 * BS).local_blocks == 0
    assert route(router, keys, 4 * BS).local_blocks == 4
    router.send("e1", VAllBlocksCleared(), seq=1)  # (0 after 0 reads as a restart too)
    router.wait_metric(lambda: router.metric("gcache_router_index_total", what="resets") >= 3)
    assert route(router, keys, 4 * BS).local_blocks == 0


def test_bad_events_are_rejected_and_change_nothing(router: Router) -> None:
    toks, keys = prompt(4, 5)
    router.load("e1")
    router.send("e1", *held(toks, [1, 2, 3, 4]))
    router.wait_metric(lambda: router.batches() >= 1)

    def rejected(reason: str) -> float:
        return router.metric("gcache_router_events_total", what=f"rejected_{reason}")

    router.send("ghost", *held(toks, [1, 2, 3, 4]))  # never reported: unknown
    # a malformed batch does not count: the next one is still batch 1 (no gap)
    router.send("e1", raw=b"\xc1 not msgpack", seq=1)
    router.send("e1", VBlockRemoved(block_hashes=[1, 2], medium="GPU", group_idx=7), seq=1)
    router.send("e1", stored([9], 12345, toks[:BS]), seq=2)  # unknown parent
    router.events.send_multipart([b"e1", b"short"])  # not (topic, 8-byte seq, payload)
    router.wait_metric(
        lambda: min(rejected("unknown_instance"), rejected("malformed"), rejected("group"),
                    rejected("unknown_parent"), rejected("malformed_message")) >= 1
    )  # fmt: skip
    reply = route(router, keys, 4 * BS)
    assert reply.instance == "e1" and reply.local_blocks == 4
    assert router.metric("gcache_router_instance_blocks", instance="e1") == 4
    assert "ghost" not in router.get("/metrics")[1].decode()
    assert "rejected" in router.log.read_text()  # one line per reason, bounded rate


def test_full_local_hit_over_the_load_guard_goes_elsewhere(router: Router) -> None:
    toks, keys = prompt(8, 6)
    router.load("e1", tokens=10_000_000)  # flooded
    router.load("e2")
    router.send("e1", *held(toks, list(range(8))))
    router.wait_metric(lambda: router.batches() >= 1)
    for _ in range(5):
        reply = route(router, keys, 8 * BS)
        assert reply.instance != "e1" and reply.local_blocks == 0, reply
    router.load("e1", tokens=0)
    assert route(router, keys, 8 * BS).instance == "e1"


def test_static_instance_publisher_the_router_connects_to(router: Router) -> None:
    """An engine that binds its PUB (vLLM's default tcp://*:5557), listed with
    @EVENTS in router.instances: any topic is that instance's."""
    toks, keys = prompt(3, 7)
    router.load("static", url="http://127.0.0.1:9")
    payload = msgspec.msgpack.encode(VEventBatch(ts=1.0, events=held(toks, [1, 2, 3])))
    deadline = time.monotonic() + 5
    while router.metric("gcache_router_instance_blocks", instance="static") < 3:
        router.pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])  # replays: rejected
        assert time.monotonic() < deadline
        time.sleep(0.1)
    reply = route(router, keys, 3 * BS)
    assert reply.instance == "static" and reply.local_blocks == 3


class _Engine(http.server.ThreadingHTTPServer):
    daemon_threads = True


def _engine(name: str, seen: list[tuple[str, bytes]]) -> _Engine:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {json.dumps({'engine': name, 'i': i})}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:
            pass

    server = _Engine(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_proxy_streams_from_the_chosen_instance(router: Router) -> None:
    """The chat prompt rendered as gcache-engine renders it is held by e2: the
    request is forwarded there unchanged and its SSE stream comes back whole."""
    from gcache import textcodec

    seen: dict[str, list[tuple[str, bytes]]] = {"e1": [], "e2": []}
    engines = {n: _engine(n, seen[n]) for n in seen}
    try:
        for n, srv in engines.items():
            router.load(n, url=f"http://127.0.0.1:{srv.server_address[1]}")
        messages = [{"role": "user", "content": "x" * 300}]
        toks = textcodec.encode(textcodec.render_chat(messages))
        nb = len(toks) // BS
        router.send("e2", *held(toks[: nb * BS], list(range(nb))))
        router.wait_metric(lambda: router.batches() >= 1)
        body = {"model": "m", "messages": messages, "stream": True}
        status, headers, data = router.post("/v1/chat/completions", body)
        assert status == 200 and headers["x-gcache-instance"] == "e2"
        assert data.count(b"data: ") == 4 and data.endswith(b"data: [DONE]\n\n")
        assert seen["e2"] == [("/v1/chat/completions", json.dumps(body).encode())]
        assert not seen["e1"]
        status, _, data = router.post("/route", {"messages": messages})
        assert status == 200 and json.loads(data)["instance"] == "e2"
        assert json.loads(data)["local_blocks"] == nb
        status, _, data = router.post("/v1/completions", {"prompt": [1, 2, "x"]})
        assert status == 400
        assert router.metric("gcache_router_decision_seconds_count") >= 2
    finally:
        for srv in engines.values():
            srv.shutdown()
