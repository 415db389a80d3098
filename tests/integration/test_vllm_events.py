"""End to end: a real vLLM (CPU build, toy Llama) with the GCache
connector and vLLM's own ZMQ KV events, a real meta + server, a real
``gcache-router`` (pool match from the events: no meta configured for it).

A prompt stored through GCache is announced as ``BlockStored(medium="GCACHE")``;
once vLLM empties its own prefix cache (``AllBlocksCleared``) the router scores the
prompt as a pool hit (no local blocks). Other data then fills the small store, GCache
evicts the prompt, the connector reports ``BlockRemoved(medium="GCACHE")`` from the
meta's removal stream, and the router stops scoring it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.keys import block_keys
from gcache.layout import LayerSpec, LayoutSpec, encode_spec
from gcache_client import GCacheClient
from tests.integration.test_router import Router
from tests.kvdata import make_kv
from tests.vllm_models import write_tiny_llama
from tests.vllm_run import TREE_PATH

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "tests" / "vllm_events_driver.py"
BS = 128  # vLLM's CPU block size
# The toy Llama: 4 full-attention layers, 2 KV heads of 64, float32 (512 KiB a block).
LLAMA = LayoutSpec(block_size=BS, dtype="float32", layers=(LayerSpec("full", 2, 64, 64),) * 4)
FILL = LayoutSpec(block_size=16, dtype="float16", layers=(LayerSpec("full", 1, 256, 256),))
FP = bytes(range(16))

if not VLLM_PY.exists():
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{VLLM_PY} missing: `make vllm-venv` must build it", pytrace=False)
    pytest.skip("no .venv-vllm (make vllm-venv)", allow_module_level=True)


def _wait(what: str, cond: object, proc: subprocess.Popen[bytes], log: Path, t: float) -> None:
    deadline = time.monotonic() + t
    while not cond():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: vLLM log:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.1)


def test_router_scores_gcache_blocks_until_gcache_evicts_them(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "llama")
    layout = tmp_path / "llama-layout.json"
    layout.write_bytes(encode_spec(LLAMA))
    rng = np.random.default_rng(7)
    prompt = [int(x) for x in rng.integers(10, 2000, 3 * BS + 1)]  # stores 3 blocks
    keys = block_keys(FP, prompt[: 3 * BS], BS)  # the router's keys
    with LocalDeployment(tmp_path / "d", servers=1, capacity="8MiB") as d:
        r = Router(
            tmp_path, fp=FP, layout=str(layout), block_size=BS,
            instances="v1=http://127.0.0.1:9", name="router",
        )  # fmt: skip
        try:
            events = (tmp_path / "router.ready").read_text().split()[3]
            spec = {
                "model": str(model),
                "connector": {"meta": d.meta_addr, "meta_grpc": d.meta_grpc},
                "events": {"endpoint": events, "topic": "v1"},
                "phases": [
                    {"name": "stored", "prompts": [prompt], "tick_until": "cleared"},
                    {"name": "cleared", "reset_prefix_cache": True, "tick_until": "scored"},
                    {"name": "evicted", "tick_until": "unscored"},
                ],
            }
            (tmp_path / "spec.json").write_text(json.dumps(spec))
            log = tmp_path / "vllm.log"
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": TREE_PATH}
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [str(VLLM_PY), str(DRIVER), str(tmp_path / "spec.json"), str(tmp_path)],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:

                def pool() -> float:
                    return r.metric("gcache_router_pool_blocks", instance="v1")

                # 1. Stored through GCache: announced with medium GCACHE.
                _wait("GCACHE BlockStored", lambda: pool() == 3, proc, log, 150)
                (tmp_path / "cleared").write_text("")
                # 2. vLLM's own cache emptied: the prompt is a pool hit, not a local one.
                _wait("AllBlocksCleared", lambda: (tmp_path / "stored.done").exists() and (
                    r.metric("gcache_router_index_total", what="resets") >= 1
                ), proc, log, 60)  # fmt: skip
                r.load("v1")  # live for routing whatever the events' timing
                routed = r.call(wire.Route(keys, len(keys) * BS))
                assert isinstance(routed, wire.Routed), routed
                assert (routed.instance, routed.local_blocks, routed.pool_blocks) == ("v1", 0, 3)
                (tmp_path / "scored").write_text("")
                # 3. GCache evicts it (other data fills the 8 MiB store, oldest first).
                c = GCacheClient(d.client_config(), timeout_s=10.0)
                try:
                    ns = c.register_namespace("filler", FILL)
                    for s in range(12):  # 12 x 1 MiB
                        t = rng.integers(0, 30000, 64 * 16)
                        assert c.put(ns, t, make_kv(ns.layout, len(t), seed=s)).ok
                finally:
                    c.close()
                assert d.stats().counters["evictions"] > 0
                # 4. The connector retracts it; the router stops scoring it.
                _wait("GCACHE BlockRemoved", lambda: pool() == 0, proc, log, 60)
                r.load("v1")
                routed = r.call(wire.Route(keys, len(keys) * BS))
                assert isinstance(routed, wire.Routed) and routed.pool_blocks == 0
                assert r.metric("gcache_router_pool_index_total", what="removed_blocks") == 3
                assert d.stats().counters["removals_delivered"] >= 3
                (tmp_path / "unscored").write_text("")
                assert proc.wait(120) == 0, log.read_text(errors="replace")[-4000:]
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        finally:
            r.stop()


def test_request_aborted_mid_load_frees_its_blocks_and_lease(tmp_path: Path) -> None:
    """A request aborted while its (async) load from GCache is in flight
    gives vLLM its blocks back once the load is over, holds no lease in the meta,
    and the next request for the same prompt loads it and produces the same tokens
    and logprobs as the run that stored it."""
    model = write_tiny_llama(tmp_path / "llama")
    prompt = [int(x) for x in np.random.default_rng(11).integers(10, 2000, 3 * BS + 1)]
    with LocalDeployment(tmp_path / "d", servers=1, capacity="64MiB") as d:
        spec = {
            "model": str(model),
            "connector": {
                "meta": d.meta_addr, "meta_grpc": d.meta_grpc, "load_mode": "async",
                "load_or_recompute": False, "transport": "tcp",
            },
            "meta_grpc": d.meta_grpc,
            "prompt": prompt,
        }  # fmt: skip
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        out, log = tmp_path / "out.json", tmp_path / "vllm.log"
        env = {
            **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": TREE_PATH,
            "GCACHE_TEST_LOAD_DELAY_S": "2", "GCACHE_TEST_LOAD_MARK": str(tmp_path / "mark"),
        }  # fmt: skip
        driver = ROOT / "tests" / "vllm_abort_driver.py"
        with open(log, "wb") as fh:
            rc = subprocess.run(
                [str(VLLM_PY), str(driver), str(tmp_path / "spec.json"), str(out)],
                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=300,
            ).returncode  # fmt: skip
        assert rc == 0 and out.exists(), log.read_text(errors="replace")[-4000:]
        res = json.loads(out.read_text())
        assert (tmp_path / "mark").read_text().split()[0].split("-")[0] == "A"
        assert res["a_status"] == "FINISHED_ABORTED", "A aborted while its load was in flight"
        assert res["free_after_abort"] == res["free_before"], "A's blocks came back"
        ref, after = res["reference"], res["after"]
        assert after["tokens"] == ref["tokens"]
        diff = max(abs(a - b) for a, b in zip(after["logprobs"], ref["logprobs"], strict=True))
        assert diff <= 1e-3
        assert after["cached"] >= 3 * BS, "the next request loaded the prompt from GCache"
        assert res["gcache"]["lookups"] >= 2
        deadline = time.monotonic() + 10
        while d.stats().counters["active_leases"] != 0:  # the releases are batched
            assert time.monotonic() < deadline, "a lease outlived its request"
            time.sleep(0.1)
