"""Encoder cache: fetching a cached image's encoder output from
GCache vs running the vision encoder for it, in one run.

The encoder is a CLIP ViT-B/16-sized vision tower (12 layers, width 768, seeded
random weights, ``transformers.CLIPVisionModel``) plus a LLaVA-style 2-layer MLP
projector to an LM width (default 4096), float32 on this CPU, one image per
forward; image sizes 224 and 336 px by default (196 and 441 patch tokens; the
position embeddings are interpolated past 224). Its output ``[tokens, width]`` is
what vLLM's encoder cache holds and what ``gcache_client.engines.vllm.ec.connector`` stores.

The fetch is exactly the connector's path (``ECStore.fetch``: leased match of
every block, ``get`` into one buffer with xxh3 verification of every block,
header check, zero-copy tensor view, lease release), against a local deployment
started here (a real ``gcache-meta`` and ``gcache-server``), over shared memory
(``auto``: the server is local) and over TCP.

    .venv/bin/python -m bench.ec_cache --json ec.json
    .venv/bin/python -m bench.ec_cache --sizes 224 --repeat 5 --width 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from gcache.cli.deploy import LocalDeployment
from gcache_client.engines.vllm.ec.store import ECConfig, ECStore


def _encoder(width: int, seed: int) -> tuple[Any, Any]:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    cfg = CLIPVisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
    )
    tower = CLIPVisionModel(cfg).eval()
    proj = torch.nn.Sequential(
        torch.nn.Linear(768, width), torch.nn.GELU(), torch.nn.Linear(width, width)
    ).eval()
    return tower, proj


def _encode(tower: Any, proj: Any, pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        h = tower(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
        return proj(h[0, 1:])  # patch tokens (CLS dropped), as LLaVA's "default"


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median_ms": statistics.median(xs) * 1e3,
        "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1e3,
        "min_ms": xs[0] * 1e3,
    }


def run(sizes: list[int], width: int, repeat: int, fetches: int) -> dict[str, Any]:
    tower, proj = _encoder(width, seed=0)
    result: dict[str, Any] = {
        "encoder": "CLIP ViT-B/16 (12 x 768) + MLP projector, float32",
        "width": width,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        d = LocalDeployment(tmp, servers=1, capacity="1GiB")
        d.start()
        try:
            stores = {
                t: ECStore(
                    ECConfig.from_extra(
                        {"meta": d.meta_addr, "meta_grpc": d.meta_grpc, "transport": t}
                    ),
                    "bench-llava",
                )
                for t in ("auto", "tcp")
            }
            try:
                for size in sizes:
                    g = torch.Generator().manual_seed(size)
                    pixels = torch.randn(1, 3, size, size, generator=g)
                    _encode(tower, proj, pixels)  # warm-up
                    enc_s = []
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        out = _encode(tower, proj, pixels)
                        enc_s.append(time.perf_counter() - t0)
                    ident = f"bench-image-{size}"
                    t0 = time.perf_counter()
                    assert stores["auto"].store(ident, out), "store failed"
                    store_s = time.perf_counter() - t0
                    n_rows = out.shape[0]
                    row: dict[str, Any] = {
                        "image_px": size,
                        "tokens": n_rows,
                        "bytes": out.numel() * out.element_size(),
                        "encoder": _stats(enc_s),
                        "store_ms": store_s * 1e3,
                    }
                    for t, st in stores.items():
                        st.fetch(ident, "float32", width, n_rows)  # connection, namespace
                        fs = []
                        for _ in range(fetches):
                            t0 = time.perf_counter()
                            got = st.fetch(ident, "float32", width, n_rows)
                            fs.append(time.perf_counter() - t0)
                            assert got is not None and torch.equal(got, out), "fetch differs"
                        row[f"fetch_{'shm' if t == 'auto' else t}"] = _stats(fs)
                    result["rows"].append(row)
            finally:
                for st in stores.values():
                    st.close()
        finally:
            d.stop()
    return result


def table(res: dict[str, Any]) -> str:
    lines = [
        f"encoder: {res['encoder']}, output width {res['width']}, "
        f"{res['torch_threads']} torch threads on {res['cpus']} CPUs",
        f"{'image':>6} {'tokens':>6} {'MiB':>6} {'encoder ms':>11} {'fetch shm ms':>13} "
        f"{'fetch tcp ms':>13} {'enc/shm':>8} {'enc/tcp':>8}",
    ]
    for r in res["rows"]:
        e, s, t = (
            r["encoder"]["median_ms"],
            r["fetch_shm"]["median_ms"],
            r["fetch_tcp"]["median_ms"],
        )
        lines.append(
            f"{r['image_px']:>6} {r['tokens']:>6} {r['bytes'] / 2**20:>6.2f} {e:>11.1f} "
            f"{s:>13.2f} {t:>13.2f} {e / s:>7.0f}x {e / t:>7.0f}x"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="224,336", help="image sizes in pixels")
    ap.add_argument("--width", type=int, default=4096, help="LM width of the projector output")
    ap.add_argument("--repeat", type=int, default=5, help="encoder forwards timed per size")
    ap.add_argument("--fetches", type=int, default=50, help="fetches timed per size and path")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args()
    res = run([int(s) for s in a.sizes.split(",")], a.width, a.repeat, a.fetches)
    print(table(res))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
