"""Runs under ``.venv-vllm/bin/python``: one vLLM instance whose GCache connector
loads asynchronously and late (tests/vllm_slowload.py), for the abort-mid-load test
of tests/integration/test_vllm_events.py.

    python tests/vllm_abort_driver.py SPEC.json OUT.json

SPEC: model, connector, meta_grpc, prompt. Stores the prompt (reference tokens),
empties vLLM's own prefix cache, starts the prompt again as request A (its load
from GCache starts and sleeps), aborts A while the load is in flight, steps until
vLLM got A's blocks back, then runs the prompt again as request B. OUT: reference
and B's tokens and logprobs, B's cached tokens, vLLM's free blocks before A and
after the abort, whether A was aborted mid-load, and the meta's counters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(spec: dict[str, Any], out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from gcache.cli.deploy import fetch_stats

    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
        gpu_memory_utilization=0.1, dtype="float32", max_model_len=4096, seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="GCacheConnector", kv_connector_module_path="tests.vllm_slowload",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        ),
    )  # fmt: skip
    engine = llm.llm_engine
    core: Any = engine.engine_core.engine_core  # in-process engine core
    pool = core.scheduler.kv_cache_manager.block_pool
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    tick = SamplingParams(max_tokens=1, temperature=0.0)
    res: dict[str, Any] = {}

    def gen(prompt: list[int]) -> dict[str, Any]:
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)]
        return {"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens or 0}

    def counters() -> dict[str, float]:
        return dict(fetch_stats(spec["meta_grpc"]).counters)

    prompt = spec["prompt"]
    res["reference"] = gen(prompt)
    deadline = time.monotonic() + 60
    while counters()["puts_committed"] < 1:  # the background store
        assert time.monotonic() < deadline, "the prompt was never stored"
        time.sleep(0.1)
    assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
    res["free_before"] = pool.get_num_free_blocks()
    mark = os.environ["GCACHE_TEST_LOAD_MARK"]
    engine.add_request("A", {"prompt_token_ids": prompt}, sp)
    deadline = time.monotonic() + 60
    while not os.path.exists(mark):  # A scheduled, its load started (and sleeping)
        assert time.monotonic() < deadline, "A's load never started"
        engine.step()
    engine.abort_request(["A"])
    # vLLM keeps an aborted request whose load is in flight (its blocks wait for it).
    a = [r for rid, r in core.scheduler.requests.items() if rid.split("-")[0] == "A"]
    res["a_status"] = a[0].status.name if a else "gone"
    deadline = time.monotonic() + 60
    while pool.get_num_free_blocks() < res["free_before"]:  # A's blocks come back
        assert time.monotonic() < deadline, "A's blocks were never freed"
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], tick, use_tqdm=False)
        time.sleep(0.1)
    res["free_after_abort"] = pool.get_num_free_blocks()
    res["after"] = gen(prompt)
    res["gcache"] = counters()
    engine.engine_core.shutdown()
    with open(out_path, "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        run(json.load(fh), sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
