"""A multi-turn conversation served through GCache by a real (tiny, random-weight)
MiMo-V2-Flash-architecture model. Used by ``client/examples/multiturn_chat.py`` and
``gcache up --demo``.

Each turn's prompt is the whole conversation so far plus a new user message; the
model prefills it (reusing the cached prefix from GCache), then greedily generates
a reply that becomes part of the next prompt. For comparison every turn is also
prefilled cold, without any cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gcache_client.engines.hf import TransformersConnector
from gcache_client.sync import GCacheClient


@dataclass
class TurnReport:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    prefill_reuse_s: float
    prefill_cold_s: float
    stored_objects: int
    stored_bytes: int
    exact: bool


def run_chat(
    client: GCacheClient,
    *,
    conversations: int = 2,
    turns: int = 4,
    system_tokens: int = 512,
    user_tokens: int = 192,
    reply_tokens: int = 16,
    layers: int = 6,
    hidden: int = 256,
    block_size: int = 64,
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> list[TurnReport]:
    import transformers

    from gcache_client.models import tiny_mimo_v2_flash

    transformers.logging.set_verbosity_error()
    model = tiny_mimo_v2_flash(num_layers=layers, hidden_size=hidden, seed=seed)
    conn = TransformersConnector(client, model, "demo/tiny-mimo-v2-flash", block_size=block_size)
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 1024, (system_tokens,), generator=gen)
    reports: list[TurnReport] = []
    echo(
        f"model: MiMo-V2-Flash architecture, {layers} layers x {hidden} wide, random weights; "
        f"block {block_size} tokens, window {model.config.sliding_window}"
    )
    echo(
        f"{'conv':>4} {'turn':>4} {'prompt':>7} {'reused':>7} {'prefill reuse':>14} "
        f"{'prefill cold':>13} {'speed-up':>9} {'stored':>12}"
    )
    for c in range(conversations):
        history = system.clone()
        for t in range(turns):
            prompt = torch.cat([history, torch.randint(0, 1024, (user_tokens,), generator=gen)])
            out = conn.prefill(prompt)
            reuse_s = out.timings["total_s"]
            with torch.no_grad():
                t0 = time.perf_counter()
                cold = model(prompt.reshape(1, -1), logits_to_keep=1).logits[0, -1]
                cold_s = time.perf_counter() - t0
                exact = bool(torch.allclose(cold, out.next_token_logits, atol=1e-4))
                # Greedy reply, appended to the conversation.
                reply = []
                nxt = int(out.next_token_logits.argmax())
                cache = out.cache
                for _ in range(reply_tokens):
                    reply.append(nxt)
                    logits = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
                    nxt = int(logits[0, -1].argmax())
            stored = out.stored
            rep = TurnReport(
                t,
                len(prompt),
                out.reused_tokens,
                reuse_s,
                cold_s,
                stored.stored if stored else 0,
                stored.bytes_written if stored else 0,
                exact,
            )
            reports.append(rep)
            echo(
                f"{c:>4} {t:>4} {rep.prompt_tokens:>7} {rep.reused_tokens:>7} "
                f"{reuse_s * 1e3:>11.1f} ms {cold_s * 1e3:>10.1f} ms {cold_s / reuse_s:>8.1f}x "
                f"{rep.stored_bytes / 1e6:>9.1f} MB" + ("" if exact else "  LOGITS DIFFER")
            )
            history = torch.cat([prompt, torch.tensor(reply)])
    return reports


def summary(reports: list[TurnReport]) -> list[str]:
    total = sum(r.prompt_tokens for r in reports)
    reused = sum(r.reused_tokens for r in reports)
    reuse_s = sum(r.prefill_reuse_s for r in reports)
    cold_s = sum(r.prefill_cold_s for r in reports)
    return [
        f"turns                {len(reports)}",
        f"prompt tokens        {total}, reused from GCache {reused} ({reused / max(total, 1):.1%})",
        f"prefill time         {reuse_s:.2f} s with GCache vs {cold_s:.2f} s cold "
        f"({cold_s / max(reuse_s, 1e-9):.1f}x)",
        f"stored               {sum(r.stored_objects for r in reports)} objects, "
        f"{sum(r.stored_bytes for r in reports) / 1e6:.1f} MB",
        f"exact logits         {sum(r.exact for r in reports)} of {len(reports)} turns",
    ]
