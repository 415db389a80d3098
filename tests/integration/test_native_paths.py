"""The client's byte paths on the native kernels (issue 12), against a real meta and
servers, over TCP and shared memory: puts checksum (and over shared memory copy)
with ``copy_checksums``/``checksums``, reads verify with them, and objects large
enough to be split across the kernel's threads come back byte-exact, or as a miss
when one byte in the part another thread copied is wrong.

The matches here turn off load-or-recompute: these tests are about the bytes, not
about whether this machine's measured bandwidths make a load worth it."""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from gcache.benchtool.ops import raw_kv, raw_layout
from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tokens

BIG = 16 << 20  # one object: K 8 MiB then V 8 MiB, split across the kernel's threads


@pytest.fixture(params=["tcp", "shm"])
def bclient(deployment: LocalDeployment, request: pytest.FixtureRequest) -> Iterator[GCacheClient]:
    c = GCacheClient(deployment.client_config(transport=request.param, load_or_recompute=False))
    yield c
    c.close()


def _big(client: GCacheClient) -> tuple[object, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    ns = client.register_namespace(f"native-{uuid.uuid4()}", raw_layout(BIG))
    toks = np.arange(2, dtype=np.int64)  # two one-token blocks: two 16 MiB objects
    kv = raw_kv(ns.layout.spec, 2)
    res = client.put(ns, toks, kv)
    assert res.ok and res.stored == 2
    return ns, toks, kv


def test_large_objects_come_back_byte_exact(bclient: GCacheClient) -> None:
    ns, toks, kv = _big(bclient)
    m = bclient.match(ns, toks)  # type: ignore[arg-type]
    assert m.blocks == 2
    out = [(np.zeros_like(kv[0][0]), np.zeros_like(kv[0][1]))]
    got = bclient.get(m, out)
    assert got is not None
    assert np.array_equal(out[0][0], kv[0][0]) and np.array_equal(out[0][1], kv[0][1])
    with bclient.get_layers(m) as stream:
        assert_layers_match(list(stream), kv)
    assert stream.ok
    bclient.release(m)


def test_a_wrong_byte_in_a_large_object_is_a_miss(
    deployment: LocalDeployment, bclient: GCacheClient
) -> None:
    """The byte sits in V, 12 MiB into the object: with two threads the second one
    copies it, and the first finishes the object's checksum over it."""
    ns, toks, kv = _big(bclient)
    m = bclient.match(ns, toks)  # type: ignore[arg-type]
    loc = m.objects[(1, 0)]
    shm = {s.server_id: s.shm_path for s in deployment.stats().servers}[
        m.servers[loc.server].server_id
    ]
    at = loc.grant.offset + (12 << 20)
    with open(shm, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        mm[at] ^= 0x5A
        try:
            before = bclient.stats().get("integrity_errors", 0)
            assert bclient.get(m) is None
            assert bclient.stats()["integrity_errors"] == before + 1
            stream = bclient.get_layers(m)
            assert list(stream) == [] and not stream.ok
        finally:
            mm[at] ^= 0x5A
    got = bclient.get(m)
    assert got is not None
    assert np.array_equal(np.asarray(got[0].v), kv[0][1])
    bclient.release(m)


@pytest.mark.parametrize(("preset", "block_size", "ntokens"), [("mimo-v2-flash", 16, 16 * 9 + 7)])
def test_a_hybrid_model_round_trips_layer_by_layer(
    bclient: GCacheClient, preset: str, block_size: int, ntokens: int
) -> None:
    ns = bclient.register_namespace(f"native-{uuid.uuid4()}", preset, block_size=block_size)
    kv = make_kv(ns.layout, ntokens, seed=5)
    toks = tokens(ntokens, seed=5)
    assert bclient.put(ns, toks, kv).ok
    m = bclient.match(ns, toks)
    assert m.tokens == ntokens // block_size * block_size
    with bclient.get_layers(m) as stream:
        assert_layers_match(list(stream), kv)
    assert stream.ok
    assert_layers_match(bclient.get(m), kv)
    bclient.release(m)
