"""Authentication against real daemons: the cluster token on the control plane,
server identity (duplicate ids), fast re-registration after a meta restart, tenant
access tokens on the hot path and gRPC, TLS for gRPC."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gcache import wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.auth import call_metadata
from gcache.cli.deploy import LocalDeployment
from gcache.errors import E_ACCESS_DENIED, GCacheError
from gcache.keys import block_keys
from gcache.layout import LayerSpec, LayoutSpec
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import make_kv, tokens

CLUSTER_TOKEN = "cluster-secret-0123456789abcdef"
SMALL = LayoutSpec(
    block_size=16, dtype="float16", layers=(LayerSpec("full", 1, 256, 256),)
)  # 16 KiB per block


def _server_args(d: LocalDeployment, shm_dir: Path) -> list[str]:
    """A gcache-server started by hand (to watch it fail to start)."""
    args = ["--meta", d.meta_grpc, "--port", "0", "--capacity", "8MiB", "--no-populate"]
    return [sys.executable, "-m", "gcache.server.daemon", *args, "--shm-dir", str(shm_dir)]


def _token_file(tmp_path: Path, name: str, token: str) -> str:
    path = tmp_path / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def _register_request(server_id: str, port: int) -> pb.RegisterServerRequest:
    return pb.RegisterServerRequest(
        server_id=server_id,
        host="127.0.0.1",
        port=port,
        hostname="intruder",
        shm_path="/dev/shm/none",
        capacity=64 << 20,
        secret=b"k" * 16,
        incarnation=12345,
    )


def _server(d: LocalDeployment, server_id: str) -> Any:
    return next(s for s in d.stats().servers if s.server_id == server_id)


# ---- cluster token and server identity ------------------------------------------------


def test_register_server_without_cluster_token_is_refused_and_keeps_objects(
    tmp_path: Path,
) -> None:
    token = _token_file(tmp_path, "cluster.token", CLUSTER_TOKEN)
    flags = ["--cluster-token-file", token]
    with LocalDeployment(
        tmp_path / "d", servers=1, capacity="16MiB", meta_args=flags, server_args=flags
    ) as d:
        with GCacheClient(d.client_config(), timeout_s=3.0) as c:
            ns = c.register_namespace("auth-cluster", SMALL)
            toks = tokens(64, seed=1)
            assert c.put(ns, toks, make_kv(ns.layout, 64, seed=1)).ok
            assert c.lookup(ns, toks) == 64
            real = _server(d, "server0")
            with grpc.insecure_channel(d.meta_grpc) as ch:
                stub = pb_grpc.ControlStub(ch)
                for metadata in ([], call_metadata("wrong-token-0123456789abcdef")):
                    with pytest.raises(grpc.RpcError) as err:
                        stub.RegisterServer(
                            _register_request("server0", 1), metadata=metadata, timeout=5
                        )
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Heartbeat(
                            pb.HeartbeatRequest(server_id="server0", incarnation=12345),
                            metadata=metadata,
                            timeout=5,
                        )
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The real server still holds its id, its address and its objects.
            assert c.lookup(ns, toks) == 64
            after = _server(d, "server0")
            assert after.address == real.address and after.alive
            assert (d.data_dir / "meta.log").read_text().count("no valid cluster token") >= 2
            assert dict(d.stats().counters)["refused_unauthenticated"] == 4


def test_server_with_wrong_cluster_token_exits_with_one_line(tmp_path: Path) -> None:
    good = _token_file(tmp_path, "cluster.token", CLUSTER_TOKEN)
    bad = _token_file(tmp_path, "bad.token", "another-token-0123456789abcdef")
    with LocalDeployment(
        tmp_path / "d", servers=0, capacity="16MiB", meta_args=["--cluster-token-file", good]
    ) as d:
        proc = subprocess.run(
            [*_server_args(d, tmp_path), "--cluster-token-file", bad],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 1
        lines = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
        assert len(lines) == 1 and "a valid cluster token is required" in lines[0]
        assert "Traceback" not in proc.stderr


def test_duplicate_server_id_from_second_server_is_refused(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path / "d", servers=1, capacity="16MiB") as d:
        with GCacheClient(d.client_config(), timeout_s=3.0) as c:
            ns = c.register_namespace("auth-dup", SMALL)
            toks = tokens(64, seed=2)
            assert c.put(ns, toks, make_kv(ns.layout, 64, seed=2)).ok
            real = _server(d, "server0")
            # A second process with the same --server-id on another port.
            proc = subprocess.run(
                [*_server_args(d, tmp_path), "--server-id", "server0"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert proc.returncode == 1, proc.stderr[-2000:]
            lines = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
            assert len(lines) == 1, proc.stderr[-2000:]
            assert "server id 'server0' is held by a live server" in lines[0]
            assert "Traceback" not in proc.stderr
            # The first server kept its id, address and objects.
            after = _server(d, "server0")
            assert after.address == real.address and after.alive
            assert c.lookup(ns, toks) == 64
            assert dict(d.stats().counters)["refused_duplicate_id"] >= 1


def test_restart_on_same_address_is_accepted(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path / "d", servers=1, capacity="16MiB") as d:
        port = d.servers[0].port
        d.server_ports = [port]
        d.kill_server(0)  # SIGKILL: the meta still thinks it is alive
        assert _server(d, "server0").alive
        d.start_server(0)  # same id, same address, new incarnation: a restart
        assert d.servers[0].port == port
        d.wait_servers(1)


def test_server_reregisters_fast_after_a_long_meta_outage(tmp_path: Path) -> None:
    """Heartbeat interval 0.5 s (LocalDeployment): after a 12 s outage the server is
    registered again within interval + 1 s of the restarted meta being ready. With
    gRPC's default reconnect back-off this took 3.8-4.4 s (grpcio 1.85)."""
    with LocalDeployment(tmp_path / "d", servers=1, capacity="16MiB") as d:
        assert d.meta is not None
        d.meta.popen.send_signal(signal.SIGKILL)
        d.meta.popen.wait(10)
        time.sleep(12.0)  # gRPC's default back-off has grown to ~6 s by now
        d.restart_meta()  # same ports; returns once the meta is ready
        ready = time.monotonic()
        while not any(s.alive for s in d.stats().servers):
            assert time.monotonic() - ready < 10, "server did not re-register"
            time.sleep(0.02)
        took = time.monotonic() - ready
        assert took <= 0.5 + 1.0 + 0.3, f"re-registered {took:.2f} s after the meta was ready"


