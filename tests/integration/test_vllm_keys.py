"""End to end: the vLLM connector never hands a request KV that another adapter,
another prompt embedding or another cache salt computed (real vLLM processes,
CPU build, ``.venv-vllm``; a real deployment: meta + 2 servers).

A tiny Llama with two PEFT LoRA adapters A and B (seeded weights on q/k/v/o, so
each changes K and V) and prompt embeddings on. Three processes:

* a reference without connector running the writer's phases and then the
  reader's, in one process: its greedy tokens are the truth, and its cached
  token counts are what vLLM's own prefix cache reuses for the same requests
  (its block hashes include the adapter, the embeddings and the salt);
* a writer with the connector: prompt P under adapter A, P with cache salt
  ``s1``, prompt embeddings E1, and a batch of Q under A and under B;
* a fresh reader with the connector: P under B, P with no adapter, P with salt
  ``s2``, embeddings E2 (same length as E1: the same all-zero token ids) must
  load nothing from GCache; P under A, P with ``s1``, E1 must load what the
  writer stored; a batch of Q under B and A (adapters mixed in one batch), and a
  batch of base-model requests mixing a salted prompt, embeddings and a plain
  prompt. Every output's tokens equal the reference's (logprobs within 1e-3),
  and every request reuses at least what vLLM's own prefix cache reuses.

vLLM 0.32's CPU build computes a batch mixing LoRA and base-model requests
wrongly by itself (the base requests run with an adapter; the same without the
connector), so the batches here mix adapters or mix base requests, not both.

Without ``.venv-vllm`` the module is skipped locally and FAILS under CI.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache.cli.deploy import LocalDeployment
from tests.integration.test_vllm import VLLM_PY, connector, rand_tokens, run_vllm, same_outputs
from tests.vllm_models import write_lora_adapter, write_tiny_llama

assert VLLM_PY.exists()  # importing test_vllm failed (CI) or skipped this module without it

BS = 128  # GCache block = vLLM's block for a full-attention model on CPU


def _phases() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    rng = random.Random(17)
    p = rand_tokens(rng, 600)
    q = rand_tokens(rng, 500)
    e1 = {"embeds_seed": 1, "n": 400}
    e2 = {"embeds_seed": 2, "n": 400}
    writer = [
        {
            "name": "w1",
            "prompts": [{"tokens": p, "lora": "A"}, {"tokens": p, "salt": "s1"}, e1],
        },
        {
            "name": "w2",
            "batch": True,
            "prompts": [{"tokens": q, "lora": "A"}, {"tokens": q, "lora": "B"}],
        },
    ]
    reader = [
        {"name": "B", "prompts": [{"tokens": p, "lora": "B"}]},
        {"name": "none", "prompts": [p]},
        {"name": "salt2", "prompts": [{"tokens": p, "salt": "s2"}]},
        {"name": "E2", "prompts": [e2]},
        {"name": "A", "prompts": [{"tokens": p, "lora": "A"}]},
        {"name": "salt1", "prompts": [{"tokens": p, "salt": "s1"}]},
        {"name": "E1", "prompts": [e1]},
        {
            "name": "mixed_lora",
            "batch": True,
            "prompts": [{"tokens": q, "lora": "B"}, {"tokens": q, "lora": "A"}],
        },
        {
            "name": "mixed_base",
            "batch": True,
            "prompts": [{"tokens": q, "salt": "s1"}, e1, q, e2],
        },
    ]
    return writer, reader, {"p": p, "q": q}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("vllm_keys")
    model = str(write_tiny_llama(tmp / "llama"))
    loras = {
        "A": {"id": 1, "path": str(write_lora_adapter(tmp / "lora_a", seed=101))},
        "B": {"id": 2, "path": str(write_lora_adapter(tmp / "lora_b", seed=202))},
    }
    writer, reader, _ = _phases()
    base = {"model": model, "loras": loras, "prompt_embeds": True, "max_tokens": 4}
    d = LocalDeployment(tmp / "deploy", servers=2, capacity="64MiB")
    d.start()
    try:
        ref = run_vllm(tmp, "ref", {**base, "phases": writer + reader, "connector": None})
        w = run_vllm(
            tmp,
            "writer",
            {**base, "phases": writer, "connector": connector(d), "stats_grpc": d.meta_grpc},
        )
        wres = w.result()
        r = run_vllm(
            tmp,
            "reader",
            {**base, "phases": reader, "connector": connector(d), "stats_grpc": d.meta_grpc},
        )
        yield {"ref": ref.result(), "writer": wres, "reader": r.result()}
    finally:
        d.stop()


def _out(run: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    rec = run["phases"][phase]
    assert "error" not in rec, f"{phase}: {rec.get('error')}"
    return list(rec["outputs"])


def test_every_output_equals_the_reference(runs: dict[str, Any]) -> None:
    writer, reader, _ = _phases()
    for role, phases in (("writer", writer), ("reader", reader)):
        for ph in phases:
            got, want = _out(runs[role], ph["name"]), _out(runs["ref"], ph["name"])
            assert len(got) == len(want) == len(ph["prompts"])
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                same_outputs(g, w, f"{role} {ph['name']}[{i}]")


def test_other_adapter_embeddings_or_salt_load_nothing(runs: dict[str, Any]) -> None:
    # Same token ids as what the writer stored (E2: the same all-zero ids as E1),
    # but other KV: vLLM's own prefix cache reuses nothing, nor may GCache.
    for phase in ("B", "none", "salt2", "E2"):
        assert [o["cached"] for o in _out(runs["ref"], phase)] == [0], phase
        assert [o["cached"] for o in _out(runs["reader"], phase)] == [0], phase


def test_reuse_where_valid_at_least_vllms_own(runs: dict[str, Any]) -> None:
    stored = {"A": 512, "salt1": 512, "E1": 384}  # full blocks before the last token
    for phase, n in stored.items():
        got = [o["cached"] for o in _out(runs["reader"], phase)]
        ref = [o["cached"] for o in _out(runs["ref"], phase)]
        assert ref == [n], (phase, ref)
        assert got == [n], f"{phase}: the fresh reader loaded {got} tokens, vLLM's own {ref}"
    for phase in ("mixed_lora", "mixed_base"):
        got = [o["cached"] for o in _out(runs["reader"], phase)]
        ref = [o["cached"] for o in _out(runs["ref"], phase)]
        assert all(g >= r for g, r in zip(got, ref, strict=True)), (phase, got, ref)
    # Q under A and under B were stored by the writer's mixed batch: both load.
    assert [o["cached"] for o in _out(runs["reader"], "mixed_lora")] == [384, 384]


def test_every_request_keyed_and_no_connector_errors(runs: dict[str, Any]) -> None:
    # Adapters with readable files, multimodal-free prompts, embeddings: all keyable;
    # no load or store failed (the connector logs each as one line).
    for role in ("writer", "reader"):
        log = runs[role]["log"]
        for bad in ("neither loaded nor stored", "GCache load of", "GCache async load of"):
            assert bad not in log, f"{role}: {bad!r} in the log"
        assert "store of" not in log or "failed" not in log, role
