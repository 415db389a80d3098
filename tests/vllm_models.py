"""Toy checkpoints for the vLLM end-to-end tests: seeded random weights saved as
safetensors under the names vLLM's loader expects, with a ``config.json`` in the
format vLLM reads. Loaded normally (never ``load_format="dummy"``: its near-uniform
logits would hide wrong KV).

* ``write_tiny_mimo``: ``MiMoV2FlashForCausalLM`` (vLLM's own MiMo-V2-Flash model):
  hybrid full / sliding-window attention with more KV heads on the sliding
  layers, equal K and V head dims (vLLM's CPU backend has no kernel for unequal
  ones) and no attention sinks, a dense first MLP and MoE after it.
* ``write_tiny_llama``: ``LlamaForCausalLM``, full attention only.

Runs under either venv (torch + safetensors only); no vLLM import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIMO_WINDOW = 128  # vLLM's sliding window for the toy MiMo's SWA layers
# 1 = sliding-window layer, 0 = full attention (vLLM's ``hybrid_layer_pattern``).
MIMO_PATTERN = (0, 1, 1, 0, 1, 1)


def _save(out: Path, config: dict[str, Any], tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _rand(gen: Any, *shape: int, scale: float = 0.0) -> Any:
    import torch

    fan_in = shape[-1]
    std = scale or fan_in**-0.5
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def _norm(gen: Any, n: int) -> Any:
    import torch

    return 1.0 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float32)


def write_tiny_mimo(
    out: str | Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    vocab: int = 2048,
    pattern: tuple[int, ...] = MIMO_PATTERN,
    window: int = MIMO_WINDOW,
    head_dim: int = 64,
    n_experts: int = 4,
) -> Path:
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = len(pattern)
    heads, kv_heads = 4, 1  # full attention
    swa_heads, swa_kv_heads = 4, 2  # sliding window: twice the KV heads (as MiMo)
    inter, moe_inter = 2 * hidden, hidden // 2
    moe_freq = [0] + [1] * (layers - 1)
    config = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "torch_dtype": "float32",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "v_head_dim": head_dim,
        "swa_num_attention_heads": swa_heads,
        "swa_num_key_value_heads": swa_kv_heads,
        "swa_head_dim": head_dim,
        "swa_v_head_dim": head_dim,
        "sliding_window": window,
        "sliding_window_size": window,
        "hybrid_layer_pattern": list(pattern),
        "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
        "moe_layer_freq": moe_freq,
        "mlp_layer_types": ["sparse" if f else "dense" for f in moe_freq],
        "n_routed_experts": n_experts,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-5,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "swa_rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
        "attention_bias": False,
        "add_swa_attention_sink_bias": False,
        "add_full_attention_sink_bias": False,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_value_scale": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    t: dict[str, Any] = {
        "model.embed_tokens.weight": _rand(gen, vocab, hidden, scale=1.0),
        "model.norm.weight": _norm(gen, hidden),
        "lm_head.weight": _rand(gen, vocab, hidden),
    }
    for i, swa in enumerate(pattern):
        p = f"model.layers.{i}."
        h, kvh = (swa_heads, swa_kv_heads) if swa else (heads, kv_heads)
        t[p + "input_layernorm.weight"] = _norm(gen, hidden)
        t[p + "post_attention_layernorm.weight"] = _norm(gen, hidden)
        t[p + "self_attn.q_proj.weight"] = _rand(gen, h * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = _rand(gen, kvh * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = _rand(gen, kvh * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = _rand(gen, hidden, h * head_dim)
        if moe_freq[i]:
            t[p + "mlp.gate.weight"] = _rand(gen, n_experts, hidden)
            t[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(n_experts)
            for e in range(n_experts):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = _rand(gen, moe_inter, hidden)
                t[q + "up_proj.weight"] = _rand(gen, moe_inter, hidden)
                t[q + "down_proj.weight"] = _rand(gen, hidden, moe_inter)
        else:
            t[p + "mlp.gate_proj.weight"] = _rand(gen, inter, hidden)
            t[p + "mlp.up_proj.weight"] = _rand(gen, inter, hidden)
            t[p + "mlp.down_proj.weight"] = _rand(gen, hidden, inter)
    return _save(Path(out), config, t)


def write_tiny_llama(
    out: str | Path, *, seed: int = 1, hidden: int = 256, vocab: int = 2048, layers: int = 4
) -> Path:
    gen = __import__("torch").Generator().manual_seed(seed)
    heads, kv_heads, head_dim = 4, 2, 64
    inter = 2 * hidden
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    t: dict[str, Any] = {
        "model.embed_tokens.weight": _rand(gen, vocab, hidden, scale=1.0),
        "model.norm.weight": _norm(gen, hidden),
        "lm_head.weight": _rand(gen, vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _norm(gen, hidden)
        t[p + "post_attention_layernorm.weight"] = _norm(gen, hidden)
        t[p + "self_attn.q_proj.weight"] = _rand(gen, heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = _rand(gen, kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = _rand(gen, kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = _rand(gen, hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = _rand(gen, inter, hidden)
        t[p + "mlp.up_proj.weight"] = _rand(gen, inter, hidden)
        t[p + "mlp.down_proj.weight"] = _rand(gen, hidden, inter)
    return _save(Path(out), config, t)


def write_lora_adapter(
    out: str | Path,
    *,
    seed: int,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    rank: int = 8,
) -> Path:
    """A PEFT LoRA adapter for ``write_tiny_llama``'s model: seeded random A and B
    on q/k/v/o of every layer (B non-zero, so the adapter changes K and V, hence
    the KV cache, and the greedy tokens)."""
    from safetensors.torch import save_file

    gen = __import__("torch").Generator().manual_seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": "tiny-llama",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    t: dict[str, Any] = {}
    for i in range(layers):
        for mod, (fan_in, fan_out) in dims.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{mod}."
            t[p + "lora_A.weight"] = _rand(gen, rank, fan_in)
            t[p + "lora_B.weight"] = _rand(gen, fan_out, rank, scale=0.5)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "adapter_model.safetensors"))
    return out
