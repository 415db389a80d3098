"""Runs under ``.venv-vllm/bin/python``: ONE vLLM instance (CPU build, engine core
in this process) for one role of tests/integration/test_vllm.py, greedy decoding,
through a list of phases; each phase sends its prompts (token ids, one
``generate`` each, in order). After every phase the result so far is written to
OUT.json (so a phase that kills the engine leaves the earlier ones readable):
per phase the output tokens, their logprobs, vLLM's cached-token counts, vLLM's
prefix-cache metrics (cumulative) and, with ``stats_grpc``, GCache's counters.

    python tests/vllm_driver.py SPEC.json OUT.json

SPEC: model (checkpoint dir), phases ([{name, prompts, reset_prefix_cache?,
kill_pids?, batch?}]), max_tokens, connector (null, or the ``kv_connector_extra_config``
dict), module (connector module path), max_num_batched_tokens (optional),
stats_grpc (the meta's gRPC address, optional), loras ({name: {id, path}}: LoRA
on), prompt_embeds (true: prompt embeddings on).

A prompt is a list of token ids, or a dict: ``{"tokens": [...]}`` or
``{"embeds_seed": S, "n": N}`` (N prompt embeddings, seeded normal values of the
model's hidden size), with optional ``"lora": NAME`` and ``"salt": CACHE_SALT``.
A phase with ``batch: true`` sends all its prompts in one ``generate`` (one
engine batch, mixed kinds); otherwise one ``generate`` each, in order.

A phase with ``kill_pids`` writes them to ``$GCACHE_TEST_KILL_FILE`` first: the
``tests.vllm_killer`` connector SIGKILLs them once its next load has started.
``reset_prefix_cache`` empties vLLM's own prefix cache first (not GCache), so
the phase's prompts load from GCache again. A phase that raises is recorded
(``error``) and ends the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Engine core in this process: no second process that imports vLLM and torch
# again (about 45 s of start-up on 2 busy cores).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, path)


def _gcache_counters(meta_grpc: str) -> dict[str, float]:
    from gcache.cli.deploy import fetch_stats

    return dict(fetch_stats(meta_grpc).counters)


def _metrics(llm: Any, names: tuple[str, ...] = ("prefix_cache", "by_source")) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for m in llm.get_metrics():
        if any(s in m.name for s in names):
            key = m.name + (f"/{m.labels['source']}" if "source" in m.labels else "")
            metrics[key] = float(getattr(m, "value", 0) or 0)
    return metrics


def _prompt(p: Any, llm: Any, loras: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(vLLM prompt, LoRARequest or None) of one spec prompt."""
    if isinstance(p, list):
        return {"prompt_token_ids": p}, None
    inp: dict[str, Any]
    if "embeds_seed" in p:
        import torch

        hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
        gen = torch.Generator().manual_seed(int(p["embeds_seed"]))
        inp = {"prompt_embeds": torch.randn(int(p["n"]), hidden, generator=gen)}
    else:
        inp = {"prompt_token_ids": p["tokens"]}
    if p.get("salt"):
        inp["cache_salt"] = p["salt"]
    lr = None
    if p.get("lora"):
        from vllm.lora.request import LoRARequest

        spec = loras[p["lora"]]
        lr = LoRARequest(p["lora"], int(spec["id"]), str(spec["path"]))
    return inp, lr


def run(spec: dict[str, Any], out_path: str) -> dict[str, Any]:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    times: dict[str, float] = {"import": time.monotonic() - t0}
    result: dict[str, Any] = {"phases": {}, "times": times, "info": {}}
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
    loras = spec.get("loras") or {}
    if loras:
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=len(loras))
    if spec.get("prompt_embeds"):
        kw["enable_prompt_embeds"] = True
    t1 = time.monotonic()
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
    times["start"] = time.monotonic() - t1
    try:
        vc = llm.llm_engine.vllm_config
        hma = not vc.scheduler_config.disable_hybrid_kv_cache_manager
        result["info"]["hybrid_kv_cache_manager"] = hma
    except AttributeError:
        pass
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, logprobs=1)
    for phase in spec["phases"]:
        name = phase["name"]
        t2 = time.monotonic()
        print(f"=== vllm_driver phase {name}", file=sys.stderr, flush=True)
        rec: dict[str, Any] = {"outputs": []}
        result["phases"][name] = rec
        try:
            if phase.get("reset_prefix_cache"):
                assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
            if phase.get("kill_pids"):
                with open(os.environ["GCACHE_TEST_KILL_FILE"], "w") as fh:
                    fh.write(",".join(str(p) for p in phase["kill_pids"]))
            prompts = [_prompt(p, llm, loras) for p in phase["prompts"]]
            groups = [prompts] if phase.get("batch") else [[p] for p in prompts]
            for group in groups:
                t4 = time.monotonic()
                outs = llm.generate(
                    [inp for inp, _ in group],
                    sp,
                    use_tqdm=False,
                    lora_request=[lr for _, lr in group],
                )
                for o in outs:
                    c = o.outputs[0]
                    lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)]
                    rec["outputs"].append(
                        {
                            "tokens": list(c.token_ids),
                            "logprobs": lps,
                            "cached": o.num_cached_tokens or 0,
                            "s": round(time.monotonic() - t4, 3),
                        }
                    )
            rec["metrics"] = _metrics(llm)
            if spec.get("stats_grpc") and not phase.get("kill_pids"):
                rec["gcache"] = _gcache_counters(spec["stats_grpc"])
        except Exception as exc:  # recorded for the test; the run ends here
            rec["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            times[name] = time.monotonic() - t2
            _write(out_path, result)
            return result
        times[name] = time.monotonic() - t2
        _write(out_path, result)
    # The connector's shutdown flushes its background stores (the next process
    # must find them); then GCache's counters include them.
    t3 = time.monotonic()
    llm.llm_engine.engine_core.shutdown()
    times["shutdown"] = time.monotonic() - t3
    if spec.get("stats_grpc"):
        result["gcache_final"] = _gcache_counters(spec["stats_grpc"])
    _write(out_path, result)
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    run(spec, sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine is shut down; the interpreter's own teardown (atexit, module
    # finalizers) took ~6 s here and checks nothing.
    os._exit(0)