def test_no_tokens_everything_works_as_before(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path / "d", servers=1, capacity="16MiB") as d:
        assert "runs without authentication" in (d.data_dir / "meta.log").read_text()
        # A client without a token never says HELLO and may do everything.
        with GCacheClient(d.client_config(), timeout_s=3.0) as c:
            ns = c.register_namespace("auth-none", SMALL, cache_salt="anything")
            toks = tokens(64, seed=3)
            assert c.put(ns, toks, make_kv(ns.layout, 64, seed=3)).ok
            assert c.lookup(ns, toks) == 64
            evicted, _ = c.evict(ns, toks, windows_only=False)
            assert evicted >= 1


# ---- tenant access tokens -------------------------------------------------------------

ALICE = "alice-access-0123456789"
BOB = "bob-access-0123456789ab"
OPS = "ops-access-0123456789ab"


def _tenants(tmp_path: Path, alice_quota: str = "0") -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'["{ALICE}"]\nname = "alice"\nnamespaces = ["alice/"]\nquota = "{alice_quota}"\n'
        f'["{BOB}"]\nname = "bob"\nnamespaces = ["bob/"]\n'
        f'["{OPS}"]\nname = "ops"\nnamespaces = [""]\nadmin = true\n'
    )
    return str(path)


def _raw(sock: socket.socket, msg: wire.Msg) -> Any:
    sock.sendall(wire.pack_frame(msg, 1))
    return rawwire.recv_frame(sock)[1]


def test_tenant_tokens_confine_each_client_to_its_namespaces(tmp_path: Path) -> None:
    flags = ["--tenants-file", _tenants(tmp_path)]
    with LocalDeployment(tmp_path / "d", servers=1, capacity="16MiB", meta_args=flags) as d:
        assert d.meta is not None
        bob = GCacheClient(d.client_config(token=BOB), timeout_s=3.0)
        alice = GCacheClient(d.client_config(token=ALICE), timeout_s=3.0)
        nobody = GCacheClient(d.client_config(), timeout_s=3.0)
        try:
            ns_b = bob.register_namespace("m", SMALL, cache_salt="bob/chat")
            toks = tokens(64, seed=4)
            kv = make_kv(ns_b.layout, 64, seed=4)
            assert bob.put(ns_b, toks, kv).ok and bob.lookup(ns_b, toks) == 64
            # gRPC: alice may register only under her prefix; no token: nothing.
            with pytest.raises(GCacheError, match="may not use cache_salt 'bob/chat'"):
                alice.register_namespace("m", SMALL, cache_salt="bob/chat")
            ns_a = alice.register_namespace("m", SMALL, cache_salt="alice/chat")
            with pytest.raises(GCacheError, match="access token is required"):
                nobody.register_namespace("m", SMALL, cache_salt="")
            # Hot path with bob's namespace in hand: alice reads nothing, writes nothing.
            assert alice.lookup(ns_b, toks) == 0
            assert alice.put(ns_b, toks, kv).stored == 0
            assert nobody.lookup(ns_b, toks) == 0
            assert alice.put(ns_a, toks, kv).ok and alice.lookup(ns_a, toks) == 64
            # Admin calls: bob may not evict, the ops token may.
            with pytest.raises(GCacheError, match="not an admin"):
                bob.evict(ns_b, toks)
            ops = GCacheClient(d.client_config(token=OPS), timeout_s=3.0)
            assert ops.evict(ns_b, toks, blocks=range(3, 4), windows_only=False) == (1, 0)
            ops.close()
            assert bob.lookup(ns_b, toks) == 48
        finally:
            for c in (bob, alice, nobody):
                c.close()

        # The same on raw frames: exact error codes, and the connection stays usable.
        keys = block_keys(ns_b.fingerprint, toks, 16)
        with rawwire.connect(d.meta.port) as s:
            err = _raw(s, wire.Lookup(ns_b.fingerprint, keys))
            assert isinstance(err, wire.Error) and err.code == E_ACCESS_DENIED
            assert "send HELLO" in err.message
            assert isinstance(_raw(s, wire.Ping()), wire.Ok)
            err = _raw(s, wire.Hello("forged-token-0123456789"))
            assert isinstance(err, wire.Error) and err.code == E_ACCESS_DENIED
            assert _raw(s, wire.Hello(ALICE)) == wire.Ok(1)
            err = _raw(s, wire.Lookup(ns_b.fingerprint, keys))
            assert isinstance(err, wire.Error) and err.code == E_ACCESS_DENIED
            err = _raw(s, wire.PutBegin(ns_b.fingerprint, keys, [1] * len(keys)))
            assert isinstance(err, wire.Error) and err.code == E_ACCESS_DENIED
        with rawwire.connect(d.meta.port) as s:
            assert _raw(s, wire.Hello(BOB)) == wire.Ok(1)
            res = _raw(s, wire.Lookup(ns_b.fingerprint, keys))
            assert isinstance(res, wire.LookupResult) and res.blocks == 3


