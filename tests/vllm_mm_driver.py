"""Runs under ``.venv-vllm/bin/python``: ONE vLLM instance (CPU build, engine core
in this process) serving a multimodal model (tests/vllm_mm_models.py), greedy
decoding with logprobs, through a list of phases. After every phase the result so
far is written to OUT.json.

    python tests/vllm_mm_driver.py SPEC.json OUT.json

SPEC (JSON object; only ``model`` and ``phases`` are required):

* ``model``: checkpoint directory (``tests.vllm_mm_models.write_tiny_blip2``).
* ``phases``: ``[{"name": str, "prompts": [PROMPT, ...], "reset_prefix_cache"?:
  bool, "reset_mm_cache"?: bool}]``; ``reset_prefix_cache`` empties vLLM's own
  KV prefix cache before the phase, ``reset_mm_cache`` its multimodal
  processor cache (neither touches GCache).
* PROMPT: ``{"text"?: str, "images": [seed, ...]}``: the text (default
  ``vllm_mm_models.PROMPT``; BLIP-2 puts the image placeholders in front of it)
  and the images, each ``make_image(seed, image_size)``; ``images`` may be
  empty (text only); at most ``max_images`` (default 1, BLIP-2's limit).
* ``image_size``: pixels of the generated images (default 64).
* ``max_tokens`` (default 4), ``max_model_len`` (default 2048),
  ``max_num_batched_tokens`` (optional).
* ``kv_connector``: null, or ``{"name", "module", "role"?, "extra"}``
  (``kv_transfer_config``; role default ``kv_both``).
* ``ec_connector``: null, or ``{"name", "module", "role"?, "extra"}``
  (``ec_transfer_config``; role default ``ec_both``;
  e.g. ``{"name": "GCacheECConnector", "module": "gcache_client.vllm_ec",
  "extra": {"meta": ..., "meta_grpc": ...}}``).
* ``stats_grpc``: the meta's gRPC address: GCache's counters after each phase.

OUT.json: ``{"phases": {name: {"outputs": [{"tokens", "logprobs", "cached",
"prompt_tokens", "s"}], "encoder_calls": int, "ec_stats": {...}, "metrics": {...}, "gcache"?:
{...}}}, "times": {...}, "info": {...}}``. ``encoder_calls`` counts the vision
tower's forward calls since the start (cumulative; a wrapper installed on the
model through ``LLM.apply_model``), ``ec_stats`` the EC connector's counters
(``{"worker": stats(), "scheduler": stats()}``, cumulative) where it has them.
A phase that raises is recorded (``error``) and ends the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# apply_model passes a function to the (in-process) worker.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm_driver import _gcache_counters, _write
from tests.vllm_driver import _metrics as _text_metrics


def _metrics(llm: Any) -> dict[str, float]:
    return _text_metrics(llm, ("prefix_cache", "by_source", "encoder", "mm_cache"))


TOWERS = ("vision_model", "vision_tower", "visual")


def _tower(model: Any) -> Any:
    return next(getattr(model, n) for n in TOWERS if hasattr(model, n))


def _count_encoder(model: Any) -> int:
    """Wrap the vision tower's forward with a call counter (once)."""
    tower = _tower(model)
    if not hasattr(tower, "_gcache_calls"):
        tower._gcache_calls = 0
        inner = tower.forward

        def counted(*a: Any, **kw: Any) -> Any:
            tower._gcache_calls += 1
            return inner(*a, **kw)

        tower.forward = counted
    return int(tower._gcache_calls)


def _encoder_calls(model: Any) -> int:
    return int(_tower(model)._gcache_calls)


def _ec_stats(llm: Any) -> dict[str, Any]:
    """The EC connector's counters (``stats()``), worker side then scheduler side
    (the engine core runs in this process)."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    out: dict[str, Any] = {}
    parts = [get_ec_transfer() if has_ec_transfer() else None]
    try:
        parts.append(llm.llm_engine.engine_core.engine_core.scheduler.ec_connector)
    except AttributeError:
        pass
    for name, part in zip(("worker", "scheduler"), parts, strict=False):
        stats = getattr(part, "stats", None)
        if callable(stats):
            out[name] = dict(stats())
    return out


def run(spec: dict[str, Any], out_path: str) -> dict[str, Any]:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    from tests.vllm_mm_models import PROMPT, make_image

    times: dict[str, float] = {"import": time.monotonic() - t0}
    result: dict[str, Any] = {"phases": {}, "times": times, "info": {}}
    kw: dict[str, Any] = {}
    kv = spec.get("kv_connector")
    if kv is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=kv["name"],
            kv_connector_module_path=kv.get("module"),
            kv_role=kv.get("role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=kv.get("extra", {}),
        )
    ec = spec.get("ec_connector")
    if ec is not None:
        from vllm.config import ECTransferConfig

        kw["ec_transfer_config"] = ECTransferConfig(
            ec_connector=ec["name"],
            ec_connector_module_path=ec.get("module"),
            ec_role=ec.get("role", "ec_both"),
            ec_connector_extra_config=ec.get("extra", {}),
        )
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    t1 = time.monotonic()
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        dtype="float32",
        max_model_len=spec.get("max_model_len", 2048),
        limit_mm_per_prompt={"image": spec.get("max_images", 1)},
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    times["start"] = time.monotonic() - t1
    llm.apply_model(_count_encoder)
    size = int(spec.get("image_size", 64))
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, logprobs=1)
    for phase in spec["phases"]:
        name = phase["name"]
        t2 = time.monotonic()
        print(f"=== vllm_mm_driver phase {name}", file=sys.stderr, flush=True)
        rec: dict[str, Any] = {"outputs": []}
        result["phases"][name] = rec
        try:
            if phase.get("reset_prefix_cache"):
                assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
            if phase.get("reset_mm_cache"):
                llm.reset_mm_cache()
            for prompt in phase["prompts"]:
                t4 = time.monotonic()
                req: dict[str, Any] = {"prompt": prompt.get("text", PROMPT)}
                seeds = prompt.get("images", [])
                if seeds:
                    imgs = [make_image(s, size) for s in seeds]
                    req["multi_modal_data"] = {"image": imgs if len(imgs) > 1 else imgs[0]}
                o = llm.generate([req], sp, use_tqdm=False)[0]
                c = o.outputs[0]
                lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)]
                rec["outputs"].append(
                    {
                        "tokens": list(c.token_ids),
                        "logprobs": lps,
                        "cached": o.num_cached_tokens or 0,
                        "prompt_tokens": len(o.prompt_token_ids or []),
                        "s": round(time.monotonic() - t4, 3),
                    }
                )
            rec["encoder_calls"] = llm.apply_model(_encoder_calls)[0]
            rec["ec_stats"] = _ec_stats(llm)
            rec["metrics"] = _metrics(llm)
            if spec.get("stats_grpc"):
                rec["gcache"] = _gcache_counters(spec["stats_grpc"])
        except Exception as exc:  # recorded for the test; the run ends here
            rec["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            times[name] = time.monotonic() - t2
            _write(out_path, result)
            return result
        times[name] = time.monotonic() - t2
        _write(out_path, result)
    t3 = time.monotonic()
    llm.llm_engine.engine_core.shutdown()  # the EC connector flushes its stores
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
    os._exit(0)  # the engine is shut down; the interpreter's teardown checks nothing
