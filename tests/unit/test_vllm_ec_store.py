"""The encoder-output format of gcache_client.engines.vllm.ec.store without a deployment:
settings, the header check, rows and key tokens (the store itself is tested
against real processes in tests/integration/test_vllm_ec.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gcache.errors import ConfigError
from gcache_client.engines.vllm.ec.store import (
    HEADER_BYTES,
    ECConfig,
    decode,
    encode_header,
    key_tokens,
    row_bytes,
    rows,
)


def test_config_defaults_and_client_fields() -> None:
    cfg = ECConfig.from_extra({"meta": "10.0.0.5:7700", "timeout_s": 1.5, "block_rows": 32})
    assert cfg.client.meta == "10.0.0.5:7700" and cfg.client.timeout_s == 1.5
    assert cfg.block_rows == 32 and cfg.store and not cfg.blocking_loads
    assert cfg.client.load_or_recompute is False  # no compute model for encoder outputs


def test_config_unknown_key_one_line() -> None:
    with pytest.raises(ConfigError, match=r"unknown GCache EC connector settings: \['blok_rows'\]"):
        ECConfig.from_extra({"blok_rows": 16})


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        ({"block_rows": 8}, "block_rows"),
        ({"max_staged_bytes": 0}, "max_staged_bytes"),
        ({"load_threads": 0}, "load_threads"),
        ({"load_wait_ms": -1}, "load_wait_ms"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_config_bad_values(extra: dict[str, object], what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        ECConfig.from_extra(extra)


def _blob(ident: str, t: torch.Tensor) -> np.ndarray:
    width = t.shape[-1]
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[t.dtype]
    total = rows(t.numel() // width, width, dtype, 16)
    buf = np.zeros(total * row_bytes(width, dtype), dtype=np.uint8)
    buf[:HEADER_BYTES] = np.frombuffer(encode_header(ident, t), dtype=np.uint8)
    n = t.numel() * t.element_size()
    buf[HEADER_BYTES : HEADER_BYTES + n] = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    return buf


def test_decode_round_trip_and_refusals() -> None:
    t = torch.randn(9, 24)
    buf = _blob("a", t)
    got = decode(buf, "a", "float32", 24, 9)
    assert got is not None and torch.equal(got, t)
    assert decode(buf, "b", "float32", 24, 9) is None  # another identifier's object
    assert decode(buf, "a", "float16", 24, 9) is None  # dtype
    assert decode(buf, "a", "float32", 12, 18) is None  # width
    assert decode(buf, "a", "float32", 24, 8) is None  # row count
    bad = buf.copy()
    bad[0] ^= 0xFF
    assert decode(bad, "a", "float32", 24, 9) is None  # magic
    assert decode(buf[: HEADER_BYTES + 10], "a", "float32", 24, 9) is None  # short


def test_bf16_and_odd_rows() -> None:
    t = torch.randn(3, 5, dtype=torch.float32).to(torch.bfloat16)  # 10-byte rows
    assert row_bytes(5, "bfloat16") == 10 and row_bytes(5, "uint8") == 6  # even
    got = decode(_blob("x", t), "x", "bfloat16", 5, 3)
    assert got is not None and torch.equal(got, t)


def test_rows_and_key_tokens() -> None:
    assert rows(8, 128, "float32", 16) == 16
    assert rows(576, 4096, "bfloat16", 16) == 592  # 577 rows of 8 KiB -> 37 blocks
    a = key_tokens("img", 8, 128, 16)
    assert a.dtype == np.int32 and len(a) == 16 and a[8] == 8 and a[9] == 128
    assert not np.array_equal(a, key_tokens("img2", 8, 128, 16))
    assert not np.array_equal(a, key_tokens("img", 9, 128, 16))
