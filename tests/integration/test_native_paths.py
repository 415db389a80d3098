"""The client's byte paths on the native kernels, against a real meta and
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


# ---- one native call per layer, read-ahead by bytes, layer order ----

NTOK = 64 * 8  # MiMo-V2-Flash, 8 blocks of 64: a full layer is 1.3 MB (a copy-thread job)


@pytest.fixture(params=["native", "python"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both kernels of the client's shared-memory read (GCACHE_NATIVE=0 selects the
    Python one; the client runs in this process, so the switch is the module's)."""
    import gcache._native as native

    if request.param == "python":
        monkeypatch.setattr(native, "NATIVE", False)
    elif not native.NATIVE:
        pytest.skip("native kernel not selected (GCACHE_NATIVE=0 or not built)")
    return str(request.param)


def _mimo(client: GCacheClient) -> tuple[object, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    ns = client.register_namespace(f"native-{uuid.uuid4()}", "mimo-v2-flash", block_size=64)
    kv = make_kv(ns.layout, NTOK, seed=9)
    toks = tokens(NTOK, seed=9)
    assert client.put(ns, toks, kv).ok
    return ns, toks, kv


def test_a_wrong_byte_is_a_miss_on_the_one_call_read_path(
    deployment: LocalDeployment, kernel: str
) -> None:
    """A byte flipped in the last block's part of full layer 5 (a copy-thread job,
    read by read_layer) makes get and get_layers misses, on both kernels."""
    c = GCacheClient(deployment.client_config(transport="shm", load_or_recompute=False))
    try:
        ns, toks, kv = _mimo(c)
        m = c.match(ns, toks)  # type: ignore[arg-type]
        layout = m.namespace.layout
        g = layout.layer_group[5]
        off, kb, _ = layout.layer_range(5)
        loc = m.objects[(m.blocks - 1, g)]
        shm = {s.server_id: s.shm_path for s in deployment.stats().servers}[
            m.servers[loc.server].server_id
        ]
        at = loc.grant.offset + off + kb + 7  # in V
        with open(shm, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
            mm[at] ^= 0x21
            try:
                assert c.get(m) is None
                with c.get_layers(m) as stream:
                    got = list(stream)
                assert not stream.ok and [x.layer for x in got] == list(range(5))
            finally:
                mm[at] ^= 0x21
        with c.get_layers(m) as stream:
            assert_layers_match(list(stream), kv)
        assert stream.ok
        c.release(m)
    finally:
        c.close()


def _guarded(
    kv: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]], list[slice]]:
    """Output buffers carved out of one array with 4 KiB of sentinel bytes around each."""
    guard = 4096
    sizes = [a.nbytes for kvp in kv for a in kvp]
    arena = np.full(sum(sizes) + guard * (len(sizes) + 1), 0xA5, np.uint8)
    out: list[np.ndarray] = []
    guards = [slice(0, guard)]
    pos = guard
    for kvp in kv:
        for a in kvp:
            out.append(arena[pos : pos + a.nbytes].view(a.dtype).reshape(a.shape))
            pos += a.nbytes
            guards.append(slice(pos, pos + guard))
            pos += guard
    return arena, [(out[2 * i], out[2 * i + 1]) for i in range(len(kv))], guards


def test_read_ahead_by_bytes_writes_only_into_the_callers_buffers(
    deployment: LocalDeployment, kernel: str
) -> None:
    """With layers_in_flight=1 the stream still reads ahead while the layers in
    flight fit layer_bytes_in_flight, and every byte it writes lands inside the
    caller's buffers (the sentinels around each are untouched)."""
    cfg = deployment.client_config(
        transport="shm", load_or_recompute=False, layers_in_flight=1,
        layer_bytes_in_flight=64 << 20,
    )  # fmt: skip
    c = GCacheClient(cfg)
    try:
        ns, toks, kv = _mimo(c)
        m = c.match(ns, toks)  # type: ignore[arg-type]
        layout = m.namespace.layout
        rows = [c.layer_rows(m, i) for i in range(layout.num_layers)]
        want = [(k[a : a + n], v[a : a + n]) for (k, v), (a, n) in zip(kv, rows, strict=True)]
        arena, out, guards = _guarded(want)
        with c.get_layers(m, out) as stream:
            first = next(stream)
            assert first.layer == 0
            assert stream._stream.started == layout.num_layers  # all 48 fit in 64 MiB
            rest = [first, *stream]
        assert stream.ok and len(rest) == layout.num_layers
        for (k, v), (wk, wv) in zip(out, want, strict=True):
            assert np.array_equal(k, wk) and np.array_equal(v, wv)
        assert all((arena[s] == 0xA5).all() for s in guards)
        c.release(m)
    finally:
        c.close()


