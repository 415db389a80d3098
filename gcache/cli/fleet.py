"""Engine instances and a ``gcache-router`` beside a :class:`LocalDeployment`:
``gcache up --router`` and the router's end-to-end tests start them here.

* :func:`start_engine` runs one ``gcache-engine`` (the toy OpenAI-compatible
  instance of ``gcache_client``) against the deployment's meta, publishing its KV
  events on a PUB socket of its own and, when given, reporting to a router;
* :func:`instance_namespace` asks an instance ``GET /v1/gcache/namespace`` for the
  namespace fingerprint and layout its prompts are keyed with, which the router
  needs to key them the same way;
* :func:`start_router` runs ``gcache-router`` in front of instances
  (``[ID=]URL[@EVENTS]``, as ``router.instances`` reads them), with the
  deployment's meta for the pool match.

Every process is added to the deployment's ``extra`` list, so ``stop()`` ends it
first (before the servers and the meta).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from gcache.cli.deploy import LocalDeployment, Proc
from gcache.errors import GCacheError


@dataclass(frozen=True, slots=True)
class InstanceNamespace:
    fingerprint: str  # 32 hex digits
    block_size: int
    layout: dict[str, object]  # the layout spec as JSON (gcache.layout.encode_spec)


def free_port(host: str) -> int:
    """A port free on ``host`` now (for a process that others must know the port of
    before it starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_engine(
    d: LocalDeployment,
    name: str,
    *,
    router: str = "",
    args: list[str] | None = None,
    timeout: float = 120.0,
) -> Proc:
    """Start ``gcache-engine`` as ``name`` (instance id ``name`` at the router); its
    ``extra`` holds ``url``, ``namespace`` and ``events`` (the PUB endpoint)."""
    ready = d.data_dir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    argv = [
        "--host",
        d.host,
        "--port",
        "0",
        "--instance-id",
        name,
        "--meta",
        d.meta_addr,
        "--meta-grpc",
        d.meta_grpc,
        "--kv-events-endpoint",
        f"tcp://{d.host}:*",
        "--ready-file",
        str(ready),
    ]
    if router:
        argv += ["--router", router]
    proc = d._spawn(name, "gcache_client.engines.demo.server", [*argv, *(args or [])])
    d.extra.append(proc)
    host, port, fingerprint, events = d._wait_ready(proc, ready, time.monotonic() + timeout)
    proc.host, proc.port = host, int(port)
    proc.extra.update(url=f"http://{host}:{port}", namespace=fingerprint, events=events)
    return proc


def instance_namespace(url: str, timeout: float = 2.0) -> InstanceNamespace | None:
    """The namespace a ``gcache-engine`` at ``url`` keys prompts with; None when
    the URL does not answer it (not a gcache-engine, or not up)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/gcache/namespace", timeout=timeout) as r:
            data = json.loads(r.read())
        return InstanceNamespace(str(data["fingerprint"]), int(data["block_size"]), data["layout"])
    except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError):
        return None


def discover_namespace(d: LocalDeployment, instances: str) -> InstanceNamespace | None:
    """The namespace every answering instance of ``instances`` agrees on (its layout
    written to the data folder for the router); None when none answers. Instances
    that disagree are refused: one router keys prompts one way."""
    found: list[tuple[str, InstanceNamespace]] = []
    for item in instances.split(","):
        item = item.strip()
        if not item:
            continue
        _, sep, rest = item.partition("=")
        url = rest if sep and "://" not in item.split("=", 1)[0] else item
        url = url.partition("@")[0]
        ns = instance_namespace(url)
        if ns is not None:
            found.append((url, ns))
    if not found:
        return None
    first_url, first = found[0]
    for url, ns in found[1:]:
        if ns.fingerprint != first.fingerprint:
            raise GCacheError(
                f"instances key prompts differently: {first_url} uses namespace "
                f"{first.fingerprint}, {url} uses {ns.fingerprint}"
            )
    return first


def start_router(
    d: LocalDeployment,
    instances: str,
    *,
    port: int = 0,
    http_port: int = 0,
    namespace: InstanceNamespace | None = None,
    args: list[str] | None = None,
    timeout: float = 30.0,
) -> Proc:
    """Start ``gcache-router`` in front of ``instances``, with the deployment's meta
    for the pool match; ``extra`` holds ``http_port`` and ``url`` (its HTTP front)."""
    ready = d.data_dir / "router.ready"
    ready.unlink(missing_ok=True)
    argv = [
        "--host",
        d.host,
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--instances",
        instances,
        "--meta",
        d.meta_addr,
        "--ready-file",
        str(ready),
    ]
    if namespace is not None:
        layout_file = d.data_dir / "router-layout.json"
        layout_file.write_text(json.dumps(namespace.layout))
        argv += [
            "--namespace",
            namespace.fingerprint,
            "--layout",
            str(layout_file),
            "--block-size",
            str(namespace.block_size),
        ]
    proc = d._spawn("router", "gcache.router.daemon", [*argv, *(args or [])])
    d.extra.append(proc)
    fields = d._wait_ready(proc, ready, time.monotonic() + timeout)
    proc.host, proc.port = fields[0], int(fields[1])
    proc.extra.update(http_port=int(fields[2]), url=f"http://{fields[0]}:{fields[2]}")
    return proc


def wait_live(router: Proc, names: list[str], timeout: float = 30.0) -> None:
    """Until the router counts every one of ``names`` live (a listed instance is
    not routed to before it answers a health probe or reports load)."""
    url = str(router.extra["url"]) + "/healthz"
    deadline = time.monotonic() + timeout
    live: list[str] = []
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                live = list(json.loads(r.read())["live"])
        except urllib.error.HTTPError as e:  # 503 while none is live
            live = list(json.loads(e.read()).get("live", []))
        except (OSError, ValueError, KeyError):
            live = []
        if all(n in live for n in names):
            return
        if time.monotonic() > deadline:
            missing = ", ".join(n for n in names if n not in live)
            raise GCacheError(f"the router never saw {missing} live within {timeout:.0f} s")
        time.sleep(0.05)


def engine_instances(engines: list[Proc]) -> str:
    """``router.instances`` for engines started here: ``ID=URL@EVENTS`` each."""
    return ",".join(f"{p.name}={p.extra['url']}@{p.extra['events']}" for p in engines)


def router_addr(proc: Proc) -> str:
    return f"{proc.host}:{proc.port}"


def up_router(
    d: LocalDeployment,
    instances: str,
    engines: int,
    port: int,
    http_port: int,
    engine_args: list[str] | None = None,
) -> list[str]:
    """``gcache up --router``: start ``engines`` gcache-engine instances (reporting to
    the router, which subscribes to their KV events), then the router in front of
    them and of ``instances``; the lines to print."""
    if engines < 0:
        raise GCacheError(f"--engines must be >= 0, got {engines}")
    if not engines and not instances.strip():
        raise GCacheError("--router needs --instances URL,... or --engines N")
    if engines and port == 0:
        port = free_port(d.host)  # the engines report to it before it starts
    procs = [
        start_engine(d, f"engine{i}", router=f"{d.host}:{port}", args=engine_args)
        for i in range(engines)
    ]
    listed = ",".join(x for x in (engine_instances(procs), instances.strip()) if x)
    ns = discover_namespace(d, listed)
    router = start_router(d, listed, port=port, http_port=http_port, namespace=ns)
    wait_live(router, [p.name for p in procs])
    lines = [
        f"  router hot path {router_addr(router)}",
        f"  router HTTP     {router.extra['url']}  (OpenAI /v1/completions, "
        "/v1/chat/completions, /route, /healthz, /metrics)",
    ]
    lines += [f"  {p.name:<15} {p.extra['url']}  (events {p.extra['events']})" for p in procs]
    if ns is None:
        lines.append(
            "  router keys     no instance answered /v1/gcache/namespace: the router's "
            "own namespace and layout settings apply"
        )
    else:
        lines.append(f"  router keys     namespace {ns.fingerprint}, block {ns.block_size}")
    return lines
