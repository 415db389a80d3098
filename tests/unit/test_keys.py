"""Chained block keys and namespace fingerprints (gcache.keys).

Expected keys are recomputed here from the definition in DESIGN.md
(``key_i = xxh3_128(key_{i-1} || tokens_i as int32 LE || extra_i)``, ``key_{-1}`` =
namespace fingerprint) with ``struct``, independently of the implementation.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gcache.keys import KEY_SIZE, block_keys, fingerprint

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
FP = st.binary(min_size=16, max_size=16)


def reference_keys(
    fp: bytes, tokens: list[int], block_size: int, extras: list[bytes] | None = None
) -> list[bytes]:
    """The definition, one concatenated message per block."""
    keys = []
    prev = fp
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        msg = prev + struct.pack(f"<{block_size}i", *chunk)
        if extras is not None:
            msg += extras[i]
        prev = xxhash.xxh3_128_digest(msg)
        keys.append(prev)
    return keys


def test_known_vector_two_blocks() -> None:
    fp = bytes(range(16))
    tokens = [1, 2, 3, 4, -1, 0x7FFFFFFF, -(2**31), 7]
    k0 = xxhash.xxh3_128_digest(fp + b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0")
    k1 = xxhash.xxh3_128_digest(
        k0 + b"\xff\xff\xff\xff" + b"\xff\xff\xff\x7f" + b"\0\0\0\x80" + b"\x07\0\0\0"
    )
    assert block_keys(fp, tokens, 4) == [k0, k1]
    assert all(len(k) == KEY_SIZE == 16 for k in (k0, k1))


@settings(max_examples=60, deadline=None)
@given(
    fp=FP,
    tokens=st.lists(INT32, max_size=80),
    block_size=st.integers(min_value=1, max_value=9),
)
def test_matches_definition(fp: bytes, tokens: list[int], block_size: int) -> None:
    expected = reference_keys(fp, tokens, block_size)
    assert block_keys(fp, tokens, block_size) == expected
    # numpy input of another dtype gives the same keys
    assert block_keys(fp, np.array(tokens, dtype=np.int64), block_size) == expected


@settings(max_examples=60, deadline=None)
@given(fp=FP, data=st.data(), block_size=st.integers(min_value=1, max_value=6))
def test_matches_definition_with_extras(fp: bytes, data: st.DataObject, block_size: int) -> None:
    tokens = data.draw(st.lists(INT32, max_size=40))
    nblocks = len(tokens) // block_size
    extras = data.draw(st.lists(st.binary(max_size=24), min_size=nblocks, max_size=nblocks + 3))
    assert block_keys(fp, tokens, block_size, extras) == reference_keys(
        fp, tokens, block_size, extras
    )


@settings(max_examples=60, deadline=None)
@given(
    fp=FP,
    tokens=st.lists(st.integers(0, 200_000), max_size=60),
    block_size=st.integers(min_value=1, max_value=8),
    cut=st.integers(min_value=0, max_value=60),
)
def test_prefix_property(fp: bytes, tokens: list[int], block_size: int, cut: int) -> None:
    full = block_keys(fp, tokens, block_size)
    prefix = block_keys(fp, tokens[:cut], block_size)
    assert prefix == full[: len(prefix)]
    assert len(prefix) == min(cut, len(tokens)) // block_size


def test_partial_trailing_block_not_keyed() -> None:
    fp = b"\x11" * 16
    assert block_keys(fp, list(range(7)), 4) == block_keys(fp, list(range(4)), 4)
    assert len(block_keys(fp, list(range(7)), 4)) == 1
    assert block_keys(fp, list(range(3)), 4) == []
    assert block_keys(fp, [], 4) == []
    # the trailing tokens do not influence the keys at all
    assert block_keys(fp, [*range(4), 9, 9, 9], 4) == block_keys(fp, [*range(4), 1, 2, 3], 4)


@settings(max_examples=40, deadline=None)
@given(
    fp1=FP,
    fp2=FP,
    tokens=st.lists(st.integers(0, 1000), min_size=4, max_size=40),
)
def test_different_fingerprints_give_disjoint_keys(
    fp1: bytes, fp2: bytes, tokens: list[int]
) -> None:
    assume(fp1 != fp2)
    k1 = block_keys(fp1, tokens, 4)
    k2 = block_keys(fp2, tokens, 4)
    assert k1 and k2
    assert set(k1).isdisjoint(k2)


def test_one_token_change_changes_that_block_and_after() -> None:
    fp = b"\x05" * 16
    tokens = list(range(32))
    base = block_keys(fp, tokens, 8)
    changed = tokens.copy()
    changed[17] += 1  # block 2
    other = block_keys(fp, changed, 8)
    assert other[:2] == base[:2]
    assert all(a != b for a, b in zip(other[2:], base[2:], strict=True))


def test_extras_change_keys_from_that_block_on() -> None:
    fp = b"\x42" * 16
    tokens = list(range(40))
    none = block_keys(fp, tokens, 8)
    empty = block_keys(fp, tokens, 8, [b""] * 5)
    assert empty == none  # an empty extra adds nothing to the hashed bytes
    lora = block_keys(fp, tokens, 8, [b"", b"", b"lora-7", b"", b""])
    assert lora[:2] == none[:2]
    assert all(a != b for a, b in zip(lora[2:], none[2:], strict=True))
    # the changed key is exactly the definition's
    assert lora[2] == xxhash.xxh3_128_digest(
        none[1] + struct.pack("<8i", *range(16, 24)) + b"lora-7"
    )
    # two different extras in the same block give different keys
    other = block_keys(fp, tokens, 8, [b"", b"", b"lora-8", b"", b""])
    assert other[2] != lora[2]


def test_extras_longer_than_blocks_is_allowed() -> None:
    fp = b"\x01" * 16
    assert block_keys(fp, list(range(8)), 4, [b"a", b"b", b"c"]) == reference_keys(
        fp, list(range(8)), 4, [b"a", b"b"]
    )


@pytest.mark.parametrize("fp", [b"", b"\0" * 15, b"\0" * 17, b"\0" * 32])
def test_bad_fingerprint_length(fp: bytes) -> None:
    with pytest.raises(ValueError):
        block_keys(fp, [1, 2, 3, 4], 2)


@pytest.mark.parametrize("bs", [0, -1, -64])
def test_bad_block_size(bs: int) -> None:
    with pytest.raises(ValueError):
        block_keys(b"\0" * 16, [1, 2, 3, 4], bs)


def test_too_few_extras() -> None:
    with pytest.raises(ValueError):
        block_keys(b"\0" * 16, list(range(12)), 4, [b"x", b"y"])
    with pytest.raises(ValueError):
        block_keys(b"\0" * 16, list(range(4)), 4, [])


def test_fingerprint_is_xxh3_128_of_canonical_json() -> None:
    desc = {"model": "m", "tp": 2, "block_size": 64}
    canon = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
    assert canon == b'{"block_size":64,"model":"m","tp":2}'
    fp = fingerprint(desc)
    assert len(fp) == 16
    assert fp == xxhash.xxh3_128_digest(canon)


@settings(max_examples=40, deadline=None)
@given(
    d=st.dictionaries(
        st.text(max_size=8),
        st.one_of(st.integers(), st.text(max_size=8), st.booleans(), st.none()),
        max_size=8,
    ),
    seed=st.randoms(use_true_random=False),
)
def test_fingerprint_order_independent(d: dict[str, object], seed: object) -> None:
    items = list(d.items())
    seed.shuffle(items)  # type: ignore[attr-defined]
    shuffled = dict(items)
    assert fingerprint(shuffled) == fingerprint(d)
    nested_a = {"outer": d, "z": 1}
    nested_b = {"z": 1, "outer": shuffled}
    assert fingerprint(nested_a) == fingerprint(nested_b)


def test_fingerprint_distinguishes_values() -> None:
    base = {"model": "m", "revision": "r1", "tp_rank": 0, "cache_salt": ""}
    fps = {
        fingerprint(base),
        fingerprint({**base, "revision": "r2"}),
        fingerprint({**base, "tp_rank": 1}),
        fingerprint({**base, "cache_salt": "tenant"}),
    }
    assert len(fps) == 4
