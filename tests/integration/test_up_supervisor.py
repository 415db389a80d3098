"""``gcache up`` as an operator runs it (a subprocess), against real daemons: a
``kill -9`` of a server or of the meta is healed (same id, same ports, the others
untouched, cached prompts hit again), and SIGTERM/SIGINT at any moment, start-up
included, leaves no process and no file of the deployment behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gcache.cli.deploy import fetch_stats
from gcache.config import ClientConfig
from gcache.leader import MetaFinder, parse_etcd, read_leader
from gcache_client import GCacheClient
from tests.kvdata import assert_layers_match, make_kv, tiny_hybrid, tokens

NTOK = 64
PROMPTS = 24


def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class Up:
    """``gcache up`` in a subprocess; its output lines collected by a thread, and
    every process whose command line names its data dir recorded by another (so
    the test knows the deployment's pids even when it is stopped mid-start)."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gcache.cli.main",
                "up",
                "--data-dir",
                str(data_dir),
                "--meta-port",
                "0",
                "--grpc-port",
                "0",
                "--metrics-port",
                "0",
                "--server-port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.pids: set[int] = set()
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def _sample(self) -> None:
        mark = str(self.data_dir).encode()
        while not self._done.is_set():
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) == self.proc.pid:
                    continue
                try:
                    if mark in Path(f"/proc/{name}/cmdline").read_bytes():
                        self.pids.add(int(name))
                except OSError:
                    pass
            time.sleep(0.01)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text)
            if m:
                return m
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the last lines
                m = re.search(pattern, self.text)
                if m:
                    return m
                raise AssertionError(f"gcache up exited ({self.proc.returncode}):\n{self.text}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in time:\n{self.text}")

    def state(self) -> dict[str, dict[str, object]]:
        body = json.loads((self.data_dir / "up-state.json").read_text())
        return {p["name"]: p for p in body["processes"]}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            time.sleep(0.1)
            self._done.set()
            self._sampler.join()
        return code

    def close(self) -> None:
        """After a failed assertion: let ``gcache up`` stop its daemons."""
        if self.proc.poll() is None:
            self.stop()
        self._done.set()


def _files_of(shm: Path, pids: set[int]) -> list[str]:
    """Files in ``shm`` named after one of ``pids`` (``gcache-<id>-<pid>.<ext>``)."""
    out = []
    for name in os.listdir(shm):
        m = re.fullmatch(r"gcache-.+-(\d+)\.\w+", name)
        if m and int(m.group(1)) in pids:
            out.append(name)
    return out


def _assert_nothing_left(up: Up, shm: Path, started: bool = True) -> None:
    """No process of the deployment (``started``: the sampler saw some) alive, no
    file of theirs in ``shm``, only logs and NVMe tiers in the data dir."""
    assert up.pids or not started, "the sampler saw no process of the deployment"
    left = [pid for pid in up.pids if _alive(pid)]
    assert not left, f"processes of the deployment still running: {left}"
    assert _files_of(shm, up.pids) == []
    survivors = sorted(p.name for p in up.data_dir.iterdir()) if up.data_dir.exists() else []
    # docs/operations.md: logs and NVMe tiers survive a stop on purpose; nothing else
    allowed = re.compile(r"(meta|server\d+)\.log|server\d+-nvme")
    assert [n for n in survivors if not allowed.fullmatch(n)] == [], survivors


SMALL = {"GCACHE_SERVER_STAGING_SIZE": "8MiB"}  # the staging file: small, but there


