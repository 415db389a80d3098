"""Small random-weight models for demos, tests and benchmarks (no download).

``tiny_mimo_v2_flash`` builds the real MiMo-V2-Flash architecture from
``transformers`` (hybrid full/sliding attention with sinks, MoE, K head dim 192, V
head dim 128, doubled KV heads on sliding layers) at a toy width, with weights from
a fixed seed.
"""

from __future__ import annotations

from typing import Any


def tiny_mimo_v2_flash(
    num_layers: int = 6,
    hidden_size: int = 256,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 1024,
    sliding_window: int = 129,
) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # Full attention every third layer, as MiMo-V2-Flash does every sixth.
    layer_types = [
        "full_attention" if i % 3 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    config = AutoConfig.for_model(
        "mimo_v2_flash",
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=192,
        v_head_dim=128,
        vocab_size=vocab_size,
        max_position_embeddings=32768,
        sliding_window=sliding_window,
        layer_types=layer_types,
        mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()
