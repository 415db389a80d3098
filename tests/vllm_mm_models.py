"""A tiny multimodal checkpoint for vLLM's CPU build, made offline: a BLIP-2
(``Blip2ForConditionalGeneration``: a BLIP ViT vision tower, a Q-Former with
``num_query_tokens`` learned queries, a linear projection and an OPT decoder)
with seeded random weights saved as safetensors under the names vLLM's loader
expects (``vision_model.*``, ``query_tokens``, ``qformer.*``,
``language_projection.*``, ``language_model.model.decoder.*``; OPT ties its LM
head to the embeddings), plus every processor file vLLM asks for, built here
(nothing downloaded):

* ``tokenizer.json`` (a byte-level BPE without merges made with the ``tokenizers``
  library: one token per byte, plus ``<s>``, ``<pad>``, ``</s>``, ``<unk>`` and
  ``<image>``), ``tokenizer_config.json``, ``special_tokens_map.json``;
* ``preprocessor_config.json`` (BLIP image processing at ``image_size``;
  transformers picks its PIL backend, no torchvision) and ``processor_config.json``
  (``Blip2Processor``, ``num_query_tokens``).

Why BLIP-2: vLLM 0.32's LLaVA, PaliGemma, Qwen2-VL, Gemma 3, InternVL,
LLaVA-OneVision ... reach ``vllm.model_executor.models.pixtral`` (through
``vision.get_vision_encoder_info``), which imports a transformers image
processor that needs torchvision, and PyPI's torchvision cannot load beside the
CPU torch of ``.venv-vllm``. BLIP-2 does not.

The encoder output vLLM caches per image (``embed_multimodal``: vision tower,
Q-Former, projection) is ``[num_query_tokens, hidden]`` float32; the vision
tower is ``vision_model`` (what tests count the forward calls of).

Never ``load_format="dummy"`` (near-uniform logits hide wrong inputs): the weights
are scaled so that greedy tokens depend on the image (two images, same text,
different tokens; checked by tests/integration/test_vllm_ec.py).

API::

    write_tiny_blip2(out, *, seed=0, image_size=64, patch_size=8,
                     vision_hidden=64, vision_layers=2, qformer_hidden=64,
                     num_query_tokens=8, hidden=128, layers=2,
                     vocab=512) -> Path                 # the checkpoint directory
    make_image(seed, size=64) -> PIL.Image.Image        # a seeded RGB image
    PROMPT = "Question: what is in the image? Answer:"

A prompt has at most one image (vLLM's BLIP-2 limit); vLLM puts
``num_query_tokens`` ``<image>`` placeholders in front of the prompt's tokens.
Any image size is resized to ``image_size``.

Runs under either venv (torch, safetensors, tokenizers, numpy, pillow); no vLLM
import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", IMAGE_TOKEN)  # ids 0..4 (OPT's order)
PAD_ID, EOS_ID = 1, 2
BOS_ID = EOS_ID  # OPT starts a prompt with </s>
IMAGE_TOKEN_ID = SPECIALS.index(IMAGE_TOKEN)
PROMPT = "Question: what is in the image? Answer:"


def make_image(seed: int, size: int = 64) -> Any:
    """A deterministic RGB image: smooth colour blobs plus noise from ``seed``
    (different seeds give clearly different pixels after any resize)."""
    import numpy as np
    from PIL import Image

    rs = np.random.RandomState(seed)
    coarse = rs.randint(0, 256, size=(4, 4, 3)).astype(np.uint8)
    img = Image.fromarray(coarse, "RGB").resize((size, size), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.int16) + rs.randint(-24, 25, size=(size, size, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    assert len(vocab) <= vocab_size, (len(vocab), vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIALS)
    }
    specials = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "added_tokens_decoder": added,
                **specials,
                "pad_token": "<pad>",
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
                "processor_class": "Blip2Processor",
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({**specials, "pad_token": "<pad>"}))


def _fill(name: str, shape: tuple[int, ...], gen: Any) -> Any:
    """Seeded values by role: norms ~1, biases small, token embeddings O(1),
    matrices 1/sqrt(fan_in) (logits then vary a lot with the input, so greedy
    tokens follow the image)."""
    import torch

    if len(shape) == 1:
        if name.endswith("bias"):
            return 0.02 * torch.randn(*shape, generator=gen)
        return 1.0 + 0.1 * torch.randn(*shape, generator=gen)
    if "embed_tokens" in name:  # also the (tied) LM head: logits ~ N(0, ~1.5)
        return 0.15 * torch.randn(*shape, generator=gen)
    if name == "query_tokens":
        return torch.randn(*shape, generator=gen)
    if "position" in name or "class_embedding" in name:
        return 0.1 * torch.randn(*shape, generator=gen)
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return torch.randn(*shape, generator=gen) * fan_in**-0.5


def _shapes(
    *,
    image_size: int,
    patch_size: int,
    vh: int,
    vision_layers: int,
    qh: int,
    num_query_tokens: int,
    th: int,
    layers: int,
    vocab: int,
    max_pos: int,
) -> dict[str, tuple[int, ...]]:
    """BLIP-2's tensor names and shapes (as transformers saves them; vLLM's blip2.py
    loads them without renaming)."""
    n_patch = (image_size // patch_size) ** 2
    s: dict[str, tuple[int, ...]] = {"query_tokens": (1, num_query_tokens, qh)}
    v = "vision_model."
    s[v + "embeddings.class_embedding"] = (1, 1, vh)
    s[v + "embeddings.position_embedding"] = (1, n_patch + 1, vh)
    s[v + "embeddings.patch_embedding.weight"] = (vh, 3, patch_size, patch_size)
    s[v + "embeddings.patch_embedding.bias"] = (vh,)
    for i in range(vision_layers):
        p = f"{v}encoder.layers.{i}."
        s[p + "self_attn.qkv.weight"] = (3 * vh, vh)
        s[p + "self_attn.qkv.bias"] = (3 * vh,)
        s[p + "self_attn.projection.weight"] = (vh, vh)
        s[p + "self_attn.projection.bias"] = (vh,)
        for ln in ("layer_norm1", "layer_norm2"):
            s[f"{p}{ln}.weight"] = (vh,)
            s[f"{p}{ln}.bias"] = (vh,)
        s[p + "mlp.fc1.weight"] = (2 * vh, vh)
        s[p + "mlp.fc1.bias"] = (2 * vh,)
        s[p + "mlp.fc2.weight"] = (vh, 2 * vh)
        s[p + "mlp.fc2.bias"] = (vh,)
    s[v + "post_layernorm.weight"] = (vh,)
    s[v + "post_layernorm.bias"] = (vh,)
    q = "qformer."
    s[q + "layernorm.weight"] = (qh,)
    s[q + "layernorm.bias"] = (qh,)
    p = q + "encoder.layer.0."
    for att, kv_in in (("attention", qh), ("crossattention", vh)):
        s[f"{p}{att}.attention.query.weight"] = (qh, qh)
        s[f"{p}{att}.attention.query.bias"] = (qh,)
        for kv in ("key", "value"):
            s[f"{p}{att}.attention.{kv}.weight"] = (qh, kv_in)
            s[f"{p}{att}.attention.{kv}.bias"] = (qh,)
        s[f"{p}{att}.output.dense.weight"] = (qh, qh)
        s[f"{p}{att}.output.dense.bias"] = (qh,)
        s[f"{p}{att}.output.LayerNorm.weight"] = (qh,)
        s[f"{p}{att}.output.LayerNorm.bias"] = (qh,)
    s[p + "intermediate_query.dense.weight"] = (2 * qh, qh)
    s[p + "intermediate_query.dense.bias"] = (2 * qh,)
    s[p + "output_query.dense.weight"] = (qh, 2 * qh)
    s[p + "output_query.dense.bias"] = (qh,)
    s[p + "output_query.LayerNorm.weight"] = (qh,)
    s[p + "output_query.LayerNorm.bias"] = (qh,)
    s["language_projection.weight"] = (th, qh)
    s["language_projection.bias"] = (th,)
    d = "language_model.model.decoder."
    s[d + "embed_tokens.weight"] = (vocab, th)
    s[d + "embed_positions.weight"] = (max_pos + 2, th)  # OPT's offset of 2
    s[d + "final_layer_norm.weight"] = (th,)
    s[d + "final_layer_norm.bias"] = (th,)
    for i in range(layers):
        p = f"{d}layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            s[f"{p}self_attn.{proj}.weight"] = (th, th)
            s[f"{p}self_attn.{proj}.bias"] = (th,)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            s[f"{p}{ln}.weight"] = (th,)
            s[f"{p}{ln}.bias"] = (th,)
        s[p + "fc1.weight"] = (2 * th, th)
        s[p + "fc1.bias"] = (2 * th,)
        s[p + "fc2.weight"] = (th, 2 * th)
        s[p + "fc2.bias"] = (th,)
    return s


def write_tiny_blip2(
    out: str | Path,
    *,
    seed: int = 0,
    image_size: int = 64,
    patch_size: int = 8,
    vision_hidden: int = 64,
    vision_layers: int = 2,
    qformer_hidden: int = 64,
    num_query_tokens: int = 8,
    hidden: int = 128,
    layers: int = 2,
    vocab: int = 512,
) -> Path:
    """Write the checkpoint into ``out`` (created) and return it."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    max_pos = 2048
    config = {
        "architectures": ["Blip2ForConditionalGeneration"],
        "model_type": "blip-2",
        "torch_dtype": "float32",
        "num_query_tokens": num_query_tokens,
        "image_token_index": IMAGE_TOKEN_ID,
        "image_text_hidden_size": qformer_hidden,
        "use_decoder_only_language_model": True,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "initializer_factor": 1.0,
        "vision_config": {
            "model_type": "blip_2_vision_model",
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": max(1, vision_hidden // 32),
            "image_size": image_size,
            "patch_size": patch_size,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-6,
            "qkv_bias": True,
            "torch_dtype": "float32",
        },
        "qformer_config": {
            "model_type": "blip_2_qformer",
            "hidden_size": qformer_hidden,
            "intermediate_size": 2 * qformer_hidden,
            "num_hidden_layers": 1,
            "num_attention_heads": max(1, qformer_hidden // 32),
            "encoder_hidden_size": vision_hidden,
            "cross_attention_frequency": 1,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-12,
            "max_position_embeddings": 512,
            "vocab_size": 30522,
            "pad_token_id": 0,
            "torch_dtype": "float32",
        },
        "text_config": {
            "model_type": "opt",
            "architectures": ["OPTForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "word_embed_proj_dim": hidden,
            "ffn_dim": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "activation_function": "relu",
            "do_layer_norm_before": True,
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
            "max_position_embeddings": max_pos,
            "tie_word_embeddings": True,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "torch_dtype": "float32",
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    )
    shapes = _shapes(
        image_size=image_size,
        patch_size=patch_size,
        vh=vision_hidden,
        vision_layers=vision_layers,
        qh=qformer_hidden,
        num_query_tokens=num_query_tokens,
        th=hidden,
        layers=layers,
        vocab=vocab,
        max_pos=max_pos,
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: _fill(n, sh, gen).to(torch.float32).contiguous() for n, sh in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"))

    _write_tokenizer(out, vocab)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "BlipImageProcessor",
                "processor_class": "Blip2Processor",
                "do_resize": True,
                "size": {"height": image_size, "width": image_size},
                "resample": 3,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "do_convert_rgb": True,
            },
            indent=1,
        )
    )
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Blip2Processor", "num_query_tokens": num_query_tokens})
    )
    return out
