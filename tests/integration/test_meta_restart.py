"""kill -9 of the meta under a workload: the restarted meta rebuilds its index from
the servers' reports, so every prompt put before (acknowledged, the kill coming
right after) hits again within 5 s of the meta being ready; clients reconnect by
themselves and every operation during the outage ends as a miss, never as an
exception."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests.kvdata import make_kv, tiny_hybrid, tokens

PROMPTS = 50
NTOK = 4 * 12 + 3  # 12 blocks of 4 tokens


def test_meta_kill9_under_load_rebuilds_from_server_reports(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=2, capacity="64MiB") as d:
        d.start()
        client = GCacheClient(d.client_config(timeout_s=1.0))
        ns = client.register_namespace("restart", tiny_hybrid())
        prompts = [tokens(NTOK, seed=s) for s in range(PROMPTS)]
        for s, toks in enumerate(prompts):
            assert client.put(ns, toks, make_kv(ns.layout, NTOK, seed=s)).ok
        hits_before = [client.lookup(ns, t) for t in prompts]
        hit = [i for i, h in enumerate(hits_before) if h]
        assert len(hit) == PROMPTS

        errors: list[BaseException] = []
        stop = threading.Event()
        ops = {"n": 0, "miss": 0}

        def workload() -> None:
            c = GCacheClient(d.client_config(timeout_s=1.0))
            try:
                i = 0
                while not stop.is_set():
                    toks = prompts[i % PROMPTS]
                    m = c.match(ns, toks)
                    if m.tokens:
                        kv = c.get(m)
                        if kv is None:
                            ops["miss"] += 1
                        c.release(m)
                    else:
                        ops["miss"] += 1
                    extra = tokens(NTOK, seed=10_000 + i)
                    c.put(ns, extra, make_kv(ns.layout, NTOK, seed=1))
                    ops["n"] += 1
                    i += 1
            except BaseException as exc:  # the test reports it
                errors.append(exc)
            finally:
                c.close()

        t = threading.Thread(target=workload, daemon=True)
        t.start()
        time.sleep(0.5)
        d.restart_meta()  # SIGKILL, then a new meta on the same ports
        ready = time.monotonic()
        rehit: list[int] = []
        while time.monotonic() - ready < 5.0:
            rehit = [i for i in hit if client.lookup(ns, prompts[i]) == hits_before[i]]
            if len(rehit) == len(hit):
                break
            time.sleep(0.1)
        took = time.monotonic() - ready
        time.sleep(0.5)
        stop.set()
        t.join(10)
        client.close()
        assert not errors, f"the workload raised: {errors[0]!r}"
        assert ops["n"] > 0
        print(f"meta restart: {len(rehit)}/{len(hit)} hit again {took:.2f} s after ready; {ops}")
        assert len(rehit) == len(hit), f"{len(rehit)}/{len(hit)} hit again in {took:.1f} s"
        # Byte-exact after the rebuild.
        c = GCacheClient(d.client_config())
        m = c.match(ns, prompts[0])
        got = c.get(m)
        assert got is not None
        kv = make_kv(ns.layout, NTOK, seed=0)
        for layer in got:
            k, v = kv[layer.layer]
            n = len(layer.k)
            assert np.array_equal(np.asarray(layer.k), k[layer.start : layer.start + n])
            assert np.array_equal(np.asarray(layer.v), v[layer.start : layer.start + n])
        c.release(m)
        c.close()
