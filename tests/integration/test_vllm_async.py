"""End to end, ``load_mode="async"``: real vLLM processes (CPU build, ``.venv-vllm``)
with ``GCacheConnector`` against a real local deployment, on the toy MiMo-V2-Flash
(full attention + sliding window 128: several KV cache groups, vLLM's hybrid KV
cache manager on).

In async mode a hit is loaded before the request is scheduled and reported through
``get_transfer_results``; a failed load is reported per request
(``failed_recving``), which vLLM 0.32 recomputes with any number of KV cache
groups (block-level failures, the layerwise path's report, stop its engine core
when there are several groups). Runs: a reference without connector, a writer, a
fresh async reader (loads, tokens identical), and a fresh async reader whose
GCache servers are SIGKILLed right after its scheduler got a match (the meta
still lists them, so the load is attempted and fails): the engine survives, the
request is recomputed, its greedy tokens equal the reference.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache.cli.deploy import LocalDeployment
from tests.vllm_models import write_tiny_mimo
from tests.vllm_run import TREE_PATH

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
PROC_TIMEOUT = 600
HMA_OFF = "Turning off hybrid kv cache manager"

if not VLLM_PY.exists():
    if os.environ.get("CI"):
        pytest.fail(f"{VLLM_PY} missing: `make vllm-venv` must build it", pytrace=False)
    pytest.skip("no .venv-vllm (make vllm-venv)", allow_module_level=True)

# One vLLM instance: prompts in order (one generate each), greedy; JSON out.
DRIVER = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    def main():
        spec = json.load(open(sys.argv[1]))
        kw = {}
        if spec["connector"] is not None:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="GCacheConnector",
                kv_connector_module_path=spec["module"],
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=spec["connector"],
            )
        llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
                  gpu_memory_utilization=0.1, dtype="float32", max_model_len=4096,
                  disable_log_stats=False, seed=0, **kw)
        sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
        outs = []
        for p in spec["prompts"]:
            c = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            outs.append({"tokens": list(c.token_ids), "logprobs": lps})
        metrics = {}
        for m in llm.get_metrics():
            if "prefix_cache" in m.name or "by_source" in m.name:
                key = m.name + (f"/{m.labels['source']}" if "source" in m.labels else "")
                metrics[key] = metrics.get(key, 0.0) + float(getattr(m, "value", 0) or 0)
        json.dump({"outputs": outs, "metrics": metrics}, open(sys.argv[2], "w"))

    if __name__ == "__main__":
        main()
    """
)

# The connector of the killed run: SIGKILLs the GCache servers once its scheduler
# got a match (so the worker's load is attempted against dead servers).
KILLER = textwrap.dedent(
    """
    import os, signal, time
    from gcache_client.engines.vllm.connector import GCacheConnector as _Base

    def _gone(pid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().split(")")[-1].split()[0] in "ZX"
        except OSError:
            return True

    class GCacheConnector(_Base):
        _killed = False

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
            pids = [int(p) for p in os.environ.get("GCACHE_TEST_KILL_PIDS", "").split(",") if p]
            if n and pids and not GCacheConnector._killed:
                GCacheConnector._killed = True
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
                    time.sleep(0.01)
                print("GCACHE-TEST killed the servers after a match of", n, flush=True)
            return n, load_async
    """
)


def run_vllm(tmp: Path, name: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    penv = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": f"{tmp}{os.pathsep}{TREE_PATH}",
        **env,
    }
    with open(log_path, "wb") as log:
        rc = subprocess.run(
            [str(VLLM_PY), str(tmp / "driver.py"), str(spec_path), str(out_path)],
            cwd=ROOT,
            env=penv,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=PROC_TIMEOUT,
        ).returncode
    text = log_path.read_text(errors="replace")
    assert rc == 0, f"vLLM {name} exited {rc}:\n{text[-4000:]}"
    return {**json.loads(out_path.read_text()), "log": text}


def same_outputs(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff <= 1e-3, f"{what}: logprobs differ by {diff}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm_async")
    (tmp / "driver.py").write_text(DRIVER)
    (tmp / "gcache_async_killer.py").write_text(KILLER)
    model = str(write_tiny_mimo(tmp / "mimo"))
    rng = random.Random(23)
    a = [rng.randrange(3, 2000) for _ in range(700)]  # longer than the window
    prompts = {
        "A": a,
        "B": a[:600] + [rng.randrange(3, 2000) for _ in range(100)],  # off a boundary
        "D": [rng.randrange(3, 2000) for _ in range(768)],  # block aligned
    }
    d = LocalDeployment(tmp / "deploy", servers=2, capacity="128MiB")
    d.start()
    try:

        def conn(**kw: Any) -> dict[str, Any]:
            # TCP reads: a killed server's shared memory would stay readable.
            return {
                "meta": d.meta_addr,
                "meta_grpc": d.meta_grpc,
                "load_or_recompute": False,
                "load_mode": "async",
                "transport": "tcp",
                "timeout_s": 2.0,
                **kw,
            }

        base = {"model": model, "module": "gcache_client.vllm"}
        ps = [prompts[k] for k in "ABD"]
        out: dict[str, Any] = {"prompts": prompts}
        out["ref"] = run_vllm(tmp, "ref", {**base, "prompts": ps, "connector": None}, {})
        writes = [prompts["A"], prompts["D"]]
        out["writer"] = run_vllm(
            tmp, "writer", {**base, "prompts": writes, "connector": conn()}, {}
        )
        out["reader"] = run_vllm(tmp, "reader", {**base, "prompts": ps, "connector": conn()}, {})
        pids = ",".join(str(s.popen.pid) for s in d.servers)
        out["killed"] = run_vllm(
            tmp,
            "killed",
            {**base, "prompts": ps, "connector": conn(), "module": "gcache_async_killer"},
            {"GCACHE_TEST_KILL_PIDS": pids},
        )
        yield out
    finally:
        d.stop()


@pytest.mark.timeout(1800)
def test_vllm_async_mimo_reader_loads_and_tokens_identical(runs: dict[str, Any]) -> None:
    ref, reader = runs["ref"], runs["reader"]
    for i, (got, want) in enumerate(zip(reader["outputs"], ref["outputs"], strict=True)):
        same_outputs(got, want, f"async reader prompt {i}")
    ext = reader["metrics"].get("vllm:prompt_tokens_by_source/external_kv_transfer", 0)
    assert ext >= 512 + 512, f"async reader loaded only {ext} tokens: {reader['metrics']}"
    assert HMA_OFF not in reader["log"]
    assert "async load of" not in reader["log"]  # no failure logged


@pytest.mark.timeout(1800)
def test_vllm_async_mimo_killed_server_during_load_recomputes_identical(
    runs: dict[str, Any],
) -> None:
    ref, killed = runs["ref"], runs["killed"]
    log = killed["log"]
    assert "GCACHE-TEST killed the servers" in log
    assert "GCache async load of" in log and "vLLM recomputes it" in log, log[-3000:]
    assert "block-level load failures" not in log and HMA_OFF not in log
    # recomputed: nothing counted as loaded, as much computed as without connector
    m, mref = killed["metrics"], ref["metrics"]
    assert m.get("vllm:prompt_tokens_by_source/external_kv_transfer", 0) == 0, m
    assert (
        m["vllm:prompt_tokens_by_source/local_compute"]
        == (mref["vllm:prompt_tokens_by_source/local_compute"])
    )
    for i, (got, want) in enumerate(zip(killed["outputs"], ref["outputs"], strict=True)):
        same_outputs(got, want, f"killed-server reader prompt {i}")
