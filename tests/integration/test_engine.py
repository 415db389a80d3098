"""The engine instance behind ``gcache-engine`` (gcache_client.engines.demo.engine) on a
real GCache: a prefix reused from the instance's own cache, or from the pool by an
instance that never saw it, gives the logits of a full recompute; its local-cache
changes reach a ZMQ subscriber as vLLM batches the router decodes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
zmq = pytest.importorskip("zmq")

from gcache.cli.deploy import LocalDeployment  # noqa: E402
from gcache.router.events import BlockRemoved, BlockStored, decode_batch  # noqa: E402
from gcache_client import GCacheClient  # noqa: E402
from gcache_client.engines.demo.engine import Engine  # noqa: E402
from gcache_client.engines.kv_events import ZmqPublisher  # noqa: E402
from gcache_client.models import tiny_mimo_v2_flash  # noqa: E402

BS = 64
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_mimo_v2_flash(num_layers=6, hidden_size=128, seed=0)


@pytest.fixture
def gc(deployment: LocalDeployment) -> Iterator[GCacheClient]:
    c = GCacheClient(deployment.client_config(transport="tcp"))
    yield c
    c.close()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@torch.no_grad()
def reference(model: object, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0, -1]  # type: ignore[operator]


@torch.no_grad()
def prefill(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, int, int]:
    logits, _, gen = engine.prefill(torch.tensor(prompt).numpy())
    return logits, gen.local_tokens, gen.pool_tokens


def test_local_and_pool_prefix_reuse_give_the_logits_of_a_full_recompute(
    gc: GCacheClient, model: object, request: pytest.FixtureRequest
) -> None:
    name = f"engine/{request.node.name}"
    one = Engine(gc, model, name, block_size=BS, local_capacity=64 << 20)
    first = ids(300, 1)
    logits, local, pool = prefill(one, first)
    assert (local, pool) == (0, 0)
    assert torch.allclose(logits, reference(model, first), atol=ATOL)
    # The follow-up turn on the same instance: its own cache serves the prefix
    # (4 blocks: the window-safe end of what the first prompt stored).
    follow = first + ids(150, 2)
    logits, local, pool = prefill(one, follow)
    assert (local, pool) == (256, 0)
    assert torch.allclose(logits, reference(model, follow), atol=ATOL)
    # Another instance (an empty local cache) gets the same prefix from the pool:
    # the follow-up stored blocks up to 448 tokens there.
    two = Engine(gc, model, name, block_size=BS, local_capacity=64 << 20)
    again = follow + ids(40, 3)
    logits, local, pool = prefill(two, again)
    assert (local, pool) == (0, 448)
    assert torch.allclose(logits, reference(model, again), atol=ATOL)
    # ...and keeps it: the next turn there is a local hit.
    logits, local, pool = prefill(two, again + ids(30, 4))
    assert local >= 448 and pool == 0
    assert torch.allclose(logits, reference(model, again + ids(30, 4)), atol=ATOL)


def test_generation_is_the_greedy_continuation_in_printable_ascii(
    gc: GCacheClient, model: object, request: pytest.FixtureRequest
) -> None:
    engine = Engine(gc, model, f"engine/{request.node.name}", block_size=BS)
    prompt = ids(200, 5)
    seen: list[int] = []
    gen = engine.generate(prompt, 6, seen.append)
    assert gen.output == seen and len(seen) == 6
    assert all(32 <= t < 127 for t in seen)
    # Greedy over the allowed tokens, by a plain forward of the whole text each step.
    allowed = torch.arange(32, 127)
    text = list(prompt)
    for tok in seen:
        logits = reference(model, text)
        assert tok == int(allowed[int(logits[allowed].argmax())])
        text.append(tok)
    # Cancelled before the first token: nothing generated.
    assert engine.generate(prompt, 6, cancelled=lambda: True).output == []


def test_local_cache_changes_are_published_as_vllm_batches(
    gc: GCacheClient, model: object, request: pytest.FixtureRequest
) -> None:
    pub = ZmqPublisher("tcp://127.0.0.1:*", topic="engine-a")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect(pub.bound_endpoint)
        time.sleep(0.3)  # the slow joiner: publish once the subscription is through
        per_entry = 4 * 2 * BS * 128 * 4 * 2  # upper bound of one entry's bytes
        engine = Engine(
            gc,
            model,
            f"engine/{request.node.name}",
            block_size=BS,
            local_capacity=6 * per_entry,  # a few entries: the second prompt evicts
            publisher=pub,
        )
        prefill(engine, ids(260, 6))
        prefill(engine, ids(260, 7))
        frames = [sub.recv_multipart() for _ in range(2)]
    finally:
        sub.close(0)
        pub.close()
    assert [f[0] for f in frames] == [b"engine-a", b"engine-a"]
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1]
    batches = [decode_batch(f[2])[1] for f in frames]
    stored = [e for e in batches[0] if isinstance(e, BlockStored)]
    assert [(e.group_idx, len(e.block_hashes)) for e in stored] == [(0, 4), (1, 2)]
    assert any(isinstance(e, BlockRemoved) for e in batches[1])
    assert engine.local.used <= engine.local.capacity