def test_closing_a_stream_stops_its_read_ahead(deployment: LocalDeployment, kernel: str) -> None:
    """Once close() returns, no read of the stream writes into the caller's
    buffers: the layers not handed over keep what the caller put there after."""
    import time

    cfg = deployment.client_config(transport="shm", load_or_recompute=False)
    c = GCacheClient(cfg)
    try:
        ns, toks, kv = _mimo(c)
        m = c.match(ns, toks)  # type: ignore[arg-type]
        layout = m.namespace.layout
        rows = [c.layer_rows(m, i) for i in range(layout.num_layers)]
        out = [
            (np.zeros((n, *k.shape[1:]), k.dtype), np.zeros((n, *v.shape[1:]), v.dtype))
            for (k, v), (_, n) in zip(kv, rows, strict=True)
        ]
        stream = c.get_layers(m, out)
        assert next(stream).layer == 0
        assert stream._stream.started > 1  # reads were in flight
        stream.close()
        assert not stream._stream._tasks
        for k, v in out[1:]:
            k.fill(7)
            v.fill(7)
        time.sleep(0.3)
        assert all((k == 7).all() and (v == 7).all() for k, v in out[1:])
        assert list(stream) == []
        c.release(m)
    finally:
        c.close()


def test_a_misshaped_buffer_raises_through_the_sync_stream(bclient: GCacheClient) -> None:
    """Misuse still raises (LayoutError) through the sync stream's pump, and the
    stream ends after it."""
    from gcache.errors import LayoutError

    ns = bclient.register_namespace(f"native-{uuid.uuid4()}", "mimo-v2-flash", block_size=16)
    kv = make_kv(ns.layout, 64, seed=3)
    toks = tokens(64, seed=3)
    assert bclient.put(ns, toks, kv).ok
    m = bclient.match(ns, toks)
    out = [(np.zeros_like(k), np.zeros_like(v)) for k, v in kv]
    out[2] = (np.zeros((1, 1, 1), kv[2][0].dtype), out[2][1])  # layer 2's K is wrong
    with bclient.get_layers(m, out) as stream:
        assert [next(stream).layer, next(stream).layer] == [0, 1]
        with pytest.raises(LayoutError):
            next(stream)
        assert list(stream) == []
    bclient.release(m)


def test_a_match_is_planned_once_per_group(
    bclient: GCacheClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """get and get_layers plan each layout group's blocks once for all its layers
    (MiMo-V2-Flash: 48 layers, 2 groups), not once per layer."""
    from gcache_client import plans

    calls: list[int] = []
    real = plans.plan_group

    def counted(match: object, g: int, first_blk: int) -> object:
        calls.append(g)
        return real(match, g, first_blk)  # type: ignore[arg-type]

    monkeypatch.setattr(plans, "plan_group", counted)
    ns = bclient.register_namespace(f"native-{uuid.uuid4()}", "mimo-v2-flash", block_size=16)
    kv = make_kv(ns.layout, 64, seed=4)
    toks = tokens(64, seed=4)
    assert bclient.put(ns, toks, kv).ok
    m = bclient.match(ns, toks)
    assert_layers_match(bclient.get(m), kv)
    assert sorted(calls) == [0, 1]
    calls.clear()
    with bclient.get_layers(m) as stream:
        assert_layers_match(list(stream), kv)
    assert sorted(calls) == [0, 1]
    bclient.release(m)


def test_reads_start_when_the_stream_is_made(bclient: GCacheClient) -> None:
    """get_layers starts layer 0's read at once, before the caller asks for it."""
    import time

    ns = bclient.register_namespace(f"native-{uuid.uuid4()}", "mimo-v2-flash", block_size=16)
    kv = make_kv(ns.layout, 64, seed=6)
    toks = tokens(64, seed=6)
    assert bclient.put(ns, toks, kv).ok
    m = bclient.match(ns, toks)
    with bclient.get_layers(m) as stream:
        deadline = time.monotonic() + 10
        while stream._stream.started == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream._stream.started > 0  # before any next()
        assert_layers_match(list(stream), kv)
    assert stream.ok
    bclient.release(m)
