"""The router's pool match through a real meta: blocks a real GCacheClient put
into a real meta + server are credited to every instance (pool_blocks), which
changes the choice as the gcache policy's cost says; with the meta down the route
still succeeds with no pool credit. With a tenant table on the meta, the router's
lookups authenticate with its own access token (router.token / token_file /
GCACHE_ROUTER_TOKEN, sent as HELLO on its meta connection)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache.keys import block_keys
from gcache.layout import LayerSpec, LayoutSpec, encode_spec
from gcache_client import GCacheClient
from tests.integration.test_router import Router
from tests.kvdata import make_kv
from tests.unit.test_router_events import stored

SMALL = LayoutSpec(
    block_size=16, dtype="float16", layers=(LayerSpec("full", 1, 256, 256),)
)  # 16 KiB per block, one full-attention group
BOB = "bob-access-0123456789ab"
ALICE = "alice-access-0123456789"


def _tenants(tmp_path: Path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'["{BOB}"]\nname = "bob"\nnamespaces = ["bob/"]\n'
        f'["{ALICE}"]\nname = "alice"\nnamespaces = ["alice/"]\n'
    )
    return str(path)


def _router(
    tmp: Path, d: LocalDeployment, fp: bytes, name: str, *args: str, **kw: object
) -> Router:
    layout = tmp / "small-layout.json"
    layout.write_bytes(encode_spec(SMALL))
    return Router(
        tmp, "--meta", d.meta_addr, "--pool-timeout-s", "1", *args,
        fp=fp, layout=str(layout), block_size=16, instances="", name=name, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _pool_route(r: Router, keys: list[bytes]) -> wire.Routed:
    reply = r.call(wire.Route(keys, len(keys) * 16))
    assert isinstance(reply, wire.Routed), reply
    return reply


def _wait_blocks(r: Router, instance: str, n: int) -> None:
    r.wait_metric(lambda: r.metric("gcache_router_instance_blocks", instance=instance) == n)


def _pool_failures(r: Router) -> float:
    return r.metric("gcache_router_connections_total", front="pool", what="failures")


def test_pool_match_through_a_real_meta_with_a_token_and_meta_down(tmp_path: Path) -> None:
    """Bob's client puts a 4-block prompt. e1 holds its first 2 blocks itself but
    has 20 tokens in flight; e2 holds nothing and is idle.

    * router with bob's token (file): pool_blocks 4, and the pool serves what e1's
      own copy would save, so idle e2 wins (cost 0.05 x 64 = 3.2 against e1's
      0.05 x 32 + 20 = 21.6), reason "pool";
    * router with no token: the meta refuses its lookups ("send HELLO"): pool 0,
      e1 wins on its local blocks (cost 32 + 20 = 52 against 64), the route succeeds;
    * router with alice's token (environment): HELLO accepted, but alice may not
      read bob's namespace: pool 0;
    * meta down: the token router still routes, pool 0, to e1.
    """
    with LocalDeployment(
        tmp_path / "d",
        servers=1,
        capacity="16MiB",
        meta_args=["--tenants-file", _tenants(tmp_path)],
    ) as d:
        with GCacheClient(d.client_config(token=BOB), timeout_s=5.0) as bob:
            ns = bob.register_namespace("m", SMALL, cache_salt="bob/chat")
            toks = [int(t) for t in range(1000, 1064)]
            assert bob.put(ns, toks, make_kv(ns.layout, 64, seed=3)).ok
            assert bob.lookup(ns, toks) == 64
        keys = block_keys(ns.fingerprint, toks, 16)
        token_file = tmp_path / "router.token"
        token_file.write_text(BOB + "\n")
        routers = {
            "bob": _router(tmp_path, d, ns.fingerprint, "bob", "--token-file", str(token_file)),
            "none": _router(tmp_path, d, ns.fingerprint, "none"),
            "alice": _router(
                tmp_path, d, ns.fingerprint, "alice", env={"GCACHE_ROUTER_TOKEN": ALICE}
            ),
        }
        try:
            for r in routers.values():
                r.load("e1", tokens=20)
                r.load("e2")
                r.send("e1", stored([11, 12], None, toks[:32], block_size=16, group_idx=0,
                                    kv_cache_spec_kind="full_attention"))  # fmt: skip
                _wait_blocks(r, "e1", 2)
            got = _pool_route(routers["bob"], keys)
            assert (got.instance, got.pool_blocks, got.local_blocks, got.reason) == (
                "e2",
                4,
                0,
                "pool",
            ), got
            assert _pool_failures(routers["bob"]) == 0
            for name in ("none", "alice"):
                got = _pool_route(routers[name], keys)
                assert (got.instance, got.pool_blocks, got.local_blocks) == ("e1", 0, 2), got
                assert _pool_failures(routers[name]) >= 1
            assert "send HELLO" in routers["none"].log.read_text()
            assert "pool match at meta" in routers["alice"].log.read_text()
            assert BOB not in routers["bob"].log.read_text()  # the token is never logged
            # The meta goes down: routes still succeed, with no pool credit.
            assert d.meta is not None
            d.meta.popen.terminate()
            assert d.meta.popen.wait(10) == 0
            for _ in range(3):
                got = _pool_route(routers["bob"], keys)
                assert (got.instance, got.pool_blocks) == ("e1", 0), got
            assert _pool_failures(routers["bob"]) >= 1
        finally:
            codes = {n: r.stop() for n, r in routers.items()}
        assert all(c == 0 for c in codes.values()), codes


def test_router_token_is_never_a_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gcache.router.daemon", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--token-file" in out.stdout
    assert "--token " not in out.stdout and "--token\n" not in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "gcache.router.daemon", "--token", "x" * 20],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and "x" * 20 not in out.stderr


@pytest.mark.parametrize("content", ["", "short"])
def test_bad_router_token_file_is_one_line(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tok"
    path.write_text(content)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "gcache.router.daemon", "--port", "0", "--http-port", "-1",
         "--token-file", str(path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0 and time.monotonic() - t0 < 30
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], out.stderr
