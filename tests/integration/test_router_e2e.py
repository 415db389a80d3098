"""gcache-router in front of two real engine instances (``gcache-engine`` processes
around the transformers model of ``client/``), all started as ``gcache up --router
--engines 2`` starts them (gcache/cli/fleet.py): the engines publish their KV events
(vLLM format, ZMQ) and report load to the router; the router proxies OpenAI
requests to the instance it chooses.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from gcache import keys as keymod
from gcache import textcodec, wire
from gcache.cli.deploy import LocalDeployment, Proc
from gcache.cli.fleet import router_addr, up_router
from gcache_client import GCacheClient
from gcache_client.router import RouterClient


class Fleet:
    def __init__(self, d: LocalDeployment) -> None:
        self.d = d
        self.engines = {p.name: p for p in d.extra if p.name.startswith("engine")}
        self.router: Proc = next(p for p in d.extra if p.name == "router")
        self.url = str(self.router.extra["url"])
        self.namespace = bytes.fromhex(str(self.engines["engine0"].extra["namespace"]))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    d = LocalDeployment(tmp_path_factory.mktemp("fleet"), servers=1, capacity="128MiB")
    d.start()
    try:
        lines = up_router(d, "", 2, 0, 0, engine_args=["--load-interval-s", "0.2"])
        assert any("router keys     namespace" in ln for ln in lines), lines
        yield Fleet(d)
    finally:
        codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[dict[str, Any], Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), r.headers


def route(fleet: Fleet, messages: list[dict[str, str]]) -> dict[str, Any]:
    return post(fleet.url + "/route", {"messages": messages})[0]


def wait_routed_locally(fleet: Fleet, messages: list[dict[str, str]], timeout: float = 10) -> None:
    """Until the router has ingested the events that make ``messages`` a local hit
    somewhere (they travel asynchronously over ZMQ)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if route(fleet, messages)["local_blocks"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the router never saw a local hit for {route(fleet, messages)}")


def conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are assistant number {i}. " * 8},
        {"role": "user", "content": f"Question {i}: what is a KV cache? " * 6},
    ]


def test_follow_up_turns_are_routed_to_the_instance_that_served_the_first(fleet: Fleet) -> None:
    """First turns of four conversations go straight to chosen instances (0, 1, 1,
    0, an order no affinity-blind policy reproduces for the follow-ups); every
    follow-up sent through the router's proxy lands on its first turn's instance,
    which serves it from its own cache."""
    chats = {}
    for i, name in enumerate(["engine0", "engine1", "engine1", "engine0"]):
        msgs = conversation(i)
        url = str(fleet.engines[name].extra["url"])
        out, _ = post(url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 8})
        assert out["gcache"]["instance"] == name
        reply = out["choices"][0]["message"]["content"]
        chats[i] = (name, [*msgs, {"role": "assistant", "content": reply}])
    for i, (name, msgs) in chats.items():
        follow = [*msgs, {"role": "user", "content": f"And a follow-up {i}?"}]
        wait_routed_locally(fleet, follow)
        out, headers = post(fleet.url + "/v1/chat/completions", {"messages": follow})
        assert headers["x-gcache-instance"] == name, (i, out["gcache"])
        assert out["gcache"]["instance"] == name
        # ...and the instance reused its own copy of the first turn's prompt.
        assert out["gcache"]["local_tokens"] > 0
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_streaming_passes_through_the_router(fleet: Fleet) -> None:
    msgs = conversation(10)
    whole, _ = post(fleet.url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 10})
    req = urllib.request.Request(
        fleet.url + "/v1/chat/completions",
        data=json.dumps({"messages": msgs, "max_tokens": 10, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [ln[len("data: ") :] for ln in raw.split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) == 10
    # The same greedy reply, token by token, as the non-streamed answer.
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_router_client_routes_by_keys_and_reports(fleet: Fleet) -> None:
    msgs = conversation(20)
    post(
        str(fleet.engines["engine1"].extra["url"]) + "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 4},
    )
    prompt = textcodec.encode(textcodec.render_chat(msgs))
    follow = prompt + textcodec.encode("more text for the next turn")
    wait_routed_locally(fleet, [*msgs, {"role": "assistant", "content": "x"}])
    with RouterClient(router_addr(fleet.router)) as rc:
        keys = keymod.block_keys(fleet.namespace, follow, 64)
        got = rc.route(keys, prompt_tokens=len(follow))
        assert isinstance(got, wire.Routed)
        assert got.instance == "engine1" and got.local_blocks > 0
        assert got.url == fleet.engines["engine1"].extra["url"]
        # A new instance announced by a load report becomes routable.
        rc.report_load("ghost", queued=0, running=0, tokens_in_flight=0, url="http://127.0.0.1:9")
        live = json.loads(urllib.request.urlopen(fleet.url + "/healthz", timeout=5).read())
        assert "ghost" in live["live"]
        rc.report_hits("engine1", prompt_tokens=len(follow), local_tokens=256, pool_tokens=64)
        assert rc.stats()["hits_reported"] == 1


def test_client_match_reports_hits_to_the_router(fleet: Fleet) -> None:
    """GCacheClient with client.router and client.instance_id set: each match()
    sends a hit report (the router counts it in its metrics)."""

    def reported() -> float:
        text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith('gcache_router_requests_total{what="hit_reports"}'):
                return float(line.split()[-1])
        return 0.0

    before = reported()
    cfg = fleet.d.client_config(router=router_addr(fleet.router), instance_id="engine0")
    with GCacheClient(cfg) as gc:
        ns = gc.register_namespace("e2e/hits", "mimo-v2-flash")
        m = gc.match(ns, list(range(640)), local_tokens=128)
        gc.release(m)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and gc.stats().get("router_hits_reported", 0) < 1:
            time.sleep(0.02)
        assert gc.stats()["router_hits_reported"] == 1
    assert reported() - before == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": [1.5]}, "prompt must be"),
        ({"prompt": [5000]}, "token ids must be in"),
        ({"prompt": "hi", "max_tokens": 10**6}, "over this engine's"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown message role"),
    ],
)
def test_engine_refuses_bad_requests_with_one_line(
    fleet: Fleet, body: dict[str, Any], reason: str
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with pytest.raises(urllib.error.HTTPError) as err:
        post(str(fleet.engines["engine0"].extra["url"]) + path, body)
    assert err.value.code == 400
    message = json.loads(err.value.read())["error"]["message"]
    assert reason in message and "\n" not in message


def test_gcache_up_router_engines_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """``gcache up --router --engines 2`` as an operator runs it: up, one request
    through the router's proxy, then SIGTERM stops every process with exit code 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcache.cli.main", "up", "--data-dir", str(tmp_path),
         "--meta-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--server-port", "0",
         "--servers", "1", "--capacity", "64MiB", "--router", "--engines", "2",
         "--router-port", "0", "--router-http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    rest = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving; Ctrl-C to stop" in line:
                break
        text = "".join(lines)
        assert "serving; Ctrl-C to stop" in text, text
        found = re.search(r"router HTTP\s+(http://\S+)", text)
        assert found is not None, text
        out, headers = post(
            found.group(1) + "/v1/completions", {"prompt": "hello router", "max_tokens": 4}
        )
        assert headers["x-gcache-instance"] in ("engine0", "engine1")
        assert out["gcache"]["instance"] == headers["x-gcache-instance"]
        assert out["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, rest
    assert "stopped: engine0=0, engine1=0, router=0, server0=0, meta=0" in rest, rest
