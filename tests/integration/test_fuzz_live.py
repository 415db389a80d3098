"""Live fuzzing (bounded, a few seconds): seeded random, truncated and oversized
frames at the meta's hot path and a server's data plane at once; afterwards the
committed data reads back byte-identical, both daemons are alive and answer, and
their memory stayed bounded."""

from __future__ import annotations

import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gcache import wire
from gcache.cli.deploy import LocalDeployment
from gcache_client import GCacheClient
from tests import rawwire
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

SEED = 20240917
FUZZ_S = 4.0
RSS_BOUND = 64 << 20
TOKS = tokens(64, seed=5)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    d = LocalDeployment(tmp_path_factory.mktemp("fuzz"), servers=1, capacity="64MiB")
    d.start()
    yield d
    codes = d.stop()
    assert all(c == 0 for c in codes.values()), f"unclean exit: {codes}"


def header(msg_type: int, body_len: int, payload_len: int = 0, req_id: int = 1) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, msg_type, 0, 0, req_id, body_len, payload_len)


def sample_bodies(fp: bytes) -> list[tuple[int, bytes]]:
    """Well-formed bodies of every request type, to mutate."""
    g = wire.Grant(4096, 4096, int(time.time() * 1000) + 60_000, b"\x00" * 8)
    msgs: list[wire.Msg] = [
        wire.Ping(),
        wire.Lookup(fp, [b"\x01" * 16] * 3, True, [1, 2]),
        wire.PutBegin(fp, [b"\x02" * 16] * 2, [1, 3], 0),
        wire.PutCommit(12345, [(0, b"\x00" * 8)], [7]),
        wire.PutAbort(99),
        wire.Release(5, [6]),
        wire.Hello("not-a-token"),
        wire.Write(g),
        wire.Read([g], [(0, 4096, 16)]),
        wire.Seal([g]),
    ]
    return [(wire.TYPE_OF[type(m)], msgspec.msgpack.encode(m)) for m in msgs]


def one_attack(rng: random.Random, port: int, samples: list[tuple[int, bytes]]) -> None:
    """Send one hostile input on a fresh connection and go away (or linger a bit)."""
    kind = rng.randrange(8)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.settimeout(0.5)
        if kind == 0:  # garbage
            s.sendall(rng.randbytes(rng.randrange(1, 300)))
        elif kind == 1:  # a truncated header
            s.sendall(header(wire.T_PING, 0)[: rng.randrange(1, wire.HEADER_SIZE)])
        elif kind == 2:  # a huge declared body, a little of it, then gone
            s.sendall(header(rng.choice(samples)[0], rng.randrange(1 << 20, 64 << 20)))
            s.sendall(rng.randbytes(rng.randrange(0, 20000)))
        elif kind == 3:  # a WRITE declaring a huge payload with a forged grant
            t, body = samples[7]
            s.sendall(header(t, len(body), rng.randrange(1 << 20, 8 << 30)) + body)
            s.sendall(rng.randbytes(rng.randrange(0, 50000)))
        elif kind == 4:  # a well-formed body with bytes flipped
            t, body = rng.choice(samples)
            mutated = bytearray(body)
            for _ in range(rng.randrange(1, 4)):
                if mutated:
                    mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            s.sendall(header(t, len(mutated)) + mutated)
        elif kind == 5:  # a header with random fields
            magic = wire.MAGIC if rng.random() < 0.8 else rng.randrange(1 << 16)
            fields = (magic, 1, rng.randrange(32), rng.randrange(4), 0, rng.randrange(1 << 32))
            s.sendall(
                struct.pack("!HBBHHI", *fields)
                + struct.pack("!IQ", rng.randrange(1 << 32), rng.randrange(1 << 64))
            )
        elif kind == 6:  # valid frames pipelined, then a bad one
            t, body = rng.choice(samples)
            s.sendall((header(t, len(body)) + body) * rng.randrange(1, 20) + b"\xff" * 24)
        else:  # a key list that claims billions of keys
            forged = b"\x94\xc4\x10" + b"\x01" * 16 + b"\xdd\xff\xff\xff\xff"
            s.sendall(header(wire.T_LOOKUP, len(forged)) + forged)
        try:
            s.settimeout(0.01)
            s.recv(65536)  # whatever the daemon answers, if anything
        except OSError:
            pass


def test_fuzz_both_daemons_data_intact_memory_bounded(live: LocalDeployment) -> None:
    assert live.meta is not None
    client = GCacheClient(live.client_config(transport="tcp"))
    try:
        ns = client.register_namespace("fuzz", tiny_hybrid())
        kv = make_kv(ns.layout, len(TOKS), seed=5)
        assert client.put(ns, TOKS, kv).ok
        targets = [
            (live.meta.port, live.meta.popen.pid),
            *[(s.port, s.popen.pid) for s in live.servers],
        ]
        base = {pid: rss(pid) for _, pid in targets}
        samples = sample_bodies(ns.fingerprint)
        rng = random.Random(SEED)
        attacks = 0
        many: list[socket.socket] = []
        deadline = time.monotonic() + FUZZ_S
        while time.monotonic() < deadline:
            port, _ = rng.choice(targets)
            if rng.random() < 0.02:  # a burst of connections held open, then dropped
                many += [rawwire.connect(port) for _ in range(50)]
                if len(many) > 200:
                    for s in many:
                        s.close()
                    many = []
                continue
            try:
                one_attack(rng, port, samples)
            except OSError:
                pass  # the daemon closed on us mid-send: expected
            attacks += 1
        for s in many:
            s.close()
        assert attacks > 500, attacks
        assert live.meta.alive and all(s.alive for s in live.servers)
        for port, _ in targets:
            assert rawwire.call(port, wire.Ping())[0].msg_type == wire.T_OK
        grown = {pid: rss(pid) - base[pid] for _, pid in targets}
        assert all(g < RSS_BOUND for g in grown.values()), f"RSS grew: {grown}"
        m = client.match(ns, TOKS)
        assert m.tokens == len(TOKS)
        assert_layers_match(client.get(m), kv)  # byte-identical after the fuzzing
        client.release(m)
    finally:
        client.close()
