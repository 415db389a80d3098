"""put -> lookup -> get / get_layers returns byte-identical KV, against real daemons."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gcache.cli.deploy import LocalDeployment
from gcache_client import AsyncGCacheClient, GCacheClient
from tests.kvdata import make_kv, tiny_hybrid, tokens


def check_layer(kv, layer) -> None:  # type: ignore[no-untyped-def]
    k, v = kv[layer.layer]
    n = len(layer.k)
    assert n > 0
    assert np.array_equal(np.asarray(layer.k), k[layer.start : layer.start + n])
    assert np.array_equal(np.asarray(layer.v), v[layer.start : layer.start + n])


@pytest.mark.parametrize(
    ("preset", "block_size", "ntokens"),
    [
        ("mimo-v2-flash", 16, 16 * 9 + 7),
        ("mimo-v2-flash", 64, 64 * 3),
        ("llama-3-8b", 16, 16 * 6 + 3),
    ],
)
def test_put_lookup_get_layers_identical(
    client: GCacheClient, preset: str, block_size: int, ntokens: int
) -> None:
    ns = client.register_namespace(
        f"rt-{preset}-{client.config.transport}", preset, block_size=block_size
    )
    layout = ns.layout
    kv = make_kv(layout, ntokens, seed=block_size)
    toks = tokens(ntokens, seed=block_size)
    res = client.put(ns, toks, kv)
    nblocks = ntokens // block_size
    assert res.ok and res.blocks == nblocks
    assert res.bytes_written == layout.stored_bytes(nblocks)
    assert client.lookup(ns, toks) == nblocks * block_size
    m = client.match(ns, toks)
    assert m.tokens == nblocks * block_size
    seen = []
    with client.get_layers(m) as stream:
        for layer in stream:
            check_layer(kv, layer)
            first, count = client.layer_rows(m, layer.layer)
            assert (layer.start, len(layer.k)) == (first, count)
            seen.append(layer.layer)
    assert stream.ok
    assert seen == list(range(layout.num_layers))
    client.release(m)
    # The data really went the configured way.
    mapped = client.stats()["mapped_segments"]
    assert bool(mapped) == (client.config.transport == "shm")


def test_get_into_caller_buffers(client: GCacheClient) -> None:
    ns = client.register_namespace(f"rt-buffers-{client.config.transport}", tiny_hybrid())
    kv = make_kv(ns.layout, 37, seed=3)
    toks = tokens(37, seed=3)
    assert client.put(ns, toks, kv).ok
    m = client.match(ns, toks)
    assert m.tokens == 36
    out = []
    for i, spec in enumerate(ns.layout.spec.layers):
        _, n = client.layer_rows(m, i)
        out.append(
            (
                np.zeros((n, spec.kv_heads, spec.k_head_dim), np.float16),
                np.zeros((n, spec.kv_heads, spec.v_head_dim), np.float16),
            )
        )
    got = client.get(m, out)
    assert got is not None
    for layer, (k_out, v_out) in zip(got, out, strict=True):
        assert layer.k is k_out and layer.v is v_out
        check_layer(kv, layer)
    client.release(m)


def test_torch_tensors_in_and_out(deployment: LocalDeployment) -> None:
    torch = pytest.importorskip("torch")
    with GCacheClient(deployment.client_config(), as_torch=True) as c:
        ns = c.register_namespace("rt-torch", "mimo-v2-flash", block_size=16)
        g = torch.Generator().manual_seed(0)
        kv_t = [
            (
                torch.randn(48, s.kv_heads, s.k_head_dim, generator=g).to(torch.bfloat16),
                torch.randn(48, s.kv_heads, s.v_head_dim, generator=g).to(torch.bfloat16),
            )
            for s in ns.layout.spec.layers
        ]
        toks = tokens(48, seed=9)
        assert c.put(ns, toks, kv_t).ok
        m = c.match(ns, toks)
        layers = c.get(m)
        assert layers is not None
        for layer in layers:
            assert layer.k.dtype == torch.bfloat16
            k, v = kv_t[layer.layer]
            assert torch.equal(layer.k, k[layer.start : layer.start + len(layer.k)])
            assert torch.equal(layer.v, v[layer.start : layer.start + len(layer.v)])
        c.release(m)


def test_async_client_roundtrip(deployment: LocalDeployment) -> None:
    async def main() -> None:
        async with AsyncGCacheClient(deployment.client_config(), layers_in_flight=2) as c:
            ns = await c.register_namespace("rt-async", tiny_hybrid(block_size=8, window=20))
            kv = make_kv(ns.layout, 80, seed=5)
            toks = tokens(80, seed=5)
            assert (await c.put(ns, toks, kv)).ok
            assert await c.lookup(ns, toks) == 80
            m = await c.match(ns, toks)
            stream = c.get_layers(m)
            n = 0
            async for layer in stream:
                check_layer(kv, layer)
                n += 1
            assert stream.ok and n == 4
            await c.release(m)

    asyncio.run(main())


def test_sliding_layers_may_pass_only_the_window(client: GCacheClient) -> None:
    spec = tiny_hybrid(block_size=4, window=8)
    ns = client.register_namespace(f"rt-window-only-{client.config.transport}", spec)
    kv = make_kv(ns.layout, 40, seed=11)
    # Sliding layers hand over only their last 12 rows, as a windowed cache holds them.
    trimmed = [
        (k[-12:], v[-12:]) if s.kind == "swa" else (k, v)
        for (k, v), s in zip(kv, spec.layers, strict=True)
    ]
    toks = tokens(40, seed=11)
    assert client.put(ns, toks, trimmed).ok
    m = client.match(ns, toks)
    got = client.get(m)
    assert got is not None and m.tokens == 40
    for layer in got:
        check_layer(kv, layer)
    client.release(m)
