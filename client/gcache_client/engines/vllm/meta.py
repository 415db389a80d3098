"""The vLLM connector's shared pieces: the GCache layout of vLLM's KV cache
(:func:`layer_map`) and the metadata the scheduler hands the workers each step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from gcache import layout as laymod
from gcache.errors import LayoutError
from gcache_client.engines.vllm.core import PLAIN, BridgeConfig, KVKey, MatchWire

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

MEDIUM = "GCACHE"  # the medium of the KV events this connector publishes


# ---- layout -------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerMap:
    """vLLM's attention layers in model order, with their KV cache group."""

    names: list[str]  # GCache layer index -> vLLM layer name
    group_of: dict[str, int]  # vLLM layer name -> vLLM KV cache group
    group_block: list[int]  # vLLM group -> its block size (tokens)
    spec: laymod.LayoutSpec


def _layer_index(name: str) -> int:
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if not nums:
        raise LayoutError(f"cannot tell the layer index of {name!r}")
    return nums[0]


def layer_map(kv_cache_config: KVCacheConfig, dtype: torch.dtype) -> LayerMap:
    """The GCache layout of vLLM's KV cache: one GCache block = the least common
    multiple of the groups' block sizes (vLLM's hybrid prefix cache hits are
    multiples of it too), layers grouped by window (full, then one group per window)."""
    group_of: dict[str, int] = {}
    specs: dict[str, Any] = {}
    group_block: list[int] = []
    for g, grp in enumerate(kv_cache_config.kv_cache_groups):
        group_block.append(int(grp.kv_cache_spec.block_size))
        for name in grp.layer_names:
            group_of[name] = g
            specs[name] = grp.kv_cache_spec
    names = sorted(group_of, key=_layer_index)
    layers = []
    for name in names:
        s = specs[name]
        hv = getattr(s, "head_size_v", None) or s.head_size
        if hv != s.head_size:
            raise LayoutError(f"{name}: K head size {s.head_size} != V head size {hv}")
        if isinstance(s, SlidingWindowSpec):
            layers.append(
                laymod.LayerSpec("swa", s.num_kv_heads, s.head_size, hv, window=s.sliding_window)
            )
        elif type(s).__name__ == "FullAttentionSpec" and not getattr(s, "sliding_window", None):
            layers.append(laymod.LayerSpec("full", s.num_kv_heads, s.head_size, hv))
        else:
            raise LayoutError(f"{name}: KV cache spec {type(s).__name__} is not supported")
    bs = math.lcm(*group_block)
    spec = laymod.LayoutSpec(
        block_size=bs, dtype=str(dtype).removeprefix("torch."), layers=tuple(layers)
    )
    laymod.validate(spec)
    return LayerMap(names, group_of, group_block, spec)


def bridge_config(vllm_config: VllmConfig) -> BridgeConfig:
    kvc = vllm_config.kv_transfer_config
    extra = dict(kvc.kv_connector_extra_config or {}) if kvc is not None else {}
    if kvc is not None and kvc.kv_role == "kv_consumer":
        extra["store"] = False  # loads only
    return BridgeConfig.from_extra(extra)


def model_id(vllm_config: VllmConfig) -> str:
    return str(vllm_config.model_config.served_model_name or vllm_config.model_config.model)


# ---- scheduler -> worker metadata ---------------------------------------------------


@dataclass
class ReqStep:
    """One request's part of a step, as the worker needs it."""

    req_id: str
    block_ids: tuple[list[int], ...]  # every group's blocks of the request
    start: int  # tokens computed (or loaded/cached) before this step's new tokens
    end: int  # tokens computed once this step ran
    store_len: int  # tokens to store (0: nothing)
    tokens: list[int] | None = None  # the tokens to store (first step only)
    key: KVKey = PLAIN  # what besides the tokens keys its blocks (vllm_keys)
    load: MatchWire | None = None  # leased match to load
    local: int = 0  # tokens vLLM had in its own prefix cache
    async_load: bool = False  # load in the background; nothing is computed this step


@dataclass
class GCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    steps: list[ReqStep] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
