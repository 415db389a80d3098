"""Prefill of a long prompt whose prefix was seen before: cold, ideal, GCache.

    python -m bench.prefill_reuse [--prompt 8192 --prefix 7680] [--json FILE]

One run, one machine, one model (a random-weight MiMo-V2-Flash architecture from
``transformers``, float32, ``--layers`` x ``--hidden``):

* cold: the whole prompt prefilled with no cache;
* ideal: the model reuses its own in-process cache of the prefix (a copy of the
  ``DynamicCache``, taken outside the timer) and computes the remaining tokens;
* GCache over TCP and over shared memory: lookup + layerwise fetch into the cache
  while the forward runs + the remaining tokens (``TransformersConnector.prefill``
  with store off), against a local meta + server started for the run.

Reported: medians over ``--repeat`` runs, cold/GCache speed-up, GCache/ideal
overhead, and the time the forward pass spent waiting for bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from gcache_client.engines.hf import TransformersConnector
from gcache_client.models import tiny_mimo_v2_flash


def timed(fn: Any, repeat: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=7680, help="tokens seen before (block aligned)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold-repeat", type=int, default=1, help="0 skips the cold run")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    model = tiny_mimo_v2_flash(num_layers=args.layers, hidden_size=args.hidden, seed=0)
    ids = torch.randint(0, 1024, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    rest = ids[:, args.prefix :]

    with torch.no_grad():
        print(f"prefilling the {args.prefix}-token prefix once (untimed) ...", flush=True)
        base = transformers.DynamicCache(config=model.config)
        model(ids[:, : args.prefix], cache=base, use_cache=True, logits_to_keep=1)
        ref = model(rest, cache=copy.deepcopy(base), use_cache=True).logits[0, -1]
        transports = args.transports.split(",")
        runs: dict[str, list[float]] = {"ideal": [], **{t: [] for t in transports}}
        outs: dict[str, list[Any]] = {t: [] for t in transports}
        with (
            tempfile.TemporaryDirectory() as tmp,
            LocalDeployment(tmp, servers=1, capacity="1GiB") as d,
        ):
            clients = {t: GCacheClient(d.client_config(transport=t)) for t in transports}
            conns = {
                t: TransformersConnector(c, model, "bench/prefill", block_size=args.block_size)
                for t, c in clients.items()
            }
            res = conns[transports[0]].store(ids[0, : args.prefix], base)
            print(f"stored {res.bytes_written / 1e6:.1f} MB of prefix KV", flush=True)
            for conn in conns.values():
                conn.prefill(ids, store=False)  # warm-up: connections, mappings
            # Interleave the paths round by round so drift on a noisy machine hits
            # all of them alike.
            for _ in range(args.repeat):
                cache = copy.deepcopy(base)
                t0 = time.perf_counter()
                model(rest, cache=cache, use_cache=True)
                runs["ideal"].append(time.perf_counter() - t0)
                del cache
                for t, conn in conns.items():
                    t0 = time.perf_counter()
                    outs[t].append(conn.prefill(ids, store=False))
                    runs[t].append(time.perf_counter() - t0)
            for c in clients.values():
                c.close()
        ideal_s = statistics.median(runs["ideal"])
        ideal_runs = runs["ideal"]
        rows: dict[str, Any] = {}
        for t in transports:
            last = outs[t][-1]
            rows[t] = {
                "median_s": statistics.median(runs[t]),
                "runs_s": runs[t],
                "reused_tokens": last.reused_tokens,
                "exact": all(
                    bool(torch.allclose(o.next_token_logits, ref, atol=1e-4)) for o in outs[t]
                ),
                "wait_s": statistics.median(o.timings.get("wait_s", 0.0) for o in outs[t]),
            }
        cold_s, cold_runs = float("nan"), list[float]()
        if args.cold_repeat:
            print("cold prefill (this takes a while) ...", flush=True)
            cold_s, cold_runs = timed(lambda: model(ids, logits_to_keep=1), args.cold_repeat)

    print()
    print(
        f"prompt {args.prompt} tokens, prefix {args.prefix} seen before; model "
        f"{args.layers} layers x {args.hidden} wide (MiMo-V2-Flash architecture, float32)"
    )
    print(
        f"{'path':<14} {'time [s]':>9} {'vs ideal':>9} {'cold speed-up':>14} {'waited [ms]':>12}"
        f" {'exact':>6}"
    )
    print(f"{'cold':<14} {cold_s:>9.3f} {cold_s / ideal_s:>9.2f} {1.0:>14.1f} {'':>12}")
    print(f"{'ideal':<14} {ideal_s:>9.3f} {1.0:>9.2f} {cold_s / ideal_s:>14.1f} {'':>12}")
    for t, r in rows.items():
        print(
            f"{'gcache ' + t:<14} {r['median_s']:>9.3f} {r['median_s'] / ideal_s:>9.3f} "
            f"{cold_s / r['median_s']:>14.1f} {r['wait_s'] * 1e3:>12.1f} {r['exact']!s:>6}"
        )
    out = {
        "prompt_tokens": args.prompt,
        "prefix_tokens": args.prefix,
        "layers": args.layers,
        "hidden": args.hidden,
        "cold_s": cold_s,
        "cold_runs_s": cold_runs,
        "ideal_s": ideal_s,
        "ideal_runs_s": ideal_runs,
        "gcache": {
            t: {
                **r,
                "overhead_vs_ideal": r["median_s"] / ideal_s,
                "speedup_vs_cold": cold_s / r["median_s"],
            }
            for t, r in rows.items()
        },
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
