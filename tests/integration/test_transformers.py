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
from gcache_client.engines.hf import TransformersConnector  # noqa: E402
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
    # Each prefill saves the window at its last full block and at the block
    # boundary before it (tail 2 blocks): windowed objects of blocks 2-4 and 5-7.
    a = rand_tokens(320, seed=7)  # 5 blocks: windows at 5 and 4
    b = torch.cat([a, rand_tokens(200, seed=8)])  # 8 blocks: windows at 8 and 7
    assert conn.prefill(a).checkpoints == [4]
    assert conn.prefill(b).checkpoints == [7]
    c = torch.cat([b, rand_tokens(50, seed=9)])
    assert client.lookup(conn.ns, c.numpy()) == 512
    # Evict blocks 6 and 7's windowed objects: the match must stop at 384, the
    # last point whose two window blocks (4 from a, 5 from b) are both there.
    evicted, _ = client.evict(conn.ns, b.numpy(), blocks=range(6, 8))
    assert evicted == 2
    check_exact(conn, c, expect_reuse=384)
    # That prefill stored its own windows at 512 and 448 again. Evict every
    # windowed object from block 2 on: nothing valid is left, it runs cold.
    assert client.lookup(conn.ns, c.numpy()) == 512
    d = torch.cat([b, rand_tokens(50, seed=10)])
    assert client.evict(conn.ns, b.numpy(), blocks=range(2, 8)) == (6, 0)
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


# ---- any window with any block size; checkpoint windows ----------------------------

_MODELS: dict[int, object] = {}


def model_with_window(window: int) -> object:
    if window not in _MODELS:
        _MODELS[window] = tiny_mimo_v2_flash(
            num_layers=6, hidden_size=128, seed=3, sliding_window=window
        )
    return _MODELS[window]


def connector(
    client: GCacheClient, window: int, bs: int, name: str, **kw: object
) -> TransformersConnector:
    model = model_with_window(window)
    return TransformersConnector(client, model, f"tiny-mimo/w{window}/{name}", block_size=bs, **kw)  # type: ignore[arg-type]


# (window, block size): transformers keeps W - 1 rows; the layout stores
# ceil((W-1)/bs) blocks, 1 row more for 128/64 and 29 more for 100/32.
WINDOWS = [(129, 64), (128, 64), (100, 32)]


@pytest.mark.parametrize(("window", "bs"), WINDOWS)
def test_window_not_a_multiple_of_the_block_size_is_exact(
    client: GCacheClient, window: int, bs: int, request: pytest.FixtureRequest
) -> None:
    conn = connector(client, window, bs, request.node.name)
    assert conn.layout.window_rows(1) == -(-(window - 1) // bs) * bs
    a = rand_tokens(10 * bs, seed=window)
    out = conn.prefill(a)
    assert out.reused_tokens == 0 and out.stored is not None and out.stored.ok
    # A prompt sharing 9 blocks resumes at 9, from the window saved at 9 by the
    # checkpoint put, whose block 8 was written by the put of the end window (10):
    # with W=128/bs=64 the first row of block 8 is one transformers had dropped
    # at 10 but a match at 9 sees.
    b = torch.cat([a[: 9 * bs], rand_tokens(40, seed=window + 1)])
    check_exact(conn, b, expect_reuse=9 * bs)
    # Longer than the first prompt, ending mid-block, shorter than a window.
    c = torch.cat([a, rand_tokens(bs + 7, seed=window + 2)])
    check_exact(conn, c, expect_reuse=10 * bs)
    short = rand_tokens(bs + 3, seed=window + 3)
    conn.prefill(short)
    check_exact(conn, torch.cat([short, rand_tokens(5, seed=1)]), expect_reuse=bs)


@pytest.mark.parametrize(("window", "bs"), WINDOWS)
def test_identical_prompt_sent_twice_reuses_all_but_its_last_block(
    client: GCacheClient, window: int, bs: int, request: pytest.FixtureRequest
) -> None:
    """The same block-aligned prompt again (a retry, a regenerated answer): its
    match must leave the last token to compute, so it ends one block early, where
    the first prefill saved a checkpoint window. Logits as a cold recompute's,
    greedy tokens the same."""
    conn = connector(client, window, bs, request.node.name)
    nblocks = 6
    a = rand_tokens(nblocks * bs, seed=window + 10)
    first = conn.prefill(a)
    assert first.reused_tokens == 0
    assert first.checkpoints == [nblocks - 1]
    tail = conn.layout.group_tail_blocks[1]
    assert tail is not None
    # The client kept O(W) rows per saved window, never the prompt's.
    sliding = [i for i in range(conn.num_layers) if conn.layout.layer_group[i] == 1]
    row_bytes = sum(
        conn.spec.layers[i].kv_heads
        * (conn.spec.layers[i].k_head_dim + conn.spec.layers[i].v_head_dim)
        * 4
        for i in sliding
    )
    assert conn.stats()["captured_bytes"] == 2 * tail * bs * row_bytes
    again = conn.prefill(a)
    assert again.reused_tokens == (nblocks - 1) * bs
    ref = reference_logits(conn.model, a)
    assert torch.allclose(again.next_token_logits, ref, atol=ATOL), (
        (again.next_token_logits - ref).abs().max()
    )
    assert greedy(conn, a, 8, reuse=True) == greedy(conn, a, 8, reuse=False)


def test_interval_checkpoint_serves_an_edited_ending(
    client: GCacheClient, request: pytest.FixtureRequest
) -> None:
    """A 20-block prompt with a checkpoint every 8 blocks saves windows at 20, 19
    and 16; the same conversation re-sent with its last 3.5 blocks changed (a new
    chat template ending) resumes at 16 instead of recomputing it all."""
    conn = connector(client, 129, 64, request.node.name, checkpoint_interval=512)
    a = rand_tokens(20 * 64, seed=40)
    assert conn.prefill(a).checkpoints == [16, 19]
    edited = torch.cat([a[: 16 * 64 + 30], rand_tokens(200, seed=41)])
    check_exact(conn, edited, expect_reuse=16 * 64)
    off = connector(client, 129, 64, request.node.name + "-off", checkpoint_interval=0)
    assert off.prefill(a).checkpoints == [19]
    no_last = connector(
        client, 129, 64, request.node.name + "-none", checkpoint_interval=0, checkpoint_last=False
    )
    assert no_last.prefill(a).checkpoints == []
    assert no_last.prefill(a).reused_tokens == 0  # the old behaviour: nothing reused


@torch.no_grad()
def test_the_documented_manual_steps(conn: TransformersConnector, client: GCacheClient) -> None:
    """docs/engines.md's step-by-step prefill, on a miss then on a hit."""
    from gcache_client.engines.hf import WindowCapture

    tokens = rand_tokens(5 * BS, seed=50)
    ids = tokens.reshape(1, -1)
    for expect in (0, 4 * BS):
        m = conn.match(tokens[:-1])
        assert m.tokens == expect
        ends = conn.windows_to_save(len(tokens) // BS, m.blocks)
        cap = WindowCapture(conn.layout, ends)
        cache = conn.load(m, cap)
        assert cache is not None
        out = conn.model(ids[:, m.tokens :], cache=cache, use_cache=True)  # type: ignore[operator]
        client.release(m)
        conn.save_windows(tokens.numpy(), cache, cap)
        ref = reference_logits(conn.model, tokens)
        assert torch.allclose(out.logits[0, -1], ref, atol=ATOL)


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
