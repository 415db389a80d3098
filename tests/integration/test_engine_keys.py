"""The engine connectors' keys against a real deployment (meta + 2 servers): the
same token ids under another cache salt, LoRA identity, per-block extras
(multimodal / prompt-embedding hashes), tensor-parallel rank or pipeline stage
are other blocks; under the same key they are found. A namespace with a bad
identity is refused with one clear error and nothing registered."""

from __future__ import annotations

import numpy as np
import pytest

from gcache import layout as laymod
from gcache.cli.deploy import LocalDeployment
from gcache.errors import LayoutError
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from gcache_client.engines.vllm.core import (
    BridgeConfig,
    KVBridge,
    KVKey,
    match_to_wire,
    wire_namespace,
)
from tests.kvdata import make_kv, tokens

SPEC = LayoutSpec(block_size=16, dtype="float16", layers=(LayerSpec("full", 1, 64, 64),))
N = 64  # 4 blocks


def _bridge(d: LocalDeployment, name: str, **kw: object) -> KVBridge:
    cfg = BridgeConfig(client=d.client_config(transport="tcp"))
    return KVBridge(cfg, name, SPEC, **kw)  # type: ignore[arg-type]


def _store(b: KVBridge, toks: np.ndarray, key: KVKey) -> None:
    kv = make_kv(laymod.Layout(SPEC), len(toks))
    b.store_async(toks, kv, key)  # type: ignore[arg-type]
    b.flush(30)
    assert b.counters["store_errors"] == 0


def _hit(b: KVBridge, toks: np.ndarray, key: KVKey) -> int:
    m = b.match(toks[:-1], key)
    b.release(m)
    return int(m.tokens)


def test_salt_identity_and_extras_are_other_blocks(deployment: LocalDeployment) -> None:
    b = _bridge(deployment, "keys-model")
    try:
        toks = tokens(N + 1, seed=3)
        img1 = tuple(b"mm-1" if i == 0 else b"" for i in range(4))
        img2 = tuple(b"mm-2" if i == 0 else b"" for i in range(4))
        stored = [
            KVKey(),
            KVKey(salt="s1"),
            KVKey(identity="lora=a@00ff"),
            KVKey(extras=img1),
        ]
        for key in stored:
            _store(b, toks[:N], key)
        for key in stored:
            assert _hit(b, toks, key) == N, key  # its own: every stored block
        others = [
            KVKey(salt="s2"),
            KVKey(identity="lora=b@00ff"),
            KVKey(identity="lora=a@00fe"),  # same name, other weights
            KVKey(salt="s1", identity="lora=a@00ff"),
            KVKey(extras=img2),  # another image at the same position
        ]
        for key in others:
            assert _hit(b, toks, key) == 0, key
        # Extras only on a later block: the blocks before it are shared, after not.
        late = KVKey(extras=(b"", b"", b"mm-3", b""))
        assert _hit(b, toks, late) == 32
    finally:
        b.close()


def test_tensor_parallel_ranks_and_stages_are_separate_shards(
    deployment: LocalDeployment,
) -> None:
    r0 = _bridge(deployment, "keys-tp", tp_size=2, tp_rank=0)
    r1 = _bridge(deployment, "keys-tp", tp_size=2, tp_rank=1)
    s1 = _bridge(deployment, "keys-tp", tp_size=2, tp_rank=0, stage="pp=1/2")
    try:
        toks = tokens(N + 1, seed=4)
        _store(r0, toks[:N], KVKey())
        assert _hit(r0, toks, KVKey()) == N
        assert _hit(r1, toks, KVKey()) == 0  # rank 1 never reads rank 0's shard
        assert _hit(s1, toks, KVKey()) == 0  # nor stage 1 stage 0's
        # A match handed to another rank's worker names its namespace: the worker
        # sees it is not its own and matches its own shard instead (engines.vllm.worker).
        m = r0.match(toks[:-1], KVKey())
        try:
            assert wire_namespace(match_to_wire(m)) == r0.namespace().fingerprint
            assert wire_namespace(match_to_wire(m)) != r1.namespace().fingerprint
        finally:
            r0.release(m)
    finally:
        for b in (r0, r1, s1):
            b.close()


def test_too_few_extras_is_a_miss_not_an_exception(deployment: LocalDeployment) -> None:
    b = _bridge(deployment, "keys-short")
    try:
        toks = tokens(N + 1, seed=5)
        assert _hit(b, toks, KVKey(extras=(b"x",))) == 0
        assert b.counters["lookup_errors"] == 1
    finally:
        b.close()


def test_overlong_identity_is_refused(deployment: LocalDeployment) -> None:
    with GCacheClient(deployment.client_config()) as c:
        with pytest.raises(LayoutError, match="kv_identity of 2000 characters"):
            c.register_namespace("keys-bad", SPEC, kv_identity="x" * 2000)
        ns = c.register_namespace("keys-bad", SPEC, kv_identity="lora=a@1")
        plain = c.register_namespace("keys-bad", SPEC)
        assert ns.fingerprint != plain.fingerprint
