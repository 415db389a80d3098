"""Meta failover: kill -9 of the leader, time until the standby serves and the
fraction of stored prompts that hit again over time.

    python -m bench.meta_failover [--prompts 200] [--servers 2] [--runs 3]
        [--sample 200] [--until 5] [--json FILE]

Real processes (``LocalDeployment(ha=True)``: etcd, two metas, the servers, a
client on etcd://). Fills ``--prompts`` prompts of 12 blocks (tiny hybrid layout),
waits until every commit is in its server's manifest, kills the leader with
SIGKILL and measures from the kill: when the other meta answers the hot path as
leader ("serves"), and at 0.5 s steps to ``--until`` s the fraction of the prompts
whose lookup hits whole (with more than ``--sample`` prompts, a fixed random sample
of that many is looked up at each step). A standby rebuilds from the servers'
reports; it does not follow the leader (docs/architecture.md "High availability"). The anchor is the
same client's lookup rate before the kill (every prompt hits)."""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from pathlib import Path

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import make_kv, tiny_hybrid, tokens

NTOK = 4 * 12 + 3


def one_run(prompts: int, servers: int, sample: int, steps: list[float]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        d = LocalDeployment(Path(tmp), servers=servers, capacity="256MiB", ha=True)
        with d:
            d.start()
            c = GCacheClient(d.client_config(timeout_s=0.5))
            ns = c.register_namespace("failover", tiny_hybrid())
            toks = [tokens(NTOK, seed=s) for s in range(prompts)]
            for s, t in enumerate(toks):
                assert c.put(ns, t, make_kv(ns.layout, NTOK, seed=s)).ok
            # No wait: a commit is in its server's manifest before its OK.
            full = (NTOK // 4) * 4
            picked = random.Random(1).sample(toks, min(sample, prompts))
            assert all(c.lookup(ns, t) == full for t in toks)
            old = d.signal_leader(signal.SIGKILL)
            killed = time.monotonic()
            new = next(p for p in d.metas.values() if p is not old)
            serves = -1.0
            curve: list[float] = []
            for step in steps:
                while time.monotonic() - killed < step:
                    if serves < 0:
                        try:
                            _, body, _ = rawwire.call(new.port, wire.Ping())
                            if isinstance(body, wire.Ok):
                                serves = time.monotonic() - killed
                        except OSError:
                            pass
                    time.sleep(0.01)
                hits = sum(1 for t in picked if c.lookup(ns, t) == full)
                curve.append(hits / len(picked))
            c.close()
            return {"serves_s": serves, "hit_fraction": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sample", type=int, default=200)
    ap.add_argument("--until", type=float, default=5.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    steps = [0.5 * i for i in range(1, int(args.until / 0.5) + 1)]
    runs = [one_run(args.prompts, args.servers, args.sample, steps) for _ in range(args.runs)]
    print(
        f"meta failover, {args.prompts} prompts x 12 blocks ({args.prompts * 12} blocks), "
        f"{args.servers} servers; hit fraction of {min(args.sample, args.prompts)} prompts"
    )
    print(f"{'run':>4} {'serves (s)':>11} " + " ".join(f"{s:>5.1f}s" for s in steps))
    for i, r in enumerate(runs):
        curve = r["hit_fraction"]
        assert isinstance(curve, list)
        print(f"{i:>4} {r['serves_s']:>11.2f} " + " ".join(f"{f:>6.0%}" for f in curve))
    if args.json:
        out = {
            "prompts": args.prompts,
            "blocks": args.prompts * 12,
            "servers": args.servers,
            "sample": min(args.sample, args.prompts),
            "steps_s": steps,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
