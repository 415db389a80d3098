"""Layout specs, byte offsets, strict O(W) storage and the valid-match rule
(gcache.layout). Expected values are computed here from DESIGN.md, not by calling
the implementation twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.errors import LayoutError
from gcache.layout import (
    DTYPE_SIZES,
    LayerSpec,
    Layout,
    LayoutSpec,
    decode_spec,
    encode_spec,
    preset,
    spec_from_dict,
    validate,
)

MIMO_FULL = {0, 5, 11, 17, 23, 29, 35, 41, 47}
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- strategies ------------------------------------------------------------------


@st.composite
def layer_specs(draw: st.DrawFn, windows: list[int]) -> LayerSpec:
    window = draw(st.sampled_from([0, *windows]))
    return LayerSpec(
        kind="full" if window == 0 else "swa",
        kv_heads=draw(st.integers(1, 16)),
        k_head_dim=draw(st.integers(1, 300)),
        v_head_dim=draw(st.integers(1, 300)),
        window=window,
    )


@st.composite
def layout_specs(draw: st.DrawFn, max_windows: int = 3) -> LayoutSpec:
    windows = draw(st.lists(st.integers(1, 700), min_size=0, max_size=max_windows, unique=True))
    layers = draw(st.lists(layer_specs(windows), min_size=1, max_size=14))
    return LayoutSpec(
        block_size=draw(st.integers(1, 256)),
        dtype=draw(st.sampled_from(sorted(DTYPE_BYTES))),
        layers=tuple(layers),
    )


@st.composite
def windowed_layouts(draw: st.DrawFn) -> LayoutSpec:
    """1 or 2 distinct windows, each used by at least one layer, with or without
    full layers, and block sizes small enough that tails span several blocks."""
    nwin = draw(st.integers(1, 2))
    windows = draw(st.lists(st.integers(1, 80), min_size=nwin, max_size=nwin, unique=True))
    with_full = draw(st.booleans())
    kinds = list(windows) + ([0] if with_full else [])
    extra = draw(st.lists(st.sampled_from(kinds), max_size=4))
    order = draw(st.permutations(kinds + extra))
    layers = tuple(
        LayerSpec(
            kind="full" if w == 0 else "swa", kv_heads=1, k_head_dim=2, v_head_dim=3, window=w
        )
        for w in order
    )
    return LayoutSpec(block_size=draw(st.integers(1, 24)), dtype="bfloat16", layers=layers)


# ---- presets ---------------------------------------------------------------------


def test_dtype_table() -> None:
    assert DTYPE_SIZES == DTYPE_BYTES


def test_mimo_preset_spec() -> None:
    spec = preset("mimo-v2-flash")
    assert spec.block_size == 64
    assert spec.dtype == "bfloat16"
    assert len(spec.layers) == 48
    assert {i for i, layer in enumerate(spec.layers) if layer.kind == "full"} == MIMO_FULL
    for i, layer in enumerate(spec.layers):
        if i in MIMO_FULL:
            assert layer == LayerSpec("full", 4, 192, 128, 0)
        else:
            assert layer == LayerSpec("swa", 8, 192, 128, 128)


def test_mimo_layout_block64() -> None:
    lay = Layout(preset("mimo-v2-flash"))
    assert lay.num_layers == 48
    assert lay.num_groups == 2
    assert lay.group_windows == [0, 128]
    assert lay.group_names == ["full", "swa128"]
    assert lay.group_layers[0] == sorted(MIMO_FULL)
    assert lay.group_layers[1] == [i for i in range(48) if i not in MIMO_FULL]
    assert lay.group_object_bytes == [9 * 64 * 2560, 39 * 64 * 5120]
    assert lay.group_tail_blocks == [None, 2]  # ceil(127 / 64)
    # byte ranges: full layer 5 is the second full layer, swa layer 2 the second swa
    assert lay.layer_range(0) == (0, 64 * 4 * 192 * 2, 64 * 4 * 128 * 2)
    assert lay.layer_range(5) == (64 * 2560, 64 * 4 * 192 * 2, 64 * 4 * 128 * 2)
    assert lay.layer_range(1) == (0, 64 * 8 * 192 * 2, 64 * 8 * 128 * 2)
    assert lay.layer_range(2) == (64 * 5120, 64 * 8 * 192 * 2, 64 * 8 * 128 * 2)
    assert lay.layer_range(47)[0] == 8 * 64 * 2560
    assert lay.layer_range(46)[0] == 38 * 64 * 5120
    # strict O(W): full for all blocks, swa for the last 2
    assert lay.groups_to_store(5) == [1, 1, 1, 3, 3]
    assert lay.groups_to_store(1) == [3]
    assert lay.groups_to_store(0) == []
    assert lay.stored_bytes(10) == 10 * 9 * 64 * 2560 + 2 * 39 * 64 * 5120
    assert lay.stored_bytes(1) == 9 * 64 * 2560 + 39 * 64 * 5120
    assert lay.stored_bytes(0) == 0


def test_mimo_layout_block16() -> None:
    lay = Layout(preset("mimo-v2-flash", block_size=16))
    assert lay.block_size == 16
    assert lay.group_tail_blocks == [None, 8]  # ceil(127 / 16)
    assert lay.group_object_bytes == [9 * 16 * 2560, 39 * 16 * 5120]


def test_llama_preset() -> None:
    spec = preset("llama-3-8b")
    assert len(spec.layers) == 32
    assert all(layer == LayerSpec("full", 8, 128, 128, 0) for layer in spec.layers)
    lay = Layout(spec)
    assert lay.num_groups == 1
    assert lay.group_names == ["full"]
    assert lay.group_tail_blocks == [None]
    assert lay.group_object_bytes == [64 * 131072]  # 131,072 B a token
    assert lay.groups_to_store(4) == [1, 1, 1, 1]
    assert lay.stored_bytes(4) == 4 * 64 * 131072
    assert lay.valid_match(7, lambda j, g: False) == 7  # no windowed group


def test_unknown_preset() -> None:
    with pytest.raises(LayoutError):
        preset("nope")


# ---- random specs: offsets, groups, storage ----------------------------------------


@settings(max_examples=80, deadline=None)
@given(spec=layout_specs())
def test_offsets_tile_each_group_object(spec: LayoutSpec) -> None:
    lay = Layout(spec)
    bs, ds = spec.block_size, DTYPE_BYTES[spec.dtype]
    windows = sorted({layer.window for layer in spec.layers})
    assert lay.group_windows == windows
    assert lay.num_groups == len(windows)
    for g, w in enumerate(windows):
        members = [i for i, layer in enumerate(spec.layers) if layer.window == w]
        assert lay.group_layers[g] == members
        assert all(lay.layer_group[i] == g for i in members)
        pos = 0
        for i in members:  # layer order, K then V, no gap, no overlap
            layer = spec.layers[i]
            off, kb, vb = lay.layer_range(i)
            assert kb == bs * layer.kv_heads * layer.k_head_dim * ds
            assert vb == bs * layer.kv_heads * layer.v_head_dim * ds
            assert off == pos
            pos += kb + vb
        assert lay.group_object_bytes[g] == pos
        expected_tail = None if w == 0 else ceil_div(w - 1, bs)
        assert lay.group_tail_blocks[g] == expected_tail


@settings(max_examples=80, deadline=None)
@given(spec=layout_specs(), n=st.integers(0, 40))
def test_groups_to_store_and_stored_bytes(spec: LayoutSpec, n: int) -> None:
    lay = Layout(spec)
    bs = spec.block_size
    masks = lay.groups_to_store(n)
    assert len(masks) == n
    for i, mask in enumerate(masks):
        for g, w in enumerate(lay.group_windows):
            wanted = w == 0 or i >= n - ceil_div(w - 1, bs)
            assert bool(mask >> g & 1) == wanted, (i, g, w)
        assert mask >> lay.num_groups == 0
    total = sum(
        lay.group_object_bytes[g] for mask in masks for g in range(lay.num_groups) if mask >> g & 1
    )
    assert lay.stored_bytes(n) == total


# ---- valid match -------------------------------------------------------------------


def brute_valid_match(
    windows: list[int], block_size: int, full_blocks: int, present: list[list[bool]]
) -> int:
    """DESIGN.md's rule, literally: the longest P <= full_blocks such that for every
    windowed group g, every block j in [max(0, P - tail_g), P) has g's object."""
    for p in range(full_blocks, 0, -1):
        ok = True
        for g, w in enumerate(windows):
            if w == 0:
                continue
            tail = ceil_div(w - 1, block_size)
            if not all(present[j][g] for j in range(max(0, p - tail), p)):
                ok = False
                break
        if ok:
            return p
    return 0


