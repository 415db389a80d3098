"""Encoder outputs shared through GCache
(``gcache_client.engines.vllm.ec.connector.GCacheECConnector``) against a real local
deployment (meta + 2 servers).

End to end: real vLLM processes (CPU build, ``.venv-vllm``; tests/vllm_mm_driver.py)
serving the tiny BLIP-2 of tests/vllm_mm_models.py, images made from seeds:

* ``ref``: no EC connector, images 1, 2, 3 (the cold outputs) - at the same time
  as ``writer``: EC connector, images 1 and 2 (its encoder runs for both and it
  stores both);
* ``reader``: a fresh instance with the connector: images 1 and 2 again (its
  vision tower must not run: its forward calls are counted by the driver), then
  image 3, which nobody stored (a miss: the tower runs once);
* ``down``: the deployment's servers SIGKILLed, a fresh instance reads over TCP:
  the meta still answers (the match is leased) but every read fails: misses, the
  tower runs for every image, and the outputs are the cold ones.

Every output (greedy tokens, logprobs within 1e-3) equals ``ref``'s for the same
image. Two vLLM processes at most run at once; the module takes about a minute
and a half on 2 busy cores.

The storage layer (``ECStore``) is also tested here without vLLM: round trip,
misses for other identifiers, widths, dtypes and salts, headers that do not
match, and eviction of part of an object.

Without ``.venv-vllm`` the vLLM tests are skipped locally and FAIL under CI.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gcache.cli.deploy import LocalDeployment
from gcache_client.engines.vllm.ec.store import (
    HEADER_BYTES,
    ECConfig,
    ECStore,
    key_tokens,
    row_bytes,
    rows,
)
from tests.vllm_mm_models import write_tiny_blip2
from tests.vllm_run import MM_DRIVER, VLLM_PY
from tests.vllm_run import Run as VllmRun

MAX_PARALLEL = 2

if not VLLM_PY.exists() and os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
    pytest.fail(f"{VLLM_PY} missing: `make vllm-venv` must build it", pytrace=False)


# ---- the storage layer, no vLLM ---------------------------------------------------


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    d = LocalDeployment(tmp_path_factory.mktemp("ecstore"), servers=2, capacity="64MiB")
    d.start()
    yield d
    d.stop()


@pytest.fixture
def store(dep: LocalDeployment) -> Iterator[ECStore]:
    s = ECStore(ECConfig.from_extra({"meta": dep.meta_addr, "meta_grpc": dep.meta_grpc}), "m")
    yield s
    s.close()


def test_ec_store_round_trip_bit_exact(store: ECStore) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(577, 96, generator=g)  # not a whole block, odd row count
    assert store.store("img-a", t)
    got = store.fetch("img-a", "float32", 96, 577)
    assert got is not None and got.dtype == torch.float32 and got.shape == (577, 96)
    assert torch.equal(got, t)
    b = torch.randn(2, 8, 64, generator=g).to(torch.bfloat16)  # 3-D, bf16
    assert store.store("img-b", b, salt="tenant")
    got_b = store.fetch("img-b", "bfloat16", 64, 16, salt="tenant")
    assert got_b is not None and got_b.shape == (2, 8, 64) and torch.equal(got_b, b)
    s = store.stats()
    assert s["hits"] == 2 and s["stores"] == 2 and s["bytes_loaded"] == t.numel() * 4 + 2048


def test_ec_store_misses(store: ECStore) -> None:
    t = torch.ones(10, 32)
    assert store.store("img-c", t)
    before = store.stats().get("misses", 0)
    assert store.fetch("img-other", "float32", 32, 10) is None  # another image
    assert store.fetch("img-c", "float32", 32, 10, salt="other") is None  # another salt
    assert store.fetch("img-c", "float16", 32, 10) is None  # another dtype
    assert store.fetch("img-c", "float32", 16, 20) is None  # another width
    assert store.fetch("img-c", "float32", 32, 11) is None  # another row count
    assert store.stats()["misses"] - before == 5
    assert store.fetch("img-c", "float32", 32, 10) is not None


def test_ec_store_header_mismatch_is_a_miss(store: ECStore) -> None:
    """Bytes stored under the right keys but with a header saying something else
    (here: another identifier's digest) are refused, not returned."""
    t = torch.arange(20 * 32, dtype=torch.float32).reshape(20, 32)
    enc = store.encode("img-x", t)
    assert enc is not None
    buf, total, _width = enc
    ns = store.namespace("float32", 32, "")
    half = row_bytes(32, "float32") // 2
    res = store.client.put(
        ns, key_tokens("img-y", 20, 32, total), [store._halves(buf, total, half)]
    )
    assert res.ok and res.stored > 0
    assert store.fetch("img-y", "float32", 32, 20) is None
    assert store.stats()["load_errors"] >= 1


def test_ec_store_partly_evicted_object_is_a_miss(store: ECStore) -> None:
    t = torch.randn(200, 64)  # several blocks
    assert store.store("img-e", t)
    total = rows(200, 64, "float32", store.config.block_rows)
    nblocks = total // store.config.block_rows
    assert nblocks > 2
    ns = store.namespace("float32", 64, "")
    toks = key_tokens("img-e", 200, 64, total)
    # The last block (a block with cached descendants cannot be evicted alone).
    evicted, _ = store.client.evict(
        ns, toks, blocks=range(nblocks - 1, nblocks), windows_only=False
    )
    assert evicted == 1
    assert store.fetch("img-e", "float32", 64, 200) is None


def test_ec_header_layout() -> None:
    assert HEADER_BYTES == 64
    assert rows(8, 128, "float32", 16) == 16  # 64 + 4096 bytes in 512-byte rows
    a, b = key_tokens("x", 8, 128, 16), key_tokens("y", 8, 128, 16)
    assert len(a) == 16 and not np.array_equal(a, b)


# ---- end to end: vLLM processes ---------------------------------------------------


def Run(tmp: Path, name: str, spec: dict[str, Any]) -> VllmRun:
    """One vLLM process of tests/vllm_mm_driver.py in the background."""
    return VllmRun(tmp, name, spec, driver=MM_DRIVER)


def prompts(*seeds: int) -> list[dict[str, Any]]:
    return [{"images": [s]} for s in seeds]


def ec(d: LocalDeployment, **kw: Any) -> dict[str, Any]:
    extra = {"meta": d.meta_addr, "meta_grpc": d.meta_grpc, **kw}
    return {"name": "GCacheECConnector", "module": "gcache_client.vllm_ec", "extra": extra}


def same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff <= 1e-3, f"{what}: logprobs differ by {diff}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm (make vllm-venv)")
    tmp = tmp_path_factory.mktemp("vllm_ec")
    model = str(write_tiny_blip2(tmp / "blip2"))
    # The meta keeps SIGKILLed servers listed (no heartbeat timeout within the test):
    # the "down" instance's matches hit and its reads fail.
    d = LocalDeployment(
        tmp / "deploy", servers=2, capacity="64MiB", meta_args=["--heartbeat-timeout-s", "600"]
    )
    d.start()
    out: dict[str, Any] = {}
    started: list[Run] = []
    try:
        base = {"model": model, "max_tokens": 6, "stats_grpc": d.meta_grpc}
        ref = Run(tmp, "ref", {**base, "phases": [{"name": "ref", "prompts": prompts(1, 2, 3)}]})
        w_spec = {**base, "ec_connector": ec(d)}
        writer = Run(tmp, "writer", {**w_spec, "phases": [{"name": "w", "prompts": prompts(1, 2)}]})
        started += [ref, writer]
        out["writer"] = writer.result()  # its shutdown flushed its stores
        reader = Run(
            tmp,
            "reader",
            {
                **w_spec,
                "phases": [
                    {"name": "hits", "prompts": prompts(1, 2)},
                    {"name": "new", "prompts": prompts(3)},
                ],
            },
        )
        started.append(reader)
        out["reader"] = reader.result()
        out["ref"] = ref.result()
        for s in d.servers:  # reads fail from here on; the meta still answers
            os.kill(s.popen.pid, signal.SIGKILL)
        for s in d.servers:
            s.popen.wait()
        down = Run(
            tmp,
            "down",
            {
                **base,
                "stats_grpc": None,
                "ec_connector": ec(d, transport="tcp", timeout_s=2.0),
                "phases": [{"name": "down", "prompts": prompts(1, 2)}],
            },
        )
        started.append(down)
        out["down"] = down.result()
        yield out
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        d.stop()


