"""Recording committed objects (heartbeat ``adopt``) reads none of their bytes, and a
restart checks them against the checksums their putter computed.

A real ``gcache-server`` with a scripted control plane (the harness of
``test_server_restart.py``). The old server hashed every adopted object on its event
loop: 1.47 MB per MiMo block, and on a sparse segment every page of it faulted into
the tmpfs; heartbeats and the data plane waited meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache import _native, wire
from gcache._proto import gcache_pb2 as pb
from tests import rawwire
from tests.integration.test_server_restart import Harness

MiB = 1 << 20
BIG = 16 * MiB
COUNT = 48  # 768 MiB of objects adopted in one heartbeat reply
LAYERS = 16


@pytest.fixture
def big(tmp_path: Path) -> Iterator[Harness]:
    # A sparse segment (no reserve, no pre-faulting): reading an object's pages
    # would allocate them in the tmpfs.
    h = Harness(tmp_path, args=("--capacity", "1GiB", "--no-populate", "--no-reserve"))
    try:
        h.start()
        yield h
    finally:
        h.close()


def _objects(size: int, count: int, base: int = 0) -> list[Any]:
    return [
        pb.StoredObject(
            namespace=b"N" * 16,
            key=(base + i).to_bytes(16, "big"),
            parent=(base + i - 1).to_bytes(16, "big") if i else b"",
            pos=i,
            group=0,
            tier=0,
            offset=base * size + i * size,
            length=size,
            sums=bytes(8 * LAYERS),
        )
        for i in range(count)
    ]


def _stall(h: Harness, objs: list[Any]) -> tuple[float, float]:
    """Adopt ``objs`` in one heartbeat reply while a client pings the data plane;
    returns (the worst PING round trip, the heartbeat gap after the reply minus the
    interval: the time the server spent applying it)."""
    rtts: list[float] = []
    stop = threading.Event()

    def pinger() -> None:
        with rawwire.connect(h.port) as s:
            while not stop.is_set():
                t0 = time.perf_counter()
                s.sendall(wire.pack_frame(wire.Ping(), 1, 0))
                rawwire.recv_frame(s)
                rtts.append(time.perf_counter() - t0)
                time.sleep(0.002)

    t = threading.Thread(target=pinger)
    t.start()
    try:
        time.sleep(0.2)
        beat = h.meta.send(lambda r: r.adopt.extend(objs))
        h.meta.wait_beats(beat, 3)
        time.sleep(0.1)
    finally:
        stop.set()
        t.join()
    times = h.meta.beat_times
    gap = times[beat + 1] - times[beat] - 0.1
    return max(rtts), gap


def test_adopting_large_objects_reads_none_of_their_bytes(big: Harness) -> None:
    """768 MiB of 16 MiB objects adopted in one reply: the data plane answers every
    PING within 0.15 s and the next heartbeat is not held back, as with as many
    64 KiB objects; the sparse segment gains no pages (nothing was read)."""
    seg = next(big.shm.glob("*.seg"))
    before = os.stat(seg).st_blocks
    _, small_gap = _stall(big, _objects(64 * 1024, COUNT, base=COUNT * 256))
    big_rtt, big_gap = _stall(big, _objects(BIG, COUNT))
    assert big_rtt < 0.15, f"a PING waited {big_rtt:.3f} s behind the adopt"
    assert big_gap < small_gap + 0.1, (big_gap, small_gap)
    grown = (os.stat(seg).st_blocks - before) * 512
    assert grown < 16 * MiB, f"adopting faulted {grown} bytes of the sparse segment in"


def _layered(i: int, size: int) -> tuple[bytes, bytes]:
    data = os.urandom(size)
    step = size // 4
    sums = _native.checksums([data[j * step : (j + 1) * step] for j in range(4)], 1)
    return data, sums


def test_restart_checks_every_layer_against_the_putters_checksums(tmp_path: Path) -> None:
    """After a kill -9, the restarted server keeps an object only if each of its
    layers still matches the checksum its putter computed: one changed byte in the
    last layer drops it, and so does a record whose checksums never matched."""
    h = Harness(tmp_path)
    try:
        h.start()
        size = 256 * 1024
        objs, datas = [], {}
        for i in range(6):
            data, sums = _layered(i, size)
            off = i * size
            assert isinstance(h.write(off, data), wire.Ok)
            o = pb.StoredObject(
                namespace=b"N" * 16,
                key=i.to_bytes(16, "big"),
                parent=(i - 1).to_bytes(16, "big") if i else b"",
                pos=i,
                group=0,
                offset=off,
                length=size,
                sums=sums if i != 4 else bytes(len(sums)),  # 4: never matched
            )
            objs.append(o)
            datas[off] = data
        beat = h.meta.send(lambda r: r.adopt.extend(objs))
        h.meta.wait_beats(beat, 2)
        h.kill()
        seg = next(h.shm.glob("*.seg"))
        with open(seg, "r+b") as fh:
            fh.seek(2 * size + size - 10)  # object 2, its last layer
            fh.write(b"\x5a")
        h.start()
        kept = {o.offset for o in h.report}
        assert kept == {0, size, 3 * size, 5 * size}
        for off in kept:
            assert h.read(off, size) == datas[off]
        log = (tmp_path / "server.log").read_text()
        assert "4 objects (1048576 bytes) intact, 2 dropped" in log
    finally:
        h.close()
