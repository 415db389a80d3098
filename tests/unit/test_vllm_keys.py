"""Keys of the engine connectors that need no engine: LoRA adapter fingerprints,
per-block extras, the namespace a wired match names."""

from __future__ import annotations

from pathlib import Path

import pytest

from gcache import layout as laymod
from gcache.errors import ConfigError, LayoutError
from gcache_client.engines.vllm.core import (
    PLAIN,
    BridgeConfig,
    KVKey,
    match_from_wire,
    match_to_wire,
    wire_namespace,
)
from gcache_client.engines.vllm.keys import AdapterFingerprints, Unkeyable
from gcache_client.types import Match, Namespace


def _adapter(root: Path, weights: bytes) -> Path:
    root.mkdir()
    (root / "adapter_config.json").write_text('{"r": 8}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def test_adapter_fingerprint_follows_the_files_not_the_path(tmp_path: Path) -> None:
    fps = AdapterFingerprints(capacity=2)
    a = _adapter(tmp_path / "a", b"\1" * 1000)
    a_copy = _adapter(tmp_path / "elsewhere", b"\1" * 1000)
    b = _adapter(tmp_path / "b", b"\2" * 1000)
    assert fps(str(a)) == fps(str(a_copy))  # one adapter mounted at two paths
    assert fps(str(a)) != fps(str(b))  # same size, other weights
    before = fps(str(a))
    (a / "adapter_model.safetensors").write_bytes(b"\3" * 1001)  # retrained in place
    assert fps(str(a)) != before
    assert len(fps._fps) <= 2  # bounded


def test_unreadable_adapter_is_unkeyable(tmp_path: Path) -> None:
    fps = AdapterFingerprints()
    with pytest.raises(Unkeyable, match="not a directory"):
        fps(str(tmp_path / "missing"))
    with pytest.raises(Unkeyable, match="not a directory"):
        fps("some-org/some-hub-adapter")


def test_extras_per_block() -> None:
    key = KVKey(extras=(b"a", b"", b"c"))
    assert key.extras_for(2) == [b"a", b""]
    assert PLAIN.extras_for(5) is None
    with pytest.raises(LayoutError, match="3 block extras for 4 blocks"):
        key.extras_for(4)
    assert KVKey(salt="s").namespace_key != KVKey(salt="s", identity="lora=x@1").namespace_key


def test_wired_match_names_its_namespace() -> None:
    spec = laymod.preset("llama-3-8b", 16)
    ns = Namespace(b"\7" * 16, "m", laymod.Layout(spec))
    wired = match_to_wire(Match(ns, 1, 16, 5, [], []))
    assert wire_namespace(wired) == b"\7" * 16
    assert match_from_wire(ns, wired).tokens == 16


def test_lora_keys_setting() -> None:
    assert BridgeConfig.from_extra({"lora_keys": "name"}).lora_keys == "name"
    with pytest.raises(ConfigError, match="lora_keys"):
        BridgeConfig.from_extra({"lora_keys": "path"})
