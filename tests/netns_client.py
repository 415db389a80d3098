"""A long-lived client process for the multi-host tests: one JSON command per line
on stdin, one JSON line per command on stdout. It keeps one real
:class:`GCacheClient` (its connections, mappings and counters) across the
commands, so a test can cut and restore links between them.

Commands (``prompts`` are seeds; a prompt's tokens and KV follow from its seed):

- ``{"op": "put", "model": M, "prompts": [...], "tokens": N}``: put each prompt;
  answers ``{"stored": [seed, ...], "failed": [...], "elapsed_s": ...}``.
- ``{"op": "get", "model": M, "prompts": [...], "tokens": N}``: match and get each
  prompt, comparing every returned byte with what was put; answers per prompt
  ``{"seed", "state": hit|partial|miss|wrong, "tokens", "blocks", "ms"}``
  (``blocks``: per matched block, the ids of the servers holding its objects), the
  totals ``hits``, ``partial``, ``misses``, ``wrong``, and ``servers`` (each
  server's address and hostname as the meta gave them).
- ``{"op": "stats"}``: the client's counters (``bytes_read_shm``, ``bytes_read``,
  ``mapped_segments``, ``data_connections``, ...).
- ``{"op": "quit"}``.

Every answer carries ``elapsed_s`` and, when anything raised, ``error`` (the tests
require that none does: a cut-off server must be a miss, never an exception).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from gcache.config import ClientConfig
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from gcache_client.types import Namespace
from tests.kvdata import KV, make_kv, tiny_hybrid, tokens

FLAT = LayoutSpec(
    block_size=4,
    dtype="float16",
    layers=(LayerSpec("full", kv_heads=2, k_head_dim=8, v_head_dim=4),) * 2,
)


class Driver:
    def __init__(self, client: GCacheClient) -> None:
        self.client = client
        self.namespaces: dict[str, Namespace] = {}
        self.addrs: dict[str, dict[str, Any]] = {}  # server id -> address the meta gave

    def ns(self, model: str) -> Namespace:
        """``model`` names the namespace; one starting with ``flat`` has one layout
        group (a block is one object, on one server), any other the hybrid
        layout (a block is two objects, which may lie on two servers)."""
        if model not in self.namespaces:
            spec = FLAT if model.startswith("flat") else tiny_hybrid(block_size=4, window=8)
            self.namespaces[model] = self.client.register_namespace(model, spec)
        return self.namespaces[model]

    def put(self, cmd: dict[str, Any]) -> dict[str, Any]:
        ns, n = self.ns(cmd["model"]), int(cmd["tokens"])
        stored: list[int] = []
        failed: list[int] = []
        for seed in cmd["prompts"]:
            res = self.client.put(ns, tokens(n, seed), make_kv(ns.layout, n, seed))
            (stored if res.ok and res.blocks else failed).append(seed)
        return {"stored": stored, "failed": failed}

    def get(self, cmd: dict[str, Any]) -> dict[str, Any]:
        ns, n = self.ns(cmd["model"]), int(cmd["tokens"])
        full = n // ns.layout.block_size * ns.layout.block_size
        out = []
        for seed in cmd["prompts"]:
            t0 = time.monotonic()
            m = self.client.match(ns, tokens(n, seed))
            blocks = [
                sorted({m.servers[o.server].server_id for (b, _), o in m.objects.items() if b == i})
                for i in range(m.blocks)
            ]
            for a in m.servers:
                self.addrs[a.server_id] = {"host": a.host, "port": a.port, "hostname": a.hostname}
            state = "miss"
            if m.tokens:
                got = self.client.get(m)
                if got is not None:
                    ok = matches(got, make_kv(ns.layout, n, seed))
                    state = "wrong" if not ok else "hit" if m.tokens == full else "partial"
                self.client.release(m)
            out.append(
                {
                    "seed": seed,
                    "state": state,
                    "tokens": int(m.tokens),
                    "blocks": blocks,
                    "ms": round((time.monotonic() - t0) * 1000, 1),
                }
            )
        totals = {k: sum(1 for r in out if r["state"] == s) for k, s in _TOTALS}
        return {"prompts": out, **totals, "servers": self.addrs}


_TOTALS = (("hits", "hit"), ("partial", "partial"), ("misses", "miss"), ("wrong", "wrong"))


def matches(got: Any, kv: KV) -> bool:
    """Whether every returned layer holds exactly the rows it claims."""
    for layer in got:
        k, v = kv[layer.layer]
        rows = len(layer.k)
        if not np.array_equal(np.asarray(layer.k), k[layer.start : layer.start + rows]):
            return False
        if not np.array_equal(np.asarray(layer.v), v[layer.start : layer.start + rows]):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--meta", required=True, help="meta hot-path address (or etcd://...)")
    ap.add_argument("--meta-grpc", default="", help="meta gRPC address")
    ap.add_argument("--timeout-s", type=float, default=2.0)
    ap.add_argument("--transport", default="auto")
    args = ap.parse_args()
    kw: dict[str, Any] = {"meta": args.meta, "timeout_s": args.timeout_s}
    if args.meta_grpc:
        kw["meta_grpc"] = args.meta_grpc
    client = GCacheClient(ClientConfig(transport=args.transport, **kw))
    driver = Driver(client)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        t0 = time.monotonic()
        reply: dict[str, Any] = {"op": cmd["op"]}
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "put":
                reply.update(driver.put(cmd))
            elif cmd["op"] == "get":
                reply.update(driver.get(cmd))
            elif cmd["op"] == "stats":
                reply["stats"] = dict(client.stats())
            else:
                reply["error"] = f"unknown op {cmd['op']!r}"
        except Exception as exc:  # reported, and the tests fail on it
            reply["error"] = f"{type(exc).__name__}: {exc}"
        reply["elapsed_s"] = round(time.monotonic() - t0, 3)
        print(json.dumps(reply), flush=True)
    client.close()


if __name__ == "__main__":
    main()