def _has(lay: Layout, full_blocks: int, present: list[list[bool]]) -> Callable[[int, int], bool]:
    def has(j: int, g: int) -> bool:
        assert 0 <= j < full_blocks, j
        assert lay.group_tail_blocks[g] is not None, "asked about a full group"
        return present[j][g]

    return has


@settings(max_examples=300, deadline=None)
@given(spec=windowed_layouts(), data=st.data())
def test_valid_match_against_brute_force(spec: LayoutSpec, data: st.DataObject) -> None:
    lay = Layout(spec)
    full_blocks = data.draw(st.integers(0, 30), label="full_blocks")
    g = lay.num_groups
    present = data.draw(
        st.lists(
            st.lists(st.booleans(), min_size=g, max_size=g),
            min_size=full_blocks,
            max_size=full_blocks,
        ),
        label="present",
    )
    expected = brute_valid_match(lay.group_windows, spec.block_size, full_blocks, present)
    assert lay.valid_match(full_blocks, _has(lay, full_blocks, present)) == expected


@settings(max_examples=200, deadline=None)
@given(
    spec=windowed_layouts(),
    full_blocks=st.integers(0, 40),
    holes=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 2)), max_size=6),
)
def test_valid_match_sparse_holes(
    spec: LayoutSpec, full_blocks: int, holes: list[tuple[int, int]]
) -> None:
    """Mostly-present matrices with a few holes (the realistic case: tombstones)."""
    lay = Layout(spec)
    present = [[True] * lay.num_groups for _ in range(full_blocks)]
    for j, g in holes:
        if j < full_blocks and g < lay.num_groups:
            present[j][g] = False
    expected = brute_valid_match(lay.group_windows, spec.block_size, full_blocks, present)
    assert lay.valid_match(full_blocks, _has(lay, full_blocks, present)) == expected


