"""SWA checkpoints: the positional rule, the meta asking for them in PutPlaced,
and the wire fields staying compatible with old frames."""

from __future__ import annotations

import msgspec
import pytest

from gcache import keys, wire
from gcache.config import MetaConfig
from gcache.errors import E_BAD_REQUEST, Refusal
from gcache.layout import LayerSpec, Layout, LayoutSpec
from gcache.meta.core import MetaCore

WALL = 1.7e9
MB = 1 << 20


def spec(block_size: int = 4, window: int = 8) -> LayoutSpec:
    full = LayerSpec("full", kv_heads=1, k_head_dim=64, v_head_dim=64)
    swa = LayerSpec("swa", kv_heads=1, k_head_dim=64, v_head_dim=64, window=window)
    return LayoutSpec(block_size=block_size, dtype="float16", layers=(full, swa))


def make(**cfg: object) -> tuple[MetaCore, bytes]:
    cfg.setdefault("checkpoint_interval", 16)  # 4 blocks of 4 tokens
    core = MetaCore(MetaConfig(**cfg))  # type: ignore[arg-type]
    addr = wire.ServerAddr("s0", "127.0.0.1", 9000, "host", "/dev/shm/s0")
    core.register_server(addr, bytes(16), incarnation=1, capacity=16 * MB, now=0.0)
    return core, core.register_namespace({"model": "m"}, spec()).fingerprint


def begin(core: MetaCore, fp: bytes, toks: list[int], ckpt_from: int = -1) -> wire.PutPlaced:
    layout = core.namespaces[fp].layout
    ks = keys.block_keys(fp, toks, layout.block_size)
    return core.put_begin(
        wire.PutBegin(fp, ks, layout.groups_to_store(len(ks)), ckpt_from), 1.0, WALL
    )


def put(core: MetaCore, fp: bytes, toks: list[int], ckpt_from: int = 0) -> wire.PutPlaced:
    placed = begin(core, fp, toks, ckpt_from)
    if placed.placements:
        done = [(i, bytes(8)) for i in range(len(placed.placements))]
        core.put_commit(wire.PutCommit(placed.put_id, done), 1.0)
    return placed


def lookup(core: MetaCore, fp: bytes, toks: list[int]) -> int:
    ks = keys.block_keys(fp, toks, 4)
    return core.lookup(wire.Lookup(fp, ks), 2.0, WALL).blocks


# ---- the rule ------------------------------------------------------------------------


def test_checkpoint_positions() -> None:
    layout = Layout(spec())  # tail 2 blocks
    pos = layout.checkpoint_positions
    # A fresh prompt of 10 blocks, interval 4: the last multiple before the end.
    assert pos(10, 0, 0, 4, dense=False) == [8]
    assert pos(10, 0, 0, 4, dense=True) == [4, 8]
    # The end itself needs no checkpoint (the prompt's own window is there).
    assert pos(8, 0, 0, 4, dense=False) == []
    # A branch point inside the prompt, and nothing whose window the client lacks.
    assert pos(10, 5, 0, 4, dense=False) == [5, 8]
    assert pos(10, 5, 4, 4, dense=False) == [8]  # window of 5 starts at block 3 < 4
    assert pos(10, 5, 7, 4, dense=False) == []
    assert pos(10, 0, -1, 0, dense=True) == []
    assert layout.add_windows([1, 1, 1, 1, 3, 3], [2]) == [3, 3, 1, 1, 3, 3]


def test_plain_put_without_checkpoint_from_is_strict_o_w() -> None:
    core, fp = make()
    placed = begin(core, fp, list(range(40)), ckpt_from=-1)  # 10 blocks
    assert placed.checkpoints == []
    got = sorted((p.block, p.group) for p in placed.placements)
    assert got == sorted([(i, 0) for i in range(10)] + [(8, 1), (9, 1)])


def test_meta_asks_for_windows_the_client_can_save() -> None:
    core, fp = make(low_watermark=1e-9, high_watermark=0.9)
    put(core, fp, [5000 + t for t in range(4)])  # now above the low watermark: no dense
    placed = put(core, fp, list(range(40)), ckpt_from=0)
    assert placed.checkpoints == [8]
    swa = sorted(p.block for p in placed.placements if p.group == 1)
    assert swa == [6, 7, 8, 9]
    assert core.counters["checkpoints_placed"] == 1
    assert lookup(core, fp, list(range(32)) + [7] * 8) == 8
    # A second prompt branching off at block 5 asks for a window there, and a third
    # one sharing exactly those 5 blocks then resumes at 5.
    second = list(range(20)) + [900 + t for t in range(20)]
    assert put(core, fp, second, ckpt_from=0).checkpoints == [5, 8]
    assert lookup(core, fp, list(range(20)) + [555] * 8) == 5


def test_dense_checkpoints_only_below_the_low_watermark() -> None:
    core, fp = make()
    assert put(core, fp, list(range(44)), ckpt_from=0).checkpoints == [4, 8]
    core2, fp2 = make(low_watermark=1e-9, high_watermark=0.9)
    put(core2, fp2, [5000 + t for t in range(4)])
    assert put(core2, fp2, list(range(44)), ckpt_from=0).checkpoints == [8]


def test_complete_windows_are_not_asked_again_and_bad_values_refused() -> None:
    core, fp = make()
    put(core, fp, list(range(40)), ckpt_from=0)
    assert begin(core, fp, list(range(40)), ckpt_from=0).checkpoints == []
    with pytest.raises(Refusal) as e:
        begin(core, fp, list(range(40)), ckpt_from=11)
    assert e.value.code == E_BAD_REQUEST


def test_checkpoints_off() -> None:
    core, fp = make(checkpoint_interval=0)
    assert put(core, fp, list(range(40)), ckpt_from=0).checkpoints == []


# ---- wire compatibility ------------------------------------------------------------------


class OldPutBegin(msgspec.Struct, array_like=True):
    namespace: bytes
    keys: list[bytes]
    groups: list[int]


class OldPutPlaced(msgspec.Struct, array_like=True):
    put_id: int
    placements: list[wire.Placement]
    servers: list[wire.ServerAddr]
    no_space: int = 0


def test_old_frames_still_decode_and_new_ones_decode_in_old_peers() -> None:
    old = msgspec.msgpack.encode(OldPutBegin(b"n" * 16, [b"k" * 16], [1]))
    msg = wire.decode_body(wire.T_PUT_BEGIN, old)
    assert msg.checkpoint_from == -1
    new = msgspec.msgpack.encode(wire.PutPlaced(3, [], [], 0, [8, 16]))
    assert msgspec.msgpack.decode(new, type=OldPutPlaced).put_id == 3
    assert wire.decode_body(wire.T_PUT_PLACED, new).checkpoints == [8, 16]
