"""The engine-agnostic part of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

import pytest

from gcache import layout as laymod
from gcache import wire
from gcache.errors import ConfigError
from gcache_client.engines.vllm.core import (
    BridgeConfig,
    match_from_wire,
    match_to_wire,
    store_tokens,
)
from gcache_client.types import Match, Namespace


def test_bridge_config_takes_client_fields_and_refuses_unknown() -> None:
    cfg = BridgeConfig.from_extra(
        {"meta": "10.0.0.5:7700", "meta_grpc": "10.0.0.5:7701", "max_pending_stores": 2}
    )
    assert cfg.client.meta == "10.0.0.5:7700" and cfg.max_pending_stores == 2
    with pytest.raises(ConfigError, match="unknown GCache connector settings"):
        BridgeConfig.from_extra({"meta": "10.0.0.5:7700", "metaa_grpc": "x"})
    with pytest.raises(ConfigError):
        BridgeConfig.from_extra({"max_pending_stores": 0})
    with pytest.raises(ConfigError):
        BridgeConfig.from_extra({"meta": "no-port"})


def test_store_tokens_stops_before_the_last_token() -> None:
    # An identical prompt later leaves its last token to compute: a block-aligned
    # prompt stores all but its last block, so the repeat matches all it stored.
    assert store_tokens(768, 256) == 512
    assert store_tokens(769, 256) == 768
    assert store_tokens(700, 256) == 512
    assert store_tokens(256, 256) == 0
    assert store_tokens(1, 256) == 0


def test_match_survives_the_trip_to_a_worker() -> None:
    spec = laymod.preset("mimo-v2-flash", 64)
    ns = Namespace(b"\1" * 16, "m", laymod.Layout(spec))
    grant = wire.Grant(offset=4096, length=512, expiry_ms=123, tag=b"t" * 8)
    objs = [wire.ObjectLoc(block=0, group=0, server=0, grant=grant, sums=b"s" * 8)]
    servers = [wire.ServerAddr("s0", "127.0.0.1", 9, "h", "/dev/shm/x", incarnation=3)]
    m = Match(ns, 1, 64, 77, objs, servers)
    back = match_from_wire(ns, match_to_wire(m))
    assert (back.blocks, back.tokens, back.lease_id) == (1, 64, 77)
    assert back.objects == m.objects and back.servers == m.servers
