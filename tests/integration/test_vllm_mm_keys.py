"""End to end: the vLLM KV connector keys multimodal prompts by their images.
Two different images behind the same placeholder tokens and the same text are
different KV: a reader must never load the KV another image computed, and must
load its own (real vLLM processes with the tiny BLIP-2 of
tests/vllm_mm_models.py, ``.venv-vllm``; a real deployment).

* a reference without connector: image 1, image 2, image 1 again (greedy truth,
  and what vLLM's own prefix cache reuses: its block hashes carry the image hash);
* a writer with the connector serves image 1 with a text longer than two GCache
  blocks;
* a fresh reader serves image 2 with the same text (loads nothing), then image 1
  (loads what the writer stored). Tokens equal the reference's.

Without ``.venv-vllm`` the module is skipped locally and FAILS under CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache.cli.deploy import LocalDeployment
from tests.integration.test_vllm import VLLM_PY
from tests.integration.test_vllm_ec import Run, same
from tests.vllm_mm_models import PROMPT, write_tiny_blip2

assert VLLM_PY.exists()  # importing test_vllm failed (CI) or skipped this module without it

# Byte-level tokens: ~330 text tokens after the 8 image placeholders, so the
# image sits in the first of two full 128-token GCache blocks that are stored.
TEXT = "Context: " + " ".join(f"item{i:03d}" for i in range(40)) + ". " + PROMPT
STORED = 256  # full blocks before the last token


def _kv(d: LocalDeployment) -> dict[str, Any]:
    extra = {"meta": d.meta_addr, "meta_grpc": d.meta_grpc, "load_or_recompute": False}
    return {"name": "GCacheConnector", "module": "gcache_client.vllm", "extra": extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("vllm_mm_keys")
    model = str(write_tiny_blip2(tmp / "blip2"))
    one, two = {"text": TEXT, "images": [1]}, {"text": TEXT, "images": [2]}
    d = LocalDeployment(tmp / "deploy", servers=2, capacity="64MiB")
    d.start()
    try:
        ref = Run(
            tmp,
            "ref",
            {
                "model": model,
                "phases": [
                    {"name": "one", "prompts": [one]},
                    {"name": "two", "prompts": [two]},
                    {"name": "one_again", "prompts": [one]},
                ],
            },
        )
        w = Run(
            tmp,
            "writer",
            {"model": model, "phases": [{"name": "one", "prompts": [one]}], "kv_connector": _kv(d)},
        )
        wres = w.result()
        r = Run(
            tmp,
            "reader",
            {
                "model": model,
                "phases": [
                    {"name": "two", "prompts": [two]},
                    {"name": "one_again", "prompts": [one]},
                ],
                "kv_connector": _kv(d),
            },
        )
        yield {"ref": ref.result(), "writer": wres, "reader": r.result()}
    finally:
        d.stop()


def _out(run: dict[str, Any], phase: str) -> dict[str, Any]:
    rec = run["phases"][phase]
    assert "error" not in rec, f"{phase}: {rec.get('error')}"
    (out,) = rec["outputs"]
    return dict(out)


def test_the_image_changes_the_tokens(runs: dict[str, Any]) -> None:
    # Otherwise loading the wrong image's KV could not show: the greedy tokens or
    # their logprobs differ by far more than the 1e-3 the checks allow.
    a, b = _out(runs["ref"], "one"), _out(runs["ref"], "two")
    diff = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    assert a["tokens"] != b["tokens"] or diff > 0.05, diff
    assert _out(runs["ref"], "one")["prompt_tokens"] > STORED


def test_other_image_loads_nothing_and_is_right(runs: dict[str, Any]) -> None:
    assert _out(runs["ref"], "two")["cached"] == 0  # vLLM's own: another image
    got = _out(runs["reader"], "two")
    assert got["cached"] == 0, "KV of image 1 loaded for image 2"
    same(got, _out(runs["ref"], "two"), "reader, image 2")


def test_same_image_loads_and_is_right(runs: dict[str, Any]) -> None:
    same(_out(runs["writer"], "one"), _out(runs["ref"], "one"), "writer, image 1")
    got = _out(runs["reader"], "one_again")
    own = _out(runs["ref"], "one_again")["cached"]
    assert got["cached"] >= own and got["cached"] == STORED, (got["cached"], own)
    same(got, _out(runs["ref"], "one_again"), "reader, image 1")
    log = runs["reader"]["log"]
    assert "neither loaded nor stored" not in log and "GCache load of" not in log
