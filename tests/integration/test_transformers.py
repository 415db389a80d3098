"""A real MiMo-V2-Flash-architecture model on GCache: reuse is exact.

Float32 weights from a fixed seed; every check compares against a full recompute
of the same prompt by the same model with no store involved.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gcache.cli.deploy import LocalDeployment  # noqa: E402
from gcache_client import GCacheClient  # noqa: E402
from gcache_client.hf import TransformersConnector  # noqa: E402
from gcache_client.models import tiny_mimo_v2_flash  # noqa: E402

BS = 64  # block size; sliding_window 129 keeps 128 rows = 2 blocks
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_mimo_v2_flash(num_layers=6, hidden_size=128, seed=0)


@pytest.fixture
def conn(
    client: GCacheClient, model: object, request: pytest.FixtureRequest
) -> TransformersConnector:
    # A fresh namespace per test (the model id carries the test name).
    return TransformersConnector(client, model, f"tiny-mimo/{request.node.name}", block_size=BS)


def rand_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference_logits(model: object, ids: torch.Tensor) -> torch.Tensor:
    return model(ids.reshape(1, -1)).logits[0, -1]  # type: ignore[operator]


def check_exact(conn: TransformersConnector, ids: torch.Tensor, expect_reuse: int) -> None:
    out = conn.prefill(ids)
    assert out.reused_tokens == expect_reuse
    ref = reference_logits(conn.model, ids)
    assert torch.allclose(out.next_token_logits, ref, atol=ATOL), (
        (out.next_token_logits - ref).abs().max()
    )


@pytest.mark.parametrize(
    ("first", "extra"),
    [
        (100, 60),  # below the window: 1 block reused, the window reaches before it
        (200, 90),  # the match ends mid-window (P = 192 > W-1, prompt of 290)
        (640, 300),  # well above the window
        (256, 64),  # second prompt ends exactly on a block boundary
    ],
)
def test_reuse_is_exact(conn: TransformersConnector, first: int, extra: int) -> None:
    a = rand_tokens(first, seed=first)
    out = conn.prefill(a)
    assert out.reused_tokens == 0
    assert out.stored is not None and out.stored.ok
    b = torch.cat([a, rand_tokens(extra, seed=first + 1)])
    check_exact(conn, b, expect_reuse=(first // BS) * BS)


def test_evicted_interior_windows_fall_back_to_a_valid_point(
    conn: TransformersConnector, client: GCacheClient
) -> None:
    a = rand_tokens(320, seed=7)  # 5 blocks: a window is saved at 320
    b = torch.cat([a, rand_tokens(200, seed=8)])  # 8 blocks: a window saved at 512
    conn.prefill(a)
    conn.prefill(b)
    c = torch.cat([b, rand_tokens(50, seed=9)])
    assert client.lookup(conn.ns, c.numpy()) == 512
    # Evict the window at 512 (blocks 6 and 7): the match must stop at 320.
    evicted, _ = client.evict(conn.ns, b.numpy(), blocks=range(6, 8))
    assert evicted == 2
    check_exact(conn, c, expect_reuse=320)
    # That prefill stored its own window at 512 again (a checkpoint at its block
    # boundary). Evict it and the one at 320: nothing valid is left, it runs cold.
    assert client.lookup(conn.ns, c.numpy()) == 512
    d = torch.cat([b, rand_tokens(50, seed=10)])
    assert client.evict(conn.ns, b.numpy(), blocks=range(3, 8)) == (4, 0)
    assert client.lookup(conn.ns, d.numpy()) == 0
    check_exact(conn, d, expect_reuse=0)


def test_two_namespaces_same_tokens_no_cross_talk(client: GCacheClient) -> None:
    m1 = tiny_mimo_v2_flash(num_layers=3, hidden_size=128, seed=1)
    m2 = tiny_mimo_v2_flash(num_layers=3, hidden_size=128, seed=2)
    c1 = TransformersConnector(
        client, m1, f"tiny-mimo/ns-a-{client.config.transport}", block_size=BS
    )
    c2 = TransformersConnector(
        client, m2, f"tiny-mimo/ns-b-{client.config.transport}", block_size=BS
    )
    assert c1.ns.fingerprint != c2.ns.fingerprint
    a = rand_tokens(300, seed=11)
    b = torch.cat([a, rand_tokens(40, seed=12)])
    c1.prefill(a)
    # ns-b has never seen the tokens: no reuse, its own model's logits.
    check_exact(c2, b, expect_reuse=0)
    check_exact(c1, b, expect_reuse=256)


@torch.no_grad()
def greedy(conn: TransformersConnector, ids: torch.Tensor, steps: int, reuse: bool) -> list[int]:
    out = conn.prefill(ids, reuse=reuse, store=False)
    cache = out.cache
    nxt = int(out.next_token_logits.argmax())
    produced = [nxt]
    for _ in range(steps - 1):
        logits = conn.model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits  # type: ignore[operator]
        nxt = int(logits[0, -1].argmax())
        produced.append(nxt)
    return produced


def test_greedy_decoding_after_reuse_matches(conn: TransformersConnector) -> None:
    a = rand_tokens(400, seed=21)
    conn.prefill(a)
    b = torch.cat([a, rand_tokens(30, seed=22)])
    with_reuse = greedy(conn, b, 32, reuse=True)
    without = greedy(conn, b, 32, reuse=False)
    assert with_reuse == without


def test_store_failure_during_load_is_recomputed(
    conn: TransformersConnector, deployment: LocalDeployment
) -> None:
    a = rand_tokens(300, seed=31)
    conn.prefill(a)
    b = torch.cat([a, rand_tokens(20, seed=32)])
    # Corrupt one byte of the first full object: the load fails its checksum
    # mid-forward, the connector recomputes; logits stay exact.
    import mmap

    m = conn.match(b.numpy()[:-1])
    loc = m.objects[(0, 0)]
    shm = {s.server_id: s.shm_path for s in deployment.stats().servers}[
        m.servers[loc.server].server_id
    ]
    conn.client.release(m)
    with open(shm, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        mm[loc.grant.offset + 5] ^= 0x55
        try:
            check_exact(conn, b, expect_reuse=0)
        finally:
            mm[loc.grant.offset + 5] ^= 0x55


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers() -> Iterator[None]:
    import transformers

    transformers.logging.set_verbosity_error()
    yield
