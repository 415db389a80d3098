"""End to end: real vLLM processes (CPU build, ``.venv-vllm``, made by
``make vllm-venv``) with ``gcache_client.engines.vllm.connector.GCacheConnector`` against a real
local deployment (meta + 2 servers) per model.

Per model three vLLM processes, each running all of that model's cases in one
instance (tests/vllm_driver.py phases), shared by every test (one module-scoped
fixture): a run without connector (the reference, and vLLM's own prefix-cache
reuse for the same prompts in one process), a writer (chunked prefill), then a
fresh reader process whose own cache is empty. Greedy tokens must be identical to
the reference and their logprobs within 1e-3 (float32); the reader must reuse at
least what vLLM's own prefix cache reuses. The toy MiMo-V2-Flash keeps vLLM's
hybrid KV cache manager on (the connector is ``SupportsHMA``) and its sliding
groups store one window per prompt. The reader's last phase empties vLLM's own
prefix cache and kills the deployment's GCache servers once a load has started
(``tests.vllm_killer``, armed by a file only then): it must recompute and produce
the same tokens. Readers read over TCP: a killed server's shared memory stays
mapped and readable, so only network reads fail (shared-memory reads into
engine buffers are covered by tests/integration/test_native_paths.py); writers
use the default transport (shared memory here).

Where the seconds go (2 busy cores; two processes at a time, three rounds):
the module took 598 s with 8 processes in sequence (reference, writer, reader and
killed-server run per model), ~75 s each: vLLM's import in the driver, a V1
engine-core subprocess that imports vLLM and torch again and handshakes
(~45 s of each start), and ~6 s of interpreter teardown. Now (110-123 s for
the module, 6 processes, 2 at a time): per process, importing vLLM takes 8-15 s
alone and 21-29 s when two start together (about half of everything); engine
start 5-10 s (config, platform, weights 0.25 s, KV cache + profile 0.7 s: the toy
models are 13-18 MB, smaller ones would not save time); the first ``generate``
4-8 s of one-off warm-up, later prompts 0.3-2.7 s; the connector's shutdown flush
1-2.5 s. The engine core runs in the driver's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the driver skips the interpreter's
teardown once the engine is shut down (``os._exit``).

Without ``.venv-vllm`` the module is skipped locally and FAILS under CI
(``CI`` set, collection error): ``make test`` builds the venv first and says so
in one line when it cannot.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache.cli.deploy import LocalDeployment
from tests.vllm_models import write_tiny_llama, write_tiny_mimo
from tests.vllm_run import VLLM_PY, Run

MAX_PARALLEL = 2  # vLLM processes at once (2 cores; each ~2 GB)
HMA_OFF = "Turning off hybrid kv cache manager"
PHASE_MARK = "=== vllm_driver phase"

if not VLLM_PY.exists():
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{VLLM_PY} missing: `make vllm-venv` must build it", pytrace=False)
    pytest.skip("no .venv-vllm (make vllm-venv)", allow_module_level=True)


def run_vllm(tmp: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> Run:
    return Run(tmp, name, spec, env or {})


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


def phase_log(run: dict[str, Any], name: str) -> str:
    """The part of a run's log its driver wrote during phase ``name``."""
    parts = run["log"].split(PHASE_MARK)
    return next((p for p in parts if p.startswith(f" {name}\n")), "")


