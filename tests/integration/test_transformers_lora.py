"""The transformers connector keys KV by the model's active LoRA adapters: a PEFT
model never reuses KV another adapter (or the base model) computed, and reuses
its own, exactly (float32, every check against a recompute without the store)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import peft  # noqa: E402  (a test extra: missing is an error, not a skip)

from gcache_client import GCacheClient  # noqa: E402
from gcache_client.engines.hf import TransformersConnector, peft_identity  # noqa: E402
from gcache_client.models import tiny_mimo_v2_flash  # noqa: E402

BS = 64
ATOL = 1e-4


def _peft_model() -> object:
    base = tiny_mimo_v2_flash(num_layers=3, hidden_size=128, seed=3)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    torch.manual_seed(5)  # init_lora_weights=False: random A and B, the KV changes
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **cfg), "a")
    model.add_adapter("b", peft.LoraConfig(init_lora_weights=False, **cfg))
    model.eval()
    return model


@torch.no_grad()
def _logits(model: object, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids.reshape(1, -1)).logits[0, -1]  # type: ignore[operator]


def _exact(conn: TransformersConnector, ids: torch.Tensor, reuse: int) -> None:
    out = conn.prefill(ids)
    assert out.reused_tokens == reuse, (conn.kv_identity, out.reused_tokens, reuse)
    ref = _logits(conn.model, ids)
    assert torch.allclose(out.next_token_logits, ref, atol=ATOL)


def test_adapters_never_share_kv(client: GCacheClient) -> None:
    model = _peft_model()
    conn = TransformersConnector(
        client, model, f"tiny-mimo/lora-{client.config.transport}", block_size=BS
    )
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(9))
    longer = torch.cat([ids, torch.randint(0, 1024, (40,), generator=torch.Generator())])
    model.set_adapter("a")  # type: ignore[attr-defined]
    ident_a = conn.kv_identity
    assert ident_a.startswith("lora=a@")
    _exact(conn, ids, reuse=0)  # stores under adapter a
    model.set_adapter("b")  # type: ignore[attr-defined]
    assert conn.kv_identity.startswith("lora=b@") and conn.kv_identity != ident_a
    _exact(conn, longer, reuse=0)  # a's KV is not b's
    with model.disable_adapter():  # type: ignore[attr-defined]
        assert conn.kv_identity == ""
        _exact(conn, longer, reuse=0)  # nor the base model's
    model.set_adapter("a")  # type: ignore[attr-defined]
    _exact(conn, longer, reuse=256)  # a's own KV is reused
    # Weights changed in place: another fingerprint, nothing reused.
    with torch.no_grad():
        for n, p in model.named_parameters():  # type: ignore[attr-defined]
            if ".lora_B.a." in n:
                p.mul_(1.5)
    assert conn.kv_identity != ident_a
    _exact(conn, longer, reuse=0)


def test_peft_identity_of_a_plain_model_is_empty() -> None:
    assert peft_identity(tiny_mimo_v2_flash(num_layers=3, hidden_size=128, seed=3)) == ""


def test_fixed_identity_overrides(client: GCacheClient) -> None:
    base = tiny_mimo_v2_flash(num_layers=3, hidden_size=128, seed=4)
    c1 = TransformersConnector(client, base, "tiny-mimo/fixed", block_size=BS, kv_identity="x")
    c2 = TransformersConnector(client, base, "tiny-mimo/fixed", block_size=BS)
    assert c1.ns.fingerprint != c2.ns.fingerprint
