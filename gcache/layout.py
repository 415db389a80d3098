"""Layout specs, layer groups, byte offsets and the SWA-aware valid-match rule.

The spec is the only description of where bytes lie. A block has at most one
*object* per layer group (all ``full`` layers, or all ``swa`` layers of one
window). Inside an object the group's layers follow in model order, each as the
block's K (``[block_size, kv_heads, k_head_dim]``) then V
(``[block_size, kv_heads, v_head_dim]``), row-major, in the spec's dtype.

Windows: a sliding layer of window ``W`` lets a token see itself and the ``W - 1``
tokens before it (the convention of transformers and vLLM). A match ending at
block ``P`` therefore needs the windowed rows ``[P * block_size - (W - 1),
P * block_size)``, which lie in the ``tail = ceil((W - 1) / block_size)`` blocks
before ``P``. Any ``W >= 1`` works with any block size: when ``block_size`` does
not divide ``W - 1`` the window is stored rounded up to whole blocks
(``window_rows`` rows, up to ``block_size - 1`` more than an engine's own
sliding cache keeps), so a connector must keep those extra rows until it stores
them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from importlib import resources
from typing import Any, Final

import msgspec

from gcache.errors import LayoutError

DTYPE_SIZES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
MAX_LAYERS: Final = 1024
MAX_BLOCK_SIZE: Final = 4096


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str  # "full" or "swa"
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int = 0  # tokens, swa only


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_size: int
    dtype: str
    layers: tuple[LayerSpec, ...]


def validate(spec: LayoutSpec) -> None:
    """Raise :class:`LayoutError` naming the first thing wrong with ``spec``."""
    if not 0 < spec.block_size <= MAX_BLOCK_SIZE:
        raise LayoutError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {spec.block_size}")
    if spec.dtype not in DTYPE_SIZES:
        raise LayoutError(f"unknown dtype {spec.dtype!r}; known: {sorted(DTYPE_SIZES)}")
    if not 0 < len(spec.layers) <= MAX_LAYERS:
        raise LayoutError(f"a layout needs 1..{MAX_LAYERS} layers, got {len(spec.layers)}")
    for i, layer in enumerate(spec.layers):
        if layer.kind not in ("full", "swa"):
            raise LayoutError(f"layer {i}: kind must be 'full' or 'swa', got {layer.kind!r}")
        if layer.kind == "swa" and layer.window <= 0:
            raise LayoutError(f"layer {i}: swa layer needs a positive window")
        if layer.kind == "full" and layer.window != 0:
            raise LayoutError(f"layer {i}: full layer cannot have a window")
        for name in ("kv_heads", "k_head_dim", "v_head_dim"):
            if not 0 < getattr(layer, name) <= 65536:
                raise LayoutError(f"layer {i}: {name} must be in 1..65536")


class Layout:
    """Everything derived from a :class:`LayoutSpec`, computed once."""

    __slots__ = (
        "block_size",
        "dtype",
        "dtype_size",
        "group_layer_bytes",
        "group_layers",
        "group_names",
        "group_object_bytes",
        "group_tail_blocks",
        "group_windows",
        "layer_group",
        "layer_k_bytes",
        "layer_offset",
        "layer_v_bytes",
        "num_layers",
        "spec",
    )

    def __init__(self, spec: LayoutSpec) -> None:
        validate(spec)
        self.spec = spec
        self.block_size = spec.block_size
        self.dtype = spec.dtype
        self.dtype_size = DTYPE_SIZES[spec.dtype]
        self.num_layers = len(spec.layers)
        windows = sorted({layer.window for layer in spec.layers})  # 0 (= full) first
        self.group_windows: list[int] = windows
        self.group_names = ["full" if w == 0 else f"swa{w}" for w in windows]
        self.group_layers: list[list[int]] = [[] for _ in windows]
        self.layer_group: list[int] = []
        self.layer_k_bytes: list[int] = []
        self.layer_v_bytes: list[int] = []
        self.layer_offset: list[int] = []
        group_fill = [0] * len(windows)
        bs, ds = spec.block_size, self.dtype_size
        for i, layer in enumerate(spec.layers):
            g = windows.index(layer.window)
            self.group_layers[g].append(i)
            self.layer_group.append(g)
            kb = bs * layer.kv_heads * layer.k_head_dim * ds
            vb = bs * layer.kv_heads * layer.v_head_dim * ds
            self.layer_k_bytes.append(kb)
            self.layer_v_bytes.append(vb)
            self.layer_offset.append(group_fill[g])
            group_fill[g] += kb + vb
        self.group_object_bytes: list[int] = group_fill
        # Each layer's byte length (K then V) of each group's object, or () when
        # they are all equal: what an object's record carries (``layer_bytes``) so
        # its server can split it into the layers its checksums cover.
        self.group_layer_bytes: list[tuple[int, ...]] = []
        for layers in self.group_layers:
            sizes = tuple(self.layer_k_bytes[i] + self.layer_v_bytes[i] for i in layers)
            self.group_layer_bytes.append(sizes if len(set(sizes)) > 1 else ())
        # Blocks before the match end whose group object must be present: all of
        # them for full attention (None), ceil((W-1)/block_size) for a window W.
        self.group_tail_blocks: list[int | None] = [
            None if w == 0 else math.ceil((w - 1) / bs) for w in windows
        ]

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def max_tail(self) -> int:
        """The longest windowed tail in blocks (0 without sliding layers)."""
        return max((t for t in self.group_tail_blocks if t is not None), default=0)

    def window_rows(self, group: int) -> int | None:
        """Rows a window of ``group`` is stored with: ``tail * block_size``, which
        is ``>= W - 1`` (the rows a match needs) and less than ``W - 1 +
        block_size``; ``None`` for a full group (every row)."""
        tail = self.group_tail_blocks[group]
        return None if tail is None else tail * self.block_size

    def window_blocks(self, group: int, end: int) -> range:
        """Blocks whose ``group`` object a match ending at block ``end`` needs (every
        block before it for a full group)."""
        tail = self.group_tail_blocks[group]
        return range(0 if tail is None else max(0, end - tail), end)

    def groups_to_store(self, nblocks: int) -> list[int]:
        """Strict O(W): bitmask of groups to store for each block of a P-block prefix."""
        masks = [0] * nblocks
        for g in range(self.num_groups):
            bit = 1 << g
            for i in self.window_blocks(g, nblocks):
                masks[i] |= bit
        return masks

    def checkpoint_positions(
        self,
        nblocks: int,
        branch: int,
        first: int,
        interval: int,
        dense: bool,
        *,
        last: bool = False,
    ) -> list[int]:
        """The checkpoint rule: block positions inside a prompt of ``nblocks`` blocks
        where an extra window is worth saving, given that its first ``branch``
        blocks are cached and the client holds windowed rows from block ``first``
        (so only positions whose whole window lies there):

        * ``branch``, where the prompt leaves the cached tree: the next prompt that
          shares exactly this prefix resumes there;
        * the last multiple of ``interval`` blocks before the end: a follow-up turn
          re-sends the prompt with its ending changed (chat template, a partial
          last block), so it shares a prefix that stops shortly before the end;
        * with ``dense`` (free space nothing would be evicted for), every multiple
          of ``interval`` between the two;
        * with ``last``, ``nblocks - 1``, the last block boundary before the end:
          the same prompt sent again (a retry, a regenerated answer) must compute
          at least its last token, so when it ends on a block boundary its match
          ends one block early, where only this window lets it resume.

        ``interval <= 0`` turns the first three off (``last`` stays)."""
        tail = self.max_tail
        if nblocks <= 0 or not tail:
            return []
        lo = max(first, 0) + tail
        out: list[int] = []
        if interval > 0:
            if lo <= branch < nblocks:
                out.append(branch)
            at = nblocks // interval * interval
            if dense:
                step = max(lo, branch + 1)
                out.extend(range(-(-step // interval) * interval, at, interval))
            if lo <= at < nblocks and at != branch:
                out.append(at)
        if last and lo <= nblocks - 1 and nblocks - 1 not in out:
            out.append(nblocks - 1)
        return out

    def add_windows(self, masks: list[int], positions: list[int]) -> list[int]:
        """``masks`` (from :meth:`groups_to_store`) plus the windowed objects of a
        match ending at each of ``positions``."""
        out = list(masks)
        n = len(out)
        windowed = [g for g, t in enumerate(self.group_tail_blocks) if t is not None]
        for c in positions:
            for g in windowed:
                for j in self.window_blocks(g, c):
                    if j < n:
                        out[j] |= 1 << g
        return out

    def stored_bytes(self, nblocks: int) -> int:
        """Bytes strict O(W) stores for a prompt of ``nblocks`` full blocks."""
        total = 0
        for g in range(self.num_groups):
            total += len(self.window_blocks(g, nblocks)) * self.group_object_bytes[g]
        return total

    def layer_range(self, layer: int) -> tuple[int, int, int]:
        """(offset in its group's object, K bytes, V bytes) of ``layer`` for one block."""
        return self.layer_offset[layer], self.layer_k_bytes[layer], self.layer_v_bytes[layer]

    def valid_match(self, full_blocks: int, has: Callable[[int, int], bool]) -> int:
        """Longest valid match P (blocks) given that blocks ``[0, full_blocks)`` have
        their full object and ``has(block, group)`` tells if a windowed group object
        is present. Every group with a window must be present on the last
        ``tail`` blocks before P (fewer when P is shorter than that)."""
        windowed = [g for g, t in enumerate(self.group_tail_blocks) if t is not None]
        p = full_blocks
        while p > 0:
            bad = -1
            for g in windowed:
                for j in reversed(self.window_blocks(g, p)):
                    if not has(j, g):
                        bad = max(bad, j)
                        break
            if bad < 0:
                return p
            p = bad
        return 0


def spec_from_dict(data: dict[str, Any]) -> LayoutSpec:
    """Build a spec from either the explicit form (``block_size``, ``dtype``,
    ``layers``) or the compact preset form of ``docs/layouts/*.json``."""
    try:
        if "layers" in data:
            return msgspec.convert(data, LayoutSpec)
        n = int(data["num_layers"])
        full_at = data.get("full_attention_layers", "all")
        full_set = set(range(n)) if full_at == "all" else {int(i) for i in full_at}
        layers = []
        for i in range(n):
            kind = "full" if i in full_set else "swa"
            heads = data[kind]
            layers.append(
                LayerSpec(
                    kind=kind,
                    kv_heads=int(heads["kv_heads"]),
                    k_head_dim=int(heads["k_head_dim"]),
                    v_head_dim=int(heads["v_head_dim"]),
                    window=0 if kind == "full" else int(data["sliding_window"]),
                )
            )
        return LayoutSpec(
            block_size=int(data.get("block_size", 64)),
            dtype=str(data["dtype"]),
            layers=tuple(layers),
        )
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
        raise LayoutError(f"invalid layout description: {exc}") from exc


PRESETS: Final = ("mimo-v2-flash", "llama-3-8b")


def preset(name: str, block_size: int = 64) -> LayoutSpec:
    """A built-in layout: ``mimo-v2-flash`` (hybrid SWA) or ``llama-3-8b`` (full)."""
    if name not in PRESETS:
        raise LayoutError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    text = resources.files("gcache.presets").joinpath(f"{name}.json").read_text()
    data = json.loads(text)
    data["block_size"] = block_size
    spec = spec_from_dict(data)
    validate(spec)
    return spec


def encode_spec(spec: LayoutSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(raw: bytes | str) -> LayoutSpec:
    try:
        spec = msgspec.json.decode(raw, type=LayoutSpec)
    except msgspec.DecodeError as exc:
        raise LayoutError(f"invalid layout spec: {exc}") from exc
    validate(spec)
    return spec
