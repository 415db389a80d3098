"""What a transformers model is, for GCache: its layout (:func:`layout_from_model`),
the KV rows of its cache (:func:`kv_from_cache`) and the identity of its active
LoRA adapters (:func:`peft_identity`)."""

from __future__ import annotations

from typing import Any

import torch

from gcache.errors import LayoutError
from gcache.layout import LayerSpec, LayoutSpec, validate
from gcache_client.types import KVPair


def _decoder(model: Any) -> Any:
    inner = getattr(model, "model", model)
    return getattr(inner, "layers", None) or inner.model.layers


def layout_from_model(model: Any, block_size: int = 64) -> LayoutSpec:
    """Derive the GCache layout from a loaded model: which layers are full or
    sliding (and their window), KV heads, K and V head dims (read off the k/v
    projection shapes, so per-layer head counts like MiMo's doubled SWA heads come
    out right), and the dtype."""
    config = model.config.get_text_config(decoder=True)
    layer_types = (
        getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    )
    layers = []
    for i, block in enumerate(_decoder(model)):
        attn = block.self_attn
        head_dim = int(attn.head_dim)
        kv_heads = attn.k_proj.out_features // head_dim
        v_dim = attn.v_proj.out_features // kv_heads
        if layer_types[i] == "sliding_attention":
            # Any window: the layout stores ceil((W-1)/block_size) blocks, which may
            # be more rows than the W-1 transformers keeps (WindowCapture keeps them).
            window = int(config.sliding_window)
            layers.append(LayerSpec("swa", kv_heads, head_dim, v_dim, window=window))
        elif layer_types[i] == "full_attention":
            layers.append(LayerSpec("full", kv_heads, head_dim, v_dim))
        else:
            raise LayoutError(f"layer {i}: unsupported layer type {layer_types[i]!r}")
    dtype = str(model.dtype).removeprefix("torch.")
    spec = LayoutSpec(block_size=block_size, dtype=dtype, layers=tuple(layers))
    validate(spec)
    return spec


def kv_from_cache(cache: Any) -> list[KVPair]:
    """``(K, V)`` per layer as ``[rows, kv_heads, head_dim]`` CPU tensors (batch 1).
    Sliding layers yield only the rows the cache keeps (its window)."""
    out: list[KVPair] = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        if k is None or k.shape[0] != 1:
            raise LayoutError("store() needs a filled cache of batch size 1")
        out.append(
            (k[0].transpose(0, 1).contiguous().cpu(), v[0].transpose(0, 1).contiguous().cpu())
        )
    return out


MAX_IDENTITIES = 64  # adapter namespaces a connector keeps registered


def peft_identity(model: Any, cache: dict[tuple[Any, ...], str] | None = None) -> str:
    """The KV identity of a (PEFT) model: ``""`` for a plain model; for a model
    with LoRA adapters, the active adapters' names with a fingerprint (xxh3-128)
    of each one's weights, e.g. ``"lora=math@<hex>"``. ``cache`` keeps fingerprints
    per (adapter, parameter versions), so weights changed in place are hashed anew."""
    import xxhash

    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return ""
    active = getattr(model, "active_adapters", None)
    names = list(active() if callable(active) else active or [])
    disabled = getattr(model, "_adapters_disabled", False) is True or any(
        getattr(m, "_disable_adapters", False) is True for m in model.modules()
    )
    if disabled or not names:  # PeftModel.disable_adapter(): the base model's KV
        return ""
    parts = []
    for name in sorted(names):
        params = sorted(
            (k, p)
            for k, p in model.named_parameters()
            if f".{name}." in k or k.endswith(f".{name}")
        )
        key = (name, tuple((k, p.data_ptr(), p._version) for k, p in params))
        fp = cache.get(key) if cache is not None else None
        if fp is None:
            h = xxhash.xxh3_128()
            h.update(repr(sorted(peft_config[name].to_dict().items(), key=str)).encode())
            for k, p in params:
                h.update(k.encode())
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            fp = h.hexdigest()
            if cache is not None:
                if len(cache) >= MAX_IDENTITIES:  # bounded: oldest out
                    cache.pop(next(iter(cache)))
                cache[key] = fp
        parts.append(f"lora={name}@{fp}")
    return ",".join(parts)
