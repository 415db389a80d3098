"""Namespace fingerprints and chained block keys.

``key_i = xxh3_128(key_{i-1} || tokens_i as int32 little-endian || extra_i)`` with
``key_{-1}`` the namespace fingerprint (DESIGN.md). Only full blocks are keyed; a
key is 16 bytes. Because keys chain, a key names the whole prefix up to its block,
so the meta matches a prompt with one hash-map probe per block.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

KEY_SIZE = 16


def fingerprint(descriptor: dict[str, Any]) -> bytes:
    """Hash of everything that must match for KV to be reusable (canonical JSON)."""
    canon = json.dumps(descriptor, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_digest(canon)


def block_keys(
    namespace_fp: bytes,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Chained keys of every *full* block of ``tokens``.

    ``extras[i]`` (LoRA id, multimodal content hashes) is mixed into block ``i``.
    """
    if len(namespace_fp) != KEY_SIZE:
        raise ValueError(f"namespace fingerprint must be {KEY_SIZE} bytes")
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = np.ascontiguousarray(tokens, dtype="<i4")
    nblocks = len(arr) // block_size
    if extras is not None and len(extras) < nblocks:
        raise ValueError("extras must have one entry per full block")
    raw = arr[: nblocks * block_size].tobytes()
    stride = block_size * 4
    keys: list[bytes] = []
    prev = namespace_fp
    h = xxhash.xxh3_128()
    for i in range(nblocks):
        h.reset()
        h.update(prev)
        h.update(raw[i * stride : (i + 1) * stride])
        if extras is not None:
            h.update(extras[i])
        prev = h.digest()
        keys.append(prev)
    return keys
