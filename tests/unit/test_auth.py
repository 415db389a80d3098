"""gcache.auth: token files, the tenant table, who may do what; the meta's
server-id rule and the hot path's HELLO gate (in process, no sockets)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from gcache import config as cfgmod
from gcache import wire
from gcache.auth import (
    CLUSTER,
    Authenticator,
    TenantTable,
    bearer,
    call_metadata,
    load_client_token,
    load_cluster_token,
    summary,
    token_hash,
)
from gcache.config import ClientConfig, MetaConfig, ServerConfig
from gcache.errors import E_ACCESS_DENIED, ConfigError, Refusal
from gcache.meta.control import id_conflict
from gcache.meta.core import MetaCore
from gcache.meta.hotpath import dispatch
from gcache.meta.records import ServerRecord
from gcache.meta.session import Principal, Session

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"
ADMIN = "admin-token-0123456789"
CLUSTER_TOKEN = "cluster-token-0123456789"

TENANTS_TOML = f"""
["{ALICE}"]
name = "alice"
namespaces = ["alice/"]
quota = "1MiB"

["sha256:{hashlib.sha256(BOB.encode()).hexdigest()}"]
name = "bob"
namespaces = ["bob/", "shared/"]

["{ADMIN}"]
name = "ops"
namespaces = [""]
admin = true
"""


@pytest.fixture
def tenants(tmp_path: Path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return str(path)


def test_tenant_table_loads_plain_and_hashed_tokens(tenants: str) -> None:
    table = TenantTable.load(tenants)
    assert len(table) == 3
    alice = table.lookup(ALICE)
    assert alice == Principal("alice", ("alice/",), 1 << 20, False)
    bob = table.lookup(BOB)  # listed only by its sha256
    assert bob is not None and bob.namespaces == ("bob/", "shared/") and bob.quota_bytes == 0
    assert table.lookup("nobody-0123456789abcdef") is None
    assert ALICE.encode() not in repr(table).encode()  # only hashes are kept
    assert set(table.by_hash) >= {token_hash(ALICE), token_hash(BOB)}


def test_tenant_table_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({ALICE: {"name": "a", "namespaces": ["a/"], "quota": 4096}}))
    who = TenantTable.load(str(path)).lookup(ALICE)
    assert who is not None and who.quota_bytes == 4096


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('["short"]\nname="x"\nnamespaces=[""]', "at least 16"),
        (f'["{ALICE}"]\nname="x"', "namespaces must be a non-empty list"),
        (f'["{ALICE}"]\nname="x"\nnamespaces=[]', "namespaces must be a non-empty list"),
        (f'["{ALICE}"]\nnamespaces=["a"]', "name is required"),
        (f'["{ALICE}"]\nname="x"\nnamespaces=["a"]\nquota="lots"', "not a size"),
        (f'["{ALICE}"]\nname="x"\nnamespaces=["a"]\nadmin="yes"', "admin must be"),
        (f'["{ALICE}"]\nname="x"\nnamespaces=["a"]\nquotas=1', "unknown keys"),
        ('["sha256:abcd"]\nname="x"\nnamespaces=["a"]', "64 hex digits"),
        ("", "no tokens"),
        ("[[", "cannot parse"),
    ],
)
def test_tenant_table_rejects_bad_files(tmp_path: Path, entry: str, message: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(entry)
    with pytest.raises(ConfigError, match=message):
        TenantTable.load(str(path))


def test_cluster_token_from_file_or_env(tmp_path: Path) -> None:
    path = tmp_path / "cluster.token"
    path.write_text(CLUSTER_TOKEN + "\n")
    assert load_cluster_token(str(path), env={}) == CLUSTER_TOKEN
    assert load_cluster_token("", env={"GCACHE_CLUSTER_TOKEN": CLUSTER_TOKEN}) == CLUSTER_TOKEN
    assert load_cluster_token("", env={}) is None
    path.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_cluster_token(str(path), env={})
    with pytest.raises(ConfigError, match="at least 16"):
        load_cluster_token("", env={"GCACHE_CLUSTER_TOKEN": "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_token(str(tmp_path / "missing"), env={})


def test_client_token_from_value_or_file(tmp_path: Path) -> None:
    path = tmp_path / "client.token"
    path.write_text(ALICE)
    assert load_client_token("", str(path)) == ALICE
    assert load_client_token(ALICE, "") == ALICE
    assert load_client_token("", "") is None
    with pytest.raises(ConfigError, match="not both"):
        load_client_token(ALICE, str(path))


def test_tokens_are_never_flags_nor_printed() -> None:
    parser = argparse.ArgumentParser()
    cfgmod.add_arguments(parser, ClientConfig)
    flags = {a for act in parser._actions for a in act.option_strings}
    assert "--token" not in flags and "--token-file" in flags and "--tls-ca" in flags
    assert ALICE not in repr(ClientConfig(token=ALICE))
    for cls in (MetaConfig, ServerConfig):
        parser = argparse.ArgumentParser()
        cfgmod.add_arguments(parser, cls)
        names = {a for act in parser._actions for a in act.option_strings}
        assert "--cluster-token-file" in names and "--cluster-token" not in names
    with pytest.raises(ConfigError, match="go together"):
        MetaConfig(tls_cert="c.pem").check()


def test_bearer_metadata_roundtrip() -> None:
    assert bearer(call_metadata(ALICE)) == ALICE
    assert bearer([("authorization", b"Bearer " + ALICE.encode())]) == ALICE
    assert bearer([("authorization", "Basic xyz")]) is None
    assert bearer(None) is None and call_metadata(None) == []


def test_authenticator_decisions(tenants: str, tmp_path: Path) -> None:
    open_auth = Authenticator()
    assert not open_auth.enabled
    assert open_auth.is_cluster(None) and open_auth.principal(None) is CLUSTER
    assert open_auth.may_register_namespace(None, "any") is None
    assert open_auth.may_administer(None) is None

    path = tmp_path / "cluster.token"
    path.write_text(CLUSTER_TOKEN)
    auth = Authenticator.from_files(str(path), tenants, env={})
    assert auth.enabled
    assert auth.is_cluster(CLUSTER_TOKEN) and not auth.is_cluster(ALICE)
    assert not auth.is_cluster(None)
    assert auth.principal(CLUSTER_TOKEN) is CLUSTER
    assert auth.may_register_namespace(ALICE, "alice/chat") is None
    assert "may not use" in (auth.may_register_namespace(ALICE, "bob/chat") or "")
    assert "access token is required" in (auth.may_register_namespace(None, "alice/") or "")
    assert auth.may_register_namespace(CLUSTER_TOKEN, "bob/x") is None
    assert "not an admin" in (auth.may_administer(ALICE) or "")
    assert auth.may_administer(ADMIN) is None and auth.may_administer(CLUSTER_TOKEN) is None
    assert auth.may_administer("junk-0123456789abcdef") is not None

    # Cluster token only: the control plane is closed, namespaces stay open.
    only_cluster = Authenticator.from_files(str(path), "", env={})
    assert only_cluster.may_register_namespace(None, "x") is None
    assert only_cluster.may_administer(None) is not None


def _record(host: str, port: int, hostname: str, incarnation: int, seen: float) -> ServerRecord:
    addr = wire.ServerAddr("s0", host, port, hostname, "/dev/shm/x", incarnation)
    return ServerRecord("s0", addr, b"k" * 16, incarnation, 1 << 20, seen)


def test_server_id_held_by_live_server() -> None:
    old = _record("10.0.0.1", 7800, "a", incarnation=1, seen=100.0)
    other = wire.ServerAddr("s0", "10.0.0.2", 7800, "b", "/dev/shm/y", 2)
    same = wire.ServerAddr("s0", "10.0.0.1", 7800, "a", "/dev/shm/z", 2)
    # A second server elsewhere while the first is heard from: refused.
    why = id_conflict(old, other, 2, now=101.0, hold_s=5.0)
    assert why is not None and "held by a live server at 10.0.0.1:7800 on a" in why
    # Same place, new incarnation: a restart.
    assert id_conflict(old, same, 2, now=101.0, hold_s=5.0) is None
    # Same incarnation: the holder itself registering again.
    assert id_conflict(old, other, 1, now=101.0, hold_s=5.0) is None
    # The old one fell silent (or was dropped): the id is free.
    assert id_conflict(old, other, 2, now=105.0, hold_s=5.0) is None
    old.alive = False
    assert id_conflict(old, other, 2, now=101.0, hold_s=5.0) is None
    assert id_conflict(None, other, 2, now=101.0, hold_s=5.0) is None
    # Same host and port on another machine is not the same place.
    old.alive = True
    moved = wire.ServerAddr("s0", "10.0.0.1", 7800, "b", "/dev/shm/y", 2)
    assert id_conflict(old, moved, 2, now=101.0, hold_s=5.0) is not None


def test_hot_path_requires_hello_when_tenants_are_configured(tenants: str) -> None:
    core = MetaCore(MetaConfig())
    auth = Authenticator.from_files("", tenants, env={})
    session = Session("test")
    release = wire.Release(12345)
    with pytest.raises(Refusal) as err:
        dispatch(core, session, wire.T_RELEASE, release, auth)
    assert err.value.code == E_ACCESS_DENIED and "send HELLO" in err.value.message
    assert isinstance(dispatch(core, session, wire.T_PING, wire.Ping(), auth), wire.Ok)
    with pytest.raises(Refusal) as err:
        dispatch(core, session, wire.T_HELLO, wire.Hello("wrong-0123456789abcdef"), auth)
    assert err.value.code == E_ACCESS_DENIED and not session.authenticated
    assert dispatch(core, session, wire.T_HELLO, wire.Hello(ALICE), auth) == wire.Ok(1)
    assert session.authenticated and session.principal.name == "alice"
    assert dispatch(core, session, wire.T_RELEASE, release, auth) == wire.Ok(0)
    # The same token again is fine; switching tenants on one connection is not.
    assert dispatch(core, session, wire.T_HELLO, wire.Hello(ALICE), auth) == wire.Ok(1)
    with pytest.raises(Refusal, match="already authenticated as alice"):
        dispatch(core, session, wire.T_HELLO, wire.Hello(BOB), auth)


def test_hot_path_without_tenants_serves_anonymous_sessions() -> None:
    core = MetaCore(MetaConfig())
    session = Session("test")
    assert dispatch(core, session, wire.T_RELEASE, wire.Release(1), Authenticator()) == wire.Ok(0)
    assert dispatch(core, session, wire.T_RELEASE, wire.Release(1), None) == wire.Ok(0)
    assert dispatch(core, session, wire.T_HELLO, wire.Hello("whatever"), None) == wire.Ok(0)
    assert session.principal.admin


def test_summary_says_when_there_is_no_authentication() -> None:
    assert summary("", "", "", env={}).startswith("none: runs without authentication")
    assert summary("", "", "", env={"GCACHE_CLUSTER_TOKEN": CLUSTER_TOKEN}) == "cluster token"
    assert summary("c", "t.toml", "cert.pem", env={}) == "cluster token, tenant tokens, gRPC TLS"
