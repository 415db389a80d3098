"""Runs under ``.venv-vllm/bin/python``: one vLLM instance (CPU build), a list of
prompts (token ids, one ``generate`` each, in order), greedy decoding; writes the
output tokens, their logprobs, vLLM's cached-token counts and its prefix-cache
metrics as JSON. Used by tests/integration/test_vllm.py.

    python tests/vllm_driver.py SPEC.json OUT.json

SPEC: model (checkpoint dir), prompts (lists of token ids), max_tokens,
connector (null, or the ``kv_connector_extra_config`` dict), module (connector
module path), max_num_batched_tokens (optional).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="GCacheConnector",
            kv_connector_module_path=spec.get("module", "gcache_client.vllm"),
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        dtype="float32",
        max_model_len=4096,
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, logprobs=1)
    outs = []
    for prompt in spec["prompts"]:
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)]
        outs.append(
            {"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens or 0}
        )
    metrics: dict[str, float] = {}
    for m in llm.get_metrics():
        if "prefix_cache" in m.name or "by_source" in m.name:
            key = m.name + (f"/{m.labels['source']}" if "source" in m.labels else "")
            metrics[key] = float(getattr(m, "value", 0) or 0)
    info = {}
    try:
        vc = llm.llm_engine.vllm_config
        info["hybrid_kv_cache_manager"] = not vc.scheduler_config.disable_hybrid_kv_cache_manager
    except AttributeError:
        pass
    return {"outputs": outs, "metrics": metrics, "info": info}


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    result = run(spec)
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)