@settings(max_examples=60, deadline=None)
@given(spec=windowed_layouts(), n=st.integers(0, 30))
def test_strict_ow_store_is_a_valid_match(spec: LayoutSpec, n: int) -> None:
    """What groups_to_store keeps for an n-block put matches exactly n blocks."""
    lay = Layout(spec)
    masks = lay.groups_to_store(n)
    present = [[bool(m >> g & 1) for g in range(lay.num_groups)] for m in masks]
    assert lay.valid_match(n, _has(lay, n, present)) == n


def _mimo_has(blocks: set[int]) -> Callable[[int, int], bool]:
    return lambda j, g: j in blocks


def test_valid_match_mimo_examples() -> None:
    lay = Layout(preset("mimo-v2-flash"))  # tail 2 blocks for swa (group 1)
    assert lay.valid_match(0, _mimo_has(set())) == 0
    assert lay.valid_match(10, _mimo_has({8, 9})) == 10
    assert lay.valid_match(10, _mimo_has({7, 8})) == 9
    assert lay.valid_match(10, _mimo_has({3, 4, 9})) == 5
    assert lay.valid_match(10, _mimo_has(set())) == 0
    assert lay.valid_match(10, _mimo_has({0})) == 1  # P=1 needs only block 0
    assert lay.valid_match(10, _mimo_has({1})) == 0  # P=2 needs blocks 0 and 1
    assert lay.valid_match(3, _mimo_has(set(range(100)))) == 3


# ---- validation ----------------------------------------------------------------------


def _spec(**kw: Any) -> LayoutSpec:
    base: dict[str, Any] = {
        "block_size": 16,
        "dtype": "bfloat16",
        "layers": (LayerSpec("full", 1, 2, 2), LayerSpec("swa", 1, 2, 2, 8)),
    }
    base.update(kw)
    return LayoutSpec(**base)


@pytest.mark.parametrize(
    "spec",
    [
        _spec(dtype="float64"),
        _spec(dtype=""),
        _spec(block_size=0),
        _spec(block_size=-16),
        _spec(block_size=4097),
        _spec(layers=()),
        _spec(layers=(LayerSpec("swa", 1, 2, 2),)),  # swa without window
        _spec(layers=(LayerSpec("swa", 1, 2, 2, -4),)),
        _spec(layers=(LayerSpec("full", 1, 2, 2, 128),)),  # full with window
        _spec(layers=(LayerSpec("mla", 1, 2, 2),)),  # unknown kind
        _spec(layers=(LayerSpec("full", 0, 2, 2),)),
        _spec(layers=(LayerSpec("full", 1, 0, 2),)),
        _spec(layers=(LayerSpec("full", 1, 2, 0),)),
        _spec(layers=(LayerSpec("full", 1, 2, 65537),)),
        _spec(layers=(LayerSpec("full", 1, 2, 2),) * 1025),
    ],
)
def test_invalid_specs_raise(spec: LayoutSpec) -> None:
    with pytest.raises(LayoutError):
        validate(spec)
    with pytest.raises(LayoutError):
        Layout(spec)
    with pytest.raises(LayoutError):
        decode_spec(encode_spec(spec))


