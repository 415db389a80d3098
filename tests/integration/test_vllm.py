"""End to end: real vLLM processes (CPU build, ``.venv-vllm``, made by
``make vllm-venv``) with ``gcache_client.vllm.GCacheConnector`` against a real
local deployment (meta + 2 servers).

Per model: a run without connector (the reference, and vLLM's own prefix-cache
reuse for the same prompts in one process), a writer process, then a fresh
reader process whose own cache is empty. Greedy tokens must be identical to the
reference and their logprobs within 1e-3 (float32); the reader must reuse at
least what vLLM's own prefix cache reuses. The toy MiMo-V2-Flash keeps vLLM's
hybrid KV cache manager on (the connector is ``SupportsHMA``) and its sliding
groups store one window per prompt. A last reader's GCache servers are killed
once its load has started: it must recompute and produce the same tokens.

Without ``.venv-vllm`` the module is skipped locally and FAILS under CI
(``CI`` set): ``make test`` builds the venv first.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache.cli.deploy import LocalDeployment
from tests.vllm_models import write_tiny_llama, write_tiny_mimo

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "tests" / "vllm_driver.py"
PROC_TIMEOUT = 600
HMA_OFF = "Turning off hybrid kv cache manager"

if not VLLM_PY.exists():
    if os.environ.get("CI"):
        pytest.fail(f"{VLLM_PY} missing: `make vllm-venv` must build it", pytrace=False)
    pytest.skip("no .venv-vllm (make vllm-venv)", allow_module_level=True)


def run_vllm(
    tmp: Path,
    name: str,
    spec: dict[str, Any],
    env: dict[str, str] | None = None,
    check: bool = True,
) -> Any:
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    penv = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log_path, "wb") as log:
        rc = subprocess.run(
            [str(VLLM_PY), str(DRIVER), str(spec_path), str(out_path)],
            cwd=ROOT,
            env=penv,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=PROC_TIMEOUT,
        ).returncode
    text = log_path.read_text(errors="replace")
    if not check and rc != 0:
        return {"rc": rc, "log": text}
    assert rc == 0, f"vLLM {name} exited {rc}:\n{text[-4000:]}"
    result = json.loads(out_path.read_text())
    result["log"] = text
    result["rc"] = rc
    return result


def connector(d: LocalDeployment, **kw: Any) -> dict[str, Any]:
    # load_or_recompute compares fetch time with a GPU's prefill speed; on this
    # CPU build recomputing is never faster, so the rule is off here.
    return {"meta": d.meta_addr, "meta_grpc": d.meta_grpc, "load_or_recompute": False, **kw}


def same_outputs(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff <= 1e-3, f"{what}: logprobs differ by {diff}"


def counters(d: LocalDeployment) -> dict[str, float]:
    return dict(d.stats().counters)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


# ---- toy MiMo-V2-Flash: hybrid (full + sliding window 128), hybrid allocator on ----

MIMO_BS = 256  # GCache block = lcm of vLLM's group blocks (full 256, sliding 128)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm_mimo")
    model = str(write_tiny_mimo(tmp / "model"))
    rng = random.Random(7)
    a = rand_tokens(rng, 700)  # longer than the window, ends off a block boundary
    p = {
        "A": a,
        "B": a[:600] + rand_tokens(rng, 100),  # shares A's prefix off a block boundary
        "C": a[:512] + rand_tokens(rng, 200),  # shares A's prefix at a block boundary
        "D": rand_tokens(rng, 768),  # block aligned, sent twice (an exact repeat)
        "E": rand_tokens(rng, 100),  # shorter than the window and than a block
    }
    d = LocalDeployment(tmp / "deploy", servers=2, capacity="128MiB")
    d.start()
    try:
        out: dict[str, Any] = {"p": p, "d": d}
        out["ref"] = run_vllm(
            tmp, "ref", {"model": model, "prompts": [p[k] for k in "ABCDDE"], "connector": None}
        )
        c0 = counters(d)
        out["writer"] = run_vllm(
            tmp,
            "writer",
            {
                "model": model,
                "prompts": [p["A"], p["D"], p["E"]],
                "connector": connector(d),
                "max_num_batched_tokens": 256,  # chunked prefill
            },
        )
        out["after_write"] = counters(d)
        out["reader"] = run_vllm(
            tmp,
            "reader",
            {"model": model, "prompts": [p[k] for k in "ABCDE"], "connector": connector(d)},
        )
        out["after_read"] = counters(d)
        out["c0"] = c0
        pids = ",".join(str(s.popen.pid) for s in d.servers)
        out["killed"] = run_vllm(
            tmp,
            "killed",
            {
                "model": model,
                "prompts": [p["A"], p["D"]],
                "connector": connector(d, transport="tcp", timeout_s=2.0),
                "module": "tests.vllm_killer",
            },
            env={"GCACHE_TEST_KILL_PIDS": pids},
            check=False,
        )
        yield out
    finally:
        d.stop()


@pytest.mark.timeout(1800)
def test_vllm_mimo_reader_tokens_identical_to_no_connector(mimo: dict[str, Any]) -> None:
    ref, w, r = mimo["ref"]["outputs"], mimo["writer"]["outputs"], mimo["reader"]["outputs"]
    ref_by = dict(zip("ABCD", ref[:4], strict=True)) | {"E": ref[5]}
    for i, k in enumerate("ADE"):
        same_outputs(w[i], ref_by[k], f"writer {k}")
    for i, k in enumerate("ABCDE"):
        same_outputs(r[i], ref_by[k], f"reader {k}")


@pytest.mark.timeout(1800)
def test_vllm_mimo_reuse_at_least_vllm_own_prefix_cache(mimo: dict[str, Any]) -> None:
    ref, r = mimo["ref"]["outputs"], mimo["reader"]["outputs"]
    # vLLM's own reuse in one process: D sent twice, B and C after A.
    own_repeat, own_b, own_c = ref[4]["cached"], ref[1]["cached"], ref[2]["cached"]
    assert own_repeat == 512 and own_b == 512 and own_c == 512
    # The fresh reader: A and D come from GCache (its own cache is empty then).
    assert r[0]["cached"] >= own_b  # A: all but A's partial last block
    assert r[3]["cached"] >= own_repeat  # D: an exact repeat, all but its last block
    assert r[1]["cached"] >= own_b and r[2]["cached"] >= own_c
    m = mimo["reader"]["metrics"]
    assert m["vllm:external_prefix_cache_hits"] >= 1024
    assert m["vllm:prompt_tokens_by_source/external_kv_transfer"] >= 1024
    before, after = mimo["after_write"], mimo["after_read"]
    # GCache's own count: the reader's lookups hit at least A's and D's 512 tokens.
    assert after["hit_tokens"] - before["hit_tokens"] >= 1024


@pytest.mark.timeout(1800)
def test_vllm_mimo_hybrid_manager_on_and_windows_o_w(mimo: dict[str, Any]) -> None:
    for run in ("writer", "reader"):
        assert HMA_OFF not in mimo[run]["log"], f"{run}: vLLM turned the hybrid manager off"
    c = mimo["after_write"]
    swa = sum(v for k, v in c.items() if k.startswith("bytes_stored_swa"))
    full = c.get("bytes_stored_full", 0)
    # Stored: A and D, 2 blocks each (up to the last boundary before the last token).
    # Full objects: 2 layers x 256 rows x 1 head x 64 x (K+V) x 4 B = 256 KiB per block.
    assert full == 4 * 256 * 1024
    # Sliding windows: one block per prompt (tail = ceil(127/256) = 1), 4 layers x 256
    # rows x 2 heads x 64 x (K+V) x 4 B = 1 MiB each: O(W), not O(prompt).
    assert swa == 2 * 1024 * 1024


@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32 refuses block-level load failures (invalid_block_ids) with several "
    "KV cache groups; a hybrid model needs asynchronous loads reporting failed_recving",
)
@pytest.mark.timeout(1800)
def test_vllm_mimo_killed_server_during_load_recomputes_identical(mimo: dict[str, Any]) -> None:
    k = mimo["killed"]
    assert k["rc"] == 0, "the engine died on the load failure"
    ref = mimo["ref"]["outputs"]
    same_outputs(k["outputs"][0], ref[0], "A after killed servers")
    same_outputs(k["outputs"][1], ref[3], "D after killed servers")
    assert "GCache load of" in k["log"] and "vLLM recomputes" in k["log"]


# ---- tiny Llama: full attention only -------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm_llama")
    model = str(write_tiny_llama(tmp / "model"))
    rng = random.Random(11)
    p1 = rand_tokens(rng, 600)
    p = {"P1": p1, "P2": p1[:300] + rand_tokens(rng, 300), "P3": rand_tokens(rng, 512)}
    d = LocalDeployment(tmp / "deploy", servers=2, capacity="64MiB")
    d.start()
    try:
        out: dict[str, Any] = {"p": p}
        prompts = [p["P1"], p["P2"], p["P3"], p["P3"]]
        out["ref"] = run_vllm(tmp, "ref", {"model": model, "prompts": prompts, "connector": None})
        out["writer"] = run_vllm(
            tmp,
            "writer",
            {"model": model, "prompts": [p["P1"], p["P3"]], "connector": connector(d)},
        )
        out["reader"] = run_vllm(
            tmp,
            "reader",
            {
                "model": model,
                "prompts": [p["P2"], p["P1"], p["P3"]],
                "connector": connector(d),
            },
        )
        pids = ",".join(str(s.popen.pid) for s in d.servers)
        out["killed"] = run_vllm(
            tmp,
            "killed",
            {
                "model": model,
                "prompts": [p["P1"], p["P3"]],
                "connector": connector(d, transport="tcp", timeout_s=2.0),
                "module": "tests.vllm_killer",
            },
            env={"GCACHE_TEST_KILL_PIDS": pids},
        )
        yield out
    finally:
        d.stop()


@pytest.mark.timeout(1800)
def test_vllm_llama_reader_identical_and_reuses(llama: dict[str, Any]) -> None:
    ref, w, r = llama["ref"]["outputs"], llama["writer"]["outputs"], llama["reader"]["outputs"]
    same_outputs(w[0], ref[0], "writer P1")
    same_outputs(w[1], ref[2], "writer P3")
    same_outputs(r[0], ref[1], "reader P2")
    same_outputs(r[1], ref[0], "reader P1")
    same_outputs(r[2], ref[2], "reader P3")
    # vLLM's own reuse: P2 after P1 (300 shared -> 256), P3 repeated (all but a block).
    assert ref[1]["cached"] == 256 and ref[3]["cached"] == 384
    assert r[0]["cached"] >= ref[1]["cached"]  # P2 first in the reader: from GCache
    assert r[2]["cached"] >= ref[3]["cached"]  # P3: an exact repeat, from GCache
    assert r[1]["cached"] == 512  # P1: 256 local (after P2) + 256 from GCache
    assert llama["reader"]["metrics"]["vllm:external_prefix_cache_hits"] >= 256 + 256 + 384


@pytest.mark.timeout(1800)
def test_vllm_killed_server_during_load_recomputes_identical(llama: dict[str, Any]) -> None:
    ref, k = llama["ref"]["outputs"], llama["killed"]
    same_outputs(k["outputs"][0], ref[0], "P1 after killed servers")
    same_outputs(k["outputs"][1], ref[2], "P3 after killed servers")
    assert "GCache load of" in k["log"] and "vLLM recomputes" in k["log"]
