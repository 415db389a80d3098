"""Layouts whose layers in one group differ in size survive restarts.

A real gcache-meta and gcache-server; a namespace whose full-attention layers
have 2 and 1 KV heads (and so do its sliding-window layers). Prompts are put,
reach the server's manifest, then both processes are killed with SIGKILL and
started again: the server re-adopts its segment by checking each object's layers
against their checksums. Before the records carried per-layer lengths
(``StoredObject.layer_bytes``) the server split every object into equal layers,
every check failed and every prompt was a miss after the restart.
"""

from __future__ import annotations

import time
from pathlib import Path

from gcache.cli.deploy import LocalDeployment
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tokens

PROMPTS = 12
NTOK = 4 * 6 + 1  # 6 blocks of 4 tokens


def uneven() -> LayoutSpec:
    big = LayerSpec("full", kv_heads=2, k_head_dim=8, v_head_dim=4)
    small = LayerSpec("full", kv_heads=1, k_head_dim=8, v_head_dim=8)
    swa_big = LayerSpec("swa", kv_heads=2, k_head_dim=8, v_head_dim=4, window=8)
    swa_small = LayerSpec("swa", kv_heads=1, k_head_dim=4, v_head_dim=4, window=8)
    return LayoutSpec(block_size=4, dtype="float16", layers=(big, swa_big, small, swa_small, big))


def test_unequal_layers_are_hits_after_kill9_of_server_and_meta(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=1, capacity="64MiB", keep_segments=False) as d:
        d.start()
        client = GCacheClient(d.client_config(timeout_s=2.0))
        ns = client.register_namespace("uneven-layers", uneven())
        layout = ns.layout
        sizes = [layout.layer_k_bytes[i] + layout.layer_v_bytes[i] for i in layout.group_layers[0]]
        assert len(set(sizes)) > 1, "the full group's layers differ in size"
        prompts = [tokens(NTOK, seed=s) for s in range(PROMPTS)]
        kvs = [make_kv(layout, NTOK, seed=s) for s in range(PROMPTS)]
        for toks, kv in zip(prompts, kvs, strict=True):
            assert client.put(ns, toks, kv).ok
        want = [client.lookup(ns, t) for t in prompts]
        assert all(want)
        time.sleep(2.0)  # heartbeat replies: every commit is in the manifest
        client.close()

        d.kill_server(0)  # SIGKILL
        d.restart_meta()  # SIGKILL, a new meta on the same ports
        d.start_server(0)
        d.wait_servers(1)

        client = GCacheClient(d.client_config(timeout_s=2.0))
        ns = client.register_namespace("uneven-layers", uneven())
        deadline = time.monotonic() + 10.0
        got = [0] * PROMPTS
        while time.monotonic() < deadline:
            got = [client.lookup(ns, t) for t in prompts]
            if got == want:
                break
            time.sleep(0.1)
        assert got == want, f"hits after the restart: {got}, before: {want}"
        for toks, kv in zip(prompts, kvs, strict=True):
            m = client.match(ns, toks)
            assert_layers_match(client.get(m), kv)
            client.release(m)
        stats = d.stats()
        assert stats.counters["report_invalid"] == 0
        log = (tmp_path / "server0.log").read_text()
        readopt = [ln for ln in log.splitlines() if "re-adopted segment" in ln]
        assert readopt and " 0 dropped" in readopt[-1], readopt
        client.close()