def test_kill9_of_a_server_and_of_the_meta_is_healed(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    up = Up(tmp_path, "--capacity", "32MiB", "--nvme-size", "16MiB", env=SMALL)
    try:
        addr = up.wait_for(r"clients: GCacheClient\(meta='(\S+)', meta_grpc='(\S+)'\)")
        meta, grpc_addr = addr.group(1), addr.group(2)
        up.wait_for("serving; Ctrl-C to stop")
        st0 = up.state()
        pids = {n: int(p["pid"]) for n, p in st0.items()}  # type: ignore[call-overload]
        assert set(pids) == {"meta", "server0", "server1"}

        client = GCacheClient(ClientConfig(meta=meta, meta_grpc=grpc_addr, timeout_s=1.0))
        ns = client.register_namespace("up-supervisor", tiny_hybrid())
        for s in range(PROMPTS):
            assert client.put(ns, tokens(NTOK, seed=s), make_kv(ns.layout, NTOK, seed=s)).ok
        assert all(client.lookup(ns, tokens(NTOK, seed=s)) == NTOK for s in range(PROMPTS))
        held = {s.server_id: s.objects for s in fetch_stats(grpc_addr).servers}
        assert held["server0"] > 0, held  # the kill below must matter
        old0 = pids["server0"]
        assert sorted(_files_of(shm, {old0})) == [
            f"gcache-server0-{old0}.{ext}" for ext in ("manifest", "seg", "stage")
        ]

        # -- kill -9 of server0: restarted with its id and port; nothing else moves
        os.kill(old0, signal.SIGKILL)
        up.wait_for(r"server0 exited \(-9\); restarting it in 0\.5 s \(restart 1\)")
        up.wait_for(r"server0 is back \(pid \d+, restart 1\)", 30)
        st1 = up.state()
        new0 = int(st1["server0"]["pid"])  # type: ignore[call-overload]
        assert new0 != old0 and st1["server0"]["port"] == st0["server0"]["port"]
        assert st1["server0"]["restarts"] == 1 and st1["server0"]["last_exit"] == -9
        assert st1["server0"]["state"] == "running"
        for name in ("meta", "server1"):  # never stopped
            assert int(st1[name]["pid"]) == pids[name] and _alive(pids[name])  # type: ignore[call-overload]
            assert st1[name]["restarts"] == 0
        assert _files_of(shm, {old0}) == []  # its segment re-adopted, its staging file removed
        assert (shm / f"gcache-server0-{new0}.seg").exists()
        readopted = re.findall(
            r"re-adopted segment \S+: (\d+) objects", (tmp_path / "server0.log").read_text()
        )
        assert readopted and int(readopted[-1]) > 0, readopted
        _wait(
            lambda: all(client.lookup(ns, tokens(NTOK, seed=s)) == NTOK for s in range(PROMPTS)),
            15,
            "every prompt put before the kill to hit again (segment re-adopted)",
        )
        on0 = 0
        for s in range(PROMPTS):  # byte-exact, also what the restarted server holds
            m = client.match(ns, tokens(NTOK, seed=s))
            with client.get_layers(m) as stream:
                layers = list(stream)
            assert stream.ok, f"prompt {s}: a read failed"
            assert_layers_match(layers, make_kv(ns.layout, NTOK, seed=s))
            on0 += any(m.servers[o.server].server_id == "server0" for o in m.objects.values())
        assert on0 > 0
        status = subprocess.run(
            [sys.executable, "-m", "gcache.cli.main", "status", "--meta-grpc", grpc_addr,
             "--data-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        row = re.search(rf"server0\s+{new0}\s+\d+\s+running\s+1\s+-9\s", status.stdout)
        assert row is not None, status.stdout

        # -- kill -9 of the meta: same ports, servers re-register, prompts hit again
        os.kill(pids["meta"], signal.SIGKILL)
        up.wait_for(r"meta exited \(-9\); restarting it", 10)
        up.wait_for(r"meta is back \(pid \d+, restart 1\)", 30)
        st2 = up.state()
        assert st2["meta"]["port"] == st0["meta"]["port"] and st2["meta"]["restarts"] == 1
        assert int(st2["server0"]["pid"]) == new0  # type: ignore[call-overload]
        assert int(st2["server1"]["pid"]) == pids["server1"]  # type: ignore[call-overload]
        _wait(
            lambda: sum(s.alive for s in fetch_stats(grpc_addr).servers) == 2,
            15,
            "both servers re-registered with the restarted meta (same gRPC port)",
        )
        _wait(
            lambda: all(client.lookup(ns, tokens(NTOK, seed=s)) == NTOK for s in range(PROMPTS)),
            15,
            "every prompt to hit again after the meta's restart",
        )
        client.close()
        assert up.stop(signal.SIGTERM) == 0, up.text
    finally:
        up.close()
    assert "stopped: server0=0, server1=0, meta=0" in up.text, up.text
    _assert_nothing_left(up, shm)


@pytest.mark.parametrize(
    ("sig", "when"),
    [
        (signal.SIGTERM, "0.2"),  # seconds after the start
        (signal.SIGINT, "0.5"),
        (signal.SIGINT, "1"),
        (signal.SIGTERM, "segment"),  # as soon as a server's segment file appears
        (signal.SIGINT, "segment"),
        (signal.SIGTERM, "serving"),
    ],
    ids=["term-0.2s", "int-0.5s", "int-1s", "term-segment", "int-segment", "term-serving"],
)
def test_stop_at_any_moment_leaves_nothing(tmp_path: Path, sig: int, when: str) -> None:
    # Its own directory under /dev/shm: this deployment's files and nobody else's.
    shm = Path("/dev/shm") / f"gcache-test-up-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    try:
        up = Up(
            tmp_path / "data",
            "--capacity",
            "512MiB",  # made and pre-faulted at start: takes a while
            "--nvme-size",
            "16MiB",
            env={**SMALL, "GCACHE_SERVER_SHM_DIR": str(shm)},
        )
        try:
            if when == "serving":
                up.wait_for("serving; Ctrl-C to stop")
                assert len(os.listdir(shm)) == 6, os.listdir(shm)  # seg, manifest, stage x2
            elif when == "segment":  # being made (reserved, pre-faulted) right now
                _wait(lambda: any(n.endswith(".seg") for n in os.listdir(shm)), 60, "a segment")
                assert "GCache is up" not in up.text
            else:
                time.sleep(float(when))
            code = up.stop(sig)
        finally:
            up.close()
        if code == -sig:  # signalled before its handler was in (still importing): no child
            assert not up.pids and os.listdir(shm) == [], up.text
            return
        assert code in (0, 130), up.text
        assert "Traceback" not in up.text, up.text
        _assert_nothing_left(up, shm, started=when in ("segment", "serving"))
        assert os.listdir(shm) == [], os.listdir(shm)
    finally:
        for name in os.listdir(shm):
            (shm / name).unlink()
        shm.rmdir()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
@pytest.mark.parametrize("when", ["making-segment", "registering"])
def test_server_stopped_while_starting_leaves_no_segment(
    tmp_path: Path, sig: int, when: str
) -> None:
    """``gcache-server`` alone: a stop while it makes its segment (reserve and
    pre-fault 1 GiB) or while it cannot reach its meta yet removes the segment that
    start made (nothing was ever in it); no ``gcache up`` cleans up after it."""
    shm = Path("/dev/shm") / f"gcache-test-srv-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gcache.server.daemon", "--port", "0", "--meta",
             "127.0.0.1:1", "--capacity", "1GiB", "--shm-dir", str(shm), "--server-id", "s0",
             "--nvme-size", "16MiB", "--nvme-path", str(tmp_path / "nvme"),
             "--staging-size", "8MiB"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            seg = f"gcache-s0-{proc.pid}.seg"
            _wait(lambda: (shm / seg).exists(), 30, "the segment file")
            if when == "registering":
                _wait(lambda: (shm / f"gcache-s0-{proc.pid}.stage").exists(), 30, "staging")
                time.sleep(0.5)  # refused registrations, retried
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out
        assert "Traceback" not in out, out
        assert "stopping (before it was ready)" in out, out
        assert os.listdir(shm) == [], os.listdir(shm)
    finally:
        for name in os.listdir(shm):
            (shm / name).unlink()
        shm.rmdir()


def test_given_up_process_stays_down_and_no_meta_stops_the_deployment(tmp_path: Path) -> None:
    """``--max-restarts 0``: a dead server is given up on (said, shown, never
    restarted) while the rest keeps serving; with the meta given up too nothing can
    serve, so ``gcache up`` stops everything and exits 1."""
    up = Up(tmp_path, "--capacity", "32MiB", "--nvme-size", "0", "--max-restarts", "0")
    try:
        grpc_addr = up.wait_for(r"meta gRPC\s+(\S+)").group(1)
        up.wait_for("serving; Ctrl-C to stop")
        pids = {n: int(p["pid"]) for n, p in up.state().items()}  # type: ignore[call-overload]
        os.kill(pids["server1"], signal.SIGKILL)
        up.wait_for(r"server1 exited \(-9\); restarted 0 times in 60 s already, giving up on it")
        _wait(lambda: up.state()["server1"]["state"] == "given-up", 5, "given-up in the state")
        time.sleep(1.0)  # no restart comes
        st = up.state()
        assert st["server1"]["restarts"] == 0 and int(st["server1"]["pid"]) == pids["server1"]  # type: ignore[call-overload]
        assert _alive(pids["server0"]) and _alive(pids["meta"])
        assert "server0" in {s.server_id for s in fetch_stats(grpc_addr).servers if s.alive}
        os.kill(pids["meta"], signal.SIGKILL)
        up.wait_for("no meta left to restart; stopping the deployment")
        assert up.proc.wait(30) == 1, up.text
    finally:
        up.close()
    assert re.search(r"stopped: server0=0, server1=-9, meta=-9", up.text), up.text
    _assert_nothing_left(up, Path("/dev/shm"))


def test_up_ha_heals_the_leader_and_etcd(tmp_path: Path) -> None:
    """``gcache up --ha``: etcd and both metas are supervised like the servers. A
    kill -9 of the leader: a new term starts (the other meta, or the restarted one,
    leads with a higher epoch), the dead one comes back with its ports; a kill -9
    of etcd: restarted on its ports and data; the cached prompts hit throughout; a
    stop leaves nothing."""
    from gcache.cli.ha import ETCD_BIN

    if not os.access(ETCD_BIN, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{ETCD_BIN} missing: CI must install etcd-server", pytrace=False)
        pytest.skip(f"{ETCD_BIN} missing (apt-get install -y etcd-server)")
    shm = Path("/dev/shm")
    up = Up(tmp_path, "--ha", "--capacity", "32MiB", env=SMALL)
    try:
        meta = up.wait_for(r"clients: GCacheClient\(meta='(etcd://\S+)'").group(1)
        up.wait_for("serving; Ctrl-C to stop")
        st0 = up.state()
        assert set(st0) == {"etcd", "meta", "meta1", "server0", "server1"}
        client = GCacheClient(ClientConfig(meta=meta, timeout_s=1.0))
        ns = client.register_namespace("up-ha", tiny_hybrid())
        for s in range(PROMPTS):
            assert client.put(ns, tokens(NTOK, seed=s), make_kv(ns.layout, NTOK, seed=s)).ok

        def all_hit() -> bool:
            return all(client.lookup(ns, tokens(NTOK, seed=s)) == NTOK for s in range(PROMPTS))

        def leader() -> str:
            """The name of the meta etcd names leader ("": none), by its hot port."""
            found = asyncio.run(MetaFinder(meta).find(2.0))
            ports = {int(p["port"]): n for n, p in up.state().items() if n.startswith("meta")}  # type: ignore[call-overload]
            return "" if found is None else ports.get(int(found[0].rpartition(":")[2]), "")

        def epoch() -> int:
            rec = asyncio.run(read_leader(parse_etcd("meta", meta)))
            return 0 if rec is None else rec.epoch

        lead, epoch0 = leader(), epoch()
        assert lead in ("meta", "meta1"), lead
        os.kill(int(st0[lead]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        up.wait_for(rf"{lead} exited \(-9\); restarting it", 10)
        up.wait_for(rf"{lead} is back \(pid \d+, restart 1\)", 30)
        # A new term: the other meta, or the restarted one (a standby campaigns too).
        _wait(lambda: epoch() > epoch0 and leader() != "", 15, "a new leader (epoch)")
        _wait(all_hit, 15, "every prompt to hit again under the new leader")
        st1 = up.state()
        assert st1[lead]["port"] == st0[lead]["port"] and st1[lead]["restarts"] == 1

        os.kill(int(st0["etcd"]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        up.wait_for(r"etcd exited \(-9\); restarting it", 10)
        up.wait_for(r"etcd is back \(pid \d+, restart 1\)", 30)
        assert up.state()["etcd"]["port"] == st0["etcd"]["port"]
        _wait(all_hit, 15, "every prompt to hit after etcd's restart")
        for s in range(PROMPTS):
            m = client.match(ns, tokens(NTOK, seed=s))
            got = client.get(m)
            assert got is not None, f"prompt {s}: a read failed"
            assert_layers_match(got, make_kv(ns.layout, NTOK, seed=s))
            client.release(m)
        client.close()
        assert up.stop(signal.SIGTERM) == 0, up.text
    finally:
        up.close()
    assert up.pids, "the sampler saw no process of the deployment"
    assert not [pid for pid in up.pids if _alive(pid)]
    assert _files_of(shm, up.pids) == []
    survivors = sorted(p.name for p in tmp_path.iterdir())
    # logs and NVMe tiers survive on purpose; etcd's data dir (the election) is removed
    allowed = re.compile(r"(meta\d*|server\d+|etcd)\.log|server\d+-nvme")
    assert [n for n in survivors if not allowed.fullmatch(n)] == [], survivors