@pytest.mark.timeout(900)
def test_vllm_ec_tokens_depend_on_the_image(runs: dict[str, Any]) -> None:
    ref = runs["ref"]["phases"]["ref"]
    r1, r2 = ref["outputs"][0], ref["outputs"][1]
    assert r1["tokens"] != r2["tokens"], "the toy model ignores its image"
    assert ref["encoder_calls"] == 3


@pytest.mark.timeout(900)
def test_vllm_ec_writer_encodes_and_stores(runs: dict[str, Any]) -> None:
    w = runs["writer"]
    ref = runs["ref"]["phases"]["ref"]["outputs"]
    ph = w["phases"]["w"]
    same(ph["outputs"][0], ref[0], "writer image 1")
    same(ph["outputs"][1], ref[1], "writer image 2")
    assert ph["encoder_calls"] == 2
    sched = ph["ec_stats"]["scheduler"]
    assert sched.get("hits", 0) == 0 and sched["sched_misses"] == 2
    # After its shutdown flush: one GCache object per image ([8, 128] float32 and
    # the header fit one 16-row block of 512 bytes), committed by the meta.
    assert w["gcache_final"]["objects_committed"] == 2
    assert w["gcache_final"]["bytes_stored"] == 2 * 16 * 512


@pytest.mark.timeout(900)
def test_vllm_ec_reader_skips_encoder_identical_outputs(runs: dict[str, Any]) -> None:
    ref = runs["ref"]["phases"]["ref"]["outputs"]
    hits = runs["reader"]["phases"]["hits"]
    same(hits["outputs"][0], ref[0], "reader image 1")
    same(hits["outputs"][1], ref[1], "reader image 2")
    assert hits["encoder_calls"] == 0, "the reader ran its vision encoder for cached images"
    sched = hits["ec_stats"]["scheduler"]
    assert sched["sched_hits"] == 2 and sched["hits"] == 2
    assert sched["bytes_loaded"] == 2 * 8 * 128 * 4  # two [8, 128] float32 outputs
    assert hits["ec_stats"]["worker"]["worker_installed"] == 2


