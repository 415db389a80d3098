"""The fused copy + checksum kernels (gcache/_native): the C extension and its
Python fallback give xxhash's own xxh3-64 of every unit, copy every byte, split
large calls across threads without changing a digest, and release the GIL."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import gcache._native as native
from gcache._native import fallback

try:
    from gcache._native import _dataplane
except ImportError:  # reported by test_the_extension_is_built
    _dataplane = None  # type: ignore[assignment]

IMPLS: list[Any] = [fallback] + ([_dataplane] if _dataplane is not None else [])
IDS = ["fallback"] + (["native"] if _dataplane is not None else [])


def reference(pieces: list[bytes], group: int) -> bytes:
    return b"".join(
        xxhash.xxh3_64(b"".join(pieces[u : u + group])).digest()
        for u in range(0, len(pieces), group)
    )


def random_pieces(rng: np.random.Generator, lens: list[int]) -> list[np.ndarray]:
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in lens]


def test_the_extension_is_built() -> None:
    """`make test` builds the extension (pip install -e .); only GCACHE_NATIVE=0
    selects the Python path."""
    if os.environ.get("GCACHE_NATIVE") == "0":
        assert not native.NATIVE
        pytest.skip("GCACHE_NATIVE=0: the Python path is selected")
    assert _dataplane is not None, "gcache._native._dataplane was not built"
    assert native.NATIVE


def test_gcache_native_0_selects_the_fallback() -> None:
    code = "import gcache._native as n; print(n.NATIVE)"
    env = {**os.environ, "GCACHE_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
@settings(max_examples=60, deadline=None)
@given(
    group=st.integers(1, 3),
    lens=st.lists(st.integers(0, 70_000), max_size=9),
    seed=st.integers(0, 2**32 - 1),
    hash_src=st.booleans(),
)
def test_copy_checksums_match_xxh3_of_each_unit(
    impl: Any, group: int, lens: list[int], seed: int, hash_src: bool
) -> None:
    lens = lens[: len(lens) - len(lens) % group]
    src = random_pieces(np.random.default_rng(seed), lens)
    dst = [np.zeros(n, np.uint8) for n in lens]
    want = reference([s.tobytes() for s in src], group)
    assert impl.checksums([memoryview(s) for s in src], group) == want
    got = impl.copy_checksums(
        [memoryview(d) for d in dst], [memoryview(s) for s in src], group, hash_src
    )
    assert got == want
    for s, d in zip(src, dst, strict=True):
        assert np.array_equal(s, d)


@pytest.mark.skipif(_dataplane is None, reason="extension not built")
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
def test_threads_split_units_without_changing_a_digest(threads: int) -> None:
    """Byte ranges split across threads cut units (and pieces) in the middle: the
    thread holding a unit's first byte finishes it after the others copied."""
    assert _dataplane is not None
    rng = np.random.default_rng(threads)
    # one unit of 17 MiB (split by every thread count), then small and empty units
    lens = [9 << 20, 8 << 20, 0, 0, 123, 4097, 3 << 20, 1, 5 << 20, 0]
    src = random_pieces(rng, lens)
    dst = [np.zeros(n, np.uint8) for n in lens]
    want = reference([s.tobytes() for s in src], 2)
    assert _dataplane.checksums([memoryview(s) for s in src], 2, threads=threads) == want
    got = _dataplane.copy_checksums(
        [memoryview(d) for d in dst], [memoryview(s) for s in src], 2, threads=threads
    )
    assert got == want
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))


