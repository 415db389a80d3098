"""The meta's removal feed against real daemons: a real meta and server,
a real client filling a small store; ``WatchRemovals`` streams exactly the blocks
that left GCache; the subscriber ends with its call; a tenant watches only its own
namespaces; a restarted meta reads as a gap."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import call_metadata, sync_channel
from gcache.cli.deploy import LocalDeployment
from gcache.keys import block_keys
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from gcache_client.engines.kv_events import RemovalWatcher, ReportedBlocks, gcache_hash
from tests.kvdata import make_kv, tokens

SMALL = LayoutSpec(
    block_size=16, dtype="float16", layers=(LayerSpec("full", 1, 256, 256),)
)  # 16 KiB per block
BOB = "bob-access-0123456789ab"
ALICE = "alice-access-0123456789"


class Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.removed: list[tuple[bytes, int]] = []
        self.gaps = 0

    def __call__(self, fp: bytes, removed: list[tuple[bytes, int]], gap: bool) -> None:
        with self.lock:
            self.removed += removed
            self.gaps += gap


def wait(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def counter(d: LocalDeployment, name: str) -> float:
    return float(d.stats().counters[name])


def test_watch_removals_streams_exactly_the_evicted_blocks(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path / "d", servers=1, capacity="2MiB") as d:
        c = GCacheClient(d.client_config(), timeout_s=5.0)
        sink = Sink()
        w = RemovalWatcher(d.meta_grpc, sink, keepalive_s=0.2)
        try:
            ns = c.register_namespace("m", SMALL)
            assert w.watch(ns.fingerprint) and w.wait_connected(ns.fingerprint, 10)
            assert counter(d, "event_subscribers") == 1
            prompts = [tokens(256, seed=s) for s in range(16)]  # 16 x 256 KiB > 2 MiB
            for t in prompts:
                assert c.put(ns, t, make_kv(ns.layout, 256, seed=1)).ok
            wait(lambda: counter(d, "removals_delivered") == counter(d, "evictions"))
            assert counter(d, "evictions") > 0
            wait(lambda: len(sink.removed) == counter(d, "evictions"))
            assert sink.gaps == 0
            removed = {k for k, _ in sink.removed}
            assert all(g == 0 for _, g in sink.removed)
            # Exactly the blocks that are gone: a lookup stops at the first removed one.
            for t in prompts:
                ks = block_keys(ns.fingerprint, t, 16)
                hit = c.lookup(ns, t) // 16
                assert not removed & set(ks[:hit]), "a block still served was reported removed"
                assert ks[hit:] == [] or ks[hit] in removed or hit == len(ks)
            # The connector's table retracts what it reported stored.
            table = ReportedBlocks([0])
            first = block_keys(ns.fingerprint, prompts[0], 16)
            table.stored([gcache_hash(k) for k in first], 0)
            table.removed(sink.removed)
            gone = {h for _, hs in table.take() for h in hs}
            assert gone == {gcache_hash(k) for k in first if k in removed}
        finally:
            w.close()
            c.close()
        # The subscriber belonged to the call: gone with it.
        wait(lambda: counter(d, "event_subscribers") == 0)


def test_a_restarted_meta_reads_as_a_gap(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path / "d", servers=1, capacity="4MiB") as d:
        c = GCacheClient(d.client_config(), timeout_s=5.0)
        sink = Sink()
        w = RemovalWatcher(d.meta_grpc, sink, retry_s=0.2, keepalive_s=0.2)
        try:
            ns = c.register_namespace("m", SMALL)
            assert w.watch(ns.fingerprint) and w.wait_connected(ns.fingerprint, 10)
            d.restart_meta()
            wait(lambda: sink.gaps >= 1, 20)
        finally:
            w.close()
            c.close()


def test_tenants_watch_only_their_own_namespaces(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'["{BOB}"]\nname = "bob"\nnamespaces = ["bob/"]\n'
        f'["{ALICE}"]\nname = "alice"\nnamespaces = ["alice/"]\n'
    )
    flags = ["--tenants-file", str(tenants)]
    with LocalDeployment(tmp_path / "d", servers=1, capacity="4MiB", meta_args=flags) as d:
        bob = GCacheClient(d.client_config(token=BOB), timeout_s=5.0)
        try:
            ns = bob.register_namespace("m", SMALL, cache_salt="bob/chat")
        finally:
            bob.close()
        req = pb.WatchRemovalsRequest(namespace=ns.fingerprint)
        with sync_channel(d.meta_grpc) as ch:
            stub = pb_grpc.ControlStub(ch)
            for token in (ALICE, None):
                with pytest.raises(grpc.RpcError) as err:
                    next(iter(stub.WatchRemovals(req, metadata=call_metadata(token), timeout=5)))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as err:
                other = pb.WatchRemovalsRequest(namespace=b"x" * 16)
                next(iter(stub.WatchRemovals(other, metadata=call_metadata(BOB), timeout=5)))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            call = stub.WatchRemovals(req, metadata=call_metadata(BOB), timeout=5)
            first = next(iter(call))
            assert not first.removed and not first.gap
            call.cancel()
        assert counter(d, "refused_unauthenticated") == 2
        wait(lambda: counter(d, "event_subscribers") == 0)
