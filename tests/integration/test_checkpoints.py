"""SWA checkpoints end to end: the meta asks, the client saves the windows inside
the prompt, and a shorter prompt then matches there, with exact bytes."""

from __future__ import annotations

import numpy as np

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

SPEC = tiny_hybrid(block_size=16, window=32)  # window tail: 2 blocks
# The meta's default checkpoint interval is 512 tokens: 32 blocks of 16.


def counters(d: LocalDeployment) -> dict[str, float]:
    return dict(d.stats().counters)


def test_client_saves_requested_checkpoints(
    deployment: LocalDeployment, client: GCacheClient
) -> None:
    ns = client.register_namespace(f"ckpt-{client.config.transport}", SPEC)
    a = tokens(40 * 16, seed=31)  # 40 blocks: a checkpoint at 32, its window at the end
    a_kv = make_kv(ns.layout, len(a), seed=31)
    before = counters(deployment).get("checkpoints_placed", 0)
    r = client.put(ns, a, a_kv)
    assert r.ok and r.stored == 40 + 2 + 2 and r.deduped == 0
    assert counters(deployment)["checkpoints_placed"] == before + 1
    # A prompt that shares A's first 512 tokens and then differs resumes at 512.
    c = np.concatenate([a[:512], tokens(100, seed=32)])
    assert client.lookup(ns, c) == 512
    m = client.match(ns, c)
    assert m.tokens == 512
    assert_layers_match(client.get(m), a_kv)
    client.release(m)
    # The same prompt again: all stored; a complete checkpoint is not asked again.
    again = client.put(ns, a, a_kv)
    assert again.stored == 0 and again.deduped == 42


def test_trailing_rows_only_means_no_checkpoints(client: GCacheClient) -> None:
    ns = client.register_namespace(f"ckpt-tail-{client.config.transport}", SPEC)
    a = tokens(40 * 16, seed=41)
    kv = make_kv(ns.layout, len(a), seed=41)
    # Sliding layers hold only their last window (what an engine's cache keeps).
    trimmed = [
        (k[-32:], v[-32:]) if spec.kind == "swa" else (k, v)
        for (k, v), spec in zip(kv, SPEC.layers, strict=True)
    ]
    r = client.put(ns, a, trimmed)
    assert r.ok and r.stored == 40 + 2
    assert client.lookup(ns, np.concatenate([a[:512], tokens(100, seed=42)])) == 0
    assert client.lookup(ns, a) == 40 * 16