MIMO_BS = 256  # GCache block = lcm of vLLM's group blocks (full 256, sliding 128)


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both models' deployments and all their vLLM processes, shared by every test:
    per model a reference (no connector), a writer, then a fresh reader whose last
    phase kills the deployment's servers during a load. Up to MAX_PARALLEL
    processes run at once (a reader starts once its writer is done)."""
    tmp = tmp_path_factory.mktemp("vllm")
    out: dict[str, Any] = {}
    deployments: list[LocalDeployment] = []
    running: dict[str, Run] = {}
    try:
        # ---- toy MiMo-V2-Flash: hybrid (full + sliding window 128), hybrid allocator on
        mimo_model = str(write_tiny_mimo(tmp / "mimo"))
        rng = random.Random(7)
        a = rand_tokens(rng, 700)  # longer than the window, ends off a block boundary
        mp = {
            "A": a,
            "B": a[:600] + rand_tokens(rng, 100),  # shares A's prefix off a block boundary
            "C": a[:512] + rand_tokens(rng, 200),  # shares A's prefix at a block boundary
            "D": rand_tokens(rng, 768),  # block aligned, sent twice (an exact repeat)
            "E": rand_tokens(rng, 100),  # shorter than the window and than a block
        }
        dm = LocalDeployment(tmp / "deploy_mimo", servers=2, capacity="128MiB")
        deployments.append(dm)
        dm.start()
        # ---- tiny Llama: full attention only
        llama_model = str(write_tiny_llama(tmp / "llama"))
        rng = random.Random(11)
        p1 = rand_tokens(rng, 600)
        lp = {"P1": p1, "P2": p1[:300] + rand_tokens(rng, 300), "P3": rand_tokens(rng, 512)}
        dl = LocalDeployment(tmp / "deploy_llama", servers=2, capacity="64MiB")
        deployments.append(dl)
        dl.start()

        def pids(d: LocalDeployment) -> list[int]:
            return [s.popen.pid for s in d.servers]

        # (name, the run it waits for, spec)
        jobs: list[tuple[str, str, dict[str, Any]]] = [
            (
                "mimo.writer",
                "",
                {
                    "model": mimo_model,
                    "phases": [{"name": "write", "prompts": [mp["A"], mp["D"], mp["E"]]}],
                    "connector": connector(dm),
                    "max_num_batched_tokens": 256,  # chunked prefill
                    "stats_grpc": dm.meta_grpc,
                },
            ),
            (
                "llama.writer",
                "",
                {
                    "model": llama_model,
                    "phases": [{"name": "write", "prompts": [lp["P1"], lp["P3"]]}],
                    "connector": connector(dl),
                    "stats_grpc": dl.meta_grpc,
                },
            ),
            (
                "mimo.reader",
                "mimo.writer",
                {
                    "model": mimo_model,
                    "phases": [
                        {"name": "read", "prompts": [mp[k] for k in "ABCDE"]},
                        {
                            "name": "killed",
                            "prompts": [mp["A"], mp["D"]],
                            "reset_prefix_cache": True,
                            "kill_pids": pids(dm),
                        },
                    ],
                    # TCP reads: a killed server's shared memory stays mapped and
                    # readable, so only network reads fail when it dies.
                    "connector": connector(dm, transport="tcp", timeout_s=2.0),
                    "module": "tests.vllm_killer",
                    "stats_grpc": dm.meta_grpc,
                },
            ),
            (
                "llama.reader",
                "llama.writer",
                {
                    "model": llama_model,
                    "phases": [
                        {"name": "read", "prompts": [lp["P2"], lp["P1"], lp["P3"]]},
                        {
                            "name": "killed",
                            "prompts": [lp["P1"], lp["P3"]],
                            "reset_prefix_cache": True,
                            "kill_pids": pids(dl),
                        },
                    ],
                    "connector": connector(dl, transport="tcp", timeout_s=2.0),
                    "module": "tests.vllm_killer",
                    "stats_grpc": dl.meta_grpc,
                },
            ),
            (
                "mimo.ref",
                "",
                {
                    "model": mimo_model,
                    "phases": [{"name": "ref", "prompts": [mp[k] for k in "ABCDDE"]}],
                    "connector": None,
                },
            ),
            (
                "llama.ref",
                "",
                {
                    "model": llama_model,
                    "phases": [
                        {"name": "ref", "prompts": [lp[k] for k in ("P1", "P2", "P3", "P3")]}
                    ],
                    "connector": None,
                },
            ),
        ]
        t0 = time.monotonic()
        while jobs or running:
            for name in [n for n, r in running.items() if r.proc.poll() is not None]:
                out[name] = running.pop(name).result()
            for job in list(jobs):
                name, dep, spec = job
                if len(running) < MAX_PARALLEL and (not dep or dep in out):
                    jobs.remove(job)
                    kill_file = {"GCACHE_TEST_KILL_FILE": str(tmp / f"{name}.kill")}
                    running[name] = run_vllm(tmp, name, spec, kill_file)
            time.sleep(0.2)
        out["wall"] = time.monotonic() - t0
        out["mimo.p"], out["llama.p"] = mp, lp
        yield out
    finally:
        for r in running.values():
            r.proc.kill()
            r.proc.wait()
        for d in deployments:
            d.stop()


# ---- toy MiMo-V2-Flash: hybrid (full + sliding window 128), hybrid allocator on ----


@pytest.mark.timeout(1800)
def test_vllm_mimo_reader_tokens_identical_to_no_connector(vllm_runs: dict[str, Any]) -> None:
    ref = vllm_runs["mimo.ref"]["phases"]["ref"]["outputs"]
    w = vllm_runs["mimo.writer"]["phases"]["write"]["outputs"]
    r = vllm_runs["mimo.reader"]["phases"]["read"]["outputs"]
    ref_by = dict(zip("ABCD", ref[:4], strict=True)) | {"E": ref[5]}
    for i, k in enumerate("ADE"):
        same_outputs(w[i], ref_by[k], f"writer {k}")
    for i, k in enumerate("ABCDE"):
        same_outputs(r[i], ref_by[k], f"reader {k}")


@pytest.mark.timeout(1800)
def test_vllm_mimo_reuse_at_least_vllm_own_prefix_cache(vllm_runs: dict[str, Any]) -> None:
    ref = vllm_runs["mimo.ref"]["phases"]["ref"]["outputs"]
    read = vllm_runs["mimo.reader"]["phases"]["read"]
    r = read["outputs"]
    # vLLM's own reuse in one process: D sent twice, B and C after A.
    own_repeat, own_b, own_c = ref[4]["cached"], ref[1]["cached"], ref[2]["cached"]
    assert own_repeat == 512 and own_b == 512 and own_c == 512
    # The fresh reader: A and D come from GCache (its own cache is empty then).
    assert r[0]["cached"] >= own_b  # A: all but A's partial last block
    assert r[3]["cached"] >= own_repeat  # D: an exact repeat, all but its last block
    assert r[1]["cached"] >= own_b and r[2]["cached"] >= own_c
    m = read["metrics"]
    assert m["vllm:external_prefix_cache_hits"] >= 1024
    assert m["vllm:prompt_tokens_by_source/external_kv_transfer"] >= 1024
    before, after = vllm_runs["mimo.writer"]["gcache_final"], read["gcache"]
    # GCache's own count: the reader's lookups hit at least A's and D's 512 tokens.
    assert after["hit_tokens"] - before["hit_tokens"] >= 1024


@pytest.mark.timeout(1800)
def test_vllm_mimo_hybrid_manager_on_and_windows_o_w(vllm_runs: dict[str, Any]) -> None:
    for run in ("mimo.writer", "mimo.reader"):
        assert HMA_OFF not in vllm_runs[run]["log"], f"{run}: vLLM turned the hybrid manager off"
        assert vllm_runs[run]["info"].get("hybrid_kv_cache_manager") is True, run
    c = vllm_runs["mimo.writer"]["gcache_final"]
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
def test_vllm_mimo_killed_server_during_load_recomputes_identical(
    vllm_runs: dict[str, Any],
) -> None:
    k = vllm_runs["mimo.reader"]["phases"]["killed"]
    assert "error" not in k, f"the engine died on the load failure: {k.get('error')}"
    ref = vllm_runs["mimo.ref"]["phases"]["ref"]["outputs"]
    same_outputs(k["outputs"][0], ref[0], "A after killed servers")
    same_outputs(k["outputs"][1], ref[3], "D after killed servers")
    log = phase_log(vllm_runs["mimo.reader"], "killed")
    assert "GCache load of" in log and "vLLM recomputes" in log


# ---- tiny Llama: full attention only -------------------------------------------


@pytest.mark.timeout(1800)
def test_vllm_llama_reader_identical_and_reuses(vllm_runs: dict[str, Any]) -> None:
    ref = vllm_runs["llama.ref"]["phases"]["ref"]["outputs"]
    w = vllm_runs["llama.writer"]["phases"]["write"]["outputs"]
    read = vllm_runs["llama.reader"]["phases"]["read"]
    r = read["outputs"]
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
    assert read["metrics"]["vllm:external_prefix_cache_hits"] >= 256 + 256 + 384
    assert "GCache load of" not in phase_log(vllm_runs["llama.reader"], "read")


@pytest.mark.timeout(1800)
def test_vllm_killed_server_during_load_recomputes_identical(vllm_runs: dict[str, Any]) -> None:
    ref = vllm_runs["llama.ref"]["phases"]["ref"]["outputs"]
    k = vllm_runs["llama.reader"]["phases"]["killed"]
    assert "error" not in k, f"the engine died on the load failure: {k.get('error')}"
    same_outputs(k["outputs"][0], ref[0], "P1 after killed servers")
    same_outputs(k["outputs"][1], ref[2], "P3 after killed servers")
    log = phase_log(vllm_runs["llama.reader"], "killed")
    assert "GCache load of" in log and "vLLM recomputes" in log
