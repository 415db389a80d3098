"""The client's load-or-recompute rule against real daemons: it cuts a match only
when told how fast the engine computes, and then by the measured bandwidths."""

from __future__ import annotations

import numpy as np

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests.kvdata import make_kv, tokens


def _put(c: GCacheClient, name: str, ntokens: int):  # type: ignore[no-untyped-def]
    ns = c.register_namespace(name, "mimo-v2-flash", block_size=16)
    toks = tokens(ntokens, seed=3)
    assert c.put(ns, toks, make_kv(ns.layout, ntokens, seed=3)).ok
    return ns, toks


def test_unknown_engine_speed_loads_every_match(deployment: LocalDeployment) -> None:
    """Default `compute_tflops` 0: the rule cannot judge, the whole match loads
    (a GPU figure assumed for a CPU engine used to cut every match to 0)."""
    with GCacheClient(deployment.client_config()) as c:
        ns, toks = _put(c, "lor-default", 16 * 9 + 5)
        m = c.match(ns, toks)
        assert m.blocks == 9
        assert c.get(m) is not None
        c.release(m)
        assert c.stats().get("matches_cut", 0) == 0


def test_fast_engine_cuts_slow_engine_loads(deployment: LocalDeployment) -> None:
    """An engine said to compute absurdly fast recomputes instead (a miss, counted
    as a cut); one said to be slow loads everything."""
    with GCacheClient(deployment.client_config()) as w:
        ns, toks = _put(w, "lor-rates", 16 * 6 + 1)
    with GCacheClient(deployment.client_config(compute_tflops=1e9)) as fast:
        nsf = fast.register_namespace("lor-rates", "mimo-v2-flash", block_size=16)
        assert nsf.fingerprint == ns.fingerprint
        m = fast.match(nsf, toks)
        assert m.blocks == 0
        assert fast.stats()["matches_cut"] == 1
    with GCacheClient(deployment.client_config(compute_tflops=1e-6)) as slow:
        nss = slow.register_namespace("lor-rates", "mimo-v2-flash", block_size=16)
        m = slow.match(nss, toks)
        assert m.blocks == 6
        layers = slow.get(m)
        assert layers is not None and all(np.asarray(x.k).size for x in layers)
        slow.release(m)
        assert slow.stats().get("matches_cut", 0) == 0
