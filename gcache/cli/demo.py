"""The built-in workload of ``gcache up --demo`` / ``gcache demo``.

Multi-turn conversations on the MiMo-V2-Flash layout: every turn's prompt extends
the previous one, so each turn first fetches the cached prefix layer by layer
(verifying every byte against what was put), then stores its own KV. The KV rows of
a block are generated from the block's chained key, so equal prefixes have equal
KV, as a deterministic model would give.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from gcache import keys as keymod
from gcache.config import ClientConfig
from gcache.layout import Layout
from gcache_client import GCacheClient, Namespace


@dataclass
class DemoReport:
    prompts: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    blocks_put: int = 0
    objects_stored: int = 0
    objects_deduped: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    put_s: float = 0.0
    get_s: float = 0.0
    verified_layers: int = 0
    mismatches: int = 0
    misses_on_error: int = 0

    def lines(self) -> list[str]:
        mib, gib = float(1 << 20), float(1 << 30)  # binary units, as gcache status
        return [
            f"prompts              {self.prompts} ({self.prompt_tokens} tokens)",
            f"tokens from cache    {self.hit_tokens} "
            f"({self.hit_tokens / max(1, self.prompt_tokens):.1%})",
            f"blocks put           {self.blocks_put}",
            f"objects stored       {self.objects_stored} (deduplicated {self.objects_deduped})",
            f"bytes written        {self.bytes_written / mib:.1f} MiB at "
            f"{self.bytes_written / gib / max(self.put_s, 1e-9):.2f} GiB/s",
            f"bytes read           {self.bytes_read / mib:.1f} MiB at "
            f"{self.bytes_read / gib / max(self.get_s, 1e-9):.2f} GiB/s",
            f"layers verified      {self.verified_layers} (mismatches: {self.mismatches})",
        ]


def synthetic_kv(
    layout: Layout, fp: bytes, toks: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """KV for a prompt whose block ``i`` rows depend only on block key ``i``. Sliding
    layers get only the rows strict O(W) stores (the trailing window blocks)."""
    bs = layout.block_size
    block_keys = keymod.block_keys(fp, toks, bs)
    n = len(block_keys)
    kv = []
    for layer, spec in enumerate(layout.spec.layers):
        first = layout.window_blocks(layout.layer_group[layer], n).start
        rows_k = spec.kv_heads * spec.k_head_dim
        rows_v = spec.kv_heads * spec.v_head_dim
        k = np.empty((n - first, bs, rows_k), np.uint16)
        v = np.empty((n - first, bs, rows_v), np.uint16)
        for b in range(first, n):
            seed = int.from_bytes(block_keys[b][:8], "little") ^ layer
            rng = np.random.default_rng(seed)
            k[b - first] = rng.integers(0, 1 << 16, (bs, rows_k), dtype=np.uint16)
            v[b - first] = rng.integers(0, 1 << 16, (bs, rows_v), dtype=np.uint16)
        kv.append(
            (
                k.reshape(-1, spec.kv_heads, spec.k_head_dim),
                v.reshape(-1, spec.kv_heads, spec.v_head_dim),
            )
        )
    return kv


def run_demo(
    cfg: ClientConfig,
    conversations: int = 4,
    turns: int = 4,
    turn_tokens: int = 256,
    block_size: int = 64,
    seed: int = 0,
    echo: bool = True,
) -> DemoReport:
    rep = DemoReport()
    rng = np.random.default_rng(seed)
    with GCacheClient(cfg) as client:
        ns: Namespace = client.register_namespace(
            "demo/mimo-v2-flash", "mimo-v2-flash", block_size=block_size
        )
        layout = ns.layout
        system = rng.integers(0, 150_000, 2 * block_size)  # a shared system prompt
        for conv in range(conversations):
            history = system.copy()
            for turn in range(turns):
                prompt = np.concatenate([history, rng.integers(0, 150_000, turn_tokens)])
                usable = (len(prompt) // block_size) * block_size
                rep.prompts += 1
                rep.prompt_tokens += len(prompt)
                t0 = time.perf_counter()
                match = client.match(ns, prompt)
                hit = 0
                if match.tokens:
                    expect = synthetic_kv(layout, ns.fingerprint, prompt[: match.tokens])
                    stream = client.get_layers(match)
                    for lay in stream:
                        ek, ev = expect[lay.layer]
                        off = lay.start - (match.tokens - len(ek))
                        ok = np.array_equal(lay.k, ek[off:]) and np.array_equal(lay.v, ev[off:])
                        rep.mismatches += 0 if ok else 1
                        rep.verified_layers += 1
                        rep.bytes_read += lay.k.nbytes + lay.v.nbytes
                    if stream.ok:
                        hit = match.tokens
                    else:
                        rep.misses_on_error += 1
                    client.release(match)
                rep.get_s += time.perf_counter() - t0
                rep.hit_tokens += hit
                kv = synthetic_kv(layout, ns.fingerprint, prompt[:usable])
                t0 = time.perf_counter()
                res = client.put(ns, prompt[:usable], kv)
                rep.put_s += time.perf_counter() - t0
                rep.blocks_put += res.blocks
                rep.objects_stored += res.stored
                rep.objects_deduped += res.deduped
                rep.bytes_written += res.bytes_written
                if echo:
                    print(
                        f"  conversation {conv} turn {turn}: prompt {len(prompt):5d} tokens, "
                        f"reused {hit:5d} from GCache, stored {res.stored:3d} objects "
                        f"({res.bytes_written / 1e6:6.1f} MB), deduplicated {res.deduped}",
                        flush=True,
                    )
                history = prompt
    return rep