def test_over_quota_put_is_refused_and_other_tenant_keeps_its_data(tmp_path: Path) -> None:
    """16 MiB store; bob holds 13 MiB; alice (quota 1 MiB) offers 4 MiB. Without the
    quota her put would evict bob's blocks to make room; with it, she stores at most
    1 MiB and bob's blocks all stay."""
    flags = ["--tenants-file", _tenants(tmp_path, alice_quota="1MiB")]
    with LocalDeployment(tmp_path / "d", servers=1, capacity="16MiB", meta_args=flags) as d:
        with (
            GCacheClient(d.client_config(token=BOB), timeout_s=5.0) as bob,
            GCacheClient(d.client_config(token=ALICE), timeout_s=5.0) as alice,
        ):
            ns_b = bob.register_namespace("m", SMALL, cache_salt="bob/")
            prompts = [tokens(1024, seed=100 + i) for i in range(13)]  # 1 MiB each
            kv = make_kv(ns_b.layout, 1024, seed=5)
            for p in prompts:
                r = bob.put(ns_b, p, kv)
                assert r.ok and r.stored == 64, r
            ns_a = alice.register_namespace("m", SMALL, cache_salt="alice/")
            big = tokens(4096, seed=7)
            r = alice.put(ns_a, big, make_kv(ns_a.layout, 4096, seed=7))
            assert r.bytes_written <= 1 << 20 and r.no_space >= 192, r
            assert alice.lookup(ns_a, big) <= 1024
            # A second put is refused outright: the quota is used up.
            r2 = alice.put(ns_a, tokens(1024, seed=8), make_kv(ns_a.layout, 1024, seed=8))
            assert r2.stored == 0 and r2.no_space == 64, r2
            assert [bob.lookup(ns_b, p) for p in prompts] == [1024] * 13


# ---- TLS ------------------------------------------------------------------------------


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 and localhost, made by openssl."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def test_grpc_over_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    with LocalDeployment(
        tmp_path / "d",
        servers=1,
        capacity="16MiB",
        meta_args=["--tls-cert", cert, "--tls-key", key],
        server_args=["--tls-ca", cert],  # the server registers over TLS
        tls_ca=cert,
    ) as d:
        assert "gRPC TLS: on" in (d.data_dir / "meta.log").read_text()
        with GCacheClient(d.client_config(), timeout_s=3.0) as c:
            ns = c.register_namespace("auth-tls", SMALL)
            toks = tokens(64, seed=9)
            assert c.put(ns, toks, make_kv(ns.layout, 64, seed=9)).ok
            assert c.lookup(ns, toks) == 64
        # Plaintext gRPC to the TLS port: no answer.
        with grpc.insecure_channel(d.meta_grpc) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ControlStub(ch).GetStats(pb.GetStatsRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with GCacheClient(d.client_config(tls_ca=""), timeout_s=3.0) as plain:
            with pytest.raises(GCacheError, match="RegisterNamespace failed"):
                plain.register_namespace("auth-tls", SMALL)


def test_gcache_up_prints_that_it_runs_without_auth(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    ports = ["--meta-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--server-port", "0"]
    sizes = ["--servers", "1", "--capacity", "16MiB"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcache.cli.main",
            "up",
            "--data-dir",
            str(tmp_path),
            *ports,
            *sizes,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "serving; Ctrl-C to stop" in line:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    auth = [ln for ln in lines if ln.strip().startswith("auth")]
    assert len(auth) == 1 and "runs without authentication" in auth[0], "".join(lines)


def test_bad_tenants_file_stops_the_meta_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.toml"
    bad.write_text('["short"]\nname = "x"\nnamespaces = [""]\n')
    ports = ["--port", "0", "--grpc-port", "0", "--metrics-port", "-1"]
    proc = subprocess.run(
        [sys.executable, "-m", "gcache.meta.daemon", *ports, "--tenants-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gcache-meta: {bad}: tenant x: tokens must be at least 16 characters"
    ]
