"""The compute model: prefill FLOPs of a model as a function of token position.

Shared by the meta's cost policy and demotion rule (gcache/meta/eviction.py,
tiers.py), the replayer, and the client's load-or-recompute rule
(client/gcache_client/tiers.py). ``docs/eviction.md`` derives the figures of the
presets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gcache.layout import PRESETS, Layout, preset


@dataclass(frozen=True)
class ModelCompute:
    """Prefill FLOPs of a model, per token, as a function of the token's position.

    A token at position ``p`` (0-based) costs ``linear`` (2 x the active
    non-embedding parameters: projections and MLP/experts) plus, for attention,
    ``full`` x (p + 1) summed over the full-attention layers and ``w_flops`` x
    min(p + 1, w) for each sliding window ``w``. ``docs/eviction.md`` derives the
    figures of the presets.
    """

    linear: float
    full: float  # per attended key, summed over the full-attention layers
    windows: tuple[tuple[int, float], ...] = ()  # (window, per key, summed over its layers)

    def prefix(self, t: int) -> float:
        """FLOPs of prefilling tokens ``[0, t)``."""
        if t <= 0:
            return 0.0
        total = self.linear * t + self.full * (t * (t + 1) // 2)
        for w, per_key in self.windows:
            keys = t * (t + 1) // 2 if t <= w else w * (w + 1) // 2 + (t - w) * w
            total += per_key * keys
        return total

    def span(self, a: int, b: int) -> float:
        """FLOPs of tokens ``[a, b)`` given the KV of ``[0, a)``."""
        return self.prefix(b) - self.prefix(a)


def _transformer_compute(
    *,
    hidden: int,
    q_heads: int,
    qk_dim: int,
    v_dim: int,
    layers: list[tuple[int, int, int]],  # (kv_heads, window or 0, active MLP params)
) -> ModelCompute:
    """Compute figures of a decoder from its config: per layer, the projections
    (q, k, v, o) and the MLP parameters a token activates; attention costs
    2 x q_heads x (qk_dim + v_dim) FLOPs per attended key (scores, then values)."""
    linear = 0
    full = 0.0
    per_window: dict[int, float] = {}
    per_key = 2.0 * q_heads * (qk_dim + v_dim)
    for kv_heads, window, mlp in layers:
        proj = hidden * (q_heads * qk_dim + kv_heads * (qk_dim + v_dim)) + q_heads * v_dim * hidden
        linear += proj + mlp
        if window:
            per_window[window] = per_window.get(window, 0.0) + per_key
        else:
            full += per_key
    return ModelCompute(2.0 * linear, full, tuple(sorted(per_window.items())))


def _mimo_v2_flash() -> ModelCompute:
    # XiaomiMiMo/MiMo-V2-Flash config.json: hidden 4096, 48 layers (full attention at
    # 0,5,11,...,47, the rest sliding with window 128), 64 query heads, head_dim 192,
    # v_head_dim 128, 4 KV heads (full) / 8 (sliding); layer 0 dense MLP
    # (intermediate 16384), layers 1-47 MoE: 8 of 256 routed experts of
    # intermediate 2048 per token, plus a 4096 x 256 router. 14.2B active
    # non-embedding parameters (+1.25B embeddings and head: the card's "15B active").
    full_at = {0, 5, 11, 17, 23, 29, 35, 41, 47}
    hidden = 4096
    layers = []
    for i in range(48):
        mlp = 3 * hidden * 16384 if i == 0 else 8 * 3 * hidden * 2048 + hidden * 256
        layers.append((4, 0, mlp) if i in full_at else (8, 128, mlp))
    return _transformer_compute(hidden=hidden, q_heads=64, qk_dim=192, v_dim=128, layers=layers)


def _llama_3_8b() -> ModelCompute:
    # meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 query heads,
    # 8 KV heads, head_dim 128, intermediate 14336 (SwiGLU: 3 matrices).
    hidden = 4096
    layers = [(8, 0, 3 * hidden * 14336)] * 32
    return _transformer_compute(hidden=hidden, q_heads=32, qk_dim=128, v_dim=128, layers=layers)


PRESET_COMPUTE: dict[str, Callable[[], ModelCompute]] = {
    "mimo-v2-flash": _mimo_v2_flash,
    "llama-3-8b": _llama_3_8b,
}
# An unknown model: recompute cost proportional to tokens (the linear part, which
# dominates below tens of thousands of tokens for every preset), no position term.
UNIT_COMPUTE = ModelCompute(1.0, 0.0)


def compute_for_layout(layout: Layout) -> ModelCompute:
    """The compute model of the preset whose layers ``layout`` has (any block size),
    else :data:`UNIT_COMPUTE`."""
    for name in PRESETS:
        if preset(name, layout.block_size).layers == layout.spec.layers:
            return PRESET_COMPUTE[name]()
    return UNIT_COMPUTE