@pytest.mark.skipif(_dataplane is None, reason="extension not built")
def test_a_read_hashes_the_bytes_it_delivers() -> None:
    """Hashing dst (the default) gives what the caller got; a copy into a buffer
    that aliases the source shows the difference from hashing src."""
    assert _dataplane is not None
    buf = np.arange(64, dtype=np.uint8)
    src, dst = memoryview(buf)[0:32], memoryview(buf)[16:48]  # overlap: dst changes src
    expect_dst = buf[0:32].tobytes()  # memcpy forward: dst gets src's original bytes
    got = _dataplane.copy_checksums([dst], [src], 1, threads=1)
    assert buf[16:48].tobytes() == expect_dst
    assert got == xxhash.xxh3_64(expect_dst).digest()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_bad_arguments_are_refused(impl: Any) -> None:
    a, b = bytearray(4), bytearray(5)
    with pytest.raises(ValueError):
        impl.copy_checksums([memoryview(a)], [memoryview(b)], 1)
    with pytest.raises(ValueError):
        impl.checksums([b"x", b"y", b"z"], 2)
    with pytest.raises(ValueError):
        impl.checksums([b"x"], 0)
    with pytest.raises(ValueError):
        impl.copy_checksums([memoryview(a)], [b"abcd", b"efgh"], 1)
    with pytest.raises((TypeError, BufferError, ValueError)):
        impl.copy_checksums([b"read-only"], [b"123456789"], 1)


@pytest.mark.skipif(_dataplane is None, reason="extension not built")
def test_crc32c_known_answer() -> None:
    """CRC32C is kept for the measurement in docs/performance.md (algo=1)."""
    assert _dataplane is not None
    pieces = [b"1234", b"", b"56789"]
    got = _dataplane.checksums(pieces, 3, algo=_dataplane.ALGO_CRC32C)
    assert int.from_bytes(got, "big") == 0xE3069283


@pytest.mark.skipif(_dataplane is None, reason="extension not built")
def test_the_gil_is_released_while_hashing() -> None:
    """Another Python thread runs during most of a long call: with the GIL held it
    could run only in the moments before the call entered C (a switch interval)."""
    assert _dataplane is not None
    block = memoryview(np.ones(16 << 20, np.uint8))
    span: list[float] = []
    done = threading.Event()

    def work() -> None:
        span.append(time.perf_counter())
        _dataplane.checksums([block] * 96, 1, threads=1)  # 1.5 GiB hashed
        span.append(time.perf_counter())
        done.set()

    seen: list[float] = []
    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        seen.append(time.perf_counter())
    t.join()
    enter, leave = span
    inside = [x for x in seen if enter < x < leave]
    assert leave - enter > 0.02
    assert inside and (max(inside) - min(inside)) > 0.5 * (leave - enter)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_set_threads_returns_the_previous_value(impl: Any) -> None:
    fn: Callable[[int], int] = impl.set_threads
    old = fn(3)
    try:
        assert fn(3) == 3
        with pytest.raises(ValueError):
            fn(0)
    finally:
        fn(old)


def test_the_package_api_is_xxh3() -> None:
    pieces = [b"abc", b"def"]
    assert native.CHECKSUM == "xxh3-64"
    assert native.checksums(pieces, 2) == xxhash.xxh3_64(b"abcdef").digest()
    assert native.verify(pieces, 2, xxhash.xxh3_64(b"abcdef").digest())
    assert not native.verify(pieces, 1, xxhash.xxh3_64(b"abcdef").digest() * 2)
    out = [bytearray(3), bytearray(3)]
    assert (
        native.copy_checksums([memoryview(o) for o in out], pieces, 2)
        == xxhash.xxh3_64(b"abcdef").digest()
    )
    assert bytes(out[0] + out[1]) == b"abcdef"


