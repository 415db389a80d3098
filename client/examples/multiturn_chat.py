"""Serve a multi-turn conversation through a running GCache.

    gcache up &                                  # meta + 2 servers on the default ports
    python client/examples/multiturn_chat.py     # or --meta HOST:PORT --meta-grpc HOST:PORT

Builds a small MiMo-V2-Flash-architecture model from its transformers config with
random weights (a fixed seed; nothing is downloaded) and prints, per turn: prompt
tokens, tokens reused from GCache, prefill time with and without reuse.

The engine-side code is two calls (see gcache_client.engines.hf.TransformersConnector):

    out = conn.prefill(prompt_ids)   # lookup + layerwise load + compute the rest + store
    # ... or by hand:
    m = conn.match(tokens); cache = conn.load(m)         # before a prefill
    model(ids[:, m.tokens:], cache=cache)                 # layers load as the model runs
    conn.store(tokens[:boundary], cache)                  # after, at a block boundary
"""

from __future__ import annotations

import argparse

from gcache_client import GCacheClient
from gcache_client.engines.demo.chat import run_chat, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--meta", default="127.0.0.1:7700")
    ap.add_argument("--meta-grpc", default="127.0.0.1:7701")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp", "shm"])
    args = ap.parse_args()
    with GCacheClient(meta=args.meta, meta_grpc=args.meta_grpc, transport=args.transport) as gc:
        reports = run_chat(
            gc,
            conversations=args.conversations,
            turns=args.turns,
            layers=args.layers,
            hidden=args.hidden,
        )
    print()
    for line in summary(reports):
        print(line)


if __name__ == "__main__":
    main()