def test_valid_limits_accepted() -> None:
    Layout(_spec(block_size=4096))
    Layout(_spec(layers=(LayerSpec("full", 65536, 1, 1),)))
    Layout(_spec(layers=(LayerSpec("swa", 1, 1, 1, 1),) * 1024))


MIMO_COMPACT = {
    "dtype": "bfloat16",
    "num_layers": 4,
    "full_attention_layers": [0, 3],
    "sliding_window": 128,
    "full": {"kv_heads": 4, "k_head_dim": 192, "v_head_dim": 128},
    "swa": {"kv_heads": 8, "k_head_dim": 192, "v_head_dim": 128},
}


def test_spec_from_dict_compact() -> None:
    spec = spec_from_dict({**MIMO_COMPACT, "block_size": 32})
    assert spec.block_size == 32
    assert [layer.kind for layer in spec.layers] == ["full", "swa", "swa", "full"]
    assert spec.layers[1] == LayerSpec("swa", 8, 192, 128, 128)
    assert spec_from_dict(MIMO_COMPACT).block_size == 64  # default


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize(
    "data",
    [
        {},
        _without(MIMO_COMPACT, "dtype"),
        _without(MIMO_COMPACT, "num_layers"),
        _without(MIMO_COMPACT, "sliding_window"),
        _without(MIMO_COMPACT, "swa"),
        _without(MIMO_COMPACT, "full"),
        {**MIMO_COMPACT, "full": {"kv_heads": 4, "k_head_dim": 192}},
        {**MIMO_COMPACT, "num_layers": "many"},
        {
            "block_size": 16,
            "layers": [{"kind": "full", "kv_heads": 1, "k_head_dim": 2, "v_head_dim": 2}],
        },  # explicit form, no dtype
        {"block_size": 16, "dtype": "bfloat16", "layers": [{"kind": "full"}]},
        {"block_size": 16, "dtype": "bfloat16", "layers": "nope"},
    ],
)
def test_spec_from_dict_missing_or_bad_keys(data: dict[str, Any]) -> None:
    with pytest.raises(LayoutError):
        spec_from_dict(data)


@settings(max_examples=60, deadline=None)
@given(spec=layout_specs())
def test_encode_decode_round_trip(spec: LayoutSpec) -> None:
    raw = encode_spec(spec)
    assert isinstance(raw, bytes)
    assert decode_spec(raw) == spec
    assert decode_spec(raw.decode()) == spec
    # the explicit dict form goes through spec_from_dict unchanged too
    assert spec_from_dict(msgspec.to_builtins(spec)) == spec


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[]",
        b'{"block_size": 16, "dtype": "bfloat16"}',
        b'{"block_size": 16, "dtype": "bfloat16", "layers": [], "extra": 1}',
        b'{"block_size": "16", "dtype": "bfloat16", "layers": []}',
    ],
)
def test_decode_spec_rejects_garbage(raw: bytes) -> None:
    with pytest.raises(LayoutError):
        decode_spec(raw)


# ---- any window with any block size (rounded up to whole blocks) -------------------


def _one_window(window: int, block_size: int) -> Layout:
    layers = (LayerSpec("full", 1, 2, 2), LayerSpec("swa", 1, 2, 2, window))
    return Layout(LayoutSpec(block_size=block_size, dtype="float16", layers=layers))


