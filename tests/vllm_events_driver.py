"""Runs under ``.venv-vllm/bin/python``: one vLLM instance (CPU build, engine core in
this process) with the GCache connector and vLLM's KV events published over ZMQ,
for tests/integration/test_vllm_events.py.

    python tests/vllm_events_driver.py SPEC.json DIR

SPEC: model, connector (``kv_connector_extra_config``), events (endpoint, topic),
phases: [{name, prompts?, reset_prefix_cache?, wait_file?, tick_until?}]. A phase
waits for DIR/wait_file (made by the test), empties vLLM's own prefix cache if
asked, sends its prompts, then keeps vLLM stepping (one short prompt every 0.2 s:
vLLM publishes KV events only with a step) until DIR/tick_until exists. It then
writes DIR/<name>.done. Each wait gives up after 120 s (the run fails).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

WAIT_S = 120.0


def _wait(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def run(spec: dict[str, Any], out: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        dtype="float32",
        max_model_len=4096,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="GCacheConnector",
            kv_connector_module_path="gcache_client.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec["connector"],
        ),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["events"]["endpoint"],
            topic=spec["events"]["topic"],
        ),
    )
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    tick = SamplingParams(max_tokens=1, temperature=0.0)
    for phase in spec["phases"]:
        print(f"=== phase {phase['name']}", file=sys.stderr, flush=True)
        if phase.get("wait_file"):
            _wait(out / phase["wait_file"])
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        for prompt in phase.get("prompts", []):
            llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        if phase.get("tick_until"):
            stop = out / phase["tick_until"]
            deadline = time.monotonic() + WAIT_S
            while not stop.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{stop} never appeared")
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], tick, use_tqdm=False)
                time.sleep(0.2)
        (out / f"{phase['name']}.done").write_text("")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        run(json.load(fh), Path(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