@pytest.mark.timeout(900)
def test_vllm_ec_other_image_misses(runs: dict[str, Any]) -> None:
    ref = runs["ref"]["phases"]["ref"]["outputs"]
    new = runs["reader"]["phases"]["new"]
    same(new["outputs"][0], ref[2], "reader image 3")
    assert new["encoder_calls"] == 1
    sched = new["ec_stats"]["scheduler"]
    assert sched["sched_hits"] == 2 and sched["misses"] >= 1
    # The reader stores what it computed (image 3) and nothing it loaded.
    assert runs["reader"]["gcache_final"]["objects_committed"] == 3


@pytest.mark.timeout(900)
def test_vllm_ec_dead_servers_are_misses(runs: dict[str, Any]) -> None:
    ref = runs["ref"]["phases"]["ref"]["outputs"]
    down = runs["down"]["phases"]["down"]
    assert "error" not in down, down.get("error")
    same(down["outputs"][0], ref[0], "image 1, servers down")
    same(down["outputs"][1], ref[1], "image 2, servers down")
    assert down["encoder_calls"] == 2
    sched = down["ec_stats"]["scheduler"]
    assert sched.get("sched_hits", 0) == 0 and sched["sched_misses"] == 2
    # The matches hit (the meta still lists the servers) and the reads failed.
    assert sched["lookups"] == 2 and sched["load_errors"] == 2 and sched["misses"] == 2
