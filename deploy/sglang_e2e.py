"""End to end on a GPU host: SGLang with the GCache HiCache backend must give the
same greedy tokens as SGLang without it, and a fresh SGLang must reuse what
another one stored.

SGLang's engine does not run on CPU-only hosts without its CPU kernels (see
docs/engines.md, "SGLang"), so this is not part of ``make test``. On a GPU host,
with sglang 0.5.x and this repository installed in one environment:

    python deploy/sglang_e2e.py --model Qwen/Qwen3-0.6B
    python deploy/sglang_e2e.py --model /models/llama --meta 10.0.0.5:7700 --meta-grpc 10.0.0.5:7701

Without ``--meta`` it starts a local deployment (meta + 2 servers). Then, one at
a time: a reference SGLang (no hierarchical cache), a writer (HiCache + GCache:
its prompts are backed up to GCache), and a fresh reader (HiCache + GCache, empty
GPU and host caches, prefetch ``wait_complete``). Prompts are token ids
(``--skip-tokenizer-init``), decoding greedy. Exit status 0 only if the reader's
and the writer's tokens equal the reference's and the reader took cached tokens
from GCache (SGLang's ``cached_tokens`` > 0 and GCache hits > 0).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from gcache.cli.deploy import LocalDeployment, fetch_stats


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sglang exited {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("sglang did not become ready")


def run_sglang(
    args: argparse.Namespace, name: str, extra: list[str], prompts: list[list[int]], log: Path
) -> list[dict[str, Any]]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", args.model, "--port", str(args.port), "--host", "127.0.0.1",
        "--skip-tokenizer-init", "--page-size", str(args.page_size),
        "--mem-fraction-static", str(args.mem_fraction), *extra,
    ]  # fmt: skip
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_ready(args.port, proc, args.start_timeout)
        outs = []
        for p in prompts:
            r = post(
                f"http://127.0.0.1:{args.port}/generate",
                {
                    "input_ids": p,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": args.max_tokens},
                },
            )
            outs.append({"ids": r["output_ids"], "cached": r["meta_info"].get("cached_tokens", 0)})
            if name == "writer":
                time.sleep(args.backup_wait_s)  # let HiCache write the prompt through
        if name == "writer":
            post(f"http://127.0.0.1:{args.port}/flush_cache", {}, timeout=60)
            time.sleep(args.backup_wait_s)
        return outs
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--meta", default="", help="GCache meta host:port (default: start one here)")
    ap.add_argument("--meta-grpc", default="")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--layout", default="page_first", help="--hicache-mem-layout")
    ap.add_argument("--backup-wait-s", type=float, default=2.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--vocab", type=int, default=20000, help="prompt token ids drawn below this")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gcache-sglang-e2e-"))
    deploy = None
    if not args.meta:
        deploy = LocalDeployment(tmp / "deploy", servers=2, capacity="4GiB").start()
        args.meta, args.meta_grpc = deploy.meta_addr, deploy.meta_grpc
    try:
        rng = random.Random(1)
        prompts = [
            [rng.randrange(100, args.vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.prompts)
        ]
        backend = {
            "backend_name": "gcache",
            "module_path": "gcache_client.sglang",
            "class_name": "GCacheHiCacheStorage",
            "interface_v1": 1,
            "meta": args.meta,
            "meta_grpc": args.meta_grpc,
        }
        hicache = [
            "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-mem-layout", args.layout, "--hicache-write-policy", "write_through",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(backend),
        ]  # fmt: skip
        ref = run_sglang(args, "reference", [], prompts, tmp / "ref.log")
        writer = run_sglang(args, "writer", hicache, prompts, tmp / "writer.log")
        before = dict(fetch_stats(args.meta_grpc).counters)
        reader = run_sglang(args, "reader", hicache, prompts, tmp / "reader.log")
        after = dict(fetch_stats(args.meta_grpc).counters)
        hits = after.get("hit_blocks", 0) - before.get("hit_blocks", 0)
        same_w = [w["ids"] == r["ids"] for w, r in zip(writer, ref, strict=True)]
        same_r = [x["ids"] == r["ids"] for x, r in zip(reader, ref, strict=True)]
        cached = [x["cached"] for x in reader]
        report = {
            "writer_tokens_identical": same_w,
            "reader_tokens_identical": same_r,
            "reader_cached_tokens": cached,
            "gcache_hit_blocks": hits,
            "gcache_bytes_stored": after.get("bytes_stored", 0),
            "logs": str(tmp),
        }
        print(json.dumps(report, indent=1))
        ok = all(same_w) and all(same_r) and sum(cached) > 0 and hits > 0
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        if deploy is not None:
            deploy.stop()


if __name__ == "__main__":
    raise SystemExit(main())