@settings(max_examples=400, deadline=None)
@given(window=st.integers(1, 5000), block_size=st.integers(1, 512), end=st.integers(0, 60))
def test_any_window_any_block_size_against_brute_force(
    window: int, block_size: int, end: int
) -> None:
    """The blocks a match ending at block ``end`` needs are exactly the blocks that
    hold a row its first computed token can see (itself and the W - 1 rows before
    it), found here row by row; the stored window is those blocks, rounded up to
    whole blocks, never short of W - 1 rows and never a whole block too long."""
    lay = _one_window(window, block_size)
    p = end * block_size  # the first token the engine computes
    seen = range(max(0, p - (window - 1)), p)
    assert sorted({r // block_size for r in seen}) == list(lay.window_blocks(1, end))
    rows = lay.window_rows(1)
    assert rows is not None and rows >= window - 1
    assert rows - block_size < window - 1 or rows == 0
    assert lay.window_rows(0) is None
    assert lay.window_blocks(0, end) == range(end)
    assert (
        lay.stored_bytes(end)
        == end * lay.group_object_bytes[0]
        + min(end, rows // block_size) * lay.group_object_bytes[1]
    )


def test_engine_windows_that_block_size_does_not_divide() -> None:
    # vLLM on CPU: 128-token blocks, window 128 -> one block (127 rows needed).
    assert _one_window(128, 128).group_tail_blocks == [None, 1]
    # window 128 with 64-token blocks: 127 rows -> 2 blocks, 128 rows stored.
    assert _one_window(128, 64).window_rows(1) == 128
    # window 4096 (Gemma/Mistral-like) with 16-token blocks: 4095 rows -> 256 blocks.
    assert _one_window(4096, 16).group_tail_blocks == [None, 256]
    # window 1: a token sees only itself, no windowed rows at all.
    assert _one_window(1, 64).group_tail_blocks == [None, 0]
    assert _one_window(1, 64).valid_match(5, lambda j, g: False) == 5


def brute_checkpoints(
    tail: int, nblocks: int, branch: int, first: int, interval: int, dense: bool, last: bool
) -> set[int]:
    """The checkpoint rule as the docstring states it, position by position."""
    out = set()
    at = nblocks // interval * interval if interval > 0 else -1
    for c in range(nblocks):
        if c < max(first, 0) + tail:  # its window starts before the rows held
            continue
        if interval > 0 and (
            c in (branch, at) or (dense and c % interval == 0 and branch < c < at)
        ):
            out.add(c)
        if last and c == nblocks - 1:
            out.add(c)
    return out


@settings(max_examples=400, deadline=None)
@given(
    spec=windowed_layouts(),
    nblocks=st.integers(0, 40),
    branch=st.integers(0, 40),
    first=st.integers(-1, 40),
    interval=st.integers(0, 9),
    dense=st.booleans(),
    last=st.booleans(),
)
def test_checkpoint_positions_against_brute_force(
    spec: LayoutSpec,
    nblocks: int,
    branch: int,
    first: int,
    interval: int,
    dense: bool,
    last: bool,
) -> None:
    lay = Layout(spec)
    got = lay.checkpoint_positions(nblocks, branch, first, interval, dense, last=last)
    assert len(got) == len(set(got))
    tail = max((t for t in lay.group_tail_blocks if t is not None), default=0)
    want = brute_checkpoints(tail, nblocks, branch, first, interval, dense, last) if tail else set()
    assert set(got) == want
    # Every position asked for is a point a later match can end at, once the put
    # stores strict O(W) plus those windows.
    masks = lay.add_windows(lay.groups_to_store(nblocks), got)
    present = [[bool(m >> g & 1) for g in range(lay.num_groups)] for m in masks]
    for c in [*got, nblocks]:
        if c:
            assert lay.valid_match(c, _has(lay, c, present)) == c


@settings(max_examples=200, deadline=None)
@given(window=st.integers(2, 600), block_size=st.integers(1, 128), nblocks=st.integers(1, 30))
def test_same_prompt_twice_resumes_one_block_early(
    window: int, block_size: int, nblocks: int
) -> None:
    """A block-aligned prompt sent again matches its tokens but the last one, so
    ``nblocks - 1`` full blocks: with ``last`` that match is valid, without it
    only when the end window already covers that point."""
    lay = _one_window(window, block_size)
    tail = lay.group_tail_blocks[1]
    assert tail is not None
    pos = lay.checkpoint_positions(nblocks, 0, 0, 0, False, last=True)
    masks = lay.add_windows(lay.groups_to_store(nblocks), pos)
    present = [[bool(m >> g & 1) for g in range(2)] for m in masks]
    assert lay.valid_match(nblocks - 1, _has(lay, nblocks - 1, present)) == nblocks - 1
    # What it costs: at most one windowed object more than strict O(W).
    strict = lay.groups_to_store(nblocks)
    extra = sum(bin(a).count("1") - bin(b).count("1") for a, b in zip(masks, strict, strict=True))
    assert extra == (1 if nblocks > tail else 0)