def _layer_case(
    seed: int, n: int = 40, kb: int = 1536, vb: int = 512, off: int = 256
) -> dict[str, Any]:
    """A segment holding ``n`` objects at scattered offsets, the layer's expected
    sums (layer 1 of 3 per object), and destination rows in a shuffled order."""
    rng = np.random.default_rng(seed)
    seg = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    obj = 4096
    offsets = np.sort(rng.choice(len(seg) // obj, n, replace=False)).astype(np.int64) * obj
    rows = rng.permutation(n).astype(np.int64)
    stride, li = 24, 1
    sums = bytearray(n * stride)
    for r, o in enumerate(offsets.tolist()):
        a = o + off
        sums[r * stride + 8 * li : r * stride + 8 * li + 8] = xxhash.xxh3_64(
            seg[a : a + kb + vb].tobytes()
        ).digest()
    return dict(seg=seg, offsets=offsets, rows=rows, sums=bytes(sums), stride=stride, li=li,
                off=off, kb=kb, vb=vb, n=n)  # fmt: skip


def _read_layer(impl: Any, c: dict[str, Any], kd: np.ndarray, vd: np.ndarray, **kw: Any) -> int:
    a = {**c, **kw}
    return int(
        impl.read_layer(
            a["seg"],
            kd,
            vd,
            a["offsets"],
            a["rows"],
            a["sums"],
            a["stride"],
            a["li"],
            a["off"],
            a["kb"],
            a["vb"],
        )
    )


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_read_layer_copies_every_block_to_its_row_and_verifies_it(impl: Any) -> None:
    c = _layer_case(1)
    kd, vd = np.zeros(c["n"] * c["kb"], np.uint8), np.zeros(c["n"] * c["vb"], np.uint8)
    assert _read_layer(impl, c, kd, vd) == -1
    kb, vb, off = c["kb"], c["vb"], c["off"]
    for o, row in zip(c["offsets"].tolist(), c["rows"].tolist(), strict=True):
        assert np.array_equal(kd[row * kb : (row + 1) * kb], c["seg"][o + off : o + off + kb])
        assert np.array_equal(
            vd[row * vb : (row + 1) * vb], c["seg"][o + off + kb : o + off + kb + vb]
        )


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
@pytest.mark.parametrize("where", ["k", "v"])
def test_read_layer_reports_the_first_block_with_a_wrong_byte(impl: Any, where: str) -> None:
    c = _layer_case(2)
    seg = c["seg"].copy()
    o = int(c["offsets"][17]) + c["off"] + (3 if where == "k" else c["kb"] + 5)
    seg[o] ^= 0x40  # block 17's K or V
    kd, vd = np.zeros(c["n"] * c["kb"], np.uint8), np.zeros(c["n"] * c["vb"], np.uint8)
    assert _read_layer(impl, c, kd, vd, seg=seg) == 17


@pytest.mark.skipif(_dataplane is None, reason="extension not built")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_layer_split_across_threads_keeps_every_digest(threads: int) -> None:
    """Blocks of 1.5 MiB, 12 of them: the kernel's threads cut blocks in the middle."""
    assert _dataplane is not None
    rng = np.random.default_rng(threads)
    n, kb, vb = 12, 1 << 20, 512 << 10
    seg = rng.integers(0, 256, n * (kb + vb) + 4096, dtype=np.uint8)
    offsets = np.arange(n, dtype=np.int64) * (kb + vb) + 4096
    rows = np.arange(n, dtype=np.int64)[::-1].copy()
    sums = b"".join(xxhash.xxh3_64(seg[o : o + kb + vb].tobytes()).digest() for o in offsets)
    kd, vd = np.zeros(n * kb, np.uint8), np.zeros(n * vb, np.uint8)
    got = _dataplane.read_layer(seg, kd, vd, offsets, rows, sums, 8, 0, 0, kb, vb, threads)
    assert got == -1
    assert np.array_equal(kd[(n - 1) * kb :], seg[4096 : 4096 + kb])


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_read_layer_refuses_ranges_outside_its_buffers_before_moving_a_byte(impl: Any) -> None:
    c = _layer_case(3)
    kd, vd = np.zeros(c["n"] * c["kb"], np.uint8), np.zeros(c["n"] * c["vb"], np.uint8)
    last = c["offsets"].copy()
    last[-1] = len(c["seg"]) - c["off"] - c["kb"] - c["vb"] + 1  # one byte past the segment
    with pytest.raises(ValueError):
        _read_layer(impl, c, kd, vd, offsets=last)
    rows = c["rows"].copy()
    rows[-1] = c["n"]  # one row past the destination
    with pytest.raises(ValueError):
        _read_layer(impl, c, kd, vd, rows=rows)
    with pytest.raises(ValueError):
        _read_layer(impl, c, kd, vd, rows=c["rows"][:-1])  # not one row per offset
    with pytest.raises(ValueError):
        _read_layer(impl, c, kd, vd, sums=c["sums"][:-1])  # a short checksum table
    assert not kd.any() and not vd.any()
