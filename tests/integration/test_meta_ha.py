"""Meta high availability on a real etcd: two metas elected through it, two
servers and clients following the leader (``LocalDeployment(ha=True)``).

* kill -9 of the leader under puts and gets: the standby serves within 3 s, the
  prompts stored before hit again, zero wrong bytes, no exception in the client;
* the leader SIGSTOPped past its lease: the standby takes over, the old leader's
  write grants are refused by the servers (their ``old_epoch_refused``), and once
  resumed it serves nothing and comes back as a standby;
* etcd down (killed, then restarted on the same data and ports): the leader
  serves on, and is still the only leader, same epoch, when etcd returns;
* a standby redirects (hot path ``E_NOT_LEADER``, gRPC ``FAILED_PRECONDITION``
  naming the leader); a client given both metas as a list works too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.cli.deploy import LocalDeployment, Proc, signal_group
from gcache.cli.ha import ETCD_BIN
from gcache.config import ClientConfig
from gcache.errors import E_ACCESS_DENIED, E_NOT_LEADER
from gcache.keys import block_keys
from gcache.leader import parse_redirect
from gcache.router.hotpath import PoolMatcher
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

NTOK = 4 * 12 + 3  # 12 blocks of 4 tokens

if not os.access(ETCD_BIN, os.X_OK):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{ETCD_BIN} missing: CI must install etcd-server", pytrace=False)
    pytest.skip(f"{ETCD_BIN} missing (apt-get install -y etcd-server)", allow_module_level=True)


def _server_stats(port: int) -> dict[str, float]:
    _, body, _ = rawwire.call(port, wire.ServerStats())
    return dict(body.values)


def _store(client: GCacheClient, ns: object, n: int, seed0: int = 0) -> list[np.ndarray]:
    prompts = [tokens(NTOK, seed=seed0 + s) for s in range(n)]
    for s, toks in enumerate(prompts):
        res = client.put(ns, toks, make_kv(ns.layout, NTOK, seed=seed0 + s))  # type: ignore[attr-defined]
        assert res.ok, res.error
    return prompts


def _check_bytes(
    client: GCacheClient, ns: object, prompts: list[np.ndarray], seed0: int = 0
) -> int:
    """Prompts that hit whole with the right bytes; a wrong byte fails the test."""
    good = 0
    for s, toks in enumerate(prompts):
        m = client.match(ns, toks)
        if not m.tokens:
            continue
        got = client.get(m)
        if got is not None:
            assert_layers_match(got, make_kv(ns.layout, NTOK, seed=seed0 + s))  # type: ignore[attr-defined]
            good += 1
        client.release(m)
    return good


def _other(d: LocalDeployment, lead: Proc) -> Proc:
    return next(p for p in d.metas.values() if p is not lead)


def test_kill9_leader_under_load_standby_serves(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=2, capacity="64MiB", ha=True) as d:
        d.start()
        client = GCacheClient(d.client_config(timeout_s=1.0))
        ns = client.register_namespace("ha-kill", tiny_hybrid())
        prompts = _store(client, ns, 40)
        assert _check_bytes(client, ns, prompts) == 40
        # No wait here: a commit is in its server's manifest before the OK.

        errors: list[BaseException] = []
        stop = threading.Event()
        ops = {"n": 0, "hits": 0}
        acked: list[int] = []  # workload puts whose commit returned OK

        def workload() -> None:
            c = GCacheClient(d.client_config(timeout_s=1.0))
            try:
                i = 0
                while not stop.is_set():
                    s = i % len(prompts)
                    m = c.match(ns, prompts[s])
                    if m.tokens:
                        got = c.get(m)
                        if got is not None:
                            assert_layers_match(got, make_kv(ns.layout, NTOK, seed=s))
                            ops["hits"] += 1
                        c.release(m)
                    res = c.put(ns, tokens(NTOK, seed=10_000 + i), make_kv(ns.layout, NTOK, seed=1))
                    if res.ok and not res.no_space and res.blocks == NTOK // 4:
                        acked.append(i)
                    ops["n"] += 1
                    i += 1
            except BaseException as exc:  # the test reports it
                errors.append(exc)
            finally:
                c.close()

        t = threading.Thread(target=workload, daemon=True)
        t.start()
        time.sleep(0.5)
        old = d.signal_leader(signal.SIGKILL)
        killed = time.monotonic()
        new = d.leader(timeout=10.0, exclude=old)
        probe = pb.GetStatsRequest()
        while True:  # serves: answers the hot path as the leader
            _, body, _ = rawwire.call(new.port, wire.Ping())
            if isinstance(body, wire.Ok):
                break
            time.sleep(0.02)
        serves = time.monotonic() - killed
        rehit = 0
        at5 = -1.0
        while time.monotonic() - killed < 15.0:
            rehit = sum(1 for toks in prompts if client.lookup(ns, toks) == (NTOK // 4) * 4)
            if rehit >= 0.95 * len(prompts) and at5 < 0:
                at5 = time.monotonic() - killed
            if rehit == len(prompts):
                break
            time.sleep(0.1)
        all_at = time.monotonic() - killed
        time.sleep(0.5)
        stop.set()
        t.join(10)
        assert not errors, f"the workload raised: {errors[0]!r}"
        good = _check_bytes(client, ns, prompts)
        client.close()
        with grpc.insecure_channel(d.grpc_of(new)) as ch:
            st = pb_grpc.ControlStub(ch).GetStats(probe, timeout=5)
        print(
            f"failover: standby serves {serves:.2f} s after kill -9; 95% hit at {at5:.2f} s, "
            f"{rehit}/{len(prompts)} at {all_at:.2f} s; epoch {st.epoch}; workload {ops}"
        )
        assert serves < 3.0
        assert 0 <= at5 <= 5.0
        assert rehit == len(prompts) and good == len(prompts)
        assert ops["n"] > 0
        # Every workload put acknowledged (before, during or after the kill) hits
        # with its bytes: its objects were in their servers' manifests before OK.
        lost = []
        with GCacheClient(d.client_config(timeout_s=2.0)) as c:
            for i in acked:
                toks = tokens(NTOK, seed=10_000 + i)
                m = c.match(ns, toks)
                got = c.get(m) if m.tokens == (NTOK // 4) * 4 else None
                if got is None:
                    lost.append(i)
                else:
                    assert_layers_match(got, make_kv(ns.layout, NTOK, seed=1))
                c.release(m)
        print(f"workload: {len(acked)} acknowledged puts, {len(lost)} not found after failover")
        assert acked and not lost, f"acknowledged puts lost: {lost}"


def test_sigstop_leader_is_fenced_and_comes_back_standby(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=2, capacity="64MiB", ha=True) as d:
        d.start()
        client = GCacheClient(d.client_config(timeout_s=1.0))
        ns = client.register_namespace("ha-stop", tiny_hybrid())
        prompts = _store(client, ns, 20)
        old = d.leader()
        old_epoch = d.stats().epoch
        # A put begun at the old leader: its write grants carry the old epoch.
        keys = [bytes([i]) * 16 for i in range(1, 4)]
        _, placed, _ = rawwire.call(
            old.port,
            wire.PutBegin(ns.fingerprint, keys, [0b11] * 3),  # type: ignore[arg-type]
        )
        assert isinstance(placed, wire.PutPlaced) and placed.placements
        signal_group(old, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            new = d.leader(timeout=10.0, exclude=old)
            took = time.monotonic() - stopped
            # Both servers registered with the new leader (its epoch is theirs).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = d.stats()
                if sum(1 for s in st.servers if s.alive) == 2:
                    break
                time.sleep(0.1)
            assert st.epoch > old_epoch
            # The old leader's grants write nothing now.
            refused = 0
            for p in placed.placements:
                srv = placed.servers[p.server]
                payload = b"\xab" * p.grant.length
                rec = rawwire.obj(ns.fingerprint, ns.layout, keys, p)
                _, body, _ = rawwire.call(srv.port, wire.Write(p.grant, rec), payload)
                assert isinstance(body, wire.Error) and body.code == E_ACCESS_DENIED, body
                refused += 1
            counts = [_server_stats(s.port)["old_epoch_refused"] for s in d.servers]
            assert sum(counts) >= refused
            time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped)))
        finally:
            signal_group(old, signal.SIGCONT)
        # Resumed: it cannot confirm its lease, serves nothing, and steps down.
        deadline = time.monotonic() + 10
        roles = set()
        while time.monotonic() < deadline:
            roles = {p.name: d.role_of(p) for p in d.metas.values()}
            if roles[old.name] == "standby":
                break
            time.sleep(0.1)
        assert roles == {old.name: "standby", new.name: "leader"}, roles
        assert old.alive  # the same process (it replaced itself: exec)
        _, body, _ = rawwire.call(old.port, wire.Ping())
        assert isinstance(body, wire.Error) and body.code == E_NOT_LEADER
        assert _check_bytes(client, ns, prompts) == len(prompts)
        client.close()
        print(f"SIGSTOP: standby leads {took:.2f} s after the stop; refused {counts}")


def test_etcd_down_leader_serves_on(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=2, capacity="64MiB", ha=True) as d:
        d.start()
        assert d.etcd is not None
        client = GCacheClient(d.client_config(timeout_s=1.0))
        ns = client.register_namespace("ha-etcd", tiny_hybrid())
        prompts = _store(client, ns, 10)
        lead = d.leader()
        epoch = d.stats().epoch
        d.etcd.kill()
        t0 = time.monotonic()
        fresh = 0
        while time.monotonic() - t0 < 30.0:  # lookups and puts go on
            assert _check_bytes(client, ns, prompts) == len(prompts)
            toks = tokens(NTOK, seed=500 + fresh)
            assert client.put(ns, toks, make_kv(ns.layout, NTOK, seed=500 + fresh)).ok
            fresh += 1
            time.sleep(0.5)
        assert d.role_of(lead) == "leader"
        d.etcd.launch()
        time.sleep(3.0)  # a few keep-alives and standby reads
        roles = {p.name: d.role_of(p) for p in d.metas.values()}
        assert sorted(roles.values()) == ["leader", "standby"], roles
        assert d.role_of(lead) == "leader"
        assert d.stats().epoch == epoch
        assert _check_bytes(client, ns, prompts) == len(prompts)
        client.close()
        print(f"etcd down 30 s: {fresh} puts went on; leader {lead.name} kept epoch {epoch}")


def test_standby_redirects_and_lists_work(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path, servers=2, capacity="64MiB", ha=True) as d:
        d.start()
        lead = d.leader()
        standby = _other(d, lead)
        _, body, _ = rawwire.call(standby.port, wire.Ping())
        assert isinstance(body, wire.Error) and body.code == E_NOT_LEADER
        assert parse_redirect(body.message) == (d.hot_of(lead), d.grpc_of(lead))
        with grpc.insecure_channel(d.grpc_of(standby)) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ControlStub(ch).RegisterNamespace(
                    pb.RegisterNamespaceRequest(model="x"), timeout=5
                )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert parse_redirect(err.value.details()) == (d.hot_of(lead), d.grpc_of(lead))
        # /ready: 200 on both (the leader serves, the standby is in touch with etcd).
        import urllib.request

        for p in (lead, standby):
            url = f"http://{d.host}:{p.extra['metrics_port']}/ready"
            with urllib.request.urlopen(url, timeout=5) as r:
                assert r.status == 200
        # A client given both metas, the standby first; and one given etcd.
        order = [standby, lead]
        listed = ClientConfig(
            meta=",".join(d.hot_of(p) for p in order),
            meta_grpc=",".join(d.grpc_of(p) for p in order),
            timeout_s=2.0,
        )
        for cfg in (listed, d.client_config(timeout_s=2.0)):
            with GCacheClient(cfg) as c:
                ns = c.register_namespace("ha-list", tiny_hybrid())
                prompts = _store(c, ns, 3, seed0=77)
                assert _check_bytes(c, ns, prompts, seed0=77) == 3
        # The router's pool match follows the leader too: given both metas with
        # the standby first, or etcd.
        keys = block_keys(ns.fingerprint, prompts[0], ns.layout.block_size)

        async def pool_match(addr: str) -> tuple[int, int]:
            pm = PoolMatcher(addr, ns.fingerprint, 2.0)
            try:
                first = await pm.match(keys)  # the standby's E_NOT_LEADER: no pool hit
                return first, await pm.match(keys)
            finally:
                pm.close()

        standby_first = ",".join(d.hot_of(p) for p in order)
        _, listed_blocks = asyncio.run(pool_match(standby_first))
        etcd_first, etcd_blocks = asyncio.run(pool_match(d.meta_addr))
        assert listed_blocks == len(keys) and etcd_first == etcd_blocks == len(keys)
