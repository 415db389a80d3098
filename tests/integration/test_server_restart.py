"""A real ``gcache-server`` killed and restarted: what the server keeps.

The server is a real process with a real segment in the tmpfs and a real NVMe tier
on disk. Its control plane is a scripted meta (:class:`ScriptedMeta`, an in-process
gRPC ``Control`` service) so the test decides exactly what is committed (``adopt``),
demoted and dropped, and knows the secret to mint grants with any tier and epoch:
the server's half of the protocol is checked byte by byte, independently of the
meta's rebuild logic (tested on its own side).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gcache import _native, capability, wire
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.errors import E_ACCESS_DENIED
from tests import rawwire

MiB = 1 << 20
OBJ = 64 * 1024


class ScriptedMeta(pb_grpc.ControlServicer):  # type: ignore[misc]
    """Records what the server says; answers heartbeats with queued commands."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.lock = threading.Lock()
        self.registrations: list[Any] = []
        self.reports: list[list[Any]] = []  # one list of StoredObject per report
        self.heartbeats: list[Any] = []
        self.beat_times: list[float] = []  # time.monotonic() of each heartbeat
        self.pending = pb.HeartbeatReply()
        self.reregister = False
        self.demoted: list[Any] = []

    def RegisterServer(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.registrations.append(request)
            self.reregister = False
        return pb.RegisterServerReply(heartbeat_interval_s=0.1, epoch=self.epoch)

    def ReportObjects(self, request_iterator: Any, context: Any) -> Any:
        objs: list[Any] = []
        last = False
        for chunk in request_iterator:
            assert chunk.epoch == self.epoch
            objs.extend(chunk.objects)
            last = chunk.last
        assert last
        with self.lock:
            self.reports.append(objs)
        return pb.ReportObjectsReply(adopted=len(objs))

    def Heartbeat(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.heartbeats.append(request)
            self.beat_times.append(time.monotonic())
            self.demoted.extend(request.demoted)
            reply, self.pending = self.pending, pb.HeartbeatReply()
            reply.reregister = self.reregister
        return reply

    def send(self, fill: Callable[[Any], object]) -> int:
        """Queue commands for the next heartbeat reply; returns the beat count."""
        with self.lock:
            fill(self.pending)
            return len(self.heartbeats)

    def wait_beats(self, after: int, n: int = 2, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.heartbeats) >= after + n:
                    return
            time.sleep(0.02)
        raise AssertionError("no heartbeat")

    def wait(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if cond():
                    return
            time.sleep(0.02)
        raise AssertionError("condition not met in time")


class Harness:
    def __init__(self, tmp: Path, epoch: int = 1_000, args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.args = args  # more server flags (a later --capacity wins)
        self.prefix: tuple[str, ...] = ()  # a command the server runs under (unshare)
        self.meta = ScriptedMeta(epoch)
        self.grpc = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_ControlServicer_to_server(self.meta, self.grpc)
        self.meta_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()
        self.shm = Path("/dev/shm") / f"gcache-test-{uuid.uuid4().hex[:12]}"
        self.shm.mkdir()
        self.nvme = tmp / "nvme"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.server_id = "restart-" + uuid.uuid4().hex[:8]

    def start(self) -> None:
        ready = self.tmp / "ready"
        ready.unlink(missing_ok=True)
        n_reg = len(self.meta.registrations)
        n_rep = len(self.meta.reports)
        log = open(self.tmp / "server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *self.prefix,
                sys.executable,
                "-m",
                "gcache.server.daemon",
                "--port",
                "0",
                "--meta",
                f"127.0.0.1:{self.meta_port}",
                "--server-id",
                self.server_id,
                "--capacity",
                "8MiB",
                "--shm-dir",
                str(self.shm),
                "--nvme-size",
                "16MiB",
                "--nvme-path",
                str(self.nvme),
                "--heartbeat-interval-s",
                "0.1",
                "--ready-file",
                str(ready),
                *self.args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "GCACHE_CLUSTER_TOKEN"},
        )
        log.close()
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.proc.poll() is None, (self.tmp / "server.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        self.port = int(ready.read_text().split()[1])
        self.meta.wait(
            lambda: len(self.meta.registrations) > n_reg and len(self.meta.reports) > n_rep
        )

    @property
    def reg(self) -> Any:
        return self.meta.registrations[-1]

    @property
    def report(self) -> list[Any]:
        return self.meta.reports[-1]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.grpc.stop(0)
        shutil.rmtree(self.shm, ignore_errors=True)

    # ---- data plane with grants minted here --------------------------------------

    def grant(
        self, kind: bytes, off: int, n: int, tier: int = 0, epoch: int | None = None
    ) -> wire.Grant:
        epoch = self.meta.epoch if epoch is None else epoch
        expiry = int(time.time() * 1000) + 30_000
        tag = capability.mint(self.reg.secret, kind, off, n, expiry, tier, epoch)
        return wire.Grant(off, n, expiry, tag, tier, epoch)

    def write(self, off: int, data: bytes, epoch: int | None = None) -> Any:
        g = self.grant(capability.KIND_WRITE, off, len(data), epoch=epoch)
        return rawwire.call(self.port, wire.Write(g), data)[1]

    def read(self, off: int, n: int, tier: int = 0) -> bytes | None:
        g = self.grant(capability.KIND_READ, off, n, tier)
        _head, body, payload = rawwire.call(self.port, wire.Read([g], [(0, off, n)]))
        return payload if isinstance(body, wire.ReadData) else None


def _obj(i: int, off: int, data: bytes) -> pb.StoredObject:
    return pb.StoredObject(
        namespace=b"N" * 16,
        key=i.to_bytes(16, "big"),
        parent=(i - 1).to_bytes(16, "big") if i else b"",
        pos=i,
        group=0,
        tier=0,
        offset=off,
        length=len(data),
        sums=_native.checksums([data], 1),  # one layer: what the putter computed
    )


def _adopt(o: pb.StoredObject) -> Callable[[Any], object]:
    return lambda r: r.adopt.append(o)


def _data(i: int, n: int = OBJ) -> bytes:
    return (i.to_bytes(4, "big") * (n // 4))[:n]


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    try:
        harness.start()
        yield harness
    finally:
        harness.close()


def test_registration_carries_tier_size_and_measured_bandwidths(h: Harness) -> None:
    reg = h.reg
    assert reg.nvme_capacity == 16 * MiB
    assert reg.dram_read_gbps > 0 and reg.nvme_read_gbps > 0 and reg.nvme_write_gbps > 0
    assert reg.objects == 0 and h.report == []
    beat = h.meta.send(lambda r: None)
    h.meta.wait_beats(beat)
    assert h.meta.heartbeats[-1].epoch == h.meta.epoch


def test_old_epoch_write_is_refused(h: Harness) -> None:
    """A grant minted by an older meta (an amnesiac one that might place over live
    data) writes nothing; the current meta's grant writes."""
    old = h.write(0, _data(1), epoch=h.meta.epoch - 1)
    assert isinstance(old, wire.Error) and old.code == E_ACCESS_DENIED and "epoch" in old.message
    assert h.read(0, OBJ) == bytes(OBJ)
    ok = h.write(0, _data(1))
    assert isinstance(ok, wire.Ok) and h.read(0, OBJ) == _data(1)
    # A SEAL is refused the same way.
    g = h.grant(capability.KIND_WRITE, OBJ, OBJ, epoch=h.meta.epoch - 1)
    sealed = rawwire.call(h.port, wire.Seal([g]))[1]
    assert isinstance(sealed, wire.Error) and sealed.code == E_ACCESS_DENIED
    # A new meta (a larger epoch) takes over: the old meta's fresh grants stop working.
    old_epoch = h.meta.epoch
    n = len(h.meta.registrations)
    with h.meta.lock:
        h.meta.epoch = old_epoch + 5
        h.meta.reregister = True
    h.meta.wait(lambda: len(h.meta.registrations) > n and len(h.meta.reports) >= n + 1)
    late = h.write(2 * OBJ, _data(2), epoch=old_epoch)
    assert isinstance(late, wire.Error) and late.code == E_ACCESS_DENIED
    assert h.read(2 * OBJ, OBJ) == bytes(OBJ)


def test_kill9_mid_burst_restart_serves_only_exact_objects(h: Harness) -> None:
    """Writes go on while the server is killed; after the restart every object it
    reports is byte-exact and recorded as committed, the rest are misses; a DRAM
    object damaged while the server was down is not reported."""
    slots = 8 * MiB // OBJ
    committed: dict[int, bytes] = {}  # offset -> bytes
    stop = threading.Event()

    def burst() -> None:
        i = 0
        while not stop.is_set():
            off = (i % slots) * OBJ
            data = _data(i)
            try:
                res = h.write(off, data)
            except OSError:
                return  # the server died under us
            if isinstance(res, wire.Ok) and off not in committed:
                committed[off] = data
                h.meta.send(_adopt(_obj(i, off, data)))
            i += 1
            if i >= slots:
                return

    t = threading.Thread(target=burst)
    t.start()
    time.sleep(0.6)  # a few heartbeats: some adopts are recorded, some in flight
    h.kill()
    stop.set()
    t.join()
    assert committed, "the burst wrote nothing"
    h.start()
    reported = {o.offset: o for o in h.report}
    assert reported, "nothing re-adopted after kill -9"
    assert set(reported) <= set(committed)
    for off, o in reported.items():
        assert o.tier == 0 and o.length == OBJ and o.key == (off // OBJ).to_bytes(16, "big")
        assert h.read(off, OBJ) == committed[off], "a re-adopted object is byte-exact"
    assert h.reg.objects == len(reported)

    # Damage one re-adopted object in the tmpfs while the server is down.
    victim = min(reported)
    h.kill()
    seg = next(h.shm.glob("*.seg"))
    with open(seg, "r+b") as fh:
        fh.seek(victim + 100)
        fh.write(b"\xff\xfe")
    h.start()
    again = {o.offset for o in h.report}
    assert again == set(reported) - {victim}


def test_demote_read_back_from_nvme_and_corruption_detected(h: Harness) -> None:
    """Demoted objects are read back byte-exact with tier-1 grants, survive a
    kill -9, and one whose NVMe bytes were damaged on disk is dropped, not served."""
    objs = [_obj(i, i * OBJ, _data(i, OBJ - 100 * i)) for i in range(6)]
    for o in objs:
        assert isinstance(h.write(o.offset, _data(o.pos, o.length)), wire.Ok)
    h.meta.send(lambda r: r.adopt.extend(objs))
    h.meta.send(lambda r: r.demote.extend(pb.DemoteCommand(object=o) for o in objs))
    h.meta.wait(lambda: len(h.meta.demoted) >= len(objs))
    done = {d.dram_offset: d for d in h.meta.demoted}
    assert all(d.ok for d in done.values()), [d.error for d in done.values()]
    for o in objs:
        d = done[o.offset]
        assert d.length == o.length
        assert h.read(d.nvme_offset, o.length, tier=1) == _data(o.pos, o.length)
    # The meta frees the DRAM ranges once it saw the reports, and drops one NVMe copy.
    gone = objs[5]
    beat = h.meta.send(
        lambda r: (
            r.free.extend(pb.Range(offset=o.offset, length=o.length) for o in objs),
            r.drop_nvme.append(pb.Range(offset=done[gone.offset].nvme_offset, length=gone.length)),
        )
    )
    h.meta.wait_beats(beat, 3)
    assert h.meta.heartbeats[-1].nvme_used == sum(o.length for o in objs[:5])
    assert h.read(done[gone.offset].nvme_offset, gone.length, tier=1) is None

    h.kill()
    damaged = objs[2]
    with open(h.nvme / "tier-0.dat", "r+b") as fh:
        fh.seek(done[damaged.offset].nvme_offset + 10)
        fh.write(b"\x00\x01\x02")
    h.start()
    rep = {o.offset: o for o in h.report}
    assert all(o.tier == 1 for o in rep.values()), "the DRAM ranges were freed"
    want = {done[o.offset].nvme_offset: o for o in objs[:5] if o is not damaged}
    assert set(rep) == set(want)
    for addr, o in want.items():
        r = rep[addr]
        assert (r.key, r.parent, r.pos, r.length, r.sums) == (
            o.key,
            o.parent,
            o.pos,
            o.length,
            o.sums,
        )
        assert h.read(addr, o.length, tier=1) == _data(o.pos, o.length)
    assert h.read(done[damaged.offset].nvme_offset, damaged.length, tier=1) is None


def test_clean_stop_keeps_the_segment_for_the_next_start(h: Harness) -> None:
    o = _obj(3, 5 * OBJ, _data(3))
    assert isinstance(h.write(o.offset, _data(3)), wire.Ok)
    beat = h.meta.send(lambda r: r.adopt.append(o))
    h.meta.wait_beats(beat)
    assert h.stop() == 0
    assert len(list(h.shm.glob("*.seg"))) == 1, "the segment file outlives a clean stop"
    h.start()
    assert [x.offset for x in h.report] == [o.offset]
    assert h.read(o.offset, OBJ) == _data(3)
