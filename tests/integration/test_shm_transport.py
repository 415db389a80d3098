"""The shared-memory data path: automatic selection, and the rules that keep a
client from handing an engine wrong KV when the bytes it maps are being freed
(the lease's end is checked like the server checks it on TCP; the checksum
catches what changes under a copy)."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gcache.cli.deploy import LocalDeployment
from gcache.errors import AccessDenied
from gcache.transport.shm import MappedSegment, now_ms
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

LAYOUT = tiny_hybrid(block_size=16, window=32)


@pytest.fixture(scope="module")
def short_lease(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    d = LocalDeployment(
        tmp_path_factory.mktemp("shm"),
        servers=1,
        capacity="8MiB",
        meta_args=["--lease-ttl-s", "2.5"],
    )
    d.start()
    yield d
    d.stop()


def _segment_path(d: LocalDeployment) -> str:
    return d.stats().servers[0].shm_path


def test_auto_maps_a_local_server_and_tcp_does_not(short_lease: LocalDeployment) -> None:
    toks = tokens(64, seed=1)
    for transport, expect_shm in (("auto", True), ("shm", True), ("tcp", False)):
        with GCacheClient(short_lease.client_config(transport=transport)) as c:
            ns = c.register_namespace("shm-auto", LAYOUT)
            kv = make_kv(ns.layout, len(toks), seed=1)
            assert c.put(ns, toks, kv).ok
            m = c.match(ns, toks)
            assert_layers_match(c.get(m), kv)
            c.release(m)
            assert (c.stats().get("bytes_read_shm", 0) > 0) == expect_shm, transport


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_read_after_the_lease_ended_and_the_range_was_reused_is_a_miss(
    short_lease: LocalDeployment, transport: str
) -> None:
    with GCacheClient(short_lease.client_config(transport=transport)) as c:
        ns = c.register_namespace(f"shm-expired-{transport}", LAYOUT)
        a = tokens(64, seed=10)
        a_kv = make_kv(ns.layout, len(a), seed=10)
        assert c.put(ns, a, a_kv).ok
        m = c.match(ns, a)
        assert m.tokens == 64
        # The lease ends; an admin eviction frees A, and B (same shape) takes its bytes.
        time.sleep(2.7)
        c.evict(ns, a, blocks=range(3, -1, -1), windows_only=False)
        assert c.lookup(ns, a) == 0
        b = tokens(64, seed=11)
        b_kv = make_kv(ns.layout, len(b), seed=11)
        assert c.put(ns, b, b_kv).ok
        before = c.stats()
        assert c.get(m) is None, "a read through an ended lease must be a miss"
        after = c.stats()
        assert after.get("remote_errors", 0) + after.get("integrity_errors", 0) > before.get(
            "remote_errors", 0
        ) + before.get("integrity_errors", 0)
        stream = c.get_layers(m)
        assert list(stream) == [] and not stream.ok
        # B, the new owner of the bytes, reads back exactly.
        mb = c.match(ns, b)
        assert_layers_match(c.get(mb), b_kv)
        c.release(mb)


def _scribble(path: str, offset: int, length: int, started: object, stop: object) -> None:
    """Another process reusing A's bytes while the client copies them."""
    rng = np.random.default_rng(0)
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        while True:
            mm[offset : offset + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
            started.set()  # type: ignore[attr-defined]
            if stop.is_set():  # type: ignore[attr-defined]
                return


def test_bytes_rewritten_during_shm_copies_never_reach_the_caller(
    short_lease: LocalDeployment,
) -> None:
    with GCacheClient(short_lease.client_config(transport="shm")) as c:
        ns = c.register_namespace("shm-race", LAYOUT)
        a = tokens(128, seed=20)
        a_kv = make_kv(ns.layout, len(a), seed=20)
        assert c.put(ns, a, a_kv).ok
        m = c.match(ns, a)
        assert_layers_match(c.get(m), a_kv)
        grants = [loc.grant for loc in m.objects.values()]
        lo = min(g.offset for g in grants)
        hi = max(g.offset + g.length for g in grants)
        ctx = mp.get_context("spawn")
        started, stop = ctx.Event(), ctx.Event()
        writer = ctx.Process(
            target=_scribble, args=(_segment_path(short_lease), lo, hi - lo, started, stop)
        )
        writer.start()
        assert started.wait(30), "scribbler did not start"
        c.release(m)
        results = []
        try:
            for _ in range(30):  # a fresh lease each time: the meta's is 2.5 s here
                m = c.match(ns, a)
                results.append(c.get(m))
                c.release(m)
        finally:
            stop.set()
            writer.join(10)
        for got in results:
            if got is not None:
                assert_layers_match(got, a_kv)
        m = c.match(ns, a)
        assert c.get(m) is None  # the bytes are garbage now: every read is a miss
        assert c.stats()["integrity_errors"] >= 1
        c.release(m)


def test_mapped_segment_refuses_expired_grants_and_foreign_ranges(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(bytes(4096))
    seg = MappedSegment(str(path))
    dest = memoryview(bytearray(16))
    future = now_ms() + 60_000
    with pytest.raises(AccessDenied, match="expired"):
        seg.read_leased([(0, 16)], [dest], now_ms() - 1)
    with pytest.raises(AccessDenied, match="outside"):
        seg.read_leased([(4090, 16)], [dest], future)
    with pytest.raises(AccessDenied, match="expired"):
        seg.write_granted(0, 16, now_ms() - 1, [memoryview(b"x" * 16)])
    with pytest.raises(AccessDenied, match="grant of 8"):
        seg.write_granted(0, 8, future, [memoryview(b"x" * 16)])
    assert path.read_bytes()[:16] == bytes(16), "refused writes change nothing"
    assert seg.write_granted(0, 16, future, [memoryview(b"y" * 16)]) == 16
    assert seg.read_leased([(0, 16)], [dest], future) == 16
    assert bytes(dest) == b"y" * 16
    seg.close()


def test_large_layers_are_copied_and_verified_off_the_loop(short_lease: LocalDeployment) -> None:
    """Layers of >= 1 MiB take the copy-thread path; reads stay exact, damaged
    bytes are still a miss, and a cancelled read leaves the client usable."""
    import asyncio

    from gcache.layout import LayerSpec, LayoutSpec
    from gcache_client import AsyncGCacheClient
    from gcache_client.aio import OFFLOAD_BYTES

    big = LayerSpec("full", kv_heads=8, k_head_dim=512, v_head_dim=512)
    spec = LayoutSpec(block_size=16, dtype="float16", layers=(big, big))
    toks = tokens(64, seed=40)

    async def scenario() -> None:
        async with AsyncGCacheClient(short_lease.client_config(transport="shm")) as c:
            ns = await c.register_namespace("shm-big", spec)
            kv = make_kv(ns.layout, len(toks), seed=40)
            assert kv[0][0].nbytes + kv[0][1].nbytes >= OFFLOAD_BYTES
            assert (await c.put(ns, toks, kv)).ok
            m = await c.match(ns, toks)
            assert_layers_match(await c.get(m), kv)
            layers = [layer async for layer in c.get_layers(m)]
            assert_layers_match(layers, kv)
            task = asyncio.create_task(c.get(m))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert_layers_match(await c.get(m), kv)
            loc = m.objects[(2, 0)]
            with open(_segment_path(short_lease), "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
                mm[loc.grant.offset + 7] ^= 0x55
                assert await c.get(m) is None
                mm[loc.grant.offset + 7] ^= 0x55
            await c.release(m)

    asyncio.run(scenario())


# ---- a tight tmpfs: clean refusals, never SIGBUS -----------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of our own (we run as root in CI). Skipped only where mount is
    not permitted and CI is not set; under CI=true that is a failure."""
    import os
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        msg = f"cannot mount a tmpfs: {r.stderr.strip()}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _used(mnt: Path) -> int:
    import os

    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_second_server_on_a_full_tmpfs_refuses_to_start_in_one_line(
    tmp_path: Path, tiny_tmpfs: Path
) -> None:
    """Two 40 MiB servers with --no-populate on a 64 MiB tmpfs: the second one used
    to start on a sparse file and die of SIGBUS (with its clients) once filled.
    Now its space is reserved at start: it refuses in one line, and the first
    server and its shared-memory clients fill their segment without a fault."""
    from gcache.errors import GCacheError

    d = LocalDeployment(
        tmp_path / "d",
        servers=1,
        capacity="40MiB",
        server_args=["--shm-dir", str(tiny_tmpfs), "--no-populate"],
    )
    with d:
        assert _used(tiny_tmpfs) >= 40 << 20, "the first server reserved its segment"
        with pytest.raises(GCacheError, match="exited with code 1"):
            d.start_server(1)
        log = (tmp_path / "d" / "server1.log").read_text()
        assert "does not fit" in log and "Traceback" not in log, log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert len(errors) == 1, log
        # Fill the first server's segment over shared memory: no SIGBUS anywhere.
        with GCacheClient(d.client_config(transport="shm")) as c:
            ns = c.register_namespace("tight-tmpfs", LAYOUT)
            for i in range(12):
                toks = tokens(256, seed=300 + i)
                kv = make_kv(ns.layout, len(toks), seed=300 + i)
                c.put(ns, toks, kv)
            toks = tokens(256, seed=400)
            kv = make_kv(ns.layout, len(toks), seed=400)
            assert c.put(ns, toks, kv).ok
            m = c.match(ns, toks)
            assert_layers_match(c.get(m), kv)
            c.release(m)
        assert d.servers[0].alive


_SPARSE_WRITER = """
import sys
from gcache.errors import GCacheError
from gcache.transport.shm import MappedSegment, now_ms
try:
    seg = MappedSegment(sys.argv[1])
    seg.write_granted(0, seg.size, now_ms() + 60_000, [memoryview(bytes(seg.size))])
except GCacheError as exc:
    print("refused:", exc)
"""


def test_shm_client_does_not_map_a_sparse_segment_and_never_dies_of_sigbus(
    tiny_tmpfs: Path,
) -> None:
    """A segment file larger than its tmpfs, not reserved (an older server, or one
    started with --no-reserve): copying into it used to kill the client with
    SIGBUS inside np.copyto. The client refuses to map it instead."""
    import os
    import subprocess
    import sys

    path = tiny_tmpfs / "gcache-sparse-1.seg"
    with open(path, "wb") as fh:
        fh.truncate(96 << 20)
    r = subprocess.run(
        [sys.executable, "-c", _SPARSE_WRITER, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ},
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "refused:" in r.stdout and "not fully allocated" in r.stdout, r.stdout
